//! Hugging Face `config.json` import.
//!
//! A transformers `config.json` is read into a [`serde_json::Value`], the keys of its
//! family are mapped onto a [`RawTransformer`], and that goes through the same
//! [`RawTransformer::validate`] as a model YAML, so defaults and checks are shared.
//! The result has no workload (it comes from flags or a workload file).
//!
//! | family (`model_type`) | mapping |
//! |---|---|
//! | `llama`, `mistral` | rmsnorm, swiglu, rope, GQA from `num_key_value_heads`, `head_dim` if given |
//! | `qwen2` | as Llama, with biases on the QKV projections |
//! | `mixtral` | as Mistral, every layer MoE: `num_local_experts`, `num_experts_per_tok`, experts of `intermediate_size` |
//! | `gpt2` | layernorm, gelu, biases everywhere, learned positions (`n_positions`), tied embeddings |
//! | `bloom` | layernorm, gelu, biases everywhere, ALiBi positions, tied embeddings; `n_embed` or `hidden_size`, `n_layer`, `n_head` (or their long names) |
//! | `deepseek_v3` | MLA (`q_lora_rank`, `kv_lora_rank`, `qk_*_head_dim`, `v_head_dim`) and MoE after `first_k_dense_replace` dense layers |
//!
//! Both the Transformers 4 and 5 spellings are read: `rope_theta` at the top level or
//! under `rope_parameters` (or `rope_scaling`), and `torch_dtype` or `dtype`.
//!
//! Fields that change the math but not the cost are kept for the executor:
//! `rope_scaling` of type `default`, `linear` and `llama3`, and `sliding_window`
//! (Mistral, Mixtral; Qwen2 with `use_sliding_window`). A field whose math the
//! executor does not implement is recorded as [`Unexecutable`]: the model can be
//! planned (the field does not change costs), and `run` refuses it naming the field,
//! never computing something else. Those are: the other rope types (`dynamic`,
//! `yarn`, `longrope`, ...), `partial_rotary_factor` below 1, an `attention_factor`,
//! GPT-2 activations other
//! than the tanh approximation (`gelu_new`, `gelu_pytorch_tanh`, `gelu_fast`),
//! `scale_attn_weights: false`, `scale_attn_by_inverse_layer_idx: true` and
//! `add_cross_attention: true`.
//!
//! Left out on purpose, as they do not change parameter counts of the shipped
//! families: DeepSeek's multi-token-prediction module (`num_nextn_predict_layers`)
//! and its router's score-correction bias (one value per expert per layer). BLOOM's
//! LayerNorm after the word embeddings is left out too: 2 x hidden parameters
//! (28,672 of BLOOM-176B's 176 billion) and one elementwise pass per step. BLOOM's
//! ALiBi attention itself is priced (by each framework's attention kernel) and
//! refused by `run`; so is `apply_residual_connection_post_layernorm: true`.

use crate::dtype::DType;
use crate::error::IrError;
use crate::spec::{
    Architecture, MlaSpec, MlpKind, ModelSpec, MoeSpec, NormKind, PositionKind, RawTransformer,
    RopeScaling, Unexecutable,
};
use serde_json::{Map, Value};

/// The `model_type` values [`import_hf_config`] reads.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &[
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "gpt2",
    "bloom",
    "deepseek_v3",
];

/// Imports a Hugging Face `config.json`: the architecture form of the model, its dtype
/// (`torch_dtype`/`dtype`, default bf16) and its name (`_name_or_path`, else
/// `model_type`). Errors name the JSON key that is missing or wrong and what is
/// expected.
pub fn import_hf_config(text: &str, file: &str) -> Result<ModelSpec, IrError> {
    let value: Value = serde_json::from_str(text).map_err(|e| IrError::from_json(file, &e))?;
    let Some(obj) = value.as_object() else {
        return Err(IrError::invalid(
            file,
            "(top level)",
            format!(
                "expected a JSON object (a Hugging Face config.json), got {}",
                describe(&value)
            ),
        ));
    };
    let cfg = Config { obj, file };
    let model_type = cfg.model_type()?;
    let (raw, keys) = match model_type {
        "llama" | "mistral" | "qwen2" => (llama_family(&cfg, model_type)?, LLAMA_KEYS),
        "mixtral" => (mixtral(&cfg)?, MIXTRAL_KEYS),
        "gpt2" => (gpt2(&cfg)?, GPT2_KEYS),
        "bloom" => (bloom(&cfg)?, BLOOM_KEYS),
        "deepseek_v3" => (deepseek_v3(&cfg)?, DEEPSEEK_V3_KEYS),
        other => {
            return Err(cfg.err(
                "model_type",
                format!(
                    "`{}` is not supported; supported families: {}",
                    truncate(other),
                    SUPPORTED_MODEL_TYPES.join(", ")
                ),
            ))
        }
    };
    let mut transformer = raw.validate(file).map_err(|e| to_hf_field(e, keys))?;
    transformer.unexecutable = cfg.unexecutable(model_type)?;
    let dtype = cfg.dtype()?;
    let name = match cfg.opt_str("_name_or_path")?.map(str::trim) {
        Some(n) if !n.is_empty() => n.to_string(),
        _ => model_type.to_string(),
    };
    Ok(ModelSpec {
        name,
        arch: Architecture::Transformer(transformer),
        dtype,
        workload: None,
    })
}

// === families ===

/// Llama, Mistral and Qwen2: pre-norm RMSNorm, SwiGLU, rotary, GQA.
fn llama_family(cfg: &Config, model_type: &str) -> Result<RawTransformer, IrError> {
    cfg.expect_silu("hidden_act")?;
    // Qwen2 always has biases on q/k/v (and none elsewhere); Llama's and Mistral's
    // `attention_bias` puts them on q, k, v and the output projection.
    let attention_bias = model_type != "qwen2" && cfg.bool_or("attention_bias", false)?;
    Ok(RawTransformer {
        qkv_bias: model_type == "qwen2" || attention_bias,
        attn_out_bias: attention_bias,
        mlp_bias: model_type != "qwen2" && cfg.bool_or("mlp_bias", false)?,
        sliding_window: cfg.sliding_window(model_type)?,
        ..llama_like(cfg)?
    })
}

/// Mixtral: Mistral with every MLP replaced by `num_local_experts` experts of
/// `intermediate_size`.
fn mixtral(cfg: &Config) -> Result<RawTransformer, IrError> {
    cfg.expect_silu("hidden_act")?;
    let base = llama_like(cfg)?;
    let expert_ffn_hidden = cfg.positive("intermediate_size")?;
    let moe = MoeSpec {
        experts: cfg.positive("num_local_experts")?,
        top_k: cfg.positive("num_experts_per_tok")?,
        expert_ffn_hidden,
        shared_experts: 0,
        shared_expert_ffn_hidden: None,
        first_dense_layers: 0,
        capacity_factor: None,
    };
    Ok(RawTransformer {
        moe: Some(moe),
        rope_theta: Some(base.rope_theta.unwrap_or(1.0e6)),
        sliding_window: cfg.sliding_window("mixtral")?,
        ..base
    })
}

