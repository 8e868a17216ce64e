//! `run`: execute a plan on the CPU backend (ranks as threads), report measured beside
//! predicted, and with `--check` compare with the single-rank run.

use crate::{print_json, Failure};
use meshplan_cost_model::estimate::gib;
use meshplan_cost_model::{parse_cluster_yaml, PreparedGraph};
use meshplan_executor::ckpt::{Checkpoint, SaveOptions};
use meshplan_executor::data::{DataSource, Sampler, TokenFile};
use meshplan_executor::engine::{Engine, EngineError};
use meshplan_executor::train::{
    byte_mismatches, check_against, train, ExecError, TrainOptions, TrainReport,
};
use meshplan_ir::plan::{Plan, PlanKind};
use meshplan_ir::{ParallelConfig, PartialConfig};
use meshplan_planner::output::plan_for_config;
use std::path::Path;

/// The flags of `run`.
pub(crate) struct RunArgs<'a> {
    pub plan: &'a Path,
    pub backend: &'a str,
    pub steps: u64,
    /// Whether `--steps` was given (an inference plan refuses it).
    pub steps_given: bool,
    pub check: bool,
    pub json: bool,
    pub data: Option<&'a Path>,
    pub trace: Option<&'a Path>,
    /// `--threads`: kernel threads per rank.
    pub threads: Option<usize>,
    pub unsupported: Vec<&'static str>,
    pub save: Option<&'a Path>,
    pub save_every: Option<u64>,
    /// `--keep-last`: step folders kept in the `--save` folder.
    pub keep_last: Option<u64>,
    pub resume: Option<&'a Path>,
    /// A checkpoint (inference plans).
    pub weights: Option<&'a Path>,
    /// Prompts and sampling (inference plans).
    pub generate: &'a crate::generate::GenerateFlags,
}

/// Most kernel threads `--threads` may give each rank: more than any machine's
/// cores, and each thread reserves a stack, so 100,000 per rank spent 25 s starting
/// threads and then aborted.
pub(crate) const THREADS_PER_RANK_MAX: usize = 1024;

/// Kernel threads per rank: `--threads`, or the machine's cores shared out over
/// `ranks` ranks (at least one each).
pub(crate) fn threads_per_rank(requested: Option<usize>, ranks: usize) -> Result<usize, Failure> {
    match requested {
        Some(0) => Err(bad(
            "--threads must be at least 1 (kernel threads per rank)".into(),
        )),
        Some(t) if t > THREADS_PER_RANK_MAX => Err(bad(format!(
            "--threads {t}: more than the limit of {THREADS_PER_RANK_MAX} kernel threads per rank; give at most the machine's cores"
        ))),
        Some(t) => Ok(t),
        None => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            Ok((cores / ranks.max(1)).max(1))
        }
    }
}

pub(crate) fn bad(message: String) -> Failure {
    Failure { code: 2, message }
}

pub(crate) fn runtime(message: String) -> Failure {
    Failure { code: 1, message }
}

/// The single-rank reference of a training plan: same model, data, seed and
/// micro-batch size, one GPU, no parallelism.
pub(crate) fn reference_plan(plan: &Plan) -> Result<Plan, String> {
    let yaml = format!(
        "name: reference\nnodes: 1\ngpus_per_node: 1\ngpu:\n  name: reference\n  memory_gib: {}\n  peak_tflops: {{bf16: 1, fp32: 1}}\n  hbm_gbps: 1\nintra_node:\n  link: none\n  bandwidth_gbps: 1\n  latency_us: 1\n",
        (plan.cluster.gpu_memory_bytes / (1u64 << 30) as f64).max(1.0)
    );
    let cluster =
        parse_cluster_yaml(&yaml, "reference cluster", None).map_err(|e| e.to_string())?;
    let cfg: ParallelConfig =
        PartialConfig::parse(&format!("dp=1,mbs={}", plan.strategy.mbs), "reference")
            .and_then(|p| p.resolve(1, "reference"))
            .map_err(|e| e.to_string())?;
    // The builder's standard roles: with one rank every layout is the same math.
    let mut graph = plan.graph.clone();
    for seg in &mut graph.segments {
        for op in &mut seg.ops {
            op.role = meshplan_ir::TpRole::Replicated;
        }
    }
    let pg = PreparedGraph::new(&graph);
    plan_for_config(
        &plan.model.name,
        &graph,
        &pg,
        &cluster,
        &plan.workload,
        &cfg,
    )
}

