//! ZeRO 1 and 2: each parameter set's gradients are reduce-scattered over the data
//! ranks in buckets; a rank updates its part of the fp32 masters with moments of
//! that part alone, and the parameter buckets' all-gathers bring the other ranks'
//! updated parts. Where the device computes on copies apart from the masters (bf16
//! on a GPU), a rank holds only its part of the masters, as Megatron-LM's
//! distributed optimizer does, and the gathers bring compute copies; where the
//! master is the compute copy (fp32 on the host), the masters stay whole and the
//! gathers bring them. ZeRO-3's segment copies are [`zero3::Zero3`]'s.
//!
//! [`ZeroState`] owns the parts, their moments and the buckets; the rank hands it
//! the device, the communicator and the weights it works on.

use super::step::{act_unpack, adamw, initial_moments, packed, pieces_of, pieces_outside, unpack};
use super::*;

/// Each parameter set's flat vector, and what ZeRO keeps of it.
pub(super) struct ZeroState<D: Device> {
    /// Each parameter set's flat vector: weights and their lengths, in order.
    pub(super) layouts: BTreeMap<ParamSet, Layout>,
    /// ZeRO's gradient and parameter buckets.
    pub(super) scatter: Vec<Bucket>,
    pub(super) gather: Vec<Bucket>,
    /// ZeRO: this rank's reduced gradient parts this step (flat start, values), and
    /// the AdamW moments of each part it updates.
    pub(super) shards: Vec<(ParamSet, usize, D::F32)>,
    pub(super) shard_adam: BTreeMap<(ParamSet, usize), Moments<D>>,
    /// ZeRO: the parts AdamW updated this step (flat start, values), packed as the
    /// all-gather sends them, until it does: masters where they serve as compute
    /// copies, else the compute copies of the updated parts.
    pub(super) updated: Vec<(ParamSet, usize, D::F32)>,
    pub(super) updated_copies: Vec<(ParamSet, usize, D::Act)>,
    /// This rank's part of the fp32 masters of each set it holds so (flat start,
    /// values), where the device keeps compute copies apart.
    pub(super) master_parts: BTreeMap<(ParamSet, usize), D::F32>,
    /// ZeRO-3: this rank's parts of each segment copy's masters, gradients and
    /// moments.
    pub(super) z3: zero3::Zero3<D>,
    /// Where AdamW's moments start.
    pub(super) start_moments: StartMoments,
}

/// Where AdamW's moments start.
pub(super) enum StartMoments {
    /// At zero: a run from the start.
    Zeros,
    /// Resuming: this rank's part of each weight's saved moments, until
    /// `first_moments` has built every state from them.
    Saved(BTreeMap<Key, (Vec<f32>, Vec<f32>)>),
    /// Every state is built: the saved moments are let go.
    Taken,
}

impl<D: Device> ZeroState<D> {
    /// Before the parameter sets are laid out.
    pub(super) fn unplanned() -> Self {
        ZeroState {
            layouts: BTreeMap::new(),
            scatter: Vec::new(),
            gather: Vec::new(),
            shards: Vec::new(),
            shard_adam: BTreeMap::new(),
            updated: Vec::new(),
            updated_copies: Vec::new(),
            master_parts: BTreeMap::new(),
            z3: zero3::Zero3::new(),
            start_moments: StartMoments::Zeros,
        }
    }

    /// `set`'s flat vector: its weights and their lengths, in order.
    pub(super) fn layout(&self, set: ParamSet) -> &[(Key, usize)] {
        self.layouts.get(&set).map_or(&[], Vec::as_slice)
    }

    /// Whether ZeRO 1-2's reduce-scatters leave this rank parts of `set`.
    pub(super) fn sharded(&self, set: ParamSet) -> bool {
        self.scatter.iter().any(|b| b.set == set)
    }

    /// Gradient bucket `i` summed over the data ranks, this rank keeping its part
    /// (adding it to the part an earlier micro-batch left, under ZeRO-2). The
    /// last of a set's `per_microbatch` (ZeRO-2) scatters, which run back to back
    /// at the end of a micro-batch's backward, lets the set's whole gradients go:
    /// they exist only while a backward writes them (the ops make them again, at
    /// zero, as they first write them).
    pub(super) fn reduce_scatter(
        &mut self,
        (dev, comm): (&D, &mut D::Comm),
        i: usize,
        wgrads: &mut BTreeMap<Key, D::F32>,
        per_microbatch: bool,
    ) -> Res {
        let bk = &self.scatter[i];
        let buf = bk.packed(dev, wgrads, "reduce-scatter")?;
        if per_microbatch && !self.scatter[i + 1..].iter().any(|b| b.set == bk.set) {
            for (key, _) in self.layout(bk.set) {
                wgrads.remove(key);
            }
        }
        let on = (CommKind::ReduceScatter, (&bk.group, bk.axis.as_str()));
        let part = comm.f32_collective_owned(dev, on, buf)?;
        let (set, own) = (bk.set, bk.own);
        match (self.shards.iter_mut()).find(|(s, at, _)| (*s, *at) == (set, own)) {
            Some((.., acc)) => dev
                .f32_accumulate(acc, &part)
                .map_err(derr("reduce-scatter"))?,
            None => self.shards.push((set, own, part)),
        }
        Ok(())
    }

