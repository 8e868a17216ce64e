//! The device interpreter's collectives inside a task: tensor and sequence
//! parallelism's sums, scatters and gathers of activations and input gradients, a
//! vocabulary-parallel loss's statistics, ZeRO-3's segment gathers and scatters
//! (in `zero3.rs`), pipeline stage boundaries and ring attention's passes.

use super::*;
use crate::device::comm::{Recvd, Sent};
use crate::device::forward::AttnMask;
use crate::device::walk::Coll;
use crate::device::{AttnGrads, CeOut, DeviceComm, Merge, On};
use CollectiveKind::{AllGather as AG, ReduceScatter as RS};

impl<'a, D: Device> DevRank<'a, D> {
    /// The context group, this rank's index in it, and its ring neighbours.
    pub(super) fn ring(&self) -> Result<(Group, usize, usize, usize), RankError> {
        let g = self.group("cp")?;
        let (n, me) = (g.size(), self.index_in(&g)?);
        let (next, prev) = (g.ranks[(me + 1) % n], g.ranks[(me + n - 1) % n]);
        Ok((g, me, next, prev))
    }

    /// `[k | v]`, the block a ring passes on.
    pub(super) fn kv_block(&self, k: &D::Act, v: &D::Act) -> Result<D::Act, RankError> {
        let (kl, vl) = (D::act_len(k), D::act_len(v));
        let e = derr("ring block");
        let mut block = self.zeros(kl + vl)?;
        self.dev.act_copy((k, 0), (&mut block, 0), kl).map_err(&e)?;
        self.dev
            .act_copy((v, 0), (&mut block, kl), vl)
            .map_err(&e)?;
        Ok(block)
    }

    /// One step of the ring: `block` to the next rank, the previous rank's in return.
    fn pass_block(
        &mut self,
        next: usize,
        prev: usize,
        block: &D::Act,
    ) -> Result<D::Act, RankError> {
        let mut passed = self.zeros(D::act_len(block))?;
        let whole = (0, D::act_len(block));
        self.comm.exchange_act(
            &self.dev,
            "cp",
            &[(next, block, whole)],
            &mut [(prev, &mut passed)],
        )?;
        Ok(passed)
    }

    /// `block[at..at + n]` as a buffer of its own.
    pub(super) fn act_part(
        &self,
        block: &D::Act,
        at: usize,
        n: usize,
    ) -> Result<D::Act, RankError> {
        let mut out = self.zeros(n)?;
        self.dev
            .act_copy((block, at), (&mut out, 0), n)
            .map_err(derr("ring block"))?;
        Ok(out)
    }

    /// A ring block's keys (its first `kl` elements) and values (the rest).
    fn kv_halves(&self, block: &D::Act, kl: usize) -> Result<(D::Act, D::Act), RankError> {
        let len = D::act_len(block);
        Ok((
            self.act_part(block, 0, kl)?,
            self.act_part(block, kl, len - kl)?,
        ))
    }

    /// Ring attention's forward: this rank's queries against every context rank's
    /// key/value block in turn (each passed on to the next rank), the partial
    /// outputs merged by their log-sum-exps into `o` (zero on entry) and `lse`.
    pub(super) fn ring_forward(
        &mut self,
        dims: &AttnDims,
        (q, k, v): (&D::Act, &D::Act, &D::Act),
        mask: &AttnMask,
        o: &mut D::Act,
        lse: &mut D::F32,
    ) -> Result<(), RankError> {
        let (g, me, next, prev) = self.ring()?;
        let n = g.size();
        let s_l = self.sizes.seq_len / n;
        let e = derr("ring attention");
        let kl = D::act_len(k);
        let mut block = self.kv_block(k, v)?;
        for t in 0..n {
            let owner = (me + n - t) % n;
            let (kb, vb) = self.kv_halves(&block, kl)?;
            let a = mask.attn(dims, (q, &kb, &vb), (me * s_l, owner * s_l));
            if t == 0 {
                // The own block first, straight into `o` and `lse`: merged into
                // an empty accumulator (`lse = -inf`) it would come out as itself.
                self.dev.attention_fwd(&a, AttnOut { o, lse }).map_err(&e)?;
            } else {
                let mut ob = self.zeros(D::act_len(o))?;
                let mut lb = self.zeros_f32(D::f32_len(lse))?;
                let out = AttnOut {
                    o: &mut ob,
                    lse: &mut lb,
                };
                self.dev.attention_fwd(&a, out).map_err(&e)?;
                let m = Merge {
                    o_acc: o,
                    lse_acc: lse,
                    o_blk: &ob,
                    lse_blk: &lb,
                };
                self.dev.attention_merge(dims, m).map_err(&e)?;
            }
            if t + 1 < n {
                block = self.pass_block(next, prev, &block)?;
            }
        }
        Ok(())
    }

