//! The walk over a task's instructions: micro-batch loading, segments and
//! recomputation, stage boundaries, and the collectives between ops.

use super::*;
use crate::device::walk::{Coll, Forward};
use meshplan_ir::plan::LocalTensor;

impl<'a, D: Device> DevRank<'a, D> {
    /// A task over micro-batch `mb` of this data rank: its tokens, labels and
    /// positions, sequence-major, from the run's data source, or those of
    /// another chunk's task on the same micro-batch (interleaved schedules).
    pub(super) fn load_batch(&self, mb: u64) -> Result<Task<D>, RankError> {
        let live = self.tasks.iter().find(|((_, m), _)| *m == mb);
        let batch = match live {
            Some((_, t)) => Arc::clone(&t.batch),
            None => Arc::new(self.upload_batch(mb)?),
        };
        Ok(Task {
            mb,
            experts: HashMap::new(),
            acts: HashMap::new(),
            stats: HashMap::new(),
            saved: HashMap::new(),
            grads: HashMap::new(),
            partial: HashMap::new(),
            loss_stats: HashMap::new(),
            gathered: HashMap::new(),
            batch,
        })
    }

    fn upload_batch(&self, mb: u64) -> Result<Batch<D>, RankError> {
        let (s, b) = (self.sizes.seq_len / self.cp.size, self.sizes.mbs);
        let sample0 = self.sample0(mb);
        // This context rank's block of each sequence.
        let s0 = self.cp.rank * s;
        let vocab = self.graph.vocab().unwrap_or(2);
        let mut tokens = vec![0u32; s * b];
        let mut labels = vec![0u32; s * b];
        for bi in 0..b {
            let seq_index = sample0 + bi as u64;
            let seq = self
                .opts
                .data
                .sequence(
                    self.opts.seed,
                    self.meter.step_no,
                    seq_index,
                    self.sizes.seq_len,
                    self.sizes.global_batch as u64,
                    vocab,
                )
                .map_err(fail)?;
            for si in 0..s {
                tokens[si * b + bi] = seq[s0 + si];
                labels[si * b + bi] = seq[s0 + si + 1];
            }
        }
        let e = derr("batch");
        let positions =
            (self.fixed.positions.clone()).ok_or_else(|| fail("the positions were not made"))?;
        Ok(Batch {
            block: match (self.sp_block(s * b), self.fixed.block_positions.clone()) {
                (Some(r), Some(pos)) => Some((self.dev.ids_upload(&tokens[r]).map_err(&e)?, pos)),
                _ => None,
            },
            tokens: self.dev.ids_upload(&tokens).map_err(&e)?,
            labels: self.dev.ids_upload(&labels).map_err(&e)?,
            positions,
        })
    }

    /// Each row's position in its sequence, sequence-major over this context
    /// rank's block (and this tensor rank's block of them under sequence
    /// parallelism): the same for every micro-batch, so uploaded once.
    pub(super) fn upload_positions(&mut self) -> Result<(), RankError> {
        let (s, b) = (self.sizes.seq_len / self.cp.size, self.sizes.mbs);
        let s0 = self.cp.rank * s;
        let positions: Vec<u32> = (0..s * b).map(|r| (s0 + r / b.max(1)) as u32).collect();
        let e = derr("positions");
        if let Some(r) = self.sp_block(s * b) {
            let block = self.dev.ids_upload(&positions[r]).map_err(&e)?;
            self.fixed.block_positions = Some(Arc::new(block));
        }
        let all = self.dev.ids_upload(&positions).map_err(&e)?;
        self.fixed.positions = Some(Arc::new(all));
        Ok(())
    }

    /// Rows of a micro-batch on this rank: its context block of each sequence.
    pub(super) fn rows(&self) -> usize {
        self.sizes.seq_len / self.cp.size * self.sizes.mbs
    }

    /// Under sequence parallelism, this tensor rank's block of a micro-batch's
    /// `rows` (sequence-major, so a block of sequence positions).
    pub(super) fn sp_block(&self, rows: usize) -> Option<std::ops::Range<usize>> {
        let c = rows / self.tp.size;
        (self.mesh.sp && self.tp.size > 1).then(|| self.tp.rank * c..(self.tp.rank + 1) * c)
    }

    /// Runs a forward list on micro-batch `t`, the ops outside any block segment
    /// as layer `cur` of segment `seg` (a recomputed body's); a segment's layer
    /// leaves behind none of what its backward recomputes (`recomputed`, by
    /// segment).
    pub(super) fn run_forward(
        &mut self,
        instrs: &[Instr],
        t: &mut Task<D>,
        (layer, cur): (&mut u64, (Option<usize>, u64)),
        recomputed: &HashMap<usize, Held>,
    ) -> Result<(), RankError> {
        let mut w = Fwd {
            r: self,
            t,
            recomputed,
        };
        crate::device::walk::forward(&mut w, instrs, layer, cur)
    }

