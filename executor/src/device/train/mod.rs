//! The device interpreter: a dense training plan's program run on a [`Device`] with
//! every tensor resident there.
//!
//! It walks a rank's program (schedule of forward and backward tasks, segments,
//! recomputation, the step list's gradient buckets and AdamW). On
//! [`super::HostDevice`] it is the fp32 reference, and it reproduces bit for bit the
//! goldens of the general interpreter it replaced. Which plans it takes is
//! [`supported`]'s answer.
//!
//! Precision on a GPU: activations, activation gradients and the weights' compute
//! copies are bf16; weight gradients accumulate in fp32 (the GEMM writes them with
//! fp32 accumulation and `beta = 1` across micro-batches), and AdamW updates fp32
//! master weights and moments, refreshing the bf16 copy in the same kernel.

use super::{derr, AttnBwd, AttnOut, DResult, Device, DeviceComm};
use crate::comm::{CommKind, Communicator, Group, RankError};
use crate::device::Buffers;
use crate::program::{
    build_groups, find_op, fixed_shape, segment_copies, segment_index, segment_input,
    segment_output,
};
use crate::shard::{held_runs, local_heads, TpPos};
use crate::train::{fail, ExecError, Key, RankReport, TrainOptions, TrainReport, NO_LAYER};
use crate::Stat;
use meshplan_ir::graph::OpKind;
use meshplan_ir::plan::{
    ChunkProgram, CollectiveKind, Instr, LossStat, ParamSet, Pass, Phase, Plan, PlanKind, Program,
    Target, Task as ScheduleTask,
};
use meshplan_ir::{
    Graph, MlpKind, NormKind, Op, SegmentKind, TensorId, TensorKind, TpRole, Workload,
};
use meshplan_kernels::cpu::{AttnDims, AttnDropout, DropoutDraw, RowDropout, Transpose};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

mod boundary;
mod comm;
mod experts;
mod ops;
mod ring;
mod run;
mod snapshot;
mod state;
mod step;
mod walk;
mod zero;
mod zero3;

use boundary::Boundaries;
use state::*;
use zero::{StartMoments, ZeroState};

/// A rank's result.
type Res<T = ()> = Result<T, RankError>;

pub use run::{train_device, train_device_rank, train_device_with};

/// Why the device interpreter does not take `plan`, or `Ok`.
/// What it takes: every training plan of the graphs meshplan builds: data, tensor
/// (with or without sequence parallelism), pipeline (any schedule), context (ring
/// attention) and expert parallelism, routed experts with or without a capacity,
/// ZeRO 0 to 3, dropout.
/// Checkpoints save and resume (any plan resumes any other's files), and
/// fine-tuning starts from a Hugging Face checkpoint.
pub fn supported(plan: &Plan) -> Result<(), String> {
    let (
        PlanKind::Train,
        Workload::Train {
            global_batch,
            seq_len,
            ..
        },
    ) = (plan.kind, &plan.workload)
    else {
        return Err("not a training plan".into());
    };
    let (global_batch, seq_len) = (*global_batch, *seq_len);
    let s = &plan.strategy;
    if meshplan_ir::framework::pads(s, global_batch) {
        // Its ranks' micro-batches would overlap and run past the step's samples.
        return Err(format!(
            "dp({}) x mbs({}) does not divide the global batch ({global_batch}): the plan \
             pads the batch, which the executor does not run (no framework does); plan with \
             an mbs and dp whose product divides {global_batch}",
            s.dp, s.mbs
        ));
    }
    for (axis, size) in plan.mesh.axes.iter().zip(&plan.mesh.shape) {
        if !["dp", "tp", "pp", "cp", "ep"].contains(&axis.as_str()) && *size > 1 {
            return Err(format!(
                "the mesh splits `{axis}` {size} ways; the device interpreter runs data, \
                 tensor, pipeline, context and expert parallelism"
            ));
        }
    }
    let graph = &plan.graph;
    crate::program::runnable(plan)?;
    crate::check_executable(graph, seq_len as usize)?;
    for phase in plan.programs.iter().flat_map(|p| &p.phases) {
        zero::cuts_match(phase)?;
    }
    if let Some(op) = graph
        .ops()
        .find(|op| matches!(op.kind, OpKind::Router { .. }))
    {
        return Err(format!(
            "`{}` is a separate router op, which the training interpreter does not \
             run: give the router's logits to the experts op, which routes its tokens \
             itself (as the `transformer:` models and Hugging Face configs do)",
            op.name
        ));
    }
    Ok(())
}

