//! The cost model against 22 published training runs (tests/data/published.yaml) on
//! seven software stacks and five clusters, replayed with the settings in
//! tests/data/calibration-configs.yaml. One set of constants prices every row (the
//! defaults of `calib`, found by [`fit`] on all rows); a framework contributes
//! mechanisms (`cost_model/src/framework.rs`), never a factor of its own.
//!
//! The honest number is leave-one-out: refit the constants without a row and
//! predict it; and leave-one-family-out: refit without every row of a framework.

use meshplan_cost_model::calib::Constants;
use meshplan_cost_model::{
    estimate_train_with, load_cluster, prepare_model, Cluster, Mechanisms, PreparedGraph,
};
use meshplan_ir::{model_graph, parse_model_yaml, Framework, ParallelConfig, PartialConfig};
use meshplan_viz::calibration::{calibration_chart, CalibrationRow};
use serde::Deserialize;
use std::collections::BTreeMap;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

#[derive(Deserialize)]
struct Published {
    runs: Vec<Run>,
}

#[derive(Deserialize)]
struct Run {
    id: String,
    layers: u64,
    hidden: u64,
    heads: u64,
    kv_heads: Option<u64>,
    ffn_hidden: Option<u64>,
    vocab: u64,
    seq_len: u64,
    global_batch_seqs: u64,
    nodes: u64,
    measured: BTreeMap<String, serde_yaml_ng::Value>,
}

#[derive(Deserialize)]
struct Replay {
    id: String,
    cluster: String,
    model: String,
    dtype: String,
    dropout: bool,
    framework: String,
    grad_bytes: Option<f64>,
    config: String,
    metric: String,
}

/// What a row published, in the units [`Case::predict`] returns.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Metric {
    /// TFLOP/s per GPU counting recomputation.
    Hardware,
    /// Model TFLOP/s per GPU (MFU times the peak).
    Model,
    /// Seconds per step.
    IterTime,
}

/// One published run, ready to price: its model, cluster and configuration.
pub struct Case {
    /// Run id.
    pub id: String,
    /// The framework family (for leave-one-family-out).
    pub family: String,
    /// The model's op graph.
    pub graph: meshplan_ir::Graph,
    /// The model, prepared.
    pub pg: PreparedGraph,
    /// The cluster at the run's size.
    pub cluster: Cluster,
    /// The published configuration.
    pub cfg: ParallelConfig,
    /// Its text, as in calibration-configs.yaml.
    pub config_text: String,
    /// How the row's framework runs it.
    pub mech: Mechanisms,
    /// Tokens per sequence.
    pub seq_len: u64,
    /// Sequences per step.
    pub global_batch: u64,
    /// What was published.
    pub metric: Metric,
    /// The published value.
    pub measured: f64,
}

/// The free constants of the fit, in one vector: GEMM efficiency on Ampere and on
/// Hopper GPUs, the fixed cost per kernel, the flash kernel's Ampere efficiency, the
/// compute lost per second of overlapped communication, the host cost per
/// micro-batch, and the achieved fraction of the inter-node links.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Params(pub [f64; 8]);

/// Names, lower and upper bounds of [`Params`]: physical ranges, not fit knobs.
pub const PARAMS: [(&str, f64, f64); 8] = [
    ("gemm_efficiency[A100]", 0.40, 0.95),
    ("gemm_efficiency[H100]", 0.30, 0.95),
    // A graph op is 1-5 kernels of 3-5 us of launch and tail each.
    ("kernel_overhead_s", 3e-6, 25e-6),
    // FlashAttention-2 on A100: 50-73% of peak over its benchmark's shapes.
    ("flash_efficiency", 0.50, 0.75),
    ("comm_compute_slowdown", 0.0, 1.0),
    ("microbatch_overhead_s", 0.0, 0.05),
    ("ib_efficiency", 0.30, 1.0),
    ("step_overhead_s", 0.0, 0.5),
];

impl Params {
    /// The constants the product ships (`calib`'s defaults).
    pub fn shipped() -> Params {
        let k = Constants::default();
        let g = |name: &str| meshplan_cost_model::calib::gemm_efficiency_for(name);
        Params([
            g("A100"),
            g("H100"),
            k.kernel_overhead_s,
            k.flash_efficiency,
            k.comm_compute_slowdown,
            k.microbatch_overhead_s,
            k.ib_efficiency,
            k.step_overhead_s,
        ])
    }

