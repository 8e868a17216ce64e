//! Inference of mixture-of-experts models end to end: tiny MoE plans (dropless, and
//! with an expert capacity in prefill) planned and run through the command line
//! with `--check` on every layout the inference executor takes (single rank, experts
//! split over `tp`, data, pipeline and expert parallelism, and their mixes, experts
//! over both `tp` and `ep` included), each generating the single-rank run's tokens
//! and sending the plan's bytes; an idle replica of an expert group still serves
//! its experts.

use crate::cli::{meshplan, run_checked, tokens};
use meshplan_executor::infer::{
    byte_mismatches, check_inference, infer, routed_ep_summary, InferOptions,
};
use meshplan_ir::plan::Plan;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Plans `models/MODEL.yaml` with `cfg` (every degree named) on `gpus` ranks for an
/// inference workload of `concurrency` 12-token prompts and 6 new tokens: the
/// plan's path, its strategy checked against `cfg`.
fn temp_dir(name: &str) -> PathBuf {
    crate::cli::temp_dir("infer-moe", name)
}

fn cluster(dir: &Path, gpus: u64) -> String {
    crate::cli::cut_mesh(dir, gpus)
}

fn plan(dir: &Path, model: &str, cfg: &str, gpus: u64, concurrency: u64) -> String {
    let wl = dir.join(format!("workload-{concurrency}.yaml"));
    std::fs::write(
        &wl,
        format!("kind: inference\nprompt_len: 12\noutput_len: 6\nconcurrency: {concurrency}\n"),
    )
    .expect("workload");
    let out = dir.join(format!(
        "{model}-{}-{concurrency}.json",
        cfg.replace(',', "_")
    ));
    let (wl, out_s) = (wl.display().to_string(), out.display().to_string());
    meshplan(&[
        "plan",
        &format!("models/{model}.yaml"),
        &cluster(dir, gpus),
        "--workload",
        &wl,
        "--config",
        &format!("{cfg},dp_attention=false"),
        "-o",
        &out_s,
    ])
    .expect_code(0);
    let p: Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("plan")).expect("plan json");
    for kv in cfg.split(',') {
        let (k, v) = kv.split_once('=').expect("key=value");
        assert_eq!(
            p["strategy"][k].as_u64(),
            v.parse::<u64>().ok(),
            "{model} {cfg}: the plan's {k}"
        );
    }
    out_s
}

/// Every layout of `layouts` (configuration, ranks) runs the plan's own workload
/// with `--check`: the single-rank run's tokens, and the plan's bytes on every rank
/// and axis; all agree with the one-rank plan's tokens.
fn check_layouts(tag: &str, model: &str, layouts: &[(&str, u64)]) {
    let dir = temp_dir(tag);
    let single = plan(&dir, model, "dp=1,tp=1,pp=1,ep=1", 1, 2);
    let want = tokens(&run_checked(&single, &[]));
    assert_eq!(want.len(), 2);
    assert!(want.iter().all(|t| t.len() == 6), "{want:?}");
    for &(cfg, gpus) in layouts {
        let p = plan(&dir, model, cfg, gpus, 2);
        let j = run_checked(&p, &[]);
        assert_eq!(
            j["bytes_match_plan"], true,
            "{model} {cfg}: {}",
            j["byte_mismatches"]
        );
        assert_eq!(tokens(&j), want, "{model} {cfg}: tokens");
    }
}

#[test]
fn moe_inference_splits_experts_over_tp_and_equals_single_rank() {
    check_layouts(
        "tp",
        "tiny-moe",
        &[("dp=1,tp=2,pp=1,ep=1", 2), ("dp=1,tp=2,pp=2,ep=1", 4)],
    );
}

#[test]
fn moe_inference_over_dp_and_pp_equals_single_rank() {
    check_layouts(
        "dp-pp",
        "tiny-moe",
        &[
            ("dp=2,tp=1,pp=1,ep=1", 2),
            ("dp=1,tp=1,pp=2,ep=1", 2),
            ("dp=2,tp=2,pp=2,ep=1", 8),
        ],
    );
}

#[test]
fn moe_inference_over_ep_equals_single_rank() {
    check_layouts(
        "ep",
        "tiny-moe",
        &[
            ("dp=2,tp=1,pp=1,ep=2", 2),
            ("dp=2,tp=1,pp=2,ep=2", 4),
            ("dp=4,tp=1,pp=1,ep=4", 4),
        ],
    );
}

