//! Shipped models: every file in `models/` loads and builds, parameter counts equal
//! hand-computed integers and agree with published figures, and a Hugging Face
//! `config.json` gives the same graph as the YAML of the same model.

use meshplan_ir::{
    load_model, model_graph, Graph, ModelSpec, TransformerSpec, Workload, WorkloadOverrides,
};
use std::path::{Path, PathBuf};

/// `models/` at the workspace root (tests run with the `tests/` crate as cwd).
const MODELS_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../models");

const GPT3_175B: u64 = 174_615_846_912;
const LLAMA3_8B: u64 = 8_030_261_248;
const LLAMA3_70B: u64 = 70_553_706_496;
const LLAMA3_405B: u64 = 405_853_388_800;
const MIXTRAL_TOTAL: u64 = 46_702_792_704;
const MIXTRAL_ACTIVE: u64 = 12_879_925_248;
const DEEPSEEK_V3_TOTAL: u64 = 671_026_404_352;
const DEEPSEEK_V3_ACTIVE: u64 = 37_552_282_624;
const GPT2_124M: u64 = 124_439_808;
const MISTRAL_7B: u64 = 7_241_732_096;
const QWEN2_7B: u64 = 7_615_616_512;
const TINY_GPT: u64 = 106_816;
const TINY_MOE_TOTAL: u64 = 254_784;
const TINY_MOE_ACTIVE: u64 = 156_480;

/// `(file relative to models/, total, active)`: exact parameter counts of every shipped
/// model file, hand-computed from the shapes (the derivations are in the tests below);
/// active counts routed experts at `top_k / experts`.
const EXPECTED: &[(&str, u64, u64)] = &[
    ("gpt3-175b.yaml", GPT3_175B, GPT3_175B),
    ("llama3-8b.yaml", LLAMA3_8B, LLAMA3_8B),
    ("llama3-70b.yaml", LLAMA3_70B, LLAMA3_70B),
    ("llama3-70b-inference.yaml", LLAMA3_70B, LLAMA3_70B),
    ("llama3-405b.yaml", LLAMA3_405B, LLAMA3_405B),
    ("mixtral-8x7b.yaml", MIXTRAL_TOTAL, MIXTRAL_ACTIVE),
    ("deepseek-v3.yaml", DEEPSEEK_V3_TOTAL, DEEPSEEK_V3_ACTIVE),
    ("gpt2-124m.yaml", GPT2_124M, GPT2_124M),
    ("tiny-gpt.yaml", TINY_GPT, TINY_GPT),
    // tiny-gpt's architecture, served.
    ("tiny-llama-inference.yaml", TINY_GPT, TINY_GPT),
    // 4096*384 embedding + 6 * (2*384 + 384*1152 + 384*384 + 384*3072 + 1536*384) + 384 + 384*4096.
    ("small-gpt.yaml", 17_306_496, 17_306_496),
    // 4096*384 embedding (tied head) + 256*384 positions + 6 * (2 LayerNorms of 2*384
    // + 384*1152 + 1152 + 384*384 + 384 + 384*1536 + 1536 + 1536*384 + 384) + 2*384.
    ("small-gpt2.yaml", 12_318_720, 12_318_720),
    ("tiny-moe.yaml", TINY_MOE_TOTAL, TINY_MOE_ACTIVE),
    ("tiny-moe-capacity.yaml", TINY_MOE_TOTAL, TINY_MOE_ACTIVE),
    // 32,832 outside the blocks (two 256*64 tables, the final norm) + a dense layer of
    // tiny-gpt's (2*64 + 64*128 + 64*64 + 3*64*128 = 36,992) + an MoE layer of
    // tiny-moe's (2*64 + 64*128 + 64*64 + 64*4 router + 4 experts * 3*64*128 =
    // 110,976; active: two experts, 61,824).
    ("tiny-moe-dense-first.yaml", 180_800, 131_648),
    ("hf/llama3-8b.json", LLAMA3_8B, LLAMA3_8B),
    ("hf/llama3-8b-transformers5.json", LLAMA3_8B, LLAMA3_8B),
    ("hf/mistral-7b.json", MISTRAL_7B, MISTRAL_7B),
    ("hf/mixtral-8x7b.json", MIXTRAL_TOTAL, MIXTRAL_ACTIVE),
    ("hf/qwen2-7b.json", QWEN2_7B, QWEN2_7B),
    ("hf/gpt2.json", GPT2_124M, GPT2_124M),
    ("hf/deepseek-v3.json", DEEPSEEK_V3_TOTAL, DEEPSEEK_V3_ACTIVE),
];

