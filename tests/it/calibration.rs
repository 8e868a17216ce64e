//! The cost model against published training runs (tests/data/published.yaml),
//! replayed with the configurations in tests/data/calibration-configs.yaml: one set
//! of constants for every run, mean absolute error at most 5%, no run over 10%.

use meshplan_cost_model::{estimate_train, load_cluster, prepare_model, Cluster, PreparedGraph};
use meshplan_ir::{model_graph, parse_model_yaml, ParallelConfig, PartialConfig};
use serde::Deserialize;

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
    ffn_hidden: Option<u64>,
    vocab: u64,
    seq_len: u64,
    global_batch_seqs: u64,
    nodes: u64,
    measured: Measured,
}

#[derive(Deserialize)]
struct Measured {
    tflops_per_gpu: f64,
}

#[derive(Deserialize)]
struct Replay {
    id: String,
    cluster: String,
    dtype: String,
    dropout: bool,
    config: String,
    metric: String,
}

/// One published run, ready to price: its model, cluster and configuration.
pub struct Case {
    /// Run id.
    pub id: String,
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
    /// Tokens per sequence.
    pub seq_len: u64,
    /// Sequences per step.
    pub global_batch: u64,
    /// Which estimate field the published TFLOP/s is.
    pub metric: String,
    /// Published TFLOP/s per GPU.
    pub measured_tflops: f64,
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
            .expect("replay for run");
        let yaml = format!(
            "name: {id}\ntransformer:\n  layers: {l}\n  hidden: {h}\n  heads: {a}\n  ffn_hidden: {f}\n  vocab: {v}\n  mlp: gelu\n  norm: layernorm\n  bias: true\n  position: learned\n  max_positions: {s}\n  tie_embeddings: true\n  dropout: {d}\ndtype: {dt}\nworkload:\n  kind: train\n  seq_len: {s}\n  global_batch: {b}\n",
            id = run.id,
            l = run.layers,
            h = run.hidden,
            a = run.heads,
            f = run.ffn_hidden.unwrap_or(4 * run.hidden),
            v = run.vocab,
            s = run.seq_len,
            d = replay.dropout,
            dt = replay.dtype,
            b = run.global_batch_seqs,
        );
        let spec = parse_model_yaml(&yaml, &run.id).expect("model parses");
        let graph = model_graph(&spec).expect("graph builds");
        let pg = prepare_model(&spec).expect("graph builds");
        let cluster = load_cluster(
            std::path::Path::new(&format!("{ROOT}/topologies/{}.yaml", replay.cluster)),
            Some(run.nodes),
        )
        .expect("cluster loads");
        let cfg = PartialConfig::parse(&replay.config, &run.id)
            .and_then(|c| c.resolve(cluster.gpus(), &run.id))
            .expect("config resolves");
        out.push(Case {
            id: run.id.clone(),
            graph,
            pg,
            cluster,
            cfg,
            config_text: replay.config.clone(),
            seq_len: run.seq_len,
            global_batch: run.global_batch_seqs,
            metric: replay.metric.clone(),
            measured_tflops: run.measured.tflops_per_gpu,
        });
    }
    out
}

/// (id, predicted TFLOP/s, published TFLOP/s) for every run.
pub fn predictions() -> Vec<(String, f64, f64)> {
    let mut out = Vec::new();
    for c in cases() {
        let est =
            estimate_train(&c.pg, &c.cluster, &c.cfg, c.seq_len, c.global_batch).expect("estimate");
        assert!(
            est.feasible,
            "{}: the published configuration must fit: {:?}",
            c.id, est.infeasible_reason
        );
        let predicted = match c.metric.as_str() {
            "hardware" => est.hardware_tflops_per_gpu,
            _ => est.model_tflops_per_gpu,
        };
        out.push((c.id, predicted, c.measured_tflops));
    }
    out
}

#[test]
fn published_runs_within_tolerance() {
    let rows = predictions();
    let mut sum = 0.0;
    let mut worst: f64 = 0.0;
    eprintln!(
        "{:<32} {:>10} {:>10} {:>8}",
        "run", "predicted", "published", "error"
    );
    for (id, p, m) in &rows {
        let err = (p - m) / m;
        sum += err.abs();
        worst = worst.max(err.abs());
        eprintln!("{id:<32} {p:>10.1} {m:>10.1} {:>7.1}%", 100.0 * err);
    }
    let mae = sum / rows.len() as f64;
    eprintln!(
        "mean absolute error {:.2}%, worst {:.2}%",
        100.0 * mae,
        100.0 * worst
    );
    assert!(mae <= 0.05, "mean absolute error {:.2}% > 5%", 100.0 * mae);
    assert!(worst <= 0.10, "worst error {:.2}% > 10%", 100.0 * worst);
}
