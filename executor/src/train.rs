//! The training interpreter: every rank runs its stage's program from `plan.json`
//! (schedule of forward and backward tasks, collectives, point-to-point transfers,
//! the optimizer step) on the CPU kernels, with ranks as threads.
//!
//! The interpreter holds no planning logic. What a compute instruction does follows
//! from its op in the plan's graph and the op's tensor-parallel role; where tensors
//! move is what the program says. Activations are laid out sequence-major
//! (`[s, b, h]`, as Megatron-LM does), so a sequence split is a contiguous block of
//! rows and the collectives of sequence parallelism act on contiguous buffers.

use crate::backend::{Backend, CpuBackend};
use crate::comm::{ByteCounts, CommError, Communicator, Group, RankError, ThreadComm};
use crate::init::{init_full, init_kind};
use crate::moe::Padding;
use crate::shard::{local_heads, local_weight, TpPos};
use crate::Stat;
use meshplan_ir::graph::OpKind;
use meshplan_ir::plan::{
    Axis, CollectiveKind, Instr, LossStat, Pass, Plan, PlanKind, Program, Target,
};
use meshplan_ir::{Graph, NormKind, Op, SegmentKind, TensorKind, TpRole, Workload};
use meshplan_kernels::cpu as k;
use meshplan_kernels::cpu::Rope;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Knobs of a training run.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// Optimizer steps.
    pub steps: u64,
    /// Seed of the weights and the synthetic data.
    pub seed: u64,
    /// AdamW learning rate.
    pub lr: f32,
    /// A collective that waits longer than this fails the run.
    pub timeout: Duration,
    /// For tests: this rank fails at this step.
    pub fail_at: Option<(usize, u64)>,
    /// Tokens of an expert-capacity group; `None`: the plan's
    /// (`meshplan_ir::graph::capacity_group_tokens`). The single-rank reference of a plan takes the plan's, so
    /// that both drop the same tokens ([`TrainOptions::reference_of`]).
    pub moe_group_tokens: Option<usize>,
    /// Where the tokens come from.
    pub data: crate::data::DataSource,
    /// Record a timeline of spans per rank ([`RankReport::spans`]).
    pub trace: bool,
    /// Write checkpoints.
    pub save: Option<crate::ckpt::SaveOptions>,
    /// Start from this checkpoint (its weights, AdamW state and step) and run up
    /// to `steps` steps in all.
    pub resume: Option<Arc<crate::ckpt::Checkpoint>>,
    /// Told by rank 0 after each step how many steps this run has done (a progress
    /// bar; the executor knows nothing of terminals).
    pub on_step: Option<StepHook>,
    /// Start from a Hugging Face checkpoint's weights (fine-tuning) instead of the
    /// seeded initialisation; each rank reads its own slice.
    pub weights: Option<Arc<crate::weights::Checkpoint>>,
    /// Kernel threads of each rank (its own pool; 1: the rank's thread alone).
    /// The results do not depend on it.
    pub threads_per_rank: usize,
}

/// A callback after each training step, with the number of steps done so far.
#[derive(Clone)]
pub struct StepHook(pub Arc<dyn Fn(u64) + Send + Sync>);

impl std::fmt::Debug for StepHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepHook")
    }
}

impl TrainOptions {
    /// These options for the single-rank reference of `plan`: the same capacity
    /// groups (a capacity group is part of what the model computes).
    pub fn reference_of(&self, plan: &Plan) -> TrainOptions {
        let st = &plan.strategy;
        let seq = match &plan.workload {
            Workload::Train { seq_len, .. } => *seq_len,
            _ => 0,
        };
        let group = meshplan_ir::graph::capacity_group_tokens(seq, st.cp, st.tp, st.ep);
        TrainOptions {
            moe_group_tokens: self.moe_group_tokens.or(Some(group as usize)),
            // The reference resumes from the same checkpoint but writes none.
            save: None,
            on_step: None,
            ..self.clone()
        }
    }
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            steps: 5,
            seed: 1234,
            lr: 3e-3,
            timeout: Duration::from_secs(30),
            fail_at: None,
            moe_group_tokens: None,
            data: crate::data::DataSource::Synthetic,
            trace: false,
            save: None,
            resume: None,
            on_step: None,
            weights: None,
            threads_per_rank: 1,
        }
    }
}

/// Weight key: tensor name and layer (`u64::MAX` outside the repeated blocks).
pub type Key = (String, u64);

/// Values per weight.
type Weights = BTreeMap<Key, Vec<f32>>;

/// Outside the blocks.
pub(crate) const NO_LAYER: u64 = u64::MAX;

/// What one rank reports.
#[derive(Clone, Debug)]
pub struct RankReport {
    /// Global rank.
    pub rank: usize,
    /// Its share of each step's loss (non-zero on loss-owning ranks only).
    pub loss_parts: Vec<f64>,
    /// Its local weights after the last step.
    pub weights: BTreeMap<Key, Vec<f32>>,
    /// Bytes it sent, per collective kind and axis, over the training steps.
    pub counts: ByteCounts,
    /// Wall seconds of each step.
    pub step_s: Vec<f64>,
    /// When this rank began its first step and ended each step, in seconds on the
    /// run's clock (shared by the ranks of one process).
    pub steps_at: (f64, Vec<f64>),
    /// The run clock's zero in seconds since the Unix epoch: lines up the clocks of
    /// separate processes (one per GPU), exactly on one node, to the system clocks'
    /// agreement across nodes.
    pub clock0_unix_s: f64,
    /// Bytes of weights, their gradients and optimizer state held at the end.
    pub state_bytes: f64,
    /// Most bytes of activations (and kept kernel statistics) held at once.
    pub peak_activation_bytes: f64,
    /// Token-to-expert assignments routed by this rank, and of those the ones over
    /// an expert's capacity (they skip that expert), over all steps and passes.
    pub expert_slots: (u64, u64),
    /// Measured spans, when tracing.
    pub spans: Vec<crate::trace::Span>,
    /// Most device memory the driver reported in use (all of the device's users),
    /// sampled after each forward task; `None` off a GPU.
    pub device_memory_bytes: Option<f64>,
}

/// A whole run.
#[derive(Clone, Debug)]
pub struct TrainReport {
    /// Mean loss over the global batch, per step.
    pub losses: Vec<f64>,
    /// Wall seconds per step: from the end of the previous step on the slowest
    /// rank (the first step: from the first rank's start) to this step's end on the
    /// slowest rank, so that they add up to the wall-clock time of the steps.
    pub step_s: Vec<f64>,
    /// Tokens per step (whole cluster).
    pub tokens_per_step: u64,
    /// Per rank, in rank order.
    pub ranks: Vec<RankReport>,
    /// Checkpoints written, in step order.
    pub saved: Vec<crate::ckpt::Saved>,
    /// The AdamW learning rate the run stepped with: the scale of its updates.
    pub lr: f64,
}

/// Why a run could not start, or did not finish. Each variant's message names what
/// went wrong and what to do; a caller matches the variant to decide (the binary
/// maps a refused plan and a bad checkpoint to the user's input).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExecError {
    /// The plan, or the options given with it, cannot run here.
    #[error("{0}")]
    Plan(String),
    /// A checkpoint to resume or fine-tune from does not fit, or one being
    /// written failed.
    #[error("{0}")]
    Checkpoint(String),
    /// A rank failed: which, why, and where the others waited.
    #[error("{0}")]
    Rank(String),
    /// The run finished but its result is unusable (a request no rank produced,
    /// non-finite logits).
    #[error("{0}")]
    Output(String),
}

impl ExecError {
    /// The message, as printed.
    pub fn message(&self) -> &str {
        match self {
            ExecError::Plan(m)
            | ExecError::Checkpoint(m)
            | ExecError::Rank(m)
            | ExecError::Output(m) => m,
        }
    }
}

pub(crate) fn fail(msg: impl Into<String>) -> RankError {
    RankError::Failed(msg.into())
}

pub(crate) fn kerr(what: &str) -> impl Fn(k::KernelError) -> RankError + '_ {
    move |e| RankError::Failed(format!("{what}: {e}"))
}

/// Runs the plan's training programs for `opts.steps` steps on the CPU kernels.
pub fn train(plan: &Plan, opts: &TrainOptions) -> Result<TrainReport, ExecError> {
    train_on(plan, opts, &CpuBackend)
}

/// Runs the plan's training programs on `backend`.
pub fn train_on(
    plan: &Plan,
    opts: &TrainOptions,
    backend: &dyn Backend,
) -> Result<TrainReport, ExecError> {
    if plan.kind != PlanKind::Train {
        return Err(ExecError::Plan(
            "this plan is an inference plan; training needs a train plan".into(),
        ));
    }
    let (seq_len, global_batch) = match &plan.workload {
        Workload::Train {
            seq_len,
            global_batch,
            ..
        } => (*seq_len, *global_batch),
        Workload::Inference { .. } => {
            return Err(ExecError::Plan(
                "the plan's workload is not training".into(),
            ))
        }
    };
    let world = plan.ranks.len();
    let t0 = Instant::now();
    let start = match &opts.resume {
        Some(ck) => check_resume(plan, opts, ck)?,
        None => 0,
    };
    let saver = match &opts.save {
        Some(s) => Some(crate::ckpt::Saver::new(plan, opts, s).map_err(ExecError::Checkpoint)?),
        None => None,
    };
    let results = crate::comm::run_ranks(world, opts.timeout, opts.threads_per_rank, |comm| {
        let mut r = RankState::new(backend, plan, comm, opts, seq_len, global_batch, t0)?;
        let mut loss_parts = Vec::new();
        let mut step_s = Vec::new();
        let mut steps_at = (t0.elapsed().as_secs_f64(), Vec::new());
        for step in start..opts.steps {
            if opts.fail_at == Some((r.rank, step)) {
                return Err(fail(format!("injected failure at step {step}")));
            }
            let t = Instant::now();
            loss_parts.push(r.step(step)?);
            step_s.push(t.elapsed().as_secs_f64());
            steps_at.1.push(t0.elapsed().as_secs_f64());
            if let (0, Some(hook)) = (r.rank, &opts.on_step) {
                (hook.0)(step_s.len() as u64);
            }
            if let Some(sv) = saver.as_ref().filter(|sv| sv.due(step + 1, opts.steps)) {
                sv.deposit(step + 1, r.snapshot()?).map_err(fail)?;
            }
        }
        let counts = r.comm.counts();
        r.gather_zero3_for_report()?;
        let bytes = |m: &BTreeMap<Key, Vec<f32>>| m.values().map(|v| v.len()).sum::<usize>();
        let adam: usize = r.adam.values().map(|(m, v)| m.len() + v.len()).sum();
        Ok(RankReport {
            rank: r.rank,
            loss_parts,
            weights: r.weights.clone(),
            counts,
            step_s,
            steps_at,
            clock0_unix_s: clock0_unix_s(t0),
            state_bytes: 4.0 * (bytes(&r.weights) + bytes(&r.wgrads) + adam) as f64,
            peak_activation_bytes: r.peak_act_bytes,
            expert_slots: r.expert_slots,
            spans: std::mem::take(&mut r.tracer.spans),
            device_memory_bytes: None,
        })
    });
    // Joined even when the run failed, so that no write outlives the call.
    let saved = saver.map(crate::ckpt::Saver::finish);
    if let Some(summary) = crate::comm::failure_summary(&results) {
        return Err(ExecError::Rank(summary));
    }
    let saved = saved
        .transpose()
        .map_err(|e| ExecError::Checkpoint(format!("checkpoint: {e}")))?;
    let mut ranks = Vec::new();
    for r in results {
        match r {
            Ok(rep) => ranks.push(rep),
            Err(e) => return Err(ExecError::Rank(format!("{e:?}"))),
        }
    }
    let steps = opts.steps.saturating_sub(start) as usize;
    let losses = (0..steps)
        .map(|s| ranks.iter().map(|r| r.loss_parts[s]).sum())
        .collect();
    let step_s = run_step_times(&ranks, steps);
    Ok(TrainReport {
        losses,
        step_s,
        tokens_per_step: seq_len * global_batch,
        ranks,
        saved: saved.unwrap_or_default(),
        lr: f64::from(opts.lr),
    })
}

/// `rank`'s place in its group `name` (no split when the plan has no such group).
pub(crate) fn place_in(groups: &BTreeMap<String, Group>, name: &str, rank: usize) -> TpPos {
    groups
        .get(name)
        .and_then(|g| {
            g.index_of(rank).map(|i| TpPos {
                rank: i,
                size: g.size(),
            })
        })
        .unwrap_or(TpPos::ONE)
}

/// Each step's wall time on the run's clock (see [`TrainReport::step_s`]): the
/// gaps between the slowest rank's step ends, the first from the first rank's
/// start. A rank's own step time would count its waits on the others at the start
/// of a step again, and the slowest rank of each step is not the same rank.
pub(crate) fn run_step_times(ranks: &[RankReport], steps: usize) -> Vec<f64> {
    let spans: Vec<(f64, &[f64])> = ranks
        .iter()
        .map(|r| (r.steps_at.0, r.steps_at.1.as_slice()))
        .collect();
    step_times(&spans, steps)
}

/// [`run_step_times`] over each rank's `(start, step ends)` on one clock.
pub(crate) fn step_times(spans: &[(f64, &[f64])], steps: usize) -> Vec<f64> {
    let mut prev = spans.iter().map(|r| r.0).fold(f64::INFINITY, f64::min);
    (0..steps)
        .map(|s| {
            let end = spans
                .iter()
                .filter_map(|r| r.1.get(s))
                .fold(f64::NEG_INFINITY, |a, &b| a.max(b));
            let dt = (end - prev).max(0.0);
            prev = end;
            dt
        })
        .collect()
}

/// The Unix time at which the monotonic clock read `t0`.
pub(crate) fn clock0_unix_s(t0: Instant) -> f64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    now - t0.elapsed().as_secs_f64()
}

/// The step a run resumed from `ck` starts at, once the checkpoint is known to fit
/// the plan's model and the run's data.
pub(crate) fn check_resume(
    plan: &Plan,
    opts: &TrainOptions,
    ck: &crate::ckpt::Checkpoint,
) -> Result<u64, ExecError> {
    let err = ExecError::Checkpoint;
    ck.check_model(&plan.graph).map_err(err)?;
    let m = ck.manifest();
    if m.seed != opts.seed {
        return Err(err(format!(
            "{}: saved with seed {}, this run uses {} (the data would not continue)",
            ck.dir().display(),
            m.seed,
            opts.seed
        )));
    }
    // The data continue only on the same tokens (a moved file is fine).
    let now = opts.data.describe();
    let same = |k: &str| m.data.get(k).unwrap_or(&serde_json::Value::Null) == &now[k];
    if !same("source") || !same("tokens") {
        return Err(err(format!(
            "{}: saved while training on {}, this run reads {} (the data would not continue); give the same --data",
            ck.dir().display(),
            m.data,
            now
        )));
    }
    if m.step >= opts.steps {
        return Err(err(format!(
            "{}: the checkpoint has done {} steps; ask for more than that in all",
            ck.dir().display(),
            m.step
        )));
    }
    Ok(m.step)
}

