//! A run of the device interpreter: every rank's setup, the ranks as threads or
//! one process's rank, and the report they make together.

use super::*;
use crate::comm::wire::{recv_bytes, recv_values, send_bytes, send_values};

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
    /// The run of every rank in this process (`launched_as: None`), or of rank `r`
    /// alone (`Some(r)`, each rank a process), where only rank 0 writes the
    /// checkpoints `opts.save` asks for.
    fn new(
        plan: &'a Plan,
        opts: &'a TrainOptions,
        launched_as: Option<usize>,
    ) -> Result<Run<'a>, ExecError> {
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
        let writes = launched_as.is_none_or(|r| r == 0);
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
            launched: launched_as.is_some(),
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

    /// Trains one rank from the run's first step to `opts.steps`, saving where due:
    /// its report and, each rank a process, on rank 0 with the final weights asked
    /// for (`--check`) or a trace, every other rank's in rank order.
    fn rank<D: Device>(
        &self,
        dev: D,
        comm: Box<D::Comm>,
    ) -> Result<(RankReport, Vec<RankReport>), RankError> {
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
        let report = r.report(loss_parts, steps_at)?;
        if !(self.launched && (opts.final_weights || opts.trace)) {
            return Ok((report, Vec::new()));
        }
        if r.rank != 0 {
            send_report(&mut *r.comm, &report)?;
            return Ok((report, Vec::new()));
        }
        let clock0 = report.clock0_unix_s;
        let others = (1..self.plan.ranks.len())
            .map(|from| recv_report(&mut *r.comm, from, clock0))
            .collect::<Result<_, _>>()?;
        Ok((report, others))
    }
}

