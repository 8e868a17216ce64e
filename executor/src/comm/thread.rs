//! [`ThreadComm`]: every rank a thread of one process, meeting in a shared
//! rendezvous table.
//!
//! Each collective is a slot keyed by (group, sequence number). A member leaves its
//! input in the slot (a copy; `collect`'s buffer itself, which the caller gave up)
//! and waits until every member has; each then reads what it needs from the shared
//! inputs outside the lock, so large copies and sums of one group do not hold up
//! the others. The last member to leave removes the slot.
//! Sends are buffered (a send never waits for its receive), which is what lets
//! pipeline stages exchange activations in either order without deadlock.
//!
//! A wait has no time limit unless one is given: a peer may compute for minutes
//! before it arrives (a pipeline stage's microbatch of a large model on one core).
//! What ends a wait that can never end is the deadlock check: a rank about to
//! sleep marks where it waits, every change to the shared state (an arrival that
//! completes a rendezvous, a message, a finished rank, a failure) clears the
//! marks, and a rank that finds every unfinished rank marked knows that each
//! looked at the state since its last change and found nothing to do, so that no
//! one can move again. It fails the run at once, naming where each rank waits.

use super::args;
use super::counts::bytes_of;
use super::{
    AbortHandle, ByteCounts, CommError, CommKind, Communicator, Failure, Group, WaitPoint,
};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

mod ops;

type GroupKey = (String, Vec<usize>);

/// In-process communicator: one per rank, each moved into its rank's thread.
pub struct ThreadComm {
    rank: usize,
    timeout: Option<Duration>,
    shared: Arc<Shared>,
    /// Next sequence number per group; presence also means the group was validated.
    seqs: HashMap<GroupKey, u64>,
    send_seq: HashMap<usize, u64>,
    recv_seq: HashMap<usize, u64>,
    counts: ByteCounts,
}

pub(crate) struct Shared {
    world: usize,
    state: Mutex<State>,
    /// One condition for every waiter: waits are short and worlds small, and a
    /// single condition cannot miss a wake-up between groups.
    wake: Condvar,
}

#[derive(Default)]
struct State {
    failure: Option<Failure>,
    slots: HashMap<(GroupKey, u64), Slot>,
    mail: HashMap<(usize, usize), VecDeque<Message>>,
    /// Ranks whose work has ended (set by the runner), so waiting for them fails
    /// at once.
    finished: Vec<bool>,
    /// Per rank, where it sleeps, once it has found nothing to do in the state as
    /// it is; cleared by every change that could wake a rank ([`State::moved`]).
    stuck: Vec<Option<WaitPoint>>,
}

impl State {
    /// The state changed in a way that may let a sleeping rank go on: every rank
    /// must look again before it counts as stuck.
    fn moved(&mut self) {
        self.stuck.iter_mut().for_each(|s| *s = None);
    }

    /// Every rank's wait, if every rank not finished sleeps where nothing can wake it.
    fn deadlock(&self) -> Option<Vec<(usize, WaitPoint)>> {
        let mut waits = Vec::new();
        for (rank, (stuck, &finished)) in self.stuck.iter().zip(&self.finished).enumerate() {
            match stuck {
                Some(w) => waits.push((rank, w.clone())),
                None if finished => {}
                None => return None,
            }
        }
        Some(waits)
    }
}

struct Message {
    axis: String,
    data: Vec<f32>,
}

/// What every member of a collective must agree on.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Signature {
    kind: CommKind,
    axis: String,
    len: usize,
    root: usize,
}

impl std::fmt::Display for Signature {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} on {} with {} elements",
            self.kind, self.axis, self.len
        )?;
        if self.kind == CommKind::Broadcast {
            write!(f, " from member {}", self.root)?;
        }
        Ok(())
    }
}

#[derive(Default)]
struct Contribution {
    data: Vec<f32>,
    send_counts: Vec<usize>,
    recv_counts: Vec<usize>,
}

impl Contribution {
    /// A member's buffer, with no All-to-All-v counts.
    fn of(data: &[f32]) -> Contribution {
        Contribution {
            data: data.to_vec(),
            ..Contribution::default()
        }
    }
}

