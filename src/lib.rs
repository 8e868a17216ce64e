//! The `meshplan` command line: wiring only; the work is in the crates.
//!
//! The binary (`src/main.rs`) calls [`cli_main`]; the Python package calls
//! [`run_json`], the same dispatch with the object a command prints with `--json`
//! handed back instead of printed. One code path: every default, check and message
//! is the command line's.

use clap::{Args, Parser, Subcommand};
use meshplan_cost_model::estimate::gib;
use meshplan_cost_model::{
    flops_per_token_forward, load_cluster_calibrated, prepare_model, replica_memory, Cluster,
    Estimate, MemoryLedger, PreparedGraph,
};
use meshplan_ir::{
    load_model, IrError, ModelSpec, ParallelConfig, PartialConfig, Recompute, Workload,
    WorkloadOverrides,
};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

mod atomic;
mod calibrate;
mod deploy;
mod draw;
mod explain;
mod export;
mod generate;
mod launch;
mod log;
mod plan;
mod report;
mod run;

#[derive(Parser)]
#[command(
    name = "meshplan",
    version,
    about = "How to split a model over these GPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Only warnings and errors on stderr; no progress bars.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// More detail on stderr (-v debug, -vv trace).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
}

#[derive(Args, Clone)]
struct WorkloadFlags {
    /// Training sequence length (for a config.json model).
    #[arg(long)]
    seq_len: Option<u64>,
    /// Training sequences per optimizer step (for a config.json model).
    #[arg(long)]
    global_batch: Option<u64>,
    /// A YAML holding the `workload:` mapping's contents.
    #[arg(long)]
    workload: Option<PathBuf>,
    /// The framework that will run the plan (megatron-core, torchtitan, deepspeed,
    /// megatron-deepspeed, meshplan): only what it can run is searched.
    #[arg(long, value_name = "NAME")]
    framework: Option<meshplan_ir::Framework>,
    /// Pads the vocabulary to a multiple of N rows, as Megatron-LM's flag of this
    /// name does, so that tensor parallelism can split the embedding, the head
    /// and the loss (128 pads GPT-2's 50257 tokens to 50304); the padded rows
    /// are never a token.
    #[arg(long, value_name = "N")]
    make_vocab_size_divisible_by: Option<u64>,
}