/// A dense first layer before an MoE one: each layer runs its own block's ops,
/// which share their names.
#[test]
fn dense_then_moe_layers_generate_like_one_rank() {
    check_layouts(
        "dense-first",
        "tiny-moe-dense-first",
        &[
            ("dp=1,tp=2,pp=1,ep=1", 2),
            ("dp=1,tp=1,pp=2,ep=1", 2),
            ("dp=2,tp=1,pp=1,ep=2", 2),
        ],
    );
}

#[test]
fn moe_inference_with_expert_capacity_equals_single_rank() {
    // Prefill holds each expert to its capacity over the prompt (the same tokens
    // dropped with one rank or many); decoding routes dropless, as the plan prices.
    check_layouts(
        "capacity",
        "tiny-moe-capacity",
        &[
            ("dp=1,tp=2,pp=1,ep=1", 2),
            ("dp=1,tp=1,pp=2,ep=1", 2),
            ("dp=2,tp=1,pp=1,ep=2", 2),
        ],
    );
}

#[test]
fn an_idle_replica_still_serves_its_experts() {
    // One request on two replicas whose experts are split between them: the idle
    // one runs every pass with no tokens of its own, or the other would wait on it.
    // With experts over tp too, the idle replica's two tensor ranks both serve.
    let dir = temp_dir("idle");
    let layouts = [("dp=2,tp=1,pp=1,ep=2", 2), ("dp=2,tp=2,pp=1,ep=4", 4)];
    for (model, (cfg, gpus)) in ["tiny-moe", "tiny-moe-capacity"]
        .into_iter()
        .flat_map(|m| layouts.map(|l| (m, l)))
    {
        let single = plan(&dir, model, "dp=1,tp=1,pp=1,ep=1", 1, 1);
        let p = plan(&dir, model, cfg, gpus, 1);
        let j = run_checked(&p, &[]);
        assert_eq!(j["bytes_match_plan"], true, "{}", j["byte_mismatches"]);
        assert!(j["measured"]["comm_bytes_per_gpu"]["ep"].as_f64() > Some(0.0));
        assert_eq!(
            tokens(&j),
            tokens(&run_checked(&single, &[])),
            "{model} {cfg}"
        );
        // Three prompts of different lengths: one replica prefills two, the other
        // one and then idles through a pass; capacity buffers of unequal prompts
        // exchange their counts.
        let prompts = [
            "--prompt-ids",
            "1,2,3",
            "--prompt-ids",
            "4,5,6,7,8",
            "--prompt-ids",
            "9,10",
            "--max-new-tokens",
            "4",
        ];
        let a = run_checked(&p, &prompts);
        let b = run_checked(&single, &prompts);
        assert_eq!(tokens(&a), tokens(&b), "{model} {cfg}");
        assert_eq!(tokens(&a).len(), 3);
    }
    // The human report names the expert-parallel bytes the router decided, which
    // the byte check leaves out.
    let p = plan(&dir, "tiny-moe", "dp=2,tp=1,pp=1,ep=2", 2, 2);
    let r = meshplan(&["run", &p, "--check"]);
    r.expect_code(0);
    assert!(
        r.stdout
            .contains("routed bytes expert-parallel bytes that follow the router"),
        "{}",
        r.stdout
    );
}

#[test]
fn moe_inference_over_both_tp_and_ep_equals_single_rank() {
    // Each tensor rank routes its slice of the replica's tokens over ep and the
    // slices' outputs are gathered over tp. At dp=2 each replica decodes one
    // request: one row on two tensor ranks, the second slice empty and padded.
    check_layouts(
        "tp-ep",
        "tiny-moe",
        &[
            ("dp=1,tp=2,pp=1,ep=2", 2),
            ("dp=2,tp=2,pp=1,ep=2", 4),
            ("dp=2,tp=2,pp=1,ep=4", 4),
            ("dp=1,tp=2,pp=2,ep=2", 4),
        ],
    );
    check_layouts(
        "tp-ep-capacity",
        "tiny-moe-capacity",
        &[("dp=1,tp=2,pp=1,ep=2", 2), ("dp=2,tp=2,pp=1,ep=4", 4)],
    );
}

