//! What `meshplan calibrate` measures ([`MeasurementPlan`]) and how the measurements
//! become a calibration overlay ([`build_overlay`]): plain functions over numbers, so
//! the arithmetic is tested without a GPU. The timing itself belongs to the CUDA
//! backend, which runs the plan and hands back [`Measurements`].
//!
//! # Conventions
//!
//! - GEMM: `2 m n k` FLOPs of one `[m,k] x [k,n]` product over its median time.
//! - HBM: a device-to-device copy of `B` bytes moves `2 B` (read and write); the
//!   bandwidth is the slope of a fit of time over bytes moved.
//! - Attention: forward FLOPs as the cost model counts them (`4 b h s s d`, times
//!   the causal fraction); backward rate over `FLASH_BACKWARD_RATIO` times that.
//! - Collectives: `bytes` is the cost model's message size (the full buffer of
//!   AllReduce and Broadcast, the gathered buffer of AllGather/ReduceScatter, one
//!   rank's send buffer of All-to-All, the message of a send); `t = alpha + bytes /
//!   beta` is fitted by [`fit_alpha_beta`].
//! - Collectives across nodes (a run under `meshplan launch` on two or more nodes):
//!   the same sizes and fit, per operation, node count and ranks per node
//!   ([`InterNodeSweep`]).

use crate::calib;
use crate::graph_cost::causal_fraction;
use crate::overlay::{
    dtype_key, LinkOp, RawAttention, RawCollectiveFit, RawGemmPoint, RawInterNodeFit, RawOverlay,
    OVERLAY_FORMAT,
};
use meshplan_ir::DType;
use std::collections::BTreeMap;
use std::fmt;

// === the measurement plan ===

/// One flash-attention case to time (forward and backward).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionCase {
    /// Sequences.
    pub batch: u64,
    /// Query heads (keys and values have as many).
    pub heads: u64,
    /// Sequence length (queries and keys).
    pub seq: u64,
    /// Head dimension.
    pub head_dim: u64,
    /// Causal mask.
    pub causal: bool,
}

impl AttentionCase {
    /// Forward FLOPs as the cost model counts them.
    pub fn forward_flops(&self) -> f64 {
        let (b, h, s, d) = (
            self.batch as f64,
            self.heads as f64,
            self.seq as f64,
            self.head_dim as f64,
        );
        let frac = if self.causal {
            causal_fraction(s, s)
        } else {
            1.0
        };
        2.0 * b * h * s * s * (2.0 * d) * frac
    }
}

/// One collective swept over message sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectiveSweep {
    /// The operation.
    pub op: LinkOp,
    /// GPUs of one node taking part (ranks `0..ranks`).
    pub ranks: u64,
    /// Message sizes, bytes (the cost model's convention).
    pub bytes: Vec<u64>,
}

/// One collective across nodes swept over message sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterNodeSweep {
    /// The operation.
    pub op: LinkOp,
    /// Nodes each group spans (the first `nodes` nodes of the run).
    pub nodes: u64,
    /// Ranks of a group on each node.
    pub ranks_per_node: u64,
    /// Message sizes, bytes (the cost model's convention).
    pub bytes: Vec<u64>,
}

impl InterNodeSweep {
    /// The groups timed at once on a run of `gpus_per_node` ranks per node, each a list
    /// of `(node, slot)` members in group rank order (slot: the rank's index among its
    /// node's ranks). The node's ranks are split into `gpus_per_node / ranks_per_node`
    /// groups side by side (one rank per node: every rail at once, as a data-parallel
    /// axis outside a tensor axis runs); `send_recv` pairs slot `l` of node 0 (the
    /// sender, member 0) with slot `l` of node 1 for `l < ranks_per_node`. The first
    /// group's first member (node 0, slot 0: rank 0) reports the time.
    pub fn groups(&self, gpus_per_node: u64) -> Vec<Vec<(u64, u64)>> {
        if self.op == LinkOp::SendRecv {
            return (0..self.ranks_per_node)
                .map(|l| vec![(0, l), (1, l)])
                .collect();
        }
        let r = self.ranks_per_node.max(1);
        (0..gpus_per_node / r)
            .map(|i| {
                (0..self.nodes)
                    .flat_map(|node| (i * r..(i + 1) * r).map(move |slot| (node, slot)))
                    .collect()
            })
            .collect()
    }
}