impl WorkloadFlags {
    fn overrides(&self) -> WorkloadOverrides {
        WorkloadOverrides {
            seq_len: self.seq_len,
            global_batch: self.global_batch,
            workload_file: self.workload.clone(),
            framework: self.framework,
            make_vocab_size_divisible_by: self.make_vocab_size_divisible_by,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Parameters, FLOPs per token and the memory ledger of a model.
    Inspect {
        /// Model YAML or Hugging Face config.json.
        model: PathBuf,
        #[command(flatten)]
        workload: WorkloadFlags,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Search for the fastest configuration that fits and write its plan.
    Plan {
        /// Model YAML or Hugging Face config.json.
        model: PathBuf,
        /// Cluster YAML.
        cluster: PathBuf,
        /// Where to write the plan.
        #[arg(short = 'o', long = "output", default_value = "plan.json")]
        output: PathBuf,
        /// Override the cluster's node count.
        #[arg(long)]
        nodes: Option<u64>,
        /// A calibration overlay (`meshplan calibrate -o FILE`) laid over the cluster:
        /// measured GEMM, HBM, attention and collective speeds.
        #[arg(long, value_name = "FILE")]
        calibration: Option<PathBuf>,
        /// Keys to fix (e.g. `tp=2,pp=2`); the rest are searched.
        #[arg(long)]
        config: Option<String>,
        /// Print the K best candidates.
        #[arg(long, default_value_t = 1)]
        top: usize,
        /// Stop after pricing this many configurations.
        #[arg(long, default_value_t = 20_000_000)]
        max_candidates: u64,
        /// Stop sweeping after this many seconds.
        #[arg(long, default_value_t = 60.0)]
        time_limit: f64,
        /// Also draw the plan (pipeline.svg, memory.svg, mesh.svg) into this directory.
        #[arg(long)]
        figures: Option<PathBuf>,
        /// Write the figures as PNG instead of SVG.
        #[arg(long, requires = "figures")]
        png: bool,
        /// Also write the predicted schedule as a Chrome trace (Perfetto, chrome://tracing).
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Also write the plan as one self-contained HTML page (`meshplan report`).
        #[arg(long, value_name = "FILE")]
        report: Option<PathBuf>,
        #[command(flatten)]
        workload: WorkloadFlags,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Plan a serving deployment within SLOs: aggregated (continuous batching) or
    /// prefill and decode pools, the throughput-latency frontier, and the plan of
    /// the best.
    Deploy {
        /// Model YAML or Hugging Face config.json (an inference workload).
        model: PathBuf,
        /// Cluster YAML.
        cluster: PathBuf,
        /// Where to write the plan.
        #[arg(short = 'o', long = "output", default_value = "plan.json")]
        output: PathBuf,
        /// Override the cluster's node count.
        #[arg(long)]
        nodes: Option<u64>,
        /// A calibration overlay (`meshplan calibrate -o FILE`) laid over the cluster.
        #[arg(long, value_name = "FILE")]
        calibration: Option<PathBuf>,
        /// Keys every instance keeps (e.g. `tp=8`); the rest are searched.
        #[arg(long)]
        config: Option<String>,
        /// Keys the prefill pool's instances keep (disaggregated deployments).
        #[arg(long, value_name = "CFG")]
        prefill_config: Option<String>,
        /// Keys the decode pool's instances keep (and an aggregated deployment's).
        #[arg(long, value_name = "CFG")]
        decode_config: Option<String>,
        /// Decode context parallelism of the decode instances (default: searched
        /// wherever tensor ranks hold copies of the KV cache, as MLA's latent).
        #[arg(long, value_name = "N")]
        dcp: Option<u64>,
        /// Also draw the frontier (frontier.svg) into this directory.
        #[arg(long)]
        figures: Option<PathBuf>,
        /// Write the figure as PNG instead of SVG.
        #[arg(long, requires = "figures")]
        png: bool,
        #[command(flatten)]
        workload: WorkloadFlags,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Draw an existing plan: pipeline schedule, memory per GPU, device mesh.
    Draw {
        /// A plan written by `meshplan plan`.
        plan: PathBuf,
        /// Directory for the figures (created if missing).
        #[arg(short = 'o', long = "output", default_value = "figures")]
        output: PathBuf,
        /// PNG instead of SVG.
        #[arg(long)]
        png: bool,
        /// Also write the predicted schedule as a Chrome trace.
        #[arg(long)]
        trace: Option<PathBuf>,
    },
    /// The planner's best beside hand-given configurations.
    Compare {
        /// Model YAML or Hugging Face config.json.
        model: PathBuf,
        /// Cluster YAML.
        cluster: PathBuf,
        /// A configuration to compare (repeatable).
        #[arg(long = "config")]
        configs: Vec<String>,
        /// A YAML list of `{name: ..., config: "..."}` (`--configs`, the contract's
        /// spelling, or `--configs-file`).
        #[arg(long, visible_alias = "configs")]
        configs_file: Option<PathBuf>,
        /// Override the cluster's node count.
        #[arg(long)]
        nodes: Option<u64>,
        /// A calibration overlay (`meshplan calibrate -o FILE`) laid over the cluster:
        /// measured GEMM, HBM, attention and collective speeds.
        #[arg(long, value_name = "FILE")]
        calibration: Option<PathBuf>,
        /// Also draw the candidates side by side (compare.svg) into this directory.
        #[arg(long)]
        figures: Option<PathBuf>,
        /// Write the figure as PNG instead of SVG.
        #[arg(long, requires = "figures")]
        png: bool,
        /// Also write one self-contained HTML page: the planner's best plan and the
        /// comparison.
        #[arg(long, value_name = "FILE")]
        report: Option<PathBuf>,
        #[command(flatten)]
        workload: WorkloadFlags,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Execute a plan (ranks as threads on the CPU or a GPU) and report measured beside predicted.
    Run {
        /// A plan written by `meshplan plan`.
        plan: PathBuf,
        /// cpu (ranks as threads, fp32), cpu-bf16 (the device interpreter with a
        /// GPU's bf16 rounding, on the CPU) or cuda (a build with `--features cuda`:
        /// the device interpreter on GPU 0, every rank a thread; under `launch`, one
        /// training rank per process and GPU).
        #[arg(long, default_value = "cpu")]
        backend: String,
        /// Optimizer steps (training plans; default 5).
        #[arg(long)]
        steps: Option<u64>,
        /// Also run the single-rank reference and fail if losses, weights or
        /// communicated bytes differ.
        #[arg(long)]
        check: bool,
        /// Train on a u16 token file (nanoGPT / llm.c format, llm.c's header
        /// optional) instead of the synthetic stream.
        #[arg(long)]
        data: Option<PathBuf>,
        /// A Hugging Face checkpoint directory (config.json + *.safetensors): the
        /// weights an inference plan serves, or a training plan fine-tunes from.
        #[arg(long)]
        weights: Option<PathBuf>,
        /// Write the measured timeline (tasks, ops, collectives, optimizer) of every
        /// rank as a Chrome trace (training plans).
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Kernel threads of each rank; results do not depend on it [default: the
        /// machine's cores divided by the plan's ranks, at least 1].
        #[arg(long, value_name = "N")]
        threads: Option<usize>,
        /// Write checkpoints (full weights and AdamW state, safetensors) into DIR:
        /// after the last step, and every --save-every steps.
        #[arg(long, value_name = "DIR")]
        save: Option<PathBuf>,
        /// Also save after every N steps (global step numbers); needs --save.
        #[arg(long, value_name = "N")]
        save_every: Option<u64>,
        /// Keep only the newest K step folders in the --save folder (the one
        /// `latest` names always stays); needs --save.
        #[arg(long, value_name = "K")]
        keep_last: Option<u64>,
        /// Continue from a checkpoint (a --save DIR, whose `latest` is used, or one
        /// of its step folders), on this or any other plan of the model; --steps
        /// counts all steps, so the run does the steps from the checkpoint's to N.
        #[arg(long, value_name = "DIR")]
        resume: Option<PathBuf>,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        generate: generate::GenerateFlags,
    },
    /// One self-contained HTML page of a plan: summary, schedule, memory, mesh, its
    /// neighbours compared and explained, calibration.
    Report {
        /// A plan written by `meshplan plan`.
        plan: PathBuf,
        /// Where to write the page.
        #[arg(short = 'o', long = "output", default_value = "report.html")]
        output: PathBuf,
    },
    /// Write a plan as a framework's arguments or config file.
    Export {
        /// A plan written by `meshplan plan`.
        plan: PathBuf,
        /// megatron, torchtitan, deepspeed (training plans); sglang, vllm (inference
        /// plans). Default: the framework the plan was made for (`plan --framework`).
        #[arg(long = "to", value_name = "TARGET")]
        to: Option<String>,
        /// Write here instead of stdout.
        #[arg(short = 'o', long = "output")]
        output: Option<PathBuf>,
    },
    /// Why this plan: its neighbours re-priced, the deciding terms, what-ifs.
    Explain {
        /// A plan written by `meshplan plan`.
        plan: PathBuf,
        /// Show this many alternatives (all with --json).
        #[arg(long, default_value_t = 8)]
        top: usize,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Evaluate one parallel configuration with the cost model.
    Estimate {
        /// Model YAML or Hugging Face config.json.
        model: PathBuf,
        /// Cluster YAML.
        cluster: PathBuf,
        /// The configuration, e.g. `dp=60,tp=8,pp=8,mbs=1,recompute=full`.
        #[arg(long)]
        config: String,
        /// Override the cluster's node count.
        #[arg(long)]
        nodes: Option<u64>,
        /// A calibration overlay (`meshplan calibrate -o FILE`) laid over the cluster:
        /// measured GEMM, HBM, attention and collective speeds.
        #[arg(long, value_name = "FILE")]
        calibration: Option<PathBuf>,
        #[command(flatten)]
        workload: WorkloadFlags,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Start this node's ranks as processes (torchrun-style), each running the
    /// meshplan command after `--` with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
    /// MASTER_PORT set; output lines are prefixed with `[rank r]`.
    #[command(
        after_help = "Example: meshplan launch --nproc-per-node 8 -- run plan.json --backend cuda\nOn several nodes run it on each with --nnodes, --node-rank and the same --master-addr/--master-port."
    )]
    Launch {
        /// Processes (GPUs) on this node.
        #[arg(long)]
        nproc_per_node: usize,
        /// Nodes of the run.
        #[arg(long, default_value_t = 1)]
        nnodes: usize,
        /// This node's index, 0..nnodes.
        #[arg(long, default_value_t = 0)]
        node_rank: usize,
        /// Host of node 0, where rank 0 listens (default 127.0.0.1 on one node).
        #[arg(long)]
        master_addr: Option<String>,
        /// Rank 0's port; 0 picks a free one (one node only).
        #[arg(long, default_value_t = 29500)]
        master_port: u16,
        /// Seconds between SIGTERM and SIGKILL when stopping ranks.
        #[arg(long, default_value_t = 10.0)]
        grace: f64,
        /// The meshplan command every rank runs, after `--`.
        #[arg(last = true, value_name = "COMMAND")]
        command: Vec<std::ffi::OsString>,
    },
    /// Join the rendezvous of a launched run and print the rank -> node map (tests).
    #[command(hide = true)]
    RendezvousCheck {
        /// Seconds any wait may take.
        #[arg(long, default_value_t = 60.0)]
        timeout: f64,
        /// A plan file whose hash every rank must share.
        #[arg(long)]
        plan: Option<PathBuf>,
        /// This rank exits with --fail-code before joining.
        #[arg(long)]
        fail_rank: Option<usize>,
        /// The exit code of --fail-rank.
        #[arg(long, default_value_t = 3)]
        fail_code: u8,
        /// Seconds to wait before the final barrier.
        #[arg(long, default_value_t = 0.0)]
        hold: f64,
    },
    /// Measure this node's GPUs (GEMM, HBM, attention, NCCL collectives) and, under a
    /// launch on several nodes, the collectives across them, into a calibration
    /// overlay for --calibration.
    Calibrate {
        /// Where to write the overlay (not needed with --dry-run).
        #[arg(
            short = 'o',
            long = "output",
            value_name = "FILE",
            required_unless_present = "dry_run"
        )]
        output: Option<PathBuf>,
        /// The backend that measures (only cuda measures GPUs).
        #[arg(long, default_value = "cuda")]
        backend: String,
        /// Print what would be measured and exit.
        #[arg(long)]
        dry_run: bool,
        /// Nodes the run spans: with --dry-run, lists the sweep across them; on a
        /// run under a launch, the node count the launch must have.
        #[arg(long, value_name = "N")]
        nodes: Option<u64>,
    },
}

/// A failure with its exit code: 1 runtime, 2 bad input, 3 does not fit.
#[derive(Debug)]
pub struct Failure {
    /// The exit code.
    pub code: u8,
    /// What went wrong, naming the file, field and fix.
    pub message: String,
}

/// The crate's version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

impl From<IrError> for Failure {
    fn from(e: IrError) -> Self {
        Failure {
            code: 2,
            message: e.to_string(),
        }
    }
}

pub(crate) fn no_fit(message: String) -> Failure {
    Failure { code: 3, message }
}

/// `println!` panics when standard output cannot be written: a reader that went away
/// (`meshplan inspect M | head -1`) ends the command quietly, any other failure (a
/// full disk) is an error with exit 1, never a panic and a backtrace.
fn stdout_failures_end_cleanly() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if let Some(why) = msg.strip_prefix("failed printing to stdout: ") {
            if why.contains("Broken pipe") {
                std::process::exit(0);
            }
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "error: cannot write to standard output: {why}"
            );
            std::process::exit(1);
        }
        default(info);
    }));
}

