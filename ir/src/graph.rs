//! The op graph: tensors with symbolic shapes, ops in topological order, grouped in
//! segments (embedding, repeated blocks, head) so that a block is described once
//! however many layers repeat it.
//!
//! Every size is a [`Mono`]: a constant times powers of the three symbolic dims
//! (`Batch` sequences per micro-batch, `Seq` query tokens, `Kv` key tokens). The cost
//! model turns a graph into a table of monomials once and then evaluates a
//! configuration with a handful of multiplications per op.

use crate::dtype::DType;
use crate::error::IrError;
use crate::spec::{MlpKind, NormKind, RopeScaling, Unexecutable};
use serde::{Deserialize, Serialize};

/// Index of a tensor in [`Graph::tensors`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorId(pub u32);

/// One dimension of a tensor shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Dim {
    /// Sequences in a micro-batch.
    Batch,
    /// Query tokens per sequence (the sequence length; 1 while decoding).
    Seq,
    /// Key/value tokens per sequence (equal to `Seq` in training and prefill).
    Kv,
    /// A size fixed by the architecture.
    Fixed(u64),
}

/// Values of the symbolic dims.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DimEnv {
    /// Sequences in a micro-batch.
    pub batch: f64,
    /// Query tokens per sequence.
    pub seq: f64,
    /// Key tokens per sequence.
    pub kv: f64,
}

/// `coef * batch^b * seq^s * kv^k`: the size of anything in the graph.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Mono {
    /// Constant factor.
    pub coef: f64,
    /// Power of `Batch`.
    pub b: u8,
    /// Power of `Seq`.
    pub s: u8,
    /// Power of `Kv`.
    pub k: u8,
}

impl Mono {
    /// Zero.
    pub const ZERO: Mono = Mono {
        coef: 0.0,
        b: 0,
        s: 0,
        k: 0,
    };

    /// A constant.
    pub const fn constant(c: f64) -> Mono {
        Mono {
            coef: c,
            b: 0,
            s: 0,
            k: 0,
        }
    }

    /// The product of a shape's dims.
    pub fn of_shape(shape: &[Dim]) -> Mono {
        let mut m = Mono::constant(1.0);
        for d in shape {
            m = m.times_dim(*d);
        }
        m
    }

    /// Multiplies by one dim.
    pub fn times_dim(mut self, d: Dim) -> Mono {
        match d {
            Dim::Batch => self.b += 1,
            Dim::Seq => self.s += 1,
            Dim::Kv => self.k += 1,
            Dim::Fixed(n) => self.coef *= n as f64,
        }
        self
    }

    /// Multiplies by a constant.
    pub fn scale(mut self, c: f64) -> Mono {
        self.coef *= c;
        self
    }

    /// Value under `env`.
    #[inline]
    pub fn eval(&self, env: &DimEnv) -> f64 {
        let mut v = self.coef;
        for _ in 0..self.b {
            v *= env.batch;
        }
        for _ in 0..self.s {
            v *= env.seq;
        }
        for _ in 0..self.k {
            v *= env.kv;
        }
        v
    }
}

/// What a tensor holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TensorKind {
    /// Produced by an op.
    Activation,
    /// A trained parameter.
    Weight,
    /// A one-byte dropout mask.
    Mask,
    /// Integer inputs (token ids, labels).
    Index,
}

/// How the standard (Megatron) layout splits a tensor over the tensor-parallel axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TpSplit {
    /// Hidden-sized activations and small weights: replicated over `tp`, split along the
    /// sequence under sequence parallelism.
    Replicated,
    /// Split over `tp` along heads, MLP width or vocabulary.
    Sharded,
    /// Expert weights: split over `ep` by expert, and over the expert tensor axis inside.
    Experts,
}

/// A tensor: name, symbolic shape, element type and its standard split.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tensor {
    /// Dotted name, e.g. `block.attn.qkv.w`.
    pub name: String,
    /// Shape.
    pub shape: Vec<Dim>,
    /// Element type.
    pub dtype: DType,
    /// What it holds.
    pub kind: TensorKind,
    /// Standard tensor-parallel split.
    pub split: TpSplit,
}