/// The engine `--backend` names, as the binary's exit codes say: an unknown name
/// is bad input (2), a missing GPU a runtime failure (1).
fn engine(backend: &str) -> Result<Engine, Failure> {
    Engine::parse(backend).map_err(failure)
}

/// An engine's error as the binary's exit codes say: a backend name it does not
/// know, a plan it does not run and a plan or token file the run refuses (the file
/// is the input to change, as for the graphs `check_executable` refuses) are bad
/// input (2); a missing GPU, a rank that fails or a checkpoint write that does, a
/// runtime failure (1). Checkpoints to resume or fine-tune from are checked before
/// the run, as bad input.
pub(crate) fn failure(e: EngineError) -> Failure {
    match e {
        EngineError::UnknownBackend(_)
        | EngineError::Unsupported(_)
        | EngineError::Launch(_)
        | EngineError::Run(ExecError::Plan(_) | ExecError::Data(_)) => bad(e.to_string()),
        EngineError::NoGpu(_) | EngineError::Run(_) | EngineError::Failed(_) => {
            runtime(e.to_string())
        }
    }
}

/// [`failure`] with the plan file named.
fn failure_in(file: &str) -> impl Fn(EngineError) -> Failure + '_ {
    move |e| {
        let mut f = failure(e);
        f.message = format!("{file}: {}", f.message);
        f
    }
}

/// `run --backend cuda` in one process per GPU (`meshplan launch`, torchrun or
/// Slurm): this process trains its rank on GPU `LOCAL_RANK`, NCCL between the
/// processes, the NCCL id shared through the TCP rendezvous; rank 0 gathers the
/// losses and reports (with `--check`, every rank's final weights and bytes come
/// to it and it compares them all with the CPU reference), and writes the
/// checkpoints of `--save` from every rank's state.
fn launched_cuda(a: &RunArgs<'_>, env: &meshplan_launch::LaunchEnv) -> Result<(), Failure> {
    let engine = engine(a.backend)?;
    let file = a.plan.display().to_string();
    let (plan, bytes) = crate::export::read_plan_bytes(a.plan)?;
    if plan.kind != PlanKind::Train || plan.ranks.len() != env.world_size {
        return Err(bad(format!(
            "{file}: a launch of {} processes runs a training plan of {} ranks, one per process; this plan has {} ranks{}",
            env.world_size,
            env.world_size,
            plan.ranks.len(),
            if plan.kind == PlanKind::Train { "" } else { " and is an inference plan" }
        )));
    }
    // Every rank's state goes to rank 0 at a save; rank 0 alone takes the folder.
    // The processes of a node verify a resumed checkpoint's files between them.
    let share = match env.local_world_size {
        Some(n) if env.local_rank < n => (env.local_rank, n),
        _ => (0, 1),
    };
    let role = CkptRole {
        writes: env.rank == 0,
        verifies: share,
    };
    let (opts, start) = training_options(a, &plan, role)?;
    let cfg = meshplan_launch::RendezvousConfig {
        master_addr: env.master_addr.clone(),
        master_port: env.master_port,
        rank: env.rank,
        world_size: env.world_size,
        plan_hash: meshplan_launch::rendezvous::fnv1a64(&bytes),
        timeout: std::time::Duration::from_secs(120),
    };
    let report = engine
        .train_launched_rank(&plan, &opts, env, &cfg)
        .map_err(failure_in(&file))?;
    if env.rank != 0 {
        return Ok(());
    }
    if let Some(path) = a.trace {
        // Every rank's timeline: each sent rank 0 its spans, on rank 0's clock.
        write_trace(path, &plan, &report)?;
    }
    conclude(a, &plan, &report, &opts, engine, start)
}