/// Everything `meshplan calibrate` times, and how often.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasurementPlan {
    /// Compute dtypes of the GEMM sweep.
    pub gemm_dtypes: Vec<DType>,
    /// `(m, n, k)` products, timed per dtype.
    pub gemm_shapes: Vec<(u64, u64, u64)>,
    /// Device-to-device copy sizes, bytes.
    pub hbm_copy_bytes: Vec<u64>,
    /// Flash-attention cases (bf16).
    pub attention: Vec<AttentionCase>,
    /// Collectives inside the node.
    pub collectives: Vec<CollectiveSweep>,
    /// Collectives across nodes (empty on one node).
    pub inter_node: Vec<InterNodeSweep>,
    /// Untimed runs before timing each case.
    pub warmup: u32,
    /// Timed runs of each case (the median is kept).
    pub repeats: u32,
}

/// The cube sides of the GEMM sweep.
pub const GEMM_SWEEP_SIDES: [u64; 10] =
    [256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384];

/// Collective message sizes: 4 KiB to 1 GiB by factors of 4.
pub fn collective_sweep_bytes() -> Vec<u64> {
    (0..10).map(|i| 4096u64 << (2 * i)).collect()
}

/// The node counts measured across `nodes` nodes: 2 and all of them. Two fix what a
/// pair of nodes costs (pipeline neighbours, the smallest data-parallel span) and
/// all of them the run's widest groups; the cost model stretches the nearest one
/// below to the counts between.
pub fn inter_node_counts(nodes: u64) -> Vec<u64> {
    match nodes {
        0 | 1 => Vec::new(),
        2 => vec![2],
        n => vec![2, n],
    }
}

/// The collectives timed across nodes, in [`LinkOp::ALL`] order (send/recv apart).
const ACROSS_OPS: [LinkOp; 5] = [
    LinkOp::AllReduce,
    LinkOp::AllGather,
    LinkOp::ReduceScatter,
    LinkOp::Broadcast,
    LinkOp::AllToAll,
];

impl MeasurementPlan {
    /// The standard sweep on a node of `gpus_per_node` GPUs: cube GEMMs from 256 to
    /// 16384 in bf16, fp16 and fp32; copies of 64 MiB to 1 GiB; causal flash
    /// attention at head_dim 128 from 1k to 8k tokens; every collective over 2, 4,
    /// ... GPUs up to the node (and the whole node), 4 KiB to 1 GiB; send/recv between
    /// two GPUs.
    pub fn standard(gpus_per_node: u64) -> MeasurementPlan {
        let mut sizes: Vec<u64> = std::iter::successors(Some(2u64), |r| Some(r * 2))
            .take_while(|&r| r <= gpus_per_node)
            .collect();
        if gpus_per_node >= 2 && !sizes.contains(&gpus_per_node) {
            sizes.push(gpus_per_node);
        }
        let bytes = collective_sweep_bytes();
        let mut collectives = Vec::new();
        for &ranks in &sizes {
            for op in LinkOp::ALL {
                if op == LinkOp::SendRecv && ranks != 2 {
                    continue;
                }
                collectives.push(CollectiveSweep {
                    op,
                    ranks,
                    bytes: bytes.clone(),
                });
            }
        }
        MeasurementPlan {
            gemm_dtypes: vec![DType::Bf16, DType::F16, DType::F32],
            gemm_shapes: GEMM_SWEEP_SIDES.iter().map(|&d| (d, d, d)).collect(),
            hbm_copy_bytes: vec![64 << 20, 256 << 20, 1 << 30],
            attention: [1024u64, 2048, 4096, 8192]
                .iter()
                .map(|&seq| AttentionCase {
                    batch: (16384 / seq).max(1),
                    heads: 16,
                    seq,
                    head_dim: 128,
                    causal: true,
                })
                .collect(),
            collectives,
            inter_node: Vec::new(),
            warmup: 5,
            repeats: 20,
        }
    }

    /// The standard sweep of one node of `gpus_per_node` GPUs, and across `nodes`
    /// nodes: at each of [`inter_node_counts`], every collective over the nodes' GPUs
    /// (`ranks_per_node = gpus_per_node`) and over one rank per node (every rail at
    /// once), 4 KiB to 1 GiB; and send/recv between two nodes, every GPU of one
    /// sending to its peer on the other at once.
    pub fn across_nodes(nodes: u64, gpus_per_node: u64) -> MeasurementPlan {
        let mut plan = MeasurementPlan::standard(gpus_per_node);
        let bytes = collective_sweep_bytes();
        let mut shapes = vec![gpus_per_node.max(1)];
        if gpus_per_node > 1 {
            shapes.push(1);
        }
        for k in inter_node_counts(nodes) {
            for &ranks_per_node in &shapes {
                for op in ACROSS_OPS {
                    plan.inter_node.push(InterNodeSweep {
                        op,
                        nodes: k,
                        ranks_per_node,
                        bytes: bytes.clone(),
                    });
                }
            }
        }
        if nodes >= 2 {
            plan.inter_node.push(InterNodeSweep {
                op: LinkOp::SendRecv,
                nodes: 2,
                ranks_per_node: gpus_per_node.max(1),
                bytes,
            });
        }
        plan
    }

