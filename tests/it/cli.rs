//! The `meshplan` binary end to end: `inspect --json` and `estimate --json` print the
//! contract's keys (shared/design/CONTRACT.md), bad input exits 2, a configuration
//! that does not fit exits 3 with the arithmetic, and nothing panics.
//!
//! The binary is the release one `crate::bin` builds once per run (a no-op when the
//! workspace's release build is fresh): one build profile for every CLI test, not a
//! second, debug build of the whole workspace.

use serde_json::Value;
use std::path::PathBuf;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
const BIN: &str = "target/release/meshplan";

/// One run of the binary.
pub(crate) struct Run {
    pub(crate) args: String,
    pub(crate) code: i32,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Run {
    #[track_caller]
    pub(crate) fn expect_code(&self, code: i32) -> &Self {
        assert_eq!(
            self.code, code,
            "meshplan {}: exit {} (want {code})\nstdout:\n{}\nstderr:\n{}",
            self.args, self.code, self.stdout, self.stderr
        );
        self
    }

    #[track_caller]
    pub(crate) fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "meshplan {}: stdout is not one JSON object ({e}):\n{}",
                self.args, self.stdout
            )
        })
    }

    /// The first line of stdout starting with `prefix`.
    #[track_caller]
    pub(crate) fn stdout_line(&self, prefix: &str) -> &str {
        self.stdout
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| {
                panic!(
                    "meshplan {}: no `{prefix}` line in:\n{}",
                    self.args, self.stdout
                )
            })
    }

    #[track_caller]
    pub(crate) fn stderr_has(&self, needles: &[&str]) -> &Self {
        for n in needles {
            assert!(
                self.stderr.contains(n),
                "meshplan {}: stderr lacks `{n}`:\n{}",
                self.args,
                self.stderr
            );
        }
        self
    }
}

/// Runs `meshplan ARGS` in the workspace root; never a panic.
#[track_caller]
pub(crate) fn meshplan(args: &[&str]) -> Run {
    let out = crate::bin::command()
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {BIN}: {e}"));
    let run = Run {
        args: args.join(" "),
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert!(
        !run.stderr.contains("panicked"),
        "meshplan {} panicked:\n{}",
        run.args,
        run.stderr
    );
    if let Some(dump) = debug_dump(&run.stderr) {
        panic!(
            "meshplan {}: stderr shows a Rust debug dump (`{dump}`) where a message in words belongs:\n{}",
            run.args, run.stderr
        );
    }
    assert!(
        out.status.code().is_some(),
        "meshplan {} was killed by a signal",
        run.args
    );
    run
}

/// A file in the temporary directory, unique to this process and test.
pub(crate) fn temp_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("meshplan-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    std::fs::write(&path, text).expect("temp file");
    path
}

/// `run PLAN --check --json EXTRA` on an inference plan: exit 0, the check passed;
/// the report.
#[track_caller]
pub(crate) fn run_checked(plan: &str, extra: &[&str]) -> Value {
    let mut args = vec!["run", plan, "--check", "--json"];
    args.extend_from_slice(extra);
    let r = meshplan(&args);
    r.expect_code(0);
    let j = r.json();
    assert_eq!(j["check"]["passed"], true, "{plan}: {}", j["check"]);
    j
}

/// Each request's generated tokens in a `run --json` report.
pub(crate) fn tokens(j: &Value) -> Vec<Vec<u64>> {
    j["requests"]
        .as_array()
        .expect("requests")
        .iter()
        .map(|r| {
            r["tokens"]
                .as_array()
                .expect("tokens")
                .iter()
                .map(|t| t.as_u64().expect("token"))
                .collect()
        })
        .collect()
}

/// A fresh temporary directory named for the test module (`prefix`) and `name`.
pub(crate) fn temp_dir(prefix: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("meshplan-{prefix}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// The CPU test mesh cut to `gpus` ranks in `dir`, so a configuration names every
/// degree; the cluster file's path.
pub(crate) fn cut_mesh(dir: &std::path::Path, gpus: u64) -> String {
    let mesh = std::fs::read_to_string(format!("{ROOT}/topologies/cpu-test-mesh.yaml"))
        .expect("cpu-test-mesh.yaml");
    assert!(
        mesh.contains("gpus_per_node: 8"),
        "the mesh names its 8 ranks"
    );
    let text = mesh.replace("gpus_per_node: 8", &format!("gpus_per_node: {gpus}"));
    let path = dir.join(format!("cluster-{gpus}.yaml"));
    std::fs::write(&path, text).expect("cluster");
    path.display().to_string()
}

/// `meshplan plan MODEL` on the 8-thread CPU mesh under `cfg`, written to a temporary
/// `name`; the plan's path.
pub(crate) fn plan_file(name: &str, model: &str, cfg: &str) -> PathBuf {
    let out = temp_file(name, "");
    let path = out.to_str().expect("utf-8 path");
    meshplan(&[
        "plan",
        model,
        "topologies/cpu-test-mesh.yaml",
        "--config",
        cfg,
        "--quiet",
        "-o",
        path,
    ])
    .expect_code(0);
    out
}

#[track_caller]
fn number(v: &Value, key: &str) -> f64 {
    v.get(key)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("key `{key}` missing or not a number in {v}"))
}

#[track_caller]
fn object<'a>(v: &'a Value, key: &str, keys: &[&str]) -> &'a Value {
    let o = v
        .get(key)
        .filter(|o| o.is_object())
        .unwrap_or_else(|| panic!("key `{key}` missing or not an object in {v}"));
    for k in keys {
        number(o, k);
    }
    o
}

const MEMORY_KEYS: &[&str] = &[
    "params",
    "grads",
    "optimizer",
    "activations",
    "kv_cache",
    "workspace",
    "total",
];

/// Every key of the contract's estimate output, with its type.
#[track_caller]
fn check_estimate_keys(v: &Value) {
    assert!(v.get("feasible").is_some_and(Value::is_boolean), "{v}");
    let cfg = v.get("config").expect("config");
    for k in ["dp", "tp", "pp", "cp", "ep", "mbs", "zero", "vpp"] {
        assert!(cfg.get(k).is_some_and(Value::is_u64), "config.{k} in {cfg}");
    }
    for k in ["recompute", "schedule"] {
        assert!(
            cfg.get(k).is_some_and(Value::is_string),
            "config.{k} in {cfg}"
        );
    }
    assert!(cfg.get("sp").is_some_and(Value::is_boolean), "config.sp");
    for k in [
        "step_time_s",
        "tokens_per_s",
        "model_tflops_per_gpu",
        "hardware_tflops_per_gpu",
        "mfu",
        "hfu",
    ] {
        number(v, k);
    }
    let m = object(v, "memory_per_gpu_bytes", MEMORY_KEYS);
    let parts: f64 = MEMORY_KEYS[..6].iter().map(|k| number(m, k)).sum();
    let total = number(m, "total");
    assert!((parts - total).abs() <= 1e-9 * total, "{m}");
    let t = object(
        v,
        "time_breakdown_s",
        &["compute", "exposed_comm", "bubble"],
    );
    let step = number(v, "step_time_s");
    let sum = number(t, "compute") + number(t, "exposed_comm") + number(t, "bubble");
    assert!(step > 0.0);
    assert!((sum - step).abs() <= 1e-9 * step, "{t} vs {step}");
    object(v, "comm_bytes_per_gpu", &["dp", "tp", "pp", "cp", "ep"]);
}

// === inspect ===

#[test]
fn inspect_json_prints_the_contract_keys() {
    // GPT-3 175B: 174,615,846,912 parameters; forward FLOPs per token at s = 2048:
    // 24 L h^2 + 4 L s h + 2 h V = 358,814,318,592; training 3x.
    let r = meshplan(&["inspect", "models/gpt3-175b.yaml", "--json"]);
    r.expect_code(0);
    let v = r.json();
    assert_eq!(number(&v, "params_total"), 174_615_846_912.0);
    assert_eq!(number(&v, "params_active"), 174_615_846_912.0);
    assert_eq!(number(&v, "flops_per_token_forward"), 358_814_318_592.0);
    assert_eq!(number(&v, "flops_per_token_train"), 3.0 * 358_814_318_592.0);
    let m = object(&v, "memory_bytes", MEMORY_KEYS);
    // Training state as meshplan's executor holds a bf16 model, 18 bytes per
    // parameter (fp32 gradients); as DeepSpeed's fp16 ZeRO holds it, the paper's 16.
    let states = |m: &Value| number(m, "params") + number(m, "grads") + number(m, "optimizer");
    assert_eq!(states(m), 18.0 * 174_615_846_912.0);
    let r = meshplan(&[
        "inspect",
        "models/gpt3-175b.yaml",
        "--framework",
        "deepspeed",
        "--json",
    ]);
    r.expect_code(0);
    let v = r.json();
    assert_eq!(
        states(object(&v, "memory_bytes", MEMORY_KEYS)),
        16.0 * 174_615_846_912.0
    );
}

#[test]
fn inspect_moe_active_parameters() {
    // Mixtral 8x7B: 46,702,792,704 total, 12,879,925,248 active (top 2 of 8).
    let r = meshplan(&["inspect", "models/mixtral-8x7b.yaml", "--json"]);
    r.expect_code(0);
    let v = r.json();
    assert_eq!(number(&v, "params_total"), 46_702_792_704.0);
    assert_eq!(number(&v, "params_active"), 12_879_925_248.0);
}

#[test]
fn inspect_inference_model_has_a_kv_cache() {
    // 64 requests x 2304 tokens x 80 layers x 4096 bytes = 48,318,382,080.
    let r = meshplan(&["inspect", "models/llama3-70b-inference.yaml", "--json"]);
    r.expect_code(0);
    let m = object(&r.json(), "memory_bytes", MEMORY_KEYS).clone();
    assert_eq!(number(&m, "kv_cache"), 48_318_382_080.0);
}

#[test]
fn inspect_text_goes_to_stdout_without_json() {
    let r = meshplan(&["inspect", "models/gpt3-175b.yaml"]);
    r.expect_code(0);
    assert!(r.stdout.contains("gpt3-175b"), "{}", r.stdout);
    assert!(serde_json::from_str::<Value>(&r.stdout).is_err());
}

// === estimate ===

#[test]
fn estimate_json_train_has_every_contract_key() {
    // GPT-3 on 480 DGX A100 nodes, 8 x 8 x 60, full recomputation: fits, 26
    // micro-batches (ceil(1536 / 60)).
    let r = meshplan(&[
        "estimate",
        "models/gpt3-175b.yaml",
        "topologies/dgx-a100-80g.yaml",
        "--nodes",
        "480",
        "--config",
        "dp=60,tp=8,pp=8,mbs=1,recompute=full",
        "--json",
    ]);
    r.expect_code(0);
    let v = r.json();
    check_estimate_keys(&v);
    assert_eq!(v["feasible"], Value::Bool(true));
    let cfg = &v["config"];
    assert_eq!(
        (&cfg["dp"], &cfg["tp"], &cfg["pp"], &cfg["mbs"]),
        (
            &Value::from(60),
            &Value::from(8),
            &Value::from(8),
            &Value::from(1)
        )
    );
    assert_eq!(cfg["recompute"], Value::from("full"));
    assert_eq!(v["microbatches"], Value::from(26));
    // Tokens per step: 1536 x 2048.
    let tokens = number(&v, "tokens_per_s") * number(&v, "step_time_s");
    assert!((tokens - 1536.0 * 2048.0).abs() < 1e-6 * tokens, "{tokens}");
    // Full recomputation: HFU / MFU = Eq. 3 / Eq. 7
    //   = 96 (1 + s/6h + V/16lh) / (72 (1 + s/6h + V/12hl))
    //   = 4/3 x 1.0304905 / 1.0313947 = 1.332164 for GPT-3.
    let (s, h, l, vv) = (2048.0, 12288.0, 96.0, 51200.0);
    let ratio = 96.0 * (1.0 + s / (6.0 * h) + vv / (16.0 * l * h))
        / (72.0 * (1.0 + s / (6.0 * h) + vv / (12.0 * h * l)));
    let got = number(&v, "hfu") / number(&v, "mfu");
    assert!((got - ratio).abs() < 1e-9, "{got} vs {ratio}");
    // Inference keys are absent from a training estimate.
    assert!(v.get("ttft_s").is_none(), "{v}");
}