/// `meshplan run`.
pub(crate) fn run(a: &RunArgs<'_>) -> Result<(), Failure> {
    if let Some(flag) = a.unsupported.first() {
        return Err(bad(format!(
            "{flag} is not supported yet by `run` (it arrives with real weights, data and traces); run without it"
        )));
    }
    let launched = meshplan_launch::LaunchEnv::from_env()
        .map_err(|e| bad(format!("launch variables: {e}")))?;
    if let Some(env) = launched.as_ref().filter(|e| e.world_size > 1) {
        if a.backend == "cuda" {
            return launched_cuda(a, env);
        }
        return Err(bad(format!(
            "this process is {}, but --backend {} runs every rank of the plan as a thread of one process: {} processes would each run the whole plan. Start one process (`meshplan run PLAN`, or `launch --nproc-per-node 1`)",
            env.describe(),
            a.backend,
            env.world_size
        )));
    }
    let engine = engine(a.backend)?;
    let file = a.plan.display().to_string();
    let plan = crate::export::read_plan(a.plan)?;
    if plan.kind == PlanKind::Inference {
        let training: Vec<&str> = [
            (a.steps_given, "--steps"),
            (a.save.is_some(), "--save"),
            (a.save_every.is_some(), "--save-every"),
            (a.keep_last.is_some(), "--keep-last"),
            (a.resume.is_some(), "--resume"),
        ]
        .iter()
        .filter(|(given, _)| *given)
        .map(|(_, flag)| *flag)
        .collect();
        if !training.is_empty() {
            return Err(bad(format!(
                "{file}: {} train; this is an inference plan (give prompts with --prompt-ids, --prompt or --prompt-file, and --max-new-tokens)",
                training.join(", ")
            )));
        }
        if a.data.is_some() || a.trace.is_some() {
            return Err(bad(format!(
                "{file}: --data and --trace are read for training plans; this is an inference plan (give prompts with --prompt-ids, --prompt or --prompt-file)"
            )));
        }
        return crate::generate::run(a, &plan, &file, engine);
    }
    if a.generate.any_given() {
        return Err(bad(format!(
            "{file}: prompts and sampling flags are for inference plans; this is a training plan"
        )));
    }
    let (opts, start) = training_options(a, &plan, CkptRole::ALONE)?;
    let engine = engine.for_plan(&plan).map_err(failure_in(&file))?;
    // Ranks are threads of this process holding fp32 weights, gradients and Adam
    // state: refuse what cannot fit rather than exhausting the machine.
    let s = &plan.strategy;
    let replicas = (plan.ranks.len() as f64 / (s.tp * s.pp).max(1) as f64).max(1.0);
    let host_bytes = 16.0 * plan.model.params * replicas;
    const HOST_BUDGET: f64 = 16.0 * (1u64 << 30) as f64;
    if engine.on_host() && (host_bytes > HOST_BUDGET || plan.ranks.len() > 256) {
        return Err(runtime(format!(
            "{file}: the CPU backend runs every rank as a thread of this process; {} ranks holding {:.1} GiB of fp32 weights, gradients and Adam state exceed its {:.0} GiB budget (use a small model, e.g. models/tiny-gpt.yaml on topologies/cpu-test-mesh.yaml)",
            plan.ranks.len(),
            host_bytes / (1u64 << 30) as f64,
            HOST_BUDGET / (1u64 << 30) as f64
        )));
    }

    // --steps counts all steps: a resumed run does only those after the checkpoint's.
    let plural = |n: u64| if n == 1 { "step" } else { "steps" };
    let steps = if start > 0 {
        let n = a.steps - start;
        format!(
            "{n} {} (from the checkpoint's step {start} to step {})",
            plural(n),
            a.steps
        )
    } else {
        format!("{} {}", a.steps, plural(a.steps))
    };
    tracing::info!(
        "training {steps} of {} on {} ranks ({})",
        plan.model.name,
        plan.ranks.len(),
        engine.describe()
    );
    let (bar, hook) =
        crate::log::bar_with_hook(a.steps - start, format!("training {}", plan.model.name));
    let opts = TrainOptions {
        on_step: Some(hook),
        ..opts
    };
    let report = engine.train(&plan, &opts).map_err(failure);
    bar.finish_and_clear();
    let report = report?;
    tracing::debug!("losses {:?}", report.losses);
    if let Some(path) = a.trace {
        write_trace(path, &plan, &report)?;
    }
    conclude(a, &plan, &report, &opts, engine, start)
}

