//! Lowering: a chosen configuration turned into `plan.json`, one program template per
//! pipeline stage plus the rank table.
//!
//! The programs say, op by op, what one rank computes (local shapes with the sharding
//! applied) and every byte it sends. The collectives emitted are exactly the ones the
//! cost model prices (`graph_cost.rs`, `LayoutCtx::segment`; `estimate.rs`,
//! `estimate_train_split` and `estimate_inference`), so that summing a stage's
//! program gives back the estimate's `comm_bytes_per_gpu`:
//!
//! - tensor axis, per segment: a column-parallel op's input is all-reduced in backward
//!   (under sequence parallelism: all-gathered in forward, all-gathered again and
//!   reduce-scattered in backward), once per distinct input; a row-parallel op's output
//!   is all-reduced in forward (reduce-scattered in forward, all-gathered in backward
//!   under SP); the vocabulary-parallel loss all-reduces three floats per token
//!   (inference instead all-gathers each sequence's last-position logits to sample);
//!   expert MLPs without `ep` are a column/row pair;
//! - expert axis: an All-to-All before (dispatch) and after (combine) the experts, in
//!   forward and in backward;
//! - context axis: ring attention passes K/V blocks `cp - 1` times in forward and
//!   K/V plus their gradients in backward;
//! - full recomputation repeats a block's forward (and its collectives) before its
//!   backward; selective recomputation repeats the attention core;
//! - pipeline: each tensor-parallel rank sends `1/tp` of the boundary activation (and
//!   of its gradient) and the receiver all-gathers it over `tp`;
//! - data axis: once per step an AllReduce of the gradients (ZeRO 0) or a
//!   ReduceScatter then AllGather (ZeRO 1); under ZeRO 2 a ReduceScatter at the end of
//!   each micro-batch's backward (with the sequence-partial sums before it) and the
//!   AllGather once per step; or per micro-batch per segment two AllGathers of the
//!   parameters and a ReduceScatter of the gradients (ZeRO 3); dense parameters over
//!   the `dp x cp` group, routed experts over the expert data group.
//!
//! The pipeline order is [`stage_orders`], a reimplementation of the cost model's
//! simulated order (Megatron's 1F1B and interleaved 1F1B) including the reordering
//! the simulation does when a partial group of micro-batches would deadlock.

use meshplan_cost_model::collective::bytes_sent_per_rank;
use meshplan_cost_model::{
    inference_timeline, train_timeline_with, Cluster, Estimate, InferenceLoad, Mechanisms,
    PreparedGraph, Timeline,
};
use meshplan_ir::graph::{attention_half, Segment};
use meshplan_ir::plan::{
    Axis, ChunkProgram, ChunkSegment, ClusterInfo, CollectiveKind, Exchange, GroupSpec, Instr,
    LocalTensor, LossStat, MeshInfo, ModelInfo, ParamSet, Pass, Payload, Phase, PhaseDims,
    PhaseKind, Plan, PlanKind, Program, RankEntry, SearchInfo, SegmentInfo, Target, Task,
    PLAN_FORMAT,
};
use meshplan_ir::{
    Dim, DimEnv, Graph, Op, OpKind, ParallelConfig, Recompute, Schedule, SegmentKind, TensorId,
    TensorKind, TpRole, TpSplit, Workload,
};
use std::collections::BTreeMap;
use std::fmt;

/// Most (pass, chunk, micro-batch) tasks a plan's schedules may hold in all, so a
/// huge micro-batch count fails with an error instead of exhausting memory.
pub const SCHEDULE_TASKS_MAX: u64 = 1 << 22;

/// Most ranks a plan may describe.
pub const RANKS_MAX: u64 = 1 << 20;

/// Why a configuration could not be lowered.
#[derive(Clone, Debug, PartialEq)]
pub enum LowerError {
    /// The inputs do not fit together; `reason` states the arithmetic.
    Invalid {
        /// Which input.
        what: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A bound on plan size was exceeded.
    LimitExceeded {
        /// What grew too large.
        what: &'static str,
        /// The bound.
        limit: u64,
    },
}

impl fmt::Display for LowerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LowerError::Invalid { what, reason } => write!(f, "cannot lower {what}: {reason}"),
            LowerError::LimitExceeded { what, limit } => {
                write!(f, "cannot lower: {what} exceeds the limit of {limit}")
            }
        }
    }
}

impl std::error::Error for LowerError {}

fn invalid(what: &'static str, reason: String) -> LowerError {
    LowerError::Invalid { what, reason }
}

/// Everything lowering needs. The workload supplies the sizes (`seq_len` and
/// `global_batch` for training; prompt, output and concurrency for inference), so
/// they cannot disagree with what the plan records.
#[derive(Clone, Debug)]
pub struct LowerInput<'a> {
    /// Model (spec) name.
    pub model_name: &'a str,
    /// The op graph; each op's [`TpRole`] is the chosen tensor-parallel layout.
    pub graph: &'a Graph,
    /// The same graph prepared for pricing (boundary, KV and dtype figures the cost
    /// model used, e.g. an MLA latent KV size the graph alone does not give).
    pub prepared: &'a PreparedGraph,
    /// The cluster.
    pub cluster: &'a Cluster,
    /// The configuration.
    pub cfg: &'a ParallelConfig,
    /// The workload.
    pub workload: &'a Workload,
    /// Block layers per model chunk: `pp * vpp` entries for training (chunk
    /// `c * pp + i` on stage `i`), `pp` for inference.
    pub layer_split: &'a [u64],
    /// Tensor name -> placement per axis (`dp`, `cp`, `tp`).
    pub placements: Vec<(String, Vec<String>)>,
    /// The cost model's estimate of this configuration.
    pub estimate: &'a Estimate,
    /// The search report.
    pub search: SearchInfo,
    /// Parameters per data-parallel gradient bucket (`calib::DP_BUCKET_PARAMS`, as
    /// the cost model prices): each bucket is its own reduction in the step list.
    pub dp_bucket_params: f64,
}

// === layout context ===

/// How one phase's micro-batch is laid out: the degrees, the dims and the tensor
/// split of each weight.
struct Layout<'a> {
    graph: &'a Graph,
    pg: &'a PreparedGraph,
    tp: u64,
    cp: u64,
    ep: u64,
    sp: bool,
    dp_attention: bool,
    recompute: Recompute,
    env: DimEnv,
    bpe: f64,
    /// Bytes per element of gradient sums, as the plan's framework moves them
    /// (`Mechanisms::grad_sum_bytes`); ZeRO gathers compute copies, at `bpe`.
    grad_bpe: f64,
    /// ZeRO stage, and whether it is 3 (parameter gathers per segment).
    zero: u8,
    zero3: bool,
    dense_dp: u64,
    expert_dp: u64,
    /// The dim of each weight the tensor axis splits (`None`: not split or unknown).
    weight_dim: Vec<Option<usize>>,
    /// Generation: the head gathers the last position's logits to sample from instead
    /// of reducing the loss (`LayoutCtx::sampling`).
    sampling: bool,
}

/// A segment copy's instructions and the parameters this rank holds for it.
struct SegmentLowered {
    forward: Vec<Instr>,
    backward: Vec<Instr>,
    dense_params: f64,
    expert_params: f64,
    /// Weights of ops that sequence parallelism runs on a slice of the sequence: each
    /// tensor rank holds a partial gradient of them, summed once per step (none under
    /// ZeRO-3 with data parallelism: the segment's backward sums them itself).
    seq_partial_params: f64,
}

fn collective(
    kind: CollectiveKind,
    group: &str,
    axis: Axis,
    ranks: u64,
    target: Target,
    payload_bytes: f64,
) -> Instr {
    Instr::Collective {
        kind,
        group: group.to_string(),
        axis,
        ranks,
        target,
        payload_bytes,
        bytes_sent: bytes_sent_per_rank(kind, ranks, payload_bytes),
    }
}

