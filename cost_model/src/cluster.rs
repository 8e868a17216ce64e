//! The cluster file: GPUs per node, the GPU's peaks and memory, NVLink and
//! InfiniBand. Parsed into [`RawCluster`] (units as written: GB/s, us, GiB) and
//! validated into [`Cluster`] (SI: bytes/s, s, bytes) once.
//!
//! A cluster may carry a calibration overlay ([`crate::overlay`]): named in the file
//! (`calibration: overlay.yaml`, relative to the cluster file) or given on the command
//! line (`--calibration`, which wins).

use crate::overlay::{load_overlay, Calibration};
use meshplan_ir::{DType, IrError};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Datasheet peaks, TFLOP/s, dense.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPeaks {
    /// bfloat16 tensor-core peak.
    pub bf16: f64,
    /// fp16 tensor-core peak; defaults to `bf16`.
    #[serde(default)]
    pub fp16: Option<f64>,
    /// fp32 (non-tensor-core) peak.
    pub fp32: f64,
    /// fp8 peak, where the GPU has one.
    #[serde(default)]
    pub fp8: Option<f64>,
}

/// The GPU as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawGpu {
    /// Model name.
    pub name: String,
    /// Memory, GiB.
    pub memory_gib: f64,
    /// Peaks, TFLOP/s.
    pub peak_tflops: RawPeaks,
    /// HBM bandwidth, GB/s.
    pub hbm_gbps: f64,
    /// Fraction of peak that large GEMMs reach (measured); defaults per GPU family.
    #[serde(default)]
    pub gemm_efficiency: Option<f64>,
}

/// A link as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLink {
    /// Link technology (documentation only).
    pub link: String,
    /// GB/s per GPU per direction.
    pub bandwidth_gbps: f64,
    /// One-way latency, microseconds.
    pub latency_us: f64,
}

/// The cluster file as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCluster {
    /// Cluster name.
    pub name: String,
    /// Nodes (`--nodes` overrides).
    pub nodes: u64,
    /// GPUs in one node.
    pub gpus_per_node: u64,
    /// The GPU.
    pub gpu: RawGpu,
    /// Links between GPUs of a node.
    pub intra_node: RawLink,
    /// Links between nodes (required when `nodes > 1`).
    #[serde(default)]
    pub inter_node: Option<RawLink>,
    /// A calibration overlay to apply, relative to the cluster file.
    #[serde(default)]
    pub calibration: Option<PathBuf>,
}

/// A link in SI units.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Bytes per second per GPU per direction.
    pub bandwidth_bytes_per_s: f64,
    /// Seconds.
    pub latency_s: f64,
}

/// A GPU in SI units.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// Model name.
    pub name: String,
    /// Memory, bytes.
    pub memory_bytes: f64,
    /// bf16 peak, FLOP/s.
    pub peak_bf16_flops: f64,
    /// fp16 peak, FLOP/s.
    pub peak_fp16_flops: f64,
    /// fp32 peak, FLOP/s.
    pub peak_fp32_flops: f64,
    /// fp8 peak, FLOP/s (bf16 peak when the GPU has no fp8).
    pub peak_fp8_flops: f64,
    /// HBM bandwidth, bytes/s.
    pub hbm_bytes_per_s: f64,
    /// Fraction of peak that large GEMMs reach.
    pub gemm_efficiency: f64,
}

impl Gpu {
    /// Tensor-core peak for a compute dtype.
    pub fn peak_flops(&self, dtype: DType) -> f64 {
        match dtype {
            DType::Bf16 => self.peak_bf16_flops,
            DType::F16 => self.peak_fp16_flops,
            DType::Fp8 => self.peak_fp8_flops,
            _ => self.peak_fp32_flops,
        }
    }
}

/// A validated cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// Name.
    pub name: String,
    /// Nodes.
    pub nodes: u64,
    /// GPUs per node.
    pub gpus_per_node: u64,
    /// The GPU.
    pub gpu: Gpu,
    /// NVLink (or PCIe) inside a node.
    pub intra: Link,
    /// InfiniBand (or Ethernet) between nodes; equal to `intra` on a one-node cluster
    /// without an `inter_node` entry.
    pub inter: Link,
    /// What `meshplan calibrate` measured on these GPUs, if an overlay was applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<Calibration>,
    /// The fitted constants pricing reads (the defaults of [`crate::calib`]; a fit
    /// to published runs varies them).
    #[serde(skip)]
    pub constants: crate::calib::Constants,
}