impl Tensor {
    /// Elements.
    pub fn elems(&self) -> Mono {
        Mono::of_shape(&self.shape)
    }

    /// Bytes.
    pub fn bytes(&self) -> Mono {
        self.elems().scale(self.dtype.size_bytes() as f64)
    }
}

/// The attention core: scores, softmax and weighted sum over values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttentionShape {
    /// Query heads.
    pub heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Query/key width per head.
    pub qk_dim: u64,
    /// Value width per head.
    pub v_dim: u64,
    /// Causal mask (half the score matrix is skipped by a flash kernel).
    pub causal: bool,
    /// ALiBi biases added to the scores ([`crate::PositionKind::Alibi`]): free inside
    /// a kernel that has them, but not every framework's flash kernel does
    /// ([`crate::Framework::flash_gap`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub alibi: bool,
}

/// Routed experts of a MoE layer, run as one grouped MLP.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertsShape {
    /// Routed experts.
    pub experts: u64,
    /// Experts per token.
    pub top_k: u64,
    /// Model width.
    pub hidden: u64,
    /// Expert MLP width.
    pub ffn: u64,
    /// Nonlinearity.
    pub mlp: MlpKind,
    /// Expert capacity factor; `None` routes dropless (see [`crate::MoeSpec`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_factor: Option<f64>,
}

/// Tokens of one expert-capacity group: what one rank dispatches of one sequence
/// of its micro-batch, `seq / cp`, and a further `1 / tp` when expert parallelism
/// runs under sequence parallelism (each tensor rank dispatches its own slice).
/// Groups are consecutive in the sequence-major token order, so a plan and its
/// single-rank reference, given the same group size, drop the same tokens.
pub fn capacity_group_tokens(seq: u64, cp: u64, tp: u64, ep: u64) -> u64 {
    let tp_split = if ep > 1 { tp.max(1) } else { 1 };
    seq / cp.max(1) / tp_split
}

/// Rows an experts op gathers over the tensor axis when its experts are split over
/// both `tp` and `ep` without sequence parallelism (inference): every tensor rank
/// holds the same `tokens`, routes the contiguous slice `ceil(tokens / tp)` at its
/// index (the last slices short or empty), and the slices' outputs, each padded to
/// that length, are gathered, as vLLM's sequence-parallel MoE chunks and pads the
/// tokens of its tensor ranks.
pub fn sliced_expert_rows(tokens: f64, tp: u64) -> f64 {
    expert_slice(tokens, tp) * tp.max(1) as f64
}

/// The busiest tensor rank's slice of [`sliced_expert_rows`]: `ceil(tokens / tp)`
/// (an even share when `tp` divides the tokens, as under sequence parallelism).
pub fn expert_slice(tokens: f64, tp: u64) -> f64 {
    (tokens / tp.max(1) as f64).ceil()
}

/// Whether `op` is latent attention (DeepSeek's MLA): its core reads the queries
/// and the compressed keys and values apart, where standard attention reads one
/// fused `q | k | v` input.
pub fn latent_attention(op: &Op) -> bool {
    matches!(op.kind, OpKind::Attention(_)) && op.inputs.len() > 1
}

/// Which of a routed experts op's weights one is, told by the op's operands (x,
/// the router's logits, the up and the down projections) and its activation, not
/// by the shape: a SwiGLU up projection `[experts, h, 2f]` is no wider than it is
/// tall when `2f <= h` (DeepSeek-V3's 7168 x 4096), and a GELU one has no halves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertWeight {
    /// `[experts, h, f]`, or `[experts, h, 2f]` as `[gate | up]`.
    Up {
        /// SwiGLU's two halves side by side.
        gated: bool,
    },
    /// `[experts, f, h]`.
    Down,
}

