//! A rank of an inference run: its weights, the passes of prefill and decode, the
//! KV cache, the last logits gathered on the device.

use super::*;
use crate::device::DeviceComm;
use crate::shard::held_runs;
use std::collections::HashSet;

impl<'a, D: Device> InferRank<'a, D> {
    /// World rank `comm.rank()` as rank `comm.rank() - base` of `plan`, on `dev`.
    pub(crate) fn new(
        dev: D,
        plan: &'a Plan,
        comm: Box<D::Comm>,
        opts: &'a InferOptions,
        base: usize,
    ) -> Result<Self, RankError> {
        let rank = comm.rank();
        let entry = rank
            .checked_sub(base)
            .and_then(|local| plan.ranks.get(local))
            .ok_or_else(|| fail(format!("rank {rank} is not in the plan's rank table")))?;
        let program = plan
            .programs
            .get(entry.program as usize)
            .ok_or_else(|| fail(format!("rank {rank}: program {} missing", entry.program)))?;
        let phase = |kind: PhaseKind| {
            program
                .phases
                .iter()
                .find(|p| p.kind == kind)
                .ok_or_else(|| fail(format!("program {} has no {kind:?} phase", program.id)))
        };
        let place = |axis: &str| mesh_place(plan, &entry.coords, axis);
        let graph = &plan.graph;
        let table = graph
            .tensors
            .iter()
            .find(|t| t.name == "embed.tokens.w")
            .ok_or_else(|| fail("the plan's model has no token embedding"))?;
        let shape = fixed_shape(table)?;
        let groups = build_groups(plan, rank - base, base)?;
        let ep_group = groups.get("ep").filter(|g| g.size() > 1).cloned();
        let ep = crate::program::place_in(&groups, "ep", rank);
        let mut st = InferRank {
            dev,
            plan,
            graph,
            rank,
            base,
            comm,
            at: StagePos {
                coords: entry.coords.clone(),
                stage: program.stage,
                last_stage: place("pp").size as u64 - 1,
                dp: place("dp").size,
                dp_index: place("dp").rank,
                groups,
            },
            tp: place("tp"),
            ep,
            ep_group,
            routed_ep: (0.0, 0.0),
            f32_priced: ByteCounts::new(),
            prefill: phase(PhaseKind::Prefill)?,
            decode: phase(PhaseKind::Decode)?,
            opts,
            weights: HashMap::new(),
            kv: HashMap::new(),
            hidden: None,
            hidden_width: shape.get(1).copied().unwrap_or(1),
            vocab: shape[0],
            tokens: graph.vocab().map_or(shape[0], |v| v as usize),
            acts: HashMap::new(),
            gathered: HashMap::new(),
            logits: None,
        };
        st.load_weights()?;
        Ok(st)
    }

    /// This rank's shard of every weight its stage uses: read from the checkpoint,
    /// or the deterministic initial values training starts from.
    pub(super) fn load_weights(&mut self) -> Result<(), RankError> {
        // A weight two ops read as the same slice (a tied embedding and head) is
        // held once.
        type Slice = (String, u64, Vec<std::ops::Range<usize>>);
        let mut held: HashMap<Slice, Arc<D::Act>> = HashMap::new();
        for (s, layer) in crate::program::segment_copies(self.graph, self.prefill)? {
            let seg = &self.graph.segments[s];
            for op in &seg.ops {
                for &w in &op.inputs {
                    let t = self.graph.tensor(w);
                    if t.kind != TensorKind::Weight {
                        continue;
                    }
                    let l = layer.unwrap_or(NO_LAYER);
                    let key = (op.name.clone(), t.name.clone(), l);
                    if self.weights.contains_key(&key) {
                        continue;
                    }
                    let shape = crate::program::fixed_shape(t)?;
                    let runs = held_runs(self.graph, (op, op.role, w), &shape, self.tp, self.ep);
                    let slice = (t.name.clone(), l, runs);
                    if let Some(same) = held.get(&slice) {
                        self.weights.insert(key, Arc::clone(same));
                        continue;
                    }
                    let local = crate::weights::starting_slice(
                        self.graph,
                        (op, w),
                        l,
                        (self.tp, self.ep),
                        self.opts.seed,
                        self.opts.weights.as_deref(),
                    )?;
                    let w = Arc::new(self.dev.act_from_host(local).map_err(derr("upload"))?);
                    held.insert(slice, Arc::clone(&w));
                    self.weights.insert(key, w);
                }
            }
        }
        Ok(())
    }