fn op_kind_name(kind: &OpKind) -> &'static str {
    match kind {
        OpKind::Embedding => "embedding",
        OpKind::Matmul { .. } => "matmul",
        OpKind::Norm(_) => "norm",
        OpKind::Rope => "rope",
        OpKind::Activation(_) => "activation",
        OpKind::Attention(_) => "attention",
        OpKind::Add => "add",
        OpKind::Dropout => "dropout",
        OpKind::Router { .. } => "router",
        OpKind::Experts(_) => "experts",
        OpKind::CrossEntropy { .. } => "cross_entropy",
    }
}

/// The tensor-axis split dim of every weight, from the ops that use it: the output
/// index of a column-parallel weight, the contracting index of a row-parallel one,
/// the vocabulary row of an embedding, the expert MLP width of expert weights.
fn weight_dims(graph: &Graph) -> Vec<Option<usize>> {
    let mut dims = vec![None; graph.tensors.len()];
    let mut set = |id: TensorId, d: Option<usize>| {
        if let Some(slot) = dims.get_mut(id.0 as usize) {
            if slot.is_none() {
                *slot = d;
            }
        }
    };
    for op in graph.ops() {
        match (&op.kind, op.role) {
            (OpKind::Matmul { einsum }, role) => {
                let Some((lhs, out)) = einsum.split_once("->") else {
                    continue;
                };
                let Some((la, lb)) = lhs.split_once(',') else {
                    continue;
                };
                let d = match role {
                    TpRole::ColumnParallel | TpRole::VocabHead => {
                        lb.chars().position(|c| out.contains(c) && !la.contains(c))
                    }
                    TpRole::RowParallel => {
                        lb.chars().position(|c| la.contains(c) && !out.contains(c))
                    }
                    _ => None,
                };
                if let Some(&w) = op.inputs.get(1) {
                    set(w, d);
                }
                // A column-parallel bias is split like the output columns.
                if let Some(&b) = op.inputs.get(2) {
                    if matches!(role, TpRole::ColumnParallel | TpRole::VocabHead) {
                        set(b, Some(0));
                    }
                }
            }
            (OpKind::Embedding, TpRole::VocabEmbedding) => {
                if let Some(&w) = op.inputs.get(1) {
                    set(w, Some(0));
                }
            }
            (OpKind::Experts(_), _) => {
                // `[experts, hidden, up]` and `[experts, ffn, hidden]`.
                if let Some(&w) = op.inputs.get(2) {
                    set(w, Some(2));
                }
                if let Some(&w) = op.inputs.get(3) {
                    set(w, Some(1));
                }
            }
            _ => {}
        }
    }
    dims
}

fn div_ceil_f(v: f64, d: u64) -> u64 {
    let q = v / d.max(1) as f64;
    if q.is_finite() && q > 0.0 {
        q.ceil() as u64
    } else {
        0
    }
}