    fn apply(&self, cluster: &Cluster) -> Cluster {
        let mut c = cluster.clone();
        c.gpu.gemm_efficiency = if c.gpu.name.starts_with('H') {
            self.0[1]
        } else {
            self.0[0]
        };
        c.constants = Constants {
            kernel_overhead_s: self.0[2],
            flash_efficiency: self.0[3],
            comm_compute_slowdown: self.0[4],
            microbatch_overhead_s: self.0[5],
            ib_efficiency: self.0[6],
            step_overhead_s: self.0[7],
            ..Constants::default()
        };
        c
    }
}

fn framework_of(text: &str, id: &str) -> (Mechanisms, String) {
    let (name, year) = text
        .split_once('@')
        .unwrap_or_else(|| panic!("{id}: framework NAME@YEAR"));
    let fw: Framework = name.parse().unwrap_or_else(|e| panic!("{id}: {e}"));
    let year: u32 = year.parse().expect("year");
    (Mechanisms::release(fw, year), name.to_string())
}

fn model_yaml(run: &Run, replay: &Replay) -> String {
    let arch = match replay.model.as_str() {
        "llama" => "  mlp: swiglu\n  norm: rmsnorm\n  bias: false\n  position: rope\n  tie_embeddings: false\n",
        "alibi" => "  mlp: gelu\n  norm: layernorm\n  bias: true\n  position: rope\n  tie_embeddings: true\n",
        _ => "  mlp: gelu\n  norm: layernorm\n  bias: true\n  position: learned\n  tie_embeddings: true\n",
    };
    format!(
        "name: {id}\ntransformer:\n  layers: {l}\n  hidden: {h}\n  heads: {a}\n  kv_heads: {kv}\n  ffn_hidden: {f}\n  vocab: {v}\n{arch}  max_positions: {s}\n  dropout: {d}\ndtype: {dt}\nworkload:\n  kind: train\n  seq_len: {s}\n  global_batch: {b}\n",
        id = run.id,
        l = run.layers,
        h = run.hidden,
        a = run.heads,
        kv = run.kv_heads.unwrap_or(run.heads),
        f = run.ffn_hidden.unwrap_or(4 * run.hidden),
        v = run.vocab,
        s = run.seq_len,
        d = replay.dropout,
        dt = replay.dtype,
        b = run.global_batch_seqs,
    )
}

fn measured(run: &Run, metric: Metric, peak_tflops: f64) -> f64 {
    let get = |k: &str| run.measured.get(k).and_then(serde_yaml_ng::Value::as_f64);
    match metric {
        Metric::IterTime => get("iter_time_s"),
        Metric::Hardware => get("tflops_per_gpu"),
        Metric::Model => get("tflops_per_gpu").or_else(|| get("mfu").map(|m| m * peak_tflops)),
    }
    .unwrap_or_else(|| panic!("{}: no measured value for {metric:?}", run.id))
}

/// Every published run with its replay.
pub fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(format!("{ROOT}/tests/data/published.yaml"))
        .expect("published.yaml");
    let published: Published = serde_yaml_ng::from_str(&text).expect("published.yaml parses");
    let text = std::fs::read_to_string(format!("{ROOT}/tests/data/calibration-configs.yaml"))
        .expect("configs");
    let replays: Vec<Replay> =
        serde_yaml_ng::from_str(&text).expect("calibration-configs.yaml parses");
    assert_eq!(
        replays.len(),
        published.runs.len(),
        "every published run has a replay"
    );
    let mut out = Vec::new();
    for run in &published.runs {
        let replay = replays
            .iter()
            .find(|r| r.id == run.id)
            .unwrap_or_else(|| panic!("replay for {}", run.id));
        let spec = parse_model_yaml(&model_yaml(run, replay), &run.id).expect("model parses");
        let graph = model_graph(&spec).expect("graph builds");
        let pg = prepare_model(&spec).expect("graph builds");
        let cluster = load_cluster(
            std::path::Path::new(&format!("{ROOT}/tests/data/calibration/{}", replay.cluster)),
            Some(run.nodes),
        )
        .expect("cluster loads");
        let cfg = PartialConfig::parse(&replay.config, &run.id)
            .and_then(|c| c.resolve(cluster.gpus(), &run.id))
            .expect("config resolves");
        let (mut mech, family) = framework_of(&replay.framework, &run.id);
        if let Some(b) = replay.grad_bytes {
            mech = mech.with_grad_bytes(b);
        }
        let metric = match replay.metric.as_str() {
            "hardware" => Metric::Hardware,
            "model" => Metric::Model,
            "iter_time" => Metric::IterTime,
            m => panic!("{}: unknown metric {m}", run.id),
        };
        let peak = cluster.gpu.peak_flops(pg.dtype) / 1e12;
        out.push(Case {
            id: run.id.clone(),
            family,
            graph,
            pg,
            measured: measured(run, metric, peak),
            cluster,
            cfg,
            config_text: replay.config.clone(),
            mech,
            seq_len: run.seq_len,
            global_batch: run.global_batch_seqs,
            metric,
        });
    }
    out
}

