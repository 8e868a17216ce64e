//! Every architecture feature a model file can name, trained and served: each
//! either equals the single-rank run on tensor- and pipeline-parallel plans (and
//! expert-parallel ones for MoE), or the executor refuses its plan before any rank
//! starts (`ExecError::Plan`), naming the feature. A feature the planner takes that
//! then fails inside a rank (a kernel argument of the wrong length, a tensor never
//! produced) fails here: latent attention once reached the RoPE kernel with the
//! wrong widths, and an MoE layer after a dense one ran the dense block's ops.

use crate::executor::{check_plan_with, model_of, plan, Model};
use crate::infer_matrix::generates_like_one_rank;
use meshplan_executor::infer::{infer, InferOptions};
use meshplan_executor::train::{train, ExecError, TrainOptions};

const MOE: &str = "position: rope\n  moe:\n    experts: 4\n    top_k: 2\n    expert_ffn_hidden: 64";

/// A feature: its name, the edits to `models/tiny-gpt.yaml` that give it, and,
/// for one the executor refuses, a phrase its refusal names.
struct Feature {
    name: &'static str,
    edits: &'static [(&'static str, &'static str)],
    refused: Option<&'static str>,
}

const fn runs(name: &'static str, edits: &'static [(&'static str, &'static str)]) -> Feature {
    Feature {
        name,
        edits,
        refused: None,
    }
}

const FEATURES: &[Feature] = &[
    runs("llama", &[]),
    runs(
        "gpt2",
        &[
            ("mlp: swiglu", "mlp: gelu"),
            ("norm: rmsnorm", "norm: layernorm\n  bias: true"),
            ("position: rope", "position: learned\n  max_positions: 64"),
        ],
    ),
    runs("gelu-rmsnorm", &[("mlp: swiglu", "mlp: gelu")]),
    runs("swiglu-layernorm", &[("norm: rmsnorm", "norm: layernorm")]),
    runs("multi-head", &[("kv_heads: 2", "kv_heads: 4")]),
    runs("multi-query", &[("kv_heads: 2", "kv_heads: 1")]),
    runs("head-dim", &[("kv_heads: 2", "kv_heads: 2\n  head_dim: 32")]),
    runs("tied", &[("tie_embeddings: false", "tie_embeddings: true")]),
    runs("qkv-bias", &[("kv_heads: 2", "kv_heads: 2\n  qkv_bias: true")]),
    runs(
        "out-bias",
        &[("kv_heads: 2", "kv_heads: 2\n  attn_out_bias: true")],
    ),
    runs("mlp-bias", &[("kv_heads: 2", "kv_heads: 2\n  mlp_bias: true")]),
    runs("dropout", &[("position: rope", "position: rope\n  dropout: true")]),
    runs(
        "rope-scaling",
        &[(
            "position: rope",
            "position: rope\n  rope_scaling: {type: linear, factor: 2.0}",
        )],
    ),
    runs(
        "padded-vocab",
        &[("vocab: 256", "vocab: 250\n  make_vocab_size_divisible_by: 64")],
    ),
    // A window no sequence reaches changes nothing.
    runs(
        "long-window",
        &[("position: rope", "position: rope\n  sliding_window: 64")],
    ),
    runs("moe", &[("position: rope", MOE)]),
    runs(
        "moe-shared",
        &[(
            "position: rope",
            "position: rope\n  moe:\n    experts: 4\n    top_k: 2\n    expert_ffn_hidden: 64\n    shared_experts: 1\n    shared_expert_ffn_hidden: 64",
        )],
    ),
    runs(
        "moe-dense-first",
        &[(
            "position: rope",
            "position: rope\n  moe:\n    experts: 4\n    top_k: 2\n    expert_ffn_hidden: 64\n    first_dense_layers: 1",
        )],
    ),
    // One expert a token: its weight is 1 and the router learns nothing through it,
    // exactly, on every layout.
    runs(
        "moe-top1",
        &[(
            "position: rope",
            "position: rope\n  moe:\n    experts: 4\n    top_k: 1\n    expert_ffn_hidden: 64",
        )],
    ),
    // GELU experts: one up projection, not [gate | up] halves.
    runs("moe-gelu", &[("mlp: swiglu", "mlp: gelu"), ("position: rope", MOE)]),
    // A gated up projection [64, 2 x 16] no wider than it is tall, as DeepSeek-V3's.
    runs(
        "moe-narrow",
        &[(
            "position: rope",
            "position: rope\n  moe:\n    experts: 4\n    top_k: 2\n    expert_ffn_hidden: 16",
        )],
    ),
    Feature {
        name: "alibi",
        edits: &[("position: rope", "position: alibi")],
        refused: Some("ALiBi"),
    },
    Feature {
        name: "short-window",
        edits: &[("position: rope", "position: rope\n  sliding_window: 4")],
        refused: Some("sliding_window"),
    },
    Feature {
        name: "mla",
        edits: &[(
            "position: rope",
            "position: rope\n  mla: {q_lora_rank: 32, kv_lora_rank: 16, qk_nope_head_dim: 16, qk_rope_head_dim: 8, v_head_dim: 16}",
        )],
        refused: Some("latent attention (`mla`)"),
    },
];