/// The command line: parses the process's arguments, runs the command, prints a
/// failure and turns it into the exit code.
pub fn cli_main() -> ExitCode {
    stdout_failures_end_cleanly();
    meshplan_executor::alloc::keep_freed_memory();
    let cli = Cli::parse();
    log::init(cli.quiet, cli.verbose);
    // A rank started by `meshplan launch` stops when its launcher dies.
    meshplan_launch::watch_launcher(|| {
        // The launcher held our stderr too: a failed write must not stop the exit.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "error: the `meshplan launch` that started this rank exited; stopping"
        );
        std::process::exit(1);
    });
    match dispatch(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("error: {}", f.message);
            // A failure never exits 0, whatever code it carries.
            ExitCode::from(f.code.max(1))
        }
    }
}

/// Runs `meshplan ARGS` (without the program name) in this process and returns the
/// JSON object the command prints with `--json` (`null` for a command that prints
/// none, such as `export -o FILE` or `draw`), or the failure the command line would
/// exit with. Bad arguments are exit code 2 with clap's message.
pub fn run_json(args: &[String]) -> Result<serde_json::Value, Failure> {
    let argv = std::iter::once("meshplan".to_string()).chain(args.iter().cloned());
    let cli = Cli::try_parse_from(argv).map_err(|e| Failure {
        code: 2,
        message: e.to_string().trim_end().to_string(),
    })?;
    log::init(cli.quiet, cli.verbose);
    JSON_OUT.with(|c| *c.borrow_mut() = Some(serde_json::Value::Null));
    let result = dispatch(cli);
    let printed = JSON_OUT.with(|c| c.borrow_mut().take());
    result.map(|()| printed.unwrap_or_default())
}