    /// One line per measured family, for `meshplan calibrate --dry-run`.
    pub fn describe(&self) -> String {
        let dtypes: Vec<&str> = self.gemm_dtypes.iter().map(|d| dtype_key(*d)).collect();
        let shapes: Vec<String> = self
            .gemm_shapes
            .iter()
            .map(|(m, n, k)| format!("{m}x{n}x{k}"))
            .collect();
        let mut s = format!(
            "gemm         {} products ({}) in {}\n",
            self.gemm_shapes.len(),
            shapes.join(", "),
            dtypes.join(", ")
        );
        s += &format!(
            "hbm          device copies of {} MiB\n",
            self.hbm_copy_bytes
                .iter()
                .map(|b| (b >> 20).to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
        s += &format!(
            "attention    causal flash attention, head_dim 128, sequences {}\n",
            self.attention
                .iter()
                .map(|a| a.seq.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
        let mut by_ranks: BTreeMap<u64, Vec<&str>> = BTreeMap::new();
        for c in &self.collectives {
            by_ranks.entry(c.ranks).or_default().push(c.op.name());
        }
        for (ranks, ops) in by_ranks {
            s += &format!("collectives  {ranks} GPUs: {}\n", ops.join(", "));
        }
        if let Some(c) = self.collectives.first() {
            s += &format!(
                "             messages of {} B to {} B by factors of 4\n",
                c.bytes.first().copied().unwrap_or(0),
                c.bytes.last().copied().unwrap_or(0)
            );
        }
        let mut by_shape: BTreeMap<(u64, u64), Vec<&str>> = BTreeMap::new();
        for c in &self.inter_node {
            by_shape
                .entry((c.nodes, c.ranks_per_node))
                .or_default()
                .push(c.op.name());
        }
        for ((nodes, per_node), ops) in by_shape {
            let how = if per_node == 1 {
                "1 GPU per node, every rail at once".to_string()
            } else {
                format!("{per_node} GPUs per node")
            };
            s += &format!("across nodes {nodes} nodes x {how}: {}\n", ops.join(", "));
        }
        if let Some(c) = self.inter_node.first() {
            s += &format!(
                "             messages of {} B to {} B by factors of 4; other node counts extrapolated\n",
                c.bytes.first().copied().unwrap_or(0),
                c.bytes.last().copied().unwrap_or(0)
            );
        }
        s += &format!(
            "repeats      {} warm-up and {} timed runs per case (median kept)\n",
            self.warmup, self.repeats
        );
        s
    }
}

/// Where the processes of a run launched on several nodes sit, from each rank's host
/// name: nodes numbered in the order of their first rank, and each rank's slot (its
/// index among its node's ranks, in rank order). [`InterNodeSweep::groups`] names
/// members by `(node, slot)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeLayout {
    /// Per rank, `(node, slot)`.
    pub places: Vec<(u64, u64)>,
    /// Nodes of the run.
    pub nodes: u64,
    /// Ranks on each node.
    pub per_node: u64,
}

impl NodeLayout {
    /// The layout of ranks whose host names are `hosts` (rank order).
    ///
    /// # Errors
    /// No ranks, or nodes holding different numbers of ranks (the measurement groups
    /// assume every node alike), named with what to do.
    pub fn of_hosts(hosts: &[String]) -> Result<NodeLayout, String> {
        let mut names: Vec<&str> = Vec::new();
        let mut counts: Vec<u64> = Vec::new();
        let mut places = Vec::with_capacity(hosts.len());
        for h in hosts {
            let node = match names.iter().position(|n| *n == h.as_str()) {
                Some(i) => i,
                None => {
                    names.push(h);
                    counts.push(0);
                    names.len() - 1
                }
            };
            places.push((node as u64, counts[node]));
            counts[node] += 1;
        }
        let Some(&per_node) = counts.first() else {
            return Err("no ranks joined".into());
        };
        if let Some(i) = counts.iter().position(|&c| c != per_node) {
            return Err(format!(
                "the launch has {per_node} ranks on {} but {} on {}: calibrate measures nodes alike; start one process per GPU, as many on every node",
                names[0], counts[i], names[i]
            ));
        }
        Ok(NodeLayout {
            places,
            nodes: names.len() as u64,
            per_node,
        })
    }

    /// The rank at `place`, if any.
    pub fn rank_of(&self, place: (u64, u64)) -> Option<usize> {
        self.places.iter().position(|&p| p == place)
    }
}

// === measurements ===

/// A timed GEMM.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmSample {
    /// Compute dtype.
    pub dtype: DType,
    /// Rows of the output.
    pub m: u64,
    /// Columns of the output.
    pub n: u64,
    /// Contraction length.
    pub k: u64,
    /// Seconds of one product.
    pub seconds: f64,
}

/// A timed transfer of `bytes`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SizeSample {
    /// Bytes (see the module conventions).
    pub bytes: f64,
    /// Seconds.
    pub seconds: f64,
}

/// A timed flash-attention case.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSample {
    /// Compute dtype.
    pub dtype: DType,
    /// The case.
    pub case: AttentionCase,
    /// Forward seconds.
    pub forward_s: f64,
    /// Backward seconds.
    pub backward_s: f64,
}

