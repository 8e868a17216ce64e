//! ZeRO-3 (FSDP): each segment copy's weights are one flat vector that the data
//! ranks shard. Between its uses a rank holds only its part of the copy's fp32
//! masters, the AdamW moments of that part and, where the device computes on
//! copies apart from the masters (bf16 on a GPU), the compute copy of that part.
//! The copy's forward and its backward each gather the whole compute copies first
//! (as FSDP gathers its `param_dtype` parameters; where the master serves as the
//! compute copy, the masters); the forward lets them go when it ends, the backward
//! after the reduce-scatter of its gradients, which exist only while it runs.
//! Weights that more than one segment reads (a tied table) stay whole, as FSDP's
//! root unit keeps its parameters.
//!
//! [`Zero3`] owns all of it: the rank hands it the device, the communicator and
//! the weights it works on, and keeps no ZeRO-3 state of its own.

use super::step::{
    act_unpack, adamw, index_in, initial_moments, packed, param_set, pieces_of, unpack,
};
use super::*;
use std::collections::BTreeSet;

/// One segment copy's weights of one parameter set: (set, segment, layer).
pub(super) type CopyKey = (ParamSet, usize, u64);

pub(super) struct Zero3<D: Device> {
    /// This rank's global rank: its place in each group below.
    rank: usize,
    /// The group each sharded parameter set is split over (the experts' over
    /// `edp`); a set not here is held whole.
    groups: BTreeMap<ParamSet, Group>,
    /// Each copy's flat vector: (weight, length) in key order.
    layouts: BTreeMap<CopyKey, Layout>,
    /// This rank's part of each copy's fp32 masters: between the copy's uses, the
    /// only values of those weights this rank holds.
    parts: BTreeMap<CopyKey, D::F32>,
    /// The compute copy of each part, where the masters do not serve as one.
    copies: BTreeMap<CopyKey, D::Act>,
    /// Each copy's reduce-scattered gradient part this step.
    pub grads: BTreeMap<CopyKey, D::F32>,
    /// The AdamW moments of each part.
    pub adam: BTreeMap<CopyKey, Moments<D>>,
    /// Weights read by more than one segment: held whole throughout.
    shared: BTreeSet<Key>,
}

impl<D: Device> Zero3<D> {
    /// Nothing sharded: before [`Zero3::shard`], and for plans below ZeRO-3.
    pub fn new() -> Self {
        Zero3 {
            rank: 0,
            groups: BTreeMap::new(),
            layouts: BTreeMap::new(),
            parts: BTreeMap::new(),
            copies: BTreeMap::new(),
            grads: BTreeMap::new(),
            adam: BTreeMap::new(),
            shared: BTreeSet::new(),
        }
    }

    /// Values held in parts of the masters, and in their compute copies.
    pub fn part_elems(&self) -> (usize, usize) {
        let copies = self.copies.values().map(D::act_len).sum();
        (self.parts.values().map(D::f32_len).sum(), copies)
    }

    /// The group ZeRO-3 shards `set` over, if it does.
    pub fn group(&self, set: ParamSet) -> Option<&Group> {
        self.groups.get(&set)
    }

