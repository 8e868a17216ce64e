//! The step as the estimate schedules it, span by span: what pictures and the
//! predicted Chrome trace draw. A timeline holds the simulation's inputs (a few
//! numbers per stage, so a plan file can carry it) and [`Timeline::spans`] replays
//! the cost model's own schedule from them: for training the pipeline simulation of
//! [`crate::pipeline`], for inference the stage-after-stage prefill and decode step of
//! [`crate::estimate_inference`].

use crate::memory::MemoryLedger;
use crate::pipeline::{simulate_timeline, PipelineInput};
use meshplan_ir::Schedule;
use serde::{Deserialize, Serialize};

/// What happens on one pipeline stage after its last backward, once per step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageTail {
    /// Gradient reduction over the data axis not hidden behind the backward.
    pub exposed_dp_s: f64,
    /// The tensor-axis AllReduce of gradients sequence parallelism leaves partial.
    pub sp_sync_s: f64,
    /// The optimizer update and the framework's host work per step
    /// (`calib::STEP_OVERHEAD_S`).
    pub optimizer_s: f64,
    /// Memory of each GPU of the stage.
    pub memory: MemoryLedger,
}

/// One training step's schedule inputs, as the estimate used them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainTimeline {
    /// Pipeline stages.
    pub pp: usize,
    /// Model chunks per stage.
    pub vpp: usize,
    /// Micro-batches per step.
    pub microbatches: usize,
    /// Pipeline schedule.
    pub schedule: Schedule,
    /// Forward time of one micro-batch per virtual stage (`chunk * pp + stage`),
    /// communication included.
    pub forward_s: Vec<f64>,
    /// Backward time (recomputation included) per virtual stage.
    pub backward_s: Vec<f64>,
    /// The part of `forward_s` spent in collectives.
    pub forward_comm_s: Vec<f64>,
    /// The part of `backward_s` spent in collectives.
    pub backward_comm_s: Vec<f64>,
    /// One activation (or gradient) transfer between consecutive virtual stages.
    pub p2p_s: f64,
    /// Per stage: its step tail and memory.
    pub stages: Vec<StageTail>,
    /// The stage whose compute and communication the estimate's breakdown reports.
    pub critical_stage: usize,
    /// The estimate's step time: the pipeline's makespan plus the longest tail.
    pub step_s: f64,
    /// GPU memory capacity, bytes.
    pub memory_capacity_bytes: f64,
}

/// One inference request's prefill and one decode step, as the estimate assumed them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct InferenceTimeline {
    /// Pipeline stages.
    pub pp: usize,
    /// Prefill forward per stage, communication included.
    pub prefill_s: Vec<f64>,
    /// The part of `prefill_s` spent in collectives.
    pub prefill_comm_s: Vec<f64>,
    /// One decode step's forward per stage.
    pub decode_s: Vec<f64>,
    /// The part of `decode_s` spent in collectives.
    pub decode_comm_s: Vec<f64>,
    /// Transfer of the prompt's activations to the next stage.
    pub hop_prefill_s: f64,
    /// Transfer of one decode step's activations to the next stage.
    pub hop_decode_s: f64,
    /// Memory of each GPU, per stage.
    pub memory: Vec<MemoryLedger>,
    /// Time to first token (the prefill's end).
    pub ttft_s: f64,
    /// Time per output token (one decode step).
    pub tpot_s: f64,
    /// GPU memory capacity, bytes.
    pub memory_capacity_bytes: f64,
}

/// The schedule of a plan, training or inference.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Timeline {
    /// A training step.
    Train(TrainTimeline),
    /// A prefill and a decode step.
    Inference(InferenceTimeline),
}

/// What a span is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpanKind {
    /// A micro-batch's forward through a chunk.
    Forward,
    /// A micro-batch's backward through a chunk.
    Backward,
    /// Inference: the prompt's forward through a stage.
    Prefill,
    /// Inference: one decode step's forward through a stage.
    Decode,
    /// An activation on its way to the next stage.
    SendAct,
    /// A gradient on its way to the previous stage.
    SendGrad,
    /// Gradient reduction over the data axis left exposed after the backward.
    DpComm,
    /// The tensor-axis AllReduce of partial gradients (sequence parallelism).
    TpSync,
    /// The optimizer update.
    Optimizer,
    /// The stage waits.
    Bubble,
}

impl SpanKind {
    /// The Chrome trace category (`compute`, `comm`, `p2p`, `bubble`, `optimizer`).
    pub fn category(self) -> &'static str {
        match self {
            SpanKind::Forward | SpanKind::Backward | SpanKind::Prefill | SpanKind::Decode => {
                "compute"
            }
            SpanKind::SendAct | SpanKind::SendGrad => "p2p",
            SpanKind::DpComm | SpanKind::TpSync => "comm",
            SpanKind::Optimizer => "optimizer",
            SpanKind::Bubble => "bubble",
        }
    }
}

