//! The plan file (`plan.json`): what the planner chose and the per-rank programs that
//! carry it out, the language planner and executor share.
//!
//! # Shape
//!
//! A [`Plan`] names the model, cluster and workload, the device mesh, the chosen
//! configuration (`strategy`), tensor placements, the cost model's prediction, the
//! search report, one [`Program`] template per pipeline stage, and the rank table.
//! Ranks of one stage (all their `dp`, `cp` and `tp` coordinates) share one template:
//! a 3840-rank plan holds eight programs and a compact rank table.
//!
//! A program has one [`Phase`] for training (`train`) or two for inference (`prefill`,
//! `decode`). A phase lists the stage's model chunks; each chunk has a `forward` and
//! (training) a `backward` instruction list for **one micro-batch**, in which a segment
//! of the model appears once with its `repeat` count ([`Instr::Segment`]), never
//! unrolled. The phase's `schedule` is the exact order of (pass, chunk, micro-batch)
//! tasks the stage runs, and `step` what runs once per optimizer step after it
//! (data-parallel gradient reduction, optimizer, parameter gathers).
//!
//! # Communication groups
//!
//! Collectives name a group of [`MeshInfo::groups`]. A group is defined over a list
//! of mesh axes (outer to inner): flatten a rank's coordinates on those axes
//! row-major into an index `x`; the rank's group holds the ranks whose coordinates on
//! every other axis are equal and whose flattened index differs from `x` only in the
//! digit `(x / stride) % size`. Each collective also names the `axis` its bytes are
//! reported under (`comm_bytes_per_gpu` keys: `dp`, `tp`, `pp`, `cp`, `ep`).
//!
//! # Determinism
//!
//! Only `Vec` and `BTreeMap` appear here, and fields serialise in declaration order,
//! so serialising the same plan twice gives identical bytes.

use crate::config::ParallelConfig;
use crate::dtype::DType;
use crate::graph::Graph;
use crate::graph::SegmentKind;
use crate::spec::{TransformerSpec, Workload};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub use crate::plan_check::PlanError;
pub use crate::target::{Exchange, LossStat, ParamSet, Target};

/// serde's message, cut to its first line and 200 characters: it may quote the
/// file, and a wrong file given as a plan should not be echoed whole.
fn clip(msg: &str) -> String {
    let line = msg.lines().next().unwrap_or("");
    let mut out: String = line.chars().take(200).collect();
    if out.len() < msg.len() {
        out.push('…');
    }
    out
}

/// Only the version, read before the rest so that a plan of another format is named
/// as such.
#[derive(Deserialize)]
struct FormatOnly {
    format: u32,
}

/// Version of the plan format this crate writes and reads.
pub const PLAN_FORMAT: u32 = 1;

/// The whole plan file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Format version ([`PLAN_FORMAT`]); readers reject versions they do not know.
    pub format: u32,
    /// Training or inference: which phases the programs hold.
    pub kind: PlanKind,
    /// The model, enough to rebuild its graph and check it is the same one.
    pub model: ModelInfo,
    /// The cluster the plan was made for.
    pub cluster: ClusterInfo,
    /// What the plan serves.
    pub workload: Workload,
    /// The device mesh and its communication groups.
    pub mesh: MeshInfo,
    /// The chosen configuration (the contract's CFG keys).
    pub strategy: ParallelConfig,
    /// Block layers per model chunk (chunk `c * pp + i` runs on stage `i`).
    pub layer_split: Vec<u64>,
    /// Tensor name -> placement per axis of [`MeshInfo::placement_axes`]
    /// (`"S(0)"`, `"R"`, `"P"`).
    pub placements: BTreeMap<String, Vec<String>>,
    /// The cost model's estimate (the contract's JSON output keys).
    pub predicted: serde_json::Value,
    /// One program template per pipeline stage, indexed by [`Program::id`].
    pub programs: Vec<Program>,
    /// Every rank, in rank order.
    pub ranks: Vec<RankEntry>,
    /// How the plan was found.
    pub search: SearchInfo,
    /// The op graph the programs name (roles = the chosen tensor-parallel layout), so
    /// an executor needs nothing but this file.
    pub graph: Graph,
    /// The serving deployment `deploy` chose (its pools, the KV move between them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving: Option<crate::serving::ServingInfo>,
}