    /// At the start of the run, with every weight whole: lays out each segment
    /// copy (`copies`: segment and layer) of each set `groups` shards, keeps
    /// `rank`'s part of its masters, and lets the whole weights go.
    pub fn shard(
        &mut self,
        (dev, graph): (&D, &Graph),
        copies: &[(usize, Option<u64>)],
        (rank, groups): (usize, BTreeMap<ParamSet, Group>),
        weights: &mut Weights<D>,
    ) -> Res {
        (self.rank, self.groups) = (rank, groups);
        let users = weight_users(graph);
        let name = |id: &TensorId| graph.tensor(*id).name.as_str();
        // Each weight with the segment that reads it first (a tied table: the
        // embedding), by name, as the weights are keyed.
        let owned: BTreeSet<(usize, &str)> = (users.iter())
            .filter_map(|(id, s)| Some((*s.first()?, name(id))))
            .collect();
        for (&set, g) in &self.groups {
            for &(s, l) in copies {
                let l = l.unwrap_or(NO_LAYER);
                let layout = copy_layout::<D>((graph, &owned), &weights.master, (s, l, set));
                if layout.is_empty() {
                    continue;
                }
                let (_, start, c) = self.part_of(g, &layout)?;
                let own = pieces_of(&layout, start, start + c);
                let part = packed(dev, &weights.master, (&own, c), "ZeRO-3")?;
                if D::master_as_act(&part).is_none() {
                    let mut copy = dev.act_zeros(c).map_err(derr("ZeRO-3"))?;
                    dev.to_act(&part, &mut copy).map_err(derr("ZeRO-3"))?;
                    self.copies.insert((set, s, l), copy);
                }
                self.parts.insert((set, s, l), part);
                self.layouts.insert((set, s, l), layout);
            }
        }
        let shared: BTreeSet<&str> = (users.iter())
            .filter(|(_, s)| s.len() > 1)
            .map(|(id, _)| name(id))
            .collect();
        self.shared = (weights.held.iter())
            .filter(|(w, _)| shared.contains(w.as_str()))
            .cloned()
            .collect();
        for copy in self.layouts.keys() {
            self.release(dev, weights, *copy, true)?;
        }
        Ok(())
    }

    /// The length of the flat vector `layout` lays out, and this rank's part of it
    /// over `g`: `(total, start, len)`.
    fn part_of(&self, g: &Group, layout: &[(Key, usize)]) -> Res<(usize, usize, usize)> {
        let total: usize = layout.iter().map(|(_, n)| n).sum();
        let n = g.size();
        if !total.is_multiple_of(n) {
            return Err(fail(format!(
                "{total} parameters of a segment do not split over {n} ranks"
            )));
        }
        let c = total / n;
        Ok((total, index_in(g, self.rank)? * c, c))
    }

    /// A copy's layout (a gather's or scatter's; [`Self::part`] with the part).
    fn layout(&self, copy: CopyKey) -> Res<Layout> {
        (self.layouts.get(&copy).cloned())
            .ok_or_else(|| fail("ZeRO-3: a segment copy is not laid out"))
    }

    /// A copy's layout, where this rank's part starts in it, and the part.
    pub fn part(&self, copy: CopyKey) -> Res<(&Layout, usize, &D::F32)> {
        let missing = || fail("ZeRO-3: a segment copy is not laid out");
        let layout = self.layouts.get(&copy).ok_or_else(missing)?;
        let part = self.parts.get(&copy).ok_or_else(missing)?;
        let g = self.group(copy.0).ok_or_else(|| fail("no ZeRO-3 group"))?;
        let (_, start, _) = self.part_of(g, layout)?;
        Ok((layout, start, part))
    }

    /// Lets a copy's whole weights go (and, after its backward, their gradients);
    /// shared weights stay, their gradients zeroed.
    fn release(&self, dev: &D, weights: &mut Weights<D>, copy: CopyKey, grads: bool) -> Res {
        let Some(layout) = self.layouts.get(&copy) else {
            return Ok(());
        };
        for (key, _) in layout {
            if self.shared.contains(key) {
                if let (true, Some(g)) = (grads, weights.wgrads.get_mut(key)) {
                    dev.f32_zero(g).map_err(derr(&key.0))?;
                }
                continue;
            }
            weights.master.remove(key);
            weights.compute.remove(key);
            if grads {
                weights.wgrads.remove(key);
            }
        }
        Ok(())
    }

    /// After a segment copy's forward: its gathered weights go.
    pub fn forward_done(&self, dev: &D, weights: &mut Weights<D>, (s, l): (usize, u64)) -> Res {
        for set in [ParamSet::Dense, ParamSet::Experts] {
            self.release(dev, weights, (set, s, l), false)?;
        }
        Ok(())
    }

