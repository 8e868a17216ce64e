//! Calibration overlays (`--calibration`, `calibration:` in a cluster file, the
//! overlay `meshplan calibrate` writes): the cost model prices with the measured
//! numbers, by the amounts worked out by hand in each test's comment, and bad
//! overlays exit 2 naming the file, the field and the fix.

use crate::bin::{meshplan, temp_dir, ROOT};
use meshplan_cost_model::calibrate::{
    build_overlay, AttentionCase, AttentionSample, CollectiveSample, GemmSample, MeasurementPlan,
    Measurements, SizeSample,
};
use meshplan_cost_model::compute::Roofline;
use meshplan_cost_model::overlay::{parse_overlay_yaml, LinkOp};
use meshplan_cost_model::{
    load_cluster, load_cluster_calibrated, Collective, CommModel, GroupShape,
};
use meshplan_ir::DType;
use std::path::{Path, PathBuf};

// === helpers ===

/// A compute-bound model: one `[4096, 4096]` weight applied to 4096 tokens, so the
/// forward and both backward products are `4096^3` cubes.
pub(crate) const ONE_MATMUL: &str = "\
name: one-matmul
dtype: bf16
graph:
  dims:
    hidden: 4096
  tensors:
    x: {shape: [batch, seq, hidden]}
    w: {shape: [hidden, hidden], kind: weight}
    y: {shape: [batch, seq, hidden]}
  ops:
    - name: mm
      kind: matmul
      einsum: \"bsh,hk->bsk\"
      inputs: [x, w]
      outputs: [y]
workload:
  kind: train
  seq_len: 4096
  global_batch: 8
  optimizer: adamw
";

/// One H100 (datasheet bf16 peak 989 TFLOP/s, 3350 GB/s).
const ONE_H100: &str = "\
name: one-h100
nodes: 1
gpus_per_node: 1
gpu:
  name: H100-SXM5-80GB
  memory_gib: 80
  peak_tflops: {bf16: 989, fp32: 67}
  hbm_gbps: 3350
intra_node:
  link: nvlink4
  bandwidth_gbps: 450
  latency_us: 3
";

/// Two A100-like GPUs of one node, for tensor parallelism.
const TWO_GPUS: &str = "\
name: two-gpus
nodes: 1
gpus_per_node: 2
gpu:
  name: A100-SXM4-80GB
  memory_gib: 80
  peak_tflops: {bf16: 312, fp32: 19.5}
  hbm_gbps: 2039
intra_node:
  link: nvlink3
  bandwidth_gbps: 300
  latency_us: 3
";

pub(crate) fn header(device: &str) -> String {
    format!(
        "format: 1\ndevice: {device}\nmeasured_at: 2025-06-01T12:00:00Z\nmeasured_with: hand-written test overlay\n"
    )
}

pub(crate) fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write test file");
    p
}

fn estimate_json(
    model: &Path,
    cluster: &Path,
    config: &str,
    overlay: Option<&Path>,
) -> serde_json::Value {
    let (m, c) = (model.display().to_string(), cluster.display().to_string());
    let mut args = vec![
        "estimate",
        m.as_str(),
        c.as_str(),
        "--config",
        config,
        "--json",
    ];
    let o = overlay.map(|p| p.display().to_string());
    if let Some(o) = &o {
        args.extend(["--calibration", o.as_str()]);
    }
    let run = meshplan(&args);
    run.expect_code(0);
    run.json()
}

pub(crate) fn f(v: &serde_json::Value, ptr: &str) -> f64 {
    v.pointer(ptr)
        .and_then(|x| x.as_f64())
        .unwrap_or_else(|| panic!("no number at {ptr} in {v}"))
}

#[track_caller]
pub(crate) fn assert_close(what: &str, got: f64, want: f64, rel: f64) {
    assert!(
        (got - want).abs() <= rel * want.abs(),
        "{what}: got {got}, want {want} (relative tolerance {rel:e})"
    );
}

// === the cost model uses the measurements ===

