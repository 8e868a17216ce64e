//! Prices a graph under a parallel layout: per segment (one block, the embedding, the
//! head) and per micro-batch, the forward and backward compute time, the tensor-,
//! context- and expert-parallel communication on the critical path, the bytes each
//! GPU sends, the activations it keeps and the parameters it holds.
//!
//! The layout is the standard one that a configuration names (Megatron tensor
//! parallelism from each op's [`TpRole`], sequence parallelism, ring attention over
//! `cp`, experts over `ep`). [`PreparedGraph`] turns the graph into monomials once, so
//! that pricing a configuration is a few multiplications per op.

use crate::calib;
use crate::cluster::GroupShape;
use crate::collective::{bytes_sent_per_rank, Collective, CommModel};
use crate::compute::Roofline;
use meshplan_ir::graph::ExpertsShape;
use meshplan_ir::graph::{attention_half, AttentionShape};
use meshplan_ir::{
    AttnImpl, DType, DimEnv, Graph, Mono, OpKind, Recompute, SegmentKind, TensorKind, TpRole,
    TpSplit,
};

/// An activation tensor's size and standard split.
#[derive(Clone, Copy, Debug)]
struct Act {
    bytes: Mono,
    split: TpSplit,
}

#[derive(Clone, Debug)]
enum Work {
    /// `batch x [m,k] x [k,n]` with sizes before sharding.
    Gemm {
        batch: Mono,
        m: Mono,
        n: Mono,
        k: Mono,
    },
    Attention(AttentionShape),
    Experts(ExpertsShape),
    /// Memory-bound: forward moves `acts`; backward moves `bwd_factor` times as much.
    Memory {
        acts: Vec<Act>,
        bwd_factor: f64,
    },
}

#[derive(Clone, Debug)]
struct POp {
    work: Work,
    role: TpRole,
    /// Forward model FLOPs, unsharded.
    flops: Mono,
    /// Part of a block's attention half (up to its first residual add); DP-attention
    /// splits these by batch instead of by heads.
    attn_part: bool,
}

/// One segment, prepared.
#[derive(Clone, Debug)]
struct PSegment {
    kind: SegmentKind,
    repeat: u64,
    ops: Vec<POp>,
    /// Tensors kept for backward, each once.
    saved: Vec<Act>,
    /// The segment's input (kept under full recomputation).
    input: Option<Act>,
    /// Tensors whose gradient (or, under SP, whose value) crosses the tensor axis:
    /// inputs of column-parallel ops.
    column_inputs: Vec<(Act, bool)>,
    /// Outputs of row-parallel ops (partial sums), with the op's `attn_part`.
    row_outputs: Vec<(Act, bool)>,
    /// Same, for expert MLPs, which are column/row pairs only when `ep == 1`.
    expert_inputs: Vec<Act>,
    expert_outputs: Vec<Act>,
    /// Router scores the experts read (gathered with the tokens under sequence
    /// parallelism when the experts are split over `tp`).
    expert_scores: Vec<Act>,
    /// Weight elements: replicated over `tp`, sharded over `tp`, routed experts.
    params_replicated: f64,
    params_sharded: f64,
    params_experts: f64,
    /// Of `params_sharded`, those a block's attention half reads first, which
    /// DP-attention holds whole on every tensor rank.
    params_sharded_attn: f64,
    /// Routed experts in one layer (0 if none).
    experts: u64,
    /// Weight elements this segment shares with another segment (tied embeddings).
    params_shared: f64,
    /// Weight elements whose gradient a tensor rank holds as a partial sum: under
    /// sequence parallelism (`[0]`), with experts split over tp (`[1]`).
    params_seq_partial: [f64; 2],
}

/// A graph turned into monomials, ready to be priced many times.
#[derive(Clone, Debug)]
pub struct PreparedGraph {
    segments: Vec<PSegment>,
    /// Compute dtype.
    pub dtype: DType,
    /// Dropout layers present (the unfused attention then keeps a mask and a copy).
    pub dropout: bool,
    /// Bytes per token of the activation passed between pipeline stages.
    pub boundary_bytes_per_token: f64,
    /// Parameters, total.
    pub params_total: f64,
    /// Parameters touched per token.
    pub params_active: f64,
    /// Attention heads (for divisibility checks), 0 if none.
    pub heads: u64,
    /// Key/value heads, 0 if none.
    pub kv_heads: u64,
    /// Routed experts per MoE layer, 0 if dense.
    pub experts: u64,
    /// Key/value bytes per token per layer, for the KV cache (0 if no attention).
    pub kv_bytes_per_token_layer: f64,
    /// Heads the KV cache splits into over tensor ranks: the KV heads, or 1 for
    /// MLA, whose compressed latent every tensor rank keeps whole.
    pub kv_cache_heads: u64,
    /// Block layers.
    pub layers: u64,
    /// Embedding and head share a weight (tied embeddings).
    pub tied: bool,
}