impl Layout<'_> {
    fn tensor_name(&self, id: TensorId) -> String {
        self.graph
            .tensors
            .get(id.0 as usize)
            .map_or_else(|| format!("tensor#{}", id.0), |t| t.name.clone())
    }

    /// Full bytes of an activation for one micro-batch on this rank's context shard
    /// (the cost model's `a.bytes.eval(env) / cp`).
    fn full_bytes(&self, id: TensorId) -> f64 {
        self.graph
            .tensors
            .get(id.0 as usize)
            .map_or(0.0, |t| t.bytes().eval(&self.env) / self.cp as f64)
    }

    /// A tensor as this rank holds it.
    fn local(&self, id: TensorId, attn_part: bool) -> LocalTensor {
        let Some(t) = self.graph.tensors.get(id.0 as usize) else {
            return LocalTensor {
                tensor: format!("tensor#{}", id.0),
                shape: Vec::new(),
                dtype: self.pg.dtype,
            };
        };
        let tp = self.tp.max(1);
        let batch_split = self.dp_attention && attn_part;
        let mut shape: Vec<u64> = Vec::with_capacity(t.shape.len());
        if t.kind == TensorKind::Weight {
            shape.extend(t.shape.iter().map(|d| match d {
                Dim::Fixed(n) => *n,
                _ => 1,
            }));
            let split_dim = self.weight_dim.get(id.0 as usize).copied().flatten();
            match t.split {
                TpSplit::Experts if self.ep > 1 => {
                    if let Some(s) = shape.first_mut() {
                        *s = s.div_ceil(self.ep);
                    }
                }
                TpSplit::Sharded | TpSplit::Experts if tp > 1 && !batch_split => {
                    let d = split_dim.unwrap_or(shape.len().saturating_sub(1));
                    if let Some(s) = shape.get_mut(d) {
                        *s = s.div_ceil(tp);
                    }
                }
                _ => {}
            }
        } else {
            let seq_split =
                self.sp && t.split == TpSplit::Replicated && t.kind != TensorKind::Index;
            // Routed tokens (`[b, s, top_k, width]`) are spread over the tensor ranks.
            let routed = t.shape.len() == 4 && t.split != TpSplit::Replicated;
            for d in &t.shape {
                shape.push(match d {
                    Dim::Batch => div_ceil_f(self.env.batch, if batch_split { tp } else { 1 }),
                    Dim::Seq => {
                        let mut div = self.cp;
                        if seq_split || routed {
                            div *= tp;
                        }
                        div_ceil_f(self.env.seq, div)
                    }
                    Dim::Kv => div_ceil_f(self.env.kv, 1),
                    Dim::Fixed(n) => *n,
                });
            }
            if t.split != TpSplit::Replicated && !routed && tp > 1 {
                if let Some(last) = shape.last_mut() {
                    *last = last.div_ceil(tp);
                }
            }
        }
        LocalTensor {
            tensor: t.name.clone(),
            shape,
            dtype: t.dtype,
        }
    }

    /// FLOPs of an op's forward on this rank.
    fn local_flops(&self, op: &Op, attn_part: bool) -> f64 {
        let f = self.graph.op_flops(op).eval(&self.env) / self.cp as f64;
        if self.dp_attention && attn_part {
            // The busiest tensor rank's whole requests, with whole attention weights.
            return f * meshplan_ir::graph::dpa_share(self.env.batch, self.tp);
        }
        let split = match op.role {
            TpRole::ColumnParallel
            | TpRole::RowParallel
            | TpRole::VocabHead
            | TpRole::Local
            | TpRole::Experts => true,
            _ => self.sp,
        };
        if split && self.tp > 1 {
            f / self.tp as f64
        } else {
            f
        }
    }

    fn compute(&self, op: &Op, attn_part: bool, backward: bool) -> Instr {
        let flops = self.local_flops(op, attn_part);
        Instr::Compute {
            name: op.name.clone(),
            kind: op_kind_name(&op.kind).to_string(),
            inputs: op
                .inputs
                .iter()
                .map(|&i| self.local(i, attn_part))
                .collect(),
            outputs: op
                .outputs
                .iter()
                .map(|&i| self.local(i, attn_part))
                .collect(),
            flops: if backward { 2.0 * flops } else { flops },
        }
    }

    fn tp_coll(&self, kind: CollectiveKind, target: Target, payload: f64) -> Option<Instr> {
        (self.tp > 1).then(|| collective(kind, "tp", Axis::Tp, self.tp, target, payload))
    }

    /// Communication of a column-parallel op's input: (forward before the op,
    /// backward before, backward after).
    fn column(&self, x: TensorId, attn_part: bool, c: &mut OpComm) {
        let full = self.full_bytes(x);
        let name = Target::activation(self.tensor_name(x));
        let grad = Target::ActivationGrad {
            tensor: self.tensor_name(x),
        };
        if self.dp_attention {
            // Attention runs data-parallel; the MLP half gathers the tokens first.
            if !attn_part {
                c.pre
                    .extend(self.tp_coll(CollectiveKind::AllGather, name, full));
            }
        } else if self.sp {
            c.pre
                .extend(self.tp_coll(CollectiveKind::AllGather, name.clone(), full));
            // Megatron gathers the input again for the weight gradient.
            c.bpre
                .extend(self.tp_coll(CollectiveKind::AllGather, name, full));
            c.bpost
                .extend(self.tp_coll(CollectiveKind::ReduceScatter, grad, full));
        } else {
            c.bpost
                .extend(self.tp_coll(CollectiveKind::AllReduce, grad, full));
        }
    }

    /// Communication of a row-parallel op's (partial) output.
    fn row(&self, y: TensorId, attn_part: bool, c: &mut OpComm) {
        let full = self.full_bytes(y);
        let name = Target::activation(self.tensor_name(y));
        if self.dp_attention {
            if !attn_part {
                c.post
                    .extend(self.tp_coll(CollectiveKind::ReduceScatter, name, full));
            }
        } else if self.sp {
            c.post
                .extend(self.tp_coll(CollectiveKind::ReduceScatter, name, full));
            let grad = Target::ActivationGrad {
                tensor: self.tensor_name(y),
            };
            c.bpre
                .extend(self.tp_coll(CollectiveKind::AllGather, grad, full));
        } else {
            c.post
                .extend(self.tp_coll(CollectiveKind::AllReduce, name, full));
        }
    }

    /// Weight elements this rank holds for one copy of `seg` (dense, routed experts),
    /// each weight once, skipping those `held` already by an earlier segment of the
    /// same chunk (a tied embedding).
    fn params(&self, seg: &Segment, held: &mut Vec<TensorId>) -> (f64, f64) {
        let t = self.tp.max(1) as f64;
        let has_experts = seg
            .ops
            .iter()
            .any(|op| matches!(op.kind, OpKind::Experts(_)));
        let (mut dense, mut experts) = (0.0, 0.0);
        for (op, attn_part) in seg.ops.iter().zip(attention_half(seg)) {
            for &w in &op.inputs {
                let Some(tensor) = self.graph.tensors.get(w.0 as usize) else {
                    continue;
                };
                if tensor.kind != TensorKind::Weight || held.contains(&w) {
                    continue;
                }
                held.push(w);
                let e = tensor.elems().coef;
                match tensor.split {
                    TpSplit::Replicated => dense += e,
                    // DP-attention holds the attention half's weights whole.
                    TpSplit::Sharded if self.dp_attention && attn_part => dense += e,
                    TpSplit::Sharded => dense += e / t,
                    TpSplit::Experts if !has_experts => {}
                    TpSplit::Experts if self.ep > 1 => experts += e / self.ep as f64,
                    TpSplit::Experts => experts += e / t,
                }
            }
        }
        (dense, experts)
    }

    /// Weight elements this rank holds of the tables the embedding and the head share.
    fn tied_params(&self) -> f64 {
        let weights = |kind: SegmentKind| -> Vec<TensorId> {
            self.graph
                .segments
                .iter()
                .filter(|s| s.kind == kind)
                .flat_map(|s| s.ops.iter().flat_map(|o| o.inputs.iter().copied()))
                .collect()
        };
        let head = weights(SegmentKind::Head);
        // Count the embedding's weights the head also reads, skipping the others.
        let mut held: Vec<TensorId> = weights(SegmentKind::Embed)
            .into_iter()
            .filter(|w| !head.contains(w))
            .collect();
        self.graph
            .segments
            .iter()
            .filter(|s| s.kind == SegmentKind::Embed)
            .map(|s| self.params(s, &mut held).0)
            .sum()
    }

    /// One copy of a segment for one micro-batch: forward and backward instructions.
    fn segment(&self, seg: &Segment, held: &mut Vec<TensorId>) -> SegmentLowered {
        let mut forward = Vec::new();
        let mut per_op_backward: Vec<Vec<Instr>> = Vec::new();
        let mut column_seen: Vec<TensorId> = Vec::new();
        let mut deferred: Vec<(usize, Vec<Instr>)> = Vec::new();
        let bpe = self.bpe;
        let block = seg.kind == SegmentKind::Block;
        for (op, attn_part) in seg.ops.iter().zip(attention_half(seg)) {
            let mut c = OpComm::default();
            match op.role {
                TpRole::ColumnParallel | TpRole::VocabHead => {
                    if let Some(&x) = op.inputs.first() {
                        if !column_seen.contains(&x) {
                            column_seen.push(x);
                            self.column(x, attn_part, &mut c);
                        }
                    }
                }
                TpRole::RowParallel | TpRole::VocabEmbedding => {
                    if let Some(&y) = op.outputs.first() {
                        self.row(y, attn_part, &mut c);
                    }
                }
                TpRole::Experts if self.ep <= 1 => {
                    // Without an expert axis the experts are a column/row pair on `tp`.
                    if let Some(&x) = op.inputs.first() {
                        let mut col = OpComm::default();
                        self.column(x, false, &mut col);
                        c.pre.extend(col.pre);
                        c.post.extend(col.post);
                        c.bpre.extend(col.bpre);
                        // The router reads the same input and, fed by partial expert
                        // outputs, also returns a partial gradient: reduce after its
                        // backward, which runs after the experts'.
                        let router = op.inputs.get(1).and_then(|logits| {
                            seg.ops
                                .iter()
                                .position(|o| o.outputs.first() == Some(logits))
                        });
                        match router {
                            Some(r) => deferred.push((r, col.bpost)),
                            None => c.bpost.extend(col.bpost),
                        }
                        // Under sequence parallelism the router scores only this
                        // rank's tokens: the experts gather the scores with the
                        // tokens, and return their (partial) gradient scattered.
                        if self.sp && !self.dp_attention {
                            if let Some(&logits) = op.inputs.get(1) {
                                let full = self.full_bytes(logits);
                                let name = self.tensor_name(logits);
                                c.pre.extend(self.tp_coll(
                                    CollectiveKind::AllGather,
                                    Target::activation(name.clone()),
                                    full,
                                ));
                                c.bpost.extend(self.tp_coll(
                                    CollectiveKind::ReduceScatter,
                                    Target::ActivationGrad { tensor: name },
                                    full,
                                ));
                            }
                        }
                    }
                    if let Some(&y) = op.outputs.first() {
                        self.row(y, false, &mut c);
                    }
                }
                TpRole::VocabLoss if self.sampling => {
                    // Each sequence's last-position logits (fp32, the whole
                    // vocabulary), gathered over the tensor axis to sample from.
                    if let Some(&logits) = op.inputs.first() {
                        let last = self.graph.tensor(logits).bytes().eval(&DimEnv {
                            seq: 1.0,
                            ..self.env
                        });
                        c.post.extend(self.tp_coll(
                            CollectiveKind::AllGather,
                            Target::activation(self.tensor_name(logits)),
                            last,
                        ));
                    }
                }
                TpRole::VocabLoss => {
                    // Max, sum of exponentials and the target logit, one float per
                    // token each: the loss runs in three phases around these.
                    let tokens = self.env.batch * self.env.seq / self.cp as f64;
                    for stat in [LossStat::Max, LossStat::SumExp, LossStat::Target] {
                        c.post.extend(self.tp_coll(
                            CollectiveKind::AllReduce,
                            Target::LossStat {
                                op: op.name.clone(),
                                stat,
                            },
                            tokens * 4.0,
                        ));
                    }
                }
                _ => {}
            }
            if let OpKind::Experts(e) = &op.kind {
                if self.ep > 1 {
                    // The busiest rank's slice of its tensor group's tokens, and of
                    // a sequence for a capacity group (even shares under sequence
                    // parallelism); decoding routes dropless
                    // (`ExpertsShape::dispatched_rows`).
                    let slice = |n: f64| meshplan_ir::graph::expert_slice(n, self.tp);
                    let tokens = slice(self.env.batch * self.env.seq / self.cp as f64);
                    let group =
                        (self.env.kv <= self.env.seq).then(|| slice(self.env.seq / self.cp as f64));
                    let bytes = e.dispatched_rows(tokens, group) * e.hidden as f64 * bpe;
                    let a2a = |exchange| {
                        collective(
                            CollectiveKind::AllToAll,
                            "ep",
                            Axis::Ep,
                            self.ep,
                            Target::Experts {
                                op: op.name.clone(),
                                exchange,
                            },
                            bytes,
                        )
                    };
                    c.pre.push(a2a(Exchange::Dispatch));
                    c.post.push(a2a(Exchange::Combine));
                    // Without sequence parallelism (inference) every tensor rank
                    // holds the same tokens and routes its own slice of them: the
                    // slices' outputs, padded to equal length, are gathered.
                    let held = self.env.batch * self.env.seq / self.cp as f64;
                    let sliced = !self.sp && !self.dp_attention && held > 0.0;
                    if let (Some(&y), true) = (op.outputs.first(), sliced) {
                        let rows = meshplan_ir::graph::sliced_expert_rows(held, self.tp);
                        let gathered = self.full_bytes(y) * rows / held;
                        c.post.extend(self.tp_coll(
                            CollectiveKind::AllGather,
                            Target::Experts {
                                op: op.name.clone(),
                                exchange: Exchange::Gather,
                            },
                            gathered,
                        ));
                    }
                    c.bpre.push(a2a(Exchange::GradCombine));
                    c.bpost.push(a2a(Exchange::GradDispatch));
                }
            }
            if matches!(op.kind, OpKind::Attention(_)) && self.cp > 1 && self.pg.heads > 0 {
                let t = self.tp.max(1) as f64;
                let kv_heads_local = (self.pg.kv_heads as f64 / t).max(1.0);
                let per_head = self.pg.kv_bytes_per_token_layer / (self.pg.kv_heads.max(1) as f64);
                let kv_block =
                    self.env.batch * self.env.seq / self.cp as f64 * kv_heads_local * per_head;
                let steps = self.cp - 1;
                let ring = |what: &str| Instr::RingPass {
                    group: "cp".into(),
                    axis: Axis::Cp,
                    tensor: format!("{}.{what}", op.name),
                    steps,
                    bytes_per_step: kv_block,
                    bytes_sent: steps as f64 * kv_block,
                };
                c.pre.push(ring("kv"));
                c.bpre.push(ring("kv"));
                c.bpost.push(ring("grad:kv"));
            }
            let fwd_op = self.compute(op, attn_part, false);
            // Recomputed attention under context parallelism passes the key/value
            // ring again (the forward's ring markers, before the op).
            let rings: Vec<Instr> = c
                .pre
                .iter()
                .filter(|i| matches!(i, Instr::RingPass { .. }))
                .cloned()
                .collect();
            forward.extend(c.pre);
            forward.push(fwd_op.clone());
            forward.extend(c.post);
            let mut b = c.bpre;
            if block
                && self.recompute == Recompute::Selective
                && matches!(op.kind, OpKind::Attention(_))
            {
                let mut body = rings;
                body.push(fwd_op);
                b.push(Instr::Recompute { body });
            }
            b.push(self.compute(op, attn_part, true));
            b.extend(c.bpost);
            per_op_backward.push(b);
        }
        for (r, instrs) in deferred {
            if let Some(list) = per_op_backward.get_mut(r) {
                list.extend(instrs);
            }
        }
        let mut backward: Vec<Instr> = Vec::new();
        if block && self.recompute == Recompute::Full {
            backward.push(Instr::Recompute {
                body: forward.clone(),
            });
        }
        backward.extend(per_op_backward.into_iter().rev().flatten());
        let (dense, experts) = self.params(seg, held);
        let seq_partial = if self.tp > 1 {
            meshplan_ir::graph::tp_partial_weights(self.graph, seg, self.sp, self.ep <= 1)
                .iter()
                .filter_map(|&w| self.graph.tensors.get(w.0 as usize))
                .map(|t| t.elems().coef)
                .sum()
        } else {
            0.0
        };
        // Under ZeRO-3 the data-parallel ReduceScatter below leaves each rank only a
        // slice of this segment's gradients, so the tensor-parallel partial sums of
        // sequence-parallel (and router) weights must meet first, per segment copy
        // and micro-batch, as FSDP with DTensor tensor parallelism does.
        let seq_partial_here = self.zero3 && self.dense_dp > 1 && dense > 0.0 && seq_partial > 0.0;
        if self.zero3 {
            // FSDP: gather this segment's parameters before its forward and again
            // before its backward, scatter its gradients after.
            let mut f_pre = Vec::new();
            let mut b_pre = Vec::new();
            let mut b_post = Vec::new();
            for (params, group, n, set) in [
                (dense, "dp", self.dense_dp, ParamSet::Dense),
                (experts, "edp", self.expert_dp, ParamSet::Experts),
            ] {
                if n <= 1 || params <= 0.0 {
                    continue;
                }
                let (p, g) = (params * self.bpe, params * self.grad_bpe);
                let segment = seg.name.clone();
                let gather = || {
                    collective(
                        CollectiveKind::AllGather,
                        group,
                        Axis::Dp,
                        n,
                        Target::SegmentParams {
                            segment: segment.clone(),
                            set,
                        },
                        p,
                    )
                };
                f_pre.push(gather());
                b_pre.push(gather());
                if seq_partial_here && set == ParamSet::Dense {
                    b_post.push(collective(
                        CollectiveKind::AllReduce,
                        "tp",
                        Axis::Tp,
                        self.tp,
                        Target::SegmentSeqPartialGrads {
                            segment: segment.clone(),
                        },
                        seq_partial * self.grad_bpe,
                    ));
                }
                b_post.push(collective(
                    CollectiveKind::ReduceScatter,
                    group,
                    Axis::Dp,
                    n,
                    Target::SegmentGrads { segment, set },
                    g,
                ));
            }
            forward.splice(0..0, f_pre);
            backward.splice(0..0, b_pre);
            backward.extend(b_post);
        }
        SegmentLowered {
            forward,
            backward,
            dense_params: dense,
            expert_params: experts,
            seq_partial_params: if seq_partial_here { 0.0 } else { seq_partial },
        }
    }
}