#[test]
fn halved_gemm_rate_adds_the_gemm_time_to_estimate() {
    // Overlay A measures 4096^3 bf16 products at 600 TFLOP/s, B at 300; both the same
    // HBM bandwidth (3000 GB/s). The model runs 8 micro-batches (global batch 8, mbs
    // 1), each one forward and two backward 4096^3 products of 2 * 4096^3 =
    // 1.37439e11 FLOPs: at 600 TFLOP/s each takes 229.0650 us, compute-bound (it
    // moves 3 * 4096^2 * 2 B = 100.7 MB, 33.6 us at 3000 GB/s). Halving the rate
    // doubles each product, so the step grows by 24 * 229.0650 us = 5.497558 ms, the
    // GEMM time at the full rate; nothing else changes.
    let dir = temp_dir("overlay-gemm");
    let model = write(&dir, "mm.yaml", ONE_MATMUL);
    let cluster = write(&dir, "one-h100.yaml", ONE_H100);
    let overlay = |tflops: f64| {
        format!(
            "{}gemm:\n  bf16:\n    - {{m: 4096, n: 4096, k: 4096, tflops: {tflops}}}\nhbm_gbps: 3000\n",
            header("NVIDIA H100 80GB HBM3")
        )
    };
    let a = write(&dir, "a.yaml", &overlay(600.0));
    let b = write(&dir, "b.yaml", &overlay(300.0));
    let ea = estimate_json(&model, &cluster, "dp=1", Some(&a));
    let eb = estimate_json(&model, &cluster, "dp=1", Some(&b));
    let gemm_at_600 = 24.0 * 2.0 * 4096f64.powi(3) / 600e12;
    assert_close("hand-worked GEMM time", gemm_at_600, 5.497558e-3, 1e-6);
    let d_step = f(&eb, "/step_time_s") - f(&ea, "/step_time_s");
    assert_close("step time difference", d_step, gemm_at_600, 1e-9);
    let d_compute = f(&eb, "/time_breakdown_s/compute") - f(&ea, "/time_breakdown_s/compute");
    assert_close("compute difference", d_compute, gemm_at_600, 1e-9);
    // Against the datasheet (no overlay) the measured 600 TFLOP/s changes the time:
    // the fitted A100/H100 efficiency is not 600/989.
    let e0 = estimate_json(&model, &cluster, "dp=1", None);
    assert!(f(&e0, "/step_time_s") != f(&ea, "/step_time_s"));
}

#[test]
fn measured_hbm_bandwidth_prices_memory_bound_work() {
    // The optimizer step of 4096^2 fp32-master parameters moves
    // ADAMW_BYTES_PER_PARAM (30) B per parameter: 503.3 MB. At a measured 1000
    // GB/s against 2000 GB/s it takes 503.316 us against 251.658 us, so the step
    // grows by 251.658 us (the GEMMs stay compute-bound at both bandwidths:
    // 100.7 MB per product is at most 100.7 us against 229.1 us of compute).
    let dir = temp_dir("overlay-hbm");
    let model = write(&dir, "mm.yaml", ONE_MATMUL);
    let cluster = write(&dir, "one-h100.yaml", ONE_H100);
    let overlay = |gbps: f64| {
        format!(
            "{}gemm:\n  bf16:\n    - {{m: 4096, n: 4096, k: 4096, tflops: 600}}\nhbm_gbps: {gbps}\n",
            header("NVIDIA H100 80GB HBM3")
        )
    };
    let fast = write(&dir, "fast.yaml", &overlay(2000.0));
    let slow = write(&dir, "slow.yaml", &overlay(1000.0));
    let d = f(
        &estimate_json(&model, &cluster, "dp=1", Some(&slow)),
        "/step_time_s",
    ) - f(
        &estimate_json(&model, &cluster, "dp=1", Some(&fast)),
        "/step_time_s",
    );
    let opt_bytes = 4096.0 * 4096.0 * 30.0;
    assert_close("optimizer bytes", opt_bytes, 503.316e6, 1e-6);
    assert_close(
        "step difference",
        d,
        opt_bytes / 1000e9 - opt_bytes / 2000e9,
        1e-9,
    );
}

