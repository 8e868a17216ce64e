//! `meshplan launch`: start this node's ranks as processes of a program (the
//! `meshplan` binary itself) with torchrun's variables, prefix their output with
//! `[rank r]`, and stop them all when one fails or the launcher is signalled. The
//! ranks get the job's `MESHPLAN_JOB_TOKEN` ([`LaunchOptions::job_token`]) with which
//! they prove to rank 0 that they belong to this job.
//!
//! # Failures and signals
//!
//! - The first rank to exit non-zero decides the launcher's exit code (a rank killed
//!   by signal `s` counts as `128 + s`); the other ranks get SIGTERM, and SIGKILL
//!   after [`LaunchOptions::grace`].
//! - SIGINT, SIGTERM and SIGHUP to the launcher are forwarded to every running rank;
//!   a second one kills them. The launcher then exits with the first failing rank's
//!   code, or `128 + signal`.
//! - Each rank's standard input is a pipe that the launcher holds open until the end,
//!   and the launcher sets `MESHPLAN_LAUNCHER_PID`: a `meshplan` rank that reads end of
//!   file there knows its launcher died (even by SIGKILL) and exits
//!   ([`watch_launcher`]), so no rank outlives it.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// The environment variable that marks a rank started by `meshplan launch`.
pub const LAUNCHER_PID_VAR: &str = "MESHPLAN_LAUNCHER_PID";

/// Most processes one launcher starts.
pub const NPROC_PER_NODE_MAX: usize = 1024;

/// What to launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchOptions {
    /// The program of every rank.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Ranks on this node.
    pub nproc_per_node: usize,
    /// Nodes of the run.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
    /// Rank 0's host.
    pub master_addr: String,
    /// Rank 0's port.
    pub master_port: u16,
    /// Between SIGTERM and SIGKILL when stopping ranks.
    pub grace: Duration,
    /// The job's `MESHPLAN_JOB_TOKEN` to hand every rank (`None`: the ranks inherit
    /// the launcher's environment, token or not).
    pub job_token: Option<String>,
}

/// How a launch ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchOutcome {
    /// The launcher's exit code.
    pub exit_code: i32,
    /// The first rank that failed and its code.
    pub first_failure: Option<(usize, i32)>,
    /// The signal the launcher received and forwarded, if any.
    pub signal: Option<i32>,
}

enum Event {
    Exited(usize, std::io::Result<ExitStatus>),
    Signal(i32),
}

fn code_of(status: &std::io::Result<ExitStatus>) -> i32 {
    let Ok(s) = status else { return 1 };
    #[cfg(unix)]
    let killed = 128 + std::os::unix::process::ExitStatusExt::signal(s).unwrap_or(0);
    #[cfg(not(unix))]
    let killed = 1;
    s.code().unwrap_or(killed)
}

/// Sends `sig` to process `pid` (a child not yet reaped).
#[cfg(unix)]
fn signal_pid(pid: u32, sig: i32) {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    if let (Ok(s), Ok(p)) = (Signal::try_from(sig), i32::try_from(pid)) {
        let _ = kill(Pid::from_raw(p), s);
    }
}

#[cfg(not(unix))]
fn signal_pid(_pid: u32, _sig: i32) {}

#[cfg(unix)]
const SIGTERM: i32 = signal_hook::consts::SIGTERM;
#[cfg(unix)]
const SIGKILL: i32 = signal_hook::consts::SIGKILL;
#[cfg(not(unix))]
const SIGTERM: i32 = 15;
#[cfg(not(unix))]
const SIGKILL: i32 = 9;

/// Copies `from` line by line to stdout or stderr, each line prefixed.
fn pump(from: impl Read, prefix: String, to_stderr: bool) {
    let mut r = BufReader::new(from);
    let mut line = Vec::new();
    loop {
        line.clear();
        match r.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                let mut out = Vec::with_capacity(prefix.len() + line.len());
                out.extend_from_slice(prefix.as_bytes());
                out.extend_from_slice(&line);
                // One write per line under the stream's lock keeps lines whole.
                let _ = if to_stderr {
                    std::io::stderr().lock().write_all(&out)
                } else {
                    std::io::stdout().lock().write_all(&out)
                };
            }
        }
    }
}