impl ExpertWeight {
    /// The part weight `w` plays in experts op `op`, if it is one of its weights.
    pub fn of(op: &Op, w: TensorId) -> Option<ExpertWeight> {
        let OpKind::Experts(e) = &op.kind else {
            return None;
        };
        match op.inputs.iter().position(|&i| i == w)? {
            2 => Some(ExpertWeight::Up {
                gated: e.mlp == MlpKind::Swiglu,
            }),
            3 => Some(ExpertWeight::Down),
            _ => None,
        }
    }

    /// The expert's hidden width, which tensor parallelism splits, in this weight
    /// of `rows x cols` (an expert's slice).
    pub fn hidden_width(self, rows: u64, cols: u64) -> u64 {
        match self {
            ExpertWeight::Up { gated: true } => cols / 2,
            ExpertWeight::Up { gated: false } => cols,
            ExpertWeight::Down => rows,
        }
    }
}

/// Under DP-attention, the busiest tensor rank's share of a replica's `batch`
/// requests in a block's attention half: each rank attends whole requests of its
/// own, so it holds `ceil(batch / tp)` of them (a lone prompt whole, on one rank),
/// not an even `1 / tp` of every request. An even share for an empty batch.
pub fn dpa_share(batch: f64, tp: u64) -> f64 {
    let tp = tp.max(1) as f64;
    if batch <= 0.0 {
        return 1.0 / tp;
    }
    (batch / tp).ceil() / batch
}

impl ExpertsShape {
    /// Slots each expert keeps per capacity group of `group_tokens` tokens:
    /// `ceil(capacity_factor * group_tokens * top_k / experts)`, `None` when dropless.
    pub fn capacity(&self, group_tokens: u64) -> Option<u64> {
        self.capacity_factor.map(|cf| {
            let ideal = group_tokens as f64 * self.top_k as f64 / self.experts as f64;
            // A hair below an integer must not round up to one more slot.
            (cf * ideal - 1e-9).ceil().max(1.0) as u64
        })
    }

    /// Rows `tokens` of one rank put into the dispatch buffers, summed over experts:
    /// `tokens * top_k` dropless (balanced routing), or every expert's padded
    /// capacity over the `tokens / group_tokens` groups. Decoding (`group_tokens`
    /// `None`: one new token per sequence) routes dropless, as capacity groups of
    /// one token would pad every expert for every token.
    pub fn dispatched_rows(&self, tokens: f64, group_tokens: Option<f64>) -> f64 {
        let Some(group_tokens) = group_tokens else {
            return tokens * self.top_k as f64;
        };
        match self.capacity(group_tokens.round() as u64) {
            None => tokens * self.top_k as f64,
            Some(c) => (tokens / group_tokens) * self.experts as f64 * c as f64,
        }
    }
}

/// What an op computes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// Row lookup: `[ids], [table]`.
    Embedding,
    /// Tensor contraction with an einsum signature over its first two inputs (a third
    /// input, if present, is a bias added to the output).
    Matmul {
        /// e.g. `bsh,hn->bsn`.
        einsum: String,
    },
    /// Normalisation over the last dim.
    Norm(NormKind),
    /// Rotary position embedding on queries and keys.
    Rope,
    /// MLP nonlinearity (`swiglu` halves the last dim).
    Activation(MlpKind),
    /// Attention core.
    Attention(AttentionShape),
    /// Elementwise sum.
    Add,
    /// Dropout: second output is the mask.
    Dropout,
    /// Top-k expert selection from router logits.
    Router {
        /// Experts.
        experts: u64,
        /// Experts per token.
        top_k: u64,
    },
    /// Routed expert MLPs with dispatch and combine.
    Experts(ExpertsShape),
    /// Softmax cross-entropy over the vocabulary.
    CrossEntropy {
        /// Vocabulary.
        vocab: u64,
    },
}