#[test]
fn estimate_json_inference_has_the_inference_keys() {
    let r = meshplan(&[
        "estimate",
        "models/llama3-70b-inference.yaml",
        "topologies/h200-node.yaml",
        "--config",
        "tp=8",
        "--json",
    ]);
    r.expect_code(0);
    let v = r.json();
    check_estimate_keys(&v);
    for k in ["ttft_s", "tpot_s", "output_tokens_per_s"] {
        assert!(number(&v, k) > 0.0, "{k} in {v}");
    }
    assert!(v.get("max_concurrency").is_some_and(Value::is_u64), "{v}");
    // KV cache of 64 requests x 2304 tokens x 80 layers x 4096 bytes, over 8 kv heads
    // on 8 ranks: 48,318,382,080 / 8 = 6,039,797,760 bytes per GPU.
    assert_eq!(
        number(&v["memory_per_gpu_bytes"], "kv_cache"),
        6_039_797_760.0
    );
    // Output tokens per second: 64 requests / TPOT.
    let tps = number(&v, "output_tokens_per_s");
    let want = 64.0 / number(&v, "tpot_s");
    assert!((tps - want).abs() <= 1e-9 * want, "{tps} vs {want}");
}

#[test]
fn estimate_text_mode() {
    let r = meshplan(&[
        "estimate",
        "models/llama3-8b.yaml",
        "topologies/dgx-a100-80g.yaml",
        "--config",
        "tp=8",
    ]);
    r.expect_code(0);
    assert!(r.stdout.contains("feasible"), "{}", r.stdout);
    assert!(r.stdout.contains("GiB"), "{}", r.stdout);
}

#[test]
fn hf_config_json_with_workload_flags() {
    // Llama 3 8B from its Hugging Face config.json: 8,030,261,248 parameters.
    let r = meshplan(&["inspect", "models/hf/llama3-8b.json", "--json"]);
    r.expect_code(0);
    assert_eq!(number(&r.json(), "params_total"), 8_030_261_248.0);
    let r = meshplan(&[
        "estimate",
        "models/hf/llama3-8b.json",
        "topologies/dgx-a100-80g.yaml",
        "--config",
        "tp=8",
        "--seq-len",
        "4096",
        "--global-batch",
        "64",
        "--json",
    ]);
    r.expect_code(0);
    let v = r.json();
    check_estimate_keys(&v);
    // dp = 1, mbs = 1: 64 micro-batches of one 4096-token sequence.
    assert_eq!(v["microbatches"], Value::from(64));
    let tokens = number(&v, "tokens_per_s") * number(&v, "step_time_s");
    assert!((tokens - 64.0 * 4096.0).abs() < 1e-6 * tokens, "{tokens}");
}

// === exit 2: bad input ===

#[test]
fn missing_model_file_exits_2() {
    let r = meshplan(&["inspect", "models/no-such-model.yaml", "--json"]);
    r.expect_code(2).stderr_has(&["no-such-model.yaml"]);
    assert!(r.stdout.trim().is_empty(), "{}", r.stdout);
    let r = meshplan(&[
        "estimate",
        "models/gpt3-175b.yaml",
        "topologies/no-such-cluster.yaml",
        "--config",
        "tp=8",
    ]);
    r.expect_code(2).stderr_has(&["no-such-cluster.yaml"]);
}

#[test]
fn unknown_yaml_key_exits_2_naming_file_line_and_key() {
    // `hiddenn` on line 4.
    let path = temp_file(
        "typo.yaml",
        "name: typo\ntransformer:\n  layers: 2\n  hiddenn: 64\n  heads: 4\n  vocab: 100\n",
    );
    let p = path.to_str().unwrap();
    let r = meshplan(&["inspect", p, "--json"]);
    r.expect_code(2)
        .stderr_has(&[p, &format!("{p}:4"), "hiddenn"]);
    let r = meshplan(&[
        "estimate",
        p,
        "topologies/dgx-a100-80g.yaml",
        "--config",
        "tp=1",
    ]);
    r.expect_code(2).stderr_has(&["hiddenn", ":4"]);
}

#[test]
fn unknown_cluster_key_exits_2() {
    let path = temp_file(
        "cluster-typo.yaml",
        "name: c\nnodes: 1\ngpus_per_node: 8\ngpu:\n  name: g\n  memory_gib: 80\n  \
         peak_tflops: {bf16: 312, fp32: 19.5}\n  hbm_gbs: 2039\nintra_node:\n  link: nv\n  \
         bandwidth_gbps: 300\n  latency_us: 3\n",
    );
    let p = path.to_str().unwrap();
    let r = meshplan(&["estimate", "models/llama3-8b.yaml", p, "--config", "tp=8"]);
    r.expect_code(2).stderr_has(&[p, "hbm_gbs"]);
}

#[test]
fn bad_config_key_exits_2() {
    let r = meshplan(&[
        "estimate",
        "models/llama3-8b.yaml",
        "topologies/dgx-a100-80g.yaml",
        "--config",
        "tq=8",
    ]);
    r.expect_code(2).stderr_has(&["--config", "tq"]);
    let r = meshplan(&[
        "estimate",
        "models/llama3-8b.yaml",
        "topologies/dgx-a100-80g.yaml",
        "--config",
        "tp=eight",
    ]);
    r.expect_code(2).stderr_has(&["--config", "tp", "eight"]);
    let r = meshplan(&[
        "estimate",
        "models/llama3-8b.yaml",
        "topologies/dgx-a100-80g.yaml",
        "--config",
        "recompute=most",
    ]);
    r.expect_code(2).stderr_has(&["recompute", "most"]);
}

#[test]
fn bad_flag_exits_2() {
    let r = meshplan(&[
        "estimate",
        "models/llama3-8b.yaml",
        "topologies/dgx-a100-80g.yaml",
        "--config",
        "tp=8",
        "--bogus",
    ]);
    r.expect_code(2).stderr_has(&["--bogus"]);
    // estimate without --config.
    let r = meshplan(&[
        "estimate",
        "models/llama3-8b.yaml",
        "topologies/dgx-a100-80g.yaml",
    ]);
    r.expect_code(2).stderr_has(&["--config"]);
}

#[test]
fn hf_config_without_a_workload_exits_2() {
    let r = meshplan(&[
        "estimate",
        "models/hf/llama3-8b.json",
        "topologies/dgx-a100-80g.yaml",
        "--config",
        "tp=8",
    ]);
    r.expect_code(2).stderr_has(&["workload", "--seq-len"]);
    // Half of the pair is not enough either.
    let r = meshplan(&[
        "estimate",
        "models/hf/llama3-8b.json",
        "topologies/dgx-a100-80g.yaml",
        "--config",
        "tp=8",
        "--seq-len",
        "4096",
    ]);
    r.expect_code(2).stderr_has(&["--global-batch"]);
}

// === exit 3: does not fit ===

#[test]
fn world_size_mismatch_exits_3_with_the_arithmetic() {
    // dp(3) * tp(2) * pp(1) * cp(1) = 6 != GPUs(8).
    let r = meshplan(&[
        "estimate",
        "models/llama3-8b.yaml",
        "topologies/dgx-a100-80g.yaml",
        "--config",
        "dp=3,tp=2",
    ]);
    r.expect_code(3)
        .stderr_has(&["dp(3) * tp(2) * pp(1) * cp(1) = 6 != GPUs(8)"]);
    // GPT-3's 3840 GPUs: dp = 61 gives 3904.
    let r = meshplan(&[
        "estimate",
        "models/gpt3-175b.yaml",
        "topologies/dgx-a100-80g.yaml",
        "--nodes",
        "480",
        "--config",
        "dp=61,tp=8,pp=8",
    ]);
    r.expect_code(3).stderr_has(&["3904", "3840", "dp=60"]);
}

/// A model no layout fits says how many GPUs its states need, as the framework
/// holds them: GPT-3's 174,615,846,912 parameters at 18 bytes (meshplan's
/// executor, fp32 gradients) over 80 GiB less the 1 GiB reserve, 3.143e12 /
/// 8.483e10 = 37.05, 38 GPUs; at DeepSpeed's 16, 32.94, 33 GPUs.
#[test]
fn a_model_no_layout_fits_says_how_many_gpus_its_framework_needs() {
    let args = [
        "plan",
        "models/gpt3-175b.yaml",
        "topologies/dgx-h100.yaml",
        "--nodes",
        "1",
        "-o",
    ];
    let out = temp_file("no-fit.json", "");
    let out = out.to_str().expect("utf-8");
    let r = meshplan(&[&args[..], &[out]].concat());
    r.expect_code(3)
        .stderr_has(&["need at least 38 GPUs of 80 GiB", "try --nodes 5"]);
    let r = meshplan(&[&args[..], &[out, "--framework", "deepspeed"]].concat());
    r.expect_code(3)
        .stderr_has(&["need at least 33 GPUs of 80 GiB", "try --nodes 5"]);
}

#[test]
fn over_memory_exits_3_in_gib_with_what_would_fit() {
    // Llama 3 8B, dp = 8 without ZeRO: 16 bytes x 8.03e9 = 128 GB of states per GPU
    // > 80 GiB; ZeRO-3 divides them by 8 (16 GB) and fits.
    let args = [
        "estimate",
        "models/llama3-8b.yaml",
        "topologies/dgx-a100-80g.yaml",
        "--config",
        "dp=8",
    ];
    let r = meshplan(&args);
    r.expect_code(3)
        .stderr_has(&["GiB", "80.0 GiB", "would fit", "zero=3"]);
    // With --json the estimate is still printed, and says it does not fit.
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let r = meshplan(&json_args);
    r.expect_code(3).stderr_has(&["GiB"]);
    let v = r.json();
    check_estimate_keys(&v);
    assert_eq!(v["feasible"], Value::Bool(false));
    let m = &v["memory_per_gpu_bytes"];
    assert!(number(m, "total") > 80.0 * 1024.0 * 1024.0 * 1024.0, "{m}");
}

#[test]
fn heads_not_divisible_by_tp_exits_3() {
    // GPT-3 has 96 heads; tp = 64 does not divide them.
    let r = meshplan(&[
        "estimate",
        "models/gpt3-175b.yaml",
        "topologies/dgx-a100-80g.yaml",
        "--nodes",
        "8",
        "--config",
        "tp=64",
    ]);
    r.expect_code(3).stderr_has(&["heads(96)", "tp(64)"]);
}

// === plan and compare ===

pub(crate) fn json_of(run: &Run) -> Value {
    serde_json::from_str(&run.stdout).unwrap_or_else(|e| {
        panic!(
            "meshplan {}: stdout is not JSON ({e}):\n{}",
            run.args, run.stdout
        )
    })
}

