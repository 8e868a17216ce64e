//! The model file: architecture form, graph form and workload, parsed into raw
//! serde types and then validated into [`ModelSpec`] (low -> high, as ripgrep's
//! `LowArgs` -> `HiArgs`).

use crate::dtype::DType;
use crate::error::IrError;
use crate::explicit::GraphSpec;
use serde::{Deserialize, Serialize};

/// Feed-forward nonlinearity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MlpKind {
    /// `down(gelu(up(x)))`, two matrices.
    Gelu,
    /// `down(silu(gate(x)) * up(x))`, three matrices.
    Swiglu,
}

impl MlpKind {
    /// Number of `hidden x ffn` matrices in one MLP.
    pub const fn matrices(self) -> u64 {
        match self {
            MlpKind::Gelu => 2,
            MlpKind::Swiglu => 3,
        }
    }
}

/// Normalisation layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NormKind {
    /// Scale and shift (2 parameters per channel).
    Layernorm,
    /// Scale only (1 parameter per channel).
    Rmsnorm,
}

impl NormKind {
    /// Parameters per channel.
    pub const fn params_per_channel(self) -> u64 {
        match self {
            NormKind::Layernorm => 2,
            NormKind::Rmsnorm => 1,
        }
    }
}

/// How token positions enter the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PositionKind {
    /// Rotary embeddings applied to queries and keys (no parameters).
    Rope,
    /// A learned `[max_positions, hidden]` table added to the token embedding (GPT-2/3).
    Learned,
    /// Attention with linear biases (Press et al. 2022; BLOOM, MPT): each head adds
    /// `-m_h * (i - j)` to the score of query `i` on key `j`, `m_h` a geometric
    /// sequence of slopes; no parameters and nothing added to the embedding.
    Alibi,
}

/// Rotary frequency scaling (Hugging Face's `rope_scaling` / `rope_parameters`):
/// how each pair's frequency `theta^(-2i/d)` is changed before it rotates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum RopeScaling {
    /// Frequencies as they are.
    #[default]
    None,
    /// Every frequency divided by `factor` (position interpolation).
    Linear {
        /// Divisor of every frequency.
        factor: f64,
    },
    /// Llama 3.1's: wavelengths shorter than `original_max_positions /
    /// high_freq_factor` kept, longer than `original_max_positions / low_freq_factor`
    /// divided by `factor`, and a smooth blend between.
    Llama3 {
        /// Divisor of the low frequencies.
        factor: f64,
        /// Wavelengths above `original_max_positions / low_freq_factor` are scaled.
        low_freq_factor: f64,
        /// Wavelengths below `original_max_positions / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context length the model was pretrained on.
        original_max_positions: f64,
    },
}

impl RopeScaling {
    /// Whether frequencies are left as they are.
    pub fn is_none(&self) -> bool {
        *self == RopeScaling::None
    }

    /// `(factor, low_wavelength, high_wavelength)`: a frequency whose wavelength
    /// `2 pi / f` is below `high_wavelength` is kept, above `low_wavelength` divided
    /// by `factor`, and between them blended by `(1/wl - 1/low) / (1/high - 1/low)`.
    /// Linear scaling is `(factor, 0, 0)`, none is `(1, 0, 0)`: one formula serves
    /// every kind, on the CPU and in the GPU kernels.
    pub fn wavelength_form(&self) -> (f64, f64, f64) {
        match *self {
            RopeScaling::None => (1.0, 0.0, 0.0),
            RopeScaling::Linear { factor } => (factor, 0.0, 0.0),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            } => (
                factor,
                original_max_positions / low_freq_factor,
                original_max_positions / high_freq_factor,
            ),
        }
    }

    pub(crate) fn validate(&self, file: &str, field: &str) -> Result<(), IrError> {
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(IrError::invalid(
                    file,
                    &format!("{field}.{name}"),
                    format!("must be a positive number, got {v}"),
                ))
            }
        };
        match *self {
            RopeScaling::None => Ok(()),
            RopeScaling::Linear { factor } => positive("factor", factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                positive("original_max_positions", original_max_positions)?;
                if high_freq_factor <= low_freq_factor {
                    return Err(IrError::invalid(
                        file,
                        &format!("{field}.high_freq_factor"),
                        format!(
                            "must be larger than low_freq_factor ({low_freq_factor}), got {high_freq_factor}"
                        ),
                    ));
                }
                Ok(())
            }
        }
    }
}