/// Prints a training run's report beside the plan's figures, and fails the run
/// (exit 1) where the single-rank reference (`--check`) or the plan's bytes
/// (`--check`, every axis but dropless experts') disagree with it, or a checkpoint
/// save failed. A launched run's report holds its process's rank only.
fn conclude(
    a: &RunArgs<'_>,
    plan: &Plan,
    report: &TrainReport,
    opts: &TrainOptions,
    engine: Engine,
    start: u64,
) -> Result<(), Failure> {
    let bytes = byte_mismatches(plan, report, a.steps - start);
    let check = if a.check {
        Some(check_with_reference(plan, report, opts, engine, a.steps)?)
    } else {
        None
    };
    print_report(
        plan,
        report,
        &bytes,
        check.as_ref(),
        (a.json, opts.threads_per_rank),
        start,
    );
    if let Some(Err(why)) = &check {
        return Err(runtime(format!(
            "the run differs from the single-rank reference:\n{why}"
        )));
    }
    // A failed save was reported when it happened and training went on; the run
    // still fails, so that a script does not take the missing checkpoint for saved.
    let failed: Vec<String> = report
        .saved
        .iter()
        .filter_map(|c| c.error.as_ref().map(|e| format!("step {}: {e}", c.step)))
        .collect();
    if !failed.is_empty() {
        return Err(runtime(format!(
            "{} of {} checkpoint saves failed:\n{}",
            failed.len(),
            report.saved.len(),
            failed.join("\n")
        )));
    }
    // Dropless expert-parallel bytes follow the router's choices; the plan prices
    // balanced routing, so on that axis a difference is reported, not failed. Under
    // an expert capacity the buffers are padded and must match like every axis.
    let dropless = plan.graph.dropless_experts();
    let (routed, exact): (Vec<&String>, Vec<&String>) =
        bytes.iter().partition(|m| dropless && m.contains(" ep: "));
    if !routed.is_empty() {
        tracing::warn!(
            "expert-parallel bytes depend on the routing; the plan assumes balanced experts:\n  {}",
            routed
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n  ")
        );
    }
    if a.check && !exact.is_empty() {
        return Err(runtime(format!(
            "measured communication differs from the plan:\n{}",
            exact
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        )));
    }
    Ok(())
}

/// The Hugging Face checkpoint `--weights` names, checked against the plan's model
/// (`config.json`'s fields, every weight's shape) before a run reads it; bad input
/// exits 2.
pub(crate) fn hf_weights(
    dir: &Path,
    plan: &Plan,
) -> Result<std::sync::Arc<meshplan_executor::weights::Checkpoint>, Failure> {
    let ck = meshplan_executor::weights::Checkpoint::open(dir).map_err(|e| bad(e.to_string()))?;
    ck.check_config(&plan.graph)
        .and_then(|()| ck.validate(&plan.graph))
        .map_err(|e| bad(e.to_string()))?;
    Ok(std::sync::Arc::new(ck))
}

/// The training options the flags give (fine-tuning weights, data, checkpoints,
/// trace, threads) and the step the run starts at; bad input exits 2.
fn training_options(
    a: &RunArgs<'_>,
    plan: &Plan,
    role: CkptRole,
) -> Result<(TrainOptions, u64), Failure> {
    let hf = match a.weights {
        Some(dir) => {
            if a.resume.is_some() {
                return Err(bad(
                    "--weights and --resume both give the weights; use one (a --save checkpoint already holds them)".into(),
                ));
            }
            Some(hf_weights(dir, plan)?)
        }
        None => None,
    };
    if a.steps == 0 {
        return Err(bad("--steps must be at least 1".into()));
    }
    // Written when training ends: a path that cannot hold it is refused now.
    if let Some(t) = a.trace {
        crate::draw::check_file("--trace", t)?;
    }
    let data = match a.data {
        None => DataSource::Synthetic,
        Some(path) => {
            let vocab = plan.graph.vocab().unwrap_or(u64::MAX);
            let file = TokenFile::open(path, vocab).map_err(|e| bad(e.to_string()))?;
            let (seq, gb) = match plan.workload {
                meshplan_ir::Workload::Train {
                    seq_len,
                    global_batch,
                    ..
                } => (seq_len as usize, global_batch),
                _ => (0, 0),
            };
            Sampler::new(file.len(), seq, gb, TrainOptions::default().seed)
                .map_err(|m| bad(format!("{}: {m}", path.display())))?;
            DataSource::File {
                file: std::sync::Arc::new(file),
            }
        }
    };
    let (opts, start) = checkpoint_options(a, plan, role)?;
    let opts = TrainOptions {
        data,
        trace: a.trace.is_some(),
        weights: hf,
        threads_per_rank: threads_per_rank(a.threads, plan.ranks.len())?,
        // Only a comparison with the reference reads them.
        final_weights: a.check,
        ..opts
    };
    // A checkpoint that does not continue on this run's data is the input to change.
    if let Some(ck) = &opts.resume {
        meshplan_executor::train::check_resume(plan, &opts, ck)
            .map_err(|e| bad(format!("--resume: {}", e.message())))?;
    }
    Ok((opts, start))
}