thread_local! {
    /// Set by [`run_json`]: where [`print_json`] puts the object instead of stdout.
    static JSON_OUT: std::cell::RefCell<Option<serde_json::Value>> =
        const { std::cell::RefCell::new(None) };
}

fn dispatch(cli: Cli) -> Result<(), Failure> {
    match cli.command {
        Command::Export { plan, to, output } => {
            export::export(&plan, to.as_deref(), output.as_deref())
        }
        Command::Explain { plan, top, json } => explain::explain(&plan, top, json),
        Command::Report { plan, output } => report::report(&plan, &output, "-o"),
        Command::Inspect {
            model,
            workload,
            json,
        } => inspect(&model, &workload, json),
        Command::Estimate {
            model,
            cluster,
            config,
            nodes,
            calibration,
            workload,
            json,
        } => estimate(
            &model,
            &cluster,
            &config,
            nodes,
            calibration.as_deref(),
            &workload,
            json,
        ),
        Command::Calibrate {
            output,
            backend,
            dry_run,
            nodes,
        } => calibrate::calibrate(output.as_deref(), &backend, dry_run, nodes),
        Command::Launch {
            nproc_per_node,
            nnodes,
            node_rank,
            master_addr,
            master_port,
            grace,
            command,
        } => launch::launch(launch::LaunchArgs {
            nproc_per_node,
            nnodes,
            node_rank,
            master_addr,
            master_port,
            grace_s: grace,
            command,
        }),
        Command::RendezvousCheck {
            timeout,
            plan,
            fail_rank,
            fail_code,
            hold,
        } => launch::rendezvous_check(&launch::CheckArgs {
            timeout_s: timeout,
            plan,
            fail_rank,
            fail_code,
            hold_s: hold,
        }),
        Command::Plan {
            model,
            cluster,
            output,
            nodes,
            calibration,
            config,
            top,
            max_candidates,
            time_limit,
            figures,
            png,
            trace,
            report: html,
            workload,
            json,
        } => report::check(html.as_deref())
            .and_then(|()| {
                plan::plan(&plan::PlanArgs {
                    model,
                    cluster,
                    output: output.clone(),
                    nodes,
                    calibration,
                    config,
                    top,
                    max_candidates,
                    time_limit,
                    quiet: cli.quiet,
                    figures,
                    png,
                    trace,
                    workload: workload.overrides(),
                    json,
                })
            })
            .and_then(|()| html.map_or(Ok(()), |h| report::report(&output, &h, "--report"))),
        Command::Deploy {
            model,
            cluster,
            output,
            nodes,
            calibration,
            config,
            prefill_config,
            decode_config,
            dcp,
            figures,
            png,
            workload,
            json,
        } => deploy::deploy(&deploy::DeployArgs {
            model,
            cluster,
            output,
            nodes,
            calibration,
            config,
            prefill_config,
            decode_config,
            dcp,
            figures,
            png,
            workload: workload.overrides(),
            json,
        }),
        Command::Draw {
            plan,
            output,
            png,
            trace,
        } => draw::draw(&plan, &output, png, trace.as_deref()),
        Command::Run {
            plan,
            backend,
            steps,
            check,
            data,
            weights,
            trace,
            threads,
            save,
            save_every,
            keep_last,
            resume,
            json,
            generate,
        } => {
            let unsupported = Vec::new();
            run::run(&run::RunArgs {
                plan: &plan,
                backend: &backend,
                steps: steps.unwrap_or(5),
                steps_given: steps.is_some(),
                check,
                json,
                data: data.as_deref(),
                trace: trace.as_deref(),
                threads,
                unsupported,
                save: save.as_deref(),
                save_every,
                keep_last,
                resume: resume.as_deref(),
                weights: weights.as_deref(),
                generate: &generate,
            })
        }
        Command::Compare {
            model,
            cluster,
            configs,
            configs_file,
            nodes,
            calibration,
            figures,
            png,
            report: html,
            workload,
            json,
        } => report::check(html.as_deref()).and_then(|()| {
            plan::compare(&plan::CompareArgs {
                model: &model,
                cluster: &cluster,
                configs: &configs,
                configs_file: configs_file.as_deref(),
                nodes,
                calibration: calibration.as_deref(),
                wo: &workload.overrides(),
                json,
                figures: figures.as_deref(),
                png,
                report: html.as_deref(),
            })
        }),
    }
}

