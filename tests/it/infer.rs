//! Inference end to end on checkpoints the tests write in Hugging Face layout
//! (`config.json` + safetensors, random weights): greedy tokens of tensor-, pipeline-
//! and tensor+pipeline-parallel plans equal the single-rank tokens and those of an
//! independent naive f64 forward pass of the architecture (Llama / Qwen2 and GPT-2,
//! written here with plain loops and no shared kernels); logits agree within
//! tolerance. Then the `run` command: `--weights`, `--prompt` through a
//! `tokenizer.json`, `--check`, and the bad-input exits.

use crate::cli::meshplan;
use meshplan_cost_model::{load_cluster, prepare_model};
use meshplan_executor::infer::{
    byte_mismatches, check_inference, infer, InferOptions, InferReport,
};
use meshplan_executor::sample::Sampling;
use meshplan_executor::train::ExecError;
use meshplan_executor::weights::Checkpoint;
use meshplan_ir::plan::Plan;
use meshplan_ir::{load_model, model_graph, PartialConfig, WorkloadOverrides};
use meshplan_planner::output::plan_for_config;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// Logit agreement demanded, relative to the largest logit magnitude (at least 1):
/// fp32 kernels against an f64 loop, or against another sharding.
const TOL: f64 = 1e-4;

// === checkpoints in Hugging Face layout ===

/// A test-local generator, so the weights owe nothing to the executor's init.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }

    fn vec(&mut self, n: usize, scale: f64, offset: f64) -> Vec<f64> {
        (0..n).map(|_| offset + scale * self.next()).collect()
    }
}

/// bf16 with round-to-nearest-even, as torch stores it.
fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

#[derive(Clone, Copy, PartialEq)]
enum Store {
    F32,
    Bf16,
    F16,
}

/// Tensors by Hugging Face name: shape and the values the checkpoint holds (already
/// rounded to its dtype, so the reference sees exactly what the executor reads).
type Tensors = HashMap<String, (Vec<usize>, Vec<f64>)>;

fn round_to(store: Store, t: &mut Tensors) {
    for (_, v) in t.values_mut() {
        for x in v.iter_mut() {
            *x = match store {
                Store::F32 => *x as f32 as f64,
                Store::Bf16 => f32::from_bits((to_bf16(*x as f32) as u32) << 16) as f64,
                Store::F16 => half::f16::from_f32(*x as f32).to_f32() as f64,
            };
        }
    }
}

/// Writes `config.json` and the tensors over `files` safetensors files.
fn write_checkpoint(dir: &Path, config: &str, t: &Tensors, store: Store, files: usize) {
    std::fs::create_dir_all(dir).expect("checkpoint dir");
    std::fs::write(dir.join("config.json"), config).expect("config.json");
    let mut names: Vec<&String> = t.keys().collect();
    names.sort();
    let per = names.len().div_ceil(files);
    for (fi, chunk) in names.chunks(per).enumerate() {
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = chunk
            .iter()
            .map(|n| {
                let (shape, v) = &t[*n];
                let b: Vec<u8> = match store {
                    Store::F32 => v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
                    Store::Bf16 => v
                        .iter()
                        .flat_map(|&x| to_bf16(x as f32).to_le_bytes())
                        .collect(),
                    Store::F16 => v
                        .iter()
                        .flat_map(|&x| half::f16::from_f32(x as f32).to_le_bytes())
                        .collect(),
                };
                ((*n).clone(), shape.clone(), b)
            })
            .collect();
        let dtype = match store {
            Store::F32 => Dtype::F32,
            Store::Bf16 => Dtype::BF16,
            Store::F16 => Dtype::F16,
        };
        let views: Vec<(String, TensorView<'_>)> = bytes
            .iter()
            .map(|(n, s, b)| {
                (
                    n.clone(),
                    TensorView::new(dtype, s.clone(), b).expect("view"),
                )
            })
            .collect();
        let path = dir.join(format!("model-{:05}-of-{files:05}.safetensors", fi + 1));
        safetensors::serialize_to_file(views, None, &path).expect("write safetensors");
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("meshplan-infer-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Sizes of the Llama-family test model.
#[derive(Clone, Copy)]
struct LlamaCfg {
    layers: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    ffn: usize,
    vocab: usize,
    /// Qwen2: biases on q, k and v.
    qkv_bias: bool,
    tied: bool,
    /// Llama 3.1 rope scaling `(factor, low_freq_factor, high_freq_factor,
    /// original_max_position_embeddings)`.
    llama3: Option<(f64, f64, f64, f64)>,
    /// Llama's `attention_bias` and `mlp_bias`: biases on q, k, v, o, gate, up
    /// and down.
    attn_bias: bool,
}

const LLAMA: LlamaCfg = LlamaCfg {
    layers: 4,
    hidden: 32,
    heads: 4,
    kv_heads: 2,
    ffn: 48,
    vocab: 64,
    qkv_bias: false,
    tied: false,
    llama3: None,
    attn_bias: false,
};

const THETA: f64 = 10000.0;
const EPS: f64 = 1e-5;

fn llama_config(c: &LlamaCfg) -> String {
    format!(
        r#"{{"architectures": ["{arch}"], "model_type": "{mt}", "hidden_size": {h}, "intermediate_size": {f},
"num_hidden_layers": {l}, "num_attention_heads": {a}, "num_key_value_heads": {kv}, "vocab_size": {v},
"rms_norm_eps": {EPS:e}, "rope_theta": {THETA:.1}, "tie_word_embeddings": {tied}, "hidden_act": "silu",
"max_position_embeddings": 128, "torch_dtype": "float32"{scaling}{bias}}}"#,
        arch = if c.qkv_bias {
            "Qwen2ForCausalLM"
        } else {
            "LlamaForCausalLM"
        },
        mt = if c.qkv_bias { "qwen2" } else { "llama" },
        h = c.hidden,
        f = c.ffn,
        l = c.layers,
        a = c.heads,
        kv = c.kv_heads,
        v = c.vocab,
        tied = c.tied,
        scaling = match c.llama3 {
            Some((f, lo, hi, orig)) => format!(
                r#", "rope_scaling": {{"rope_type": "llama3", "factor": {f:.1}, "low_freq_factor": {lo:.1}, "high_freq_factor": {hi:.1}, "original_max_position_embeddings": {orig}}}"#
            ),
            None => String::new(),
        },
        bias = if c.attn_bias {
            r#", "attention_bias": true, "mlp_bias": true"#
        } else {
            ""
        },
    )
}

fn llama_tensors(c: &LlamaCfg, seed: u64) -> Tensors {
    let mut r = Rng(seed);
    let d = c.hidden / c.heads;
    let mut t = Tensors::new();
    let mut put = |name: String, shape: Vec<usize>, scale: f64, offset: f64, r: &mut Rng| {
        let n = shape.iter().product();
        t.insert(name, (shape, r.vec(n, scale, offset)));
    };
    put(
        "model.embed_tokens.weight".into(),
        vec![c.vocab, c.hidden],
        1.0,
        0.0,
        &mut r,
    );
    for i in 0..c.layers {
        let p = format!("model.layers.{i}.");
        let w = 0.6 / (c.hidden as f64).sqrt();
        put(
            format!("{p}input_layernorm.weight"),
            vec![c.hidden],
            0.2,
            1.0,
            &mut r,
        );
        put(
            format!("{p}self_attn.q_proj.weight"),
            vec![c.heads * d, c.hidden],
            w,
            0.0,
            &mut r,
        );
        put(
            format!("{p}self_attn.k_proj.weight"),
            vec![c.kv_heads * d, c.hidden],
            w,
            0.0,
            &mut r,
        );
        put(
            format!("{p}self_attn.v_proj.weight"),
            vec![c.kv_heads * d, c.hidden],
            w,
            0.0,
            &mut r,
        );
        if c.qkv_bias || c.attn_bias {
            put(
                format!("{p}self_attn.q_proj.bias"),
                vec![c.heads * d],
                0.1,
                0.0,
                &mut r,
            );
            put(
                format!("{p}self_attn.k_proj.bias"),
                vec![c.kv_heads * d],
                0.1,
                0.0,
                &mut r,
            );
            put(
                format!("{p}self_attn.v_proj.bias"),
                vec![c.kv_heads * d],
                0.1,
                0.0,
                &mut r,
            );
        }
        put(
            format!("{p}self_attn.o_proj.weight"),
            vec![c.hidden, c.heads * d],
            w,
            0.0,
            &mut r,
        );
        if c.attn_bias {
            put(
                format!("{p}self_attn.o_proj.bias"),
                vec![c.hidden],
                0.3,
                0.0,
                &mut r,
            );
        }
        put(
            format!("{p}post_attention_layernorm.weight"),
            vec![c.hidden],
            0.2,
            1.0,
            &mut r,
        );
        put(
            format!("{p}mlp.gate_proj.weight"),
            vec![c.ffn, c.hidden],
            w,
            0.0,
            &mut r,
        );
        put(
            format!("{p}mlp.up_proj.weight"),
            vec![c.ffn, c.hidden],
            w,
            0.0,
            &mut r,
        );
        let wd = 0.6 / (c.ffn as f64).sqrt();
        put(
            format!("{p}mlp.down_proj.weight"),
            vec![c.hidden, c.ffn],
            wd,
            0.0,
            &mut r,
        );
        if c.attn_bias {
            for (name, n) in [("gate", c.ffn), ("up", c.ffn), ("down", c.hidden)] {
                put(
                    format!("{p}mlp.{name}_proj.bias"),
                    vec![n],
                    0.2,
                    0.0,
                    &mut r,
                );
            }
        }
    }
    put("model.norm.weight".into(), vec![c.hidden], 0.2, 1.0, &mut r);
    if !c.tied {
        put(
            "lm_head.weight".into(),
            vec![c.vocab, c.hidden],
            0.5,
            0.0,
            &mut r,
        );
    }
    t
}

/// Sizes of the GPT-2 test model.
const GPT2: (usize, usize, usize, usize, usize) = (2, 32, 4, 64, 64); // layers, n_embd, n_head, vocab, n_positions

fn gpt2_config() -> String {
    let (l, h, a, v, np) = GPT2;
    format!(
        r#"{{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": {l}, "n_embd": {h}, "n_head": {a},
"vocab_size": {v}, "n_positions": {np}, "n_inner": null, "activation_function": "gelu_new",
"layer_norm_epsilon": {EPS:e}, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "torch_dtype": "float32"}}"#
    )
}