/// GPT-2: learned positions, LayerNorm, GELU, biases everywhere, tied embeddings.
fn gpt2(cfg: &Config) -> Result<RawTransformer, IrError> {
    let act = cfg.opt_str("activation_function")?.unwrap_or("gelu_new");
    if !act.starts_with("gelu") {
        return Err(cfg.err(
            "activation_function",
            format!(
                "`{}` is not modelled; expected a gelu variant (gelu, gelu_new, ...)",
                truncate(act)
            ),
        ));
    }
    let hidden = cfg.positive("n_embd")?;
    // `n_inner: null` means 4 * n_embd (resolved here so that a huge n_embd is an
    // error, not an overflow).
    let ffn_hidden = match cfg.opt_positive("n_inner")? {
        Some(f) => f,
        None => hidden
            .checked_mul(4)
            .ok_or_else(|| cfg.err("n_embd", format!("4 * n_embd({hidden}) overflows")))?,
    };
    Ok(RawTransformer {
        ffn_hidden: Some(ffn_hidden),
        position: PositionKind::Learned,
        max_positions: Some(cfg.positive("n_positions")?),
        dropout: cfg.fraction_or("resid_pdrop", 0.1)? > 0.0,
        ..gpt2_block(
            cfg,
            cfg.positive("n_layer")?,
            hidden,
            cfg.positive("n_head")?,
        )?
    })
}

/// GPT-2's block (LayerNorm, GELU, biases everywhere, tied embeddings unless the
/// config unties them) of `layers` x `hidden` with `heads`, a `4 x hidden` MLP,
/// no dropout and no position table, for the families built on it to complete.
fn gpt2_block(
    cfg: &Config,
    layers: u64,
    hidden: u64,
    heads: u64,
) -> Result<RawTransformer, IrError> {
    Ok(RawTransformer {
        layers,
        hidden,
        heads,
        kv_heads: None,
        head_dim: None,
        ffn_hidden: None,
        mlp: MlpKind::Gelu,
        norm: NormKind::Layernorm,
        vocab: cfg.positive("vocab_size")?,
        make_vocab_size_divisible_by: None,
        tie_embeddings: cfg.bool_or("tie_word_embeddings", true)?,
        bias: true,
        qkv_bias: false,
        attn_out_bias: false,
        mlp_bias: false,
        position: PositionKind::Learned,
        max_positions: None,
        dropout: false,
        rope_theta: None,
        rope_scaling: None,
        sliding_window: None,
        norm_eps: cfg.norm_eps()?,
        moe: None,
        mla: None,
    })
}

/// BLOOM: GPT-2's block with ALiBi instead of a position table. transformers'
/// `BloomConfig` takes `n_embed` for `hidden_size` and maps `num_hidden_layers` and
/// `num_attention_heads` onto `n_layer` and `n_head`; its GELU is the tanh
/// approximation.
fn bloom(cfg: &Config) -> Result<RawTransformer, IrError> {
    let either = |short: &'static str, long: &'static str| {
        if cfg.get(short).is_some() {
            short
        } else {
            long
        }
    };
    let dropout = cfg.fraction_or("hidden_dropout", 0.0)? > 0.0
        || cfg.fraction_or("attention_dropout", 0.0)? > 0.0;
    Ok(RawTransformer {
        position: PositionKind::Alibi,
        dropout,
        ..gpt2_block(
            cfg,
            cfg.positive(either("n_layer", "num_hidden_layers"))?,
            cfg.positive(either("n_embed", "hidden_size"))?,
            cfg.positive(either("n_head", "num_attention_heads"))?,
        )?
    })
}

/// DeepSeek-V3: multi-head latent attention, `first_k_dense_replace` dense layers of
/// `intermediate_size`, then MoE layers of `n_routed_experts` routed and
/// `n_shared_experts` shared experts of `moe_intermediate_size`.
fn deepseek_v3(cfg: &Config) -> Result<RawTransformer, IrError> {
    cfg.expect_silu("hidden_act")?;
    if cfg.bool_or("attention_bias", false)? {
        return Err(cfg.err(
            "attention_bias",
            "biases on the MLA projections are not modelled; expected false",
        ));
    }
    let freq = cfg.count_or("moe_layer_freq", 1)?;
    if freq != 1 {
        return Err(cfg.err(
            "moe_layer_freq",
            format!(
                "expected 1 (every layer after first_k_dense_replace is MoE), got {freq}: \
                 interleaved dense/MoE layers are not modelled"
            ),
        ));
    }
    let q_lora_rank = match cfg.obj.get("q_lora_rank") {
        None => {
            return Err(cfg.err(
                "q_lora_rank",
                "missing: expected a positive integer, or null for uncompressed queries",
            ))
        }
        Some(_) => cfg.opt_positive("q_lora_rank")?,
    };
    let mla = MlaSpec {
        q_lora_rank,
        kv_lora_rank: cfg.positive("kv_lora_rank")?,
        qk_nope_head_dim: cfg.positive("qk_nope_head_dim")?,
        qk_rope_head_dim: cfg.positive("qk_rope_head_dim")?,
        v_head_dim: cfg.positive("v_head_dim")?,
    };
    let moe = MoeSpec {
        experts: cfg.positive("n_routed_experts")?,
        top_k: cfg.positive("num_experts_per_tok")?,
        expert_ffn_hidden: cfg.positive("moe_intermediate_size")?,
        shared_experts: cfg.count_or("n_shared_experts", 0)?,
        shared_expert_ffn_hidden: None,
        first_dense_layers: cfg.count_or("first_k_dense_replace", 0)?,
        capacity_factor: None,
    };
    let heads = cfg.positive("num_attention_heads")?;
    Ok(RawTransformer {
        layers: cfg.positive("num_hidden_layers")?,
        hidden: cfg.positive("hidden_size")?,
        heads,
        kv_heads: cfg.opt_positive("num_key_value_heads")?,
        // The query/key width per head (transformers' `qk_head_dim`); the builder takes
        // every MLA width from `mla`, and `hidden / heads` need not be whole.
        head_dim: Some(
            mla.qk_nope_head_dim
                .checked_add(mla.qk_rope_head_dim)
                .ok_or_else(|| {
                    cfg.err(
                        "qk_rope_head_dim",
                        "qk_nope_head_dim + qk_rope_head_dim overflows",
                    )
                })?,
        ),
        ffn_hidden: Some(cfg.positive("intermediate_size")?),
        mlp: MlpKind::Swiglu,
        norm: NormKind::Rmsnorm,
        vocab: cfg.positive("vocab_size")?,
        make_vocab_size_divisible_by: None,
        tie_embeddings: cfg.bool_or("tie_word_embeddings", false)?,
        bias: false,
        qkv_bias: false,
        attn_out_bias: false,
        mlp_bias: false,
        position: PositionKind::Rope,
        max_positions: None,
        dropout: false,
        rope_theta: cfg.rope_theta()?,
        rope_scaling: Some(cfg.rope_scaling()?),
        sliding_window: None,
        norm_eps: cfg.norm_eps()?,
        moe: Some(moe),
        mla: Some(mla),
    })
}

