//! ZeRO-3 (FSDP): each segment copy's weights are one flat vector that the data
//! ranks shard. Between its uses a rank holds only its part of the copy's fp32
//! masters, and the AdamW moments of that part. The copy's forward and its backward
//! each gather the whole weights first (and their compute copies are written from
//! them); the forward lets them go when it ends, the backward after the
//! reduce-scatter of its gradients, which exist only while it runs. Weights that
//! more than one segment reads (a tied table) stay whole, as FSDP's root unit keeps
//! its parameters.

use super::step::{adamw, initial_moments, packed, pieces_of, unpack};
use super::*;
use std::collections::BTreeSet;

/// One segment copy's weights of one parameter set: (set, segment, layer).
pub(super) type CopyKey = (ParamSet, usize, u64);

pub(super) struct Zero3<D: Device> {
    /// Each copy's flat vector: (weight, length) in key order.
    layouts: BTreeMap<CopyKey, Layout>,
    /// This rank's part of each copy's fp32 masters: between the copy's uses, the
    /// only values of those weights this rank holds.
    parts: BTreeMap<CopyKey, D::F32>,
    /// Each copy's reduce-scattered gradient part this step.
    pub grads: BTreeMap<CopyKey, D::F32>,
    /// The AdamW moments of each part.
    pub adam: BTreeMap<CopyKey, Moments<D>>,
    /// Weights read by more than one segment: held whole throughout.
    shared: BTreeSet<Key>,
}

impl<D: Device> Zero3<D> {
    pub fn new() -> Self {
        Zero3 {
            layouts: BTreeMap::new(),
            parts: BTreeMap::new(),
            grads: BTreeMap::new(),
            adam: BTreeMap::new(),
            shared: BTreeSet::new(),
        }
    }

    /// Values held in parts of the masters.
    pub fn part_elems(&self) -> usize {
        self.parts.values().map(D::f32_len).sum()
    }
}

impl<'a, D: Device> DevRank<'a, D> {
    /// The group ZeRO-3 shards `set` over (the experts' over `edp`), when the plan
    /// is ZeRO-3 and that group has more than one member.
    pub(super) fn zero3_group(&self, set: ParamSet) -> Option<Group> {
        let name = match set {
            ParamSet::Dense => "dp",
            ParamSet::Experts => "edp",
        };
        self.mesh
            .groups
            .get(name)
            .filter(|g| self.plan.strategy.zero >= 3 && g.size() > 1)
            .cloned()
    }

    /// At the start of the run, with every weight whole: lays out each segment
    /// copy, keeps this rank's part of its masters, and lets the whole weights go.
    pub(super) fn zero3_shard(&mut self) -> Result<(), RankError> {
        let copies = segment_copies(self.graph, self.phase()?)?;
        for set in [ParamSet::Dense, ParamSet::Experts] {
            let Some(g) = self.zero3_group(set) else {
                continue;
            };
            for &(s, l) in &copies {
                let l = l.unwrap_or(NO_LAYER);
                let layout = self.copy_layout(s, l, set);
                if layout.is_empty() {
                    continue;
                }
                let (_, start, c) = self.part_of(&g, &layout)?;
                let own = pieces_of(&layout, start, start + c);
                let part = packed(&self.dev, &self.weights.master, (&own, c), "ZeRO-3")?;
                self.zero.z3.parts.insert((set, s, l), part);
                self.zero.z3.layouts.insert((set, s, l), layout);
            }
        }
        self.zero.z3.shared = self.shared_weights();
        let copies: Vec<CopyKey> = self.zero.z3.layouts.keys().copied().collect();
        for copy in copies {
            self.zero3_release(copy, true)?;
        }
        Ok(())
    }

    /// Weights read by ops of more than one segment.
    fn shared_weights(&self) -> BTreeSet<Key> {
        let users = weight_users(self.graph);
        self.weights
            .held
            .iter()
            .filter(|(name, _)| users.get(name.as_str()).is_some_and(|s| s.len() > 1))
            .cloned()
            .collect()
    }

    /// ZeRO-3: the weights of one segment copy (those whose first user is in that
    /// segment; a tied table belongs to the embedding), as the flat vector the data
    /// ranks shard: (weight, length) in key order.
    fn copy_layout(&self, segment: usize, l: u64, set: ParamSet) -> Layout {
        let users = weight_users(self.graph);
        let first_user = |w: &str| users.get(w).and_then(|s| s.first().copied());
        self.weights
            .master
            .iter()
            .filter(|(k, _)| self.set_of(k) == set)
            .filter(|((w, layer), _)| *layer == l && first_user(w) == Some(segment))
            .map(|(k, m)| (k.clone(), D::f32_len(m)))
            .collect()
    }

