//! `plan` and `compare`: the search, its report, the plan file.

use crate::{evaluate, no_fit, print_json, suggestions, Failure};
use meshplan_cost_model::estimate::gib;
use meshplan_cost_model::{prepare_model, Cluster, Estimate, InferenceLoad, PreparedGraph};
use meshplan_ir::{
    load_model, model_graph, Graph, ModelSpec, PartialConfig, Workload, WorkloadOverrides,
};
use meshplan_planner::compare;
use meshplan_planner::output::plan_of;
use meshplan_planner::search::{
    inference_space, search_inference, search_train, training_space, Candidate, Progress,
    SearchOptions, SearchReport, StopReason,
};
use meshplan_planner::search::{violations, Violation};
use meshplan_viz::compare::{compare_bars, CompareBar};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// The flags of `plan`.
pub(crate) struct PlanArgs {
    pub model: PathBuf,
    pub cluster: PathBuf,
    pub output: PathBuf,
    pub nodes: Option<u64>,
    pub calibration: Option<PathBuf>,
    pub config: Option<String>,
    pub top: usize,
    pub max_candidates: u64,
    pub time_limit: f64,
    pub quiet: bool,
    pub figures: Option<PathBuf>,
    pub png: bool,
    pub trace: Option<PathBuf>,
    pub workload: WorkloadOverrides,
    pub json: bool,
}

pub(crate) struct Inputs {
    pub spec: ModelSpec,
    pub graph: Graph,
    pub pg: PreparedGraph,
    pub cluster: Cluster,
    pub workload: Workload,
}

pub(crate) fn load(
    model: &Path,
    cluster: &Path,
    nodes: Option<u64>,
    calibration: Option<&Path>,
    wo: &WorkloadOverrides,
) -> Result<Inputs, Failure> {
    let swapped = |f: Failure| crate::swapped_inputs(model, cluster).unwrap_or(f);
    let spec = load_model(model, wo).map_err(|e| swapped(e.into()))?;
    let graph = model_graph(&spec)?;
    let pg = prepare_model(&spec)?;
    let cluster = crate::load_cluster_flagged(cluster, nodes, calibration).map_err(swapped)?;
    tracing::debug!(
        "model {} ({} layers, {:.3e} parameters); cluster {} x {} GPUs",
        spec.name,
        pg.layers,
        pg.params_total,
        cluster.nodes,
        cluster.gpus_per_node
    );
    let workload = spec.workload.clone().ok_or_else(|| Failure {
        code: 2,
        message: format!(
            "{}: model `{}` has no workload: add `workload:` to the model file, or give --seq-len and --global-batch, or --workload FILE",
            model.display(),
            spec.name
        ),
    })?;
    Ok(Inputs {
        spec,
        graph,
        pg,
        cluster,
        workload,
    })
}

fn is_inference(w: &Workload) -> bool {
    matches!(w, Workload::Inference { .. })
}

/// Runs the search with a progress bar on stderr when it takes more than a moment.
fn run_search(inp: &Inputs, opts: &SearchOptions, quiet: bool) -> Result<SearchReport, Failure> {
    // The workload names the framework (`framework:` or `--framework`): every
    // search of a command is for it.
    let opts = &SearchOptions {
        framework: inp.workload.framework(),
        ..opts.clone()
    };
    let progress = Arc::new(Progress::default());
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let bar_thread = (!quiet && crate::log::progress_visible()).then(|| {
        let (progress, done) = (progress.clone(), done.clone());
        std::thread::spawn(move || {
            // Only searches that outlast half a second get a bar.
            for _ in 0..10 {
                if done.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let bar = indicatif::ProgressBar::new(progress.total.load(Ordering::Relaxed));
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{spinner} searching {pos}/{len} configurations [{elapsed}]",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            while !done.load(Ordering::Relaxed) {
                bar.set_length(progress.total.load(Ordering::Relaxed));
                bar.set_position(progress.done.load(Ordering::Relaxed));
                std::thread::sleep(Duration::from_millis(100));
            }
            bar.finish_and_clear();
        })
    });
    let r = match &inp.workload {
        Workload::Train {
            seq_len,
            global_batch,
            ..
        } => search_train(
            &inp.graph,
            &inp.pg,
            &inp.cluster,
            *seq_len,
            *global_batch,
            opts,
            Some(&progress),
        ),
        Workload::Inference { .. } => match InferenceLoad::from_workload(&inp.workload) {
            Some(load) => search_inference(&inp.graph, &inp.pg, &inp.cluster, &load, opts),
            None => unreachable!("an inference workload converts"),
        },
    };
    done.store(true, Ordering::Relaxed);
    if let Some(t) = bar_thread {
        let _ = t.join();
    }
    r.map_err(|e| no_fit(e.message))
}