fn model_path(rel: &str) -> PathBuf {
    Path::new(MODELS_DIR).join(rel)
}

#[track_caller]
fn load(rel: &str) -> ModelSpec {
    let path = model_path(rel);
    load_model(&path, &WorkloadOverrides::default())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[track_caller]
fn transformer(rel: &str) -> TransformerSpec {
    match load(rel).transformer() {
        Some(t) => t.clone(),
        None => panic!("{rel}: expected the architecture form"),
    }
}

#[track_caller]
fn graph(spec: &ModelSpec) -> Graph {
    model_graph(spec).unwrap_or_else(|e| panic!("{}: {e}", spec.name))
}

/// A parameter count as an exact integer (the graph sums them in f64, exact below 2^53).
#[track_caller]
fn exact(count: f64) -> u64 {
    assert!(count >= 0.0, "{count}");
    assert!(count.fract() == 0.0, "{count} is not an integer");
    assert!(
        count < 9_007_199_254_740_992.0,
        "{count} is beyond f64's exact integers"
    );
    count as u64
}

/// `(total, active)` parameters of a shipped model file.
#[track_caller]
fn params(rel: &str) -> (u64, u64) {
    let g = graph(&load(rel));
    (exact(g.param_count(false)), exact(g.param_count(true)))
}

/// `got` is within `rel_tol` of a published (rounded) figure.
#[track_caller]
fn assert_published(what: &str, got: u64, published: f64, rel_tol: f64) {
    let rel = (got as f64 - published).abs() / published;
    assert!(
        rel <= rel_tol,
        "{what}: {got} is {rel:.2e} away from the published {published:e} (tolerance {rel_tol:e})"
    );
}

/// Every `.yaml`/`.yml`/`.json` file under `dir`, as paths relative to `models/`.
fn model_files(dir: &Path, out: &mut Vec<String>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .path();
        if path.is_dir() {
            model_files(&path, out);
        } else if path
            .extension()
            .is_some_and(|e| e == "yaml" || e == "yml" || e == "json")
        {
            let rel = path
                .strip_prefix(MODELS_DIR)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            out.push(rel.to_string_lossy().replace('\\', "/"));
        }
    }
}

// === every file ===

/// Loads and builds every file in `models/` so none can rot. Files at the top level
/// and in `hf/` must also have an exact parameter count in [`EXPECTED`].
#[test]
fn every_model_file_loads_builds_and_has_its_parameter_count() {
    let mut files = Vec::new();
    model_files(Path::new(MODELS_DIR), &mut files);
    files.sort();
    let mut checked = 0;
    for rel in &files {
        let spec = load(rel);
        let g = graph(&spec);
        let (total, active) = (exact(g.param_count(false)), exact(g.param_count(true)));
        assert!(active > 0, "{rel}: no parameters");
        assert!(active <= total, "{rel}: active {active} > total {total}");
        let shipped = !rel.contains('/') || rel.starts_with("hf/");
        match EXPECTED.iter().find(|(file, _, _)| *file == rel.as_str()) {
            Some(&(_, want_total, want_active)) => {
                assert_eq!(total, want_total, "{rel}: total parameters");
                assert_eq!(active, want_active, "{rel}: active parameters");
                checked += 1;
            }
            None => assert!(!shipped, "{rel}: add its parameter counts to EXPECTED"),
        }
        if rel.ends_with(".json") {
            assert!(
                spec.workload.is_none(),
                "{rel}: a config.json has no workload"
            );
        } else if shipped {
            assert!(
                spec.workload.is_some(),
                "{rel}: shipped model YAMLs carry a workload"
            );
        }
    }
    for (file, _, _) in EXPECTED {
        assert!(
            files.iter().any(|f| f == file),
            "{file}: listed in EXPECTED but missing"
        );
    }
    assert_eq!(checked, EXPECTED.len());
}