fn einsum_mnk(
    einsum: &str,
    a: &[meshplan_ir::Dim],
    b: &[meshplan_ir::Dim],
) -> (Mono, Mono, Mono, Mono) {
    let mut batch = Mono::constant(1.0);
    let mut m = Mono::constant(1.0);
    let mut n = Mono::constant(1.0);
    let mut k = Mono::constant(1.0);
    let Some((lhs, out)) = einsum.split_once("->") else {
        return (batch, m, n, k);
    };
    let Some((la, lb)) = lhs.split_once(',') else {
        return (batch, m, n, k);
    };
    let mut seen = Vec::new();
    for (letters, shape) in [(la, a), (lb, b)] {
        for (c, d) in letters.chars().zip(shape.iter()) {
            if seen.contains(&c) {
                continue;
            }
            seen.push(c);
            let (in_a, in_b, in_o) = (la.contains(c), lb.contains(c), out.contains(c));
            match (in_a, in_b, in_o) {
                (true, true, true) => batch = batch.times_dim(*d),
                (true, true, false) => k = k.times_dim(*d),
                (true, false, _) => m = m.times_dim(*d),
                (false, true, _) => n = n.times_dim(*d),
                _ => {}
            }
        }
    }
    (batch, m, n, k)
}

impl PreparedGraph {
    /// Prepares `graph` for pricing.
    pub fn new(graph: &Graph) -> PreparedGraph {
        let act = |id: meshplan_ir::TensorId| {
            let t = graph.tensor(id);
            Act {
                bytes: t.bytes(),
                split: t.split,
            }
        };
        let mut dtype = DType::Bf16;
        let mut dropout = false;
        let mut heads = 0;
        let mut kv_heads = 0;
        let mut experts = 0;
        let mut kv_bytes = 0.0;
        let mut layers = 0;
        let mut boundary = 0.0;
        // Weight ids per segment, to find weights two segments share.
        let mut weight_users: Vec<Vec<u32>> = Vec::new();
        let mut segments = Vec::new();
        for seg in &graph.segments {
            let mut ops = Vec::new();
            let mut saved_ids = Vec::new();
            let mut col_ids = Vec::new();
            let mut row_ids = Vec::new();
            let mut exp_in = Vec::new();
            let mut exp_scores = Vec::new();
            let mut exp_out = Vec::new();
            let mut weights: Vec<u32> = Vec::new();
            let (mut p_rep, mut p_sh, mut p_exp, mut p_sh_attn) = (0.0, 0.0, 0.0, 0.0);
            let mut seg_experts = 0;
            for (op, attn_part) in seg.ops.iter().zip(attention_half(seg)) {
                for s in &op.saves {
                    if !saved_ids.contains(s) {
                        saved_ids.push(*s);
                    }
                }
                for &w in &op.inputs {
                    let t = graph.tensor(w);
                    if t.kind != TensorKind::Weight || weights.contains(&w.0) {
                        continue;
                    }
                    weights.push(w.0);
                    let e = t.elems().coef;
                    match t.split {
                        TpSplit::Replicated => p_rep += e,
                        TpSplit::Sharded => {
                            p_sh += e;
                            if attn_part {
                                p_sh_attn += e;
                            }
                        }
                        TpSplit::Experts => p_exp += e,
                    }
                }
                let acts_of = |ids: &[meshplan_ir::TensorId]| -> Vec<Act> {
                    ids.iter()
                        .filter(|&&i| {
                            graph.tensor(i).kind != TensorKind::Weight
                                && graph.tensor(i).kind != TensorKind::Index
                        })
                        .map(|&i| act(i))
                        .collect()
                };
                let work = match &op.kind {
                    OpKind::Matmul { einsum } => {
                        dtype = graph.tensor(op.inputs[1]).dtype;
                        let (batch, m, n, k) = einsum_mnk(
                            einsum,
                            &graph.tensor(op.inputs[0]).shape,
                            &graph.tensor(op.inputs[1]).shape,
                        );
                        Work::Gemm { batch, m, n, k }
                    }
                    OpKind::Attention(a) => {
                        heads = a.heads;
                        kv_heads = a.kv_heads;
                        Work::Attention(*a)
                    }
                    OpKind::Experts(e) => {
                        seg_experts = e.experts;
                        experts = e.experts;
                        Work::Experts(*e)
                    }
                    kind => {
                        let bwd_factor = match kind {
                            OpKind::Norm(_) | OpKind::Activation(_) => 1.5,
                            OpKind::Add => 0.0,
                            OpKind::CrossEntropy { .. } => 2.0,
                            _ => 1.0,
                        };
                        if matches!(kind, OpKind::Dropout) {
                            dropout = true;
                        }
                        let mut acts = acts_of(&op.inputs);
                        acts.extend(acts_of(&op.outputs));
                        // An embedding reads the rows it writes.
                        if matches!(kind, OpKind::Embedding) {
                            acts.extend(acts_of(&op.outputs));
                        }
                        Work::Memory { acts, bwd_factor }
                    }
                };
                match op.role {
                    TpRole::ColumnParallel | TpRole::VocabHead
                        if !col_ids.iter().any(|(i, _)| *i == op.inputs[0]) =>
                    {
                        col_ids.push((op.inputs[0], attn_part));
                    }
                    TpRole::RowParallel | TpRole::VocabEmbedding => {
                        row_ids.push((op.outputs[0], attn_part))
                    }
                    TpRole::Experts => {
                        exp_in.push(op.inputs[0]);
                        exp_scores.extend(op.inputs.get(1).copied());
                        exp_out.push(op.outputs[0]);
                    }
                    _ => {}
                }
                ops.push(POp {
                    work,
                    role: op.role,
                    flops: graph.op_flops(op),
                    attn_part,
                });
            }
            let input = if seg.kind == SegmentKind::Block {
                seg.ops.first().map(|op| act(op.inputs[0]))
            } else {
                None
            };
            if seg.kind == SegmentKind::Block {
                layers += seg.repeat;
                if let Some(i) = input {
                    boundary = i.bytes.coef;
                }
            }
            weight_users.push(weights);
            segments.push(PSegment {
                kind: seg.kind,
                repeat: seg.repeat,
                ops,
                saved: saved_ids.iter().map(|&i| act(i)).collect(),
                input,
                column_inputs: col_ids.iter().map(|&(i, a)| (act(i), a)).collect(),
                row_outputs: row_ids.iter().map(|&(i, a)| (act(i), a)).collect(),
                expert_inputs: exp_in.iter().map(|&i| act(i)).collect(),
                expert_outputs: exp_out.iter().map(|&i| act(i)).collect(),
                expert_scores: exp_scores.iter().map(|&i| act(i)).collect(),
                params_replicated: p_rep,
                params_sharded: p_sh,
                params_sharded_attn: p_sh_attn,
                params_experts: p_exp,
                experts: seg_experts,
                params_shared: 0.0,
                params_seq_partial: [false, true].map(|expert_tp| {
                    meshplan_ir::graph::tp_partial_weights(graph, seg, !expert_tp, expert_tp)
                        .iter()
                        .map(|&w| graph.tensor(w).elems().coef)
                        .sum::<f64>()
                }),
            });
        }
        // Weights used by two segments (a tied embedding): each holder keeps a copy.
        for i in 0..segments.len() {
            let mut shared = 0.0;
            for &w in &weight_users[i] {
                if weight_users
                    .iter()
                    .enumerate()
                    .any(|(j, ws)| j != i && ws.contains(&w))
                {
                    shared += graph.tensors[w as usize].elems().coef;
                }
            }
            segments[i].params_shared = shared;
        }
        let segments_tied = segments.iter().any(|s| s.params_shared > 0.0);
        if let Some(t) = graph.ops().find_map(|op| match &op.kind {
            OpKind::Attention(a) => Some(*a),
            _ => None,
        }) {
            kv_bytes =
                2.0 * (t.kv_heads * t.qk_dim.max(t.v_dim)) as f64 * dtype.size_bytes() as f64;
        }
        PreparedGraph {
            segments,
            dtype,
            dropout,
            boundary_bytes_per_token: boundary,
            params_total: graph.param_count(false),
            params_active: graph.param_count(true),
            heads,
            kv_heads,
            kv_cache_heads: kv_heads,
            experts,
            kv_bytes_per_token_layer: kv_bytes,
            layers,
            tied: segments_tied,
        }
    }