/// Exit 2 when `--config` (`text`, parsed as `fixed`) leaves no configuration at
/// all: that is bad input, not a model that does not fit.
fn fixed_keys_conflict(inp: &Inputs, fixed: &PartialConfig, text: &str) -> Option<Failure> {
    let (empty, inference) = match &inp.workload {
        Workload::Train {
            seq_len,
            global_batch,
            framework,
            ..
        } => {
            let needs = meshplan_ir::framework::Needs::of(&inp.graph, inp.pg.layers, *global_batch);
            let fixed = &fixed.or_attn(framework.default_attn(&needs));
            let space = training_space(&inp.pg, &inp.cluster, fixed, *seq_len, *global_batch);
            let refusals: Vec<Vec<String>> = space
                .iter()
                .map(|c| framework.cannot_run(c, &needs))
                .collect();
            if !space.is_empty() && refusals.iter().all(|r| !r.is_empty()) {
                // What the framework lacks, from the configuration it misses least.
                let fewest = refusals
                    .iter()
                    .min_by_key(|r| r.len())
                    .cloned()
                    .unwrap_or_default();
                return Some(Failure {
                    code: 2,
                    message: format!(
                        "--config {text}: --framework {framework} cannot run any configuration with these keys: {}",
                        fewest.join("; ")
                    ),
                });
            }
            (space.is_empty(), false)
        }
        Workload::Inference { .. } => (
            inference_space(&inp.pg, &inp.cluster, fixed).is_empty(),
            true,
        ),
    };
    if !empty {
        return None;
    }
    let written: Vec<&str> = text
        .split(',')
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .collect();
    Some(Failure {
        code: 2,
        message: format!(
            "--config {}: no configuration of {} GPUs ({} x {}) satisfies these keys: {}",
            written.join(","),
            inp.cluster.gpus(),
            inp.cluster.nodes,
            inp.cluster.name,
            meshplan_planner::search::unsatisfiable_because(
                fixed,
                &inp.cluster,
                inp.pg.layers,
                inference
            )
        ),
    })
}

/// Exit 3 with the closest miss and what would bring it under.
fn nothing_fits(inp: &Inputs, report: &SearchReport) -> Failure {
    let Some(c) = &report.closest_miss else {
        let mut msg = format!(
            "no feasible plan for {} on {} GPUs ({} enumerated, {} pruned by the memory lower bound, {} ruled out by shapes)",
            inp.spec.name,
            inp.cluster.gpus(),
            report.enumerated,
            report.pruned,
            report.rejected
        );
        if let Some(why) = &report.rejected_reason {
            msg.push_str(&format!("; ruled out because {why}"));
        }
        if let Some((cfg, bytes)) = &report.smallest_lower_bound {
            // With everything sharded (ZeRO-3 over every GPU), the states alone need
            // the framework's bytes per parameter spread over the cluster.
            let usable =
                inp.cluster.gpu.memory_bytes - meshplan_cost_model::calib::RUNTIME_RESERVED_BYTES;
            let per_param = meshplan_cost_model::state_bytes_per_param(
                inp.workload.framework(),
                inp.pg.dtype.size_bytes() as f64,
            );
            let gpus_needed = (per_param * inp.pg.params_total / usable).ceil();
            let nodes = (gpus_needed / inp.cluster.gpus_per_node as f64).ceil();
            msg.push_str(&format!(
                "; smallest per-GPU memory found {:.1} GiB > {:.1} GiB (model states alone, {cfg}); the weights, gradients and Adam states need at least {gpus_needed:.0} GPUs of {:.0} GiB: try --nodes {nodes:.0} or more",
                gib(*bytes),
                gib(inp.cluster.gpu.memory_bytes),
                gib(inp.cluster.gpu.memory_bytes),
            ));
        }
        return no_fit(msg);
    };
    if let Some(load) = InferenceLoad::from_workload(&inp.workload) {
        return no_fit(inference_miss(inp, report, c, &load));
    }
    let e = &c.estimate;
    let mut msg = format!(
        "no feasible plan for {} on {} GPUs; closest: {} with per-GPU memory {:.1} GiB > {:.1} GiB",
        inp.spec.name,
        inp.cluster.gpus(),
        c.cfg,
        gib(e.memory_per_gpu_bytes.total),
        gib(e.memory_capacity_bytes)
    );
    if let (Some(t), Some(p)) = (e.ttft_s, e.tpot_s) {
        msg.push_str(&format!(", TTFT {:.0} ms, TPOT {:.1} ms", t * 1e3, p * 1e3));
    }
    if report.pruned > 0 {
        msg.push_str(&format!(
            " ({} configurations could not hold the model states at all)",
            report.pruned
        ));
    }
    msg.push_str(&suggestions(&inp.spec, &inp.pg, &inp.cluster, &c.cfg));
    no_fit(msg)
}

