//! Measured timelines: each rank records spans (schedule tasks, ops, collectives,
//! point-to-point transfers, the optimizer step) when tracing is on, and
//! [`chrome_trace`] lays them out in the Chrome trace format the planner's predicted
//! schedule uses too: one process per pipeline stage, one thread per rank.

use meshplan_ir::plan::Plan;
use meshplan_ir::trace::Trace;

/// One measured span of a rank.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// What ran, e.g. `fwd mb3 c0`, `block.attn.qkv`, `AllReduce tp`.
    pub name: String,
    /// One of [`CATEGORIES`].
    pub cat: &'static str,
    /// Seconds since the run's start.
    pub start_s: f64,
    /// Seconds.
    pub dur_s: f64,
    /// Details: step, layer, bytes, axis.
    pub args: serde_json::Value,
}

/// Every span category: a span read back from another process takes its own.
pub const CATEGORIES: [&str; 5] = ["task", "compute", "comm", "p2p", "optimizer"];

/// The measured spans of every rank (`spans[i]` of `ranks[i]`) as a Chrome trace:
/// a process per pipeline stage, a thread per rank.
pub fn chrome_trace(plan: &Plan, spans: &[(usize, Vec<Span>)]) -> Trace {
    let mut t = Trace::new();
    let pp_axis = plan.mesh.axes.iter().position(|a| a == "pp");
    let stage_of = |rank: usize| -> u64 {
        plan.ranks
            .get(rank)
            .and_then(|r| pp_axis.and_then(|i| r.coords.get(i).copied()))
            .unwrap_or(0)
    };
    let mut stages: Vec<u64> = spans.iter().map(|(r, _)| stage_of(*r)).collect();
    stages.sort_unstable();
    stages.dedup();
    for s in stages {
        t.name_process(s, &format!("stage {s}"));
    }
    for (rank, list) in spans {
        let pid = stage_of(*rank);
        t.name_thread(pid, *rank as u64, &format!("rank {rank}"));
        for sp in list {
            t.span(
                sp.name.clone(),
                sp.cat,
                pid,
                *rank as u64,
                sp.start_s,
                sp.dur_s,
                sp.args.clone(),
            );
        }
    }
    t
}
