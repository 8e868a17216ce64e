//! What a pass computes on a rank: the program's instructions, each op's forward
//! on the device, attention against the KV cache, the pass's collectives.

use super::*;
use crate::device::forward::{AttnMask, Site};
use crate::device::DeviceComm;

impl<'a, D: Device> InferRank<'a, D> {
    pub(super) fn run_phase(&mut self, phase: &Phase, batch: &Batch) -> Result<(), RankError> {
        for ch in &phase.chunks {
            let mut layer = ch.layer_start;
            self.hidden = None;
            let pass = &mut Pass {
                r: self,
                batch,
                ids: PassIds {
                    tokens: None,
                    positions: None,
                },
            };
            walk::forward(pass, &ch.forward, &mut layer, (None, NO_LAYER))?;
        }
        Ok(())
    }

    /// The logits the head segment produced: the loss's input, or its last matmul's
    /// output.
    pub(super) fn head_logits(&mut self, s: usize) -> Result<D::Act, RankError> {
        let seg = &self.graph.segments[s];
        let name = seg
            .ops
            .iter()
            .find(|o| matches!(o.kind, OpKind::CrossEntropy { .. }))
            .map(|o| o.inputs[0])
            .or_else(|| {
                seg.ops
                    .iter()
                    .rev()
                    .find(|o| matches!(o.kind, OpKind::Matmul { .. }))
                    .and_then(|o| o.outputs.first().copied())
            })
            .map(|t| self.graph.tensor(t).name.clone())
            .ok_or_else(|| fail("the head segment produces no logits"))?;
        self.acts
            .remove(&name)
            .ok_or_else(|| fail(format!("the head did not produce `{name}`")))
    }

    pub(super) fn collective(&mut self, c: Coll<'_>) -> Result<(), RankError> {
        let tensor = match c.target {
            // Plans lowered before sampling was planned hold the training loss's
            // statistics instead: nothing to reduce when generating.
            Target::LossStat { .. } => return Ok(()),
            // The experts op moves its tokens itself (counts follow the routing).
            Target::Experts { .. } => return Ok(()),
            Target::HiddenStates => {
                let g = self.group(c.group)?;
                let on = (&g, c.axis);
                let h = self
                    .hidden
                    .as_ref()
                    .ok_or_else(|| fail("no hidden states to gather"))?;
                let (dev, comm) = (&self.dev, self.comm.as_mut());
                let out = comm.act_collective(dev, (CommKind::AllGather, on), h)?;
                self.hidden = Some(out);
                return Ok(());
            }
            Target::Activation { tensor } => tensor.as_str(),
            Target::ActivationGrad { .. }
            | Target::HiddenStatesGrad
            | Target::SegmentParams { .. }
            | Target::SegmentGrads { .. }
            | Target::SegmentSeqPartialGrads { .. }
            | Target::TiedGrads
            | Target::SeqPartialGrads
            | Target::GradBucket { .. }
            | Target::ParamBucket { .. } => {
                return Err(fail(format!(
                    "`{}` is a training collective; inference plans do not hold it",
                    c.target
                )))
            }
        };
        // The head's logits: `last_logits` gathers the last positions, the rows this
        // collective's bytes count.
        let is_logits = self.graph.ops().any(|o| {
            matches!(o.kind, OpKind::CrossEntropy { .. })
                && o.inputs
                    .first()
                    .map(|&t| self.graph.tensor(t).name.as_str())
                    == Some(tensor)
        });
        if is_logits && c.kind == CollectiveKind::AllGather {
            return Ok(());
        }
        let g = self.group(c.group)?;
        let on = (&g, c.axis);
        let buf = self
            .acts
            .get_mut(tensor)
            .ok_or_else(|| fail(format!("no tensor `{tensor}` to communicate")))?;
        let (dev, comm) = (&self.dev, self.comm.as_mut());
        match c.kind {
            CollectiveKind::AllReduce => comm.all_reduce_act(dev, on, buf)?,
            CollectiveKind::AllGather => {
                let out = comm.act_collective(dev, (CommKind::AllGather, on), buf)?;
                self.gathered.insert(tensor.to_string(), out);
            }
            CollectiveKind::ReduceScatter => {
                *buf = comm.act_collective(dev, (CommKind::ReduceScatter, on), buf)?;
            }
            other => {
                return Err(fail(format!(
                    "{other:?} on `{tensor}` is not run by the inference executor"
                )))
            }
        }
        Ok(())
    }