/// The closest inference miss: which objectives it violates and by how much, and
/// what would meet them all (fewer requests, more nodes, a shorter prompt).
fn inference_miss(
    inp: &Inputs,
    report: &SearchReport,
    c: &Candidate,
    load: &InferenceLoad,
) -> String {
    let e = &c.estimate;
    let missed = violations(e, Some(load));
    let mut msg = format!(
        "no feasible plan for {} on {} GPUs; closest: {} misses {}",
        inp.spec.name,
        inp.cluster.gpus(),
        c.cfg,
        missed
            .iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join(" and ")
    );
    // The objectives it meets, and the predictions no SLO bounds, so the reader sees
    // every number of the miss.
    let missed_any = |f: fn(&Violation) -> bool| missed.iter().any(f);
    let mut met = Vec::new();
    let mut unbounded = Vec::new();
    if !missed_any(|v| matches!(v, Violation::Memory { .. })) {
        met.push(format!(
            "memory {:.1} of {:.1} GiB",
            gib(e.memory_per_gpu_bytes.total),
            gib(e.memory_capacity_bytes)
        ));
    }
    if let Some(t) = e
        .ttft_s
        .filter(|_| !missed_any(|v| matches!(v, Violation::Ttft { .. })))
    {
        match load.ttft_max_s {
            Some(m) => met.push(format!("TTFT {:.1} ms <= {:.1} ms", t * 1e3, m * 1e3)),
            None => unbounded.push(format!("TTFT {:.1} ms", t * 1e3)),
        }
    }
    if let Some(t) = e
        .tpot_s
        .filter(|_| !missed_any(|v| matches!(v, Violation::Tpot { .. })))
    {
        match load.tpot_max_s {
            Some(m) => met.push(format!("TPOT {:.2} ms <= {:.2} ms", t * 1e3, m * 1e3)),
            None => unbounded.push(format!("TPOT {:.2} ms", t * 1e3)),
        }
    }
    if !met.is_empty() {
        msg.push_str(&format!(" (meets {})", met.join(", ")));
    }
    if !unbounded.is_empty() {
        msg.push_str(&format!(" ({}; no SLO bounds them)", unbounded.join(", ")));
    }
    let knobs: Vec<&str> = missed
        .iter()
        .map(|v| match v {
            Violation::Tpot { .. } => {
                "TPOT grows with the requests each replica decodes together: fewer concurrent requests or more replicas (more nodes) lower it"
            }
            Violation::Ttft { .. } => {
                "TTFT is one request's prefill: more tensor ranks or a shorter prompt lower it, fewer requests do not"
            }
            Violation::Memory { .. } => {
                "the KV cache grows with concurrency x (prompt + output) tokens: fewer requests, shorter contexts or more GPUs (tp, pp, nodes) bring it under"
            }
        })
        .collect();
    if !knobs.is_empty() {
        msg.push_str(&format!("; {}", knobs.join("; ")));
    }
    let served = |c: &Candidate| {
        let e = &c.estimate;
        format!(
            "{}: TTFT {:.1} ms, TPOT {:.2} ms, {:.1} GiB",
            c.cfg,
            e.ttft_s.unwrap_or(0.0) * 1e3,
            e.tpot_s.unwrap_or(0.0) * 1e3,
            gib(e.memory_per_gpu_bytes.total)
        )
    };
    let mut fixes = Vec::new();
    if let Some(r) = &report.remedy {
        if let Some((n, c)) = &r.concurrency {
            fixes.push(format!(
                "concurrency {n} instead of {} ({})",
                load.concurrency,
                served(c)
            ));
        }
        if let Some((n, c)) = &r.nodes {
            fixes.push(format!("--nodes {n} ({})", served(c)));
        }
        if let Some((p, n, c)) = &r.prompt_len {
            let with = if *n == load.concurrency {
                String::new()
            } else {
                format!(" with concurrency {n} instead of {}", load.concurrency)
            };
            fixes.push(format!(
                "prompt_len {p} instead of {}{with} ({})",
                load.prompt_len,
                served(c)
            ));
        }
    }
    if fixes.is_empty() {
        msg.push_str(&format!(
            "; no smaller concurrency or prompt, nor up to {} nodes, meets every objective: relax the SLO or use faster GPUs",
            inp.cluster.nodes * 8
        ));
    } else {
        msg.push_str(&format!(
            "; these would meet every objective: {}",
            fixes.join(", or ")
        ));
    }
    msg
}

