//! The device interpreter: a dense training plan's program run on a [`Device`] with
//! every tensor resident there.
//!
//! It walks the same program as [`crate::train`] (schedule of forward and backward
//! tasks, segments, recomputation, the step list's gradient buckets and AdamW) and
//! gives each op the same meaning, so on [`super::HostDevice`] it reproduces the
//! general interpreter's run. Which plans it takes is [`supported`]'s answer; the
//! others run on the general interpreter.
//!
//! Precision on a GPU: activations, activation gradients and the weights' compute
//! copies are bf16; weight gradients accumulate in fp32 (the GEMM writes them with
//! fp32 accumulation and `beta = 1` across micro-batches), and AdamW updates fp32
//! master weights and moments, refreshing the bf16 copy in the same kernel.

use super::{qkv_width, DResult, Device, DeviceError};
use crate::comm::{Communicator, Group, RankError};
use crate::init::{init_full, init_kind};
use crate::shard::{local_heads, local_weight, TpPos};
use crate::train::{
    build_groups, fail, fixed_shape, fixed_shape_tail, segment_copies, segment_index,
    segment_input, segment_output, ExecError, Key, RankReport, TrainOptions, TrainReport, NO_LAYER,
};
use crate::Stat;
use meshplan_ir::graph::OpKind;
use meshplan_ir::plan::{
    CollectiveKind, Instr, LossStat, ParamSet, Pass, Plan, PlanKind, Program, Target,
};
use meshplan_ir::{Graph, MlpKind, NormKind, Op, SegmentKind, TensorKind, TpRole, Workload};
use meshplan_kernels::cpu::{AttnDims, Transpose};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

/// Why the device interpreter does not take `plan`, or `Ok`.
/// What it takes: a training plan with no expert split: data, tensor (with or
/// without sequence parallelism), pipeline (any schedule) and context parallelism
/// (ring attention), ZeRO 0 to 3, no routed experts, no dropout.
/// Checkpoints save and resume as on the general interpreter (the same files: either
/// interpreter resumes the other's), and fine-tuning starts from a Hugging Face
/// checkpoint.
pub fn supported(plan: &Plan) -> Result<(), String> {
    if plan.kind != PlanKind::Train || !matches!(plan.workload, Workload::Train { .. }) {
        return Err("not a training plan".into());
    }
    for (axis, size) in plan.mesh.axes.iter().zip(&plan.mesh.shape) {
        if !["dp", "tp", "pp", "cp"].contains(&axis.as_str()) && *size > 1 {
            return Err(format!(
                "the mesh splits `{axis}` {size} ways; the device interpreter runs data, \
                 tensor, pipeline and context parallelism"
            ));
        }
    }
    let graph = &plan.graph;
    for op in graph.segments.iter().flat_map(|s| &s.ops) {
        match op.kind {
            OpKind::Experts(_) | OpKind::Router { .. } => {
                return Err(format!("`{}`: routed experts", op.name))
            }
            OpKind::Dropout if graph.constants.dropout_p > 0.0 => {
                return Err(format!("`{}`: dropout with p > 0", op.name))
            }
            _ => {}
        }
    }
    Ok(())
}

fn mesh_size(plan: &Plan, axis: &str) -> usize {
    plan.mesh
        .axes
        .iter()
        .position(|a| a == axis)
        .map(|i| plan.mesh.shape[i] as usize)
        .unwrap_or(1)
}

/// What every rank of a run shares: the workload's sizes, the clock, the step the
/// run starts at (a resumed checkpoint's) and the checkpoint writer.
struct Run<'a> {
    plan: &'a Plan,
    opts: &'a TrainOptions,
    seq_len: u64,
    global_batch: u64,
    t0: Instant,
    start: u64,
    saver: Option<crate::ckpt::Saver>,
}

impl<'a> Run<'a> {
    fn new(plan: &'a Plan, opts: &'a TrainOptions) -> Result<Run<'a>, ExecError> {
        supported(plan).map_err(|m| ExecError {
            message: format!("the device interpreter cannot run this plan: {m}"),
        })?;
        let Workload::Train {
            seq_len,
            global_batch,
            ..
        } = plan.workload
        else {
            unreachable!("checked by supported()")
        };
        let start = match &opts.resume {
            Some(ck) => crate::train::check_resume(plan, opts, ck)?,
            None => 0,
        };
        let saver = match &opts.save {
            Some(s) => Some(
                crate::ckpt::Saver::new(plan, opts, s).map_err(|message| ExecError { message })?,
            ),
            None => None,
        };
        Ok(Run {
            plan,
            opts,
            seq_len,
            global_batch,
            t0: Instant::now(),
            start,
            saver,
        })
    }

    /// The run of every rank's report: losses summed over ranks, step times of the
    /// slowest, the checkpoints written (joined even when the run failed, so that
    /// no write outlives the call).
    fn finish(self, results: Vec<Result<RankReport, RankError>>) -> Result<TrainReport, ExecError> {
        let saved = self.saver.map(crate::ckpt::Saver::finish);
        if let Some(summary) = crate::comm::failure_summary(&results) {
            return Err(ExecError { message: summary });
        }
        let saved = saved.transpose().map_err(|e| ExecError {
            message: format!("checkpoint: {e}"),
        })?;
        let ranks: Vec<RankReport> =
            results
                .into_iter()
                .collect::<Result<_, _>>()
                .map_err(|e| ExecError {
                    message: format!("{e:?}"),
                })?;
        let steps = self.opts.steps.saturating_sub(self.start) as usize;
        Ok(TrainReport {
            losses: (0..steps)
                .map(|s| ranks.iter().map(|r| r.loss_parts[s]).sum())
                .collect(),
            step_s: (0..steps)
                .map(|s| ranks.iter().map(|r| r.step_s[s]).fold(0.0, f64::max))
                .collect(),
            tokens_per_step: self.seq_len * self.global_batch,
            ranks,
            saved: saved.unwrap_or_default(),
            lr: f64::from(self.opts.lr),
        })
    }

    /// Trains one rank from the run's first step to `opts.steps`, saving where due.
    fn rank<D: Device>(
        &self,
        dev: D,
        comm: Box<dyn Communicator>,
    ) -> Result<RankReport, RankError> {
        let opts = self.opts;
        let mut r = DevRank::new(
            dev,
            self.plan,
            comm,
            opts,
            self.seq_len,
            self.global_batch,
            self.t0,
        )?;
        let mut loss_parts = Vec::new();
        let mut step_s = Vec::new();
        for step in self.start..opts.steps {
            if opts.fail_at == Some((r.rank, step)) {
                return Err(fail(format!("injected failure at step {step}")));
            }
            let t = Instant::now();
            loss_parts.push(r.step(step)?);
            step_s.push(t.elapsed().as_secs_f64());
            if let (0, Some(hook)) = (r.rank, &opts.on_step) {
                (hook.0)(step_s.len() as u64);
            }
            if let Some(sv) = self
                .saver
                .as_ref()
                .filter(|sv| sv.due(step + 1, opts.steps))
            {
                sv.deposit(step + 1, r.snapshot()?).map_err(fail)?;
            }
        }
        r.report(loss_parts, step_s)
    }
}

/// Runs `plan`'s training programs for `opts.steps` steps, each rank on the device
/// `make(rank)` gives, ranks as threads over the in-process communicator.
pub fn train_device<D: Device>(
    plan: &Plan,
    opts: &TrainOptions,
    make: &(dyn Fn(usize) -> DResult<D> + Sync),
) -> Result<TrainReport, ExecError> {
    let run = Run::new(plan, opts)?;
    let results = crate::comm::run_ranks(
        plan.ranks.len(),
        opts.timeout,
        opts.threads_per_rank,
        |comm| {
            let dev = make(comm.rank()).map_err(|e| fail(format!("device: {e}")))?;
            run.rank(dev, Box::new(comm))
        },
    );
    run.finish(results)
}

/// [`train_device`] over given communicators, one per rank in rank order (one
/// process driving several GPUs: `NcclComm::in_process`), each rank a thread.
/// Unlike the in-process communicator these need not detect a rank that fails, so
/// a failure may leave the others waiting (NCCL has no timeout).
pub fn train_device_with<D: Device>(
    plan: &Plan,
    opts: &TrainOptions,
    make: &(dyn Fn(usize) -> DResult<D> + Sync),
    comms: Vec<Box<dyn Communicator>>,
) -> Result<TrainReport, ExecError> {
    if comms.len() != plan.ranks.len() || comms.iter().enumerate().any(|(r, c)| c.rank() != r) {
        return Err(ExecError {
            message: format!(
                "{} communicators for a plan of {} ranks (one per rank, in rank order)",
                comms.len(),
                plan.ranks.len()
            ),
        });
    }
    let run = Run::new(plan, opts)?;
    let results = std::thread::scope(|s| {
        let run = &run;
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let rank = comm.rank();
                    let dev = make(rank).map_err(|e| fail(format!("device: {e}")))?;
                    run.rank(dev, comm)
                        .map_err(|e| fail(format!("rank {rank}: {e:?}")))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(fail("a rank's thread panicked")))
            })
            .collect::<Vec<_>>()
    });
    run.finish(results)
}

/// One rank of `plan` in this process, connected to the others by `comm` (one
/// process per GPU, NCCL between them): its report alone. The caller gathers the
/// ranks' losses. It may resume from a checkpoint; saving needs every rank's state
/// in one process, so `opts.save` is refused.
pub fn train_device_rank<D: Device>(
    plan: &Plan,
    opts: &TrainOptions,
    dev: D,
    comm: Box<dyn Communicator>,
) -> Result<RankReport, ExecError> {
    if opts.save.is_some() {
        return Err(ExecError {
            message: "a checkpoint is written by one process holding every rank; with one process per GPU, save from a single-process run".into(),
        });
    }
    if comm.world() != plan.ranks.len() {
        return Err(ExecError {
            message: format!(
                "the plan has {} ranks and this launch {}: start one process per rank",
                plan.ranks.len(),
                comm.world()
            ),
        });
    }
    let run = Run::new(plan, opts)?;
    let rank = comm.rank();
    run.rank(dev, comm).map_err(|e| ExecError {
        message: format!("rank {rank}: {e:?}"),
    })
}

/// No split on an axis.
fn tp1() -> TpPos {
    TpPos::ONE
}

fn derr(what: &str) -> impl Fn(DeviceError) -> RankError + '_ {
    move |e| fail(format!("{what}: {e}"))
}

/// Weights laid out one after another in a flat vector: (weight, length).
type Layout = Vec<(Key, usize)>;

/// AdamW's first and second moments of some weights.
type Moments<D> = (<D as Device>::F32, <D as Device>::F32);

/// Query, key and value of an attention op, `[b, s, h, d]` each.
type Qkv<D> = (<D as Device>::Act, <D as Device>::Act, <D as Device>::Act);

/// One forward-backward task's tensors on the device.
struct Task<D: Device> {
    acts: HashMap<(u64, String), Arc<D::Act>>,
    /// Kernel statistics kept for the backward (norm means and scales, attention
    /// log-sum-exps).
    stats: HashMap<(u64, String, Stat), D::F32>,
    grads: HashMap<(u64, String), D::Act>,
    /// Input gradients of ops split over the tensor axis, partial until the program
    /// sums them over it.
    partial: HashMap<(u64, String), D::Act>,
    /// A vocabulary-parallel loss's statistics between its collectives.
    loss_stats: HashMap<(u64, String, LossStat), D::F32>,
    /// Sequence parallelism: activations gathered over the tensor axis for the ops
    /// that read whole sequences.
    gathered: HashMap<(u64, String), Arc<D::Act>>,
    tokens: D::Ids,
    labels: D::Ids,
    /// Each row's position in its sequence (rows are sequence-major).
    positions: D::Ids,
    /// Sequence parallelism: this tensor rank's block of rows of `tokens` and
    /// `positions`, which a replicated table looks up.
    block: Option<(D::Ids, D::Ids)>,
}

/// A span on the device timeline, resolved at the end of the step.
struct Pending<M> {
    from: M,
    to: M,
    name: String,
    cat: &'static str,
    args: serde_json::Value,
}