/// What a plan runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PlanKind {
    /// Forward, backward and optimizer steps.
    Train,
    /// Prefill and decode.
    Inference,
}

/// The model: its name and a summary of its graph's segments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// Model (spec) name.
    pub name: String,
    /// Compute dtype.
    pub dtype: DType,
    /// Block layers.
    pub layers: u64,
    /// Parameters (elements), counted once.
    pub params: f64,
    /// Graph segments in execution order.
    pub segments: Vec<SegmentInfo>,
    /// The architecture as specified (layers, widths, heads, vocabulary, MoE), so
    /// a plan can be exported to a framework's model arguments without the model
    /// file. Absent in plans of explicit graphs and in older plans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transformer: Option<TransformerSpec>,
}

/// One graph segment, summarised.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SegmentInfo {
    /// Segment name (e.g. `dense_block`).
    pub name: String,
    /// Position in the model.
    pub kind: SegmentKind,
    /// Consecutive copies.
    pub repeat: u64,
    /// Op names in order.
    pub ops: Vec<String>,
}

/// The cluster, summarised.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterInfo {
    /// Cluster name.
    pub name: String,
    /// Nodes.
    pub nodes: u64,
    /// GPUs per node.
    pub gpus_per_node: u64,
    /// GPU model name.
    pub gpu: String,
    /// GPU memory, bytes.
    pub gpu_memory_bytes: f64,
    /// The validated cluster (the cost model's `Cluster`, SI units), so `explain`
    /// can re-price alternatives with the links the plan was priced on. Kept as
    /// JSON because this crate knows nothing of the cost model. Absent in older
    /// plans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<serde_json::Value>,
}

/// The device mesh.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MeshInfo {
    /// Axis names, outermost first (`["pp", "dp", "cp", "tp"]`): rank order is
    /// row-major over `shape`, so `tp` is innermost.
    pub axes: Vec<String>,
    /// Size of each axis.
    pub shape: Vec<u64>,
    /// The axes a placement string lists, in order (pipeline stages are separate
    /// submeshes, so `pp` is not one of them).
    pub placement_axes: Vec<String>,
    /// Communication groups collectives refer to by name.
    pub groups: Vec<GroupSpec>,
}

/// A communication group (see the module doc for the membership rule).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GroupSpec {
    /// Name collectives use (`tp`, `cp`, `dp`, `ep`, `edp`, `pp`).
    pub name: String,
    /// Mesh axes the group is laid over, outer to inner.
    pub over: Vec<String>,
    /// Ranks in one group.
    pub size: u64,
    /// Distance between consecutive members in the flattened index over `over`.
    pub stride: u64,
}

/// One rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankEntry {
    /// Global rank.
    pub rank: u64,
    /// Node (`rank / gpus_per_node`).
    pub node: u64,
    /// GPU index inside the node.
    pub local_gpu: u64,
    /// Coordinate on each axis of [`MeshInfo::axes`].
    pub coords: Vec<u64>,
    /// Index of the program template it runs.
    pub program: u32,
}

/// How the plan was found.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SearchInfo {
    /// Configurations priced.
    pub candidates_evaluated: u64,
    /// Configurations discarded without pricing (bounds, memory, divisibility).
    pub pruned: u64,
    /// Wall-clock time of the search, s.
    pub wall_s: f64,
    /// Solver used for intra-op placements (e.g. `microlp`, or `standard-layout`).
    pub solver: String,
    /// Why the search stopped (e.g. `exhausted`, `time_limit`, `fixed_config`).
    pub stop_reason: String,
    /// Anything else the search wants to record.
    #[serde(default)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// Bytes one GPU sends, by the axis the cost model reports them under.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AxisBytes {
    /// Data axis (gradient reduction, ZeRO gathers).
    pub dp: f64,
    /// Tensor axis.
    pub tp: f64,
    /// Pipeline sends.
    pub pp: f64,
    /// Context axis.
    pub cp: f64,
    /// Expert axis.
    pub ep: f64,
}