/// GPT-2 names as the original checkpoint stores them (no `transformer.` prefix).
fn gpt2_tensors(seed: u64) -> Tensors {
    let (l, h, _, v, np) = GPT2;
    let mut r = Rng(seed);
    let mut t = Tensors::new();
    let mut put = |name: String, shape: Vec<usize>, scale: f64, offset: f64, r: &mut Rng| {
        let n = shape.iter().product();
        t.insert(name, (shape, r.vec(n, scale, offset)));
    };
    put("wte.weight".into(), vec![v, h], 0.5, 0.0, &mut r);
    put("wpe.weight".into(), vec![np, h], 0.3, 0.0, &mut r);
    let w = 0.6 / (h as f64).sqrt();
    for i in 0..l {
        let p = format!("h.{i}.");
        put(format!("{p}ln_1.weight"), vec![h], 0.2, 1.0, &mut r);
        put(format!("{p}ln_1.bias"), vec![h], 0.1, 0.0, &mut r);
        put(
            format!("{p}attn.c_attn.weight"),
            vec![h, 3 * h],
            w,
            0.0,
            &mut r,
        );
        put(
            format!("{p}attn.c_attn.bias"),
            vec![3 * h],
            0.1,
            0.0,
            &mut r,
        );
        put(format!("{p}attn.c_proj.weight"), vec![h, h], w, 0.0, &mut r);
        put(format!("{p}attn.c_proj.bias"), vec![h], 0.1, 0.0, &mut r);
        put(format!("{p}ln_2.weight"), vec![h], 0.2, 1.0, &mut r);
        put(format!("{p}ln_2.bias"), vec![h], 0.1, 0.0, &mut r);
        put(
            format!("{p}mlp.c_fc.weight"),
            vec![h, 4 * h],
            w,
            0.0,
            &mut r,
        );
        put(format!("{p}mlp.c_fc.bias"), vec![4 * h], 0.1, 0.0, &mut r);
        put(
            format!("{p}mlp.c_proj.weight"),
            vec![4 * h, h],
            0.3 / (h as f64).sqrt(),
            0.0,
            &mut r,
        );
        put(format!("{p}mlp.c_proj.bias"), vec![h], 0.1, 0.0, &mut r);
    }
    put("ln_f.weight".into(), vec![h], 0.2, 1.0, &mut r);
    put("ln_f.bias".into(), vec![h], 0.1, 0.0, &mut r);
    t
}

// === naive reference forward passes (f64, plain loops) ===

fn get<'a>(t: &'a Tensors, name: &str) -> &'a [f64] {
    &t.get(name)
        .unwrap_or_else(|| panic!("reference lacks {name}"))
        .1
}

/// `nn.Linear`: `w [out, in]`.
fn linear(x: &[f64], w: &[f64], b: Option<&[f64]>, out: usize) -> Vec<f64> {
    let inp = x.len();
    (0..out)
        .map(|o| {
            let s: f64 = (0..inp).map(|i| w[o * inp + i] * x[i]).sum();
            s + b.map_or(0.0, |b| b[o])
        })
        .collect()
}

/// GPT-2 `Conv1D`: `w [in, out]`.
fn conv1d(x: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
    let out = b.len();
    (0..out)
        .map(|o| (0..x.len()).map(|i| x[i] * w[i * out + o]).sum::<f64>() + b[o])
        .collect()
}

fn rmsnorm(x: &[f64], w: &[f64]) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + EPS).sqrt();
    x.iter().zip(w).map(|(v, g)| v * r * g).collect()
}

fn layernorm(x: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    let r = 1.0 / (var + EPS).sqrt();
    (0..x.len())
        .map(|i| (x[i] - mean) * r * w[i] + b[i])
        .collect()
}

