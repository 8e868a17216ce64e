//! Communication between the ranks of a plan: the [`Communicator`] trait the
//! interpreter calls, and [`ThreadComm`], which runs every rank as a thread of one
//! process (a CUDA/NCCL backend implements the same trait).
//!
//! # Groups and matching
//!
//! A collective runs over a [`Group`], a sub-communicator over a mesh axis. A rank's
//! position in the group is its index in [`Group::ranks`]; every "in group order"
//! below means that order. Collectives on one group are matched by a per-group
//! sequence number: every member must call the same collectives on a group in the
//! same order, while different groups (the `tp` and `dp` groups of a 2-D mesh, a
//! pipeline stage sending while another reduces) proceed independently. Two groups
//! are the same group when both their `id` and their `ranks` are equal, so all the
//! `tp` groups of a mesh may share the id `"tp"`. Point-to-point messages are matched
//! in order per (sender, receiver) pair.
//!
//! # Determinism
//!
//! Reductions sum in group order (member 0 + member 1 + ...) whatever the arrival
//! order, so every member gets the bit-identical result and reruns reproduce it.
//!
//! # Byte accounting
//!
//! Each rank counts, per (collective kind, axis label), its calls and the bytes it
//! sent, by the planner's cost model (`meshplan_cost_model::collective::
//! bytes_sent_per_rank`), so measured bytes can be compared with predicted ones.
//! With `n` members and `B` the full buffer in bytes (4 an element, whatever
//! precision moved: fp32 on the host, bf16 activations through NCCL; a run's
//! report restates them at the plan's element sizes, `ByteCounts::at_element_size_but`):
//!
//! | kind | `B` | bytes sent |
//! |---|---|---|
//! | AllReduce | the buffer | `2(n-1)/n * B` |
//! | AllGather | the gathered output | `(n-1)/n * B` |
//! | ReduceScatter | the full input | `(n-1)/n * B` |
//! | AllToAll | this rank's send buffer | `(n-1)/n * B` |
//! | AllToAllV | this rank's send buffer | the bytes it sends to *other* members |
//! | Broadcast | the buffer | `B` on every member, root or not (the model's bound) |
//! | Send | the message | `B` |
//! | Recv | the message | 0 |
//!
//! Groups of one member send nothing (their calls still count). Barriers are not
//! counted. Counts are kept as exact fractions (see [`KindCount`]).
//!
//! # Failures
//!
//! A failure anywhere stops every rank with an error, never a hang.
//! [`Communicator::abort`] marks the world failed with the first failing rank and its
//! reason; from then on every blocked or new operation returns
//! [`CommError::Aborted`], naming where that rank was waiting. Any error a
//! [`ThreadComm`] operation returns aborts the world too, because the peers cannot
//! complete the operation without this rank. A [`ThreadComm`] world whose every
//! running rank waits for another returns [`CommError::Deadlock`] at once, naming
//! each wait; a wait longer than a given timeout returns [`CommError::Timeout`]
//! naming the ranks that did not arrive. [`run_ranks`] and
//! [`run_with`] turn a rank's error or panic into an abort (`run_with` through every
//! rank's [`AbortHandle`], for communicators such as NCCL's that neither time out
//! nor see a peer fail), and [`failure_summary`] says in one line who failed first
//! and where the others were waiting.

pub(crate) mod args;
mod counts;
#[cfg(feature = "cuda")]
pub mod nccl;
mod run;
mod thread;
pub(crate) mod wire;

#[cfg(test)]
mod tests;

pub(crate) use counts::{byte_gap, bytes_of};
pub use counts::{ByteCounts, KindCount};
#[cfg(feature = "cuda")]
pub use nccl::{nccl_available, Elem, NcclBench, NcclComm, NcclError, P2p};
pub use run::{failure_summary, run_ranks, run_with, RankError};
pub use thread::ThreadComm;

use std::fmt;
use std::time::Duration;

/// A sub-communicator: the global ranks of one group over a mesh axis, in group
/// order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Group {
    /// Name of the group kind (`tp`, `dp`, ...); groups with the same id but
    /// different ranks are different groups.
    pub id: String,
    /// Global ranks in group order.
    pub ranks: Vec<usize>,
}

