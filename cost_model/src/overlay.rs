//! The calibration overlay: what `meshplan calibrate` measured on the user's GPUs,
//! laid over a cluster file so that the cost model prices with measured numbers
//! instead of datasheet peaks and the fitted fractions of [`crate::calib`].
//!
//! ```yaml
//! format: 1
//! device: NVIDIA H100 80GB HBM3
//! measured_at: 2025-06-01T12:00:00Z
//! measured_with: meshplan calibrate 0.1.0 (cuBLAS, NCCL 2.21.5)
//! gpus_per_node: 8          # the node it was measured on (documentation)
//! gemm:                     # achieved TFLOP/s of [m,k] x [k,n] products, per dtype
//!   bf16:
//!     - {m: 1024, n: 1024, k: 1024, tflops: 420.5}
//!     - {m: 8192, n: 8192, k: 8192, tflops: 702.0}
//! hbm_gbps: 2900            # device-to-device copy, bytes read + written per second
//! attention:                # flash attention, per dtype
//!   bf16: {forward_tflops: 480, backward_tflops: 360}
//! intra_node:               # per collective and group size: t = alpha + bytes / beta
//!   - {collective: all_reduce, ranks: 8, alpha_us: 28.1, beta_gbps: 182.5}
//!   - {collective: send_recv, ranks: 2, alpha_us: 9.0, beta_gbps: 310.0}
//! inter_node:               # per collective, nodes and GPUs per node: t = alpha + bytes / beta
//!   - {op: all_reduce, nodes: 2, ranks_per_node: 8, alpha_us: 48.0, beta_gbps: 46.5}
//!   - {op: all_reduce, nodes: 2, ranks_per_node: 1, alpha_us: 21.0, beta_gbps: 24.0}
//!   - {op: send_recv, nodes: 2, ranks_per_node: 8, alpha_us: 12.0, beta_gbps: 44.0}
//! ```
//!
//! Every section is optional: what the overlay does not name keeps the cluster
//! file's model. How each number is used:
//!
//! - **GEMM**: the points form a curve of achieved FLOP/s over the product's FLOPs
//!   (`2 m n k`), interpolated linearly in `ln(FLOPs)` and held flat beyond the ends.
//!   A product of another shape runs at the curve's rate for its FLOPs times
//!   [`crate::compute::shape_factor`] (1 for a cube; below 1 for skinny products), so
//!   every measured point reproduces its own time. See [`crate::compute::GemmCurve`].
//! - **HBM**: `hbm_gbps` replaces `gpu.hbm_gbps x calib::HBM_EFFICIENCY` for
//!   memory-bound kernels (it is already an achieved bandwidth).
//! - **Attention**: `forward_tflops` replaces `calib::FLASH_ATTENTION_EFFICIENCY x
//!   peak` for the flash kernel; `backward_tflops` counts the backward's work as
//!   `calib::FLASH_BACKWARD_RATIO` times the forward's FLOPs (FlashAttention's
//!   benchmark convention) and defaults to the forward rate.
//! - **Collectives** inside a node: a group of exactly `ranks` ranks inside one node
//!   takes `alpha + bytes / beta`, with `bytes` the cost model's message size (the
//!   full buffer of AllReduce and Broadcast, the gathered buffer of AllGather and
//!   ReduceScatter, one rank's send buffer of All-to-All, the message of
//!   `send_recv`). Measured ReduceScatter/AllGather/Broadcast of `g` ranks also
//!   price the inside-the-node phases of collectives across nodes. Group sizes the
//!   overlay does not name keep the link model.
//! - **Collectives across nodes** (`meshplan calibrate` under a launch of two or more
//!   nodes): a group spanning `nodes` nodes with `ranks_per_node` ranks on each takes
//!   the fit as a whole (in place of the hierarchical link model), same message size
//!   convention. `ranks_per_node: 1` was measured with every node's GPUs running their
//!   own such group at once (one per rail, as a data-parallel axis outside a tensor
//!   axis runs), so it is one GPU's share of the node's NICs. Other node counts are
//!   extrapolated from the largest measured one below (see
//!   [`crate::collective::MeasuredAcrossNodes`]); `send_recv` (always `nodes: 2`)
//!   prices pipeline sends between nodes.
//!
//! Bad overlays are bad input: every error names the overlay file, the field and the
//! fix, as cluster errors do.