/// Trains the single-rank reference of `plan` on the CPU in fp32 and compares
/// `report` with it: to 1e-5 for an fp32 run, within the mixed-precision tolerances
/// for a bf16 one. The outer error is a failure to run the reference.
fn check_with_reference(
    plan: &Plan,
    report: &TrainReport,
    opts: &TrainOptions,
    engine: Engine,
    steps: u64,
) -> Result<Result<Vec<String>, String>, Failure> {
    let reference = reference_plan(plan).map_err(runtime)?;
    tracing::info!("training the single-rank reference for --check");
    let bar = crate::log::spinner(format!("training the reference {steps} steps"));
    let ref_opts = TrainOptions {
        threads_per_rank: threads_per_rank(None, 1)?,
        ..opts.reference_of(plan)
    };
    let base = train(&reference, &ref_opts).map_err(|e| runtime(format!("reference: {e}")));
    bar.finish_and_clear();
    let base = base?;
    Ok(match engine {
        Engine::Cpu => check_against(plan, report, &base, 1e-5),
        // Mixed precision against the fp32 reference: bf16 tolerances.
        Engine::CpuBf16 | Engine::Cuda(_) => {
            use meshplan_executor::device as dv;
            dv::check_mixed_precision(
                plan,
                report,
                &base,
                opts,
                dv::MIXED_LOSS_TOLERANCE,
                dv::MIXED_UPDATE_TOLERANCE,
            )
        }
    })
}

/// Writes the measured timeline of `report`'s ranks as a Chrome trace.
fn write_trace(path: &Path, plan: &Plan, report: &TrainReport) -> Result<(), Failure> {
    let spans: Vec<_> = report
        .ranks
        .iter()
        .map(|r| (r.rank, r.spans.clone()))
        .collect();
    let text = meshplan_executor::trace::chrome_trace(plan, &spans).to_json();
    crate::atomic::write_atomically(path, text.as_bytes(), "trace")?;
    tracing::info!(
        "trace written to {} ({} spans; open in https://ui.perfetto.dev)",
        path.display(),
        spans.iter().map(|(_, s)| s.len()).sum::<usize>()
    );
    Ok(())
}

/// What one process does with checkpoints.
#[derive(Clone, Copy)]
struct CkptRole {
    /// Whether it writes them: a launched rank other than 0 only says when they
    /// are due, and leaves the folder to rank 0.
    writes: bool,
    /// Its share `(i, n)` of a resumed checkpoint's data files to verify
    /// (`Checkpoint::open_shared`).
    verifies: (usize, usize),
}

impl CkptRole {
    /// Every rank in this process.
    const ALONE: CkptRole = CkptRole {
        writes: true,
        verifies: (0, 1),
    };
}