impl std::fmt::Display for RopeScaling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RopeScaling::None => f.write_str("no scaling"),
            RopeScaling::Linear { factor } => write!(f, "linear scaling by {factor}"),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            } => write!(
                f,
                "llama3 scaling (factor {factor}, low_freq_factor {low_freq_factor}, high_freq_factor {high_freq_factor}, original_max_position_embeddings {original_max_positions})"
            ),
        }
    }
}

/// A `config.json` field whose math the executor does not implement: planning
/// prices the model (the field does not change costs), running it refuses, naming
/// the field, rather than computing something else.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Unexecutable {
    /// The field as written, e.g. `activation_function`.
    pub field: String,
    /// What it asks for and what is implemented instead.
    pub reason: String,
}

/// Mixture-of-experts feed-forward layers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeSpec {
    /// Routed experts per MoE layer.
    pub experts: u64,
    /// Experts each token is sent to.
    pub top_k: u64,
    /// Hidden width of one routed expert.
    pub expert_ffn_hidden: u64,
    /// Always-active shared experts per MoE layer (DeepSeek).
    #[serde(default)]
    pub shared_experts: u64,
    /// Hidden width of one shared expert; defaults to `expert_ffn_hidden`.
    #[serde(default)]
    pub shared_expert_ffn_hidden: Option<u64>,
    /// Leading layers that keep a dense MLP of `ffn_hidden` (DeepSeek-V3: 3).
    #[serde(default)]
    pub first_dense_layers: u64,
    /// Expert capacity (GShard, Switch; Megatron's `--moe-expert-capacity-factor`):
    /// each expert takes at most `ceil(capacity_factor * tokens * top_k / experts)`
    /// of a capacity group's tokens, the rest pass through the residual only, and
    /// dispatch buffers are padded to capacity. Absent: dropless, with buffers sized
    /// by the actual routing.
    #[serde(default)]
    pub capacity_factor: Option<f64>,
}

/// DeepSeek-style multi-head latent attention (low-rank queries and keys/values).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlaSpec {
    /// Rank of the query down-projection; `null` projects queries directly.
    #[serde(default)]
    pub q_lora_rank: Option<u64>,
    /// Rank of the compressed key/value latent (what the KV cache holds).
    pub kv_lora_rank: u64,
    /// Per-head query/key width without rotary part.
    pub qk_nope_head_dim: u64,
    /// Per-head rotary width, shared across heads for keys.
    pub qk_rope_head_dim: u64,
    /// Per-head value width.
    pub v_head_dim: u64,
}

/// The architecture form of a model file, as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTransformer {
    /// Transformer blocks.
    pub layers: u64,
    /// Model width.
    pub hidden: u64,
    /// Query heads.
    pub heads: u64,
    /// Key/value heads (GQA when fewer than `heads`).
    #[serde(default)]
    pub kv_heads: Option<u64>,
    /// Per-head width; defaults to `hidden / heads`.
    #[serde(default)]
    pub head_dim: Option<u64>,
    /// MLP width; defaults to `4 * hidden`.
    #[serde(default)]
    pub ffn_hidden: Option<u64>,
    /// MLP nonlinearity.
    #[serde(default = "default_mlp")]
    pub mlp: MlpKind,
    /// Normalisation.
    #[serde(default = "default_norm")]
    pub norm: NormKind,
    /// Vocabulary size.
    pub vocab: u64,
    /// Pads the embedding table, the LM head and the logits to a multiple of this
    /// many rows (Megatron-LM's `--make-vocab-size-divisible-by`, whose default is
    /// 128), so that tensor parallelism can split them; the padded rows are never
    /// a token, and the loss and sampling never see them. Absent: no padding.
    #[serde(default)]
    pub make_vocab_size_divisible_by: Option<u64>,
    /// Whether the LM head shares the embedding matrix.
    #[serde(default)]
    pub tie_embeddings: bool,
    /// Biases on every linear layer (GPT-2/3 style).
    #[serde(default)]
    pub bias: bool,
    /// Biases on the query/key/value projections only (Qwen2 style).
    #[serde(default)]
    pub qkv_bias: bool,
    /// A bias on the attention output projection (Llama's `attention_bias`, with
    /// `qkv_bias`); implied by `bias`.
    #[serde(default)]
    pub attn_out_bias: bool,
    /// Biases on the MLP projections (Llama's `mlp_bias`); implied by `bias`.
    #[serde(default)]
    pub mlp_bias: bool,
    /// Position encoding.
    #[serde(default = "default_position")]
    pub position: PositionKind,
    /// Rows of the learned position table (required with `position: learned`).
    #[serde(default)]
    pub max_positions: Option<u64>,
    /// Dropout after attention probabilities, attention output and MLP output.
    #[serde(default)]
    pub dropout: bool,
    /// Rotary base frequency (kept for the executor; does not change costs).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// Rotary frequency scaling (kept for the executor; does not change costs).
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Keys each query attends to at most, itself included (Mistral's
    /// `sliding_window`); absent: the whole causal prefix.
    #[serde(default)]
    pub sliding_window: Option<u64>,
    /// Normalisation epsilon (kept for the executor; does not change costs).
    #[serde(default)]
    pub norm_eps: Option<f64>,
    /// Mixture of experts.
    #[serde(default)]
    pub moe: Option<MoeSpec>,
    /// Multi-head latent attention instead of standard attention.
    #[serde(default)]
    pub mla: Option<MlaSpec>,
}

