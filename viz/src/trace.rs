//! The predicted schedule as a Chrome trace, in the executor's layout: one process
//! per pipeline stage, one thread per rank, spans named `fwd mb3 c0` / `bwd mb3 c0`
//! with the categories `compute`, `comm`, `p2p`, `bubble`, `optimizer`.
//!
//! Every rank of a stage runs the same program at the same predicted times, so the
//! trace holds one rank per stage (its first: all other coordinates 0), named as
//! such. Sends overlap the compute, so they go on a second thread of that rank
//! (`tid = world + rank`), keeping every thread's spans nested.

use meshplan_cost_model::{Lane, Timeline};
use meshplan_ir::trace::Trace;

/// The predicted trace of `tl` (validated) for a mesh of `world` ranks, `pp` stages of
/// `world / pp` consecutive ranks.
pub fn predicted_trace(tl: &Timeline, world: u64) -> Trace {
    let pp = tl.pp() as u64;
    let per_stage = (world / pp.max(1)).max(1);
    let mut t = Trace::new();
    for s in 0..pp {
        let rank = s * per_stage;
        t.name_process(s, &format!("stage {s} (predicted)"));
        let alike = if per_stage > 1 {
            format!(" (and {} more ranks alike)", per_stage - 1)
        } else {
            String::new()
        };
        t.name_thread(s, rank, &format!("rank {rank}{alike}"));
        t.name_thread(s, world + rank, &format!("rank {rank} sends"));
    }
    for sp in tl.spans() {
        let rank = sp.stage as u64 * per_stage;
        let tid = match sp.lane {
            Lane::Compute => rank,
            Lane::P2p => world + rank,
        };
        let mut args = serde_json::Map::new();
        if let Some(mb) = sp.mb {
            args.insert("mb".into(), mb.into());
            args.insert("chunk".into(), sp.chunk.into());
        }
        if sp.comm_s > 0.0 {
            args.insert("comm_us".into(), (sp.comm_s * 1e6).into());
        }
        t.span(
            sp.name(),
            sp.kind.category(),
            sp.stage as u64,
            tid,
            sp.start_s,
            sp.dur_s(),
            if args.is_empty() {
                serde_json::Value::Null
            } else {
                serde_json::Value::Object(args)
            },
        );
    }
    t
}