/// The keys shared by Llama, Mistral, Qwen2 and Mixtral.
fn llama_like(cfg: &Config) -> Result<RawTransformer, IrError> {
    Ok(RawTransformer {
        layers: cfg.positive("num_hidden_layers")?,
        hidden: cfg.positive("hidden_size")?,
        heads: cfg.positive("num_attention_heads")?,
        kv_heads: cfg.opt_positive("num_key_value_heads")?,
        head_dim: cfg.opt_positive("head_dim")?,
        ffn_hidden: Some(cfg.positive("intermediate_size")?),
        mlp: MlpKind::Swiglu,
        norm: NormKind::Rmsnorm,
        vocab: cfg.positive("vocab_size")?,
        make_vocab_size_divisible_by: None,
        tie_embeddings: cfg.bool_or("tie_word_embeddings", false)?,
        bias: false,
        qkv_bias: false,
        attn_out_bias: false,
        mlp_bias: false,
        position: PositionKind::Rope,
        max_positions: None,
        dropout: false,
        rope_theta: cfg.rope_theta()?,
        rope_scaling: Some(cfg.rope_scaling()?),
        sliding_window: None,
        norm_eps: cfg.norm_eps()?,
        moe: None,
        mla: None,
    })
}

// === error fields: spec names back to config.json keys ===

/// `(spec field, config.json key)` pairs, so that a check made by
/// [`RawTransformer::validate`] names the key the user wrote.
type KeyMap = &'static [(&'static str, &'static str)];

const LLAMA_KEYS: KeyMap = &[
    ("transformer.layers", "num_hidden_layers"),
    ("transformer.hidden", "hidden_size"),
    ("transformer.heads", "num_attention_heads"),
    ("transformer.kv_heads", "num_key_value_heads"),
    ("transformer.head_dim", "head_dim"),
    ("transformer.ffn_hidden", "intermediate_size"),
    ("transformer.vocab", "vocab_size"),
    ("transformer.rope_theta", "rope_theta"),
    ("transformer.norm_eps", "rms_norm_eps"),
];

const MIXTRAL_KEYS: KeyMap = &[
    ("transformer.layers", "num_hidden_layers"),
    ("transformer.hidden", "hidden_size"),
    ("transformer.heads", "num_attention_heads"),
    ("transformer.kv_heads", "num_key_value_heads"),
    ("transformer.head_dim", "head_dim"),
    ("transformer.ffn_hidden", "intermediate_size"),
    ("transformer.vocab", "vocab_size"),
    ("transformer.rope_theta", "rope_theta"),
    ("transformer.norm_eps", "rms_norm_eps"),
    ("transformer.moe.experts", "num_local_experts"),
    ("transformer.moe.top_k", "num_experts_per_tok"),
    ("transformer.moe.expert_ffn_hidden", "intermediate_size"),
];

const GPT2_KEYS: KeyMap = &[
    ("transformer.layers", "n_layer"),
    ("transformer.hidden", "n_embd"),
    ("transformer.heads", "n_head"),
    ("transformer.head_dim", "n_head"),
    ("transformer.ffn_hidden", "n_inner"),
    ("transformer.vocab", "vocab_size"),
    ("transformer.max_positions", "n_positions"),
    ("transformer.norm_eps", "layer_norm_epsilon"),
];

const BLOOM_KEYS: KeyMap = &[
    ("transformer.layers", "n_layer"),
    ("transformer.hidden", "n_embed"),
    ("transformer.heads", "n_head"),
    ("transformer.head_dim", "n_head"),
    ("transformer.vocab", "vocab_size"),
    ("transformer.norm_eps", "layer_norm_epsilon"),
];

const DEEPSEEK_V3_KEYS: KeyMap = &[
    ("transformer.layers", "num_hidden_layers"),
    ("transformer.hidden", "hidden_size"),
    ("transformer.heads", "num_attention_heads"),
    ("transformer.kv_heads", "num_key_value_heads"),
    ("transformer.ffn_hidden", "intermediate_size"),
    ("transformer.vocab", "vocab_size"),
    ("transformer.rope_theta", "rope_theta"),
    ("transformer.norm_eps", "rms_norm_eps"),
    ("transformer.moe.experts", "n_routed_experts"),
    ("transformer.moe.top_k", "num_experts_per_tok"),
    ("transformer.moe.expert_ffn_hidden", "moe_intermediate_size"),
    (
        "transformer.moe.first_dense_layers",
        "first_k_dense_replace",
    ),
    ("transformer.mla.q_lora_rank", "q_lora_rank"),
    ("transformer.mla.kv_lora_rank", "kv_lora_rank"),
    ("transformer.mla.qk_nope_head_dim", "qk_nope_head_dim"),
    ("transformer.mla.qk_rope_head_dim", "qk_rope_head_dim"),
    ("transformer.mla.v_head_dim", "v_head_dim"),
];

fn to_hf_field(e: IrError, keys: KeyMap) -> IrError {
    match e {
        IrError::Invalid {
            file,
            field,
            message,
        } => {
            let field = keys
                .iter()
                .find(|(spec, _)| *spec == field)
                .map_or(field, |(_, hf)| (*hf).to_string());
            IrError::Invalid {
                file,
                field,
                message,
            }
        }
        other => other,
    }
}

// === reading keys ===

/// The top-level object of a `config.json`, with typed accessors whose errors name
/// the key and what is expected.
struct Config<'a> {
    obj: &'a Map<String, Value>,
    file: &'a str,
}

impl<'a> Config<'a> {
    fn err(&self, field: &str, message: impl Into<String>) -> IrError {
        IrError::invalid(self.file, field, message)
    }