struct DevRank<'a, D: Device> {
    plan: &'a Plan,
    dev: D,
    graph: &'a Graph,
    rank: usize,
    comm: Box<dyn Communicator>,
    program: &'a Program,
    groups: BTreeMap<String, Group>,
    dp_index: usize,
    dp_size: usize,
    /// This rank's coordinates on the mesh (a pipeline peer differs in `pp`).
    coords: Vec<u64>,
    /// This rank's place on the tensor axis.
    tp: TpPos,
    /// Sequence parallelism over the tensor axis.
    sp: bool,
    /// This rank's place on the context axis (its block of every sequence).
    cp: TpPos,
    /// ZeRO-3 over more than one data rank: segments gather their weights.
    zero3: bool,
    seq_len: usize,
    global_batch: usize,
    mbs: usize,
    opts: TrainOptions,
    /// fp32 master weights, their compute copies, gradients and AdamW moments.
    master: BTreeMap<Key, D::F32>,
    compute: BTreeMap<Key, D::Act>,
    wgrads: BTreeMap<Key, D::F32>,
    adam: BTreeMap<Key, (D::F32, D::F32)>,
    tasks: BTreeMap<(u64, u64), Task<D>>,
    hidden: Option<Arc<D::Act>>,
    grad_hidden: Option<D::Act>,
    loss_part: f64,
    step_no: u64,
    peak_act_bytes: f64,
    t0: Instant,
    pending: Vec<Pending<D::Mark>>,
    spans: Vec<crate::trace::Span>,
    /// The step list, checked once: gradient buckets and the optimizer.
    step_plan: Vec<StepItem>,
    buckets: Vec<Bucket>,
    /// Reductions started early, per bucket.
    in_flight: Vec<Option<D::Reduction>>,
    /// The next bucket to start (buckets start in the step list's order on every
    /// rank, as the communicator matches them).
    next_bucket: usize,
    /// Backward ops writing each weight's gradient in one backward task, and during
    /// the step's last backward task how many are still to run.
    uses: BTreeMap<Key, usize>,
    remaining: Option<BTreeMap<Key, usize>>,
    /// Weights in the order the backward's last write to their gradient comes.
    final_order: Vec<Key>,
    /// Per-row losses of this step's micro-batches, in order.
    losses: Vec<D::F32>,
    /// Most device memory in use seen after a forward task.
    device_peak: Option<u64>,
    /// The flat vector's layout: weights and their lengths, in order.
    layout: Vec<(Key, usize)>,
    /// ZeRO's gradient and parameter buckets.
    scatter: Vec<Bucket>,
    gather: Vec<Bucket>,
    /// ZeRO: this rank's reduced gradient parts this step (flat start, values), and
    /// the AdamW moments of each part it updates.
    shards: Vec<(usize, D::F32)>,
    shard_adam: BTreeMap<usize, (D::F32, D::F32)>,
    /// ZeRO-3: each segment copy's reduce-scattered gradient part this step, and
    /// the AdamW moments of the part of its flat vector this rank updates.
    z3_grads: BTreeMap<(usize, u64), D::F32>,
    z3_adam: BTreeMap<(usize, u64), (D::F32, D::F32)>,
    /// Resuming: each weight's saved AdamW moments, whole, until the optimizer's
    /// first step takes its parts of them.
    resume_moments: BTreeMap<Key, (Vec<f32>, Vec<f32>)>,
}

/// What the step list does, in order.
enum StepItem {
    /// All-reduce of bucket `i` over the data ranks.
    Bucket(usize),
    /// ZeRO: reduce-scatter of gradient bucket `i`, each rank keeping its part.
    ReduceScatter(usize),
    Optimizer,
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
        tensor: &'static str,
    },
}

/// A gradient bucket: a range of the flat gradient (weights in key order).
struct Bucket {
    group: Group,
    axis: String,
    tensor: String,
    /// Where it starts in the flat vector, and its length.
    start: usize,
    len: usize,
    /// (weight, offset in its gradient, offset in the bucket, values).
    pieces: Vec<(Key, usize, usize, usize)>,
}

impl<'a, D: Device> DevRank<'a, D> {
    fn new(
        dev: D,
        plan: &'a Plan,
        comm: Box<dyn Communicator>,
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
        let dp_axis = plan.mesh.axes.iter().position(|a| a == "dp");
        let tp_axis = plan.mesh.axes.iter().position(|a| a == "tp");
        let mut r = DevRank {
            plan,
            dev,
            graph: &plan.graph,
            rank,
            comm,
            program,
            groups: build_groups(plan, rank)?,
            dp_index: dp_axis.map(|i| entry.coords[i] as usize).unwrap_or(0),
            dp_size: mesh_size(plan, "dp"),
            tp: TpPos {
                rank: tp_axis.map(|i| entry.coords[i] as usize).unwrap_or(0),
                size: mesh_size(plan, "tp"),
            },
            sp: plan.strategy.sp,
            cp: TpPos {
                rank: plan
                    .mesh
                    .axes
                    .iter()
                    .position(|a| a == "cp")
                    .map_or(0, |i| entry.coords[i] as usize),
                size: mesh_size(plan, "cp"),
            },
            zero3: false,
            coords: entry.coords.clone(),
            seq_len: seq_len as usize,
            global_batch: global_batch as usize,
            mbs: plan.strategy.mbs as usize,
            opts: opts.clone(),
            master: BTreeMap::new(),
            compute: BTreeMap::new(),
            wgrads: BTreeMap::new(),
            adam: BTreeMap::new(),
            tasks: BTreeMap::new(),
            hidden: None,
            grad_hidden: None,
            loss_part: 0.0,
            step_no: 0,
            peak_act_bytes: 0.0,
            t0,
            pending: Vec::new(),
            spans: Vec::new(),
            step_plan: Vec::new(),
            buckets: Vec::new(),
            in_flight: Vec::new(),
            next_bucket: 0,
            uses: BTreeMap::new(),
            remaining: None,
            final_order: Vec::new(),
            losses: Vec::new(),
            device_peak: None,
            layout: Vec::new(),
            scatter: Vec::new(),
            gather: Vec::new(),
            shards: Vec::new(),
            shard_adam: BTreeMap::new(),
            z3_grads: BTreeMap::new(),
            z3_adam: BTreeMap::new(),
            resume_moments: BTreeMap::new(),
        };
        // ZeRO-3 shards over the data group (data and context ranks together).
        r.zero3 = plan.strategy.zero >= 3 && r.groups.get("dp").is_some_and(|g| g.size() > 1);
        r.init_weights()?;
        r.count_uses()?;
        r.plan_step()?;
        Ok(r)
    }

