//! `--check` of an inference run against its single-rank reference, and its bytes
//! against the plan's.

use super::*;

/// Largest logit difference `--check` accepts, relative to the reference's largest
/// logit magnitude (at least 1): sharded sums round differently in fp32, by about
/// 1e-6 of the magnitude at these sizes.
pub const LOGIT_TOLERANCE: f64 = 1e-4;

/// How far a bf16 run's first logits (the prompt's last position, computed from
/// the same tokens) may lie from the fp32 reference's, relative to the largest
/// reference logit: bf16 keeps 8 bits of mantissa (a relative step of 2^-8 =
/// 3.9e-3 per rounding) and the error grows over the layers. Measured with
/// `Bf16Host` on the Llama test checkpoint: 6.4e-3 on one rank, 8.8e-3 over tp=2;
/// other weights give 1.5 (tests/it/infer.rs, `mixed_precision_inference_*`).
pub const MIXED_LOGIT_TOLERANCE: f64 = 0.05;

/// The largest difference between logits `x` and the reference's `y`, and the
/// scale it is judged against (the largest reference logit, at least 1).
fn logit_gap(x: &[f32], y: &[f32]) -> Result<(f64, f64), String> {
    if x.len() != y.len() {
        return Err(format!(
            "have {} values, the reference's {}",
            x.len(),
            y.len()
        ));
    }
    let scale = y.iter().fold(1.0f64, |m, v| m.max(v.abs() as f64));
    // `f64::max` passes over a NaN: a NaN anywhere makes the gap NaN.
    let d = x
        .iter()
        .zip(y)
        .map(|(p, q)| (p - q).abs() as f64)
        .fold(0.0, |m, v| if v > m || v.is_nan() { v } else { m });
    Ok((d, scale))
}

/// Both runs generated for the same number of requests.
fn same_requests(run: &InferReport, reference: &InferReport) -> Result<(), String> {
    if run.requests.len() != reference.requests.len() {
        return Err(format!(
            "{} requests generated, the reference {}",
            run.requests.len(),
            reference.requests.len()
        ));
    }
    Ok(())
}

/// A check's result: the summary and the worst difference, or every problem
/// found followed by the summary.
fn verdict(
    mut problems: Vec<String>,
    summary: String,
    worst: f64,
) -> Result<(String, f64), String> {
    if problems.is_empty() {
        Ok((summary, worst))
    } else {
        problems.push(summary);
        Err(problems.join("\n"))
    }
}

/// Compares a mixed-precision run with the fp32 single-rank reference: each
/// request's first logits within [`MIXED_LOGIT_TOLERANCE`]. Later tokens may differ
/// (a greedy choice between two near-equal logits can flip, and the runs then
/// diverge): the summary says how many requests kept the reference's tokens.
/// Returns the summary and the largest absolute first-logit difference.
pub fn check_inference_mixed(
    run: &InferReport,
    reference: &InferReport,
) -> Result<(String, f64), String> {
    same_requests(run, reference)?;
    let mut problems = Vec::new();
    let (mut worst, mut worst_rel): (f64, f64) = (0.0, 0.0);
    for (i, (a, b)) in run.requests.iter().zip(&reference.requests).enumerate() {
        let (d, scale) = match logit_gap(&a.first_logits, &b.first_logits) {
            Ok(gap) => gap,
            Err(why) => {
                problems.push(format!("request {i}: first logits {why}"));
                continue;
            }
        };
        worst = worst.max(d);
        worst_rel = worst_rel.max(d / scale);
        if d > MIXED_LOGIT_TOLERANCE * scale || !d.is_finite() {
            problems.push(format!(
                "request {i}: first logits differ by up to {d:.3e} ({:.3e} of the largest; tolerance {MIXED_LOGIT_TOLERANCE})",
                d / scale
            ));
        }
    }
    let same = run
        .requests
        .iter()
        .zip(&reference.requests)
        .filter(|(a, b)| a.tokens == b.tokens)
        .count();
    let summary = format!(
        "first logits within {worst_rel:.3e} of the largest reference logit (tolerance {MIXED_LOGIT_TOLERANCE}); {same} of {} requests generated the reference's tokens",
        run.requests.len()
    );
    verdict(problems, summary, worst)
}

/// Compares a run with its single-rank reference: every request's tokens must be
/// equal, its first and last logits within [`LOGIT_TOLERANCE`]. Returns the summary
/// line (and the worst difference) or every difference found.
pub fn check_inference(
    run: &InferReport,
    reference: &InferReport,
) -> Result<(String, f64), String> {
    let mut problems = Vec::new();
    let mut worst: f64 = 0.0;
    let mut worst_rel: f64 = 0.0;
    same_requests(run, reference)?;
    for (i, (a, b)) in run.requests.iter().zip(&reference.requests).enumerate() {
        if a.tokens != b.tokens {
            problems.push(format!(
                "request {i}: tokens {:?} differ from the reference's {:?}",
                a.tokens, b.tokens
            ));
        }
        for (x, y, what) in [
            (&a.first_logits, &b.first_logits, "first"),
            (&a.logits, &b.logits, "last"),
        ] {
            let (d, scale) = match logit_gap(x, y) {
                Ok(gap) => gap,
                Err(why) => {
                    problems.push(format!("request {i}: {what} logits {why}"));
                    continue;
                }
            };
            worst = worst.max(d);
            worst_rel = worst_rel.max(d / scale);
            if d > LOGIT_TOLERANCE * scale || !d.is_finite() {
                problems.push(format!(
                    "request {i}: {what} logits differ by up to {d:.3e} (tolerance {:.1e})",
                    LOGIT_TOLERANCE * scale
                ));
            }
        }
    }
    let summary = format!(
        "tokens equal on {} requests; largest logit difference {worst:.3e} ({worst_rel:.3e} of the largest logit; tolerance {LOGIT_TOLERANCE:.0e})",
        run.requests.len()
    );
    verdict(problems, summary, worst)
}