impl Group {
    /// A group named `id` over `ranks` (in group order).
    pub fn new(id: impl Into<String>, ranks: Vec<usize>) -> Group {
        Group {
            id: id.into(),
            ranks,
        }
    }

    /// Every rank of a world of `world` ranks, in rank order, named `"world"`.
    pub fn world(world: usize) -> Group {
        Group::new("world", (0..world).collect())
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Position of global rank `rank` in the group, if it is a member.
    pub fn index_of(&self, rank: usize) -> Option<usize> {
        self.ranks.iter().position(|&r| r == rank)
    }
}

/// The kind of a communication operation, as errors and byte counts name it.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum CommKind {
    /// Sum, result everywhere.
    AllReduce,
    /// Concatenate every member's buffer, result everywhere.
    AllGather,
    /// Sum, each member keeps its part.
    ReduceScatter,
    /// One member's buffer to all.
    Broadcast,
    /// Equal parts exchanged between every pair.
    AllToAll,
    /// Per-pair counts exchanged between every pair.
    AllToAllV,
    /// Point-to-point send.
    Send,
    /// Point-to-point receive.
    Recv,
    /// Synchronisation without data.
    Barrier,
}

impl CommKind {
    /// Snake-case name (`all_reduce`, `send`, ...), as in `plan.json`.
    pub fn name(self) -> &'static str {
        match self {
            CommKind::AllReduce => "all_reduce",
            CommKind::AllGather => "all_gather",
            CommKind::ReduceScatter => "reduce_scatter",
            CommKind::Broadcast => "broadcast",
            CommKind::AllToAll => "all_to_all",
            CommKind::AllToAllV => "all_to_all_v",
            CommKind::Send => "send",
            CommKind::Recv => "recv",
            CommKind::Barrier => "barrier",
        }
    }
}

impl fmt::Display for CommKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a rank was blocked: one operation on one group (or one peer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaitPoint {
    /// The operation.
    pub kind: CommKind,
    /// Axis label the operation is accounted under.
    pub axis: String,
    /// Group id (`"p2p"` for send and receive).
    pub group: String,
    /// Group members in group order; for send/receive `[sender, receiver]`.
    pub ranks: Vec<usize>,
    /// Sequence number on the group (per pair and direction for send/receive),
    /// counted from 0.
    pub seq: u64,
}

impl fmt::Display for WaitPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.kind, self.ranks.as_slice()) {
            (CommKind::Send, [_, to]) => {
                write!(f, "send on {} to rank {to} (seq {})", self.axis, self.seq)
            }
            (CommKind::Recv, [from, _]) => {
                write!(
                    f,
                    "recv on {} from rank {from} (seq {})",
                    self.axis, self.seq
                )
            }
            _ if self.group == self.axis => {
                write!(f, "{} on {} (seq {})", self.kind, self.axis, self.seq)
            }
            _ => write!(
                f,
                "{} on {} (group {}, seq {})",
                self.kind, self.axis, self.group, self.seq
            ),
        }
    }
}

/// The first failure of a world: who failed and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The rank that failed first.
    pub first_rank: usize,
    /// Its reason.
    pub reason: String,
}