use crate::cluster::Cluster;
pub use meshplan_ir::plan::LinkOp;
use meshplan_ir::{DType, IrError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The overlay format this build reads and writes.
pub const OVERLAY_FORMAT: u32 = 1;

/// Most GEMM points per dtype (the measurement plan sweeps fewer).
pub const GEMM_POINTS_MAX: usize = 32;

/// Most distinct group sizes among the measured collectives.
pub const COLLECTIVE_SIZES_MAX: usize = 8;

/// Most `inter_node` fits (the measurement plan writes at most 21: five
/// collectives at two node counts and two shapes, and one send/recv). It bounds the
/// fixed-size table that keeps [`crate::CommModel`] `Copy`.
pub const INTER_FITS_MAX: usize = 32;

// === the file as written ===

/// The overlay file as written (units as in cluster files: TFLOP/s, GB/s, us).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOverlay {
    /// [`OVERLAY_FORMAT`].
    pub format: u32,
    /// The measured device's name, as the driver reports it.
    pub device: String,
    /// When, RFC 3339 UTC.
    pub measured_at: String,
    /// How: the tool, its version, the libraries.
    pub measured_with: String,
    /// GPUs in the node it was measured on (documentation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus_per_node: Option<u64>,
    /// GEMM points per dtype key (`bf16`, `fp16`, `fp32`, `fp8`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gemm: BTreeMap<String, Vec<RawGemmPoint>>,
    /// Achieved HBM bandwidth, GB/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hbm_gbps: Option<f64>,
    /// Flash-attention throughput per dtype key.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attention: BTreeMap<String, RawAttention>,
    /// Collectives inside one node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub intra_node: Vec<RawCollectiveFit>,
    /// Collectives across nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inter_node: Vec<RawInterNodeFit>,
}

/// One measured `[m,k] x [k,n]` product.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawGemmPoint {
    /// Rows of the output.
    pub m: u64,
    /// Columns of the output.
    pub n: u64,
    /// Contraction length.
    pub k: u64,
    /// Achieved `2 m n k / seconds / 1e12`.
    pub tflops: f64,
}

/// Flash-attention throughput.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAttention {
    /// Forward FLOPs (`4 b h s kv d`, causal half counted once) per second / 1e12.
    pub forward_tflops: f64,
    /// `FLASH_BACKWARD_RATIO` x forward FLOPs per backward second / 1e12.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward_tflops: Option<f64>,
}

/// One collective's fitted latency and bandwidth.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCollectiveFit {
    /// `all_reduce`, `all_gather`, `reduce_scatter`, `broadcast`, `all_to_all` or
    /// `send_recv`.
    pub collective: String,
    /// Group size.
    pub ranks: u64,
    /// Fitted latency, microseconds.
    pub alpha_us: f64,
    /// Fitted bandwidth over the cost model's message size, GB/s.
    pub beta_gbps: f64,
}

/// One collective's fitted latency and bandwidth across nodes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawInterNodeFit {
    /// `all_reduce`, `all_gather`, `reduce_scatter`, `broadcast`, `all_to_all` or
    /// `send_recv`.
    pub op: String,
    /// Nodes the group spans (at least 2; `send_recv` joins exactly 2).
    pub nodes: u64,
    /// Ranks of the group on each node.
    pub ranks_per_node: u64,
    /// Fitted latency, microseconds.
    pub alpha_us: f64,
    /// Fitted bandwidth over the cost model's message size, GB/s.
    pub beta_gbps: f64,
}

