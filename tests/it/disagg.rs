//! Disaggregated serving on the CPU executor: `deploy` plans whose prefill and decode
//! pools have forced layouts (`--prefill-config`, `--decode-config`) run with
//! `run --check`: the prefill ranks send each request's KV cache to the decode
//! ranks, which decode the single-rank run's tokens, and every rank's bytes (each
//! pool's collectives, the KV move, the first tokens) are the plan's; with
//! `--backend cpu-bf16` too, within the mixed-precision tolerance. The KV bytes
//! each rank moves are written out by hand for every layout; the per-GPU figure of
//! the route agrees with the cost model's `kv_transfer`; a pool the executor cannot
//! run, and a plan without its prefill pool, exit 2 naming them.
//!
//! Both tiny models (`tiny-llama-inference`, `tiny-moe`) have 2 layers, 2 KV heads
//! of width 64 / 4 = 16 and an f32 dtype, so one request of 8 prompt tokens caches
//! 8 x 2 layers x 2 (keys, values) x 2 heads x 16 x 4 bytes = 4096 bytes; one head
//! of both layers is 2048, both heads of one layer 2048.

use crate::cli::{meshplan, run_checked, tokens};
use meshplan_cost_model::serving::kv_transfer;
use meshplan_cost_model::{parse_cluster_yaml, PreparedGraph};
use meshplan_executor::disagg::{byte_mismatches, infer_disaggregated, pools};
use meshplan_executor::infer::InferOptions;
use meshplan_ir::kv_move::kv_transfer_bytes;
use meshplan_ir::plan::Plan;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Bytes of one request's whole cache (see the module doc).
const CACHE: f64 = 8.0 * 2.0 * 2.0 * 2.0 * 16.0 * 4.0;

/// `deploy models/MODEL.yaml` on `gpus` ranks, disaggregated, the pools' layouts
/// forced, for 8-token prompts, 8 new tokens and 2 requests in flight per decode
/// instance: the plan's path, its pools checked against the layouts.
fn temp_dir(name: &str) -> PathBuf {
    crate::cli::temp_dir("disagg", name)
}

fn cluster(dir: &Path, gpus: u64) -> String {
    crate::cli::cut_mesh(dir, gpus)
}

fn deploy(dir: &Path, model: &str, gpus: u64, prefill: &str, decode: &str) -> String {
    let wl = dir.join("workload.yaml");
    std::fs::write(
        &wl,
        "kind: inference\nprompt_len: 8\noutput_len: 8\nconcurrency: 2\nserving: {mode: disaggregated, concurrency: {min: 2, max: 2}}\n",
    )
    .expect("workload");
    let (file, model) = match model.rsplit_once('/') {
        Some((_, name)) => (model.to_string(), name.trim_end_matches(".yaml")),
        None => (format!("models/{model}.yaml"), model),
    };
    let out = dir.join(format!("{model}-{prefill}-{decode}.json").replace(',', "_"));
    let out_s = out.display().to_string();
    meshplan(&[
        "deploy",
        &file,
        &cluster(dir, gpus),
        "--workload",
        &wl.display().to_string(),
        "--prefill-config",
        prefill,
        "--decode-config",
        decode,
        "-o",
        &out_s,
    ])
    .expect_code(0);
    let p: Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("plan")).expect("json");
    assert_eq!(p["serving"]["mode"], "disaggregated", "{model}");
    for (pool, cfg) in [("prefill", prefill), ("decode", decode)] {
        for kv in cfg.split(',') {
            let (k, v) = kv.split_once('=').expect("key=value");
            let got = &p["serving"][pool]["strategy"][k];
            let want: Value = serde_yaml_ng::from_str(v).expect("value");
            assert_eq!(got, &want, "{model} {pool} pool {cfg}: {k}");
        }
    }
    out_s
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

fn load(path: &str) -> Plan {
    Plan::from_json(&std::fs::read_to_string(path).expect("plan")).expect("plan json")
}

