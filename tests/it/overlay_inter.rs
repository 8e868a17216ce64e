//! Calibration overlays across nodes (`inter_node:`, what `meshplan calibrate` writes
//! under a launch on two or more nodes): `estimate` prices a data-parallel gradient
//! AllReduce that spans nodes with the measured fit, by the amounts worked out by hand
//! in each test's comment; bad entries exit 2 naming the file, the field and the fix;
//! the dry run lists the sweep across nodes.

use crate::bin::{meshplan, temp_dir, ROOT};
use crate::overlay::{assert_close, f, header, write, ONE_MATMUL};
use meshplan_cost_model::calibrate::{
    build_overlay, InterNodeSample, MeasurementPlan, Measurements, SizeSample,
};
use meshplan_cost_model::overlay::{parse_overlay_yaml, LinkOp};
use meshplan_cost_model::{
    load_cluster, load_cluster_calibrated, Collective, CommModel, GroupShape,
};
use std::path::{Path, PathBuf};

/// One `[4096, 4096]` bf16 weight over 4096-token sequences: 16,777,216 parameters
/// whose gradients, fp32 in meshplan's executor (67,108,864 bytes, under 40M
/// parameters: one bucket, all of it exposed after the backward), are the only bytes
/// data parallelism moves.
fn one_matmul() -> String {
    ONE_MATMUL.replace("global_batch: 8\n", "global_batch: 32\n")
}

/// The gradient bytes of [`one_matmul`]: 4096^2 parameters x 4 bytes.
const GRAD_BYTES: f64 = 67_108_864.0;

fn dgx_h100() -> String {
    Path::new(ROOT)
        .join("topologies/dgx-h100.yaml")
        .display()
        .to_string()
}

/// `estimate --json` of `config` on `nodes` DGX H100 nodes, with `overlay` if given.
fn estimate(model: &Path, nodes: u64, config: &str, overlay: Option<&Path>) -> serde_json::Value {
    let (m, c, n) = (model.display().to_string(), dgx_h100(), nodes.to_string());
    let mut args = vec![
        "estimate", &m, &c, "--nodes", &n, "--config", config, "--json",
    ];
    let o = overlay.map(|p| p.display().to_string());
    if let Some(o) = &o {
        args.extend(["--calibration", o.as_str()]);
    }
    let run = meshplan(&args);
    run.expect_code(0);
    run.json()
}

fn all_reduce_overlay(dir: &Path, name: &str, alpha_us: f64, beta_gbps: f64) -> PathBuf {
    write(
        dir,
        name,
        &format!(
            "{}inter_node:\n  - {{op: all_reduce, nodes: 2, ranks_per_node: 8, alpha_us: {alpha_us}, beta_gbps: {beta_gbps}}}\n",
            header("NVIDIA H100 80GB HBM3")
        ),
    )
}