impl RawOverlay {
    /// The overlay as YAML, one flow mapping per point (what `meshplan calibrate`
    /// writes; [`parse_overlay_yaml`] reads it back to an equal value).
    pub fn to_yaml(&self) -> String {
        let mut s = String::new();
        let q = |v: &str| serde_json::to_string(v).unwrap_or_else(|_| format!("\"{v}\""));
        let _ = writeln!(
            s,
            "# meshplan calibration overlay: use with --calibration FILE, or name it as"
        );
        let _ = writeln!(s, "# `calibration: FILE` in a cluster YAML.");
        let _ = writeln!(s, "format: {}", self.format);
        let _ = writeln!(s, "device: {}", q(&self.device));
        let _ = writeln!(s, "measured_at: {}", q(&self.measured_at));
        let _ = writeln!(s, "measured_with: {}", q(&self.measured_with));
        if let Some(g) = self.gpus_per_node {
            let _ = writeln!(s, "gpus_per_node: {g}");
        }
        if !self.gemm.is_empty() {
            let _ = writeln!(s, "gemm:");
            for (dtype, points) in &self.gemm {
                let _ = writeln!(s, "  {dtype}:");
                for p in points {
                    let _ = writeln!(
                        s,
                        "    - {{m: {}, n: {}, k: {}, tflops: {:?}}}",
                        p.m, p.n, p.k, p.tflops
                    );
                }
            }
        }
        if let Some(h) = self.hbm_gbps {
            let _ = writeln!(s, "hbm_gbps: {h:?}");
        }
        if !self.attention.is_empty() {
            let _ = writeln!(s, "attention:");
            for (dtype, a) in &self.attention {
                match a.backward_tflops {
                    Some(b) => {
                        let _ = writeln!(
                            s,
                            "  {dtype}: {{forward_tflops: {:?}, backward_tflops: {b:?}}}",
                            a.forward_tflops
                        );
                    }
                    None => {
                        let _ =
                            writeln!(s, "  {dtype}: {{forward_tflops: {:?}}}", a.forward_tflops);
                    }
                }
            }
        }
        if !self.intra_node.is_empty() {
            let _ = writeln!(s, "intra_node:");
            for c in &self.intra_node {
                let _ = writeln!(
                    s,
                    "  - {{collective: {}, ranks: {}, alpha_us: {:?}, beta_gbps: {:?}}}",
                    c.collective, c.ranks, c.alpha_us, c.beta_gbps
                );
            }
        }
        if !self.inter_node.is_empty() {
            let _ = writeln!(s, "inter_node:");
            for c in &self.inter_node {
                let _ = writeln!(
                    s,
                    "  - {{op: {}, nodes: {}, ranks_per_node: {}, alpha_us: {:?}, beta_gbps: {:?}}}",
                    c.op, c.nodes, c.ranks_per_node, c.alpha_us, c.beta_gbps
                );
            }
        }
        s
    }
}

// === validated, SI units ===

/// A measured GEMM point, SI.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmPoint {
    /// Rows of the output.
    pub m: u64,
    /// Columns of the output.
    pub n: u64,
    /// Contraction length.
    pub k: u64,
    /// Achieved FLOP/s.
    pub flops_per_s: f64,
}

/// The measured GEMM points of one dtype.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmCurveSpec {
    /// Dtype key (`bf16`, `fp16`, `fp32`, `fp8`).
    pub dtype: String,
    /// Points as measured.
    pub points: Vec<GemmPoint>,
}

/// Flash-attention rates of one dtype, SI.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionRate {
    /// Dtype key.
    pub dtype: String,
    /// Forward FLOP/s.
    pub forward_flops_per_s: f64,
    /// Backward FLOP/s (work counted as `FLASH_BACKWARD_RATIO` x forward FLOPs).
    pub backward_flops_per_s: f64,
}

/// A fitted `t = alpha + bytes / beta`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AlphaBeta {
    /// Latency, seconds.
    pub alpha_s: f64,
    /// Bandwidth over the cost model's message size, bytes/s.
    pub beta_bytes_per_s: f64,
}

impl AlphaBeta {
    /// `alpha + bytes / beta`.
    #[inline]
    pub fn time_s(&self, bytes: f64) -> f64 {
        self.alpha_s + bytes / self.beta_bytes_per_s
    }
}

/// One collective's fit for one group size, SI.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CollectiveFit {
    /// The operation.
    pub op: LinkOp,
    /// Group size.
    pub ranks: u64,
    /// The fit.
    pub fit: AlphaBeta,
}

/// One collective's fit across nodes, SI.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct InterNodeFit {
    /// The operation.
    pub op: LinkOp,
    /// Nodes the group spans (at least 2).
    pub nodes: u64,
    /// Ranks of the group on each node.
    pub ranks_per_node: u64,
    /// The fit.
    pub fit: AlphaBeta,
}

/// A validated overlay in SI units, as the cluster carries it (and plans record it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// The overlay file it was read from.
    pub file: String,
    /// The measured device.
    pub device: String,
    /// When.
    pub measured_at: String,
    /// How.
    pub measured_with: String,
    /// GEMM curves per dtype.
    pub gemm: Vec<GemmCurveSpec>,
    /// Achieved HBM bandwidth, bytes/s.
    pub hbm_bytes_per_s: Option<f64>,
    /// Flash-attention rates per dtype.
    pub attention: Vec<AttentionRate>,
    /// Collectives inside one node.
    pub intra_node: Vec<CollectiveFit>,
    /// Collectives across nodes (absent in plans written before they were measured).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inter_node: Vec<InterNodeFit>,
}