    /// The gather of one segment copy's weights (`segment` names it) before its
    /// forward or `backward`: every rank's part of the compute copies (of the
    /// masters where they serve as them, their compute copies then written); before
    /// the backward, zero gradients to accumulate into.
    pub fn gather(
        &self,
        (dev, comm): (&D, &mut D::Comm),
        (g, axis): (&Group, &str),
        (segment, copy): (&str, CopyKey),
        (weights, backward): (&mut Weights<D>, bool),
    ) -> Res {
        let layout = self.layout(copy)?;
        let e = derr(segment);
        if let Some(part) = self.copies.get(&copy) {
            let all = comm.act_collective(dev, (CommKind::AllGather, (g, axis)), part)?;
            for (key, n) in &layout {
                if !weights.compute.contains_key(key) {
                    let w = dev.act_zeros(*n).map_err(&e)?;
                    weights.compute.insert(key.clone(), w);
                }
            }
            let total = layout.iter().map(|(_, n)| n).sum();
            let all_pieces = pieces_of(&layout, 0, total);
            act_unpack(dev, &all, &all_pieces, &mut weights.compute, segment)?;
        } else {
            self.gather_masters((dev, comm), (g, axis), (segment, copy, &layout), weights)?;
        }
        if backward {
            for (key, n) in &layout {
                if !weights.wgrads.contains_key(key) {
                    let grad = dev.f32_zeros(*n).map_err(&e)?;
                    weights.wgrads.insert(key.clone(), grad);
                }
            }
        }
        Ok(())
    }

    /// Every rank's part of a segment copy's fp32 masters, whole in `weights`,
    /// with their compute copies written.
    fn gather_masters(
        &self,
        (dev, comm): (&D, &mut D::Comm),
        (g, axis): (&Group, &str),
        (segment, copy, layout): (&str, CopyKey, &[(Key, usize)]),
        weights: &mut Weights<D>,
    ) -> Res {
        let total: usize = layout.iter().map(|(_, n)| n).sum();
        let part = self.parts.get(&copy).ok_or_else(|| fail("no part"))?;
        let all = comm.f32_collective(dev, (CommKind::AllGather, (g, axis)), part)?;
        let e = derr(segment);
        for (key, n) in layout {
            if !weights.master.contains_key(key) {
                let master = dev.f32_zeros(*n).map_err(&e)?;
                if D::master_as_act(&master).is_none() && !weights.compute.contains_key(key) {
                    let copy = dev.act_zeros(*n).map_err(&e)?;
                    weights.compute.insert(key.clone(), copy);
                }
                weights.master.insert(key.clone(), master);
            }
        }
        let all_pieces = pieces_of(layout, 0, total);
        unpack(dev, &all, &all_pieces, &mut weights.master, segment)?;
        let keys = layout.iter().map(|(key, _)| key);
        refresh_copies(dev, &weights.master, &mut weights.compute, keys)
    }

