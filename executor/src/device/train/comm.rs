//! The device interpreter's collectives inside a task: tensor and sequence
//! parallelism's sums, scatters and gathers of activations and input gradients, a
//! vocabulary-parallel loss's statistics, ZeRO-3's segment gathers and scatters
//! (in `zero3.rs`) and pipeline stage boundaries.

use super::*;
use crate::device::walk::Coll;
use crate::device::{CeOut, DeviceComm, On};
use CollectiveKind::{AllGather as AG, ReduceScatter as RS};

/// Whether a collective on `target` moves fp32 buffers on every device: gradients
/// (accumulated and reduced in fp32) and a loss's statistics. Activations, their
/// gradients and ZeRO's gathered weights move in the compute dtype.
fn moves_f32(target: &Target) -> bool {
    match target {
        Target::SegmentGrads { .. }
        | Target::SegmentSeqPartialGrads { .. }
        | Target::TiedGrads
        | Target::SeqPartialGrads
        | Target::GradBucket { .. }
        | Target::LossStat { .. } => true,
        // Compute copies, or masters that serve as them.
        Target::SegmentParams { .. }
        | Target::ParamBucket { .. }
        | Target::Activation { .. }
        | Target::ActivationGrad { .. }
        | Target::HiddenStates
        | Target::HiddenStatesGrad
        | Target::Experts { .. } => false,
    }
}

impl<'a, D: Device> DevRank<'a, D> {
    /// Keeps apart what the communicator counted since `before` as moved in fp32
    /// (`Meter::f32_moved`).
    pub(super) fn moved_f32_since(&mut self, before: &crate::comm::ByteCounts) {
        let moved = self.comm.counts().without(before);
        self.meter.f32_moved.merge(&moved);
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
        let before = moves_f32(target).then(|| self.comm.counts());
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
                let keys = (self.weights).keys_named(&self.seq_partial_names(Some(s)), Some(l));
                let on = (&self.dev, &mut *self.comm);
                let what = (&keys[..], target);
                step::sum_grads(on, (&g, axis), what, &mut self.weights.wgrads)?
            }
            // ZeRO-2, at the end of each micro-batch's backward: this rank adds up
            // its part of the sum, and the set's last scatter lets its gradients go.
            (Target::GradBucket { .. }, RS) => {
                let i = self.zero.scatter_index(target)?;
                let keys = self.zero.scatter[i].pieces.iter().map(|(k, ..)| k);
                self.weights.hold_grads(&self.dev, keys)?;
                let on = (&self.dev, &mut *self.comm);
                self.zero
                    .reduce_scatter(on, i, &mut self.weights.wgrads, true)?
            }
            (Target::SeqPartialGrads, CollectiveKind::AllReduce) => {
                let keys = self.seq_partial_keys();
                self.weights.hold_grads(&self.dev, &keys)?;
                let on = (&self.dev, &mut *self.comm);
                let what = (&keys[..], target);
                step::sum_grads(on, (&g, axis), what, &mut self.weights.wgrads)?
            }
            (Target::HiddenStates, CollectiveKind::AllGather) => {
                let on = (&self.dev, &mut *self.comm);
                self.stage.gather(on, (&g, axis), false)?
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
        if let Some(before) = before {
            self.moved_f32_since(&before);
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
        let op = find_op(self.graph, None, name)?;
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
