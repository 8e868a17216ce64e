//! The step list: gradient buckets (started early during the last backward),
//! ZeRO 1-3's reduce-scatters, gathers and part updates, sums over tp and between
//! stages, and AdamW.

use super::*;

impl<'a, D: Device> DevRank<'a, D> {
    /// Checks the step list once and lays out its buckets: each `grads:dense[a..b]`
    /// is a range of the flat gradient. The weights lie in it in the order the
    /// backward finishes their gradients (as DDP orders its buckets), so that the
    /// first buckets fill first. The layout changes no value (each element is summed
    /// and updated alone, with or without ZeRO) and no byte count (the ranges are
    /// the plan's).
    pub(super) fn plan_step(&mut self) -> Result<(), RankError> {
        let layouts = self.flat_layouts()?;
        for instr in &self.phase()?.step {
            match instr {
                Instr::Collective {
                    kind: CollectiveKind::AllReduce,
                    group,
                    axis,
                    target: target @ (Target::SeqPartialGrads | Target::TiedGrads),
                    ..
                } => {
                    let keys = if *target == Target::TiedGrads {
                        self.weights.keys_named(&self.tied_names(), None)
                    } else {
                        self.seq_partial_keys()
                    };
                    self.sync.step_plan.push(StepItem::SumGrads {
                        group: self.group(group)?,
                        axis: axis.name().to_string(),
                        keys,
                        target: target.clone(),
                    });
                }
                Instr::Collective {
                    kind,
                    group,
                    axis,
                    target,
                    ..
                } => {
                    let bucket =
                        self.bucket(target, (self.group(group)?, axis.name()), &layouts)?;
                    let (sync, zero) = (&mut self.sync, &mut self.zero);
                    let (item, list) = match (target, kind) {
                        (Target::GradBucket { .. }, CollectiveKind::AllReduce) => {
                            (StepItem::Bucket(sync.buckets.len()), &mut sync.buckets)
                        }
                        (Target::GradBucket { .. }, CollectiveKind::ReduceScatter) => (
                            StepItem::ReduceScatter(zero.scatter.len()),
                            &mut zero.scatter,
                        ),
                        (Target::ParamBucket { .. }, CollectiveKind::AllGather) => {
                            (StepItem::AllGather(zero.gather.len()), &mut zero.gather)
                        }
                        _ => {
                            return Err(fail(format!(
                                "{kind:?} of `{target}` is not a step the device interpreter runs"
                            )))
                        }
                    };
                    list.push(bucket);
                    sync.step_plan.push(item);
                }
                Instr::Optimizer { params, .. } => {
                    self.sync.step_plan.push(StepItem::Optimizer(*params))
                }
                other => {
                    return Err(fail(format!(
                    "a step list holds a `{}` instruction; it holds collectives and the optimizer",
                    other.op_name()
                )))
                }
            }
        }
        // ZeRO-2's buckets, reduce-scattered at the end of every micro-batch's
        // backward.
        for ch in &self.phase()?.chunks {
            for instr in &ch.backward {
                if let Instr::Collective {
                    kind: CollectiveKind::ReduceScatter,
                    group,
                    axis,
                    target: target @ Target::GradBucket { .. },
                    ..
                } = instr
                {
                    let bucket =
                        self.bucket(target, (self.group(group)?, axis.name()), &layouts)?;
                    self.zero.scatter.push(bucket);
                }
            }
        }
        self.sync.in_flight = self.sync.buckets.iter().map(|_| None).collect();
        self.zero.layouts = layouts;
        Ok(())
    }

    /// Every weight whose gradient sequence parallelism leaves partial over the
    /// tensor axis.
    pub(super) fn seq_partial_keys(&self) -> Vec<Key> {
        self.weights.keys_named(&self.seq_partial_names(None), None)
    }