/// The overlay key of a compute dtype (the spelling of `gpu.peak_tflops`).
pub fn dtype_key(dtype: DType) -> &'static str {
    match dtype {
        DType::Bf16 => "bf16",
        DType::F16 => "fp16",
        DType::Fp8 => "fp8",
        DType::F32 | DType::I32 | DType::U8 => "fp32",
    }
}

/// The dtype of an overlay key: a floating-point type in any spelling
/// [`DType::parse`] takes.
fn parse_dtype_key(key: &str) -> Option<DType> {
    DType::parse(key).filter(|d| !matches!(d, DType::I32 | DType::U8))
}

impl Calibration {
    /// The GEMM points of `dtype`, if measured.
    pub fn gemm_points(&self, dtype: DType) -> Option<&[GemmPoint]> {
        let key = dtype_key(dtype);
        self.gemm
            .iter()
            .find(|c| c.dtype == key)
            .map(|c| c.points.as_slice())
    }

    /// The flash-attention rates of `dtype`, if measured.
    pub fn attention_rate(&self, dtype: DType) -> Option<&AttentionRate> {
        let key = dtype_key(dtype);
        self.attention.iter().find(|a| a.dtype == key)
    }

    /// Whether the overlay's device and the cluster's GPU name the same family, by
    /// their model tokens (`A100`, `H100`, ...): `None` when either name has none.
    pub fn device_matches(&self, gpu_name: &str) -> Option<bool> {
        let a = model_tokens(&self.device);
        let b = model_tokens(gpu_name);
        if a.is_empty() || b.is_empty() {
            return None;
        }
        Some(a.iter().any(|t| b.contains(t)))
    }
}

/// Tokens of a GPU name that look like a model number: letters then digits (`H100`).
fn model_tokens(name: &str) -> Vec<String> {
    name.split(|c: char| !c.is_ascii_alphanumeric())
        .filter_map(|t| {
            let t = t.to_ascii_uppercase();
            let letters = t.chars().take_while(|c| c.is_ascii_alphabetic()).count();
            let rest = &t[letters..];
            ((1..=3).contains(&letters)
                && rest.len() >= 2
                && rest.chars().all(|c| c.is_ascii_digit()))
            .then_some(t)
        })
        .collect()
}

// === validation ===

fn invalid(file: &str, field: &str, message: impl Into<String>) -> IrError {
    IrError::invalid(file, field, message)
}

fn positive(file: &str, field: &str, v: f64) -> Result<f64, IrError> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(invalid(
            file,
            field,
            format!("must be a positive number, got {v}"),
        ))
    }
}

/// A measured rate must not beat the datasheet: if it does, the overlay belongs to
/// another GPU or the cluster file's peak is wrong.
fn below_peak(
    file: &str,
    field: &str,
    measured: f64,
    peak: f64,
    unit: &str,
    peak_field: &str,
    cluster_file: &str,
) -> Result<(), IrError> {
    if measured > peak * (1.0 + 1e-9) {
        return Err(invalid(
            file,
            field,
            format!(
                "{measured} {unit} exceeds the cluster's {peak_field} of {peak} {unit} ({cluster_file}): this overlay was measured on another GPU, or the cluster file's peak is wrong; use an overlay measured on this cluster's GPUs (`meshplan calibrate`) or correct {peak_field}"
            ),
        ));
    }
    Ok(())
}