fn default_mlp() -> MlpKind {
    MlpKind::Gelu
}
fn default_norm() -> NormKind {
    NormKind::Layernorm
}
fn default_position() -> PositionKind {
    PositionKind::Rope
}

/// A validated transformer architecture: every default resolved.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransformerSpec {
    /// Transformer blocks.
    pub layers: u64,
    /// Model width.
    pub hidden: u64,
    /// Query heads.
    pub heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Per-head width.
    pub head_dim: u64,
    /// MLP width of dense layers.
    pub ffn_hidden: u64,
    /// MLP nonlinearity.
    pub mlp: MlpKind,
    /// Normalisation.
    pub norm: NormKind,
    /// Vocabulary size: the tokens, what the loss and sampling range over.
    pub vocab: u64,
    /// The embedding table, the head and the logits have
    /// [`TransformerSpec::padded_vocab`] rows, `vocab` rounded up to a multiple of
    /// this (1: unpadded).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub make_vocab_size_divisible_by: u64,
    /// LM head shares the embedding.
    pub tie_embeddings: bool,
    /// Biases on every linear layer (GPT style); a layernorm always has its shift.
    pub bias: bool,
    /// Biases on the QKV projections.
    pub qkv_bias: bool,
    /// A bias on the attention output projection.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub attn_out_bias: bool,
    /// Biases on the MLP projections.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mlp_bias: bool,
    /// Position encoding.
    pub position: PositionKind,
    /// Learned position rows (0 for rotary).
    pub max_positions: u64,
    /// Dropout layers present.
    pub dropout: bool,
    /// Rotary base.
    pub rope_theta: f64,
    /// Rotary frequency scaling.
    #[serde(default, skip_serializing_if = "RopeScaling::is_none")]
    pub rope_scaling: RopeScaling,
    /// Keys each query attends to at most, itself included; `None`: all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<u64>,
    /// Fields of the source `config.json` the executor does not implement.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unexecutable: Vec<Unexecutable>,
    /// Normalisation epsilon.
    pub norm_eps: f64,
    /// Mixture of experts.
    pub moe: Option<MoeSpec>,
    /// Multi-head latent attention.
    pub mla: Option<MlaSpec>,
}

fn is_one(x: &u64) -> bool {
    *x == 1
}

impl TransformerSpec {
    /// Rows of the embedding table and the head, columns of the logits: `vocab`
    /// rounded up to a multiple of `make_vocab_size_divisible_by`.
    pub fn padded_vocab(&self) -> u64 {
        self.vocab
            .next_multiple_of(self.make_vocab_size_divisible_by)
    }

    /// Number of layers with a MoE feed-forward.
    pub fn moe_layers(&self) -> u64 {
        self.moe
            .as_ref()
            .map_or(0, |m| self.layers - m.first_dense_layers)
    }

    /// Key/value bytes cached per token per layer: `2 x kv_heads x head_dim x bytes`,
    /// or for MLA the compressed latent plus the shared rotary key.
    pub fn kv_cache_bytes_per_token_per_layer(&self, dtype: DType) -> u64 {
        let elems = match &self.mla {
            Some(m) => m.kv_lora_rank + m.qk_rope_head_dim,
            None => 2 * self.kv_heads * self.head_dim,
        };
        elems * dtype.size_bytes()
    }
}