    /// The reduce-scatter of one segment copy's gradients after its backward:
    /// this rank keeps (adds up, over micro-batches) its part of the sum, and the
    /// copy's weights and gradients go.
    pub fn scatter(
        &mut self,
        (dev, comm): (&D, &mut D::Comm),
        (g, axis): (&Group, &str),
        (segment, copy): (&str, CopyKey),
        weights: &mut Weights<D>,
    ) -> Res {
        let layout = self.layout(copy)?;
        let (total, _, c) = self.part_of(g, &layout)?;
        let e = derr(segment);
        let all = pieces_of(&layout, 0, total);
        let flat = packed(dev, &weights.wgrads, (&all, total), segment)?;
        let on = (CommKind::ReduceScatter, (g, axis));
        let out = comm.f32_collective_owned(dev, on, flat)?;
        let acc = match self.grads.entry(copy) {
            std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(dev.f32_zeros(c).map_err(&e)?)
            }
        };
        dev.f32_accumulate(acc, &out).map_err(&e)?;
        self.release(dev, weights, copy, true)
    }

    /// The AdamW moments of each segment copy's part this rank holds
    /// ([`DevRank::first_moments`]).
    pub fn moments(&mut self, dev: &D, start: &StartMoments) -> Res {
        for &copy in self.layouts.keys() {
            let (layout, at, part) = self.part(copy)?;
            let c = D::f32_len(part);
            let pieces = pieces_of(layout, at, at + c);
            let state = initial_moments(dev, start, &pieces, c)?;
            self.adam.insert(copy, state);
        }
        Ok(())
    }

    /// AdamW: each segment copy's part of `set`'s fp32 masters this rank holds,
    /// with moments of that part alone.
    pub fn optimizer(&mut self, dev: &D, set: ParamSet, (step, lr): (u64, f32)) -> Res {
        for (&copy, part) in self.parts.iter_mut().filter(|(c, _)| c.0 == set) {
            let compute = self.copies.get_mut(&copy);
            let (m, v) = (self.adam.get_mut(&copy))
                .ok_or_else(|| fail(format!("ZeRO-3: no AdamW state of segment copy {copy:?}")))?;
            // A copy whose gradients the program never reduce-scattered would still
            // move on its moments: a plan that lost the collective, refused.
            let grad = self.grads.remove(&copy).ok_or_else(|| {
                fail(format!(
                    "ZeRO-3: no reduced gradient of segment copy {copy:?} this step (the plan's backward has no reduce-scatter of it)"
                ))
            })?;
            adamw(dev, (part, &grad), (m, v), compute, (step, lr)).map_err(derr("adamw"))?;
        }
        Ok(())
    }

    /// This rank's parts of the segment copies' masters, each with its copy.
    pub fn parts(&self) -> impl Iterator<Item = (CopyKey, &D::F32)> {
        self.parts.iter().map(|(c, p)| (*c, p))
    }

    /// The first non-finite value in this rank's part of segment copy `copy`'s
    /// masters (which holds one): the weight it belongs to.
    pub fn non_finite(&self, dev: &D, copy: CopyKey) -> Res<(Key, f32)> {
        let (layout, start, part) = self.part(copy)?;
        non_finite_in(dev, (layout, start), part)
    }

    /// Before the report: every copy's fp32 masters gathered whole.
    pub fn gather_all(
        &self,
        on: (&D, &mut D::Comm),
        graph: &Graph,
        weights: &mut Weights<D>,
    ) -> Res {
        let (dev, comm) = on;
        for &copy in self.layouts.keys() {
            let g = self.group(copy.0).ok_or_else(|| fail("no ZeRO-3 group"))?;
            let seg = &graph.segments[copy.1].name;
            let layout = self.layouts.get(&copy).map_or(&[][..], Vec::as_slice);
            self.gather_masters((dev, &mut *comm), (g, "dp"), (seg, copy, layout), weights)?;
        }
        Ok(())
    }
}

/// The weights of one segment copy (those `owned` pairs with that segment, the
/// first to read them; a tied table belongs to the embedding) in `set`, as the flat
/// vector the data ranks shard: (weight, length) in key order.
fn copy_layout<D: Device>(
    (graph, owned): (&Graph, &BTreeSet<(usize, &str)>),
    master: &BTreeMap<Key, D::F32>,
    (segment, l, set): (usize, u64, ParamSet),
) -> Layout {
    master
        .iter()
        .filter(|(k, _)| param_set(graph, k) == set)
        .filter(|((w, layer), _)| *layer == l && owned.contains(&(segment, w.as_str())))
        .map(|(k, m)| (k.clone(), D::f32_len(m)))
        .collect()
}

/// The first non-finite value in `part`, which starts at `start` of the flat
/// vector `layout` lays out: the weight it belongs to, and the value.
pub(super) fn non_finite_in<D: Device>(
    dev: &D,
    (layout, start): (&[(Key, usize)], usize),
    part: &D::F32,
) -> Res<(Key, f32)> {
    let host = dev.f32_download(part).map_err(derr("check"))?;
    let at = host.iter().position(|x| !x.is_finite()).unwrap_or(0);
    let key = pieces_of(layout, start, start + host.len())
        .into_iter()
        .find(|(_, _, dst, n)| (*dst..dst + n).contains(&at))
        .map_or_else(|| layout[0].0.clone(), |p| p.0);
    Ok((key, host.get(at).copied().unwrap_or(f32::NAN)))
}
