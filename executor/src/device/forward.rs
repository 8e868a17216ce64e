//! An op's forward on operands its caller resolved: the one meaning of the
//! embedding, norm, linear, RoPE, activation and residual ops and of an
//! attention call's mask, run by the training interpreter (`train/ops/`) and by
//! inference (`crate::infer`). The callers differ only in where operands live
//! (a micro-batch's task, or a pass and its KV cache) and in what they keep for
//! a backward.

use super::{derr, Attn, Device, Embed, Norm, NormOut, RopeQkv};
use crate::comm::RankError;
use crate::device::Buffers;
use crate::program::{fixed_shape, fixed_width};
use crate::shard::{local_heads, weight_transposed, TpPos};
use crate::train::fail;
use meshplan_ir::graph::OpKind;
use meshplan_ir::{Graph, MlpKind, NormKind, Op, TpRole};
use meshplan_kernels::cpu::{AttnDims, AttnDropout, GemmAt, Transpose};

type Res<T> = Result<T, RankError>;

/// A norm's output and the statistics its backward reads: `(y, mean, rstd)`,
/// the mean only for LayerNorm.
pub(crate) type Normed<D> = (
    <D as Buffers>::Act,
    Option<<D as Buffers>::F32>,
    <D as Buffers>::F32,
);

/// Where an op runs: the device, the graph (shapes and constants) and this
/// rank's place on the tensor axis, which decides its slice of heads, columns
/// and vocabulary.
pub(crate) struct Site<'s, D> {
    pub dev: &'s D,
    pub graph: &'s Graph,
    pub tp: TpPos,
}

/// How an attention op masks and scales its scores: causal or not, `1 / sqrt(d)`,
/// and its probabilities' dropout (none at inference).
pub(crate) struct AttnMask {
    pub causal: bool,
    pub scale: f32,
    pub dropout: Option<AttnDropout>,
}

impl AttnMask {
    /// One attention call over `(q, k, v)` under this mask, its blocks starting at
    /// query and key positions `pos0`.
    pub(crate) fn attn<'a, D: Device>(
        &'a self,
        dims: &'a AttnDims,
        (q, k, v): (&'a D::Act, &'a D::Act, &'a D::Act),
        pos0: (usize, usize),
    ) -> Attn<'a, D> {
        Attn {
            dims,
            q,
            k,
            v,
            pos0,
            causal: self.causal,
            scale: self.scale,
            dropout: self.dropout.as_ref(),
            fused: false,
        }
    }
}