    /// The length of the flat vector `layout` lays out, and this rank's part of it
    /// over `g`: `(total, start, len)`.
    fn part_of(
        &self,
        g: &Group,
        layout: &[(Key, usize)],
    ) -> Result<(usize, usize, usize), RankError> {
        let total: usize = layout.iter().map(|(_, n)| n).sum();
        let n = g.size();
        if !total.is_multiple_of(n) {
            return Err(fail(format!(
                "{total} parameters of a segment do not split over {n} ranks"
            )));
        }
        let c = total / n;
        Ok((total, self.index_in(g)? * c, c))
    }

    /// A copy's layout (a gather's or scatter's; [`Self::zero3_part`] with the
    /// part).
    fn zero3_layout(&self, copy: CopyKey) -> Result<Layout, RankError> {
        (self.zero.z3.layouts.get(&copy).cloned())
            .ok_or_else(|| fail("ZeRO-3: a segment copy is not laid out"))
    }

    /// A copy's layout, where this rank's part starts in it, and the part.
    pub(super) fn zero3_part(&self, copy: CopyKey) -> Result<(&Layout, usize, &D::F32), RankError> {
        let missing = || fail("ZeRO-3: a segment copy is not laid out");
        let layout = self.zero.z3.layouts.get(&copy).ok_or_else(missing)?;
        let part = self.zero.z3.parts.get(&copy).ok_or_else(missing)?;
        let g = self
            .zero3_group(copy.0)
            .ok_or_else(|| fail("no ZeRO-3 group"))?;
        let (_, start, _) = self.part_of(&g, layout)?;
        Ok((layout, start, part))
    }

    /// Lets a copy's whole weights go (and, after its backward, their gradients);
    /// shared weights stay, their gradients zeroed.
    fn zero3_release(&mut self, copy: CopyKey, grads: bool) -> Result<(), RankError> {
        let Some(layout) = self.zero.z3.layouts.get(&copy) else {
            return Ok(());
        };
        for (key, _) in layout {
            if self.zero.z3.shared.contains(key) {
                if let (true, Some(g)) = (grads, self.weights.wgrads.get_mut(key)) {
                    self.dev.f32_zero(g).map_err(derr(&key.0))?;
                }
                continue;
            }
            self.weights.master.remove(key);
            self.weights.compute.remove(key);
            if grads {
                self.weights.wgrads.remove(key);
            }
        }
        Ok(())
    }

    /// After a segment copy's forward: its gathered weights go.
    pub(super) fn zero3_forward_done(&mut self, s: usize, l: u64) -> Result<(), RankError> {
        for set in [ParamSet::Dense, ParamSet::Experts] {
            self.zero3_release((set, s, l), false)?;
        }
        Ok(())
    }

    /// ZeRO-3's gather of one segment copy's weights before its forward or
    /// `backward`: every rank's part of the fp32 masters, then the compute copies
    /// written; before the backward, zero gradients to accumulate into.
    pub(super) fn zero3_gather(
        &mut self,
        (g, axis): (&Group, &str),
        (segment, set, l): (&str, ParamSet, u64),
        backward: bool,
    ) -> Result<(), RankError> {
        let copy = (set, segment_index(self.graph, segment)?, l);
        let layout = self.zero3_layout(copy)?;
        let total: usize = layout.iter().map(|(_, n)| n).sum();
        let part = self
            .zero
            .z3
            .parts
            .get(&copy)
            .ok_or_else(|| fail("no part"))?;
        let all = self
            .comm
            .f32_collective(&self.dev, (CommKind::AllGather, (g, axis)), part)?;
        let e = derr(segment);
        for (key, n) in &layout {
            if !self.weights.master.contains_key(key) {
                let master = self.dev.f32_zeros(*n).map_err(&e)?;
                if D::master_as_act(&master).is_none() {
                    let copy = self.dev.act_zeros(*n).map_err(&e)?;
                    self.weights.compute.insert(key.clone(), copy);
                }
                self.weights.master.insert(key.clone(), master);
            }
            if backward && !self.weights.wgrads.contains_key(key) {
                let grad = self.dev.f32_zeros(*n).map_err(&e)?;
                self.weights.wgrads.insert(key.clone(), grad);
            }
        }
        let all_pieces = pieces_of(&layout, 0, total);
        unpack(
            &self.dev,
            &all,
            &all_pieces,
            &mut self.weights.master,
            segment,
        )?;
        refresh_copies(
            &self.dev,
            &self.weights.master,
            &mut self.weights.compute,
            layout.iter().map(|(key, _)| key),
        )
    }

