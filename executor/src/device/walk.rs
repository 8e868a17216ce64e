//! The walk over a forward instruction list, one for training's micro-batches,
//! inference's passes and an idle expert rank's turn: segment copies and the
//! block layer each runs as, recomputation, stage boundaries and collectives.
//! What an instruction does is the walker's; the order and the layer numbering
//! are written here once.

use meshplan_ir::plan::{CollectiveKind, Instr, LocalTensor, Target};
use meshplan_ir::{Graph, Op};

use crate::comm::RankError;
use crate::program::{find_op, next_layer, segment_index};
use crate::train::fail;

/// A collective instruction's operands.
#[derive(Clone, Copy)]
pub(crate) struct Coll<'i> {
    pub kind: CollectiveKind,
    /// The group, by name.
    pub group: &'i str,
    /// The axis its bytes are reported under.
    pub axis: &'i str,
    pub target: &'i Target,
}

impl<'i> Coll<'i> {
    /// The operands of `instr` if it is a collective.
    pub(crate) fn of(instr: &'i Instr) -> Option<Coll<'i>> {
        match instr {
            Instr::Collective {
                kind,
                group,
                axis,
                target,
                ..
            } => Some(Coll {
                kind: *kind,
                group,
                axis: axis.name(),
                target,
            }),
            _ => None,
        }
    }
}

/// What a rank does at each instruction of a forward list.
pub(crate) trait Forward<'g> {
    fn graph(&self) -> &'g Graph;
    /// Before copy `l` of segment `s` runs (hands it the hidden states).
    fn enter(&mut self, s: usize, l: u64) -> Result<(), RankError>;
    /// After copy `l` of segment `s` ran (takes its output as the hidden states).
    fn leave(&mut self, s: usize, l: u64) -> Result<(), RankError>;
    /// Op `op` of layer `l`, its outputs as the plan holds them here.
    fn compute(&mut self, op: &'g Op, outputs: &[LocalTensor], l: u64) -> Result<(), RankError>;
    fn collective(&mut self, c: Coll<'_>, l: u64) -> Result<(), RankError>;
    /// The hidden states to the same coordinates on `stage` (`bytes` planned).
    fn send(&mut self, stage: u64, bytes: f64) -> Result<(), RankError>;
    /// The hidden states from the same coordinates on `stage`.
    fn recv(&mut self, stage: u64, bytes: f64) -> Result<(), RankError>;
    /// A ring-attention exchange: the attention op passes the blocks itself, so
    /// a walker that runs ring attention does nothing here.
    fn ring_pass(&mut self) -> Result<(), RankError>;
}

/// Runs `instrs` on `w`, the ops outside any block segment as layer `cur`;
/// `layer` counts the block layers on. `seg` is the segment the instructions stand
/// in (a recomputed body's), whose ops their names are looked up among.
pub(crate) fn forward<'g, W: Forward<'g> + ?Sized>(
    w: &mut W,
    instrs: &[Instr],
    layer: &mut u64,
    (seg, cur): (Option<usize>, u64),
) -> Result<(), RankError> {
    for instr in instrs {
        match instr {
            Instr::Segment {
                name,
                kind,
                repeat,
                body,
            } => {
                let s = segment_index(w.graph(), name)?;
                for _ in 0..*repeat {
                    let l = next_layer(*kind, layer);
                    w.enter(s, l)?;
                    forward(w, body, layer, (Some(s), l))?;
                    w.leave(s, l)?;
                }
            }
            Instr::Recompute { body } => forward(w, body, layer, (seg, cur))?,
            Instr::Compute { name, outputs, .. } => {
                w.compute(find_op(w.graph(), seg, name)?, outputs, cur)?
            }
            Instr::Collective { .. } => {
                if let Some(c) = Coll::of(instr) {
                    w.collective(c, cur)?
                }
            }
            Instr::Send {
                peer_stage, bytes, ..
            } => w.send(*peer_stage, *bytes)?,
            Instr::Recv {
                peer_stage, bytes, ..
            } => w.recv(*peer_stage, *bytes)?,
            Instr::RingPass { .. } => w.ring_pass()?,
            Instr::Optimizer { .. } => {
                return Err(fail(
                    "an optimizer update stands in a forward list; plans put it in the step list",
                ))
            }
        }
    }
    Ok(())
}