/// Per-task tensors: activations, gradients and what kernels saved, keyed by layer
/// and tensor name.
#[derive(Default)]
struct Store {
    /// Shared so that reading an input does not copy it.
    acts: HashMap<(u64, String), Arc<Vec<f32>>>,
    grads: HashMap<(u64, String), Vec<f32>>,
    /// Kernel statistics kept for the backward, by layer, op and kind.
    stats: HashMap<(u64, String, Stat), Arc<Vec<f32>>>,
    /// What each experts op keeps for its backward, by layer and op name.
    experts: HashMap<(u64, String), crate::moe::ExpertsKept>,
}

struct RankState<'a> {
    be: &'a dyn Backend,
    plan: &'a Plan,
    graph: &'a Graph,
    rank: usize,
    comm: ThreadComm,
    program: &'a Program,
    coords: BTreeMap<String, usize>,
    groups: BTreeMap<String, Group>,
    tp: TpPos,
    cp: TpPos,
    ep: TpPos,
    dp_index: usize,
    dp_size: usize,
    seq_len: usize,
    global_batch: usize,
    mbs: usize,
    opts: TrainOptions,
    /// Which op of which segment uses each weight.
    users: HashMap<String, (usize, usize)>,
    weights: BTreeMap<Key, Vec<f32>>,
    wgrads: BTreeMap<Key, Vec<f32>>,
    /// ZeRO-3: gradient shards accumulated per segment copy and kind.
    shard_grads: BTreeMap<(String, u64), Vec<f32>>,
    /// Adam state per flat parameter set (`dense`, `experts`).
    adam: BTreeMap<String, (Vec<f32>, Vec<f32>)>,
    /// Reduced gradient shards (ZeRO 1, 2) per set: (this rank's flat range, values)
    /// per bucket.
    reduced: BTreeMap<String, Vec<Shard>>,
    tasks: BTreeMap<(u64, u64), Store>,
    hidden: Vec<f32>,
    grad_hidden: Vec<f32>,
    loss_part: f64,
    step_no: u64,
    peak_act_bytes: f64,
    expert_slots: (u64, u64),
    tracer: crate::trace::Tracer,
    /// The micro-batch the running task belongs to (dropout masks are keyed by it).
    cur_mb: u64,
    /// Per AdamW state: the weight keys of its flat vector and the flat ranges it
    /// holds, in order (what a checkpoint reads back).
    adam_parts: BTreeMap<String, (Vec<Key>, Vec<Range>)>,
    /// Resuming: AdamW moments (m, v) of each local weight, the starting state of
    /// each partition.
    resume_adam: Option<(Weights, Weights)>,
}

impl Store {
    fn put(&mut self, key: (u64, String), v: Vec<f32>) {
        self.acts.insert(key, Arc::new(v));
    }

    fn put_stat(&mut self, l: u64, op: &str, which: Stat, v: Vec<f32>) {
        self.stats.insert((l, op.to_string(), which), Arc::new(v));
    }

    /// A kernel statistic kept earlier in this task.
    fn stat(&self, l: u64, op: &str, which: Stat) -> Result<Arc<Vec<f32>>, RankError> {
        self.stats
            .get(&(l, op.to_string(), which))
            .cloned()
            .ok_or_else(|| fail(format!("{which:?} of `{op}` (layer {l}) was not kept")))
    }

    /// Values held, for the memory report.
    fn held_floats(&self) -> usize {
        let experts: usize = self.experts.values().map(|e| e.floats()).sum();
        let stats: usize = self.stats.values().map(|v| v.len()).sum();
        self.acts.values().map(|v| v.len()).sum::<usize>() + stats + experts
    }

    /// A tensor or kernel statistic kept earlier in this task.
    fn kept(&self, l: u64, name: &str) -> Result<Arc<Vec<f32>>, RankError> {
        self.acts
            .get(&(l, name.to_string()))
            .cloned()
            .ok_or_else(|| fail(format!("`{name}` (layer {l}) was not kept")))
    }
}