    /// ZeRO-3's reduce-scatter of one segment copy's gradients after its
    /// backward: this rank keeps (adds up, over micro-batches) its part of the sum,
    /// and the copy's weights and gradients go.
    pub(super) fn zero3_scatter(
        &mut self,
        (g, axis): (&Group, &str),
        (segment, set, l): (&str, ParamSet, u64),
    ) -> Result<(), RankError> {
        let copy = (set, segment_index(self.graph, segment)?, l);
        let layout = self.zero3_layout(copy)?;
        let (total, _, c) = self.part_of(g, &layout)?;
        let e = derr(segment);
        let all = pieces_of(&layout, 0, total);
        let flat = packed(&self.dev, &self.weights.wgrads, (&all, total), segment)?;
        let on = (CommKind::ReduceScatter, (g, axis));
        let out = self.comm.f32_collective_owned(&self.dev, on, flat)?;
        let acc = match self.zero.z3.grads.entry(copy) {
            std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(self.dev.f32_zeros(c).map_err(&e)?)
            }
        };
        self.dev.f32_accumulate(acc, &out).map_err(&e)?;
        self.zero3_release(copy, true)
    }

    /// The AdamW moments of each segment copy's part this rank holds
    /// ([`DevRank::first_moments`]).
    pub(super) fn zero3_moments(&mut self) -> Result<(), RankError> {
        let copies: Vec<CopyKey> = self.zero.z3.layouts.keys().copied().collect();
        for copy in copies {
            let (layout, start, part) = self.zero3_part(copy)?;
            let c = D::f32_len(part);
            let pieces = pieces_of(layout, start, start + c);
            let state = initial_moments(&self.dev, &self.zero.start_moments, &pieces, c)?;
            self.zero.z3.adam.insert(copy, state);
        }
        Ok(())
    }

    /// ZeRO-3's AdamW: each segment copy's part of the fp32 masters this rank
    /// holds, with moments of that part alone.
    pub(super) fn optimizer_zero3(&mut self, set: ParamSet) -> Result<(), RankError> {
        let step = self.meter.step_no + 1;
        let copies: Vec<CopyKey> = self
            .zero
            .z3
            .layouts
            .keys()
            .filter(|c| c.0 == set)
            .copied()
            .collect();
        for copy in copies {
            let (mut m, mut v) = (self.zero.z3.adam.remove(&copy))
                .ok_or_else(|| fail(format!("ZeRO-3: no AdamW state of segment copy {copy:?}")))?;
            // A copy whose gradients the program never reduce-scattered would still
            // move on its moments: a plan that lost the collective, refused.
            let grad = self.zero.z3.grads.remove(&copy).ok_or_else(|| {
                fail(format!(
                    "ZeRO-3: no reduced gradient of segment copy {copy:?} this step (the plan's backward has no reduce-scatter of it)"
                ))
            })?;
            let part = self
                .zero
                .z3
                .parts
                .get_mut(&copy)
                .ok_or_else(|| fail("no part"))?;
            let lr = self.opts.lr;
            adamw(&self.dev, (part, &grad), (&mut m, &mut v), None, (step, lr))
                .map_err(derr("adamw"))?;
            self.zero.z3.adam.insert(copy, (m, v));
        }
        Ok(())
    }

    /// This rank's parts of the segment copies' masters, each with its copy.
    pub(super) fn zero3_parts(&self) -> impl Iterator<Item = (CopyKey, &D::F32)> {
        self.zero.z3.parts.iter().map(|(c, p)| (*c, p))
    }

    /// The first non-finite value in this rank's part of segment copy `copy`'s
    /// masters (which holds one): the weight it belongs to.
    pub(super) fn zero3_non_finite(&self, copy: CopyKey) -> Result<(Key, f32), RankError> {
        let e = derr("check");
        let (layout, start, part) = self.zero3_part(copy)?;
        let host = self.dev.f32_download(part).map_err(&e)?;
        let at = host.iter().position(|x| !x.is_finite()).unwrap_or(0);
        let key = pieces_of(layout, start, start + host.len())
            .into_iter()
            .find(|(_, _, dst, n)| (*dst..dst + n).contains(&at))
            .map_or_else(|| layout[0].0.clone(), |p| p.0);
        Ok((key, host.get(at).copied().unwrap_or(f32::NAN)))
    }

    /// Before the report: every copy's weights gathered whole.
    pub(super) fn zero3_gather_all(&mut self) -> Result<(), RankError> {
        let copies: Vec<CopyKey> = self.zero.z3.layouts.keys().copied().collect();
        for (set, s, l) in copies {
            let g = self
                .zero3_group(set)
                .ok_or_else(|| fail("no ZeRO-3 group"))?;
            let seg = self.graph.segments[s].name.clone();
            self.zero3_gather((&g, "dp"), (&seg, set, l), false)?;
        }
        Ok(())
    }
}