#[test]
fn measured_all_reduce_gives_alpha_plus_bytes_over_beta() {
    // DGX H100 with an overlay measuring AllReduce over 8 GPUs at alpha = 25 us,
    // beta = 180 GB/s: a 256 MiB AllReduce of the tensor axis takes
    // 25e-6 + 268435456 / 180e9 = 1.516308 ms. Without the overlay the link model
    // gives the ring over NVLink4 at 78% of 450 GB/s: 14 * 3 us + 1.75 * 268435456 /
    // 351e9 = 1.380353 ms. Sizes the overlay does not name (4 GPUs) keep the model.
    let dir = temp_dir("overlay-ar");
    let overlay = write(
        &dir,
        "h100.yaml",
        &format!(
            "{}intra_node:\n  - {{collective: all_reduce, ranks: 8, alpha_us: 25, beta_gbps: 180}}\n  - {{collective: send_recv, ranks: 2, alpha_us: 5, beta_gbps: 300}}\n",
            header("NVIDIA H100 80GB HBM3")
        ),
    );
    let path = Path::new(ROOT).join("topologies/dgx-h100.yaml");
    let plain = CommModel::new(&load_cluster(&path, None).expect("dgx-h100"));
    let cal = CommModel::new(
        &load_cluster_calibrated(&path, None, Some(&overlay)).expect("calibrated dgx-h100"),
    );
    let g8 = GroupShape {
        size: 8,
        per_node: 8,
    };
    let bytes = 268435456.0;
    assert_close(
        "measured AllReduce",
        cal.time_s(Collective::AllReduce, g8, bytes),
        1.516308e-3,
        1e-6,
    );
    assert_close(
        "datasheet AllReduce",
        plain.time_s(Collective::AllReduce, g8, bytes),
        1.380353e-3,
        1e-6,
    );
    let g4 = GroupShape {
        size: 4,
        per_node: 4,
    };
    assert_eq!(
        cal.time_s(Collective::AllReduce, g4, bytes),
        plain.time_s(Collective::AllReduce, g4, bytes)
    );
    // A pipeline send inside the node: 5 us + 64 MiB / 300 GB/s = 228.6962 us.
    assert_close(
        "send_recv",
        cal.p2p_time_s(true, 67108864.0),
        228.6962e-6,
        1e-6,
    );
    assert_eq!(cal.p2p_time_s(false, 1e6), plain.p2p_time_s(false, 1e6));
}

#[test]
fn measured_beta_changes_tensor_parallel_step_time_by_the_bytes() {
    // small-gpt with tp=2 on two GPUs of one node: every tensor-parallel collective
    // (no sequence parallelism) is an AllReduce over 2 ranks, which sends its whole
    // message once (2(n-1)/n = 1), so comm_bytes_per_gpu.tp is the sum of the
    // messages. With beta 100 GB/s against 50 GB/s (alpha 10 us in both) every
    // AllReduce takes bytes/100e9 longer, all of it exposed (pp = 1, no overlap): the
    // step grows by tp_bytes * (1/50e9 - 1/100e9).
    let dir = temp_dir("overlay-tp");
    let cluster = write(&dir, "two.yaml", TWO_GPUS);
    let overlay = |beta: f64, alpha: f64| {
        format!(
            "{}intra_node:\n  - {{collective: all_reduce, ranks: 2, alpha_us: {alpha}, beta_gbps: {beta}}}\n",
            header("NVIDIA A100-SXM4-80GB")
        )
    };
    // small-gpt, not tiny-gpt: on an A100 tiny-gpt is so small that the search's
    // placements (which `estimate` prices with, as `plan` does) keep it off the
    // tensor axis altogether.
    let model = Path::new(ROOT).join("models/small-gpt.yaml");
    let fast = estimate_json(
        &model,
        &cluster,
        "tp=2",
        Some(&write(&dir, "f.yaml", &overlay(100.0, 10.0))),
    );
    let slow = estimate_json(
        &model,
        &cluster,
        "tp=2",
        Some(&write(&dir, "s.yaml", &overlay(50.0, 10.0))),
    );
    let tp_bytes = f(&fast, "/comm_bytes_per_gpu/tp");
    assert!(tp_bytes > 0.0);
    assert_eq!(tp_bytes, f(&slow, "/comm_bytes_per_gpu/tp"));
    let d = f(&slow, "/step_time_s") - f(&fast, "/step_time_s");
    assert_close(
        "step difference",
        d,
        tp_bytes * (1.0 / 50e9 - 1.0 / 100e9),
        1e-6,
    );
}