impl<'a> RankState<'a> {
    fn new(
        be: &'a dyn Backend,
        plan: &'a Plan,
        comm: ThreadComm,
        opts: &TrainOptions,
        seq_len: u64,
        global_batch: u64,
        t0: Instant,
    ) -> Result<RankState<'a>, RankError> {
        let rank = comm.rank();
        let entry = plan
            .ranks
            .get(rank)
            .ok_or_else(|| fail(format!("rank {rank} is not in the plan's rank table")))?;
        let program = plan
            .programs
            .get(entry.program as usize)
            .ok_or_else(|| fail(format!("rank {rank}: program {} missing", entry.program)))?;
        let coords: BTreeMap<String, usize> = plan
            .mesh
            .axes
            .iter()
            .cloned()
            .zip(entry.coords.iter().map(|&c| c as usize))
            .collect();
        let size_of = |axis: &str| {
            plan.mesh
                .axes
                .iter()
                .position(|a| a == axis)
                .map(|i| plan.mesh.shape[i] as usize)
                .unwrap_or(1)
        };
        let tp = TpPos {
            rank: coords.get("tp").copied().unwrap_or(0),
            size: size_of("tp"),
        };
        let cp = TpPos {
            rank: coords.get("cp").copied().unwrap_or(0),
            size: size_of("cp"),
        };
        let groups = build_groups(plan, rank)?;
        let ep = place_in(&groups, "ep", rank);
        let graph = &plan.graph;
        let mut users = HashMap::new();
        for (s, seg) in graph.segments.iter().enumerate() {
            for (o, op) in seg.ops.iter().enumerate() {
                for &t in &op.inputs {
                    let tensor = graph.tensor(t);
                    if tensor.kind == TensorKind::Weight {
                        users.entry(tensor.name.clone()).or_insert((s, o));
                    }
                }
            }
        }
        // Programs the CPU executor cannot run faithfully: refuse rather than
        // compute something else.
        let mut st = RankState {
            be,
            plan,
            graph,
            rank,
            comm,
            program,
            tp,
            cp,
            ep,
            dp_index: coords.get("dp").copied().unwrap_or(0),
            dp_size: size_of("dp"),
            coords,
            groups,
            seq_len: seq_len as usize,
            global_batch: global_batch as usize,
            mbs: plan.strategy.mbs as usize,
            opts: opts.clone(),
            users,
            weights: BTreeMap::new(),
            wgrads: BTreeMap::new(),
            shard_grads: BTreeMap::new(),
            adam: BTreeMap::new(),
            reduced: BTreeMap::new(),
            tasks: BTreeMap::new(),
            hidden: Vec::new(),
            grad_hidden: Vec::new(),
            loss_part: 0.0,
            step_no: 0,
            peak_act_bytes: 0.0,
            expert_slots: (0, 0),
            tracer: crate::trace::Tracer::new(t0, opts.trace),
            cur_mb: 0,
            adam_parts: BTreeMap::new(),
            resume_adam: None,
        };
        st.init_weights()?;
        Ok(st)
    }

    fn phase(&self) -> Result<&'a meshplan_ir::plan::Phase, RankError> {
        self.program
            .phases
            .first()
            .ok_or_else(|| fail("the program has no phase"))
    }

    /// Layers of this rank: (segment index, layer key) per segment copy it runs.
    fn copies(&self) -> Result<Vec<(usize, u64)>, RankError> {
        Ok(segment_copies(self.graph, self.phase()?)?
            .into_iter()
            .map(|(s, l)| (s, l.unwrap_or(NO_LAYER)))
            .collect())
    }

    fn segment_index(&self, name: &str) -> Result<usize, RankError> {
        segment_index(self.graph, name)
    }

    fn init_weights(&mut self) -> Result<(), RankError> {
        for (s, layer) in self.copies()? {
            let seg = &self.graph.segments[s];
            for op in &seg.ops {
                for &w in &op.inputs {
                    let t = self.graph.tensor(w);
                    if t.kind != TensorKind::Weight {
                        continue;
                    }
                    let key = (t.name.clone(), layer);
                    if self.weights.contains_key(&key) {
                        continue;
                    }
                    let shape = fixed_shape(t)?;
                    let elems: usize = shape.iter().product();
                    let kind = init_kind(op, w, &shape);
                    let full = match &self.opts.resume {
                        Some(ck) => {
                            let slice = |kind: &str| -> Result<Vec<f32>, RankError> {
                                let name = crate::ckpt::tensor_name(kind, &key);
                                let full = ck.values(&name, &shape).map_err(fail)?;
                                Ok(local_weight(
                                    self.graph, op, op.role, w, &full, &shape, self.tp, self.ep,
                                ))
                            };
                            let (m, v) = (slice("adam_m")?, slice("adam_v")?);
                            let state = self.resume_adam.get_or_insert_with(Default::default);
                            state.0.insert(key.clone(), m);
                            state.1.insert(key.clone(), v);
                            ck.values(&crate::ckpt::tensor_name("w", &key), &shape)
                                .map_err(fail)?
                        }
                        None if self.opts.weights.is_some() => Vec::new(),
                        None => init_full(self.opts.seed, &t.name, layer, elems, kind),
                    };
                    let local = match (&self.opts.weights, &self.opts.resume) {
                        // Fine-tuning: this rank's slice straight from the mapped files.
                        (Some(hf), None) => {
                            let spec = crate::weights::shard_spec(
                                self.graph, op, op.role, w, &shape, self.tp,
                            );
                            let l = (layer != NO_LAYER).then_some(layer);
                            hf.local(self.graph, op, w, l, &spec)
                                .map_err(|e| fail(e.message))?
                        }
                        _ => local_weight(
                            self.graph, op, op.role, w, &full, &shape, self.tp, self.ep,
                        ),
                    };
                    self.wgrads.insert(key.clone(), vec![0.0; local.len()]);
                    self.weights.insert(key, local);
                }
            }
        }
        Ok(())
    }

    /// Keys of the weights embedding and head share (a tied table) that this rank holds.
    fn tied_keys(&self) -> Vec<Key> {
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
        let tied: Vec<String> = weights_of(SegmentKind::Embed)
            .into_iter()
            .filter(|w| head.contains(w))
            .collect();
        self.weights
            .keys()
            .filter(|(name, _)| tied.contains(name))
            .cloned()
            .collect()
    }

    /// Keys of the weights of a parameter set (`dense` or `experts`), optionally of
    /// one segment copy, in the canonical (sorted) order every rank uses.
    fn set_keys(&self, what: &str, copy: Option<(usize, u64)>) -> Vec<Key> {
        let expert = what == "experts";
        self.weights
            .keys()
            .filter(|(name, layer)| {
                let is_expert = self
                    .graph
                    .tensors
                    .iter()
                    .find(|t| &t.name == name)
                    .is_some_and(|t| t.split == meshplan_ir::TpSplit::Experts);
                if is_expert != expert {
                    return false;
                }
                match copy {
                    Some((s, l)) => {
                        *layer == l
                            && self.users.get(name).is_some_and(|&(us, _)| {
                                self.graph.segments[us].name == self.graph.segments[s].name
                            })
                    }
                    None => true,
                }
            })
            .cloned()
            .collect()
    }

    fn flat(&self, map: &BTreeMap<Key, Vec<f32>>, keys: &[Key]) -> Vec<f32> {
        let mut out = Vec::new();
        for key in keys {
            if let Some(v) = map.get(key) {
                out.extend_from_slice(v);
            }
        }
        out
    }

    fn unflat(
        map: &mut BTreeMap<Key, Vec<f32>>,
        keys: &[Key],
        flat: &[f32],
        range: (usize, usize),
    ) {
        let mut off = 0;
        for key in keys {
            if let Some(v) = map.get_mut(key) {
                for (i, x) in v.iter_mut().enumerate() {
                    let g = off + i;
                    if g >= range.0 && g < range.1 {
                        *x = flat[g];
                    }
                }
                off += v.len();
            }
        }
    }

    fn group(&self, name: &str) -> Result<Group, RankError> {
        self.groups
            .get(name)
            .cloned()
            .ok_or_else(|| fail(format!("group `{name}` is not in the plan's mesh")))
    }

    /// One optimizer step: every task of the schedule, then the step list.
    fn step(&mut self, step: u64) -> Result<f64, RankError> {
        self.step_no = step;
        self.loss_part = 0.0;
        for g in self.wgrads.values_mut() {
            g.iter_mut().for_each(|x| *x = 0.0);
        }
        self.shard_grads.clear();
        let phase = self.phase()?;
        for task in &phase.schedule {
            let ch = phase
                .chunks
                .iter()
                .find(|c| c.chunk == task.chunk)
                .ok_or_else(|| fail(format!("schedule names chunk {}", task.chunk)))?;
            let t = self.tracer.begin();
            self.cur_mb = task.mb;
            match task.pass {
                Pass::F => {
                    let mut store = Store::default();
                    self.load_batch(&mut store, task.mb)?;
                    self.hidden.clear();
                    let mut layer = ch.layer_start;
                    self.run_forward(&ch.forward, &mut store, &mut layer, NO_LAYER)?;
                    self.tasks.insert((task.chunk, task.mb), store);
                    let held: usize = self.tasks.values().map(Store::held_floats).sum();
                    self.peak_act_bytes = self.peak_act_bytes.max(4.0 * held as f64);
                }
                Pass::B => {
                    let mut store = self
                        .tasks
                        .remove(&(task.chunk, task.mb))
                        .ok_or_else(|| fail("a backward before its forward"))?;
                    self.grad_hidden.clear();
                    let mut layer = ch.layer_end;
                    self.run_backward(&ch.backward, &mut store, &mut layer)?;
                }
            }
            let pass = if task.pass == Pass::F { "fwd" } else { "bwd" };
            self.tracer.end(
                t,
                format!("{pass} mb{} c{}", task.mb, task.chunk),
                "task",
                serde_json::json!({"step": self.step_no, "mb": task.mb, "chunk": task.chunk}),
            );
        }
        let step_list = phase.step.clone();
        self.run_step(&step_list)?;
        // A NaN or an infinity never recovers, and training on would write it into
        // every checkpoint: stop, naming the step and the first tensor it reached.
        let bad = self
            .weights
            .iter()
            .find_map(|(k, w)| w.iter().find(|x| !x.is_finite()).map(|x| (k, *x)));
        if let Some(((name, layer), x)) = bad {
            let layer = layer_label(*layer);
            return Err(fail(format!(
                "step {step}: weight `{name}`{layer} holds {x} after the update (loss {}): stopping; a learning rate too large, or non-finite --weights",
                self.loss_part
            )));
        }
        if !self.loss_part.is_finite() {
            return Err(fail(format!(
                "step {step}: the loss is {}: stopping; non-finite activations from finite weights (an overflow in the model's arithmetic)",
                self.loss_part
            )));
        }
        Ok(self.loss_part)
    }

    /// Tokens and labels of micro-batch `mb` on this rank, sequence-major.
    fn load_batch(&self, store: &mut Store, mb: u64) -> Result<(), RankError> {
        let per_dp = self.global_batch / self.dp_size.max(1);
        let s_local = self.seq_len / self.cp.size;
        let s0 = self.cp.rank * s_local;
        let b = self.mbs;
        let vocab = self.vocab();
        let mut tokens = vec![0.0f32; s_local * b];
        let mut labels = vec![0.0f32; s_local * b];
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
            for si in 0..s_local {
                tokens[si * b + bi] = seq[s0 + si] as f32;
                labels[si * b + bi] = seq[s0 + si + 1] as f32;
            }
        }
        store.put((NO_LAYER, "tokens".into()), tokens);
        store.put((NO_LAYER, "labels".into()), labels);
        Ok(())
    }

    /// Global (sample, position) of local row `r` of a sequence-major activation of
    /// `rows` rows: the micro-batch's samples of this data rank, positions offset by
    /// the context rank and, when sequence parallelism split the rows, the tensor rank.
    fn row_coords(&self, r: usize, rows: usize) -> (u64, u64) {
        let b = self.mbs.max(1);
        let s_cp = self.seq_len / self.cp.size.max(1);
        let s_rows = (rows / b).max(1);
        let sp_off = if s_rows < s_cp {
            self.tp.rank * s_rows
        } else {
            0
        };
        let per_dp = self.global_batch / self.dp_size.max(1);
        let sample = self.dp_index * per_dp + self.cur_mb as usize * b + r % b;
        let pos = self.cp.rank * s_cp + sp_off + r / b;
        (sample as u64, pos as u64)
    }

    /// A dropout op's mask over its `rows x width` input: `1 / (1 - p)` where an entry
    /// survives, 0 where it drops; a pure function of the run's seed, the step, the op
    /// and layer, and the entry's global sample, position and column, so every
    /// sharding (and recomputation) draws the same mask.
    fn dropout_mask(
        &self,
        op: &Op,
        l: u64,
        rows: usize,
        width: usize,
    ) -> Result<Vec<f32>, RankError> {
        let (sample0, pos0) = self.row_coords(0, rows);
        let d = k::RowDropout {
            draw: k::DropoutDraw {
                seed: self.opts.seed,
                step: self.step_no,
                site: crate::init::name_hash(&op.name) ^ l,
                p: self.graph.constants.dropout_p,
            },
            sample0,
            mbs: self.mbs.max(1),
            pos0,
        };
        // The mask is the kernel applied to ones: `1 / (1 - p)` or 0 per entry.
        let ones = vec![1.0f32; rows * width];
        let mut mask = vec![0.0f32; rows * width];
        k::dropout_rows(&ones, rows, width, &d, &mut mask).map_err(kerr(&op.name))?;
        Ok(mask)
    }

    /// Attention-probability dropout of a graph with dropout layers: `p` and the
    /// keep function over (local batch row, local head, query, key position), keyed
    /// by global sample and head so that every sharding draws the same mask.
    #[allow(clippy::type_complexity)]
    fn attention_keep(
        &self,
        op: &Op,
        l: u64,
    ) -> Option<(f32, Box<dyn Fn(usize, usize, usize, usize) -> bool + Sync>)> {
        let has_dropout = self
            .graph
            .segments
            .iter()
            .flat_map(|s| &s.ops)
            .any(|o| matches!(o.kind, OpKind::Dropout));
        let p = self.graph.constants.dropout_p;
        if !has_dropout || p <= 0.0 {
            return None;
        }
        let OpKind::Attention(a) = &op.kind else {
            return None;
        };
        let head0 = if op.role == TpRole::Replicated {
            0
        } else {
            local_heads(a.heads, a.kv_heads, self.tp).0 * self.tp.rank
        };
        let per_dp = self.global_batch / self.dp_size.max(1);
        let a = k::AttnDropout {
            draw: k::DropoutDraw {
                seed: self.opts.seed,
                step: self.step_no,
                site: crate::init::name_hash(&op.name) ^ l ^ 0xa77e_0000,
                p,
            },
            head0: head0 as u64,
            sample0: (self.dp_index * per_dp + self.cur_mb as usize * self.mbs) as u64,
        };
        Some((p as f32, Box::new(move |b, h, i, j| a.keep(b, h, i, j))))
    }

    fn vocab(&self) -> u64 {
        self.graph.vocab().unwrap_or(2)
    }

    fn peer(&self, stage: u64) -> Result<usize, RankError> {
        let mut coords: Vec<u64> = self
            .plan
            .mesh
            .axes
            .iter()
            .map(|a| self.coords.get(a).copied().unwrap_or(0) as u64)
            .collect();
        let pp_axis = self
            .plan
            .mesh
            .axes
            .iter()
            .position(|a| a == "pp")
            .ok_or_else(|| fail("the mesh has no pp axis"))?;
        coords[pp_axis] = stage;
        self.plan
            .ranks
            .iter()
            .find(|r| r.coords == coords)
            .map(|r| r.rank as usize)
            .ok_or_else(|| fail(format!("no rank at {coords:?}")))
    }

    fn run_forward(
        &mut self,
        instrs: &[Instr],
        store: &mut Store,
        layer: &mut u64,
        cur: u64,
    ) -> Result<(), RankError> {
        for instr in instrs {
            let t = self.tracer.begin();
            match instr {
                Instr::Segment {
                    name,
                    kind,
                    repeat,
                    body,
                } => {
                    let s = self.segment_index(name)?;
                    for _ in 0..*repeat {
                        let l = if *kind == SegmentKind::Block {
                            let l = *layer;
                            *layer += 1;
                            l
                        } else {
                            NO_LAYER
                        };
                        if let Some(input) = segment_input(self.graph, s) {
                            store.put((l, input), self.hidden.clone());
                        }
                        self.run_forward(body, store, layer, l)?;
                        if let Some(out) = segment_output(self.graph, s) {
                            if let Some(v) = store.acts.get(&(l, out)) {
                                self.hidden = v.to_vec();
                            }
                        }
                    }
                }
                Instr::Recompute { body } => self.run_forward(body, store, layer, cur)?,
                Instr::Compute { name, outputs, .. } => {
                    let op = self.find_op(name)?;
                    let out_rows = outputs
                        .first()
                        .map(|t| {
                            let n = t.shape.len();
                            t.shape[..n.saturating_sub(1)].iter().product::<u64>() as usize
                        })
                        .unwrap_or(0);
                    self.forward_op(op, cur, store, out_rows)?;
                }
                Instr::Collective {
                    kind,
                    group,
                    axis,
                    target,
                    ..
                } => self.collective(*kind, group, *axis, target, cur, store, false)?,
                Instr::Send {
                    peer_stage, bytes, ..
                } => {
                    let peer = self.peer(*peer_stage)?;
                    let n = (*bytes / 4.0) as usize;
                    let part = slice_for(&self.hidden, n, self.tp)?;
                    self.comm.send(peer, "pp", &part)?;
                }
                Instr::Recv {
                    peer_stage, bytes, ..
                } => {
                    let peer = self.peer(*peer_stage)?;
                    let mut buf = vec![0.0f32; (*bytes / 4.0) as usize];
                    self.comm.recv(peer, "pp", &mut buf)?;
                    self.hidden = buf;
                }
                // The attention op passes the blocks itself (see `ring_forward`).
                Instr::RingPass { .. } => {}
                Instr::Optimizer { .. } => {}
            }
            self.tracer.end_instr(t, instr, self.step_no, cur);
        }
        Ok(())
    }

    fn run_backward(
        &mut self,
        instrs: &[Instr],
        store: &mut Store,
        layer: &mut u64,
    ) -> Result<(), RankError> {
        for instr in instrs {
            let t = self.tracer.begin();
            match instr {
                Instr::Segment {
                    name,
                    kind,
                    repeat,
                    body,
                } => {
                    let s = self.segment_index(name)?;
                    for _ in 0..*repeat {
                        let l = if *kind == SegmentKind::Block {
                            *layer -= 1;
                            *layer
                        } else {
                            NO_LAYER
                        };
                        if let Some(out) = segment_output(self.graph, s) {
                            if !self.grad_hidden.is_empty() {
                                store.grads.insert((l, out), self.grad_hidden.clone());
                            }
                        }
                        self.run_backward_body(body, store, l)?;
                        if let Some(input) = segment_input(self.graph, s) {
                            self.grad_hidden = store.grads.remove(&(l, input)).unwrap_or_default();
                        }
                    }
                }
                Instr::Collective {
                    group,
                    axis,
                    target,
                    ..
                } => {
                    if *target == Target::HiddenStatesGrad {
                        let g = self.group(group)?;
                        let mut out = vec![0.0f32; self.grad_hidden.len() * g.size()];
                        self.comm
                            .all_gather(&g, axis.name(), &self.grad_hidden, &mut out)?;
                        self.grad_hidden = out;
                    } else {
                        return Err(fail(format!(
                            "unexpected collective on `{target}` outside a segment"
                        )));
                    }
                }
                Instr::Send {
                    peer_stage, bytes, ..
                } => {
                    let peer = self.peer(*peer_stage)?;
                    let n = (*bytes / 4.0) as usize;
                    let part = slice_for(&self.grad_hidden, n, self.tp)?;
                    self.comm.send(peer, "pp", &part)?;
                }
                Instr::Recv {
                    peer_stage, bytes, ..
                } => {
                    let peer = self.peer(*peer_stage)?;
                    let mut buf = vec![0.0f32; (*bytes / 4.0) as usize];
                    self.comm.recv(peer, "pp", &mut buf)?;
                    self.grad_hidden = buf;
                }
                other => {
                    return Err(fail(format!(
                        "unexpected instruction in a backward list: {other:?}"
                    )))
                }
            }
            self.tracer.end_instr(t, instr, self.step_no, NO_LAYER);
        }
        Ok(())
    }

    fn run_backward_body(
        &mut self,
        body: &[Instr],
        store: &mut Store,
        l: u64,
    ) -> Result<(), RankError> {
        for instr in body {
            let t = self.tracer.begin();
            match instr {
                Instr::Recompute { body } => {
                    let mut dummy = l;
                    self.run_forward(body, store, &mut dummy, l)?;
                }
                Instr::Compute { name, .. } => {
                    let op = self.find_op(name)?;
                    self.backward_op(op, l, store)?;
                }
                Instr::RingPass { .. } => {}
                Instr::Collective {
                    kind,
                    group,
                    axis,
                    target,
                    ..
                } => self.collective(*kind, group, *axis, target, l, store, true)?,
                other => {
                    return Err(fail(format!(
                        "unexpected instruction in a segment's backward: {other:?}"
                    )));
                }
            }
            self.tracer.end_instr(t, instr, self.step_no, l);
        }
        Ok(())
    }

    fn find_op(&self, name: &str) -> Result<&'a Op, RankError> {
        self.graph
            .segments
            .iter()
            .flat_map(|s| &s.ops)
            .find(|o| o.name == name)
            .ok_or_else(|| fail(format!("op `{name}` is not in the plan's graph")))
    }

    fn act(
        &self,
        store: &Store,
        l: u64,
        id: meshplan_ir::TensorId,
    ) -> Result<Arc<Vec<f32>>, RankError> {
        let name = &self.graph.tensor(id).name;
        let key_l = if name == "tokens" || name == "labels" {
            NO_LAYER
        } else {
            l
        };
        store
            .acts
            .get(&(key_l, name.clone()))
            .cloned()
            .ok_or_else(|| fail(format!("tensor `{name}` (layer {l}) has not been produced")))
    }

    /// The input as a column-parallel op reads it: gathered when sequence parallelism
    /// gathered it.
    fn act_gathered(
        &self,
        store: &Store,
        l: u64,
        id: meshplan_ir::TensorId,
    ) -> Result<Arc<Vec<f32>>, RankError> {
        let name = format!("{}@g", self.graph.tensor(id).name);
        match store.acts.get(&(l, name)) {
            Some(v) => Ok(v.clone()),
            None => self.act(store, l, id),
        }
    }

    fn weight(&self, id: meshplan_ir::TensorId, l: u64) -> Result<&Vec<f32>, RankError> {
        let name = &self.graph.tensor(id).name;
        self.weights
            .get(&(name.clone(), l))
            .or_else(|| self.weights.get(&(name.clone(), NO_LAYER)))
            .ok_or_else(|| {
                fail(format!(
                    "weight `{name}` (layer {l}) is not held by rank {}",
                    self.rank
                ))
            })
    }

    fn wkey(&self, id: meshplan_ir::TensorId, l: u64) -> Key {
        let name = self.graph.tensor(id).name.clone();
        if self.weights.contains_key(&(name.clone(), l)) {
            (name, l)
        } else {
            (name, NO_LAYER)
        }
    }

    /// Adds a gradient it owns: the first contribution is moved in, not copied.
    fn add_grad_vec(be: &dyn Backend, store: &mut Store, l: u64, name: &str, g: Vec<f32>) {
        match store.grads.get_mut(&(l, name.to_string())) {
            Some(e) if e.len() == g.len() => be.accumulate(e, &g),
            _ => {
                store.grads.insert((l, name.to_string()), g);
            }
        }
    }

    fn add_grad(be: &dyn Backend, store: &mut Store, l: u64, name: &str, g: &[f32]) {
        match store.grads.get_mut(&(l, name.to_string())) {
            Some(e) if e.len() == g.len() => be.accumulate(e, g),
            _ => {
                store.grads.insert((l, name.to_string()), g.to_vec());
            }
        }
    }

    fn out_name(&self, op: &Op) -> String {
        op.outputs
            .first()
            .map(|&t| self.graph.tensor(t).name.clone())
            .unwrap_or_default()
    }

    fn attention_dims(
        &self,
        op: &Op,
        rows: usize,
    ) -> Result<(k::AttnDims, usize, usize), RankError> {
        let OpKind::Attention(a) = &op.kind else {
            return Err(fail("not an attention op"));
        };
        let (hq, hkv, _) = if op.role == TpRole::Replicated {
            (a.heads as usize, a.kv_heads as usize, 0)
        } else {
            local_heads(a.heads, a.kv_heads, self.tp)
        };
        let b = self.mbs;
        let s = rows / b.max(1);
        Ok((
            k::AttnDims {
                batch: b,
                sq: s,
                sk: s,
                hq,
                hkv,
                d: a.qk_dim as usize,
                dv: a.v_dim as usize,
            },
            hq,
            hkv,
        ))
    }

    fn forward_op(
        &mut self,
        op: &Op,
        l: u64,
        store: &mut Store,
        out_rows: usize,
    ) -> Result<(), RankError> {
        let out = self.out_name(op);
        let eps = self.graph.constants.norm_eps as f32;
        match &op.kind {
            OpKind::Embedding => {
                let ids = self.lookup_ids(op, self.act(store, l, op.inputs[0])?);
                let table = self.weight(op.inputs[1], l)?;
                let dim = *fixed_shape(self.graph.tensor(op.inputs[1]))?
                    .last()
                    .unwrap_or(&1);
                let (vocab_start, ids) = self.embedding_rows(op, &ids, out_rows)?;
                let ids: Vec<u32> = ids.iter().map(|&x| x as u32).collect();
                let mut y = vec![0.0; ids.len() * dim];
                self.be
                    .embedding_fwd(&ids, table, vocab_start, dim, &mut y)
                    .map_err(kerr(&op.name))?;
                store.put((l, out), y);
            }
            OpKind::Norm(kind) => {
                let x = self.act(store, l, op.inputs[0])?;
                let w = self.weight(op.inputs[1], l)?.clone();
                let dim = w.len();
                let rows = x.len() / dim;
                let mut y = vec![0.0; x.len()];
                let mut rstd = vec![0.0; rows];
                match kind {
                    NormKind::Rmsnorm => self
                        .be
                        .rmsnorm_fwd(&x, &w, rows, dim, eps, &mut y, &mut rstd),
                    NormKind::Layernorm => {
                        let b = match op.inputs.get(2) {
                            Some(&bid) => self.weight(bid, l)?.clone(),
                            None => vec![0.0; dim],
                        };
                        let mut mean = vec![0.0; rows];
                        let r = self.be.layernorm_fwd(
                            &x, &w, &b, rows, dim, eps, &mut y, &mut mean, &mut rstd,
                        );
                        store.put_stat(l, &op.name, Stat::Mean, mean);
                        r
                    }
                }
                .map_err(kerr(&op.name))?;
                store.put_stat(l, &op.name, Stat::Rstd, rstd);
                store.put((l, out), y);
            }
            OpKind::Matmul { .. } => {
                let gathered = matches!(op.role, TpRole::ColumnParallel | TpRole::VocabHead);
                let x = if gathered {
                    self.act_gathered(store, l, op.inputs[0])?
                } else {
                    self.act(store, l, op.inputs[0])?
                };
                let w = self.weight(op.inputs[1], l)?;
                let (kk, n) = self.matmul_dims(op, w.len())?;
                let rows = x.len() / kk.max(1);
                let mut y = vec![0.0; rows * n];
                if crate::shard::weight_transposed(op) {
                    self.be
                        .matmul(
                            k::Transpose::No,
                            k::Transpose::Yes,
                            rows,
                            kk,
                            n,
                            &x,
                            w,
                            0.0,
                            &mut y,
                        )
                        .map_err(kerr(&op.name))?;
                } else {
                    linear_fwd(self.be, &x, w, rows, kk, n, &mut y).map_err(kerr(&op.name))?;
                }
                if let Some(&bid) = op.inputs.get(2) {
                    // A row-parallel bias is added once, before the partial sums meet.
                    if op.role != TpRole::RowParallel || self.tp.rank == 0 {
                        let b = self.weight(bid, l)?;
                        for r in 0..rows {
                            for c in 0..n {
                                y[r * n + c] += b[c];
                            }
                        }
                    }
                }
                store.put((l, out), y);
            }
            OpKind::Rope => {
                let x = self.act(store, l, op.inputs[0])?;
                let att = self.consumer_attention(op)?;
                let rows = x.len() / self.qkv_width(att)?;
                let y = self.rope(att, &x, rows, false)?;
                store.put((l, out), y);
            }
            OpKind::Attention(a) => {
                let x = self.act(store, l, op.inputs[0])?;
                let width = self.qkv_width(op)?;
                let rows = x.len() / width;
                let (dims, hq, hkv) = self.attention_dims(op, rows)?;
                let (q, kk, v) = split_qkv(&x, rows, hq, hkv, dims.d, dims.dv, self.mbs);
                let mut o = vec![0.0; dims.batch * dims.sq * hq * dims.dv];
                let mut lse = vec![0.0; dims.batch * hq * dims.sq];
                let pos0 = self.cp.rank * self.seq_len / self.cp.size;
                let scale = 1.0 / (a.qk_dim as f32).sqrt();
                let keep = self.attention_keep(op, l);
                let dropout = keep.as_ref().map(|(p, f)| k::Dropout { p: *p, keep: f });
                if self.cp.size > 1 {
                    self.ring_forward(
                        &dims,
                        &q,
                        &kk,
                        &v,
                        a.causal,
                        scale,
                        &mut o,
                        &mut lse,
                        dropout.as_ref(),
                    )?;
                } else {
                    self.be
                        .attention_fwd(
                            &dims,
                            &q,
                            &kk,
                            &v,
                            pos0,
                            pos0,
                            a.causal,
                            scale,
                            &mut o,
                            &mut lse,
                            dropout.as_ref(),
                        )
                        .map_err(kerr(&op.name))?;
                }
                store.put_stat(l, &op.name, Stat::Lse, lse);
                let y = bshd_to_sbhd(&o, self.mbs, dims.sq, hq * dims.dv);
                store.put((l, format!("{}#o", op.name)), o);
                store.put((l, out), y);
            }
            OpKind::Activation(kind) => {
                let x = self.act(store, l, op.inputs[0])?;
                let y = match kind {
                    meshplan_ir::MlpKind::Swiglu => {
                        let f = self.swiglu_width(op)?;
                        let rows = x.len() / (2 * f);
                        let mut y = vec![0.0; rows * f];
                        self.be
                            .swiglu_fwd(&x, rows, f, &mut y)
                            .map_err(kerr(&op.name))?;
                        y
                    }
                    meshplan_ir::MlpKind::Gelu => {
                        let mut y = vec![0.0; x.len()];
                        self.be.gelu_fwd(&x, &mut y).map_err(kerr(&op.name))?;
                        y
                    }
                };
                store.put((l, out), y);
            }
            OpKind::Add => {
                let a = self.act(store, l, op.inputs[0])?;
                let b = self.act(store, l, op.inputs[1])?;
                let mut y = vec![0.0; a.len()];
                self.be.add(&a, &b, &mut y).map_err(kerr(&op.name))?;
                store.put((l, out), y);
            }
            OpKind::Dropout => {
                let x = self.act(store, l, op.inputs[0])?;
                let width = match self.graph.tensor(op.inputs[0]).shape.last() {
                    Some(meshplan_ir::Dim::Fixed(w)) => *w as usize,
                    _ => return Err(fail(format!("{}: input width is not fixed", op.name))),
                };
                let mask = self.dropout_mask(op, l, x.len() / width.max(1), width)?;
                let y: Vec<f32> = x.iter().zip(&mask).map(|(a, m)| a * m).collect();
                store.put((l, format!("{}#mask", op.name)), mask);
                store.put((l, out), y);
            }
            OpKind::CrossEntropy { .. } => {
                let logits = self.act(store, l, op.inputs[0])?;
                let labels = self.act(store, l, op.inputs[1])?;
                let rows = labels.len();
                let v_local = logits.len() / rows.max(1);
                let mut max = vec![0.0; rows];
                self.be
                    .ce_row_max(&logits, rows, v_local, &mut max)
                    .map_err(kerr(&op.name))?;
                store.put((l, format!("{}.max", op.name)), max);
                if op.role != TpRole::VocabLoss || self.tp.size == 1 {
                    self.loss_after_max(op, l, store)?;
                    self.loss_finish(op, l, store)?;
                }
            }
            OpKind::Experts(e) => self.experts_forward(op, e, l, store)?,
            OpKind::Router { .. } => {
                return Err(fail("a separate router op is not run by the CPU executor"))
            }
        }
        Ok(())
    }

    /// The ids a rank looks up and the first vocabulary row it holds.
    /// The rows an embedding op looks up: token ids, or, for a learned position
    /// table (`embed.positions`, reading the tokens only for their layout), each
    /// token's global position in its sequence.
    fn lookup_ids(&self, op: &Op, tokens: Arc<Vec<f32>>) -> Arc<Vec<f32>> {
        if !op.name.ends_with("positions") {
            return tokens;
        }
        let b = self.mbs.max(1);
        let s0 = self.cp.rank * self.seq_len / self.cp.size.max(1);
        Arc::new((0..tokens.len()).map(|r| (s0 + r / b) as f32).collect())
    }

    fn embedding_rows(
        &self,
        op: &Op,
        ids: &[f32],
        out_rows: usize,
    ) -> Result<(usize, Vec<f32>), RankError> {
        let vocab_start = if op.role == TpRole::VocabEmbedding {
            let v = fixed_shape(self.graph.tensor(op.inputs[1]))?[0];
            self.tp.rank * v / self.tp.size
        } else {
            0
        };
        if op.role != TpRole::VocabEmbedding && out_rows > 0 && out_rows < ids.len() {
            // A replicated table under sequence parallelism: this rank looks up its own
            // block of sequence positions (a vocabulary-parallel one looks up every
            // position and reduce-scatters the partial rows).
            let c = out_rows;
            return Ok((
                vocab_start,
                ids[self.tp.rank * c..(self.tp.rank + 1) * c].to_vec(),
            ));
        }
        Ok((vocab_start, ids.to_vec()))
    }

    fn loss_after_max(&mut self, op: &Op, l: u64, store: &mut Store) -> Result<(), RankError> {
        let logits = self.act(store, l, op.inputs[0])?;
        let labels = self.act(store, l, op.inputs[1])?;
        let rows = labels.len();
        let v_local = logits.len() / rows.max(1);
        let max = store.kept(l, &format!("{}.max", op.name))?;
        let mut se = vec![0.0; rows];
        self.be
            .ce_row_sumexp(&logits, rows, v_local, &max, &mut se)
            .map_err(kerr(&op.name))?;
        store.put((l, format!("{}.sum_exp", op.name)), se);
        let lab: Vec<u32> = labels.iter().map(|&x| x as u32).collect();
        let mut target = vec![0.0; rows];
        let start = self.loss_vocab_start(op, v_local);
        self.be
            .ce_target_logit(&logits, &lab, rows, v_local, start, &mut target)
            .map_err(kerr(&op.name))?;
        store.put((l, format!("{}.target", op.name)), target);
        Ok(())
    }

    /// The first vocabulary column of this rank's logits.
    fn loss_vocab_start(&self, op: &Op, v_local: usize) -> usize {
        if op.role == TpRole::VocabLoss {
            self.tp.rank * v_local
        } else {
            0
        }
    }

    /// Each token's weight in the step's loss: the mean over the global batch.
    fn loss_scale(&self) -> f64 {
        1.0 / (self.global_batch * self.seq_len) as f64
    }

    fn loss_finish(&mut self, op: &Op, l: u64, store: &mut Store) -> Result<(), RankError> {
        let get = |what: &str| store.kept(l, &format!("{}.{what}", op.name));
        let (max, se, target) = (get("max")?, get("sum_exp")?, get("target")?);
        let mut loss = vec![0.0; max.len()];
        self.be
            .ce_loss(&max, &se, &target, &mut loss)
            .map_err(kerr(&op.name))?;
        if self.tp.rank == 0 {
            let scale = self.loss_scale();
            self.loss_part += loss.iter().map(|&x| x as f64).sum::<f64>() * scale;
        }
        Ok(())
    }

    /// One collective of a forward or backward list, on the tensor it names.
    #[allow(clippy::too_many_arguments)] // the instruction's fields plus where it runs
    fn collective(
        &mut self,
        kind: CollectiveKind,
        group: &str,
        axis: Axis,
        target: &Target,
        l: u64,
        store: &mut Store,
        backward: bool,
    ) -> Result<(), RankError> {
        let g = self.group(group)?;
        let n = g.size();
        let ax = axis.name();
        let tensor = match target {
            // The experts op moves its tokens itself (counts depend on the routing).
            Target::Experts { .. } => return Ok(()),
            // Parameter sets (ZeRO-3 inside a segment).
            Target::SegmentParams { segment, set } => {
                return self.zero3_gather(&g, ax, segment, set.name(), l)
            }
            Target::SegmentGrads { segment, set } => {
                return self.zero3_scatter(&g, ax, segment, set.name(), l)
            }
            Target::SegmentSeqPartialGrads { segment } => {
                let s = self.segment_index(segment)?;
                return self.seq_partial_reduce(&g, ax, Some((s, l)));
            }
            Target::ActivationGrad { tensor: name } => {
                return self.activation_grad_collective(kind, &g, ax, name, l, store)
            }
            Target::HiddenStates => {
                let mut out = vec![0.0f32; self.hidden.len() * n];
                self.comm.all_gather(&g, ax, &self.hidden, &mut out)?;
                self.hidden = out;
                return Ok(());
            }
            Target::LossStat { op, stat } => {
                let op = self.find_op(op)?;
                if !matches!(op.kind, OpKind::CrossEntropy { .. }) {
                    return Err(fail(format!(
                        "`{target}`: `{}` is not a cross-entropy op",
                        op.name
                    )));
                }
                if backward {
                    return Ok(());
                }
                let key = (l, target.to_string());
                let buf = store
                    .acts
                    .get_mut(&key)
                    .map(Arc::make_mut)
                    .ok_or_else(|| fail(format!("`{target}` missing")))?;
                self.comm.all_reduce(&g, ax, buf)?;
                match stat {
                    LossStat::Max => {
                        // The plan reduces by sum: the shift of the log-sum-exp
                        // becomes the mean of the local maxima, which is exact for
                        // any common shift and safe at these magnitudes.
                        let inv = 1.0 / n as f32;
                        buf.iter_mut().for_each(|x| *x *= inv);
                        self.loss_after_max(op, l, store)?;
                    }
                    LossStat::SumExp => {}
                    LossStat::Target => self.loss_finish(op, l, store)?,
                }
                return Ok(());
            }
            Target::Activation { tensor } => tensor,
            Target::HiddenStatesGrad
            | Target::TiedGrads
            | Target::SeqPartialGrads
            | Target::GradBucket { .. }
            | Target::ParamBucket { .. } => {
                return Err(fail(format!(
                    "`{target}` is a step collective, not one inside a segment"
                )))
            }
        };
        let key = (l, tensor.to_string());
        match kind {
            CollectiveKind::AllReduce => {
                let buf = store
                    .acts
                    .get_mut(&key)
                    .map(Arc::make_mut)
                    .ok_or_else(|| fail(format!("no tensor `{tensor}`")))?;
                self.comm.all_reduce(&g, ax, buf)?;
            }
            CollectiveKind::ReduceScatter => {
                let full = store
                    .acts
                    .get(&key)
                    .cloned()
                    .ok_or_else(|| fail(format!("no tensor `{tensor}`")))?;
                let mut out = vec![0.0; full.len() / n];
                self.comm.reduce_scatter(&g, ax, &full, &mut out)?;
                store.put(key, out);
            }
            CollectiveKind::AllGather => {
                let local = store
                    .acts
                    .get(&key)
                    .cloned()
                    .ok_or_else(|| fail(format!("no tensor `{tensor}`")))?;
                let mut out = vec![0.0; local.len() * n];
                self.comm.all_gather(&g, ax, &local, &mut out)?;
                store.put((l, format!("{tensor}@g")), out);
            }
            other => return Err(fail(format!("{other:?} on `{tensor}` is not supported"))),
        }
        Ok(())
    }

    /// A collective on the gradient of activation `name` (tensor parallelism's
    /// backward): summed whole or scattered, or gathered.
    fn activation_grad_collective(
        &mut self,
        kind: CollectiveKind,
        g: &Group,
        ax: &str,
        name: &str,
        l: u64,
        store: &mut Store,
    ) -> Result<(), RankError> {
        let n = g.size();
        let key = (l, name.to_string());
        let gkey = (l, format!("{name}@g"));
        match kind {
            CollectiveKind::AllReduce => {
                let pkey = (l, format!("{name}@p"));
                if let Some(mut partial) = store.grads.remove(&pkey) {
                    self.comm.all_reduce(g, ax, &mut partial)?;
                    Self::add_grad_vec(self.be, store, l, name, partial);
                } else {
                    let buf = store
                        .grads
                        .get_mut(&key)
                        .ok_or_else(|| fail(format!("no gradient of `{name}`")))?;
                    self.comm.all_reduce(g, ax, buf)?;
                }
            }
            CollectiveKind::ReduceScatter => {
                let full = store
                    .grads
                    .remove(&(l, format!("{name}@p")))
                    .or_else(|| store.grads.remove(&gkey))
                    .or_else(|| store.grads.remove(&key))
                    .ok_or_else(|| fail(format!("no gradient of `{name}`")))?;
                let mut out = vec![0.0; full.len() / n];
                self.comm.reduce_scatter(g, ax, &full, &mut out)?;
                Self::add_grad_vec(self.be, store, l, name, out);
            }
            CollectiveKind::AllGather => {
                let local = store
                    .grads
                    .get(&key)
                    .cloned()
                    .ok_or_else(|| fail(format!("no gradient of `{name}`")))?;
                let mut out = vec![0.0; local.len() * n];
                self.comm.all_gather(g, ax, &local, &mut out)?;
                store.grads.insert(key, out);
            }
            other => return Err(fail(format!("{other:?} on a gradient is not supported"))),
        }
        Ok(())
    }

    fn zero3_gather(
        &mut self,
        g: &Group,
        ax: &str,
        seg: &str,
        set: &str,
        l: u64,
    ) -> Result<(), RankError> {
        let s = self.segment_index(seg)?;
        let keys = self.set_keys(set, Some((s, l)));
        let flat = self.flat(&self.weights, &keys);
        let n = g.size();
        if !flat.len().is_multiple_of(n) {
            return Err(fail(format!(
                "{} parameters of `{seg}.{set}` do not split over {n} ranks",
                flat.len()
            )));
        }
        let c = flat.len() / n;
        let me = g.index_of(self.rank).unwrap_or(0);
        let mut out = vec![0.0; flat.len()];
        self.comm
            .all_gather(g, ax, &flat[me * c..(me + 1) * c], &mut out)?;
        Self::unflat(&mut self.weights, &keys, &out, (0, out.len()));
        Ok(())
    }

    /// Sums over the tensor axis the partial gradients of the weights that sequence
    /// parallelism (or a router under tensor-parallel experts) leaves partial: all of
    /// this rank's, or one segment copy's.
    fn seq_partial_reduce(
        &mut self,
        g: &Group,
        ax: &str,
        copy: Option<(usize, u64)>,
    ) -> Result<(), RankError> {
        let sp = self.plan.strategy.sp && self.tp.size > 1;
        let expert_tp = self.ep.size <= 1 && self.tp.size > 1;
        let partial: Vec<String> = self
            .graph
            .segments
            .iter()
            .enumerate()
            .filter(|(s, _)| copy.is_none_or(|(want, _)| want == *s))
            .flat_map(|(_, seg)| {
                meshplan_ir::graph::tp_partial_weights(self.graph, seg, sp, expert_tp)
            })
            .map(|w| self.graph.tensor(w).name.clone())
            .collect();
        let keys: Vec<Key> = self
            .weights
            .keys()
            .filter(|(name, layer)| partial.contains(name) && copy.is_none_or(|(_, l)| l == *layer))
            .cloned()
            .collect();
        let mut flat = self.flat(&self.wgrads, &keys);
        self.comm.all_reduce(g, ax, &mut flat)?;
        Self::unflat(&mut self.wgrads, &keys, &flat, (0, flat.len()));
        Ok(())
    }

    fn zero3_scatter(
        &mut self,
        g: &Group,
        ax: &str,
        seg: &str,
        set: &str,
        l: u64,
    ) -> Result<(), RankError> {
        let s = self.segment_index(seg)?;
        let keys = self.set_keys(set, Some((s, l)));
        let flat = self.flat(&self.wgrads, &keys);
        let n = g.size();
        let mut out = vec![0.0; flat.len() / n];
        self.comm.reduce_scatter(g, ax, &flat, &mut out)?;
        for key in &keys {
            if let Some(v) = self.wgrads.get_mut(key) {
                v.iter_mut().for_each(|x| *x = 0.0);
            }
        }
        let acc = self
            .shard_grads
            .entry((format!("{seg}.{set}"), l))
            .or_insert_with(|| vec![0.0; out.len()]);
        for (a, b) in acc.iter_mut().zip(&out) {
            *a += b;
        }
        Ok(())
    }

    /// After training, gather ZeRO-3 shards so the report holds every local weight.
    fn gather_zero3_for_report(&mut self) -> Result<(), RankError> {
        if self.plan.strategy.zero < 3 {
            return Ok(());
        }
        // Both sets, each over the group that shards it (experts over `edp`), or the
        // report holds the other ranks' slices as of the last gather, one update old.
        for (set, group) in [("dense", "dp"), ("experts", "edp")] {
            let Some(g) = self.groups.get(group).filter(|g| g.size() > 1).cloned() else {
                continue;
            };
            for (s, l) in self.copies()? {
                let seg = self.graph.segments[s].name.clone();
                if !self.set_keys(set, Some((s, l))).is_empty() {
                    self.zero3_gather(&g, "dp", &seg, set, l)?;
                }
            }
        }
        Ok(())
    }

    fn run_step(&mut self, step: &[Instr]) -> Result<(), RankError> {
        for instr in step {
            let t = self.tracer.begin();
            match instr {
                Instr::Collective {
                    kind,
                    group,
                    axis,
                    target,
                    ..
                } => {
                    let g = self.group(group)?;
                    let ax = axis.name();
                    let n = g.size();
                    let me = g.index_of(self.rank).unwrap_or(0);
                    if *target == Target::TiedGrads {
                        // The table embedding and head share, held by the first and
                        // the last stage: sum the two gradients.
                        let keys = self.tied_keys();
                        let mut flat = self.flat(&self.wgrads, &keys);
                        self.comm.all_reduce(&g, ax, &mut flat)?;
                        Self::unflat(&mut self.wgrads, &keys, &flat, (0, flat.len()));
                    } else if *target == Target::SeqPartialGrads {
                        self.seq_partial_reduce(&g, ax, None)?;
                    } else if let Target::GradBucket { set, range } = target {
                        let (set, range) = (set.name(), bucket_range(*range));
                        let keys = self.set_keys(set, None);
                        let mut flat = self.flat(&self.wgrads, &keys);
                        let (a, b) = range.unwrap_or((0, flat.len()));
                        if b > flat.len() || a > b || (b - a) % n != 0 {
                            return Err(fail(format!(
                                "bucket {a}..{b} of `{set}` does not fit {} parameters over {n} ranks",
                                flat.len()
                            )));
                        }
                        match kind {
                            CollectiveKind::AllReduce => {
                                self.comm.all_reduce(&g, ax, &mut flat[a..b])?;
                                Self::unflat(&mut self.wgrads, &keys, &flat, (a, b));
                            }
                            CollectiveKind::ReduceScatter => {
                                let c = (b - a) / n;
                                let mut out = vec![0.0; c];
                                self.comm.reduce_scatter(&g, ax, &flat[a..b], &mut out)?;
                                let mine = (a + me * c, a + (me + 1) * c);
                                self.reduced
                                    .entry(set.to_string())
                                    .or_default()
                                    .push((mine, out));
                            }
                            other => {
                                return Err(fail(format!(
                                    "{other:?} of gradients is not supported"
                                )))
                            }
                        }
                    } else if let Target::ParamBucket { set, range } = target {
                        let (set, range) = (set.name(), bucket_range(*range));
                        let keys = self.set_keys(set, None);
                        let mut flat = self.flat(&self.weights, &keys);
                        let (a, b) = range.unwrap_or((0, flat.len()));
                        if b > flat.len() || a > b || (b - a) % n != 0 {
                            return Err(fail(format!("bucket {a}..{b} of `{set}` does not fit")));
                        }
                        let c = (b - a) / n;
                        let mut out = vec![0.0; b - a];
                        let mine = flat[a + me * c..a + (me + 1) * c].to_vec();
                        self.comm.all_gather(&g, ax, &mine, &mut out)?;
                        flat[a..b].copy_from_slice(&out);
                        Self::unflat(&mut self.weights, &keys, &flat, (a, b));
                    } else {
                        return Err(fail(format!("unexpected step collective on `{target}`")));
                    }
                }
                Instr::Optimizer { params, .. } => self.optimizer(params.name())?,
                other => return Err(fail(format!("unexpected step instruction {other:?}"))),
            }
            self.tracer.end_instr(t, instr, self.step_no, NO_LAYER);
        }
        Ok(())
    }

    fn optimizer(&mut self, set: &str) -> Result<(), RankError> {
        let zero = self.plan.strategy.zero;
        let dpg = self.group(if set == "experts" { "edp" } else { "dp" })?;
        let n = dpg.size();
        let me = dpg.index_of(self.rank).unwrap_or(0);
        let step = self.step_no + 1;
        let (b1, b2, eps, wd) = crate::ckpt::ADAMW;
        let lr = self.opts.lr;
        if zero >= 3 && n > 1 {
            // Each segment copy's shard, in the order the copies run.
            for (s, l) in self.copies()? {
                let seg = self.graph.segments[s].name.clone();
                let keys = self.set_keys(set, Some((s, l)));
                if keys.is_empty() {
                    continue;
                }
                let mut flat = self.flat(&self.weights, &keys);
                let c = flat.len() / n;
                let grad = self
                    .shard_grads
                    .get(&(format!("{seg}.{set}"), l))
                    .cloned()
                    .unwrap_or_else(|| vec![0.0; c]);
                let name = format!("{set}@{seg}@{l}");
                let be = self.be;
                let (m, v) = self.adam_state(name, &keys, vec![(me * c, (me + 1) * c)])?;
                be.adamw_step(
                    &mut flat[me * c..(me + 1) * c],
                    &grad,
                    m,
                    v,
                    step,
                    lr,
                    b1,
                    b2,
                    eps,
                    wd,
                )
                .map_err(kerr("adamw"))?;
                Self::unflat(&mut self.weights, &keys, &flat, (me * c, (me + 1) * c));
            }
            return Ok(());
        }
        let keys = self.set_keys(set, None);
        if zero == 0 || n <= 1 {
            // Every weight whole on this rank: update each in place (the state is the
            // set's flat vector in key order, as the sharded path keeps it).
            let total: usize = keys
                .iter()
                .map(|k| self.weights.get(k).map_or(0, Vec::len))
                .sum();
            self.adam_state(set.to_string(), &keys, vec![(0, total)])?;
            let (mut m, mut v) = self
                .adam
                .remove(set)
                .ok_or_else(|| fail(format!("no AdamW state `{set}`")))?;
            let be = self.be;
            let mut off = 0;
            for k in &keys {
                let missing = || fail(format!("weight or gradient of `{}` missing", k.0));
                let w = self.weights.get_mut(k).ok_or_else(missing)?;
                let g = self.wgrads.get(k).ok_or_else(missing)?;
                let len = w.len();
                be.adamw_step(
                    w,
                    g,
                    &mut m[off..off + len],
                    &mut v[off..off + len],
                    step,
                    lr,
                    b1,
                    b2,
                    eps,
                    wd,
                )
                .map_err(kerr("adamw"))?;
                off += len;
            }
            self.adam.insert(set.to_string(), (m, v));
            return Ok(());
        }
        let mut flat = self.flat(&self.weights, &keys);
        // The slices this rank updates: its share of each bucket.
        let (parts, grad): (Vec<(usize, usize)>, Vec<f32>) = if zero >= 1 && n > 1 {
            let mut got = self
                .reduced
                .remove(set)
                .ok_or_else(|| fail(format!("no reduced gradients of `{set}`")))?;
            got.sort_by_key(|(r, _)| r.0);
            let parts = got.iter().map(|(r, _)| *r).collect();
            (parts, got.into_iter().flat_map(|(_, g)| g).collect())
        } else {
            (vec![(0, flat.len())], self.flat(&self.wgrads, &keys))
        };
        let mut own: Vec<f32> = parts
            .iter()
            .flat_map(|&(a, b)| flat[a..b].to_vec())
            .collect();
        let range = (0, own.len());
        let be = self.be;
        let (m, v) = self.adam_state(set.to_string(), &keys, parts.clone())?;
        be.adamw_step(
            &mut own[range.0..range.1],
            &grad,
            m,
            v,
            step,
            lr,
            b1,
            b2,
            eps,
            wd,
        )
        .map_err(kerr("adamw"))?;
        let mut off = 0;
        for &(a, b) in &parts {
            flat[a..b].copy_from_slice(&own[off..off + b - a]);
            off += b - a;
        }
        Self::unflat(&mut self.weights, &keys, &flat, (0, flat.len()));
        Ok(())
    }

    /// The AdamW state `name` over flat `parts` of `keys`' weights: zeros, or when
    /// resuming the checkpoint's moments of those parts.
    fn adam_state(
        &mut self,
        name: String,
        keys: &[Key],
        parts: Vec<Range>,
    ) -> Result<&mut (Vec<f32>, Vec<f32>), RankError> {
        if !self.adam.contains_key(&name) {
            let len: usize = parts.iter().map(|(a, b)| b - a).sum();
            let state = match &self.resume_adam {
                None => (vec![0.0; len], vec![0.0; len]),
                Some((rm, rv)) => {
                    let (fm, fv) = (self.flat(rm, keys), self.flat(rv, keys));
                    let take = |f: &[f32]| -> Result<Vec<f32>, RankError> {
                        let mut out = Vec::with_capacity(len);
                        for &(a, b) in &parts {
                            out.extend_from_slice(f.get(a..b).ok_or_else(|| {
                                fail(format!("resumed AdamW state of `{name}` lacks {a}..{b}"))
                            })?);
                        }
                        Ok(out)
                    };
                    (take(&fm)?, take(&fv)?)
                }
            };
            self.adam.insert(name.clone(), state);
            self.adam_parts.insert(name.clone(), (keys.to_vec(), parts));
        }
        self.adam
            .get_mut(&name)
            .ok_or_else(|| fail(format!("no AdamW state `{name}`")))
    }

    /// This rank's part of a checkpoint: the flat ranges its AdamW states cover, with
    /// the weights' values there (under ZeRO-3 the only up-to-date ones).
    fn snapshot(&self) -> Result<crate::ckpt::RankSnapshot, RankError> {
        let mut pieces = Vec::new();
        for (name, (keys, parts)) in &self.adam_parts {
            let (m, v) = self
                .adam
                .get(name)
                .ok_or_else(|| fail(format!("no AdamW state `{name}`")))?;
            let mut at = 0;
            for &(a, b) in parts {
                let mut off = 0;
                for key in keys {
                    let Some(w) = self.weights.get(key) else {
                        continue;
                    };
                    let (x, y) = (off.max(a), (off + w.len()).min(b));
                    if x < y {
                        let (i, j) = (at + x - a, at + y - a);
                        pieces.push(crate::ckpt::Piece {
                            key: key.clone(),
                            start: x - off,
                            w: w[x - off..y - off].to_vec(),
                            m: m[i..j].to_vec(),
                            v: v[i..j].to_vec(),
                        });
                    }
                    off += w.len();
                }
                at += b - a;
            }
        }
        Ok(crate::ckpt::RankSnapshot {
            tp: self.tp,
            ep: self.ep,
            pieces,
        })
    }
}

