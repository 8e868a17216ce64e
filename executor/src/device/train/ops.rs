//! What each op means on the device, forward and backward: the kernels of
//! [`super::super::Device`] on this rank's slices of weights, heads and rows.

use super::*;
use crate::device::{norm_forward, Ce, CeOut, Embed, Norm, NormBwd, RopeQkv};
use meshplan_kernels::cpu::GemmAt;
use Transpose::{No, Yes};

/// How an attention op masks and scales its scores: causal or not, `1 / sqrt(d)`,
/// and its probabilities' dropout.
pub(super) struct AttnMask {
    pub causal: bool,
    pub scale: f32,
    pub dropout: Option<AttnDropout>,
}

impl AttnMask {
    /// One attention call over `(q, k, v)` under this mask, its blocks starting at
    /// query and key positions `pos0`.
    pub(super) fn attn<'a, D: Device>(
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
        }
    }
}

impl<'a, D: Device> DevRank<'a, D> {
    pub(super) fn attention_dims(
        &self,
        op: &Op,
        rows: usize,
    ) -> Result<(AttnDims, usize), RankError> {
        let OpKind::Attention(a) = &op.kind else {
            return Err(fail(format!("`{}` is not an attention op", op.name)));
        };
        let b = self.sizes.mbs.max(1);
        let (hq, hkv) = if op.role == TpRole::Replicated {
            (a.heads as usize, a.kv_heads as usize)
        } else {
            let (hq, hkv, _) = local_heads(a.heads, a.kv_heads, self.tp);
            (hq, hkv)
        };
        let dims = AttnDims {
            batch: b,
            sq: rows / b,
            sk: rows / b,
            hq,
            hkv,
            d: a.qk_dim as usize,
            dv: a.v_dim as usize,
        };
        Ok((dims, qkv_width(&dims)))
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
        let has_dropout = self
            .graph
            .segments
            .iter()
            .flat_map(|s| &s.ops)
            .any(|o| matches!(o.kind, OpKind::Dropout));
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
        let width = match self.graph.tensor(op.inputs[0]).shape.last() {
            Some(meshplan_ir::Dim::Fixed(w)) => *w as usize,
            _ => return Err(fail(format!("`{}`: input width is not fixed", op.name))),
        };
        let rows = D::act_len(&x) / width.max(1);
        let d = self.row_dropout(op, l, t, rows);
        let mut y = self.zeros(D::act_len(&x))?;
        self.dev
            .dropout(&x, width, &d, &mut y)
            .map_err(derr(&op.name))?;
        Ok(Arc::new(y))
    }