impl Case {
    /// The row's quantity under `params`.
    pub fn predict(&self, params: &Params) -> f64 {
        let cluster = params.apply(&self.cluster);
        let est = estimate_train_with(
            &self.pg,
            &cluster,
            &self.cfg,
            self.seq_len,
            self.global_batch,
            None,
            f64::INFINITY,
            &self.mech,
        )
        .unwrap_or_else(|e| panic!("{}: {e}", self.id))
        .expect("a step time");
        assert!(
            est.feasible,
            "{}: the published configuration must fit: {:?}",
            self.id, est.infeasible_reason
        );
        match self.metric {
            Metric::Hardware => est.hardware_tflops_per_gpu,
            Metric::Model => est.model_tflops_per_gpu,
            Metric::IterTime => est.step_time_s,
        }
    }

    /// Relative error of the prediction, signed as "predicted faster" > 0.
    pub fn error(&self, params: &Params) -> f64 {
        let p = self.predict(params);
        match self.metric {
            Metric::IterTime => (self.measured - p) / self.measured,
            _ => (p - self.measured) / self.measured,
        }
    }
}

fn mean_abs_error(cases: &[&Case], params: &Params) -> f64 {
    cases.iter().map(|c| c.error(params).abs()).sum::<f64>() / cases.len() as f64
}

/// The constants that minimise the mean absolute error over `cases`: coordinate
/// search in multiplicative steps within the physical bounds, the step halved
/// whenever no coordinate improves, from `start`.
pub fn fit(cases: &[&Case], start: &Params) -> Params {
    let mut best = *start;
    let mut err = mean_abs_error(cases, &best);
    let mut step = 0.2f64;
    while step > 0.01 {
        let mut improved = false;
        for (i, &(_, lo, hi)) in PARAMS.iter().enumerate() {
            for dir in [1.0, -1.0] {
                let mut p = best;
                let x = best.0[i];
                // Parameters that may be zero move additively near zero.
                let moved = if x.abs() < 1e-9 {
                    dir * step * hi * 0.1
                } else {
                    x * (1.0 + dir * step)
                };
                p.0[i] = moved.clamp(lo, hi);
                if p.0[i] == x {
                    continue;
                }
                let e = mean_abs_error(cases, &p);
                if e < err - 1e-9 {
                    (best, err, improved) = (p, e, true);
                    break;
                }
            }
        }
        if !improved {
            step *= 0.5;
        }
    }
    best
}

/// Rows no mechanism of the model explains, reported beside the others but kept out
/// of the fit and its bounds. DeepSpeed ZeRO-3 in 2021 on 384-1536 A100s at a fixed
/// global batch: the measured step stays near 65 s from 768 to 1536 GPUs, so its
/// communication took about 60 s per step; NCCL's rail-local rings with a latency
/// per ring step (NCCL's own tuning model) put the 2 x 350 GB of gathers and the
/// 350 GB of scatters at 7-11 s per GPU per step. Fitting them would drag every
/// other constant (the link efficiency to 0.6, the contention to 1.0) and break the
/// rows that are explained; they stay open in issue 14.
pub const UNEXPLAINED: [&str; 3] = [
    "megatron-sc21-t2-zero3-174.6B-384gpu",
    "megatron-sc21-t2-zero3-174.6B-768gpu",
    "megatron-sc21-t2-zero3-174.6B-1536gpu",
];