impl<D: Device> Site<'_, D> {
    fn zeros(&self, op: &Op, n: usize) -> Res<D::Act> {
        self.dev.act_zeros(n).map_err(derr(&op.name))
    }

    /// An attention op's sizes over `rows` sequence-major rows of `batch`
    /// sequences, with the heads this rank computes (all of them when the op is
    /// replicated, its share otherwise), and the width of its fused `q | k | v`
    /// input.
    pub(crate) fn attention_dims(
        &self,
        att: &Op,
        batch: usize,
        rows: usize,
    ) -> Res<(AttnDims, usize)> {
        let OpKind::Attention(a) = &att.kind else {
            return Err(fail(format!("`{}` is not an attention op", att.name)));
        };
        let (hq, hkv) = if att.role == TpRole::Replicated {
            (a.heads as usize, a.kv_heads as usize)
        } else {
            let (hq, hkv, _) = local_heads(a.heads, a.kv_heads, self.tp);
            (hq, hkv)
        };
        let b = batch.max(1);
        let dims = AttnDims {
            batch: b,
            sq: rows / b,
            sk: rows / b,
            hq,
            hkv,
            d: a.qk_dim as usize,
            dv: a.v_dim as usize,
        };
        Ok((dims, dims.qkv_width()))
    }

    /// An attention op's sizes over its fused `q | k | v` input `x`, rows of
    /// `batch` sequences, and the input's width.
    pub(crate) fn attention_dims_of(
        &self,
        att: &Op,
        batch: usize,
        x: &D::Act,
    ) -> Res<(AttnDims, usize)> {
        let (_, width) = self.attention_dims(att, batch, 0)?;
        self.attention_dims(att, batch, D::act_len(x) / width.max(1))
    }

    /// `(k, n)` of a matmul op (`y [rows, n] = x [rows, k] w`) on this rank's
    /// slice `w` of the weight: a row-parallel op splits `k`, the others `n`.
    pub(crate) fn matmul_dims(&self, op: &Op, w: &D::Act) -> Res<(usize, usize)> {
        let shape = fixed_shape(self.graph.tensor(op.inputs[1]))?;
        let (kf, nf) = if weight_transposed(op) {
            (shape[1], shape[0])
        } else {
            (shape[0], shape[1])
        };
        Ok(match op.role {
            TpRole::RowParallel => (kf / self.tp.size, nf),
            _ => (kf, D::act_len(w) / kf.max(1)),
        })
    }

    /// The first vocabulary row of this rank's slice of an embedding table.
    pub(crate) fn vocab_start(&self, op: &Op) -> Res<usize> {
        Ok(if op.role == TpRole::VocabEmbedding {
            let v = fixed_shape(self.graph.tensor(op.inputs[1]))?[0];
            self.tp.rank * v / self.tp.size
        } else {
            0
        })
    }

    /// This rank's columns of a SwiGLU op's output.
    pub(crate) fn swiglu_width(&self, op: &Op) -> Res<usize> {
        let full = fixed_width(self.graph.tensor(op.outputs[0]))?;
        Ok(if op.role == TpRole::Replicated {
            full
        } else {
            full / self.tp.size
        })
    }

    /// The embedding op's `rows` rows of `table` at `ids`.
    pub(crate) fn embedding(
        &self,
        op: &Op,
        ids: &D::Ids,
        table: &D::Act,
        rows: usize,
    ) -> Res<D::Act> {
        let dim = *fixed_shape(self.graph.tensor(op.inputs[1]))?
            .last()
            .unwrap_or(&1);
        let mut y = self.zeros(op, rows * dim)?;
        let vocab_start = self.vocab_start(op)?;
        let e = Embed {
            ids,
            vocab_start,
            dim,
        };
        self.dev
            .embedding_fwd(&e, table, &mut y)
            .map_err(derr(&op.name))?;
        Ok(y)
    }

    /// A norm over `x`'s rows with weight `w` and bias `b`; a bias-free LayerNorm
    /// adds zeros.
    pub(crate) fn norm(
        &self,
        op: &Op,
        kind: NormKind,
        x: &D::Act,
        w: &D::Act,
        b: Option<&D::Act>,
    ) -> Res<Normed<D>> {
        let e = derr(&op.name);
        let dim = fixed_shape(self.graph.tensor(op.inputs[1]))?[0];
        let rows = D::act_len(x) / dim.max(1);
        let eps = self.graph.constants.norm_eps as f32;
        let layer = kind == NormKind::Layernorm;
        let dev = self.dev;
        let mut y = self.zeros(op, D::act_len(x))?;
        let mut rstd = dev.f32_zeros(rows).map_err(&e)?;
        let mut mean = layer.then(|| dev.f32_zeros(rows)).transpose().map_err(&e)?;
        let zero = (layer && b.is_none())
            .then(|| self.zeros(op, dim))
            .transpose()?;
        let b = b.or(zero.as_ref());
        let n = Norm {
            kind,
            x,
            w,
            b,
            rows,
            dim,
            eps,
        };
        let out = NormOut {
            y: &mut y,
            mean: mean.as_mut(),
            rstd: &mut rstd,
        };
        dev.norm_fwd(&n, out).map_err(&e)?;
        Ok((y, mean, rstd))
    }

    /// `y = x w` (or `x wᵀ` against a tied table) plus the bias `b`; a
    /// row-parallel op's bias is added once, on tensor rank 0, before the partial
    /// sums meet.
    pub(crate) fn linear(
        &self,
        op: &Op,
        x: &D::Act,
        w: &D::Act,
        b: Option<&D::Act>,
    ) -> Res<D::Act> {
        let e = derr(&op.name);
        let (kk, n) = self.matmul_dims(op, w)?;
        let rows = D::act_len(x) / kk.max(1);
        let tb = if weight_transposed(op) {
            Transpose::Yes
        } else {
            Transpose::No
        };
        let at = GemmAt::whole(Transpose::No, tb, rows, kk, n);
        let mut y = self.dev.matmul_new(at, x, w).map_err(&e)?;
        if let Some(b) = b.filter(|_| op.role != TpRole::RowParallel || self.tp.rank == 0) {
            self.dev.bias_add(&mut y, b).map_err(&e)?;
        }
        Ok(y)
    }

    /// RoPE on the `q` and `k` columns of `x` (fused `q | k | v` rows of the
    /// attention op it feeds) at `positions`; `backward` rotates back, which is
    /// the gradient.
    pub(crate) fn rope(
        &self,
        op: &Op,
        x: &D::Act,
        positions: &D::Ids,
        backward: bool,
    ) -> Res<D::Act> {
        let att = self
            .graph
            .attention_fed_by(op)
            .ok_or_else(|| fail(format!("`{}` feeds no attention op", op.name)))?;
        let (dims, width) = self.attention_dims_of(att, 1, x)?;
        let rows = dims.sq;
        let mut y = self.zeros(op, D::act_len(x))?;
        let rope = crate::rope_of(&self.graph.constants);
        let shape = (dims.hq, dims.hkv, dims.d, width);
        let r = RopeQkv {
            x,
            positions,
            rows,
            shape,
            rope,
            backward,
        };
        self.dev.rope_qkv(&r, &mut y).map_err(derr(&op.name))?;
        Ok(y)
    }

    /// SwiGLU (`x` holds the gate and up columns side by side) or GELU.
    pub(crate) fn activation(&self, op: &Op, kind: MlpKind, x: &D::Act) -> Res<D::Act> {
        let e = derr(&op.name);
        match kind {
            MlpKind::Swiglu => {
                let f = self.swiglu_width(op)?;
                let rows = D::act_len(x) / (2 * f).max(1);
                let mut y = self.zeros(op, rows * f)?;
                self.dev.swiglu_fwd(x, f, &mut y).map_err(&e)?;
                Ok(y)
            }
            MlpKind::Gelu => {
                let mut y = self.zeros(op, D::act_len(x))?;
                self.dev.gelu_fwd(x, &mut y).map_err(&e)?;
                Ok(y)
            }
        }
    }

    /// The residual sum `a + b`.
    pub(crate) fn add(&self, op: &Op, a: &D::Act, b: &D::Act) -> Res<D::Act> {
        let mut y = self.zeros(op, D::act_len(a))?;
        self.dev.add(a, b, &mut y).map_err(derr(&op.name))?;
        Ok(y)
    }
}