/// Communication around one op.
#[derive(Default)]
struct OpComm {
    /// Forward, before the op.
    pre: Vec<Instr>,
    /// Forward, after the op.
    post: Vec<Instr>,
    /// Backward, before the op's backward.
    bpre: Vec<Instr>,
    /// Backward, after the op's backward.
    bpost: Vec<Instr>,
}

// === pipeline order ===

#[derive(Clone, Copy)]
struct RawTask {
    forward: bool,
    mb: usize,
    chunk: usize,
}

/// The cost model's per-stage order before any reordering (Megatron's 1F1B and
/// interleaved 1F1B; GPipe all forwards then all backwards).
fn initial_order(
    pp: usize,
    vpp: usize,
    m: usize,
    stage: usize,
    schedule: Schedule,
) -> Vec<RawTask> {
    let total = m * vpp;
    let mut order = Vec::with_capacity(2 * total);
    match schedule {
        Schedule::Gpipe => {
            for forward in [true, false] {
                for c in 0..vpp {
                    let chunk = if forward { c } else { vpp - 1 - c };
                    order.extend((0..m).map(|mb| RawTask { forward, mb, chunk }));
                }
            }
        }
        Schedule::OneFOneB | Schedule::Interleaved => {
            let mut fwd = Vec::with_capacity(total);
            let mut bwd = Vec::with_capacity(total);
            let mut g = 0;
            while g * pp < m {
                let group = g * pp..((g + 1) * pp).min(m);
                for c in 0..vpp {
                    for mb in group.clone() {
                        fwd.push(RawTask {
                            forward: true,
                            mb,
                            chunk: c,
                        });
                        bwd.push(RawTask {
                            forward: false,
                            mb,
                            chunk: vpp - 1 - c,
                        });
                    }
                }
                g += 1;
            }
            let warmup = schedule.warmup_forwards(pp, vpp, stage, total);
            order.extend_from_slice(&fwd[..warmup]);
            for k in 0..total - warmup {
                order.push(fwd[warmup + k]);
                order.push(bwd[k]);
            }
            order.extend_from_slice(&bwd[total - warmup..]);
        }
    }
    order
}