struct Slot {
    sig: Signature,
    first_rank: usize,
    inputs: Vec<Option<Arc<Contribution>>>,
    arrived: usize,
    departed: usize,
    /// Disagreement found once everyone arrived (All-to-All-v counts).
    error: Option<String>,
}

fn poisoned<T>(_: PoisonError<T>) -> CommError {
    CommError::Internal {
        detail: "shared state poisoned: a thread panicked inside the communicator".into(),
    }
}

fn aborted(failure: &Failure, wait: &WaitPoint) -> CommError {
    CommError::Aborted {
        first_rank: failure.first_rank,
        reason: failure.reason.clone(),
        waiting_in: wait.clone(),
    }
}

impl Shared {
    fn lock(&self) -> Result<MutexGuard<'_, State>, CommError> {
        self.state.lock().map_err(poisoned)
    }

    /// Records the first failure and wakes everyone. Recovers a poisoned lock: the
    /// failure flag must get through precisely when something already went wrong.
    pub(crate) fn abort(&self, rank: usize, reason: String) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if st.failure.is_none() {
            st.failure = Some(Failure {
                first_rank: rank,
                reason,
            });
        }
        st.moved();
        drop(st);
        self.wake.notify_all();
    }

    /// The first message a rank sent that its peer never received, said as such:
    /// sends are buffered, so a run whose every rank returned can still have left
    /// one (a program that sends where its peer's does not receive).
    pub(crate) fn unreceived(&self) -> Option<(usize, String)> {
        let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let mut left: Vec<_> = st.mail.iter().filter(|(_, q)| !q.is_empty()).collect();
        left.sort_by_key(|(k, _)| **k);
        let (&(from, to), q) = left.first()?;
        Some((
            to,
            format!(
                "rank {from} sent rank {to} {} message(s) it never received (the first on `{}`, {} values)",
                q.len(),
                q[0].axis,
                q[0].data.len()
            ),
        ))
    }

    /// Marks `rank`'s work as ended and wakes everyone.
    pub(crate) fn finish(&self, rank: usize) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(f) = st.finished.get_mut(rank) {
            *f = true;
        }
        st.moved();
        drop(st);
        self.wake.notify_all();
    }

    /// `rank` sleeps in `wait` until the state changes or `deadline` (never when
    /// `None`); `false` once the deadline has passed. Fails instead where every
    /// rank not finished sleeps too ([`CommError::Deadlock`]).
    fn wait<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        (rank, wait): (usize, &WaitPoint),
        deadline: Option<Instant>,
    ) -> Result<(MutexGuard<'a, State>, bool), CommError> {
        if let Some(s) = st.stuck.get_mut(rank) {
            *s = Some(wait.clone());
        }
        if let Some(waits) = st.deadlock() {
            return Err(CommError::Deadlock { waits });
        }
        match deadline {
            None => Ok((self.wake.wait(st).map_err(poisoned)?, true)),
            Some(d) => {
                let now = Instant::now();
                if now >= d {
                    return Ok((st, false));
                }
                let (g, _) = self.wake.wait_timeout(st, d - now).map_err(poisoned)?;
                Ok((g, true))
            }
        }
    }
}

impl ThreadComm {
    /// Communicators for a world of `world` ranks, index = rank. A wait longer than
    /// `timeout` fails with [`CommError::Timeout`]; without one, only a deadlock
    /// ends a wait early.
    pub fn create(world: usize, timeout: Option<Duration>) -> Vec<ThreadComm> {
        let shared = Arc::new(Shared {
            world,
            state: Mutex::new(State {
                finished: vec![false; world],
                stuck: vec![None; world],
                ..State::default()
            }),
            wake: Condvar::new(),
        });
        (0..world)
            .map(|rank| ThreadComm {
                rank,
                timeout,
                shared: Arc::clone(&shared),
                seqs: HashMap::new(),
                send_seq: HashMap::new(),
                recv_seq: HashMap::new(),
                counts: ByteCounts::new(),
            })
            .collect()
    }

