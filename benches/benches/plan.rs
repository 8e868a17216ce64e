//! Criterion benchmarks of the whole search (sweep, ILP, stage DP) on the sizes the
//! planner promises to handle in about a second, and of writing the plan file:
//!
//! - GPT-3 175B on 480 DGX A100 nodes (3840 GPUs), global batch 1536;
//! - Llama 3 8B on 8 DGX H100 nodes (64 GPUs);
//! - Llama 3 405B on 2048 DGX H100 nodes (16,384 GPUs);
//! - lowering each best plan to per-rank programs and serialising it (`plan.json`).
//!
//! Each search is run fresh (no cache kept between iterations). Run:
//! `cargo bench -p meshplan-benches --bench plan`. A line per model with the
//! configurations priced per second is printed before the timings.

use criterion::{criterion_group, criterion_main, Criterion};
use meshplan_cost_model::{load_cluster, prepare_model, Cluster, PreparedGraph};
use meshplan_ir::{load_model, model_graph, Graph, ModelSpec, Workload, WorkloadOverrides};
use meshplan_planner::output::plan_of;
use meshplan_planner::search::{search_train, SearchOptions};
use std::hint::black_box;
use std::path::Path;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

struct Case {
    name: &'static str,
    spec: ModelSpec,
    graph: Graph,
    pg: PreparedGraph,
    cluster: Cluster,
    seq: u64,
    gb: u64,
}

fn case(name: &'static str, model: &str, topo: &str, nodes: u64) -> Case {
    let spec = load_model(
        Path::new(&format!("{ROOT}/models/{model}.yaml")),
        &WorkloadOverrides::default(),
    )
    .expect("model loads");
    let graph = model_graph(&spec).expect("graph builds");
    let pg = prepare_model(&spec).expect("graph prepares");
    let cluster = load_cluster(
        Path::new(&format!("{ROOT}/topologies/{topo}.yaml")),
        Some(nodes),
    )
    .expect("cluster loads");
    let (seq, gb) = match spec.workload.clone().expect("workload") {
        Workload::Train {
            seq_len,
            global_batch,
            ..
        } => (seq_len, global_batch),
        Workload::Inference { .. } => panic!("training model expected"),
    };
    Case {
        name,
        spec,
        graph,
        pg,
        cluster,
        seq,
        gb,
    }
}

fn bench(c: &mut Criterion) {
    let cases = [
        case("gpt3-175b on 3840 A100", "gpt3-175b", "dgx-a100-80g", 480),
        case("llama3-8b on 64 H100", "llama3-8b", "dgx-h100", 8),
        case("llama3-405b on 16384 H100", "llama3-405b", "dgx-h100", 2048),
    ];
    let opts = SearchOptions::default();
    for k in &cases {
        let r =
            search_train(&k.graph, &k.pg, &k.cluster, k.seq, k.gb, &opts, None).expect("search");
        eprintln!(
            "{}: {} enumerated, {} priced, {} pruned in a {:.3} s sweep ({:.0} configurations priced per second, {} threads); whole search {:.3} s; {} ILP solves; best {}",
            k.name,
            r.enumerated,
            r.evaluated,
            r.pruned,
            r.sweep_s,
            r.evaluated as f64 / r.sweep_s,
            rayon::current_num_threads(),
            r.wall_s,
            r.ilp_solves,
            r.top.first().map(|c| c.cfg.to_string()).unwrap_or_default()
        );
        c.bench_function(&format!("plan search {}", k.name), |b| {
            b.iter(|| {
                search_train(
                    black_box(&k.graph),
                    &k.pg,
                    &k.cluster,
                    k.seq,
                    k.gb,
                    &opts,
                    None,
                )
                .expect("search")
            })
        });
        let best = r.top.first().expect("a feasible plan");
        let workload = k.spec.workload.clone().expect("workload");
        let bytes = plan_of(
            &k.spec.name,
            &k.graph,
            &k.pg,
            &k.cluster,
            &workload,
            best,
            &r,
        )
        .expect("lowers")
        .to_json()
        .expect("serialises");
        eprintln!(
            "{}: plan.json for {} ranks is {} bytes",
            k.name,
            k.cluster.gpus(),
            bytes.len()
        );
        c.bench_function(&format!("lower + serialise plan {}", k.name), |b| {
            b.iter(|| {
                plan_of(
                    &k.spec.name,
                    black_box(&k.graph),
                    &k.pg,
                    &k.cluster,
                    &workload,
                    best,
                    &r,
                )
                .expect("lowers")
                .to_json()
                .expect("serialises")
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
