//! torchtitan's job config: FSDP or DDP for the data axis, TP (always with
//! sequence parallelism), PP with PyTorch's schedule names, CP, EP.
//!
//! Two spellings: the TOML file (`[training]`, `[parallelism]`,
//! `[activation_checkpoint]`) that torchtitan up to 0.2 reads with
//! `--job.config_file`, and the command-line overrides torchtitan 0.3 takes after
//! `--module M --config C` (it reads no TOML: a config is a Python function of its
//! `config_registry`, and `--section.key value` flags override its fields).

use crate::{
    batch_refusal, even_split, gib, predicted, provenance, train_shape, ArgList, Refusals, Target,
};
use meshplan_ir::plan::Plan;
use meshplan_ir::{DType, Recompute, Schedule};
use std::fmt::Write;

pub(crate) fn export(plan: &Plan, target: Target) -> Result<String, crate::CannotExpress> {
    let mut r = Refusals::new(target);
    let c = &plan.strategy;
    let (seq, global_batch) = train_shape(plan);
    let layers = plan.model.layers;
    if c.zero == 1 {
        let opt = predicted(plan, &["memory_per_gpu_bytes", "optimizer"]).unwrap_or(0.0);
        // The rank's parameters, from its compute copy (whole below ZeRO-3): AdamW's
        // two fp32 moments and, below fp32, fp32 masters, unsharded under DDP.
        let bpe = plan.model.dtype.size_bytes() as f64;
        let params = predicted(plan, &["memory_per_gpu_bytes", "params"]).unwrap_or(0.0) / bpe;
        let unsharded = params * if bpe < 4.0 { 12.0 } else { 8.0 };
        r.push(format!(
            "torchtitan has no ZeRO-1: its data axis is DDP (the optimizer state unsharded, up to {:.1} GiB per GPU instead of the plan's {:.1} GiB) or FSDP (gradients sharded too, plus parameter all-gathers the plan did not price); re-plan with --config zero=0, zero=2 or zero=3",
            gib(unsharded),
            gib(opt)
        ));
    }
    if c.tp > 1 && !c.sp {
        r.push(format!(
            "torchtitan's tensor parallelism always shards the sequence between blocks (sequence parallelism); the plan's tp={} without sp would run with it (same bytes, different collectives and less activation memory than priced); re-plan with --config sp=true",
            c.tp
        ));
    }
    if c.dp_attention {
        r.push("dp_attention is an inference layout; a training plan should not have it");
    }
    if c.pp > 1 && !even_split(plan) {
        r.push(format!(
            "the plan splits layers {:?}; the exported pipeline_parallel_layers_per_stage gives every stage the same count, which would move the slowest stage's time; re-plan with layers divisible by pp x vpp",
            plan.layer_split
        ));
    }
    if c.pp > 1 && !layers.is_multiple_of(c.pp * c.vpp) {
        r.push(format!(
            "pipeline_parallel_layers_per_stage needs the {layers} layers to divide into pp({}) x vpp({}) stages",
            c.pp, c.vpp
        ));
    }
    let local = global_batch.div_ceil(c.dp);
    if let Some(why) = batch_refusal(plan, "torchtitan", global_batch) {
        r.push(why);
    }
    // recompute=selective is not refused: torchtitan's op-level selective
    // checkpointing keeps matmul outputs and recomputes the cheap ops, the same trade.
    match plan.model.dtype {
        DType::Bf16 | DType::F32 => {}
        d => r.push(format!(
            "the plan computes in {d:?}; torchtitan's mixed precision is bfloat16 or float32"
        )),
    }
    r.check()?;
    if target == Target::TorchtitanCli {
        return Ok(cli(plan, global_batch, seq, local));
    }

    let mut s = String::new();
    let _ = writeln!(s, "# {}", provenance(plan, Target::Torchtitan));
    let _ = writeln!(
        s,
        "# torchrun --nnodes {} --nproc-per-node {} -m torchtitan.train --job.config_file THIS_FILE; choose [model] name and flavor for {}",
        plan.cluster.nodes, plan.cluster.gpus_per_node, plan.model.name
    );
    s.push('\n');
    s.push_str("[training]\n");
    // Without a pipeline, local_batch_size is one micro-batch and the global batch
    // sets the accumulation; with one, local_batch_size is what the schedule splits
    // into pipeline_parallel_microbatch_size pieces.
    let local_batch = if c.pp > 1 { local } else { c.mbs };
    let _ = writeln!(s, "local_batch_size = {local_batch}");
    let _ = writeln!(s, "global_batch_size = {global_batch}");
    let _ = writeln!(s, "seq_len = {seq}");
    if plan.model.dtype == DType::Bf16 {
        let _ = writeln!(s, "mixed_precision_param = \"bfloat16\"");
    } else {
        let _ = writeln!(s, "mixed_precision_param = \"float32\"");
    }
    s.push('\n');
    s.push_str("[parallelism]\n");
    let (replicate, shard) = if c.zero >= 2 { (1, c.dp) } else { (c.dp, 1) };
    let _ = writeln!(s, "data_parallel_replicate_degree = {replicate}");
    let _ = writeln!(s, "data_parallel_shard_degree = {shard}");
    if c.zero >= 2 {
        // ZeRO-2 keeps the gathered parameters from forward to backward; ZeRO-3
        // gathers them again.
        let policy = if c.zero == 2 { "never" } else { "always" };
        let _ = writeln!(s, "fsdp_reshard_after_forward = \"{policy}\"");
    }
    let _ = writeln!(s, "tensor_parallel_degree = {}", c.tp);
    if c.tp_overlap {
        let _ = writeln!(s, "enable_async_tensor_parallel = true");
    }
    let _ = writeln!(s, "pipeline_parallel_degree = {}", c.pp);
    if c.pp > 1 {
        let schedule = schedule_name(c.schedule);
        let _ = writeln!(s, "pipeline_parallel_schedule = \"{schedule}\"");
        let _ = writeln!(
            s,
            "pipeline_parallel_layers_per_stage = {}",
            layers / (c.pp * c.vpp)
        );
        // The defaults (1) count the embedding and the output layer as a block each
        // and would add a stage; the plan's split holds block layers only.
        let _ = writeln!(s, "pipeline_parallel_first_stage_less_layers = 0");
        let _ = writeln!(s, "pipeline_parallel_last_stage_less_layers = 0");
        let _ = writeln!(s, "pipeline_parallel_microbatch_size = {}", c.mbs);
    }
    let _ = writeln!(s, "context_parallel_degree = {}", c.cp);
    let _ = writeln!(s, "expert_parallel_degree = {}", c.ep);
    s.push('\n');
    s.push_str("[activation_checkpoint]\n");
    match c.recompute {
        Recompute::None => {
            let _ = writeln!(s, "mode = \"none\"");
        }
        Recompute::Selective => {
            let _ = writeln!(s, "mode = \"selective\"");
            let _ = writeln!(s, "selective_ac_option = \"op\"");
        }
        Recompute::Full => {
            let _ = writeln!(s, "mode = \"full\"");
        }
    }
    if c.tp_overlap {
        s.push('\n');
        s.push_str("[compile]\n");
        // Async tensor parallelism is a compiler pass.
        let _ = writeln!(s, "enable = true");
    }
    Ok(s)
}