/// Why a communication operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    /// The world was aborted by another rank (or by this one earlier).
    #[error(
        "aborted: rank {first_rank} failed ({reason}) while this rank was waiting in {waiting_in}"
    )]
    Aborted {
        /// The rank that failed first.
        first_rank: usize,
        /// Its reason.
        reason: String,
        /// The operation this rank was waiting in (or about to enter).
        waiting_in: WaitPoint,
    },
    /// Members did not all arrive within the timeout.
    #[error("{}", timed_out(kind, axis, group, *seq, missing, timeout))]
    Timeout {
        /// The operation.
        kind: CommKind,
        /// Its axis label.
        axis: String,
        /// Its group id (`"p2p"` for a receive).
        group: String,
        /// Its sequence number.
        seq: u64,
        /// Global ranks that did not arrive (the sender, for a receive).
        missing: Vec<usize>,
        /// How long this rank waited.
        timeout: Duration,
    },
    /// Every rank not finished waits, each where only another waiting rank could
    /// wake it: the ranks' programs do not match (the in-process world finds this
    /// at once; its waits have no time limit otherwise).
    #[error("{}", deadlocked(waits))]
    Deadlock {
        /// Each waiting rank and where it waits, in rank order.
        waits: Vec<(usize, WaitPoint)>,
    },
    /// Members called different operations (kind, axis, size or root) at the same
    /// sequence number, or a message does not fit the receive.
    #[error("mismatched {waiting_in}: {detail}")]
    Mismatch {
        /// The operation this rank called.
        waiting_in: WaitPoint,
        /// What differs, naming the ranks.
        detail: String,
    },
    /// A member finished its work without joining an operation this rank waits in.
    #[error("{} finished without joining {waiting_in}", rank_list(finished))]
    Unmatched {
        /// The operation this rank was waiting in.
        waiting_in: WaitPoint,
        /// Global ranks that finished without arriving.
        finished: Vec<usize>,
    },
    /// Arguments this rank passed are inconsistent (sizes, group membership, peer).
    #[error("invalid {kind} arguments: {detail}")]
    InvalidArgument {
        /// The operation.
        kind: CommKind,
        /// What is wrong.
        detail: String,
    },
    /// The communicator's shared state is unusable (a thread panicked while holding
    /// it).
    #[error("communicator failure: {detail}")]
    Internal {
        /// What happened.
        detail: String,
    },
}

/// [`CommError::Timeout`]'s message: the group only where it is not the axis's
/// own and the operation is a collective.
fn timed_out(
    kind: &CommKind,
    axis: &str,
    group: &str,
    seq: u64,
    missing: &[usize],
    timeout: &Duration,
) -> String {
    let group = if group != axis && !matches!(kind, CommKind::Send | CommKind::Recv) {
        format!("group {group}, ")
    } else {
        String::new()
    };
    format!(
        "timed out after {:.3} s in {kind} on {axis} ({group}seq {seq}): {} did not arrive",
        timeout.as_secs_f64(),
        rank_list(missing)
    )
}

/// [`CommError::Deadlock`]'s message.
fn deadlocked(waits: &[(usize, WaitPoint)]) -> String {
    let each: Vec<String> = waits
        .iter()
        .map(|(r, w)| format!("rank {r} in {w}"))
        .collect();
    format!(
        "deadlock: every rank still running waits for another ({})",
        each.join(", ")
    )
}

/// `rank 3` or `ranks 0,1,2`.
pub(crate) fn rank_list(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    let s = if ranks.len() == 1 { "" } else { "s" };
    format!("rank{s} {}", list.join(","))
}

/// Collective and point-to-point communication of one rank.
///
/// Buffers are `f32`. Every operation names the axis label its bytes are accounted
/// under (`"dp"`, `"tp"`, `"pp"`, `"cp"`, `"ep"`); see the module doc for the
/// conventions. Operations take `&mut self` because matching is by per-rank sequence
/// numbers.
pub trait Communicator: Send {
    /// This rank's global rank.
    fn rank(&self) -> usize;

    /// Number of ranks in the world.
    fn world(&self) -> usize;

    /// Sum of every member's `buf`, in group order, into every member's `buf`.
    fn all_reduce(&mut self, group: &Group, axis: &str, buf: &mut [f32]) -> Result<(), CommError>;