    /// A compute buffer of `n` zeros.
    pub(super) fn zeros(&self, n: usize) -> Result<D::Act, RankError> {
        self.dev.act_zeros(n).map_err(derr("allocation"))
    }

    pub(super) fn weight(&self, op: &Op, i: usize, l: u64) -> Result<&D::Act, RankError> {
        let name = &self.graph.tensor(op.inputs[i]).name;
        self.weights
            .get(&(op.name.clone(), name.clone(), l))
            .map(|w| w.as_ref())
            .ok_or_else(|| {
                fail(format!(
                    "weight `{name}` of `{}` (layer {l}) is not held by rank {}",
                    op.name, self.rank
                ))
            })
    }

    pub(super) fn act(&self, op: &Op, i: usize) -> Result<&D::Act, RankError> {
        let name = &self.graph.tensor(op.inputs[i]).name;
        self.acts.get(name).ok_or_else(|| {
            fail(format!(
                "`{}` reads `{name}` before it is produced",
                op.name
            ))
        })
    }

    pub(super) fn peer(&self, stage: u64) -> Result<usize, RankError> {
        Ok(self.base + crate::program::peer_on_stage(self.plan, &self.at.coords, stage)?)
    }

    pub(super) fn group(&self, name: &str) -> Result<Group, RankError> {
        crate::program::group_named(&self.at.groups, name)
    }

    /// Runs `body` over this replica's requests and their progress, unless the
    /// replica has none and no expert group needs its passes; then the requests'
    /// outputs where this rank records them, and what `body` returned.
    pub(crate) fn serve<T: Default>(
        &mut self,
        body: impl FnOnce(&mut Self, &[usize], &mut Progress) -> Result<T, RankError>,
    ) -> Result<(Vec<(usize, RequestOutput)>, T), RankError> {
        let mine = self.served_by(self.at.dp_index);
        if mine.is_empty() && !self.expert_lockstep() {
            return Ok((Vec::new(), T::default()));
        }
        let mut p = Progress::new(&mine, self.opts);
        let t = body(self, &mine, &mut p)?;
        let outs = if self.records() {
            mine.into_iter().zip(p.outs).collect()
        } else {
            Vec::new()
        };
        Ok((outs, t))
    }

    /// Prefill every request of this replica, then decode them together.
    pub(super) fn generate(
        &mut self,
        t0: Instant,
    ) -> Result<Vec<(usize, RequestOutput)>, RankError> {
        let record = self.records();
        let served = self.serve(|r, mine, p| {
            r.prefill_passes(mine, |r, j, _, done| {
                r.put_cache(j, done.cache);
                if let Some(l) = done.logits {
                    let now = record.then(|| t0.elapsed());
                    (p.take_tokens(&r.dev, (j, 0), &l, &r.opts.sampling, now))
                        .map_err(derr("sampling"))?;
                }
                Ok(())
            })?;
            r.decode_passes(mine, p, t0)
        })?;
        Ok(served.0)
    }

    /// Whether this rank records its replica's outputs: the last stage's first
    /// tensor rank.
    pub(crate) fn records(&self) -> bool {
        self.at.stage == self.at.last_stage && self.tp.rank == 0
    }

    /// Prefills the requests `mine` (slot `j` request `mine[j]`) one at a time,
    /// handing each to `done`. An expert group runs its passes together: a replica
    /// out of requests still serves its experts to the others' tokens.
    pub(crate) fn prefill_passes(
        &mut self,
        mine: &[usize],
        mut done: impl FnMut(
            &mut Self,
            usize,
            usize,
            Prefilled<D::Act, D::F32>,
        ) -> Result<(), RankError>,
    ) -> Result<(), RankError> {
        let passes = match &self.ep_group {
            Some(g) if self.expert_lockstep() => g
                .ranks
                .iter()
                .map(|&r| self.served_by(self.dp_of(r)).len())
                .max()
                .unwrap_or(0),
            _ => mine.len(),
        };
        for j in 0..passes {
            let Some(&i) = mine.get(j) else {
                self.idle_pass(self.prefill)?;
                continue;
            };
            let out = self.prefill_request(j, i)?;
            done(self, j, i, out)?;
        }
        Ok(())
    }