    fn phase(&self) -> Result<&'a meshplan_ir::plan::Phase, RankError> {
        self.program
            .phases
            .first()
            .ok_or_else(|| fail("the program has no phase"))
    }

    /// The weights the general interpreter starts from, seeded or a checkpoint's
    /// (whole: nothing is split), with zero gradients.
    fn init_weights(&mut self) -> Result<(), RankError> {
        let graph = self.graph;
        for (s, layer) in segment_copies(graph, self.phase()?)? {
            let layer = layer.unwrap_or(NO_LAYER);
            for op in &graph.segments[s].ops {
                for &w in &op.inputs {
                    let t = graph.tensor(w);
                    let key = (t.name.clone(), layer);
                    if t.kind != TensorKind::Weight || self.master.contains_key(&key) {
                        continue;
                    }
                    let shape = fixed_shape(t)?;
                    let n: usize = shape.iter().product();
                    let tp = self.tp;
                    let local =
                        |full: &[f32]| local_weight(graph, op, op.role, w, full, &shape, tp, tp1());
                    let mine = match (&self.opts.resume, &self.opts.weights) {
                        // Resuming: this rank's slices of the saved weights and moments.
                        (Some(ck), _) => {
                            let key = (t.name.clone(), layer);
                            let read = |kind: &str| {
                                ck.values(&crate::ckpt::tensor_name(kind, &key), &shape)
                                    .map(|full| local(&full))
                                    .map_err(fail)
                            };
                            let (m, v) = (read("adam_m")?, read("adam_v")?);
                            self.resume_moments.insert(key.clone(), (m, v));
                            read("w")?
                        }
                        // Fine-tuning: this rank's slice straight from the checkpoint.
                        (None, Some(hf)) => {
                            let l = (layer != NO_LAYER).then_some(layer);
                            let spec =
                                crate::weights::shard_spec(graph, op, op.role, w, &shape, tp);
                            hf.local(graph, op, w, l, &spec)
                                .map_err(|e| fail(e.message))?
                        }
                        (None, None) => local(&init_full(
                            self.opts.seed,
                            &t.name,
                            layer,
                            n,
                            init_kind(op, w, &shape),
                        )),
                    };
                    let n = mine.len();
                    let dev = &self.dev;
                    let e = derr(&t.name);
                    let master = dev.f32_upload(&mine).map_err(&e)?;
                    let mut compute = dev.act_zeros(n).map_err(&e)?;
                    dev.to_act(&master, &mut compute).map_err(&e)?;
                    self.wgrads
                        .insert(key.clone(), dev.f32_zeros(n).map_err(&e)?);
                    self.compute.insert(key.clone(), compute);
                    self.master.insert(key, master);
                }
            }
        }
        Ok(())
    }

    /// One optimizer step: the schedule's tasks, then the step list.
    fn step(&mut self, step: u64) -> Result<f64, RankError> {
        self.step_no = step;
        self.loss_part = 0.0;
        let step_mark = (Instant::now(), self.dev.mark().map_err(derr("mark"))?);
        for g in self.wgrads.values_mut() {
            self.dev.f32_zero(g).map_err(derr("zero gradients"))?;
        }
        self.z3_grads.clear();
        let phase = self.phase()?;
        let last_b = phase.schedule.iter().rposition(|t| t.pass == Pass::B);
        for (ti, task) in phase.schedule.iter().enumerate() {
            let ch = phase
                .chunks
                .iter()
                .find(|c| c.chunk == task.chunk)
                .ok_or_else(|| fail(format!("schedule names chunk {}", task.chunk)))?;
            let m0 = self.mark()?;
            match task.pass {
                Pass::F => {
                    let mut t = self.load_batch(task.mb)?;
                    self.hidden = None;
                    let mut layer = ch.layer_start;
                    self.run_forward(&ch.forward, &mut t, &mut layer, NO_LAYER)?;
                    self.tasks.insert((task.chunk, task.mb), t);
                    let held: f64 = self.tasks.values().map(|t| self.held_bytes(t)).sum();
                    self.peak_act_bytes = self.peak_act_bytes.max(held);
                    if let Some(used) = self.dev.memory_in_use() {
                        self.device_peak = Some(self.device_peak.unwrap_or(0).max(used));
                    }
                }
                Pass::B => {
                    let mut t = self
                        .tasks
                        .remove(&(task.chunk, task.mb))
                        .ok_or_else(|| fail("a backward before its forward"))?;
                    self.grad_hidden = None;
                    let mut layer = ch.layer_end;
                    // In the step's last backward, each gradient is final once the
                    // last op writing it has run.
                    // (Not under sequence parallelism: some gradients are partial
                    // until the step list sums them over the tensor axis.)
                    let partial = self
                        .step_plan
                        .iter()
                        .any(|s| matches!(s, StepItem::SumGrads { .. }));
                    if Some(ti) == last_b && phase.chunks.len() == 1 && !partial {
                        self.remaining = Some(self.uses.clone());
                    }
                    self.run_backward(&ch.backward, &mut t, &mut layer)?;
                    self.remaining = None;
                }
            }
            let pass = if task.pass == Pass::F { "fwd" } else { "bwd" };
            self.span(
                m0,
                format!("{pass} mb{} c{}", task.mb, task.chunk),
                "task",
                serde_json::json!({"step": step, "mb": task.mb, "chunk": task.chunk}),
            )?;
        }
        for i in 0..self.step_plan.len() {
            let m0 = self.mark()?;
            if let StepItem::SumGrads { axis, tensor, .. } = &self.step_plan[i] {
                let args = serde_json::json!({"step": step, "tensor": tensor});
                let name = format!("AllReduce {axis}");
                self.sum_grads(i)?;
                self.span(m0, name, "comm", args)?;
                continue;
            }
            match self.step_plan[i] {
                StepItem::Bucket(b) => {
                    if self.in_flight[b].is_none() {
                        self.start_bucket(b)?;
                    }
                    self.finish_bucket(b)?;
                    let bk = &self.buckets[b];
                    let args = serde_json::json!({"step": step, "tensor": bk.tensor});
                    let name = format!("AllReduce {}", bk.axis);
                    self.span(m0, name, "comm", args)?;
                }
                StepItem::Optimizer => {
                    self.optimizer()?;
                    self.span(
                        m0,
                        "optimizer",
                        "optimizer",
                        serde_json::json!({"step": step}),
                    )?;
                }
                StepItem::ReduceScatter(b) => {
                    self.reduce_scatter(b)?;
                    let bk = &self.scatter[b];
                    let args = serde_json::json!({"step": step, "tensor": bk.tensor});
                    let name = format!("ReduceScatter {}", bk.axis);
                    self.span(m0, name, "comm", args)?;
                }
                StepItem::SumGrads { .. } => {}
                StepItem::AllGather(b) => {
                    self.all_gather(b)?;
                    let bk = &self.gather[b];
                    let args = serde_json::json!({"step": step, "tensor": bk.tensor});
                    let name = format!("AllGather {}", bk.axis);
                    self.span(m0, name, "comm", args)?;
                }
            }
        }
        if !self.gather.is_empty() {
            // The gathered masters hold every rank's update: refresh the compute copies.
            for (key, w) in &self.master {
                let c = self
                    .compute
                    .get_mut(key)
                    .ok_or_else(|| fail("compute copy missing"))?;
                self.dev.to_act(w, c).map_err(derr(&key.0))?;
            }
        }
        self.next_bucket = 0;
        let scale = self.loss_scale();
        for loss in std::mem::take(&mut self.losses) {
            let loss = self.dev.f32_download(&loss).map_err(derr("loss"))?;
            self.loss_part += loss.iter().map(|&x| x as f64).sum::<f64>() * scale;
        }
        // A step ends when its work has, not when its launches have.
        self.dev.synchronize().map_err(derr("synchronize"))?;
        self.resolve_spans(step_mark)?;
        // The loss is the one number that leaves the device each step: a NaN or an
        // infinity in it (from non-finite weights, or an update that overflowed)
        // stops the run rather than writing it into every later checkpoint.
        if !self.loss_part.is_finite() {
            return Err(fail(format!(
                "step {step}: the loss is {}: stopping; non-finite weights (a learning rate too large, or non-finite --weights) or an overflow in the model's arithmetic",
                self.loss_part
            )));
        }
        Ok(self.loss_part)
    }

    fn mark(&self) -> Result<Option<D::Mark>, RankError> {
        if self.opts.trace {
            Ok(Some(self.dev.mark().map_err(derr("mark"))?))
        } else {
            Ok(None)
        }
    }

    fn span(
        &mut self,
        from: Option<D::Mark>,
        name: impl Into<String>,
        cat: &'static str,
        args: serde_json::Value,
    ) -> Result<(), RankError> {
        if let Some(from) = from {
            let to = self.dev.mark().map_err(derr("mark"))?;
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
    fn resolve_spans(&mut self, (host0, mark0): (Instant, D::Mark)) -> Result<(), RankError> {
        let base = host0.duration_since(self.t0).as_secs_f64();
        for p in std::mem::take(&mut self.pending) {
            let e = derr("timing");
            let start = self.dev.seconds_between(&mark0, &p.from).map_err(&e)?;
            let dur = self.dev.seconds_between(&p.from, &p.to).map_err(&e)?;
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

    fn held_bytes(&self, t: &Task<D>) -> f64 {
        let act: usize = t.acts.values().map(|a| D::act_len(a)).sum();
        let stats: usize = t.stats.values().map(D::f32_len).sum();
        (act * self.dev.act_bytes() + stats * 4) as f64
    }

    /// Tokens, labels and positions of micro-batch `mb` of this data rank,
    /// sequence-major, from the run's data source.
    fn load_batch(&self, mb: u64) -> Result<Task<D>, RankError> {
        let per_dp = self.global_batch / self.dp_size.max(1);
        let (s, b) = (self.seq_len / self.cp.size, self.mbs);
        // This context rank's block of each sequence.
        let s0 = self.cp.rank * s;
        let vocab = self.graph.vocab().unwrap_or(2);
        let mut tokens = vec![0u32; s * b];
        let mut labels = vec![0u32; s * b];
        for bi in 0..b {
            let seq_index = (self.dp_index * per_dp + mb as usize * b + bi) as u64;
            let seq = self
                .opts
                .data
                .sequence(
                    self.opts.seed,
                    self.step_no,
                    seq_index,
                    self.seq_len,
                    self.global_batch as u64,
                    vocab,
                )
                .map_err(fail)?;
            for si in 0..s {
                tokens[si * b + bi] = seq[s0 + si];
                labels[si * b + bi] = seq[s0 + si + 1];
            }
        }
        let positions: Vec<u32> = (0..s * b).map(|r| (s0 + r / b.max(1)) as u32).collect();
        let e = derr("batch");
        Ok(Task {
            acts: HashMap::new(),
            stats: HashMap::new(),
            grads: HashMap::new(),
            partial: HashMap::new(),
            loss_stats: HashMap::new(),
            gathered: HashMap::new(),
            block: match self.sp_block(s * b) {
                Some(r) => Some((
                    self.dev.ids_upload(&tokens[r.clone()]).map_err(&e)?,
                    self.dev.ids_upload(&positions[r]).map_err(&e)?,
                )),
                None => None,
            },
            tokens: self.dev.ids_upload(&tokens).map_err(&e)?,
            labels: self.dev.ids_upload(&labels).map_err(&e)?,
            positions: self.dev.ids_upload(&positions).map_err(&e)?,
        })
    }

    /// Rows of a micro-batch on this rank: its context block of each sequence.
    fn rows(&self) -> usize {
        self.seq_len / self.cp.size * self.mbs
    }

    /// Under sequence parallelism, this tensor rank's block of a micro-batch's
    /// `rows` (sequence-major, so a block of sequence positions).
    fn sp_block(&self, rows: usize) -> Option<std::ops::Range<usize>> {
        let c = rows / self.tp.size;
        (self.sp && self.tp.size > 1).then(|| self.tp.rank * c..(self.tp.rank + 1) * c)
    }

    fn run_forward(
        &mut self,
        instrs: &[Instr],
        t: &mut Task<D>,
        layer: &mut u64,
        cur: u64,
    ) -> Result<(), RankError> {
        for instr in instrs {
            match instr {
                Instr::Segment {
                    name,
                    kind,
                    repeat,
                    body,
                } => {
                    let s = segment_index(self.graph, name)?;
                    for _ in 0..*repeat {
                        let l = if *kind == SegmentKind::Block {
                            *layer += 1;
                            *layer - 1
                        } else {
                            NO_LAYER
                        };
                        if let (Some(input), Some(h)) = (segment_input(self.graph, s), &self.hidden)
                        {
                            t.acts.insert((l, input), Arc::clone(h));
                        }
                        self.run_forward(body, t, layer, l)?;
                        if let Some(out) = segment_output(self.graph, s) {
                            if let Some(v) = t.acts.get(&(l, out)) {
                                self.hidden = Some(Arc::clone(v));
                            }
                        }
                    }
                }
                Instr::Recompute { body } => self.run_forward(body, t, layer, cur)?,
                Instr::Compute { name, outputs, .. } => {
                    let m0 = self.mark()?;
                    let op = self.find_op(name)?;
                    // The rows the plan gives the output (a replicated table under
                    // sequence parallelism looks up this rank's block alone).
                    let out_rows = outputs.first().map_or(0, |t| {
                        let n = t.shape.len();
                        t.shape[..n.saturating_sub(1)].iter().product::<u64>() as usize
                    });
                    self.forward_op(op, cur, t, out_rows)?;
                    self.span(m0, name.clone(), "compute", self.op_args(cur))?;
                }
                Instr::Collective {
                    kind,
                    group,
                    axis,
                    target,
                    ..
                } => self.collective(*kind, group, axis.name(), target, cur, t, false)?,
                Instr::Send {
                    peer_stage, bytes, ..
                } => self.send_boundary(*peer_stage, *bytes, false)?,
                // The attention op passes the blocks itself (`ring_forward`).
                Instr::RingPass { .. } => {}
                Instr::Recv {
                    peer_stage, bytes, ..
                } => self.recv_boundary(*peer_stage, *bytes, false)?,
                other => {
                    return Err(fail(format!(
                        "the device interpreter does not run {other:?} in a forward list"
                    )))
                }
            }
        }
        Ok(())
    }

    fn run_backward(
        &mut self,
        instrs: &[Instr],
        t: &mut Task<D>,
        layer: &mut u64,
    ) -> Result<(), RankError> {
        for instr in instrs {
            let (name, kind, repeat, body) = match instr {
                Instr::Segment {
                    name,
                    kind,
                    repeat,
                    body,
                } => (name, kind, repeat, body),
                Instr::Send {
                    peer_stage, bytes, ..
                } => {
                    self.send_boundary(*peer_stage, *bytes, true)?;
                    continue;
                }
                Instr::Recv {
                    peer_stage, bytes, ..
                } => {
                    self.recv_boundary(*peer_stage, *bytes, true)?;
                    continue;
                }
                Instr::Collective {
                    kind: CollectiveKind::AllGather,
                    group,
                    axis,
                    target: Target::HiddenStatesGrad,
                    ..
                } => {
                    self.gather_boundary(group, axis.name(), true)?;
                    continue;
                }
                other => {
                    return Err(fail(format!(
                        "the device interpreter does not run {other:?} in a backward list"
                    )))
                }
            };
            let s = segment_index(self.graph, name)?;
            for _ in 0..*repeat {
                let l = if *kind == SegmentKind::Block {
                    *layer -= 1;
                    *layer
                } else {
                    NO_LAYER
                };
                if let (Some(out), Some(g)) =
                    (segment_output(self.graph, s), self.grad_hidden.take())
                {
                    t.grads.insert((l, out), g);
                }
                for instr in body {
                    match instr {
                        Instr::Recompute { body } => {
                            let mut dummy = l;
                            self.run_forward(body, t, &mut dummy, l)?;
                        }
                        Instr::Compute { name, .. } => {
                            let m0 = self.mark()?;
                            let op = self.find_op(name)?;
                            self.backward_op(op, l, t)?;
                            self.gradients_written(op, l)?;
                            self.span(m0, format!("{name} bwd"), "compute", self.op_args(l))?;
                        }
                        Instr::Collective {
                            kind,
                            group,
                            axis,
                            target,
                            ..
                        } => self.collective(*kind, group, axis.name(), target, l, t, true)?,
                        // The attention op passes the blocks itself (`ring_backward`).
                        Instr::RingPass { .. } => {}
                        other => {
                            return Err(fail(format!(
                                "the device interpreter does not run {other:?} in a backward body"
                            )))
                        }
                    }
                }
                if let Some(input) = segment_input(self.graph, s) {
                    self.grad_hidden = t.grads.remove(&(l, input));
                }
            }
        }
        Ok(())
    }

    /// Each token's weight in the step's loss: the mean over the global batch.
    fn loss_scale(&self) -> f64 {
        1.0 / (self.global_batch * self.seq_len) as f64
    }

    fn op_args(&self, l: u64) -> serde_json::Value {
        if l == NO_LAYER {
            serde_json::json!({"step": self.step_no})
        } else {
            serde_json::json!({"step": self.step_no, "layer": l})
        }
    }

    fn find_op(&self, name: &str) -> Result<&'a Op, RankError> {
        self.graph
            .segments
            .iter()
            .flat_map(|s| &s.ops)
            .find(|o| o.name == name)
            .ok_or_else(|| fail(format!("op `{name}` is not in the plan's graph")))
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
            .find(|k| self.master.contains_key(k))
            .ok_or_else(|| fail(format!("weight `{name}` (layer {l}) is not held")))
    }

    fn weight(&self, id: meshplan_ir::TensorId, l: u64) -> Result<&D::Act, RankError> {
        let key = self.wkey(id, l)?;
        self.compute
            .get(&key)
            .ok_or_else(|| fail(format!("weight `{}` has no compute copy", key.0)))
    }

    fn zeros(&self, n: usize) -> Result<D::Act, RankError> {
        self.dev.act_zeros(n).map_err(derr("alloc"))
    }

    fn zeros_f32(&self, n: usize) -> Result<D::F32, RankError> {
        self.dev.f32_zeros(n).map_err(derr("alloc"))
    }

    /// `grads[name] += g`; the first contribution is moved in.
    fn add_grad(&self, t: &mut Task<D>, l: u64, name: String, g: D::Act) -> Result<(), RankError> {
        match t.grads.get_mut(&(l, name.clone())) {
            Some(e) if D::act_len(e) == D::act_len(&g) => {
                self.dev.accumulate(e, &g).map_err(derr(&name))
            }
            _ => {
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
            if D::act_len(e) == D::act_len(g) {
                return self.dev.accumulate(e, g).map_err(derr(&name));
            }
        }
        let mut c = self.zeros(D::act_len(g))?;
        self.dev.accumulate(&mut c, g).map_err(derr(&name))?;
        t.grads.insert((l, name), c);
        Ok(())
    }

    /// The context group, this rank's index in it, and its ring neighbours.
    fn ring(&self) -> Result<(Group, usize, usize, usize), RankError> {
        let g = self
            .groups
            .get("cp")
            .cloned()
            .ok_or_else(|| fail("no cp group"))?;
        let (n, me) = (g.size(), self.index_in(&g)?);
        let (next, prev) = (g.ranks[(me + 1) % n], g.ranks[(me + n - 1) % n]);
        Ok((g, me, next, prev))
    }

    /// `[k | v]`, the block a ring passes on.
    fn kv_block(&self, k: &D::Act, v: &D::Act) -> Result<D::Act, RankError> {
        let (kl, vl) = (D::act_len(k), D::act_len(v));
        let e = derr("ring block");
        let mut block = self.zeros(kl + vl)?;
        self.dev.act_copy(k, 0, &mut block, 0, kl).map_err(&e)?;
        self.dev.act_copy(v, 0, &mut block, kl, vl).map_err(&e)?;
        Ok(block)
    }

    /// `block[at..at + n]` as a buffer of its own.
    fn act_part(&self, block: &D::Act, at: usize, n: usize) -> Result<D::Act, RankError> {
        let mut out = self.zeros(n)?;
        self.dev
            .act_copy(block, at, &mut out, 0, n)
            .map_err(derr("ring block"))?;
        Ok(out)
    }

    /// Ring attention's forward: this rank's queries against every context rank's
    /// key/value block in turn (each passed on to the next rank), the partial
    /// outputs merged by their log-sum-exps into `o` (zero on entry) and `lse`.
    fn ring_forward(
        &mut self,
        dims: &AttnDims,
        (q, k, v): (&D::Act, &D::Act, &D::Act),
        causal: bool,
        scale: f32,
        o: &mut D::Act,
        lse: &mut D::F32,
    ) -> Result<(), RankError> {
        let (g, me, next, prev) = self.ring()?;
        let n = g.size();
        let s_l = self.seq_len / n;
        let e = derr("ring attention");
        *lse = self
            .dev
            .f32_upload(&vec![f32::NEG_INFINITY; D::f32_len(lse)])
            .map_err(&e)?;
        let kl = D::act_len(k);
        let mut block = self.kv_block(k, v)?;
        let len = D::act_len(&block);
        for t in 0..n {
            let owner = (me + n - t) % n;
            let (kb, vb) = (
                self.act_part(&block, 0, kl)?,
                self.act_part(&block, kl, len - kl)?,
            );
            let mut ob = self.zeros(D::act_len(o))?;
            let mut lb = self.zeros_f32(D::f32_len(lse))?;
            let pos = (me * s_l, owner * s_l);
            self.dev
                .attention_fwd(dims, q, &kb, &vb, pos, causal, scale, &mut ob, &mut lb)
                .map_err(&e)?;
            self.dev
                .attention_merge(dims, o, lse, &ob, &lb)
                .map_err(&e)?;
            if t + 1 < n {
                self.dev
                    .send_act(self.comm.as_mut(), next, "cp", &block, (0, len))?;
                self.dev
                    .recv_act(self.comm.as_mut(), prev, "cp", &mut block)?;
            }
        }
        Ok(())
    }

    /// Ring attention's backward: the key/value blocks go round again; the gradient
    /// computed for every other rank's block goes straight to its owner, which adds
    /// them in rank order.
    fn ring_backward(
        &mut self,
        dims: &AttnDims,
        (q, k, v): (&D::Act, &D::Act, &D::Act),
        (o, lse, d_o): (&D::Act, &D::F32, &D::Act),
        causal: bool,
        scale: f32,
        (dq, dk, dv): (&mut D::Act, &mut D::Act, &mut D::Act),
    ) -> Result<(), RankError> {
        let (g, me, next, prev) = self.ring()?;
        let n = g.size();
        let s_l = self.seq_len / n;
        let e = derr("ring attention");
        let kl = D::act_len(k);
        let mut block = self.kv_block(k, v)?;
        let len = D::act_len(&block);
        let mut grads: Vec<Option<D::Act>> = (0..n).map(|_| None).collect();
        for t in 0..n {
            let owner = (me + n - t) % n;
            let (kb, vb) = (
                self.act_part(&block, 0, kl)?,
                self.act_part(&block, kl, len - kl)?,
            );
            let (mut gk, mut gv) = (self.zeros(kl)?, self.zeros(len - kl)?);
            let pos = (me * s_l, owner * s_l);
            self.dev
                .attention_bwd(
                    dims, q, &kb, &vb, o, lse, d_o, pos, causal, scale, dq, &mut gk, &mut gv,
                )
                .map_err(&e)?;
            grads[owner] = Some(self.kv_block(&gk, &gv)?);
            if t + 1 < n {
                self.dev
                    .send_act(self.comm.as_mut(), next, "cp", &block, (0, len))?;
                self.dev
                    .recv_act(self.comm.as_mut(), prev, "cp", &mut block)?;
            }
        }
        let mut grads: Vec<D::Act> = grads
            .into_iter()
            .collect::<Option<_>>()
            .ok_or_else(|| fail("a ring block was not visited"))?;
        for (j, gj) in grads.iter().enumerate() {
            if j != me {
                self.dev
                    .send_act(self.comm.as_mut(), g.ranks[j], "cp", gj, (0, len))?;
            }
        }
        let mut total = grads.swap_remove(me);
        let mut buf = self.zeros(len)?;
        for j in 0..n {
            if j != me {
                self.dev
                    .recv_act(self.comm.as_mut(), g.ranks[j], "cp", &mut buf)?;
                self.dev.accumulate(&mut total, &buf).map_err(&e)?;
            }
        }
        let (tk, tv) = (
            self.act_part(&total, 0, kl)?,
            self.act_part(&total, kl, len - kl)?,
        );
        self.dev.accumulate(dk, &tk).map_err(&e)?;
        self.dev.accumulate(dv, &tv).map_err(&e)
    }

    /// The rank of stage `stage` at this rank's other coordinates.
    fn peer(&self, stage: u64) -> Result<usize, RankError> {
        let pp = self
            .plan
            .mesh
            .axes
            .iter()
            .position(|a| a == "pp")
            .ok_or_else(|| fail("the mesh has no pp axis"))?;
        let mut coords = self.coords.clone();
        coords[pp] = stage;
        self.plan
            .ranks
            .iter()
            .find(|r| r.coords == coords)
            .map(|r| r.rank as usize)
            .ok_or_else(|| fail(format!("no rank at {coords:?}")))
    }

    /// Elements of a boundary of `bytes` in the plan's dtype.
    fn boundary_len(&self, bytes: f64) -> usize {
        (bytes / self.plan.model.dtype.size_bytes() as f64) as usize
    }

    /// Sends the stage boundary (the hidden states forward, their gradient
    /// backward) to stage `stage`: whole, or this tensor rank's slice of it when
    /// the plan scatters the boundary over the tensor axis (the receiver gathers).
    fn send_boundary(&mut self, stage: u64, bytes: f64, grad: bool) -> Result<(), RankError> {
        let peer = self.peer(stage)?;
        let n = self.boundary_len(bytes);
        let m0 = self.mark()?;
        let x: &D::Act = if grad {
            self.grad_hidden.as_ref()
        } else {
            self.hidden.as_deref()
        }
        .ok_or_else(|| fail("no boundary to send"))?;
        let len = D::act_len(x);
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
        self.dev
            .send_act(self.comm.as_mut(), peer, "pp", x, (off, n))?;
        let args = serde_json::json!({"step": self.step_no, "peer": peer, "elements": n});
        self.span(m0, "Send pp".to_string(), "comm", args)
    }

    /// Receives the stage boundary from stage `stage`.
    fn recv_boundary(&mut self, stage: u64, bytes: f64, grad: bool) -> Result<(), RankError> {
        let peer = self.peer(stage)?;
        let n = self.boundary_len(bytes);
        let m0 = self.mark()?;
        let mut x = self.zeros(n)?;
        self.dev.recv_act(self.comm.as_mut(), peer, "pp", &mut x)?;
        if grad {
            self.grad_hidden = Some(x);
        } else {
            self.hidden = Some(Arc::new(x));
        }
        let args = serde_json::json!({"step": self.step_no, "peer": peer, "elements": n});
        self.span(m0, "Recv pp".to_string(), "comm", args)
    }

    /// Gathers a boundary received in tensor-rank slices.
    fn gather_boundary(&mut self, group: &str, axis: &str, grad: bool) -> Result<(), RankError> {
        let g = self
            .groups
            .get(group)
            .cloned()
            .ok_or_else(|| fail(format!("group `{group}` is not in the plan's mesh")))?;
        let local: &D::Act = if grad {
            self.grad_hidden.as_ref()
        } else {
            self.hidden.as_deref()
        }
        .ok_or_else(|| fail("no boundary to gather"))?;
        let mut out = self.zeros(D::act_len(local) * g.size())?;
        self.dev
            .all_gather_act(self.comm.as_mut(), &g, axis, local, &mut out)?;
        if grad {
            self.grad_hidden = Some(out);
        } else {
            self.hidden = Some(Arc::new(out));
        }
        Ok(())
    }

    /// `partial[name] += g`: an input gradient the program has still to sum.
    fn add_partial(
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
    #[allow(clippy::too_many_arguments)] // the instruction's fields plus where it runs
    fn collective(
        &mut self,
        kind: CollectiveKind,
        group: &str,
        axis: &str,
        target: &Target,
        l: u64,
        t: &mut Task<D>,
        backward: bool,
    ) -> Result<(), RankError> {
        let g = self
            .groups
            .get(group)
            .cloned()
            .ok_or_else(|| fail(format!("group `{group}` is not in the plan's mesh")))?;
        let m0 = self.mark()?;
        match (target, kind) {
            (Target::Activation { tensor }, CollectiveKind::AllReduce) => {
                let key = (l, tensor.clone());
                let x = t
                    .acts
                    .remove(&key)
                    .ok_or_else(|| fail(format!("no tensor `{tensor}`")))?;
                let mut x = Arc::try_unwrap(x)
                    .map_err(|_| fail(format!("`{tensor}` is read elsewhere before its sum")))?;
                self.dev
                    .all_reduce_act(self.comm.as_mut(), &g, axis, &mut x)?;
                t.acts.insert(key, Arc::new(x));
            }
            (Target::Activation { tensor }, CollectiveKind::ReduceScatter) => {
                let key = (l, tensor.clone());
                let full = t
                    .acts
                    .get(&key)
                    .ok_or_else(|| fail(format!("no tensor `{tensor}`")))?;
                let mut out = self.zeros(D::act_len(full) / g.size())?;
                self.dev
                    .reduce_scatter_act(self.comm.as_mut(), &g, axis, full, &mut out)?;
                t.acts.insert(key, Arc::new(out));
            }
            (Target::Activation { tensor }, CollectiveKind::AllGather) => {
                let key = (l, tensor.clone());
                let local = t
                    .acts
                    .get(&key)
                    .ok_or_else(|| fail(format!("no tensor `{tensor}`")))?;
                let mut out = self.zeros(D::act_len(local) * g.size())?;
                self.dev
                    .all_gather_act(self.comm.as_mut(), &g, axis, local, &mut out)?;
                t.gathered.insert(key, Arc::new(out));
            }
            (Target::SegmentParams { segment, set }, CollectiveKind::AllGather)
                if *set == ParamSet::Dense =>
            {
                self.zero3_gather(&g, axis, segment, l)?
            }
            (Target::SegmentGrads { segment, set }, CollectiveKind::ReduceScatter)
                if *set == ParamSet::Dense =>
            {
                self.zero3_scatter(&g, axis, segment, l)?
            }
            (Target::SegmentSeqPartialGrads { segment }, CollectiveKind::AllReduce) => {
                let s = segment_index(self.graph, segment)?;
                let names = self.seq_partial_names(Some(s));
                let keys: Vec<Key> = self
                    .master
                    .keys()
                    .filter(|(name, layer)| *layer == l && names.contains(name))
                    .cloned()
                    .collect();
                self.sum_grads_of(&g, axis, &keys, "segment_seq_partial_grads")?
            }
            (Target::HiddenStates, CollectiveKind::AllGather) => {
                self.gather_boundary(group, axis, false)?
            }
            (Target::ActivationGrad { tensor }, CollectiveKind::ReduceScatter) => {
                let key = (l, tensor.clone());
                let full = t
                    .partial
                    .remove(&key)
                    .or_else(|| t.grads.remove(&key))
                    .ok_or_else(|| fail(format!("no gradient of `{tensor}`")))?;
                let mut out = self.zeros(D::act_len(&full) / g.size())?;
                self.dev
                    .reduce_scatter_act(self.comm.as_mut(), &g, axis, &full, &mut out)?;
                self.add_grad(t, l, tensor.clone(), out)?;
            }
            (Target::ActivationGrad { tensor }, CollectiveKind::AllGather) => {
                let key = (l, tensor.clone());
                let local = t
                    .grads
                    .remove(&key)
                    .ok_or_else(|| fail(format!("no gradient of `{tensor}`")))?;
                let mut out = self.zeros(D::act_len(&local) * g.size())?;
                self.dev
                    .all_gather_act(self.comm.as_mut(), &g, axis, &local, &mut out)?;
                t.grads.insert(key, out);
            }
            (Target::ActivationGrad { tensor }, CollectiveKind::AllReduce) => {
                let key = (l, tensor.clone());
                if let Some(mut p) = t.partial.remove(&key) {
                    self.dev
                        .all_reduce_act(self.comm.as_mut(), &g, axis, &mut p)?;
                    self.add_grad(t, l, tensor.clone(), p)?;
                } else {
                    let x = t
                        .grads
                        .get_mut(&key)
                        .ok_or_else(|| fail(format!("no gradient of `{tensor}`")))?;
                    self.dev.all_reduce_act(self.comm.as_mut(), &g, axis, x)?;
                }
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
        let args = serde_json::json!({"step": self.step_no, "tensor": target.to_string()});
        self.span(m0, format!("{kind:?} {axis}"), "comm", args)
    }

    /// Sums one statistic of a vocabulary-parallel loss over the tensor axis, then
    /// takes the loss's next step: after the maxima (whose sum becomes their mean,
    /// a common shift exact for any value) each rank's sum of exponentials and
    /// target logit; after the target logits the loss and this rank's slice of the
    /// logits' gradient.
    fn loss_collective(
        &mut self,
        name: &str,
        stat: LossStat,
        g: &Group,
        axis: &str,
        l: u64,
        t: &mut Task<D>,
    ) -> Result<(), RankError> {
        let op = self.find_op(name)?;
        if !matches!(op.kind, OpKind::CrossEntropy { .. }) {
            return Err(fail(format!("`{name}` is not a cross-entropy op")));
        }
        let key = (l, name.to_string(), stat);
        let buf = t
            .loss_stats
            .remove(&key)
            .ok_or_else(|| fail(format!("`{name}`: no {stat:?} to sum")))?;
        let r = self
            .dev
            .all_reduce_start(self.comm.as_mut(), g, axis, buf)?;
        let mut sum = self.dev.all_reduce_finish(self.comm.as_mut(), r)?;
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
                self.dev
                    .ce_sumexp_target(
                        &logits,
                        &t.labels,
                        rows,
                        v_local,
                        start,
                        &sum,
                        &mut se,
                        &mut target,
                    )
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
                self.dev
                    .ce_finish(
                        &logits,
                        &t.labels,
                        rows,
                        v_local,
                        start,
                        self.loss_scale() as f32,
                        [get(LossStat::Max)?, get(LossStat::SumExp)?, &sum],
                        &mut loss,
                        &mut d,
                    )
                    .map_err(&e)?;
                if self.tp.rank == 0 {
                    self.losses.push(loss);
                }
                t.acts.insert((l, format!("{name}#dlogits")), Arc::new(d));
                t.loss_stats.retain(|k, _| k.0 != l || k.1 != name);
            }
        }
        Ok(())
    }

    fn attention_dims(&self, op: &Op, rows: usize) -> Result<(AttnDims, usize), RankError> {
        let OpKind::Attention(a) = &op.kind else {
            return Err(fail(format!("`{}` is not an attention op", op.name)));
        };
        let b = self.mbs.max(1);
        let (hq, hkv) = if op.role == TpRole::Replicated {
            (a.heads as usize, a.kv_heads as usize)
        } else {
            let (hq, hkv, _) = local_heads(a.heads, a.kv_heads, self.tp);
            (hq, hkv)
        };
        let dims = AttnDims {
            batch: b,
            sq: rows / b,
            sk: rows / b,
            hq,
            hkv,
            d: a.qk_dim as usize,
            dv: a.v_dim as usize,
        };
        Ok((dims, qkv_width(&dims)))
    }

    fn consumer_attention(&self, op: &Op) -> Result<&'a Op, RankError> {
        self.graph
            .attention_fed_by(op)
            .ok_or_else(|| fail("rope feeds no attention op"))
    }

    /// `(k, n)` of a matmul op (`y [rows, n] = x [rows, k] w`) on this rank's
    /// slice `w` of the weight: a row-parallel op splits `k`, the others `n`.
    fn matmul_dims(&self, op: &Op, w: &D::Act) -> Result<(usize, usize), RankError> {
        let shape = fixed_shape(self.graph.tensor(op.inputs[1]))?;
        let (kf, nf) = if crate::shard::weight_transposed(op) {
            (shape[1], shape[0])
        } else {
            (shape[0], shape[1])
        };
        Ok(match op.role {
            TpRole::RowParallel => (kf / self.tp.size, nf),
            _ => (kf, D::act_len(w) / kf.max(1)),
        })
    }

    /// The ids an embedding op looks up for `rows` rows: token ids, or each token's
    /// position for a learned position table; a block of them under sequence
    /// parallelism.
    fn lookup_ids<'t>(
        &self,
        op: &Op,
        t: &'t Task<D>,
        rows: usize,
    ) -> Result<&'t D::Ids, RankError> {
        let positions = op.name.ends_with("positions");
        let all = self.rows();
        if rows == all {
            return Ok(if positions { &t.positions } else { &t.tokens });
        }
        match &t.block {
            Some((tokens, pos)) if self.sp_block(all).is_some_and(|r| r.len() == rows) => {
                Ok(if positions { pos } else { tokens })
            }
            _ => Err(fail(format!(
                "`{}`: {rows} rows are neither the micro-batch nor this rank's block",
                op.name
            ))),
        }
    }

    /// The activation a column-parallel op reads: gathered over the tensor axis
    /// under sequence parallelism.
    fn act_gathered(
        &self,
        t: &Task<D>,
        l: u64,
        id: meshplan_ir::TensorId,
    ) -> Result<Arc<D::Act>, RankError> {
        match t.gathered.get(&(l, self.name_of(id))) {
            Some(x) => Ok(Arc::clone(x)),
            None => self.act(t, l, id),
        }
    }

    /// This rank's columns of a SwiGLU op's output.
    fn swiglu_width(&self, op: &Op) -> Result<usize, RankError> {
        let full = *fixed_shape_tail(self.graph.tensor(op.outputs[0]))
            .last()
            .unwrap_or(&1);
        Ok(if op.role == TpRole::Replicated {
            full
        } else {
            full / self.tp.size
        })
    }

    /// The first vocabulary row of this rank's slice of an embedding table.
    fn vocab_start(&self, op: &Op) -> Result<usize, RankError> {
        Ok(if op.role == TpRole::VocabEmbedding {
            let v = fixed_shape(self.graph.tensor(op.inputs[1]))?[0];
            self.tp.rank * v / self.tp.size
        } else {
            0
        })
    }

    fn rope(&self, op: &Op, x: &D::Act, backward: bool, t: &Task<D>) -> Result<D::Act, RankError> {
        let att = self.consumer_attention(op)?;
        let rows = D::act_len(x) / self.attention_dims(att, 1)?.1;
        let (dims, width) = self.attention_dims(att, rows)?;
        let mut y = self.zeros(D::act_len(x))?;
        let rope = crate::rope_of(&self.graph.constants);
        self.dev
            .rope_qkv(
                x,
                &t.positions,
                rows,
                dims.hq,
                dims.hkv,
                dims.d,
                width,
                rope,
                backward,
                &mut y,
            )
            .map_err(derr(&op.name))?;
        Ok(y)
    }

    fn forward_op(
        &mut self,
        op: &Op,
        l: u64,
        t: &mut Task<D>,
        out_rows: usize,
    ) -> Result<(), RankError> {
        let out = op
            .outputs
            .first()
            .map(|&o| self.name_of(o))
            .unwrap_or_default();
        let eps = self.graph.constants.norm_eps as f32;
        let e = derr(&op.name);
        let dev = &self.dev;
        let y = match &op.kind {
            OpKind::Embedding => {
                let dim = *fixed_shape(self.graph.tensor(op.inputs[1]))?
                    .last()
                    .unwrap_or(&1);
                let all = self.rows();
                let rows = if out_rows > 0 && out_rows < all && op.role != TpRole::VocabEmbedding {
                    out_rows
                } else {
                    all
                };
                let mut y = self.zeros(rows * dim)?;
                let ids = self.lookup_ids(op, t, rows)?;
                let start = self.vocab_start(op)?;
                dev.embedding_fwd(ids, self.weight(op.inputs[1], l)?, start, dim, &mut y)
                    .map_err(&e)?;
                y
            }
            OpKind::Norm(kind) => {
                let x = self.act(t, l, op.inputs[0])?;
                let dim = fixed_shape(self.graph.tensor(op.inputs[1]))?[0];
                let rows = D::act_len(&x) / dim;
                let w = self.weight(op.inputs[1], l)?;
                let mut y = self.zeros(D::act_len(&x))?;
                let mut rstd = self.zeros_f32(rows)?;
                match kind {
                    NormKind::Rmsnorm => {
                        dev.rmsnorm_fwd(&x, w, rows, dim, eps, &mut y, &mut rstd)
                            .map_err(&e)?;
                    }
                    NormKind::Layernorm => {
                        let mut mean = self.zeros_f32(rows)?;
                        let zero;
                        let b = match op.inputs.get(2) {
                            Some(&bid) => self.weight(bid, l)?,
                            None => {
                                zero = self.zeros(dim)?;
                                &zero
                            }
                        };
                        dev.layernorm_fwd(&x, w, b, rows, dim, eps, &mut y, &mut mean, &mut rstd)
                            .map_err(&e)?;
                        t.stats.insert((l, op.name.clone(), Stat::Mean), mean);
                    }
                }
                t.stats.insert((l, op.name.clone(), Stat::Rstd), rstd);
                y
            }
            OpKind::Matmul { .. } => {
                let x = if matches!(op.role, TpRole::ColumnParallel | TpRole::VocabHead) {
                    self.act_gathered(t, l, op.inputs[0])?
                } else {
                    self.act(t, l, op.inputs[0])?
                };
                let w = self.weight(op.inputs[1], l)?;
                let (kk, n) = self.matmul_dims(op, w)?;
                let rows = D::act_len(&x) / kk.max(1);
                let mut y = self.zeros(rows * n)?;
                let tb = if crate::shard::weight_transposed(op) {
                    Transpose::Yes
                } else {
                    Transpose::No
                };
                dev.matmul(Transpose::No, tb, rows, kk, n, &x, w, &mut y)
                    .map_err(&e)?;
                // A row-parallel bias is added once, before the partial sums meet.
                if let Some(&bid) = op.inputs.get(2) {
                    if op.role != TpRole::RowParallel || self.tp.rank == 0 {
                        dev.bias_add(&mut y, self.weight(bid, l)?, rows, n)
                            .map_err(&e)?;
                    }
                }
                y
            }
            OpKind::Rope => {
                let x = self.act(t, l, op.inputs[0])?;
                self.rope(op, &x, false, t)?
            }
            OpKind::Attention(a) => {
                let x = self.act(t, l, op.inputs[0])?;
                let rows = D::act_len(&x) / self.attention_dims(op, 1)?.1;
                let (dims, _) = self.attention_dims(op, rows)?;
                let (q, kk, v) = self.split(&x, &dims)?;
                let mut o = self.zeros(rows * dims.hq * dims.dv)?;
                let mut lse = self.zeros_f32(dims.batch * dims.hq * dims.sq)?;
                let scale = 1.0 / (a.qk_dim as f32).sqrt();
                if self.cp.size > 1 {
                    self.ring_forward(&dims, (&q, &kk, &v), a.causal, scale, &mut o, &mut lse)?;
                } else {
                    self.dev
                        .attention_fwd(
                            &dims,
                            &q,
                            &kk,
                            &v,
                            (0, 0),
                            a.causal,
                            scale,
                            &mut o,
                            &mut lse,
                        )
                        .map_err(&e)?;
                }
                let mut y = self.zeros(D::act_len(&o))?;
                self.dev
                    .transpose_bs(&o, dims.batch, dims.sq, dims.hq * dims.dv, true, &mut y)
                    .map_err(&e)?;
                t.stats.insert((l, op.name.clone(), Stat::Lse), lse);
                t.acts.insert((l, format!("{}#o", op.name)), Arc::new(o));
                y
            }
            OpKind::Activation(kind) => {
                let x = self.act(t, l, op.inputs[0])?;
                match kind {
                    MlpKind::Swiglu => {
                        let f = self.swiglu_width(op)?;
                        let rows = D::act_len(&x) / (2 * f);
                        let mut y = self.zeros(rows * f)?;
                        dev.swiglu_fwd(&x, rows, f, &mut y).map_err(&e)?;
                        y
                    }
                    MlpKind::Gelu => {
                        let mut y = self.zeros(D::act_len(&x))?;
                        dev.gelu_fwd(&x, &mut y).map_err(&e)?;
                        y
                    }
                }
            }
            OpKind::Add => {
                let a = self.act(t, l, op.inputs[0])?;
                let b = self.act(t, l, op.inputs[1])?;
                let mut y = self.zeros(D::act_len(&a))?;
                dev.add(&a, &b, &mut y).map_err(&e)?;
                y
            }
            OpKind::Dropout => {
                // p = 0 (`supported`): the identity, sharing the input's buffer.
                let x = self.act(t, l, op.inputs[0])?;
                t.acts.insert((l, out), x);
                return Ok(());
            }
            OpKind::CrossEntropy { .. } => {
                let logits = self.act(t, l, op.inputs[0])?;
                let rows = self.rows();
                let vocab = D::act_len(&logits) / rows.max(1);
                if op.role == TpRole::VocabLoss && self.tp.size > 1 {
                    // Each rank holds a slice of the vocabulary: the program's
                    // collectives on the loss's statistics finish it
                    // (`loss_collective`).
                    let mut max = self.zeros_f32(rows)?;
                    dev.ce_row_max(&logits, rows, vocab, &mut max).map_err(&e)?;
                    t.loss_stats
                        .insert((l, op.name.clone(), LossStat::Max), max);
                    return Ok(());
                }
                let scale = self.loss_scale();
                let mut loss = self.zeros_f32(rows)?;
                let mut dlogits = self.zeros(D::act_len(&logits))?;
                dev.cross_entropy(
                    &logits,
                    &t.labels,
                    rows,
                    vocab,
                    scale as f32,
                    &mut loss,
                    &mut dlogits,
                )
                .map_err(&e)?;
                // Read at the end of the step: a download here would stall the
                // launches of the backward behind the forward's kernels. Every
                // tensor rank computes the same loss; the first reports it.
                if self.tp.rank == 0 {
                    self.losses.push(loss);
                }
                // The backward is done: the gradient waits for the backward pass.
                t.acts
                    .insert((l, format!("{}#dlogits", op.name)), Arc::new(dlogits));
                return Ok(());
            }
            OpKind::Experts(_) | OpKind::Router { .. } => {
                return Err(fail(format!("`{}`: routed experts", op.name)))
            }
        };
        t.acts.insert((l, out), Arc::new(y));
        Ok(())
    }

    fn split(&self, x: &D::Act, dims: &AttnDims) -> Result<Qkv<D>, RankError> {
        let rows = dims.batch * dims.sq;
        let mut q = self.zeros(rows * dims.hq * dims.d)?;
        let mut kk = self.zeros(rows * dims.hkv * dims.d)?;
        let mut v = self.zeros(rows * dims.hkv * dims.dv)?;
        self.dev
            .split_qkv(x, dims, &mut q, &mut kk, &mut v)
            .map_err(derr("split_qkv"))?;
        Ok((q, kk, v))
    }

    fn backward_op(&mut self, op: &Op, l: u64, t: &mut Task<D>) -> Result<(), RankError> {
        let in0 = self.name_of(op.inputs[0]);
        if let OpKind::CrossEntropy { .. } = op.kind {
            let d = t
                .acts
                .remove(&(l, format!("{}#dlogits", op.name)))
                .ok_or_else(|| fail("the loss gradient was not kept"))?;
            let d = Arc::try_unwrap(d).map_err(|_| fail("the loss gradient is shared"))?;
            return self.add_grad(t, l, in0, d);
        }
        let out = op
            .outputs
            .first()
            .map(|&o| self.name_of(o))
            .unwrap_or_default();
        // Nothing downstream used this output.
        let Some(dy) = t.grads.remove(&(l, out.clone())) else {
            return Ok(());
        };
        let e = derr(&op.name);
        let dev = &self.dev;
        match &op.kind {
            OpKind::Embedding => {
                let dim = *fixed_shape(self.graph.tensor(op.inputs[1]))?
                    .last()
                    .unwrap_or(&1);
                let key = self.wkey(op.inputs[1], l)?;
                let ids = self.lookup_ids(op, t, D::act_len(&dy) / dim.max(1))?;
                let start = self.vocab_start(op)?;
                let dt = self
                    .wgrads
                    .get_mut(&key)
                    .ok_or_else(|| fail("embedding gradient missing"))?;
                dev.embedding_bwd(ids, &dy, start, dim, dt).map_err(&e)?;
            }
            OpKind::Norm(kind) => {
                let x = self.act(t, l, op.inputs[0])?;
                let dim = fixed_shape(self.graph.tensor(op.inputs[1]))?[0];
                let rows = D::act_len(&x) / dim;
                let mut dx = self.zeros(D::act_len(&x))?;
                let wkey = self.wkey(op.inputs[1], l)?;
                let bkey = op.inputs.get(2).map(|&b| self.wkey(b, l)).transpose()?;
                let w = self
                    .compute
                    .get(&wkey)
                    .ok_or_else(|| fail("norm weight missing"))?;
                let rstd = stat(t, l, &op.name, Stat::Rstd)?;
                let mut dw = self
                    .wgrads
                    .remove(&wkey)
                    .ok_or_else(|| fail("norm gradient missing"))?;
                let r = match kind {
                    NormKind::Rmsnorm => {
                        dev.rmsnorm_bwd(&x, w, rstd, &dy, rows, dim, &mut dx, &mut dw)
                    }
                    NormKind::Layernorm => {
                        let mean = stat(t, l, &op.name, Stat::Mean)?;
                        // A bias-less norm's bias gradient goes to a scratch buffer.
                        let mut scratch = self.zeros_f32(dim)?;
                        let db = match &bkey {
                            Some(k) => self
                                .wgrads
                                .get_mut(k)
                                .ok_or_else(|| fail("bias gradient missing"))?,
                            None => &mut scratch,
                        };
                        dev.layernorm_bwd(&x, w, mean, rstd, &dy, rows, dim, &mut dx, &mut dw, db)
                    }
                };
                self.wgrads.insert(wkey, dw);
                r.map_err(&e)?;
                self.add_grad(t, l, in0, dx)?;
            }
            OpKind::Matmul { .. } => {
                let x = if matches!(op.role, TpRole::ColumnParallel | TpRole::VocabHead) {
                    self.act_gathered(t, l, op.inputs[0])?
                } else {
                    self.act(t, l, op.inputs[0])?
                };
                let wkey = self.wkey(op.inputs[1], l)?;
                let w = self
                    .compute
                    .get(&wkey)
                    .ok_or_else(|| fail("weight missing"))?;
                let (kk, n) = self.matmul_dims(op, w)?;
                let rows = D::act_len(&x) / kk.max(1);
                let mut dx = self.zeros(rows * kk)?;
                let dw = self
                    .wgrads
                    .get_mut(&wkey)
                    .ok_or_else(|| fail("gradient missing"))?;
                if crate::shard::weight_transposed(op) {
                    // `y = x wᵀ` with `w [n, k]`: `dx = dy w`, `dw += dyᵀ x`.
                    dev.matmul(Transpose::No, Transpose::No, rows, n, kk, &dy, w, &mut dx)
                        .map_err(&e)?;
                    dev.matmul_acc(Transpose::Yes, Transpose::No, n, rows, kk, &dy, &x, dw)
                        .map_err(&e)?;
                } else {
                    dev.matmul(Transpose::No, Transpose::Yes, rows, n, kk, &dy, w, &mut dx)
                        .map_err(&e)?;
                    dev.matmul_acc(Transpose::Yes, Transpose::No, kk, rows, n, &x, &dy, dw)
                        .map_err(&e)?;
                }
                if let Some(&b) = op.inputs.get(2) {
                    let bk = self.wkey(b, l)?;
                    let db = self
                        .wgrads
                        .get_mut(&bk)
                        .ok_or_else(|| fail("bias gradient missing"))?;
                    dev.bias_grad(&dy, rows, n, db).map_err(&e)?;
                }
                // A split op's input gradient is partial until the program sums it.
                if matches!(op.role, TpRole::ColumnParallel | TpRole::VocabHead) && self.tp.size > 1
                {
                    self.add_partial(t, l, in0, dx)?;
                } else {
                    self.add_grad(t, l, in0, dx)?;
                }
            }
            OpKind::Rope => {
                let dx = self.rope(op, &dy, true, t)?;
                self.add_grad(t, l, in0, dx)?;
            }
            OpKind::Attention(a) => {
                let x = self.act(t, l, op.inputs[0])?;
                let rows = D::act_len(&x) / self.attention_dims(op, 1)?.1;
                let (dims, _) = self.attention_dims(op, rows)?;
                let (q, kk, v) = self.split(&x, &dims)?;
                let o = t
                    .acts
                    .get(&(l, format!("{}#o", op.name)))
                    .cloned()
                    .ok_or_else(|| fail("attention output was not kept"))?;
                let lse = stat(t, l, &op.name, Stat::Lse)?;
                let mut d_o = self.zeros(D::act_len(&dy))?;
                dev.transpose_bs(&dy, dims.batch, dims.sq, dims.hq * dims.dv, false, &mut d_o)
                    .map_err(&e)?;
                let mut dq = self.zeros(D::act_len(&q))?;
                let mut dk = self.zeros(D::act_len(&kk))?;
                let mut dv = self.zeros(D::act_len(&v))?;
                let scale = 1.0 / (a.qk_dim as f32).sqrt();
                if self.cp.size > 1 {
                    self.ring_backward(
                        &dims,
                        (&q, &kk, &v),
                        (&o, lse, &d_o),
                        a.causal,
                        scale,
                        (&mut dq, &mut dk, &mut dv),
                    )?;
                } else {
                    self.dev
                        .attention_bwd(
                            &dims,
                            &q,
                            &kk,
                            &v,
                            &o,
                            lse,
                            &d_o,
                            (0, 0),
                            a.causal,
                            scale,
                            &mut dq,
                            &mut dk,
                            &mut dv,
                        )
                        .map_err(&e)?;
                }
                let mut dx = self.zeros(D::act_len(&x))?;
                self.dev
                    .join_qkv(&dq, &dk, &dv, &dims, &mut dx)
                    .map_err(&e)?;
                self.add_grad(t, l, in0, dx)?;
            }
            OpKind::Activation(kind) => {
                let x = self.act(t, l, op.inputs[0])?;
                let mut dx = self.zeros(D::act_len(&x))?;
                match kind {
                    MlpKind::Swiglu => {
                        let f = self.swiglu_width(op)?;
                        let rows = D::act_len(&x) / (2 * f);
                        dev.swiglu_bwd(&x, &dy, rows, f, &mut dx).map_err(&e)?;
                    }
                    MlpKind::Gelu => dev.gelu_bwd(&x, &dy, &mut dx).map_err(&e)?,
                }
                self.add_grad(t, l, in0, dx)?;
            }
            OpKind::Add => {
                let in1 = self.name_of(op.inputs[1]);
                self.add_grad_copy(t, l, in0, &dy)?;
                self.add_grad(t, l, in1, dy)?;
            }
            OpKind::Dropout => self.add_grad(t, l, in0, dy)?,
            OpKind::CrossEntropy { .. } => {}
            OpKind::Experts(_) | OpKind::Router { .. } => {
                return Err(fail(format!("`{}`: routed experts", op.name)))
            }
        }
        Ok(())
    }

    /// Checks the step list once and lays out its buckets: each `grads:dense[a..b]`
    /// is a range of the flat gradient. The weights lie in it in the order the
    /// backward finishes their gradients (as DDP orders its buckets), so that the
    /// first buckets fill first. The layout changes no value (each element is summed
    /// and updated alone, with or without ZeRO) and no byte count (the ranges are
    /// the plan's).
    fn plan_step(&mut self) -> Result<(), RankError> {
        let total: usize = self.wgrads.values().map(D::f32_len).sum();
        let mut sizes: Vec<(Key, usize)> = Vec::new();
        for key in self.final_order.iter().chain(self.wgrads.keys()) {
            if !sizes.iter().any(|(k, _)| k == key) {
                let g = self
                    .wgrads
                    .get(key)
                    .ok_or_else(|| fail("gradient missing"))?;
                sizes.push((key.clone(), D::f32_len(g)));
            }
        }
        for instr in &self.phase()?.step {
            match instr {
                Instr::Collective {
                    kind: CollectiveKind::AllReduce,
                    group,
                    axis,
                    target: target @ (Target::SeqPartialGrads | Target::TiedGrads),
                    ..
                } => {
                    let group = self.groups.get(group).cloned().ok_or_else(|| {
                        fail(format!("group `{group}` is not in the plan's mesh"))
                    })?;
                    let (names, tensor) = if *target == Target::TiedGrads {
                        (self.tied_names(), "grads:tied")
                    } else {
                        (self.seq_partial_names(None), "seq_partial_grads")
                    };
                    let keys = self
                        .master
                        .keys()
                        .filter(|(name, _)| names.contains(name))
                        .cloned()
                        .collect();
                    self.step_plan.push(StepItem::SumGrads {
                        group,
                        axis: axis.name().to_string(),
                        keys,
                        tensor,
                    });
                }
                Instr::Collective {
                    kind,
                    group,
                    axis,
                    target,
                    ..
                } => {
                    let tensor = target.to_string();
                    let (a, b) = bucket_range(target, total)?;
                    let g = self.groups.get(group).cloned().ok_or_else(|| {
                        fail(format!("group `{group}` is not in the plan's mesh"))
                    })?;
                    if (b - a) % g.size() != 0 {
                        return Err(fail(format!(
                            "bucket {a}..{b} of `{tensor}` does not split over {} ranks",
                            g.size()
                        )));
                    }
                    let bucket = Bucket {
                        group: g,
                        axis: axis.name().to_string(),
                        tensor: tensor.clone(),
                        start: a,
                        len: b - a,
                        pieces: pieces_of(&sizes, a, b),
                    };
                    match (target, kind) {
                        (Target::GradBucket { .. }, CollectiveKind::AllReduce) => {
                            self.step_plan.push(StepItem::Bucket(self.buckets.len()));
                            self.buckets.push(bucket);
                        }
                        (Target::GradBucket { .. }, CollectiveKind::ReduceScatter) => {
                            self.step_plan
                                .push(StepItem::ReduceScatter(self.scatter.len()));
                            self.scatter.push(bucket);
                        }
                        (Target::ParamBucket { .. }, CollectiveKind::AllGather) => {
                            self.step_plan.push(StepItem::AllGather(self.gather.len()));
                            self.gather.push(bucket);
                        }
                        _ => {
                            return Err(fail(format!(
                                "{kind:?} of `{tensor}` is not a step the device interpreter runs"
                            )))
                        }
                    }
                }
                Instr::Optimizer {
                    params: ParamSet::Dense,
                    ..
                } => self.step_plan.push(StepItem::Optimizer),
                other => return Err(fail(format!("unexpected step instruction {other:?}"))),
            }
        }
        self.in_flight = self.buckets.iter().map(|_| None).collect();
        self.layout = sizes;
        Ok(())
    }

    /// How many backward ops of one backward task write each weight's gradient.
    fn count_uses(&mut self) -> Result<(), RankError> {
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
                segment_index(self.graph, name)?;
                for _ in 0..*repeat {
                    let l = if *kind == SegmentKind::Block {
                        layer -= 1;
                        layer
                    } else {
                        NO_LAYER
                    };
                    for instr in body {
                        if let Instr::Compute { name, .. } = instr {
                            for key in self.weight_keys(self.find_op(name)?, l)? {
                                *uses.entry(key.clone()).or_insert(0) += 1;
                                order.retain(|k| *k != key);
                                order.push(key);
                            }
                        }
                    }
                }
            }
        }
        self.uses = uses;
        self.final_order = order;
        Ok(())
    }

    fn weight_keys(&self, op: &Op, l: u64) -> Result<Vec<Key>, RankError> {
        op.inputs
            .iter()
            .filter(|&&id| self.graph.tensor(id).kind == TensorKind::Weight)
            .map(|&id| self.wkey(id, l))
            .collect()
    }

    /// After a backward op of the step's last backward task: its weights' gradients
    /// may be final, and with them the next buckets.
    fn gradients_written(&mut self, op: &Op, l: u64) -> Result<(), RankError> {
        let keys = self.weight_keys(op, l)?;
        let Some(remaining) = self.remaining.as_mut() else {
            return Ok(());
        };
        for key in keys {
            if let Some(n) = remaining.get_mut(&key) {
                *n = n.saturating_sub(1);
            }
        }
        while let Some(b) = self.buckets.get(self.next_bucket) {
            let remaining = self.remaining.as_ref().ok_or_else(|| fail("no counts"))?;
            let ready = b
                .pieces
                .iter()
                .all(|(key, ..)| remaining.get(key).is_none_or(|&n| n == 0));
            if !ready {
                break;
            }
            let m0 = self.mark()?;
            let i = self.next_bucket;
            self.start_bucket(i)?;
            let bk = &self.buckets[i];
            let args =
                serde_json::json!({"step": self.step_no, "tensor": bk.tensor, "early": true});
            let name = format!("AllReduce {} (start)", bk.axis);
            self.span(m0, name, "comm", args)?;
        }
        Ok(())
    }

    /// Copies bucket `i`'s gradient pieces into one buffer and starts its sum.
    fn start_bucket(&mut self, i: usize) -> Result<(), RankError> {
        let b = &self.buckets[i];
        let e = derr("bucket");
        let mut buf = self.zeros_f32(b.len)?;
        for (key, src, dst, n) in &b.pieces {
            let g = self
                .wgrads
                .get(key)
                .ok_or_else(|| fail("gradient missing"))?;
            self.dev.f32_copy(g, *src, &mut buf, *dst, *n).map_err(&e)?;
        }
        let r = self
            .dev
            .all_reduce_start(&mut *self.comm, &b.group, &b.axis, buf)?;
        self.in_flight[i] = Some(r);
        self.next_bucket = self.next_bucket.max(i + 1);
        Ok(())
    }

    /// Waits for bucket `i`'s sum and copies it back into the gradients.
    fn finish_bucket(&mut self, i: usize) -> Result<(), RankError> {
        let r = self.in_flight[i]
            .take()
            .ok_or_else(|| fail("a bucket finished before it started"))?;
        let buf = self.dev.all_reduce_finish(&mut *self.comm, r)?;
        let e = derr("bucket");
        for (key, src, dst, n) in &self.buckets[i].pieces {
            let g = self
                .wgrads
                .get_mut(key)
                .ok_or_else(|| fail("gradient missing"))?;
            self.dev.f32_copy(&buf, *dst, g, *src, *n).map_err(&e)?;
        }
        Ok(())
    }

    /// Gradient bucket `i` summed over the data ranks, this rank keeping its part.
    fn reduce_scatter(&mut self, i: usize) -> Result<(), RankError> {
        let bk = &self.scatter[i];
        let (n, me) = (bk.group.size(), self.index_in(&bk.group)?);
        let c = bk.len / n;
        let e = derr("reduce-scatter");
        let mut buf = self.zeros_f32(bk.len)?;
        for (key, src, dst, len) in &bk.pieces {
            let g = self
                .wgrads
                .get(key)
                .ok_or_else(|| fail("gradient missing"))?;
            self.dev
                .f32_copy(g, *src, &mut buf, *dst, *len)
                .map_err(&e)?;
        }
        let mut part = self.zeros_f32(c)?;
        self.dev
            .reduce_scatter(&mut *self.comm, &bk.group, &bk.axis, &buf, &mut part)?;
        self.shards.push((bk.start + me * c, part));
        Ok(())
    }

    /// Parameter bucket `i` from the parts each data rank updated.
    fn all_gather(&mut self, i: usize) -> Result<(), RankError> {
        let bk = &self.gather[i];
        let (n, me) = (bk.group.size(), self.index_in(&bk.group)?);
        let c = bk.len / n;
        let e = derr("all-gather");
        let mut local = self.zeros_f32(c)?;
        let own = bk.start + me * c;
        for (key, src, dst, len) in pieces_of(&self.layout, own, own + c) {
            let w = self
                .master
                .get(&key)
                .ok_or_else(|| fail("weight missing"))?;
            self.dev
                .f32_copy(w, src, &mut local, dst, len)
                .map_err(&e)?;
        }
        let mut all = self.zeros_f32(bk.len)?;
        self.dev
            .all_gather(&mut *self.comm, &bk.group, &bk.axis, &local, &mut all)?;
        for (key, src, dst, len) in &bk.pieces {
            let w = self
                .master
                .get_mut(key)
                .ok_or_else(|| fail("weight missing"))?;
            self.dev.f32_copy(&all, *dst, w, *src, *len).map_err(&e)?;
        }
        Ok(())
    }

    /// ZeRO-3: the weights of one segment copy (those whose first user is in that
    /// segment; a tied table belongs to the embedding), as the flat vector the data
    /// ranks shard: (weight, length) in key order.
    fn copy_layout(&self, segment: usize, l: u64) -> Vec<(Key, usize)> {
        let name = &self.graph.segments[segment].name;
        let first_user = |w: &str| {
            self.graph.segments.iter().find(|seg| {
                seg.ops
                    .iter()
                    .any(|op| op.inputs.iter().any(|&t| self.graph.tensor(t).name == w))
            })
        };
        self.master
            .iter()
            .filter(|((w, layer), _)| *layer == l && first_user(w).is_some_and(|s| s.name == *name))
            .map(|(k, m)| (k.clone(), D::f32_len(m)))
            .collect()
    }

    /// This rank's part `(start, len)` of a flat vector of `total` over `g`.
    fn part_of(&self, g: &Group, total: usize) -> Result<(usize, usize), RankError> {
        let n = g.size();
        if !total.is_multiple_of(n) {
            return Err(fail(format!(
                "{total} parameters of a segment do not split over {n} ranks"
            )));
        }
        let c = total / n;
        Ok((self.index_in(g)? * c, c))
    }

    /// ZeRO-3's gather of one segment copy's weights before its forward or
    /// backward: each rank's updated part of the fp32 masters, then the compute
    /// copies refreshed.
    fn zero3_gather(
        &mut self,
        g: &Group,
        axis: &str,
        segment: &str,
        l: u64,
    ) -> Result<(), RankError> {
        let s = segment_index(self.graph, segment)?;
        let layout = self.copy_layout(s, l);
        let total: usize = layout.iter().map(|(_, n)| n).sum();
        let (start, c) = self.part_of(g, total)?;
        let e = derr(segment);
        let mut mine = self.zeros_f32(c)?;
        for (key, src, dst, len) in pieces_of(&layout, start, start + c) {
            let w = self
                .master
                .get(&key)
                .ok_or_else(|| fail("weight missing"))?;
            self.dev.f32_copy(w, src, &mut mine, dst, len).map_err(&e)?;
        }
        let mut all = self.zeros_f32(total)?;
        self.dev
            .all_gather(self.comm.as_mut(), g, axis, &mine, &mut all)?;
        for (key, src, dst, len) in pieces_of(&layout, 0, total) {
            let w = self
                .master
                .get_mut(&key)
                .ok_or_else(|| fail("weight missing"))?;
            self.dev.f32_copy(&all, dst, w, src, len).map_err(&e)?;
            let c = self
                .compute
                .get_mut(&key)
                .ok_or_else(|| fail("compute copy missing"))?;
            self.dev.to_act(w, c).map_err(&e)?;
        }
        Ok(())
    }

    /// ZeRO-3's reduce-scatter of one segment copy's gradients after its
    /// backward: this rank keeps (adds up, over micro-batches) its part of the sum,
    /// and the whole gradients start again from zero.
    fn zero3_scatter(
        &mut self,
        g: &Group,
        axis: &str,
        segment: &str,
        l: u64,
    ) -> Result<(), RankError> {
        let s = segment_index(self.graph, segment)?;
        let layout = self.copy_layout(s, l);
        let total: usize = layout.iter().map(|(_, n)| n).sum();
        let (_, c) = self.part_of(g, total)?;
        let e = derr(segment);
        let mut flat = self.zeros_f32(total)?;
        for (key, src, dst, len) in pieces_of(&layout, 0, total) {
            let gr = self
                .wgrads
                .get_mut(&key)
                .ok_or_else(|| fail("gradient missing"))?;
            self.dev
                .f32_copy(gr, src, &mut flat, dst, len)
                .map_err(&e)?;
            self.dev.f32_zero(gr).map_err(&e)?;
        }
        let mut out = self.zeros_f32(c)?;
        self.dev
            .reduce_scatter(self.comm.as_mut(), g, axis, &flat, &mut out)?;
        let acc = match self.z3_grads.entry((s, l)) {
            std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(self.dev.f32_zeros(c).map_err(&e)?)
            }
        };
        self.dev.f32_accumulate(acc, &out).map_err(&e)
    }

    /// ZeRO-3's AdamW: each segment copy's part of the fp32 masters this rank owns,
    /// with moments of that part alone.
    fn optimizer_zero3(&mut self) -> Result<(), RankError> {
        let g = self
            .groups
            .get("dp")
            .cloned()
            .ok_or_else(|| fail("no dp group"))?;
        for (s, l) in segment_copies(self.graph, self.phase()?)? {
            let l = l.unwrap_or(NO_LAYER);
            let layout = self.copy_layout(s, l);
            let total: usize = layout.iter().map(|(_, n)| n).sum();
            if total == 0 {
                continue;
            }
            let (start, c) = self.part_of(&g, total)?;
            let pieces = pieces_of(&layout, start, start + c);
            let mut state = match self.z3_adam.remove(&(s, l)) {
                Some(state) => state,
                None => self.initial_moments(&pieces, c)?,
            };
            let grad = match self.z3_grads.remove(&(s, l)) {
                Some(gr) => gr,
                None => self.zeros_f32(c)?,
            };
            self.adamw_part(&pieces, c, &grad, &mut state)?;
            self.z3_adam.insert((s, l), state);
        }
        Ok(())
    }

    /// The weights whose gradients sequence parallelism leaves partial over the
    /// tensor axis (norms): of every segment, or of segment `only`.
    fn seq_partial_names(&self, only: Option<usize>) -> Vec<String> {
        self.graph
            .segments
            .iter()
            .enumerate()
            .filter(|(s, _)| only.is_none_or(|o| o == *s))
            .flat_map(|(_, seg)| {
                meshplan_ir::graph::tp_partial_weights(self.graph, seg, true, false)
            })
            .map(|w| self.graph.tensor(w).name.clone())
            .collect()
    }

    /// The weights embedding and head share (a tied table).
    fn tied_names(&self) -> Vec<String> {
        let weights_of = |kind: SegmentKind| -> Vec<String> {
            self.graph
                .segments
                .iter()
                .filter(|s| s.kind == kind)
                .flat_map(|s| &s.ops)
                .flat_map(|o| o.inputs.iter().copied())
                .filter(|&t| self.graph.tensor(t).kind == TensorKind::Weight)
                .map(|t| self.graph.tensor(t).name.clone())
                .collect()
        };
        let head = weights_of(SegmentKind::Head);
        weights_of(SegmentKind::Embed)
            .into_iter()
            .filter(|w| head.contains(w))
            .collect()
    }

    /// Sums the gradients of step item `i`'s weights over its group, as one flat
    /// vector (one collective, as the plan counts it).
    fn sum_grads(&mut self, i: usize) -> Result<(), RankError> {
        let StepItem::SumGrads {
            group,
            axis,
            keys,
            tensor,
        } = &self.step_plan[i]
        else {
            return Err(fail("not a sum of gradients"));
        };
        let (group, axis, keys) = (group.clone(), axis.clone(), keys.clone());
        self.sum_grads_of(&group, &axis, &keys, tensor)
    }

    /// Sums the gradients of `keys` over `group` as one flat vector.
    fn sum_grads_of(
        &mut self,
        group: &Group,
        axis: &str,
        keys: &[Key],
        tensor: &str,
    ) -> Result<(), RankError> {
        let e = derr(tensor);
        let lens: Vec<usize> = keys
            .iter()
            .map(|k| self.wgrads.get(k).map(D::f32_len))
            .collect::<Option<_>>()
            .ok_or_else(|| fail("a partial gradient is missing"))?;
        let mut flat = self.zeros_f32(lens.iter().sum())?;
        let mut at = 0;
        for (k, &n) in keys.iter().zip(&lens) {
            let g = self.wgrads.get(k).ok_or_else(|| fail("gradient missing"))?;
            self.dev.f32_copy(g, 0, &mut flat, at, n).map_err(&e)?;
            at += n;
        }
        let r = self
            .dev
            .all_reduce_start(self.comm.as_mut(), group, axis, flat)?;
        let flat = self.dev.all_reduce_finish(self.comm.as_mut(), r)?;
        let mut at = 0;
        for (k, &n) in keys.iter().zip(&lens) {
            let g = self
                .wgrads
                .get_mut(k)
                .ok_or_else(|| fail("gradient missing"))?;
            self.dev.f32_copy(&flat, at, g, 0, n).map_err(&e)?;
            at += n;
        }
        Ok(())
    }

    fn index_in(&self, g: &Group) -> Result<usize, RankError> {
        g.index_of(self.rank)
            .ok_or_else(|| fail(format!("rank {} is not in group {}", self.rank, g.id)))
    }

    fn initial_moments(
        &self,
        pieces: &[(Key, usize, usize, usize)],
        n: usize,
    ) -> Result<(D::F32, D::F32), RankError> {
        initial_moments(&self.dev, &self.resume_moments, pieces, n)
    }

    /// This rank's part of a checkpoint: the weights whose moments it holds (whole
    /// weights, or under ZeRO its parts of the flat vector), with those moments.
    fn snapshot(&self) -> Result<crate::ckpt::RankSnapshot, RankError> {
        let e = derr("checkpoint");
        let download = |key: &Key| -> Result<Vec<f32>, RankError> {
            let w = self.master.get(key).ok_or_else(|| fail("weight missing"))?;
            self.dev.f32_download(w).map_err(&e)
        };
        let mut pieces = Vec::new();
        for (key, (m, v)) in &self.adam {
            pieces.push(crate::ckpt::Piece {
                key: key.clone(),
                start: 0,
                w: download(key)?,
                m: self.dev.f32_download(m).map_err(&e)?,
                v: self.dev.f32_download(v).map_err(&e)?,
            });
        }
        // Under ZeRO each weight is read back once, however many parts it spans: the
        // parts of the flat vector (ZeRO 1 and 2), or of each segment copy's
        // (ZeRO-3; where this rank's masters are the up-to-date ones).
        let mut parts: Vec<(Layout, usize, &Moments<D>)> = self
            .shard_adam
            .iter()
            .map(|(&start, mv)| (self.layout.clone(), start, mv))
            .collect();
        if let Some(g) = self.groups.get("dp").filter(|_| self.zero3) {
            for (&(s, l), mv) in &self.z3_adam {
                let layout = self.copy_layout(s, l);
                let total = layout.iter().map(|(_, n)| n).sum();
                let (start, _) = self.part_of(g, total)?;
                parts.push((layout, start, mv));
            }
        }
        let mut masters: BTreeMap<Key, Vec<f32>> = BTreeMap::new();
        for (layout, start, (m, v)) in parts {
            let (m, v) = (
                self.dev.f32_download(m).map_err(&e)?,
                self.dev.f32_download(v).map_err(&e)?,
            );
            for (key, src, dst, len) in pieces_of(&layout, start, start + m.len()) {
                if !masters.contains_key(&key) {
                    masters.insert(key.clone(), download(&key)?);
                }
                let w = masters.get(&key).ok_or_else(|| fail("weight missing"))?;
                pieces.push(crate::ckpt::Piece {
                    start: src,
                    w: w[src..src + len].to_vec(),
                    m: m[dst..dst + len].to_vec(),
                    v: v[dst..dst + len].to_vec(),
                    key,
                });
            }
        }
        Ok(crate::ckpt::RankSnapshot {
            tp: self.tp,
            ep: TpPos::ONE,
            pieces,
        })
    }

    /// ZeRO's AdamW: each reduced part of the flat gradient updates the same part of
    /// the fp32 masters, with moments of that part alone.
    fn optimizer_shards(&mut self) -> Result<(), RankError> {
        for (start, grad) in std::mem::take(&mut self.shards) {
            let c = D::f32_len(&grad);
            let pieces = pieces_of(&self.layout, start, start + c);
            let mut state = match self.shard_adam.remove(&start) {
                Some(state) => state,
                None => self.initial_moments(&pieces, c)?,
            };
            self.adamw_part(&pieces, c, &grad, &mut state)?;
            self.shard_adam.insert(start, state);
        }
        Ok(())
    }

    /// AdamW on the `c` values of the fp32 masters that `pieces` cover, with the
    /// moments of that part alone (ZeRO's parts).
    fn adamw_part(
        &mut self,
        pieces: &[(Key, usize, usize, usize)],
        c: usize,
        grad: &D::F32,
        (m, v): &mut Moments<D>,
    ) -> Result<(), RankError> {
        let (b1, b2, eps, wd) = crate::ckpt::ADAMW;
        let step = self.step_no + 1;
        let e = derr("adamw");
        let mut param = self.zeros_f32(c)?;
        for (key, src, dst, len) in pieces {
            let w = self.master.get(key).ok_or_else(|| fail("weight missing"))?;
            self.dev
                .f32_copy(w, *src, &mut param, *dst, *len)
                .map_err(&e)?;
        }
        let mut scratch = self.zeros(c)?;
        self.dev
            .adamw(
                &mut param,
                grad,
                m,
                v,
                &mut scratch,
                step,
                self.opts.lr,
                (b1, b2, eps, wd),
            )
            .map_err(&e)?;
        for (key, src, dst, len) in pieces {
            let w = self
                .master
                .get_mut(key)
                .ok_or_else(|| fail("weight missing"))?;
            self.dev.f32_copy(&param, *dst, w, *src, *len).map_err(&e)?;
        }
        Ok(())
    }

    fn optimizer(&mut self) -> Result<(), RankError> {
        if self.zero3 {
            return self.optimizer_zero3();
        }
        if !self.scatter.is_empty() {
            return self.optimizer_shards();
        }
        let (b1, b2, eps, wd) = crate::ckpt::ADAMW;
        let step = self.step_no + 1;
        for (key, w) in self.master.iter_mut() {
            let e = derr(&key.0);
            let missing = || fail(format!("state of `{}` missing", key.0));
            if !self.adam.contains_key(key) {
                // Moments on first use: under ZeRO only the parts' moments exist.
                let n = D::f32_len(w);
                let whole = [(key.clone(), 0, 0, n)];
                let state = initial_moments(&self.dev, &self.resume_moments, &whole, n)?;
                self.adam.insert(key.clone(), state);
            }
            let g = self.wgrads.get(key).ok_or_else(missing)?;
            let (m, v) = self.adam.get_mut(key).ok_or_else(missing)?;
            let c = self.compute.get_mut(key).ok_or_else(missing)?;
            self.dev
                .adamw(w, g, m, v, c, step, self.opts.lr, (b1, b2, eps, wd))
                .map_err(e)?;
        }
        Ok(())
    }

    fn report(mut self, loss_parts: Vec<f64>, step_s: Vec<f64>) -> Result<RankReport, RankError> {
        // The run's bytes, before ZeRO-3's last gather (which only the report
        // needs: each rank holds the others' parts as of their previous gather).
        let counts = self.comm.counts();
        if self.zero3 {
            let g = self
                .groups
                .get("dp")
                .cloned()
                .ok_or_else(|| fail("no dp group"))?;
            for (s, l) in segment_copies(self.graph, self.phase()?)? {
                let seg = self.graph.segments[s].name.clone();
                let l = l.unwrap_or(NO_LAYER);
                if !self.copy_layout(s, l).is_empty() {
                    self.zero3_gather(&g, "dp", &seg, l)?;
                }
            }
        }
        let mut weights = BTreeMap::new();
        for (key, w) in &self.master {
            weights.insert(key.clone(), self.dev.f32_download(w).map_err(derr(&key.0))?);
        }
        let n: usize = self.master.values().map(D::f32_len).sum();
        let moments: usize = self
            .adam
            .values()
            .chain(self.shard_adam.values())
            .chain(self.z3_adam.values())
            .map(|(m, v)| D::f32_len(m) + D::f32_len(v))
            .sum();
        // Master and gradient in fp32, the moments held (a part of them under ZeRO),
        // and the compute copy.
        let state_bytes = ((n * 8 + moments * 4) + n * self.dev.act_bytes()) as f64;
        Ok(RankReport {
            rank: self.rank,
            loss_parts,
            weights,
            counts,
            step_s,
            state_bytes,
            peak_activation_bytes: self.peak_act_bytes,
            expert_slots: (0, 0),
            spans: std::mem::take(&mut self.spans),
            device_memory_bytes: self.device_peak.map(|b| b as f64),
        })
    }
}