impl RawOverlay {
    /// Checks every field against `cluster` (named `cluster_file` in messages) and
    /// converts to SI. `file` names the overlay in messages.
    pub fn validate(
        &self,
        file: &str,
        cluster: &Cluster,
        cluster_file: &str,
    ) -> Result<Calibration, IrError> {
        if self.format != OVERLAY_FORMAT {
            return Err(invalid(
                file,
                "format",
                format!(
                    "format {} is not the one this meshplan reads ({OVERLAY_FORMAT}); measure again with this version's `meshplan calibrate`",
                    self.format
                ),
            ));
        }
        if self.device.trim().is_empty() {
            return Err(invalid(
                file,
                "device",
                "must name the measured GPU (as the driver reports it, e.g. `NVIDIA H100 80GB HBM3`)",
            ));
        }
        let mut gemm = Vec::new();
        for (key, points) in &self.gemm {
            let field = format!("gemm.{key}");
            let dtype = parse_dtype_key(key).ok_or_else(|| {
                invalid(
                    file,
                    &field,
                    format!("unknown dtype `{key}`; expected bf16, fp16, fp32 or fp8"),
                )
            })?;
            if points.is_empty() || points.len() > GEMM_POINTS_MAX {
                return Err(invalid(
                    file,
                    &field,
                    format!(
                        "needs 1 to {GEMM_POINTS_MAX} points, got {}; remove the dtype or keep the sweep's points",
                        points.len()
                    ),
                ));
            }
            let peak = cluster.gpu.peak_flops(dtype) / 1e12;
            let mut out = Vec::with_capacity(points.len());
            for (i, p) in points.iter().enumerate() {
                let f = format!("{field}[{i}]");
                for (name, v) in [("m", p.m), ("n", p.n), ("k", p.k)] {
                    if v == 0 {
                        return Err(invalid(
                            file,
                            &format!("{f}.{name}"),
                            "must be a positive integer, got 0",
                        ));
                    }
                }
                let t = positive(file, &format!("{f}.tflops"), p.tflops)?;
                below_peak(
                    file,
                    &format!("{f}.tflops"),
                    t,
                    peak,
                    "TFLOP/s",
                    &format!("gpu.peak_tflops.{}", dtype_key(dtype)),
                    cluster_file,
                )?;
                out.push(GemmPoint {
                    m: p.m,
                    n: p.n,
                    k: p.k,
                    flops_per_s: t * 1e12,
                });
            }
            let key = dtype_key(dtype).to_string();
            if gemm.iter().any(|c: &GemmCurveSpec| c.dtype == key) {
                return Err(invalid(
                    file,
                    &field,
                    format!("`{key}` is given twice (as {key} and an alias); keep one"),
                ));
            }
            gemm.push(GemmCurveSpec {
                dtype: key,
                points: out,
            });
        }
        let hbm_bytes_per_s = match self.hbm_gbps {
            Some(h) => {
                let h = positive(file, "hbm_gbps", h)?;
                below_peak(
                    file,
                    "hbm_gbps",
                    h,
                    cluster.gpu.hbm_bytes_per_s / 1e9,
                    "GB/s",
                    "gpu.hbm_gbps",
                    cluster_file,
                )?;
                Some(h * 1e9)
            }
            None => None,
        };
        let mut attention = Vec::new();
        for (key, a) in &self.attention {
            let field = format!("attention.{key}");
            let dtype = parse_dtype_key(key).ok_or_else(|| {
                invalid(
                    file,
                    &field,
                    format!("unknown dtype `{key}`; expected bf16, fp16, fp32 or fp8"),
                )
            })?;
            let peak = cluster.gpu.peak_flops(dtype) / 1e12;
            let peak_field = format!("gpu.peak_tflops.{}", dtype_key(dtype));
            let fwd = positive(file, &format!("{field}.forward_tflops"), a.forward_tflops)?;
            below_peak(
                file,
                &format!("{field}.forward_tflops"),
                fwd,
                peak,
                "TFLOP/s",
                &peak_field,
                cluster_file,
            )?;
            let bwd = match a.backward_tflops {
                Some(b) => {
                    let b = positive(file, &format!("{field}.backward_tflops"), b)?;
                    below_peak(
                        file,
                        &format!("{field}.backward_tflops"),
                        b,
                        peak,
                        "TFLOP/s",
                        &peak_field,
                        cluster_file,
                    )?;
                    b
                }
                None => fwd,
            };
            let key = dtype_key(dtype).to_string();
            if attention.iter().any(|r: &AttentionRate| r.dtype == key) {
                return Err(invalid(
                    file,
                    &field,
                    format!("`{key}` is given twice (as {key} and an alias); keep one"),
                ));
            }
            attention.push(AttentionRate {
                dtype: key,
                forward_flops_per_s: fwd * 1e12,
                backward_flops_per_s: bwd * 1e12,
            });
        }
        let mut intra_node: Vec<CollectiveFit> = Vec::new();
        let mut sizes: Vec<u64> = Vec::new();
        for (i, c) in self.intra_node.iter().enumerate() {
            let f = format!("intra_node[{i}]");
            let op = parse_link_op(file, &format!("{f}.collective"), &c.collective)?;
            if c.ranks < 2 {
                return Err(invalid(
                    file,
                    &format!("{f}.ranks"),
                    format!(
                        "a collective needs at least 2 ranks, got {}; remove the entry",
                        c.ranks
                    ),
                ));
            }
            if op == LinkOp::SendRecv && c.ranks != 2 {
                return Err(invalid(
                    file,
                    &format!("{f}.ranks"),
                    format!(
                        "send_recv is between 2 ranks, got {}; write ranks: 2",
                        c.ranks
                    ),
                ));
            }
            if c.ranks > cluster.gpus_per_node {
                return Err(invalid(
                    file,
                    &format!("{f}.ranks"),
                    format!(
                        "{} ranks do not fit in one node of {} GPUs (gpus_per_node in {cluster_file}): the overlay was measured on a larger node; remove the entry or use an overlay of this node",
                        c.ranks, cluster.gpus_per_node
                    ),
                ));
            }
            let beta = checked_fit(file, &f, c.alpha_us, c.beta_gbps)?;
            if intra_node.iter().any(|x| x.op == op && x.ranks == c.ranks) {
                return Err(invalid(
                    file,
                    &f,
                    format!(
                        "{} over {} ranks is given twice; keep one fit",
                        op.name(),
                        c.ranks
                    ),
                ));
            }
            if !sizes.contains(&c.ranks) {
                sizes.push(c.ranks);
                if sizes.len() > COLLECTIVE_SIZES_MAX {
                    return Err(invalid(
                        file,
                        &format!("{f}.ranks"),
                        format!(
                            "more than {COLLECTIVE_SIZES_MAX} distinct group sizes; keep the sizes the cluster uses (powers of two up to gpus_per_node)"
                        ),
                    ));
                }
            }
            intra_node.push(CollectiveFit {
                op,
                ranks: c.ranks,
                fit: AlphaBeta {
                    alpha_s: c.alpha_us * 1e-6,
                    beta_bytes_per_s: beta * 1e9,
                },
            });
        }
        let inter_node = self.validate_inter_node(file, cluster, cluster_file)?;
        Ok(Calibration {
            file: file.to_string(),
            device: self.device.clone(),
            measured_at: self.measured_at.clone(),
            measured_with: self.measured_with.clone(),
            gemm,
            hbm_bytes_per_s,
            attention,
            intra_node,
            inter_node,
        })
    }