    /// Decodes the requests `mine`, whose caches are in place and whose first tokens
    /// `p` holds, until each has its tokens (a replica without requests whose expert
    /// group has some serves its experts at every step).
    pub(crate) fn decode_passes(
        &mut self,
        mine: &[usize],
        p: &mut Progress,
        t0: Instant,
    ) -> Result<(), RankError> {
        let record = self.records();
        // One rank tells: the first replica's recording rank.
        let hook = (self.opts.on_token.as_ref()).filter(|_| record && self.at.dp_index == 0);
        let tell = |tokens: usize| hook.map(|h| (h.0)(tokens as u64));
        tell(1);
        for step in 1..self.opts.max_new_tokens {
            if mine.is_empty() {
                self.idle_pass(self.decode)?;
                continue;
            }
            self.hand_tokens_back(&mut p.current)?;
            if let Some(l) = self.decode_step(mine, step, &p.current)? {
                let now = record.then(|| t0.elapsed());
                (p.take_tokens(&self.dev, (0, step), &l, &self.opts.sampling, now))
                    .map_err(derr("sampling"))?;
            }
            tell(step + 1);
        }
        Ok(())
    }

    /// What this rank hands back once its work is done.
    pub(crate) fn finish(&self, outputs: Vec<(usize, RequestOutput)>, t0: Instant) -> RankOut {
        let elapsed = t0.elapsed().as_secs_f64();
        let act = self.dev.act_bytes() as f64;
        let kv_bytes = act
            * self
                .kv
                .values()
                .map(|(a, b)| (D::act_len(a) + D::act_len(b)) as f64)
                .sum::<f64>();
        // Each buffer once, however many ops read it.
        let mut seen = HashSet::new();
        let weight_bytes = act
            * self
                .weights
                .values()
                .filter(|w| seen.insert(Arc::as_ptr(w)))
                .map(|w| D::act_len(w) as f64)
                .sum::<f64>();
        RankOut {
            outputs,
            elapsed,
            kv_bytes,
            weight_bytes,
            counts: self.counts(),
            routed_ep: self.routed_ep,
        }
    }

    /// Requests replica `dp_index` serves, in order (round robin over replicas).
    pub(crate) fn served_by(&self, dp_index: usize) -> Vec<usize> {
        let dp = self.at.dp.max(1);
        (0..self.opts.requests.len())
            .filter(|i| i % dp == dp_index)
            .collect()
    }

    pub(super) fn dp_of(&self, rank: usize) -> usize {
        let entry = rank
            .checked_sub(self.base)
            .and_then(|r| self.plan.ranks.get(r));
        entry.map_or(0, |e| mesh_place(self.plan, &e.coords, "dp").rank)
    }

    /// Whether this rank's expert group spans replicas one of which has requests:
    /// its members must then run every pass together.
    pub(crate) fn expert_lockstep(&self) -> bool {
        self.ep_group.as_ref().is_some_and(|g| {
            g.ranks
                .iter()
                .any(|&r| !self.served_by(self.dp_of(r)).is_empty())
        })
    }

    /// How the experts of prefill pass `j` (request `i`) hold tokens to capacity:
    /// groups of one prompt (or of a slice of it, where the tensor ranks route a
    /// slice each), padded counts known to every member when each member prefills
    /// a prompt of the same length in this pass.
    pub(super) fn prefill_routing(&self, j: usize, i: usize) -> Routing {
        let len = self.opts.requests[i].len();
        let dp = self.at.dp.max(1);
        let even = self.ep_group.as_ref().is_none_or(|g| {
            g.ranks.iter().all(|&r| {
                let other = self.dp_of(r) + j * dp;
                self.opts.requests.get(other).map(Vec::len) == Some(len)
            })
        });
        Routing {
            group_tokens: Some(len),
            even,
        }
    }