/// Per rank of a pool plan: the requests its replica serves (request `i` on
/// replica `i % dp`) times `share[stage * tp + tensor rank]`, the rank's bytes of
/// one request.
fn per_rank(plan: &Plan, n: usize, share: &[f64]) -> Vec<f64> {
    let at = |name: &str| plan.mesh.axes.iter().position(|a| a == name).expect("axis");
    let (dp, tp) = (
        plan.mesh.shape[at("dp")] as usize,
        plan.mesh.shape[at("tp")] as usize,
    );
    plan.ranks
        .iter()
        .map(|r| {
            let (stage, replica, t) = (r.coords[at("pp")], r.coords[at("dp")], r.coords[at("tp")]);
            let served = (0..n).filter(|i| i % dp == replica as usize).count();
            served as f64 * share[stage as usize * tp + t as usize]
        })
        .collect()
}

/// Deploys, runs with `--check` and checks the KV bytes: `sent` and `received` are
/// one request's bytes per rank of a prefill and a decode instance (index `stage x
/// tp + tensor rank`). The tokens equal a one-rank plan's run of the same prompts.
fn check_layout(
    tag: &str,
    model: &str,
    gpus: u64,
    pools: (&str, &str),
    sent: &[f64],
    received: &[f64],
) -> Value {
    let dir = temp_dir(tag);
    let path = deploy(&dir, model, gpus, pools.0, pools.1);
    let j = run_checked(&path, &[]);
    assert_eq!(
        j["bytes_match_plan"], true,
        "{tag}: {}",
        j["byte_mismatches"]
    );
    let plan = load(&path);
    let prefill = plan
        .serving
        .as_ref()
        .and_then(|s| s.prefill_plan.as_deref())
        .expect("prefill plan");
    let n = tokens(&j).len();
    assert_eq!(n, requests(&plan), "{tag}: the plan's requests");
    assert_eq!(
        floats(&j["kv_sent_bytes_per_rank"]),
        per_rank(prefill, n, sent),
        "{tag}: KV sent"
    );
    assert_eq!(
        floats(&j["kv_received_bytes_per_rank"]),
        per_rank(&plan, n, received),
        "{tag}: KV received"
    );
    let total: f64 = per_rank(prefill, n, sent).iter().sum();
    assert_eq!(j["kv_transfer_bytes"].as_f64(), Some(total), "{tag}");
    // The single-rank run of the same synthetic prompts.
    let wl = dir.join("single.yaml");
    std::fs::write(
        &wl,
        format!("kind: inference\nprompt_len: 8\noutput_len: 8\nconcurrency: {n}\n"),
    )
    .expect("workload");
    let single = dir.join("single.json").display().to_string();
    meshplan(&[
        "plan",
        &format!("models/{model}.yaml"),
        &cluster(&dir, 1),
        "--workload",
        &wl.display().to_string(),
        "--config",
        "dp=1,tp=1,pp=1,ep=1,dp_attention=false",
        "-o",
        &single,
    ])
    .expect_code(0);
    assert_eq!(
        tokens(&j),
        tokens(&run_checked(&single, &[])),
        "{tag}: tokens"
    );
    assert!(
        tokens(&j).iter().all(|t| t.len() == 8),
        "{tag}: {:?}",
        tokens(&j)
    );
    // With a GPU's bf16 rounding the caches move between device buffers: the same
    // bytes (the in-process communicator carries fp32), the prompts' logits within
    // the mixed-precision tolerance of the single-rank fp32 run.
    let b = run_checked(&path, &["--backend", "cpu-bf16"]);
    assert_eq!(
        b["bytes_match_plan"], true,
        "{tag} bf16: {}",
        b["byte_mismatches"]
    );
    for key in ["kv_sent_bytes_per_rank", "kv_received_bytes_per_rank"] {
        assert_eq!(floats(&b[key]), floats(&j[key]), "{tag} bf16: {key}");
    }
    let gap = b["check"]["max_abs_logit_diff"]
        .as_f64()
        .expect("logit gap");
    assert!(gap > 0.0, "{tag}: bf16 rounding moves the logits");
    eprintln!("{tag} bf16: {}", b["check"]["details"]);
    // Only the decode pool's steps read the moved caches: a head out of place would
    // change the tokens. (bf16 may in general flip a near tie; these keep theirs.)
    assert_eq!(tokens(&b), tokens(&j), "{tag} bf16: tokens");
    j
}