/// How the standard layout places an op on the tensor-parallel axis. The planner
/// ignores this and finds placements from costs; it names the layout that a hand-given
/// configuration means.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TpRole {
    /// Computed redundantly on every `tp` rank (or sequence-split under SP).
    Replicated,
    /// `Replicate x Shard(1) -> Shard(1)`.
    ColumnParallel,
    /// `Shard(1) x Shard(0) -> Partial`.
    RowParallel,
    /// Split by heads or channels, no communication.
    Local,
    /// Vocabulary-parallel embedding (output partial).
    VocabEmbedding,
    /// Vocabulary-parallel LM head (column-parallel over the vocabulary).
    VocabHead,
    /// Vocabulary-parallel cross-entropy (small reductions of max and sum).
    VocabLoss,
    /// Expert-parallel MLPs (tokens moved by All-to-All).
    Experts,
}

/// One op.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Op {
    /// Dotted name, e.g. `block.attn.qkv`.
    pub name: String,
    /// What it computes.
    pub kind: OpKind,
    /// Inputs, activations first, then weights.
    pub inputs: Vec<TensorId>,
    /// Outputs.
    pub outputs: Vec<TensorId>,
    /// Tensors kept from forward for backward.
    pub saves: Vec<TensorId>,
    /// Standard tensor-parallel role.
    pub role: TpRole,
}

/// Where a segment sits in the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SegmentKind {
    /// Token (and position) embedding.
    Embed,
    /// A transformer block (or any repeated unit).
    Block,
    /// Final norm, LM head and loss.
    Head,
}

/// A run of ops, repeated `repeat` times with identical shapes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    /// e.g. `dense_block`.
    pub name: String,
    /// Position in the model.
    pub kind: SegmentKind,
    /// Consecutive copies.
    pub repeat: u64,
    /// Ops in topological order.
    pub ops: Vec<Op>,
}

/// A whole model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Graph {
    /// Model name.
    pub name: String,
    /// All tensors; block tensors describe one copy of the block.
    pub tensors: Vec<Tensor>,
    /// Segments in execution order.
    pub segments: Vec<Segment>,
    /// Numeric constants of the ops (what an executor needs beyond shapes).
    #[serde(default)]
    pub constants: Constants,
}

/// Numeric constants an executor needs to run the graph's ops.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Constants {
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE frequency scaling.
    #[serde(default, skip_serializing_if = "RopeScaling::is_none")]
    pub rope_scaling: RopeScaling,
    /// Keys each query attends to at most, itself included; `None`: all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<u64>,
    /// Fields of the model's `config.json` the executor does not implement: a run
    /// refuses, naming them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unexecutable: Vec<Unexecutable>,
    /// Normalisation epsilon.
    pub norm_eps: f64,
    /// Probability of dropping an entry, where the graph has dropout (its dropout ops
    /// and the attention probabilities).
    #[serde(default = "default_dropout_p")]
    pub dropout_p: f64,
}

/// GPT-2's and GPT-3's `resid_pdrop` and `attn_pdrop`.
pub const DEFAULT_DROPOUT_P: f64 = 0.1;

fn default_dropout_p() -> f64 {
    DEFAULT_DROPOUT_P
}

impl Default for Constants {
    fn default() -> Self {
        Constants {
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            sliding_window: None,
            unexecutable: Vec::new(),
            norm_eps: 1e-5,
            dropout_p: DEFAULT_DROPOUT_P,
        }
    }
}

impl Graph {
    /// Every op, segment by segment in order.
    pub fn ops(&self) -> impl Iterator<Item = &Op> {
        self.segments.iter().flat_map(|s| &s.ops)
    }

    /// The vocabulary, the tokens there are: the cross-entropy's classes, or the
    /// embedding table's rows.
    pub fn vocab(&self) -> Option<u64> {
        self.ops()
            .find_map(|o| match o.kind {
                OpKind::CrossEntropy { vocab } => Some(vocab),
                _ => None,
            })
            .or_else(|| self.vocab_rows())
    }

    /// The token embedding table's rows: [`Graph::vocab`] and any padding
    /// (`make_vocab_size_divisible_by`), what tensor parallelism splits.
    pub fn vocab_rows(&self) -> Option<u64> {
        self.ops()
            .find(|o| o.kind == OpKind::Embedding)
            .and_then(|o| {
                let t = self.tensors.get(o.inputs.get(1)?.0 as usize)?;
                match t.shape.first()? {
                    Dim::Fixed(v) => Some(*v),
                    _ => None,
                }
            })
    }