    /// Whether the pass's expert exchange follows the router rather than the plan's
    /// fixed sizes: expert parallelism without even capacity buffers.
    pub(super) fn routed(&self, routing: Routing) -> bool {
        let padded = |o: &Op| matches!(&o.kind, OpKind::Experts(e) if e.capacity_factor.is_some());
        let ops = || self.graph.ops();
        let even = routing.even && routing.group_tokens.is_some() && ops().any(padded);
        self.ep.size > 1 && !even && ops().any(|o| matches!(o.kind, OpKind::Experts(_)))
    }

    /// Runs `phase` on `batch`, keeping apart the expert-parallel bytes that follow
    /// the router, with the plan's figure for the pass.
    pub(super) fn run_counted(&mut self, phase: &Phase, batch: &Batch) -> Result<(), RankError> {
        let routed = self.routed(batch.routing);
        let before = if routed { self.ep_sent() } else { 0.0 };
        self.run_phase(phase, batch)?;
        if routed {
            self.routed_ep.0 += self.ep_sent() - before;
            self.routed_ep.1 += phase.bytes_sent().get(Axis::Ep);
        }
        Ok(())
    }

    /// What this rank has sent, at the plan's element size.
    fn counts(&self) -> ByteCounts {
        let elem = self.plan.model.dtype.size_bytes();
        self.comm
            .counts()
            .at_element_size_but(elem, &self.f32_priced)
    }

    /// Bytes this rank has sent over the expert axis.
    pub(super) fn ep_sent(&self) -> f64 {
        self.counts().axis_bytes_sent(Axis::Ep.name())
    }

    /// Prefills request `i` into local slot `j`: its KV cache entries on this rank,
    /// and on the last stage the full-vocabulary logits of its last position.
    pub(super) fn prefill_request(
        &mut self,
        j: usize,
        i: usize,
    ) -> Result<Prefilled<D::Act, D::F32>, RankError> {
        let prompt = &self.opts.requests[i];
        let batch = Batch {
            reqs: vec![j],
            seq: prompt.len(),
            pos0: vec![0],
            tokens: prompt.clone(),
            routing: self.prefill_routing(j, i),
        };
        self.run_counted(self.prefill, &batch)?;
        let last = self.at.stage == self.at.last_stage;
        Ok(Prefilled {
            logits: last.then(|| self.last_logits(&batch)).transpose()?,
            cache: self.take_cache(j),
        })
    }

    /// Decode step `step` of the requests `mine` (local slots `0..`), from their
    /// caches, fed the tokens `current`: on the last stage each request's logits.
    pub(super) fn decode_step(
        &mut self,
        mine: &[usize],
        step: usize,
        current: &[u32],
    ) -> Result<Option<Last<D::F32>>, RankError> {
        let batch = Batch {
            reqs: (0..mine.len()).collect(),
            seq: 1,
            pos0: mine
                .iter()
                .map(|&i| self.opts.requests[i].len() + step - 1)
                .collect(),
            tokens: current.to_vec(),
            // One token per request: capacity groups of one token would pad every
            // expert for every token, so decoding routes dropless
            // (`ExpertsShape::dispatched_rows`).
            routing: Routing::DROPLESS,
        };
        self.run_counted(self.decode, &batch)?;
        let last = self.at.stage == self.at.last_stage;
        last.then(|| self.last_logits(&batch)).transpose()
    }

    /// A pass of `phase` without tokens of this replica: only its experts run, on
    /// what the rest of the expert group sends them.
    pub(super) fn idle_pass(&mut self, phase: &Phase) -> Result<(), RankError> {
        let before = self.ep_sent();
        for ch in &phase.chunks {
            let mut layer = ch.layer_start;
            walk::forward(&mut Idle(self), &ch.forward, &mut layer, (None, NO_LAYER))?;
        }
        // The plan counts no pass for a replica without requests.
        self.routed_ep.0 += self.ep_sent() - before;
        Ok(())
    }

    /// Removes one local request's KV cache entries from this rank.
    pub(super) fn take_cache(&mut self, slot: usize) -> RequestCache<D::Act> {
        let keys: Vec<(u64, usize)> = self.kv.keys().filter(|k| k.1 == slot).copied().collect();
        keys.into_iter()
            .filter_map(|k| self.kv.remove(&k).map(|v| (k.0, v)))
            .collect()
    }