#[test]
fn plan_and_deploy_say_when_run_will_refuse_the_plan() {
    // DP-attention layouts are planned (and exported) but not run by meshplan's
    // executor: `plan` and `deploy` say so when they write one, `run` refuses it.
    let dir = temp_dir("not-run");
    let warning = "`meshplan run` will refuse this plan: dp_attention plans are not run";
    let wl = dir.join("workload.yaml");
    std::fs::write(
        &wl,
        "kind: inference\nprompt_len: 12\noutput_len: 6\nconcurrency: 2\n",
    )
    .expect("workload");
    let mesh = cluster(&dir, 4);
    let out = dir.join("dpa.json").display().to_string();
    // Whether the command succeeds with the warning.
    let warns = |args: &[&str]| {
        let r = meshplan(args);
        r.expect_code(0);
        r.stderr.contains(warning)
    };
    let (wl, model) = (wl.display().to_string(), "models/tiny-moe.yaml");
    let planned = |config: &str| {
        warns(&[
            "plan",
            model,
            &mesh,
            "--workload",
            &wl,
            "--config",
            config,
            "-o",
            &out,
        ])
    };
    assert!(planned("dp=2,tp=2,ep=2,dp_attention=true"));
    meshplan(&["run", &out])
        .expect_code(2)
        .stderr_has(&["dp_attention plans are not run"]);
    assert!(!planned("dp=2,tp=2,ep=2,dp_attention=false"));
    // A deployment says it of its prefill pool too.
    let disagg = dir.join("disagg.yaml");
    std::fs::write(
        &disagg,
        "kind: inference\nprompt_len: 8\noutput_len: 8\nconcurrency: 2\nserving: {mode: disaggregated, concurrency: {min: 2, max: 2}}\n",
    )
    .expect("workload");
    let (disagg, deploy_out) = (
        disagg.display().to_string(),
        dir.join("deploy.json").display().to_string(),
    );
    let deployed = |prefill: &str| {
        warns(&[
            "deploy",
            model,
            &mesh,
            "--workload",
            &disagg,
            "--prefill-config",
            prefill,
            "--decode-config",
            "tp=1",
            "-o",
            &deploy_out,
        ])
    };
    assert!(deployed("tp=2,ep=2,dp_attention=true"));
    assert!(!deployed("tp=2,ep=2,dp_attention=false"));
}

/// The prompts of [`sliced_experts_hold_each_slice_to_capacity_as_the_reference_does`]
/// as `run` arguments: 7 and 5 tokens, 5 new ones.
pub(crate) const UNEVEN_PROMPTS: [&str; 6] = [
    "--prompt-ids",
    "3,14,15,92,65,35,89",
    "--prompt-ids",
    "79,32,38,46,26",
    "--max-new-tokens",
    "5",
];