/// torchtitan 0.3's command-line overrides: every field the plan decides, set
/// explicitly (a config function's own defaults, e.g. tensor_parallel_degree = 8 in
/// `llama3_70b`, must not survive), and the activation-checkpointing mode as the
/// `activation_checkpoint:MODE` subcommand, last.
fn cli(plan: &Plan, global_batch: u64, seq: u64, local: u64) -> String {
    let c = &plan.strategy;
    let layers = plan.model.layers;
    let mut a = ArgList::new(plan, Target::TorchtitanCli);
    a.comment(format!(
        "torchrun --nnodes {} --nproc-per-node {} -m torchtitan.train --module MODULE --config CONFIG $(grep -v '^#' THIS_FILE)",
        plan.cluster.nodes, plan.cluster.gpus_per_node
    ));
    a.comment(format!(
        "torchtitan 0.3: MODULE and CONFIG name the config_registry function for {} (e.g. --module llama3 --config llama3_8b); these flags override its fields",
        plan.model.name
    ));
    let local_batch = if c.pp > 1 { local } else { c.mbs };
    a.opt("--training.local_batch_size", local_batch);
    a.opt("--training.global_batch_size", global_batch);
    a.opt("--training.seq_len", seq);
    a.opt(
        "--training.mixed_precision_param",
        if plan.model.dtype == DType::Bf16 {
            "bfloat16"
        } else {
            "float32"
        },
    );
    if c.pp > 1 || c.ep > 1 {
        // torchtitan 0.3 validates that CUDA graphs (its default) are off under
        // pipeline parallelism and under expert parallelism with a token
        // dispatcher that synchronizes with the CPU (the default ones do).
        a.flag("--training.disable_cuda_graphs");
    }
    let (replicate, shard) = if c.zero >= 2 { (1, c.dp) } else { (c.dp, 1) };
    a.opt("--parallelism.data_parallel_replicate_degree", replicate);
    a.opt("--parallelism.data_parallel_shard_degree", shard);
    if c.zero >= 2 {
        let policy = if c.zero == 2 { "never" } else { "always" };
        a.opt("--parallelism.fsdp_reshard_after_forward", policy);
    }
    a.opt("--parallelism.tensor_parallel_degree", c.tp);
    if c.tp > 1 {
        a.flag("--parallelism.enable_sequence_parallel");
    }
    a.opt("--parallelism.pipeline_parallel_degree", c.pp);
    if c.pp > 1 {
        a.opt(
            "--parallelism.pipeline_parallel_schedule",
            schedule_name(c.schedule),
        );
        a.opt(
            "--parallelism.pipeline_parallel_layers_per_stage",
            layers / (c.pp * c.vpp),
        );
        a.opt("--parallelism.pipeline_parallel_first_stage_less_layers", 0);
        a.opt("--parallelism.pipeline_parallel_last_stage_less_layers", 0);
        a.opt("--parallelism.pipeline_parallel_microbatch_size", c.mbs);
    }
    a.opt("--parallelism.context_parallel_degree", c.cp);
    a.opt("--parallelism.expert_parallel_degree", c.ep);
    if c.tp_overlap {
        // Async tensor parallelism is a compiler pass over the model.
        a.flag("--compile.enable");
        a.opt("--compile.components", "model,loss");
        a.flag("--compile.enable_async_tensor_parallel");
    } else {
        a.flag("--compile.no-enable-async-tensor-parallel");
    }
    // A subcommand, not an option: the last word on the line.
    a.word(match c.recompute {
        Recompute::None => "activation_checkpoint:none",
        Recompute::Selective => "activation_checkpoint:selective",
        Recompute::Full => "activation_checkpoint:full",
    });
    a.render()
}

fn schedule_name(s: Schedule) -> &'static str {
    match s {
        Schedule::Gpipe => "GPipe",
        Schedule::OneFOneB => "1F1B",
        Schedule::Interleaved => "Interleaved1F1B",
    }
}