#[test]
fn plan_json_has_the_contract_keys_and_writes_the_plan() {
    let out = temp_file("plan-tiny.json", "");
    let run = meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "-o",
        out.to_str().expect("utf-8 path"),
        "--json",
    ]);
    run.expect_code(0);
    let v = json_of(&run);
    check_estimate_keys(v.get("predicted").expect("predicted"));
    let s = v.get("strategy").expect("strategy");
    for k in ["dp", "tp", "pp", "cp", "ep", "mbs", "zero", "vpp"] {
        assert!(s.get(k).is_some_and(Value::is_u64), "strategy.{k} in {s}");
    }
    let search = v.get("search").expect("search");
    number(search, "candidates_evaluated");
    number(search, "pruned");
    number(search, "wall_s");
    assert!(search.get("solver").is_some_and(Value::is_string));
    assert!(search.get("stop_reason").is_some_and(Value::is_string));
    let plan: Value =
        serde_json::from_slice(&std::fs::read(&out).expect("plan written")).expect("plan is JSON");
    for k in [
        "format",
        "model",
        "cluster",
        "workload",
        "mesh",
        "strategy",
        "placements",
        "predicted",
        "programs",
        "ranks",
        "search",
    ] {
        assert!(plan.get(k).is_some(), "plan.json lacks `{k}`");
    }
    assert!(plan["format"].is_u64());
    assert_eq!(
        plan["strategy"], *s,
        "the plan file holds the printed strategy"
    );
    let ranks = plan["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 8, "cpu-test-mesh has 8 ranks");
    assert!(plan["mesh"]["axes"].is_array() && plan["mesh"]["shape"].is_array());
    assert!(!plan["placements"]
        .as_object()
        .expect("placements")
        .is_empty());
}

#[test]
fn plan_is_deterministic() {
    let a = temp_file("plan-a.json", "");
    let b = temp_file("plan-b.json", "");
    for out in [&a, &b] {
        meshplan(&[
            "plan",
            "models/llama3-8b.yaml",
            "topologies/dgx-h100.yaml",
            "--quiet",
            "-o",
            out.to_str().expect("utf-8 path"),
        ])
        .expect_code(0);
    }
    let (x, y) = (std::fs::read(&a).expect("a"), std::fs::read(&b).expect("b"));
    assert!(!x.is_empty());
    // The search's wall time is the one field allowed to differ; compare the rest.
    let strip = |bytes: &[u8]| {
        let mut v: Value = serde_json::from_slice(bytes).expect("JSON");
        v["search"]["wall_s"] = Value::Null;
        v["search"]["extra"] = Value::Null;
        serde_json::to_vec(&v).expect("JSON")
    };
    assert_eq!(strip(&x), strip(&y), "same inputs, same plan");
}

#[test]
fn plan_config_fixes_the_keys_it_names() {
    let out = temp_file("plan-fixed.json", "");
    let run = meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "tp=2,pp=2",
        "--top",
        "3",
        "-o",
        out.to_str().expect("utf-8 path"),
        "--json",
    ]);
    run.expect_code(0);
    let v = json_of(&run);
    assert_eq!(v["strategy"]["tp"], 2);
    assert_eq!(v["strategy"]["pp"], 2);
    assert_eq!(v["strategy"]["dp"], 2);
    let top = v["top"].as_array().expect("top");
    assert!(!top.is_empty() && top.len() <= 3);
}

#[test]
fn plan_with_nothing_that_fits_exits_3_with_the_closest_miss() {
    let out = temp_file("plan-none.json", "");
    let run = meshplan(&[
        "plan",
        "models/llama3-405b.yaml",
        "topologies/dgx-a100-80g.yaml",
        "--quiet",
        "-o",
        out.to_str().expect("utf-8 path"),
    ]);
    run.expect_code(3);
    assert!(run.stderr.contains("no feasible plan"), "{}", run.stderr);
    assert!(run.stderr.contains("GiB"), "{}", run.stderr);
    assert!(!out.exists() || std::fs::read(&out).expect("read").is_empty());
}

#[test]
fn plan_bad_config_key_exits_2() {
    let run = meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "tq=2",
    ]);
    run.expect_code(2);
    assert!(run.stderr.contains("tq"), "{}", run.stderr);
}

#[test]
fn plan_inference_reports_latency_and_capacity() {
    let out = temp_file("plan-inf.json", "");
    let run = meshplan(&[
        "plan",
        "models/llama3-70b-inference.yaml",
        "topologies/h200-node.yaml",
        "-o",
        out.to_str().expect("utf-8 path"),
        "--json",
    ]);
    run.expect_code(0);
    let v = json_of(&run);
    let p = &v["predicted"];
    for k in ["ttft_s", "tpot_s", "output_tokens_per_s", "max_concurrency"] {
        number(p, k);
    }
    assert!(v["search"]["prefill_best"].is_object());
    assert!(v["search"]["decode_best"].is_object());
}

#[test]
fn compare_puts_the_planner_first_with_ratios() {
    let file = temp_file(
        "configs.yaml",
        "- name: megatron-tp8\n  config: \"tp=8,mbs=1\"\n- name: zero1\n  config: \"dp=8,zero=1,mbs=1\"\n",
    );
    let run = meshplan(&[
        "compare",
        "models/llama3-8b.yaml",
        "topologies/dgx-h100.yaml",
        "--config",
        "dp=4,tp=2,mbs=1,recompute=full",
        "--configs-file",
        file.to_str().expect("utf-8 path"),
        "--json",
    ]);
    run.expect_code(0);
    let v = json_of(&run);
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 4);
    assert_eq!(rows[0]["name"], "planner");
    assert_eq!(rows[2]["name"], "megatron-tp8");
    let best = number(&rows[0]["predicted"], "step_time_s");
    for r in rows {
        assert!(r["strategy"].is_string());
        check_estimate_keys(&r["predicted"]);
        let step = number(&r["predicted"], "step_time_s");
        let ratio = number(r, "ratio_to_planner");
        assert!((ratio - step / best).abs() < 1e-9, "{r}");
        // A configuration that does not fit may be faster; the planner is not
        // slower than any that does.
        if r["predicted"]["feasible"] == true {
            assert!(ratio >= 1.0 - 1e-9, "the planner is not slower: {r}");
        }
        assert!(r["account"].is_string());
    }
    // Text mode prints one row per configuration.
    let text = meshplan(&[
        "compare",
        "models/llama3-8b.yaml",
        "topologies/dgx-h100.yaml",
        "--config",
        "tp=8,mbs=1",
    ]);
    text.expect_code(0);
    assert!(text.stdout.contains("planner") && text.stdout.contains("tp=8,mbs=1"));
}

#[test]
fn compare_bad_configs_file_exits_2_naming_it() {
    let file = temp_file("bad-configs.yaml", "- nam: x\n  config: tp=2\n");
    let run = meshplan(&[
        "compare",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--configs-file",
        file.to_str().expect("utf-8 path"),
    ]);
    run.expect_code(2);
    assert!(run.stderr.contains("bad-configs.yaml"), "{}", run.stderr);
}

// === run ===

#[test]
fn run_check_trains_the_planned_layout_like_one_rank() {
    let out = plan_file(
        "plan-run.json",
        "models/tiny-gpt.yaml",
        "dp=2,tp=2,pp=2,mbs=1",
    );
    let path = out.to_str().expect("utf-8 path");
    let run = meshplan(&["run", path, "--steps", "5", "--check", "--json"]);
    run.expect_code(0);
    let v = json_of(&run);
    let losses = v["loss"].as_array().expect("loss per step");
    assert_eq!(losses.len(), 5);
    assert!(losses[4].as_f64() < losses[0].as_f64(), "{v}");
    assert_eq!(v["check"]["passed"], true, "{v}");
    assert_eq!(v["bytes_match_plan"], true, "{v}");
    number(&v["measured"], "step_time_s");
    number(&v["predicted"], "step_time_s");
    for s in v["steps"].as_array().expect("steps") {
        number(s, "loss");
        number(s, "tokens_per_s");
    }
}

#[test]
fn run_threads_split_kernels_without_changing_the_losses() {
    let out = plan_file(
        "plan-run-threads.json",
        "models/tiny-gpt.yaml",
        "dp=2,tp=2,mbs=1",
    );
    let path = out.to_str().expect("utf-8 path");
    let losses = |threads: &str| {
        let run = meshplan(&["run", path, "--steps", "2", "--threads", threads, "--json"]);
        run.expect_code(0);
        json_of(&run)["loss"].clone()
    };
    assert_eq!(losses("1"), losses("3"), "kernel threads change no bit");
    meshplan(&["run", path, "--threads", "0"])
        .expect_code(2)
        .stderr_has(&["--threads must be at least 1"]);
}

/// The measured memory counts what the run allocates for the model; the plan's
/// total also holds the runtime's workspace (a CUDA context and library buffers,
/// about a GiB, where the measured side on the CPU is a few MiB). The report sets
/// each predicted part beside its measured one, so that a reader compares states
/// with states and activations with activations.
#[test]
fn run_report_sets_each_predicted_memory_part_beside_the_measured_one() {
    let out = plan_file("plan-run-memory.json", "models/tiny-gpt.yaml", "dp=2,tp=2");
    let path = out.to_str().expect("utf-8 path");
    let plan: Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("plan")).expect("plan json");
    let ledger = &plan["predicted"]["memory_per_gpu_bytes"];
    let gib = |key: &str| number(ledger, key) / (1u64 << 30) as f64;
    let run = meshplan(&["run", path, "--steps", "1"]);
    let line = run.expect_code(0).stdout_line("memory ");
    let (measured, predicted) = line.split_once("predicted ").expect("both sides");
    let near = |shown: f64, want: f64| (shown - want).abs() <= 5e-5;
    let states = gib("params") + gib("grads") + gib("optimizer");
    for (prefix, want) in [
        ("", gib("total")),
        ("states ", states),
        ("activations ", gib("activations")),
        ("runtime workspace ", gib("workspace")),
    ] {
        let shown = number_after(predicted, prefix);
        assert!(near(shown, want), "{prefix}{shown} against {want}: {line}");
    }
    assert!(gib("workspace") > 0.5, "{line}");
    let total = number_after(measured, "measured ");
    let parts = number_after(measured, "states ") + number_after(measured, "activations ");
    assert!(total > 0.0 && (total - parts).abs() <= 2e-4, "{line}");
}

/// A plan the executor does not run (here a graph that starts from an activation,
/// not token ids) is the input to change: exit 2 with the file and the reason, as
/// for inference plans and the models `check_executable` refuses, not 1.
#[test]
fn run_refuses_a_plan_it_cannot_run_as_bad_input() {
    let out = plan_file(
        "plan-run-mlp.json",
        "models/examples/mlp-graph.yaml",
        "dp=2",
    );
    let path = out.to_str().expect("utf-8 path");
    meshplan(&["run", path, "--steps", "1"])
        .expect_code(2)
        .stderr_has(&[path, "enters the model's graph from outside it", "not run"]);
}

