//! Criterion benchmark of one `estimate` evaluation: GPT-3 175B on 480 DGX A100
//! nodes (3840 GPUs), `dp=60,tp=8,pp=8,mbs=1,recompute=full`, global batch 1536.
//!
//! Run: `cargo bench -p meshplan-benches --bench estimate`. Reported numbers were taken
//! on the project's 2-core development machine.

use criterion::{criterion_group, criterion_main, Criterion};
use meshplan_cost_model::{estimate_train, load_cluster, prepare_model};
use meshplan_ir::{load_model, PartialConfig, WorkloadOverrides};
use std::hint::black_box;
use std::path::Path;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

fn bench(c: &mut Criterion) {
    let spec = load_model(
        Path::new(&format!("{ROOT}/models/gpt3-175b.yaml")),
        &WorkloadOverrides::default(),
    )
    .expect("model loads");
    let cluster = load_cluster(
        Path::new(&format!("{ROOT}/topologies/dgx-a100-80g.yaml")),
        Some(480),
    )
    .expect("cluster loads");
    let cfg = PartialConfig::parse("dp=60,tp=8,pp=8,mbs=1,recompute=full", "bench")
        .and_then(|p| p.resolve(cluster.gpus(), "bench"))
        .expect("config resolves");
    let pg = prepare_model(&spec).expect("graph builds");
    c.bench_function("estimate_train gpt3-175b 3840 gpus (prepared graph)", |b| {
        b.iter(|| estimate_train(black_box(&pg), &cluster, &cfg, 2048, 1536).expect("estimate"))
    });
    c.bench_function("prepare + estimate gpt3-175b (from spec)", |b| {
        b.iter(|| {
            let pg = prepare_model(black_box(&spec)).expect("graph builds");
            estimate_train(&pg, &cluster, &cfg, 2048, 1536).expect("estimate")
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