/// Which track of a stage a span runs on: its compute stream, or the transfers to
/// its neighbours (which overlap the compute).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Lane {
    /// Kernels (and the collectives inside them).
    Compute,
    /// Point-to-point sends to the neighbouring stage.
    P2p,
}

/// One interval on one stage.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Span {
    /// Pipeline stage.
    pub stage: usize,
    /// Track.
    pub lane: Lane,
    /// What it is.
    pub kind: SpanKind,
    /// Local chunk (0 where not applicable).
    pub chunk: usize,
    /// Micro-batch, where it belongs to one.
    pub mb: Option<usize>,
    /// Start, s.
    pub start_s: f64,
    /// End, s.
    pub end_s: f64,
    /// The part spent in collectives inside the span (tensor, context, expert axes).
    pub comm_s: f64,
}

impl Span {
    /// Duration, s.
    pub fn dur_s(&self) -> f64 {
        self.end_s - self.start_s
    }

    /// The label traces and pictures use: `fwd mb3 c0`, `bwd mb3 c0`,
    /// `send act mb3 c0`, `dp grads`, `optimizer`, `bubble`, ...
    pub fn name(&self) -> String {
        let mb = self.mb.unwrap_or(0);
        let c = self.chunk;
        match self.kind {
            SpanKind::Forward => format!("fwd mb{mb} c{c}"),
            SpanKind::Backward => format!("bwd mb{mb} c{c}"),
            SpanKind::Prefill => "prefill".into(),
            SpanKind::Decode => "decode".into(),
            SpanKind::SendAct if self.mb.is_none() => "send act".into(),
            SpanKind::SendAct => format!("send act mb{mb} c{c}"),
            SpanKind::SendGrad => format!("send grad mb{mb} c{c}"),
            SpanKind::DpComm => "dp grads".into(),
            SpanKind::TpSync => "tp grad sync".into(),
            SpanKind::Optimizer => "optimizer".into(),
            SpanKind::Bubble => "bubble".into(),
        }
    }
}

impl Timeline {
    /// Pipeline stages.
    pub fn pp(&self) -> usize {
        match self {
            Timeline::Train(t) => t.pp,
            Timeline::Inference(t) => t.pp,
        }
    }

    /// Where the timeline ends: the step time (training) or TTFT + TPOT (inference).
    pub fn end_s(&self) -> f64 {
        match self {
            Timeline::Train(t) => t.step_s,
            Timeline::Inference(t) => t.ttft_s + t.tpot_s,
        }
    }

    /// Memory of one GPU of each stage.
    pub fn stage_memory(&self) -> Vec<MemoryLedger> {
        match self {
            Timeline::Train(t) => t.stages.iter().map(|s| s.memory).collect(),
            Timeline::Inference(t) => t.memory.clone(),
        }
    }

    /// GPU memory capacity, bytes.
    pub fn memory_capacity_bytes(&self) -> f64 {
        match self {
            Timeline::Train(t) => t.memory_capacity_bytes,
            Timeline::Inference(t) => t.memory_capacity_bytes,
        }
    }