    /// The value of a key; `None` when absent or `null` (transformers writes `null`
    /// for "use the default").
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn model_type(&self) -> Result<&'a str, IrError> {
        let expected = format!("expected one of {}", SUPPORTED_MODEL_TYPES.join(", "));
        match self.get("model_type") {
            None => Err(self.err("model_type", format!("missing: {expected}"))),
            Some(Value::String(s)) => Ok(s.as_str()),
            Some(v) => Err(self.err("model_type", format!("{expected}, got {}", describe(v)))),
        }
    }

    /// A required positive integer.
    fn positive(&self, key: &str) -> Result<u64, IrError> {
        self.opt_positive(key)?
            .ok_or_else(|| self.err(key, "missing: expected a positive integer"))
    }

    /// An optional positive integer (`None` when absent or `null`).
    fn opt_positive(&self, key: &str) -> Result<Option<u64>, IrError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match as_uint(v) {
                Some(n) if n > 0 => Ok(Some(n)),
                _ => Err(self.err(
                    key,
                    format!("expected a positive integer, got {}", describe(v)),
                )),
            },
        }
    }

    /// A non-negative integer with a default for absent or `null`.
    fn count_or(&self, key: &str, default: u64) -> Result<u64, IrError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => as_uint(v).ok_or_else(|| {
                self.err(
                    key,
                    format!("expected a non-negative integer, got {}", describe(v)),
                )
            }),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool, IrError> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.err(key, format!("expected true or false, got {}", describe(v)))),
        }
    }

    /// A probability in `[0, 1]` with a default for absent or `null`.
    fn fraction_or(&self, key: &str, default: f64) -> Result<f64, IrError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => match v.as_f64() {
                Some(p) if (0.0..=1.0).contains(&p) => Ok(p),
                _ => Err(self.err(
                    key,
                    format!("expected a number in [0, 1], got {}", describe(v)),
                )),
            },
        }
    }

    fn opt_str(&self, key: &str) -> Result<Option<&'a str>, IrError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(v) => Err(self.err(key, format!("expected a string, got {}", describe(v)))),
        }
    }

    /// A positive finite number at `path` (already looked up).
    fn positive_number(&self, path: &str, v: &Value) -> Result<f64, IrError> {
        match v.as_f64() {
            Some(x) if x.is_finite() && x > 0.0 => Ok(x),
            _ => Err(self.err(
                path,
                format!("expected a positive number, got {}", describe(v)),
            )),
        }
    }

    /// Llama-family MLPs are gated SiLU (SwiGLU); anything else is not modelled.
    fn expect_silu(&self, key: &str) -> Result<(), IrError> {
        match self.opt_str(key)? {
            None | Some("silu") | Some("swish") => Ok(()),
            Some(other) => Err(self.err(
                key,
                format!(
                    "`{}` is not modelled; expected silu (a SwiGLU MLP)",
                    truncate(other)
                ),
            )),
        }
    }

    /// `rope_theta` at the top level (Transformers 4) or inside `rope_parameters`
    /// (Transformers 5) or `rope_scaling`. Two different values are an error.
    fn rope_theta(&self) -> Result<Option<f64>, IrError> {
        let mut found: Option<(String, f64)> = None;
        let top = self
            .get("rope_theta")
            .map(|v| ("rope_theta".to_string(), v));
        let nested = ["rope_parameters", "rope_scaling"]
            .into_iter()
            .filter_map(|outer| {
                let inner = match self.get(outer) {
                    Some(Value::Object(m)) => m.get("rope_theta").filter(|v| !v.is_null()),
                    _ => None,
                };
                inner.map(|v| (format!("{outer}.rope_theta"), v))
            });
        for (path, v) in top.into_iter().chain(nested) {
            let theta = self.positive_number(&path, v)?;
            match &found {
                Some((first, prev)) if *prev != theta => {
                    return Err(self.err(
                        &path,
                        format!("{theta} disagrees with {first} = {prev}: give one rotary base"),
                    ))
                }
                Some(_) => {}
                None => found = Some((path, theta)),
            }
        }
        for outer in ["rope_parameters", "rope_scaling"] {
            if let Some(v) = self.get(outer) {
                if !v.is_object() {
                    return Err(self.err(
                        outer,
                        format!("expected an object or null, got {}", describe(v)),
                    ));
                }
            }
        }
        Ok(found.map(|(_, t)| t))
    }

    /// The rope dictionary: `rope_parameters` (Transformers 5) or `rope_scaling`
    /// (Transformers 4), with its key prefix for messages.
    fn rope_dict(&self) -> Option<(&'static str, &'a Map<String, Value>)> {
        ["rope_parameters", "rope_scaling"]
            .into_iter()
            .find_map(|k| match self.get(k) {
                Some(Value::Object(m)) => Some((k, m)),
                _ => None,
            })
    }

    /// The rope type: `rope_type` or the older `type`; `default` when absent.
    fn rope_type(&self) -> Result<Option<(String, &'a str)>, IrError> {
        let Some((outer, m)) = self.rope_dict() else {
            return Ok(None);
        };
        for key in ["rope_type", "type"] {
            match m.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::String(t)) => return Ok(Some((format!("{outer}.{key}"), t))),
                Some(v) => {
                    return Err(self.err(
                        &format!("{outer}.{key}"),
                        format!("expected a string, got {}", describe(v)),
                    ))
                }
            }
        }
        Ok(Some((format!("{outer}.rope_type"), "default")))
    }

    /// The frequency scaling the executor implements; other rope types read as
    /// none here and are listed by [`Config::unexecutable`].
    fn rope_scaling(&self) -> Result<RopeScaling, IrError> {
        let Some((outer, m)) = self.rope_dict() else {
            return Ok(RopeScaling::None);
        };
        let number = |key: &str| -> Result<f64, IrError> {
            let path = format!("{outer}.{key}");
            match m.get(key).filter(|v| !v.is_null()) {
                None => Err(self.err(&path, "missing: expected a positive number")),
                Some(v) => self.positive_number(&path, v),
            }
        };
        Ok(match self.rope_type()?.map(|(_, t)| t) {
            Some("linear") => RopeScaling::Linear {
                factor: number("factor")?,
            },
            Some("llama3") => {
                let original_max_positions = match m
                    .get("original_max_position_embeddings")
                    .filter(|v| !v.is_null())
                {
                    Some(_) => number("original_max_position_embeddings")?,
                    None => match self.get("max_position_embeddings") {
                        Some(v) => self.positive_number("max_position_embeddings", v)?,
                        None => number("original_max_position_embeddings")?,
                    },
                };
                let (low, high) = (number("low_freq_factor")?, number("high_freq_factor")?);
                if high <= low {
                    return Err(self.err(
                        &format!("{outer}.high_freq_factor"),
                        format!("must be larger than low_freq_factor ({low}), got {high}"),
                    ));
                }
                RopeScaling::Llama3 {
                    factor: number("factor")?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_positions,
                }
            }
            _ => RopeScaling::None,
        })
    }

    /// The attention window: Mistral's and Mixtral's `sliding_window`, Qwen2's when
    /// `use_sliding_window` is true (Transformers 5 may instead list
    /// `sliding_attention` in `layer_types`). Windows on only some layers read as a
    /// window on all: the executor runs either exactly (no sequence longer than the
    /// window) or refuses, so the difference never shows in an output.
    fn sliding_window(&self, model_type: &str) -> Result<Option<u64>, IrError> {
        let applies = match model_type {
            "mistral" | "mixtral" => true,
            "qwen2" => {
                let listed = match self.get("layer_types") {
                    Some(Value::Array(a)) => a.iter().any(|t| t == "sliding_attention"),
                    _ => false,
                };
                listed || self.bool_or("use_sliding_window", false)?
            }
            _ => false,
        };
        if !applies {
            return Ok(None);
        }
        self.opt_positive("sliding_window")
    }

    /// The fields whose math the executor does not implement (see the module
    /// documentation), each with what it asks for.
    fn unexecutable(&self, model_type: &str) -> Result<Vec<Unexecutable>, IrError> {
        let mut out = Vec::new();
        let mut refuse = |field: &str, reason: String| {
            out.push(Unexecutable {
                field: field.to_string(),
                reason,
            })
        };
        if let Some((path, t)) = self.rope_type()? {
            if !matches!(t, "default" | "linear" | "llama3") {
                refuse(
                    &path,
                    format!(
                        "rope type `{}` is not implemented (default, linear and llama3 are)",
                        truncate(t)
                    ),
                );
            }
        }
        if let Some((outer, m)) = self.rope_dict() {
            for key in ["attention_factor", "partial_rotary_factor"] {
                if let Some(v) = m.get(key).filter(|v| !v.is_null()) {
                    if v.as_f64() != Some(1.0) {
                        refuse(
                            &format!("{outer}.{key}"),
                            format!("{} is not implemented (only 1 is)", describe(v)),
                        );
                    }
                }
            }
        }
        if let Some(v) = self.get("partial_rotary_factor") {
            if v.as_f64() != Some(1.0) {
                refuse(
                    "partial_rotary_factor",
                    format!(
                        "{}: rotating part of each head is not implemented (only 1 is)",
                        describe(v)
                    ),
                );
            }
        }
        if model_type == "bloom"
            && self.bool_or("apply_residual_connection_post_layernorm", false)?
        {
            refuse(
                "apply_residual_connection_post_layernorm",
                "true (the residual taken after the LayerNorm) is not implemented".into(),
            );
        }
        if model_type == "gpt2" {
            let act = self.opt_str("activation_function")?.unwrap_or("gelu_new");
            // transformers' tanh-approximation spellings, one formula.
            let tanh = [
                "gelu_new",
                "gelu_pytorch_tanh",
                "gelu_fast",
                "gelu_accurate",
                "gelu_python_tanh",
            ];
            if !tanh.contains(&act) {
                refuse(
                        "activation_function",
                        format!(
                            "`{}` is not implemented; the executor's GELU is the tanh approximation (gelu_new, gelu_pytorch_tanh, gelu_fast, gelu_accurate, gelu_python_tanh)",
                            truncate(act)
                        ),
                    );
            }
            if !self.bool_or("scale_attn_weights", true)? {
                refuse(
                    "scale_attn_weights",
                    "false (unscaled attention scores) is not implemented".into(),
                );
            }
            if self.bool_or("scale_attn_by_inverse_layer_idx", false)? {
                refuse(
                    "scale_attn_by_inverse_layer_idx",
                    "true (scores divided by the layer number) is not implemented".into(),
                );
            }
            if self.bool_or("add_cross_attention", false)? {
                refuse(
                    "add_cross_attention",
                    "true (cross-attention blocks) is not implemented".into(),
                );
            }
        }
        Ok(out)
    }

    /// `rms_norm_eps` (Llama family) or `layer_norm_epsilon` (GPT-2).
    fn norm_eps(&self) -> Result<Option<f64>, IrError> {
        for key in ["rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps"] {
            if let Some(v) = self.get(key) {
                return self.positive_number(key, v).map(Some);
            }
        }
        Ok(None)
    }

    /// `dtype` (Transformers 5) or `torch_dtype` (Transformers 4); bf16 when absent.
    fn dtype(&self) -> Result<DType, IrError> {
        for key in ["dtype", "torch_dtype"] {
            if let Some(s) = self.opt_str(key)? {
                return match DType::parse(s) {
                    Some(d @ (DType::Bf16 | DType::F16 | DType::F32)) => Ok(d),
                    _ => Err(self.err(
                        key,
                        format!(
                            "`{}` is not supported; expected bfloat16, float16 or float32",
                            truncate(s.strip_prefix("torch.").unwrap_or(s))
                        ),
                    )),
                };
            }
        }
        Ok(DType::Bf16)
    }
}

