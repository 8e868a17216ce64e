//! Training runs: their options and reports, [`train`] on the CPU (the device
//! interpreter, `device::train`, on the fp32 host device), `--check` against a
//! single-rank run and the byte comparison with the plan.

use crate::comm::{ByteCounts, RankError};
use crate::program::{layer_label, rank_slice};
use meshplan_ir::plan::{Axis, Plan};
use meshplan_ir::Workload;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Knobs of a training run.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// Optimizer steps.
    pub steps: u64,
    /// Seed of the weights and the synthetic data.
    pub seed: u64,
    /// AdamW learning rate.
    pub lr: f32,
    /// A wait in the in-process world longer than this fails the run; `None`:
    /// no limit, since a rank may compute for minutes between two collectives
    /// (a deadlock fails at once either way).
    pub timeout: Option<Duration>,
    /// For tests: this rank fails at this step.
    pub fail_at: Option<(usize, u64)>,
    /// Tokens of an expert-capacity group; `None`: the plan's
    /// (`meshplan_ir::graph::capacity_group_tokens`). The single-rank reference of a plan takes the plan's, so
    /// that both drop the same tokens ([`TrainOptions::reference_of`]).
    pub moe_group_tokens: Option<usize>,
    /// Where the tokens come from.
    pub data: crate::data::DataSource,
    /// Record a timeline of spans per rank ([`RankReport::spans`]).
    pub trace: bool,
    /// Write checkpoints.
    pub save: Option<crate::ckpt::SaveOptions>,
    /// Start from this checkpoint (its weights, AdamW state and step) and run up
    /// to `steps` steps in all.
    pub resume: Option<Arc<crate::ckpt::Checkpoint>>,
    /// Told by rank 0 after each step how many steps this run has done (a progress
    /// bar; the executor knows nothing of terminals).
    pub on_step: Option<StepHook>,
    /// Start from a Hugging Face checkpoint's weights (fine-tuning) instead of the
    /// seeded initialisation; each rank reads its own slice.
    pub weights: Option<Arc<crate::weights::Checkpoint>>,
    /// Kernel threads of each rank (its own pool; 1: the rank's thread alone).
    /// The results do not depend on it.
    pub threads_per_rank: usize,
    /// Hand every rank's final weights back in [`RankReport::weights`] (what a
    /// comparison with the reference reads). A run that only reports leaves them
    /// where they are: a copy of every data-parallel replica's weights on the host
    /// (downloaded from each GPU, and gathered first under ZeRO-3) can outweigh
    /// the whole run.
    pub final_weights: bool,
}

/// A callback with the work done so far: the training steps done
/// ([`TrainOptions::on_step`]), or the tokens generated
/// ([`crate::infer::InferOptions::on_token`]).
#[derive(Clone)]
pub struct StepHook(pub Arc<dyn Fn(u64) + Send + Sync>);

impl std::fmt::Debug for StepHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepHook")
    }
}

impl TrainOptions {
    /// These options for the single-rank reference of `plan`: the same capacity
    /// groups (a capacity group is part of what the model computes).
    pub fn reference_of(&self, plan: &Plan) -> TrainOptions {
        let st = &plan.strategy;
        let seq = match &plan.workload {
            Workload::Train { seq_len, .. } => *seq_len,
            _ => 0,
        };
        let group = meshplan_ir::graph::capacity_group_tokens(seq, st.cp, st.tp, st.ep);
        TrainOptions {
            moe_group_tokens: self.moe_group_tokens.or(Some(group as usize)),
            // The reference resumes from the same checkpoint but writes none.
            save: None,
            on_step: None,
            final_weights: true,
            ..self.clone()
        }
    }
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            steps: 5,
            seed: 1234,
            lr: 3e-3,
            timeout: None,
            fail_at: None,
            moe_group_tokens: None,
            data: crate::data::DataSource::Synthetic,
            trace: false,
            save: None,
            resume: None,
            on_step: None,
            weights: None,
            threads_per_rank: 1,
            final_weights: true,
        }
    }
}

/// Weight key: tensor name and layer (`u64::MAX` outside the repeated blocks).
pub type Key = (String, u64);

/// Outside the blocks.
pub(crate) const NO_LAYER: u64 = u64::MAX;