// === published figures ===

/// GPT-3 175B: Narayanan et al. 2021, Eq. 2,
/// `P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) = 12 l h^2 + 13 l h + (V + s) h`
/// (the `13 h` per layer are the biases and the two LayerNorms), plus the final
/// LayerNorm's `2h`, which the equation leaves out. Published: 174.6B.
#[test]
fn gpt3_175b_matches_narayanan_eq2() {
    let (l, h, v, s) = (96u64, 12288u64, 51200u64, 2048u64);
    let eq2 = 12 * l * h * h + 13 * l * h + (v + s) * h;
    let (lf, hf, vf, sf) = (l as f64, h as f64, v as f64, s as f64);
    let eq2_as_written =
        12.0 * lf * hf * hf * (1.0 + 13.0 / (12.0 * hf) + (vf + sf) / (12.0 * lf * hf));
    assert!((eq2 as f64 - eq2_as_written).abs() / eq2_as_written < 1e-12);
    assert_eq!(eq2 + 2 * h, GPT3_175B);

    let (total, active) = params("gpt3-175b.yaml");
    assert_eq!(total, eq2 + 2 * h);
    assert_eq!(active, total);
    assert_published("GPT-3 175B", total, 174.6e9, 1e-3);
}

/// Llama-style dense model: per layer `h (H + 2 kv) d` for QKV, `H d h` for the output,
/// `3 h f` for SwiGLU and `2h` for the two RMSNorms; untied embedding and head `2 V h`,
/// and the final norm `h`.
fn llama_params(l: u64, h: u64, heads: u64, kv: u64, d: u64, f: u64, v: u64) -> u64 {
    let layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * f + 2 * h;
    l * layer + 2 * v * h + h
}

#[test]
fn llama3_8b_70b_405b_exact_and_published() {
    assert_eq!(llama_params(32, 4096, 32, 8, 128, 14336, 128256), LLAMA3_8B);
    assert_eq!(
        llama_params(80, 8192, 64, 8, 128, 28672, 128256),
        LLAMA3_70B
    );
    assert_eq!(
        llama_params(126, 16384, 128, 8, 128, 53248, 128256),
        LLAMA3_405B
    );
    for (file, exact_count, published, tol) in [
        ("llama3-8b.yaml", LLAMA3_8B, 8.03e9, 1e-3),
        ("llama3-70b.yaml", LLAMA3_70B, 70.55e9, 1e-4),
        ("llama3-405b.yaml", LLAMA3_405B, 405.85e9, 1e-4),
    ] {
        let (total, active) = params(file);
        assert_eq!(total, exact_count, "{file}");
        assert_eq!(active, total, "{file}");
        assert_published(file, total, published, tol);
    }
}

/// Mixtral 8x7B: Llama-style attention, router `h x 8` and 8 SwiGLU experts per layer,
/// 2 active. Published: 46.7B total, 12.9B active (Jiang et al. 2024: "47B", "13B").
#[test]
fn mixtral_8x7b_exact_and_published() {
    let (l, h, f, v, e, k) = (32u64, 4096u64, 14336u64, 32000u64, 8u64, 2u64);
    let attn = h * (32 + 2 * 8) * 128 + 32 * 128 * h;
    let shared = l * (attn + 2 * h + h * e) + 2 * v * h + h;
    assert_eq!(shared + l * e * 3 * h * f, MIXTRAL_TOTAL);
    assert_eq!(shared + l * k * 3 * h * f, MIXTRAL_ACTIVE);

    let (total, active) = params("mixtral-8x7b.yaml");
    assert_eq!(total, MIXTRAL_TOTAL);
    assert_eq!(active, MIXTRAL_ACTIVE);
    assert_published("Mixtral total", total, 46.70e9, 1e-4);
    assert_published("Mixtral active", active, 12.88e9, 1e-4);
}

