//! What each op means on the device, forward and backward: the kernels of
//! [`super::super::Device`] on this rank's slices of weights, heads and rows.
//! [`DevRank::forward_op`] and [`DevRank::backward_op`] dispatch on the op's kind;
//! each family lives in its own file (`embedding`, `norm`, `linear`, `attention`,
//! `loss`, and the experts in `super::experts`), the elementwise ops here.

use super::*;
use crate::device::forward::{AttnMask, Site};
use crate::device::{Ce, CeOut, Embed, Norm, NormBwd};
use crate::program::output_name;
use meshplan_kernels::cpu::GemmAt;
use Transpose::{No, Yes};

mod attention;
mod embedding;
mod linear;
mod loss;
mod norm;

impl<'a, D: Device> DevRank<'a, D> {
    /// This rank's place to run an op: its device, graph and tensor-parallel slot.
    pub(super) fn site(&self) -> Site<'_, D> {
        Site {
            dev: &self.dev,
            graph: self.graph,
            tp: self.tp,
        }
    }

    /// The draw of dropout site `op` in layer `l` this step.
    fn dropout_draw(&self, op: &Op, l: u64, salt: u64) -> DropoutDraw {
        DropoutDraw {
            seed: self.opts.seed,
            step: self.meter.step_no,
            site: crate::init::name_hash(&op.name) ^ l ^ salt,
            p: self.graph.constants.dropout_p,
        }
    }

    /// The global index of micro-batch `mb`'s first sample on this rank.
    pub(super) fn sample0(&self, mb: u64) -> u64 {
        let per_dp = self.sizes.global_batch / self.mesh.dp_size.max(1);
        (self.mesh.dp_index * per_dp + mb as usize * self.sizes.mbs) as u64
    }

    /// A dropout op's mask over its `rows` rows: rows are sequence-major, offset by
    /// the context block and, when sequence parallelism split them, the tensor
    /// rank's block.
    fn row_dropout(&self, op: &Op, l: u64, t: &Task<D>, rows: usize) -> RowDropout {
        let b = self.sizes.mbs.max(1);
        let s_cp = self.sizes.seq_len / self.cp.size.max(1);
        let s_rows = (rows / b).max(1);
        let sp_off = if s_rows < s_cp {
            self.tp.rank * s_rows
        } else {
            0
        };
        RowDropout {
            draw: self.dropout_draw(op, l, 0),
            sample0: self.sample0(t.mb),
            mbs: b,
            pos0: (self.cp.rank * s_cp + sp_off) as u64,
        }
    }

    /// Attention-probability dropout, when the graph has dropout layers and
    /// `p > 0`: drawn per global sample and head, so every sharding draws the same.
    pub(super) fn attention_dropout(&self, op: &Op, l: u64, t: &Task<D>) -> Option<AttnDropout> {
        let has_dropout = self.graph.ops().any(|o| matches!(o.kind, OpKind::Dropout));
        let OpKind::Attention(a) = &op.kind else {
            return None;
        };
        if !has_dropout || self.graph.constants.dropout_p <= 0.0 {
            return None;
        }
        let head0 = if op.role == TpRole::Replicated {
            0
        } else {
            local_heads(a.heads, a.kv_heads, self.tp).0 * self.tp.rank
        };
        Some(AttnDropout {
            draw: self.dropout_draw(op, l, 0xa77e_0000),
            head0: head0 as u64,
            sample0: self.sample0(t.mb),
        })
    }

    /// Dropout's mask applied to `x` (the forward's input or the backward's
    /// gradient): the identity, sharing the buffer, at `p = 0`.
    fn apply_dropout(
        &self,
        op: &Op,
        l: u64,
        t: &Task<D>,
        x: Arc<D::Act>,
    ) -> Result<Arc<D::Act>, RankError> {
        if self.graph.constants.dropout_p <= 0.0 {
            return Ok(x);
        }
        let width = crate::program::fixed_width(self.graph.tensor(op.inputs[0]))?;
        let rows = D::act_len(&x) / width.max(1);
        let d = self.row_dropout(op, l, t, rows);
        let mut y = self.zeros(D::act_len(&x))?;
        self.dev
            .dropout(&x, width, &d, &mut y)
            .map_err(derr(&op.name))?;
        Ok(Arc::new(y))
    }

    /// The ids an embedding op looks up for `rows` rows: token ids, or each token's
    /// position for a learned position table; a block of them under sequence
    /// parallelism.
    pub(super) fn lookup_ids<'t>(
        &self,
        op: &Op,
        t: &'t Task<D>,
        rows: usize,
    ) -> Result<&'t D::Ids, RankError> {
        let positions = op.name.ends_with("positions");
        let all = self.rows();
        if rows == all {
            return Ok(if positions {
                &*t.batch.positions
            } else {
                &t.batch.tokens
            });
        }
        match &t.batch.block {
            Some((tokens, pos)) if self.sp_block(all).is_some_and(|r| r.len() == rows) => {
                Ok(if positions { &**pos } else { tokens })
            }
            _ => Err(fail(format!(
                "`{}`: {rows} rows are neither the micro-batch nor this rank's block",
                op.name
            ))),
        }
    }

    /// The activation a column-parallel op reads: gathered over the tensor axis
    /// under sequence parallelism.
    pub(super) fn act_gathered(
        &self,
        t: &Task<D>,
        l: u64,
        id: meshplan_ir::TensorId,
    ) -> Result<Arc<D::Act>, RankError> {
        match t.gathered.get(&(l, self.name_of(id))) {
            Some(x) => Ok(Arc::clone(x)),
            None => self.act(t, l, id),
        }
    }

    /// Cross-entropy's operands over this rank's rows of `logits` (its shard of
    /// the vocabulary from `vocab_start`).
    pub(super) fn ce<'c>(
        &self,
        logits: &'c D::Act,
        labels: &'c D::Ids,
        vocab_start: usize,
        scale: f32,
    ) -> Ce<'c, D> {
        let rows = self.rows();
        let v_local = D::act_len(logits) / rows.max(1);
        Ce {
            logits,
            labels,
            rows,
            v_local,
            vocab_start,
            scale,
        }
    }

    pub(super) fn forward_op(&mut self, op: &Op, l: u64, t: &mut Task<D>, out_rows: usize) -> Res {
        let out = output_name(self.graph, op);
        let y = match &op.kind {
            OpKind::Embedding => self.embedding_fwd(op, l, t, out_rows)?,
            OpKind::Norm(kind) => self.norm_fwd(op, kind, l, t)?,
            OpKind::Matmul { .. } => self.linear_fwd(op, l, t)?,
            OpKind::Rope => {
                let x = self.act(t, l, op.inputs[0])?;
                self.site().rope(op, &x, &t.batch.positions, false)?
            }
            OpKind::Attention(a) => {
                let y = self.attention_fwd(op, a, l, t)?;
                t.acts.insert((l, out), y);
                return Ok(());
            }
            OpKind::Activation(kind) => {
                let x = self.act(t, l, op.inputs[0])?;
                self.site().activation(op, *kind, &x)?
            }
            OpKind::Add => {
                let a = self.act(t, l, op.inputs[0])?;
                let b = self.act(t, l, op.inputs[1])?;
                self.site().add(op, &a, &b)?
            }
            OpKind::Dropout => {
                let x = self.act(t, l, op.inputs[0])?;
                let y = self.apply_dropout(op, l, t, x)?;
                t.acts.insert((l, out), y);
                return Ok(());
            }
            OpKind::CrossEntropy { .. } => return self.loss_fwd(op, l, t),
            OpKind::Experts(e) => return self.experts_forward(op, e, l, t),
            OpKind::Router { .. } => {
                return Err(fail(format!("`{}`: a separate router op", op.name)))
            }
        };
        t.acts.insert((l, out), Arc::new(y));
        Ok(())
    }

    pub(super) fn backward_op(&mut self, op: &Op, l: u64, t: &mut Task<D>) -> Res {
        let in0 = self.name_of(op.inputs[0]);
        if let OpKind::CrossEntropy { .. } = op.kind {
            let d = t
                .saved
                .remove(&(l, op.name.clone(), Saved::LogitsGrad))
                .ok_or_else(|| fail("the loss gradient was not kept"))?;
            let d = Arc::try_unwrap(d).map_err(|_| fail("the loss gradient is shared"))?;
            return self.add_grad(t, l, in0, d);
        }
        let out = output_name(self.graph, op);
        // Nothing downstream used this output.
        let Some(dy) = t.grads.remove(&(l, out.clone())) else {
            return Ok(());
        };
        let e = derr(&op.name);
        let dev = &self.dev;
        match &op.kind {
            OpKind::Embedding => self.embedding_bwd(op, l, t, dy)?,
            OpKind::Norm(kind) => self.norm_bwd(op, kind, l, t, dy)?,
            OpKind::Matmul { .. } => self.linear_bwd(op, l, t, dy)?,
            OpKind::Rope => {
                let dx = self.site().rope(op, &dy, &t.batch.positions, true)?;
                self.add_grad(t, l, in0, dx)?;
            }
            OpKind::Attention(a) => self.attention_bwd(op, a, l, t, dy)?,
            OpKind::Activation(kind) => {
                let x = self.act(t, l, op.inputs[0])?;
                let mut dx = self.zeros(D::act_len(&x))?;
                match kind {
                    MlpKind::Swiglu => {
                        let f = self.site().swiglu_width(op)?;
                        dev.swiglu_bwd(&x, &dy, f, &mut dx).map_err(&e)?;
                    }
                    MlpKind::Gelu => dev.gelu_bwd(&x, &dy, &mut dx).map_err(&e)?,
                }
                self.add_grad(t, l, in0, dx)?;
            }
            OpKind::Add => {
                let in1 = self.name_of(op.inputs[1]);
                self.add_grad_copy(t, l, in0, &dy)?;
                self.add_grad(t, l, in1, dy)?;
            }
            OpKind::Dropout => {
                let dx = Arc::try_unwrap(self.apply_dropout(op, l, t, Arc::new(dy))?)
                    .map_err(|_| fail("a dropout gradient is shared"))?;
                self.add_grad(t, l, in0, dx)?
            }
            OpKind::CrossEntropy { .. } => {}
            OpKind::Experts(e) => self.experts_backward(op, e, l, t, dy)?,
            OpKind::Router { .. } => {
                return Err(fail(format!("`{}`: a separate router op", op.name)))
            }
        }
        Ok(())
    }
}

/// A kernel statistic kept in the forward.
pub(super) fn stat<'t, D: Device>(
    t: &'t Task<D>,
    l: u64,
    op: &str,
    which: Stat,
) -> Result<&'t D::F32, RankError> {
    t.stats
        .get(&(l, op.to_string(), which))
        .ok_or_else(|| fail(format!("{which:?} of `{op}` (layer {l}) was not kept")))
}