pub(crate) fn print_json(v: &serde_json::Value) {
    let captured = JSON_OUT.with(|c| match c.borrow_mut().as_mut() {
        Some(slot) => {
            *slot = v.clone();
            true
        }
        None => false,
    });
    if captured {
        return;
    }
    match serde_json::to_string_pretty(v) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("error: cannot serialise output: {e}"),
    }
}

pub(crate) fn ledger_lines(m: &MemoryLedger) -> String {
    format!(
        "  params      {:>9.2} GiB\n  grads       {:>9.2} GiB\n  optimizer   {:>9.2} GiB\n  activations {:>9.2} GiB\n  kv_cache    {:>9.2} GiB\n  workspace   {:>9.2} GiB\n  total       {:>9.2} GiB",
        gib(m.params),
        gib(m.grads),
        gib(m.optimizer),
        gib(m.activations),
        gib(m.kv_cache),
        gib(m.workspace),
        gib(m.total)
    )
}

fn inspect(model: &Path, wf: &WorkloadFlags, json: bool) -> Result<(), Failure> {
    let spec = load_model(model, &wf.overrides())?;
    let pg = prepare_model(&spec)?;
    let workload = spec.workload.clone().unwrap_or(Workload::Train {
        seq_len: 2048,
        global_batch: 1,
        optimizer: "adamw".into(),
        framework: Default::default(),
    });
    let seq = match &workload {
        Workload::Train { seq_len, .. } => *seq_len,
        Workload::Inference { prompt_len, .. } => *prompt_len,
    };
    let fwd = flops_per_token_forward(&pg, seq);
    let memory = replica_memory(&pg, &workload);
    if json {
        print_json(&serde_json::json!({
            "name": spec.name,
            "dtype": spec.dtype,
            "params_total": pg.params_total,
            "params_active": pg.params_active,
            "flops_per_token_forward": fwd,
            "flops_per_token_train": 3.0 * fwd,
            "seq_len": seq,
            "memory_bytes": memory,
        }));
    } else {
        println!("{}", spec.name);
        println!(
            "  parameters   {:.4e} total, {:.4e} active",
            pg.params_total, pg.params_active
        );
        println!(
            "  FLOPs/token  {:.4e} forward, {:.4e} training (at sequence {seq})",
            fwd,
            3.0 * fwd
        );
        println!("memory of one unsharded replica:");
        println!("{}", ledger_lines(&memory));
    }
    Ok(())
}