impl RankState<'_> {
    /// Routed experts (`crate::moe::forward`), keeping what the backward needs.
    fn experts_forward(
        &mut self,
        op: &Op,
        e: &meshplan_ir::graph::ExpertsShape,
        l: u64,
        store: &mut Store,
    ) -> Result<(), RankError> {
        crate::moe::check_split(&op.name, self.tp, self.ep, self.plan.strategy.sp)?;
        // Split over tp under sequence parallelism, the experts read the gathered
        // tokens and router scores.
        let x = self.act_gathered(store, l, op.inputs[0])?;
        let logits = self.act_gathered(store, l, op.inputs[1])?;
        let sizes = (self.cp.size, self.tp.size, self.ep.size);
        let group = crate::moe::group_tokens(self.opts.moe_group_tokens, self.seq_len, sizes);
        let ep_group = self.ep_group()?;
        let place = crate::moe::Place {
            tp: self.tp,
            ep: self.ep,
            group: ep_group.as_ref(),
        };
        let (ku, kd) = (self.wkey(op.inputs[2], l), self.wkey(op.inputs[3], l));
        let missing = || fail(format!("{}: expert weights missing", op.name));
        let inputs = crate::moe::Inputs {
            x: &x,
            logits: &logits,
            w_up: self.weights.get(&ku).ok_or_else(missing)?,
            w_down: self.weights.get(&kd).ok_or_else(missing)?,
        };
        let routing = crate::moe::Routing {
            group_tokens: Some(group),
            even: true,
        };
        let (out, kept) = crate::moe::forward(
            self.be,
            &mut self.comm,
            &place,
            &op.name,
            e,
            &inputs,
            routing,
        )?;
        self.expert_slots.0 += kept.perm.len() as u64;
        if let Some(p) = &kept.padding {
            self.expert_slots.1 += p.at.iter().filter(|&&a| a == Padding::DROPPED).count() as u64;
        }
        store.experts.insert((l, op.name.clone()), kept);
        store.put((l, self.out_name(op)), out);
        Ok(())
    }

    /// The expert group, when the experts are split over ranks.
    fn ep_group(&self) -> Result<Option<Group>, RankError> {
        if self.ep.size > 1 {
            self.group("ep").map(Some)
        } else {
            Ok(None)
        }
    }

    fn experts_backward(
        &mut self,
        op: &Op,
        e: &meshplan_ir::graph::ExpertsShape,
        l: u64,
        store: &mut Store,
        dy: &[f32],
    ) -> Result<(), RankError> {
        let (h, f, ne, kk) = crate::moe::dims(e, self.tp, self.ep);
        let crate::moe::ExpertsKept {
            probs,
            idx,
            wts,
            perm,
            local_rows,
            local_counts,
            ups,
            acts,
            y_disp,
            route,
            padding,
        } = store.experts.remove(&(l, op.name.clone())).ok_or_else(|| {
            fail(format!(
                "{} (layer {l}): forward state was not kept",
                op.name
            ))
        })?;
        let rows = dy.len() / h;
        let mut d_y = vec![0.0; y_disp.len()];
        let mut d_w = vec![0.0; wts.len()];
        self.be
            .moe_combine_bwd(dy, &y_disp, &perm, &wts, rows, kk, h, &mut d_y, &mut d_w)
            .map_err(kerr(&op.name))?;
        // Gradients of the expert outputs travel to the experts as the tokens did.
        let d_y = match &padding {
            Some(p) => p.pad(&d_y, h)?,
            None => d_y,
        };
        let ep_group = self.ep_group()?;
        let place = crate::moe::Place {
            tp: self.tp,
            ep: self.ep,
            group: ep_group.as_ref(),
        };
        let d_local = crate::moe::resend(&mut self.comm, &place, &d_y, &route, h)?;
        let gated = e.mlp == meshplan_ir::MlpKind::Swiglu;
        let up_w = if gated { 2 * f } else { f };
        let (ku, kd) = (self.wkey(op.inputs[2], l), self.wkey(op.inputs[3], l));
        let missing = || fail(format!("{}: expert weights or gradients missing", op.name));
        let mut d_rows = vec![0.0; local_rows.len()];
        let mut off = 0;
        for (j, &n) in local_counts.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let dyr = &d_local[off * h..(off + n) * h];
            let act = &acts[off * f..(off + n) * f];
            let up = &ups[off * up_w..(off + n) * up_w];
            let xr = &local_rows[off * h..(off + n) * h];
            // Distinct fields: weights read, their gradients written, no copies.
            let w_down = self.weights.get(&kd).ok_or_else(missing)?;
            let gd = self.wgrads.get_mut(&kd).ok_or_else(missing)?;
            let mut d_act = vec![0.0; n * f];
            linear_bwd(
                self.be,
                act,
                &w_down[j * f * h..(j + 1) * f * h],
                dyr,
                n,
                f,
                h,
                &mut d_act,
                &mut gd[j * f * h..(j + 1) * f * h],
            )
            .map_err(kerr(&op.name))?;
            let mut d_up = vec![0.0; n * up_w];
            if gated {
                self.be
                    .swiglu_bwd(up, &d_act, n, f, &mut d_up)
                    .map_err(kerr(&op.name))?;
            } else {
                self.be
                    .gelu_bwd(up, &d_act, &mut d_up)
                    .map_err(kerr(&op.name))?;
            }
            let w_up = self.weights.get(&ku).ok_or_else(missing)?;
            let gu = self.wgrads.get_mut(&ku).ok_or_else(missing)?;
            linear_bwd(
                self.be,
                xr,
                &w_up[j * h * up_w..(j + 1) * h * up_w],
                &d_up,
                n,
                h,
                up_w,
                &mut d_rows[off * h..(off + n) * h],
                &mut gu[j * h * up_w..(j + 1) * h * up_w],
            )
            .map_err(kerr(&op.name))?;
            off += n;
        }
        let d_disp = crate::moe::send_back(&mut self.comm, &place, &d_rows, &route, h)?;
        let d_disp = match &padding {
            Some(p) => p.unpad(&d_disp, h)?,
            None => d_disp,
        };
        let mut dx = vec![0.0; rows * h];
        self.be
            .moe_dispatch_bwd(&d_disp, &perm, rows, kk, h, &mut dx)
            .map_err(kerr(&op.name))?;
        let mut d_logits = vec![0.0; rows * ne];
        self.be
            .moe_route_bwd(&probs, &idx, &wts, &d_w, rows, ne, kk, true, &mut d_logits)
            .map_err(kerr(&op.name))?;
        let x_name = self.graph.tensor(op.inputs[0]).name.clone();
        let g_name = self.graph.tensor(op.inputs[1]).name.clone();
        // Split over tp, each rank's experts give a partial input gradient (and,
        // under sequence parallelism, partial router scores for every token: the
        // plan reduce-scatters them before the router's backward).
        let (x_key, g_key) = if self.ep.size == 1 && self.tp.size > 1 {
            let g_key = if self.plan.strategy.sp {
                format!("{g_name}@p")
            } else {
                g_name
            };
            (format!("{x_name}@p"), g_key)
        } else {
            (x_name, g_name)
        };
        Self::add_grad_vec(self.be, store, l, &x_key, dx);
        Self::add_grad_vec(self.be, store, l, &g_key, d_logits);
        Ok(())
    }

    /// The context-parallel ring: this rank's queries meet every rank's key/value
    /// block in turn (its own first), each block passed on to the next rank while
    /// partial results merge by log-sum-exp.
    #[allow(clippy::too_many_arguments)] // the attention kernel's own arguments
    fn ring_forward(
        &mut self,
        dims: &k::AttnDims,
        q: &[f32],
        kk: &[f32],
        v: &[f32],
        causal: bool,
        scale: f32,
        o: &mut [f32],
        lse: &mut [f32],
        dropout: Option<&k::Dropout<'_>>,
    ) -> Result<(), RankError> {
        let g = self.group("cp")?;
        let n = g.size();
        let me = g
            .index_of(self.rank)
            .ok_or_else(|| fail("not in my cp group"))?;
        let s_l = self.seq_len / n;
        let (next, prev) = (g.ranks[(me + 1) % n], g.ranks[(me + n - 1) % n]);
        o.iter_mut().for_each(|x| *x = 0.0);
        lse.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
        let mut block: Vec<f32> = kk.iter().chain(v).copied().collect();
        let split = kk.len();
        for t in 0..n {
            let owner = (me + n - t) % n;
            let mut ob = vec![0.0; o.len()];
            let mut lb = vec![0.0; lse.len()];
            self.be
                .attention_fwd(
                    dims,
                    q,
                    &block[..split],
                    &block[split..],
                    me * s_l,
                    owner * s_l,
                    causal,
                    scale,
                    &mut ob,
                    &mut lb,
                    dropout,
                )
                .map_err(kerr("ring attention"))?;
            self.be
                .attention_merge(dims, o, lse, &ob, &lb)
                .map_err(kerr("ring attention"))?;
            if t + 1 < n {
                self.comm.send(next, "cp", &block)?;
                self.comm.recv(prev, "cp", &mut block)?;
            }
        }
        Ok(())
    }

    /// The ring's backward: key/value blocks go round again; each rank sends the
    /// gradient it computed for every other rank's block straight to its owner, which
    /// adds them in rank order.
    #[allow(clippy::too_many_arguments)] // the attention kernel's own arguments
    fn ring_backward(
        &mut self,
        dims: &k::AttnDims,
        q: &[f32],
        kk: &[f32],
        v: &[f32],
        o: &[f32],
        lse: &[f32],
        d_o: &[f32],
        causal: bool,
        scale: f32,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        dropout: Option<&k::Dropout<'_>>,
    ) -> Result<(), RankError> {
        let g = self.group("cp")?;
        let n = g.size();
        let me = g
            .index_of(self.rank)
            .ok_or_else(|| fail("not in my cp group"))?;
        let s_l = self.seq_len / n;
        let (next, prev) = (g.ranks[(me + 1) % n], g.ranks[(me + n - 1) % n]);
        let split = kk.len();
        let mut block: Vec<f32> = kk.iter().chain(v).copied().collect();
        let mut grads = vec![vec![0.0f32; block.len()]; n];
        for t in 0..n {
            let owner = (me + n - t) % n;
            let (gk, gv) = grads[owner].split_at_mut(split);
            self.be
                .attention_bwd(
                    dims,
                    q,
                    &block[..split],
                    &block[split..],
                    o,
                    lse,
                    d_o,
                    me * s_l,
                    owner * s_l,
                    causal,
                    scale,
                    dq,
                    gk,
                    gv,
                    dropout,
                )
                .map_err(kerr("ring attention"))?;
            if t + 1 < n {
                self.comm.send(next, "cp", &block)?;
                self.comm.recv(prev, "cp", &mut block)?;
            }
        }
        for (j, gj) in grads.iter().enumerate() {
            if j != me {
                self.comm.send(g.ranks[j], "cp", gj)?;
            }
        }
        let mut total = grads[me].clone();
        let mut buf = vec![0.0f32; total.len()];
        for j in 0..n {
            if j != me {
                self.comm.recv(g.ranks[j], "cp", &mut buf)?;
                for (a, b) in total.iter_mut().zip(&buf) {
                    *a += b;
                }
            }
        }
        for (a, b) in dk.iter_mut().zip(&total[..split]) {
            *a += b;
        }
        for (a, b) in dv.iter_mut().zip(&total[split..]) {
            *a += b;
        }
        Ok(())
    }

    fn matmul_dims(&self, op: &Op, w_len: usize) -> Result<(usize, usize), RankError> {
        let shape = fixed_shape(self.graph.tensor(op.inputs[1]))?;
        let (kf, nf) = if crate::shard::weight_transposed(op) {
            (shape[1], shape[0])
        } else {
            (shape[0], shape[1])
        };
        let t = self.tp.size;
        Ok(match op.role {
            TpRole::RowParallel => (kf / t, nf),
            _ => (kf, w_len / kf.max(1)),
        })
    }

    fn consumer_attention(&self, op: &Op) -> Result<&Op, RankError> {
        self.graph
            .attention_fed_by(op)
            .ok_or_else(|| fail("rope feeds no attention op"))
    }

    fn qkv_width(&self, att: &Op) -> Result<usize, RankError> {
        let OpKind::Attention(a) = &att.kind else {
            return Err(fail("not attention"));
        };
        let (hq, hkv, _) = if att.role == TpRole::Replicated {
            (a.heads as usize, a.kv_heads as usize, 0)
        } else {
            local_heads(a.heads, a.kv_heads, self.tp)
        };
        Ok(hq * a.qk_dim as usize + hkv * a.qk_dim as usize + hkv * a.v_dim as usize)
    }

    fn swiglu_width(&self, op: &Op) -> Result<usize, RankError> {
        let t = self.graph.tensor(op.outputs[0]);
        let full = *fixed_shape_tail(t).last().unwrap_or(&1);
        Ok(if op.role == TpRole::Replicated {
            full
        } else {
            full / self.tp.size
        })
    }

    /// Rotates the query and key heads of a fused QKV row block (or, backward, their
    /// gradients by the inverse rotation).
    fn rope(
        &self,
        att: &Op,
        x: &[f32],
        rows: usize,
        backward: bool,
    ) -> Result<Vec<f32>, RankError> {
        let OpKind::Attention(a) = &att.kind else {
            return Err(fail("not attention"));
        };
        let (hq, hkv, _) = if att.role == TpRole::Replicated {
            (a.heads as usize, a.kv_heads as usize, 0)
        } else {
            local_heads(a.heads, a.kv_heads, self.tp)
        };
        let d = a.qk_dim as usize;
        let width = self.qkv_width(att)?;
        let b = self.mbs;
        let pos0 = self.cp.rank * self.seq_len / self.cp.size;
        let positions: Vec<u32> = (0..rows).map(|r| (pos0 + r / b) as u32).collect();
        let rope = crate::rope_of(&self.graph.constants);
        rope_qkv_host(
            self.be,
            x,
            &positions,
            rows,
            (hq, hkv, d, width),
            rope,
            backward,
        )
        .map_err(kerr(&att.name))
    }

    fn backward_op(&mut self, op: &Op, l: u64, store: &mut Store) -> Result<(), RankError> {
        let out = self.out_name(op);
        let dy = store.grads.get(&(l, out.clone())).cloned();
        let in_name = |i: usize| self.graph.tensor(op.inputs[i]).name.clone();
        match &op.kind {
            OpKind::CrossEntropy { .. } => {
                let logits = self.act(store, l, op.inputs[0])?;
                let labels = self.act(store, l, op.inputs[1])?;
                let rows = labels.len();
                let v_local = logits.len() / rows.max(1);
                let get = |what: &str| store.kept(l, &format!("{}.{what}", op.name));
                let (max, se) = (get("max")?, get("sum_exp")?);
                let lab: Vec<u32> = labels.iter().map(|&x| x as u32).collect();
                let start = self.loss_vocab_start(op, v_local);
                let scale = self.loss_scale() as f32;
                let mut d = vec![0.0; logits.len()];
                self.be
                    .ce_bwd(
                        &logits, rows, v_local, &max, &se, &lab, start, scale, &mut d,
                    )
                    .map_err(kerr(&op.name))?;
                Self::add_grad_vec(self.be, store, l, &in_name(0), d);
            }
            _ => {
                let Some(dy) = dy else {
                    // Nothing downstream used this output.
                    return Ok(());
                };
                self.backward_op_with(op, l, store, &dy)?;
            }
        }
        Ok(())
    }

    fn backward_op_with(
        &mut self,
        op: &Op,
        l: u64,
        store: &mut Store,
        dy: &[f32],
    ) -> Result<(), RankError> {
        let in_name = |i: usize| self.graph.tensor(op.inputs[i]).name.clone();
        match &op.kind {
            OpKind::Embedding => {
                let ids = self.lookup_ids(op, self.act(store, l, op.inputs[0])?);
                let dim = *fixed_shape(self.graph.tensor(op.inputs[1]))?
                    .last()
                    .unwrap_or(&1);
                let rows = dy.len() / dim;
                let (vocab_start, ids) = self.embedding_rows(op, &ids, rows)?;
                let ids: Vec<u32> = ids.iter().map(|&x| x as u32).collect();
                let key = self.wkey(op.inputs[1], l);
                let dt = self
                    .wgrads
                    .get_mut(&key)
                    .ok_or_else(|| fail("embedding gradient missing"))?;
                self.be
                    .embedding_bwd(&ids, dy, vocab_start, dim, dt)
                    .map_err(kerr(&op.name))?;
            }
            OpKind::Norm(kind) => {
                let x = self.act(store, l, op.inputs[0])?;
                let w = self.weight(op.inputs[1], l)?.clone();
                let dim = w.len();
                let rows = x.len() / dim;
                let rstd = store.stat(l, &op.name, Stat::Rstd)?;
                let mut dx = vec![0.0; x.len()];
                let wkey = self.wkey(op.inputs[1], l);
                let mut dw = self
                    .wgrads
                    .get(&wkey)
                    .cloned()
                    .ok_or_else(|| fail("norm gradient missing"))?;
                match kind {
                    NormKind::Rmsnorm => self
                        .be
                        .rmsnorm_bwd(&x, &w, &rstd, dy, rows, dim, &mut dx, &mut dw)
                        .map_err(kerr(&op.name))?,
                    NormKind::Layernorm => {
                        let mean = store.stat(l, &op.name, Stat::Mean)?;
                        let mut db = match op.inputs.get(2) {
                            Some(&b) => self
                                .wgrads
                                .get(&self.wkey(b, l))
                                .cloned()
                                .unwrap_or_else(|| vec![0.0; dim]),
                            None => vec![0.0; dim],
                        };
                        self.be
                            .layernorm_bwd(
                                &x, &w, &mean, &rstd, dy, rows, dim, &mut dx, &mut dw, &mut db,
                            )
                            .map_err(kerr(&op.name))?;
                        if let Some(&b) = op.inputs.get(2) {
                            let bk = self.wkey(b, l);
                            self.wgrads.insert(bk, db);
                        }
                    }
                }
                self.wgrads.insert(wkey, dw);
                Self::add_grad_vec(self.be, store, l, &in_name(0), dx);
            }
            OpKind::Matmul { .. } => {
                let gathered = matches!(op.role, TpRole::ColumnParallel | TpRole::VocabHead);
                let x = if gathered {
                    self.act_gathered(store, l, op.inputs[0])?
                } else {
                    self.act(store, l, op.inputs[0])?
                };
                let wkey = self.wkey(op.inputs[1], l);
                // Distinct fields: the weight read, its gradient written, no copy.
                let missing = || fail(format!("{}: weight or gradient missing", op.name));
                let w_len = self.weights.get(&wkey).ok_or_else(missing)?.len();
                let (kk, n) = self.matmul_dims(op, w_len)?;
                let w = self.weights.get(&wkey).ok_or_else(missing)?;
                let dw = self.wgrads.get_mut(&wkey).ok_or_else(missing)?;
                let rows = x.len() / kk.max(1);
                let mut dx = vec![0.0; rows * kk];
                if crate::shard::weight_transposed(op) {
                    // `y = x wᵀ` with `w [n, k]`: `dx = dy w`, `dw += dyᵀ x`.
                    let be = self.be;
                    be.matmul(
                        k::Transpose::No,
                        k::Transpose::No,
                        rows,
                        n,
                        kk,
                        dy,
                        w,
                        0.0,
                        &mut dx,
                    )
                    .and_then(|()| {
                        be.matmul(
                            k::Transpose::Yes,
                            k::Transpose::No,
                            n,
                            rows,
                            kk,
                            dy,
                            &x,
                            1.0,
                            dw,
                        )
                    })
                    .map_err(kerr(&op.name))?;
                } else {
                    linear_bwd(self.be, &x, w, dy, rows, kk, n, &mut dx, dw)
                        .map_err(kerr(&op.name))?;
                }
                if let Some(&b) = op.inputs.get(2) {
                    let bk = self.wkey(b, l);
                    if let Some(db) = self.wgrads.get_mut(&bk) {
                        for r in 0..rows {
                            for c in 0..n {
                                db[c] += dy[r * n + c];
                            }
                        }
                    }
                }
                // A split op's input gradient is partial until the program reduces it;
                // so is a router's when the experts it feeds are split over tp (under
                // sequence parallelism its scores' gradient arrives reduced instead).
                let name = in_name(0);
                let router_of_split_experts = self.ep.size <= 1
                    && self.tp.size > 1
                    && !self.plan.strategy.sp
                    && op.outputs.first().is_some_and(|out| {
                        self.graph.segments.iter().flat_map(|s| &s.ops).any(|o| {
                            matches!(o.kind, OpKind::Experts(_)) && o.inputs.get(1) == Some(out)
                        })
                    });
                if (gathered || router_of_split_experts) && self.tp.size > 1 {
                    Self::add_grad_vec(self.be, store, l, &format!("{name}@p"), dx);
                } else {
                    Self::add_grad_vec(self.be, store, l, &name, dx);
                }
            }
            OpKind::Rope => {
                let att = self.consumer_attention(op)?;
                let rows = dy.len() / self.qkv_width(att)?;
                let dx = self.rope(att, dy, rows, true)?;
                Self::add_grad_vec(self.be, store, l, &in_name(0), dx);
            }
            OpKind::Attention(a) => {
                let x = self.act(store, l, op.inputs[0])?;
                let width = self.qkv_width(op)?;
                let rows = x.len() / width;
                let (dims, hq, hkv) = self.attention_dims(op, rows)?;
                let (q, kk, v) = split_qkv(&x, rows, hq, hkv, dims.d, dims.dv, self.mbs);
                let o = store.kept(l, &format!("{}#o", op.name))?;
                let lse = store.stat(l, &op.name, Stat::Lse)?;
                let d_o = sbhd_to_bshd(dy, self.mbs, dims.sq, hq * dims.dv);
                let mut dq = vec![0.0; q.len()];
                let mut dk = vec![0.0; kk.len()];
                let mut dv = vec![0.0; v.len()];
                let keep = self.attention_keep(op, l);
                let dropout = keep.as_ref().map(|(p, f)| k::Dropout { p: *p, keep: f });
                let pos0 = self.cp.rank * self.seq_len / self.cp.size;
                let scale = 1.0 / (a.qk_dim as f32).sqrt();
                if self.cp.size > 1 {
                    self.ring_backward(
                        &dims,
                        &q,
                        &kk,
                        &v,
                        &o,
                        &lse,
                        &d_o,
                        a.causal,
                        scale,
                        &mut dq,
                        &mut dk,
                        &mut dv,
                        dropout.as_ref(),
                    )?;
                } else {
                    self.be
                        .attention_bwd(
                            &dims,
                            &q,
                            &kk,
                            &v,
                            &o,
                            &lse,
                            &d_o,
                            pos0,
                            pos0,
                            a.causal,
                            scale,
                            &mut dq,
                            &mut dk,
                            &mut dv,
                            dropout.as_ref(),
                        )
                        .map_err(kerr(&op.name))?;
                }
                let dx = join_qkv(&dq, &dk, &dv, rows, hq, hkv, dims.d, dims.dv, self.mbs);
                Self::add_grad_vec(self.be, store, l, &in_name(0), dx);
            }
            OpKind::Activation(kind) => {
                let x = self.act(store, l, op.inputs[0])?;
                let mut dx = vec![0.0; x.len()];
                match kind {
                    meshplan_ir::MlpKind::Swiglu => {
                        let f = self.swiglu_width(op)?;
                        let rows = x.len() / (2 * f);
                        self.be
                            .swiglu_bwd(&x, dy, rows, f, &mut dx)
                            .map_err(kerr(&op.name))?;
                    }
                    meshplan_ir::MlpKind::Gelu => {
                        self.be.gelu_bwd(&x, dy, &mut dx).map_err(kerr(&op.name))?
                    }
                }
                Self::add_grad_vec(self.be, store, l, &in_name(0), dx);
            }
            OpKind::Add => {
                Self::add_grad(self.be, store, l, &in_name(0), dy);
                Self::add_grad(self.be, store, l, &in_name(1), dy);
            }
            OpKind::Dropout => {
                let mask = store.kept(l, &format!("{}#mask", op.name))?;
                let dx: Vec<f32> = dy.iter().zip(mask.iter()).map(|(g, m)| g * m).collect();
                Self::add_grad_vec(self.be, store, l, &in_name(0), dx);
            }
            OpKind::CrossEntropy { .. } => {}
            OpKind::Experts(e) => self.experts_backward(op, e, l, store, dy)?,
            OpKind::Router { .. } => {
                return Err(fail("a separate router op is not run by the CPU executor"))
            }
        }
        Ok(())
    }
}

