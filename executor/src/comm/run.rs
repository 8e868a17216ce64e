//! Running a world of ranks as threads, and reporting how it failed.

use super::thread::Shared;
use super::{rank_list, AbortHandle, CommError, Communicator, ThreadComm};
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

/// Why one rank of [`run_ranks`] failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RankError {
    /// A communication operation failed (including being aborted by another rank).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The rank's own work failed.
    #[error("{0}")]
    Failed(String),
    /// The rank panicked; the panic's message.
    #[error("panicked: {0}")]
    Panicked(String),
    /// A file the rank reads holds what no run can use (a checkpoint tensor
    /// holding NaN): the user's input, not the run, is at fault.
    #[error("{0}")]
    Input(String),
}

impl From<String> for RankError {
    fn from(m: String) -> RankError {
        RankError::Failed(m)
    }
}

impl From<&str> for RankError {
    fn from(m: &str) -> RankError {
        RankError::Failed(m.to_string())
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Runs `f` once per rank of a world of `world` ranks, each on its own thread with
/// its own [`ThreadComm`], and returns each rank's result, index = rank.
///
/// With `threads_per_rank > 1` each rank runs inside a rayon pool of its own of that
/// many threads, which its kernels split their work over
/// (`meshplan_kernels::cpu::intra_op_threads`); ranks never share a pool.
///
/// A rank whose `f` returns an error or panics aborts the world with its reason
/// (`panicked: <message>` for a panic), so the others stop with
/// [`CommError::Aborted`] instead of waiting; a rank whose `f` returns early marks
/// itself finished, so peers still waiting for it fail with
/// [`CommError::Unmatched`]. Pass the results to [`failure_summary`] for a one-line
/// report.
pub fn run_ranks<T, F>(
    world: usize,
    timeout: Option<Duration>,
    threads_per_rank: usize,
    f: F,
) -> Vec<Result<T, RankError>>
where
    T: Send,
    F: Fn(ThreadComm) -> Result<T, RankError> + Sync,
{
    let comms = ThreadComm::create(world, timeout);
    let Some(shared) = comms.first().map(ThreadComm::shared) else {
        return Vec::new();
    };
    let f = &f;
    std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(world);
        for (rank, comm) in comms.into_iter().enumerate() {
            let sh = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn_scoped(s, move || run_one(rank, &sh, threads_per_rank, f, comm));
            handles.push(spawned.map_err(|e| {
                let reason = format!("could not start a thread: {e}");
                shared.abort(rank, reason.clone());
                RankError::Failed(reason)
            }));
        }
        let mut results: Vec<Result<T, RankError>> = handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h.join().unwrap_or_else(|payload| {
                    // `run_one` catches panics; this is only a panic in the
                    // catching itself.
                    let msg = panic_message(payload.as_ref());
                    shared.abort(rank, format!("panicked: {msg}"));
                    Err(RankError::Panicked(msg))
                }),
                Err(e) => Err(e),
            })
            .collect();
        // Every rank returned, yet a message was left unread: the programs did not
        // match, which the run must not report as a success.
        if results.iter().all(Result::is_ok) {
            if let Some((to, why)) = shared.unreceived() {
                results[to] = Err(RankError::Failed(why));
            }
        }
        results
    })
}

/// Runs `f` once per given communicator (one per rank of a world of `world`, in
/// rank order: one process driving several GPUs, `NcclComm::in_process`), each on
/// its own thread; each rank's result, index = rank.
///
/// A rank whose `f` returns an error or panics aborts every communicator of the
/// world through its [`AbortHandle`]: these communicators (NCCL's) neither time
/// out nor see a peer fail, so the others would otherwise wait for it forever.
pub fn run_with<T, C, F>(
    world: usize,
    comms: Vec<Box<C>>,
    f: &F,
) -> Result<Vec<Result<T, RankError>>, String>
where
    T: Send,
    C: Communicator + ?Sized,
    F: Fn(Box<C>) -> Result<T, RankError> + Sync,
{
    if comms.len() != world || comms.iter().enumerate().any(|(r, c)| c.rank() != r) {
        return Err(format!(
            "{} communicators for a plan of {world} ranks (one per rank, in rank order)",
            comms.len()
        ));
    }
    let handles: Vec<AbortHandle> = comms.iter().map(|c| c.abort_handle()).collect();
    let abort_all = |rank: usize, reason: String| {
        for h in &handles {
            h.abort(rank, reason.clone());
        }
    };
    let abort_all = &abort_all;
    Ok(std::thread::scope(|s| {
        let spawned: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| (rank, s.spawn(move || guarded(rank, abort_all, || f(comm)))))
            .collect();
        spawned
            .into_iter()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|payload| {
                    // `guarded` catches panics; this is only a panic in the
                    // catching itself.
                    let msg = panic_message(payload.as_ref());
                    abort_all(rank, format!("panicked: {msg}"));
                    Err(RankError::Panicked(msg))
                })
            })
            .collect()
    }))
}