/// DeepSeek-V3 without its multi-token-prediction module. Per layer, MLA:
/// `q_a h x 1536`, `q_a_norm 1536`, `q_b 1536 x 128 (128 + 64)`,
/// `kv_a h x (512 + 64)`, `kv_a_norm 512`, `kv_b 512 x 128 (128 + 128)`,
/// `o 128 * 128 x h`; two RMSNorms `2h`. Layers 0-2: dense SwiGLU of 18432. Layers
/// 3-60: router `h x 256`, 256 routed and 1 shared SwiGLU expert of 2048, 8 routed
/// active. Untied embedding and head `2 V h`, final norm `h`. Published: 671B total,
/// 37B active (DeepSeek-AI 2024).
#[test]
fn deepseek_v3_exact_and_published() {
    let (h, heads, v) = (7168u64, 128u64, 129280u64);
    let (q_rank, kv_rank, nope, rope, vd) = (1536u64, 512u64, 128u64, 64u64, 128u64);
    let attn = h * q_rank
        + q_rank
        + q_rank * heads * (nope + rope)
        + h * (kv_rank + rope)
        + kv_rank
        + kv_rank * heads * (nope + vd)
        + heads * vd * h;
    assert_eq!(attn, 187_107_328);
    let expert = 3 * h * 2048;
    let dense_layer = attn + 2 * h + 3 * h * 18432;
    let moe_layer_shared = attn + 2 * h + h * 256 + expert;
    let rest = 3 * dense_layer + 2 * v * h + h;
    assert_eq!(
        rest + 58 * (moe_layer_shared + 256 * expert),
        DEEPSEEK_V3_TOTAL
    );
    assert_eq!(
        rest + 58 * (moe_layer_shared + 8 * expert),
        DEEPSEEK_V3_ACTIVE
    );

    let (total, active) = params("deepseek-v3.yaml");
    assert_eq!(total, DEEPSEEK_V3_TOTAL);
    assert_eq!(active, DEEPSEEK_V3_ACTIVE);
    assert_published("DeepSeek-V3 total", total, 671e9, 1e-3);
    // "37B activated" is rounded to two digits.
    assert_published("DeepSeek-V3 active", active, 37e9, 0.02);
}

/// GPT-2 small: the 124,439,808 of the released checkpoint (tied head, learned
/// positions, biases and LayerNorms everywhere).
#[test]
fn gpt2_124m_exact() {
    let (l, h, v, p) = (12u64, 768u64, 50257u64, 1024u64);
    assert_eq!(l * (12 * h * h + 13 * h) + (v + p) * h + 2 * h, GPT2_124M);
    assert_eq!(params("gpt2-124m.yaml"), (GPT2_124M, GPT2_124M));
    assert_eq!(params("hf/gpt2.json"), (GPT2_124M, GPT2_124M));
}

/// The HF-only configs: Mistral 7B (7.24B) and Qwen2 7B (7.62B, QKV biases).
#[test]
fn mistral_and_qwen2_exact_and_published() {
    assert_eq!(llama_params(32, 4096, 32, 8, 128, 14336, 32000), MISTRAL_7B);
    let qkv_bias = 28 * (28 + 2 * 4) * 128;
    assert_eq!(
        llama_params(28, 3584, 28, 4, 128, 18944, 152064) + qkv_bias,
        QWEN2_7B
    );
    assert_eq!(params("hf/mistral-7b.json"), (MISTRAL_7B, MISTRAL_7B));
    assert_eq!(params("hf/qwen2-7b.json"), (QWEN2_7B, QWEN2_7B));
    assert_published("Mistral 7B", MISTRAL_7B, 7.24e9, 1e-3);
    assert_published("Qwen2 7B", QWEN2_7B, 7.62e9, 1e-3);
}

#[test]
fn tiny_models_exact() {
    assert_eq!(llama_params(2, 64, 4, 2, 16, 128, 256), TINY_GPT);
    let attn = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64;
    let rest = 2 * (attn + 2 * 64 + 64 * 4) + 2 * 256 * 64 + 64;
    assert_eq!(rest + 2 * 4 * 3 * 64 * 128, TINY_MOE_TOTAL);
    assert_eq!(rest + 2 * 2 * 3 * 64 * 128, TINY_MOE_ACTIVE);
    assert_eq!(params("tiny-gpt.yaml"), (TINY_GPT, TINY_GPT));
    assert_eq!(params("tiny-moe.yaml"), (TINY_MOE_TOTAL, TINY_MOE_ACTIVE));
}