/// Hugging Face `rotate_half` RoPE on one head at position `pos`, with
/// transformers' `_compute_llama3_parameters` written out when `llama3` is given.
fn rope(x: &mut [f64], pos: usize, llama3: Option<(f64, f64, f64, f64)>) {
    let d = x.len();
    let half = d / 2;
    for i in 0..half {
        let mut freq = THETA.powf(-2.0 * i as f64 / d as f64);
        if let Some((factor, low, high, orig)) = llama3 {
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen > orig / low {
                freq /= factor;
            } else if wavelen >= orig / high {
                let smooth = (orig / wavelen - low) / (high - low);
                freq = (1.0 - smooth) * freq / factor + smooth * freq;
            }
        }
        let ang = pos as f64 * freq;
        let (c, s) = (ang.cos(), ang.sin());
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

/// Causal attention of every position: `q [t][heads*d]`, `k`, `v` `[t][kv_heads*d]`.
fn attend(
    q: &[Vec<f64>],
    k: &[Vec<f64>],
    v: &[Vec<f64>],
    heads: usize,
    kv_heads: usize,
    d: usize,
) -> Vec<Vec<f64>> {
    let group = heads / kv_heads;
    (0..q.len())
        .map(|t| {
            let mut out = vec![0.0; heads * d];
            for h in 0..heads {
                let g = h / group;
                let scores: Vec<f64> = (0..=t)
                    .map(|j| {
                        (0..d)
                            .map(|e| q[t][h * d + e] * k[j][g * d + e])
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for (j, s) in scores.iter().enumerate() {
                    let p = (s - m).exp() / z;
                    for e in 0..d {
                        out[h * d + e] += p * v[j][g * d + e];
                    }
                }
            }
            out
        })
        .collect()
}

/// Logits of the last position of `tokens`.
fn llama_forward(c: &LlamaCfg, t: &Tensors, tokens: &[u32]) -> Vec<f64> {
    let d = c.hidden / c.heads;
    let emb = get(t, "model.embed_tokens.weight");
    let mut x: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&id| emb[id as usize * c.hidden..(id as usize + 1) * c.hidden].to_vec())
        .collect();
    for i in 0..c.layers {
        let p = format!("model.layers.{i}.");
        let w = |n: &str| get(t, &format!("{p}{n}"));
        let b = |n: &str| (c.qkv_bias || c.attn_bias).then(|| get(t, &format!("{p}{n}")));
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, xt) in x.iter().enumerate() {
            let h = rmsnorm(xt, w("input_layernorm.weight"));
            let mut qt = linear(
                &h,
                w("self_attn.q_proj.weight"),
                b("self_attn.q_proj.bias"),
                c.heads * d,
            );
            let mut kt = linear(
                &h,
                w("self_attn.k_proj.weight"),
                b("self_attn.k_proj.bias"),
                c.kv_heads * d,
            );
            for head in qt.chunks_mut(d) {
                rope(head, pos, c.llama3);
            }
            for head in kt.chunks_mut(d) {
                rope(head, pos, c.llama3);
            }
            q.push(qt);
            k.push(kt);
            v.push(linear(
                &h,
                w("self_attn.v_proj.weight"),
                b("self_attn.v_proj.bias"),
                c.kv_heads * d,
            ));
        }
        let o = attend(&q, &k, &v, c.heads, c.kv_heads, d);
        for (xt, ot) in x.iter_mut().zip(&o) {
            let a = linear(
                ot,
                w("self_attn.o_proj.weight"),
                c.attn_bias.then(|| w("self_attn.o_proj.bias")),
                c.hidden,
            );
            xt.iter_mut().zip(&a).for_each(|(u, y)| *u += y);
            let h = rmsnorm(xt, w("post_attention_layernorm.weight"));
            let mb = |n: &str| c.attn_bias.then(|| w(n));
            let g = linear(
                &h,
                w("mlp.gate_proj.weight"),
                mb("mlp.gate_proj.bias"),
                c.ffn,
            );
            let u = linear(&h, w("mlp.up_proj.weight"), mb("mlp.up_proj.bias"), c.ffn);
            let m: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let dn = linear(
                &m,
                w("mlp.down_proj.weight"),
                mb("mlp.down_proj.bias"),
                c.hidden,
            );
            xt.iter_mut().zip(&dn).for_each(|(u, y)| *u += y);
        }
    }
    let last = rmsnorm(x.last().expect("a token"), get(t, "model.norm.weight"));
    let head = if c.tied {
        emb
    } else {
        get(t, "lm_head.weight")
    };
    linear(&last, head, None, c.vocab)
}

fn gelu_new(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

fn gpt2_forward(t: &Tensors, tokens: &[u32]) -> Vec<f64> {
    let (layers, h, heads, vocab, _) = GPT2;
    let d = h / heads;
    let (wte, wpe) = (get(t, "wte.weight"), get(t, "wpe.weight"));
    let mut x: Vec<Vec<f64>> = tokens
        .iter()
        .enumerate()
        .map(|(pos, &id)| {
            (0..h)
                .map(|e| wte[id as usize * h + e] + wpe[pos * h + e])
                .collect()
        })
        .collect();
    for i in 0..layers {
        let w = |n: &str| get(t, &format!("h.{i}.{n}"));
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for xt in &x {
            let n = layernorm(xt, w("ln_1.weight"), w("ln_1.bias"));
            let qkv = conv1d(&n, w("attn.c_attn.weight"), w("attn.c_attn.bias"));
            q.push(qkv[..h].to_vec());
            k.push(qkv[h..2 * h].to_vec());
            v.push(qkv[2 * h..].to_vec());
        }
        let o = attend(&q, &k, &v, heads, heads, d);
        for (xt, ot) in x.iter_mut().zip(&o) {
            let a = conv1d(ot, w("attn.c_proj.weight"), w("attn.c_proj.bias"));
            xt.iter_mut().zip(&a).for_each(|(u, y)| *u += y);
            let n = layernorm(xt, w("ln_2.weight"), w("ln_2.bias"));
            let f: Vec<f64> = conv1d(&n, w("mlp.c_fc.weight"), w("mlp.c_fc.bias"))
                .into_iter()
                .map(gelu_new)
                .collect();
            let m = conv1d(&f, w("mlp.c_proj.weight"), w("mlp.c_proj.bias"));
            xt.iter_mut().zip(&m).for_each(|(u, y)| *u += y);
        }
    }
    let last = layernorm(
        x.last().expect("a token"),
        get(t, "ln_f.weight"),
        get(t, "ln_f.bias"),
    );
    linear(&last, wte, None, vocab)
}

/// Greedy generation with full recomputation: the tokens and the logits the last
/// one was chosen from.
fn reference_generate(
    forward: &dyn Fn(&[u32]) -> Vec<f64>,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, Vec<f64>) {
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    let mut logits = Vec::new();
    for _ in 0..n {
        logits = forward(&seq);
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        out.push(best as u32);
        seq.push(best as u32);
    }
    (out, logits)
}

// === plans and runs ===

const WORKLOAD: &str = "kind: inference\nprompt_len: 6\noutput_len: 5\nconcurrency: 2\n";

/// A Llama checkpoint of [`LLAMA`]'s sizes drawn from `seed`, stored in fp32, in a
/// fresh folder `name`, opened.
fn llama_checkpoint(name: &str, seed: u64) -> (PathBuf, Arc<Checkpoint>) {
    let dir = temp_dir(name);
    let t = llama_tensors(&LLAMA, seed);
    write_checkpoint(&dir, &llama_config(&LLAMA), &t, Store::F32, 1);
    let ck = Arc::new(Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{e}")));
    (dir, ck)
}

/// A plan of `cfg` for the checkpoint's config.json on a CPU mesh of exactly the
/// ranks the configuration names.
fn plan_of(dir: &Path, cfg: &str, gpus: u64) -> Plan {
    let workload = dir.join("workload.yaml");
    std::fs::write(&workload, WORKLOAD).expect("workload");
    plan_with(
        dir,
        WorkloadOverrides {
            workload_file: Some(workload),
            ..WorkloadOverrides::default()
        },
        cfg,
        gpus,
    )
}

/// A plan of `cfg` for the checkpoint's model under the workload `overrides` give.
fn plan_with(dir: &Path, overrides: WorkloadOverrides, cfg: &str, gpus: u64) -> Plan {
    let spec = load_model(&dir.join("config.json"), &overrides).unwrap_or_else(|e| panic!("{e}"));
    let graph = model_graph(&spec).unwrap_or_else(|e| panic!("{e}"));
    let pg = prepare_model(&spec).unwrap_or_else(|e| panic!("{e}"));
    let mut cluster = load_cluster(
        Path::new(&format!("{ROOT}/topologies/cpu-test-mesh.yaml")),
        Some(1),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    cluster.gpus_per_node = gpus;
    let cfg = PartialConfig::parse(cfg, "test")
        .and_then(|p| p.resolve(gpus, "test"))
        .unwrap_or_else(|e| panic!("{e}"));
    let workload = spec.workload.clone().expect("a workload");
    plan_for_config(&spec.name, &graph, &pg, &cluster, &workload, &cfg)
        .unwrap_or_else(|e| panic!("{e}"))
}

const PROMPTS: [&[u32]; 3] = [&[1, 15, 42, 7, 3, 9], &[60, 2], &[5, 6, 7, 8]];

fn run(plan: &Plan, ck: &Arc<Checkpoint>, sampling: Sampling, requests: usize) -> InferReport {
    infer(
        plan,
        &InferOptions {
            requests: PROMPTS[..requests].iter().map(|p| p.to_vec()).collect(),
            max_new_tokens: 5,
            sampling,
            weights: Some(ck.clone()),
            ..InferOptions::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn max_diff(a: &[f32], b: &[f64]) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - y).abs())
        .fold(0.0, f64::max);
    let scale = b.iter().fold(1.0f64, |m, y| m.max(y.abs()));
    (d, scale)
}

/// Every configuration's greedy tokens equal the single-rank run's and the naive
/// reference's; logits agree with both.
fn check_all(tag: &str, dir: &Path, forward: &dyn Fn(&[u32]) -> Vec<f64>) {
    let ck = Arc::new(Checkpoint::open(dir).unwrap_or_else(|e| panic!("{e}")));
    let single = run(&plan_of(dir, "dp=1", 1), &ck, Sampling::GREEDY, 3);
    crate::exec_golden::check_infer(&format!("infer-{tag}-dp=1"), &single);
    let mut worst: f64 = 0.0;
    for (i, req) in single.requests.iter().enumerate() {
        let (tokens, logits) = reference_generate(forward, PROMPTS[i], 5);
        assert_eq!(
            req.tokens, tokens,
            "request {i}: single rank vs naive reference"
        );
        let (d, scale) = max_diff(&req.logits, &logits);
        assert!(
            d <= TOL * scale,
            "request {i}: logits differ from the reference by {d:e}"
        );
        worst = worst.max(d);
    }
    eprintln!(
        "{}: single rank vs naive f64 reference, largest logit difference {worst:.3e}",
        dir.display()
    );
    // The cache is split by KV heads over tp and by layers over pp: the fullest rank
    // holds exactly that share of the single rank's (dp=2 splits the requests instead).
    for (cfg, gpus, share) in [
        ("tp=2", 2, Some(2.0)),
        ("pp=2", 2, Some(2.0)),
        ("tp=2,pp=2", 4, Some(4.0)),
        ("tp=2,pp=2,dp=2", 8, None),
    ] {
        let r = run(&plan_of(dir, cfg, gpus), &ck, Sampling::GREEDY, 3);
        crate::exec_golden::check_infer(&format!("infer-{tag}-{cfg}"), &r);
        if let Some(share) = share {
            assert_eq!(
                r.kv_cache_bytes * share,
                single.kv_cache_bytes,
                "{cfg}: KV cache"
            );
            // Weights too, but for what stays replicated (norms, biases, GPT-2 positions).
            assert!(
                r.weight_bytes < 1.5 * single.weight_bytes / share,
                "{cfg}: {} of {} weight bytes",
                r.weight_bytes,
                single.weight_bytes
            );
        }
        let (line, diff) = check_inference(&r, &single).unwrap_or_else(|e| panic!("{cfg}: {e}"));
        eprintln!("{cfg}: {line}");
        assert!(diff <= TOL, "{cfg}: {diff}");
        for (i, req) in r.requests.iter().enumerate() {
            let (_, logits) = reference_generate(forward, PROMPTS[i], 5);
            let (d, scale) = max_diff(&req.logits, &logits);
            assert!(
                d <= TOL * scale,
                "{cfg} request {i}: logits differ from the reference by {d:e}"
            );
        }
    }
}

/// Writes a Llama-family checkpoint of `c` (tensors from `seed`, stored as `store`,
/// over `files` files) and runs [`check_all`] on it against the f64 reference: the
/// tensors, for more checks.
fn check_llama(c: &LlamaCfg, tag: &str, seed: u64, store: Store, files: usize) -> Tensors {
    let dir = temp_dir(tag);
    let mut t = llama_tensors(c, seed);
    round_to(store, &mut t);
    write_checkpoint(&dir, &llama_config(c), &t, store, files);
    check_all(tag, &dir, &|tokens| llama_forward(c, &t, tokens));
    t
}

#[test]
fn llama_checkpoint_sharded_equals_single_rank_and_reference() {
    // Two files: the loader indexes tensors across shards.
    check_llama(&LLAMA, "llama", 11, Store::F32, 2);
}

#[test]
fn llama3_rope_scaling_checkpoint_equals_single_rank_and_reference() {
    // Head width 8 over base 10000: wavelengths 6.3, 63, 628 and 6283. With 64
    // original positions and frequency factors 1 and 4 the first is kept, the second
    // blended and the last two divided by 8: every branch of the scaling runs.
    let c = LlamaCfg {
        llama3: Some((8.0, 1.0, 4.0, 64.0)),
        ..LLAMA
    };
    let t = check_llama(&c, "llama3-rope", 21, Store::F32, 1);
    // The scaling changes the outputs: the unscaled reference does not match.
    let scaled = llama_forward(&c, &t, PROMPTS[0]);
    let plain = llama_forward(&LLAMA, &t, PROMPTS[0]);
    let d = scaled
        .iter()
        .zip(&plain)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(d > 1e-3, "scaling moved the logits by only {d:e}");
}

#[test]
fn llama_attention_and_mlp_bias_checkpoint_equals_single_rank_and_reference() {
    // Biases on q, k, v, o, gate, up and down: the row-parallel projections' (o and
    // down) are added once after the reduction, whatever tp.
    let c = LlamaCfg {
        attn_bias: true,
        ..LLAMA
    };
    check_llama(&c, "llama-attention-bias", 28, Store::F32, 1);
}

#[test]
fn qwen2_bf16_tied_checkpoint_sharded_equals_single_rank_and_reference() {
    let c = LlamaCfg {
        qkv_bias: true,
        tied: true,
        ..LLAMA
    };
    check_llama(&c, "qwen2", 12, Store::Bf16, 1);
}

/// `LLAMA`'s tensors as a Mixtral checkpoint of 4 experts, 2 a token, every expert
/// a copy of the layer's MLP (`w1` its gate, `w3` its up, `w2` its down
/// projection) under a router of its own: whatever the router picks, the chosen
/// weights sum to one, so the model is the Llama model. Gate and up read swapped,
/// or an expert's tensor transposed wrongly, would not be.
fn mixtral_of_copies(t: &Tensors, dir: &Path, seed: u64) {
    let mut m = Tensors::new();
    for (name, v) in t {
        let Some((pre, proj)) = name.split_once(".mlp.") else {
            m.insert(name.clone(), v.clone());
            continue;
        };
        let w = match proj {
            "gate_proj.weight" => "w1",
            "up_proj.weight" => "w3",
            "down_proj.weight" => "w2",
            other => panic!("{other}"),
        };
        for e in 0..4 {
            m.insert(
                format!("{pre}.block_sparse_moe.experts.{e}.{w}.weight"),
                v.clone(),
            );
        }
    }
    let mut r = Rng(seed);
    for l in 0..LLAMA.layers {
        let router = (vec![4, LLAMA.hidden], r.vec(4 * LLAMA.hidden, 1.0, 0.0));
        m.insert(
            format!("model.layers.{l}.block_sparse_moe.gate.weight"),
            router,
        );
    }
    let config = llama_config(&LLAMA)
        .replace("LlamaForCausalLM", "MixtralForCausalLM")
        .replace(r#""model_type": "llama""#, r#""model_type": "mixtral""#)
        .replacen(
            '{',
            r#"{"num_local_experts": 4, "num_experts_per_tok": 2, "#,
            1,
        );
    write_checkpoint(dir, &config, &m, Store::F32, 1);
}

/// Mixtral's routed experts read from a checkpoint: on one rank, split over tp, over
/// ep and over both, generation equals the naive f64 forward of the Llama model the
/// checkpoint computes (see [`mixtral_of_copies`]), and fine-tuning from it on
/// expert-parallel ranks starts from that model's loss.
#[test]
fn mixtral_checkpoint_equals_the_model_it_computes_on_every_expert_split() {
    use meshplan_executor::train::{train, TrainOptions};
    let dir = temp_dir("mixtral");
    let t = llama_tensors(&LLAMA, 31);
    mixtral_of_copies(&t, &dir, 5);
    let ck = Arc::new(Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{e}")));
    for (cfg, gpus) in [
        ("dp=1,dp_attention=false", 1),
        ("tp=2,ep=1,dp_attention=false", 2),
        ("dp=2,ep=2,dp_attention=false", 2),
        ("tp=2,ep=2,dp_attention=false", 2),
    ] {
        let r = run(&plan_of(&dir, cfg, gpus), &ck, Sampling::GREEDY, 3);
        for (i, req) in r.requests.iter().enumerate() {
            let (tokens, logits) =
                reference_generate(&|x| llama_forward(&LLAMA, &t, x), PROMPTS[i], 5);
            assert_eq!(req.tokens, tokens, "{cfg}: request {i}");
            let (d, scale) = max_diff(&req.logits, &logits);
            assert!(
                d <= TOL * scale,
                "{cfg}: request {i}: logits differ by {d:e}"
            );
        }
    }
    // Fine-tuning: the first step's loss is the dense checkpoint's, on the same data.
    let dense = temp_dir("mixtral-dense");
    write_checkpoint(&dense, &llama_config(&LLAMA), &t, Store::F32, 1);
    let first_loss = |dir: &Path, cfg: &str| {
        let opts = TrainOptions {
            steps: 1,
            weights: Some(Arc::new(
                Checkpoint::open(dir).unwrap_or_else(|e| panic!("{e}")),
            )),
            ..TrainOptions::default()
        };
        train(&train_plan_of(dir, cfg, 2), &opts)
            .unwrap_or_else(|e| panic!("{cfg}: {e}"))
            .losses[0]
    };
    let want = first_loss(&dense, "dp=2");
    for cfg in ["dp=2,ep=2", "tp=2,ep=1,sp=true"] {
        let got = first_loss(&dir, cfg);
        assert!(
            (got - want).abs() <= 1e-5 * want,
            "{cfg}: loss {got}, the dense model's {want}"
        );
    }
}

#[test]
fn gpt2_checkpoint_sharded_equals_single_rank_and_reference() {
    let dir = temp_dir("gpt2");
    let t = gpt2_tensors(13);
    write_checkpoint(&dir, &gpt2_config(), &t, Store::F32, 1);
    check_all("gpt2", &dir, &|tokens| gpt2_forward(&t, tokens));
}

/// GPT-2 with its vocabulary padded for tensor parallelism
/// (`--make-vocab-size-divisible-by 48`: the test model's 64 tokens in 96 rows, 48
/// a tensor rank): the checkpoint's 64 rows fill the padded table, and every plan,
/// vocabulary-parallel ones included, generates the unpadded single rank's tokens
/// with its logits, the 64 a token has (the padded columns left out).
#[test]
fn a_padded_gpt2_generates_the_unpadded_models_tokens_on_every_split() {
    let dir = temp_dir("gpt2-padded");
    let t = gpt2_tensors(13);
    write_checkpoint(&dir, &gpt2_config(), &t, Store::F32, 1);
    let ck = Arc::new(Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{e}")));
    let single = run(&plan_of(&dir, "dp=1", 1), &ck, Sampling::GREEDY, 3);
    let workload = dir.join("workload.yaml");
    for (cfg, gpus) in [("dp=1", 1), ("tp=2", 2), ("tp=2,pp=2", 4)] {
        let padded = WorkloadOverrides {
            workload_file: Some(workload.clone()),
            make_vocab_size_divisible_by: Some(48),
            ..WorkloadOverrides::default()
        };
        let p = plan_with(&dir, padded, cfg, gpus);
        assert_eq!(p.graph.vocab_rows(), Some(96), "{cfg}");
        let r = run(&p, &ck, Sampling::GREEDY, 3);
        for q in &r.requests {
            assert_eq!((q.logits.len(), q.first_logits.len()), (64, 64), "{cfg}");
        }
        let (line, diff) = check_inference(&r, &single).unwrap_or_else(|e| panic!("{cfg}: {e}"));
        eprintln!("{cfg}: {line}");
        assert!(diff <= TOL, "{cfg}: {diff}");
    }
}

/// The test GPT-2 (seed 13) as an f32 checkpoint in `tag`'s folder, opened, and a
/// one-rank plan of it.
fn gpt2_on_one_rank(tag: &str) -> (Tensors, Arc<Checkpoint>, Plan) {
    let dir = temp_dir(tag);
    let t = gpt2_tensors(13);
    write_checkpoint(&dir, &gpt2_config(), &t, Store::F32, 1);
    let ck = Arc::new(Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{e}")));
    let plan = plan_of(&dir, "dp=1", 1);
    (t, ck, plan)
}

/// A tied table is read by two ops, the token embedding and the head, as the same
/// slice on one rank: it is held once (GPT-2 used to hold its 50257 x 768 table
/// twice), so the weights a rank holds are the model's parameters, each once.
#[test]
fn a_tied_table_read_by_two_ops_is_held_once() {
    let (_, ck, plan) = gpt2_on_one_rank("gpt2-tied-once");
    // 2 x (64 x 32) tables, 2 blocks of 12704 (norms, biased qkv, projections,
    // MLP), the final norm: 29568, hand-counted, and the planner's count.
    let params = 2 * 64 * 32 + 2 * 12704 + 64;
    assert_eq!(plan.model.params, params as f64);
    let r = run(&plan, &ck, Sampling::GREEDY, 1);
    assert_eq!(r.weight_bytes, 4.0 * params as f64);
    let tied = plan
        .graph
        .tensors
        .iter()
        .find(|x| x.name == "embed.tokens.w")
        .expect("table");
    let readers = plan
        .graph
        .ops()
        .filter(|o| {
            o.inputs
                .iter()
                .any(|&i| plan.graph.tensor(i).name == tied.name)
        })
        .count();
    assert_eq!(readers, 2, "the embedding and the head read the table");
}

/// Every token but the last new one takes a position (the last is sampled, never
/// fed back): a prompt of 60 on GPT-2's 64 positions may ask for 5 new tokens, the
/// last fed at position 63, and its logits are the reference's there; 6 are refused,
/// naming what fits.
#[test]
fn gpt2_generates_up_to_its_last_learned_position_and_no_further() {
    let (t, ck, plan) = gpt2_on_one_rank("gpt2-positions");
    let prompt: Vec<u32> = (0..60).map(|i| (i * 7 % 64) as u32).collect();
    let ask = |n: usize| {
        infer(
            &plan,
            &InferOptions {
                requests: vec![prompt.clone()],
                max_new_tokens: n,
                weights: Some(ck.clone()),
                ..InferOptions::default()
            },
        )
    };
    let r = ask(5).unwrap_or_else(|e| panic!("{e}"));
    let (tokens, logits) = reference_generate(&|x| gpt2_forward(&t, x), &prompt, 5);
    assert_eq!(r.requests[0].tokens, tokens);
    let (d, scale) = max_diff(&r.requests[0].logits, &logits);
    assert!(
        d <= TOL * scale,
        "logits differ from the reference by {d:e}"
    );
    let e = ask(6)
        .expect_err("65 positions on a table of 64")
        .to_string();
    for want in [
        "65 positions",
        "64 learned positions",
        "at most 5 new tokens",
    ] {
        assert!(e.contains(want), "`{want}` not in: {e}");
    }
}

#[test]
fn gpt2_f16_checkpoint_saved_by_the_lm_head_model() {
    // `GPT2LMHeadModel.save_pretrained` names tensors `transformer.*` and leaves the
    // tied head out; stored in f16.
    let dir = temp_dir("gpt2-f16");
    let mut t = gpt2_tensors(19);
    round_to(Store::F16, &mut t);
    let prefixed: Tensors = t
        .iter()
        .map(|(k, v)| (format!("transformer.{k}"), v.clone()))
        .collect();
    write_checkpoint(&dir, &gpt2_config(), &prefixed, Store::F16, 1);
    let ck = Arc::new(Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{e}")));
    let r = run(&plan_of(&dir, "tp=2,pp=2", 4), &ck, Sampling::GREEDY, 3);
    for (i, req) in r.requests.iter().enumerate() {
        let (tokens, logits) = reference_generate(&|s| gpt2_forward(&t, s), PROMPTS[i], 5);
        assert_eq!(req.tokens, tokens, "request {i}");
        let (d, scale) = max_diff(&req.logits, &logits);
        assert!(d <= TOL * scale, "request {i}: {d:e}");
    }
}

/// A generation tells its progress once per token, in order, from one rank
/// whatever the split: 1 once the prompts are prefilled, then after each decode
/// step (what `run`'s progress bar shows).
#[test]
fn a_generation_tells_its_progress_once_per_token() {
    use meshplan_executor::train::StepHook;
    use std::sync::Mutex;
    let (dir, ck) = llama_checkpoint("progress", 12);
    for (cfg, gpus) in [("dp=1", 1), ("tp=2,pp=2,dp=2", 8)] {
        let told = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&told);
        let opts = InferOptions {
            requests: PROMPTS.iter().map(|p| p.to_vec()).collect(),
            max_new_tokens: 5,
            weights: Some(Arc::clone(&ck)),
            on_token: Some(StepHook(Arc::new(move |n| sink.lock().unwrap().push(n)))),
            ..InferOptions::default()
        };
        infer(&plan_of(&dir, cfg, gpus), &opts).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(*told.lock().unwrap(), [1, 2, 3, 4, 5], "{cfg}");
    }
}

#[test]
fn sampling_is_seeded_and_equal_across_shardings() {
    let dir = temp_dir("sampling");
    let mut t = llama_tensors(&LLAMA, 14);
    round_to(Store::F32, &mut t);
    write_checkpoint(&dir, &llama_config(&LLAMA), &t, Store::F32, 1);
    let ck = Arc::new(Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{e}")));
    let s = Sampling {
        temperature: 1.5,
        top_p: 0.95,
        seed: 1,
    };
    let single = run(&plan_of(&dir, "dp=1", 1), &ck, s, 3);
    let sharded = run(&plan_of(&dir, "tp=2,pp=2", 4), &ck, s, 3);
    check_inference(&sharded, &single).unwrap_or_else(|e| panic!("{e}"));
    let other = run(&plan_of(&dir, "dp=1", 1), &ck, Sampling { seed: 2, ..s }, 3);
    let tokens = |r: &InferReport| {
        r.requests
            .iter()
            .map(|q| q.tokens.clone())
            .collect::<Vec<_>>()
    };
    assert_ne!(
        tokens(&single),
        tokens(&other),
        "another seed draws other tokens"
    );
    let greedy = run(&plan_of(&dir, "dp=1", 1), &ck, Sampling::GREEDY, 3);
    assert_ne!(
        tokens(&single),
        tokens(&greedy),
        "sampling at temperature 1.5 is not greedy"
    );
}

#[test]
fn check_fails_on_different_tokens_or_logits() {
    let dir = temp_dir("check");
    let mut t = llama_tensors(&LLAMA, 15);
    round_to(Store::F32, &mut t);
    write_checkpoint(&dir, &llama_config(&LLAMA), &t, Store::F32, 1);
    let ck = Arc::new(Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{e}")));
    let base = run(&plan_of(&dir, "dp=1", 1), &ck, Sampling::GREEDY, 1);
    let mut r = base.clone();
    r.requests[0].tokens[2] ^= 1;
    assert!(check_inference(&r, &base).unwrap_err().contains("tokens"));
    let mut r = base.clone();
    r.requests[0].logits[3] += 0.01;
    assert!(check_inference(&r, &base)
        .unwrap_err()
        .contains("last logits differ"));
    // A NaN is no difference under `>`: the same tokens with a NaN logit still fail.
    let mut r = base.clone();
    r.requests[0].first_logits[1] = f32::NAN;
    let e = check_inference(&r, &base).unwrap_err();
    assert!(
        e.contains("request 0: first logits differ by up to NaN"),
        "{e}"
    );
}

#[test]
fn checkpoint_errors_name_the_tensor_or_field() {
    let dir = temp_dir("bad-shape");
    let mut t = llama_tensors(&LLAMA, 16);
    let k = t
        .get_mut("model.layers.1.self_attn.k_proj.weight")
        .expect("k_proj");
    k.0 = vec![LLAMA.hidden, LLAMA.hidden];
    k.1 = vec![0.0; LLAMA.hidden * LLAMA.hidden];
    write_checkpoint(&dir, &llama_config(&LLAMA), &t, Store::F32, 1);
    let plan = plan_of(&dir, "dp=1", 1);
    let ck = Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{e}"));
    let e = ck.validate(&plan.graph).unwrap_err().to_string();
    assert!(
        e.contains("model.layers.1.self_attn.k_proj.weight") && e.contains("[16, 32]"),
        "{e}"
    );
    let mut t = llama_tensors(&LLAMA, 16);
    t.remove("model.norm.weight");
    let dir2 = temp_dir("missing");
    write_checkpoint(&dir2, &llama_config(&LLAMA), &t, Store::F32, 1);
    let e = Checkpoint::open(&dir2)
        .unwrap()
        .validate(&plan.graph)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.norm.weight") && e.contains("missing"),
        "{e}"
    );
    // A config.json of another size names the field.
    let other = LlamaCfg {
        hidden: 64,
        ..LLAMA
    };
    let dir3 = temp_dir("other-config");
    write_checkpoint(
        &dir3,
        &llama_config(&other),
        &llama_tensors(&other, 1),
        Store::F32,
        1,
    );
    let e = Checkpoint::open(&dir3)
        .unwrap()
        .check_config(&plan.graph)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`hidden_size`") && e.contains("64"), "{e}");
    // Same sizes, another computation: biases the plan's model lacks were left
    // unread (the tokens of a Qwen2 checkpoint under a Llama plan came out as if its
    // biases were zero), and a plan's bias the checkpoint lacks is refused as well.
    for (name, c, has) in [
        (
            "qwen2",
            LlamaCfg {
                qkv_bias: true,
                ..LLAMA
            },
            "the checkpoint's model has weight `block.attn.qkv.b`",
        ),
        (
            "llama-bias",
            LlamaCfg {
                attn_bias: true,
                ..LLAMA
            },
            "the checkpoint's model has weight `block.attn.proj.b`",
        ),
    ] {
        let d = temp_dir(name);
        write_checkpoint(&d, &llama_config(&c), &llama_tensors(&c, 1), Store::F32, 1);
        let e = Checkpoint::open(&d)
            .unwrap()
            .check_config(&plan.graph)
            .unwrap_err()
            .to_string();
        assert!(e.contains(has) && e.contains("config.json"), "{name}: {e}");
        let biased = plan_of(&d, "dp=1", 1);
        let e = Checkpoint::open(&dir)
            .unwrap()
            .check_config(&biased.graph)
            .unwrap_err()
            .to_string();
        let first = has.replace("the checkpoint's", "the plan's");
        assert!(e.contains(&first), "{name}: {e}");
    }
}

#[test]
fn the_plans_workload_sends_the_plans_bytes() {
    // Sampling is planned: the head's logit gather is in the programs and the cost
    // model, so the run sends what the plan says on every rank and axis.
    let spec = load_model(
        Path::new(&format!("{ROOT}/models/tiny-llama-inference.yaml")),
        &WorkloadOverrides::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let graph = model_graph(&spec).unwrap_or_else(|e| panic!("{e}"));
    let pg = prepare_model(&spec).unwrap_or_else(|e| panic!("{e}"));
    let workload = spec.workload.clone().expect("a workload");
    let meshplan_ir::Workload::Inference {
        prompt_len,
        output_len,
        concurrency,
        ..
    } = workload
    else {
        panic!("an inference workload")
    };
    for (cfg, gpus) in [("tp=2,pp=2", 4), ("tp=2,pp=2,dp=2", 8), ("tp=4", 4)] {
        let mut cluster = load_cluster(
            Path::new(&format!("{ROOT}/topologies/cpu-test-mesh.yaml")),
            Some(1),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        cluster.gpus_per_node = gpus;
        let c = PartialConfig::parse(cfg, "test")
            .and_then(|p| p.resolve(gpus, "test"))
            .unwrap_or_else(|e| panic!("{e}"));
        let plan = plan_for_config(&spec.name, &graph, &pg, &cluster, &workload, &c)
            .unwrap_or_else(|e| panic!("{e}"));
        let gathers = plan.programs.last().expect("a program").phases[1]
            .chunks
            .iter()
            .flat_map(|ch| &ch.forward)
            .flat_map(|i| match i {
                meshplan_ir::plan::Instr::Segment { body, .. } => body.clone(),
                other => vec![other.clone()],
            })
            .filter(|i| matches!(i, meshplan_ir::plan::Instr::Collective { kind: meshplan_ir::plan::CollectiveKind::AllGather, target: meshplan_ir::plan::Target::Activation { tensor }, .. } if tensor == "head.lm.out"))
            .count();
        assert_eq!(gathers, 1, "{cfg}: the decode head gathers the logits once");
        let opts = InferOptions {
            requests: (0..concurrency)
                .map(|i| {
                    (0..prompt_len)
                        .map(|t| ((i * 31 + t * 7) % 256) as u32)
                        .collect()
                })
                .collect(),
            max_new_tokens: output_len as usize,
            ..InferOptions::default()
        };
        let r = infer(&plan, &opts).unwrap_or_else(|e| panic!("{e}"));
        let bytes = byte_mismatches(&plan, &opts, &r).expect("the plan's shapes");
        assert!(bytes.is_empty(), "{cfg}:\n{}", bytes.join("\n"));
        assert!(r.counts.iter().any(|c| c.axis_bytes_sent("tp") > 0.0));
        // Other prompt lengths are not the plan's shapes: not compared.
        let other = InferOptions {
            requests: vec![vec![1, 2, 3]],
            ..opts
        };
        let r = infer(&plan, &other).unwrap_or_else(|e| panic!("{e}"));
        assert!(byte_mismatches(&plan, &other, &r).is_none());
    }
}

// === the command line ===

/// A WordLevel tokenizer over `w0 .. w63`, split on whitespace.
fn tokenizer_json(vocab: usize) -> String {
    let words: Vec<String> = (0..vocab).map(|i| format!("\"w{i}\": {i}")).collect();
    format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
"pre_tokenizer": {{"type": "Whitespace"}}, "post_processor": null, "decoder": null,
"model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "w0"}}}}"#,
        words.join(", ")
    )
}

/// The memory line sets the plan's weights and KV cache (in its dtype), its
/// activations and its runtime workspace beside the measured weights and KV cache.
#[test]
fn cli_inference_memory_line_sets_the_plans_parts_beside_the_measured_ones() {
    let dir = temp_dir("memory-line");
    let plan = dir.join("plan.json");
    let plan_s = plan.display().to_string();
    meshplan(&[
        "plan",
        &format!("{ROOT}/models/tiny-llama-inference.yaml"),
        &format!("{ROOT}/topologies/cpu-test-mesh.yaml"),
        "--config",
        "tp=2,pp=2",
        "-o",
        &plan_s,
    ])
    .expect_code(0);
    let p: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).expect("plan")).expect("json");
    let ledger = &p["predicted"]["memory_per_gpu_bytes"];
    let mib = |key: &str| ledger[key].as_f64().expect(key) / (1u64 << 20) as f64;
    let text = meshplan(&["run", &plan_s]);
    let line = text.expect_code(0).stdout_line("memory ");
    let (measured, predicted) = line.split_once("predicted per GPU:").expect("two sides");
    let v = meshplan(&["run", &plan_s, "--json"]).json();
    let number = |s: &str, prefix: &str| -> f64 {
        let at = s
            .find(prefix)
            .unwrap_or_else(|| panic!("no `{prefix}` in {line}"));
        let rest = &s[at + prefix.len()..];
        rest[..rest.find(' ').unwrap_or(rest.len())]
            .parse()
            .unwrap_or_else(|e| panic!("`{prefix}` ({e}): {line}"))
    };
    let near = |shown: f64, want: f64| (shown - want).abs() <= 5e-4 * want.max(1.0);
    for (side, prefix, want) in [
        (
            measured,
            "weights ",
            v["measured"]["weight_bytes"].as_f64().expect("weights") / (1u64 << 20) as f64,
        ),
        (
            measured,
            "KV cache ",
            v["measured"]["kv_cache_bytes"].as_f64().expect("kv") / (1u64 << 20) as f64,
        ),
        (predicted, "weights ", mib("params")),
        (predicted, "KV cache ", mib("kv_cache")),
        (predicted, "activations ", mib("activations")),
        (predicted, "runtime workspace ", mib("workspace")),
    ] {
        let shown = number(side, prefix);
        assert!(near(shown, want), "{prefix}{shown} against {want}: {line}");
    }
    assert!(
        predicted.contains(&format!(
            "({})",
            p["model"]["dtype"].as_str().expect("dtype")
        )),
        "{line}"
    );
}

#[test]
fn cli_runs_a_checkpoint_with_ids_text_and_check() {
    let dir = temp_dir("cli");
    let mut t = llama_tensors(&LLAMA, 17);
    round_to(Store::F32, &mut t);
    write_checkpoint(&dir, &llama_config(&LLAMA), &t, Store::F32, 2);
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json(LLAMA.vocab)).expect("tokenizer");
    let plan_s = cli_plan(&dir, "tp=2,pp=2,dp_attention=false");
    let dir_s = dir.display().to_string();
    let out = meshplan(&[
        "run",
        &plan_s,
        "--weights",
        &dir_s,
        "--json",
        "--check",
        "--max-new-tokens",
        "5",
        "--prompt-ids",
        "1,15,42,7,3,9",
        "--prompt-ids",
        "60,2",
    ]);
    out.expect_code(0);
    let v = out.json();
    for (i, p) in PROMPTS[..2].iter().enumerate() {
        let (want, logits) = reference_generate(&|s| llama_forward(&LLAMA, &t, s), p, 5);
        let got: Vec<u32> =
            serde_json::from_value(v["requests"][i]["tokens"].clone()).expect("tokens");
        assert_eq!(got, want, "request {i}");
        if i == 0 {
            let first: Vec<u32> = serde_json::from_value(v["tokens"].clone()).expect("tokens");
            assert_eq!(first, want);
            let l: Vec<f32> = serde_json::from_value(v["logits"].clone()).expect("logits");
            let (d, scale) = max_diff(&l, &logits);
            assert!(d <= TOL * scale, "{d}");
        }
    }
    assert_eq!(v["check"]["passed"], true);
    for key in [
        "ttft_s",
        "tpot_s",
        "output_tokens_per_s",
        "predicted_ttft_s",
        "predicted_tpot_s",
        "predicted_output_tokens_per_s",
    ] {
        assert!(
            v[key].as_f64().is_some_and(|x| x > 0.0),
            "{key}: {}",
            v[key]
        );
    }
    // The same prompt as text through tokenizer.json, and back.
    let text = meshplan(&[
        "run",
        &plan_s,
        "--weights",
        &dir_s,
        "--json",
        "--max-new-tokens",
        "5",
        "--prompt",
        "w1 w15 w42 w7 w3 w9",
    ]);
    text.expect_code(0);
    let tv = text.json();
    assert_eq!(tv["tokens"], v["tokens"]);
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).expect("tokens");
    let words: Vec<String> = ids.iter().map(|i| format!("w{i}")).collect();
    assert_eq!(tv["text"].as_str(), Some(words.join(" ").as_str()));
    // A prompt file, one request per line.
    let prompts = dir.join("prompts.txt");
    std::fs::write(&prompts, "w1 w15 w42 w7 w3 w9\n\nw60 w2\n").expect("prompts");
    let file = meshplan(&[
        "run",
        &plan_s,
        "--weights",
        &dir_s,
        "--json",
        "--max-new-tokens",
        "5",
        "--prompt-file",
        &prompts.display().to_string(),
    ]);
    file.expect_code(0);
    let fv = file.json();
    assert_eq!(fv["requests"][0]["tokens"], v["requests"][0]["tokens"]);
    assert_eq!(fv["requests"][1]["tokens"], v["requests"][1]["tokens"]);
}

#[test]
fn cli_bad_inference_input_exits_2() {
    let dir = temp_dir("cli-bad");
    let mut t = llama_tensors(&LLAMA, 18);
    write_checkpoint(&dir, &llama_config(&LLAMA), &t, Store::F32, 1);
    let plan = cli_plan(&dir, "tp=2,pp=2,dp_attention=false");
    let dir_s = dir.display().to_string();
    meshplan(&["run", &plan, "--prompt", "hello"])
        .expect_code(2)
        .stderr_has(&["tokenizer"]);
    meshplan(&["run", &plan, "--prompt-ids", "1,x"])
        .expect_code(2)
        .stderr_has(&["--prompt-ids"]);
    meshplan(&["run", &plan, "--prompt-ids", "1,64"])
        .expect_code(2)
        .stderr_has(&["token id 64", "vocabulary of 64"]);
    meshplan(&["run", &plan, "--prompt-ids", "1", "--top-p", "0"])
        .expect_code(2)
        .stderr_has(&["--top-p"]);
    // A prompt file with no prompt ran the plan's synthetic prompts in their place.
    let blank = dir.join("blank.txt");
    std::fs::write(&blank, "\n  \n").expect("prompt file");
    let blank = blank.display().to_string();
    meshplan(&["run", &plan, "--prompt-file", &blank])
        .expect_code(2)
        .stderr_has(&[&blank, "no request (every line is blank)"]);
    // --step-logits lives in the JSON report; without --json it was dropped.
    meshplan(&["run", &plan, "--prompt-ids", "1", "--step-logits"])
        .expect_code(2)
        .stderr_has(&["--step-logits", "--json"]);
    // Plans the executor cannot run yet say so and how to plan instead.
    let dpa = cli_plan_named(&dir, "tp=2,pp=2,dp_attention=true", "dpa.json");
    meshplan(&["run", &dpa, "--prompt-ids", "1"])
        .expect_code(2)
        .stderr_has(&["dp_attention=false"]);
    // Without --weights the plan runs on its deterministic synthetic weights.
    meshplan(&[
        "run",
        &plan,
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "2",
        "--check",
    ])
    .expect_code(0);
    // A checkpoint whose tensor has the wrong shape names it and the shape wanted.
    let v = t.get_mut("model.layers.0.mlp.up_proj.weight").expect("up");
    v.0 = vec![LLAMA.ffn + 1, LLAMA.hidden];
    v.1 = vec![0.0; (LLAMA.ffn + 1) * LLAMA.hidden];
    let bad = temp_dir("cli-bad-shape");
    write_checkpoint(&bad, &llama_config(&LLAMA), &t, Store::F32, 1);
    meshplan(&[
        "run",
        &plan,
        "--weights",
        &bad.display().to_string(),
        "--prompt-ids",
        "1",
    ])
    .expect_code(2)
    .stderr_has(&["model.layers.0.mlp.up_proj.weight", "[48, 32]"]);
    // A checkpoint of another model names the config field.
    let tiny = dir.join("tiny.json").display().to_string();
    meshplan(&[
        "plan",
        "models/tiny-llama-inference.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "tp=2,pp=2,dp_attention=false",
        "-o",
        &tiny,
    ])
    .expect_code(0);
    meshplan(&["run", &tiny, "--weights", &dir_s, "--prompt-ids", "1"])
        .expect_code(2)
        .stderr_has(&["num_hidden_layers"]);
    meshplan(&[
        "run",
        &tiny,
        "--weights",
        &dir.join("nowhere").display().to_string(),
    ])
    .expect_code(2)
    .stderr_has(&["config.json"]);
}

// === fine-tuning from a checkpoint ===

/// A training plan of the checkpoint's model: `seq_len` 16, 4 sequences a step.
fn train_plan_of(dir: &Path, cfg: &str, gpus: u64) -> Plan {
    let overrides = WorkloadOverrides {
        seq_len: Some(16),
        global_batch: Some(4),
        ..WorkloadOverrides::default()
    };
    plan_with(dir, overrides, cfg, gpus)
}

#[test]
fn fine_tuning_starts_from_the_checkpoint_weights_on_any_sharding() {
    use meshplan_executor::train::{check_against, train, TrainOptions};
    let dir = temp_dir("finetune-llama");
    let t = llama_tensors(&LLAMA, 11);
    write_checkpoint(&dir, &llama_config(&LLAMA), &t, Store::F32, 2);
    let ck = Arc::new(Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{e}")));
    let opts = TrainOptions {
        steps: 3,
        weights: Some(ck),
        ..TrainOptions::default()
    };
    let single = train_plan_of(&dir, "dp=1", 1);
    let base = train(&single, &opts).unwrap_or_else(|e| panic!("{e}"));
    crate::exec_golden::check("finetune-llama-dp=1", &base);
    // The first step's loss is the checkpoint's: the naive f64 forward's mean
    // cross-entropy over the same synthetic sequences, position by position.
    let mut total = 0.0;
    let mut n = 0.0;
    for i in 0..4u64 {
        let seq = meshplan_executor::init::synthetic_sequence(opts.seed, 0, i, 16, 64);
        for p in 0..16 {
            let logits = llama_forward(&LLAMA, &t, &seq[..=p]);
            let m = logits.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
            let lse = m + logits.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            total += lse - logits[seq[p + 1] as usize];
            n += 1.0;
        }
    }
    let want = total / n;
    assert!(
        (base.losses[0] - want).abs() < 1e-4 * want,
        "step 0 loss {} vs naive {want}",
        base.losses[0]
    );
    assert!(base.losses[2] < base.losses[0], "{:?}", base.losses);
    for cfg in ["dp=2,tp=2", "tp=2,pp=2", "dp=2,pp=2,zero=2"] {
        let plan = train_plan_of(&dir, cfg, 4);
        let run = train(&plan, &opts).unwrap_or_else(|e| panic!("{cfg}: {e}"));
        crate::exec_golden::check(&format!("finetune-llama-{cfg}"), &run);
        let base = train(&single, &opts.reference_of(&plan)).unwrap_or_else(|e| panic!("{e}"));
        if let Err(why) = check_against(&plan, &run, &base, 1e-5) {
            panic!("{cfg} differs from the single-rank fine-tuning:\n{why}");
        }
    }
    // Starting from the same checkpoint weights, the general interpreter's
    // goldens, bit for bit.
    for cfg in [
        "dp=1",
        "dp=2,zero=1",
        "tp=2,sp=false",
        "pp=2,mbs=1",
        "dp=2,zero=3",
    ] {
        let gpus = if cfg == "dp=1" { 1 } else { 2 };
        let plan = train_plan_of(&dir, cfg, gpus);
        let run = train(&plan, &opts).unwrap_or_else(|e| panic!("{cfg}: {e}"));
        crate::exec_golden::check(&format!("finetune-llama-general-{cfg}"), &run);
    }
}

#[test]
fn a_checkpoint_holding_nan_is_refused_naming_the_tensor() {
    let dir = temp_dir("llama-nan");
    let mut t = llama_tensors(&LLAMA, 11);
    let name = "model.layers.2.input_layernorm.weight";
    t.get_mut(name).expect("the tensor").1[3] = f64::NAN;
    write_checkpoint(&dir, &llama_config(&LLAMA), &t, Store::F32, 1);
    let ck = Arc::new(Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{e}")));
    let plan = plan_of(&dir, "tp=2", 2);
    let err = infer(
        &plan,
        &InferOptions {
            requests: vec![PROMPTS[0].to_vec()],
            max_new_tokens: 2,
            weights: Some(ck),
            ..InferOptions::default()
        },
    )
    .expect_err("NaN weights are refused");
    // Bad input (the binary exits 2), whichever rank read the tensor first.
    assert!(
        matches!(&err, ExecError::Data(m) if m.contains(&format!("`{name}` holds NaN"))),
        "{err:?}"
    );
    // Fine-tuning from it is refused the same way, before a step runs.
    use meshplan_executor::train::{train, TrainOptions};
    let run = train(
        &train_plan_of(&dir, "dp=2", 2),
        &TrainOptions {
            weights: Some(
                Checkpoint::open(&dir)
                    .map(Arc::new)
                    .unwrap_or_else(|e| panic!("{e}")),
            ),
            ..TrainOptions::default()
        },
    );
    let err = run.expect_err("fine-tuning from NaN weights");
    assert!(
        matches!(&err, ExecError::Data(m) if m.contains(&format!("`{name}` holds NaN"))),
        "{err:?}"
    );
    let (plan, dir_s) = (cli_plan(&dir, "tp=2"), dir.display().to_string());
    meshplan(&["run", &plan, "--weights", &dir_s, "--max-new-tokens", "2"])
        .expect_code(2)
        .stderr_has(&[&format!("`{name}` holds NaN"), "use an intact checkpoint"]);
}

/// Plans `dir`'s config.json with `cfg` through the command line into `dir/NAME`:
/// the plan's path.
fn cli_plan_named(dir: &Path, cfg: &str, name: &str) -> String {
    std::fs::write(dir.join("workload.yaml"), WORKLOAD).expect("workload");
    let (config, wl, plan) = (
        dir.join("config.json").display().to_string(),
        dir.join("workload.yaml").display().to_string(),
        dir.join(name).display().to_string(),
    );
    meshplan(&[
        "plan",
        &config,
        "topologies/cpu-test-mesh.yaml",
        "--workload",
        &wl,
        "--config",
        cfg,
        "-o",
        &plan,
    ])
    .expect_code(0);
    plan
}

/// [`cli_plan_named`] into `dir/plan.json`.
fn cli_plan(dir: &Path, cfg: &str) -> String {
    cli_plan_named(dir, cfg, "plan.json")
}

/// Plans `dir`'s config.json with `cfg` and runs it greedily on `prompt` through the
/// command line, with extra `run` flags.
fn cli_plan_and_run(
    dir: &Path,
    cfg: &str,
    prompt: &str,
    new: &str,
    extra: &[&str],
) -> crate::cli::Run {
    let plan = cli_plan(dir, cfg);
    let dir_s = dir.display().to_string();
    let mut args = vec![
        "run",
        &plan,
        "--weights",
        &dir_s,
        "--json",
        "--max-new-tokens",
        new,
        "--prompt-ids",
        prompt,
    ];
    args.extend_from_slice(extra);
    meshplan(&args)
}

#[test]
fn cli_refuses_config_fields_whose_math_is_not_implemented() {
    // Each field plans (costs are unaffected) and then `run` exits 2 naming it,
    // never generating from another model.
    let mut t = llama_tensors(&LLAMA, 22);
    round_to(Store::F32, &mut t);
    let base = llama_config(&LLAMA);
    let cases: [(&str, String, &str); 3] = [
        (
            "yarn",
            base.replace(
                "\"torch_dtype\"",
                r#""rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, "torch_dtype""#,
            ),
            "rope_scaling.rope_type",
        ),
        (
            "dynamic",
            base.replace(
                "\"torch_dtype\"",
                r#""rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "torch_dtype""#,
            ),
            "rope_parameters.rope_type",
        ),
        (
            "partial-rotary",
            base.replace("\"torch_dtype\"", r#""partial_rotary_factor": 0.5, "torch_dtype""#),
            "partial_rotary_factor",
        ),
    ];
    for (name, config, field) in cases {
        let dir = temp_dir(&format!("refuse-{name}"));
        write_checkpoint(&dir, &config, &t, Store::F32, 1);
        let r = cli_plan_and_run(&dir, "dp=1", "1,2,3", "3", &[]);
        r.expect_code(2).stderr_has(&[field, "config.json"]);
    }
    // GPT-2's attention-scaling switches and the exact GELU.
    let gt = gpt2_tensors(23);
    for (name, from, to, field) in [
        ("gelu", "\"gelu_new\"", "\"gelu\"", "activation_function"),
        (
            "unscaled",
            "\"n_inner\": null",
            "\"n_inner\": null, \"scale_attn_weights\": false",
            "scale_attn_weights",
        ),
        (
            "inverse-layer",
            "\"n_inner\": null",
            "\"n_inner\": null, \"scale_attn_by_inverse_layer_idx\": true",
            "scale_attn_by_inverse_layer_idx",
        ),
    ] {
        let dir = temp_dir(&format!("refuse-gpt2-{name}"));
        write_checkpoint(&dir, &gpt2_config().replace(from, to), &gt, Store::F32, 1);
        let r = cli_plan_and_run(&dir, "dp=1", "1,2,3", "3", &[]);
        r.expect_code(2).stderr_has(&[field]);
    }
    // The tanh spellings are the executor's GELU and run.
    let dir = temp_dir("gpt2-tanh");
    write_checkpoint(
        &dir,
        &gpt2_config().replace("\"gelu_new\"", "\"gelu_pytorch_tanh\""),
        &gt,
        Store::F32,
        1,
    );
    let r = cli_plan_and_run(&dir, "dp=1", "1,15,42,7,3,9", "5", &[]);
    r.expect_code(0);
    let (want, _) = reference_generate(&|s| gpt2_forward(&gt, s), PROMPTS[0], 5);
    let got: Vec<u32> = serde_json::from_value(r.json()["tokens"].clone()).expect("tokens");
    assert_eq!(got, want);
}

#[test]
fn cli_sliding_window_runs_within_it_and_refuses_past_it() {
    // Mistral's window of 8 keys: 6 prompt tokens + 3 new ones feed 8 positions
    // through the model (the last token is only sampled), every query sees its
    // whole prefix and the run is exact; 4 new ones would need the window.
    let mut t = llama_tensors(&LLAMA, 24);
    round_to(Store::F32, &mut t);
    let config = llama_config(&LLAMA)
        .replace("\"llama\"", "\"mistral\"")
        .replace("LlamaForCausalLM", "MistralForCausalLM")
        .replace("\"torch_dtype\"", "\"sliding_window\": 8, \"torch_dtype\"");
    let dir = temp_dir("sliding-window");
    write_checkpoint(&dir, &config, &t, Store::F32, 1);
    let r = cli_plan_and_run(&dir, "tp=2", "1,15,42,7,3,9", "3", &[]);
    r.expect_code(0);
    let (want, _) = reference_generate(&|s| llama_forward(&LLAMA, &t, s), PROMPTS[0], 3);
    let got: Vec<u32> = serde_json::from_value(r.json()["tokens"].clone()).expect("tokens");
    assert_eq!(got, want);
    let r = cli_plan_and_run(&dir, "tp=2", "1,15,42,7,3,9", "4", &[]);
    r.expect_code(2)
        .stderr_has(&["sliding_window", "8", "9 tokens"]);
    // Qwen2 without use_sliding_window ignores the key, as transformers does.
    let q = LlamaCfg {
        qkv_bias: true,
        ..LLAMA
    };
    let mut qt = llama_tensors(&q, 25);
    round_to(Store::F32, &mut qt);
    let dir = temp_dir("qwen2-window-off");
    let config = llama_config(&q).replace(
        "\"torch_dtype\"",
        "\"sliding_window\": 4, \"use_sliding_window\": false, \"torch_dtype\"",
    );
    write_checkpoint(&dir, &config, &qt, Store::F32, 1);
    cli_plan_and_run(&dir, "dp=1", "1,15,42,7,3,9", "5", &[]).expect_code(0);
}

#[test]
fn cli_generation_stops_at_the_checkpoints_eos() {
    let mut t = llama_tensors(&LLAMA, 26);
    round_to(Store::F32, &mut t);
    let (want, _) = reference_generate(&|s| llama_forward(&LLAMA, &t, s), PROMPTS[0], 6);
    // The end-of-sequence token is the one greedy decoding picks third (one that
    // did not come before it, so generation ends exactly there).
    let k = (2..want.len())
        .find(|&k| !want[..k].contains(&want[k]))
        .expect("a new token after the second");
    let eos = want[k];
    let dir = temp_dir("eos");
    let config = llama_config(&LLAMA).replace(
        "\"torch_dtype\"",
        &format!(
            "\"eos_token_id\": [{}, {eos}], \"torch_dtype\"",
            LLAMA.vocab + 5
        ),
    );
    write_checkpoint(&dir, &config, &t, Store::F32, 1);
    let tokens = |r: &crate::cli::Run| -> Vec<u32> {
        serde_json::from_value(r.json()["tokens"].clone()).expect("tokens")
    };
    let r = cli_plan_and_run(&dir, "pp=2", "1,15,42,7,3,9", "6", &[]);
    r.expect_code(0);
    assert_eq!(tokens(&r), want[..=k].to_vec(), "stops after the EOS token");
    assert_eq!(r.json()["requests"][0]["finish_reason"], "eos");
    // The logits reported are those the end-of-sequence token was picked from.
    let logits: Vec<f32> = serde_json::from_value(r.json()["logits"].clone()).expect("logits");
    let mut seq = PROMPTS[0].to_vec();
    seq.extend_from_slice(&want[..k]);
    let (d, scale) = max_diff(&logits, &llama_forward(&LLAMA, &t, &seq));
    assert!(d <= TOL * scale, "the EOS token's logits: {d:e}");
    let r = cli_plan_and_run(
        &dir,
        "pp=2",
        "1,15,42,7,3,9",
        "6",
        &["--ignore-eos", "--step-logits"],
    );
    r.expect_code(0);
    assert_eq!(tokens(&r), want, "--ignore-eos generates them all");
    let v = r.json();
    assert_eq!(v["requests"][0]["finish_reason"], "length");
    // Every step's logits, each the reference's for that prefix.
    let steps: Vec<Vec<f32>> =
        serde_json::from_value(v["requests"][0]["step_logits"].clone()).expect("step_logits");
    assert_eq!(steps.len(), want.len());
    for (i, row) in steps.iter().enumerate() {
        let mut seq = PROMPTS[0].to_vec();
        seq.extend_from_slice(&want[..i]);
        let (d, scale) = max_diff(row, &llama_forward(&LLAMA, &t, &seq));
        assert!(d <= TOL * scale, "step {i}: {d:e}");
    }
    assert_eq!(v["logits"], v["requests"][0]["step_logits"][want.len() - 1]);
    // generation_config.json comes first, as in transformers.
    std::fs::write(
        dir.join("generation_config.json"),
        format!("{{\"eos_token_id\": {}}}", want[1]),
    )
    .expect("generation_config.json");
    let r = cli_plan_and_run(&dir, "pp=2", "1,15,42,7,3,9", "6", &[]);
    r.expect_code(0);
    let first = want.iter().position(|&x| x == want[1]).expect("present");
    assert_eq!(tokens(&r), want[..=first].to_vec());
}

#[test]
fn cli_refuses_a_checkpoint_whose_rope_differs_from_the_plan() {
    // A plan made from one config.json and run with weights whose config.json says
    // another rotary base or scaling would compute another model.
    let mut t = llama_tensors(&LLAMA, 27);
    round_to(Store::F32, &mut t);
    let dir = temp_dir("rope-mismatch");
    write_checkpoint(&dir, &llama_config(&LLAMA), &t, Store::F32, 1);
    let plan = cli_plan(&dir, "dp=1");
    for (from, to, field) in [
        (
            "\"rope_theta\": 10000.0",
            "\"rope_theta\": 500000.0",
            "rope_theta",
        ),
        (
            "\"torch_dtype\"",
            r#""rope_scaling": {"rope_type": "linear", "factor": 2.0}, "torch_dtype""#,
            "rope_scaling",
        ),
        (
            "\"rms_norm_eps\": 1e-5",
            "\"rms_norm_eps\": 1e-6",
            "rms_norm_eps",
        ),
    ] {
        let text = llama_config(&LLAMA);
        assert!(text.contains(from), "{from} in {text}");
        std::fs::write(dir.join("config.json"), text.replace(from, to)).expect("config");
        let dir_s = dir.display().to_string();
        meshplan(&[
            "run",
            &plan,
            "--weights",
            &dir_s,
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "2",
        ])
        .expect_code(2)
        .stderr_has(&[field, "plan this checkpoint's config.json"]);
    }
}

/// Inference on the bf16-emulating host device (what a GPU computes in bf16):
/// every layout's prompt logits stay within the mixed-precision tolerance of the
/// fp32 single-rank run, bf16 does move them, and damaged weights do not pass.
#[test]
fn mixed_precision_inference_stays_within_the_tolerance() {
    use meshplan_executor::device::emulate::Bf16Host;
    use meshplan_executor::infer::{check_inference_mixed, infer_on};
    let (dir, ck) = llama_checkpoint("llama-bf16", 11);
    let opts = InferOptions {
        requests: PROMPTS.iter().map(|p| p.to_vec()).collect(),
        max_new_tokens: 5,
        weights: Some(ck),
        ..InferOptions::default()
    };
    let single = infer(&plan_of(&dir, "dp=1", 1), &opts).unwrap_or_else(|e| panic!("{e}"));
    for (cfg, gpus) in [("dp=1", 1), ("tp=2", 2), ("pp=2", 2), ("tp=2,pp=2,dp=2", 8)] {
        let p = plan_of(&dir, cfg, gpus);
        let bf16 = infer_on(&p, &opts, &|_| Ok(Bf16Host)).unwrap_or_else(|e| panic!("{e}"));
        let (line, worst) =
            check_inference_mixed(&bf16, &single).unwrap_or_else(|e| panic!("{cfg}: {e}"));
        eprintln!("{cfg}: {line}");
        assert!(worst > 0.0, "{cfg}: bf16 rounding changed nothing");
        // The host device in fp32 through the same entry point is the fp32 run.
        let fp32 = infer_on(&p, &opts, &|_| Ok(meshplan_executor::device::HostDevice))
            .unwrap_or_else(|e| panic!("{e}"));
        check_inference(&fp32, &single).unwrap_or_else(|e| panic!("{cfg}: {e}"));
    }
    // Over given communicators (how one process drives several GPUs with NCCL),
    // one per rank: the tokens and logits of the in-process world, the same bytes.
    use meshplan_executor::comm::{Communicator, ThreadComm};
    let p = plan_of(&dir, "tp=2,pp=2,dp=2", 8);
    let comms = |n: usize| -> Vec<Box<dyn Communicator>> {
        ThreadComm::create(n, opts.timeout)
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Communicator>)
            .collect()
    };
    let host = |_| Ok(meshplan_executor::device::HostDevice);
    let given = meshplan_executor::infer::infer_on_with(&p, &opts, &host, Some(comms(8)))
        .unwrap_or_else(|e| panic!("{e}"));
    let world = infer_on(&p, &opts, &host).unwrap_or_else(|e| panic!("{e}"));
    for (a, b) in given.requests.iter().zip(&world.requests) {
        assert_eq!(a.tokens, b.tokens, "given communicators: tokens");
        assert_eq!(a.logits, b.logits, "given communicators: logits");
    }
    assert_eq!(given.counts, world.counts, "given communicators: bytes");
    let e = meshplan_executor::infer::infer_on_with(&p, &opts, &host, Some(comms(2)))
        .expect_err("two communicators for eight ranks");
    assert!(
        e.to_string()
            .contains("2 communicators for a plan of 8 ranks"),
        "{e}"
    );
    // Other weights: the same prompts' logits are far outside the tolerance.
    let other = temp_dir("llama-bf16-other");
    write_checkpoint(
        &other,
        &llama_config(&LLAMA),
        &llama_tensors(&LLAMA, 12),
        Store::F32,
        1,
    );
    let ck = Arc::new(Checkpoint::open(&other).unwrap_or_else(|e| panic!("{e}")));
    let wrong = InferOptions {
        weights: Some(ck),
        ..opts.clone()
    };
    let bf16 = infer_on(&plan_of(&dir, "tp=2", 2), &wrong, &|_| Ok(Bf16Host))
        .unwrap_or_else(|e| panic!("{e}"));
    let e = check_inference_mixed(&bf16, &single).expect_err("other weights pass");
    eprintln!("other weights: {}", e.lines().last().unwrap_or_default());
    // A NaN among the first logits fails, though every other value is the reference's.
    let mut nan = single.clone();
    nan.requests[1].first_logits[0] = f32::NAN;
    let e = check_inference_mixed(&nan, &single).expect_err("a NaN logit passes");
    assert!(
        e.contains("request 1: first logits differ by up to NaN"),
        "{e}"
    );
}

/// Inference keeps its work on the device: what crosses between the host and
/// the device (counted on the host device, where a GPU run would cross the bus)
/// is the weights once, then per generated token only the pass's ids: tokens to
/// the first stage and positions to every stage going up, and each request's
/// token coming back from each last-stage tensor rank, picked on the device. The
/// logits come back only where the report keeps them (each request's first and
/// last token's, on the one rank that records): never the prompt's other rows, an
/// activation or the KV cache. Sampling with a temperature draws on the device
/// too: only the requests' indices go up besides.
#[test]
fn a_generated_token_moves_its_ids_only_greedy_or_sampled() {
    use crate::device::crossings::{per_token, Audited};
    use meshplan_executor::device::Crossing::{ActUp, F32Down, IdsDown, IdsUp};
    use meshplan_executor::infer::infer_on;
    use meshplan_executor::sample::Sampling;
    let (dir, ck) = llama_checkpoint("llama-crossings", 11);
    let requests = PROMPTS.len() as u64;
    let sampled = Sampling {
        temperature: 0.8,
        top_p: 0.9,
        seed: 3,
    };
    for (cfg, gpus) in [("dp=1", 1), ("tp=2", 2), ("pp=2", 2), ("tp=2,pp=2,dp=2", 8)] {
        let p = plan_of(&dir, cfg, gpus);
        let vocab = p.graph.vocab().expect("vocab");
        let (tp, pp) = (p.strategy.tp, p.strategy.pp);
        let ledgers = |sampling: Sampling| {
            per_token(&|n| {
                let opts = InferOptions {
                    requests: PROMPTS.iter().map(|p| p.to_vec()).collect(),
                    max_new_tokens: n as usize,
                    weights: Some(Arc::clone(&ck)),
                    sampling,
                    ..InferOptions::default()
                };
                infer_on(&p, &opts, &|_| Ok(Audited)).unwrap_or_else(|e| panic!("{e}"));
            })
        };
        let ids = requests * tp * (pp + 1);
        let (three, token) = ledgers(Sampling::GREEDY);
        assert_eq!(
            token.get(&IdsUp).map(|c| c.1),
            Some(ids),
            "{cfg}: {token:?}"
        );
        assert_eq!(
            token.get(&IdsDown).map(|c| c.1),
            Some(requests * tp),
            "{cfg}: {token:?}"
        );
        assert_eq!(token.len(), 2, "{cfg}: {token:?}");
        // Each request's first and last logits, read back by the recording rank.
        assert_eq!(
            three.get(&F32Down).map(|c| c.1),
            Some(2 * requests * vocab),
            "{cfg}"
        );
        assert_eq!(
            three.keys().copied().collect::<Vec<_>>(),
            [ActUp, IdsUp, F32Down, IdsDown],
            "{cfg}"
        );
        let (three, token) = ledgers(sampled);
        assert_eq!(
            token.get(&IdsUp).map(|c| c.1),
            Some(ids + requests * tp),
            "{cfg}: {token:?}"
        );
        assert_eq!(
            token.get(&IdsDown).map(|c| c.1),
            Some(requests * tp),
            "{cfg}: {token:?}"
        );
        assert_eq!(token.len(), 2, "{cfg}: {token:?}");
        assert_eq!(
            three.get(&F32Down).map(|c| c.1),
            Some(2 * requests * vocab),
            "{cfg}"
        );
    }
}
