//! `vllm serve` flags for an inference plan: tensor, pipeline and data degrees,
//! expert parallelism, context length and concurrency.

use crate::{serve_dtype, serve_shape, ArgList, Refusals, Target};
use meshplan_ir::plan::Plan;

pub(crate) fn export(plan: &Plan) -> Result<String, crate::CannotExpress> {
    let mut r = Refusals::new(Target::Vllm);
    let c = &plan.strategy;
    let (context, concurrency) = serve_shape(plan);
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
    // vLLM's expert group is every data and tensor rank together.
    if c.ep > 1 && c.ep != c.dp * c.tp {
        r.push(format!(
            "ep={}: vLLM's --enable-expert-parallel spreads experts over all data x tensor ranks ({} x {} = {}); re-plan with --config ep={} or ep=1",
            c.ep,
            c.dp,
            c.tp,
            c.dp * c.tp,
            c.dp * c.tp
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
    a.comment("vllm serve MODEL $(grep -v '^#' THIS_FILE)");
    a.opt("--tensor-parallel-size", c.tp);
    if c.pp > 1 {
        a.opt("--pipeline-parallel-size", c.pp);
    }
    if c.dp > 1 {
        a.opt("--data-parallel-size", c.dp);
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
    Ok(a.render())
}