/// What one rank reports.
#[derive(Clone, Debug)]
pub struct RankReport {
    /// Global rank.
    pub rank: usize,
    /// Its share of each step's loss (non-zero on loss-owning ranks only).
    pub loss_parts: Vec<f64>,
    /// Its local weights after the last step (none unless
    /// [`TrainOptions::final_weights`]).
    pub weights: BTreeMap<Key, Vec<f32>>,
    /// Bytes it sent, per collective kind and axis, over the training steps.
    pub counts: ByteCounts,
    /// When this rank began its first step and ended each step, in seconds on the
    /// run's clock (shared by the ranks of one process).
    pub steps_at: (f64, Vec<f64>),
    /// The run clock's zero in seconds since the Unix epoch: lines up the clocks of
    /// separate processes (one per GPU), exactly on one node, to the system clocks'
    /// agreement across nodes.
    pub clock0_unix_s: f64,
    /// Bytes of weights, their gradients and optimizer state held at the end.
    pub state_bytes: f64,
    /// Most bytes of activations (and kept kernel statistics) held at once.
    pub peak_activation_bytes: f64,
    /// Token-to-expert assignments routed by this rank, and of those the ones over
    /// an expert's capacity (they skip that expert), over all steps and passes.
    pub expert_slots: (u64, u64),
    /// Measured spans, when tracing.
    pub spans: Vec<crate::trace::Span>,
    /// Most device memory the driver reported in use (all of the device's users),
    /// sampled after each forward task; `None` off a GPU.
    pub device_memory_bytes: Option<f64>,
}

/// A whole run.
#[derive(Clone, Debug)]
pub struct TrainReport {
    /// Mean loss over the global batch, per step.
    pub losses: Vec<f64>,
    /// Wall seconds per step: from the end of the previous step on the slowest
    /// rank (the first step: from the first rank's start) to this step's end on the
    /// slowest rank, so that they add up to the wall-clock time of the steps.
    pub step_s: Vec<f64>,
    /// Tokens per step (whole cluster).
    pub tokens_per_step: u64,
    /// Per rank, in rank order.
    pub ranks: Vec<RankReport>,
    /// Checkpoints written, in step order.
    pub saved: Vec<crate::ckpt::Saved>,
    /// The AdamW learning rate the run stepped with: the scale of its updates.
    pub lr: f64,
}

/// Why a run could not start, or did not finish. Each variant's message names what
/// went wrong and what to do; a caller matches the variant to decide (the binary
/// maps a refused plan or token file to the user's input, exit code 2, and the
/// rest to a runtime failure, 1).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExecError {
    /// The plan, or the options given with it, cannot run here.
    #[error("{0}")]
    Plan(String),
    /// A checkpoint to resume or fine-tune from does not fit, or one being
    /// written failed.
    #[error("{0}")]
    Checkpoint(String),
    /// A file the run reads (a token file to train on, a checkpoint's tensors)
    /// cannot be used: the message names the file and the fix.
    #[error("{0}")]
    Data(String),
    /// A rank failed: which, why, and where the others waited.
    #[error("{0}")]
    Rank(String),
    /// The run finished but its result is unusable (a request no rank produced,
    /// non-finite logits).
    #[error("{0}")]
    Output(String),
}

impl ExecError {
    /// The message, as printed.
    pub fn message(&self) -> &str {
        match self {
            ExecError::Plan(m)
            | ExecError::Checkpoint(m)
            | ExecError::Data(m)
            | ExecError::Rank(m)
            | ExecError::Output(m) => m,
        }
    }
}

/// Every rank's result, or the world's failure in one message.
pub(crate) fn rank_outs<T>(results: Vec<Result<T, RankError>>) -> Result<Vec<T>, ExecError> {
    if let Some(summary) = crate::comm::failure_summary(&results) {
        // Bad input whichever rank failed first: the run cannot succeed on it.
        let input = results.iter().find_map(|r| match r {
            Err(RankError::Input(m)) => Some(m.clone()),
            _ => None,
        });
        return Err(input.map_or(ExecError::Rank(summary), ExecError::Data));
    }
    results
        .into_iter()
        .map(|r| r.map_err(|e| ExecError::Rank(e.to_string())))
        .collect()
}

pub(crate) fn fail(msg: impl Into<String>) -> RankError {
    RankError::Failed(msg.into())
}