/// Most GPUs a cluster may have: the most ranks a plan may describe (the planner's
/// `RANKS_MAX`); beyond it `nodes * gpus_per_node` could also wrap (2^61 nodes of 8
/// GPUs planned for "0 GPUs").
pub const GPUS_MAX: u64 = 1 << 20;

impl Cluster {
    /// GPUs in the cluster.
    pub fn gpus(&self) -> u64 {
        self.nodes * self.gpus_per_node
    }
}

fn positive(file: &str, field: &str, v: f64) -> Result<f64, IrError> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(IrError::invalid(
            file,
            field,
            format!("must be a positive number, got {v}"),
        ))
    }
}

fn link(file: &str, field: &str, l: &RawLink) -> Result<Link, IrError> {
    let bw = positive(file, &format!("{field}.bandwidth_gbps"), l.bandwidth_gbps)?;
    if !(l.latency_us.is_finite() && l.latency_us >= 0.0) {
        return Err(IrError::invalid(
            file,
            &format!("{field}.latency_us"),
            format!("must be a non-negative number, got {}", l.latency_us),
        ));
    }
    Ok(Link {
        bandwidth_bytes_per_s: bw * 1e9,
        latency_s: l.latency_us * 1e-6,
    })
}

impl RawCluster {
    /// Converts units and checks every field; `nodes_override` is `--nodes`.
    pub fn validate(&self, file: &str, nodes_override: Option<u64>) -> Result<Cluster, IrError> {
        let nodes = nodes_override.unwrap_or(self.nodes);
        let field = if nodes_override.is_some() {
            "--nodes"
        } else {
            "nodes"
        };
        if nodes == 0 {
            return Err(IrError::invalid(
                file,
                field,
                "must be a positive integer, got 0",
            ));
        }
        if self.gpus_per_node == 0 {
            return Err(IrError::invalid(
                file,
                "gpus_per_node",
                "must be a positive integer, got 0",
            ));
        }
        if nodes
            .checked_mul(self.gpus_per_node)
            .is_none_or(|g| g > GPUS_MAX)
        {
            return Err(IrError::invalid(
                file,
                field,
                format!(
                    "nodes({nodes}) * gpus_per_node({}) is more than the limit of {GPUS_MAX} GPUs",
                    self.gpus_per_node
                ),
            ));
        }
        let g = &self.gpu;
        let memory = positive(file, "gpu.memory_gib", g.memory_gib)?;
        let bf16 = positive(file, "gpu.peak_tflops.bf16", g.peak_tflops.bf16)?;
        let fp16 = positive(
            file,
            "gpu.peak_tflops.fp16",
            g.peak_tflops.fp16.unwrap_or(bf16),
        )?;
        let fp32 = positive(file, "gpu.peak_tflops.fp32", g.peak_tflops.fp32)?;
        let fp8 = positive(
            file,
            "gpu.peak_tflops.fp8",
            g.peak_tflops.fp8.unwrap_or(bf16),
        )?;
        let hbm = positive(file, "gpu.hbm_gbps", g.hbm_gbps)?;
        let gemm_efficiency = match g.gemm_efficiency {
            Some(e) if !(e.is_finite() && e > 0.0 && e <= 1.0) => {
                return Err(IrError::invalid(
                    file,
                    "gpu.gemm_efficiency",
                    format!("must be in (0, 1], got {e}"),
                ))
            }
            Some(e) => e,
            None => crate::calib::gemm_efficiency_for(&g.name),
        };
        let intra = link(file, "intra_node", &self.intra_node)?;
        let inter = match &self.inter_node {
            Some(l) => link(file, "inter_node", l)?,
            None if nodes == 1 => intra,
            None => {
                return Err(IrError::invalid(
                    file,
                    "inter_node",
                    format!(
                    "missing: {nodes} nodes need an `inter_node` link (bandwidth_gbps, latency_us)"
                ),
                ))
            }
        };
        Ok(Cluster {
            name: self.name.clone(),
            nodes,
            gpus_per_node: self.gpus_per_node,
            gpu: Gpu {
                name: g.name.clone(),
                memory_bytes: memory * 1024.0 * 1024.0 * 1024.0,
                peak_bf16_flops: bf16 * 1e12,
                peak_fp16_flops: fp16 * 1e12,
                peak_fp32_flops: fp32 * 1e12,
                peak_fp8_flops: fp8 * 1e12,
                hbm_bytes_per_s: hbm * 1e9,
                gemm_efficiency,
            },
            intra,
            inter,
            calibration: None,
            constants: crate::calib::Constants::default(),
        })
    }
}