    /// Checks the shape before replaying (a timeline read from a file may be edited):
    /// the per-stage lists as long as the stages, times finite and not negative.
    pub fn validate(&self) -> Result<(), String> {
        let finite = |name: &str, v: &[f64]| -> Result<(), String> {
            match v.iter().find(|x| !x.is_finite() || **x < 0.0) {
                Some(x) => Err(format!("{name} holds {x}: times must be finite and >= 0")),
                None => Ok(()),
            }
        };
        match self {
            Timeline::Train(t) => {
                if t.pp == 0 || t.vpp == 0 || t.microbatches == 0 {
                    return Err("pp, vpp and microbatches must be at least 1".into());
                }
                let tasks = 2usize
                    .saturating_mul(t.pp)
                    .saturating_mul(t.vpp)
                    .saturating_mul(t.microbatches);
                if tasks > 1 << 22 {
                    return Err(format!(
                        "{tasks} schedule tasks: at most {} are drawn",
                        1 << 22
                    ));
                }
                let nvs = t.pp * t.vpp;
                for (name, v) in [
                    ("forward_s", &t.forward_s),
                    ("backward_s", &t.backward_s),
                    ("forward_comm_s", &t.forward_comm_s),
                    ("backward_comm_s", &t.backward_comm_s),
                ] {
                    if v.len() != nvs {
                        return Err(format!(
                            "{name} has {} entries, expected pp * vpp = {nvs}",
                            v.len()
                        ));
                    }
                    finite(name, v)?;
                }
                if t.stages.len() != t.pp {
                    return Err(format!(
                        "stages has {} entries, expected pp = {}",
                        t.stages.len(),
                        t.pp
                    ));
                }
                if t.critical_stage >= t.pp {
                    return Err(format!(
                        "critical_stage {} is not a stage (pp = {})",
                        t.critical_stage, t.pp
                    ));
                }
                finite("p2p_s", &[t.p2p_s, t.step_s])?;
                for s in &t.stages {
                    finite("stages", &[s.exposed_dp_s, s.sp_sync_s, s.optimizer_s])?;
                }
            }
            Timeline::Inference(t) => {
                if t.pp == 0 {
                    return Err("pp must be at least 1".into());
                }
                for (name, v) in [
                    ("prefill_s", &t.prefill_s),
                    ("prefill_comm_s", &t.prefill_comm_s),
                    ("decode_s", &t.decode_s),
                    ("decode_comm_s", &t.decode_comm_s),
                ] {
                    if v.len() != t.pp {
                        return Err(format!(
                            "{name} has {} entries, expected pp = {}",
                            v.len(),
                            t.pp
                        ));
                    }
                    finite(name, v)?;
                }
                if t.memory.len() != t.pp {
                    return Err(format!(
                        "memory has {} entries, expected pp = {}",
                        t.memory.len(),
                        t.pp
                    ));
                }
                finite(
                    "hop",
                    &[t.hop_prefill_s, t.hop_decode_s, t.ttft_s, t.tpot_s],
                )?;
            }
        }
        Ok(())
    }

    /// Every span of every stage: tasks in the order the schedule runs them, their
    /// sends on the p2p lane, the step tail, and the waits between (bubbles), so that
    /// each stage's compute lane covers `0..end_s()` exactly. Call
    /// [`Timeline::validate`] first on a timeline read from a file.
    pub fn spans(&self) -> Vec<Span> {
        match self {
            Timeline::Train(t) => train_spans(t),
            Timeline::Inference(t) => inference_spans(t),
        }
    }
}

fn span(stage: usize, kind: SpanKind, start_s: f64, end_s: f64) -> Span {
    Span {
        stage,
        lane: Lane::Compute,
        kind,
        chunk: 0,
        mb: None,
        start_s,
        end_s,
        comm_s: 0.0,
    }
}

/// Adds bubbles where a stage's compute lane is idle in `0..end`.
fn fill_bubbles(pp: usize, end: f64, spans: &mut Vec<Span>) {
    let mut bubbles = Vec::new();
    for stage in 0..pp {
        let mut busy: Vec<(f64, f64)> = spans
            .iter()
            .filter(|s| s.stage == stage && s.lane == Lane::Compute)
            .map(|s| (s.start_s, s.end_s))
            .collect();
        busy.sort_by(|a, b| a.0.total_cmp(&b.0));
        // Gaps of rounding size are not waits.
        let eps = 1e-12 * end.abs();
        let mut t = 0.0;
        for (a, b) in busy {
            if a > t + eps {
                bubbles.push(span(stage, SpanKind::Bubble, t, a));
            }
            t = t.max(b);
        }
        if end > t + eps {
            bubbles.push(span(stage, SpanKind::Bubble, t, end));
        }
    }
    spans.extend(bubbles);
}

fn train_spans(t: &TrainTimeline) -> Vec<Span> {
    let (_, tasks) = simulate_timeline(&PipelineInput {
        pp: t.pp,
        vpp: t.vpp,
        microbatches: t.microbatches,
        forward_s: &t.forward_s,
        backward_s: &t.backward_s,
        p2p_s: t.p2p_s,
        schedule: t.schedule,
    });
    let nvs = t.pp * t.vpp;
    let makespan = tasks.iter().map(|k| k.end_s).fold(0.0, f64::max);
    let mut out = Vec::with_capacity(tasks.len() * 2 + 4 * t.pp);
    for k in &tasks {
        let vs = k.chunk * t.pp + k.stage;
        out.push(Span {
            stage: k.stage,
            lane: Lane::Compute,
            kind: if k.forward {
                SpanKind::Forward
            } else {
                SpanKind::Backward
            },
            chunk: k.chunk,
            mb: Some(k.mb),
            start_s: k.start_s,
            end_s: k.end_s,
            comm_s: if k.forward {
                t.forward_comm_s[vs]
            } else {
                t.backward_comm_s[vs]
            },
        });
    }
    if t.p2p_s > 0.0 {
        for k in &tasks {
            let vs = k.chunk * t.pp + k.stage;
            let sends = if k.forward { vs + 1 < nvs } else { vs > 0 };
            if sends {
                out.push(Span {
                    stage: k.stage,
                    lane: Lane::P2p,
                    kind: if k.forward {
                        SpanKind::SendAct
                    } else {
                        SpanKind::SendGrad
                    },
                    chunk: k.chunk,
                    mb: Some(k.mb),
                    start_s: k.end_s,
                    end_s: k.end_s + t.p2p_s,
                    comm_s: t.p2p_s,
                });
            }
        }
    }
    // The estimate adds the tail to the pipeline's makespan: every stage flushes
    // before the step's reduction and update.
    for (i, s) in t.stages.iter().enumerate() {
        let mut at = makespan;
        for (kind, d) in [
            (SpanKind::DpComm, s.exposed_dp_s),
            (SpanKind::TpSync, s.sp_sync_s),
            (SpanKind::Optimizer, s.optimizer_s),
        ] {
            if d > 0.0 {
                let mut sp = span(i, kind, at, at + d);
                if kind != SpanKind::Optimizer {
                    sp.comm_s = d;
                }
                out.push(sp);
                at += d;
            }
        }
    }
    fill_bubbles(t.pp, t.step_s, &mut out);
    out
}