/// Runs the plan's training programs for `opts.steps` steps on the CPU in fp32:
/// the device interpreter on [`crate::device::HostDevice`], every rank a thread.
pub fn train(plan: &Plan, opts: &TrainOptions) -> Result<TrainReport, ExecError> {
    crate::device::train::train_device(plan, opts, &|_| Ok(crate::device::HostDevice))
}

/// Each step's wall time on the run's clock (see [`TrainReport::step_s`]): the
/// gaps between the slowest rank's step ends, the first from the first rank's
/// start. A rank's own step time would count its waits on the others at the start
/// of a step again, and the slowest rank of each step is not the same rank.
pub(crate) fn run_step_times(ranks: &[RankReport], steps: usize) -> Vec<f64> {
    let spans: Vec<(f64, &[f64])> = ranks
        .iter()
        .map(|r| (r.steps_at.0, r.steps_at.1.as_slice()))
        .collect();
    step_times(&spans, steps)
}

/// [`run_step_times`] over each rank's `(start, step ends)` on one clock.
pub(crate) fn step_times(spans: &[(f64, &[f64])], steps: usize) -> Vec<f64> {
    let mut prev = spans.iter().map(|r| r.0).fold(f64::INFINITY, f64::min);
    (0..steps)
        .map(|s| {
            let end = spans
                .iter()
                .filter_map(|r| r.1.get(s))
                .fold(f64::NEG_INFINITY, |a, &b| a.max(b));
            let dt = (end - prev).max(0.0);
            prev = end;
            dt
        })
        .collect()
}

/// The Unix time at which the monotonic clock read `t0`.
pub(crate) fn clock0_unix_s(t0: Instant) -> f64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    now - t0.elapsed().as_secs_f64()
}

/// The step a run resumed from `ck` starts at, once the checkpoint is known to fit
/// the plan's model and the run's data.
pub fn check_resume(
    plan: &Plan,
    opts: &TrainOptions,
    ck: &crate::ckpt::Checkpoint,
) -> Result<u64, ExecError> {
    let err = ExecError::Checkpoint;
    ck.check_model(&plan.graph).map_err(err)?;
    let (m, dir) = (ck.manifest(), ck.dir().display());
    if m.seed != opts.seed {
        return Err(err(format!(
            "{dir}: saved with seed {}, this run uses {} (the data would not continue)",
            m.seed, opts.seed
        )));
    }
    // The data continue only on the same tokens (a moved file is fine; checkpoints
    // from before the tokens' SHA-256 was recorded are matched by their count).
    let now = opts.data.describe();
    let same = |k: &str| m.data.get(k).unwrap_or(&serde_json::Value::Null) == &now[k];
    let digest = m.data.get("sha256").is_none() || same("sha256");
    if !same("source") || !same("tokens") || !digest {
        return Err(err(format!(
            "{dir}: saved while training on {}, this run reads {now} (the data would not continue); give the same --data",
            m.data
        )));
    }
    // A token file's windows follow from the sequence length and the batch: other
    // values would revisit windows of the epoch and skip others.
    if let Workload::Train {
        seq_len,
        global_batch,
        ..
    } = plan.workload
    {
        let was = |k: &str| m.workload.get(k).and_then(serde_json::Value::as_u64);
        let saved = (was("seq_len"), was("global_batch"));
        if now["source"] == "file" && saved != (Some(seq_len), Some(global_batch)) {
            return Err(err(format!(
                "{dir}: saved training on the token file with workload {}, this plan has seq_len {seq_len} and global_batch {global_batch}, which read the file's windows in another order (the data would not continue); plan the saved seq_len and global_batch",
                m.workload
            )));
        }
    }
    if m.step >= opts.steps {
        return Err(err(format!(
            "{dir}: the checkpoint has done {} steps; ask for more than that in all",
            m.step
        )));
    }
    Ok(m.step)
}

/// Largest distance allowed between a rank's final weight tensor and the reference's
/// same slice, as the root mean square of the element differences over the farthest
/// an AdamW update can move one element in the run (`lr` per step, times the steps).
///
/// A per-element bound measures the optimizer, not the run: AdamW divides each
/// gradient by its own running magnitude, so where a gradient sums to nearly zero the
/// rounding of a sharded sum (another order of the same additions) flips its sign and
/// moves that element by up to `2 lr` per step (the old 1e-4 per-element bound failed
/// correct runs so). Measured over the generated mode matrix (`tests/it/matrix.rs`:
/// 141 configurations, 5 steps at lr 3e-3), correct runs stay at or under 3.9e-4;
/// the wrong runs it caught measure 0.685 (sequence-parallel norm gradients not
/// summed under ZeRO-3, whose losses stayed within 7.3e-6) and 0.093 (ZeRO-3 expert
/// weights reported one update old).
pub const PARAM_TOLERANCE: f64 = 1e-2;