/// A `[start, end)` range of a flat parameter set.
type Range = (usize, usize);

/// A rank's reduced share of one gradient bucket: its flat range and the values.
type Shard = (Range, Vec<f32>);

/// `dense[0..4096]` -> (`dense`, Some((0, 4096))); `dense` -> (`dense`, None).
fn bucket_range(range: Option<(u64, u64)>) -> Option<Range> {
    range.map(|(a, b)| (a as usize, b as usize))
}

/// `y = x w`: `x [rows, k]`, `w [k, n]`, `y [rows, n]` overwritten.
pub(crate) fn linear_fwd(
    be: &dyn Backend,
    x: &[f32],
    w: &[f32],
    rows: usize,
    k: usize,
    n: usize,
    y: &mut [f32],
) -> Result<(), k::KernelError> {
    be.matmul(k::Transpose::No, k::Transpose::No, rows, k, n, x, w, 0.0, y)
}

/// The backward of [`linear_fwd`]: `dx = dy wᵀ` (overwritten) and `dw += xᵀ dy`.
#[allow(clippy::too_many_arguments)] // the product's operands and their gradients
fn linear_bwd(
    be: &dyn Backend,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    rows: usize,
    k: usize,
    n: usize,
    dx: &mut [f32],
    dw: &mut [f32],
) -> Result<(), k::KernelError> {
    be.matmul(
        k::Transpose::No,
        k::Transpose::Yes,
        rows,
        n,
        k,
        dy,
        w,
        0.0,
        dx,
    )?;
    be.matmul(
        k::Transpose::Yes,
        k::Transpose::No,
        k,
        rows,
        n,
        x,
        dy,
        1.0,
        dw,
    )
}

