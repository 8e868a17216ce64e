//! A DeepSpeed JSON config: ZeRO data parallelism, micro-batch, gradient
//! accumulation, precision. Plain DeepSpeed has no tensor, pipeline, context or
//! expert split of a model it did not write (those need Megatron-DeepSpeed, whose
//! arguments are `--to megatron`'s), so those plans are refused.

use crate::{batch_refusal, gib, predicted, train_shape, Refusals, Target};
use meshplan_ir::plan::Plan;
use meshplan_ir::{DType, Recompute};
use serde_json::{json, Map, Value};

pub(crate) fn export(plan: &Plan) -> Result<String, crate::CannotExpress> {
    let mut r = Refusals::new(Target::Deepspeed);
    let c = &plan.strategy;
    let (_, global_batch) = train_shape(plan);
    for (name, degree) in [("tp", c.tp), ("pp", c.pp), ("cp", c.cp), ("ep", c.ep)] {
        if degree > 1 {
            r.push(format!(
                "{name}={degree}: a DeepSpeed config alone splits a model only over data-parallel ranks (ZeRO); {name} needs Megatron-DeepSpeed (use --to megatron for its arguments), or re-plan with --config {name}=1"
            ));
        }
    }
    if c.recompute == Recompute::Selective {
        let act = predicted(plan, &["memory_per_gpu_bytes", "activations"]).unwrap_or(0.0);
        r.push(format!(
            "recompute=selective (attention core only) has no DeepSpeed switch: DeepSpeed's activation checkpointing recomputes whole layers (recompute=full, about a third more compute), and none keeps every activation (more than the {:.1} GiB predicted); re-plan with --config recompute=full or recompute=none",
            gib(act)
        ));
    }
    let per_step = c.mbs * c.dp;
    if let Some(why) = batch_refusal(
        plan,
        "DeepSpeed (train_batch_size = micro-batch x accumulation x data-parallel size)",
        global_batch,
    ) {
        r.push(why);
    }
    if c.tp_overlap {
        r.push("tp_overlap: there is no tensor axis to overlap under plain DeepSpeed");
    }
    match plan.model.dtype {
        DType::Bf16 | DType::F16 | DType::F32 => {}
        d => r.push(format!(
            "the plan computes in {d:?}; the exported config covers bf16, fp16 and fp32"
        )),
    }
    r.check()?;

    let mut cfg = Map::new();
    cfg.insert("train_batch_size".into(), json!(global_batch));
    cfg.insert("train_micro_batch_size_per_gpu".into(), json!(c.mbs));
    cfg.insert(
        "gradient_accumulation_steps".into(),
        json!(global_batch / per_step),
    );
    match plan.model.dtype {
        DType::Bf16 => {
            cfg.insert("bf16".into(), json!({ "enabled": true }));
        }
        DType::F16 => {
            cfg.insert("fp16".into(), json!({ "enabled": true }));
        }
        _ => {}
    }
    cfg.insert("zero_optimization".into(), json!({ "stage": c.zero }));
    if c.recompute == Recompute::Full {
        // These settle how DeepSpeed's checkpoint() behaves; the model's layers must
        // call deepspeed.checkpointing.checkpoint for the recomputation to happen.
        cfg.insert(
            "activation_checkpointing".into(),
            json!({
                "partition_activations": false,
                "cpu_checkpointing": false,
                "contiguous_memory_optimization": false,
                "number_checkpoints": plan.model.layers,
            }),
        );
    }
    let text = serde_json::to_string_pretty(&Value::Object(cfg)).unwrap_or_default();
    Ok(text + "\n")
}