#[test]
fn published_runs_within_tolerance_and_leave_one_out() {
    let every = cases();
    assert_eq!(every.len(), 22, "the 22 published rows");
    let shipped = Params::shipped();
    eprintln!("not fitted (no mechanism explains them):");
    let mut unfitted_rows = Vec::new();
    for c in every
        .iter()
        .filter(|c| UNEXPLAINED.contains(&c.id.as_str()))
    {
        let e = c.error(&shipped);
        unfitted_rows.push(CalibrationRow {
            id: c.id.clone(),
            ratio: 1.0 + e,
            loo_ratio: 1.0 + e,
            unfitted: true,
        });
        eprintln!(
            "  {:<40} {:>10.2} {:>10.2} {:>7.1}%",
            c.id,
            c.predict(&shipped),
            c.measured,
            100.0 * e
        );
        // When a mechanism explains them this fails: fit them and drop the list.
        assert!(e > 0.25, "{} is now within 25%: fit it", c.id);
    }
    let cases: Vec<Case> = every
        .into_iter()
        .filter(|c| !UNEXPLAINED.contains(&c.id.as_str()))
        .collect();
    let all: Vec<&Case> = cases.iter().collect();
    eprintln!("shipped constants:");
    for (i, (name, _, _)) in PARAMS.iter().enumerate() {
        eprintln!("  {name:<24} {:.4e}", shipped.0[i]);
    }
    // Leave one out: refit without the row, predict it.
    let loo: Vec<f64> = (0..cases.len())
        .map(|i| {
            let rest: Vec<&Case> = all
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, c)| *c)
                .collect();
            cases[i].error(&fit(&rest, &shipped))
        })
        .collect();
    // Leave one family out.
    let families: std::collections::BTreeSet<&str> =
        cases.iter().map(|c| c.family.as_str()).collect();
    let mut lofo = vec![0.0; cases.len()];
    for f in &families {
        let rest: Vec<&Case> = all.iter().filter(|c| c.family != *f).copied().collect();
        let p = fit(&rest, &shipped);
        for (i, c) in cases.iter().enumerate() {
            if c.family == *f {
                lofo[i] = c.error(&p);
            }
        }
    }
    eprintln!(
        "{:<40} {:>10} {:>10} {:>8} {:>8} {:>8}",
        "run", "predicted", "published", "error", "loo", "family"
    );
    let mut sum = 0.0;
    for (i, c) in cases.iter().enumerate() {
        let e = c.error(&shipped);
        sum += e.abs();
        eprintln!(
            "{:<40} {:>10.2} {:>10.2} {:>7.1}% {:>7.1}% {:>7.1}%",
            c.id,
            c.predict(&shipped),
            c.measured,
            100.0 * e,
            100.0 * loo[i],
            100.0 * lofo[i]
        );
    }
    let n = cases.len() as f64;
    let in_sample = sum / n;
    let mut rows: Vec<CalibrationRow> = cases
        .iter()
        .zip(&loo)
        .map(|(c, l)| CalibrationRow {
            id: c.id.clone(),
            ratio: 1.0 + c.error(&shipped),
            loo_ratio: 1.0 + l,
            unfitted: false,
        })
        .collect();
    rows.extend(unfitted_rows);
    crate::draw::golden(
        "calibration.svg",
        &calibration_chart(
            &rows,
            "meshplan against 22 published training runs (1x: exact; right: too optimistic)",
        )
        .to_svg(),
    );
    let loo_mean = loo.iter().map(|e| e.abs()).sum::<f64>() / n;
    let loo_worst = loo.iter().fold(0.0f64, |a, e| a.max(e.abs()));
    let lofo_mean = lofo.iter().map(|e| e.abs()).sum::<f64>() / n;
    eprintln!(
        "in-sample mean {:.2}%; leave-one-out mean {:.2}%, worst {:.2}%; leave-one-family-out mean {:.2}%",
        100.0 * in_sample,
        100.0 * loo_mean,
        100.0 * loo_worst,
        100.0 * lofo_mean
    );
    // The shipped constants are the fit on every row: refitting from them finds
    // nothing better.
    let best = fit(&all, &shipped);
    let refit = mean_abs_error(&all, &best);
    eprintln!(
        "a refit from the shipped constants: {:?} ({:.2}%)",
        best.0,
        100.0 * refit
    );
    assert!(
        in_sample <= refit + 0.002,
        "calib's constants ({:.2}%) are not the fit ({:.2}%): update calib.rs",
        100.0 * in_sample,
        100.0 * refit
    );
    assert!(
        in_sample <= 0.05,
        "in-sample mean {:.2}% > 5%",
        100.0 * in_sample
    );
    assert!(
        loo_mean <= 0.10,
        "leave-one-out mean {:.2}% > 10%",
        100.0 * loo_mean
    );
    assert!(
        loo_worst <= 0.25,
        "leave-one-out worst {:.2}% > 25%",
        100.0 * loo_worst
    );
    // Megatron holds 10 of the 19 fitted rows: without them the fit has little left,
    // so leaving a whole family out is the hardest test; held where it is.
    assert!(
        lofo_mean <= 0.15,
        "leave-one-family-out mean {:.2}% > 15%",
        100.0 * lofo_mean
    );
}