impl AxisBytes {
    /// Bytes on `axis`.
    pub fn get(&self, axis: Axis) -> f64 {
        match axis {
            Axis::Dp => self.dp,
            Axis::Tp => self.tp,
            Axis::Pp => self.pp,
            Axis::Cp => self.cp,
            Axis::Ep => self.ep,
        }
    }

    fn add(&mut self, axis: Axis, bytes: f64) {
        match axis {
            Axis::Dp => self.dp += bytes,
            Axis::Tp => self.tp += bytes,
            Axis::Pp => self.pp += bytes,
            Axis::Cp => self.cp += bytes,
            Axis::Ep => self.ep += bytes,
        }
    }
}

/// The axis bytes are reported under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Axis {
    /// Data parallel (dense `dp x cp` group and the expert data group).
    Dp,
    /// Tensor parallel.
    Tp,
    /// Pipeline.
    Pp,
    /// Context parallel.
    Cp,
    /// Expert parallel.
    Ep,
}

impl Axis {
    /// Every axis, in report order.
    pub const ALL: [Axis; 5] = [Axis::Dp, Axis::Tp, Axis::Pp, Axis::Cp, Axis::Ep];

    /// The key of `comm_bytes_per_gpu`.
    pub fn name(self) -> &'static str {
        match self {
            Axis::Dp => "dp",
            Axis::Tp => "tp",
            Axis::Pp => "pp",
            Axis::Cp => "cp",
            Axis::Ep => "ep",
        }
    }
}

/// The program template of one pipeline stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Program {
    /// Template id (the index in [`Plan::programs`]).
    pub id: u32,
    /// Pipeline stage.
    pub stage: u64,
    /// `train`, or `prefill` then `decode`.
    pub phases: Vec<Phase>,
}

/// Which part of the work a phase is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PhaseKind {
    /// One optimizer step: every micro-batch forward and backward, then `step`.
    Train,
    /// The prompt's forward pass, filling the KV cache.
    Prefill,
    /// One generated token for every request of the replica.
    Decode,
}

/// Values of the symbolic dims one micro-batch is shaped by (before sharding).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PhaseDims {
    /// Sequences per micro-batch.
    pub batch: f64,
    /// Query tokens per sequence.
    pub seq: f64,
    /// Key tokens per sequence (decode: the mean context the plan was priced at;
    /// the cache grows from `prompt_len` to `prompt_len + output_len`).
    pub kv: f64,
}

/// A phase of a stage's program.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Phase {
    /// What the phase is.
    pub kind: PhaseKind,
    /// Symbolic dims of one micro-batch.
    pub dims: PhaseDims,
    /// Micro-batches per run of the phase.
    pub microbatches: u64,
    /// The stage's model chunks, by local chunk index.
    pub chunks: Vec<ChunkProgram>,
    /// Tasks in execution order.
    pub schedule: Vec<Task>,
    /// Instructions after the schedule, once per run (gradient reduction, optimizer).
    pub step: Vec<Instr>,
    /// Bytes this stage's ranks send per run of the phase, by axis (what
    /// [`Phase::bytes_sent`] computes, written out for readers of the file).
    pub comm_bytes_per_gpu: AxisBytes,
}