/// The order each stage runs its (pass, chunk, micro-batch) tasks in, as the cost
/// model's pipeline simulation runs them: Megatron's order, and where a partial last
/// group of micro-batches would make a stage wait on work queued behind its own next
/// task, the earliest ready task moved forward (the simulation's rule, which depends
/// on dependencies only, not on durations). Errors if the order cannot complete.
pub fn stage_orders(
    pp: u64,
    vpp: u64,
    microbatches: u64,
    schedule: Schedule,
) -> Result<Vec<Vec<Task>>, LowerError> {
    let tasks = 2u64
        .saturating_mul(pp)
        .saturating_mul(vpp)
        .saturating_mul(microbatches);
    if tasks > SCHEDULE_TASKS_MAX {
        return Err(LowerError::LimitExceeded {
            what: "schedule tasks (2 * pp * vpp * micro-batches)",
            limit: SCHEDULE_TASKS_MAX,
        });
    }
    let (pp, vpp, m) = (
        pp.max(1) as usize,
        vpp.max(1) as usize,
        microbatches.max(1) as usize,
    );
    let nvs = pp * vpp;
    let mut orders: Vec<Vec<RawTask>> = (0..pp)
        .map(|i| initial_order(pp, vpp, m, i, schedule))
        .collect();
    let mut f_done = vec![false; nvs * m];
    let mut b_done = vec![false; nvs * m];
    let ready = |t: &RawTask, i: usize, f_done: &[bool], b_done: &[bool]| -> bool {
        let vs = t.chunk * pp + i;
        if t.forward {
            vs == 0 || f_done[(vs - 1) * m + t.mb]
        } else if vs == nvs - 1 {
            f_done[vs * m + t.mb]
        } else {
            b_done[(vs + 1) * m + t.mb]
        }
    };
    let mut next = vec![0usize; pp];
    let mut remaining: usize = orders.iter().map(Vec::len).sum();
    while remaining > 0 {
        let mut progressed = false;
        for i in 0..pp {
            while next[i] < orders[i].len() {
                let t = orders[i][next[i]];
                if !ready(&t, i, &f_done, &b_done) {
                    break;
                }
                let vs = t.chunk * pp + i;
                if t.forward {
                    f_done[vs * m + t.mb] = true;
                } else {
                    b_done[vs * m + t.mb] = true;
                }
                next[i] += 1;
                remaining -= 1;
                progressed = true;
            }
        }
        if !progressed {
            let mut moved = false;
            for i in 0..pp {
                let found =
                    (next[i]..orders[i].len()).find(|&j| ready(&orders[i][j], i, &f_done, &b_done));
                if let Some(j) = found {
                    orders[i][next[i]..=j].rotate_right(1);
                    moved = true;
                    break;
                }
            }
            if !moved {
                return Err(invalid(
                    "schedule",
                    format!("the pipeline order deadlocks (pp={pp}, vpp={vpp}, micro-batches={m})"),
                ));
            }
        }
    }
    Ok(orders
        .into_iter()
        .map(|o| {
            o.into_iter()
                .map(|t| Task {
                    pass: if t.forward { Pass::F } else { Pass::B },
                    chunk: t.chunk as u64,
                    mb: t.mb as u64,
                })
                .collect()
        })
        .collect())
}

// === plan assembly ===

/// Communication groups of a configuration (the cost model's `Groups::new` layout:
/// tensor innermost, then context, data, pipeline; experts on contiguous blocks of
/// `ep` ranks inside a stage, the expert data group strided by `ep`).
/// `tied`: embedding and head share a table, so with several stages the first and
/// the last form the `embed` group that reduces its gradient.
fn mesh_info(cfg: &ParallelConfig, tied: bool) -> MeshInfo {
    let axes = ["pp", "dp", "cp", "tp"].map(String::from).to_vec();
    let stage_ranks = cfg.dp * cfg.cp * cfg.tp;
    let ep = cfg.ep.max(1);
    let group = |name: &str, over: &[&str], size: u64, stride: u64| GroupSpec {
        name: name.to_string(),
        over: over.iter().map(|s| s.to_string()).collect(),
        size,
        stride,
    };
    MeshInfo {
        axes,
        shape: vec![cfg.pp, cfg.dp, cfg.cp, cfg.tp],
        placement_axes: ["dp", "cp", "tp"].map(String::from).to_vec(),
        groups: vec![
            group("tp", &["tp"], cfg.tp, 1),
            group("cp", &["cp"], cfg.cp, 1),
            group("dp", &["dp", "cp"], cfg.dp * cfg.cp, 1),
            group("ep", &["dp", "cp", "tp"], ep, 1),
            if ep > 1 {
                group("edp", &["dp", "cp", "tp"], (stage_ranks / ep).max(1), ep)
            } else {
                // Experts split over tp share the dense data axis.
                group("edp", &["dp", "cp"], cfg.dp * cfg.cp, 1)
            },
            group("pp", &["pp"], cfg.pp, 1),
        ]
        .into_iter()
        .chain((tied && cfg.pp > 1).then(|| group("embed", &["pp"], 2, cfg.pp - 1)))
        .collect(),
    }
}

fn rank_table(cfg: &ParallelConfig, gpus_per_node: u64) -> Vec<RankEntry> {
    let world = cfg.world_size();
    let gpn = gpus_per_node.max(1);
    (0..world)
        .map(|r| {
            let tp = r % cfg.tp;
            let cp = (r / cfg.tp) % cfg.cp;
            let dp = (r / (cfg.tp * cfg.cp)) % cfg.dp;
            let pp = r / (cfg.tp * cfg.cp * cfg.dp);
            RankEntry {
                rank: r,
                node: r / gpn,
                local_gpu: r % gpn,
                coords: vec![pp, dp, cp, tp],
                program: pp as u32,
            }
        })
        .collect()
}

fn model_info(name: &str, graph: &Graph, pg: &PreparedGraph) -> ModelInfo {
    ModelInfo {
        name: name.to_string(),
        dtype: pg.dtype,
        layers: pg.layers,
        params: graph.param_count(false),
        segments: graph
            .segments
            .iter()
            .map(|s| SegmentInfo {
                name: s.name.clone(),
                kind: s.kind,
                repeat: s.repeat,
                ops: s.ops.iter().map(|o| o.name.clone()).collect(),
            })
            .collect(),
        transformer: None,
    }
}