    /// Each parameter set's flat vector: its weights in the order the backward
    /// finishes their gradients, then the rest.
    fn flat_layouts(&self) -> Res<BTreeMap<ParamSet, Layout>> {
        let mut layouts: BTreeMap<ParamSet, Layout> = BTreeMap::new();
        let wgrads = &self.weights.wgrads;
        for key in self.sync.final_order.iter().chain(wgrads.keys()) {
            let sizes = layouts.entry(param_set(self.graph, key)).or_default();
            if !sizes.iter().any(|(k, _)| k == key) {
                let g = wgrads.get(key).ok_or_else(|| fail("gradient missing"))?;
                sizes.push((key.clone(), D::f32_len(g)));
            }
        }
        Ok(layouts)
    }

    /// The bucket a step-list collective on `target` moves over `(group, axis)`:
    /// its range of the flat vector, which must split evenly over the group.
    fn bucket(
        &self,
        target: &Target,
        (group, axis): (Group, &str),
        layouts: &BTreeMap<ParamSet, Layout>,
    ) -> Res<Bucket> {
        let total_of = |set: ParamSet| -> usize {
            layouts
                .get(&set)
                .map_or(0, |l| l.iter().map(|(_, n)| n).sum())
        };
        let (set, a, b) = bucket_range(target, &total_of)?;
        if (b - a) % group.size() != 0 {
            return Err(fail(format!(
                "bucket {a}..{b} of `{target}` does not split over {} ranks",
                group.size()
            )));
        }
        let sizes = layouts.get(&set).map_or(&[][..], |l| l.as_slice());
        let own = a + index_in(&group, self.rank)? * ((b - a) / group.size());
        Ok(Bucket {
            set,
            group,
            axis: axis.to_string(),
            target: target.clone(),
            start: a,
            len: b - a,
            own,
            pieces: pieces_of(sizes, a, b),
        })
    }

    /// How many backward ops of one backward task write each weight's gradient.
    pub(super) fn count_uses(&mut self) -> Result<(), RankError> {
        let phase = self.phase()?;
        let mut uses = BTreeMap::new();
        let mut order: Vec<Key> = Vec::new();
        for ch in &phase.chunks {
            let mut layer = ch.layer_end;
            for instr in &ch.backward {
                let Instr::Segment {
                    name,
                    kind,
                    repeat,
                    body,
                } = instr
                else {
                    continue;
                };
                let s = segment_index(self.graph, name)?;
                for _ in 0..*repeat {
                    let l = crate::program::prev_layer(*kind, &mut layer);
                    for instr in body {
                        if let Instr::Compute { name, .. } = instr {
                            for key in self.weight_keys(find_op(self.graph, Some(s), name)?, l)? {
                                *uses.entry(key.clone()).or_insert(0) += 1;
                                order.retain(|k| *k != key);
                                order.push(key);
                            }
                        }
                    }
                }
            }
        }
        self.sync.uses = uses;
        self.sync.final_order = order;
        Ok(())
    }

    pub(super) fn weight_keys(&self, op: &Op, l: u64) -> Result<Vec<Key>, RankError> {
        op.inputs
            .iter()
            .filter(|&&id| self.graph.tensor(id).kind == TensorKind::Weight)
            .map(|&id| self.wkey(id, l))
            .collect()
    }

    /// After a backward op of the step's last backward task: its weights' gradients
    /// may be final, and with them the next buckets.
    pub(super) fn gradients_written(&mut self, op: &Op, l: u64) -> Result<(), RankError> {
        let keys = self.weight_keys(op, l)?;
        let Some(remaining) = self.sync.remaining.as_mut() else {
            return Ok(());
        };
        for key in keys {
            if let Some(n) = remaining.get_mut(&key) {
                *n = n.saturating_sub(1);
            }
        }
        while let Some(b) = self.sync.buckets.get(self.sync.next_bucket) {
            let remaining = self
                .sync
                .remaining
                .as_ref()
                .ok_or_else(|| fail("no counts"))?;
            let ready = b
                .pieces
                .iter()
                .all(|(key, ..)| remaining.get(key).is_none_or(|&n| n == 0));
            if !ready {
                break;
            }
            let m0 = self.meter.mark(&self.dev)?;
            let i = self.sync.next_bucket;
            let before = self.comm.counts();
            let on = (&self.dev, &mut *self.comm);
            self.sync.start_bucket(on, i, &self.weights.wgrads)?;
            self.moved_f32_since(&before);
            let bk = &self.sync.buckets[i];
            let args = serde_json::json!({"step": self.meter.step_no, "tensor": bk.target.to_string(), "early": true});
            let name = format!("AllReduce {} (start)", bk.axis);
            self.meter.span(&self.dev, m0, name, ("comm", args))?;
        }
        Ok(())
    }

