//! A training rank's state by concern: the weights it holds, where it sits on the
//! mesh, the workload's sizes, the step list and its buckets, and what it
//! measures (ZeRO's parts are in `zero.rs` and `zero3.rs`).

use super::*;

/// The weights a rank holds, by (name, layer).
pub(super) struct Weights<D: Device> {
    /// Every weight this rank holds, whole or (ZeRO-3) by part.
    pub(super) held: BTreeSet<Key>,
    /// fp32 master weights (none of a set whose parts ZeRO holds apart, where the
    /// device computes on copies), their compute copies, gradients and AdamW
    /// moments (under ZeRO-3, of the segment copies in use).
    pub(super) master: BTreeMap<Key, D::F32>,
    pub(super) compute: BTreeMap<Key, D::Act>,
    pub(super) wgrads: BTreeMap<Key, D::F32>,
    pub(super) adam: BTreeMap<Key, (D::F32, D::F32)>,
}

/// A rank's masters and compute copies, borrowed apart from its gradients.
pub(super) type Held<'w, D> = (
    &'w BTreeMap<Key, <D as Buffers>::F32>,
    &'w BTreeMap<Key, <D as Buffers>::Act>,
);

/// `key`'s gradient to accumulate into: made at zero where no op has written it
/// since a ZeRO-2 scatter let it go; missing with its weight (its master, or its
/// compute copy where the rank holds a part of the masters).
pub(super) fn grad_in<'w, D: Device>(
    dev: &D,
    wgrads: &'w mut BTreeMap<Key, D::F32>,
    (master, compute): Held<'_, D>,
    key: &Key,
) -> Res<&'w mut D::F32> {
    match wgrads.entry(key.clone()) {
        std::collections::btree_map::Entry::Occupied(o) => Ok(o.into_mut()),
        std::collections::btree_map::Entry::Vacant(v) => {
            let n = (master.get(key).map(D::f32_len)).or_else(|| compute.get(key).map(D::act_len));
            let n = n.ok_or_else(|| {
                fail(format!(
                    "the gradient of `{}`: its weight is not held",
                    key.0
                ))
            })?;
            Ok(v.insert(dev.f32_zeros(n).map_err(derr(&key.0))?))
        }
    }
}

/// The kernels' operand of weight `key`: its compute copy, or the master itself
/// where the device computes on it ([`Buffers::master_as_act`]). Takes the two maps
/// rather than the rank, so a caller may hold a gradient mutably meanwhile.
pub(super) fn operand<'m, D: Device>(
    (master, compute): Held<'m, D>,
    key: &Key,
) -> Result<&'m D::Act, RankError> {
    if let Some(w) = master.get(key).and_then(D::master_as_act) {
        return Ok(w);
    }
    compute
        .get(key)
        .ok_or_else(|| fail(format!("weight `{}` has no compute copy", key.0)))
}

/// Writes the compute copy of each of `keys` from its master, after the masters
/// changed outside AdamW (ZeRO's gathers); nothing where the master serves as its
/// own ([`Buffers::master_as_act`]).
pub(super) fn refresh_copies<'k, D: Device>(
    dev: &D,
    master: &BTreeMap<Key, D::F32>,
    compute: &mut BTreeMap<Key, D::Act>,
    keys: impl IntoIterator<Item = &'k Key>,
) -> Result<(), RankError> {
    for key in keys {
        let w = master.get(key).ok_or_else(|| fail("weight missing"))?;
        if D::master_as_act(w).is_some() {
            continue;
        }
        let c = compute
            .get_mut(key)
            .ok_or_else(|| fail("compute copy missing"))?;
        dev.to_act(w, c).map_err(derr(&key.0))?;
    }
    Ok(())
}

impl<D: Device> Weights<D> {
    /// The keys of the weights held that are named in `names` (of layer `layer`
    /// only, if given).
    pub(super) fn keys_named(&self, names: &[String], layer: Option<u64>) -> Vec<Key> {
        let keys: BTreeSet<&Key> = self.master.keys().chain(self.compute.keys()).collect();
        (keys.into_iter())
            .filter(|(name, l)| layer.is_none_or(|at| *l == at) && names.contains(name))
            .cloned()
            .collect()
    }

    /// Each of `keys`' gradients held, at zero where none is ([`grad_in`]): what
    /// a collective reads that a backward may not have written since a ZeRO-2
    /// scatter let it go (an expert no token chose, a later chunk's gradients under
    /// interleaved stages).
    pub(super) fn hold_grads<'k>(
        &mut self,
        dev: &D,
        keys: impl IntoIterator<Item = &'k Key>,
    ) -> Res {
        for key in keys {
            grad_in(dev, &mut self.wgrads, (&self.master, &self.compute), key)?;
        }
        Ok(())
    }
}