#[test]
fn run_refuses_a_padded_batch_and_weights_a_degree_does_not_split_whole() {
    // Each ran before, wrongly: the padded batch's ranks read overlapping samples and
    // scaled the loss by the unpadded batch (1.2x the loss at batch 10, mbs 4); a
    // vocabulary of 251 over tp=2 lost token 250's embedding row and logit.
    let dir = temp_dir("cli", "uneven");
    let tiny = std::fs::read_to_string(format!("{ROOT}/models/tiny-gpt.yaml")).expect("model");
    let variant = |name: &str, from: &str, to: &str| {
        assert!(tiny.contains(from), "tiny-gpt has `{from}`");
        let path = dir.join(name);
        std::fs::write(&path, tiny.replace(from, to)).expect("model");
        path.display().to_string()
    };
    // The planner writes none of these for meshplan's executor (it warns about the
    // padded batch, and refuses the splits); a plan for torchtitan, whose DTensors
    // split unevenly, reaches the executor, which refuses it rather than run it.
    let cases = [
        (
            variant("batch10.yaml", "global_batch: 8", "global_batch: 10"),
            "dp=2,mbs=4",
            "meshplan",
            "does not divide the global batch (10)",
        ),
        (
            variant("vocab251.yaml", "vocab: 256", "vocab: 251"),
            "dp=2,tp=2",
            "torchtitan",
            "`embed.tokens.w` of `embed.tokens`: 251 does not split evenly over tp=2",
        ),
        (
            variant("ffn129.yaml", "ffn_hidden: 128", "ffn_hidden: 129"),
            "dp=2,tp=2",
            "torchtitan",
            "`block.mlp.up.w` of `block.mlp.up`: each of its gate and up halves, 129, does not split evenly over tp=2",
        ),
    ];
    let plan = dir.join("plan.json");
    let path = plan.to_str().expect("utf-8 path");
    let planned = |model: &str, cfg: &str, framework: &str| {
        meshplan(&[
            "plan",
            model,
            "topologies/cpu-test-mesh.yaml",
            "--config",
            cfg,
            "--framework",
            framework,
            "--quiet",
            "-o",
            path,
        ])
    };
    for (model, cfg, framework, why) in cases {
        planned(&model, cfg, framework).expect_code(0);
        meshplan(&["run", path, "--steps", "1"])
            .expect_code(2)
            .stderr_has(&[path, why]);
    }
    for (model, why) in [
        ("vocab251.yaml", "splits the vocabulary (251) over tp whole"),
        ("ffn129.yaml", "splits the layers' widths over tp whole"),
    ] {
        let model = dir.join(model).display().to_string();
        planned(&model, "dp=2,tp=2", "meshplan")
            .expect_code(2)
            .stderr_has(&["meshplan's executor", why]);
    }
}

/// The fix the refusal above names: the same 251 tokens padded on the command line
/// (`--make-vocab-size-divisible-by 4`: 252 rows, 126 a tensor rank) plan at tp=2
/// and train equal to the single rank (`--check`), in fp32 and bf16; a padded
/// serving model runs its own workload at tp=2. GPT-2 padded by 128 exports to
/// Megatron-LM as its 50257 tokens and the divisor that makes the same 50304 rows at
/// tp=2 (64 x 2). A multiple of 0, or one for an explicit graph, is refused.
#[test]
fn a_vocabulary_padded_on_the_command_line_splits_over_tp_and_exports_to_megatron() {
    let dir = temp_dir("cli", "padded");
    let tiny = std::fs::read_to_string(format!("{ROOT}/models/tiny-gpt.yaml")).expect("model");
    let model = dir.join("vocab251.yaml");
    std::fs::write(&model, tiny.replace("vocab: 256", "vocab: 251")).expect("model");
    let plan = dir.join("plan.json");
    let (model, path) = (
        model.to_str().expect("utf-8"),
        plan.to_str().expect("utf-8"),
    );
    let planned = |m: &str, cluster: &str, extra: &[&str]| {
        let mut args = vec!["plan", m, cluster, "--quiet", "-o", path];
        args.extend(extra);
        meshplan(&args)
    };
    let mesh = "topologies/cpu-test-mesh.yaml";
    planned(model, mesh, &["--config", "dp=2,tp=2"])
        .expect_code(2)
        .stderr_has(&["--make-vocab-size-divisible-by 128"]);
    let pad = [
        "--config",
        "dp=2,tp=2",
        "--make-vocab-size-divisible-by",
        "4",
    ];
    planned(model, mesh, &pad).expect_code(0);
    let run = meshplan(&["run", path, "--steps", "2", "--check"]);
    run.expect_code(0);
    assert!(
        run.stdout_line("check").contains("passed"),
        "{}",
        run.stdout
    );
    // In bf16 too; the weight farthest from the reference is the table, named
    // without a layer (it read `layer 18446744073709551615`, the no-layer mark).
    let bf16 = meshplan(&[
        "run",
        path,
        "--steps",
        "3",
        "--check",
        "--backend",
        "cpu-bf16",
    ]);
    bf16.expect_code(0);
    let check = bf16.stdout_line("check");
    assert!(
        check.contains("passed") && check.contains("`embed.tokens.w` at"),
        "{check}"
    );
    // An inference plan's own workload draws its prompts from the tokens, not the
    // rows (it drew 255 of 250 tokens in 256 rows, and refused its own prompt).
    let serving = dir.join("serve250.yaml");
    let llama = std::fs::read_to_string(format!("{ROOT}/models/tiny-llama-inference.yaml"));
    let llama = llama.expect("model").replace("vocab: 256", "vocab: 250");
    std::fs::write(&serving, llama).expect("model");
    let two = cut_mesh(&dir, 2);
    let serve = ["--config", "tp=2", "--make-vocab-size-divisible-by", "64"];
    planned(serving.to_str().expect("utf-8"), &two, &serve).expect_code(0);
    let run = meshplan(&["run", path, "--check"]);
    run.expect_code(0);
    assert!(
        run.stdout_line("check").contains("passed"),
        "{}",
        run.stdout
    );
    let gpt2 = [
        "--config",
        "dp=4,tp=2",
        "--make-vocab-size-divisible-by",
        "128",
    ];
    planned("models/gpt2-124m.yaml", "topologies/dgx-h100.yaml", &gpt2).expect_code(0);
    let args = meshplan(&["export", path, "--to", "megatron"]);
    args.expect_code(0);
    for line in ["--vocab-size 50257", "--make-vocab-size-divisible-by 64"] {
        assert!(
            args.stdout.lines().any(|l| l == line),
            "{line}:\n{}",
            args.stdout
        );
    }
    planned(model, mesh, &["--make-vocab-size-divisible-by", "0"])
        .expect_code(2)
        .stderr_has(&[
            "--make-vocab-size-divisible-by",
            "must be a positive integer",
        ]);
    planned(
        "models/examples/mlp-graph.yaml",
        mesh,
        &["--make-vocab-size-divisible-by", "8"],
    )
    .expect_code(2)
    .stderr_has(&["mlp-graph.yaml", "an explicit graph"]);
}

/// A plan's collective on an activation must fit how its producer leaves it: the
/// embedding's all-reduce over tp=2 edited to an all-gather sends the same bytes and
/// ran to the end with another loss (5.5649 for 5.5663) and "bytes equal".
#[test]
fn an_edited_collective_kind_is_refused_naming_it() {
    let out = plan_file(
        "plan-edit-kind.json",
        "models/tiny-gpt.yaml",
        "dp=2,tp=2,sp=false",
    );
    let mut plan: Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("plan")).expect("JSON");
    // The embedding segment's body: its lookup, then the sum of the vocabulary shards.
    let embed = &mut plan["programs"][0]["phases"][0]["chunks"][0]["forward"][0]["body"][1];
    assert_eq!(embed["tensor"]["activation"]["tensor"], "embed.tokens.out");
    assert_eq!(embed["kind"], "all_reduce");
    embed["kind"] = "all_gather".into();
    let edited = temp_file("plan-edit-kind-edited.json", &plan.to_string());
    let path = edited.to_str().expect("utf-8 path");
    meshplan(&["run", path, "--steps", "1"])
        .expect_code(2)
        .stderr_has(&[
            "AllGather of `embed.tokens.out` over tp",
            "places `P` there (placements.embed.tokens.out)",
        ]);
}

/// Two stages' schedules, each a valid order on its own, that wait for each
/// other: stage 0 waits for microbatch 0's gradient before it sends microbatch
/// 1, which stage 1 waits for before it sends that gradient. The run stops at
/// once naming both waits, where it used to sleep until a timeout.
#[test]
fn crossed_pipeline_schedules_fail_at_once_as_a_deadlock_naming_both_waits() {
    let out = plan_file(
        "plan-edit-schedule.json",
        "models/tiny-gpt.yaml",
        "dp=4,pp=2,mbs=1,vpp=1,schedule=1f1b",
    );
    let mut plan: Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("plan")).expect("JSON");
    let pass = |p: &str, mb: u64| serde_json::json!({"pass": p, "chunk": 0, "mb": mb});
    for (stage, order) in [
        (0, [("F", 0), ("B", 0), ("F", 1), ("B", 1)]),
        (1, [("F", 0), ("F", 1), ("B", 0), ("B", 1)]),
    ] {
        let program = &mut plan["programs"][stage];
        assert_eq!(program["stage"], stage);
        let schedule = &mut program["phases"][0]["schedule"];
        assert_eq!(schedule.as_array().map(Vec::len), Some(4), "{schedule}");
        *schedule = order.iter().map(|&(p, mb)| pass(p, mb)).collect();
    }
    let edited = temp_file("plan-edit-schedule-edited.json", &plan.to_string());
    let path = edited.to_str().expect("utf-8 path");
    // Killed, and failed, if it sleeps instead.
    let run = crate::bin::within(
        std::time::Duration::from_secs(120),
        &["run", path, "--steps", "1"],
    );
    run.expect_code(1);
    for needle in [
        "error: deadlock: every rank still running waits for another (rank 0 in recv on pp from rank 4 (seq 0), ",
        ", rank 4 in recv on pp from rank 0 (seq 1), ",
        ", rank 7 in recv on pp from rank 3 (seq 1))\n",
    ] {
        assert!(run.stderr.contains(needle), "{}", run.stderr);
    }
}

#[test]
fn run_check_expert_parallel_with_capacity_matches_the_plan_byte_for_byte() {
    let out = plan_file(
        "plan-run-moe.json",
        "models/tiny-moe-capacity.yaml",
        "dp=4,ep=4,tp=2,sp=true,mbs=1",
    );
    let path = out.to_str().expect("utf-8 path");
    let run = meshplan(&["run", path, "--steps", "5", "--check", "--json"]);
    run.expect_code(0);
    let v = json_of(&run);
    assert_eq!(v["check"]["passed"], true, "{v}");
    assert_eq!(v["bytes_match_plan"], true, "{v}");
    assert!(
        number(&v["measured"]["comm_bytes_per_gpu"], "ep") > 0.0,
        "{v}"
    );
    let slots = number(&v["measured"], "expert_assignments");
    let dropped = number(&v["measured"], "expert_assignments_dropped");
    assert!(dropped > 0.0 && dropped < slots, "{v}");
    // Without sequence parallelism every tensor rank would route the same tokens.
    let est = meshplan(&[
        "estimate",
        "models/tiny-moe-capacity.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "dp=4,ep=4,tp=2,sp=false",
    ]);
    est.expect_code(3);
    assert!(est.stderr.contains("needs sp=true"), "{}", est.stderr);
}

/// `tokens` as a u16 file, raw or behind llm.c's header.
fn token_file(name: &str, tokens: &[u16], llmc_header: bool) -> PathBuf {
    let mut bytes = Vec::new();
    if llmc_header {
        let mut header = [0i32; 256];
        header[0] = 20240520;
        header[1] = 1;
        header[2] = tokens.len() as i32;
        bytes.extend(header.iter().flat_map(|x| x.to_le_bytes()));
    }
    bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    let path = temp_file(name, "");
    std::fs::write(&path, bytes).expect("write tokens");
    path
}