    /// The weights whose gradients sequence parallelism leaves partial over the
    /// tensor axis (norms): of every segment, or of segment `only`.
    pub(super) fn seq_partial_names(&self, only: Option<usize>) -> Vec<String> {
        self.graph
            .segments
            .iter()
            .enumerate()
            .filter(|(s, _)| only.is_none_or(|o| o == *s))
            .flat_map(|(_, seg)| {
                // Under sequence parallelism the norms saw a block of rows; with
                // experts split over tp, the router's weights saw partial scores.
                let sp = self.mesh.sp && self.tp.size > 1;
                let expert_tp = self.ep.size <= 1 && self.tp.size > 1;
                meshplan_ir::graph::tp_partial_weights(self.graph, seg, sp, expert_tp)
            })
            .map(|w| self.graph.tensor(w).name.clone())
            .collect()
    }

    /// The weights embedding and head share (a tied table).
    pub(super) fn tied_names(&self) -> Vec<String> {
        let read_by = |segs: &BTreeSet<usize>, kind| {
            segs.iter().any(|&s| self.graph.segments[s].kind == kind)
        };
        weight_users(self.graph)
            .into_iter()
            .filter(|(_, s)| read_by(s, SegmentKind::Embed) && read_by(s, SegmentKind::Head))
            .map(|(w, _)| self.graph.tensor(w).name.clone())
            .collect()
    }

    /// AdamW's moments of every weight the whole-tensor optimizer updates, of
    /// every part ZeRO-1/2's reduce-scatters leave this rank and of every segment
    /// copy's ZeRO-3 part, made before the first step. Made on first use, they took
    /// the memory the first backward had freed, and the second step's forward
    /// faulted in new pages for its activations: GPT-2 124M's second step took
    /// 5.2 s where the later ones take 3.3 s.
    pub(super) fn first_moments(&mut self) -> Result<(), RankError> {
        self.zero.z3.moments(&self.dev, &self.zero.start_moments)?;
        self.zero.part_moments(&self.dev)?;
        let whole = |r: &Self, k: &Key| {
            let set = param_set(r.graph, k);
            r.zero.z3.group(set).is_none() && !r.zero.sharded(set)
        };
        let keys: Vec<Key> = (self.weights.master.keys())
            .filter(|k| whole(self, k))
            .cloned()
            .collect();
        for key in keys {
            let n = self.weights.master.get(&key).map_or(0, D::f32_len);
            let part = [(key.clone(), 0, 0, n)];
            let state = initial_moments(&self.dev, &self.zero.start_moments, &part, n)?;
            self.weights.adam.insert(key, state);
        }
        // Every state exists: a resumed run lets the saved moments go before its
        // first step, not after it.
        self.zero.start_moments = StartMoments::Taken;
        Ok(())
    }