/// Where a rank sits on the mesh, beyond its tensor, context and expert places.
pub(super) struct MeshPos {
    pub(super) groups: BTreeMap<String, Group>,
    pub(super) dp_index: usize,
    pub(super) dp_size: usize,
    /// This rank's coordinates on the mesh (a pipeline peer differs in `pp`).
    pub(super) coords: Vec<u64>,
    /// Sequence parallelism over the tensor axis.
    pub(super) sp: bool,
}

/// The workload's sizes: tokens a sequence, sequences a step, a micro-batch.
pub(super) struct Sizes {
    pub(super) seq_len: usize,
    pub(super) global_batch: usize,
    pub(super) mbs: usize,
}

/// The step list, checked once, and the gradient buckets' progress through a
/// step.
pub(super) struct GradSync<D: Device> {
    /// What the step list does, in order: gradient buckets and the optimizer.
    pub(super) step_plan: Vec<StepItem>,
    pub(super) buckets: Vec<Bucket>,
    /// Reductions started early, per bucket.
    pub(super) in_flight: Vec<Option<D::Reduction>>,
    /// The next bucket to start (buckets start in the step list's order on every
    /// rank, as the communicator matches them).
    pub(super) next_bucket: usize,
    /// Backward ops writing each weight's gradient in one backward task, and during
    /// the step's last backward task how many are still to run.
    pub(super) uses: BTreeMap<Key, usize>,
    pub(super) remaining: Option<BTreeMap<Key, usize>>,
    /// Weights in the order the backward's last write to their gradient comes.
    pub(super) final_order: Vec<Key>,
}

/// What a rank measures and records: this step's number and losses, the clock,
/// the trace, memory peaks and expert slots.
pub(super) struct Meter<D: Device> {
    pub(super) loss_part: f64,
    pub(super) step_no: u64,
    pub(super) peak_act_bytes: f64,
    pub(super) t0: Instant,
    pub(super) pending: Vec<Pending<D::Mark>>,
    pub(super) spans: Vec<crate::trace::Span>,
    /// Per-row losses of this step's micro-batches, in order.
    pub(super) losses: Vec<D::F32>,
    /// Most device memory in use seen after a forward task.
    pub(super) device_peak: Option<u64>,
    /// Dispatch slots routed, and dropped over an expert capacity.
    pub(super) expert_slots: (u64, u64),
    /// What of the communicator's counts moved fp32 buffers whatever the model's
    /// dtype (gradients, ZeRO's masters, a loss's statistics): the report states
    /// them at 4 bytes an element, the rest at the model's element size.
    pub(super) f32_moved: crate::comm::ByteCounts,
    /// What of them the saves moved (a launched run's snapshots to rank 0), which
    /// are not the training's bytes.
    pub(super) saves: crate::comm::ByteCounts,
    /// Whether spans are recorded (`TrainOptions::trace`).
    trace: bool,
}

impl<D: Device> Weights<D> {
    pub(super) fn none() -> Self {
        Weights {
            held: BTreeSet::new(),
            master: BTreeMap::new(),
            compute: BTreeMap::new(),
            wgrads: BTreeMap::new(),
            adam: BTreeMap::new(),
        }
    }
}

impl<D: Device> GradSync<D> {
    /// Before the step list is read.
    pub(super) fn unplanned() -> Self {
        GradSync {
            step_plan: Vec::new(),
            buckets: Vec::new(),
            in_flight: Vec::new(),
            next_bucket: 0,
            uses: BTreeMap::new(),
            remaining: None,
            final_order: Vec::new(),
        }
    }
}

impl<D: Device> Meter<D> {
    /// Nothing measured yet; the run's clock started at `t0`; spans recorded
    /// when `trace`.
    pub(super) fn started(t0: Instant, trace: bool) -> Self {
        Meter {
            loss_part: 0.0,
            step_no: 0,
            peak_act_bytes: 0.0,
            t0,
            pending: Vec::new(),
            spans: Vec::new(),
            losses: Vec::new(),
            device_peak: None,
            expert_slots: (0, 0),
            f32_moved: crate::comm::ByteCounts::new(),
            saves: crate::comm::ByteCounts::new(),
            trace,
        }
    }

    /// A mark on the device's timeline where spans are recorded.
    pub(super) fn mark(&self, dev: &D) -> Res<Option<D::Mark>> {
        (self.trace.then(|| dev.mark()).transpose()).map_err(derr("mark"))
    }