/// A model chunk of a stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkProgram {
    /// Local chunk index on the stage (`0..vpp`).
    pub chunk: u64,
    /// Global position in the pipeline (`chunk * pp + stage`).
    pub virtual_stage: u64,
    /// First block layer of the chunk.
    pub layer_start: u64,
    /// One past the last block layer.
    pub layer_end: u64,
    /// The graph segments the chunk runs, in order, with their repeats here.
    pub segments: Vec<ChunkSegment>,
    /// One micro-batch's forward pass.
    pub forward: Vec<Instr>,
    /// One micro-batch's backward pass (empty for inference).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backward: Vec<Instr>,
}

/// A graph segment inside a chunk.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkSegment {
    /// Segment name in the graph.
    pub segment: String,
    /// Copies run in this chunk.
    pub repeat: u64,
}

/// Forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Pass {
    /// Forward pass.
    F,
    /// Backward pass.
    B,
}

/// One entry of a stage's schedule: run `chunk`'s `pass` for micro-batch `mb`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    /// Forward or backward.
    pub pass: Pass,
    /// Local chunk index.
    pub chunk: u64,
    /// Micro-batch.
    pub mb: u64,
}

/// A collective's operation (also what the cost model prices,
/// `cost_model::collective::Collective`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveKind {
    /// Sum, result everywhere.
    AllReduce,
    /// Concatenate shards, result everywhere.
    AllGather,
    /// Sum, each rank keeps one shard.
    ReduceScatter,
    /// Every rank sends a distinct shard to every other.
    AllToAll,
    /// One rank's buffer to all.
    Broadcast,
}

/// An operation timed on the links between GPUs: a [`CollectiveKind`], or a
/// point-to-point transfer. A calibration overlay keys its measurements by it, and
/// the NCCL timing of `meshplan calibrate` takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkOp {
    /// [`CollectiveKind::AllReduce`].
    AllReduce,
    /// [`CollectiveKind::AllGather`].
    AllGather,
    /// [`CollectiveKind::ReduceScatter`].
    ReduceScatter,
    /// [`CollectiveKind::Broadcast`].
    Broadcast,
    /// [`CollectiveKind::AllToAll`].
    AllToAll,
    /// Point to point between two GPUs of a node (pipeline sends, ring attention).
    SendRecv,
}

impl LinkOp {
    /// Every kind, in table order.
    pub const ALL: [LinkOp; 6] = [
        LinkOp::AllReduce,
        LinkOp::AllGather,
        LinkOp::ReduceScatter,
        LinkOp::Broadcast,
        LinkOp::AllToAll,
        LinkOp::SendRecv,
    ];

    /// The spelling in overlay files.
    pub fn name(self) -> &'static str {
        match self {
            LinkOp::AllReduce => "all_reduce",
            LinkOp::AllGather => "all_gather",
            LinkOp::ReduceScatter => "reduce_scatter",
            LinkOp::Broadcast => "broadcast",
            LinkOp::AllToAll => "all_to_all",
            LinkOp::SendRecv => "send_recv",
        }
    }

    /// Parses the overlay spelling.
    pub fn parse(s: &str) -> Option<LinkOp> {
        LinkOp::ALL.into_iter().find(|k| k.name() == s)
    }

    /// Index in [`LinkOp::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The link operation of a collective.
    pub fn of(kind: CollectiveKind) -> LinkOp {
        match kind {
            CollectiveKind::AllReduce => LinkOp::AllReduce,
            CollectiveKind::AllGather => LinkOp::AllGather,
            CollectiveKind::ReduceScatter => LinkOp::ReduceScatter,
            CollectiveKind::Broadcast => LinkOp::Broadcast,
            CollectiveKind::AllToAll => LinkOp::AllToAll,
        }
    }
}

/// What a point-to-point transfer carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Payload {
    /// A forward activation.
    Activation,
    /// A backward gradient.
    Gradient,
}

/// A tensor as one rank holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LocalTensor {
    /// Graph tensor name.
    pub tensor: String,
    /// Local shape (sharding applied).
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: DType,
}

