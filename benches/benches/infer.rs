//! Criterion benchmark of CPU inference: `models/small-gpt.yaml` (Llama-style, 6
//! layers, hidden 384) generating 32 greedy tokens for each of 4 prompts of 128
//! tokens (prefill one request at a time, then decode the 4 together against
//! their KV caches), on one rank and on two tensor ranks (`tp=2`), one thread per
//! rank. One sample is one whole `infer` call (weights built, prefill, decode).
//!
//! Run: `cargo bench -p meshplan-benches --bench infer`.

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use meshplan_cost_model::{load_cluster, prepare_model};
use meshplan_executor::infer::{infer, InferOptions};
use meshplan_ir::plan::Plan;
use meshplan_ir::{load_model, model_graph, PartialConfig, WorkloadOverrides};
use meshplan_planner::output::plan_for_config;
use std::path::Path;
use std::time::{Duration, Instant};

/// The allocator of the `meshplan` binary, so the figures are the command's.
#[global_allocator]
static ALLOC: meshplan_executor::alloc::Allocator = meshplan_executor::alloc::ALLOCATOR;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
const PROMPT: usize = 128;
const NEW: usize = 32;
const REQUESTS: usize = 4;

/// The inference plan of small-gpt under `cfg` on a CPU mesh of `gpus` ranks.
fn plan(cfg: &str, gpus: u64) -> Plan {
    let dir = std::env::temp_dir().join(format!("meshplan-bench-infer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let wl = dir.join("workload.yaml");
    std::fs::write(
        &wl,
        format!(
            "kind: inference\nprompt_len: {PROMPT}\noutput_len: {NEW}\nconcurrency: {REQUESTS}\n"
        ),
    )
    .expect("workload");
    let spec = load_model(
        Path::new(&format!("{ROOT}/models/small-gpt.yaml")),
        &WorkloadOverrides {
            workload_file: Some(wl),
            ..WorkloadOverrides::default()
        },
    )
    .expect("model loads");
    let graph = model_graph(&spec).expect("graph builds");
    let pg = prepare_model(&spec).expect("graph prepares");
    let mut cluster = load_cluster(
        Path::new(&format!("{ROOT}/topologies/cpu-test-mesh.yaml")),
        Some(1),
    )
    .expect("cluster loads");
    cluster.gpus_per_node = gpus;
    let c = PartialConfig::parse(cfg, "bench")
        .and_then(|p| p.resolve(gpus, "bench"))
        .expect("config resolves");
    let workload = spec.workload.clone().expect("workload");
    plan_for_config(&spec.name, &graph, &pg, &cluster, &workload, &c)
        .unwrap_or_else(|e| panic!("{cfg}: {e}"))
}

fn bench_infer(c: &mut Criterion) {
    meshplan_executor::alloc::keep_freed_memory();
    let mut group = c.benchmark_group("infer_small_gpt");
    group.sample_size(10);
    group.sampling_mode(SamplingMode::Flat);
    group.warm_up_time(Duration::from_millis(1));
    group.measurement_time(Duration::from_secs(1));
    let opts = InferOptions {
        requests: (0..REQUESTS)
            .map(|i| {
                (0..PROMPT)
                    .map(|t| ((i * 31 + t * 7) % 512) as u32)
                    .collect()
            })
            .collect(),
        max_new_tokens: NEW,
        ..InferOptions::default()
    };
    for (cfg, gpus) in [("dp=1,tp=1,pp=1", 1), ("dp=1,tp=2,pp=1", 2)] {
        let p = plan(cfg, gpus);
        let mut secs = Vec::new();
        group.bench_function(format!("{gpus}_ranks_{cfg}"), |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    let r = infer(&p, &opts).unwrap_or_else(|e| panic!("{e}"));
                    assert_eq!(r.requests.len(), REQUESTS);
                }
                let d = t.elapsed();
                secs.push(d.as_secs_f64() / iters as f64);
                d
            })
        });
        if secs.is_empty() {
            continue;
        }
        secs.sort_by(f64::total_cmp);
        let med = secs[secs.len() / 2];
        eprintln!(
            "meshplan infer small-gpt {cfg}: median call {med:.3} s, {:.1} generated tokens/s",
            (REQUESTS * NEW) as f64 / med
        );
    }
    group.finish();
}

criterion_group!(benches, bench_infer);
criterion_main!(benches);