#[test]
fn run_trains_on_a_token_file_and_writes_a_trace() {
    let out = plan_file(
        "plan-data.json",
        "models/tiny-gpt.yaml",
        "dp=2,tp=2,pp=2,mbs=1",
    );
    let path = out.to_str().expect("utf-8 path");
    // 64 windows of 33 tokens: a counting pattern the model can learn.
    let tokens: Vec<u16> = (0..32 * 64 + 1)
        .map(|i| ((i * 5 + i / 7) % 256) as u16)
        .collect();
    let raw = token_file("tokens.bin", &tokens, false);
    let trace = temp_file("trace.json", "");
    let args = |data: &str| {
        vec![
            "run".to_string(),
            path.to_string(),
            "--steps".into(),
            "5".into(),
            "--check".into(),
            "--json".into(),
            "--data".into(),
            data.to_string(),
        ]
    };
    let mut with_trace = args(raw.to_str().expect("utf-8"));
    with_trace.extend(["--trace".to_string(), trace.to_str().expect("utf-8").into()]);
    let run = meshplan(&with_trace.iter().map(String::as_str).collect::<Vec<_>>());
    run.expect_code(0);
    let v = json_of(&run);
    assert_eq!(v["check"]["passed"], true, "{v}");
    assert_eq!(v["bytes_match_plan"], true, "{v}");
    let losses: Vec<f64> = v["loss"]
        .as_array()
        .expect("loss")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect();
    assert!(losses[4] < losses[0], "{losses:?}");
    // The file's tokens, not the synthetic stream.
    let synthetic = meshplan(&["run", path, "--steps", "1", "--json"]);
    synthetic.expect_code(0);
    assert_ne!(json_of(&synthetic)["loss"][0].as_f64(), Some(losses[0]));
    // llm.c's header gives the same tokens, so the same losses.
    let llmc = token_file("tokens-llmc.bin", &tokens, true);
    let run = meshplan(
        &args(llmc.to_str().expect("utf-8"))
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    run.expect_code(0);
    let again: Vec<f64> = json_of(&run)["loss"]
        .as_array()
        .expect("loss")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect();
    assert_eq!(again, losses);

    // The trace: Chrome trace fields, one track per rank, every kind of span.
    let t: Value = serde_json::from_str(&std::fs::read_to_string(&trace).expect("trace written"))
        .expect("trace is JSON");
    let events = t["traceEvents"].as_array().expect("traceEvents");
    let spans: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    for e in &spans {
        for key in ["name", "cat", "ts", "dur", "pid", "tid"] {
            assert!(!e[key].is_null(), "span without {key}: {e}");
        }
        assert!(e["dur"].as_f64().expect("dur") >= 0.0);
    }
    let tids: std::collections::BTreeSet<u64> = spans
        .iter()
        .map(|e| e["tid"].as_u64().expect("tid"))
        .collect();
    assert_eq!(tids, (0..8).collect());
    for cat in ["task", "compute", "comm", "p2p", "optimizer"] {
        assert!(spans.iter().any(|e| e["cat"] == cat), "no {cat} span");
    }
    // 5 steps x 4 micro-batches forward tasks on every rank.
    let fwd_rank0 = spans
        .iter()
        .filter(|e| {
            e["tid"] == 0
                && e["cat"] == "task"
                && e["name"].as_str().is_some_and(|n| n.starts_with("fwd"))
        })
        .count();
    assert_eq!(fwd_rank0, 20);
    assert!(spans
        .iter()
        .any(|e| e["cat"] == "comm" && e["args"]["bytes_sent"].as_f64() > Some(0.0)));
    let names: Vec<&str> = events
        .iter()
        .filter(|e| e["ph"] == "M")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert!(
        names.contains(&"stage 1") && names.contains(&"rank 7"),
        "{names:?}"
    );

    // Bad files: a token outside the vocabulary, too few sequences for a step.
    let bad = token_file("bad-tokens.bin", &[1, 2, 300, 4], false);
    let run = meshplan(&["run", path, "--data", bad.to_str().expect("utf-8")]);
    run.expect_code(2);
    assert!(
        run.stderr.contains("bad-tokens.bin") && run.stderr.contains("token 300"),
        "{}",
        run.stderr
    );
    let small = token_file("small-tokens.bin", &tokens[..32 * 4 + 1], false);
    let run = meshplan(&["run", path, "--data", small.to_str().expect("utf-8")]);
    run.expect_code(2);
    assert!(run.stderr.contains("global_batch(8)"), "{}", run.stderr);
}

#[test]
fn run_rejects_bad_input_and_missing_backends() {
    let bad = temp_file("not-a-plan.json", "{\"format\": 1}");
    let run = meshplan(&["run", bad.to_str().expect("utf-8 path")]);
    run.expect_code(2);
    assert!(run.stderr.contains("not-a-plan.json"), "{}", run.stderr);
    let out = temp_file("plan-run-cuda.json", "");
    let path = out.to_str().expect("utf-8 path");
    meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--quiet",
        "-o",
        path,
    ])
    .expect_code(0);
    let cuda = meshplan(&["run", path, "--backend", "cuda"]);
    cuda.expect_code(1);
    assert!(cuda.stderr.contains("CUDA"), "{}", cuda.stderr);
    let tpu = meshplan(&["run", path, "--backend", "tpu"]);
    tpu.expect_code(2);
    // An 8B-parameter plan does not fit the CPU backend's threads: a message, exit 1.
    let big = temp_file("plan-run-big.json", "");
    let big_path = big.to_str().expect("utf-8 path");
    meshplan(&[
        "plan",
        "models/llama3-8b.yaml",
        "topologies/dgx-h100.yaml",
        "--quiet",
        "-o",
        big_path,
    ])
    .expect_code(0);
    let run = meshplan(&["run", big_path]);
    run.expect_code(1);
    assert!(run.stderr.contains("budget"), "{}", run.stderr);
}

#[test]
fn training_refuses_kv_heads_copied_over_tp() {
    // tiny-gpt has 2 key/value heads: tp=4 would copy each on two tensor ranks, whose
    // gradients would then be partial (inference may copy them; training may not).
    let est = meshplan(&[
        "estimate",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "tp=4,dp=2",
    ]);
    est.expect_code(3);
    assert!(
        est.stderr.contains("kv_heads(2) % tp(4) != 0"),
        "{}",
        est.stderr
    );
    let plan = meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "tp=4",
    ]);
    plan.expect_code(3);
    assert!(
        plan.stderr.contains("ruled out because kv_heads(2)"),
        "{}",
        plan.stderr
    );
}

#[test]
fn deepseek_v3_with_dense_and_moe_blocks_plans_and_lowers() {
    // Two kinds of repeated block name their shared tensors alike (`block.in`): the
    // plan holds one placement for both rather than refusing to lower.
    let out = temp_file("plan-deepseek.json", "");
    let path = out.to_str().expect("utf-8 path");
    let run = meshplan(&[
        "plan",
        "models/deepseek-v3.yaml",
        "topologies/h800-node.yaml",
        "--nodes",
        "256",
        "--json",
        "-o",
        path,
    ]);
    run.expect_code(0);
    let plan: Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("plan written")).expect("JSON");
    let segments = plan["model"]["segments"].as_array().expect("segments");
    assert!(
        segments.len() >= 4,
        "embed, dense blocks, MoE blocks, head: {segments:?}"
    );
    assert!(plan["placements"]["block.in"].is_array());
    assert!(
        plan["predicted"]["comm_bytes_per_gpu"]["ep"].as_f64() > Some(0.0)
            || plan["strategy"]["ep"] == 1
    );
}

#[test]
fn run_backend_cpu_bf16_checks_mixed_precision_and_names_plans_it_does_not_run() {
    let out = plan_file(
        "plan-run-bf16.json",
        "models/tiny-gpt.yaml",
        "dp=8,tp=1,pp=1,cp=1,zero=0",
    );
    let path = out.to_str().expect("utf-8 path");
    let run = meshplan(&["run", path, "--backend", "cpu-bf16", "--check", "--json"]);
    run.expect_code(0);
    let v = json_of(&run);
    assert_eq!(v["check"]["passed"], true, "{v}");
    assert_eq!(v["bytes_match_plan"], true, "{v}");
    let details = v["check"]["details"].to_string();
    assert!(
        details.contains("of the reference's update away"),
        "{details}"
    );
    let mfu = number(&v["measured"], "mfu");
    assert!(mfu > 0.0 && mfu.is_finite(), "{v}");
    // bf16 rounding moves the losses off the fp32 run's, a little.
    let fp32 = meshplan(&["run", path, "--json"]);
    fp32.expect_code(0);
    let (a, b) = (&v["loss"], &json_of(&fp32)["loss"]);
    assert_ne!(a, b, "bf16 rounding changed nothing");
    // Routed experts over ep run on it too, within the check.
    let moe = plan_file(
        "plan-run-bf16-moe-ep.json",
        "models/tiny-moe.yaml",
        "dp=4,ep=2,tp=2,pp=1,cp=1,sp=true",
    );
    let run = meshplan(&[
        "run",
        moe.to_str().expect("utf-8"),
        "--backend",
        "cpu-bf16",
        "--check",
        "--steps",
        "3",
    ]);
    run.expect_code(0);
    let out = &run.stdout;
    assert!(out.contains("check        passed"), "{out}");
    // An inference plan generates on it too, KV cache in the device's buffers,
    // checked against the fp32 single-rank run within the bf16 tolerance.
    let infer = plan_file(
        "plan-run-bf16-infer.json",
        "models/tiny-llama-inference.yaml",
        "dp=8,tp=1,pp=1,cp=1",
    );
    let j = run_checked(
        infer.to_str().expect("utf-8"),
        &[
            "--backend",
            "cpu-bf16",
            "--prompt-ids",
            "1,2,3,4",
            "--max-new-tokens",
            "3",
        ],
    );
    let line = j["check"].to_string();
    assert!(line.contains("first logits within"), "{line}");
    // Tensor, pipeline and context parallelism run on it, within the check.
    let tp = plan_file(
        "plan-run-bf16-tp.json",
        "models/tiny-gpt.yaml",
        "dp=1,tp=2,pp=2,cp=2,mbs=1,sp=false",
    );
    let run = meshplan(&[
        "run",
        tp.to_str().expect("utf-8"),
        "--backend",
        "cpu-bf16",
        "--check",
        "--json",
    ]);
    run.expect_code(0);
    let v = json_of(&run);
    assert_eq!(v["check"]["passed"], true, "{v}");
    assert_eq!(v["bytes_match_plan"], true, "{v}");
    meshplan(&["run", path, "--backend", "tpu"])
        .expect_code(2)
        .stderr_has(&["expected cpu, cpu-bf16 or cuda"]);
}

/// `models/NAME.yaml` in bf16, written to `dir`: its path.
fn bf16_model(dir: &std::path::Path, name: &str) -> String {
    let text = std::fs::read_to_string(format!("{ROOT}/models/{name}.yaml")).expect("model");
    assert!(text.contains("\ndtype: f32\n"), "{name} is an fp32 model");
    let path = dir.join(format!("{name}-bf16.yaml"));
    std::fs::write(&path, text.replace("\ndtype: f32\n", "\ndtype: bf16\n")).expect("write");
    path.display().to_string()
}

/// A bf16 model's plan prices its activations and ZeRO's gathered compute copies
/// in bf16, and in fp32 what meshplan's executor moves in fp32 on every device
/// (gradients, a vocabulary-parallel loss's statistics, the sampled logits), while
/// the CPU engines move every value as fp32: `run --check` compares them element
/// for element, so it passes on a bf16 model as on an fp32 one, on every engine;
/// the measured pipeline bytes are half the fp32 model's, and the data-parallel
/// bytes (fp32 gradients, bf16 gathers) 3/4 of them at ZeRO 1-2 (a reduce-scatter
/// and a gather of as many elements) and 2/3 at ZeRO-3 (two gathers a
/// reduce-scatter). (It failed before, every axis measuring twice the plan.)
#[test]
fn run_check_compares_a_bf16_models_bytes_element_for_element() {
    let dir = temp_dir("cli", "bf16-bytes");
    let gpt = bf16_model(&dir, "tiny-gpt");
    let measured = |v: &Value, axis: &str| number(&v["measured"]["comm_bytes_per_gpu"], axis);
    for (cfg, dp_share) in [
        ("dp=2,tp=2,pp=2,cp=1,zero=1", 0.75),
        ("dp=2,tp=1,pp=2,cp=2,zero=3", 2.0 / 3.0),
    ] {
        let name = format!("bf16-{}.json", cfg.replace([',', '='], "_"));
        let f32_name = format!("f32-{name}");
        let bf16 = plan_file(&name, &gpt, cfg);
        let fp32 = plan_file(&f32_name, "models/tiny-gpt.yaml", cfg);
        let fp32_run = json_of(&meshplan(&["run", fp32.to_str().expect("utf-8"), "--json"]));
        for backend in ["cpu", "cpu-bf16"] {
            let path = bf16.to_str().expect("utf-8");
            let run = meshplan(&["run", path, "--check", "--json", "--backend", backend]);
            run.expect_code(0);
            let v = json_of(&run);
            assert_eq!(v["bytes_match_plan"], true, "{cfg} {backend}: {v}");
            for (axis, share) in [("dp", dp_share), ("pp", 0.5)] {
                let (b, f) = (measured(&v, axis), measured(&fp32_run, axis));
                assert!(
                    b > 0.0 && b == f * share,
                    "{cfg} {backend} {axis}: {b} vs fp32 {f}"
                );
            }
        }
    }
    let infer = bf16_model(&dir, "tiny-llama-inference");
    for cfg in ["dp=2,tp=2,pp=2,cp=1", "dp=1,tp=4,pp=2,cp=1"] {
        let name = format!("bf16-infer-{}.json", cfg.replace([',', '='], "_"));
        let plan = plan_file(&name, &infer, cfg);
        let j = run_checked(plan.to_str().expect("utf-8"), &["--max-new-tokens", "3"]);
        assert_eq!(j["bytes_match_plan"], true, "{cfg}: {j}");
    }
}