fn inference_spans(t: &InferenceTimeline) -> Vec<Span> {
    let mut out = Vec::with_capacity(4 * t.pp);
    let mut phase = |kind: SpanKind, start: f64, times: &[f64], comm: &[f64], hop: f64| {
        let mut at = start;
        for i in 0..t.pp {
            let mut sp = span(i, kind, at, at + times[i]);
            sp.comm_s = comm[i];
            out.push(sp);
            at += times[i];
            if i + 1 < t.pp {
                let mut send = span(i, SpanKind::SendAct, at, at + hop);
                send.lane = Lane::P2p;
                send.comm_s = hop;
                out.push(send);
                at += hop;
            }
        }
    };
    phase(
        SpanKind::Prefill,
        0.0,
        &t.prefill_s,
        &t.prefill_comm_s,
        t.hop_prefill_s,
    );
    phase(
        SpanKind::Decode,
        t.ttft_s,
        &t.decode_s,
        &t.decode_comm_s,
        t.hop_decode_s,
    );
    fill_bubbles(t.pp, t.ttft_s + t.tpot_s, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn train(pp: usize, m: usize) -> TrainTimeline {
        TrainTimeline {
            pp,
            vpp: 1,
            microbatches: m,
            schedule: Schedule::OneFOneB,
            forward_s: vec![1.0; pp],
            backward_s: vec![2.0; pp],
            forward_comm_s: vec![0.25; pp],
            backward_comm_s: vec![0.5; pp],
            p2p_s: 0.0,
            stages: vec![
                StageTail {
                    exposed_dp_s: 0.5,
                    sp_sync_s: 0.0,
                    optimizer_s: 0.25,
                    memory: MemoryLedger::default(),
                };
                pp
            ],
            critical_stage: 0,
            step_s: (m + pp - 1) as f64 * 3.0 + 0.75,
            memory_capacity_bytes: 1.0,
        }
    }

    #[test]
    fn every_compute_lane_covers_the_step_without_overlap() {
        let t = Timeline::Train(train(4, 8));
        t.validate().unwrap();
        let spans = t.spans();
        for s in 0..4 {
            let mut lane: Vec<&Span> = spans
                .iter()
                .filter(|x| x.stage == s && x.lane == Lane::Compute)
                .collect();
            lane.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
            assert_eq!(lane[0].start_s, 0.0);
            for w in lane.windows(2) {
                assert!((w[1].start_s - w[0].end_s).abs() < 1e-12);
            }
            assert!((lane.last().unwrap().end_s - t.end_s()).abs() < 1e-12);
            // 1F1B, balanced, no hops: (p - 1)(t_f + t_b) idle per stage.
            let idle: f64 = lane
                .iter()
                .filter(|x| x.kind == SpanKind::Bubble)
                .map(|x| x.dur_s())
                .sum();
            assert!((idle - 3.0 * 3.0).abs() < 1e-9, "stage {s}: {idle}");
        }
        assert_eq!(
            spans.iter().filter(|x| x.kind == SpanKind::Forward).count(),
            32
        );
    }

    #[test]
    fn validate_names_the_bad_field() {
        let mut t = train(2, 2);
        t.forward_s.pop();
        let e = Timeline::Train(t).validate().unwrap_err();
        assert!(e.contains("forward_s"), "{e}");
        let mut t = train(2, 2);
        t.backward_s[0] = f64::NAN;
        assert!(Timeline::Train(t).validate().is_err());
    }
}