    pub(super) fn optimizer(&mut self, set: ParamSet) -> Result<(), RankError> {
        if self.zero.z3.group(set).is_some() {
            let step = (self.meter.step_no + 1, self.opts.lr);
            return self.zero.z3.optimizer(&self.dev, set, step);
        }
        let step = self.meter.step_no + 1;
        if self.zero.sharded(set) {
            let weights = &mut self.weights;
            return (self.zero).optimizer(&self.dev, set, weights, (step, self.opts.lr));
        }
        let keys: Vec<Key> = self
            .weights
            .master
            .keys()
            .filter(|k| param_set(self.graph, k) == set)
            .cloned()
            .collect();
        for key in &keys {
            let w = self
                .weights
                .master
                .get_mut(key)
                .ok_or_else(|| fail("weight missing"))?;
            let e = derr(&key.0);
            let missing = || fail(format!("state of `{}` missing", key.0));
            let g = self.weights.wgrads.get(key).ok_or_else(missing)?;
            let (m, v) = self.weights.adam.get_mut(key).ok_or_else(missing)?;
            let c = match D::master_as_act(w) {
                Some(_) => None,
                None => Some(self.weights.compute.get_mut(key).ok_or_else(missing)?),
            };
            adamw(&self.dev, (w, g), (m, v), c, (step, self.opts.lr)).map_err(e)?;
        }
        Ok(())
    }
}

impl<D: Device> GradSync<D> {
    /// Copies bucket `i`'s gradient pieces into one buffer and starts its sum.
    pub(super) fn start_bucket(
        &mut self,
        (dev, comm): (&D, &mut D::Comm),
        i: usize,
        wgrads: &BTreeMap<Key, D::F32>,
    ) -> Res {
        let b = &self.buckets[i];
        let buf = b.packed(dev, wgrads, "bucket")?;
        let r = comm.all_reduce_start(dev, (&b.group, &b.axis), buf)?;
        self.in_flight[i] = Some(r);
        self.next_bucket = self.next_bucket.max(i + 1);
        Ok(())
    }

    /// Waits for bucket `i`'s sum and copies it back into the gradients.
    pub(super) fn finish_bucket(
        &mut self,
        (dev, comm): (&D, &mut D::Comm),
        i: usize,
        wgrads: &mut BTreeMap<Key, D::F32>,
    ) -> Res {
        let r = self.in_flight[i]
            .take()
            .ok_or_else(|| fail("a bucket finished before it started"))?;
        let buf = comm.all_reduce_finish(dev, r)?;
        unpack(dev, &buf, &self.buckets[i].pieces, wgrads, "bucket")
    }
}

/// Sums the gradients of `keys` over `(group, axis)` as one flat vector.
pub(super) fn sum_grads<D: Device>(
    (dev, comm): (&D, &mut D::Comm),
    (group, axis): (&Group, &str),
    (keys, target): (&[Key], &Target),
    wgrads: &mut BTreeMap<Key, D::F32>,
) -> Res {
    let tensor = &target.to_string();
    let layout: Layout = (keys.iter())
        .map(|k| wgrads.get(k).map(|g| (k.clone(), D::f32_len(g))))
        .collect::<Option<_>>()
        .ok_or_else(|| fail("a partial gradient is missing"))?;
    let total = layout.iter().map(|(_, n)| n).sum();
    let pieces = pieces_of(&layout, 0, total);
    let flat = packed(dev, wgrads, (&pieces, total), tensor)?;
    let r = comm.all_reduce_start(dev, (group, axis), flat)?;
    let flat = comm.all_reduce_finish(dev, r)?;
    unpack(dev, &flat, &pieces, wgrads, tensor)
}

/// The parameter set and flat range `a..b` of a gradient or parameter bucket (the
/// whole set without a range), within the set's total.
pub(super) fn bucket_range(
    target: &Target,
    total_of: &dyn Fn(ParamSet) -> usize,
) -> Result<(ParamSet, usize, usize), RankError> {
    let (set, range) = match target {
        Target::GradBucket { set, range } | Target::ParamBucket { set, range } => (*set, range),
        _ => {
            return Err(fail(format!(
                "the device interpreter does not reduce `{target}`"
            )))
        }
    };
    let total = total_of(set);
    let (a, b) = range.map_or((0, total), |(a, b)| (a as usize, b as usize));
    if a > b || b > total {
        return Err(fail(format!(
            "bucket {a}..{b} of `{target}` is outside its {total} values"
        )));
    }
    Ok((set, a, b))
}