// Issue 15 (items 6 and 7): command-line papercuts.

#[test]
fn calibrate_dry_run_needs_no_output_file() {
    let run = meshplan(&["calibrate", "--dry-run"]);
    run.expect_code(0);
    assert!(run.stdout.contains("measures"), "{}", run.stdout);
    assert!(run.stdout.contains("-o FILE"), "{}", run.stdout);
    let named = temp_file("overlay-dry.yaml", "");
    std::fs::remove_file(&named).expect("remove");
    let path = named.to_str().expect("utf-8 path");
    let run = meshplan(&["calibrate", "--dry-run", "-o", path]);
    run.expect_code(0);
    assert!(run.stdout.contains(path), "{}", run.stdout);
    assert!(!named.exists(), "a dry run writes nothing");
    // Measuring for real still needs somewhere to write.
    meshplan(&["calibrate"])
        .expect_code(2)
        .stderr_has(&["--output"]);
}

#[test]
fn swapped_model_and_cluster_exit_2_naming_the_order() {
    for cmd in [
        &["plan", "topologies/dgx-h100.yaml", "models/llama3-8b.yaml"][..],
        &[
            "estimate",
            "topologies/dgx-h100.yaml",
            "models/llama3-8b.yaml",
            "--config",
            "tp=8",
        ][..],
        &[
            "compare",
            "topologies/dgx-h100.yaml",
            "models/llama3-8b.yaml",
            "--config",
            "tp=8",
        ][..],
    ] {
        meshplan(cmd).expect_code(2).stderr_has(&[
            "models/llama3-8b.yaml: this looks like a model file (it has `transformer:`)",
            "topologies/dgx-h100.yaml like a cluster file",
            "the order is MODEL CLUSTER",
        ]);
    }
    // Only one of the two misplaced.
    meshplan(&["plan", "models/llama3-8b.yaml", "models/tiny-gpt.yaml"])
        .expect_code(2)
        .stderr_has(&[
            "models/tiny-gpt.yaml: this looks like a model file",
            "given as CLUSTER; the order is MODEL CLUSTER",
        ]);
    meshplan(&[
        "plan",
        "topologies/dgx-h100.yaml",
        "topologies/dgx-h100.yaml",
    ])
    .expect_code(2)
    .stderr_has(&[
        "topologies/dgx-h100.yaml: this looks like a cluster file",
        "given as MODEL; the order is MODEL CLUSTER",
    ]);
    // A real typo in a model file keeps its own message.
    let tiny = std::fs::read_to_string(format!("{ROOT}/models/tiny-gpt.yaml")).expect("model");
    let typo = temp_file("typo-model.yaml", &format!("{tiny}\nnodes: 1\n"));
    let run = meshplan(&[
        "plan",
        typo.to_str().expect("utf-8 path"),
        "topologies/cpu-test-mesh.yaml",
    ]);
    run.expect_code(2);
    assert!(
        run.stderr.contains("unknown field `nodes`"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("MODEL CLUSTER"), "{}", run.stderr);
}

#[test]
fn quiet_plan_prints_no_ranking_but_writes_the_plan() {
    let out = temp_file("plan-quiet.json", "");
    std::fs::remove_file(&out).expect("remove");
    let path = out.to_str().expect("utf-8 path");
    let args = |quiet: bool| {
        let mut a = vec![
            "plan",
            "models/tiny-gpt.yaml",
            "topologies/cpu-test-mesh.yaml",
            "--top",
            "3",
            "-o",
            path,
        ];
        if quiet {
            a.push("-q");
        }
        meshplan(&a)
    };
    let loud = args(false);
    loud.expect_code(0);
    assert!(loud.stderr.contains("  1. dp="), "{}", loud.stderr);
    let quiet = args(true);
    quiet.expect_code(0);
    assert!(quiet.stderr.trim().is_empty(), "-q: {}", quiet.stderr);
    assert!(quiet.stdout.contains("plan written to"), "{}", quiet.stdout);
    assert!(std::fs::metadata(&out).expect("plan written").len() > 0);
    // Errors still show.
    meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "tq=2",
        "-q",
    ])
    .expect_code(2)
    .stderr_has(&["tq"]);
}

#[test]
fn identical_plans_differ_only_in_the_search_wall_time() {
    // Searches whose refinement solves the intra-op ILP for several candidates at
    // once: racing threads must not count a layout twice.
    for (name, args) in [
        (
            "llama",
            &["models/llama3-8b.yaml", "topologies/dgx-h100.yaml"][..],
        ),
        (
            "mixtral",
            &[
                "models/mixtral-8x7b.yaml",
                "topologies/dgx-h100.yaml",
                "--nodes",
                "2",
            ][..],
        ),
    ] {
        let runs: Vec<(Vec<u8>, Value)> = (0..3)
            .map(|i| {
                let out = temp_file(&format!("plan-same-{name}-{i}.json"), "");
                let mut a = vec!["plan"];
                a.extend_from_slice(args);
                a.extend_from_slice(&["-q", "-o", out.to_str().expect("utf-8 path")]);
                meshplan(&a).expect_code(0);
                let mut v: Value =
                    serde_json::from_slice(&std::fs::read(&out).expect("plan")).expect("JSON");
                let solves = v["search"]["extra"]["ilp_solves"].clone();
                assert!(solves.is_u64(), "{name}: ilp_solves in {}", v["search"]);
                // The measured time is the one field allowed to differ.
                assert!(v["search"]["wall_s"].is_number(), "{}", v["search"]);
                v["search"]["wall_s"] = Value::Null;
                (serde_json::to_vec(&v).expect("JSON"), solves)
            })
            .collect();
        for (bytes, solves) in &runs[1..] {
            assert_eq!(*solves, runs[0].1, "{name}: ILP solves differ between runs");
            assert!(
                *bytes == runs[0].0,
                "{name}: same inputs, different plan.json"
            );
        }
    }
}

#[test]
fn search_log_counts_what_a_budget_let_it_examine() {
    let out = temp_file("plan-budget.json", "");
    let run = meshplan(&[
        "plan",
        "models/llama3-8b.yaml",
        "topologies/dgx-h100.yaml",
        "--max-candidates",
        "300",
        "-o",
        out.to_str().expect("utf-8 path"),
    ]);
    run.expect_code(0);
    let line = run
        .stderr
        .lines()
        .find(|l| l.contains("searched "))
        .unwrap_or_else(|| panic!("no search line:\n{}", run.stderr));
    assert!(
        line.contains("stopped by the candidate budget (--max-candidates 300)"),
        "{line}"
    );
    let words: Vec<&str> = line
        .split("searched ")
        .nth(1)
        .expect("count")
        .split_whitespace()
        .collect();
    let (examined, of, total): (u64, &str, u64) = (
        words[0].parse().expect("examined"),
        words[1],
        words[2].parse().expect("enumerated"),
    );
    assert_eq!(of, "of", "{line}");
    assert!(examined >= 300 && examined < total, "{line}");
    // Without a limit the whole space is searched and said so.
    let full = meshplan(&[
        "plan",
        "models/llama3-8b.yaml",
        "topologies/dgx-h100.yaml",
        "-o",
        out.to_str().expect("utf-8 path"),
    ]);
    full.expect_code(0);
    assert!(
        full.stderr
            .contains(&format!("searched {total} configurations (")),
        "{}",
        full.stderr
    );
}

#[test]
fn run_help_says_weights_also_fine_tune_training_plans() {
    let run = meshplan(&["run", "--help"]);
    run.expect_code(0);
    let weights = run
        .stdout
        .split("--weights")
        .nth(1)
        .and_then(|s| s.split("\n  ").next())
        .unwrap_or_else(|| panic!("no --weights in:\n{}", run.stdout));
    assert!(weights.contains("fine-tunes"), "{weights}");
    assert!(weights.contains("inference"), "{weights}");
}