/// The segments (by index) whose ops read each weight tensor. By tensor, not by
/// name: a model whose first layers are dense and the rest MoE names the weights of
/// both blocks alike, and they are different weights; a tied table is one tensor
/// that the embedding and the head both read.
fn weight_users(graph: &Graph) -> BTreeMap<TensorId, BTreeSet<usize>> {
    let mut users: BTreeMap<TensorId, BTreeSet<usize>> = BTreeMap::new();
    for (s, seg) in graph.segments.iter().enumerate() {
        for &t in seg.ops.iter().flat_map(|op| &op.inputs) {
            if graph.tensor(t).kind == TensorKind::Weight {
                users.entry(t).or_default().insert(s);
            }
        }
    }
    users
}

/// Weights laid out one after another in a flat vector: (weight, length).
type Layout = Vec<(Key, usize)>;

/// AdamW's first and second moments of some weights.
type Moments<D> = (<D as Buffers>::F32, <D as Buffers>::F32);

/// Query, key and value of an attention op, `[b, s, h, d]` each.
type Qkv<D> = (
    <D as Buffers>::Act,
    <D as Buffers>::Act,
    <D as Buffers>::Act,
);

/// One forward-backward task's tensors on the device.
struct Task<D: Device> {
    acts: HashMap<(u64, String), Arc<D::Act>>,
    /// Kernel statistics kept for the backward (norm means and scales, attention
    /// log-sum-exps).
    stats: HashMap<(u64, String, Stat), D::F32>,
    /// Other buffers an op keeps for its backward, by (layer, op, what).
    saved: HashMap<(u64, String, Saved), Arc<D::Act>>,
    grads: HashMap<(u64, String), D::Act>,
    /// Input gradients of ops split over the tensor axis, partial until the program
    /// sums them over it.
    partial: HashMap<(u64, String), D::Act>,
    /// A vocabulary-parallel loss's statistics between its collectives.
    loss_stats: HashMap<(u64, String, LossStat), D::F32>,
    /// Sequence parallelism: activations gathered over the tensor axis for the ops
    /// that read whole sequences.
    gathered: HashMap<(u64, String), Arc<D::Act>>,
    /// The micro-batch (dropout masks are drawn by its samples).
    mb: u64,
    /// Routed experts' forward state, per (layer, op).
    experts: HashMap<(u64, String), crate::moe::Kept<D>>,
    /// Its ids, shared by the chunks of an interleaved schedule on this rank.
    batch: Arc<Batch<D>>,
}

/// A micro-batch's ids on the device.
struct Batch<D: Device> {
    tokens: D::Ids,
    labels: D::Ids,
    /// Each row's position in its sequence (rows are sequence-major).
    positions: Arc<D::Ids>,
    /// Sequence parallelism: this tensor rank's block of rows of `tokens` and
    /// `positions`, which a replicated table looks up.
    block: Option<(D::Ids, Arc<D::Ids>)>,
}

/// What every micro-batch of a rank reads alike, made on the device once so
/// that a step uploads nothing but its batch's tokens and labels.
struct Fixed<D: Device> {
    /// Each row's position ([`Batch::positions`]).
    positions: Option<Arc<D::Ids>>,
    /// Under sequence parallelism, this tensor rank's block of them.
    block_positions: Option<Arc<D::Ids>>,
    /// The padded vocabulary's columns at -inf, the rest 0 (`masked_logits`).
    vocab_mask: Option<D::Act>,
}