    /// This rank's place to run an op: its device, graph and tensor-parallel slot.
    fn site(&self) -> Site<'_, D> {
        Site {
            dev: &self.dev,
            graph: self.graph,
            tp: self.tp,
        }
    }

    /// The weight in input `i` of `op`, if the op has one there.
    fn weight_at(&self, op: &Op, i: usize, l: u64) -> Result<Option<&D::Act>, RankError> {
        op.inputs.get(i).map(|_| self.weight(op, i, l)).transpose()
    }

    fn forward_op(
        &mut self,
        op: &Op,
        (batch, ids): (&Batch, &mut PassIds<D>),
        l: u64,
    ) -> Result<(), RankError> {
        let out = crate::program::output_name(self.graph, op);
        let site = self.site();
        let y = match &op.kind {
            OpKind::Embedding => {
                let learned_positions = self.graph.tensor(op.inputs[1]).name == "embed.positions.w";
                let ids = ids.get(&self.dev, batch, learned_positions)?;
                site.embedding(op, ids, self.weight(op, 1, l)?, batch.rows())?
            }
            OpKind::Norm(kind) => {
                let (x, w) = (self.act(op, 0)?, self.weight(op, 1, l)?);
                site.norm(op, *kind, x, w, self.weight_at(op, 2, l)?)?.0
            }
            OpKind::Matmul { .. } => {
                let in_name = &self.graph.tensor(op.inputs[0]).name;
                let x = match self.gathered.get(in_name) {
                    Some(g) if matches!(op.role, TpRole::ColumnParallel | TpRole::VocabHead) => g,
                    _ => self.act(op, 0)?,
                };
                site.linear(op, x, self.weight(op, 1, l)?, self.weight_at(op, 2, l)?)?
            }
            OpKind::Rope => {
                let positions = ids.get(&self.dev, batch, true)?;
                site.rope(op, self.act(op, 0)?, positions, false)?
            }
            OpKind::Attention(a) => self.attention(op, a.causal, batch, l)?,
            OpKind::Activation(kind) => site.activation(op, *kind, self.act(op, 0)?)?,
            OpKind::Add => site.add(op, self.act(op, 0)?, self.act(op, 1)?)?,
            // Dropout is the identity at inference.
            OpKind::Dropout => {
                let x = self.act(op, 0)?;
                let n = D::act_len(x);
                let mut y = self.zeros(n)?;
                self.dev
                    .act_copy((x, 0), (&mut y, 0), n)
                    .map_err(derr(&op.name))?;
                y
            }
            // Generation samples from the logits; the loss is not computed.
            OpKind::CrossEntropy { .. } => return Ok(()),
            OpKind::Experts(e) => self.experts(op, e, l, batch.routing, false)?,
            OpKind::Router { .. } => {
                return Err(fail(format!(
                    "`{}`: a separate router op is not run by the executor",
                    op.name
                )))
            }
        };
        self.acts.insert(out, y);
        Ok(())
    }

    /// Routed experts on this pass's tokens (`idle`: none, the rank serving only
    /// its experts to the rest of its expert group), on the device.
    pub(super) fn experts(
        &mut self,
        op: &Op,
        e: &meshplan_ir::graph::ExpertsShape,
        l: u64,
        routing: Routing,
        idle: bool,
    ) -> Result<D::Act, RankError> {
        let name = |i: usize| self.graph.tensor(op.inputs[i]).name.as_str();
        let input = |i: usize| {
            self.acts.get(name(i)).ok_or_else(|| {
                fail(format!(
                    "`{}` reads `{}` before it is produced",
                    op.name,
                    name(i)
                ))
            })
        };
        let weight = |i: usize| {
            let key = (op.name.clone(), name(i).to_string(), l);
            self.weights.get(&key).map(|w| w.as_ref()).ok_or_else(|| {
                fail(format!(
                    "weight `{}` of `{}` (layer {l}) is not held by rank {}",
                    name(i),
                    op.name,
                    self.rank
                ))
            })
        };
        let (on, group) = ((&self.dev, self.comm.as_mut()), self.ep_group.as_ref());
        let mut exec = crate::moe::Exec::new(on, (self.tp, self.ep), group, &op.name);
        let weights = (weight(2)?, weight(3)?);
        // An idle rank routes no tokens: empty inputs, allocated only then.
        if idle {
            let none = self.dev.act_zeros(0).map_err(derr("allocation"))?;
            return Ok(exec.forward(e, (&none, &none), weights, routing)?.0);
        }
        let (x, logits) = (input(0)?, input(1)?);
        // Experts over both tp and ep: every tensor rank holds the same tokens and
        // routes its slice (`sliced_expert_rows`); a reference routes the same
        // slices one after the other.
        let (h, sharded) = (e.hidden as usize, self.ep.size > 1 && self.tp.size > 1);
        let slices = if sharded {
            self.tp.size
        } else {
            self.opts.moe_token_slices.max(1)
        };
        if slices == 1 {
            return Ok(exec.forward(e, (x, logits), weights, routing)?.0);
        }
        let rows = D::act_len(x) / h.max(1);
        let (ne, each) = (e.experts as usize, rows.div_ceil(slices));
        let mine = if sharded {
            self.tp.rank..self.tp.rank + 1
        } else {
            0..slices
        };
        let err = derr(&op.name);
        let mut padded = self.dev.act_zeros(mine.len() * each * h).map_err(&err)?;
        for (at, s) in mine.enumerate() {
            let span = (s * each).min(rows)..((s + 1) * each).min(rows);
            let n = span.len();
            let part = |src: &D::Act, w: usize| -> Result<D::Act, RankError> {
                let mut out = self.dev.act_zeros(n * w).map_err(&err)?;
                (self.dev)
                    .act_copy((src, span.start * w), (&mut out, 0), n * w)
                    .map_err(&err)?;
                Ok(out)
            };
            let (xs, ls) = (part(x, h)?, part(logits, ne)?);
            // A slice is a capacity group; members' slices are equal only when the
            // tokens split evenly.
            let routing = Routing {
                group_tokens: routing.group_tokens.map(|_| n),
                even: routing.even && rows.is_multiple_of(slices),
            };
            let (y, _) = exec.forward(e, (&xs, &ls), weights, routing)?;
            (self.dev)
                .act_copy((&y, 0), (&mut padded, at * each * h), n * h)
                .map_err(&err)?;
        }
        if sharded {
            let g = self.group("tp")?;
            padded = (self.comm).act_collective(
                &self.dev,
                (CommKind::AllGather, (&g, "tp")),
                &padded,
            )?;
        }
        let mut out = self.dev.act_zeros(rows * h).map_err(&err)?;
        (self.dev)
            .act_copy((&padded, 0), (&mut out, 0), rows * h)
            .map_err(&err)?;
        Ok(out)
    }

    /// Appends each request's new keys and values to its cache and attends its
    /// queries (at positions `pos0..pos0 + seq`) to everything cached.
    pub(super) fn attention(
        &mut self,
        op: &Op,
        causal: bool,
        batch: &Batch,
        l: u64,
    ) -> Result<D::Act, RankError> {
        let (b, seq) = (batch.reqs.len(), batch.seq);
        let (all, _) = self.site().attention_dims(op, b, b * seq)?;
        let (hq, hkv, d, dv) = (all.hq, all.hkv, all.d, all.dv);
        // Inference runs in eval mode: no dropout.
        let mask = AttnMask {
            causal,
            scale: 1.0 / (d as f32).sqrt(),
            dropout: None,
        };
        let err = derr(&op.name);
        let x = self.act(op, 0)?;
        // `[s, b, q | k | v]` rows into `[b, s, heads, d]` blocks, one per request.
        let (nq, nk, nv, no) = (seq * hq * d, seq * hkv * d, seq * hkv * dv, seq * hq * dv);
        let mut q = self.zeros(b * nq)?;
        let mut kv = (self.zeros(b * nk)?, self.zeros(b * nv)?);
        self.dev
            .split_qkv(x, &all, [&mut q, &mut kv.0, &mut kv.1])
            .map_err(&err)?;
        let mut o_all = self.zeros(b * no)?;
        for (bi, &req) in batch.reqs.iter().enumerate() {
            let (kc, vc) =
                self.grown_cache((l, req), (&kv.0, &kv.1), (bi * nk, nk), (bi * nv, nv))?;
            let sk = D::act_len(&kc) / (hkv * d).max(1);
            if sk != batch.pos0[bi] + seq {
                return Err(fail(format!(
                    "`{}` layer {l}: the cache holds {sk} positions, expected {}",
                    op.name,
                    batch.pos0[bi] + seq
                )));
            }
            let qb = if b == 1 {
                None
            } else {
                let mut qb = self.zeros(nq)?;
                self.dev
                    .act_copy((&q, bi * nq), (&mut qb, 0), nq)
                    .map_err(&err)?;
                Some(qb)
            };
            let dims = k::AttnDims {
                batch: 1,
                sk,
                ..all
            };
            let mut o = self.zeros(no)?;
            let mut lse = self.dev.f32_zeros(hq * seq).map_err(derr("allocation"))?;
            let qkv = (qb.as_ref().unwrap_or(&q), &kc, &vc);
            let a = mask.attn::<D>(&dims, qkv, (batch.pos0[bi], 0));
            let out = AttnOut {
                o: &mut o,
                lse: &mut lse,
            };
            self.dev.attention_fwd(&a, out).map_err(&err)?;
            self.dev
                .act_copy((&o, 0), (&mut o_all, bi * no), no)
                .map_err(&err)?;
            self.kv.insert((l, req), (kc, vc));
        }
        // `[b, s, hq dv]` back to sequence-major rows.
        let mut y = self.zeros(b * no)?;
        self.dev
            .swap_axes(&o_all, [b, seq, hq * dv], &mut y)
            .map_err(&err)?;
        Ok(y)
    }

    /// Request `req`'s cache of layer `l`, taken out and grown by this pass's keys
    /// and values (the `(offset, length)` blocks of `k` and `v`), or started by them.
    fn grown_cache(
        &mut self,
        (l, req): (u64, usize),
        (k, v): (&D::Act, &D::Act),
        kb: (usize, usize),
        vb: (usize, usize),
    ) -> Result<(D::Act, D::Act), RankError> {
        let err = derr("the KV cache");
        // A new cache is allocated at the first part's size: a device allocation
        // of zero bytes is not one every driver takes.
        let Some((mut kc, mut vc)) = self.kv.remove(&(l, req)) else {
            let (mut kc, mut vc) = (self.zeros(kb.1)?, self.zeros(vb.1)?);
            self.dev
                .act_copy((k, kb.0), (&mut kc, 0), kb.1)
                .map_err(&err)?;
            self.dev
                .act_copy((v, vb.0), (&mut vc, 0), vb.1)
                .map_err(&err)?;
            return Ok((kc, vc));
        };
        self.dev.act_append(&mut kc, k, kb).map_err(&err)?;
        self.dev.act_append(&mut vc, v, vb).map_err(&err)?;
        Ok((kc, vc))
    }
}