    pub(crate) fn shared(&self) -> Arc<Shared> {
        Arc::clone(&self.shared)
    }

    fn deadline(&self) -> Option<Instant> {
        Instant::now().checked_add(self.timeout?)
    }

    /// Runs `f`, aborting the world on any error: the peers cannot finish without
    /// this rank.
    fn checked<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        let r = f(self);
        if let Err(e) = &r {
            self.shared.abort(self.rank, e.to_string());
        }
        r
    }

    /// Validates the group (once per group), takes the next sequence number, and
    /// returns this rank's index and wait point.
    fn enter(
        &mut self,
        group: &Group,
        kind: CommKind,
        axis: &str,
    ) -> Result<(usize, WaitPoint), CommError> {
        let me = args::index_in(group, self.rank, kind)?;
        let key = (group.id.clone(), group.ranks.clone());
        if !self.seqs.contains_key(&key) {
            args::check_members(group, self.shared.world, kind)?;
        }
        let seq = self.seqs.entry(key).or_insert(0);
        let wait = next_wait(seq, kind, axis, &group.id, group.ranks.clone());
        Ok((me, wait))
    }

    /// Deposits this member's contribution and returns every member's, in group
    /// order, once all have arrived.
    fn exchange(
        &self,
        me: usize,
        wait: &WaitPoint,
        len: usize,
        root: usize,
        contribution: Contribution,
    ) -> Result<Vec<Arc<Contribution>>, CommError> {
        let n = wait.ranks.len();
        let sig = Signature {
            kind: wait.kind,
            axis: wait.axis.clone(),
            len,
            root,
        };
        let key = ((wait.group.clone(), wait.ranks.clone()), wait.seq);
        let deadline = self.deadline();
        let mut st = self.shared.lock()?;
        self.arrive(&mut st, &key, (me, wait), sig, contribution)?;
        loop {
            let Some(slot) = st.slots.get_mut(&key) else {
                return Err(CommError::Internal {
                    detail: format!("rendezvous of {wait} vanished"),
                });
            };
            if let Some(detail) = &slot.error {
                return Err(CommError::Mismatch {
                    waiting_in: wait.clone(),
                    detail: detail.clone(),
                });
            }
            if slot.arrived == n {
                let inputs: Option<Vec<Arc<Contribution>>> = slot.inputs.iter().cloned().collect();
                slot.departed += 1;
                if slot.departed == n {
                    st.slots.remove(&key);
                }
                return inputs.ok_or_else(|| CommError::Internal {
                    detail: format!("rendezvous of {wait} complete with an input missing"),
                });
            }
            let missing: Vec<usize> = wait
                .ranks
                .iter()
                .zip(&slot.inputs)
                .filter(|(_, i)| i.is_none())
                .map(|(&r, _)| r)
                .collect();
            if let Some(f) = &st.failure {
                return Err(aborted(f, wait));
            }
            let finished: Vec<usize> = missing
                .iter()
                .copied()
                .filter(|&r| st.finished.get(r).copied().unwrap_or(false))
                .collect();
            if !finished.is_empty() {
                return Err(CommError::Unmatched {
                    waiting_in: wait.clone(),
                    finished,
                });
            }
            let (guard, in_time) = self.shared.wait(st, (self.rank, wait), deadline)?;
            st = guard;
            if !in_time {
                return Err(timeout(wait, missing, self.timeout));
            }
        }
    }

    /// Rank `me` leaves its contribution in the slot of `wait`'s rendezvous (the
    /// first to arrive opens it); the last to arrive checks All-to-All(v)'s counts
    /// and wakes the others.
    fn arrive(
        &self,
        st: &mut State,
        key: &(GroupKey, u64),
        (me, wait): (usize, &WaitPoint),
        sig: Signature,
        contribution: Contribution,
    ) -> Result<(), CommError> {
        let n = wait.ranks.len();
        if let Some(f) = &st.failure {
            return Err(aborted(f, wait));
        }
        let slot = st.slots.entry(key.clone()).or_insert_with(|| Slot {
            sig: sig.clone(),
            first_rank: self.rank,
            inputs: vec![None; n],
            arrived: 0,
            departed: 0,
            error: None,
        });
        if slot.sig != sig {
            return Err(CommError::Mismatch {
                waiting_in: wait.clone(),
                detail: format!(
                    "rank {} called {sig} but rank {} called {}",
                    self.rank, slot.first_rank, slot.sig
                ),
            });
        }
        match slot.inputs.get_mut(me) {
            Some(entry @ None) => *entry = Some(Arc::new(contribution)),
            _ => {
                return Err(CommError::Internal {
                    detail: format!("rank {} entered {wait} twice", self.rank),
                })
            }
        }
        slot.arrived += 1;
        if slot.arrived == n {
            if sig.kind == CommKind::AllToAllV {
                slot.error = check_counts(&slot.inputs, &wait.ranks).err();
            }
            st.moved();
            self.shared.wake.notify_all();
        }
        Ok(())
    }

    /// A reduce-scatter or an all-gather of `src` into a result of `out_len`
    /// elements: the arguments checked, the members' inputs exchanged, the bytes
    /// counted; `take` makes the result from every member's input (this member's
    /// index second).
    fn gather_scatter<T>(
        &mut self,
        kind: CommKind,
        (group, axis): (&Group, &str),
        (src, out_len): (Contribution, usize),
        take: impl FnOnce(&[Arc<Contribution>], usize, &WaitPoint) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        self.checked(|s| {
            let (n, len) = (group.size(), src.data.len());
            args::gather_scatter(kind, n, len, out_len)?;
            let (me, wait) = s.enter(group, kind, axis)?;
            let inputs = s.exchange(me, &wait, len, 0, src)?;
            let out = take(&inputs, me, &wait)?;
            // Counted on the whole buffer: an all-gather's output, a
            // reduce-scatter's input.
            let whole = len.max(out_len);
            s.counts.record_ring(kind, axis, n, bytes_of(whole));
            Ok(out)
        })
    }

    fn check_peer(&self, kind: CommKind, peer: usize) -> Result<(), CommError> {
        if peer >= self.shared.world {
            return Err(CommError::InvalidArgument {
                kind,
                detail: format!("peer {peer} in a world of {}", self.shared.world),
            });
        }
        Ok(())
    }
}