    /// Whether some MoE layer routes dropless (no expert capacity): its
    /// expert-parallel traffic follows the router's choices, not a fixed size.
    pub fn dropless_experts(&self) -> bool {
        self.ops()
            .any(|o| matches!(&o.kind, OpKind::Experts(e) if e.capacity_factor.is_none()))
    }

    /// The attention op that reads `op`'s first output as its first input (the
    /// rotary op's consumer, whose heads say how the rotated columns are laid out).
    pub fn attention_fed_by(&self, op: &Op) -> Option<&Op> {
        let out = op.outputs.first()?;
        self.ops()
            .find(|o| o.inputs.first() == Some(out) && matches!(o.kind, OpKind::Attention(_)))
    }

    /// A tensor by id.
    pub fn tensor(&self, id: TensorId) -> &Tensor {
        &self.tensors[id.0 as usize]
    }

    /// Forward FLOPs of an op (matrix products and attention only: elementwise work is
    /// priced by bytes, and is left out of model FLOPs as the literature does).
    pub fn op_flops(&self, op: &Op) -> Mono {
        match &op.kind {
            OpKind::Matmul { einsum } => {
                let a = self.tensor(op.inputs[0]);
                let b = self.tensor(op.inputs[1]);
                // Validated at build time; a malformed einsum here is a programming error.
                einsum_flops(einsum, &a.shape, &b.shape).unwrap_or(Mono::ZERO)
            }
            // Scores `2 b h s kv d_qk` plus weighted sum `2 b h s kv d_v`, the full square
            // as Megatron counts it; the causal saving is a matter of kernel time.
            OpKind::Attention(at) => Mono::of_shape(&[Dim::Batch, Dim::Seq, Dim::Kv])
                .scale(2.0 * at.heads as f64 * (at.qk_dim + at.v_dim) as f64),
            OpKind::Experts(e) => Mono::of_shape(&[Dim::Batch, Dim::Seq]).scale(
                2.0 * e.top_k as f64 * e.hidden as f64 * e.ffn as f64 * (e.mlp.matrices() as f64),
            ),
            _ => Mono::ZERO,
        }
    }

    /// Parameters (elements) of weight tensors, counting each tensor once and each
    /// block tensor once per repeat; `active` counts routed experts at `top_k / experts`.
    pub fn param_count(&self, active: bool) -> f64 {
        let mut seen = vec![false; self.tensors.len()];
        let mut total = 0.0;
        for seg in &self.segments {
            for op in &seg.ops {
                let expert_frac = match (&op.kind, active) {
                    (OpKind::Experts(e), true) => e.top_k as f64 / e.experts as f64,
                    _ => 1.0,
                };
                for &t in &op.inputs {
                    let tensor = self.tensor(t);
                    if tensor.kind != TensorKind::Weight || seen[t.0 as usize] {
                        continue;
                    }
                    seen[t.0 as usize] = true;
                    total += tensor.elems().coef * seg.repeat as f64 * expert_frac;
                }
            }
        }
        total
    }

    /// Forward FLOPs of the whole model under `env`.
    pub fn forward_flops(&self, env: &DimEnv) -> f64 {
        self.segments
            .iter()
            .map(|seg| {
                seg.repeat as f64
                    * seg
                        .ops
                        .iter()
                        .map(|op| self.op_flops(op).eval(env))
                        .sum::<f64>()
            })
            .sum()
    }
}

/// Whether each op of `seg` lies in a block's attention half: the ops up to and
/// including the first residual add, which DP-attention runs data-parallel over
/// the tensor ranks with whole weights. No op of another segment does.
pub fn attention_half(seg: &Segment) -> Vec<bool> {
    let mut in_attention = seg.kind == SegmentKind::Block;
    (seg.ops.iter())
        .map(|op| {
            let attn_part = in_attention;
            if matches!(op.kind, OpKind::Add) {
                in_attention = false;
            }
            attn_part
        })
        .collect()
}

