//! Criterion benchmark of CPU training throughput of the executor: one AdamW step
//! (forward, backward, gradient all-reduce, optimizer) of the whole global batch of
//! `models/small-gpt.yaml` (Llama-style: 6 layers, hidden 384, 8 sequences of 256
//! tokens) and of `models/small-gpt2.yaml` (the same shape with GPT-2's block:
//! LayerNorm with biases, GELU, biased linears, learned positions, tied head) on
//!
//! - 1 thread: `dp=1,mbs=8`, one rank;
//! - 2 threads as PyTorch uses them: `dp=1,mbs=8`, one rank whose kernels split
//!   their work over a pool of 2 threads (`TrainOptions::threads_per_rank`);
//! - 2 threads as ranks: `dp=2,mbs=4`, two single-threaded ranks on the in-process
//!   communicator.
//!
//! Each case runs `train`, what `run --backend cpu` uses: the device interpreter
//! (the one a GPU runs) on the fp32 host device, named `..._device`.
//!
//! The figure to compare with PyTorch eager (`benches/python/torch_train.py`, same
//! model and thread counts, intra-op threads) is printed as
//! `tokens/s = 8 * 256 / median step time` after each group.
//!
//! Run: `cargo bench -p meshplan-benches --bench train`.
//!
//! What is timed is the executor's own per-step wall clock (`TrainReport::step_s`,
//! on the run's clock from one step's end on the slowest rank to the next's), not
//! the whole `train` call: weight initialisation and spawning the
//! rank threads happen once per call and are not part of a training step, and
//! PyTorch's figure excludes model construction too. Each call runs two untimed
//! warm-up steps before the timed ones, as `torch_train.py` does: the first
//! touches the Adam state and activation buffers, and the second is still slower
//! than the steady state (on the 2-vCPU VM this was written on, GPT-2-style at 2
//! threads, medians over 8 runs: 0.686, 0.683, 0.640, 0.619, 0.637, 0.621 s for
//! steps 1 to 6).

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use meshplan_cost_model::{load_cluster, prepare_model};
use meshplan_executor::train::{train, TrainOptions};
use meshplan_ir::plan::Plan;
use meshplan_ir::{load_model, model_graph, PartialConfig, WorkloadOverrides};
use meshplan_planner::output::plan_for_config;
use std::path::Path;
use std::time::Duration;

/// The allocator of the `meshplan` binary, so the figures are the command's.
#[global_allocator]
static ALLOC: meshplan_executor::alloc::Allocator = meshplan_executor::alloc::ALLOCATOR;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
/// The Llama-style and the GPT-2-style model.
const MODELS: [&str; 2] = ["small-gpt", "small-gpt2"];

/// Untimed steps at the start of every `train` call (PyTorch's side warms up
/// as many).
const WARMUP_STEPS: u64 = 2;

/// The training plan of `model` under `cfg` on a CPU mesh of exactly as many
/// ranks as the configuration needs.
fn plan(model: &str, cfg: &str) -> Plan {
    let spec = load_model(
        Path::new(&format!("{ROOT}/models/{model}.yaml")),
        &WorkloadOverrides::default(),
    )
    .expect("model loads");
    let graph = model_graph(&spec).expect("graph builds");
    let pg = prepare_model(&spec).expect("graph prepares");
    let partial = PartialConfig::parse(cfg, "bench").expect("config parses");
    let gpus = partial.dp.unwrap_or(1)
        * partial.tp.unwrap_or(1)
        * partial.pp.unwrap_or(1)
        * partial.cp.unwrap_or(1);
    let mut cluster = load_cluster(
        Path::new(&format!("{ROOT}/topologies/cpu-test-mesh.yaml")),
        Some(1),
    )
    .expect("cluster loads");
    // One node of exactly `gpus` ranks: the executor spawns one thread per rank.
    cluster.gpus_per_node = gpus;
    let c = partial
        .resolve(cluster.gpus(), "bench")
        .expect("config resolves");
    let workload = spec.workload.clone().expect("workload");
    plan_for_config(&spec.name, &graph, &pg, &cluster, &workload, &c)
        .unwrap_or_else(|e| panic!("{cfg}: {e}"))
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

fn bench_train(c: &mut Criterion) {
    meshplan_executor::alloc::keep_freed_memory();
    for model in MODELS {
        bench_model(c, model);
    }
}

fn bench_model(c: &mut Criterion, model: &str) {
    let mut group = c.benchmark_group(format!("train_{}", model.replace('-', "_")));
    // A step takes seconds: the minimum sample count, every sample one step (flat
    // sampling; linear sampling would run 1 + 2 + ... + 10 steps per sample set).
    group.sample_size(10);
    group.sampling_mode(SamplingMode::Flat);
    group.warm_up_time(Duration::from_millis(1));
    group.measurement_time(Duration::from_secs(1));
    // (kernel threads per rank, configuration); ranks x kernel threads = threads.
    // `train` is the device interpreter on the fp32 host device (`run --backend
    // cpu`); the case names keep their `_device` suffix so criterion compares with
    // earlier runs.
    let run = |p: &Plan, o: &TrainOptions| train(p, o).unwrap_or_else(|e| panic!("{e}"));
    let which = "device";
    let cases = [(1, "dp=1,mbs=8"), (2, "dp=1,mbs=8"), (1, "dp=2,mbs=4")];
    for (per_rank, cfg) in cases {
        let p = plan(model, cfg);
        let threads = per_rank * p.ranks.len();
        let mut steps: Vec<f64> = Vec::new();
        let mut tokens_per_step = 0;
        group.bench_function(
            format!("{threads}_threads_{cfg}_{per_rank}_per_rank_{which}"),
            |b| {
                b.iter_custom(|iters| {
                    let opts = TrainOptions {
                        steps: WARMUP_STEPS + iters,
                        threads_per_rank: per_rank,
                        ..Default::default()
                    };
                    let report = run(&p, &opts);
                    tokens_per_step = report.tokens_per_step;
                    let timed = &report.step_s[WARMUP_STEPS as usize..];
                    steps.extend_from_slice(timed);
                    Duration::from_secs_f64(timed.iter().sum())
                })
            },
        );
        // Nothing ran when a name filter (or `--profile-time`) skipped this case.
        if steps.is_empty() {
            continue;
        }
        let med = median(&mut steps);
        // The fastest step too: on a shared machine other load only ever slows a
        // step down, so the minimum is the least disturbed figure.
        let min = steps[0]; // `median` sorted them
        let tps = |s: f64| tokens_per_step as f64 / s;
        eprintln!(
            "meshplan {model} {threads} thread(s) ({cfg}, {per_rank} per rank, {which}): \
             {tokens_per_step} tokens/step, \
             median step {med:.3} s over {} steps, {:.1} tokens/s (fastest step {min:.3} s, \
             {:.1} tokens/s)",
            steps.len(),
            tps(med),
            tps(min)
        );
    }
    group.finish();
}

criterion_group!(benches, bench_train);
criterion_main!(benches);