    /// The index of the gradient bucket `target` names.
    pub(super) fn scatter_index(&self, target: &Target) -> Res<usize> {
        (self.scatter.iter().position(|b| b.target == *target))
            .ok_or_else(|| fail(format!("`{target}` is not a gradient bucket of this stage")))
    }

    /// Parameter bucket `i` from the parts each data rank updated (the buckets
    /// cut the flat vector as the reduce-scatters do: [`cuts_match`]): the
    /// compute copies where this rank holds a part of the set's masters, else the
    /// masters.
    pub(super) fn all_gather(
        &mut self,
        (dev, comm): (&D, &mut D::Comm),
        i: usize,
        weights: &mut Weights<D>,
    ) -> Res {
        let bk = &self.gather[i];
        let (own, c) = bk.part();
        let on = (CommKind::AllGather, (&bk.group, bk.axis.as_str()));
        // The other ranks' parts only: this rank's holds its own values.
        let mine = own - bk.start;
        let others = pieces_outside(&bk.pieces, (mine, mine + c));
        let is_mine = |(s, at, n): (ParamSet, usize, usize)| (s, at, n) == (bk.set, own, c);
        let missing = || fail(format!("`{}`: this rank updated no part of it", bk.target));
        if self.sharded_masters(bk.set) {
            let done = (self.updated_copies.iter())
                .position(|(s, at, x)| is_mine((*s, *at, D::act_len(x))));
            let local = self.updated_copies.swap_remove(done.ok_or_else(missing)?).2;
            let all = comm.act_collective(dev, on, &local)?;
            return act_unpack(dev, &all, &others, &mut weights.compute, "all-gather");
        }
        // AdamW's packed output is this rank's part as it is in the masters: sent
        // as it is.
        let done = (self.updated.iter()).position(|(s, at, x)| is_mine((*s, *at, D::f32_len(x))));
        let local = self.updated.swap_remove(done.ok_or_else(missing)?).2;
        let all = comm.f32_collective_owned(dev, on, local)?;
        unpack(dev, &all, &others, &mut weights.master, "all-gather")
    }

    /// The weights whose whole masters the parameter gathers write (of the sets
    /// gathered without parts of the masters).
    pub(super) fn gathered_masters(&self) -> impl Iterator<Item = &Key> {
        let sets: BTreeSet<ParamSet> = (self.gather.iter().map(|b| b.set))
            .filter(|&set| !self.sharded_masters(set))
            .collect();
        sets.into_iter()
            .flat_map(|set| self.layout(set).iter().map(|(key, _)| key))
    }

    /// Whether this rank holds only its parts of `set`'s masters.
    fn sharded_masters(&self, set: ParamSet) -> bool {
        self.master_parts.keys().any(|(s, _)| *s == set)
    }

    /// Once the buckets are laid out, where the device computes on copies apart
    /// from the masters: this rank keeps its part of each set's masters that the
    /// reduce-scatters tile, and lets the whole masters go.
    pub(super) fn shard_masters(&mut self, dev: &D, weights: &mut Weights<D>) -> Res {
        let serve = (weights.master.values()).any(|w| D::master_as_act(w).is_some());
        for set in [ParamSet::Dense, ParamSet::Experts] {
            let total: usize = self.layout(set).iter().map(|(_, n)| n).sum();
            let ranges: BTreeMap<usize, usize> = (self.scatter.iter())
                .filter(|b| b.set == set)
                .map(|b| (b.start, b.len))
                .collect();
            let mut end = 0;
            for (&a, &n) in &ranges {
                end = if a == end { a + n } else { usize::MAX };
            }
            if serve || total == 0 || end != total {
                continue;
            }
            for bk in self.scatter.iter().filter(|b| b.set == set) {
                let (own, c) = bk.part();
                let pieces = pieces_of(self.layout(set), own, own + c);
                let part = packed(dev, &weights.master, (&pieces, c), "ZeRO")?;
                self.master_parts.insert((set, own), part);
            }
            for (key, _) in self.layout(set) {
                weights.master.remove(key);
            }
        }
        Ok(())
    }