/// Starts the ranks, supervises them, and returns when all have exited.
///
/// # Errors
/// Inconsistent options, or a rank that cannot be started (the ones already started
/// are stopped first).
pub fn launch(o: &LaunchOptions) -> Result<LaunchOutcome, String> {
    check_options(o)?;
    let (tx, rx) = mpsc::channel::<Event>();
    #[cfg(unix)]
    let signals = {
        use signal_hook::consts::{SIGHUP, SIGINT};
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
            .map_err(|e| format!("cannot watch for signals: {e}"))?;
        let handle = signals.handle();
        let tx = tx.clone();
        thread::spawn(move || {
            for s in signals.forever() {
                if tx.send(Event::Signal(s)).is_err() {
                    return;
                }
            }
        });
        handle
    };
    let mut ranks = Children::default();
    for local in 0..o.nproc_per_node {
        if let Err(e) = ranks.spawn(o, local, &tx) {
            ranks.kill();
            return Err(e);
        }
    }
    drop(tx);
    let (first_failure, signal) = supervise(o, &ranks.pids, &rx);
    for w in ranks.waiters {
        let _ = w.join();
    }
    for p in ranks.pumps {
        let _ = p.join();
    }
    drop(ranks.stdins);
    #[cfg(unix)]
    signals.close();
    let exit_code = match (first_failure, signal) {
        (Some((_, c)), _) => c,
        (None, Some(s)) => 128 + s,
        (None, None) => 0,
    };
    Ok(LaunchOutcome {
        exit_code,
        first_failure,
        signal,
    })
}

/// Whether `o` names a launch that can start: the flags' own error otherwise (bad
/// input, where [`launch`]'s later errors are the machine's).
pub fn check_options(o: &LaunchOptions) -> Result<(), String> {
    if o.nproc_per_node == 0 || o.nproc_per_node > NPROC_PER_NODE_MAX {
        return Err(format!(
            "--nproc-per-node {} must be in 1..={NPROC_PER_NODE_MAX}",
            o.nproc_per_node
        ));
    }
    if o.nnodes == 0 {
        return Err("--nnodes must be at least 1".into());
    }
    if o.node_rank >= o.nnodes {
        return Err(format!(
            "--node-rank {} is not below --nnodes {}: nodes count from 0",
            o.node_rank, o.nnodes
        ));
    }
    // Rank numbers are node_rank * nproc_per_node + local: a world past the
    // rendezvous's limit (or past usize, where they would wrap) pairs wrong ranks.
    match o.nnodes.checked_mul(o.nproc_per_node) {
        Some(w) if w <= crate::rendezvous::WORLD_MAX => Ok(()),
        _ => Err(format!(
            "--nnodes {} x --nproc-per-node {} is over the {} ranks a rendezvous takes",
            o.nnodes,
            o.nproc_per_node,
            crate::rendezvous::WORLD_MAX
        )),
    }
}

/// This node's ranks as child processes: their pids, the stdin pipes that tell
/// them the launcher lives, the threads prefixing their output and reaping them.
#[derive(Default)]
struct Children {
    pids: Vec<u32>,
    stdins: Vec<ChildStdin>,
    pumps: Vec<thread::JoinHandle<()>>,
    waiters: Vec<thread::JoinHandle<()>>,
}