#[test]
fn a_measured_all_reduce_across_nodes_prices_data_parallel_gradients() {
    // dp=16 on two DGX H100 nodes (8 ranks per node, ZeRO 0, one micro-batch of one
    // sequence each): the step ends with one AllReduce of the 67,108,864 gradient
    // bytes over 2 nodes x 8, all of it exposed (one bucket). Measured at 50 us +
    // B / 40 GB/s it takes 50e-6 + 67108864 / 40e9 = 1727.7216 us; at 50 us + B / 20
    // GB/s, 3405.4432 us: the step grows by 1677.7216 us and nothing else moves.
    let dir = temp_dir("overlay-inter-dp");
    let model = write(&dir, "mm.yaml", &one_matmul());
    let fast = all_reduce_overlay(&dir, "fast.yaml", 50.0, 40.0);
    let slow = all_reduce_overlay(&dir, "slow.yaml", 50.0, 20.0);
    let cfg = "dp=16,zero=0,mbs=1";
    let plain = estimate(&model, 2, cfg, None);
    let ef = estimate(&model, 2, cfg, Some(&fast));
    let es = estimate(&model, 2, cfg, Some(&slow));
    // The bytes are the model's, not the overlay's: 2 x 15/16 x 33554432.
    for e in [&plain, &ef, &es] {
        assert_eq!(
            f(e, "/comm_bytes_per_gpu/dp"),
            2.0 * 15.0 / 16.0 * GRAD_BYTES
        );
    }
    let t_fast = 50e-6 + GRAD_BYTES / 40e9;
    assert_close("fit at 40 GB/s", t_fast, 1727.7216e-6, 1e-9);
    assert_close(
        "exposed communication at 40 GB/s",
        f(&ef, "/time_breakdown_s/exposed_comm"),
        t_fast,
        1e-9,
    );
    let d = f(&es, "/step_time_s") - f(&ef, "/step_time_s");
    assert_close("slower network, longer step", d, 1677.7216e-6, 1e-6);
    assert_eq!(
        f(&es, "/time_breakdown_s/compute"),
        f(&ef, "/time_breakdown_s/compute")
    );
    // Against the link model (no overlay): the step moves by the fit minus what the
    // hierarchical model over the cluster's InfiniBand gave for the same AllReduce.
    let cluster =
        load_cluster(&Path::new(ROOT).join("topologies/dgx-h100.yaml"), Some(2)).expect("dgx-h100");
    let modelled = CommModel::new(&cluster).time_s(
        Collective::AllReduce,
        GroupShape {
            size: 16,
            per_node: 8,
        },
        GRAD_BYTES,
    );
    assert!(modelled < t_fast, "{modelled}");
    assert_close(
        "overlay against the link model",
        f(&ef, "/step_time_s") - f(&plain, "/step_time_s"),
        t_fast - modelled,
        1e-6,
    );
}

#[test]
fn four_nodes_stretch_the_two_node_fit() {
    // dp=32 on four nodes, the overlay measured on two. The latency grows with the
    // ring's node crossings, 3/1 x 50 us = 150 us; the bytes term with the ring's
    // share per rank, (31/32) / (15/16) = 1.0333: at 40 GB/s 1677.7216 us x 1.0333 =
    // 1733.6457 us, in all 1883.6457 us; at 20 GB/s the step grows by 1733.6457 us.
    let dir = temp_dir("overlay-inter-4");
    let model = write(&dir, "mm.yaml", &one_matmul());
    let fast = all_reduce_overlay(&dir, "fast.yaml", 50.0, 40.0);
    let slow = all_reduce_overlay(&dir, "slow.yaml", 50.0, 20.0);
    let cfg = "dp=32,zero=0,mbs=1";
    let ef = estimate(&model, 4, cfg, Some(&fast));
    let es = estimate(&model, 4, cfg, Some(&slow));
    let share = (31.0 / 32.0) / (15.0 / 16.0);
    let t_fast = 150e-6 + GRAD_BYTES / 40e9 * share;
    assert_close("stretched fit", t_fast, 1883.6457e-6, 1e-7);
    assert_close(
        "exposed communication on four nodes",
        f(&ef, "/time_breakdown_s/exposed_comm"),
        t_fast,
        1e-9,
    );
    assert_close(
        "step difference on four nodes",
        f(&es, "/step_time_s") - f(&ef, "/step_time_s"),
        1733.6457e-6,
        1e-6,
    );
}