    /// Ring attention's backward: the key/value blocks go round again; the gradient
    /// computed for every other rank's block goes straight to its owner (in
    /// pairwise exchanges), which adds them in rank order.
    pub(super) fn ring_backward(
        &mut self,
        dims: &AttnDims,
        (q, k, v): (&D::Act, &D::Act, &D::Act),
        (o, lse, d_o): (&D::Act, &D::F32, &D::Act),
        mask: &AttnMask,
        (dq, dk, dv): (&mut D::Act, &mut D::Act, &mut D::Act),
    ) -> Result<(), RankError> {
        let (g, me, next, prev) = self.ring()?;
        let n = g.size();
        let s_l = self.sizes.seq_len / n;
        let e = derr("ring attention");
        let kl = D::act_len(k);
        let mut block = self.kv_block(k, v)?;
        let len = D::act_len(&block);
        let mut grads: Vec<Option<D::Act>> = (0..n).map(|_| None).collect();
        for t in 0..n {
            let owner = (me + n - t) % n;
            let (kb, vb) = self.kv_halves(&block, kl)?;
            let (mut gk, mut gv) = (self.zeros(kl)?, self.zeros(len - kl)?);
            let pos = (me * s_l, owner * s_l);
            let b = AttnBwd {
                o,
                lse,
                d_o,
                grads: AttnGrads::Apart(&mut *dq, &mut gk, &mut gv),
            };
            let a = mask.attn(dims, (q, &kb, &vb), pos);
            self.dev.attention_bwd(&a, b).map_err(&e)?;
            grads[owner] = Some(self.kv_block(&gk, &gv)?);
            if t + 1 < n {
                block = self.pass_block(next, prev, &block)?;
            }
        }
        let mut grads: Vec<D::Act> = grads
            .into_iter()
            .collect::<Option<_>>()
            .ok_or_else(|| fail("a ring block was not visited"))?;
        // Round r sends rank me + r its block's gradient and receives its own
        // from rank me - r: pairwise exchanges, none waiting on another.
        let mut got: Vec<Option<D::Act>> = (0..n).map(|_| None).collect();
        for r in 1..n {
            let (to, from) = ((me + r) % n, (me + n - r) % n);
            let mut buf = self.zeros(len)?;
            self.comm.exchange_act(
                &self.dev,
                "cp",
                &[(g.ranks[to], &grads[to], (0, len))],
                &mut [(g.ranks[from], &mut buf)],
            )?;
            got[from] = Some(buf);
        }
        // Added in rank order, as the goldens were recorded.
        let mut total = grads.swap_remove(me);
        for buf in got.iter().flatten() {
            self.dev.accumulate(&mut total, buf).map_err(&e)?;
        }
        let (tk, tv) = self.kv_halves(&total, kl)?;
        self.dev.accumulate(dk, &tk).map_err(&e)?;
        self.dev.accumulate(dv, &tv).map_err(&e)
    }