struct DevRank<'a, D: Device> {
    plan: &'a Plan,
    dev: D,
    graph: &'a Graph,
    rank: usize,
    comm: Box<D::Comm>,
    program: &'a Program,
    /// This rank's groups and coordinates.
    mesh: MeshPos,
    /// This rank's place on the tensor axis.
    tp: TpPos,
    /// This rank's place on the context axis (its block of every sequence).
    cp: TpPos,
    /// This rank's place in its expert group.
    ep: TpPos,
    sizes: Sizes,
    opts: TrainOptions,
    /// The weights this rank holds, their gradients and moments.
    weights: Weights<D>,
    tasks: BTreeMap<(u64, u64), Task<D>>,
    /// The pipeline stage boundaries: what a task opens with and what it sends.
    stage: Boundaries<D>,
    /// What the run measures and records.
    meter: Meter<D>,
    /// The step list and the gradient buckets' progress.
    sync: GradSync<D>,
    /// The parameter sets' flat layouts and ZeRO's parts.
    zero: ZeroState<D>,
    fixed: Fixed<D>,
}

impl<'a, D: Device> DevRank<'a, D> {
    fn new(
        dev: D,
        plan: &'a Plan,
        comm: Box<D::Comm>,
        opts: &TrainOptions,
        seq_len: u64,
        global_batch: u64,
        t0: Instant,
    ) -> Result<DevRank<'a, D>, RankError> {
        let rank = comm.rank();
        let entry = plan
            .ranks
            .get(rank)
            .ok_or_else(|| fail(format!("rank {rank} is not in the plan's rank table")))?;
        let program = plan
            .programs
            .get(entry.program as usize)
            .ok_or_else(|| fail(format!("rank {rank}: program {} missing", entry.program)))?;
        let place = |axis: &str| crate::program::mesh_place(plan, &entry.coords, axis);
        let mut r = DevRank {
            plan,
            dev,
            graph: &plan.graph,
            rank,
            comm,
            program,
            mesh: MeshPos {
                groups: build_groups(plan, rank, 0)?,
                dp_index: place("dp").rank,
                dp_size: place("dp").size,
                coords: entry.coords.clone(),
                sp: plan.strategy.sp,
            },
            tp: place("tp"),
            cp: place("cp"),
            ep: TpPos::ONE,
            sizes: Sizes {
                seq_len: seq_len as usize,
                global_batch: global_batch as usize,
                mbs: plan.strategy.mbs as usize,
            },
            opts: opts.clone(),
            weights: Weights::none(),
            tasks: BTreeMap::new(),
            stage: Boundaries::of(plan, &entry.coords, place("tp"))?,
            meter: Meter::started(t0, opts.trace),
            sync: GradSync::unplanned(),
            zero: ZeroState::unplanned(),
            fixed: Fixed {
                positions: None,
                block_positions: None,
                vocab_mask: None,
            },
        };
        r.ep = crate::program::place_in(&r.mesh.groups, "ep", rank);
        r.upload_positions()?;
        r.init_weights()?;
        r.count_uses()?;
        r.plan_step()?;
        r.zero.shard_masters(&r.dev, &mut r.weights)?;
        let zero3 = [(ParamSet::Dense, "dp"), (ParamSet::Experts, "edp")]
            .into_iter()
            .filter_map(|(set, name)| Some((set, r.mesh.groups.get(name)?.clone())))
            .filter(|(_, g)| plan.strategy.zero >= 3 && g.size() > 1)
            .collect();
        let copies = segment_copies(r.graph, r.phase()?)?;
        (r.zero.z3).shard((&r.dev, r.graph), &copies, (rank, zero3), &mut r.weights)?;
        r.first_moments()?;
        Ok(r)
    }

    fn phase(&self) -> Result<&'a meshplan_ir::plan::Phase, RankError> {
        self.program
            .phases
            .first()
            .ok_or_else(|| fail("the program has no phase"))
    }

    /// The weights a run starts from, seeded or a checkpoint's
    /// (whole: nothing is split), with zero gradients.
    fn init_weights(&mut self) -> Result<(), RankError> {
        let graph = self.graph;
        for (s, layer) in segment_copies(graph, self.phase()?)? {
            let layer = layer.unwrap_or(NO_LAYER);
            for op in &graph.segments[s].ops {
                for &w in &op.inputs {
                    let t = graph.tensor(w);
                    let key = (t.name.clone(), layer);
                    if t.kind != TensorKind::Weight || self.weights.master.contains_key(&key) {
                        continue;
                    }
                    let shape = fixed_shape(t)?;
                    let (tp, ep) = (self.tp, self.ep);
                    let mine = match (&self.opts.resume, &self.opts.weights) {
                        // Resuming: this rank's slices of the saved weights and moments.
                        (Some(ck), _) => {
                            let runs = held_runs(graph, (op, op.role, w), &shape, tp, ep);
                            let read = |kind: &str| {
                                ck.held(&crate::ckpt::tensor_name(kind, &key), &shape, &runs)
                                    .map_err(fail)
                            };
                            let (m, v) = (read("adam_m")?, read("adam_v")?);
                            if let StartMoments::Zeros = self.zero.start_moments {
                                self.zero.start_moments = StartMoments::Saved(BTreeMap::new());
                            }
                            if let StartMoments::Saved(saved) = &mut self.zero.start_moments {
                                saved.insert(key.clone(), (m, v));
                            }
                            read("w")?
                        }
                        // Fine-tuning from a checkpoint, or the seeded start.
                        (None, hf) => crate::weights::starting_slice(
                            graph,
                            (op, w),
                            layer,
                            (tp, ep),
                            self.opts.seed,
                            hf.as_deref(),
                        )?,
                    };
                    let n = mine.len();
                    let dev = &self.dev;
                    let e = derr(&t.name);
                    let master = dev.f32_upload(&mine).map_err(&e)?;
                    if D::master_as_act(&master).is_none() {
                        let mut compute = dev.act_zeros(n).map_err(&e)?;
                        dev.to_act(&master, &mut compute).map_err(&e)?;
                        self.weights.compute.insert(key.clone(), compute);
                    }
                    self.weights
                        .wgrads
                        .insert(key.clone(), dev.f32_zeros(n).map_err(&e)?);
                    self.weights.held.insert(key.clone());
                    self.weights.master.insert(key, master);
                }
            }
        }
        Ok(())
    }

    /// One optimizer step: the schedule's tasks, then the step list.
    fn step(&mut self, step: u64) -> Result<f64, RankError> {
        self.meter.step_no = step;
        self.meter.loss_part = 0.0;
        let step_mark = (Instant::now(), self.dev.mark().map_err(derr("mark"))?);
        for g in self.weights.wgrads.values_mut() {
            self.dev.f32_zero(g).map_err(derr("zero gradients"))?;
        }
        self.zero.z3.grads.clear();
        let phase = self.phase()?;
        let last_b = phase.schedule.iter().rposition(|t| t.pass == Pass::B);
        let points = self.exchange_points(phase);
        self.exchange_boundaries(phase, points.first())?;
        for (k, between) in points.iter().enumerate() {
            for ti in between.clone() {
                let task = &phase.schedule[ti];
                let m0 = self.meter.mark(&self.dev)?;
                // In the step's last backward, each gradient is final once the last
                // op writing it has run.
                self.run_task(phase, task, Some(ti) == last_b)?;
                let pass = if task.pass == Pass::F { "fwd" } else { "bwd" };
                let args = serde_json::json!({"step": step, "mb": task.mb, "chunk": task.chunk});
                let name = format!("{pass} mb{} c{}", task.mb, task.chunk);
                self.meter.span(&self.dev, m0, name, ("task", args))?;
            }
            self.exchange_boundaries(phase, points.get(k + 1))?;
        }
        for i in 0..self.sync.step_plan.len() {
            self.run_step_item(i, step)?;
        }
        // Whole masters the gathers wrote hold every rank's update: refresh their
        // compute copies (AdamW wrote every other copy).
        let gathered = self.zero.gathered_masters();
        refresh_copies(
            &self.dev,
            &self.weights.master,
            &mut self.weights.compute,
            gathered,
        )?;
        self.sync.next_bucket = 0;
        let scale = self.loss_scale();
        // Every micro-batch's token losses in one read back (one wait for the
        // device a step), each micro-batch summed apart as before.
        let losses = std::mem::take(&mut self.meter.losses);
        if !losses.is_empty() {
            let runs: Vec<_> = losses.iter().map(|l| (l, 0, D::f32_len(l))).collect();
            let e = derr("loss");
            let all = self.dev.f32_concat(&runs).map_err(&e)?;
            let all = self.dev.f32_download(&all).map_err(&e)?;
            let mut at = 0;
            for l in &losses {
                let n = D::f32_len(l);
                let mb = all[at..at + n].iter().map(|&x| x as f64).sum::<f64>();
                self.meter.loss_part += mb * scale;
                at += n;
            }
        }
        // A step ends when its work has, not when its launches have.
        self.dev.synchronize().map_err(derr("synchronize"))?;
        self.meter.resolve_spans(&self.dev, step_mark)?;
        self.check_finite(step)?;
        Ok(self.meter.loss_part)
    }

    /// The schedule's tasks between two exchange points ([`Boundaries`]): one task
    /// in the warm-up and the cool-down, a forward and the backward after it in the
    /// steady state.
    fn exchange_points(&self, phase: &Phase) -> Vec<std::ops::Range<usize>> {
        let s = &self.plan.strategy;
        let stage = crate::program::mesh_place(self.plan, &self.mesh.coords, "pp").rank;
        let tasks = &phase.schedule;
        let total = tasks.iter().filter(|t| t.pass == Pass::F).count();
        let warmup = s
            .schedule
            .warmup_forwards(s.pp as usize, s.vpp.max(1) as usize, stage, total);
        let (mut out, mut i, mut forwards) = (Vec::new(), 0, 0);
        while i < tasks.len() {
            let forward = tasks[i].pass == Pass::F;
            let pair = forward
                && forwards >= warmup
                && tasks.get(i + 1).is_some_and(|t| t.pass == Pass::B);
            forwards += usize::from(forward);
            let n = 1 + usize::from(pair);
            out.push(i..i + n);
            i += n;
        }
        out
    }

    /// An exchange point of the schedule ([`Boundaries`]): the receives that the
    /// tasks `next` open with, posted with the sends held since the last point.
    fn exchange_boundaries(&mut self, phase: &Phase, next: Option<&std::ops::Range<usize>>) -> Res {
        let mut recvs = Vec::new();
        for ti in next.cloned().unwrap_or_default() {
            if let Some(Instr::Recv {
                peer_stage, bytes, ..
            }) = task_list(phase, &phase.schedule[ti])?.first()
            {
                recvs.push((*peer_stage, *bytes));
            }
        }
        let on = (&self.dev, &mut *self.comm);
        self.stage.exchange(on, &recvs, &mut self.meter)
    }

    /// One task of the schedule: a micro-batch's forward or backward over a chunk.
    fn run_task(&mut self, phase: &Phase, task: &ScheduleTask, last_backward: bool) -> Res {
        let ch = task_chunk(phase, task)?;
        match task.pass {
            Pass::F => {
                let mut t = self.load_batch(task.mb)?;
                self.stage.hidden = None;
                let mut layer = ch.layer_start;
                let recomputed = walk::recomputed(self.graph, &ch.backward)?;
                self.run_forward(
                    &ch.forward,
                    &mut t,
                    (&mut layer, (None, NO_LAYER)),
                    &recomputed,
                )?;
                self.note_peak(&t);
                self.tasks.insert((task.chunk, task.mb), t);
            }
            Pass::B => {
                let mut t = self
                    .tasks
                    .remove(&(task.chunk, task.mb))
                    .ok_or_else(|| fail("a backward before its forward"))?;
                self.stage.grad_hidden = None;
                let mut layer = ch.layer_end;
                // Not under sequence parallelism: some gradients are partial until
                // the step list sums them over the tensor axis.
                let partial = self
                    .sync
                    .step_plan
                    .iter()
                    .any(|s| matches!(s, StepItem::SumGrads { .. }));
                if last_backward && phase.chunks.len() == 1 && !partial {
                    self.sync.remaining = Some(self.sync.uses.clone());
                }
                self.run_backward(&ch.backward, &mut t, &mut layer)?;
                self.sync.remaining = None;
            }
        }
        Ok(())
    }

    /// Item `i` of the step list, traced as a span.
    fn run_step_item(&mut self, i: usize, step: u64) -> Res {
        let m0 = self.meter.mark(&self.dev)?;
        // Every step item but the parameter gathers (of compute copies, or masters
        // that serve as them) moves fp32 gradients.
        let fp32 = !matches!(self.sync.step_plan[i], StepItem::AllGather(_));
        let before = self.comm.counts();
        let comm = |kind: &str, axis: &str, tensor: &str| {
            (format!("{kind} {axis}"), "comm", Some(tensor.to_string()))
        };
        let (name, cat, tensor) = match &self.sync.step_plan[i] {
            StepItem::SumGrads {
                group,
                axis,
                keys,
                target,
            } => {
                let (group, axis, keys) = (group.clone(), axis.clone(), keys.clone());
                let target = target.clone();
                let (on, grads) = ((&self.dev, &mut *self.comm), &mut self.weights.wgrads);
                step::sum_grads(on, (&group, &axis), (&keys, &target), grads)?;
                comm("AllReduce", &axis, &target.to_string())
            }
            &StepItem::Bucket(b) => {
                let (dev, net, grads) = (&self.dev, &mut *self.comm, &mut self.weights.wgrads);
                if self.sync.in_flight[b].is_none() {
                    self.sync.start_bucket((dev, &mut *net), b, grads)?;
                }
                self.sync.finish_bucket((dev, net), b, grads)?;
                let bk = &self.sync.buckets[b];
                comm("AllReduce", &bk.axis, &bk.target.to_string())
            }
            &StepItem::Optimizer(set) => {
                self.optimizer(set)?;
                ("optimizer".to_string(), "optimizer", None)
            }
            &StepItem::ReduceScatter(b) => {
                let on = (&self.dev, &mut *self.comm);
                self.zero
                    .reduce_scatter(on, b, &mut self.weights.wgrads, false)?;
                let bk = &self.zero.scatter[b];
                comm("ReduceScatter", &bk.axis, &bk.target.to_string())
            }
            &StepItem::AllGather(b) => {
                let on = (&self.dev, &mut *self.comm);
                self.zero.all_gather(on, b, &mut self.weights)?;
                let bk = &self.zero.gather[b];
                comm("AllGather", &bk.axis, &bk.target.to_string())
            }
        };
        if fp32 {
            self.moved_f32_since(&before);
        }
        let args = match tensor {
            Some(tensor) => serde_json::json!({"step": step, "tensor": tensor}),
            None => serde_json::json!({"step": step}),
        };
        self.meter.span(&self.dev, m0, name, (cat, args))
    }

    /// A NaN or an infinity never recovers, and training on would write it into
    /// every checkpoint: stop, naming the step and the first weight it reached
    /// (one flag read back; the weight itself only when there is one), or the
    /// loss: non-finite activations from finite weights.
    fn check_finite(&mut self, step: u64) -> Res {
        let (keys, mut ws): (Vec<&Key>, Vec<&D::F32>) = self.weights.master.iter().unzip();
        // ZeRO's parts in the same call: one flag read back a step.
        let (zero, parts): (Vec<_>, Vec<&D::F32>) = self.zero.master_parts.iter().unzip();
        ws.extend(parts);
        let (copies, parts): (Vec<_>, Vec<&D::F32>) = self.zero.z3.parts().unzip();
        ws.extend(parts);
        let bad = match self.dev.first_non_finite(&ws).map_err(derr("check"))? {
            Some(i) if i < keys.len() => {
                let (key, w) = (keys[i], ws[i]);
                let host = self.dev.f32_download(w).map_err(derr(&key.0))?;
                let x = host.into_iter().find(|v| !v.is_finite());
                Some((key.clone(), x.unwrap_or(f32::NAN)))
            }
            Some(i) if i < keys.len() + zero.len() => {
                let &(set, start) = zero[i - keys.len()];
                let at = (self.zero.layout(set), start);
                Some(zero3::non_finite_in(&self.dev, at, ws[i])?)
            }
            Some(i) => {
                let copy = copies[i - keys.len() - zero.len()];
                Some(self.zero.z3.non_finite(&self.dev, copy)?)
            }
            None => None,
        };
        if let Some(((name, layer), x)) = bad {
            return Err(fail(format!(
                "step {step}: weight `{name}`{} holds {x} after the update (loss {}): stopping; a learning rate too large, or non-finite --weights",
                crate::program::layer_label(layer),
                self.meter.loss_part
            )));
        }
        if !self.meter.loss_part.is_finite() {
            return Err(fail(format!(
                "step {step}: the loss is {}: stopping; non-finite activations from finite weights (an overflow in the model's arithmetic)",
                self.meter.loss_part
            )));
        }
        Ok(())
    }

    /// Each token's weight in the step's loss: the mean over the global batch.
    fn loss_scale(&self) -> f64 {
        1.0 / (self.sizes.global_batch * self.sizes.seq_len) as f64
    }

    fn op_args(&self, l: u64) -> serde_json::Value {
        if l == NO_LAYER {
            serde_json::json!({"step": self.meter.step_no})
        } else {
            serde_json::json!({"step": self.meter.step_no, "layer": l})
        }
    }

    /// The plan's group `name`, this rank among its members.
    fn group(&self, name: &str) -> Res<Group> {
        crate::program::group_named(&self.mesh.groups, name)
    }

    fn name_of(&self, id: meshplan_ir::TensorId) -> String {
        self.graph.tensor(id).name.clone()
    }

    fn act(
        &self,
        t: &Task<D>,
        l: u64,
        id: meshplan_ir::TensorId,
    ) -> Result<Arc<D::Act>, RankError> {
        let name = self.name_of(id);
        t.acts
            .get(&(l, name.clone()))
            .cloned()
            .ok_or_else(|| fail(format!("tensor `{name}` (layer {l}) has not been produced")))
    }

    fn wkey(&self, id: meshplan_ir::TensorId, l: u64) -> Result<Key, RankError> {
        let name = self.name_of(id);
        [(name.clone(), l), (name.clone(), NO_LAYER)]
            .into_iter()
            .find(|k| self.weights.held.contains(k))
            .ok_or_else(|| fail(format!("weight `{name}` (layer {l}) is not held")))
    }

    fn weight(&self, id: meshplan_ir::TensorId, l: u64) -> Result<&D::Act, RankError> {
        let key = self.wkey(id, l)?;
        operand::<D>((&self.weights.master, &self.weights.compute), &key)
    }

    /// The bias of a norm or linear op (its third input), if it has one.
    fn bias(&self, op: &Op, l: u64) -> Res<Option<&D::Act>> {
        op.inputs.get(2).map(|&b| self.weight(b, l)).transpose()
    }

    fn zeros(&self, n: usize) -> Result<D::Act, RankError> {
        self.dev.act_zeros(n).map_err(derr("alloc"))
    }

    fn zeros_f32(&self, n: usize) -> Result<D::F32, RankError> {
        self.dev.f32_zeros(n).map_err(derr("alloc"))
    }

    /// `grads[name] += g`; the first contribution is moved in. Contributions of
    /// other lengths are an error (the device's), never a replacement.
    fn add_grad(&self, t: &mut Task<D>, l: u64, name: String, g: D::Act) -> Result<(), RankError> {
        match t.grads.get_mut(&(l, name.clone())) {
            Some(e) => self.dev.accumulate(e, &g).map_err(derr(&name)),
            None => {
                t.grads.insert((l, name), g);
                Ok(())
            }
        }
    }

    /// `grads[name] += g` for a gradient also used elsewhere.
    fn add_grad_copy(
        &self,
        t: &mut Task<D>,
        l: u64,
        name: String,
        g: &D::Act,
    ) -> Result<(), RankError> {
        if let Some(e) = t.grads.get_mut(&(l, name.clone())) {
            return self.dev.accumulate(e, g).map_err(derr(&name));
        }
        let mut c = self.zeros(D::act_len(g))?;
        self.dev.accumulate(&mut c, g).map_err(derr(&name))?;
        t.grads.insert((l, name), c);
        Ok(())
    }

    fn report(
        &mut self,
        loss_parts: Vec<f64>,
        steps_at: (f64, Vec<f64>),
    ) -> Result<RankReport, RankError> {
        // The run's bytes, before ZeRO-3's last gather (which only the report
        // needs: each rank holds the others' parts as of their previous gather).
        let elem = self.plan.model.dtype.size_bytes();
        let counts = (self.comm.counts().without(&self.meter.saves))
            .at_element_size_but(elem, &self.meter.f32_moved);
        // What the rank holds between steps: masters and gradients in fp32 (under
        // ZeRO-3 its parts of the masters alone), the moments held (a part of them
        // under ZeRO), and the compute copies (none where the master serves).
        let masters: usize = (self.weights.master.values().map(D::f32_len))
            .chain(self.zero.master_parts.values().map(D::f32_len))
            .sum();
        let grads: usize = self.weights.wgrads.values().map(D::f32_len).sum();
        let moments: usize = self
            .weights
            .adam
            .values()
            .chain(self.zero.shard_adam.values())
            .chain(self.zero.z3.adam.values())
            .map(|(m, v)| D::f32_len(m) + D::f32_len(v))
            .sum();
        let (parts, part_copies) = self.zero.z3.part_elems();
        let copies: usize =
            self.weights.compute.values().map(D::act_len).sum::<usize>() + part_copies;
        let fp32 = masters + grads + parts + moments;
        let state_bytes = (fp32 * 4 + copies * self.dev.act_bytes()) as f64;
        let mut weights = BTreeMap::new();
        if self.opts.final_weights {
            let on = (&self.dev, &mut *self.comm);
            (self.zero.z3).gather_all(on, self.graph, &mut self.weights)?;
            let on = (&self.dev, &mut *self.comm);
            self.zero.gather_masters(on, &mut self.weights)?;
            for (key, w) in &self.weights.master {
                weights.insert(key.clone(), self.dev.f32_download(w).map_err(derr(&key.0))?);
            }
        }
        Ok(RankReport {
            rank: self.rank,
            loss_parts,
            weights,
            counts,
            steps_at,
            clock0_unix_s: crate::train::clock0_unix_s(self.meter.t0),
            state_bytes,
            peak_activation_bytes: self.meter.peak_act_bytes,
            expert_slots: self.meter.expert_slots,
            spans: std::mem::take(&mut self.meter.spans),
            device_memory_bytes: self.meter.device_peak.map(|b| b as f64),
        })
    }
}

/// The chunk a task of the schedule runs.
fn task_chunk<'p>(phase: &'p Phase, task: &ScheduleTask) -> Result<&'p ChunkProgram, RankError> {
    phase
        .chunks
        .iter()
        .find(|c| c.chunk == task.chunk)
        .ok_or_else(|| fail(format!("schedule names chunk {}", task.chunk)))
}

/// The instruction list a task runs: its chunk's forward or backward.
fn task_list<'p>(phase: &'p Phase, task: &ScheduleTask) -> Result<&'p [Instr], RankError> {
    let ch = task_chunk(phase, task)?;
    Ok(match task.pass {
        Pass::F => &ch.forward,
        Pass::B => &ch.backward,
    })
}