    /// A span from `from` (a [`Meter::mark`]) to now, resolved at the end of
    /// the step.
    pub(super) fn span(
        &mut self,
        dev: &D,
        from: Option<D::Mark>,
        name: impl Into<String>,
        (cat, args): (&'static str, serde_json::Value),
    ) -> Res {
        if let Some(from) = from {
            let to = dev.mark().map_err(derr("mark"))?;
            self.pending.push(Pending {
                from,
                to,
                name: name.into(),
                cat,
                args,
            });
        }
        Ok(())
    }

    /// Device times of this step's spans, placed on the run's clock by the step's
    /// first mark.
    pub(super) fn resolve_spans(&mut self, dev: &D, (host0, mark0): (Instant, D::Mark)) -> Res {
        let base = host0.duration_since(self.t0).as_secs_f64();
        for p in std::mem::take(&mut self.pending) {
            let e = derr("timing");
            let start = dev.seconds_between(&mark0, &p.from).map_err(&e)?;
            let dur = dev.seconds_between(&p.from, &p.to).map_err(&e)?;
            self.spans.push(crate::trace::Span {
                name: p.name,
                cat: p.cat,
                start_s: base + start,
                dur_s: dur,
                args: p.args,
            });
        }
        Ok(())
    }
}

/// A buffer an op keeps for its backward beside its inputs and outputs: key
/// (layer, op, `Saved`), so one saved under one name and read under another is a
/// compile error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Saved {
    /// Attention's output in its kernel's `[b, s, h dv]` layout, which the
    /// backward reads with the log-sum-exps.
    AttnOut,
    /// The loss's gradient of its logits, computed in the forward.
    LogitsGrad,
}

/// What the step list does, in order.
pub(super) enum StepItem {
    /// All-reduce of bucket `i` over the data ranks.
    Bucket(usize),
    /// ZeRO: reduce-scatter of gradient bucket `i`, each rank keeping its part.
    ReduceScatter(usize),
    /// AdamW on one parameter set.
    Optimizer(ParamSet),
    /// ZeRO: all-gather of parameter bucket `i`, the parts each rank updated.
    AllGather(usize),
    /// A sum of some weights' gradients over a group, as one flat vector: under
    /// sequence parallelism over the tensor axis for the weights each tensor rank
    /// saw only its block of rows for (norms); with a tied table split over
    /// pipeline stages, between the first and the last stage.
    SumGrads {
        group: Group,
        axis: String,
        keys: Vec<Key>,
        target: Target,
    },
}

/// A gradient bucket: a range of a parameter set's flat gradient.
pub(super) struct Bucket {
    pub(super) set: ParamSet,
    pub(super) group: Group,
    pub(super) axis: String,
    /// What the plan's collective names (a `GradBucket` or `ParamBucket`).
    pub(super) target: Target,
    /// Where it starts in the flat vector, and its length.
    pub(super) start: usize,
    pub(super) len: usize,
    /// Where this rank's part starts in the flat vector (ZeRO's reduce-scatters
    /// and gathers leave it): the group's equal parts, in group order.
    pub(super) own: usize,
    /// (weight, offset in its gradient, offset in the bucket, values).
    pub(super) pieces: Vec<(Key, usize, usize, usize)>,
}

impl Bucket {
    /// This rank's part under ZeRO: where it starts in the set's flat vector, and
    /// its length (the group's equal parts, in group order).
    pub(super) fn part(&self) -> (usize, usize) {
        (self.own, self.len / self.group.size())
    }

    /// The bucket's values of `from` as one buffer.
    pub(super) fn packed<D: Device>(
        &self,
        dev: &D,
        from: &BTreeMap<Key, D::F32>,
        what: &str,
    ) -> Res<D::F32> {
        super::step::packed(dev, from, (&self.pieces, self.len), what)
    }
}

/// A span on the device timeline, resolved at the end of the step.
pub(super) struct Pending<M> {
    from: M,
    to: M,
    name: String,
    cat: &'static str,
    args: serde_json::Value,
}

/// What the rank holds.
impl<D: Device> DevRank<'_, D> {
    /// Samples what the rank holds with `current`, the task it runs, beside
    /// those waiting for their backward: after each forward task, and after each
    /// recomputation, when a layer's activations are held again.
    pub(super) fn note_peak(&mut self, current: &Task<D>) {
        let waiting: f64 = self.tasks.values().map(|t| self.held_bytes(t)).sum();
        let held = waiting + self.held_bytes(current);
        self.meter.peak_act_bytes = self.meter.peak_act_bytes.max(held);
        if let Some(used) = self.dev.memory_in_use() {
            self.meter.device_peak = Some(self.meter.device_peak.unwrap_or(0).max(used));
        }
    }

    fn held_bytes(&self, t: &Task<D>) -> f64 {
        // A buffer both an output and kept for a backward counts once.
        let mut seen = HashSet::new();
        let act: usize = (t.acts.values().chain(t.saved.values()))
            .filter(|a| seen.insert(Arc::as_ptr(a)))
            .map(|a| D::act_len(a))
            .sum();
        let stats: usize = t.stats.values().map(D::f32_len).sum();
        (act * self.dev.act_bytes() + stats * 4) as f64
    }
}