    /// Installs one local request's KV cache entries.
    pub(crate) fn put_cache(&mut self, slot: usize, cache: RequestCache<D::Act>) {
        for (layer, kv) in cache {
            self.kv.insert((layer, slot), kv);
        }
    }

    /// The last stage sends the tokens it sampled to the first, which embeds them.
    pub(super) fn hand_tokens_back(&mut self, current: &mut [u32]) -> Result<(), RankError> {
        if self.at.last_stage == 0 {
            return Ok(());
        }
        if self.at.stage == self.at.last_stage {
            let peer = self.peer(0)?;
            let buf: Vec<f32> = current.iter().map(|&t| t as f32).collect();
            self.comm.send(peer, "pp", &buf)?;
        } else if self.at.stage == 0 {
            let peer = self.peer(self.at.last_stage)?;
            let mut buf = vec![0.0f32; current.len()];
            self.comm.recv(peer, "pp", &mut buf)?;
            for (c, b) in current.iter_mut().zip(&buf) {
                *c = *b as u32;
            }
        }
        Ok(())
    }

    /// Each request's last row of logits, in fp32 on the device, gathered over the
    /// tensor ranks (the plan's AllGather, which the cost model prices in fp32).
    pub(super) fn last_logits(&mut self, batch: &Batch) -> Result<Last<D::F32>, RankError> {
        let b = batch.reqs.len();
        let rows = batch.rows();
        let logits = self
            .logits
            .as_ref()
            .ok_or_else(|| fail("the head produced no logits"))?;
        let v_local = D::act_len(logits) / rows.max(1);
        let first = (batch.seq - 1) * b;
        let err = derr("logits");
        let local = if first == 0 {
            self.dev.act_to_f32(logits).map_err(&err)?
        } else {
            let n = (rows - first) * v_local;
            let mut last = self.zeros(n)?;
            self.dev
                .act_copy((logits, first * v_local), (&mut last, 0), n)
                .map_err(&err)?;
            self.dev.act_to_f32(&last).map_err(&err)?
        };
        let parts = self.vocab / v_local.max(1);
        let buf = if v_local == self.vocab {
            local
        } else {
            let g = self.group("tp")?;
            if v_local * g.size() != self.vocab {
                return Err(fail(format!(
                    "logits of {v_local} columns per rank do not make a vocabulary of {} over {} ranks",
                    self.vocab,
                    g.size()
                )));
            }
            let on = (CommKind::AllGather, (&g, "tp"));
            let gathered = self.comm.f32_collective_owned(&self.dev, on, local)?;
            let bytes = crate::comm::bytes_of(D::f32_len(&gathered));
            (self.f32_priced).record_ring(CommKind::AllGather, "tp", g.size(), bytes);
            gathered
        };
        let picks = k::Picks {
            parts,
            rows: b,
            cols: v_local,
            limit: self.tokens,
        };
        Ok(Last { buf, picks })
    }
}

/// An expert rank's turn in a pass it holds no requests of: only its experts
/// run, on no tokens of its own, serving what the rest of its group routes to
/// them.
struct Idle<'r, 'a, D: Device>(&'r mut InferRank<'a, D>);

impl<'a, D: Device> Forward<'a> for Idle<'_, 'a, D> {
    fn graph(&self) -> &'a Graph {
        self.0.graph
    }

    fn enter(&mut self, _: usize, _: u64) -> Result<(), RankError> {
        Ok(())
    }

    fn leave(&mut self, _: usize, _: u64) -> Result<(), RankError> {
        Ok(())
    }

    fn compute(&mut self, op: &'a Op, _: &[LocalTensor], l: u64) -> Result<(), RankError> {
        if let OpKind::Experts(e) = &op.kind {
            self.0.experts(op, e, l, Routing::DROPLESS, true)?;
        }
        Ok(())
    }

    // The collectives, boundaries and ring passes are those of the ranks holding
    // requests; this one is not among them.
    fn collective(&mut self, _: Coll<'_>, _: u64) -> Result<(), RankError> {
        Ok(())
    }

    fn send(&mut self, _: u64, _: f64) -> Result<(), RankError> {
        Ok(())
    }

    fn recv(&mut self, _: u64, _: f64) -> Result<(), RankError> {
        Ok(())
    }

    fn ring_pass(&mut self) -> Result<(), RankError> {
        Ok(())
    }
}