    /// An instruction of a backward list outside its segments: the stage
    /// boundary's receive, gather and send, and (ZeRO-2) the micro-batch's
    /// gradient scatters with the sequence-partial sums before them.
    fn backward_boundary(&mut self, instr: &Instr, t: &mut Task<D>, layer: u64) -> Res {
        match instr {
            Instr::Send {
                peer_stage, bytes, ..
            } => self.stage.send(*peer_stage, *bytes, true)?,
            Instr::Recv {
                peer_stage, bytes, ..
            } => self.stage.recv(*peer_stage, *bytes, true)?,
            Instr::Collective {
                kind: CollectiveKind::AllGather,
                group,
                axis,
                target: Target::HiddenStatesGrad,
                ..
            } => {
                let g = self.group(group)?;
                let on = (&self.dev, &mut *self.comm);
                self.stage.gather(on, (&g, axis.name()), true)?
            }
            // ZeRO-2: the micro-batch's gradients reduce-scattered, and the
            // sequence-partial sums before it.
            Instr::Collective { .. } => {
                if let Some(c) = Coll::of(instr) {
                    self.collective(c, layer, t, true)?
                }
            }
            other => {
                return Err(fail(format!(
                    "the device interpreter does not run `{}` in a backward list",
                    other.op_name()
                )))
            }
        }
        Ok(())
    }

    pub(super) fn run_backward(
        &mut self,
        instrs: &[Instr],
        t: &mut Task<D>,
        layer: &mut u64,
    ) -> Result<(), RankError> {
        for instr in instrs {
            let Instr::Segment {
                name,
                kind,
                repeat,
                body,
            } = instr
            else {
                self.backward_boundary(instr, t, *layer)?;
                continue;
            };
            let s = segment_index(self.graph, name)?;
            let held = Held::whole(self.graph, s);
            for _ in 0..*repeat {
                let l = crate::program::prev_layer(*kind, layer);
                if let (Some(out), Some(g)) =
                    (segment_output(self.graph, s), self.stage.grad_hidden.take())
                {
                    t.grads.insert((l, out), g);
                }
                for instr in body {
                    match instr {
                        Instr::Recompute { body } => {
                            let mut dummy = l;
                            self.run_forward(body, t, (&mut dummy, (Some(s), l)), &HashMap::new())?;
                            // A recomputed layer beside everything else held.
                            self.note_peak(t);
                        }
                        Instr::Compute { name, .. } => {
                            let m0 = self.meter.mark(&self.dev)?;
                            let op = find_op(self.graph, Some(s), name)?;
                            self.backward_op(op, l, t)?;
                            self.gradients_written(op, l)?;
                            let args = self.op_args(l);
                            self.meter.span(
                                &self.dev,
                                m0,
                                format!("{name} bwd"),
                                ("compute", args),
                            )?;
                        }
                        Instr::Collective { .. } => {
                            if let Some(c) = Coll::of(instr) {
                                self.collective(c, l, t, true)?
                            }
                        }
                        // The attention op passes the blocks itself (`Ring::backward`).
                        Instr::RingPass { .. } => {}
                        other => {
                            return Err(fail(format!(
                                "the device interpreter does not run `{}` in a backward body",
                                other.op_name()
                            )))
                        }
                    }
                }
                if let Some(input) = segment_input(self.graph, s) {
                    self.stage.grad_hidden = t.grads.remove(&(l, input));
                }
                // No backward after this one reads this layer's activations.
                t.let_go(l, &held);
            }
        }
        Ok(())
    }
}

/// What a layer of a segment may let go of: ops (their kept buffers,
/// statistics and routing state) and tensors (their values and gathered
/// copies). Either all the layer holds ([`Held::whole`], once its backward is
/// done) or what its backward recomputes before reading it ([`recomputed`]).
#[derive(Default)]
pub(super) struct Held {
    ops: HashSet<String>,
    tensors: HashSet<String>,
}

impl Held {
    /// Everything a layer of segment `s` holds: its ops, their outputs and the
    /// segment's input.
    fn whole(graph: &Graph, s: usize) -> Held {
        let ops = graph.segments.get(s).map_or(&[][..], |g| &g.ops[..]);
        let outputs = ops.iter().flat_map(|o| &o.outputs);
        let mut tensors: HashSet<String> = outputs.map(|&t| graph.tensor(t).name.clone()).collect();
        tensors.extend(segment_input(graph, s));
        Held {
            ops: ops.iter().map(|o| o.name.clone()).collect(),
            tensors,
        }
    }
}