/// Service-level objective for inference.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Slo {
    /// Time to first token bound, milliseconds.
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    /// Time per output token bound, milliseconds.
    #[serde(default)]
    pub tpot_ms: Option<f64>,
    /// The percentile (0-100) of requests the bounds hold for, where the lengths are
    /// a distribution (`serving.prompt`, `serving.output`); default 50.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percentile: Option<f64>,
}

/// What the model is used for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Workload {
    /// Training with an optimizer.
    Train {
        /// Tokens per sequence.
        seq_len: u64,
        /// Sequences per optimizer step.
        global_batch: u64,
        /// Optimizer (only `adamw` is modelled).
        #[serde(default = "default_optimizer")]
        optimizer: String,
        /// The framework that will run it; the planner searches only what it can.
        #[serde(default, skip_serializing_if = "is_meshplan")]
        framework: crate::Framework,
    },
    /// Serving requests.
    Inference {
        /// Prompt tokens per request.
        prompt_len: u64,
        /// Generated tokens per request.
        output_len: u64,
        /// Requests decoded together.
        #[serde(default = "one")]
        concurrency: u64,
        /// Optional latency bounds.
        #[serde(default)]
        slo: Option<Slo>,
        /// What `deploy` searches: length distributions, a concurrency range or an
        /// arrival rate, the objective.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        serving: Option<crate::serving::ServingSpec>,
    },
}

impl Workload {
    /// The framework a training workload is for (meshplan's own for inference).
    pub fn framework(&self) -> crate::Framework {
        match self {
            Workload::Train { framework, .. } => *framework,
            Workload::Inference { .. } => crate::Framework::Meshplan,
        }
    }
}

fn is_meshplan(f: &crate::Framework) -> bool {
    *f == crate::Framework::Meshplan
}

fn default_optimizer() -> String {
    "adamw".to_string()
}
fn one() -> u64 {
    1
}

/// The model file as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModel {
    /// Model name.
    pub name: String,
    /// Architecture form.
    #[serde(default)]
    pub transformer: Option<RawTransformer>,
    /// Explicit graph form.
    #[serde(default)]
    pub graph: Option<GraphSpec>,
    /// Compute dtype.
    #[serde(default = "default_dtype")]
    pub dtype: DType,
    /// Workload.
    #[serde(default)]
    pub workload: Option<Workload>,
}

fn default_dtype() -> DType {
    DType::Bf16
}

/// The model body: a standard transformer or an explicit graph.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
// One per loaded model, moved rarely: boxing the larger form would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Architecture {
    /// Architecture form, expanded by the transformer builder.
    Transformer(TransformerSpec),
    /// Explicit ops over named tensors.
    Graph(GraphSpec),
}

/// A validated model: name, architecture, compute dtype and workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Model name.
    pub name: String,
    /// The body.
    pub arch: Architecture,
    /// Compute dtype.
    pub dtype: DType,
    /// Workload, if the file (or flags) gave one.
    pub workload: Option<Workload>,
}

impl ModelSpec {
    /// The transformer spec, if this is one.
    pub fn transformer(&self) -> Option<&TransformerSpec> {
        match &self.arch {
            Architecture::Transformer(t) => Some(t),
            Architecture::Graph(_) => None,
        }
    }
}

/// Largest size any dim may have: products of a few dims must stay exact in `f64`
/// and must not overflow `u64`.
pub const DIM_MAX: u64 = 1 << 24;

/// `d`, a multiple to pad `vocab` tokens to (`make_vocab_size_divisible_by`), if it
/// is positive and the padded rows stay within [`DIM_MAX`].
pub(crate) fn vocab_divisor(file: &str, field: &str, vocab: u64, d: u64) -> Result<u64, IrError> {
    let d = positive(file, field, d)?;
    if vocab.next_multiple_of(d) > DIM_MAX {
        return Err(IrError::invalid(
            file,
            field,
            format!("pads the vocabulary ({vocab}) past the supported maximum {DIM_MAX}; use a smaller multiple such as 128"),
        ));
    }
    Ok(d)
}

fn positive(file: &str, field: &str, v: u64) -> Result<u64, IrError> {
    if v == 0 {
        return Err(IrError::invalid(
            file,
            field,
            "must be a positive integer, got 0",
        ));
    }
    if v > DIM_MAX {
        return Err(IrError::invalid(
            file,
            field,
            format!("{v} is larger than the supported maximum {DIM_MAX}"),
        ));
    }
    Ok(v)
}