    /// The rank of stage `stage` at this rank's other coordinates.
    pub(super) fn peer(&self, stage: u64) -> Result<usize, RankError> {
        crate::program::peer_on_stage(self.plan, &self.mesh.coords, stage)
    }

    /// Elements of a boundary of `bytes` in the plan's dtype.
    pub(super) fn boundary_len(&self, bytes: f64) -> usize {
        (bytes / self.plan.model.dtype.size_bytes() as f64) as usize
    }

    /// Holds the stage boundary (the hidden states forward, their gradient
    /// backward) for stage `stage` until the schedule's next exchange point
    /// ([`Boundaries`]): whole, or this tensor rank's slice of it when the plan
    /// scatters the boundary over the tensor axis (the receiver gathers).
    pub(super) fn send_boundary(
        &mut self,
        stage: u64,
        bytes: f64,
        grad: bool,
    ) -> Result<(), RankError> {
        let peer = self.peer(stage)?;
        let n = self.boundary_len(bytes);
        let x = if grad {
            self.grad_hidden.take().map(Arc::new)
        } else {
            self.hidden.clone()
        }
        .ok_or_else(|| fail("no boundary to send"))?;
        let len = D::act_len(&x);
        let off = if n == len {
            0
        } else if n * self.tp.size == len {
            self.tp.rank * n
        } else {
            return Err(fail(format!(
                "a boundary of {len} values cannot be sent as {n} per rank over tp={}",
                self.tp.size
            )));
        };
        self.boundaries.held.push(HeldSend {
            stage,
            peer,
            x,
            part: (off, n),
        });
        Ok(())
    }

    /// Takes the stage boundary from stage `stage`, received at the exchange point
    /// before this task.
    pub(super) fn recv_boundary(
        &mut self,
        stage: u64,
        bytes: f64,
        grad: bool,
    ) -> Result<(), RankError> {
        let n = self.boundary_len(bytes);
        let x = self.boundaries.posted.pop_front().ok_or_else(|| {
            fail(format!(
                "a receive from stage {stage} that no exchange point posted"
            ))
        })?;
        if D::act_len(&x) != n {
            return Err(fail(format!(
                "the boundary received from stage {stage} holds {} values, the task takes {n}",
                D::act_len(&x)
            )));
        }
        self.set_boundary(grad, x);
        Ok(())
    }

    /// The boundary a task opens with: the hidden state, or its gradient.
    fn set_boundary(&mut self, grad: bool, x: D::Act) {
        if grad {
            self.grad_hidden = Some(x);
        } else {
            self.hidden = Some(Arc::new(x));
        }
    }

    /// An exchange point of the schedule: the boundaries held since the last one
    /// go out, and the boundaries that `next` (tasks of the phase's schedule) open
    /// with come in, as one exchange.
    pub(super) fn exchange_boundaries(
        &mut self,
        phase: &Phase,
        next: Option<&std::ops::Range<usize>>,
    ) -> Result<(), RankError> {
        let mut recvs = Vec::new();
        for ti in next.cloned().unwrap_or_default() {
            if let Some(Instr::Recv {
                peer_stage, bytes, ..
            }) = task_list(phase, &phase.schedule[ti])?.first()
            {
                let n = self.boundary_len(*bytes);
                recvs.push((*peer_stage, self.peer(*peer_stage)?, self.zeros(n)?));
            }
        }
        let held = std::mem::take(&mut self.boundaries.held);
        if held.is_empty() && recvs.is_empty() {
            return Ok(());
        }
        let m0 = self.meter.mark(&self.dev)?;
        let sends: Vec<Sent<'_, D>> = held.iter().map(|h| (h.peer, &*h.x, h.part)).collect();
        let mut into: Vec<Recvd<'_, D>> = recvs.iter_mut().map(|r| (r.1, &mut r.2)).collect();
        self.comm.exchange_act(&self.dev, "pp", &sends, &mut into)?;
        let mut name: Vec<String> = held
            .iter()
            .map(|h| format!("send to stage {}", h.stage))
            .collect();
        name.extend(recvs.iter().map(|r| format!("recv from stage {}", r.0)));
        let sent: usize = held.iter().map(|h| h.part.1).sum();
        let got: usize = recvs.iter().map(|r| D::act_len(&r.2)).sum();
        let elem = self.plan.model.dtype.size_bytes() as usize;
        let args = serde_json::json!({
            "step": self.meter.step_no,
            "bytes": (sent + got) * elem,
            "peers": held.iter().map(|h| h.peer).chain(recvs.iter().map(|r| r.1)).collect::<Vec<_>>(),
        });
        self.boundaries
            .posted
            .extend(recvs.into_iter().map(|r| r.2));
        self.meter
            .span(&self.dev, m0, name.join(", "), ("p2p", args))
    }