impl<D: Device> Task<D> {
    /// Lets go of what `held`'s ops of layer `l` keep: their outputs (and the
    /// gathered copies of them), their kept buffers and statistics, their
    /// routing state.
    fn let_go(&mut self, l: u64, held: &Held) {
        let (ops, tensors) = (&held.ops, &held.tensors);
        self.acts
            .retain(|(k, n), _| *k != l || !tensors.contains(n));
        self.gathered
            .retain(|(k, n), _| *k != l || !tensors.contains(n));
        self.saved
            .retain(|(k, op, _), _| *k != l || !ops.contains(op));
        self.stats
            .retain(|(k, op, _), _| *k != l || !ops.contains(op));
        self.experts
            .retain(|(k, op), _| *k != l || !ops.contains(op));
    }
}

/// The segments of a chunk's `backward` list that recompute (part of) their
/// forward, by segment index. Under full recomputation the body comes first and
/// every output goes; a selective body stands after the ops whose backward reads
/// its output (the attention's, the projection's input), which stays.
pub(super) fn recomputed(
    graph: &Graph,
    backward: &[Instr],
) -> Result<HashMap<usize, Held>, RankError> {
    let mut out: HashMap<usize, Held> = HashMap::new();
    for instr in backward {
        let Instr::Segment { name, body, .. } = instr else {
            continue;
        };
        if !body.iter().any(|i| matches!(i, Instr::Recompute { .. })) {
            continue;
        }
        let s = segment_index(graph, name)?;
        let mut read_before = HashSet::new();
        for i in body {
            match i {
                Instr::Compute { name, .. } => {
                    let op = find_op(graph, Some(s), name)?;
                    let names = op.inputs.iter().chain(&op.outputs);
                    read_before.extend(names.map(|&x| graph.tensor(x).name.clone()));
                }
                Instr::Recompute { body } => {
                    let r = out.entry(s).or_default();
                    for i in body {
                        if let Instr::Compute { name, .. } = i {
                            let op = find_op(graph, Some(s), name)?;
                            r.ops.insert(op.name.clone());
                            let outputs = op.outputs.iter().map(|&o| &graph.tensor(o).name);
                            r.tensors
                                .extend(outputs.filter(|n| !read_before.contains(*n)).cloned());
                        }
                    }
                }
                _ => {}
            }
        }
    }
    Ok(out)
}

/// A rank's forward over one micro-batch.
struct Fwd<'r, 'a, D: Device> {
    r: &'r mut DevRank<'a, D>,
    t: &'r mut Task<D>,
    recomputed: &'r HashMap<usize, Held>,
}

impl<'a, D: Device> Forward<'a> for Fwd<'_, 'a, D> {
    fn graph(&self) -> &'a Graph {
        self.r.graph
    }

    fn enter(&mut self, s: usize, l: u64) -> Res {
        if let (Some(input), Some(h)) = (segment_input(self.r.graph, s), &self.r.stage.hidden) {
            self.t.acts.insert((l, input), Arc::clone(h));
        }
        Ok(())
    }

    fn leave(&mut self, s: usize, l: u64) -> Res {
        let r = &mut *self.r;
        r.zero.z3.forward_done(&r.dev, &mut r.weights, (s, l))?;
        if let Some(out) = segment_output(self.r.graph, s) {
            if let Some(v) = self.t.acts.get(&(l, out)) {
                self.r.stage.hidden = Some(Arc::clone(v));
            }
        }
        // What recomputation is for: the layer keeps its input (and what the
        // backward does not recompute) until its backward, not every output.
        if let Some(rc) = self.recomputed.get(&s) {
            self.t.let_go(l, rc);
        }
        Ok(())
    }

    fn compute(&mut self, op: &'a Op, outputs: &[LocalTensor], l: u64) -> Res {
        let r = &mut *self.r;
        let m0 = r.meter.mark(&r.dev)?;
        // The rows the plan gives the output (a replicated table under sequence
        // parallelism looks up this rank's block alone).
        let out_rows = outputs.first().map_or(0, |t| {
            let n = t.shape.len();
            t.shape[..n.saturating_sub(1)].iter().product::<u64>() as usize
        });
        r.forward_op(op, l, self.t, out_rows)?;
        let args = r.op_args(l);
        r.meter.span(&r.dev, m0, &op.name, ("compute", args))
    }

    fn collective(&mut self, c: Coll<'_>, l: u64) -> Res {
        self.r.collective(c, l, self.t, false)
    }

    fn send(&mut self, stage: u64, bytes: f64) -> Res {
        self.r.stage.send(stage, bytes, false)
    }

    fn recv(&mut self, stage: u64, bytes: f64) -> Res {
        self.r.stage.recv(stage, bytes, false)
    }

    // The attention op passes the blocks itself (`Ring::forward`).
    fn ring_pass(&mut self) -> Res {
        Ok(())
    }
}