/// The weights of `seg` whose gradient each tensor-parallel rank holds only as a
/// partial sum, to be all-reduced over the tensor axis once per step: under sequence
/// parallelism (`sp`) those of replicated ops (norm scales and biases, which see a
/// slice of the sequence); with experts split over the tensor axis (`expert_tp`) the
/// router's, whose logits' gradient comes from partial expert outputs.
pub fn tp_partial_weights(
    graph: &Graph,
    seg: &Segment,
    sp: bool,
    expert_tp: bool,
) -> Vec<TensorId> {
    let routers: Vec<TensorId> = seg
        .ops
        .iter()
        .filter(|o| matches!(o.kind, OpKind::Experts(_)))
        .filter_map(|o| o.inputs.get(1).copied())
        .collect();
    let mut out = Vec::new();
    for op in &seg.ops {
        let is_router = op.outputs.iter().any(|t| routers.contains(t));
        let take = (sp && op.role == TpRole::Replicated) || (expert_tp && is_router);
        if !take {
            continue;
        }
        for &w in &op.inputs {
            if graph
                .tensors
                .get(w.0 as usize)
                .is_some_and(|t| t.kind == TensorKind::Weight)
                && !out.contains(&w)
            {
                out.push(w);
            }
        }
    }
    out
}

/// Letters of an einsum operand.
fn einsum_parts(einsum: &str) -> Option<(&str, &str, &str)> {
    let (lhs, out) = einsum.split_once("->")?;
    let (a, b) = lhs.split_once(',')?;
    Some((a.trim(), b.trim(), out.trim()))
}

/// FLOPs of a two-operand einsum: `2 x` the product of every distinct index size.
/// Errors if an index has two different sizes or an operand's rank disagrees.
pub fn einsum_flops(einsum: &str, a: &[Dim], b: &[Dim]) -> Result<Mono, IrError> {
    let shape_err = |message: String| IrError::Shape {
        op: format!("einsum `{einsum}`"),
        message,
    };
    let (la, lb, lo) =
        einsum_parts(einsum).ok_or_else(|| shape_err("expected `ab,bc->ac` form".into()))?;
    if la.chars().count() != a.len() || lb.chars().count() != b.len() {
        return Err(shape_err(format!(
            "operand ranks {} and {} do not match `{la}` and `{lb}`",
            a.len(),
            b.len()
        )));
    }
    let mut sizes: Vec<(char, Dim)> = Vec::new();
    for (letters, shape) in [(la, a), (lb, b)] {
        for (c, d) in letters.chars().zip(shape.iter()) {
            match sizes.iter().find(|(l, _)| *l == c) {
                Some((_, prev)) if prev != d => {
                    return Err(shape_err(format!(
                        "index `{c}` is {prev:?} in one operand and {d:?} in the other"
                    )))
                }
                Some(_) => {}
                None => sizes.push((c, *d)),
            }
        }
    }
    for c in lo.chars() {
        if !sizes.iter().any(|(l, _)| *l == c) {
            return Err(shape_err(format!("output index `{c}` appears in no input")));
        }
    }
    let mut m = Mono::constant(2.0);
    for (_, d) in sizes {
        m = m.times_dim(d);
    }
    Ok(m)
}

/// The output shape of a two-operand einsum.
pub fn einsum_output_shape(einsum: &str, a: &[Dim], b: &[Dim]) -> Result<Vec<Dim>, IrError> {
    einsum_flops(einsum, a, b)?;
    let (la, lb, lo) = einsum_parts(einsum).ok_or_else(|| IrError::Shape {
        op: format!("einsum `{einsum}`"),
        message: "expected `ab,bc->ac` form".into(),
    })?;
    let lookup = |c: char| -> Dim {
        la.chars()
            .zip(a.iter())
            .chain(lb.chars().zip(b.iter()))
            .find(|(l, _)| *l == c)
            .map(|(_, d)| *d)
            .unwrap_or(Dim::Fixed(1))
    };
    Ok(lo.chars().map(lookup).collect())
}