#[test]
fn bad_inter_node_entries_exit_2_naming_the_field() {
    let dir = temp_dir("overlay-inter-bad");
    let model = write(&dir, "mm.yaml", &one_matmul());
    let m = model.display().to_string();
    let c = dgx_h100();
    let cases: &[(&str, &str, &[&str])] = &[
        (
            "one-node",
            "  - {op: all_reduce, nodes: 1, ranks_per_node: 8, alpha_us: 50, beta_gbps: 40}\n",
            &["one-node.yaml", "inter_node[0].nodes", "at least 2 nodes", "intra_node"],
        ),
        (
            "op",
            "  - {op: allreduce, nodes: 2, ranks_per_node: 8, alpha_us: 50, beta_gbps: 40}\n",
            &["inter_node[0].op", "expected one of all_reduce"],
        ),
        (
            "big-node",
            "  - {op: all_gather, nodes: 2, ranks_per_node: 16, alpha_us: 50, beta_gbps: 40}\n",
            &["inter_node[0].ranks_per_node", "node of 8 GPUs", "dgx-h100.yaml"],
        ),
        (
            "zero-beta",
            "  - {op: all_reduce, nodes: 2, ranks_per_node: 8, alpha_us: 50, beta_gbps: 40}\n  - {op: broadcast, nodes: 4, ranks_per_node: 1, alpha_us: 5, beta_gbps: 0}\n",
            &["inter_node[1].beta_gbps", "positive"],
        ),
        (
            "send-4",
            "  - {op: send_recv, nodes: 4, ranks_per_node: 8, alpha_us: 5, beta_gbps: 40}\n",
            &["inter_node[0].nodes", "write nodes: 2"],
        ),
        (
            "twice",
            "  - {op: all_to_all, nodes: 2, ranks_per_node: 8, alpha_us: 5, beta_gbps: 40}\n  - {op: all_to_all, nodes: 2, ranks_per_node: 8, alpha_us: 6, beta_gbps: 30}\n",
            &["inter_node[1]", "given twice", "keep one fit"],
        ),
        (
            "misspelt",
            "  - {op: all_to_all, node: 2, ranks_per_node: 8, alpha_us: 5, beta_gbps: 40}\n",
            &["misspelt.yaml", "node"],
        ),
    ];
    for (name, entries, needles) in cases {
        let p = write(
            &dir,
            &format!("{name}.yaml"),
            &format!("{}inter_node:\n{entries}", header("NVIDIA H100 80GB HBM3")),
        );
        let ps = p.display().to_string();
        let run = meshplan(&[
            "estimate",
            &m,
            &c,
            "--nodes",
            "2",
            "--config",
            "dp=16",
            "--calibration",
            &ps,
        ]);
        run.expect_code(2);
        for n in *needles {
            assert!(
                run.stderr.contains(n),
                "{name}: `{n}` missing from:\n{}",
                run.stderr
            );
        }
    }
}

#[test]
fn calibrate_fits_inter_node_measurements_into_an_overlay_the_cost_model_reads() {
    // Synthetic measurements of the sweep across 2 nodes of 8: AllReduce over 2 x 8
    // at 45 us + B / 48 GB/s and send/recv at 12 us + B / 44 GB/s. The overlay written
    // holds both fits; laid over two DGX H100 nodes, a 1 GiB AllReduce of dp=16 takes
    // 45e-6 + 1073741824 / 48e9 = 22.414621 ms and a 64 MiB pipeline send between the
    // nodes 12e-6 + 67108864 / 44e9 = 1.537201 ms.
    let plan = MeasurementPlan::across_nodes(2, 8);
    let mut m = Measurements {
        device: "NVIDIA H100 80GB HBM3".into(),
        gpus_per_node: 8,
        measured_with: "synthetic".into(),
        ..Measurements::default()
    };
    for sweep in &plan.inter_node {
        let (alpha, beta) = match (sweep.op, sweep.ranks_per_node) {
            (LinkOp::AllReduce, 8) => (45e-6, 48e9),
            (LinkOp::SendRecv, 8) => (12e-6, 44e9),
            _ => continue,
        };
        for &b in &sweep.bytes {
            m.inter_node.push(InterNodeSample {
                op: sweep.op,
                nodes: sweep.nodes,
                ranks_per_node: sweep.ranks_per_node,
                sample: SizeSample {
                    bytes: b as f64,
                    seconds: alpha + b as f64 / beta,
                },
            });
        }
    }
    let overlay = build_overlay(&m, "2025-06-01T12:00:00Z").expect("overlay");
    let yaml = overlay.to_yaml();
    assert!(
        yaml.contains(
            "  - {op: all_reduce, nodes: 2, ranks_per_node: 8, alpha_us: 45.0, beta_gbps: 48.0}"
        ),
        "{yaml}"
    );
    assert_eq!(
        parse_overlay_yaml(&yaml, "w.yaml").expect("parses"),
        overlay
    );
    let dir = temp_dir("overlay-inter-calibrate");
    let path = write(&dir, "two-nodes.yaml", &yaml);
    let cluster = load_cluster_calibrated(
        &Path::new(ROOT).join("topologies/dgx-h100.yaml"),
        Some(2),
        Some(&path),
    )
    .expect("the written overlay applies to two DGX H100 nodes");
    let comm = CommModel::new(&cluster);
    let t = comm.time_s(
        Collective::AllReduce,
        GroupShape {
            size: 16,
            per_node: 8,
        },
        1073741824.0,
    );
    assert_close("AllReduce across the nodes", t, 22.414621e-3, 1e-6);
    assert_close(
        "send between the nodes",
        comm.p2p_time_s(false, 67108864.0),
        1.537201e-3,
        1e-6,
    );
}