/// A piece of a flat vector: (weight, offset in it, offset in the flat vector,
/// values).
pub(super) type Piece = (Key, usize, usize, usize);

/// Global rank `rank`'s position in group `g`.
pub(super) fn index_in(g: &Group, rank: usize) -> Res<usize> {
    (g.index_of(rank)).ok_or_else(|| fail(format!("rank {rank} is not in group {}", g.id)))
}

/// The parameter set a weight belongs to: the routed experts' or the rest.
pub(super) fn param_set(graph: &Graph, key: &Key) -> ParamSet {
    let expert = (graph.tensors.iter())
        .find(|t| t.name == key.0)
        .is_some_and(|t| t.split == meshplan_ir::TpSplit::Experts);
    if expert {
        ParamSet::Experts
    } else {
        ParamSet::Dense
    }
}

/// The pieces of the weights in `from` one after another, as one new buffer of
/// `len` values (`pieces` as [`pieces_of`] cuts a flat range of that length:
/// consecutive from offset 0, covering it).
pub(super) fn packed<D: Device>(
    dev: &D,
    from: &BTreeMap<Key, D::F32>,
    (pieces, len): (&[Piece], usize),
    what: &str,
) -> Result<D::F32, RankError> {
    let mut at = 0;
    let mut parts = Vec::with_capacity(pieces.len());
    for (key, src, dst, n) in pieces {
        let x = from
            .get(key)
            .ok_or_else(|| fail(format!("{what}: `{}` is not held", key.0)))?;
        if *dst != at {
            return Err(fail(format!(
                "{what}: `{}` is not where its run starts",
                key.0
            )));
        }
        parts.push((x, *src, *n));
        at += n;
    }
    if at != len {
        return Err(fail(format!(
            "{what}: the pieces hold {at} of {len} values"
        )));
    }
    dev.f32_concat(&parts).map_err(derr(what))
}

/// The inverse of [`packed`]: each piece of `flat` back into its weight in `into`.
pub(super) fn unpack<D: Device>(
    dev: &D,
    flat: &D::F32,
    pieces: &[Piece],
    into: &mut BTreeMap<Key, D::F32>,
    what: &str,
) -> Result<(), RankError> {
    scatter_into((flat, pieces), into, what, |x, y, n| dev.f32_copy(x, y, n))
}

/// [`unpack`] into compute copies.
pub(super) fn act_unpack<D: Device>(
    dev: &D,
    flat: &D::Act,
    pieces: &[Piece],
    into: &mut BTreeMap<Key, D::Act>,
    what: &str,
) -> Result<(), RankError> {
    scatter_into((flat, pieces), into, what, |x, y, n| dev.act_copy(x, y, n))
}

/// Each piece of `flat` into its weight's buffer in `into`, by `copy` (the
/// device's fp32 or compute-copy copy).
fn scatter_into<B>(
    (flat, pieces): (&B, &[Piece]),
    into: &mut BTreeMap<Key, B>,
    what: &str,
    copy: impl Fn((&B, usize), (&mut B, usize), usize) -> DResult<()>,
) -> Result<(), RankError> {
    for (key, src, dst, n) in pieces {
        let x = into
            .get_mut(key)
            .ok_or_else(|| fail(format!("{what}: `{}` is not held", key.0)))?;
        copy((flat, *dst), (x, *src), *n).map_err(derr(what))?;
    }
    Ok(())
}

/// One AdamW step of `param` from `grad` with moments `(m, v)` (and the compute
/// copy refreshed), with the run's constants ([`crate::ckpt::ADAMW`]) at `(step,
/// lr)`.
pub(super) fn adamw<D: Device>(
    dev: &D,
    (param, grad): (&mut D::F32, &D::F32),
    (m, v): (&mut D::F32, &mut D::F32),
    compute: Option<&mut D::Act>,
    (step, lr): (u64, f32),
) -> DResult<()> {
    let hyper = crate::ckpt::ADAMW;
    dev.adamw(crate::device::AdamW {
        param,
        grad,
        m,
        v,
        compute,
        step,
        lr,
        hyper,
    })
}