impl RawTransformer {
    /// Resolves defaults and checks that the shapes fit together.
    pub fn validate(self, file: &str) -> Result<TransformerSpec, IrError> {
        let f = |name: &str| format!("transformer.{name}");
        let layers = positive(file, &f("layers"), self.layers)?;
        let hidden = positive(file, &f("hidden"), self.hidden)?;
        let heads = positive(file, &f("heads"), self.heads)?;
        let vocab = positive(file, &f("vocab"), self.vocab)?;
        let divisor = match self.make_vocab_size_divisible_by {
            None => 1,
            Some(d) => vocab_divisor(file, &f("make_vocab_size_divisible_by"), vocab, d)?,
        };
        let kv_heads = positive(file, &f("kv_heads"), self.kv_heads.unwrap_or(heads))?;
        if heads % kv_heads != 0 {
            return Err(IrError::invalid(
                file,
                &f("kv_heads"),
                format!("heads({heads}) % kv_heads({kv_heads}) != 0: kv_heads must divide heads"),
            ));
        }
        let head_dim = match self.head_dim {
            Some(d) => positive(file, &f("head_dim"), d)?,
            None => {
                if hidden % heads != 0 {
                    return Err(IrError::invalid(
                        file,
                        &f("head_dim"),
                        format!(
                            "not given and hidden({hidden}) % heads({heads}) != 0: \
                             give head_dim or make heads divide hidden"
                        ),
                    ));
                }
                hidden / heads
            }
        };
        let ffn_hidden = positive(
            file,
            &f("ffn_hidden"),
            self.ffn_hidden.unwrap_or(4 * hidden),
        )?;
        let max_positions = match (self.position, self.max_positions) {
            (PositionKind::Learned, None) => {
                return Err(IrError::invalid(
                    file,
                    &f("max_positions"),
                    "required with `position: learned` (rows of the position table)",
                ))
            }
            (PositionKind::Learned, Some(p)) => positive(file, &f("max_positions"), p)?,
            (PositionKind::Rope | PositionKind::Alibi, _) => 0,
        };
        if let Some(m) = &self.moe {
            positive(file, &f("moe.experts"), m.experts)?;
            positive(file, &f("moe.top_k"), m.top_k)?;
            positive(file, &f("moe.expert_ffn_hidden"), m.expert_ffn_hidden)?;
            if m.top_k > m.experts {
                return Err(IrError::invalid(
                    file,
                    &f("moe.top_k"),
                    format!(
                        "top_k({}) > experts({}): top_k must be at most experts",
                        m.top_k, m.experts
                    ),
                ));
            }
            if let Some(cf) = m.capacity_factor {
                if !(cf.is_finite() && cf > 0.0 && cf <= m.experts as f64) {
                    return Err(IrError::invalid(
                        file,
                        &f("moe.capacity_factor"),
                        format!(
                            "must be a number in (0, experts({})], got {cf}; omit it for dropless routing",
                            m.experts
                        ),
                    ));
                }
            }
            if m.first_dense_layers > layers {
                return Err(IrError::invalid(
                    file,
                    &f("moe.first_dense_layers"),
                    format!(
                        "first_dense_layers({}) > layers({layers})",
                        m.first_dense_layers
                    ),
                ));
            }
            if m.shared_experts > DIM_MAX {
                return Err(IrError::invalid(
                    file,
                    &f("moe.shared_experts"),
                    format!(
                        "{} is larger than the supported maximum {DIM_MAX}",
                        m.shared_experts
                    ),
                ));
            }
            if let Some(s) = m.shared_expert_ffn_hidden {
                positive(file, &f("moe.shared_expert_ffn_hidden"), s)?;
            }
        }
        if let Some(m) = &self.mla {
            positive(file, &f("mla.kv_lora_rank"), m.kv_lora_rank)?;
            positive(file, &f("mla.qk_nope_head_dim"), m.qk_nope_head_dim)?;
            positive(file, &f("mla.qk_rope_head_dim"), m.qk_rope_head_dim)?;
            positive(file, &f("mla.v_head_dim"), m.v_head_dim)?;
            if let Some(q) = m.q_lora_rank {
                positive(file, &f("mla.q_lora_rank"), q)?;
            }
            if self.position != PositionKind::Rope {
                return Err(IrError::invalid(
                    file,
                    &f("position"),
                    "latent attention (mla) carries positions in its decoupled RoPE part: write `position: rope` or drop `mla`",
                ));
            }
        }
        for (name, v) in [("rope_theta", self.rope_theta), ("norm_eps", self.norm_eps)] {
            if let Some(v) = v {
                if !(v.is_finite() && v > 0.0) {
                    return Err(IrError::invalid(
                        file,
                        &f(name),
                        format!("must be a positive number, got {v}"),
                    ));
                }
            }
        }
        let rope_scaling = self.rope_scaling.unwrap_or_default();
        rope_scaling.validate(file, &f("rope_scaling"))?;
        if let Some(w) = self.sliding_window {
            positive(file, &f("sliding_window"), w)?;
        }
        Ok(TransformerSpec {
            layers,
            hidden,
            heads,
            kv_heads,
            head_dim,
            ffn_hidden,
            mlp: self.mlp,
            norm: self.norm,
            vocab,
            make_vocab_size_divisible_by: divisor,
            tie_embeddings: self.tie_embeddings,
            bias: self.bias,
            qkv_bias: self.qkv_bias,
            attn_out_bias: self.attn_out_bias,
            mlp_bias: self.mlp_bias,
            position: self.position,
            max_positions,
            dropout: self.dropout,
            rope_theta: self.rope_theta.unwrap_or(10000.0),
            rope_scaling,
            sliding_window: self.sliding_window,
            unexecutable: Vec::new(),
            norm_eps: self.norm_eps.unwrap_or(1e-5),
            moe: self.moe,
            mla: self.mla,
        })
    }
}