// === HF config.json against the YAML ===

/// A `config.json` and the YAML of the same model resolve to the same transformer
/// and expand to the same graph (tensors and segments; names differ).
#[test]
fn hf_config_and_yaml_give_the_same_graph() {
    for (yaml, json) in [
        ("llama3-8b.yaml", "hf/llama3-8b.json"),
        ("llama3-8b.yaml", "hf/llama3-8b-transformers5.json"),
        ("mixtral-8x7b.yaml", "hf/mixtral-8x7b.json"),
        ("deepseek-v3.yaml", "hf/deepseek-v3.json"),
        ("gpt2-124m.yaml", "hf/gpt2.json"),
    ] {
        let (y, j) = (load(yaml), load(json));
        // What `run` would refuse (DeepSeek-V3's YaRN rope) is recorded from the
        // config.json only; it changes no shape and no cost.
        let mut jt = j.transformer().cloned();
        if let Some(t) = jt.as_mut() {
            let fields: Vec<&str> = t.unexecutable.iter().map(|u| u.field.as_str()).collect();
            let want: &[&str] = if json.contains("deepseek") {
                &["rope_scaling.type"]
            } else {
                &[]
            };
            assert_eq!(fields, want, "{json}");
            t.unexecutable.clear();
        }
        assert_eq!(y.transformer(), jt.as_ref(), "{yaml} vs {json}");
        assert_eq!(y.dtype, j.dtype, "{yaml} vs {json}");
        let (gy, gj) = (graph(&y), graph(&j));
        assert_eq!(gy.tensors, gj.tensors, "{yaml} vs {json}");
        assert_eq!(gy.segments, gj.segments, "{yaml} vs {json}");
        assert_eq!(
            gy.param_count(false),
            gj.param_count(false),
            "{yaml} vs {json}"
        );
        assert_eq!(
            gy.param_count(true),
            gj.param_count(true),
            "{yaml} vs {json}"
        );
    }
}

/// `rope_theta` at the top level with `torch_dtype` (Transformers 4) and under
/// `rope_parameters` with `dtype` and an explicit `head_dim` (Transformers 5).
#[test]
fn transformers4_and_5_spellings_give_equal_specs() {
    let v4 = load("hf/llama3-8b.json");
    let v5 = load("hf/llama3-8b-transformers5.json");
    assert_eq!(v4, v5);
    assert_eq!(v4.name, "meta-llama/Meta-Llama-3-8B");
    assert_eq!(
        transformer("hf/llama3-8b-transformers5.json").rope_theta,
        500000.0
    );
}

// === workloads ===

#[test]
fn shipped_workloads() {
    let train = |rel: &str| match load(rel).workload {
        Some(Workload::Train {
            seq_len,
            global_batch,
            ..
        }) => (seq_len, global_batch),
        other => panic!("{rel}: expected a training workload, got {other:?}"),
    };
    assert_eq!(train("gpt3-175b.yaml"), (2048, 1536));
    assert_eq!(train("llama3-8b.yaml"), (8192, 512));
    assert_eq!(train("llama3-70b.yaml"), (8192, 512));
    assert_eq!(train("llama3-405b.yaml"), (8192, 2048));
    assert_eq!(train("gpt2-124m.yaml"), (1024, 512));
    assert_eq!(train("tiny-gpt.yaml"), (32, 8));
    assert_eq!(train("tiny-moe.yaml"), (32, 8));

    let inference = load("llama3-70b-inference.yaml");
    match &inference.workload {
        Some(Workload::Inference {
            prompt_len,
            output_len,
            concurrency,
            slo,
            ..
        }) => {
            assert_eq!((*prompt_len, *output_len, *concurrency), (2048, 256, 64));
            let slo = slo.as_ref().map(|s| (s.ttft_ms, s.tpot_ms));
            assert_eq!(slo, Some((Some(2000.0), Some(50.0))));
        }
        other => panic!("expected an inference workload, got {other:?}"),
    }
    // Same model as the training file.
    assert_eq!(
        inference.transformer(),
        load("llama3-70b.yaml").transformer()
    );
}