/// A kernel statistic kept in the forward.
fn stat<'t, D: Device>(
    t: &'t Task<D>,
    l: u64,
    op: &str,
    which: Stat,
) -> Result<&'t D::F32, RankError> {
    t.stats
        .get(&(l, op.to_string(), which))
        .ok_or_else(|| fail(format!("{which:?} of `{op}` (layer {l}) was not kept")))
}

/// The flat range `a..b` of a dense gradient or parameter bucket (the whole set
/// without a range), within `total`.
fn bucket_range(target: &Target, total: usize) -> Result<(usize, usize), RankError> {
    let range = match target {
        Target::GradBucket {
            set: ParamSet::Dense,
            range,
        }
        | Target::ParamBucket {
            set: ParamSet::Dense,
            range,
        } => range,
        _ => {
            return Err(fail(format!(
                "the device interpreter does not reduce `{target}`"
            )))
        }
    };
    let (a, b) = range.map_or((0, total), |(a, b)| (a as usize, b as usize));
    if a > b || b > total {
        return Err(fail(format!(
            "bucket {a}..{b} does not fit {total} parameters"
        )));
    }
    Ok((a, b))
}

/// The pieces of the flat range `a..b` over weights laid out as `layout`: (weight,
/// offset in it, offset in the range, values).
fn pieces_of(layout: &[(Key, usize)], a: usize, b: usize) -> Vec<(Key, usize, usize, usize)> {
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

/// AdamW moments of `n` values made of `pieces` (weight, offset in it, offset in the
/// result, values): a resumed checkpoint's, or zeros.
fn initial_moments<D: Device>(
    dev: &D,
    saved: &BTreeMap<Key, (Vec<f32>, Vec<f32>)>,
    pieces: &[(Key, usize, usize, usize)],
    n: usize,
) -> Result<(D::F32, D::F32), RankError> {
    let e = derr("AdamW state");
    if saved.is_empty() {
        return Ok((dev.f32_zeros(n).map_err(&e)?, dev.f32_zeros(n).map_err(&e)?));
    }
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
