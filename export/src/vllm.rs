//! `vllm serve` flags for an inference plan: tensor, pipeline and data degrees,
//! expert parallelism, context length and concurrency.

use crate::{serve_dtype, serve_shape, ArgList, Launch, Refusals, Target};
use meshplan_ir::plan::Plan;

pub(crate) fn export(plan: &Plan) -> Result<String, crate::CannotExpress> {
    let (context, _) = serve_shape(plan);
    let mut a = launch(plan, context, plan.strategy.dp)?.args;
    a.comment("vllm serve MODEL $(grep -v '^#' THIS_FILE)");
    Ok(a.render())
}

/// The servers the plan's strategy makes, each running `replicas` of its
/// data-parallel replicas (all of them for a plain export), with requests up to
/// `context` tokens. A serving pool (`meshplan deploy`) goes through here with its
/// own plan.
pub(crate) fn launch(
    plan: &Plan,
    context: u64,
    replicas: u64,
) -> Result<Launch, crate::CannotExpress> {
    let mut r = Refusals::new(Target::Vllm);
    let c = &plan.strategy;
    let (_, concurrency) = serve_shape(plan);
    if c.cp > 1 {
        r.push(format!(
            "cp={}: vLLM's decode context parallelism splits the KV cache, not the prompt's sequence as the plan's ring does; re-plan with --config cp=1",
            c.cp
        ));
    }
    if c.dp_attention {
        r.push(format!(
            "dp_attention inside tp={}: vLLM's attention is data-parallel only across --data-parallel-size replicas, each with its own tensor group; run as tp={} without it, each GPU would hold 1/{} of the KV heads instead of whole heads for its own requests; re-plan with --config dp_attention=false, or export --to sglang",
            c.tp, c.tp, c.tp
        ));
    }
    // vLLM's expert group is every data and tensor rank of a server together.
    if c.ep > 1 && c.ep != replicas * c.tp {
        r.push(format!(
            "ep={}: vLLM's --enable-expert-parallel spreads experts over all data x tensor ranks ({} x {} = {}); re-plan with --config ep={} or ep=1",
            c.ep,
            replicas,
            c.tp,
            replicas * c.tp,
            replicas * c.tp
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

    let mut a = ArgList::new(plan, Target::Vllm);
    a.opt("--tensor-parallel-size", c.tp);
    if c.pp > 1 {
        a.opt("--pipeline-parallel-size", c.pp);
    }
    if replicas > 1 {
        a.opt("--data-parallel-size", replicas);
    }
    if c.ep > 1 {
        a.flag("--enable-expert-parallel");
    }
    if let Some(d) = dtype {
        a.opt("--dtype", d);
    }
    a.opt("--max-model-len", context);
    // Each data-parallel engine schedules its own share of the requests.
    a.opt("--max-num-seqs", concurrency.div_ceil(c.dp));
    let gpus = replicas * c.tp * c.pp;
    Ok(Launch {
        args: a,
        servers: c.dp / replicas,
        gpus,
        nodes: gpus.div_ceil(plan.cluster.gpus_per_node),
        replicas,
    })
}