/// A JSON integer, or a float with no fractional part (some exporters write `4096.0`).
fn as_uint(v: &Value) -> Option<u64> {
    // 2^53: beyond it a float no longer holds every integer exactly.
    const EXACT_MAX: f64 = 9_007_199_254_740_992.0;
    v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f <= EXACT_MAX)
            .map(|f| f as u64)
    })
}

/// A short description of a JSON value for error messages.
fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => format!("the string \"{}\"", truncate(s)),
        Value::Array(_) => "an array".to_string(),
        Value::Object(_) => "an object".to_string(),
    }
}

/// At most 40 characters of user text in a message.
fn truncate(s: &str) -> String {
    const MAX: usize = 40;
    if s.chars().count() <= MAX {
        s.to_string()
    } else {
        format!("{}...", s.chars().take(MAX).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::TransformerSpec;

    fn import(text: &str) -> Result<ModelSpec, IrError> {
        import_hf_config(text, "config.json")
    }

    fn transformer(text: &str) -> TransformerSpec {
        match import(text) {
            Ok(spec) => match spec.arch {
                Architecture::Transformer(t) => t,
                Architecture::Graph(_) => panic!("expected the architecture form"),
            },
            Err(e) => panic!("import failed: {e}"),
        }
    }

    /// The field and message of an `Invalid` error.
    fn invalid(text: &str) -> (String, String) {
        match import(text) {
            Err(IrError::Invalid {
                file,
                field,
                message,
            }) => {
                assert_eq!(file, "config.json");
                (field, message)
            }
            other => panic!("expected IrError::Invalid, got {other:?}"),
        }
    }

    const LLAMA3_8B_TF4: &str = r#"{
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_scaling": null,
        "rope_theta": 500000.0,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256
    }"#;

    const LLAMA3_8B_TF5: &str = r#"{
        "architectures": ["LlamaForCausalLM"],
        "dtype": "bfloat16",
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "tie_word_embeddings": false,
        "vocab_size": 128256
    }"#;

    #[test]
    fn llama_transformers4() {
        let spec = match import(LLAMA3_8B_TF4) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(spec.name, "llama");
        assert_eq!(spec.dtype, DType::Bf16);
        assert!(spec.workload.is_none());
        let t = transformer(LLAMA3_8B_TF4);
        assert_eq!(t.layers, 32);
        assert_eq!(t.hidden, 4096);
        assert_eq!(t.heads, 32);
        assert_eq!(t.kv_heads, 8);
        assert_eq!(t.head_dim, 128);
        assert_eq!(t.ffn_hidden, 14336);
        assert_eq!(t.vocab, 128256);
        assert_eq!(t.mlp, MlpKind::Swiglu);
        assert_eq!(t.norm, NormKind::Rmsnorm);
        assert_eq!(t.position, PositionKind::Rope);
        assert_eq!(t.max_positions, 0);
        assert_eq!(t.rope_theta, 500000.0);
        assert_eq!(t.norm_eps, 1e-5);
        assert!(!t.tie_embeddings);
        assert!(!t.bias);
        assert!(!t.qkv_bias);
        assert!(!t.dropout);
        assert!(t.moe.is_none());
        assert!(t.mla.is_none());
    }

    #[test]
    fn llama_transformers5_equals_transformers4() {
        assert_eq!(transformer(LLAMA3_8B_TF5), transformer(LLAMA3_8B_TF4));
    }

    #[test]
    fn rope_theta_under_rope_scaling_and_default() {
        let t = transformer(
            r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
                "rope_scaling": {"rope_type": "default", "rope_theta": 250000}}"#,
        );
        assert_eq!(t.rope_theta, 250000.0);
        // No num_key_value_heads: plain multi-head attention.
        assert_eq!(t.kv_heads, 4);
        let t = transformer(
            r#"{"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
                "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256}"#,
        );
        assert_eq!(t.rope_theta, 10000.0);
    }

    #[test]
    fn head_dim_key_overrides_hidden_over_heads() {
        // Mistral-Nemo: 5120 / 32 = 160, but head_dim is 128.
        let t = transformer(
            r#"{"model_type": "mistral", "hidden_size": 5120, "intermediate_size": 14336,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "num_hidden_layers": 40, "vocab_size": 131072, "rope_theta": 1000000.0}"#,
        );
        assert_eq!(t.head_dim, 128);
        let t = transformer(
            r#"{"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                "num_attention_heads": 32, "head_dim": null,
                "num_hidden_layers": 32, "vocab_size": 32000}"#,
        );
        assert_eq!(t.head_dim, 128);
    }

    #[test]
    fn mistral() {
        let spec = match import(
            r#"{"_name_or_path": "mistralai/Mistral-7B-v0.1", "model_type": "mistral",
                "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
                "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
                "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
                "tie_word_embeddings": false, "torch_dtype": "float16", "vocab_size": 32000}"#,
        ) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(spec.name, "mistralai/Mistral-7B-v0.1");
        assert_eq!(spec.dtype, DType::F16);
        let Some(t) = spec.transformer() else {
            panic!("expected the architecture form")
        };
        assert_eq!(t.kv_heads, 8);
        assert_eq!(t.vocab, 32000);
        assert!(t.moe.is_none());
    }

    #[test]
    fn mixtral_every_layer_moe() {
        let t = transformer(
            r#"{"model_type": "mixtral", "hidden_act": "silu", "hidden_size": 4096,
                "intermediate_size": 14336, "num_attention_heads": 32,
                "num_key_value_heads": 8, "num_hidden_layers": 32, "num_local_experts": 8,
                "num_experts_per_tok": 2, "rms_norm_eps": 1e-05, "vocab_size": 32000}"#,
        );
        let Some(m) = &t.moe else {
            panic!("expected moe")
        };
        assert_eq!(m.experts, 8);
        assert_eq!(m.top_k, 2);
        assert_eq!(m.expert_ffn_hidden, 14336);
        assert_eq!(m.shared_experts, 0);
        assert_eq!(m.first_dense_layers, 0);
        assert_eq!(t.moe_layers(), 32);
        // Mixtral's default rotary base when the key is absent.
        assert_eq!(t.rope_theta, 1.0e6);
    }

    #[test]
    fn mixtral_top_k_above_experts_names_the_json_key() {
        let (field, message) = invalid(
            r#"{"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128,
                "num_attention_heads": 4, "num_hidden_layers": 2, "num_local_experts": 2,
                "num_experts_per_tok": 3, "vocab_size": 256}"#,
        );
        assert_eq!(field, "num_experts_per_tok");
        assert!(message.contains("top_k(3) > experts(2)"), "{message}");
    }

    #[test]
    fn qwen2_qkv_bias_and_tied() {
        let t = transformer(
            r#"{"model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
                "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
                "num_hidden_layers": 24, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                "tie_word_embeddings": true, "torch_dtype": "bfloat16", "vocab_size": 151936}"#,
        );
        assert!(t.qkv_bias);
        assert!(!t.bias);
        assert!(t.tie_embeddings);
        assert_eq!(t.head_dim, 64);
        assert_eq!(t.norm_eps, 1e-6);
    }

    const GPT2: &str = r#"{
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": 1024,
        "n_embd": 768,
        "n_head": 12,
        "n_inner": null,
        "n_layer": 12,
        "n_positions": 1024,
        "resid_pdrop": 0.1,
        "vocab_size": 50257
    }"#;

    #[test]
    fn gpt2() {
        let spec = match import(GPT2) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(spec.name, "gpt2");
        assert_eq!(spec.dtype, DType::Bf16);
        let t = transformer(GPT2);
        assert_eq!(t.layers, 12);
        assert_eq!(t.hidden, 768);
        assert_eq!(t.heads, 12);
        assert_eq!(t.kv_heads, 12);
        assert_eq!(t.head_dim, 64);
        assert_eq!(t.ffn_hidden, 4 * 768);
        assert_eq!(t.mlp, MlpKind::Gelu);
        assert_eq!(t.norm, NormKind::Layernorm);
        assert_eq!(t.position, PositionKind::Learned);
        assert_eq!(t.max_positions, 1024);
        assert!(t.bias);
        assert!(t.tie_embeddings);
        assert!(t.dropout);
        assert_eq!(t.vocab, 50257);
    }

    /// bigscience/bloom's config.json, as published.
    const BLOOM: &str = r#"{
        "apply_residual_connection_post_layernorm": false, "attention_dropout": 0.0,
        "architectures": ["BloomForCausalLM"], "attention_softmax_in_fp32": true,
        "bias_dropout_fusion": true, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_dropout": 0.0, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
        "masked_softmax_fusion": true, "model_type": "bloom", "n_embed": 14336,
        "n_layer": 70, "num_attention_heads": 112, "pad_token_id": 3,
        "pretraining_tp": 4, "slow_but_exact": false, "torch_dtype": "bfloat16",
        "transformers_version": "4.21.0", "use_cache": true, "vocab_size": 250880
    }"#;

    #[test]
    fn bloom_is_gpt2_with_alibi() {
        let t = transformer(BLOOM);
        assert_eq!(
            (t.layers, t.hidden, t.heads, t.head_dim),
            (70, 14336, 112, 128)
        );
        assert_eq!(t.ffn_hidden, 4 * 14336);
        assert_eq!(t.position, PositionKind::Alibi);
        assert_eq!(t.max_positions, 0);
        assert!(t.bias && t.tie_embeddings && !t.dropout);
        assert!(t.unexecutable.is_empty());
        // Per layer 12h^2 + 13h (QKV, projection, two MLP matrices, their biases,
        // two LayerNorms), 70 layers, the 250880 x 14336 table and the final
        // LayerNorm: transformers' 176,247,271,424 less the 2h of the embedding
        // LayerNorm the graph leaves out.
        let spec = import(BLOOM).expect("bloom imports");
        let graph = crate::model_graph(&spec).expect("a graph");
        let h = 14336u64;
        let want = 70 * (12 * h * h + 13 * h) + 250880 * h + 2 * h;
        assert_eq!(want, 176_247_271_424 - 2 * h);
        assert_eq!(graph.param_count(false), want as f64);
        let alibi = graph
            .ops()
            .any(|o| matches!(o.kind, crate::OpKind::Attention(a) if a.alibi && a.qk_dim == 128));
        assert!(alibi, "the attention carries ALiBi");
        assert!(!graph.ops().any(|o| o.kind == crate::OpKind::Rope));
        let post = transformer(&BLOOM.replace(
            r#""apply_residual_connection_post_layernorm": false"#,
            r#""apply_residual_connection_post_layernorm": true"#,
        ));
        assert_eq!(
            post.unexecutable[0].field,
            "apply_residual_connection_post_layernorm"
        );
    }

    #[test]
    fn gpt2_n_inner_and_untied() {
        let t = transformer(
            r#"{"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_inner": 100,
                "n_layer": 2, "n_positions": 32, "vocab_size": 256,
                "tie_word_embeddings": false, "resid_pdrop": 0.0}"#,
        );
        assert_eq!(t.ffn_hidden, 100);
        assert!(!t.tie_embeddings);
        assert!(!t.dropout);
    }

    #[test]
    fn huge_sizes_are_errors_not_overflows() {
        let (field, _) = invalid(
            r#"{"model_type": "gpt2", "n_embd": 18446744073709551615, "n_head": 1,
                "n_layer": 2, "n_positions": 32, "vocab_size": 256}"#,
        );
        assert_eq!(field, "n_embd");
        let (field, _) = invalid(&DEEPSEEK_V3.replace(
            "\"qk_nope_head_dim\": 128",
            "\"qk_nope_head_dim\": 18446744073709551615",
        ));
        assert_eq!(field, "qk_rope_head_dim");
    }

    #[test]
    fn gpt2_non_gelu_is_rejected() {
        let (field, message) = invalid(
            r#"{"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2,
                "n_positions": 32, "vocab_size": 256, "activation_function": "relu"}"#,
        );
        assert_eq!(field, "activation_function");
        assert!(message.contains("gelu"), "{message}");
    }

    const DEEPSEEK_V3: &str = r#"{
        "architectures": ["DeepseekV3ForCausalLM"],
        "first_k_dense_replace": 3,
        "hidden_act": "silu",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 2048,
        "moe_layer_freq": 1,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_attention_heads": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
        "rope_theta": 10000,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "v_head_dim": 128,
        "vocab_size": 129280
    }"#;

    #[test]
    fn deepseek_v3() {
        let t = transformer(DEEPSEEK_V3);
        assert_eq!(t.layers, 61);
        assert_eq!(t.head_dim, 128 + 64);
        assert_eq!(t.ffn_hidden, 18432);
        assert_eq!(t.rope_theta, 10000.0);
        assert_eq!(t.norm_eps, 1e-6);
        assert_eq!(
            t.mla,
            Some(MlaSpec {
                q_lora_rank: Some(1536),
                kv_lora_rank: 512,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
            })
        );
        assert_eq!(
            t.moe,
            Some(MoeSpec {
                experts: 256,
                top_k: 8,
                expert_ffn_hidden: 2048,
                shared_experts: 1,
                shared_expert_ffn_hidden: None,
                first_dense_layers: 3,
                capacity_factor: None,
            })
        );
        assert_eq!(t.moe_layers(), 58);
    }

    #[test]
    fn deepseek_q_lora_rank_null_and_missing() {
        let t = transformer(&DEEPSEEK_V3.replace("\"q_lora_rank\": 1536", "\"q_lora_rank\": null"));
        assert_eq!(t.mla.map(|m| m.q_lora_rank), Some(None));
        let (field, message) = invalid(&DEEPSEEK_V3.replace("\"q_lora_rank\": 1536,", ""));
        assert_eq!(field, "q_lora_rank");
        assert!(message.starts_with("missing"), "{message}");
    }

    #[test]
    fn deepseek_moe_layer_freq_must_be_one() {
        let (field, message) =
            invalid(&DEEPSEEK_V3.replace("\"moe_layer_freq\": 1", "\"moe_layer_freq\": 2"));
        assert_eq!(field, "moe_layer_freq");
        assert!(message.contains("expected 1"), "{message}");
        assert!(message.contains("got 2"), "{message}");
    }

    #[test]
    fn deepseek_first_dense_layers_above_layers() {
        let (field, _) = invalid(&DEEPSEEK_V3.replace(
            "\"first_k_dense_replace\": 3",
            "\"first_k_dense_replace\": 62",
        ));
        assert_eq!(field, "first_k_dense_replace");
    }

    #[test]
    fn json_syntax_error_has_a_location() {
        match import("{\"model_type\": \"llama\",\n  \"hidden_size\": 4096,,}") {
            Err(IrError::Parse {
                file, line, column, ..
            }) => {
                assert_eq!(file, "config.json");
                assert_eq!(line, Some(2));
                assert!(column.is_some());
            }
            other => panic!("expected IrError::Parse, got {other:?}"),
        }
    }

    #[test]
    fn top_level_must_be_an_object() {
        let (field, message) = invalid("[1, 2]");
        assert_eq!(field, "(top level)");
        assert!(message.contains("an array"), "{message}");
    }

    #[test]
    fn model_type_missing_or_unknown_lists_families() {
        let (field, message) = invalid(r#"{"hidden_size": 64}"#);
        assert_eq!(field, "model_type");
        assert!(message.starts_with("missing"), "{message}");
        assert!(message.contains("deepseek_v3"), "{message}");
        let (field, message) = invalid(r#"{"model_type": "bert"}"#);
        assert_eq!(field, "model_type");
        assert!(message.contains("`bert` is not supported"), "{message}");
        for family in SUPPORTED_MODEL_TYPES {
            assert!(message.contains(family), "{message}");
        }
        let (field, _) = invalid(r#"{"model_type": 7}"#);
        assert_eq!(field, "model_type");
    }

    #[test]
    fn missing_key_is_named() {
        let (field, message) = invalid(&LLAMA3_8B_TF4.replace("\"hidden_size\": 4096,", ""));
        assert_eq!(field, "hidden_size");
        assert_eq!(message, "missing: expected a positive integer");
        // `null` reads as missing for a required key.
        let (field, message) =
            invalid(&LLAMA3_8B_TF4.replace("\"vocab_size\": 128256", "\"vocab_size\": null"));
        assert_eq!(field, "vocab_size");
        assert_eq!(message, "missing: expected a positive integer");
    }

    #[test]
    fn mistyped_key_is_named_with_its_value() {
        let (field, message) =
            invalid(&LLAMA3_8B_TF4.replace("\"hidden_size\": 4096", "\"hidden_size\": \"4096\""));
        assert_eq!(field, "hidden_size");
        assert!(message.contains("expected a positive integer"), "{message}");
        assert!(message.contains("\"4096\""), "{message}");
        for bad in ["0", "-8", "8.5", "true", "[8]"] {
            let text = LLAMA3_8B_TF4.replace(
                "\"num_key_value_heads\": 8",
                &format!("\"num_key_value_heads\": {bad}"),
            );
            let (field, message) = invalid(&text);
            assert_eq!(field, "num_key_value_heads", "{bad}");
            assert!(message.contains("positive integer"), "{bad}: {message}");
        }
        // An integral float is an integer.
        let t = transformer(
            &LLAMA3_8B_TF4.replace("\"num_hidden_layers\": 32", "\"num_hidden_layers\": 32.0"),
        );
        assert_eq!(t.layers, 32);
        let (field, _) = invalid(&LLAMA3_8B_TF4.replace(
            "\"tie_word_embeddings\": false",
            "\"tie_word_embeddings\": \"no\"",
        ));
        assert_eq!(field, "tie_word_embeddings");
    }

    #[test]
    fn kv_heads_must_divide_heads_names_the_json_key() {
        let (field, message) = invalid(
            &LLAMA3_8B_TF4.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 6"),
        );
        assert_eq!(field, "num_key_value_heads");
        assert!(message.contains("heads(32) % kv_heads(6)"), "{message}");
    }

    #[test]
    fn rope_theta_errors() {
        let (field, _) =
            invalid(&LLAMA3_8B_TF5.replace("\"rope_theta\": 500000.0", "\"rope_theta\": -1"));
        assert_eq!(field, "rope_parameters.rope_theta");
        let both = LLAMA3_8B_TF5.replace(
            "\"vocab_size\": 128256",
            "\"vocab_size\": 128256, \"rope_theta\": 10000.0",
        );
        let (field, message) = invalid(&both);
        assert_eq!(field, "rope_parameters.rope_theta");
        assert!(message.contains("disagrees with rope_theta"), "{message}");
        // The same value given twice is fine.
        let same = LLAMA3_8B_TF5.replace(
            "\"vocab_size\": 128256",
            "\"vocab_size\": 128256, \"rope_theta\": 500000",
        );
        assert_eq!(transformer(&same).rope_theta, 500000.0);
        let (field, _) =
            invalid(&LLAMA3_8B_TF4.replace("\"rope_scaling\": null", "\"rope_scaling\": 8"));
        assert_eq!(field, "rope_scaling");
    }

    #[test]
    fn dtypes() {
        for (s, want) in [
            ("bfloat16", DType::Bf16),
            ("float16", DType::F16),
            ("float32", DType::F32),
            ("torch.float32", DType::F32),
        ] {
            let text = LLAMA3_8B_TF4.replace("\"bfloat16\"", &format!("\"{s}\""));
            match import(&text) {
                Ok(spec) => assert_eq!(spec.dtype, want, "{s}"),
                Err(e) => panic!("{s}: {e}"),
            }
        }
        let (field, message) = invalid(&LLAMA3_8B_TF4.replace("\"bfloat16\"", "\"int8\""));
        assert_eq!(field, "torch_dtype");
        assert!(message.contains("`int8`"), "{message}");
        let (field, _) = invalid(&LLAMA3_8B_TF5.replace("\"bfloat16\"", "16"));
        assert_eq!(field, "dtype");
    }

    #[test]
    fn llama_non_silu_is_rejected() {
        let (field, message) = invalid(&LLAMA3_8B_TF4.replace("\"silu\"", "\"gelu_pytorch_tanh\""));
        assert_eq!(field, "hidden_act");
        assert!(message.contains("expected silu"), "{message}");
    }

    #[test]
    fn name_or_path_becomes_the_name() {
        let text = LLAMA3_8B_TF4.replace(
            "\"architectures\"",
            "\"_name_or_path\": \"meta-llama/Meta-Llama-3-8B\", \"architectures\"",
        );
        match import(&text) {
            Ok(spec) => assert_eq!(spec.name, "meta-llama/Meta-Llama-3-8B"),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn llama3_rope_scaling_in_both_spellings() {
        let want = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_positions: 8192.0,
        };
        // Transformers 4: `rope_scaling` beside `rope_theta` (Llama 3.1 8B's config).
        let tf4 = LLAMA3_8B_TF4.replace(
            "\"rope_scaling\": null",
            r#""rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}"#,
        );
        let t = transformer(&tf4);
        assert_eq!(t.rope_scaling, want);
        assert_eq!(t.rope_theta, 500000.0);
        assert!(t.unexecutable.is_empty());
        // Transformers 5: everything under `rope_parameters`.
        let tf5 = LLAMA3_8B_TF5.replace(
            r#""rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}"#,
            r#""rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}"#,
        );
        assert_eq!(transformer(&tf5).rope_scaling, want);
        // Linear, under the old `type` key.
        let lin = LLAMA3_8B_TF4.replace(
            "\"rope_scaling\": null",
            r#""rope_scaling": {"type": "linear", "factor": 2.0}"#,
        );
        assert_eq!(
            transformer(&lin).rope_scaling,
            RopeScaling::Linear { factor: 2.0 }
        );
        // A missing or inconsistent number names its key.
        let (field, _) = invalid(&tf4.replace("\"low_freq_factor\": 1.0, ", ""));
        assert_eq!(field, "rope_scaling.low_freq_factor");
        let (field, message) =
            invalid(&tf4.replace("\"high_freq_factor\": 4.0", "\"high_freq_factor\": 1.0"));
        assert_eq!(field, "rope_scaling.high_freq_factor");
        assert!(message.contains("larger than low_freq_factor"), "{message}");
    }

    #[test]
    fn unimplemented_math_is_recorded_not_dropped() {
        let fields = |text: &str| -> Vec<String> {
            transformer(text)
                .unexecutable
                .into_iter()
                .map(|u| u.field)
                .collect()
        };
        assert!(fields(LLAMA3_8B_TF4).is_empty());
        let yarn = LLAMA3_8B_TF4.replace(
            "\"rope_scaling\": null",
            r#""rope_scaling": {"type": "yarn", "factor": 4.0}"#,
        );
        assert_eq!(fields(&yarn), ["rope_scaling.type"]);
        // DeepSeek-V3 plans (its YaRN does not change costs) but would not run.
        assert_eq!(fields(DEEPSEEK_V3), ["rope_scaling.type"]);
        let bias =
            LLAMA3_8B_TF4.replace("\"vocab_size\"", "\"attention_bias\": true, \"vocab_size\"");
        // Llama's attention_bias and mlp_bias run: biases on q, k, v, o and the MLP.
        assert!(fields(&bias).is_empty());
        let t = transformer(&bias);
        assert!(t.qkv_bias && t.attn_out_bias && !t.mlp_bias && !t.bias);
        let t = transformer(&bias.replace("\"vocab_size\"", "\"mlp_bias\": true, \"vocab_size\""));
        assert!(t.mlp_bias);
        let gpt2 = GPT2
            .replace("\"gelu_new\"", "\"gelu\"")
            .replace(
                "\"n_inner\": null",
                "\"n_inner\": null, \"scale_attn_weights\": false, \"scale_attn_by_inverse_layer_idx\": true",
            );
        assert_eq!(
            fields(&gpt2),
            [
                "activation_function",
                "scale_attn_weights",
                "scale_attn_by_inverse_layer_idx"
            ]
        );
        for tanh in [
            "gelu_new",
            "gelu_pytorch_tanh",
            "gelu_fast",
            "gelu_accurate",
            "gelu_python_tanh",
        ] {
            assert!(fields(&GPT2.replace("gelu_new", tanh)).is_empty(), "{tanh}");
        }
    }

    #[test]
    fn sliding_windows() {
        let mistral = r#"{"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
            "sliding_window": 4096}"#;
        assert_eq!(transformer(mistral).sliding_window, Some(4096));
        assert_eq!(
            transformer(&mistral.replace("4096", "null")).sliding_window,
            None
        );
        let qwen2 = r#"{"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
            "sliding_window": 32768, "use_sliding_window": false}"#;
        assert_eq!(transformer(qwen2).sliding_window, None);
        assert_eq!(
            transformer(&qwen2.replace("false", "true")).sliding_window,
            Some(32768)
        );
        // Llama has no window, whatever the file says.
        assert_eq!(
            transformer(&mistral.replace("mistral", "llama")).sliding_window,
            None
        );
    }

    #[test]
    fn long_strings_are_truncated_in_messages() {
        let long = "x".repeat(1000);
        let (_, message) = invalid(&format!("{{\"model_type\": \"{long}\"}}"));
        assert!(message.len() < 200, "{message}");
    }
}
