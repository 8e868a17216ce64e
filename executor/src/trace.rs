//! Measured timelines: each rank records spans (schedule tasks, ops, collectives,
//! point-to-point transfers, the optimizer step) when tracing is on, and
//! [`chrome_trace`] lays them out in the Chrome trace format the planner's predicted
//! schedule uses too: one process per pipeline stage, one thread per rank.

use meshplan_ir::plan::{Instr, Plan};
use meshplan_ir::trace::Trace;
use std::time::Instant;

/// One measured span of a rank.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// What ran, e.g. `fwd mb3 c0`, `block.attn.qkv`, `AllReduce tp`.
    pub name: String,
    /// `task`, `compute`, `comm`, `p2p` or `optimizer`.
    pub cat: &'static str,
    /// Seconds since the run's start.
    pub start_s: f64,
    /// Seconds.
    pub dur_s: f64,
    /// Details: step, layer, bytes, axis.
    pub args: serde_json::Value,
}

/// A rank's recorder; does nothing when off.
#[derive(Debug)]
pub struct Tracer {
    t0: Instant,
    on: bool,
    /// Spans recorded so far.
    pub spans: Vec<Span>,
}

impl Tracer {
    /// A recorder timing from `t0` (shared by every rank of a run).
    pub fn new(t0: Instant, on: bool) -> Self {
        Tracer {
            t0,
            on,
            spans: Vec::new(),
        }
    }

    /// The start of a span, if tracing.
    pub fn begin(&self) -> Option<Instant> {
        self.on.then(Instant::now)
    }

    /// Records a span begun at `started`.
    pub fn end(
        &mut self,
        started: Option<Instant>,
        name: impl Into<String>,
        cat: &'static str,
        args: serde_json::Value,
    ) {
        if let Some(t) = started {
            self.spans.push(Span {
                name: name.into(),
                cat,
                start_s: t.duration_since(self.t0).as_secs_f64(),
                dur_s: t.elapsed().as_secs_f64(),
                args,
            });
        }
    }

    /// Records the span of one leaf instruction of a program (segments and
    /// recomputation wrappers are not spans: their contents are).
    pub fn end_instr(&mut self, started: Option<Instant>, instr: &Instr, step: u64, layer: u64) {
        if started.is_none() {
            return;
        }
        let layer = (layer != u64::MAX).then_some(layer);
        let (name, cat, args) = match instr {
            Instr::Compute { name, kind, .. } => (
                name.clone(),
                "compute",
                serde_json::json!({"step": step, "layer": layer, "kind": kind}),
            ),
            Instr::Collective {
                kind,
                axis,
                target,
                bytes_sent,
                ..
            } => (
                format!("{kind:?} {}", axis.name()),
                "comm",
                serde_json::json!({"step": step, "layer": layer, "tensor": target.to_string(), "axis": axis.name(), "bytes_sent": bytes_sent}),
            ),
            Instr::Send {
                peer_stage, bytes, ..
            } => (
                format!("send to stage {peer_stage}"),
                "p2p",
                serde_json::json!({"step": step, "bytes": bytes}),
            ),
            Instr::Recv {
                peer_stage, bytes, ..
            } => (
                format!("recv from stage {peer_stage}"),
                "p2p",
                serde_json::json!({"step": step, "bytes": bytes}),
            ),
            Instr::Optimizer { name, .. } => {
                (name.clone(), "optimizer", serde_json::json!({"step": step}))
            }
            Instr::Segment { .. } | Instr::Recompute { .. } | Instr::RingPass { .. } => return,
        };
        self.end(started, name, cat, args);
    }
}

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