#[test]
fn sliced_experts_hold_each_slice_to_capacity_as_the_reference_does() {
    // Prompts of 7 and 5 tokens on two tensor ranks: slices of 4 and 3, and of 3
    // and 2, each its own capacity group, the replicas' slices unequal (their
    // counts exchanged). The single-rank reference routes the same slices, one
    // after the other; routing each whole prompt as one group keeps other tokens.
    let dir = temp_dir("slices");
    let path = plan(&dir, "tiny-moe-capacity", "dp=2,tp=2,pp=1,ep=4", 4, 2);
    let single = load(&plan(
        &dir,
        "tiny-moe-capacity",
        "dp=1,tp=1,pp=1,ep=1",
        1,
        2,
    ));
    let sharded = load(&path);
    let opts = InferOptions {
        requests: vec![vec![3, 14, 15, 92, 65, 35, 89], vec![79, 32, 38, 46, 26]],
        max_new_tokens: 5,
        ..InferOptions::default()
    };
    assert_eq!(opts.reference_of(&sharded).moe_token_slices, 2);
    assert_eq!(opts.reference_of(&single).moe_token_slices, 1);
    let run = infer(&sharded, &opts).unwrap_or_else(|e| panic!("{e}"));
    let reference = infer(&single, &opts.reference_of(&sharded)).unwrap_or_else(|e| panic!("{e}"));
    let whole = infer(&single, &opts).unwrap_or_else(|e| panic!("{e}"));
    if let Err(e) = check_inference(&run, &reference) {
        panic!("against the sliced reference: {e}");
    }
    assert!(
        check_inference(&run, &whole).is_err(),
        "whole-prompt capacity groups give the same logits: the slices are not tested"
    );
    // With bf16 compute: within the mixed-precision tolerance of the same reference.
    let bf16 = meshplan_executor::infer::infer_on(&sharded, &opts, &|_| {
        Ok(meshplan_executor::device::emulate::Bf16Host)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    if let Err(e) = meshplan_executor::infer::check_inference_mixed(&bf16, &reference) {
        panic!("bf16 against the sliced reference: {e}");
    }
    // The command line's --check takes the same reference.
    let j = run_checked(&path, &UNEVEN_PROMPTS);
    assert_eq!(tokens(&j), tokens_of(&run));
}

fn tokens_of(r: &meshplan_executor::infer::InferReport) -> Vec<Vec<u64>> {
    (r.requests.iter())
        .map(|q| q.tokens.iter().map(|&t| u64::from(t)).collect())
        .collect()
}

#[test]
fn capacity_prefill_bytes_are_compared_and_routed_ones_reported() {
    // With an expert capacity, prefill pads every expert's buffer: those
    // expert-parallel bytes are the plan's exactly and compared; decode steps route
    // dropless, and their bytes are reported beside the plan's balanced figure.
    let dir = temp_dir("bytes");
    let path = plan(&dir, "tiny-moe-capacity", "dp=2,tp=1,pp=1,ep=2", 2, 2);
    let capacity = load(&path);
    let opts = InferOptions {
        requests: (0..2)
            .map(|i| (0..12).map(|t| ((i * 31 + t * 7) % 256) as u32).collect())
            .collect(),
        max_new_tokens: 6,
        ..InferOptions::default()
    };
    let r = infer(&capacity, &opts).unwrap_or_else(|e| panic!("{e}"));
    let bytes = byte_mismatches(&capacity, &opts, &r).expect("the plan's shapes");
    assert!(bytes.is_empty(), "{}", bytes.join("\n"));
    for (rank, c) in r.counts.iter().enumerate() {
        let (routed, planned) = r.routed_ep_bytes[rank];
        let total = c.axis_bytes_sent("ep");
        assert!(
            routed > 0.0 && planned > 0.0,
            "rank {rank}: decode exchanges"
        );
        assert!(
            total > routed,
            "rank {rank}: prefill's padded bytes compared"
        );
    }
    let line = routed_ep_summary(&r).expect("routed bytes");
    assert!(line.contains("not compared"), "{line}");
    // Dropless, every pass follows the router.
    let path = plan(&dir, "tiny-moe", "dp=2,tp=1,pp=1,ep=2", 2, 2);
    let dropless = load(&path);
    let r = infer(&dropless, &opts).unwrap_or_else(|e| panic!("{e}"));
    for (rank, c) in r.counts.iter().enumerate() {
        assert_eq!(c.axis_bytes_sent("ep"), r.routed_ep_bytes[rank].0);
    }
}

fn load(path: &str) -> Plan {
    Plan::from_json(&std::fs::read_to_string(path).expect("plan")).unwrap_or_else(|e| panic!("{e}"))
}

/// Routed experts at inference, bit for bit: every request's tokens and logits and
/// every rank's bytes as the inference interpreter on the retired `Backend` trait
/// recorded them (goldens `infer-moe-*`), replicated, split over tp and over ep,
/// dropless and under a capacity.
#[test]
fn moe_inference_reproduces_its_goldens() {
    let dir = temp_dir("goldens");
    let opts = InferOptions {
        requests: (0..2)
            .map(|i| (0..12).map(|t| ((i * 31 + t * 7) % 256) as u32).collect())
            .collect(),
        max_new_tokens: 6,
        step_logits: true,
        ..InferOptions::default()
    };
    for (model, cfg, gpus) in [
        ("tiny-moe", "dp=1,tp=1,pp=1,ep=1", 1),
        ("tiny-moe", "dp=1,tp=2,pp=1,ep=1", 2),
        ("tiny-moe", "dp=2,tp=1,pp=1,ep=2", 2),
        ("tiny-moe", "dp=1,tp=1,pp=2,ep=1", 2),
        ("tiny-moe-capacity", "dp=2,tp=1,pp=1,ep=2", 2),
        ("tiny-moe-capacity", "dp=1,tp=2,pp=1,ep=1", 2),
    ] {
        let p = load(&plan(&dir, model, cfg, gpus, 2));
        let r = infer(&p, &opts).unwrap_or_else(|e| panic!("{model} {cfg}: {e}"));
        crate::exec_golden::check_infer(&format!("infer-{model}-{cfg}"), &r);
        // With bf16 compute (the experts themselves on the host in fp32): within
        // the mixed-precision tolerance of the fp32 run.
        let bf16 = meshplan_executor::infer::infer_on(&p, &opts, &|_| {
            Ok(meshplan_executor::device::emulate::Bf16Host)
        })
        .unwrap_or_else(|e| panic!("{model} {cfg}: {e}"));
        let (line, _) = meshplan_executor::infer::check_inference_mixed(&bf16, &r)
            .unwrap_or_else(|e| panic!("{model} {cfg} bf16: {e}"));
        eprintln!("{model} {cfg} bf16: {line}");
    }
}