    /// Gathers a boundary received in tensor-rank slices.
    pub(super) fn gather_boundary(
        &mut self,
        group: &str,
        axis: &str,
        grad: bool,
    ) -> Result<(), RankError> {
        let g = self.group(group)?;
        let local: &D::Act = if grad {
            self.grad_hidden.as_ref()
        } else {
            self.hidden.as_deref()
        }
        .ok_or_else(|| fail("no boundary to gather"))?;
        let (dev, comm) = (&self.dev, self.comm.as_mut());
        let out = comm.act_collective(dev, (CommKind::AllGather, (&g, axis)), local)?;
        self.set_boundary(grad, out);
        Ok(())
    }

    /// `partial[name] += g`: an input gradient the program has still to sum.
    pub(super) fn add_partial(
        &self,
        t: &mut Task<D>,
        l: u64,
        name: String,
        g: D::Act,
    ) -> Result<(), RankError> {
        match t.partial.get_mut(&(l, name.clone())) {
            Some(e) => self.dev.accumulate(e, &g).map_err(derr(&name)),
            None => {
                t.partial.insert((l, name), g);
                Ok(())
            }
        }
    }

    /// A collective of a forward list or a segment's backward, on what it names:
    /// tensor parallelism's sums of activations, of input gradients and of a
    /// vocabulary-parallel loss's statistics.
    pub(super) fn collective(
        &mut self,
        c: Coll<'_>,
        l: u64,
        t: &mut Task<D>,
        backward: bool,
    ) -> Result<(), RankError> {
        let Coll {
            kind,
            group,
            axis,
            target,
        } = c;
        let g = self.group(group)?;
        let m0 = self.meter.mark(&self.dev)?;
        // Read only when tracing: a count is a copy of the communicator's table.
        let sent0 = m0
            .is_some()
            .then(|| self.comm.counts().axis_bytes_sent(axis));
        match (target, kind) {
            // The experts op moves its tokens itself (counts depend on the routing).
            (Target::Experts { .. }, _) => {}
            (Target::Activation { tensor }, k @ (CollectiveKind::AllReduce | RS | AG)) => {
                self.activation_collective(k, (&g, axis), tensor, l, t)?
            }
            (Target::SegmentParams { segment, set }, CollectiveKind::AllGather) => {
                let copy = (*set, segment_index(self.graph, segment)?, l);
                let (on, w) = ((&self.dev, &mut *self.comm), &mut self.weights);
                (self.zero.z3).gather(on, (&g, axis), (segment, copy), (w, backward))?
            }
            (Target::SegmentGrads { segment, set }, CollectiveKind::ReduceScatter) => {
                let copy = (*set, segment_index(self.graph, segment)?, l);
                let (on, w) = ((&self.dev, &mut *self.comm), &mut self.weights);
                (self.zero.z3).scatter(on, (&g, axis), (segment, copy), w)?
            }
            (Target::SegmentSeqPartialGrads { segment }, CollectiveKind::AllReduce) => {
                let s = segment_index(self.graph, segment)?;
                let names = self.seq_partial_names(Some(s));
                let keys: Vec<Key> = self
                    .weights
                    .master
                    .keys()
                    .filter(|(name, layer)| *layer == l && names.contains(name))
                    .cloned()
                    .collect();
                let on = (&self.dev, &mut *self.comm);
                let what = (&keys[..], "segment_seq_partial_grads");
                step::sum_grads(on, (&g, axis), what, &mut self.weights.wgrads)?
            }
            (Target::HiddenStates, CollectiveKind::AllGather) => {
                self.gather_boundary(group, axis, false)?
            }
            (Target::ActivationGrad { tensor }, k @ (CollectiveKind::AllReduce | RS | AG)) => {
                self.grad_collective(k, (&g, axis), tensor, l, t)?
            }
            // The statistics are summed in the forward; the backward reads them.
            (Target::LossStat { .. }, CollectiveKind::AllReduce) if backward => return Ok(()),
            (Target::LossStat { op, stat }, CollectiveKind::AllReduce) => {
                self.loss_collective(op, *stat, &g, axis, l, t)?
            }
            _ => {
                return Err(fail(format!(
                    "{kind:?} of `{target}` is not a collective the device interpreter runs"
                )))
            }
        }
        // The bytes this rank sent in it, measured, under the trace's key.
        let sent = sent0.map(|s0| self.comm.counts().axis_bytes_sent(axis) - s0);
        let args = serde_json::json!({"step": self.meter.step_no, "layer": l, "tensor": target.to_string(), "axis": axis, "bytes_sent": sent});
        self.meter
            .span(&self.dev, m0, format!("{kind:?} {axis}"), ("comm", args))
    }