/// A cluster file with its calibration overlay (`--calibration` wins over the one
/// the file names); says on stderr which measurements price the run.
pub(crate) fn load_cluster_flagged(
    path: &Path,
    nodes: Option<u64>,
    calibration: Option<&Path>,
) -> Result<Cluster, Failure> {
    let cluster = load_cluster_calibrated(path, nodes, calibration)?;
    if let Some(c) = &cluster.calibration {
        tracing::info!(
            "calibrated by {}: {} measured at {} ({})",
            c.file,
            c.device,
            c.measured_at,
            c.measured_with
        );
        if c.device_matches(&cluster.gpu.name) == Some(false) {
            tracing::warn!(
                "{}: measured on `{}`, but {} describes `{}`; the measurements may not fit these GPUs",
                c.file,
                c.device,
                path.display(),
                cluster.gpu.name
            );
        }
    }
    Ok(cluster)
}

/// Top-level keys that only a cluster file has, and only a model file (YAML or a
/// Hugging Face config.json) has.
const CLUSTER_KEYS: &[&str] = &["gpus_per_node", "gpu", "nodes", "intra_node", "inter_node"];
const MODEL_KEYS: &[&str] = &[
    "transformer",
    "graph",
    "workload",
    "hidden_size",
    "num_hidden_layers",
    "model_type",
];

