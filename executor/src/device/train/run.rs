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
}

impl<'a> Run<'a> {
    fn new(plan: &'a Plan, opts: &'a TrainOptions) -> Result<Run<'a>, ExecError> {
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
        let saver = (opts.save.as_ref())
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
            if let Some(sv) = self
                .saver
                .as_ref()
                .filter(|sv| sv.due(step + 1, opts.steps))
            {
                sv.deposit(step + 1, r.snapshot()?).map_err(fail)?;
            }
        }
        r.report(loss_parts, steps_at)
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
    let run = Run::new(plan, opts)?;
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
/// process per GPU, NCCL between them): its report alone. The caller gathers the
/// ranks' losses. It may resume from a checkpoint; saving needs every rank's state
/// in one process, so `opts.save` is refused.
pub fn train_device_rank<D: Device>(
    plan: &Plan,
    opts: &TrainOptions,
    dev: D,
    comm: Box<D::Comm>,
) -> Result<RankReport, ExecError> {
    if opts.save.is_some() {
        return Err(ExecError::Plan("a checkpoint is written by one process holding every rank; with one process per GPU, save from a single-process run".into()));
    }
    if comm.world() != plan.ranks.len() {
        return Err(ExecError::Plan(format!(
            "the plan has {} ranks and this launch {}: start one process per rank",
            plan.ranks.len(),
            comm.world()
        )));
    }
    let run = Run::new(plan, opts)?;
    let rank = comm.rank();
    run.rank(dev, comm)
        .map_err(|e| ExecError::Rank(format!("rank {rank}: {e}")))
}