fn search_json(r: &SearchReport) -> serde_json::Value {
    let cand = |c: &Option<Candidate>| {
        c.as_ref().map(|c| {
            serde_json::json!({
                "strategy": c.cfg.to_string(),
                "ttft_s": c.estimate.ttft_s,
                "tpot_s": c.estimate.tpot_s,
                "output_tokens_per_s": c.estimate.output_tokens_per_s,
            })
        })
    };
    serde_json::json!({
        "candidates_enumerated": r.enumerated,
        "candidates_evaluated": r.evaluated,
        "pruned": r.pruned,
        "rejected": r.rejected,
        "infeasible": r.infeasible,
        "bounded": r.bounded,
        "wall_s": r.wall_s,
        "sweep_s": r.sweep_s,
        "stop_reason": r.stop_reason,
        "ilp_solves": r.ilp_solves,
        "solver": r.solver,
        "prefill_best": cand(&r.prefill_best),
        "decode_best": cand(&r.decode_best),
    })
}

fn print_candidate_line(i: usize, c: &Candidate) {
    let e = &c.estimate;
    if let (Some(tok), Some(tpot)) = (e.output_tokens_per_s, e.tpot_s) {
        eprintln!(
            "{:>3}. {:<70} {:>9.0} tok/s  TTFT {:>7.1} ms  TPOT {:>6.2} ms  {:>6.1} GiB",
            i + 1,
            c.cfg.to_string(),
            tok,
            e.ttft_s.unwrap_or(0.0) * 1e3,
            tpot * 1e3,
            gib(e.memory_per_gpu_bytes.total)
        );
    } else {
        eprintln!(
            "{:>3}. {:<70} {:>8.3} s  MFU {:>5.1}%  bubble {:>4.1}%  {:>6.1} GiB{}",
            i + 1,
            c.cfg.to_string(),
            e.step_time_s,
            100.0 * e.mfu,
            100.0 * e.bubble_fraction,
            gib(e.memory_per_gpu_bytes.total),
            c.layer_split
                .as_ref()
                .map(|s| format!("  layers {s:?}"))
                .unwrap_or_default()
        );
    }
}