/// The wait point of an operation numbered `*seq`, which moves on to the next.
fn next_wait(
    seq: &mut u64,
    kind: CommKind,
    axis: &str,
    group: &str,
    ranks: Vec<usize>,
) -> WaitPoint {
    let wait = WaitPoint {
        kind,
        axis: axis.to_string(),
        group: group.to_string(),
        ranks,
        seq: *seq,
    };
    *seq += 1;
    wait
}

fn timeout(wait: &WaitPoint, missing: Vec<usize>, timeout: Option<Duration>) -> CommError {
    CommError::Timeout {
        kind: wait.kind,
        axis: wait.axis.clone(),
        group: wait.group.clone(),
        seq: wait.seq,
        missing,
        // Only a wait with a deadline times out.
        timeout: timeout.unwrap_or_default(),
    }
}

/// Member `i`'s `send_counts[j]` must equal member `j`'s `recv_counts[i]`.
fn check_counts(inputs: &[Option<Arc<Contribution>>], ranks: &[usize]) -> Result<(), String> {
    for (i, ci) in inputs.iter().enumerate() {
        for (j, cj) in inputs.iter().enumerate() {
            let sent = ci.as_ref().and_then(|c| c.send_counts.get(j).copied());
            let expected = cj.as_ref().and_then(|c| c.recv_counts.get(i).copied());
            if sent != expected {
                return Err(format!(
                    "rank {} sends {} elements to rank {}, which expects {}",
                    ranks[i],
                    sent.map_or("?".into(), |s| s.to_string()),
                    ranks[j],
                    expected.map_or("?".into(), |s| s.to_string()),
                ));
            }
        }
    }
    Ok(())
}