    /// A collective on activation `tensor` of layer `l`: summed in place, or
    /// reduce-scattered (its rows replace it) or gathered (the copy sits beside it,
    /// for the column-parallel op that reads it).
    fn activation_collective(
        &mut self,
        kind: CollectiveKind,
        on: On,
        tensor: &str,
        l: u64,
        t: &mut Task<D>,
    ) -> Res {
        let key = (l, tensor.to_string());
        let missing = || fail(format!("no tensor `{tensor}`"));
        if kind == CollectiveKind::AllReduce {
            let x = t.acts.remove(&key).ok_or_else(missing)?;
            let mut x = Arc::try_unwrap(x)
                .map_err(|_| fail(format!("`{tensor}` is read elsewhere before its sum")))?;
            self.comm.all_reduce_act(&self.dev, on, &mut x)?;
            t.acts.insert(key, Arc::new(x));
            return Ok(());
        }
        let x = t.acts.get(&key).ok_or_else(missing)?;
        let ck = if kind == RS {
            CommKind::ReduceScatter
        } else {
            CommKind::AllGather
        };
        let (dev, comm) = (&self.dev, self.comm.as_mut());
        let out = Arc::new(comm.act_collective(dev, (ck, on), x)?);
        match kind {
            RS => t.acts.insert(key, out),
            _ => t.gathered.insert(key, out),
        };
        Ok(())
    }

    /// A collective on the gradient of activation `tensor` of layer `l`: its
    /// partial sums reduced (all of it, or this rank's rows) into it, or its rows
    /// gathered.
    fn grad_collective(
        &mut self,
        kind: CollectiveKind,
        on: On,
        tensor: &str,
        l: u64,
        t: &mut Task<D>,
    ) -> Res {
        let key = (l, tensor.to_string());
        let missing = || fail(format!("no gradient of `{tensor}`"));
        let (dev, comm) = (&self.dev, self.comm.as_mut());
        match kind {
            RS => {
                let full = t.partial.remove(&key).or_else(|| t.grads.remove(&key));
                let full = full.ok_or_else(missing)?;
                let out = comm.act_collective(dev, (CommKind::ReduceScatter, on), &full)?;
                self.add_grad(t, l, key.1, out)?;
            }
            AG => {
                let local = t.grads.remove(&key).ok_or_else(missing)?;
                let out = comm.act_collective(dev, (CommKind::AllGather, on), &local)?;
                t.grads.insert(key, out);
            }
            _ => match t.partial.remove(&key) {
                Some(mut p) => {
                    comm.all_reduce_act(dev, on, &mut p)?;
                    self.add_grad(t, l, key.1, p)?;
                }
                None => {
                    let x = t.grads.get_mut(&key).ok_or_else(missing)?;
                    comm.all_reduce_act(dev, on, x)?;
                }
            },
        }
        Ok(())
    }