#[test]
fn dense_prefill_tp2_hands_each_head_to_a_decode_tp1() {
    // Each prefill tensor rank holds one KV head of both layers: 8 x 2 layers x 2 x
    // 1 head x 16 x 4 = 2048 bytes per request; the decode rank receives both, 4096.
    check_layout(
        "tp2-tp1",
        "tiny-llama-inference",
        4,
        ("tp=2", "tp=1"),
        &[CACHE / 2.0, CACHE / 2.0],
        &[CACHE],
    );
}

#[test]
fn dense_prefill_tp1_splits_the_cache_over_decode_tp2() {
    // The prefill rank sends the whole cache, 4096 bytes per request; each decode
    // tensor rank receives its head, 2048.
    check_layout(
        "tp1-tp2",
        "tiny-llama-inference",
        3,
        ("tp=1", "tp=2"),
        &[CACHE],
        &[CACHE / 2.0, CACHE / 2.0],
    );
}

#[test]
fn dense_decode_pipeline_gets_each_stage_its_layer() {
    // Decode pp=2: stage s holds layer s, both heads: 8 x 1 layer x 2 x 2 heads x 16
    // x 4 = 2048 bytes per request each; each prefill tensor rank (tp=2) sends its
    // head of both layers, 2048, half to each stage.
    check_layout(
        "tp2-pp2",
        "tiny-llama-inference",
        4,
        ("tp=2", "tp=1,pp=2"),
        &[CACHE / 2.0, CACHE / 2.0],
        &[CACHE / 2.0, CACHE / 2.0],
    );
}

#[test]
fn moe_pools_move_the_attention_cache() {
    // Experts do not cache: the attention's 4096 bytes per request move as for the
    // dense model (prefill tp=2 sends 2048 per rank; decode tp=1 receives 4096).
    check_layout(
        "moe-tp2-tp1",
        "tiny-moe",
        4,
        ("tp=2,ep=1,dp_attention=false", "tp=1"),
        &[CACHE / 2.0, CACHE / 2.0],
        &[CACHE],
    );
    // A decode instance of two attention replicas sharing their experts (dp=2,
    // ep=2): each replica's rank receives whole caches of its own requests.
    check_layout(
        "moe-tp1-ep2",
        "tiny-moe",
        5,
        ("tp=1", "tp=1,dp=2,ep=2,dp_attention=false"),
        &[CACHE],
        &[CACHE],
    );
    // A prefill instance with experts over both tp and ep (each tensor rank routes
    // its slice of the prompt, each slice a capacity group) hands a decode tp=1
    // instance its caches, as the dense layout does.
    check_layout(
        "moe-tp2-ep2-tp1",
        "tiny-moe",
        4,
        ("tp=2,ep=2,dp_attention=false", "tp=1"),
        &[CACHE / 2.0, CACHE / 2.0],
        &[CACHE],
    );
    // Under a capacity, prompts of 7 and 5 tokens slice unevenly; `--check`'s
    // reference routes the prefill pool's slices (the deployment's decode pool has
    // tp=1), which routing whole prompts does not reproduce.
    let dir = temp_dir("moe-slices");
    let path = deploy(
        &dir,
        "tiny-moe-capacity",
        4,
        "tp=2,ep=2,dp_attention=false",
        "tp=1",
    );
    let j = run_checked(&path, &crate::infer_moe::UNEVEN_PROMPTS);
    assert_eq!(tokens(&j).len(), 2);
}

#[test]
fn prompts_of_other_lengths_move_their_own_caches() {
    // Prompts of 3 and 2 tokens: (3 + 2) x 2 layers x 2 x 2 heads x 16 x 4 = 2560
    // bytes in all; bytes are not compared with the plan's shapes, tokens are.
    let dir = temp_dir("prompts");
    let path = deploy(&dir, "tiny-llama-inference", 4, "tp=2", "tp=1");
    let args = [
        "--prompt-ids",
        "1,15,42",
        "--prompt-ids",
        "7,8",
        "--max-new-tokens",
        "5",
    ];
    let j = run_checked(&path, &args);
    assert_eq!(
        j["kv_transfer_bytes"].as_f64(),
        Some(5.0 * 2.0 * 2.0 * 2.0 * 16.0 * 4.0)
    );
    assert!(tokens(&j).iter().all(|t| t.len() == 5), "{:?}", tokens(&j));
    // The human report says how much KV moved: the plan's requests, 4096 bytes each.
    let r = meshplan(&["run", &path]);
    r.expect_code(0);
    let line = format!(
        "KV moved     {} bytes from the prefill pool to the decode pool",
        requests(&load(&path)) as f64 * CACHE
    );
    assert!(r.stdout.contains(&line), "{line}\n{}", r.stdout);
}