/// A timed collective.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CollectiveSample {
    /// The operation.
    pub op: LinkOp,
    /// Group size.
    pub ranks: u64,
    /// Message size and seconds.
    pub sample: SizeSample,
}

/// A timed collective across nodes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InterNodeSample {
    /// The operation.
    pub op: LinkOp,
    /// Nodes the group spans.
    pub nodes: u64,
    /// Ranks of the group on each node.
    pub ranks_per_node: u64,
    /// Message size and seconds.
    pub sample: SizeSample,
}

/// What a calibration run measured (repeats as separate samples).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Measurements {
    /// The device name, as the driver reports it.
    pub device: String,
    /// GPUs of the node.
    pub gpus_per_node: u64,
    /// Tool and library versions.
    pub measured_with: String,
    /// GEMMs.
    pub gemm: Vec<GemmSample>,
    /// Device copies (`bytes` = bytes moved, read + written).
    pub hbm: Vec<SizeSample>,
    /// Flash attention.
    pub attention: Vec<AttentionSample>,
    /// Collectives inside the node.
    pub collectives: Vec<CollectiveSample>,
    /// Collectives across nodes.
    pub inter_node: Vec<InterNodeSample>,
}

/// A fit that cannot be made from the measurements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FitError {
    /// What was being fitted (`all_reduce over 8 ranks`, `gemm bf16 1024x1024x1024`).
    pub what: String,
    /// Why.
    pub reason: String,
}

impl fmt::Display for FitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.what, self.reason)
    }
}

impl std::error::Error for FitError {}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

fn check_time(what: &str, s: f64) -> Result<(), FitError> {
    if s.is_finite() && s > 0.0 {
        Ok(())
    } else {
        Err(FitError {
            what: what.to_string(),
            reason: format!("a time must be a positive number of seconds, got {s}"),
        })
    }
}

/// Fits `t = alpha + bytes / beta` to `(bytes, seconds)` samples.
///
/// Repeats of one size are reduced to their median; then weighted least squares with
/// weights `1 / t^2` (relative residuals), so small messages fix the latency and
/// large ones the bandwidth instead of the largest times drowning the rest. A
/// negative intercept is clamped to 0 and the slope refitted through the origin.
///
/// # Errors
/// Fewer than two distinct sizes, a non-positive time or size, or times that do not
/// grow with size.
pub fn fit_alpha_beta(what: &str, samples: &[SizeSample]) -> Result<(f64, f64), FitError> {
    let err = |reason: String| FitError {
        what: what.to_string(),
        reason,
    };
    let mut by_size: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for s in samples {
        check_time(what, s.seconds)?;
        if !(s.bytes.is_finite() && s.bytes > 0.0) {
            return Err(err(format!(
                "a size must be a positive number of bytes, got {}",
                s.bytes
            )));
        }
        by_size
            .entry(s.bytes.to_bits())
            .or_default()
            .push(s.seconds);
    }
    if by_size.len() < 2 {
        return Err(err(format!(
            "needs at least two message sizes, got {}",
            by_size.len()
        )));
    }
    let pts: Vec<(f64, f64)> = by_size
        .into_iter()
        .map(|(b, ts)| (f64::from_bits(b), median(ts)))
        .collect();
    let (mut s, mut sx, mut sy, mut sxx, mut sxy) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x, t) in &pts {
        let w = 1.0 / (t * t);
        s += w;
        sx += w * x;
        sy += w * t;
        sxx += w * x * x;
        sxy += w * x * t;
    }
    let det = s * sxx - sx * sx;
    let mut slope = (s * sxy - sx * sy) / det;
    let mut alpha = (sy - slope * sx) / s;
    if alpha.is_nan() || alpha < 0.0 {
        alpha = 0.0;
        slope = sxy / sxx;
    }
    if !(slope.is_finite() && slope > 0.0) {
        return Err(err(
            "the time does not grow with the message size; measure larger messages".into(),
        ));
    }
    Ok((alpha, 1.0 / slope))
}

