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
    // An SGLang server's expert group lives inside its own tensor ranks (MoE tensor
    // parallelism is --tp-size / --ep-size), and --dp-size replicas are independent
    // servers, each holding every expert: the plan's experts must not span replicas.
    if c.ep > 1 && !c.tp.is_multiple_of(c.ep) {
        let inside = gcd(c.tp, c.ep);
        r.push(format!(
            "ep={} spans the ranks of {} data-parallel replicas (dp={}, tp={}), but SGLang's --ep-size must divide one server's --tp-size ({}), each --dp-size replica holding every expert; re-plan with an ep that divides tp (--config ep={inside}) or a tp that is a multiple of ep (e.g. --config tp={},ep={})",
            c.ep,
            (c.ep / inside).min(c.dp),
            c.dp,
            c.tp,
            c.tp,
            c.ep,
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

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