fn check_common(input: &LowerInput<'_>, chunks: u64) -> Result<(), LowerError> {
    let cfg = input.cfg;
    for (name, v) in [
        ("dp", cfg.dp),
        ("tp", cfg.tp),
        ("pp", cfg.pp),
        ("cp", cfg.cp),
        ("ep", cfg.ep),
        ("mbs", cfg.mbs),
        ("vpp", cfg.vpp),
    ] {
        if v == 0 {
            return Err(invalid("configuration", format!("{name} must be positive")));
        }
    }
    let world = cfg
        .dp
        .checked_mul(cfg.tp)
        .and_then(|v| v.checked_mul(cfg.pp))
        .and_then(|v| v.checked_mul(cfg.cp))
        .ok_or_else(|| invalid("configuration", "dp * tp * pp * cp overflows".into()))?;
    if world > RANKS_MAX {
        return Err(LowerError::LimitExceeded {
            what: "ranks",
            limit: RANKS_MAX,
        });
    }
    let gpus = input.cluster.gpus();
    if world != gpus {
        return Err(invalid(
            "configuration",
            format!(
                "dp({}) * tp({}) * pp({}) * cp({}) = {world} != GPUs({gpus})",
                cfg.dp, cfg.tp, cfg.pp, cfg.cp
            ),
        ));
    }
    if !(cfg.dp * cfg.cp * cfg.tp).is_multiple_of(cfg.ep) {
        return Err(invalid(
            "configuration",
            format!(
                "ep({}) must divide dp({}) * cp({}) * tp({})",
                cfg.ep, cfg.dp, cfg.cp, cfg.tp
            ),
        ));
    }
    let split = input.layer_split;
    let layers = input.prepared.layers;
    if split.len() as u64 != chunks || split.iter().sum::<u64>() != layers {
        return Err(invalid(
            "layer split",
            format!("expected {chunks} chunks summing to {layers} layers, got {split:?}"),
        ));
    }
    if cfg.zero > 3 {
        return Err(invalid(
            "configuration",
            format!("zero({}) must be 0, 1, 2 or 3", cfg.zero),
        ));
    }
    Ok(())
}

fn placements_map(
    placements: &[(String, Vec<String>)],
) -> Result<BTreeMap<String, Vec<String>>, LowerError> {
    let mut map = BTreeMap::new();
    for (name, p) in placements {
        if p.len() != 3 {
            return Err(invalid(
                "placements",
                format!(
                    "`{name}` has {} entries; expected one per axis of dp, cp, tp",
                    p.len()
                ),
            ));
        }
        // Repeated blocks of different kinds (DeepSeek's dense and MoE layers) name
        // their shared tensors alike; one placement for both is fine, two are not.
        if let Some(prev) = map.insert(name.clone(), p.clone()) {
            if prev != *p {
                return Err(invalid(
                    "placements",
                    format!("`{name}` is given twice, as {prev:?} and {p:?}"),
                ));
            }
        }
    }
    Ok(map)
}

/// What every phase builder needs besides the layout.
struct PhaseSpec {
    kind: PhaseKind,
    /// Model chunks per stage.
    vpp: u64,
    pp: u64,
    microbatches: u64,
    schedule: Schedule,
    /// Bytes of the boundary activation one rank sends per micro-batch.
    p2p_bytes: f64,
    /// Receivers all-gather the boundary over `tp` (the scatter-gather send).
    p2p_gather_tp: bool,
    training: bool,
    /// Parameters per data-parallel gradient bucket.
    bucket_params: f64,
}

/// Layer range of each chunk.
fn bounds(split: &[u64]) -> Vec<u64> {
    std::iter::once(0)
        .chain(split.iter().scan(0u64, |acc, &n| {
            *acc += n;
            Some(*acc)
        }))
        .collect()
}

/// The phases of every stage (one list per stage).
fn build_phase(
    layout: &Layout<'_>,
    spec: &PhaseSpec,
    split: &[u64],
    step_params: &mut Vec<(f64, f64)>,
) -> Result<Vec<Phase>, LowerError> {
    let graph = layout.graph;
    let pp = spec.pp as usize;
    let vpp = spec.vpp as usize;
    let nvs = pp * vpp;
    let b = bounds(split);
    let orders = if spec.training {
        stage_orders(spec.pp, spec.vpp, spec.microbatches, spec.schedule)?
    } else {
        // One batch flows through the stages once: each stage runs its chunk once.
        (0..pp)
            .map(|_| {
                vec![Task {
                    pass: Pass::F,
                    chunk: 0,
                    mb: 0,
                }]
            })
            .collect()
    };
    let tp = layout.tp.max(1);
    let mut phases = Vec::with_capacity(pp);
    step_params.clear();
    for (i, order) in orders.into_iter().enumerate() {
        let mut chunks = Vec::with_capacity(vpp);
        let (mut dense, mut experts, mut seq_partial) = (0.0, 0.0, 0.0);
        for c in 0..vpp {
            let vs = c * pp + i;
            let (lo, hi) = (b[vs], b[vs + 1]);
            let mut held: Vec<TensorId> = Vec::new();
            let mut segs = Vec::new();
            let mut fwd_segs = Vec::new();
            let mut bwd_segs = Vec::new();
            let mut layer = 0u64;
            for seg in &graph.segments {
                let n = match seg.kind {
                    SegmentKind::Embed => u64::from(vs == 0),
                    SegmentKind::Head => u64::from(vs == nvs - 1),
                    SegmentKind::Block => {
                        let (start, end) = (layer, layer + seg.repeat);
                        layer = end;
                        hi.min(end).saturating_sub(lo.max(start))
                    }
                };
                if n == 0 {
                    continue;
                }
                let lowered = layout.segment(seg, &mut held);
                dense += n as f64 * lowered.dense_params;
                experts += n as f64 * lowered.expert_params;
                seq_partial += n as f64 * lowered.seq_partial_params;
                segs.push(ChunkSegment {
                    segment: seg.name.clone(),
                    repeat: n,
                });
                fwd_segs.push(Instr::Segment {
                    name: seg.name.clone(),
                    kind: seg.kind,
                    repeat: n,
                    body: lowered.forward,
                });
                if spec.training {
                    bwd_segs.push(Instr::Segment {
                        name: seg.name.clone(),
                        kind: seg.kind,
                        repeat: n,
                        body: lowered.backward,
                    });
                }
            }
            let p2p = |recv: bool, peer: usize, payload: Payload| {
                let tensor = match payload {
                    Payload::Activation => "hidden_states".to_string(),
                    Payload::Gradient => "grad:hidden_states".to_string(),
                };
                let peer_stage = (peer % pp) as u64;
                if recv {
                    Instr::Recv {
                        peer_stage,
                        tensor,
                        payload,
                        bytes: spec.p2p_bytes,
                    }
                } else {
                    Instr::Send {
                        peer_stage,
                        tensor,
                        payload,
                        bytes: spec.p2p_bytes,
                    }
                }
            };
            let gather = |payload: Payload| {
                let target = match payload {
                    Payload::Activation => Target::HiddenStates,
                    Payload::Gradient => Target::HiddenStatesGrad,
                };
                (spec.p2p_gather_tp && tp > 1).then(|| {
                    collective(
                        CollectiveKind::AllGather,
                        "tp",
                        Axis::Tp,
                        tp,
                        target,
                        spec.p2p_bytes * tp as f64,
                    )
                })
            };
            let mut forward = Vec::new();
            if vs > 0 && pp > 1 {
                forward.push(p2p(true, vs - 1, Payload::Activation));
                forward.extend(gather(Payload::Activation));
            }
            forward.extend(fwd_segs);
            if vs + 1 < nvs && pp > 1 {
                forward.push(p2p(false, vs + 1, Payload::Activation));
            }
            let mut backward = Vec::new();
            if spec.training {
                if vs + 1 < nvs && pp > 1 {
                    backward.push(p2p(true, vs + 1, Payload::Gradient));
                    backward.extend(gather(Payload::Gradient));
                }
                backward.extend(bwd_segs.into_iter().rev());
                if vs > 0 && pp > 1 {
                    backward.push(p2p(false, vs - 1, Payload::Gradient));
                }
            }
            chunks.push(ChunkProgram {
                chunk: c as u64,
                virtual_stage: vs as u64,
                layer_start: lo,
                layer_end: hi,
                segments: segs,
                forward,
                backward,
            });
        }
        step_params.push((dense, experts));
        let mut phase = Phase {
            kind: spec.kind,
            dims: PhaseDims {
                batch: layout.env.batch,
                seq: layout.env.seq,
                kv: layout.env.kv,
            },
            microbatches: spec.microbatches,
            chunks,
            schedule: order,
            step: Vec::new(),
            comm_bytes_per_gpu: Default::default(),
        };
        if spec.training {
            let (per_mb, step) = optimizer_step(layout, dense, experts, spec.bucket_params);
            phase.step = step;
            // ZeRO-2 reduce-scatters the dense gradients in every micro-batch.
            let dense_per_mb = layout.zero == 2 && layout.dense_dp > 1 && dense > 0.0;
            let tied = layout.tied_params();
            if pp > 1 && tied > 0.0 && (i == 0 || i == pp - 1) {
                // The first and the last stage each hold the tied table: its two
                // gradients are summed before the data-parallel reduction.
                phase.step.insert(
                    0,
                    collective(
                        CollectiveKind::AllReduce,
                        "embed",
                        Axis::Pp,
                        2,
                        Target::TiedGrads,
                        tied * layout.grad_bpe,
                    ),
                );
            }
            if seq_partial > 0.0 {
                // First, so the data-parallel reduction sees whole gradients.
                let sum = collective(
                    CollectiveKind::AllReduce,
                    "tp",
                    Axis::Tp,
                    layout.tp,
                    Target::SeqPartialGrads,
                    seq_partial * layout.grad_bpe,
                );
                if dense_per_mb {
                    phase.chunks[0].backward.push(sum);
                } else {
                    phase.step.insert(0, sum);
                }
            }
            phase.chunks[0].backward.extend(per_mb);
        }
        phase.comm_bytes_per_gpu = phase.bytes_sent();
        phases.push(phase);
    }
    Ok(phases)
}