/// The first of `keys` that the mapping in `path` has at its top level.
fn has_top_key(path: &Path, keys: &[&'static str]) -> Option<&'static str> {
    let text = meshplan_ir::load::read_text(path).ok()?;
    meshplan_ir::yaml_depth::check_yaml_depth(&text, "").ok()?;
    let serde_yaml_ng::Value::Mapping(m) = serde_yaml_ng::from_str(&text).ok()? else {
        return None;
    };
    m.keys()
        .filter_map(|k| k.as_str())
        .find_map(|k| keys.iter().find(|c| **c == k).copied())
}

/// When MODEL or CLUSTER failed to load, whether the two were given in the wrong
/// order: the loader's `unknown field` alone does not say so.
pub(crate) fn swapped_inputs(model: &Path, cluster: &Path) -> Option<Failure> {
    let model_is_cluster =
        has_top_key(model, CLUSTER_KEYS).filter(|_| has_top_key(model, MODEL_KEYS).is_none());
    let cluster_is_model =
        has_top_key(cluster, MODEL_KEYS).filter(|_| has_top_key(cluster, CLUSTER_KEYS).is_none());
    let (m, c) = (model.display(), cluster.display());
    let message = match (model_is_cluster, cluster_is_model) {
        (Some(mk), Some(ck)) => format!(
            "{c}: this looks like a model file (it has `{ck}:`), and {m} like a cluster file (it has `{mk}:`); the order is MODEL CLUSTER: give {c} first, then {m}"
        ),
        (Some(mk), None) => format!(
            "{m}: this looks like a cluster file (it has `{mk}:`), given as MODEL; the order is MODEL CLUSTER"
        ),
        (None, Some(ck)) => format!(
            "{c}: this looks like a model file (it has `{ck}:`), given as CLUSTER; the order is MODEL CLUSTER"
        ),
        (None, None) => return None,
    };
    Some(Failure { code: 2, message })
}

fn load_inputs(
    model: &Path,
    cluster: &Path,
    nodes: Option<u64>,
    calibration: Option<&Path>,
    wf: &WorkloadFlags,
) -> Result<(ModelSpec, PreparedGraph, Cluster), Failure> {
    let swapped = |f: Failure| swapped_inputs(model, cluster).unwrap_or(f);
    let spec = load_model(model, &wf.overrides()).map_err(|e| swapped(e.into()))?;
    let pg = prepare_model(&spec)?;
    let cluster = load_cluster_flagged(cluster, nodes, calibration).map_err(swapped)?;
    Ok((spec, pg, cluster))
}

fn estimate(
    model: &Path,
    cluster_path: &Path,
    config: &str,
    nodes: Option<u64>,
    calibration: Option<&Path>,
    wf: &WorkloadFlags,
    json: bool,
) -> Result<(), Failure> {
    let (spec, pg, cluster) = load_inputs(model, cluster_path, nodes, calibration, wf)?;
    let partial = PartialConfig::parse(config, "--config")?;
    let inference = matches!(spec.workload, Some(Workload::Inference { .. }));
    partial.check_workload(inference, "--config")?;
    let partial = match &spec.workload {
        Some(w) => framework_keys(&meshplan_ir::model_graph(&spec)?, &pg, w, &partial),
        None => partial,
    };
    let cfg = partial
        .resolve(cluster.gpus(), "--config")
        .map_err(|e| no_fit(e.to_string()))?;
    let est = evaluate(&spec, &pg, &cluster, &cfg)?;
    if json {
        print_json(&serde_json::to_value(&est).unwrap_or_default());
    } else {
        print_estimate(&spec, &cluster, &est);
    }
    if !est.feasible {
        let reason = est.infeasible_reason.clone().unwrap_or_default();
        let hint = suggestions(&spec, &pg, &cluster, &cfg);
        return Err(no_fit(format!("{}: {reason}{hint}", cfg)));
    }
    Ok(())
}

/// `keys` with the training framework's attention kernel for the model where they
/// leave the kernel open, as the search does.
pub(crate) fn framework_keys(
    graph: &meshplan_ir::Graph,
    pg: &PreparedGraph,
    workload: &Workload,
    keys: &PartialConfig,
) -> PartialConfig {
    match workload {
        Workload::Train {
            global_batch,
            framework,
            ..
        } => keys.or_attn(framework.default_attn(&meshplan_ir::framework::Needs::of(
            graph,
            pg.layers,
            *global_batch,
        ))),
        Workload::Inference { .. } => *keys,
    }
}

pub(crate) fn evaluate(
    spec: &ModelSpec,
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
) -> Result<Estimate, Failure> {
    let workload = spec.workload.as_ref().ok_or_else(|| Failure {
        code: 2,
        message: format!(
            "model `{}` has no workload: add `workload:` to the model file, or give --seq-len and --global-batch, or --workload FILE",
            spec.name
        ),
    })?;
    // Priced as the search prices it (balanced and stage-DP layer splits, standard
    // and ILP placements), so that `estimate` agrees with `plan --config`.
    let graph = meshplan_ir::model_graph(spec)?;
    if let Workload::Train {
        global_batch,
        framework,
        ..
    } = workload
    {
        let needs = meshplan_ir::framework::Needs::of(&graph, pg.layers, *global_batch);
        let why = framework.cannot_run(cfg, &needs);
        if !why.is_empty() {
            return Err(Failure {
                code: 2,
                message: format!(
                    "{cfg}: --framework {framework} cannot run it: {}",
                    why.join("; ")
                ),
            });
        }
    }
    // The framework's refusal was given above (exit 2); price_config prices as it runs.
    meshplan_planner::search::price_config(&graph, pg, cluster, workload, cfg)
        .map(|c| c.estimate)
        .map_err(|e| no_fit(format!("{cfg}: {}", e.message)))
}

/// What would fit: the nearest changes (more ZeRO, recomputation, more stages or
/// tensor ranks) that bring memory under capacity.
pub(crate) fn suggestions(
    spec: &ModelSpec,
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
) -> String {
    let mut tries: Vec<(String, ParallelConfig)> = Vec::new();
    for zero in (cfg.zero + 1)..=3 {
        tries.push((format!("zero={zero}"), ParallelConfig { zero, ..*cfg }));
    }
    for (name, rc) in [
        ("recompute=selective", Recompute::Selective),
        ("recompute=full", Recompute::Full),
    ] {
        if rc != cfg.recompute {
            tries.push((
                name.into(),
                ParallelConfig {
                    recompute: rc,
                    ..*cfg
                },
            ));
        }
    }
    if cfg.dp.is_multiple_of(2) {
        tries.push((
            format!("pp={}", cfg.pp * 2),
            ParallelConfig {
                pp: cfg.pp * 2,
                dp: cfg.dp / 2,
                ..*cfg
            },
        ));
        tries.push((
            format!("tp={}", cfg.tp * 2),
            ParallelConfig {
                tp: cfg.tp * 2,
                dp: cfg.dp / 2,
                ..*cfg
            },
        ));
    }
    let fits: Vec<String> = tries
        .into_iter()
        .filter_map(|(name, c)| match evaluate(spec, pg, cluster, &c) {
            Ok(e) if e.feasible => Some(format!(
                "{name} ({:.1} GiB)",
                gib(e.memory_per_gpu_bytes.total)
            )),
            _ => None,
        })
        .collect();
    if fits.is_empty() {
        "; no single change of zero, recompute, pp or tp fits".into()
    } else {
        format!("; these would fit: {}", fits.join(", "))
    }
}

pub(crate) fn print_estimate(spec: &ModelSpec, cluster: &Cluster, e: &Estimate) {
    println!(
        "{} on {} x {} ({} GPUs)",
        spec.name,
        cluster.nodes,
        cluster.name,
        cluster.gpus()
    );
    println!("config       {}", e.config);
    if let (Some(ttft), Some(tpot)) = (e.ttft_s, e.tpot_s) {
        println!("TTFT         {:.1} ms", ttft * 1e3);
        println!("TPOT         {:.2} ms", tpot * 1e3);
        println!(
            "output       {:.0} tokens/s",
            e.output_tokens_per_s.unwrap_or(0.0)
        );
        println!(
            "KV capacity  {:.3e} tokens, max concurrency {}",
            e.kv_capacity_tokens.unwrap_or(0.0),
            e.max_concurrency.unwrap_or(0)
        );
    } else {
        println!(
            "step time    {:.3} s ({} micro-batches)",
            e.step_time_s, e.microbatches
        );
        println!("throughput   {:.0} tokens/s", e.tokens_per_s);
        println!(
            "per GPU      {:.1} model TFLOP/s (MFU {:.1}%), {:.1} hardware TFLOP/s (HFU {:.1}%)",
            e.model_tflops_per_gpu,
            100.0 * e.mfu,
            e.hardware_tflops_per_gpu,
            100.0 * e.hfu
        );
        let t = &e.time_breakdown_s;
        println!(
            "time         compute {:.3} s, exposed comm {:.3} s, bubble {:.3} s ({:.1}%)",
            t.compute,
            t.exposed_comm,
            t.bubble,
            100.0 * e.bubble_fraction
        );
        let c = &e.comm_bytes_per_gpu;
        println!(
            "sent/GPU     dp {:.2} GB, tp {:.2} GB, pp {:.2} GB, cp {:.2} GB, ep {:.2} GB",
            c.dp / 1e9,
            c.tp / 1e9,
            c.pp / 1e9,
            c.cp / 1e9,
            c.ep / 1e9
        );
    }
    println!(
        "memory of the fullest GPU (capacity {:.1} GiB):",
        gib(e.memory_capacity_bytes)
    );
    println!("{}", ledger_lines(&e.memory_per_gpu_bytes));
    println!("feasible     {}", e.feasible);
}