/// `meshplan plan`.
pub(crate) fn plan(a: &PlanArgs) -> Result<(), Failure> {
    if let Some(d) = &a.figures {
        crate::draw::check_dir("--figures", d)?;
    }
    if let Some(t) = &a.trace {
        crate::draw::check_file("--trace", t)?;
    }
    let inp = load(
        &a.model,
        &a.cluster,
        a.nodes,
        a.calibration.as_deref(),
        &a.workload,
    )?;
    let fixed = match &a.config {
        Some(c) => PartialConfig::parse(c, "--config")?,
        None => PartialConfig::default(),
    };
    fixed.check_workload(is_inference(&inp.workload), "--config")?;
    let opts = SearchOptions {
        fixed,
        top_k: a.top.max(1),
        max_candidates: a.max_candidates,
        time_limit_s: a.time_limit,
        ..SearchOptions::default()
    };
    let report = match run_search(&inp, &opts, a.quiet || a.json) {
        Ok(r) => r,
        Err(f) => {
            let conflict = a
                .config
                .as_deref()
                .and_then(|text| fixed_keys_conflict(&inp, &opts.fixed, text));
            return Err(conflict.unwrap_or(f));
        }
    };
    let Some(best) = report.top.first() else {
        return Err(nothing_fits(&inp, &report));
    };
    if let Workload::Train { global_batch, .. } = &inp.workload {
        if meshplan_ir::framework::pads(&best.cfg, *global_batch) {
            let per_step = best.cfg.dp * best.cfg.mbs;
            tracing::warn!(
                "dp({}) x mbs({}) = {per_step} does not divide the global batch ({global_batch}): the plan computes {} sequences per step, which no framework runs, meshplan's executor included: it can be estimated and compared, not run",
                best.cfg.dp,
                best.cfg.mbs,
                global_batch.div_ceil(per_step) * per_step
            );
        }
    }
    let mut plan = plan_of(
        &inp.spec.name,
        &inp.graph,
        &inp.pg,
        &inp.cluster,
        &inp.workload,
        best,
        &report,
    )
    .map_err(|message| Failure { code: 1, message })?;
    plan.model.transformer = inp.spec.transformer().cloned();
    let bytes = plan.to_json().map_err(|e| Failure {
        code: 1,
        message: format!("cannot serialise the plan: {e}"),
    })?;
    crate::atomic::write_atomically(&a.output, &bytes, "plan")?;
    warn_if_not_run(&plan);
    let source = a.output.display().to_string();
    if let Some(dir) = &a.figures {
        let figures = crate::draw::plan_figures(&plan, &source)?;
        crate::draw::write_figures(dir, &figures, a.png)?;
    }
    if let Some(t) = &a.trace {
        crate::draw::write_trace(&plan, t, &source)?;
    }
    let search = search_json(&report);
    if a.json {
        print_json(&serde_json::json!({
            "plan_file": a.output.display().to_string(),
            "strategy": best.cfg,
            "layer_split": best.split_or_even(inp.pg.layers),
            "predicted": best.estimate,
            "search": search,
            "top": report.top.iter().take(a.top.max(1)).map(|c| serde_json::json!({
                "strategy": c.cfg.to_string(),
                "predicted": c.estimate,
                "layer_split": c.layer_split,
            })).collect::<Vec<_>>(),
        }));
    } else {
        // Every configuration the sweep looked at was priced, pruned or ruled out;
        // a budget or time limit leaves the rest of the space unexamined.
        let examined = report.evaluated + report.pruned + report.rejected;
        let searched = match report.stop_reason {
            StopReason::Exhausted => format!("{} configurations", report.enumerated),
            StopReason::CandidateBudget => format!(
                "{examined} of {} configurations, stopped by the candidate budget (--max-candidates {}):",
                report.enumerated, a.max_candidates
            ),
            StopReason::TimeLimit => format!(
                "{examined} of {} configurations, stopped by the time limit (--time-limit {} s):",
                report.enumerated, a.time_limit
            ),
        };
        tracing::info!(
            "searched {searched} ({} priced, {} of them stopped at the step-time bound; {} pruned by memory, {} ruled out by shapes, {} over memory or SLO) in {:.3} s; {} ILP solves ({}); stop: {:?}",
            report.evaluated,
            report.bounded,
            report.pruned,
            report.rejected,
            report.infeasible,
            report.wall_s,
            report.ilp_solves,
            report.solver,
            report.stop_reason
        );
        // The ranking goes to stderr beside the logs, so -q silences it too; the
        // chosen plan still goes to stdout and the file.
        if !a.quiet {
            for (i, c) in report.top.iter().take(a.top.max(1)).enumerate() {
                print_candidate_line(i, c);
            }
        }
        crate::print_estimate(&inp.spec, &inp.cluster, &best.estimate);
        if let Some(s) = &best.layer_split {
            println!("layer split  {s:?} (stage DP; even would be {:?})", {
                let mut even = best.clone();
                even.layer_split = None;
                even.split_or_even(inp.pg.layers)
            });
        }
        if let (Some(p), Some(d)) = (&report.prefill_best, &report.decode_best) {
            println!(
                "prefill best {} (TTFT {:.1} ms); decode best {} (TPOT {:.2} ms)",
                p.cfg,
                p.estimate.ttft_s.unwrap_or(0.0) * 1e3,
                d.cfg,
                d.estimate.tpot_s.unwrap_or(0.0) * 1e3
            );
        }
        println!(
            "plan written to {} ({} bytes)",
            a.output.display(),
            bytes.len()
        );
    }
    Ok(())
}