/// Parses and validates cluster YAML text. A `calibration:` overlay it names is read
/// relative to the directory of `file`.
pub fn parse_cluster_yaml(
    text: &str,
    file: &str,
    nodes_override: Option<u64>,
) -> Result<Cluster, IrError> {
    parse_calibrated(text, file, nodes_override, None)
}

fn parse_calibrated(
    text: &str,
    file: &str,
    nodes_override: Option<u64>,
    overlay: Option<&Path>,
) -> Result<Cluster, IrError> {
    meshplan_ir::yaml_depth::check_yaml_depth(text, file)?;
    let raw: RawCluster =
        serde_yaml_ng::from_str(text).map_err(|e| IrError::from_yaml(file, &e))?;
    let mut cluster = raw.validate(file, nodes_override)?;
    // A file names only overlays beside it: a shared cluster file must not make
    // meshplan read (and quote) whatever path it likes. The flag may name any path.
    if let Some(p) = raw.calibration.as_ref().filter(|_| overlay.is_none()) {
        let escapes = p.components().any(|c| {
            !matches!(
                c,
                std::path::Component::Normal(_) | std::path::Component::CurDir
            )
        });
        if escapes {
            return Err(IrError::invalid(
                file,
                "calibration",
                format!(
                    "names {}, outside the cluster file's folder; write a path relative to the cluster file without `..`, or pass the overlay with --calibration",
                    p.display()
                ),
            ));
        }
    }
    let named = raw.calibration.as_ref().map(|p| {
        Path::new(file)
            .parent()
            .map_or_else(|| p.clone(), |dir| dir.join(p))
    });
    let path = match (overlay, &named) {
        (Some(flag), _) => flag.to_path_buf(),
        (None, Some(named)) => {
            if !named.is_file() {
                return Err(IrError::invalid(
                    file,
                    "calibration",
                    format!(
                        "names {}, which is not a readable file; write the overlay's path relative to the cluster file, or remove the field",
                        named.display()
                    ),
                ));
            }
            named.clone()
        }
        (None, None) => return Ok(cluster),
    };
    cluster.calibration = Some(apply_overlay(&cluster, &path, file)?);
    Ok(cluster)
}

/// Reads the overlay at `path` and validates it against `cluster` (named
/// `cluster_file` in messages).
pub fn apply_overlay(
    cluster: &Cluster,
    path: &Path,
    cluster_file: &str,
) -> Result<Calibration, IrError> {
    let raw = load_overlay(path)?;
    raw.validate(&path.display().to_string(), cluster, cluster_file)
}

/// Reads a cluster file (and the calibration overlay it names, if any).
pub fn load_cluster(path: &Path, nodes_override: Option<u64>) -> Result<Cluster, IrError> {
    load_cluster_calibrated(path, nodes_override, None)
}

/// Reads a cluster file and lays a calibration overlay over it: `overlay` (the
/// `--calibration` flag) if given, else the one the file names, else none.
pub fn load_cluster_calibrated(
    path: &Path,
    nodes_override: Option<u64>,
    overlay: Option<&Path>,
) -> Result<Cluster, IrError> {
    let text = meshplan_ir::load::read_text(path)?;
    parse_calibrated(&text, &path.display().to_string(), nodes_override, overlay)
}

/// How a communication group sits on the cluster: `size` ranks, `per_node` of them
/// in each node it touches (groups are regular: every node holds the same number).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupShape {
    /// Ranks in the group.
    pub size: u64,
    /// Ranks of the group inside one node.
    pub per_node: u64,
}

impl GroupShape {
    /// The group of a mesh axis of `size` whose ranks are `stride` apart in the global
    /// rank order (inner axes first, so `stride` is the product of the inner sizes).
    ///
    /// # Assumptions
    /// Ranks fill nodes in order (rank `r` is on node `r / gpus_per_node`), and the
    /// axis sizes divide or are multiples of `gpus_per_node`.
    pub fn of_axis(size: u64, stride: u64, gpus_per_node: u64) -> GroupShape {
        let per_node = if stride >= gpus_per_node {
            1
        } else {
            (gpus_per_node / stride.max(1)).clamp(1, size.max(1))
        };
        GroupShape {
            size,
            per_node: per_node.min(size.max(1)),
        }
    }

    /// Nodes the group spans.
    pub fn nodes(&self) -> u64 {
        self.size.div_ceil(self.per_node.max(1))
    }
}