#[test]
fn calibrate_dry_run_lists_the_sweep_across_nodes() {
    let run = meshplan(&["calibrate", "--dry-run", "--nodes", "2"]);
    run.expect_code(0);
    for needle in [
        "on 2 nodes of 8 GPUs",
        "across nodes 2 nodes x 8 GPUs per node: all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, send_recv",
        "across nodes 2 nodes x 1 GPU per node, every rail at once: all_reduce",
        "4096 B to 1073741824 B by factors of 4; other node counts extrapolated",
        // The node's own sweep stays.
        "collectives  8 GPUs: all_reduce",
    ] {
        assert!(run.stdout.contains(needle), "{needle}:\n{}", run.stdout);
    }
    // Four nodes: counts 2 and 4.
    let run = meshplan(&["calibrate", "--dry-run", "--nodes", "4"]);
    run.expect_code(0);
    assert!(
        run.stdout
            .contains("across nodes 4 nodes x 8 GPUs per node: all_reduce"),
        "{}",
        run.stdout
    );
    // One node (the default): no sweep across nodes.
    let run = meshplan(&["calibrate", "--dry-run"]);
    run.expect_code(0);
    assert!(!run.stdout.contains("across nodes"), "{}", run.stdout);
    // --nodes 0, and --nodes 2 outside a launch, are bad input.
    let run = meshplan(&["calibrate", "--dry-run", "--nodes", "0"]);
    run.expect_code(2);
    assert!(run.stderr.contains("--nodes 0"), "{}", run.stderr);
    let dir = temp_dir("overlay-inter-cli");
    let out = dir.join("o.yaml");
    let o = out.display().to_string();
    let run = meshplan(&["calibrate", "-o", &o, "--nodes", "2"]);
    run.expect_code(2);
    assert!(
        run.stderr.contains("meshplan launch") && run.stderr.contains("--nnodes 2"),
        "{}",
        run.stderr
    );
    assert!(!out.exists());
}

#[test]
fn calibrate_under_a_launch_without_a_gpu_exits_1_and_writes_nothing() {
    // Two processes on this machine: without the cuda feature each says so; with it,
    // they meet at the rendezvous and rank 0's failure to open a GPU stops both.
    let dir = temp_dir("overlay-inter-launch");
    let out = dir.join("o.yaml");
    let o = out.display().to_string();
    let run = meshplan(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--master-port",
        "0",
        "--",
        "calibrate",
        "-o",
        &o,
    ]);
    run.expect_code(1);
    let all = format!("{}{}", run.stdout, run.stderr);
    assert!(all.contains("written") && all.contains(&o), "{all}");
    assert!(!out.exists());
}