/// A bf16 model's pools move their caches in bf16 as the plan prices them: on
/// both CPU engines (which move fp32) the bytes equal the plan's element for
/// element, half the fp32 model's cache (hand-worked, see the module doc).
#[test]
fn a_bf16_models_caches_compare_with_the_plan_element_for_element() {
    let dir = temp_dir("bf16");
    let model = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../models/tiny-llama-inference.yaml"
    );
    let text = std::fs::read_to_string(model).expect("model");
    let model = dir.join("tiny-llama-bf16.yaml");
    std::fs::write(&model, text.replace("\ndtype: f32\n", "\ndtype: bf16\n")).expect("write");
    let path = deploy(&dir, &model.display().to_string(), 4, "tp=2", "tp=1");
    let n = requests(&load(&path)) as f64;
    for backend in ["cpu", "cpu-bf16"] {
        let j = run_checked(&path, &["--backend", backend]);
        assert_eq!(
            j["bytes_match_plan"], true,
            "{backend}: {}",
            j["byte_mismatches"]
        );
        assert_eq!(
            j["kv_transfer_bytes"].as_f64(),
            Some(n * CACHE / 2.0),
            "{backend}"
        );
    }
}

/// The requests of a plan's own workload.
fn requests(plan: &Plan) -> usize {
    match plan.workload {
        meshplan_ir::Workload::Inference { concurrency, .. } => concurrency as usize,
        _ => panic!("an inference plan"),
    }
}

#[test]
fn the_byte_check_sees_a_kv_byte_missing() {
    let dir = temp_dir("tamper");
    let plan = load(&deploy(&dir, "tiny-llama-inference", 4, "tp=2", "tp=1"));
    let n = requests(&plan);
    let opts = InferOptions {
        requests: (0..n)
            .map(|i| (0..8).map(|t| ((i * 31 + t * 7) % 256) as u32).collect())
            .collect(),
        max_new_tokens: 8,
        ..InferOptions::default()
    };
    let mut run = infer_disaggregated(&plan, &opts).unwrap_or_else(|e| panic!("{e}"));
    let bytes = byte_mismatches(&plan, &opts, &run).expect("the plan's shapes");
    assert!(bytes.is_empty(), "{}", bytes.join("\n"));
    assert_eq!(run.kv_transfer_bytes(), n as f64 * CACHE);
    let np = run.prefill_ranks;
    run.kv_received[np] -= 4.0;
    let bytes = byte_mismatches(&plan, &opts, &run).expect("the plan's shapes");
    assert_eq!(bytes.len(), 1, "{bytes:?}");
    assert!(
        bytes[0].contains(&format!("rank {np} kv received")),
        "{bytes:?}"
    );
}

#[test]
fn route_bytes_per_gpu_agree_with_the_cost_model() {
    // f32 models: the route's bytes (4 per element) are the cost model's, also where
    // the decode pool copies a head over more ranks than the prefill pool (tp=1 ->
    // tp=4 over 2 KV heads: each head is sent twice, 2 x 4096 bytes from the one
    // prefill GPU).
    let dir = temp_dir("agree");
    for (gpus, pre, dec) in [
        (4, "tp=2", "tp=1"),
        (3, "tp=1", "tp=2"),
        (4, "tp=2", "tp=1,pp=2"),
        (6, "tp=2", "tp=2,pp=2"),
        (8, "tp=4", "tp=1"),
        (4, "tp=1,pp=2", "tp=2"),
        (5, "tp=1", "tp=4"),
        (6, "tp=2", "tp=4"),
    ] {
        let plan = load(&deploy(&dir, "tiny-llama-inference", gpus, pre, dec));
        let (prefill, decode) = pools(&plan).expect("pools").expect("disaggregated");
        let route = kv_transfer_bytes(prefill, decode, 8, 4.0).expect("route");
        let pg = PreparedGraph::new(&plan.graph);
        let text = std::fs::read_to_string(cluster(&dir, gpus)).expect("cluster");
        let cl = parse_cluster_yaml(&text, "cluster", None).expect("cluster");
        let model = kv_transfer(&pg, &cl, &prefill.strategy, &decode.strategy, 8.0, true);
        assert_eq!(route.per_gpu(), model.bytes_per_gpu, "{pre} -> {dec}");
        assert_eq!(model.bytes, CACHE, "{pre} -> {dec}");
        // One prefill replica sends the whole cache once.
        let replica: f64 = route
            .sent
            .iter()
            .take(prefill.ranks.len() / prefill.strategy.dp as usize)
            .sum();
        let planned = plan
            .serving
            .as_ref()
            .and_then(|s| s.kv_transfer.as_ref())
            .expect("kv_transfer");
        assert_eq!(replica, planned.bytes_per_request, "{pre} -> {dec}");
    }
}