/// One weight tensor of one rank against the reference: `(rms of the differences,
/// largest difference, its index)`.
pub fn tensor_distance(local: &[f32], want: &[f32]) -> (f64, f64, usize) {
    let (mut sum2, mut worst, mut at) = (0.0f64, 0.0f64, 0usize);
    for (i, (a, b)) in local.iter().zip(want).enumerate() {
        let d = (a - b).abs() as f64;
        sum2 += d * d;
        if d > worst || d.is_nan() {
            (worst, at) = (d, i);
        }
    }
    ((sum2 / local.len().max(1) as f64).sqrt(), worst, at)
}

/// Each step's loss against the reference's, as report lines, and the worst
/// relative difference: NaN when any is NaN, so that it is never within a
/// tolerance.
pub(crate) fn loss_lines(run: &TrainReport, reference: &TrainReport) -> (Vec<String>, f64) {
    let mut lines = Vec::new();
    let mut worst: f64 = 0.0;
    for (i, (a, b)) in run.losses.iter().zip(&reference.losses).enumerate() {
        let rel = (a - b).abs() / b.abs().max(1e-12);
        worst = if rel.is_nan() || worst.is_nan() {
            f64::NAN
        } else {
            worst.max(rel)
        };
        lines.push(format!(
            "step {i}: loss {a:.6} vs reference {b:.6} (rel {rel:.2e})"
        ));
    }
    (lines, worst)
}

/// One weight a rank of a run holds, beside the same slice of its single-rank
/// reference's.
pub(crate) struct WeightSlice<'r> {
    pub rank: usize,
    pub name: &'r str,
    pub layer: u64,
    pub local: &'r [f32],
    pub want: Vec<f32>,
}

/// Calls `f` on every weight every rank of `run` holds, with the reference's
/// slice of it (a sharded rank holds a slice: it is compared with the same one).
pub(crate) fn each_weight_slice<'r>(
    plan: &Plan,
    run: &'r TrainReport,
    reference: &'r TrainReport,
    mut f: impl FnMut(WeightSlice<'r>) -> Result<(), String>,
) -> Result<(), String> {
    let refw = &reference
        .ranks
        .first()
        .ok_or("the reference has no rank")?
        .weights;
    for rep in &run.ranks {
        for ((name, layer), local) in &rep.weights {
            let full = refw
                .get(&(name.clone(), *layer))
                .ok_or_else(|| format!("the reference lacks `{name}`{}", layer_label(*layer)))?;
            let want = rank_slice(plan, rep.rank, name, full)?;
            if want.len() != local.len() {
                return Err(format!(
                    "rank {}: `{name}` has {} values, the reference's slice {}",
                    rep.rank,
                    local.len(),
                    want.len()
                ));
            }
            let (rank, layer) = (rep.rank, *layer);
            f(WeightSlice {
                rank,
                name,
                layer,
                local,
                want,
            })?;
        }
    }
    Ok(())
}

/// Compares a run with its single-rank reference: per-step losses (relative) and
/// every rank's final weights against the reference's sliced the same way
/// ([`PARAM_TOLERANCE`]).
pub fn check_against(
    plan: &Plan,
    run: &TrainReport,
    reference: &TrainReport,
    tolerance: f64,
) -> Result<Vec<String>, String> {
    let (mut lines, worst_loss) = loss_lines(run, reference);
    // The farthest one element can move: the scale the distances are measured in.
    let reach = run.lr.abs() * run.losses.len().max(1) as f64;
    let mut worst = (0.0f64, String::new());
    each_weight_slice(plan, run, reference, |w| {
        let (local, want) = (w.local, &w.want);
        let (rms, max, at) = tensor_distance(local, want);
        let rel = rms / reach.max(f64::MIN_POSITIVE);
        if rel > worst.0 || rel.is_nan() {
            let (rank, name, layer) = (w.rank, w.name, layer_label(w.layer));
            worst = (
                rel,
                format!(
                    "rank {rank} `{name}`{layer} (rms {rms:.2e}; largest {max:.2e} at [{at}]: {} vs {})",
                    local[at], want[at]
                ),
            );
        }
        Ok(())
    })?;
    lines.push(format!(
        "worst relative loss difference {worst_loss:.2e} (tolerance {tolerance:.0e}); weights at most {:.2e} of lr x steps away (tolerance {PARAM_TOLERANCE:.0e}), at {}",
        worst.0, worst.1
    ));
    // A NaN anywhere fails too: it is never within a tolerance.
    let within = |x: f64, tol: f64| x <= tol;
    if !within(worst_loss, tolerance) || !within(worst.0, PARAM_TOLERANCE) {
        return Err(lines.join("\n"));
    }
    Ok(lines)
}