/// GEMM points from timed products: per dtype and shape, `2 m n k` over the median
/// time, sorted by FLOPs.
pub fn gemm_points(
    samples: &[GemmSample],
) -> Result<BTreeMap<String, Vec<RawGemmPoint>>, FitError> {
    let mut groups: BTreeMap<(String, u64, u64, u64), Vec<f64>> = BTreeMap::new();
    for s in samples {
        let what = format!("gemm {} {}x{}x{}", dtype_key(s.dtype), s.m, s.n, s.k);
        check_time(&what, s.seconds)?;
        if s.m == 0 || s.n == 0 || s.k == 0 {
            return Err(FitError {
                what,
                reason: "a dimension is 0".into(),
            });
        }
        groups
            .entry((dtype_key(s.dtype).to_string(), s.m, s.n, s.k))
            .or_default()
            .push(s.seconds);
    }
    let mut out: BTreeMap<String, Vec<RawGemmPoint>> = BTreeMap::new();
    for ((dtype, m, n, k), ts) in groups {
        let flops = 2.0 * m as f64 * n as f64 * k as f64;
        out.entry(dtype).or_default().push(RawGemmPoint {
            m,
            n,
            k,
            tflops: round(flops / median(ts) / 1e12, 3),
        });
    }
    for points in out.values_mut() {
        points.sort_by(|a, b| {
            let f = |p: &RawGemmPoint| p.m as f64 * p.n as f64 * p.k as f64;
            f(a).total_cmp(&f(b))
        });
    }
    Ok(out)
}

/// Rounds to `decimals` places (overlay values are for people to read).
fn round(x: f64, decimals: i32) -> f64 {
    let p = 10f64.powi(decimals);
    (x * p).round() / p
}

/// The overlay of a calibration run measured at `measured_at` (RFC 3339).
pub fn build_overlay(m: &Measurements, measured_at: &str) -> Result<RawOverlay, FitError> {
    let gemm = gemm_points(&m.gemm)?;
    let hbm_gbps = if m.hbm.is_empty() {
        None
    } else {
        let (_, beta) = fit_alpha_beta("hbm copy", &m.hbm)?;
        Some(round(beta / 1e9, 3))
    };
    let mut attention: BTreeMap<String, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    for a in &m.attention {
        let what = format!("attention {} seq {}", dtype_key(a.dtype), a.case.seq);
        check_time(&what, a.forward_s)?;
        check_time(&what, a.backward_s)?;
        let flops = a.case.forward_flops();
        let e = attention.entry(dtype_key(a.dtype).to_string()).or_default();
        e.0.push(flops / a.forward_s);
        e.1.push(calib::FLASH_BACKWARD_RATIO * flops / a.backward_s);
    }
    let attention = attention
        .into_iter()
        .map(|(k, (f, b))| {
            (
                k,
                RawAttention {
                    forward_tflops: round(median(f) / 1e12, 3),
                    backward_tflops: Some(round(median(b) / 1e12, 3)),
                },
            )
        })
        .collect();
    let mut groups: BTreeMap<(LinkOp, u64), Vec<SizeSample>> = BTreeMap::new();
    for c in &m.collectives {
        groups.entry((c.op, c.ranks)).or_default().push(c.sample);
    }
    let mut intra_node = Vec::new();
    for ((op, ranks), samples) in groups {
        let (alpha, beta) = fit_alpha_beta(&format!("{} over {ranks} ranks", op.name()), &samples)?;
        intra_node.push(RawCollectiveFit {
            collective: op.name().to_string(),
            ranks,
            alpha_us: round(alpha * 1e6, 3),
            beta_gbps: round(beta / 1e9, 3),
        });
    }
    let mut across: BTreeMap<(LinkOp, u64, u64), Vec<SizeSample>> = BTreeMap::new();
    for c in &m.inter_node {
        across
            .entry((c.op, c.nodes, c.ranks_per_node))
            .or_default()
            .push(c.sample);
    }
    let mut inter_node = Vec::new();
    for ((op, nodes, ranks_per_node), samples) in across {
        let what = format!(
            "{} across {nodes} nodes x {ranks_per_node} ranks",
            op.name()
        );
        let (alpha, beta) = fit_alpha_beta(&what, &samples)?;
        inter_node.push(RawInterNodeFit {
            op: op.name().to_string(),
            nodes,
            ranks_per_node,
            alpha_us: round(alpha * 1e6, 3),
            beta_gbps: round(beta / 1e9, 3),
        });
    }
    Ok(RawOverlay {
        format: OVERLAY_FORMAT,
        device: m.device.clone(),
        measured_at: measured_at.to_string(),
        measured_with: m.measured_with.clone(),
        gpus_per_node: (m.gpus_per_node > 0).then_some(m.gpus_per_node),
        gemm,
        hbm_gbps,
        attention,
        intra_node,
        inter_node,
    })
}