/// Says, when it is so, that `meshplan run` refuses a plan of meshplan's own
/// executor (or a deployment's prefill pool) before any rank starts, and where
/// such a plan runs instead.
pub(crate) fn warn_if_not_run(plan: &meshplan_ir::plan::Plan) {
    // A plan for another framework is that framework's to run.
    if plan.workload.framework() != meshplan_ir::Framework::Meshplan {
        return;
    }
    let prefill = meshplan_executor::disagg::prefill_pool(plan);
    let why = [Some(plan), prefill]
        .into_iter()
        .flatten()
        .find_map(meshplan_executor::refusal);
    let instead = match plan.kind {
        meshplan_ir::plan::PlanKind::Inference => "`meshplan export PLAN --to sglang` (or vllm) gives a serving engine's launch lines for it",
        meshplan_ir::plan::PlanKind::Train => "`meshplan export PLAN --to megatron` (or torchtitan, deepspeed) gives a training framework's arguments for it",
    };
    if let Some(why) = why {
        tracing::warn!("`meshplan run` will refuse this plan: {why}; {instead}");
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct NamedConfig {
    name: String,
    config: String,
}

fn read_configs_file(path: &Path) -> Result<Vec<(String, String)>, Failure> {
    let file = path.display().to_string();
    let text = meshplan_ir::load::read_text(path)?;
    meshplan_ir::yaml_depth::check_yaml_depth(&text, &file)?;
    let list: Vec<NamedConfig> = serde_yaml_ng::from_str(&text).map_err(|e| Failure {
        code: 2,
        message: format!(
            "{file}: {e}; expected a list of `{{name: ..., config: \"dp=..,tp=..\"}}`"
        ),
    })?;
    Ok(list.into_iter().map(|c| (c.name, c.config)).collect())
}

/// The flags of `compare`.
pub(crate) struct CompareArgs<'a> {
    pub model: &'a Path,
    pub cluster: &'a Path,
    pub configs: &'a [String],
    pub configs_file: Option<&'a Path>,
    pub nodes: Option<u64>,
    pub calibration: Option<&'a Path>,
    pub wo: &'a WorkloadOverrides,
    pub json: bool,
    pub figures: Option<&'a Path>,
    pub png: bool,
    /// `--report FILE`: the planner's best plan and the rows as one HTML page.
    pub report: Option<&'a Path>,
}

/// `meshplan compare`.
pub(crate) fn compare(a: &CompareArgs<'_>) -> Result<(), Failure> {
    let CompareArgs {
        model,
        cluster,
        configs,
        configs_file,
        nodes,
        calibration,
        wo,
        json,
        figures,
        png,
        report: html,
    } = *a;
    if let Some(d) = figures {
        crate::draw::check_dir("--figures", d)?;
    }
    let inp = load(model, cluster, nodes, calibration, wo)?;
    // (name, configuration, where it was written, for error messages)
    let mut named: Vec<(String, String, String)> = configs
        .iter()
        .map(|c| (c.clone(), c.clone(), format!("--config {c}")))
        .collect();
    if let Some(f) = configs_file {
        named.extend(read_configs_file(f)?.into_iter().map(|(name, text)| {
            let source = format!("{}: entry `{name}`", f.display());
            (name, text, source)
        }));
    }
    if named.is_empty() {
        return Err(Failure {
            code: 2,
            message: "compare needs at least one --config CFG or --configs-file FILE.yaml".into(),
        });
    }
    // Parse every configuration before searching, so a typo fails fast.
    let mut hand: Vec<(String, String, Result<Estimate, String>)> = Vec::new();
    let mut parsed = Vec::new();
    for (name, text, source) in &named {
        let p = PartialConfig::parse(text, source)?;
        p.check_workload(is_inference(&inp.workload), source)?;
        parsed.push((name.clone(), text.clone(), p));
    }
    let opts = SearchOptions::default();
    let report = run_search(&inp, &opts, json)?;
    let Some(best) = report.top.first() else {
        return Err(nothing_fits(&inp, &report));
    };
    for (name, text, p) in parsed {
        // A row means what `plan --config` means: the keys it names fixed, the rest
        // searched, priced as the search prices; a row with no layout that fits is
        // shown at its defaults, marked as not fitting.
        let searched = run_search(
            &inp,
            &SearchOptions {
                fixed: p,
                ..SearchOptions::default()
            },
            true,
        )
        .ok()
        .and_then(|r| r.top.into_iter().next());
        let r = match searched {
            Some(c) => Ok(c.estimate),
            None => crate::framework_keys(&inp.graph, &inp.pg, &inp.workload, &p)
                .resolve(inp.cluster.gpus(), &format!("--config {name}"))
                .map_err(|e| e.to_string())
                .and_then(|cfg| {
                    evaluate(&inp.spec, &inp.pg, &inp.cluster, &cfg).map_err(|f| f.message)
                }),
        };
        hand.push((name, text, r));
    }
    let rows = compare::rows(&best.estimate, best.layer_split.as_deref(), &hand);
    if let Some(path) = html {
        let (spec, g, pg, c, w) = (&inp.spec, &inp.graph, &inp.pg, &inp.cluster, &inp.workload);
        let mut plan = plan_of(&spec.name, g, pg, c, w, best, &report)
            .map_err(|message| Failure { code: 1, message })?;
        plan.model.transformer = spec.transformer().cloned();
        crate::report::compare_report(path, &plan, &rows)?;
    }
    if let Some(dir) = figures {
        let inference = best.estimate.tpot_s.is_some();
        let bars: Vec<CompareBar> = rows.iter().map(crate::report::compare_bar).collect();
        let title = crate::report::compare_title(
            &inp.spec.name,
            inp.cluster.gpus(),
            inp.cluster.nodes,
            &inp.cluster.name,
        );
        let what = crate::report::what(inference);
        let figure = meshplan_viz::Figure {
            name: "compare",
            canvas: compare_bars(&bars, &title, what),
        };
        crate::draw::write_figures(dir, &[figure], png)?;
    }
    if json {
        print_json(&serde_json::json!({
            "rows": rows,
            "search": search_json(&report),
        }));
        return Ok(());
    }
    println!(
        "{} on {} GPUs ({} x {})",
        inp.spec.name,
        inp.cluster.gpus(),
        inp.cluster.nodes,
        inp.cluster.name
    );
    let inference = best.estimate.tpot_s.is_some();
    // Names are printed whole (two configurations must never share a row label); the
    // column is as wide as the longest.
    let w = rows
        .iter()
        .map(|r| r.name.chars().count())
        .fold(22, usize::max);
    if inference {
        println!(
            "{:<w$} {:>11} {:>10} {:>10} {:>9} {:>7}  fits",
            "name", "tok/s", "TTFT ms", "TPOT ms", "mem GiB", "ratio"
        );
    } else {
        println!(
            "{:<w$} {:>9} {:>8} {:>6} {:>9} {:>8} {:>9} {:>7}  fits",
            "name", "step s", "TFLOP/s", "MFU%", "mem GiB", "bubble%", "exp.comm", "ratio"
        );
    }
    // The figure flags rows that miss memory or the SLO; the table says so too.
    let fits = |e: &Estimate| if e.feasible { "yes" } else { "NO" };
    for r in &rows {
        match &r.predicted {
            Some(e) if inference => println!(
                "{:<w$} {:>11.0} {:>10.1} {:>10.2} {:>9.1} {:>7.3}  {}",
                r.name,
                e.output_tokens_per_s.unwrap_or(0.0),
                e.ttft_s.unwrap_or(0.0) * 1e3,
                e.tpot_s.unwrap_or(0.0) * 1e3,
                gib(e.memory_per_gpu_bytes.total),
                r.ratio_to_planner.unwrap_or(f64::NAN),
                fits(e)
            ),
            Some(e) => println!(
                "{:<w$} {:>9.3} {:>8.1} {:>6.1} {:>9.1} {:>8.1} {:>9.3} {:>7.3}  {}",
                r.name,
                e.step_time_s,
                e.model_tflops_per_gpu,
                100.0 * e.mfu,
                gib(e.memory_per_gpu_bytes.total),
                100.0 * e.bubble_fraction,
                e.time_breakdown_s.exposed_comm,
                r.ratio_to_planner.unwrap_or(f64::NAN),
                fits(e)
            ),
            None => println!("{:<w$} cannot run", r.name),
        }
        println!("    {}", r.strategy);
        println!("    {}", r.account);
    }
    Ok(())
}