    /// `out` = concatenation of every member's `local`, in group order
    /// (`out.len() == n * local.len()`).
    fn all_gather(
        &mut self,
        group: &Group,
        axis: &str,
        local: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError>;

    /// `input` is split into `n` equal contiguous parts in group order; `out` = sum
    /// over members of part `my index` (`input.len() == n * out.len()`).
    fn reduce_scatter(
        &mut self,
        group: &Group,
        axis: &str,
        input: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError>;

    /// A reduce-scatter (this member's part of the sum of every member's `src`) or an
    /// all-gather (every member's `src`, in group order) into a new vector: the
    /// collectives whose result the interpreter keeps. `src` is given up to the
    /// call: the in-process communicator hands it to the peers as it is, where the
    /// in-place calls copy their input first, and builds the result from the
    /// members' inputs without zero-filling it.
    fn collect(
        &mut self,
        kind: CommKind,
        (group, axis): (&Group, &str),
        src: Vec<f32>,
    ) -> Result<Vec<f32>, CommError> {
        let mut out = vec![0.0; args::collected_len(kind, group.size(), src.len())?];
        match kind {
            CommKind::ReduceScatter => self.reduce_scatter(group, axis, &src, &mut out)?,
            _ => self.all_gather(group, axis, &src, &mut out)?,
        }
        Ok(out)
    }

    /// Every member's `buf` becomes the `buf` of member `root_index` (a position in
    /// the group, not a global rank).
    fn broadcast(
        &mut self,
        group: &Group,
        axis: &str,
        buf: &mut [f32],
        root_index: usize,
    ) -> Result<(), CommError>;

    /// Equal splits: part `j` of `send` goes to member `j`; part `i` of `recv` comes
    /// from member `i` (`send.len() == recv.len()`, a multiple of `n`).
    fn all_to_all(
        &mut self,
        group: &Group,
        axis: &str,
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), CommError>;

    /// Uneven splits: `send` holds `send_counts[j]` elements for member `j`,
    /// contiguous in group order; `recv` receives `recv_counts[i]` elements from
    /// member `i`, contiguous in group order. Member `i`'s `send_counts[j]` must equal
    /// member `j`'s `recv_counts[i]`.
    fn all_to_all_v(
        &mut self,
        group: &Group,
        axis: &str,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError>;

    /// Sends `buf` to global rank `peer`; messages between a pair arrive in order.
    fn send(&mut self, peer: usize, axis: &str, buf: &[f32]) -> Result<(), CommError>;

    /// Receives the next message from global rank `peer` into `buf` (the lengths must
    /// match).
    fn recv(&mut self, peer: usize, axis: &str, buf: &mut [f32]) -> Result<(), CommError>;

    /// Sends each `sends[i].1` to global rank `sends[i].0` and receives the next
    /// message from each `recvs[j].0` into `recvs[j].1`, as one exchange: a
    /// communicator whose sends wait for their receives (as NCCL's may) posts them
    /// all before waiting on any, so that two ranks that each send to the other
    /// before they receive do not deadlock. The default sends, then receives, which
    /// suits sends that only queue.
    fn p2p_group(
        &mut self,
        axis: &str,
        sends: &[(usize, &[f32])],
        recvs: &mut [(usize, &mut [f32])],
    ) -> Result<(), CommError> {
        for (to, x) in sends {
            self.send(*to, axis, x)?;
        }
        for (from, x) in recvs {
            self.recv(*from, axis, x)?;
        }
        Ok(())
    }

    /// Returns once every member has entered the barrier.
    fn barrier(&mut self, group: &Group) -> Result<(), CommError>;

    /// Calls and bytes sent so far by this rank.
    fn counts(&self) -> ByteCounts;

    /// Marks the world failed with this rank as the first failure (unless another
    /// failure came first) and wakes every blocked rank.
    fn abort(&self, reason: String) {
        self.abort_handle().abort(self.rank(), reason);
    }

    /// What aborts this communicator from another thread, also while its owner
    /// is blocked in a call on it. [`run_with`] hands one rank's failure to the
    /// others through these: communicators that cannot see a peer fail (NCCL
    /// has no timeout) would otherwise wait for it forever.
    fn abort_handle(&self) -> AbortHandle;
}

/// Aborts one communicator from any thread ([`Communicator::abort_handle`]).
#[derive(Clone)]
pub struct AbortHandle(std::sync::Arc<dyn Fn(usize, String) + Send + Sync>);

impl AbortHandle {
    /// A handle that runs `f(first_rank, reason)`.
    pub fn new(f: impl Fn(usize, String) + Send + Sync + 'static) -> AbortHandle {
        AbortHandle(std::sync::Arc::new(f))
    }

    /// Marks the world failed with `first_rank`'s `reason` (unless another
    /// failure came first): every blocked or later call on the communicator
    /// returns [`CommError::Aborted`].
    pub fn abort(&self, first_rank: usize, reason: String) {
        (self.0)(first_rank, reason)
    }
}

impl fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AbortHandle")
    }
}
