//! The cost model against published training runs (tests/data/published.yaml),
//! replayed with the configurations in tests/data/calibration-configs.yaml: one set
//! of constants for every run, mean absolute error at most 5%, no run over 10%.

use meshplan_cost_model::{estimate_train, load_cluster, prepare_model};
use meshplan_ir::{parse_model_yaml, PartialConfig};
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

/// (id, predicted TFLOP/s, published TFLOP/s) for every run.
pub fn predictions() -> Vec<(String, f64, f64)> {
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
        let pg = prepare_model(&spec).expect("graph builds");
        let cluster = load_cluster(
            std::path::Path::new(&format!("{ROOT}/topologies/{}.yaml", replay.cluster)),
            Some(run.nodes),
        )
        .expect("cluster loads");
        let cfg = PartialConfig::parse(&replay.config, &run.id)
            .and_then(|c| c.resolve(cluster.gpus(), &run.id))
            .expect("config resolves");
        let est = estimate_train(&pg, &cluster, &cfg, run.seq_len, run.global_batch_seqs)
            .expect("estimate");
        assert!(
            est.feasible,
            "{}: the published configuration must fit: {:?}",
            run.id, est.infeasible_reason
        );
        let predicted = match replay.metric.as_str() {
            "hardware" => est.hardware_tflops_per_gpu,
            _ => est.model_tflops_per_gpu,
        };
        out.push((run.id.clone(), predicted, run.measured.tflops_per_gpu));
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