#[test]
fn resumed_run_logs_the_steps_it_runs_and_from_where() {
    let plan = plan_file(
        "plan-resume-log.json",
        "models/tiny-gpt.yaml",
        "dp=2,tp=1,pp=1",
    );
    let path = plan.to_str().expect("utf-8 path");
    let dir = std::env::temp_dir().join(format!("meshplan-cli-{}-resume-log", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let ck = dir.to_str().expect("utf-8 path");
    let first = meshplan(&["run", path, "--steps", "2", "--save", ck]);
    first.expect_code(0);
    assert!(
        first.stderr.contains("training 2 steps of"),
        "{}",
        first.stderr
    );
    let resumed = meshplan(&["run", path, "--steps", "5", "--resume", ck]);
    resumed.expect_code(0);
    assert!(
        resumed
            .stderr
            .contains("training 3 steps (from the checkpoint's step 2 to step 5) of"),
        "{}",
        resumed.stderr
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn plan_default_output_is_git_ignored() {
    let ignore = std::fs::read_to_string(format!("{ROOT}/.gitignore")).expect(".gitignore");
    let default = "plan.json";
    assert!(
        ignore
            .lines()
            .map(str::trim)
            .any(|l| l == default || l == format!("/{default}")),
        "`meshplan plan` writes {default} by default (the README's main job); .gitignore:\n{ignore}"
    );
}

/// Test paths (`module::function`) of the `it` test binary.
fn it_test_paths() -> Vec<String> {
    let dir = format!("{ROOT}/tests/it");
    let main = std::fs::read_to_string(format!("{dir}/main.rs")).expect("tests/it/main.rs");
    let mut paths = Vec::new();
    for module in main
        .lines()
        .filter_map(|l| l.trim().strip_prefix("mod "))
        .map(|m| m.trim_end_matches(';'))
    {
        let text = std::fs::read_to_string(format!("{dir}/{module}.rs")).unwrap_or_default();
        let mut after_test = false;
        for line in text.lines().map(str::trim) {
            if line == "#[test]" {
                after_test = true;
            } else if after_test {
                if let Some(rest) = line.strip_prefix("fn ") {
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    paths.push(format!("{module}::{name}"));
                    after_test = false;
                }
            }
        }
    }
    paths
}

/// Every `cargo test` command the README shows runs tests: a filter at the workspace
/// root alone matches nothing (the integration tests are the `it` binary of
/// meshplan-tests), so a filtered command names the package and the binary, and the
/// filter matches at least one test.
#[test]
fn readme_cargo_test_commands_run_tests() {
    let readme = std::fs::read_to_string(format!("{ROOT}/README.md")).expect("README");
    let paths = it_test_paths();
    assert!(paths.len() > 50, "found only {} tests", paths.len());
    let mut commands = Vec::new();
    for (at, _) in readme.match_indices("cargo test") {
        let fenced = readme[..at].matches("```").count() % 2 == 1;
        let rest = &readme[at..];
        let end = if fenced {
            rest.find('\n')
        } else {
            rest.find('`')
        }
        .unwrap_or(rest.len());
        let cmd = rest[..end].split('#').next().unwrap_or("");
        commands.push(cmd.split_whitespace().collect::<Vec<_>>().join(" "));
    }
    assert!(
        commands.iter().any(|c| c.contains("calibration")),
        "the README's accuracy command is gone: {commands:?}"
    );
    for cmd in &commands {
        let words: Vec<&str> = cmd.split_whitespace().skip(2).collect();
        let (mut package, mut binary, mut filter, mut workspace) = (None, None, None, false);
        let mut i = 0;
        while i < words.len() {
            match words[i] {
                "--" => break,
                "-p" | "--package" => {
                    package = words.get(i + 1).copied();
                    i += 1;
                }
                "--test" => {
                    binary = words.get(i + 1).copied();
                    i += 1;
                }
                "--features" | "--bench" | "--target-dir" | "-j" => i += 1,
                "--workspace" => workspace = true,
                w if w.starts_with('-') => {}
                w => filter = Some(w),
            }
            i += 1;
        }
        let Some(filter) = filter else {
            assert!(
                workspace || package.is_some(),
                "`{cmd}`: name a package or --workspace"
            );
            continue;
        };
        assert_eq!(
            (package, binary),
            (Some("meshplan-tests"), Some("it")),
            "`{cmd}`: a filter at the workspace root runs no test; the tests are `-p meshplan-tests --test it`"
        );
        let hits = paths.iter().filter(|p| p.contains(filter)).count();
        assert!(hits > 0, "`{cmd}`: no test of tests/it matches `{filter}`");
    }
}

#[test]
fn plan_fixed_keys_that_cannot_multiply_exit_2_as_written() {
    let run = meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "cp=2,dp=1,tp=1,pp=1",
    ]);
    run.expect_code(2).stderr_has(&[
        "--config cp=2,dp=1,tp=1,pp=1",
        "no configuration of 8 GPUs",
        "dp x tp x pp x cp = 1 x 1 x 1 x 2 = 2 != 8 GPUs",
    ]);
    for debug in ["PartialConfig", "Some(", "None"] {
        assert!(!run.stderr.contains(debug), "{}", run.stderr);
    }
    // The inference search says the same.
    let run = meshplan(&[
        "plan",
        "models/tiny-llama-inference.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "tp=3",
    ]);
    run.expect_code(2)
        .stderr_has(&["--config tp=3", "tp=3 does not divide 8 GPUs"]);
    assert!(!run.stderr.contains("PartialConfig"), "{}", run.stderr);
    // A virtual-stage schedule on one stage.
    meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "pp=1,schedule=interleaved",
    ])
    .expect_code(2)
    .stderr_has(&["--config pp=1,schedule=interleaved", "need pp > 1"]);
}

// === issue 15: a planner you can trust ===