    /// The `inter_node` section, checked as `intra_node` is.
    fn validate_inter_node(
        &self,
        file: &str,
        cluster: &Cluster,
        cluster_file: &str,
    ) -> Result<Vec<InterNodeFit>, IrError> {
        if self.inter_node.len() > INTER_FITS_MAX {
            return Err(invalid(
                file,
                "inter_node",
                format!(
                    "{} fits, more than the {INTER_FITS_MAX} this meshplan keeps; keep the node counts and shapes the cluster uses",
                    self.inter_node.len()
                ),
            ));
        }
        let mut out: Vec<InterNodeFit> = Vec::with_capacity(self.inter_node.len());
        for (i, c) in self.inter_node.iter().enumerate() {
            let f = format!("inter_node[{i}]");
            let op = parse_link_op(file, &format!("{f}.op"), &c.op)?;
            if c.nodes < 2 {
                return Err(invalid(
                    file,
                    &format!("{f}.nodes"),
                    format!(
                        "a fit across nodes spans at least 2 nodes, got {}; put a measurement inside one node under intra_node",
                        c.nodes
                    ),
                ));
            }
            if c.nodes > crate::cluster::GPUS_MAX {
                return Err(invalid(
                    file,
                    &format!("{f}.nodes"),
                    format!(
                        "{} nodes is more than any cluster meshplan plans ({} GPUs); write the node count the fit was measured on",
                        c.nodes,
                        crate::cluster::GPUS_MAX
                    ),
                ));
            }
            if op == LinkOp::SendRecv && c.nodes != 2 {
                return Err(invalid(
                    file,
                    &format!("{f}.nodes"),
                    format!(
                        "send_recv is between 2 nodes, got {}; write nodes: 2",
                        c.nodes
                    ),
                ));
            }
            if c.ranks_per_node == 0 {
                return Err(invalid(
                    file,
                    &format!("{f}.ranks_per_node"),
                    "must be at least 1, got 0; write the group's ranks on each node",
                ));
            }
            if c.ranks_per_node > cluster.gpus_per_node {
                return Err(invalid(
                    file,
                    &format!("{f}.ranks_per_node"),
                    format!(
                        "{} ranks per node do not fit in a node of {} GPUs (gpus_per_node in {cluster_file}): the overlay was measured on larger nodes; remove the entry or use an overlay of this cluster",
                        c.ranks_per_node, cluster.gpus_per_node
                    ),
                ));
            }
            let beta = checked_fit(file, &f, c.alpha_us, c.beta_gbps)?;
            if out
                .iter()
                .any(|x| x.op == op && x.nodes == c.nodes && x.ranks_per_node == c.ranks_per_node)
            {
                return Err(invalid(
                    file,
                    &f,
                    format!(
                        "{} over {} nodes with {} ranks each is given twice; keep one fit",
                        op.name(),
                        c.nodes,
                        c.ranks_per_node
                    ),
                ));
            }
            out.push(InterNodeFit {
                op,
                nodes: c.nodes,
                ranks_per_node: c.ranks_per_node,
                fit: AlphaBeta {
                    alpha_s: c.alpha_us * 1e-6,
                    beta_bytes_per_s: beta * 1e9,
                },
            });
        }
        Ok(out)
    }
}