    /// Overrides the KV-cache bytes per token per layer (MLA caches a latent).
    pub fn set_kv_bytes_per_token_layer(&mut self, bytes: f64) {
        self.kv_bytes_per_token_layer = bytes;
    }

    /// Model FLOPs of the forward pass under `env` (matrix products and attention,
    /// unsharded), per segment copy.
    pub fn segment_forward_flops(&self, env: &DimEnv) -> Vec<f64> {
        self.segments
            .iter()
            .map(|s| s.ops.iter().map(|op| op.flops.eval(env)).sum())
            .collect()
    }

    /// Segments as (kind, repeat).
    pub fn segment_kinds(&self) -> impl Iterator<Item = (SegmentKind, u64)> + '_ {
        self.segments.iter().map(|s| (s.kind, s.repeat))
    }
}

/// The layout and the machine a segment is priced on.
#[derive(Clone, Copy, Debug)]
pub struct LayoutCtx {
    /// Tensor-parallel degree.
    pub tp: u64,
    /// Context-parallel degree.
    pub cp: u64,
    /// Expert-parallel degree.
    pub ep: u64,
    /// Sequence parallelism.
    pub sp: bool,
    /// Attention kernel.
    pub attn: AttnImpl,
    /// Recomputation.
    pub recompute: Recompute,
    /// Micro-batch and sequence sizes.
    pub env: DimEnv,
    /// Compute throughput.
    pub roof: Roofline,
    /// Communication.
    pub comm: CommModel,
    /// Where the tensor axis sits.
    pub tp_group: GroupShape,
    /// Where the context axis sits (ring neighbours share a node if `per_node > 1`).
    pub cp_group: GroupShape,
    /// Where the expert axis sits.
    pub ep_group: GroupShape,
    /// Tensor-parallel collectives overlapped with the adjacent GEMMs.
    pub tp_overlap: bool,
    /// Batch split of attention over the tensor axis (inference DP-attention): the
    /// attention part runs data-parallel on the `tp` ranks with full weights.
    pub dp_attention: bool,
    /// Under DP-attention, price the attention half as an even `1 / tp` of the
    /// batch's requests: a busy prefill pool's time per prompt, its ranks prefilling
    /// prompts of their own side by side. Otherwise the busiest rank's whole
    /// requests, which a step (and a lone prompt's TTFT) waits on.
    pub dpa_amortized: bool,
    /// Generation: the head samples instead of computing the loss, so it gathers each
    /// sequence's last-position logits over the tensor axis (fp32, full vocabulary)
    /// in place of the loss's three per-token reductions.
    pub sampling: bool,
}