#[test]
fn measured_attention_rate_replaces_the_flash_efficiency() {
    // The flash forward of a kernel of F FLOPs takes F / rate when compute-bound: a
    // measured 450 TFLOP/s on a 989 TFLOP/s part is an efficiency of 0.455005; the
    // backward (2.5 F) at a measured 300 TFLOP/s is 0.303337.
    let dir = temp_dir("overlay-attn");
    let overlay = write(
        &dir,
        "attn.yaml",
        &format!(
            "{}attention:\n  bf16: {{forward_tflops: 450, backward_tflops: 300}}\n",
            header("NVIDIA H100 80GB HBM3")
        ),
    );
    let path = Path::new(ROOT).join("topologies/dgx-h100.yaml");
    let c = load_cluster_calibrated(&path, None, Some(&overlay)).expect("calibrated");
    let r = Roofline::new(&c, DType::Bf16);
    assert_close(
        "forward efficiency",
        r.flash_fwd_efficiency,
        450.0 / 989.0,
        1e-12,
    );
    assert_close(
        "backward efficiency",
        r.flash_bwd_efficiency,
        300.0 / 989.0,
        1e-12,
    );
    // Other dtypes keep the fitted constant (on Hopper, scaled as FlashAttention-2
    // runs there).
    let r32 = Roofline::new(&c, DType::F32);
    assert_eq!(
        r32.flash_fwd_efficiency,
        meshplan_cost_model::calib::FLASH_ATTENTION_EFFICIENCY
            * meshplan_cost_model::calib::flash_arch_scale("H100")
    );
}

// === where overlays come from ===

#[test]
fn a_cluster_file_may_name_its_overlay_and_the_flag_wins() {
    // The cluster names `a.yaml` (600 TFLOP/s); `--calibration b.yaml` (300) replaces
    // it: the same 5.497558 ms difference as with two flags.
    let dir = temp_dir("overlay-named");
    let model = write(&dir, "mm.yaml", ONE_MATMUL);
    let overlay = |tflops: f64| {
        format!(
            "{}gemm:\n  bf16:\n    - {{m: 4096, n: 4096, k: 4096, tflops: {tflops}}}\nhbm_gbps: 3000\n",
            header("NVIDIA H100 80GB HBM3")
        )
    };
    write(&dir, "a.yaml", &overlay(600.0));
    let b = write(&dir, "b.yaml", &overlay(300.0));
    let cluster = write(
        &dir,
        "named.yaml",
        &format!("{ONE_H100}calibration: a.yaml\n"),
    );
    let named = estimate_json(&model, &cluster, "dp=1", None);
    let flagged = estimate_json(&model, &cluster, "dp=1", Some(&b));
    let d = f(&flagged, "/step_time_s") - f(&named, "/step_time_s");
    assert_close(
        "named vs flag",
        d,
        24.0 * 2.0 * 4096f64.powi(3) / 600e12,
        1e-9,
    );
    // A plan records the overlay with its cluster.
    let out = dir.join("plan.json");
    let (m, c, o) = (
        model.display().to_string(),
        cluster.display().to_string(),
        out.display().to_string(),
    );
    meshplan(&["plan", &m, &c, "-o", &o, "--quiet"]).expect_code(0);
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("plan")).expect("json");
    let device = plan
        .pointer("/cluster/spec/calibration/device")
        .and_then(|d| d.as_str());
    assert_eq!(device, Some("NVIDIA H100 80GB HBM3"), "{}", plan["cluster"]);
}