/// Bytes each rank sent against the plan's programs, when the run has the plan's
/// shapes (every prompt `prompt_len` tokens, each replica decoding the plan's batch):
/// `None` otherwise. Per rank: its prefill phase once per request it served, its
/// decode phase once per step after the first token; the last stage also sends the
/// sampled tokens back to the first (4 bytes per request and step), which the plan
/// does not list. Expert-parallel bytes that follow the router
/// ([`InferReport::routed_ep_bytes`]) are left out, as training reports rather than
/// compares those of dropless experts ([`routed_ep_summary`] says what they were).
pub fn byte_mismatches(plan: &Plan, opts: &InferOptions, run: &InferReport) -> Option<Vec<String>> {
    let pool = PoolBytes {
        plan,
        counts: &run.counts,
        routed_ep: &run.routed_ep_bytes,
        prefill: true,
        decode: true,
        name: "",
        base: 0,
    };
    pool.mismatches(opts)
}

/// One pool's ranks of a run, for comparing their bytes with its plan's.
pub(crate) struct PoolBytes<'a> {
    pub(crate) plan: &'a Plan,
    /// Per rank of the plan, what it sent.
    pub(crate) counts: &'a [ByteCounts],
    /// Per rank of the plan, [`InferReport::routed_ep_bytes`].
    pub(crate) routed_ep: &'a [(f64, f64)],
    /// Whether its ranks prefilled their requests.
    pub(crate) prefill: bool,
    /// Whether its ranks decoded them.
    pub(crate) decode: bool,
    /// The pool's name in messages (`"prefill pool "`, or empty).
    pub(crate) name: &'a str,
    /// World rank of the plan's rank 0.
    pub(crate) base: usize,
}

impl PoolBytes<'_> {
    /// Every rank's difference from the plan's bytes on each axis (see
    /// [`byte_mismatches`]); `None` when the run does not have the plan's shapes.
    pub(crate) fn mismatches(&self, opts: &InferOptions) -> Option<Vec<String>> {
        let plan = self.plan;
        let meshplan_ir::Workload::Inference { prompt_len, .. } = plan.workload else {
            return None;
        };
        if opts.requests.iter().any(|r| r.len() as u64 != prompt_len) {
            return None;
        }
        let size = |axis: &str| crate::program::mesh_place(plan, &[], axis).size;
        let (dp, pp) = (size("dp").max(1), size("pp"));
        let mut out = Vec::new();
        for (rank, counts) in self.counts.iter().enumerate() {
            let entry = plan.ranks.get(rank)?;
            let program = plan.programs.get(entry.program as usize)?;
            let dp_index = crate::program::mesh_place(plan, &entry.coords, "dp").rank;
            let served = (0..opts.requests.len())
                .filter(|i| i % dp == dp_index)
                .count();
            let phase = |k: PhaseKind| program.phases.iter().find(|p| p.kind == k);
            let (pre, dec) = (phase(PhaseKind::Prefill)?, phase(PhaseKind::Decode)?);
            if self.decode && served > 0 && dec.dims.batch as usize != served {
                return None;
            }
            let passes = if self.prefill { served as f64 } else { 0.0 };
            let steps = if self.decode && served > 0 {
                opts.max_new_tokens as f64 - 1.0
            } else {
                0.0
            };
            let (p, d) = (pre.bytes_sent(), dec.bytes_sent());
            for ax in Axis::ALL {
                let mut want = passes * p.get(ax) + steps * d.get(ax);
                if ax == Axis::Pp && pp > 1 && program.stage + 1 == pp as u64 {
                    want += steps * served as f64 * plan.model.dtype.size_bytes() as f64;
                }
                let mut got = counts.axis_bytes_sent(ax.name());
                if ax == Axis::Ep {
                    let (sent, planned) = self.routed_ep.get(rank).copied().unwrap_or_default();
                    got -= sent;
                    want -= planned;
                }
                let label = format!("{}rank {} {}", self.name, self.base + rank, ax.name());
                out.extend(crate::comm::byte_gap(label, got, want));
            }
        }
        Some(out)
    }
}

/// One line on the expert-parallel bytes that followed the router (left out of
/// [`byte_mismatches`]): the busiest rank's bytes beside the plan's figure for the
/// same passes under balanced routing; `None` when there were none.
pub fn routed_ep_summary(run: &InferReport) -> Option<String> {
    let (rank, &(sent, planned)) = run
        .routed_ep_bytes
        .iter()
        .enumerate()
        .max_by(|a, b| a.1 .0.total_cmp(&b.1 .0))?;
    (sent > 0.0 || planned > 0.0).then(|| {
        format!(
            "expert-parallel bytes that follow the router (dropless routing, decode steps): rank {rank} sent {sent}, the plan's balanced routing {planned}; not compared"
        )
    })
}