    /// Sums one statistic of a vocabulary-parallel loss over the tensor axis, then
    /// takes the loss's next step: after the maxima (whose sum becomes their mean,
    /// a common shift exact for any value) each rank's sum of exponentials and
    /// target logit; after the target logits the loss and this rank's slice of the
    /// logits' gradient.
    pub(super) fn loss_collective(
        &mut self,
        name: &str,
        stat: LossStat,
        g: &Group,
        axis: &str,
        l: u64,
        t: &mut Task<D>,
    ) -> Result<(), RankError> {
        let op = find_op(self.graph, name)?;
        if !matches!(op.kind, OpKind::CrossEntropy { .. }) {
            return Err(fail(format!("`{name}` is not a cross-entropy op")));
        }
        let key = (l, name.to_string(), stat);
        let buf = t
            .loss_stats
            .remove(&key)
            .ok_or_else(|| fail(format!("`{name}`: no {stat:?} to sum")))?;
        let r = self.comm.all_reduce_start(&self.dev, (g, axis), buf)?;
        let mut sum = self.comm.all_reduce_finish(&self.dev, r)?;
        let bytes = crate::comm::bytes_of(D::f32_len(&sum));
        (self.meter.f32_priced).record_ring(CommKind::AllReduce, axis, g.size(), bytes);
        let e = derr(name);
        let logits = self.act(t, l, op.inputs[0])?;
        let rows = self.rows();
        let v_local = D::act_len(&logits) / rows.max(1);
        let start = self.tp.rank * v_local;
        match stat {
            LossStat::Max => {
                self.dev
                    .f32_scale(&mut sum, 1.0 / g.size() as f32)
                    .map_err(&e)?;
                let mut se = self.zeros_f32(rows)?;
                let mut target = self.zeros_f32(rows)?;
                let c = self.ce(&logits, &t.batch.labels, start, 1.0);
                self.dev
                    .ce_sums(&c, &sum, [&mut se, &mut target])
                    .map_err(&e)?;
                t.loss_stats.insert((l, name.into(), LossStat::SumExp), se);
                t.loss_stats
                    .insert((l, name.into(), LossStat::Target), target);
                t.loss_stats.insert(key, sum);
            }
            LossStat::SumExp => {
                t.loss_stats.insert(key, sum);
            }
            LossStat::Target => {
                let get = |s: LossStat| {
                    t.loss_stats
                        .get(&(l, name.to_string(), s))
                        .ok_or_else(|| fail(format!("`{name}`: no summed {s:?}")))
                };
                let mut loss = self.zeros_f32(rows)?;
                let mut d = self.zeros(D::act_len(&logits))?;
                let c = self.ce(&logits, &t.batch.labels, start, self.loss_scale() as f32);
                let stats = [get(LossStat::Max)?, get(LossStat::SumExp)?, &sum];
                let out = CeOut {
                    loss: &mut loss,
                    dlogits: &mut d,
                };
                self.dev.ce_finish(&c, stats, out).map_err(&e)?;
                if self.tp.rank == 0 {
                    self.meter.losses.push(loss);
                }
                t.saved
                    .insert((l, name.to_string(), Saved::LogitsGrad), Arc::new(d));
                t.loss_stats.retain(|k, _| k.0 != l || k.1 != name);
            }
        }
        Ok(())
    }
}