    pub(super) fn consumer_attention(&self, op: &Op) -> Result<&'a Op, RankError> {
        self.graph
            .attention_fed_by(op)
            .ok_or_else(|| fail("rope feeds no attention op"))
    }

    /// `(k, n)` of a matmul op (`y [rows, n] = x [rows, k] w`) on this rank's
    /// slice `w` of the weight: a row-parallel op splits `k`, the others `n`.
    pub(super) fn matmul_dims(&self, op: &Op, w: &D::Act) -> Result<(usize, usize), RankError> {
        let shape = fixed_shape(self.graph.tensor(op.inputs[1]))?;
        let (kf, nf) = if crate::shard::weight_transposed(op) {
            (shape[1], shape[0])
        } else {
            (shape[0], shape[1])
        };
        Ok(match op.role {
            TpRole::RowParallel => (kf / self.tp.size, nf),
            _ => (kf, D::act_len(w) / kf.max(1)),
        })
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
            return Ok(if positions { &t.positions } else { &t.tokens });
        }
        match &t.block {
            Some((tokens, pos)) if self.sp_block(all).is_some_and(|r| r.len() == rows) => {
                Ok(if positions { pos } else { tokens })
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

    /// This rank's columns of a SwiGLU op's output.
    pub(super) fn swiglu_width(&self, op: &Op) -> Result<usize, RankError> {
        let full = *fixed_shape_tail(self.graph.tensor(op.outputs[0]))
            .last()
            .unwrap_or(&1);
        Ok(if op.role == TpRole::Replicated {
            full
        } else {
            full / self.tp.size
        })
    }

    /// The first vocabulary row of this rank's slice of an embedding table.
    pub(super) fn vocab_start(&self, op: &Op) -> Result<usize, RankError> {
        Ok(if op.role == TpRole::VocabEmbedding {
            let v = fixed_shape(self.graph.tensor(op.inputs[1]))?[0];
            self.tp.rank * v / self.tp.size
        } else {
            0
        })
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

    pub(super) fn rope(
        &self,
        op: &Op,
        x: &D::Act,
        backward: bool,
        t: &Task<D>,
    ) -> Result<D::Act, RankError> {
        let att = self.consumer_attention(op)?;
        let rows = D::act_len(x) / self.attention_dims(att, 1)?.1;
        let (dims, width) = self.attention_dims(att, rows)?;
        let mut y = self.zeros(D::act_len(x))?;
        let rope = crate::rope_of(&self.graph.constants);
        let r = RopeQkv {
            x,
            positions: &t.positions,
            rows,
            shape: (dims.hq, dims.hkv, dims.d, width),
            rope,
            backward,
        };
        self.dev.rope_qkv(&r, &mut y).map_err(derr(&op.name))?;
        Ok(y)
    }

    pub(super) fn forward_op(
        &mut self,
        op: &Op,
        l: u64,
        t: &mut Task<D>,
        out_rows: usize,
    ) -> Result<(), RankError> {
        let out = op
            .outputs
            .first()
            .map(|&o| self.name_of(o))
            .unwrap_or_default();
        let eps = self.graph.constants.norm_eps as f32;
        let e = derr(&op.name);
        let dev = &self.dev;
        let y = match &op.kind {
            OpKind::Embedding => {
                let dim = *fixed_shape(self.graph.tensor(op.inputs[1]))?
                    .last()
                    .unwrap_or(&1);
                let all = self.rows();
                let rows = if out_rows > 0 && out_rows < all && op.role != TpRole::VocabEmbedding {
                    out_rows
                } else {
                    all
                };
                let mut y = self.zeros(rows * dim)?;
                let ids = self.lookup_ids(op, t, rows)?;
                let start = self.vocab_start(op)?;
                dev.embedding_fwd(
                    &Embed {
                        ids,
                        vocab_start: start,
                        dim,
                    },
                    self.weight(op.inputs[1], l)?,
                    &mut y,
                )
                .map_err(&e)?;
                y
            }
            OpKind::Norm(kind) => {
                let x = self.act(t, l, op.inputs[0])?;
                let dim = fixed_shape(self.graph.tensor(op.inputs[1]))?[0];
                let rows = D::act_len(&x) / dim;
                let w = self.weight(op.inputs[1], l)?;
                let b = match op.inputs.get(2) {
                    Some(&bid) => Some(self.weight(bid, l)?),
                    None => None,
                };
                let (x, kind) = (&*x, *kind);
                let n = Norm {
                    kind,
                    x,
                    w,
                    b,
                    rows,
                    dim,
                    eps,
                };
                let (y, mean, rstd) = norm_forward(dev, &n).map_err(&e)?;
                if let Some(mean) = mean {
                    t.stats.insert((l, op.name.clone(), Stat::Mean), mean);
                }
                t.stats.insert((l, op.name.clone(), Stat::Rstd), rstd);
                y
            }
            OpKind::Matmul { .. } => {
                let x = if matches!(op.role, TpRole::ColumnParallel | TpRole::VocabHead) {
                    self.act_gathered(t, l, op.inputs[0])?
                } else {
                    self.act(t, l, op.inputs[0])?
                };
                let w = self.weight(op.inputs[1], l)?;
                let (kk, n) = self.matmul_dims(op, w)?;
                let rows = D::act_len(&x) / kk.max(1);
                let mut y = self.zeros(rows * n)?;
                let tb = if crate::shard::weight_transposed(op) {
                    Transpose::Yes
                } else {
                    Transpose::No
                };
                dev.matmul(GemmAt::whole(Transpose::No, tb, rows, kk, n), &x, w, &mut y)
                    .map_err(&e)?;
                // A row-parallel bias is added once, before the partial sums meet.
                if let Some(&bid) = op.inputs.get(2) {
                    if op.role != TpRole::RowParallel || self.tp.rank == 0 {
                        dev.bias_add(&mut y, self.weight(bid, l)?).map_err(&e)?;
                    }
                }
                y
            }
            OpKind::Rope => {
                let x = self.act(t, l, op.inputs[0])?;
                self.rope(op, &x, false, t)?
            }
            OpKind::Attention(a) => {
                let x = self.act(t, l, op.inputs[0])?;
                let rows = D::act_len(&x) / self.attention_dims(op, 1)?.1;
                let (dims, _) = self.attention_dims(op, rows)?;
                let (q, kk, v) = self.split(&x, &dims)?;
                let mut o = self.zeros(rows * dims.hq * dims.dv)?;
                let mut lse = self.zeros_f32(dims.batch * dims.hq * dims.sq)?;
                let mask = AttnMask {
                    causal: a.causal,
                    scale: 1.0 / (a.qk_dim as f32).sqrt(),
                    dropout: self.attention_dropout(op, l, t),
                };
                if self.cp.size > 1 {
                    self.ring_forward(&dims, (&q, &kk, &v), &mask, &mut o, &mut lse)?;
                } else {
                    let a = mask.attn(&dims, (&q, &kk, &v), (0, 0));
                    let out = AttnOut {
                        o: &mut o,
                        lse: &mut lse,
                    };
                    self.dev.attention_fwd(&a, out).map_err(&e)?;
                }
                let mut y = self.zeros(D::act_len(&o))?;
                self.dev
                    .swap_axes(&o, [dims.batch, dims.sq, dims.hq * dims.dv], &mut y)
                    .map_err(&e)?;
                t.stats.insert((l, op.name.clone(), Stat::Lse), lse);
                t.acts.insert((l, format!("{}#o", op.name)), Arc::new(o));
                y
            }
            OpKind::Activation(kind) => {
                let x = self.act(t, l, op.inputs[0])?;
                match kind {
                    MlpKind::Swiglu => {
                        let f = self.swiglu_width(op)?;
                        let rows = D::act_len(&x) / (2 * f);
                        let mut y = self.zeros(rows * f)?;
                        dev.swiglu_fwd(&x, f, &mut y).map_err(&e)?;
                        y
                    }
                    MlpKind::Gelu => {
                        let mut y = self.zeros(D::act_len(&x))?;
                        dev.gelu_fwd(&x, &mut y).map_err(&e)?;
                        y
                    }
                }
            }
            OpKind::Add => {
                let a = self.act(t, l, op.inputs[0])?;
                let b = self.act(t, l, op.inputs[1])?;
                let mut y = self.zeros(D::act_len(&a))?;
                dev.add(&a, &b, &mut y).map_err(&e)?;
                y
            }
            OpKind::Dropout => {
                let x = self.act(t, l, op.inputs[0])?;
                let y = self.apply_dropout(op, l, t, x)?;
                t.acts.insert((l, out), y);
                return Ok(());
            }
            OpKind::CrossEntropy { .. } => {
                let logits = self.act(t, l, op.inputs[0])?;
                let rows = self.rows();
                if op.role == TpRole::VocabLoss && self.tp.size > 1 {
                    // Each rank holds a slice of the vocabulary: the program's
                    // collectives on the loss's statistics finish it
                    // (`loss_collective`).
                    let mut max = self.zeros_f32(rows)?;
                    let c = self.ce(&logits, &t.labels, 0, 1.0);
                    dev.ce_row_max(&c, &mut max).map_err(&e)?;
                    t.loss_stats
                        .insert((l, op.name.clone(), LossStat::Max), max);
                    return Ok(());
                }
                let scale = self.loss_scale();
                let mut loss = self.zeros_f32(rows)?;
                let mut dlogits = self.zeros(D::act_len(&logits))?;
                let c = self.ce(&logits, &t.labels, 0, scale as f32);
                let out = CeOut {
                    loss: &mut loss,
                    dlogits: &mut dlogits,
                };
                dev.cross_entropy(&c, out).map_err(&e)?;
                // Read at the end of the step: a download here would stall the
                // launches of the backward behind the forward's kernels. Every
                // tensor rank computes the same loss; the first reports it.
                if self.tp.rank == 0 {
                    self.meter.losses.push(loss);
                }
                // The backward is done: the gradient waits for the backward pass.
                t.acts
                    .insert((l, format!("{}#dlogits", op.name)), Arc::new(dlogits));
                return Ok(());
            }
            OpKind::Experts(e) => return self.experts_forward(op, e, l, t),
            OpKind::Router { .. } => {
                return Err(fail(format!("`{}`: a separate router op", op.name)))
            }
        };
        t.acts.insert((l, out), Arc::new(y));
        Ok(())
    }

    pub(super) fn split(&self, x: &D::Act, dims: &AttnDims) -> Result<Qkv<D>, RankError> {
        let rows = dims.batch * dims.sq;
        let mut q = self.zeros(rows * dims.hq * dims.d)?;
        let mut kk = self.zeros(rows * dims.hkv * dims.d)?;
        let mut v = self.zeros(rows * dims.hkv * dims.dv)?;
        self.dev
            .split_qkv(x, dims, [&mut q, &mut kk, &mut v])
            .map_err(derr("split_qkv"))?;
        Ok((q, kk, v))
    }

    pub(super) fn backward_op(
        &mut self,
        op: &Op,
        l: u64,
        t: &mut Task<D>,
    ) -> Result<(), RankError> {
        let in0 = self.name_of(op.inputs[0]);
        if let OpKind::CrossEntropy { .. } = op.kind {
            let d = t
                .acts
                .remove(&(l, format!("{}#dlogits", op.name)))
                .ok_or_else(|| fail("the loss gradient was not kept"))?;
            let d = Arc::try_unwrap(d).map_err(|_| fail("the loss gradient is shared"))?;
            return self.add_grad(t, l, in0, d);
        }
        let out = op
            .outputs
            .first()
            .map(|&o| self.name_of(o))
            .unwrap_or_default();
        // Nothing downstream used this output.
        let Some(dy) = t.grads.remove(&(l, out.clone())) else {
            return Ok(());
        };
        let e = derr(&op.name);
        let dev = &self.dev;
        match &op.kind {
            OpKind::Embedding => {
                let dim = *fixed_shape(self.graph.tensor(op.inputs[1]))?
                    .last()
                    .unwrap_or(&1);
                let key = self.wkey(op.inputs[1], l)?;
                let ids = self.lookup_ids(op, t, D::act_len(&dy) / dim.max(1))?;
                let start = self.vocab_start(op)?;
                let dt = self
                    .weights
                    .wgrads
                    .get_mut(&key)
                    .ok_or_else(|| fail("embedding gradient missing"))?;
                dev.embedding_bwd(
                    &Embed {
                        ids,
                        vocab_start: start,
                        dim,
                    },
                    &dy,
                    dt,
                )
                .map_err(&e)?;
            }
            OpKind::Norm(kind) => {
                let x = self.act(t, l, op.inputs[0])?;
                let dim = fixed_shape(self.graph.tensor(op.inputs[1]))?[0];
                let rows = D::act_len(&x) / dim;
                let mut dx = self.zeros(D::act_len(&x))?;
                let wkey = self.wkey(op.inputs[1], l)?;
                let bkey = op.inputs.get(2).map(|&b| self.wkey(b, l)).transpose()?;
                let w = operand::<D>(&self.weights.master, &self.weights.compute, &wkey)?;
                let rstd = stat(t, l, &op.name, Stat::Rstd)?;
                let mut dw = self
                    .weights
                    .wgrads
                    .remove(&wkey)
                    .ok_or_else(|| fail("norm gradient missing"))?;
                let layer = *kind == NormKind::Layernorm;
                let mean = if layer {
                    Some(stat(t, l, &op.name, Stat::Mean)?)
                } else {
                    None
                };
                // A bias-less norm's bias gradient goes to a scratch buffer.
                let mut scratch = match (layer, &bkey) {
                    (true, None) => Some(self.zeros_f32(dim)?),
                    _ => None,
                };
                let db = match &bkey {
                    Some(k) => Some(
                        self.weights
                            .wgrads
                            .get_mut(k)
                            .ok_or_else(|| fail("bias gradient missing"))?,
                    ),
                    None => scratch.as_mut(),
                };
                let (x, kind, eps) = (&*x, *kind, self.graph.constants.norm_eps as f32);
                let n = Norm {
                    kind,
                    x,
                    w,
                    b: None,
                    rows,
                    dim,
                    eps,
                };
                let g = NormBwd {
                    mean,
                    rstd,
                    dy: &dy,
                    dx: &mut dx,
                    dw: &mut dw,
                    db,
                };
                let r = dev.norm_bwd(&n, g);
                self.weights.wgrads.insert(wkey, dw);
                r.map_err(&e)?;
                self.add_grad(t, l, in0, dx)?;
            }
            OpKind::Matmul { .. } => {
                let x = if matches!(op.role, TpRole::ColumnParallel | TpRole::VocabHead) {
                    self.act_gathered(t, l, op.inputs[0])?
                } else {
                    self.act(t, l, op.inputs[0])?
                };
                let wkey = self.wkey(op.inputs[1], l)?;
                let w = operand::<D>(&self.weights.master, &self.weights.compute, &wkey)?;
                let (kk, n) = self.matmul_dims(op, w)?;
                let rows = D::act_len(&x) / kk.max(1);
                let mut dx = self.zeros(rows * kk)?;
                let dw = self
                    .weights
                    .wgrads
                    .get_mut(&wkey)
                    .ok_or_else(|| fail("gradient missing"))?;
                if crate::shard::weight_transposed(op) {
                    // `y = x wᵀ` with `w [n, k]`: `dx = dy w`, `dw += dyᵀ x`.
                    dev.matmul(GemmAt::whole(No, No, rows, n, kk), &dy, w, &mut dx)
                        .map_err(&e)?;
                    dev.matmul_acc(GemmAt::whole(Yes, No, n, rows, kk), &dy, &x, dw)
                        .map_err(&e)?;
                } else {
                    dev.matmul(GemmAt::whole(No, Yes, rows, n, kk), &dy, w, &mut dx)
                        .map_err(&e)?;
                    dev.matmul_acc(GemmAt::whole(Yes, No, kk, rows, n), &x, &dy, dw)
                        .map_err(&e)?;
                }
                if let Some(&b) = op.inputs.get(2) {
                    let bk = self.wkey(b, l)?;
                    let db = self
                        .weights
                        .wgrads
                        .get_mut(&bk)
                        .ok_or_else(|| fail("bias gradient missing"))?;
                    dev.bias_grad(&dy, db).map_err(&e)?;
                }
                // A split op's input gradient is partial until the program sums it.
                if (matches!(op.role, TpRole::ColumnParallel | TpRole::VocabHead)
                    || self.routes_split_experts(op))
                    && self.tp.size > 1
                {
                    self.add_partial(t, l, in0, dx)?;
                } else {
                    self.add_grad(t, l, in0, dx)?;
                }
            }
            OpKind::Rope => {
                let dx = self.rope(op, &dy, true, t)?;
                self.add_grad(t, l, in0, dx)?;
            }
            OpKind::Attention(a) => {
                let x = self.act(t, l, op.inputs[0])?;
                let rows = D::act_len(&x) / self.attention_dims(op, 1)?.1;
                let (dims, _) = self.attention_dims(op, rows)?;
                let (q, kk, v) = self.split(&x, &dims)?;
                let o = t
                    .acts
                    .get(&(l, format!("{}#o", op.name)))
                    .cloned()
                    .ok_or_else(|| fail("attention output was not kept"))?;
                let lse = stat(t, l, &op.name, Stat::Lse)?;
                let mut d_o = self.zeros(D::act_len(&dy))?;
                dev.swap_axes(&dy, [dims.sq, dims.batch, dims.hq * dims.dv], &mut d_o)
                    .map_err(&e)?;
                let mut dq = self.zeros(D::act_len(&q))?;
                let mut dk = self.zeros(D::act_len(&kk))?;
                let mut dv = self.zeros(D::act_len(&v))?;
                let mask = AttnMask {
                    causal: a.causal,
                    scale: 1.0 / (a.qk_dim as f32).sqrt(),
                    dropout: self.attention_dropout(op, l, t),
                };
                if self.cp.size > 1 {
                    self.ring_backward(
                        &dims,
                        (&q, &kk, &v),
                        (&o, lse, &d_o),
                        &mask,
                        (&mut dq, &mut dk, &mut dv),
                    )?;
                } else {
                    let a = mask.attn(&dims, (&q, &kk, &v), (0, 0));
                    let b = AttnBwd {
                        o: &*o,
                        lse,
                        d_o: &d_o,
                        d_q: &mut dq,
                        d_k: &mut dk,
                        d_v: &mut dv,
                    };
                    self.dev.attention_bwd(&a, b).map_err(&e)?;
                }
                let mut dx = self.zeros(D::act_len(&x))?;
                self.dev
                    .join_qkv([&dq, &dk, &dv], &dims, &mut dx)
                    .map_err(&e)?;
                self.add_grad(t, l, in0, dx)?;
            }
            OpKind::Activation(kind) => {
                let x = self.act(t, l, op.inputs[0])?;
                let mut dx = self.zeros(D::act_len(&x))?;
                match kind {
                    MlpKind::Swiglu => {
                        let f = self.swiglu_width(op)?;
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