/// Prompts and new tokens: 8-token prompts and 3 new tokens stay inside the long
/// window and the learned positions, and beyond the short window.
const SERVED: &str =
    "workload:\n  kind: inference\n  prompt_len: 8\n  output_len: 3\n  concurrency: 2\n";

fn feature_model(f: &Feature, serve: bool) -> Model {
    model_of(&feature_text(f, serve))
}

fn feature_text(f: &Feature, serve: bool) -> String {
    let mut text = std::fs::read_to_string(format!(
        "{}/../models/tiny-gpt.yaml",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("tiny-gpt");
    for (from, to) in f.edits {
        assert!(text.contains(from), "{}: `{from}`", f.name);
        text = text.replacen(from, to, 1);
    }
    if serve {
        let at = text.find("workload:").expect("a workload");
        text.replace_range(at.., SERVED);
    }
    text
}

/// The layouts a feature runs on: tensor and pipeline parallelism, and expert
/// parallelism where there are experts. Training splits key/value heads over tp
/// (serving copies them), so one kv head trains data-parallel instead.
fn layouts(m: &Model, serve: bool) -> Vec<String> {
    let t = m.spec.transformer().expect("a transformer");
    let tp = if serve || t.kv_heads.is_multiple_of(2) {
        "tp=2"
    } else {
        "dp=2"
    };
    let mut out = vec![tp.to_string(), "pp=2,mbs=1".to_string()];
    if t.moe.is_some() {
        // Experts split over tp, and over ep.
        out.extend(["tp=2,ep=1".into(), "dp=2,ep=2".into()]);
    }
    if serve {
        for c in &mut out {
            c.push_str(",dp_attention=false");
        }
    }
    out
}

/// Whether `result` is the refusal `f` expects (its phrase, before any rank),
/// or a run; anything else fails the feature.
fn refused_or_ran<T>(f: &Feature, what: &str, result: Result<T, ExecError>) -> Option<T> {
    match (result, f.refused) {
        (Ok(run), None) => Some(run),
        (Err(ExecError::Plan(m)), Some(phrase)) => {
            assert!(
                m.contains(phrase),
                "{what}: refused without `{phrase}`: {m}"
            );
            None
        }
        (Ok(_), Some(phrase)) => panic!("{what}: ran, but is refused for `{phrase}`"),
        (Err(e), _) => panic!("{what}: failed as it ran, not refused before: {e:?}"),
    }
}

#[test]
fn every_feature_trains_like_one_rank_or_is_refused_before_any_rank_starts() {
    let mut ran = 0;
    for f in FEATURES {
        let m = feature_model(f, false);
        for cfg in layouts(&m, false) {
            let p = plan(&m, &cfg);
            let what = format!("{} {cfg}", f.name);
            if refused_or_ran(f, &what, train(&p, &TrainOptions::default())).is_some() {
                check_plan_with(&m, &what, p, false);
                ran += 1;
            }
        }
    }
    assert!(ran >= 40, "{ran} runs");
}

#[test]
fn every_feature_generates_like_one_rank_or_is_refused_before_any_rank_starts() {
    let opts = InferOptions {
        requests: vec![vec![5, 9, 2, 7, 1, 3, 8, 4], vec![11, 6, 2, 9, 12, 1, 7, 3]],
        max_new_tokens: 3,
        ..InferOptions::default()
    };
    let mut ran = 0;
    for f in FEATURES {
        let m = feature_model(f, true);
        let single = plan(&m, "dp=1,dp_attention=false");
        for cfg in layouts(&m, true) {
            let p = plan(&m, &cfg);
            let what = format!("{} {cfg}", f.name);
            let Some(run) = refused_or_ran(f, &what, infer(&p, &opts)) else {
                continue;
            };
            generates_like_one_rank(&what, (&p, &single), &opts, &run);
            ran += 1;
        }
    }
    assert!(ran >= 40, "{ran} runs");
}

/// A plan `run` refuses is written with a warning that says why and where it runs
/// instead (a training framework's arguments); `run` then refuses it before any
/// rank starts, exit 2, naming the op. A plan it runs carries no warning.
#[test]
fn plan_says_when_run_will_refuse_a_model_and_run_refuses_it() {
    let dir = crate::cli::temp_dir("features", "refused");
    let mesh = crate::cli::cut_mesh(&dir, 2);
    let mla = FEATURES.iter().find(|f| f.name == "mla").expect("mla");
    let tiny = std::fs::read_to_string(format!(
        "{}/../models/tiny-gpt.yaml",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("tiny-gpt");
    let warning =
        "`meshplan run` will refuse this plan: `block.attn.core`: latent attention (`mla`)";
    for (name, text, refused) in [
        (
            "mla",
            tiny.replacen(mla.edits[0].0, mla.edits[0].1, 1),
            true,
        ),
        ("llama", tiny.clone(), false),
    ] {
        let model = dir.join(format!("{name}.yaml"));
        std::fs::write(&model, text).expect("model");
        let out = dir.join(format!("{name}.json")).display().to_string();
        let model = model.display().to_string();
        let r = crate::cli::meshplan(&["plan", &model, &mesh, "--config", "tp=2", "-o", &out]);
        r.expect_code(0);
        assert_eq!(r.stderr.contains(warning), refused, "{name}: {}", r.stderr);
        if refused {
            assert!(r.stderr.contains("--to megatron"), "{}", r.stderr);
            crate::cli::meshplan(&["run", &out, "--steps", "1"])
                .expect_code(2)
                .stderr_has(&["`block.attn.core`: latent attention (`mla`) is not run"]);
            // A plan for another framework is that framework's to run: no warning.
            let r = crate::cli::meshplan(&[
                "plan",
                &model,
                &mesh,
                "--config",
                "tp=2",
                "--framework",
                "megatron-core",
                "-o",
                &out,
            ]);
            r.expect_code(0);
            assert!(!r.stderr.contains("will refuse"), "{}", r.stderr);
        }
    }
}

/// Each feature `run` trains, its model, and `tp=2,` where its key/value heads
/// split over two tensor ranks.
fn trained_features() -> impl Iterator<Item = (&'static Feature, Model, &'static str)> {
    FEATURES.iter().filter(|f| f.refused.is_none()).map(|f| {
        let m = feature_model(f, false);
        let kv = m.spec.transformer().expect("a transformer").kv_heads;
        (f, m, if kv.is_multiple_of(2) { "tp=2," } else { "" })
    })
}

/// Every feature saved on one layout and resumed on another (or the same) equals
/// the uninterrupted run: bit for bit on the same plan, within `run --check`'s
/// tolerances resharded. A checkpoint holds each weight whole, whatever split
/// (heads, experts, ZeRO parts, stages) wrote it.
#[test]
fn every_feature_resumes_on_another_layout_like_the_uninterrupted_run() {
    let mut ran = 0;
    for (f, m, tp) in trained_features() {
        let t = m.spec.transformer().expect("a transformer");
        // ZeRO-3 with a table tied across stages is refused by the planner.
        let z = if t.tie_embeddings { 1 } else { 3 };
        let pairs: Vec<(String, String)> = if t.moe.is_some() {
            vec![
                ("dp=2,ep=2,pp=2,mbs=1,zero=1".into(), "tp=2,ep=1".into()),
                ("tp=2,ep=1,zero=3,dp=2".into(), "dp=2,ep=2".into()),
                ("dp=2,ep=2".into(), "dp=2,ep=2".into()),
            ]
        } else {
            vec![
                (
                    format!("{tp}pp=2,mbs=1,dp=2,zero={z}"),
                    format!("{tp}dp=2,zero=2"),
                ),
                (format!("{tp}dp=2,zero=1"), "pp=2,mbs=1,cp=2".into()),
                (format!("{tp}pp=2,mbs=1"), format!("{tp}pp=2,mbs=1")),
            ]
        };
        for (a, b) in pairs {
            eprintln!("{}:", f.name);
            crate::ckpt::resumes_like_uninterrupted(&m, &a, &b, false);
            ran += 1;
        }
    }
    assert!(ran >= 60, "{ran} resumes");
}

/// Every feature on the bf16-emulating device (a GPU's rounding) stays within the
/// mixed-precision tolerances of its fp32 single-rank reference, and a 1.5x
/// learning rate does not, on ZeRO-3, context-parallel, pipeline, recomputed and
/// expert layouts.
#[test]
fn every_feature_trains_in_bf16_within_the_mixed_precision_tolerances() {
    let mut ran = 0;
    for (f, m, tp) in trained_features() {
        let t = m.spec.transformer().expect("a transformer");
        let cfgs: Vec<String> = if t.moe.is_some() {
            vec!["dp=2,ep=2,zero=3".into(), "tp=2,ep=1,pp=2,mbs=1".into()]
        } else {
            vec![
                format!("{tp}dp=2,zero=3"),
                "pp=2,mbs=1,cp=2".into(),
                format!("{tp}dp=2,recompute=full"),
            ]
        };
        for cfg in cfgs {
            eprintln!("{}:", f.name);
            crate::matrix::check_bf16(&m, &cfg, &plan(&m, &cfg));
            ran += 1;
        }
    }
    assert!(ran >= 50, "{ran} runs");
}

/// Every feature served disaggregated: a prefill pool hands each request's KV
/// cache to a decode pool of another layout, and `run --check` (fp32, and with a
/// GPU's bf16 rounding) decodes the single-rank tokens with the plan's bytes.
#[test]
fn every_feature_serves_disaggregated_like_one_rank() {
    let dir = crate::cli::temp_dir("features", "disaggregated");
    let wl = dir.join("workload.yaml");
    std::fs::write(
        &wl,
        "kind: inference\nprompt_len: 8\noutput_len: 3\nconcurrency: 2\nserving: {mode: disaggregated, concurrency: {min: 2, max: 2}}\n",
    )
    .expect("workload");
    let (wl, mesh) = (wl.display().to_string(), crate::cli::cut_mesh(&dir, 4));
    let pools = |moe: bool, i: usize| match (moe, i % 2) {
        (false, 0) => ("tp=2", "pp=2"),
        (false, _) => ("pp=2", "tp=2"),
        (true, 0) => ("tp=2", "dp=2,ep=2"),
        (true, _) => ("pp=2", "tp=2,ep=1"),
    };
    for (i, f) in FEATURES.iter().filter(|f| f.refused.is_none()).enumerate() {
        let model = dir.join(format!("{}.yaml", f.name));
        std::fs::write(&model, feature_text(f, true)).expect("model");
        let moe = feature_model(f, true)
            .spec
            .transformer()
            .expect("t")
            .moe
            .is_some();
        let (pre, dec) = pools(moe, i);
        let (pre, dec) = (
            format!("{pre},dp_attention=false"),
            format!("{dec},dp_attention=false"),
        );
        let out = dir.join(format!("{}.json", f.name)).display().to_string();
        let model = model.display().to_string();
        crate::cli::meshplan(&[
            "deploy",
            &model,
            &mesh,
            "--workload",
            &wl,
            "--prefill-config",
            &pre,
            "--decode-config",
            &dec,
            "-o",
            &out,
        ])
        .expect_code(0);
        for backend in ["cpu", "cpu-bf16"] {
            let j = crate::cli::run_checked(&out, &["--backend", backend]);
            assert_eq!(
                j["bytes_match_plan"], true,
                "{} {backend}: {}",
                f.name, j["byte_mismatches"]
            );
            assert!(
                j["kv_transfer_bytes"].as_f64().unwrap_or(0.0) > 0.0,
                "{}: no KV moved",
                f.name
            );
        }
    }
}