/// One instruction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Instr {
    /// A graph segment run `repeat` times in a row; `body` is one copy.
    Segment {
        /// Segment name in the graph.
        name: String,
        /// Position in the model.
        kind: SegmentKind,
        /// Consecutive copies.
        repeat: u64,
        /// One copy's instructions.
        body: Vec<Instr>,
    },
    /// Forward work redone before a backward (activation recomputation).
    Recompute {
        /// The forward instructions redone.
        body: Vec<Instr>,
    },
    /// A graph op on this rank's shards (forward, or its backward in a `backward`
    /// list).
    Compute {
        /// Op name in the graph.
        name: String,
        /// Op kind (`matmul`, `attention`, `norm`, ...).
        kind: String,
        /// Inputs as held locally.
        inputs: Vec<LocalTensor>,
        /// Outputs as held locally.
        outputs: Vec<LocalTensor>,
        /// FLOPs this rank executes (backward: twice the forward's).
        flops: f64,
    },
    /// A collective over a communication group.
    Collective {
        /// The operation.
        kind: CollectiveKind,
        /// The group, by [`GroupSpec::name`].
        group: String,
        /// The axis its bytes are reported under.
        axis: Axis,
        /// Ranks in the group.
        ranks: u64,
        /// What it acts on (a graph tensor, its gradient, a parameter set or bucket).
        #[serde(
            rename = "tensor",
            deserialize_with = "crate::target::deserialize_target"
        )]
        target: Target,
        /// Full buffer in bytes (nccl-tests convention: the gathered buffer of an
        /// AllGather/ReduceScatter, one rank's send buffer of an All-to-All).
        payload_bytes: f64,
        /// Bytes this rank sends.
        bytes_sent: f64,
    },
    /// Ring attention: `steps` times, send the held block to the next rank of the
    /// group and receive one from the previous, overlapped with the attention of the
    /// block in hand.
    RingPass {
        /// The group, by [`GroupSpec::name`].
        group: String,
        /// The axis its bytes are reported under.
        axis: Axis,
        /// What circulates (`K/V` blocks or their gradients).
        tensor: String,
        /// Exchanges.
        steps: u64,
        /// Bytes sent per exchange.
        bytes_per_step: f64,
        /// Bytes this rank sends in all (`steps * bytes_per_step`).
        bytes_sent: f64,
    },
    /// Send to the rank with the same coordinates on `peer_stage`.
    Send {
        /// Receiving stage.
        peer_stage: u64,
        /// What is sent.
        tensor: String,
        /// Activation or gradient.
        payload: Payload,
        /// Bytes sent.
        bytes: f64,
    },
    /// Receive from the rank with the same coordinates on `peer_stage`.
    Recv {
        /// Sending stage.
        peer_stage: u64,
        /// What is received.
        tensor: String,
        /// Activation or gradient.
        payload: Payload,
        /// Bytes received.
        bytes: f64,
    },
    /// An optimizer update of the parameters this rank holds.
    Optimizer {
        /// Algorithm (`adamw`).
        name: String,
        /// Which parameters.
        params: ParamSet,
        /// Elements updated by this rank.
        elements: f64,
    },
}

impl Instr {
    /// The instruction's `op`, as plan.json spells it (for messages).
    pub fn op_name(&self) -> &'static str {
        match self {
            Instr::Segment { .. } => "segment",
            Instr::Recompute { .. } => "recompute",
            Instr::Compute { .. } => "compute",
            Instr::Collective { .. } => "collective",
            Instr::RingPass { .. } => "ring_pass",
            Instr::Send { .. } => "send",
            Instr::Recv { .. } => "recv",
            Instr::Optimizer { .. } => "optimizer",
        }
    }

    /// Adds the bytes this instruction sends, `times` over, to `acc`.
    fn add_bytes(&self, times: f64, acc: &mut AxisBytes) {
        match self {
            Instr::Segment { repeat, body, .. } => {
                for i in body {
                    i.add_bytes(times * *repeat as f64, acc);
                }
            }
            Instr::Recompute { body } => {
                for i in body {
                    i.add_bytes(times, acc);
                }
            }
            Instr::Collective {
                axis, bytes_sent, ..
            }
            | Instr::RingPass {
                axis, bytes_sent, ..
            } => acc.add(*axis, times * bytes_sent),
            Instr::Send { bytes, .. } => acc.add(Axis::Pp, times * bytes),
            Instr::Compute { .. } | Instr::Recv { .. } | Instr::Optimizer { .. } => {}
        }
    }
}