fn run_one<T, F>(
    rank: usize,
    shared: &Shared,
    threads: usize,
    f: &F,
    comm: ThreadComm,
) -> Result<T, RankError>
where
    T: Send,
    F: Fn(ThreadComm) -> Result<T, RankError> + Sync,
{
    let body = || -> Result<T, RankError> {
        if threads <= 1 {
            return f(comm);
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("rank-{rank}-kernel-{i}"))
            .build()
            .map_err(|e| {
                RankError::Failed(format!("could not start {threads} kernel threads: {e}"))
            })?;
        // A panic inside the pool resumes here, where it is caught below.
        pool.install(|| f(comm))
    };
    let out = guarded(rank, |r, reason| shared.abort(r, reason), body);
    // After the abort: a peer waiting for this rank must see its reason, not
    // only that it finished.
    shared.finish(rank);
    out
}

/// `body()`, a panic caught as [`RankError::Panicked`]; a failure goes to
/// `abort(rank, reason)` (a no-op where it only reports an abort that came
/// first: the first failure stays the one every rank reports).
fn guarded<T>(
    rank: usize,
    abort: impl Fn(usize, String),
    body: impl FnOnce() -> Result<T, RankError>,
) -> Result<T, RankError> {
    let out = catch_unwind(AssertUnwindSafe(body))
        .unwrap_or_else(|payload| Err(RankError::Panicked(panic_message(payload.as_ref()))));
    if let Err(e) = &out {
        abort(rank, e.to_string());
    }
    out
}

/// One line saying which rank failed first, why, and where the others were
/// waiting, e.g. `rank 3 failed: bad input; ranks 0,1,2 were waiting in all_reduce
/// on tp (seq 7)`; `None` if every rank succeeded.
///
/// The first failure is the one every aborted rank reports; when no rank was
/// aborted, it is the lowest failed rank. Other ranks that failed on their own are
/// listed after the waiting ones. A deadlock is said as itself, each rank's wait
/// once.
pub fn failure_summary<T>(results: &[Result<T, RankError>]) -> Option<String> {
    let errors: Vec<(usize, &RankError)> = results
        .iter()
        .enumerate()
        .filter_map(|(r, res)| res.as_ref().err().map(|e| (r, e)))
        .collect();
    let from_abort = errors.iter().find_map(|(_, e)| match e {
        RankError::Comm(CommError::Aborted {
            first_rank, reason, ..
        }) => Some((*first_rank, reason.clone())),
        _ => None,
    });
    let (first, reason) = match from_abort {
        Some(f) => f,
        None => errors.first().map(|(r, e)| (*r, e.to_string()))?,
    };
    // A deadlock is no one rank's failure, and its message already says where
    // every rank waits.
    let deadlock = errors.iter().find_map(|(r, e)| match e {
        RankError::Comm(d @ CommError::Deadlock { .. }) if *r == first => Some(d.to_string()),
        _ => None,
    });
    if deadlock.is_some() {
        return deadlock;
    }
    let mut parts = vec![format!("rank {first} failed: {reason}")];
    // Waiting ranks grouped by where they waited, in order of their lowest rank.
    let mut waits: Vec<(String, Vec<usize>)> = Vec::new();
    let mut others = Vec::new();
    for (r, e) in &errors {
        if *r == first {
            continue;
        }
        match e {
            RankError::Comm(CommError::Aborted { waiting_in, .. }) => {
                let w = waiting_in.to_string();
                match waits.iter_mut().find(|(x, _)| *x == w) {
                    Some((_, ranks)) => ranks.push(*r),
                    None => waits.push((w, vec![*r])),
                }
            }
            other => others.push(format!("rank {r} also failed: {other}")),
        }
    }
    for (w, ranks) in waits {
        let verb = if ranks.len() == 1 { "was" } else { "were" };
        parts.push(format!("{} {verb} waiting in {w}", rank_list(&ranks)));
    }
    parts.extend(others);
    Some(parts.join("; "))
}
