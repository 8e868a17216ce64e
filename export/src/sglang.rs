//! SGLang `launch_server` flags for an inference plan: tensor, pipeline, data and
//! expert degrees, DP-attention, context length and concurrency.
//!
//! One SGLang server spans `--tp-size` GPUs (times `--pp-size`). Its experts live
//! inside it: MoE tensor parallelism is `--tp-size / --ep-size`, so `--ep-size`
//! must divide `--tp-size`. Attention is data-parallel inside a server with
//! `--attn-dp-size N` (N attention groups of `--tp-size / N` GPUs), while
//! `--dp-size N` starts N independent replicas, each holding every expert. A plan whose experts span its
//! data-parallel replicas (ep > tp) is therefore one wider server per `ep / tp`
//! replicas, with attention data-parallel inside it.

use crate::{serve_dtype, serve_shape, ArgList, Launch, Refusals, Target};
use meshplan_ir::plan::Plan;

/// The environment variable the multi-node launch lines read the first node's
/// address from.
pub(crate) const DIST_INIT_ADDR_VAR: &str = "SGLANG_DIST_INIT_ADDR";

pub(crate) fn export(plan: &Plan) -> Result<String, crate::CannotExpress> {
    let (context, _) = serve_shape(plan);
    let Launch {
        mut args,
        servers,
        gpus,
        nodes,
        ..
    } = launch(plan, context)?;
    let c = &plan.strategy;
    if servers > 1 {
        args.comment(format!(
            "run {servers} copies of this server ({} GPUs each, the plan's {} data-parallel replicas) behind sglang_router; --max-running-requests is one server's share",
            gpus,
            c.dp
        ));
    }
    if nodes > 1 {
        args.comment(format!(
            "one server on {nodes} nodes: set {DIST_INIT_ADDR_VAR}=HOST:PORT (node 0's address and a free port, the same on every node) and run on node i (0..{}):",
            nodes - 1
        ));
        for i in 0..nodes {
            args.comment(format!(
                "node {i}: python -m sglang.launch_server --model-path MODEL $(grep -v '^#' THIS_FILE) --node-rank {i} --dist-init-addr ${DIST_INIT_ADDR_VAR}"
            ));
        }
    } else {
        args.comment("python -m sglang.launch_server --model-path MODEL $(grep -v '^#' THIS_FILE)");
    }
    Ok(args.render())
}

/// The server the plan's strategy makes, with requests up to `context` tokens: its
/// options, and how many copies of it on how many GPUs and nodes. A serving pool
/// (`meshplan deploy`) goes through here with its own plan.
pub(crate) fn launch(plan: &Plan, context: u64) -> Result<Launch, crate::CannotExpress> {
    let mut r = Refusals::new(Target::Sglang);
    let c = &plan.strategy;
    let (_, concurrency) = serve_shape(plan);
    if c.cp > 1 {
        r.push(format!(
            "cp={}: SGLang's decode context parallelism (--dcp-size) splits the KV cache, not the prompt's sequence as the plan's ring does; re-plan with --config cp=1",
            c.cp
        ));
    }
    // The server's width: the tensor group, or the expert group when the experts
    // span several data-parallel replicas.
    let width = if c.ep <= 1 || c.tp.is_multiple_of(c.ep) {
        Some(c.tp)
    } else if c.ep.is_multiple_of(c.tp) && c.dp.is_multiple_of(c.ep / c.tp) {
        Some(c.ep)
    } else {
        r.push(format!(
            "ep={} over dp={} replicas of tp={}: an SGLang server holds every expert inside its --tp-size GPUs (--ep-size must divide --tp-size), so the experts can span replicas only as a server of --tp-size ep made of ep/tp whole replicas with data-parallel attention, which needs ep to be a multiple of tp ({}) and ep/tp to divide dp; re-plan with --config ep={} (inside each replica) or an ep that is tp times a divisor of dp",
            c.ep,
            c.dp,
            c.tp,
            c.tp,
            meshplan_ir::config::gcd(c.tp, c.ep)
        ));
        None
    };
    let dtype = serve_dtype(plan.model.dtype);
    if dtype.is_none() {
        r.push(format!(
            "the plan computes in {:?}; the exported flags cover bfloat16, float16 and float32 weights",
            plan.model.dtype
        ));
    }
    r.check()?;
    let width = width.unwrap_or(c.tp);

    // Attention: tensor-parallel over tp GPUs, or over one GPU with DP-attention.
    let attn_tp = if c.dp_attention { 1 } else { c.tp };
    let attn_dp = width / attn_tp;
    // Servers to start: with attention data-parallel inside a server, the plan's
    // replicas beyond one server are separate servers; plain replicas are one
    // launch (--dp-size) while they fit on one node, separate servers beyond it.
    let replicas_in_one =
        attn_dp == 1 && c.dp > 1 && c.tp * c.pp * c.dp <= plan.cluster.gpus_per_node;
    let servers = if attn_dp > 1 {
        c.dp * c.tp / width
    } else if replicas_in_one {
        1
    } else {
        c.dp
    };
    // SGLang's --max-running-requests is per --dp-size replica, and a server's total
    // over its attention data-parallel groups (each takes max_running_requests //
    // attn_dp_size): one attention group's share of the plan's concurrency, times
    // the groups of one server.
    let attention_groups = c.dp * c.tp / attn_tp;
    let share = concurrency.div_ceil(attention_groups);
    let max_running = share * attn_dp;
    let gpus = width * c.pp * if replicas_in_one { c.dp } else { 1 };
    let nodes = gpus.div_ceil(plan.cluster.gpus_per_node);

    let mut a = ArgList::new(plan, Target::Sglang);
    a.opt("--tp-size", width);
    if c.pp > 1 {
        a.opt("--pp-size", c.pp);
    }
    if attn_dp > 1 {
        // DP-attention: the attention groups inside the server (SGLang 0.5.23's
        // spelling of the deprecated `--dp-size N --enable-dp-attention`).
        a.opt("--attn-dp-size", attn_dp);
    } else if replicas_in_one {
        a.opt("--dp-size", c.dp);
    }
    if c.ep > 1 {
        a.opt("--ep-size", c.ep);
    }
    if nodes > 1 {
        a.opt("--nnodes", nodes);
    }
    if let Some(d) = dtype {
        a.opt("--dtype", d);
    }
    a.opt("--context-length", context);
    a.opt("--max-running-requests", max_running);
    Ok(Launch {
        args: a,
        servers,
        gpus,
        nodes,
        replicas: c.dp / servers,
    })
}
