//! Criterion benchmarks of the serving search (`meshplan deploy`): every instance
//! configuration, requests in flight, chunk size and prefill/decode pool ratio,
//! promised to finish in under a second for one model and cluster:
//!
//! - Llama 3 70B on one 8-GPU H200 node (TTFT <= 2 s, TPOT <= 50 ms);
//! - DeepSeek-V3 on 4 H200 nodes (32 GPUs: DP-attention, experts over 1-32 GPUs);
//! - DeepSeek-V3 on 16 H200 nodes (128 GPUs).
//!
//! Run: `cargo bench -p meshplan-benches --bench deploy`.

use criterion::{criterion_group, criterion_main, Criterion};
use meshplan_cost_model::serving::ServeLoad;
use meshplan_cost_model::{load_cluster, prepare_model};
use meshplan_ir::{load_model, parse_model_yaml, PartialConfig, WorkloadOverrides};
use meshplan_planner::deploy::deploy;
use std::hint::black_box;
use std::path::Path;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

const SERVE: &str =
    "kind: inference\nprompt_len: 2048\noutput_len: 256\nslo: {ttft_ms: 2000, tpot_ms: 100}\n";

fn bench(c: &mut Criterion) {
    let llama = load_model(
        Path::new(&format!("{ROOT}/models/llama3-70b-inference.yaml")),
        &WorkloadOverrides::default(),
    )
    .expect("model loads");
    let ds_text =
        std::fs::read_to_string(format!("{ROOT}/models/deepseek-v3.yaml")).expect("model reads");
    let ds_text = match ds_text.find("workload:") {
        Some(i) => format!(
            "{}workload:\n{}",
            &ds_text[..i],
            SERVE
                .lines()
                .map(|l| format!("  {l}\n"))
                .collect::<String>()
        ),
        None => panic!("deepseek-v3.yaml has a workload"),
    };
    let ds = parse_model_yaml(&ds_text, "deepseek-v3.yaml").expect("model parses");
    let h200 = |nodes| {
        load_cluster(
            Path::new(&format!("{ROOT}/topologies/h200-node.yaml")),
            Some(nodes),
        )
        .expect("cluster loads")
    };
    for (name, spec, nodes) in [
        ("llama3-70b x 8 H200", &llama, 1),
        ("deepseek-v3 x 32 H200", &ds, 4),
        ("deepseek-v3 x 128 H200", &ds, 16),
    ] {
        let pg = prepare_model(spec).expect("graph prepares");
        let cluster = h200(nodes);
        let load =
            ServeLoad::from_workload(spec.workload.as_ref().expect("workload")).expect("inference");
        let r = deploy(&pg, &cluster, &load, &PartialConfig::default().into());
        println!(
            "{name}: {} instances tried, {} deployments priced",
            r.instances_tried,
            r.points.len()
        );
        c.bench_function(&format!("deploy search {name}"), |b| {
            b.iter(|| {
                black_box(deploy(
                    &pg,
                    &cluster,
                    &load,
                    &PartialConfig::default().into(),
                ))
            })
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench
}
criterion_main!(benches);