/// The full shape of a weight (its dims are fixed).
pub(crate) fn fixed_shape(t: &meshplan_ir::Tensor) -> Result<Vec<usize>, RankError> {
    t.shape
        .iter()
        .map(|d| match d {
            meshplan_ir::Dim::Fixed(n) => Ok(*n as usize),
            other => Err(fail(format!("`{}` has a symbolic dim {other:?}", t.name))),
        })
        .collect()
}

/// The fixed trailing dims of an activation.
pub(crate) fn fixed_shape_tail(t: &meshplan_ir::Tensor) -> Vec<usize> {
    t.shape
        .iter()
        .filter_map(|d| match d {
            meshplan_ir::Dim::Fixed(n) => Some(*n as usize),
            _ => None,
        })
        .collect()
}

/// A segment's input activation (what the previous segment produced).
pub(crate) fn segment_input(graph: &Graph, s: usize) -> Option<String> {
    let seg = &graph.segments[s];
    let produced: Vec<_> = seg
        .ops
        .iter()
        .flat_map(|o| o.outputs.iter().copied())
        .collect();
    seg.ops
        .iter()
        .flat_map(|o| o.inputs.iter().copied())
        .find(|t| {
            let tensor = graph.tensor(*t);
            tensor.kind == TensorKind::Activation && !produced.contains(t)
        })
        .map(|t| graph.tensor(t).name.clone())
}