/// Cost of one copy of a segment for one micro-batch.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SegCost {
    /// Forward compute.
    pub fwd_s: f64,
    /// Backward compute.
    pub bwd_s: f64,
    /// Forward work redone before backward (compute and its communication).
    pub recompute_s: f64,
    /// Communication on the critical path in forward (TP, exposed CP, EP).
    pub comm_fwd_s: f64,
    /// Same in backward.
    pub comm_bwd_s: f64,
    /// Model FLOPs executed by this GPU, forward.
    pub flops_fwd: f64,
    /// FLOPs redone by recomputation on this GPU.
    pub flops_recompute: f64,
    /// Activation bytes kept for backward.
    pub act_bytes: f64,
    /// Extra bytes live while this segment's backward runs (recomputed activations).
    pub act_transient_bytes: f64,
    /// Bytes sent per GPU: tensor, context, expert axes (forward + backward + recompute).
    pub tp_bytes: f64,
    /// Of `tp_bytes`, those sent in the forward pass (all of inference's).
    pub tp_bytes_fwd: f64,
    /// Of `ep_bytes`, those sent in the forward pass.
    pub ep_bytes_fwd: f64,
    /// Context axis.
    pub cp_bytes: f64,
    /// Expert axis.
    pub ep_bytes: f64,
    /// Dense parameters on this GPU (elements).
    pub params_dense: f64,
    /// Routed-expert parameters on this GPU (elements).
    pub params_expert: f64,
    /// Of `params_dense`, those shared with another segment (tied embedding).
    pub params_shared: f64,
    /// Weight elements whose gradient sequence parallelism leaves partial over `tp`.
    pub params_seq_partial: f64,
}

impl LayoutCtx {
    fn tokens_div(&self) -> f64 {
        self.cp as f64
    }

    /// Tokens of one expert-capacity group (`capacity_group_tokens`); `None` while
    /// decoding (see [`ExpertsShape::dispatched_rows`]).
    fn capacity_group(&self) -> Option<f64> {
        let seq = self.env.seq / self.cp as f64;
        let group = if self.ep > 1 {
            meshplan_ir::graph::expert_slice(seq, self.tp)
        } else {
            seq
        };
        (self.env.kv <= self.env.seq).then_some(group)
    }

    /// Tokens the busiest rank routes when the experts split over `ep`: its slice of
    /// the tokens its tensor group holds (`expert_slice`; an even share under
    /// sequence parallelism).
    fn expert_tokens(&self) -> f64 {
        let tokens = self.env.batch * self.env.seq / self.tokens_div();
        meshplan_ir::graph::expert_slice(tokens, self.tp)
    }

    /// Under DP-attention, the busiest tensor rank's share of the replica's batch in
    /// the attention half: each rank attends whole requests of its own, so it holds
    /// `ceil(batch / tp)` of them (one prompt of a lone prefill, whole, on one rank),
    /// not an even `1 / tp` of every request.
    fn dpa_share(&self) -> f64 {
        if self.dpa_amortized {
            return 1.0 / self.tp as f64;
        }
        meshplan_ir::graph::dpa_share(self.env.batch, self.tp)
    }

    /// Local bytes of an activation (`attn_part`: produced in a block's attention half).
    fn local(&self, a: &Act, attn_part: bool) -> f64 {
        let t = self.tp as f64;
        let v = a.bytes.eval(&self.env) / self.tokens_div();
        if self.dp_attention && attn_part {
            return v * self.dpa_share();
        }
        match a.split {
            TpSplit::Sharded | TpSplit::Experts => v / t,
            TpSplit::Replicated if self.sp => v / t,
            TpSplit::Replicated => v,
        }
    }

    /// A collective on the tensor axis: (time, bytes sent).
    fn tp_coll(&self, kind: Collective, bytes: f64) -> (f64, f64) {
        if self.tp <= 1 {
            return (0.0, 0.0);
        }
        (
            self.comm.time_s(kind, self.tp_group, bytes),
            bytes_sent_per_rank(kind, self.tp, bytes),
        )
    }