/// The Llama 3 70B serving model with `slo` (and `concurrency`) replaced.
fn llama70b_serving(name: &str, slo: &str, concurrency: u64) -> PathBuf {
    let text = std::fs::read_to_string(format!("{ROOT}/models/llama3-70b-inference.yaml"))
        .expect("llama3-70b-inference.yaml");
    let text = text
        .lines()
        .map(|l| match l.trim_start() {
            s if s.starts_with("slo:") => format!("  slo: {slo}"),
            s if s.starts_with("concurrency:") => format!("  concurrency: {concurrency}"),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    temp_file(name, &text)
}

/// The number after `prefix` in `text` (up to the next space).
#[track_caller]
fn number_after(text: &str, prefix: &str) -> f64 {
    let at = text
        .find(prefix)
        .unwrap_or_else(|| panic!("no `{prefix}` in:\n{text}"));
    let rest = &text[at + prefix.len()..];
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    rest[..end]
        .parse()
        .unwrap_or_else(|e| panic!("`{prefix}` not followed by a number ({e}):\n{text}"))
}

#[test]
fn inference_miss_names_the_violated_objective_its_numbers_and_what_meets_it() {
    let model = llama70b_serving("l70-tpot.yaml", "{ttft_ms: 1000, tpot_ms: 15}", 64);
    let model = model.to_str().expect("utf-8 path");
    let out = temp_file("l70-tpot.json", "");
    let run = meshplan(&[
        "plan",
        model,
        "topologies/dgx-h100.yaml",
        "--quiet",
        "-o",
        out.to_str().expect("utf-8 path"),
    ]);
    run.expect_code(3);
    let msg = run.stderr.clone();
    // TPOT is what fails, with the prediction above the SLO; memory fits and is not
    // blamed.
    assert!(msg.contains("misses TPOT "), "{msg}");
    let tpot = number_after(&msg, "misses TPOT ");
    assert!(
        msg.contains(&format!("TPOT {tpot:.2} ms > SLO 15.00 ms")),
        "{msg}"
    );
    assert!(tpot > 15.0, "{msg}");
    assert!(
        !msg.contains("GiB >") && !msg.contains("GiB capacity"),
        "{msg}"
    );
    assert!(
        msg.contains("TTFT") && msg.contains("<= 1000.0 ms"),
        "{msg}"
    );
    // What would meet it: fewer requests, or more nodes, each with its configuration.
    assert!(msg.contains("fewer concurrent requests"), "{msg}");
    let n = number_after(&msg, "concurrency ") as u64;
    assert!((1..64).contains(&n), "{msg}");
    assert!(msg.contains("--nodes "), "{msg}");
    // The remedy is true: at that concurrency a plan meets the SLO, at one more none.
    let at = llama70b_serving("l70-at.yaml", "{ttft_ms: 1000, tpot_ms: 15}", n);
    let fits = meshplan(&[
        "plan",
        at.to_str().expect("utf-8 path"),
        "topologies/dgx-h100.yaml",
        "--quiet",
        "-o",
        out.to_str().expect("utf-8 path"),
        "--json",
    ]);
    fits.expect_code(0);
    assert!(number(&json_of(&fits)["predicted"], "tpot_s") <= 0.030);
    let over = llama70b_serving("l70-over.yaml", "{ttft_ms: 1000, tpot_ms: 15}", n + 1);
    meshplan(&[
        "plan",
        over.to_str().expect("utf-8 path"),
        "topologies/dgx-h100.yaml",
        "--quiet",
        "-o",
        out.to_str().expect("utf-8 path"),
    ])
    .expect_code(3)
    .stderr_has(&["misses TPOT"]);

    // TTFT is one request's prefill: fewer requests cannot help, a shorter prompt can.
    let ttft = llama70b_serving("l70-ttft.yaml", "{ttft_ms: 50, tpot_ms: 50}", 64);
    let r = meshplan(&[
        "plan",
        ttft.to_str().expect("utf-8 path"),
        "topologies/dgx-h100.yaml",
        "--quiet",
        "-o",
        out.to_str().expect("utf-8 path"),
    ]);
    r.expect_code(3);
    r.stderr_has(&["misses TTFT ", "> SLO 50.0 ms", "prompt_len "]);
    assert!(!r.stderr.contains("TPOT grows"), "{}", r.stderr);

    // Memory, when memory is what fails (no SLO at all).
    let mem = llama70b_serving("l70-mem.yaml", "{}", 100_000);
    let r = meshplan(&[
        "plan",
        mem.to_str().expect("utf-8 path"),
        "topologies/dgx-h100.yaml",
        "--quiet",
        "-o",
        out.to_str().expect("utf-8 path"),
    ]);
    r.expect_code(3);
    r.stderr_has(&[
        "misses per-GPU memory ",
        "GiB > 80.0 GiB capacity",
        "KV cache",
    ]);
    assert!(!r.stderr.contains("> SLO"), "{}", r.stderr);
}

#[test]
fn compare_shows_whole_names_and_flags_rows_that_do_not_fit() {
    let file = temp_file(
        "long-names.yaml",
        "- name: llama-70b-serving-candidate-tp4\n  config: \"dp=2,tp=4\"\n- name: llama-70b-serving-candidate-tp1\n  config: \"dp=8,tp=1\"\n",
    );
    let figures = std::env::temp_dir().join(format!("meshplan-cli-{}-cmp", std::process::id()));
    let run = meshplan(&[
        "compare",
        "models/llama3-70b-inference.yaml",
        "topologies/dgx-h100.yaml",
        "--configs-file",
        file.to_str().expect("utf-8 path"),
        "--config",
        "dp=1,tp=8,pp=1,cp=1,ep=1,mbs=1,zero=0,recompute=none,sp=false,vpp=1,schedule=1f1b",
        "--figures",
        figures.to_str().expect("utf-8 path"),
    ]);
    run.expect_code(0);
    let rows: Vec<&str> = run.stdout.lines().filter(|l| !l.starts_with(' ')).collect();
    let row = |name: &str| {
        *rows
            .iter()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no row named `{name}` in full:\n{}", run.stdout))
    };
    assert!(row("name").ends_with("fits"), "{}", run.stdout);
    assert!(row("planner").ends_with(" yes"), "{}", run.stdout);
    assert!(row("llama-70b-serving-candidate-tp4").ends_with(" yes"));
    // dp=8,tp=1 holds the whole 70B model per GPU: flagged in the table as in the figure.
    assert!(
        row("llama-70b-serving-candidate-tp1").ends_with(" NO"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("does not fit: per-GPU memory"),
        "{}",
        run.stdout
    );
    row("dp=1,tp=8,pp=1,cp=1,ep=1,mbs=1,zero=0,recompute=none,sp=false,vpp=1,schedule=1f1b");
    let svg = std::fs::read_to_string(figures.join("compare.svg")).expect("compare.svg");
    for name in [
        ">llama-70b-serving-candidate-tp4<",
        ">llama-70b-serving-candidate-tp1<",
        ">dp=8,tp=1,pp=1,cp=1,ep=1,mbs=1,zero=0,recompute=none,sp=false,vpp=1,schedule=1f1b<",
    ] {
        assert!(svg.contains(name), "compare.svg lacks {name}");
    }
    assert!(!svg.contains('~'), "a truncated label in compare.svg");
}

#[test]
fn explain_marks_moves_that_do_not_fit_and_never_as_improvements() {
    // ZeRO-3 with one sequence per micro-batch fits 80 GiB (56 GiB): mbs=2 and ZeRO-2
    // are faster but do not fit.
    let out = temp_file("explain-oom.json", "");
    let plan = out.to_str().expect("utf-8 path");
    meshplan(&[
        "plan",
        "models/llama3-8b.yaml",
        "topologies/dgx-h100.yaml",
        "--config",
        "dp=8,tp=1,pp=1,mbs=1,zero=3,recompute=none",
        "--quiet",
        "-o",
        plan,
    ])
    .expect_code(0);
    let j = meshplan(&["explain", plan, "--json"]);
    j.expect_code(0);
    let x = j.json();
    let alts = x["alternatives"].as_array().expect("alternatives");
    let mbs2 = alts
        .iter()
        .find(|a| a["change"] == "mbs 1->2")
        .expect("mbs 1->2");
    assert_eq!(mbs2["feasible"], false, "{mbs2}");
    let sens = x["sensitivity"].as_array().expect("sensitivity");
    let mbs = sens.iter().find(|s| s["key"] == "mbs").expect("mbs");
    assert!(mbs["doubled_pct"].is_null(), "{mbs}");
    assert!(
        mbs["doubled_infeasible"]
            .as_str()
            .is_some_and(|w| w.contains("GiB capacity")),
        "{mbs}"
    );
    // No sensitivity percentage comes from a move that does not fit.
    for s in sens {
        let key = s["key"].as_str().expect("key");
        let value = s["value"].as_u64().expect("value");
        for (field, to) in [("doubled_pct", value * 2), ("halved_pct", value / 2)] {
            let prefix = format!("{key} {value}->{to}");
            let alt = alts.iter().find(|a| {
                let c = a["change"].as_str().unwrap_or("");
                c == prefix || c.starts_with(&format!("{prefix},"))
            });
            if let Some(a) = alt.filter(|a| a["feasible"] == false) {
                assert!(s[field].is_null(), "{s} reports {a}");
            }
        }
    }
    // Text: the sensitivity says infeasible and why; each alternative that does not
    // fit says so on its own line.
    let t = meshplan(&["explain", plan, "--top", "50"]);
    t.expect_code(0);
    let mbs_line = t
        .stdout
        .lines()
        .find(|l| l.trim_start().starts_with("mbs  ="))
        .unwrap_or_else(|| panic!("no mbs sensitivity:\n{}", t.stdout));
    assert!(mbs_line.contains("x2 infeasible"), "{mbs_line}");
    assert!(!mbs_line.contains('%'), "{mbs_line}");
    assert!(
        t.stdout.contains("mbs x2 does not fit: memory"),
        "{}",
        t.stdout
    );
    for a in alts.iter().filter(|a| a["feasible"] == false) {
        let change = a["change"].as_str().expect("change");
        let line = t
            .stdout
            .lines()
            .find(|l| l.contains(&format!(". {change} ")))
            .unwrap_or_else(|| panic!("no line for {change}:\n{}", t.stdout));
        assert!(line.contains("does not fit: "), "{line}");
    }
}

#[test]
fn sglang_export_keeps_experts_inside_one_server() {
    let workload = temp_file(
        "mixtral-serve.yaml",
        "kind: inference\nprompt_len: 2048\noutput_len: 256\nconcurrency: 64\n",
    );
    let workload = workload.to_str().expect("utf-8 path");
    let plan_of = |name: &str, cfg: &str| {
        let out = temp_file(name, "");
        meshplan(&[
            "plan",
            "models/mixtral-8x7b.yaml",
            "topologies/dgx-h100.yaml",
            "--workload",
            workload,
            "--config",
            cfg,
            "--quiet",
            "-o",
            out.to_str().expect("utf-8 path"),
        ])
        .expect_code(0);
        out.display().to_string()
    };
    // Experts over 8 ranks, attention replicas of 2: one SGLang server of 8 ranks whose
    // attention runs in 4 data-parallel groups of 2 (SGLang's MoE tensor width stays
    // 1; `--tp-size 2 --ep-size 8` would derive 0 and crash at launch).
    let spans = plan_of("mixtral-ep8.json", "dp=4,tp=2,ep=8,dp_attention=false");
    let r = meshplan(&["export", &spans, "--to", "sglang"]);
    r.expect_code(0);
    for line in ["--tp-size 8", "--attn-dp-size 4", "--ep-size 8"] {
        assert!(r.stdout.lines().any(|l| l == line), "{line}:\n{}", r.stdout);
    }
    // Experts inside a server's tensor ranks: the flags follow the rule.
    for (name, cfg, tp, ep) in [
        (
            "mixtral-ep2.json",
            "dp=4,tp=2,ep=2,dp_attention=false",
            2,
            2,
        ),
        (
            "mixtral-tp8.json",
            "dp=1,tp=8,ep=8,dp_attention=false",
            8,
            8,
        ),
    ] {
        let plan = plan_of(name, cfg);
        let r = meshplan(&["export", &plan, "--to", "sglang"]);
        r.expect_code(0);
        let flag = |f: &str| -> u64 {
            let line = r
                .stdout
                .lines()
                .find(|l| l.starts_with(&format!("{f} ")))
                .unwrap_or_else(|| panic!("{cfg}: no {f}:\n{}", r.stdout));
            line[f.len() + 1..].trim().parse().expect("a number")
        };
        assert_eq!((flag("--tp-size"), flag("--ep-size")), (tp, ep), "{cfg}");
        assert!(flag("--tp-size") % flag("--ep-size") == 0, "{}", r.stdout);
    }
}

#[test]
fn config_keys_that_mean_nothing_for_the_workload_exit_2() {
    let serve = "models/llama3-70b-inference.yaml";
    let node = "topologies/dgx-h100.yaml";
    for (cfg, key) in [
        ("tp=8,zero=1", "zero"),
        ("tp=8,recompute=full", "recompute"),
        ("tp=8,mbs=4", "mbs"),
        ("tp=8,sp=true", "sp"),
    ] {
        for cmd in ["plan", "estimate"] {
            let r = meshplan(&[cmd, serve, node, "--config", cfg]);
            r.expect_code(2);
            r.stderr_has(&[
                "--config",
                &format!("field `{key}`"),
                "means nothing for an inference workload",
                "remove it",
            ]);
            assert!(!r.stderr.contains("Invalid {"), "{}", r.stderr);
        }
    }
    // A configuration file names itself and the entry.
    let file = temp_file(
        "inference-zero.yaml",
        "- name: sharded\n  config: \"tp=4,zero=3\"\n",
    );
    let r = meshplan(&[
        "compare",
        serve,
        node,
        "--configs-file",
        file.to_str().expect("utf-8 path"),
    ]);
    r.expect_code(2);
    r.stderr_has(&["inference-zero.yaml", "entry `sharded`", "field `zero`"]);
    // The strategy meshplan prints for an inference plan reads back.
    meshplan(&[
        "estimate",
        serve,
        node,
        "--config",
        "dp=1,tp=8,pp=1,cp=1,ep=1,mbs=1,zero=0,recompute=none,sp=false,vpp=1,schedule=1f1b",
    ])
    .expect_code(0);
    // DP-attention is a serving layout: refused for training.
    for cmd in ["estimate", "compare"] {
        let r = meshplan(&[
            cmd,
            "models/llama3-8b.yaml",
            node,
            "--config",
            "tp=8,dp_attention=true",
        ]);
        r.expect_code(2);
        r.stderr_has(&[
            "field `dp_attention`",
            "means nothing for training",
            "remove it",
        ]);
    }
    meshplan(&[
        "estimate",
        "models/llama3-8b.yaml",
        node,
        "--config",
        "tp=8,dp_attention=false",
    ])
    .expect_code(0);
}

#[test]
fn a_closed_or_full_standard_output_ends_without_a_panic() {
    // A reader that goes away: a quiet end, no backtrace.
    let mut child = crate::bin::command()
        .args(["inspect", "models/small-gpt.yaml"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(0), "{err}");
    // A full device: an error naming it, exit 1.
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full");
    if let Ok(full) = full {
        let out = crate::bin::command()
            .args(["inspect", "models/small-gpt.yaml"])
            .stdout(full)
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains("cannot write to standard output") && !err.contains("panicked"),
            "{err}"
        );
    }
}

#[test]
fn a_key_given_twice_a_byte_order_mark_and_training_flags_on_inference() {
    // `--config dp=4,dp=8` is refused naming the key, not resolved to the last.
    meshplan(&[
        "estimate",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "dp=4,dp=8",
    ])
    .expect_code(2)
    .stderr_has(&["`dp` is given twice", "give it once"]);
    // A UTF-8 byte order mark before a model and a cluster file is not content.
    let model = std::fs::read_to_string(format!("{ROOT}/models/tiny-gpt.yaml")).expect("model");
    let cluster =
        std::fs::read_to_string(format!("{ROOT}/topologies/cpu-test-mesh.yaml")).expect("cluster");
    let m = temp_file("bom-model.yaml", &format!("\u{feff}{model}"));
    let c = temp_file("bom-cluster.yaml", &format!("\u{feff}{cluster}"));
    meshplan(&[
        "estimate",
        m.to_str().expect("path"),
        c.to_str().expect("path"),
        "--config",
        "dp=8",
    ])
    .expect_code(0);
    // Training flags on an inference plan exit 2 naming them.
    let plan = temp_file("inference-plan-flags.json", "");
    let p = plan.to_str().expect("path");
    meshplan(&[
        "plan",
        "models/tiny-llama-inference.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "tp=2",
        "-o",
        p,
    ])
    .expect_code(0);
    meshplan(&["run", p, "--steps", "3", "--resume", "ck"])
        .expect_code(2)
        .stderr_has(&["--steps, --resume train", "inference plan"]);
}

/// The first trace of Rust's `{:?}` of a struct or an option in `text`: `Name { field:`
/// or `Some(`. A user reads messages in words, never a debug dump.
pub(crate) fn debug_dump(text: &str) -> Option<String> {
    if let Some(i) = text.find("Some(") {
        return Some(text[i..].chars().take(30).collect());
    }
    let b = text.as_bytes();
    for (i, w) in text.match_indices(" { ") {
        let _ = w;
        let name_start = text[..i]
            .rfind(|c: char| !c.is_ascii_alphanumeric() && c != '_')
            .map_or(0, |j| j + 1);
        let name = &text[name_start..i];
        let field: String = text[i + 3..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_')
            .collect();
        let after = i + 3 + field.len();
        if name.starts_with(|c: char| c.is_ascii_uppercase())
            && !field.is_empty()
            && b.get(after) == Some(&b':')
        {
            return Some(text[name_start..].chars().take(40).collect());
        }
    }
    None
}

#[test]
fn the_debug_dump_detector_finds_what_it_should() {
    assert!(debug_dump("fixed keys PartialConfig { dp: Some(1), tp: None }").is_some());
    assert!(debug_dump("expected Some(3)").is_some());
    assert!(debug_dump("got Linear { factor: 2.0 }").is_some());
    assert!(debug_dump("no configuration of 8 GPUs satisfies the fixed keys cp=2, dp=1").is_none());
    assert!(debug_dump("field `x` {expected}: 3").is_none());
}

/// Every spelling of a dtype users write plans the same model, written back in the
/// canonical spelling; an unknown one exits 2 naming the file, the field and the
/// spellings.
#[test]
fn dtype_spellings() {
    let dir = std::env::temp_dir().join(format!("meshplan-dtypes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let text = std::fs::read_to_string(format!("{ROOT}/models/tiny-gpt.yaml")).expect("tiny-gpt");
    assert!(text.contains("dtype: "), "tiny-gpt.yaml names its dtype");
    let with = |dtype: &str| {
        let lines: Vec<String> = text
            .lines()
            .map(|l| {
                if l.starts_with("dtype:") {
                    format!("dtype: {dtype}")
                } else {
                    l.to_string()
                }
            })
            .collect();
        let p = dir.join(format!("m-{dtype}.yaml"));
        std::fs::write(&p, lines.join("\n")).expect("model");
        p.display().to_string()
    };
    for (spellings, canonical) in [
        (&["fp32", "float32", "f32", "FP32"][..], "f32"),
        (&["bf16", "bfloat16"][..], "bf16"),
        (&["fp16", "f16", "float16", "half"][..], "f16"),
    ] {
        for s in spellings {
            let m = with(s);
            let r = meshplan(&["inspect", &m, "--json"]);
            r.expect_code(0);
            assert_eq!(r.json()["dtype"], canonical, "{s}");
        }
    }
    let m = with("float64");
    meshplan(&["inspect", &m, "--json"])
        .expect_code(2)
        .stderr_has(&[&m, "dtype", "unknown dtype `float64`", "fp32", "bfloat16"]);
}

/// Fixed degrees that cannot multiply to the cluster's GPUs: exit 2 with the keys
/// in the `--config` spelling and why, never a debug dump (checked by `meshplan`).
#[test]
fn unsatisfiable_fixed_keys_are_explained_in_words() {
    let r = meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "cp=2,dp=1,tp=1,pp=1",
    ]);
    r.expect_code(2).stderr_has(&["cp=2", "dp=1"]);
}