/// Training options of `--save`, `--save-every`, `--keep-last` and `--resume`, and
/// the step the run starts at. A checkpoint that cannot be read or does not fit the
/// plan's model, and a `--save` folder another run holds or whose `latest` this run
/// would move back, are bad input.
fn checkpoint_options(
    a: &RunArgs<'_>,
    plan: &Plan,
    role: CkptRole,
) -> Result<(TrainOptions, u64), Failure> {
    let writes = role.writes;
    let mut opts = TrainOptions {
        steps: a.steps,
        ..TrainOptions::default()
    };
    match (a.save, a.save_every, a.keep_last) {
        (None, Some(_), _) => return Err(bad("--save-every needs --save DIR".into())),
        (None, _, Some(_)) => return Err(bad("--keep-last needs --save DIR".into())),
        (_, Some(0), _) => return Err(bad("--save-every must be at least 1".into())),
        (_, _, Some(0)) => {
            return Err(bad(
                "--keep-last must be at least 1 (the checkpoint `latest` names is always kept)"
                    .into(),
            ))
        }
        (Some(dir), every, keep_last) => {
            let mut save = SaveOptions::new(dir, every.unwrap_or(0));
            save.keep_last = keep_last;
            save.notify = Some(meshplan_executor::ckpt::SaveNotify(std::sync::Arc::new(
                |m: &str| tracing::error!("{m}"),
            )));
            // Locked before the resumed checkpoint is read, so that no other run
            // moves `latest` in between.
            if writes {
                save.lock().map_err(|e| bad(format!("--save: {e}")))?;
            }
            opts.save = Some(save);
        }
        (None, None, None) => {}
    }
    let Some(dir) = a.resume else {
        if writes {
            prepare_save(&mut opts, 0, a.steps)?;
        }
        return Ok((opts, 0));
    };
    let ck =
        Checkpoint::open_shared(dir, role.verifies).map_err(|e| bad(format!("--resume: {e}")))?;
    ck.check_model(&plan.graph)
        .map_err(|e| bad(format!("--resume: {e}")))?;
    let m = ck.manifest();
    if m.step >= a.steps {
        return Err(bad(format!(
            "--resume: {} holds {} steps already; --steps counts all steps, so ask for more than {}",
            ck.dir().display(),
            m.step,
            m.step
        )));
    }
    // The data continue only with the saved seed; the rate continues the run.
    opts.seed = m.seed;
    if let Some(lr) = m.optimizer.get("lr").and_then(|v| v.as_f64()) {
        opts.lr = lr as f32;
    }
    let start = m.step;
    opts.resume = Some(std::sync::Arc::new(ck));
    if writes {
        prepare_save(&mut opts, start, a.steps)?;
    }
    Ok((opts, start))
}

/// Checks the `--save` folder for a run from `start` to `steps` (the first save
/// must not move `latest` back) and removes what dead runs left there.
fn prepare_save(opts: &mut TrainOptions, start: u64, steps: u64) -> Result<(), Failure> {
    match opts.save.as_mut() {
        Some(save) => save
            .prepare(start, steps)
            .map_err(|e| bad(format!("--save: {e}"))),
        None => Ok(()),
    }
}

/// The report's MFU line, and where the measured figure passes 100% a second
/// saying why: the machine that ran the plan is faster than the plan's device
/// (a CPU core against `cpu-test-mesh`'s conservative peak, or several of them
/// where each rank ran on several threads), not a utilisation above one.
fn mfu_lines(measured: f64, predicted: f64, gpu: &str, threads: usize) -> Vec<String> {
    let mut lines = vec![format!(
        "mfu          measured {:.2}%, predicted {:.2}% (model FLOPs over the peak of the plan's {gpu})",
        100.0 * measured,
        100.0 * predicted,
    )];
    if measured > 1.0 {
        let per_rank = if threads > 1 {
            format!(", and each rank ran on {threads} threads where the plan counts one {gpu}")
        } else {
            String::new()
        };
        lines.push(format!(
            "             above 100%: this machine outruns the peak the plan's cluster gives a {gpu}{per_rank}; the figure compares with that cluster, not with this machine"
        ));
    }
    lines
}

/// The plan's predicted `key` (NaN where the plan has none).
pub(crate) fn predicted(plan: &Plan, key: &str) -> f64 {
    plan.predicted
        .get(key)
        .and_then(|v| v.as_f64())
        .unwrap_or(f64::NAN)
}

/// The plan's predicted bytes per GPU of memory `part` (`params`, `kv_cache`,
/// `workspace`, `total`, ...; NaN where the plan has none).
pub(crate) fn predicted_memory(plan: &Plan, part: &str) -> f64 {
    plan.predicted
        .pointer(&format!("/memory_per_gpu_bytes/{part}"))
        .and_then(|v| v.as_f64())
        .unwrap_or(f64::NAN)
}