    /// Before the report: the whole masters of every set this rank holds parts
    /// of, gathered from every rank's part.
    pub(super) fn gather_masters(
        &self,
        (dev, comm): (&D, &mut D::Comm),
        weights: &mut Weights<D>,
    ) -> Res {
        for bk in &self.scatter {
            let Some(part) = self.master_parts.get(&(bk.set, bk.own)) else {
                continue;
            };
            for (key, n) in self.layout(bk.set) {
                if !weights.master.contains_key(key) {
                    let w = dev.f32_zeros(*n).map_err(derr("final weights"))?;
                    weights.master.insert(key.clone(), w);
                }
            }
            let on = (CommKind::AllGather, (&bk.group, bk.axis.as_str()));
            let all = comm.f32_collective(dev, on, part)?;
            unpack(dev, &all, &bk.pieces, &mut weights.master, "final weights")?;
        }
        Ok(())
    }

    /// AdamW on `set`: each reduced part of the flat gradient updates the same
    /// part of the fp32 masters, with moments of that part alone; the updated
    /// part is kept, packed, for the parameter bucket's gather (its compute copy,
    /// written into the compute copies, where this rank holds parts of the
    /// masters).
    pub(super) fn optimizer(
        &mut self,
        dev: &D,
        set: ParamSet,
        weights: &mut Weights<D>,
        (step, lr): (u64, f32),
    ) -> Res {
        let (mine, rest) = std::mem::take(&mut self.shards)
            .into_iter()
            .partition(|(s, ..)| *s == set);
        self.shards = rest;
        for (_, start, grad) in mine {
            let c = D::f32_len(&grad);
            let pieces = pieces_of(self.layout(set), start, start + c);
            let (m, v) = (self.shard_adam.get_mut(&(set, start)))
                .ok_or_else(|| fail(format!("no AdamW state of the part at {start}")))?;
            let e = derr("adamw");
            if let Some(param) = self.master_parts.get_mut(&(set, start)) {
                let mut copy = dev.act_zeros(c).map_err(&e)?;
                adamw(dev, (param, &grad), (m, v), Some(&mut copy), (step, lr)).map_err(e)?;
                act_unpack(dev, &copy, &pieces, &mut weights.compute, "adamw")?;
                self.updated_copies.push((set, start, copy));
                continue;
            }
            let mut param = packed(dev, &weights.master, (&pieces, c), "adamw")?;
            // The compute copies are refreshed once the parts are gathered.
            adamw(dev, (&mut param, &grad), (m, v), None, (step, lr)).map_err(e)?;
            unpack(dev, &param, &pieces, &mut weights.master, "adamw")?;
            self.updated.push((set, start, param));
        }
        Ok(())
    }

    /// The AdamW moments of every part the reduce-scatters leave this rank
    /// ([`DevRank::first_moments`]).
    pub(super) fn part_moments(&mut self, dev: &D) -> Res {
        for bk in &self.scatter {
            let (own, c) = bk.part();
            let pieces = pieces_of(self.layout(bk.set), own, own + c);
            let state = initial_moments(dev, &self.start_moments, &pieces, c)?;
            self.shard_adam.insert((bk.set, own), state);
        }
        Ok(())
    }
}

/// ZeRO 1-2: each rank gathers the parts of the flat parameter vector it updated,
/// which its gradient reduce-scatters leave it, so a phase's parameter gathers
/// must cut the vector where its reduce-scatters do. Cut elsewhere, a gather would
/// send values this rank did not update, and a part never gathered would leave the
/// other ranks' copies behind: both train on silently.
pub(super) fn cuts_match(phase: &Phase) -> Result<(), String> {
    let (mut grads, mut params) = (BTreeSet::new(), BTreeSet::new());
    let lists = (phase.step.iter()).chain(phase.chunks.iter().flat_map(|c| &c.backward));
    for instr in lists {
        match instr {
            Instr::Collective {
                kind: CollectiveKind::ReduceScatter,
                target: Target::GradBucket { set, range },
                ..
            } => grads.insert((*set, *range)),
            Instr::Collective {
                kind: CollectiveKind::AllGather,
                target: Target::ParamBucket { set, range },
                ..
            } => params.insert((*set, *range)),
            _ => false,
        };
    }
    if grads == params {
        return Ok(());
    }
    let names = |cuts: &BTreeSet<(ParamSet, Option<(u64, u64)>)>, grad: bool| {
        let name = |&(set, range)| match grad {
            true => Target::GradBucket { set, range },
            false => Target::ParamBucket { set, range },
        };
        cuts.iter()
            .map(name)
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    Err(format!(
        "the parameter gathers ({}) do not cut the flat vector where the gradient \
         reduce-scatters do ({}): under ZeRO each rank gathers the parts it updated; \
         give every reduce-scatter's range a gather of the same range (as `meshplan \
         plan` writes them)",
        names(&params, false),
        names(&grads, true)
    ))
}
