//! A run of the device interpreter: every rank's setup, the ranks as threads or
//! one process's rank, and the report they make together.

use super::*;

/// What every rank of a run shares: the workload's sizes, the clock, the step the
/// run starts at (a resumed checkpoint's) and the checkpoint writer.
struct Run<'a> {
    plan: &'a Plan,
    opts: &'a TrainOptions,
    seq_len: u64,
    global_batch: u64,
    t0: Instant,
    start: u64,
    saver: Option<crate::ckpt::Saver>,
    /// Each rank a process of its own: the ranks' snapshots go to rank 0, whose
    /// writer alone takes the folder.
    launched: bool,
}

impl<'a> Run<'a> {
    /// The run; `writes`: whether this process writes the checkpoints `opts.save`
    /// asks for.
    fn new(plan: &'a Plan, opts: &'a TrainOptions, writes: bool) -> Result<Run<'a>, ExecError> {
        supported(plan).map_err(|m| {
            ExecError::Plan(format!("the device interpreter cannot run this plan: {m}"))
        })?;
        let Workload::Train {
            seq_len,
            global_batch,
            ..
        } = plan.workload
        else {
            unreachable!("checked by supported()")
        };
        let start = match &opts.resume {
            Some(ck) => crate::train::check_resume(plan, opts, ck)?,
            None => 0,
        };
        let saver = (opts.save.as_ref().filter(|_| writes))
            .map(|s| crate::ckpt::Saver::new(plan, opts, s))
            .transpose()
            .map_err(ExecError::Checkpoint)?;
        Ok(Run {
            plan,
            opts,
            seq_len,
            global_batch,
            t0: Instant::now(),
            start,
            saver,
            launched: false,
        })
    }

    /// The run of every rank's report: losses summed over ranks, step times of the
    /// slowest, the checkpoints written (joined even when the run failed, so that
    /// no write outlives the call).
    fn finish(self, results: Vec<Result<RankReport, RankError>>) -> Result<TrainReport, ExecError> {
        let saved = self.saver.map(crate::ckpt::Saver::finish);
        let ranks = crate::train::rank_outs(results)?;
        let saved = saved
            .transpose()
            .map_err(|e| ExecError::Checkpoint(format!("checkpoint: {e}")))?;
        let steps = self.opts.steps.saturating_sub(self.start) as usize;
        Ok(TrainReport {
            losses: (0..steps)
                .map(|s| ranks.iter().map(|r| r.loss_parts[s]).sum())
                .collect(),
            step_s: crate::train::run_step_times(&ranks, steps),
            tokens_per_step: self.seq_len * self.global_batch,
            ranks,
            saved: saved.unwrap_or_default(),
            lr: f64::from(self.opts.lr),
        })
    }

    /// Trains one rank from the run's first step to `opts.steps`, saving where due.
    fn rank<D: Device>(&self, dev: D, comm: Box<D::Comm>) -> Result<RankReport, RankError> {
        let opts = self.opts;
        let mut r = DevRank::new(
            dev,
            self.plan,
            comm,
            opts,
            self.seq_len,
            self.global_batch,
            self.t0,
        )?;
        let mut loss_parts = Vec::new();
        let mut steps_at = (self.t0.elapsed().as_secs_f64(), Vec::new());
        for step in self.start..opts.steps {
            if opts.fail_at == Some((r.rank, step)) {
                return Err(fail(format!("injected failure at step {step}")));
            }
            loss_parts.push(r.step(step)?);
            steps_at.1.push(self.t0.elapsed().as_secs_f64());
            if let (0, Some(hook)) = (r.rank, &opts.on_step) {
                (hook.0)(steps_at.1.len() as u64);
            }
            if (opts.save.as_ref()).is_some_and(|s| s.due(step + 1, opts.steps)) {
                self.save(&mut r, step + 1)?;
            }
        }
        r.report(loss_parts, steps_at)
    }
}

impl Run<'_> {
    /// Hands rank `r`'s state after `done` steps to the writer: in this process,
    /// or, each rank a process, over the communicator to rank 0, which receives
    /// every other rank's in rank order.
    fn save<D: Device>(&self, r: &mut DevRank<'_, D>, done: u64) -> Result<(), RankError> {
        let snap = r.snapshot()?;
        let Some(sv) = &self.saver else {
            if self.launched {
                crate::ckpt::send_snapshot(&mut *r.comm, 0, &snap)?;
            }
            return Ok(());
        };
        sv.deposit(done, snap).map_err(fail)?;
        if self.launched {
            for from in 1..self.plan.ranks.len() {
                let snap = crate::ckpt::recv_snapshot(&mut *r.comm, from)?;
                sv.deposit(done, snap).map_err(fail)?;
            }
        }
        Ok(())
    }
}

/// Runs `plan`'s training programs for `opts.steps` steps, each rank on the device
/// `make(rank)` gives, ranks as threads over the in-process communicator.
pub fn train_device<D: Device>(
    plan: &Plan,
    opts: &TrainOptions,
    make: &(dyn Fn(usize) -> DResult<D> + Sync),
) -> Result<TrainReport, ExecError> {
    train_device_with(plan, opts, make, None)
}

/// [`train_device`] over given communicators (`Some`), one per rank in rank order
/// (one process driving several GPUs: `NcclComm::in_process`), each rank a thread.
/// A rank that fails aborts the others' communicators (`comm::run_with`), so they
/// stop with its reason instead of waiting for it (NCCL has no timeout).
pub fn train_device_with<D: Device>(
    plan: &Plan,
    opts: &TrainOptions,
    make: &(dyn Fn(usize) -> DResult<D> + Sync),
    comms: Option<Vec<Box<D::Comm>>>,
) -> Result<TrainReport, ExecError> {
    let run = Run::new(plan, opts, true)?;
    let (world, rank) = (plan.ranks.len(), |comm: Box<D::Comm>| {
        run.rank(make(comm.rank()).map_err(derr("device"))?, comm)
    });
    let results = match comms {
        Some(comms) => crate::comm::run_with(world, comms, &rank).map_err(ExecError::Plan)?,
        None => crate::comm::run_ranks(world, opts.timeout, opts.threads_per_rank, |c| {
            rank(D::host_comm(Box::new(c)))
        }),
    };
    run.finish(results)
}

/// One rank of `plan` in this process, connected to the others by `comm` (one
/// process per GPU, NCCL between them): its report alone, and, on rank 0, the
/// checkpoints written. The caller gathers the ranks' losses. It may resume from a
/// checkpoint; with `opts.save`, every rank's state goes to rank 0 at each save,
/// and rank 0 alone prepares the folder and writes (the other ranks' options need
/// only say when).
pub fn train_device_rank<D: Device>(
    plan: &Plan,
    opts: &TrainOptions,
    dev: D,
    comm: Box<D::Comm>,
) -> Result<(RankReport, Vec<crate::ckpt::Saved>), ExecError> {
    if comm.world() != plan.ranks.len() {
        return Err(ExecError::Plan(format!(
            "the plan has {} ranks and this launch {}: start one process per rank",
            plan.ranks.len(),
            comm.world()
        )));
    }
    let rank = comm.rank();
    let mut run = Run::new(plan, opts, rank == 0)?;
    run.launched = true;
    let report = run.rank(dev, comm);
    let saved = run.saver.map(crate::ckpt::Saver::finish).transpose();
    let report = report.map_err(|e| ExecError::Rank(format!("rank {rank}: {e}")))?;
    let saved = saved.map_err(|e| ExecError::Checkpoint(format!("checkpoint: {e}")))?;
    Ok((report, saved.unwrap_or_default()))
}