/// The pieces of the flat range `a..b` over weights laid out as `layout`: (weight,
/// offset in it, offset in the range, values).
pub(super) fn pieces_of(layout: &[(Key, usize)], a: usize, b: usize) -> Vec<Piece> {
    let mut pieces = Vec::new();
    let mut off = 0;
    for (key, len) in layout {
        let (x, y) = (off.max(a), (off + len).min(b));
        if x < y {
            pieces.push((key.clone(), x - off, x - a, y - x));
        }
        off += len;
    }
    pieces
}

/// The parts of `pieces` (offsets in a flat range) that lie outside its values
/// `lo..hi`.
pub(super) fn pieces_outside(pieces: &[Piece], (lo, hi): (usize, usize)) -> Vec<Piece> {
    let mut out = Vec::new();
    for (key, src, dst, n) in pieces {
        for (a, b) in [(*dst, (dst + n).min(lo)), ((*dst).max(hi), dst + n)] {
            if a < b {
                out.push((key.clone(), src + (a - dst), a, b - a));
            }
        }
    }
    out
}

/// AdamW moments of `n` values made of `pieces` (weight, offset in it, offset in the
/// result, values): a resumed checkpoint's, or zeros.
pub(super) fn initial_moments<D: Device>(
    dev: &D,
    start: &StartMoments,
    pieces: &[Piece],
    n: usize,
) -> Result<(D::F32, D::F32), RankError> {
    let e = derr("AdamW state");
    let saved = match start {
        StartMoments::Zeros => {
            return Ok((dev.f32_zeros(n).map_err(&e)?, dev.f32_zeros(n).map_err(&e)?))
        }
        StartMoments::Saved(saved) => saved,
        StartMoments::Taken => {
            let of = pieces.first().map_or("?", |p| p.0 .0.as_str());
            return Err(fail(format!(
                "the AdamW state of `{of}` made after `first_moments`, when the saved moments are let go"
            )));
        }
    };
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    for (key, src, dst, len) in pieces {
        let (sm, sv) = saved
            .get(key)
            .ok_or_else(|| fail(format!("the checkpoint has no AdamW state of `{}`", key.0)))?;
        m[*dst..dst + len].copy_from_slice(&sm[*src..src + len]);
        v[*dst..dst + len].copy_from_slice(&sv[*src..src + len]);
    }
    Ok((
        dev.f32_upload(&m).map_err(&e)?,
        dev.f32_upload(&v).map_err(&e)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bucket's pieces outside a part of it are the layout's pieces of the
    /// ranges before and after that part, at their offsets in the bucket.
    #[test]
    fn pieces_outside_a_part_are_the_ranges_around_it() {
        let layout: Layout = [("a", 5), ("b", 3), ("c", 8), ("d", 1)]
            .map(|(k, n)| ((k.to_string(), 0), n))
            .to_vec();
        for (start, len, n) in [(0, 17, 1), (2, 12, 2), (4, 12, 4), (1, 16, 2)] {
            let pieces = pieces_of(&layout, start, start + len);
            let c = len / n;
            for me in 0..n {
                let own = start + me * c;
                let want: Vec<Piece> = [(start, own), (own + c, start + len)]
                    .into_iter()
                    .flat_map(|(a, b)| {
                        let p = pieces_of(&layout, a, b).into_iter();
                        p.map(move |(key, src, dst, m)| (key, src, dst + a - start, m))
                    })
                    .collect();
                let got = pieces_outside(&pieces, (own - start, own - start + c));
                assert_eq!(got, want, "bucket {start}+{len}, part {me} of {n}");
                let covered: usize = got.iter().map(|p| p.3).sum();
                assert_eq!(covered, len - c, "bucket {start}+{len}, part {me} of {n}");
            }
        }
    }
}