    fn gemm_local(
        &self,
        op: &POp,
        batch: &Mono,
        m: &Mono,
        n: &Mono,
        k: &Mono,
    ) -> (f64, f64, f64, f64) {
        let role = op.role;
        let t = self.tp as f64;
        let batch = batch.eval(&self.env);
        let mut m = m.eval(&self.env);
        let mut n = n.eval(&self.env);
        let mut k = k.eval(&self.env);
        // Tokens live in `m`; context parallelism splits them.
        m /= self.tokens_div();
        if self.dp_attention && op.attn_part {
            // DP-attention: the attention half keeps whole weights (projections
            // too) and takes the busiest rank's requests instead.
            m *= self.dpa_share();
        } else {
            match role {
                TpRole::ColumnParallel | TpRole::VocabHead | TpRole::Local => n /= t,
                TpRole::RowParallel => k /= t,
                _ if self.sp => m /= t,
                _ => {}
            }
        }
        (batch, m, n, k)
    }

    /// Prices one segment copy for one micro-batch.
    fn segment(&self, seg: &PSegment, pg: &PreparedGraph) -> SegCost {
        let mut c = SegCost::default();
        let t = self.tp as f64;
        let bpe = pg.dtype.size_bytes() as f64;
        let mut attn_fwd_s = 0.0;
        let mut attn_bwd_s = 0.0;
        let mut attn_internal_bytes = 0.0;
        // GEMM time of the tensor-parallel matmuls, which overlapped collectives hide behind.
        let mut tp_gemm_fwd = 0.0;
        let mut tp_gemm_bwd = 0.0;
        let mut flops_attn = 0.0;
        for op in &seg.ops {
            match &op.work {
                Work::Gemm { batch, m, n, k } => {
                    let (batch, m, n, k) = self.gemm_local(op, batch, m, n, k);
                    let w = batch * k * n * bpe;
                    let x = batch * m * k * bpe;
                    let y = batch * m * n * bpe;
                    let f = self.roof.gemm_s(batch, m, n, k, w + x + y);
                    let b = self.roof.gemm_s(batch, m, k, n, w + y + x)
                        + self.roof.gemm_s(batch, k, n, m, x + y + w);
                    if matches!(
                        op.role,
                        TpRole::ColumnParallel | TpRole::RowParallel | TpRole::VocabHead
                    ) {
                        tp_gemm_fwd += f;
                        tp_gemm_bwd += b;
                    }
                    c.fwd_s += f;
                    c.bwd_s += b;
                    c.flops_fwd += 2.0 * batch * m * n * k;
                }
                Work::Attention(a) => {
                    let (f, b, internal, flops) = self.attention(a, pg);
                    attn_fwd_s += f;
                    attn_bwd_s += b;
                    attn_internal_bytes += internal;
                    flops_attn += flops;
                    c.fwd_s += f;
                    c.bwd_s += b;
                    c.flops_fwd += flops;
                }
                Work::Experts(e) => {
                    let (f, b, flops) = self.experts(e, bpe);
                    c.fwd_s += f;
                    c.bwd_s += b;
                    c.flops_fwd += flops;
                }
                Work::Memory { acts, bwd_factor } => {
                    let bytes: f64 = acts.iter().map(|a| self.local(a, op.attn_part)).sum();
                    c.fwd_s += self.roof.memory_s(bytes);
                    c.bwd_s += self.roof.memory_s(bytes * bwd_factor);
                }
            }
        }
        // Tensor-parallel communication of the standard layout: (time, bytes) per pass.
        let mut tp_f = (0.0, 0.0);
        let mut tp_b = (0.0, 0.0);
        let add = |acc: &mut (f64, f64), (time, sent): (f64, f64)| {
            acc.0 += time;
            acc.1 += sent;
        };
        let ep_split = self.ep > 1;
        let col = seg.column_inputs.iter().copied().chain(
            seg.expert_inputs
                .iter()
                .filter(|_| !ep_split)
                .map(|a| (*a, false)),
        );
        let row = seg.row_outputs.iter().copied().chain(
            seg.expert_outputs
                .iter()
                .filter(|_| !ep_split)
                .map(|a| (*a, false)),
        );
        for (a, attn_part) in col {
            let full = a.bytes.eval(&self.env) / self.tokens_div();
            if self.dp_attention {
                // Attention runs data-parallel; the MLP half gathers the tokens first.
                if !attn_part {
                    add(&mut tp_f, self.tp_coll(Collective::AllGather, full));
                }
            } else if self.sp {
                add(&mut tp_f, self.tp_coll(Collective::AllGather, full));
                // Megatron gathers the input again for the weight gradient.
                add(&mut tp_b, self.tp_coll(Collective::AllGather, full));
                add(&mut tp_b, self.tp_coll(Collective::ReduceScatter, full));
            } else {
                add(&mut tp_b, self.tp_coll(Collective::AllReduce, full));
            }
        }
        if !ep_split && self.sp && !self.dp_attention {
            // The router scored only this rank's tokens; the experts gather the scores.
            for a in &seg.expert_scores {
                let full = a.bytes.eval(&self.env) / self.tokens_div();
                add(&mut tp_f, self.tp_coll(Collective::AllGather, full));
                add(&mut tp_b, self.tp_coll(Collective::ReduceScatter, full));
            }
        }
        for (a, attn_part) in row {
            let full = a.bytes.eval(&self.env) / self.tokens_div();
            if self.dp_attention {
                if !attn_part {
                    add(&mut tp_f, self.tp_coll(Collective::ReduceScatter, full));
                }
            } else if self.sp {
                add(&mut tp_f, self.tp_coll(Collective::ReduceScatter, full));
                add(&mut tp_b, self.tp_coll(Collective::AllGather, full));
            } else {
                add(&mut tp_f, self.tp_coll(Collective::AllReduce, full));
            }
        }
        let tokens = self.env.batch * self.env.seq / self.tokens_div();
        if ep_split && !self.sp && !self.dp_attention && tokens > 0.0 {
            // Inference: each tensor rank routes its slice of the same tokens; the
            // slices' outputs, padded to equal length, are gathered (as lowered).
            let rows = meshplan_ir::graph::sliced_expert_rows(tokens, self.tp);
            for a in &seg.expert_outputs {
                let full = a.bytes.eval(&self.env) / self.tokens_div();
                add(
                    &mut tp_f,
                    self.tp_coll(Collective::AllGather, full * rows / tokens),
                );
            }
        }
        for op in &seg.ops {
            if op.role == TpRole::VocabLoss && self.sampling {
                if let Work::Memory { acts, .. } = &op.work {
                    if let Some(logits) = acts.first() {
                        let last = logits.bytes.eval(&DimEnv {
                            seq: 1.0,
                            ..self.env
                        });
                        add(&mut tp_f, self.tp_coll(Collective::AllGather, last));
                    }
                }
            } else if op.role == TpRole::VocabLoss {
                // Max, sum of exponentials and the target logit, one float per token each.
                let tokens = self.env.batch * self.env.seq / self.tokens_div();
                for _ in 0..3 {
                    add(&mut tp_f, self.tp_coll(Collective::AllReduce, tokens * 4.0));
                }
            }
        }
        let (mut tp_fwd, mut tp_bwd) = (tp_f.0, tp_b.0);
        if self.tp_overlap {
            let share = calib::TP_OVERLAP_EXPOSED_SHARE;
            tp_fwd = (tp_fwd - tp_gemm_fwd).max(tp_fwd * share);
            tp_bwd = (tp_bwd - tp_gemm_bwd).max(tp_bwd * share);
        }
        let tp_bytes = tp_f.1 + tp_b.1;
        c.tp_bytes = tp_bytes;
        c.tp_bytes_fwd = tp_f.1;
        // Expert-parallel All-to-All: dispatch and combine, forward and backward.
        let mut ep_fwd = 0.0;
        let mut ep_bwd = 0.0;
        if ep_split {
            for op in &seg.ops {
                if let Work::Experts(e) = &op.work {
                    let rows = e.dispatched_rows(self.expert_tokens(), self.capacity_group());
                    let bytes = rows * e.hidden as f64 * bpe;
                    let time = self.comm.time_s(Collective::AllToAll, self.ep_group, bytes);
                    ep_fwd += 2.0 * time;
                    ep_bwd += 2.0 * time;
                    c.ep_bytes += 4.0 * bytes_sent_per_rank(Collective::AllToAll, self.ep, bytes);
                    c.ep_bytes_fwd +=
                        2.0 * bytes_sent_per_rank(Collective::AllToAll, self.ep, bytes);
                }
            }
        }
        // Context parallel: ring attention passes K and V blocks around the ring,
        // overlapped with the attention of the previous block.
        let mut cp_fwd = 0.0;
        let mut cp_bwd = 0.0;
        // Only segments with an attention core pass key/value blocks around the ring.
        let has_attention = seg.ops.iter().any(|o| matches!(o.work, Work::Attention(_)));
        if self.cp > 1 && pg.heads > 0 && has_attention {
            let cpf = self.cp as f64;
            let kv_heads_local = (pg.kv_heads as f64 / t).max(1.0);
            let per_head = pg.kv_bytes_per_token_layer / (pg.kv_heads.max(1) as f64);
            let kv_block = self.env.batch * self.env.seq / cpf * kv_heads_local * per_head;
            // A ring moves at the pace of its slowest hop: once it spans nodes, every
            // step waits on the InfiniBand transfers.
            let same_node = self.cp_group.nodes() <= 1;
            let step = self.comm.p2p_time_s(same_node, kv_block);
            let steps = cpf - 1.0;
            cp_fwd = (steps * step - attn_fwd_s * steps / cpf).max(0.0);
            cp_bwd = (2.0 * steps * step - attn_bwd_s * steps / cpf).max(0.0);
            c.cp_bytes = 3.0 * steps * kv_block;
        }
        c.comm_fwd_s = tp_fwd + ep_fwd + cp_fwd;
        c.comm_bwd_s = tp_bwd + ep_bwd + cp_bwd;
        // Activations kept for backward.
        let all_saved: f64 =
            seg.saved.iter().map(|a| self.local(a, false)).sum::<f64>() + attn_internal_bytes;
        match (seg.kind, self.recompute) {
            (SegmentKind::Block, Recompute::Full) => {
                c.act_bytes = seg.input.as_ref().map_or(0.0, |a| self.local(a, false));
                c.act_transient_bytes = all_saved;
                c.recompute_s = c.fwd_s + tp_fwd + ep_fwd + cp_fwd;
                c.flops_recompute = c.flops_fwd;
                c.tp_bytes += tp_f.1;
                c.ep_bytes *= 1.5;
                // The recomputed forward passes the ring again: 1 + 2 passes become 2 + 2.
                c.cp_bytes *= 4.0 / 3.0;
            }
            (SegmentKind::Block, Recompute::Selective) => {
                c.act_bytes = all_saved - attn_internal_bytes;
                c.act_transient_bytes = attn_internal_bytes;
                c.recompute_s = attn_fwd_s + cp_fwd;
                c.flops_recompute = flops_attn;
                // Recomputed ring attention needs every key/value block again: under
                // context parallelism the ring passes once more, as under full
                // recomputation.
                c.cp_bytes *= 4.0 / 3.0;
            }
            _ => c.act_bytes = all_saved,
        }
        // Parameters on this GPU.
        // DP-attention: each tensor rank attends requests of its own with whole
        // attention weights; the MLP and the vocabulary stay split, as their
        // collectives (`column`, `row`) say.
        let dense_sharded = if self.dp_attention {
            seg.params_sharded_attn + (seg.params_sharded - seg.params_sharded_attn) / t
        } else {
            seg.params_sharded / t
        };
        c.params_dense = seg.params_replicated + dense_sharded;
        c.params_seq_partial = if self.tp <= 1 {
            0.0
        } else if self.sp {
            // Replicated ops include the router, so this covers both cases.
            seg.params_seq_partial[0]
        } else if self.ep <= 1 {
            seg.params_seq_partial[1]
        } else {
            0.0
        };
        c.params_shared = seg.params_shared
            / if seg.kind == SegmentKind::Embed || seg.kind == SegmentKind::Head {
                t
            } else {
                1.0
            };
        c.params_expert = if seg.experts > 0 {
            if self.ep > 1 {
                seg.params_experts / self.ep as f64
            } else {
                seg.params_experts / t
            }
        } else {
            0.0
        };
        c
    }