/// A segment's output activation (the residual stream it hands on).
pub(crate) fn segment_output(graph: &Graph, s: usize) -> Option<String> {
    let seg = &graph.segments[s];
    if seg.kind == SegmentKind::Head {
        return None;
    }
    seg.ops
        .last()
        .and_then(|o| o.outputs.first())
        .map(|&t| graph.tensor(t).name.clone())
}

/// The part of `v` a rank sends when a boundary is scattered over the tensor axis.
fn slice_for(v: &[f32], n: usize, tp: TpPos) -> Result<Vec<f32>, RankError> {
    if n == v.len() {
        return Ok(v.to_vec());
    }
    if n * tp.size != v.len() {
        return Err(fail(format!(
            "a boundary of {} values cannot be sent as {n} per rank over tp={}",
            v.len(),
            tp.size
        )));
    }
    Ok(v[tp.rank * n..(tp.rank + 1) * n].to_vec())
}

/// `[s, b, (hq d | hkv d | hkv dv)]` rows into `q [b, s, hq, d]`, `k`, `v`.
pub(crate) fn split_qkv(
    x: &[f32],
    rows: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    dv: usize,
    b: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let s = rows / b.max(1);
    let width = hq * d + hkv * d + hkv * dv;
    let mut q = vec![0.0; b * s * hq * d];
    let mut kk = vec![0.0; b * s * hkv * d];
    let mut v = vec![0.0; b * s * hkv * dv];
    for si in 0..s {
        for bi in 0..b {
            let row = &x[(si * b + bi) * width..(si * b + bi + 1) * width];
            let t = bi * s + si;
            q[t * hq * d..(t + 1) * hq * d].copy_from_slice(&row[..hq * d]);
            kk[t * hkv * d..(t + 1) * hkv * d].copy_from_slice(&row[hq * d..hq * d + hkv * d]);
            v[t * hkv * dv..(t + 1) * hkv * dv].copy_from_slice(&row[hq * d + hkv * d..]);
        }
    }
    (q, kk, v)
}