/// The data groups' gradient reduction per the ZeRO stage, the update of this
/// rank's share of the parameters and the gather of the updated parameters (ZeRO
/// 1, 2): `(per micro-batch, per step)`. ZeRO-2 shards the gradients themselves:
/// its reduce-scatters come back apart, to close the stage's backward of every
/// micro-batch (its first chunk's), each rank adding up its part, so that no rank
/// holds whole gradients from one micro-batch to the next (DeepSpeed's stage 2
/// reduces in every micro-batch for this reason); every other stage reduces once
/// per step.
fn optimizer_step(
    layout: &Layout<'_>,
    dense: f64,
    experts: f64,
    bucket_params: f64,
) -> (Vec<Instr>, Vec<Instr>) {
    let zero = layout.zero;
    let groups = [
        (dense, "dp", layout.dense_dp, ParamSet::Dense),
        (experts, "edp", layout.expert_dp, ParamSet::Experts),
    ];
    let mut reduce = Vec::new();
    let mut gather = Vec::new();
    let mut update = Vec::new();
    for (params, group, n, set) in groups {
        if params <= 0.0 {
            continue;
        }
        if n > 1 && zero < 3 {
            // Buckets of whole shards: a multiple of the group size each, so every
            // rank owns an equal slice of every bucket.
            let total = params.round() as u64;
            let size = ((bucket_params.max(1.0) as u64) / n).max(1) * n;
            let mut start = 0u64;
            while start < total {
                let end = (start + size).min(total);
                let range = (start > 0 || end < total).then_some((start, end));
                let elems = (end - start) as f64;
                let (p, g) = (elems * layout.bpe, elems * layout.grad_bpe);
                if zero == 0 {
                    reduce.push(collective(
                        CollectiveKind::AllReduce,
                        group,
                        Axis::Dp,
                        n,
                        Target::GradBucket { set, range },
                        g,
                    ));
                } else {
                    reduce.push(collective(
                        CollectiveKind::ReduceScatter,
                        group,
                        Axis::Dp,
                        n,
                        Target::GradBucket { set, range },
                        g,
                    ));
                    gather.push(collective(
                        CollectiveKind::AllGather,
                        group,
                        Axis::Dp,
                        n,
                        Target::ParamBucket { set, range },
                        p,
                    ));
                }
                start = end;
            }
        }
        let share = if zero >= 1 { n.max(1) as f64 } else { 1.0 };
        update.push(Instr::Optimizer {
            name: "adamw".into(),
            params: set,
            elements: params / share,
        });
    }
    if zero == 2 {
        update.extend(gather);
        return (reduce, update);
    }
    reduce.extend(update);
    reduce.extend(gather);
    (Vec::new(), reduce)
}

/// Lowers a training configuration into a plan: one `train` phase per stage.
pub fn lower_train(input: &LowerInput<'_>) -> Result<Plan, LowerError> {
    let cfg = input.cfg;
    let (seq_len, global_batch) = match input.workload {
        Workload::Train {
            seq_len,
            global_batch,
            ..
        } => (*seq_len, *global_batch),
        Workload::Inference { .. } => {
            return Err(invalid(
                "workload",
                "lower_train needs a training workload; use lower_inference".into(),
            ))
        }
    };
    check_common(input, cfg.pp * cfg.vpp)?;
    if seq_len == 0 || global_batch == 0 || !seq_len.is_multiple_of(cfg.cp) {
        return Err(invalid(
            "workload",
            format!(
                "seq_len({seq_len}) must be a positive multiple of cp({}) and global_batch({global_batch}) positive",
                cfg.cp
            ),
        ));
    }
    let pg = input.prepared;
    let microbatches = global_batch.div_ceil(cfg.dp * cfg.mbs);
    let seq = seq_len as f64;
    let bpe = pg.dtype.size_bytes() as f64;
    let mech = Mechanisms::of(input.workload.framework());
    let layout = Layout {
        graph: input.graph,
        pg,
        tp: cfg.tp,
        cp: cfg.cp,
        ep: cfg.ep,
        sp: cfg.sp && cfg.tp > 1,
        dp_attention: false,
        recompute: cfg.recompute,
        env: DimEnv {
            batch: cfg.mbs as f64,
            seq,
            kv: seq,
        },
        bpe,
        grad_bpe: mech.grad_sum_bytes(bpe),
        zero3: cfg.zero >= 3,
        zero: cfg.zero,
        dense_dp: cfg.dp * cfg.cp,
        expert_dp: crate::cost_model::estimate::expert_dp_of(cfg),
        weight_dim: weight_dims(input.graph),
        sampling: false,
    };
    let p2p_bytes = pg.boundary_bytes_per_token * cfg.mbs as f64 * seq
        / cfg.cp as f64
        / if cfg.tp > 1 { cfg.tp as f64 } else { 1.0 };
    let spec = PhaseSpec {
        kind: PhaseKind::Train,
        vpp: cfg.vpp,
        pp: cfg.pp,
        microbatches,
        schedule: cfg.schedule,
        p2p_bytes,
        // Under sequence parallelism the boundary is already split along the
        // sequence, so nothing is gathered.
        p2p_gather_tp: !(cfg.sp && cfg.tp > 1),
        training: true,
        bucket_params: input.dp_bucket_params,
    };
    let mut params = Vec::new();
    let phases = build_phase(&layout, &spec, input.layer_split, &mut params)?;
    let programs = phases
        .into_iter()
        .enumerate()
        .map(|(i, ph)| Program {
            id: i as u32,
            stage: i as u64,
            phases: vec![ph],
        })
        .collect();
    assemble(input, PlanKind::Train, programs)
}