/// Parses overlay YAML text (named `file` in messages).
pub fn parse_overlay_yaml(text: &str, file: &str) -> Result<RawOverlay, IrError> {
    meshplan_ir::yaml_depth::check_yaml_depth(text, file)?;
    serde_yaml_ng::from_str(text).map_err(|e| IrError::from_yaml(file, &e))
}

/// Reads an overlay file.
pub fn load_overlay(path: &std::path::Path) -> Result<RawOverlay, IrError> {
    let text = meshplan_ir::load::read_text(path)?;
    parse_overlay_yaml(&text, &path.display().to_string())
}

/// A fit's `alpha_us` (non-negative) and `beta_gbps` (positive) under entry `f`:
/// the validated beta.
fn checked_fit(file: &str, f: &str, alpha_us: f64, beta_gbps: f64) -> Result<f64, IrError> {
    if !(alpha_us.is_finite() && alpha_us >= 0.0) {
        return Err(invalid(
            file,
            &format!("{f}.alpha_us"),
            format!("must be a non-negative number, got {alpha_us}"),
        ));
    }
    positive(file, &format!("{f}.beta_gbps"), beta_gbps)
}

/// A collective's name in an overlay, or an error naming `field` and the spellings.
fn parse_link_op(file: &str, field: &str, name: &str) -> Result<LinkOp, IrError> {
    LinkOp::parse(name).ok_or_else(|| {
        invalid(
            file,
            field,
            format!(
                "unknown collective `{name}`; expected one of {}",
                LinkOp::ALL.map(LinkOp::name).join(", ")
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_tokens_find_families() {
        assert_eq!(model_tokens("NVIDIA H100 80GB HBM3"), vec!["H100"]);
        assert_eq!(model_tokens("H100-SXM5-80GB"), vec!["H100"]);
        assert_eq!(model_tokens("A100-SXM4-80GB"), vec!["A100"]);
        assert!(model_tokens("cpu-thread").is_empty());
    }

    fn two_dgx() -> Cluster {
        crate::cluster::parse_cluster_yaml(
            "name: t\nnodes: 2\ngpus_per_node: 8\ngpu:\n  name: H100-SXM5-80GB\n  memory_gib: 80\n  peak_tflops: {bf16: 989, fp32: 67}\n  hbm_gbps: 3350\nintra_node:\n  link: nv\n  bandwidth_gbps: 450\n  latency_us: 3\ninter_node:\n  link: ib\n  bandwidth_gbps: 50\n  latency_us: 6\n",
            "t.yaml",
            None,
        )
        .expect("cluster")
    }

    const HEADER: &str = "format: 1\ndevice: NVIDIA H100 80GB HBM3\nmeasured_at: 2025-06-01T12:00:00Z\nmeasured_with: test\n";

    fn inter(entries: &str) -> Result<Calibration, IrError> {
        let raw = parse_overlay_yaml(&format!("{HEADER}inter_node:\n{entries}"), "o.yaml")?;
        raw.validate("o.yaml", &two_dgx(), "t.yaml")
    }

    #[test]
    fn inter_node_fits_round_trip_and_convert_to_si() {
        // 48 us and 46.5 GB/s are 4.8e-5 s and 4.65e10 B/s.
        let text = format!(
            "{HEADER}intra_node:\n  - {{collective: all_reduce, ranks: 8, alpha_us: 28.1, beta_gbps: 182.5}}\ninter_node:\n  - {{op: all_reduce, nodes: 2, ranks_per_node: 8, alpha_us: 48.0, beta_gbps: 46.5}}\n  - {{op: send_recv, nodes: 2, ranks_per_node: 1, alpha_us: 0.0, beta_gbps: 24.0}}\n"
        );
        let raw = parse_overlay_yaml(&text, "o.yaml").expect("parses");
        assert_eq!(raw.inter_node.len(), 2);
        let again = parse_overlay_yaml(&raw.to_yaml(), "again.yaml").expect("round trip");
        assert_eq!(again, raw);
        assert!(raw.to_yaml().contains(
            "  - {op: all_reduce, nodes: 2, ranks_per_node: 8, alpha_us: 48.0, beta_gbps: 46.5}"
        ));
        let c = raw.validate("o.yaml", &two_dgx(), "t.yaml").expect("valid");
        assert_eq!(c.inter_node.len(), 2);
        let f = c.inter_node[0];
        assert_eq!((f.op, f.nodes, f.ranks_per_node), (LinkOp::AllReduce, 2, 8));
        assert!((f.fit.alpha_s - 4.8e-5).abs() < 1e-18);
        assert!((f.fit.beta_bytes_per_s - 4.65e10).abs() < 1e-3);
        // Absent is empty, and an overlay without the section writes none.
        let old = parse_overlay_yaml(HEADER, "old.yaml").expect("old overlay");
        assert!(old.inter_node.is_empty());
        assert!(!old.to_yaml().contains("inter_node"));
    }

    #[test]
    fn bad_inter_node_entries_name_the_field_and_the_fix() {
        let cases: &[(&str, &[&str])] = &[
            (
                "  - {op: allreduce, nodes: 2, ranks_per_node: 8, alpha_us: 1, beta_gbps: 1}\n",
                &["inter_node[0].op", "all_reduce"],
            ),
            (
                "  - {op: all_reduce, nodes: 1, ranks_per_node: 8, alpha_us: 1, beta_gbps: 1}\n",
                &["inter_node[0].nodes", "at least 2", "intra_node"],
            ),
            (
                "  - {op: send_recv, nodes: 4, ranks_per_node: 8, alpha_us: 1, beta_gbps: 1}\n",
                &["inter_node[0].nodes", "nodes: 2"],
            ),
            (
                "  - {op: all_gather, nodes: 2, ranks_per_node: 0, alpha_us: 1, beta_gbps: 1}\n",
                &["inter_node[0].ranks_per_node", "at least 1"],
            ),
            (
                "  - {op: all_gather, nodes: 2, ranks_per_node: 16, alpha_us: 1, beta_gbps: 1}\n",
                &["inter_node[0].ranks_per_node", "node of 8 GPUs", "t.yaml"],
            ),
            (
                "  - {op: broadcast, nodes: 2, ranks_per_node: 8, alpha_us: -1, beta_gbps: 1}\n",
                &["inter_node[0].alpha_us", "non-negative"],
            ),
            (
                "  - {op: broadcast, nodes: 2, ranks_per_node: 8, alpha_us: 1, beta_gbps: .inf}\n",
                &["inter_node[0].beta_gbps", "positive"],
            ),
            (
                "  - {op: all_to_all, nodes: 2, ranks_per_node: 8, alpha_us: 1, beta_gbps: 1}\n  - {op: all_to_all, nodes: 2, ranks_per_node: 8, alpha_us: 2, beta_gbps: 2}\n",
                &["inter_node[1]", "given twice"],
            ),
            (
                "  - {op: all_to_all, node: 2, ranks_per_node: 8, alpha_us: 1, beta_gbps: 1}\n",
                &["o.yaml", "node"],
            ),
        ];
        for (entries, needles) in cases {
            let e = inter(entries).expect_err(entries).to_string();
            assert!(e.contains("o.yaml"), "{e}");
            for n in *needles {
                assert!(e.contains(n), "`{n}` missing from: {e}");
            }
        }
        let many: String = (0..=INTER_FITS_MAX)
            .map(|i| {
                format!(
                    "  - {{op: all_reduce, nodes: {}, ranks_per_node: 8, alpha_us: 1, beta_gbps: 1}}\n",
                    i + 2
                )
            })
            .collect();
        let e = inter(&many).expect_err("too many").to_string();
        assert!(
            e.contains("inter_node") && e.contains("more than the 32"),
            "{e}"
        );
    }

    #[test]
    fn link_op_names_round_trip() {
        for op in LinkOp::ALL {
            assert_eq!(LinkOp::parse(op.name()), Some(op));
            assert_eq!(LinkOp::ALL[op.index()], op);
        }
        assert_eq!(LinkOp::parse("allreduce"), None);
    }
}