/// Bytes sent per rank and axis, summed over kinds, against the plan's prediction
/// for `steps` steps: every difference.
pub fn byte_mismatches(plan: &Plan, run: &TrainReport, steps: u64) -> Vec<String> {
    let mut out = Vec::new();
    for rep in &run.ranks {
        let entry = &plan.ranks[rep.rank];
        let Some(program) = plan.programs.get(entry.program as usize) else {
            out.push(format!("rank {}: no program", rep.rank));
            continue;
        };
        let sent: Vec<_> = program.phases.iter().map(|p| p.bytes_sent()).collect();
        for axis in Axis::ALL {
            let want = sent.iter().fold(0.0, |a, b| a + b.get(axis));
            let got = rep.counts.axis_bytes_sent(axis.name());
            let label = format!("rank {} {}", rep.rank, axis.name());
            out.extend(crate::comm::byte_gap(label, got, want * steps as f64));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{loss_lines, run_step_times, RankReport, TrainReport};

    fn report(losses: &[f64]) -> TrainReport {
        TrainReport {
            losses: losses.to_vec(),
            step_s: Vec::new(),
            tokens_per_step: 0,
            ranks: Vec::new(),
            saved: Vec::new(),
            lr: 0.0,
        }
    }

    /// Losses 2.0 and 1.1 against 2.0 and 1.0 (hand-worked): relative differences
    /// 0 and 0.1. A NaN at any step, earlier or later than a finite one, leaves the
    /// worst NaN, which no tolerance admits.
    #[test]
    fn the_worst_loss_difference_keeps_a_nan_from_any_step() {
        let (lines, worst) = loss_lines(&report(&[2.0, 1.1]), &report(&[2.0, 1.0]));
        assert_eq!(lines.len(), 2);
        assert!((worst - 0.1).abs() < 1e-12, "{worst}");
        let (_, worst) = loss_lines(&report(&[f64::NAN, 1.1]), &report(&[2.0, 1.0]));
        assert!(worst.is_nan());
        let (_, worst) = loss_lines(&report(&[2.0, f64::NAN]), &report(&[2.0, 1.0]));
        assert!(worst.is_nan());
    }

    fn rank(start: f64, ends: &[f64]) -> RankReport {
        RankReport {
            rank: 0,
            loss_parts: Vec::new(),
            weights: Default::default(),
            counts: Default::default(),
            steps_at: (start, ends.to_vec()),
            clock0_unix_s: 0.0,
            state_bytes: 0.0,
            peak_activation_bytes: 0.0,
            expert_slots: (0, 0),
            spans: Vec::new(),
            device_memory_bytes: None,
        }
    }

    #[test]
    fn step_times_add_up_to_the_wall_clock() {
        // Rank 1 starts first (0.0) and is slowest at steps 0 and 2, rank 0 at
        // step 1: steps end at 1.5, 2.2 and 3.1, so they take 1.5, 0.7 and 0.9 s,
        // 3.1 s in all, the wall time from the first start to the last end. Each
        // rank's own step times (0.9, 1.2, 0.8 and 1.5, 0.6, 1.0), maximised per
        // step, would give 1.5 + 1.2 + 1.0 = 3.7 s: a rank that waited for the
        // other at the end of one step starts the next late and is counted again.
        let ranks = [rank(0.1, &[1.0, 2.2, 3.0]), rank(0.0, &[1.5, 2.1, 3.1])];
        let s = run_step_times(&ranks, 3);
        let want = [1.5, 0.7, 0.9];
        for (a, b) in s.iter().zip(want) {
            assert!((a - b).abs() < 1e-12, "{s:?}");
        }
        assert!((s.iter().sum::<f64>() - 3.1).abs() < 1e-12);
    }
}