#[test]
fn unsupported_pools_are_refused() {
    let dir = temp_dir("refuse");
    // DP-attention is not run by meshplan's executor, in a pool or alone.
    let p = deploy(&dir, "tiny-moe", 4, "tp=2,ep=2,dp_attention=true", "tp=1");
    meshplan(&["run", &p, "--check"])
        .expect_code(2)
        .stderr_has(&[
            "the prefill pool",
            "dp_attention",
            "not run by meshplan's executor",
        ]);
    // A disaggregated plan whose prefill pool was cut out.
    let p = deploy(&dir, "tiny-llama-inference", 4, "tp=2", "tp=1");
    let mut v: Value =
        serde_json::from_str(&std::fs::read_to_string(&p).expect("plan")).expect("json");
    v["serving"]
        .as_object_mut()
        .expect("serving")
        .remove("prefill_plan");
    let cut = dir.join("cut.json");
    std::fs::write(&cut, v.to_string()).expect("write");
    meshplan(&["run", &cut.display().to_string()])
        .expect_code(2)
        .stderr_has(&["disaggregated", "no prefill_plan"]);
}

/// A disaggregated deployment moves each request's KV cache between device
/// buffers: what crosses between host and device (counted on the host device) is
/// the weights, each pass's ids and greedy tokens, and the logits the report keeps,
/// as in one pool; never a cache (its bytes would read back as activations).
#[test]
fn the_kv_cache_moves_between_device_buffers() {
    use crate::device::crossings::{per_token, Audited};
    use meshplan_executor::device::Crossing::{ActUp, F32Down, IdsDown, IdsUp};
    use meshplan_executor::disagg::infer_disaggregated_on;
    let dir = temp_dir("crossings");
    let plan = load(&deploy(
        &dir,
        "tiny-llama-inference",
        4,
        "tp=2",
        "tp=1,pp=2",
    ));
    let n = requests(&plan);
    let vocab = plan.graph.vocab().expect("vocab");
    let (three, token) = per_token(&|new| {
        let opts = InferOptions {
            requests: (0..n)
                .map(|i| {
                    (0..8)
                        .map(|j| ((7 * i + 3 * j + 1) as u64 % vocab) as u32)
                        .collect()
                })
                .collect(),
            max_new_tokens: new as usize,
            ..InferOptions::default()
        };
        infer_disaggregated_on(&plan, &opts, &|_| Ok(Audited)).unwrap_or_else(|e| panic!("{e}"));
    });
    // Decode pp=2: tokens to the first stage, positions to both.
    let n = n as u64;
    assert_eq!(token.get(&IdsUp).map(|c| c.1), Some(3 * n), "{token:?}");
    // Decode tp=1: each request's token comes back from the one last-stage rank.
    assert_eq!(token.get(&IdsDown).map(|c| c.1), Some(n), "{token:?}");
    assert_eq!(token.len(), 2, "{token:?}");
    // The first token's logits come from the prefill pool, the last one's from the
    // decode pool: 2 rows a request in all, and no cache.
    assert_eq!(
        three.get(&F32Down).map(|c| c.1),
        Some(2 * n * vocab),
        "{three:?}"
    );
    assert_eq!(
        three.keys().copied().collect::<Vec<_>>(),
        [ActUp, IdsUp, F32Down, IdsDown]
    );
}