#[test]
fn bad_overlays_exit_2_naming_file_field_and_fix() {
    let dir = temp_dir("overlay-bad");
    let model = write(&dir, "mm.yaml", ONE_MATMUL);
    let cluster = write(&dir, "one-h100.yaml", ONE_H100);
    let (m, c) = (model.display().to_string(), cluster.display().to_string());
    let cases: &[(&str, String, &[&str])] = &[
        (
            "over-peak",
            format!("{}gemm:\n  bf16:\n    - {{m: 8192, n: 8192, k: 8192, tflops: 1200}}\n", header("H100")),
            &["over-peak.yaml", "gemm.bf16[0].tflops", "exceeds the cluster's gpu.peak_tflops.bf16 of 989", "another GPU"],
        ),
        (
            "dtype",
            format!("{}gemm:\n  bf17:\n    - {{m: 1, n: 1, k: 1, tflops: 1}}\n", header("H100")),
            &["gemm.bf17", "expected bf16, fp16, fp32 or fp8"],
        ),
        (
            "collective",
            format!("{}intra_node:\n  - {{collective: allreduce, ranks: 2, alpha_us: 1, beta_gbps: 1}}\n", header("H100")),
            &["intra_node[0].collective", "all_reduce"],
        ),
        (
            "ranks",
            format!("{}intra_node:\n  - {{collective: all_reduce, ranks: 8, alpha_us: 1, beta_gbps: 1}}\n", header("H100")),
            &["intra_node[0].ranks", "do not fit in one node of 1 GPUs", "remove the entry"],
        ),
        (
            "beta",
            format!("{}intra_node:\n  - {{collective: send_recv, ranks: 2, alpha_us: 1, beta_gbps: 0}}\n", header("H100")),
            &["ranks", "do not fit"],
        ),
        (
            "format",
            header("H100").replace("format: 1", "format: 7"),
            &["field `format`", "measure again"],
        ),
        (
            "unknown",
            format!("{}hbm_gbs: 100\n", header("H100")),
            &["unknown.yaml", "hbm_gbs"],
        ),
    ];
    for (name, text, needles) in cases {
        let p = write(&dir, &format!("{name}.yaml"), text);
        let ps = p.display().to_string();
        let run = meshplan(&["estimate", &m, &c, "--config", "dp=1", "--calibration", &ps]);
        run.expect_code(2);
        for n in *needles {
            assert!(
                run.stderr.contains(n),
                "{name}: `{n}` missing from:\n{}",
                run.stderr
            );
        }
    }
    // A zero bandwidth on a two-GPU node: the field is named.
    let two = write(&dir, "two.yaml", TWO_GPUS);
    let p = write(
        &dir,
        "zero-beta.yaml",
        &format!(
            "{}intra_node:\n  - {{collective: send_recv, ranks: 2, alpha_us: 1, beta_gbps: 0}}\n",
            header("A100")
        ),
    );
    let run = meshplan(&[
        "estimate",
        &m,
        &two.display().to_string(),
        "--config",
        "dp=2",
        "--calibration",
        &p.display().to_string(),
    ]);
    run.expect_code(2);
    assert!(
        run.stderr.contains("intra_node[0].beta_gbps"),
        "{}",
        run.stderr
    );
    // A missing overlay named by the cluster file.
    let named = write(
        &dir,
        "named.yaml",
        &format!("{ONE_H100}calibration: nowhere.yaml\n"),
    );
    let run = meshplan(&[
        "estimate",
        &m,
        &named.display().to_string(),
        "--config",
        "dp=1",
    ]);
    run.expect_code(2);
    assert!(run.stderr.contains("field `calibration`"), "{}", run.stderr);
    assert!(run.stderr.contains("nowhere.yaml"), "{}", run.stderr);
    // A missing --calibration file.
    let run = meshplan(&[
        "estimate",
        &m,
        &c,
        "--config",
        "dp=1",
        "--calibration",
        "/nonexistent/o.yaml",
    ]);
    run.expect_code(2);
    assert!(run.stderr.contains("/nonexistent/o.yaml"), "{}", run.stderr);
}

// === calibrate ===

/// Synthetic measurements of an 8-GPU H100 node with known answers.
fn synthetic() -> Measurements {
    let mut m = Measurements {
        device: "NVIDIA H100 80GB HBM3".into(),
        gpus_per_node: 8,
        measured_with: "synthetic".into(),
        ..Measurements::default()
    };
    // GEMMs: side d runs at 700 * d / (d + 512) TFLOP/s; three repeats, the median
    // the true time.
    for d in [1024u64, 4096, 8192] {
        let rate = 700e12 * d as f64 / (d as f64 + 512.0);
        let t = 2.0 * (d as f64).powi(3) / rate;
        for k in [1.1, 1.0, 0.999] {
            m.gemm.push(GemmSample {
                dtype: DType::Bf16,
                m: d,
                n: d,
                k: d,
                seconds: t * k,
            });
        }
    }
    // Copies moving B bytes at 2 us + B / 3000 GB/s.
    for b in [128e6, 512e6, 2048e6] {
        m.hbm.push(SizeSample {
            bytes: b,
            seconds: 2e-6 + b / 3000e9,
        });
    }
    // Attention at exactly 500 TFLOP/s forward and 350 backward.
    let case = AttentionCase {
        batch: 4,
        heads: 16,
        seq: 4096,
        head_dim: 128,
        causal: true,
    };
    m.attention.push(AttentionSample {
        dtype: DType::Bf16,
        case,
        forward_s: case.forward_flops() / 500e12,
        backward_s: 2.5 * case.forward_flops() / 350e12,
    });
    // Collectives on the standard sweep's sizes: AllReduce over 8 at 30 us + B / 170
    // GB/s, send/recv at 8 us + B / 320 GB/s.
    let plan = MeasurementPlan::standard(8);
    for sweep in &plan.collectives {
        let (alpha, beta) = match (sweep.op, sweep.ranks) {
            (LinkOp::AllReduce, 8) => (30e-6, 170e9),
            (LinkOp::SendRecv, 2) => (8e-6, 320e9),
            _ => continue,
        };
        for &b in &sweep.bytes {
            m.collectives.push(CollectiveSample {
                op: sweep.op,
                ranks: sweep.ranks,
                sample: SizeSample {
                    bytes: b as f64,
                    seconds: alpha + b as f64 / beta,
                },
            });
        }
    }
    m
}