impl Run<'_> {
    /// Hands rank `r`'s state after `done` steps to the writer: in this process,
    /// or, each rank a process, over the communicator to rank 0, which receives
    /// from every other rank in rank order the pieces it holds no copy of yet.
    fn save<D: Device>(&self, r: &mut DevRank<'_, D>, done: u64) -> Result<(), RankError> {
        let (place, offered) = ((r.tp, r.ep), r.offer()?);
        let before = r.comm.counts();
        match &self.saver {
            // A launched rank other than 0: rank 0 writes.
            None => {
                let wanted = crate::ckpt::offer(&mut *r.comm, 0, place, &offered)?;
                let snap = r.snapshot(&wanted)?;
                crate::ckpt::send_pieces(&mut *r.comm, 0, &snap)?;
            }
            Some(sv) => {
                let wanted = sv.wanted(done, place, &offered).map_err(fail)?;
                sv.deposit(done, r.snapshot(&wanted)?).map_err(fail)?;
                if self.launched {
                    for from in 1..self.plan.ranks.len() {
                        let offer = crate::ckpt::recv_offer(&mut *r.comm, from)?;
                        let wanted = sv.wanted(done, offer.place, &offer.pieces);
                        let snap = crate::ckpt::take_offer(
                            &mut *r.comm,
                            from,
                            offer,
                            &wanted.map_err(fail)?,
                        )?;
                        sv.deposit(done, snap).map_err(fail)?;
                    }
                }
            }
        }
        let moved = r.comm.counts().without(&before);
        r.meter.saves.merge(&moved);
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
    let run = Run::new(plan, opts, None)?;
    let (world, rank) = (plan.ranks.len(), |comm: Box<D::Comm>| {
        let dev = make(comm.rank()).map_err(derr("device"))?;
        run.rank(dev, comm).map(|(mine, _)| mine)
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
/// process per GPU, NCCL between them): its report and, on rank 0 of a run that
/// keeps its final weights (`--check`), every other rank's after it, so that rank
/// 0 compares every rank's slices and bytes with the reference; and, on rank 0,
/// the checkpoints written. The caller gathers the ranks' losses. It may resume
/// from a checkpoint; with `opts.save`, every rank's state goes to rank 0 at each
/// save, and rank 0 alone prepares the folder and writes (the other ranks'
/// options need only say when).
pub fn train_device_rank<D: Device>(
    plan: &Plan,
    opts: &TrainOptions,
    dev: D,
    comm: Box<D::Comm>,
) -> Result<(Vec<RankReport>, Vec<crate::ckpt::Saved>), ExecError> {
    if comm.world() != plan.ranks.len() {
        return Err(ExecError::Plan(format!(
            "the plan has {} ranks and this launch {}: start one process per rank",
            plan.ranks.len(),
            comm.world()
        )));
    }
    let rank = comm.rank();
    let run = Run::new(plan, opts, Some(rank))?;
    let reports = run.rank(dev, comm);
    let saved = run.saver.map(crate::ckpt::Saver::finish).transpose();
    let (mine, others) = reports.map_err(|e| ExecError::Rank(format!("rank {rank}: {e}")))?;
    let saved = saved.map_err(|e| ExecError::Checkpoint(format!("checkpoint: {e}")))?;
    let reports = std::iter::once(mine).chain(others).collect();
    Ok((reports, saved.unwrap_or_default()))
}

/// Where a launched rank's report counts its bytes: not an axis of the plan's mesh
/// (and sent after the report's counts were taken).
const REPORT_AXIS: &str = "report";

/// A rank's report as it travels to rank 0, its weights' keys and lengths
/// standing for the values that follow.
#[derive(serde::Serialize, serde::Deserialize)]
struct Sent {
    rank: usize,
    loss_parts: Vec<f64>,
    steps_at: (f64, Vec<f64>),
    clock0_unix_s: f64,
    state_bytes: f64,
    peak_activation_bytes: f64,
    expert_slots: (u64, u64),
    device_memory_bytes: Option<f64>,
    counts: Vec<(crate::comm::CommKind, String, crate::comm::KindCount)>,
    weights: Vec<(String, u64, usize)>,
    /// The timeline: name, category, start and duration, details.
    spans: Vec<(String, String, f64, f64, serde_json::Value)>,
}

/// Sends `r` to rank 0.
fn send_report<C: Communicator + ?Sized>(comm: &mut C, r: &RankReport) -> Result<(), RankError> {
    let sent = Sent {
        rank: r.rank,
        loss_parts: r.loss_parts.clone(),
        steps_at: r.steps_at.clone(),
        clock0_unix_s: r.clock0_unix_s,
        state_bytes: r.state_bytes,
        peak_activation_bytes: r.peak_activation_bytes,
        expert_slots: r.expert_slots,
        device_memory_bytes: r.device_memory_bytes,
        counts: r.counts.entries(),
        weights: (r.weights.iter())
            .map(|((name, layer), w)| (name.clone(), *layer, w.len()))
            .collect(),
        spans: (r.spans.iter())
            .map(|s| {
                (
                    s.name.clone(),
                    s.cat.into(),
                    s.start_s,
                    s.dur_s,
                    s.args.clone(),
                )
            })
            .collect(),
    };
    let bytes = serde_json::to_vec(&sent).map_err(|e| fail(format!("report: {e}")))?;
    send_bytes(comm, (0, REPORT_AXIS), &bytes)?;
    for w in r.weights.values() {
        send_values(comm, (0, REPORT_AXIS), w)?;
    }
    Ok(())
}

/// The report rank `from` sends with [`send_report`], its times moved to the
/// clock whose zero is `clock0` seconds since the Unix epoch (the receiver's), so
/// that every rank's timeline lines up in one trace.
fn recv_report<C: Communicator + ?Sized>(
    comm: &mut C,
    from: usize,
    clock0: f64,
) -> Result<RankReport, RankError> {
    let bytes = recv_bytes(comm, (from, REPORT_AXIS))?;
    let mut s: Sent =
        serde_json::from_slice(&bytes).map_err(|e| fail(format!("rank {from}'s report: {e}")))?;
    let shift = s.clock0_unix_s - clock0;
    s.steps_at.0 += shift;
    s.steps_at.1.iter_mut().for_each(|t| *t += shift);
    let spans = (s.spans.into_iter())
        .map(|(name, cat, start_s, dur_s, args)| {
            let known = crate::trace::CATEGORIES.iter().find(|c| **c == cat);
            let unknown = || fail(format!("rank {from}'s report: span category `{cat}`"));
            Ok(crate::trace::Span {
                name,
                cat: known.ok_or_else(unknown)?,
                start_s: start_s + shift,
                dur_s,
                args,
            })
        })
        .collect::<Result<Vec<_>, RankError>>()?;
    let mut weights = BTreeMap::new();
    for (name, layer, n) in s.weights {
        weights.insert((name, layer), recv_values(comm, (from, REPORT_AXIS), n)?);
    }
    Ok(RankReport {
        rank: s.rank,
        loss_parts: s.loss_parts,
        weights,
        counts: crate::comm::ByteCounts::from_entries(s.counts),
        steps_at: s.steps_at,
        clock0_unix_s: clock0,
        state_bytes: s.state_bytes,
        peak_activation_bytes: s.peak_activation_bytes,
        expert_slots: s.expert_slots,
        spans,
        device_memory_bytes: s.device_memory_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::ThreadComm;
    use crate::trace::Span;

    /// A report sent by a process whose clock started 0.5 s before the
    /// receiver's arrives on the receiver's clock: every time 0.5 s less.
    #[test]
    fn a_received_report_moves_to_the_receivers_clock() {
        let sent = RankReport {
            rank: 1,
            loss_parts: vec![2.5],
            weights: BTreeMap::from([(("w".to_string(), 0), vec![1.0, 2.0])]),
            counts: crate::comm::ByteCounts::new(),
            steps_at: (0.25, vec![1.0, 2.0]),
            clock0_unix_s: 100.0,
            state_bytes: 8.0,
            peak_activation_bytes: 0.0,
            expert_slots: (0, 0),
            spans: vec![Span {
                name: "fwd mb0 c0".into(),
                cat: "task",
                start_s: 0.75,
                dur_s: 0.125,
                args: serde_json::json!({"step": 0}),
            }],
            device_memory_bytes: None,
        };
        let mut comms = ThreadComm::create(2, None);
        let (mut zero, mut one) = (comms.remove(0), comms.remove(0));
        let got = std::thread::scope(|s| {
            s.spawn(|| send_report(&mut one, &sent).expect("sent"));
            recv_report(&mut zero, 1, 100.5).expect("received")
        });
        assert_eq!(got.steps_at, (-0.25, vec![0.5, 1.5]));
        assert_eq!(got.clock0_unix_s, 100.5);
        assert_eq!(got.spans[0].start_s, 0.25);
        assert_eq!(got.spans[0].dur_s, 0.125);
        assert_eq!(
            (got.spans[0].cat, got.spans[0].args["step"].as_u64()),
            ("task", Some(0))
        );
        assert_eq!(got.weights, sent.weights);
        assert_eq!(got.loss_parts, sent.loss_parts);
    }
}