/// Lowers an inference configuration: per stage a `prefill` phase (one request's
/// prompt, `seq = kv = prompt_len`) and a `decode` phase (one token for each of the
/// replica's requests, `seq = 1`, `kv` = the mean context), the same block programs
/// at two sizes, as `estimate_inference` prices them.
pub fn lower_inference(input: &LowerInput<'_>) -> Result<Plan, LowerError> {
    let cfg = input.cfg;
    let (prompt_len, output_len, concurrency) = match input.workload {
        Workload::Inference {
            prompt_len,
            output_len,
            concurrency,
            ..
        } => (*prompt_len, *output_len, *concurrency),
        Workload::Train { .. } => {
            return Err(invalid(
                "workload",
                "lower_inference needs an inference workload; use lower_train".into(),
            ))
        }
    };
    check_common(input, cfg.pp)?;
    if prompt_len == 0 || !prompt_len.is_multiple_of(cfg.cp) {
        return Err(invalid(
            "workload",
            format!(
                "prompt_len({prompt_len}) must be a positive multiple of cp({})",
                cfg.cp
            ),
        ));
    }
    let pg = input.prepared;
    let per_replica = concurrency.div_ceil(cfg.dp).max(1) as f64;
    let mean_ctx = prompt_len as f64 + output_len as f64 / 2.0;
    let base = Layout {
        graph: input.graph,
        pg,
        tp: cfg.tp,
        cp: cfg.cp,
        ep: cfg.ep,
        sp: false,
        dp_attention: cfg.dp_attention,
        recompute: Recompute::None,
        env: DimEnv {
            batch: 1.0,
            seq: prompt_len as f64,
            kv: prompt_len as f64,
        },
        bpe: pg.dtype.size_bytes() as f64,
        grad_bpe: pg.dtype.size_bytes() as f64,
        zero3: false,
        zero: 0,
        dense_dp: cfg.dp * cfg.cp,
        expert_dp: crate::cost_model::estimate::expert_dp_of(cfg),
        weight_dim: weight_dims(input.graph),
        sampling: true,
    };
    let decode = Layout {
        env: DimEnv {
            batch: per_replica,
            seq: 1.0,
            kv: mean_ctx,
        },
        cp: 1,
        weight_dim: base.weight_dim.clone(),
        ..base
    };
    let spec = |kind, tokens: f64| PhaseSpec {
        kind,
        vpp: 1,
        pp: cfg.pp,
        microbatches: 1,
        schedule: Schedule::OneFOneB,
        // Every tensor rank sends the whole activation of its tokens.
        p2p_bytes: tokens * pg.boundary_bytes_per_token,
        p2p_gather_tp: false,
        training: false,
        bucket_params: input.dp_bucket_params,
    };
    let mut params = Vec::new();
    let prefill = build_phase(
        &base,
        &spec(PhaseKind::Prefill, prompt_len as f64 / cfg.cp as f64),
        input.layer_split,
        &mut params,
    )?;
    let decoded = build_phase(
        &decode,
        &spec(PhaseKind::Decode, per_replica),
        input.layer_split,
        &mut params,
    )?;
    let programs = prefill
        .into_iter()
        .zip(decoded)
        .enumerate()
        .map(|(i, (p, d))| Program {
            id: i as u32,
            stage: i as u64,
            phases: vec![p, d],
        })
        .collect();
    assemble(input, PlanKind::Inference, programs)
}

/// The estimate's timeline for the lowered configuration (same graph, cluster and
/// layer split as the estimate the plan carries).
fn timeline_of(input: &LowerInput<'_>) -> Result<Timeline, LowerError> {
    let r = match input.workload {
        Workload::Train {
            seq_len,
            global_batch,
            ..
        } => train_timeline_with(
            input.prepared,
            input.cluster,
            input.cfg,
            *seq_len,
            *global_batch,
            Some(input.layer_split),
            &crate::cost_model::Mechanisms::of(input.workload.framework()),
        )
        .map(|(_, t)| Timeline::Train(t)),
        Workload::Inference { .. } => match InferenceLoad::from_workload(input.workload) {
            Some(load) => inference_timeline(input.prepared, input.cluster, input.cfg, &load)
                .map(|(_, t)| Timeline::Inference(t)),
            None => {
                return Err(invalid(
                    "workload",
                    "an inference workload without its load".into(),
                ))
            }
        },
    };
    r.map_err(|e| invalid("timeline", e.reason))
}

fn assemble(
    input: &LowerInput<'_>,
    kind: PlanKind,
    programs: Vec<Program>,
) -> Result<Plan, LowerError> {
    let cfg = input.cfg;
    let mut predicted = serde_json::to_value(input.estimate)
        .map_err(|e| invalid("estimate", format!("does not serialise: {e}")))?;
    // The schedule the estimate simulated, so pictures and the predicted trace of a
    // plan file replay the cost model's own timeline.
    let timeline = timeline_of(input)?;
    if let serde_json::Value::Object(m) = &mut predicted {
        m.insert(
            "timeline".into(),
            serde_json::to_value(&timeline)
                .map_err(|e| invalid("timeline", format!("does not serialise: {e}")))?,
        );
    }
    Ok(Plan {
        format: PLAN_FORMAT,
        kind,
        model: model_info(input.model_name, input.graph, input.prepared),
        cluster: ClusterInfo {
            name: input.cluster.name.clone(),
            nodes: input.cluster.nodes,
            gpus_per_node: input.cluster.gpus_per_node,
            gpu: input.cluster.gpu.name.clone(),
            gpu_memory_bytes: input.cluster.gpu.memory_bytes,
            spec: serde_json::to_value(input.cluster).ok(),
        },
        workload: input.workload.clone(),
        mesh: mesh_info(cfg, input.prepared.tied),
        strategy: *cfg,
        layer_split: input.layer_split.to_vec(),
        placements: placements_map(&input.placements)?,
        predicted,
        programs,
        ranks: rank_table(cfg, input.cluster.gpus_per_node),
        search: input.search.clone(),
        graph: input.graph.clone(),
        serving: None,
    })
}

/// The standard (Megatron) layout's placements per axis (`dp`, `cp`, `tp`) of every
/// tensor of `graph`, for plans of hand-given configurations: activations
/// `Shard(batch)` on `dp` and `Shard(seq)` on `cp`; on `tp` column-parallel outputs
/// and split weights `Shard` along the split dim, row-parallel outputs `P` (partial,
/// reduced by the collective that follows), the rest `R` (`Shard(seq)` under
/// sequence parallelism); parameters `R` on `dp` (`S(0)` under ZeRO-3).
pub fn standard_placements(graph: &Graph, cfg: &ParallelConfig) -> Vec<(String, Vec<String>)> {
    let dims = weight_dims(graph);
    let sp = cfg.sp && cfg.tp > 1;
    let mut partial = vec![false; graph.tensors.len()];
    for op in graph.ops() {
        if matches!(op.role, TpRole::RowParallel | TpRole::VocabEmbedding) && !sp {
            if let Some(p) = op
                .outputs
                .first()
                .and_then(|y| partial.get_mut(y.0 as usize))
            {
                *p = true;
            }
        }
    }
    graph
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let s = |d: usize| format!("S({d})");
            let place = if t.kind == TensorKind::Weight {
                let dp = if cfg.zero >= 3 { s(0) } else { "R".into() };
                let tp = match t.split {
                    TpSplit::Replicated => "R".into(),
                    _ => s(dims[i].unwrap_or(t.shape.len().saturating_sub(1))),
                };
                vec![dp, "R".into(), tp]
            } else if t.shape.is_empty() {
                vec!["R".into(), "R".into(), "R".into()]
            } else {
                let seq_dim = t.shape.iter().position(|d| *d == Dim::Seq);
                let cp = seq_dim.map_or("R".into(), s);
                let routed = t.shape.len() == 4 && t.split != TpSplit::Replicated;
                let tp = if partial[i] {
                    "P".into()
                } else if routed {
                    seq_dim.map_or("R".into(), s)
                } else if t.split != TpSplit::Replicated {
                    s(t.shape.len() - 1)
                } else if sp && t.kind != TensorKind::Index {
                    seq_dim.map_or("R".into(), s)
                } else {
                    "R".into()
                };
                vec![s(0), cp, tp]
            };
            (t.name.clone(), place)
        })
        .collect()
}