#[allow(clippy::too_many_arguments)] // the inverse of `split_qkv`, same shape arguments
pub(crate) fn join_qkv(
    dq: &[f32],
    dk: &[f32],
    dv: &[f32],
    rows: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    dvw: usize,
    b: usize,
) -> Vec<f32> {
    let s = rows / b.max(1);
    let width = hq * d + hkv * d + hkv * dvw;
    let mut x = vec![0.0; rows * width];
    for si in 0..s {
        for bi in 0..b {
            let t = bi * s + si;
            let row = &mut x[(si * b + bi) * width..(si * b + bi + 1) * width];
            row[..hq * d].copy_from_slice(&dq[t * hq * d..(t + 1) * hq * d]);
            row[hq * d..hq * d + hkv * d].copy_from_slice(&dk[t * hkv * d..(t + 1) * hkv * d]);
            row[hq * d + hkv * d..].copy_from_slice(&dv[t * hkv * dvw..(t + 1) * hkv * dvw]);
        }
    }
    x
}

pub(crate) fn bshd_to_sbhd(x: &[f32], b: usize, s: usize, w: usize) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    for bi in 0..b {
        for si in 0..s {
            y[(si * b + bi) * w..(si * b + bi + 1) * w]
                .copy_from_slice(&x[(bi * s + si) * w..(bi * s + si + 1) * w]);
        }
    }
    y
}

pub(crate) fn sbhd_to_bshd(x: &[f32], b: usize, s: usize, w: usize) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    for bi in 0..b {
        for si in 0..s {
            y[(bi * s + si) * w..(bi * s + si + 1) * w]
                .copy_from_slice(&x[(si * b + bi) * w..(si * b + bi + 1) * w]);
        }
    }
    y
}

/// RoPE on the query and key heads of fused QKV rows `[rows, width]` (`shape`:
/// query heads, key/value heads, head dim, row width), the value columns copied;
/// with `backward`, the inverse rotation of a gradient.
pub(crate) fn rope_qkv_host(
    be: &dyn Backend,
    x: &[f32],
    positions: &[u32],
    rows: usize,
    (hq, hkv, d, width): (usize, usize, usize, usize),
    rope: Rope,
    backward: bool,
) -> Result<Vec<f32>, k::KernelError> {
    let mut y = x.to_vec();
    for (start, heads) in [(0, hq), (hq * d, hkv)] {
        let mut part = vec![0.0; rows * heads * d];
        for r in 0..rows {
            part[r * heads * d..(r + 1) * heads * d]
                .copy_from_slice(&x[r * width + start..r * width + start + heads * d]);
        }
        let mut out = vec![0.0; part.len()];
        if backward {
            be.rope_bwd(&part, positions, rows, heads, d, rope, &mut out)?;
        } else {
            be.rope_fwd(&part, positions, rows, heads, d, rope, &mut out)?;
        }
        for r in 0..rows {
            y[r * width + start..r * width + start + heads * d]
                .copy_from_slice(&out[r * heads * d..(r + 1) * heads * d]);
        }
    }
    Ok(y)
}

/// Every copy of a segment a phase's chunks run, in order: (segment index, block
/// layer or `None` outside the blocks). Both interpreters hold weights per copy.
pub(crate) fn segment_copies(
    graph: &Graph,
    phase: &meshplan_ir::plan::Phase,
) -> Result<Vec<(usize, Option<u64>)>, RankError> {
    let mut out = Vec::new();
    for ch in &phase.chunks {
        let mut layer = ch.layer_start;
        for instr in &ch.forward {
            if let Instr::Segment {
                name, kind, repeat, ..
            } = instr
            {
                let s = segment_index(graph, name)?;
                for _ in 0..*repeat {
                    if *kind == SegmentKind::Block {
                        out.push((s, Some(layer)));
                        layer += 1;
                    } else {
                        out.push((s, None));
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The index of segment `name` in the plan's graph.
pub(crate) fn segment_index(graph: &Graph, name: &str) -> Result<usize, RankError> {
    graph
        .segments
        .iter()
        .position(|s| s.name == name)
        .ok_or_else(|| fail(format!("segment `{name}` is not in the plan's graph")))
}

/// The communication groups of `rank`, by name (see the plan format's rule).
pub(crate) fn build_groups(plan: &Plan, rank: usize) -> Result<BTreeMap<String, Group>, RankError> {
    let axes = &plan.mesh.axes;
    let shape = &plan.mesh.shape;
    let me = plan
        .ranks
        .get(rank)
        .ok_or_else(|| fail(format!("rank {rank} missing")))?;
    let mut out = BTreeMap::new();
    for g in &plan.mesh.groups {
        let over: Vec<usize> = g
            .over
            .iter()
            .filter_map(|a| axes.iter().position(|x| x == a))
            .collect();
        let flat_of = |coords: &[u64]| -> u64 {
            over.iter().fold(0u64, |acc, &i| acc * shape[i] + coords[i])
        };
        let x = flat_of(&me.coords);
        let (size, stride) = (g.size.max(1), g.stride.max(1));
        let digit = (x / stride) % size;
        let base = x - digit * stride;
        let mut members: Vec<(u64, usize)> = Vec::new();
        for r in &plan.ranks {
            let same_elsewhere = (0..axes.len())
                .filter(|i| !over.contains(i))
                .all(|i| r.coords[i] == me.coords[i]);
            if !same_elsewhere {
                continue;
            }
            let y = flat_of(&r.coords);
            let d = (y / stride) % size;
            if y == base + d * stride {
                members.push((d, r.rank as usize));
            }
        }
        members.sort();
        let ranks: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
        out.insert(
            g.name.clone(),
            Group::new(format!("{}:{:?}", g.name, ranks), ranks),
        );
    }
    Ok(out)
}

/// Largest distance allowed between a rank's final weight tensor and the reference's
/// same slice, as the root mean square of the element differences over the farthest
/// an AdamW update can move one element in the run (`lr` per step, times the steps).
///
/// A per-element bound measures the optimizer, not the run: AdamW divides each
/// gradient by its own running magnitude, so where a gradient sums to nearly zero the
/// rounding of a sharded sum (another order of the same additions) flips its sign and
/// moves that element by up to `2 lr` per step (the old 1e-4 per-element bound failed
/// correct runs so). Measured over the generated mode matrix (`tests/it/matrix.rs`:
/// 141 configurations, 5 steps at lr 3e-3), correct runs stay at or under 3.9e-4;
/// the wrong runs it caught measure 0.685 (sequence-parallel norm gradients not
/// summed under ZeRO-3, whose losses stayed within 7.3e-6) and 0.093 (ZeRO-3 expert
/// weights reported one update old).
pub const PARAM_TOLERANCE: f64 = 1e-2;

/// ` layer L` for a weight of a repeated block, nothing for one outside them.
pub(crate) fn layer_label(layer: u64) -> String {
    if layer == NO_LAYER {
        String::new()
    } else {
        format!(" layer {layer}")
    }
}

/// One weight tensor of one rank against the reference: `(rms of the differences,
/// largest difference, its index)`.
pub fn tensor_distance(local: &[f32], want: &[f32]) -> (f64, f64, usize) {
    let (mut sum2, mut worst, mut at) = (0.0f64, 0.0f64, 0usize);
    for (i, (a, b)) in local.iter().zip(want).enumerate() {
        let d = (a - b).abs() as f64;
        sum2 += d * d;
        if d > worst || d.is_nan() {
            (worst, at) = (d, i);
        }
    }
    ((sum2 / local.len().max(1) as f64).sqrt(), worst, at)
}

/// Compares a run with its single-rank reference: per-step losses (relative) and
/// every rank's final weights against the reference's sliced the same way
/// ([`PARAM_TOLERANCE`]).
pub fn check_against(
    plan: &Plan,
    run: &TrainReport,
    reference: &TrainReport,
    tolerance: f64,
) -> Result<Vec<String>, String> {
    let mut lines = Vec::new();
    let mut worst_loss: f64 = 0.0;
    for (i, (a, b)) in run.losses.iter().zip(&reference.losses).enumerate() {
        let rel = (a - b).abs() / b.abs().max(1e-12);
        worst_loss = if rel.is_nan() {
            f64::NAN
        } else {
            worst_loss.max(rel)
        };
        lines.push(format!(
            "step {i}: loss {a:.6} vs reference {b:.6} (rel {rel:.2e})"
        ));
    }
    let refw = &reference
        .ranks
        .first()
        .ok_or("the reference has no rank")?
        .weights;
    // The farthest one element can move: the scale the distances are measured in.
    let reach = run.lr.abs() * run.losses.len().max(1) as f64;
    let mut worst = (0.0f64, String::new());
    for rep in &run.ranks {
        for ((name, layer), local) in &rep.weights {
            let full = refw
                .get(&(name.clone(), *layer))
                .ok_or_else(|| format!("reference lacks `{name}` layer {layer}"))?;
            let want = rank_slice(plan, rep.rank, name, full)?;
            if want.len() != local.len() {
                return Err(format!(
                    "rank {}: `{name}` has {} values, reference slice {}",
                    rep.rank,
                    local.len(),
                    want.len()
                ));
            }
            let (rms, max, at) = tensor_distance(local, &want);
            let rel = rms / reach.max(f64::MIN_POSITIVE);
            if rel > worst.0 || rel.is_nan() {
                let layer = layer_label(*layer);
                worst = (
                    rel,
                    format!(
                        "rank {} `{name}`{layer} (rms {rms:.2e}; largest {max:.2e} at [{at}]: {} vs {})",
                        rep.rank, local[at], want[at]
                    ),
                );
            }
        }
    }
    lines.push(format!(
        "worst relative loss difference {worst_loss:.2e} (tolerance {tolerance:.0e}); weights at most {:.2e} of lr x steps away (tolerance {PARAM_TOLERANCE:.0e}), at {}",
        worst.0, worst.1
    ));
    // A NaN anywhere fails too: it is never within a tolerance.
    let within = |x: f64, tol: f64| x <= tol;
    if !within(worst_loss, tolerance) || !within(worst.0, PARAM_TOLERANCE) {
        return Err(lines.join("\n"));
    }
    Ok(lines)
}

/// The first op reading weight `name` (whose role decides how it is sliced and
/// initialised), the weight's tensor and its full shape.
pub(crate) fn weight_site<'g>(
    graph: &'g Graph,
    name: &str,
) -> Result<(&'g Op, meshplan_ir::TensorId, Vec<usize>), String> {
    let (op, id) = graph
        .segments
        .iter()
        .flat_map(|s| &s.ops)
        .find_map(|o| {
            o.inputs
                .iter()
                .find(|&&t| graph.tensor(t).name == name)
                .map(|&t| (o, t))
        })
        .ok_or_else(|| format!("`{name}` used by no op"))?;
    let shape = fixed_shape(graph.tensor(id)).map_err(|e| format!("{e:?}"))?;
    Ok((op, id, shape))
}

/// The part of weight `name` (whole values `full`) that `rank` of `plan` holds.
pub(crate) fn rank_slice(
    plan: &Plan,
    rank: usize,
    name: &str,
    full: &[f32],
) -> Result<Vec<f32>, String> {
    let graph = &plan.graph;
    let entry = plan
        .ranks
        .get(rank)
        .ok_or_else(|| format!("rank {rank} is not in the plan"))?;
    let tp_axis = plan.mesh.axes.iter().position(|a| a == "tp");
    let tp = TpPos {
        rank: tp_axis.map(|i| entry.coords[i] as usize).unwrap_or(0),
        size: tp_axis.map(|i| plan.mesh.shape[i] as usize).unwrap_or(1),
    };
    let (op, id, shape) = weight_site(graph, name)?;
    let ep = build_groups(plan, rank)
        .ok()
        .and_then(|gs| gs.get("ep").cloned())
        .and_then(|g| {
            g.index_of(rank).map(|i| TpPos {
                rank: i,
                size: g.size(),
            })
        })
        .unwrap_or(TpPos::ONE);
    Ok(local_weight(graph, op, op.role, id, full, &shape, tp, ep))
}

/// Bytes sent per rank and axis, summed over kinds, against the plan's prediction
/// for `steps` steps: every difference.
pub fn byte_mismatches(plan: &Plan, run: &TrainReport, steps: u64) -> Vec<String> {
    let mut out = Vec::new();
    for rep in &run.ranks {
        let entry = &plan.ranks[rep.rank];
        let Some(program) = plan.programs.get(entry.program as usize) else {
            out.push(format!("rank {}: no program", rep.rank));
            continue;
        };
        let predicted = program.phases.iter().map(|p| p.bytes_sent()).fold(
            meshplan_ir::plan::AxisBytes::default(),
            |a, b| meshplan_ir::plan::AxisBytes {
                dp: a.dp + b.dp,
                tp: a.tp + b.tp,
                pp: a.pp + b.pp,
                cp: a.cp + b.cp,
                ep: a.ep + b.ep,
            },
        );
        for axis in Axis::ALL {
            let want = predicted.get(axis) * steps as f64;
            let got = rep.counts.axis_bytes_sent(axis.name());
            if (got - want).abs() > 1e-6 * want.max(1.0) {
                out.push(format!(
                    "rank {} {}: measured {got} bytes, plan {want}",
                    rep.rank,
                    axis.name()
                ));
            }
        }
    }
    out
}

impl From<CommError> for ExecError {
    fn from(e: CommError) -> Self {
        ExecError::Rank(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::{run_step_times, RankReport};

    fn rank(start: f64, ends: &[f64]) -> RankReport {
        RankReport {
            rank: 0,
            loss_parts: Vec::new(),
            weights: Default::default(),
            counts: Default::default(),
            step_s: Vec::new(),
            steps_at: (start, ends.to_vec()),
            clock0_unix_s: 0.0,
            state_bytes: 0.0,
            peak_activation_bytes: 0.0,
            expert_slots: (0, 0),
            spans: Vec::new(),
            device_memory_bytes: None,
        }
    }

    #[test]
    fn step_times_add_up_to_the_wall_clock() {
        // Rank 1 starts first (0.0) and is slowest at steps 0 and 2, rank 0 at
        // step 1: steps end at 1.5, 2.2 and 3.1, so they take 1.5, 0.7 and 0.9 s,
        // 3.1 s in all, the wall time from the first start to the last end. Each
        // rank's own step times (0.9, 1.2, 0.8 and 1.5, 0.6, 1.0), maximised per
        // step, would give 1.5 + 1.2 + 1.0 = 3.7 s: a rank that waited for the
        // other at the end of one step starts the next late and is counted again.
        let ranks = [rank(0.1, &[1.0, 2.2, 3.0]), rank(0.0, &[1.5, 2.1, 3.1])];
        let s = run_step_times(&ranks, 3);
        let want = [1.5, 0.7, 0.9];
        for (a, b) in s.iter().zip(want) {
            assert!((a - b).abs() < 1e-12, "{s:?}");
        }
        assert!((s.iter().sum::<f64>() - 3.1).abs() < 1e-12);
    }
}