impl Workload {
    /// Checks sizes.
    pub fn validate(&self, file: &str) -> Result<(), IrError> {
        match self {
            Workload::Train {
                seq_len,
                global_batch,
                optimizer,
                ..
            } => {
                positive(file, "workload.seq_len", *seq_len)?;
                positive(file, "workload.global_batch", *global_batch)?;
                if optimizer != "adamw" {
                    return Err(IrError::invalid(
                        file,
                        "workload.optimizer",
                        format!("`{optimizer}` is not modelled; use `adamw`"),
                    ));
                }
            }
            Workload::Inference {
                prompt_len,
                output_len,
                concurrency,
                slo,
                serving,
            } => {
                positive(file, "workload.prompt_len", *prompt_len)?;
                if let Some(s) = serving {
                    s.validate(file)?;
                }
                positive(file, "workload.output_len", *output_len)?;
                positive(file, "workload.concurrency", *concurrency)?;
                if let Some(p) = slo.as_ref().and_then(|s| s.percentile) {
                    if !(p > 0.0 && p < 100.0) {
                        return Err(IrError::invalid(
                            file,
                            "workload.slo.percentile",
                            format!("must lie strictly between 0 and 100 (e.g. 90), got {p}"),
                        ));
                    }
                }
                if let Some(s) = slo {
                    for (name, v) in [
                        ("workload.slo.ttft_ms", s.ttft_ms),
                        ("workload.slo.tpot_ms", s.tpot_ms),
                        ("workload.slo.percentile", s.percentile),
                    ] {
                        if let Some(v) = v {
                            if !(v.is_finite() && v > 0.0) {
                                return Err(IrError::invalid(
                                    file,
                                    name,
                                    format!("must be a positive number, got {v}"),
                                ));
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

impl RawModel {
    /// Resolves the model: exactly one of `transformer:` and `graph:`, valid sizes.
    pub fn validate(self, file: &str) -> Result<ModelSpec, IrError> {
        if self.name.trim().is_empty() {
            return Err(IrError::invalid(file, "name", "must not be empty"));
        }
        let arch = match (self.transformer, self.graph) {
            (Some(t), None) => Architecture::Transformer(t.validate(file)?),
            (None, Some(g)) => {
                g.validate(file)?;
                Architecture::Graph(g)
            }
            (Some(_), Some(_)) => {
                return Err(IrError::invalid(
                    file,
                    "transformer",
                    "give either `transformer:` or `graph:`, not both",
                ))
            }
            (None, None) => {
                return Err(IrError::invalid(
                    file,
                    "transformer",
                    "missing: give the architecture (`transformer:`) or an explicit `graph:`",
                ))
            }
        };
        if let Some(w) = &self.workload {
            w.validate(file)?;
        }
        Ok(ModelSpec {
            name: self.name,
            arch,
            dtype: self.dtype,
            workload: self.workload,
        })
    }
}