/// `secs` since the Unix epoch as RFC 3339 UTC (`2025-06-01T12:00:00Z`).
pub fn rfc3339_utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    format!(
        "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(alpha: f64, beta: f64, sizes: &[f64]) -> Vec<SizeSample> {
        sizes
            .iter()
            .map(|&b| SizeSample {
                bytes: b,
                seconds: alpha + b / beta,
            })
            .collect()
    }

    #[test]
    fn exact_line_is_recovered() {
        let s = samples(
            25e-6,
            180e9,
            &[4096.0, 65536.0, 1048576.0, 16777216.0, 268435456.0],
        );
        let (a, b) = fit_alpha_beta("t", &s).expect("fit");
        assert!((a - 25e-6).abs() < 1e-12, "{a}");
        assert!((b - 180e9).abs() < 1e-3 * 1.0, "{b}");
    }

    #[test]
    fn noise_and_repeats_fit_within_a_few_percent() {
        // +-3% multiplicative noise, deterministic, three repeats per size.
        let sizes: Vec<f64> = collective_sweep_bytes().iter().map(|&b| b as f64).collect();
        let mut s = Vec::new();
        for (i, &b) in sizes.iter().enumerate() {
            for r in 0..3 {
                let noise = 1.0 + 0.03 * (((i * 7 + r * 13) % 5) as f64 - 2.0) / 2.0;
                s.push(SizeSample {
                    bytes: b,
                    seconds: (20e-6 + b / 150e9) * noise,
                });
            }
        }
        let (a, b) = fit_alpha_beta("t", &s).expect("fit");
        assert!((a - 20e-6).abs() < 0.05 * 20e-6, "alpha {a}");
        assert!((b - 150e9).abs() < 0.05 * 150e9, "beta {b}");
    }

    #[test]
    fn negative_intercept_clamps_to_zero() {
        // Times exactly proportional to size, minus a constant: the unconstrained
        // intercept is negative.
        let s = vec![
            SizeSample {
                bytes: 1e6,
                seconds: 1e-5 - 1e-7,
            },
            SizeSample {
                bytes: 1e8,
                seconds: 1e-3 - 1e-7,
            },
        ];
        let (a, b) = fit_alpha_beta("t", &s).expect("fit");
        assert_eq!(a, 0.0);
        assert!((b - 1e11).abs() < 0.01 * 1e11, "{b}");
    }

    #[test]
    fn bad_samples_are_refused_naming_the_fit() {
        let one = samples(1e-5, 1e11, &[1e6]);
        let e = fit_alpha_beta("all_reduce over 8 ranks", &one).unwrap_err();
        assert!(e.to_string().contains("all_reduce over 8 ranks"), "{e}");
        assert!(e.to_string().contains("two message sizes"), "{e}");
        let flat = vec![
            SizeSample {
                bytes: 1e3,
                seconds: 2e-5,
            },
            SizeSample {
                bytes: 1e9,
                seconds: 1e-5,
            },
        ];
        assert!(fit_alpha_beta("x", &flat).is_err());
        let neg = samples(1e-5, 1e11, &[1e6, 1e7]);
        let mut neg = neg;
        neg[0].seconds = -1.0;
        assert!(fit_alpha_beta("x", &neg)
            .unwrap_err()
            .reason
            .contains("positive"));
    }

    #[test]
    fn gemm_points_take_the_median_and_sort_by_flops() {
        let s = |d: u64, seconds: f64| GemmSample {
            dtype: DType::Bf16,
            m: d,
            n: d,
            k: d,
            seconds,
        };
        // 2 * 4096^3 = 1.374e11 FLOPs; median of 0.5, 0.25, 0.3 ms = 0.3 ms:
        // 458.130 TFLOP/s. 1024^3 in 10 us: 214.748 TFLOP/s.
        let pts = gemm_points(&[
            s(4096, 0.5e-3),
            s(4096, 0.25e-3),
            s(1024, 10e-6),
            s(4096, 0.3e-3),
        ])
        .expect("points");
        let bf = &pts["bf16"];
        assert_eq!(bf.len(), 2);
        assert_eq!(bf[0].m, 1024);
        assert!((bf[0].tflops - 214.748).abs() < 1e-9, "{}", bf[0].tflops);
        assert!((bf[1].tflops - 458.13).abs() < 1e-9, "{}", bf[1].tflops);
    }

    #[test]
    fn timestamps_are_rfc3339() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_utc(1_748_779_200), "2025-06-01T12:00:00Z");
    }

    #[test]
    fn across_nodes_plan_measures_two_and_all_nodes_in_two_shapes() {
        // 4 nodes of 8: at 2 and 4 nodes, the five collectives over 8 GPUs per node
        // and over 1 (every rail at once): 2 x 2 x 5 = 20 sweeps, and one send/recv
        // between 2 nodes with all 8 pairs at once.
        let p = MeasurementPlan::across_nodes(4, 8);
        assert_eq!(p.collectives, MeasurementPlan::standard(8).collectives);
        assert_eq!(p.inter_node.len(), 21);
        assert!(p.inter_node.len() <= crate::overlay::INTER_FITS_MAX);
        let shapes: std::collections::BTreeSet<(u64, u64)> = p
            .inter_node
            .iter()
            .filter(|c| c.op != LinkOp::SendRecv)
            .map(|c| (c.nodes, c.ranks_per_node))
            .collect();
        assert_eq!(
            shapes.into_iter().collect::<Vec<_>>(),
            vec![(2, 1), (2, 8), (4, 1), (4, 8)]
        );
        let sr: Vec<_> = p
            .inter_node
            .iter()
            .filter(|c| c.op == LinkOp::SendRecv)
            .collect();
        assert_eq!(sr.len(), 1);
        assert_eq!((sr[0].nodes, sr[0].ranks_per_node), (2, 8));
        assert!(p
            .inter_node
            .iter()
            .all(|c| c.bytes == collective_sweep_bytes()));
        // Two nodes: only the count 2; one GPU per node: one shape; one node: none.
        assert_eq!(inter_node_counts(2), vec![2]);
        assert_eq!(inter_node_counts(480), vec![2, 480]);
        assert_eq!(MeasurementPlan::across_nodes(2, 8).inter_node.len(), 11);
        assert_eq!(MeasurementPlan::across_nodes(3, 1).inter_node.len(), 11);
        assert!(MeasurementPlan::across_nodes(1, 8).inter_node.is_empty());
        let text = p.describe();
        for needle in [
            "across nodes 2 nodes x 8 GPUs per node: all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, send_recv",
            "across nodes 4 nodes x 1 GPU per node, every rail at once: all_reduce",
            "messages of 4096 B to 1073741824 B by factors of 4; other node counts extrapolated",
        ] {
            assert!(text.contains(needle), "{needle}:\n{text}");
        }
        assert!(!MeasurementPlan::standard(8)
            .describe()
            .contains("across nodes"));
    }

    #[test]
    fn inter_node_groups_place_ranks_on_nodes() {
        let sweep = |op, nodes, ranks_per_node| InterNodeSweep {
            op,
            nodes,
            ranks_per_node,
            bytes: vec![4096],
        };
        // All 4 GPUs of nodes 0 and 1, node-major: one group of 8.
        let all = sweep(LinkOp::AllReduce, 2, 4).groups(4);
        assert_eq!(
            all,
            vec![vec![
                (0, 0),
                (0, 1),
                (0, 2),
                (0, 3),
                (1, 0),
                (1, 1),
                (1, 2),
                (1, 3)
            ]]
        );
        // One rank per node on 3 nodes of 4: four rails, slot l on each node.
        let rails = sweep(LinkOp::AllGather, 3, 1).groups(4);
        assert_eq!(rails.len(), 4);
        assert_eq!(rails[2], vec![(0, 2), (1, 2), (2, 2)]);
        // Two per node: two groups side by side.
        let pairs = sweep(LinkOp::AllToAll, 2, 2).groups(4);
        assert_eq!(pairs[1], vec![(0, 2), (0, 3), (1, 2), (1, 3)]);
        // send/recv: node 0's slot l sends to node 1's slot l.
        let sends = sweep(LinkOp::SendRecv, 2, 4).groups(4);
        assert_eq!(sends.len(), 4);
        assert_eq!(sends[3], vec![(0, 3), (1, 3)]);
    }

    #[test]
    fn node_layout_numbers_nodes_and_slots_in_rank_order() {
        let hosts = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // Ranks interleaved over two hosts (a launcher that deals round robin).
        let l = NodeLayout::of_hosts(&hosts(&["b", "a", "b", "a"])).expect("layout");
        assert_eq!((l.nodes, l.per_node), (2, 2));
        assert_eq!(l.places, vec![(0, 0), (1, 0), (0, 1), (1, 1)]);
        assert_eq!(l.rank_of((1, 1)), Some(3));
        assert_eq!(l.rank_of((2, 0)), None);
        let e = NodeLayout::of_hosts(&hosts(&["a", "a", "b"])).unwrap_err();
        assert!(
            e.contains("2 ranks on a but 1 on b") && e.contains("as many on every node"),
            "{e}"
        );
        assert!(NodeLayout::of_hosts(&[]).is_err());
    }

    #[test]
    fn inter_node_fits_recover_alpha_and_beta() {
        // fit_alpha_beta on exact lines with awkward numbers: within 1e-6 relative.
        let sizes: Vec<f64> = collective_sweep_bytes().iter().map(|&b| b as f64).collect();
        for (alpha, beta) in [(37.123_456e-6, 41.987_654e9), (112.5e-6, 6.25e9)] {
            let (a, b) = fit_alpha_beta("x", &samples(alpha, beta, &sizes)).expect("fit");
            assert!((a - alpha).abs() <= 1e-6 * alpha, "alpha {a} vs {alpha}");
            assert!((b - beta).abs() <= 1e-6 * beta, "beta {b} vs {beta}");
        }
        // build_overlay: AllReduce across 2 nodes x 8 at 47.25 us + B / 23.5 GB/s and
        // across 2 x 1 at 21 us + B / 11.75 GB/s, send/recv at 12.5 us + B / 44 GB/s,
        // three repeats each (one 5% slow: the median drops it).
        let plan = MeasurementPlan::across_nodes(2, 8);
        let mut m = Measurements {
            device: "NVIDIA H100 80GB HBM3".into(),
            gpus_per_node: 8,
            ..Measurements::default()
        };
        let truth = [
            (LinkOp::AllReduce, 8, 47.25e-6, 23.5e9),
            (LinkOp::AllReduce, 1, 21e-6, 11.75e9),
            (LinkOp::SendRecv, 8, 12.5e-6, 44e9),
        ];
        for sweep in &plan.inter_node {
            let Some(&(_, _, alpha, beta)) = truth
                .iter()
                .find(|t| t.0 == sweep.op && t.1 == sweep.ranks_per_node)
            else {
                continue;
            };
            for &b in &sweep.bytes {
                for slow in [1.0, 1.05, 1.0] {
                    m.inter_node.push(InterNodeSample {
                        op: sweep.op,
                        nodes: sweep.nodes,
                        ranks_per_node: sweep.ranks_per_node,
                        sample: SizeSample {
                            bytes: b as f64,
                            seconds: (alpha + b as f64 / beta) * slow,
                        },
                    });
                }
            }
        }
        let o = build_overlay(&m, "2025-06-01T12:00:00Z").expect("overlay");
        assert!(o.intra_node.is_empty());
        let got: Vec<(String, u64, u64, f64, f64)> = o
            .inter_node
            .iter()
            .map(|f| {
                (
                    f.op.clone(),
                    f.nodes,
                    f.ranks_per_node,
                    f.alpha_us,
                    f.beta_gbps,
                )
            })
            .collect();
        let want = [
            ("all_reduce", 2, 1, 21.0, 11.75),
            ("all_reduce", 2, 8, 47.25, 23.5),
            ("send_recv", 2, 8, 12.5, 44.0),
        ];
        assert_eq!(got.len(), want.len(), "{got:?}");
        for (g, w) in got.iter().zip(want) {
            assert_eq!((g.0.as_str(), g.1, g.2), (w.0, w.1, w.2));
            assert!((g.3 - w.3).abs() <= 1e-6 * w.3, "{g:?} vs {w:?}");
            assert!((g.4 - w.4).abs() <= 1e-6 * w.4, "{g:?} vs {w:?}");
        }
        // The overlay written reads back equal.
        let yaml = o.to_yaml();
        assert!(yaml.contains("inter_node:\n"), "{yaml}");
        assert_eq!(
            crate::overlay::parse_overlay_yaml(&yaml, "w.yaml").expect("parses"),
            o
        );
        // A shape with one message size cannot be fitted, and the error names it.
        m.inter_node.retain(|c| c.sample.bytes == 4096.0);
        let e = build_overlay(&m, "t").unwrap_err().to_string();
        assert!(e.contains("all_reduce across 2 nodes x 1 ranks"), "{e}");
    }

    #[test]
    fn standard_plan_covers_the_node() {
        let p = MeasurementPlan::standard(8);
        let sizes: std::collections::BTreeSet<u64> =
            p.collectives.iter().map(|c| c.ranks).collect();
        assert_eq!(sizes.into_iter().collect::<Vec<_>>(), vec![2, 4, 8]);
        assert_eq!(
            p.collectives
                .iter()
                .filter(|c| c.op == LinkOp::SendRecv)
                .count(),
            1
        );
        let p6 = MeasurementPlan::standard(6);
        assert!(p6.collectives.iter().any(|c| c.ranks == 6));
        assert!(MeasurementPlan::standard(1).collectives.is_empty());
        assert!(p.gemm_shapes.len() <= crate::overlay::GEMM_POINTS_MAX);
    }
}
