//! SGLang `launch_server` flags for an inference plan: tensor, pipeline, data and
//! expert degrees, DP-attention, context length and concurrency.

use crate::{serve_dtype, serve_shape, ArgList, Refusals, Target};
use meshplan_ir::plan::Plan;

pub(crate) fn export(plan: &Plan) -> Result<String, crate::CannotExpress> {
    let mut r = Refusals::new(Target::Sglang);
    let c = &plan.strategy;
    let (context, concurrency) = serve_shape(plan);
    if c.cp > 1 {
        r.push(format!(
            "cp={}: SGLang's decode context parallelism (--dcp-size) splits the KV cache, not the prompt's sequence as the plan's ring does; re-plan with --config cp=1",
            c.cp
        ));
    }
    // An SGLang server's expert group lives inside one replica's tensor ranks.
    let instance_ranks = if c.dp_attention { c.tp } else { c.tp * c.dp };
    if c.ep > 1 && !instance_ranks.is_multiple_of(c.ep) {
        r.push(format!(
            "ep={} spans ranks of several replicas; SGLang's --ep-size must divide one server's --tp-size ({instance_ranks})",
            c.ep
        ));
    }
    let dtype = serve_dtype(plan.model.dtype);
    if dtype.is_none() {
        r.push(format!(
            "the plan computes in {:?}; the exported flags cover bfloat16, float16 and float32 weights",
            plan.model.dtype
        ));
    }
    r.check()?;

    let mut a = ArgList::new(plan, Target::Sglang);
    if c.dp_attention && c.dp > 1 {
        a.comment(format!(
            "run {} copies of this server (one per data-parallel replica, {} GPUs each) behind sglang_router",
            c.dp,
            c.tp * c.pp
        ));
    }
    a.comment("python -m sglang.launch_server --model-path MODEL $(grep -v '^#' THIS_FILE)");
    a.opt("--tp-size", c.tp);
    if c.pp > 1 {
        a.opt("--pp-size", c.pp);
    }
    if c.dp_attention {
        // DP-attention: attention runs data-parallel over the tensor ranks, whose
        // count SGLang takes as --dp-size.
        a.opt("--dp-size", c.tp);
        a.flag("--enable-dp-attention");
    } else if c.dp > 1 {
        a.opt("--dp-size", c.dp);
    }
    if c.ep > 1 {
        a.opt("--ep-size", c.ep);
    }
    let gpus = if c.dp_attention {
        c.tp * c.pp
    } else {
        c.world_size()
    };
    let nodes = gpus.div_ceil(plan.cluster.gpus_per_node);
    if nodes > 1 {
        a.opt("--nnodes", nodes);
    }
    if let Some(d) = dtype {
        a.opt("--dtype", d);
    }
    a.opt("--context-length", context);
    a.opt("--max-running-requests", concurrency);
    Ok(a.render())
}