/// A rank's pass over one batch.
struct Pass<'r, 'a, 'b, D: Device> {
    r: &'r mut InferRank<'a, D>,
    batch: &'b Batch,
    ids: PassIds<D>,
}

/// A pass's token ids and positions on the device, uploaded at their first use
/// and read by every op of the pass that needs them.
struct PassIds<D: Device> {
    tokens: Option<D::Ids>,
    positions: Option<D::Ids>,
}

impl<D: Device> PassIds<D> {
    fn get(&mut self, dev: &D, batch: &Batch, positions: bool) -> Result<&D::Ids, RankError> {
        let slot = if positions {
            &mut self.positions
        } else {
            &mut self.tokens
        };
        if slot.is_none() {
            let host = if positions {
                batch.positions()
            } else {
                batch.tokens.clone()
            };
            *slot = Some(dev.ids_upload(&host).map_err(derr("the pass's ids"))?);
        }
        slot.as_ref()
            .ok_or_else(|| fail("the pass's ids were not uploaded"))
    }
}

impl<'a, D: Device> Forward<'a> for Pass<'_, 'a, '_, D> {
    fn graph(&self) -> &'a Graph {
        self.r.graph
    }

    fn enter(&mut self, s: usize, _: u64) -> Result<(), RankError> {
        let r = &mut *self.r;
        r.acts.clear();
        r.gathered.clear();
        if let (Some(input), Some(h)) = (segment_input(r.graph, s), r.hidden.take()) {
            r.acts.insert(input, h);
        }
        Ok(())
    }

    fn leave(&mut self, s: usize, _: u64) -> Result<(), RankError> {
        let r = &mut *self.r;
        match segment_output(r.graph, s) {
            Some(out) => {
                let h = r.acts.remove(&out).ok_or_else(|| {
                    let name = &r.graph.segments[s].name;
                    fail(format!("segment `{name}` did not produce `{out}`"))
                })?;
                r.hidden = Some(h);
            }
            None => r.logits = Some(r.head_logits(s)?),
        }
        Ok(())
    }

    fn compute(&mut self, op: &'a Op, _: &[LocalTensor], l: u64) -> Result<(), RankError> {
        self.r.forward_op(op, (self.batch, &mut self.ids), l)
    }

    fn collective(&mut self, c: Coll<'_>, _: u64) -> Result<(), RankError> {
        self.r.collective(c)
    }

    fn send(&mut self, stage: u64, _: f64) -> Result<(), RankError> {
        let r = &mut *self.r;
        let peer = r.peer(stage)?;
        let h = r
            .hidden
            .as_ref()
            .ok_or_else(|| fail("no hidden states to send"))?;
        let n = D::act_len(h);
        r.comm.send_act(&r.dev, (peer, "pp"), h, (0, n))?;
        Ok(())
    }

    fn recv(&mut self, stage: u64, _: f64) -> Result<(), RankError> {
        let r = &mut *self.r;
        let peer = r.peer(stage)?;
        let mut buf = r.zeros(self.batch.rows() * r.hidden_width)?;
        r.comm.recv_act(&r.dev, (peer, "pp"), &mut buf)?;
        r.hidden = Some(buf);
        Ok(())
    }

    fn ring_pass(&mut self) -> Result<(), RankError> {
        Err(fail(
            "ring attention (context parallelism) is a training layout; inference plans do not hold it",
        ))
    }
}