#[test]
fn calibrate_fits_synthetic_measurements_into_an_overlay_the_cost_model_reads() {
    let overlay = build_overlay(&synthetic(), "2025-06-01T12:00:00Z").expect("overlay");
    // GEMM: 700 * 1024/1536 = 466.667, 700 * 4096/4608 = 622.222, 700 * 8192/8704 =
    // 658.824 TFLOP/s.
    let bf16 = &overlay.gemm["bf16"];
    let rates: Vec<f64> = bf16.iter().map(|p| p.tflops).collect();
    assert_eq!(rates, vec![466.667, 622.222, 658.824]);
    assert_eq!(overlay.hbm_gbps, Some(3000.0));
    let a = overlay.attention["bf16"];
    assert_eq!((a.forward_tflops, a.backward_tflops), (500.0, Some(350.0)));
    let fits: Vec<(String, u64, f64, f64)> = overlay
        .intra_node
        .iter()
        .map(|c| (c.collective.clone(), c.ranks, c.alpha_us, c.beta_gbps))
        .collect();
    assert_eq!(
        fits,
        vec![
            ("all_reduce".to_string(), 8, 30.0, 170.0),
            ("send_recv".to_string(), 2, 8.0, 320.0)
        ]
    );
    // The YAML round-trips and prices: a 1 GiB AllReduce over the node's 8 GPUs
    // takes 30 us + 1073741824 / 170e9 = 6.346129 ms.
    let yaml = overlay.to_yaml();
    assert_eq!(
        parse_overlay_yaml(&yaml, "written.yaml").expect("parses"),
        overlay
    );
    let dir = temp_dir("overlay-calibrate");
    let path = write(&dir, "h100-overlay.yaml", &yaml);
    let cluster = load_cluster_calibrated(
        &Path::new(ROOT).join("topologies/dgx-h100.yaml"),
        None,
        Some(&path),
    )
    .expect("the written overlay applies to dgx-h100");
    let t = CommModel::new(&cluster).time_s(
        Collective::AllReduce,
        GroupShape {
            size: 8,
            per_node: 8,
        },
        1073741824.0,
    );
    assert_close("AllReduce from the fitted overlay", t, 6.346129e-3, 1e-6);
    // And the GEMM curve: a 4096^3 product at 622.222 TFLOP/s.
    let r = Roofline::new(&cluster, DType::Bf16);
    assert_close(
        "4096^3 rate",
        r.gemm_rate(4096.0, 4096.0, 4096.0),
        622.222e12,
        1e-12,
    );
}

#[test]
fn calibrate_without_a_gpu_exits_1_and_writes_nothing() {
    let dir = temp_dir("calibrate-cli");
    let out = dir.join("overlay.yaml");
    let o = out.display().to_string();
    let run = meshplan(&["calibrate", "-o", &o]);
    run.expect_code(1);
    assert!(run.stderr.contains("no CUDA backend"), "{}", run.stderr);
    assert!(!out.exists());
    let run = meshplan(&["calibrate", "--backend", "cpu", "-o", &o]);
    run.expect_code(2);
    assert!(run.stderr.contains("--backend cuda"), "{}", run.stderr);
    let run = meshplan(&["calibrate", "--dry-run", "-o", &o]);
    run.expect_code(0);
    for needle in [
        "16384x16384x16384",
        "all_reduce",
        "send_recv",
        "4096 B to 1073741824 B",
    ] {
        assert!(run.stdout.contains(needle), "{needle}: {}", run.stdout);
    }
}
