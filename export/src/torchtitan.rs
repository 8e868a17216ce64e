//! torchtitan's TOML job config (`[training]`, `[parallelism]`,
//! `[activation_checkpoint]`): FSDP or DDP for the data axis, TP (always with
//! sequence parallelism), PP with PyTorch's schedule names, CP, EP.

use crate::{batch_refusal, even_split, gib, predicted, provenance, train_shape, Refusals, Target};
use meshplan_ir::plan::Plan;
use meshplan_ir::{DType, Recompute, Schedule};
use std::fmt::Write;

pub(crate) fn export(plan: &Plan) -> Result<String, crate::CannotExpress> {
    let mut r = Refusals::new(Target::Torchtitan);
    let c = &plan.strategy;
    let (seq, global_batch) = train_shape(plan);
    let layers = plan.model.layers;
    if c.zero == 1 {
        let opt = predicted(plan, &["memory_per_gpu_bytes", "optimizer"]).unwrap_or(0.0);
        r.push(format!(
            "torchtitan has no ZeRO-1: its data axis is DDP (the optimizer state unsharded, up to {:.1} GiB per GPU instead of the plan's {:.1} GiB) or FSDP (gradients sharded too, plus parameter all-gathers the plan did not price); re-plan with --config zero=0, zero=2 or zero=3",
            gib(opt) * (c.dp * c.cp) as f64,
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
        let schedule = match c.schedule {
            Schedule::Gpipe => "GPipe",
            Schedule::OneFOneB => "1F1B",
            Schedule::Interleaved => "Interleaved1F1B",
        };
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