impl Children {
    /// Starts local rank `local` with torchrun's variables; its exit is sent to `tx`.
    fn spawn(
        &mut self,
        o: &LaunchOptions,
        local: usize,
        tx: &mpsc::Sender<Event>,
    ) -> Result<(), String> {
        let rank = o.node_rank * o.nproc_per_node + local;
        let world = o.nnodes * o.nproc_per_node;
        let mut cmd = Command::new(&o.program);
        if let Some(t) = &o.job_token {
            // Through the environment, as torchrun passes its variables: a command
            // line would show the token to every user of the node in `ps`.
            cmd.env(super::auth::TOKEN_VAR, t);
        }
        let spawned: std::io::Result<Child> = cmd
            .args(&o.args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", o.nproc_per_node.to_string())
            .env("GROUP_RANK", o.node_rank.to_string())
            .env("MASTER_ADDR", &o.master_addr)
            .env("MASTER_PORT", o.master_port.to_string())
            .env(LAUNCHER_PID_VAR, std::process::id().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = spawned
            .map_err(|e| format!("cannot start rank {rank} ({}): {e}", o.program.display()))?;
        self.pids.push(child.id());
        if let Some(s) = child.stdin.take() {
            self.stdins.push(s);
        }
        let prefix = format!("[rank {rank}] ");
        if let Some(out) = child.stdout.take() {
            let p = prefix.clone();
            self.pumps.push(thread::spawn(move || pump(out, p, false)));
        }
        if let Some(err) = child.stderr.take() {
            self.pumps
                .push(thread::spawn(move || pump(err, prefix, true)));
        }
        let tx = tx.clone();
        self.waiters.push(thread::spawn(move || {
            let status = child.wait();
            let _ = tx.send(Event::Exited(local, status));
        }));
        Ok(())
    }

    /// Kills the ranks started so far (one failed to start) and reaps them.
    fn kill(self) {
        for &p in &self.pids {
            signal_pid(p, SIGKILL);
        }
        drop(self.stdins);
        for w in self.waiters {
            let _ = w.join();
        }
    }
}

/// Waits for every rank to exit: the first failure stops the others (SIGTERM,
/// then SIGKILL after the grace period), a signal is forwarded to them (a second
/// one kills). Returns the first failure (global rank, exit code) and the signal.
fn supervise(
    o: &LaunchOptions,
    pids: &[u32],
    rx: &mpsc::Receiver<Event>,
) -> (Option<(usize, i32)>, Option<i32>) {
    let mut running = vec![true; o.nproc_per_node];
    let mut first_failure: Option<(usize, i32)> = None;
    let mut signal: Option<i32> = None;
    let mut kill_at: Option<Instant> = None;
    let stop = |running: &[bool], sig: i32| {
        for (i, &alive) in running.iter().enumerate() {
            if alive {
                signal_pid(pids[i], sig);
            }
        }
    };
    while running.iter().any(|&r| r) {
        let ev = match kill_at {
            Some(t) => rx.recv_timeout(t.saturating_duration_since(Instant::now())),
            None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
        };
        match ev {
            Ok(Event::Exited(local, status)) => {
                // A rank counts as exited once its waiter reaped it: signal no more.
                running[local] = false;
                let code = code_of(&status);
                if code != 0 && first_failure.is_none() && signal.is_none() {
                    first_failure = Some((o.node_rank * o.nproc_per_node + local, code));
                    stop(&running, SIGTERM);
                    kill_at = Some(Instant::now() + o.grace);
                }
            }
            Ok(Event::Signal(s)) => {
                if signal.is_some() {
                    stop(&running, SIGKILL);
                } else {
                    signal = Some(s);
                    stop(&running, s);
                    kill_at = Some(Instant::now() + o.grace);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                stop(&running, SIGKILL);
                kill_at = None;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    (first_failure, signal)
}

/// In a rank started by `meshplan launch` (`MESHPLAN_LAUNCHER_PID` set), watches
/// standard input, the pipe the launcher holds: at end of file the launcher has died,
/// and `on_orphaned` runs (it should exit the process). Returns whether it watches.
pub fn watch_launcher(on_orphaned: impl FnOnce() + Send + 'static) -> bool {
    if std::env::var_os(LAUNCHER_PID_VAR).is_none() {
        return false;
    }
    thread::Builder::new()
        .name("launcher-watch".into())
        .spawn(move || {
            let mut sink = [0u8; 256];
            let mut stdin = std::io::stdin().lock();
            loop {
                match stdin.read(&mut sink) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            on_orphaned();
        })
        .is_ok()
}