/// Bytes sent by a list of instructions run `times` times.
pub fn instrs_bytes_sent(instrs: &[Instr], times: f64) -> AxisBytes {
    let mut acc = AxisBytes::default();
    for i in instrs {
        i.add_bytes(times, &mut acc);
    }
    acc
}

impl Phase {
    /// Bytes one rank of this stage sends per run of the phase: each chunk's forward
    /// and backward lists as many times as the schedule runs them, plus `step`.
    pub fn bytes_sent(&self) -> AxisBytes {
        let mut acc = AxisBytes::default();
        for ch in &self.chunks {
            let runs = |pass: Pass| {
                self.schedule
                    .iter()
                    .filter(|t| t.pass == pass && t.chunk == ch.chunk)
                    .count() as f64
            };
            for (list, pass) in [(&ch.forward, Pass::F), (&ch.backward, Pass::B)] {
                let n = runs(pass);
                for i in list {
                    i.add_bytes(n, &mut acc);
                }
            }
        }
        for i in &self.step {
            i.add_bytes(1.0, &mut acc);
        }
        acc
    }
}

impl Plan {
    /// Serialises to pretty-printed JSON (deterministic).
    pub fn to_json_pretty(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string_pretty(self)
    }

    /// Serialises to compact JSON (deterministic).
    pub fn to_json(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }

    /// Reads a plan and checks it ([`Plan::validate`]): a format version this crate
    /// does not know, or a plan whose parts disagree, is an error naming the field.
    pub fn from_json(text: &str) -> Result<Plan, PlanError> {
        // The version first, so a newer format is named as such rather than as
        // whatever field it renamed.
        if let Ok(v) = serde_json::from_str::<FormatOnly>(text) {
            if v.format != PLAN_FORMAT {
                return Err(PlanError::Format { found: v.format });
            }
        }
        let plan: Plan =
            serde_json::from_str(text).map_err(|e| PlanError::Parse(clip(&e.to_string())))?;
        plan.validate()?;
        Ok(plan)
    }

    /// Reads and checks the plan file at `path`, refusing what is not a regular file
    /// or is larger than [`crate::input::PLAN_LIMIT`]; also returns the file's bytes
    /// (the rendezvous hashes them).
    pub fn read_file(path: &std::path::Path) -> Result<(Plan, Vec<u8>), PlanError> {
        let bytes = crate::input::read_bounded(path, crate::input::PLAN_LIMIT)
            .map_err(|e| PlanError::Parse(format!("cannot read: {e}")))?;
        let text = std::str::from_utf8(&bytes).map_err(|e| {
            PlanError::Parse(format!(
                "is not UTF-8 text (invalid byte at offset {})",
                e.valid_up_to()
            ))
        })?;
        let plan = Plan::from_json(text)?;
        Ok((plan, bytes))
    }

    /// The largest bytes any stage sends per run of phase `kind`, per axis taken
    /// separately (the busiest stage of each axis, as `comm_bytes_per_gpu` reports).
    pub fn busiest_bytes(&self, kind: PhaseKind) -> AxisBytes {
        let mut out = AxisBytes::default();
        for p in &self.programs {
            for ph in p.phases.iter().filter(|ph| ph.kind == kind) {
                let b = ph.bytes_sent();
                out.dp = out.dp.max(b.dp);
                out.tp = out.tp.max(b.tp);
                out.pp = out.pp.max(b.pp);
                out.cp = out.cp.max(b.cp);
                out.ep = out.ep.max(b.ep);
            }
        }
        out
    }
}