    /// Attention core: (forward s, backward s, internal bytes kept, forward FLOPs) per GPU.
    fn attention(&self, a: &AttentionShape, pg: &PreparedGraph) -> (f64, f64, f64, f64) {
        let t = self.tp as f64;
        let (b, s, kv) = (self.env.batch, self.env.seq / self.cp as f64, self.env.kv);
        let (heads, batch) = if self.dp_attention {
            (a.heads as f64, b * self.dpa_share())
        } else {
            (a.heads as f64 / t, b)
        };
        let kv_heads = if self.dp_attention {
            a.kv_heads as f64
        } else {
            (a.kv_heads as f64 / t).max(1.0)
        };
        let bpe = pg.dtype.size_bytes() as f64;
        let flops = 2.0 * batch * heads * s * kv * (a.qk_dim + a.v_dim) as f64;
        let scores = batch * heads * s * kv;
        // Reading K and V, Q, and writing the output. Queries behind cached keys
        // (decoding) read the cache as stored: for MLA the latent, which absorbed
        // attention reads once for all heads, not per-head keys and values.
        let kv_per_token = if s < kv && pg.kv_bytes_per_token_layer > 0.0 {
            let cache_heads = pg.kv_cache_heads.max(1) as f64;
            let local = if self.dp_attention {
                cache_heads
            } else {
                (cache_heads / t).max(1.0)
            };
            pg.kv_bytes_per_token_layer * local / cache_heads
        } else {
            kv_heads * (a.qk_dim + a.v_dim) as f64 * bpe
        };
        let io_bytes =
            batch * kv * kv_per_token + batch * s * heads * (a.qk_dim + a.v_dim) as f64 * bpe;
        match self.attn {
            AttnImpl::Flash => {
                let frac = if a.causal {
                    causal_fraction(self.env.seq, kv)
                } else {
                    1.0
                };
                let (f, bw) = self
                    .roof
                    .flash_s(flops * frac, io_bytes, a.qk_dim as f64, kv);
                // Log-sum-exp per query row, fp32.
                (f, bw, batch * heads * s * 4.0, flops)
            }
            AttnImpl::Unfused => {
                let bh = batch * heads;
                let (dq, dv) = (a.qk_dim as f64, a.v_dim as f64);
                let qk = self.roof.gemm_s(bh, s, kv, dq, 0.0);
                let av = self.roof.gemm_s(bh, s, dv, kv, 0.0);
                let softmax = self.roof.memory_s(2.0 * scores * bpe);
                let dropout = if pg.dropout {
                    self.roof.memory_s(scores * (2.0 * bpe + 1.0))
                } else {
                    0.0
                };
                let f = qk + av + softmax + dropout;
                let qk_b =
                    self.roof.gemm_s(bh, s, dq, kv, 0.0) + self.roof.gemm_s(bh, kv, dq, s, 0.0);
                let av_b =
                    self.roof.gemm_s(bh, s, kv, dv, 0.0) + self.roof.gemm_s(bh, kv, dv, s, 0.0);
                let softmax_b = self.roof.memory_s(3.0 * scores * bpe);
                let dropout_b = if pg.dropout {
                    self.roof.memory_s(scores * (2.0 * bpe + 1.0))
                } else {
                    0.0
                };
                // Softmax output, and with dropout its mask and the dropped copy:
                // Korthikanti's `5 a s^2 b` (2 + 1 + 2 bytes per score).
                let kept = scores * (bpe + if pg.dropout { 1.0 + bpe } else { 0.0 });
                (f, qk_b + av_b + softmax_b + dropout_b, kept, flops)
            }
        }
    }