fn print_report(
    plan: &Plan,
    r: &TrainReport,
    bytes: &[String],
    check: Option<&Result<Vec<String>, String>>,
    (json, threads): (bool, usize),
    start: u64,
) {
    let predicted_step = predicted(plan, "step_time_s");
    let predicted_part = |part: &str| predicted_memory(plan, part);
    let predicted_mem = predicted_part("total");
    // The measured figures count what the run allocates for the model: the
    // prediction's runtime workspace (CUDA context, library workspaces, bucket
    // buffers) is shown apart, so the two sides compare part by part.
    let predicted_states =
        predicted_part("params") + predicted_part("grads") + predicted_part("optimizer");
    let predicted_acts = predicted_part("activations");
    let predicted_workspace = predicted_part("workspace");
    let median = {
        let mut s = r.step_s.clone();
        s.sort_by(f64::total_cmp);
        s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
    };
    // The same model FLOPs over the same peak: MFU scales with the inverse step time.
    let predicted_mfu = plan
        .predicted
        .get("mfu")
        .and_then(|v| v.as_f64())
        .unwrap_or(f64::NAN);
    let measured_mfu = predicted_mfu * predicted_step / median;
    let worst = r.ranks.iter().max_by(|a, b| {
        (a.state_bytes + a.peak_activation_bytes)
            .total_cmp(&(b.state_bytes + b.peak_activation_bytes))
    });
    let (measured_states, measured_acts) =
        worst.map_or((0.0, 0.0), |w| (w.state_bytes, w.peak_activation_bytes));
    let measured_mem = measured_states + measured_acts;
    let (slots, dropped) = r.ranks.iter().fold((0u64, 0u64), |a, k| {
        (a.0 + k.expert_slots.0, a.1 + k.expert_slots.1)
    });
    let mut per_axis = serde_json::Map::new();
    for rank in &r.ranks {
        for (axis, b) in rank.counts.per_axis() {
            let e = per_axis.entry(axis).or_insert(serde_json::json!(0.0));
            let prev = e.as_f64().unwrap_or(0.0);
            *e = serde_json::json!(prev.max(b / r.step_s.len() as f64));
        }
    }
    if json {
        print_json(&serde_json::json!({
            "steps": r.losses.iter().zip(&r.step_s).enumerate().map(|(i, (l, s))| serde_json::json!({
                "step": start + i as u64,
                "loss": l,
                "step_time_s": s,
                "tokens_per_s": r.tokens_per_step as f64 / s,
            })).collect::<Vec<_>>(),
            "loss": r.losses,
            "measured": {
                "step_time_s": median,
                "mfu": measured_mfu,
                "tokens_per_s": r.tokens_per_step as f64 / median,
                "comm_bytes_per_gpu": per_axis,
                "expert_assignments": slots,
                "expert_assignments_dropped": dropped,
                "device_memory_in_use_bytes": r.ranks.iter().filter_map(|k| k.device_memory_bytes).reduce(f64::max),
                "memory_per_gpu_bytes": {
                    "states": measured_states,
                    "activations": measured_acts,
                    "total": measured_mem,
                },
            },
            "predicted": plan.predicted,
            "resumed_from_step": (start > 0).then_some(start),
            "checkpoints": r.saved.iter().map(|c| serde_json::json!({
                "step": c.step,
                "path": c.path.display().to_string(),
                "bytes": c.bytes,
                "files": c.files,
                "seconds": c.seconds,
                "saved": c.error.is_none(),
                "error": c.error,
            })).collect::<Vec<_>>(),
            "bytes_match_plan": bytes.is_empty(),
            "byte_mismatches": bytes,
            "check": check.map(|c| match c {
                Ok(lines) => serde_json::json!({"passed": true, "details": lines}),
                Err(why) => serde_json::json!({"passed": false, "details": why}),
            }),
        }));
        return;
    }
    println!(
        "{} on {} ranks ({}), {} steps",
        plan.model.name,
        plan.ranks.len(),
        plan.strategy,
        r.losses.len()
    );
    if start > 0 {
        println!("resumed at step {start} from a checkpoint of {start} steps");
    }
    for (i, (l, s)) in r.losses.iter().zip(&r.step_s).enumerate() {
        let i = start + i as u64;
        println!(
            "step {i:>3}  loss {l:.6}  {:.3} s  {:.0} tokens/s",
            s,
            r.tokens_per_step as f64 / s
        );
    }
    println!(
        "step time    measured {median:.4} s (median), predicted {predicted_step:.4} s for the plan's cluster ({})",
        plan.cluster.gpu
    );
    for line in mfu_lines(measured_mfu, predicted_mfu, &plan.cluster.gpu, threads) {
        println!("{line}");
    }
    println!(
        "memory       measured {:.4} GiB (states {:.4} + activations {:.4}, fullest rank), predicted {:.4} GiB per GPU (states {:.4} + activations {:.4} + runtime workspace {:.4})",
        gib(measured_mem),
        gib(measured_states),
        gib(measured_acts),
        gib(predicted_mem),
        gib(predicted_states),
        gib(predicted_acts),
        gib(predicted_workspace)
    );
    if let Some(used) = r
        .ranks
        .iter()
        .filter_map(|k| k.device_memory_bytes)
        .reduce(f64::max)
    {
        println!(
            "gpu memory   {:.4} GiB in use at the fullest (the driver's count: context, cuBLASLt workspace and caching included)",
            gib(used)
        );
    }
    if slots > 0 {
        println!(
            "experts      {dropped} of {slots} token-expert assignments over capacity ({:.2}%)",
            100.0 * dropped as f64 / slots as f64
        );
    }
    // A launched run's report holds its own process's rank.
    let ranks = match r.ranks.as_slice() {
        [one] if plan.ranks.len() > 1 => format!("rank {}", one.rank),
        _ => "every rank".into(),
    };
    if bytes.is_empty() {
        println!("comm bytes   equal to the plan's on {ranks} and axis");
    } else if plan.graph.dropless_experts() && bytes.iter().all(|m| m.contains(" ep: ")) {
        println!(
            "comm bytes   equal to the plan's on every axis but ep (routed tokens; see stderr)"
        );
    } else {
        println!(
            "comm bytes   differ from the plan:\n  {}",
            bytes.join("\n  ")
        );
    }
    for c in &r.saved {
        if let Some(e) = &c.error {
            println!("checkpoint   step {} FAILED: {e}", c.step);
            continue;
        }
        println!(
            "checkpoint   step {} saved to {} ({} files, {:.1} MiB, {:.3} s)",
            c.step,
            c.path.display(),
            c.files,
            c.bytes as f64 / (1u64 << 20) as f64,
            c.seconds
        );
    }
    match check {
        Some(Ok(lines)) => println!(
            "check        passed: {}",
            lines.last().cloned().unwrap_or_default()
        ),
        Some(Err(_)) => println!("check        FAILED (details on stderr)"),
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::{failure, mfu_lines};
    use meshplan_executor::engine::EngineError;
    use meshplan_executor::train::ExecError;

    #[test]
    fn a_plan_or_token_file_the_run_refuses_is_bad_input_and_a_failed_rank_is_not() {
        let code = |e| failure(e).code;
        let run = EngineError::Run;
        assert_eq!(code(run(ExecError::Plan("p".into()))), 2);
        assert_eq!(code(run(ExecError::Data("d".into()))), 2);
        assert_eq!(code(EngineError::Unsupported("u".into())), 2);
        assert_eq!(code(run(ExecError::Rank("r".into()))), 1);
        assert_eq!(code(run(ExecError::Checkpoint("c".into()))), 1);
        assert_eq!(code(run(ExecError::Output("o".into()))), 1);
        assert_eq!(code(EngineError::Failed("f".into())), 1);
        // A launched rank's rendezvous: ranks launched inconsistently are the input.
        use meshplan_launch::RendezvousError as R;
        let refused = R::Refused {
            message: "give every rank the same plan file".into(),
        };
        assert_eq!(code(refused.into()), 2);
        let io = R::Io {
            message: "connection reset".into(),
        };
        assert_eq!(code(io.into()), 1);
    }

    #[test]
    fn an_mfu_over_100_percent_says_the_machine_outruns_the_plans_device() {
        // 0.5 TFLOP/s of model FLOPs against the 0.1 TFLOP/s peak of one cpu-thread
        // per rank, each rank on 2 threads: measured 5.0 of the plan's peak.
        let lines = mfu_lines(5.0, 0.5689, "cpu-thread", 2);
        assert_eq!(
            lines,
            [
                "mfu          measured 500.00%, predicted 56.89% (model FLOPs over the peak of the plan's cpu-thread)",
                "             above 100%: this machine outruns the peak the plan's cluster gives a cpu-thread, and each rank ran on 2 threads where the plan counts one cpu-thread; the figure compares with that cluster, not with this machine",
            ]
        );
        assert_eq!(mfu_lines(1.12, 0.57, "cpu-thread", 1)[1], "             above 100%: this machine outruns the peak the plan's cluster gives a cpu-thread; the figure compares with that cluster, not with this machine");
    }

    #[test]
    fn an_mfu_at_or_below_100_percent_is_one_line() {
        assert_eq!(
            mfu_lines(0.4123, 0.45, "H100-SXM", 1),
            ["mfu          measured 41.23%, predicted 45.00% (model FLOPs over the peak of the plan's H100-SXM)"]
        );
        assert_eq!(mfu_lines(1.0, 0.45, "H100-SXM", 4).len(), 1);
    }
}