    /// Routed experts: (forward s, backward s, forward FLOPs) per GPU.
    fn experts(&self, e: &ExpertsShape, bpe: f64) -> (f64, f64, f64) {
        let t = self.tp as f64;
        let tokens = self.env.batch * self.env.seq / self.tokens_div();
        let group = self.capacity_group();
        let mats = e.mlp.matrices() as f64;
        let up_w = if mats > 2.0 { 2.0 } else { 1.0 };
        // Rows per expert: balanced routing dropless, padded capacity otherwise.
        let (experts_local, rows, ffn) = if self.ep > 1 {
            let ep = self.ep as f64;
            (
                e.experts as f64 / ep,
                e.dispatched_rows(self.expert_tokens(), group) * ep / e.experts as f64,
                e.ffn as f64,
            )
        } else {
            (
                e.experts as f64,
                e.dispatched_rows(tokens, group) / e.experts as f64,
                e.ffn as f64 / t,
            )
        };
        // Experts no token reached are skipped by the grouped kernel: with `r` rows
        // routed uniformly over the experts, each is hit with probability
        // `1 - (1 - 1/E)^(r E)` (1 in training, a fraction while decoding few tokens).
        let all = e.experts as f64;
        let hit = 1.0 - (1.0 - 1.0 / all).powf(rows * all);
        let (experts_local, rows) = if hit > 0.0 {
            (experts_local * hit, rows / hit)
        } else {
            (experts_local, rows)
        };
        let h = e.hidden as f64;
        let w_up = h * ffn * up_w * bpe;
        let w_down = ffn * h * bpe;
        let up = self.roof.gemm_s(
            1.0,
            rows,
            ffn * up_w,
            h,
            w_up + rows * (h + ffn * up_w) * bpe,
        );
        let down = self
            .roof
            .gemm_s(1.0, rows, h, ffn, w_down + rows * (h + ffn) * bpe);
        let act = self.roof.memory_s(rows * ffn * (up_w + 1.0) * bpe);
        // Permuting tokens into expert order and back.
        let permute = self.roof.memory_s(4.0 * rows * experts_local * h * bpe);
        // One grouped kernel per matrix runs every local expert: its fixed cost is
        // paid once, not per expert.
        let ko = self.roof.kernel_overhead_s;
        let (up, down, act) = (
            (up - ko).max(0.0),
            (down - ko).max(0.0),
            (act - ko).max(0.0),
        );
        let f = experts_local * (up + down + act) + 3.0 * ko + permute;
        let b = experts_local * (2.0 * (up + down) + 1.5 * act) + 5.5 * ko + permute;
        // Model FLOPs count routed tokens, not the padding of capacity buffers.
        let padded = e.dispatched_rows(tokens, group) / e.dispatched_rows(tokens, None);
        let flops = experts_local * 2.0 * rows / padded * h * ffn * mats;
        (f, b, flops)
    }

    /// Prices every segment: one [`SegCost`] per segment, in graph order.
    pub fn price(&self, pg: &PreparedGraph) -> Vec<SegCost> {
        pg.segments.iter().map(|s| self.segment(s, pg)).collect()
    }
}

/// Fraction of the `s x kv` score matrix a causal kernel computes when the `s`
/// queries are the last `s` of `kv` positions.
pub fn causal_fraction(s: f64, kv: f64) -> f64 {
    if s <= 0.0 || kv <= 0.0 {
        return 1.0;
    }
    let s = s.min(kv);
    (s * (kv - s) + s * (s + 1.0) / 2.0) / (s * kv)
}
