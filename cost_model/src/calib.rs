//! Every calibration constant of the cost model, in one place, with its source.
//!
//! The fitted ones were set once against the published runs in
//! `tests/data/published.yaml` (22 runs on seven software stacks; the three DeepSpeed
//! ZeRO-3 rows of 2021 are reported but not fitted, see `tests/it/calibration.rs`) by
//! a coordinate search within physical bounds, the same constants for every run
//! (`calibration::fit`); a calibration overlay (`meshplan calibrate`, [`crate::overlay`]) replaces the
//! GEMM, HBM, flash-attention and in-node collective ones with measurements of the
//! user's own GPUs.

/// Fraction of the datasheet peak that large, well-shaped GEMMs reach inside a real
/// training step (clocks under sustained load, fp16/bf16 casts, tile tails), for GPUs
/// the table below does not name. Fitted value.
pub const GEMM_EFFICIENCY_MAX: f64 = 0.75;

/// Per GPU family, the same fraction: the first entry whose key the GPU's name
/// contains wins. A cluster file may set `gpu.gemm_efficiency` to override it (what
/// `meshplan calibrate` measures).
///
/// Sources: A100 cuBLAS reaches 250-280 of 312 TFLOP/s on 8192^3 fp16 in isolation;
/// Hopper parts are power-limited well below their 989 TFLOP/s datasheet peak
/// (we measured 769-798 on an H200 for one 8192^3 product; sustained training runs
/// lower). The values themselves were fitted on the published runs.
pub const GEMM_EFFICIENCY_BY_GPU: &[(&str, f64)] = &[
    ("A100", 0.7265),
    ("H100", 0.62),
    ("H200", 0.62),
    ("H800", 0.62),
];

/// The GEMM efficiency maximum for a GPU name.
pub fn gemm_efficiency_for(gpu_name: &str) -> f64 {
    GEMM_EFFICIENCY_BY_GPU
        .iter()
        .find(|(k, _)| gpu_name.contains(k))
        .map_or(GEMM_EFFICIENCY_MAX, |(_, v)| *v)
}

/// With tensor-parallel communication overlapped with the adjacent GEMMs
/// (Megatron-Core `--tp-comm-overlap`), the share of each collective that stays
/// exposed: the first chunk of a pipelined AllGather/ReduceScatter cannot overlap.
pub const TP_OVERLAP_EXPOSED_SHARE: f64 = 0.2;

/// Dimension at which a GEMM reaches half of its maximum efficiency along that
/// dimension: efficiency `x / (x + GEMM_HALF_DIM)` per dimension, so skinny or small
/// GEMMs (decode with few tokens, `head_dim`-wide attention products) run slower.
/// Source: the knee of cuBLAS efficiency curves on A100/H100 lies near 64-128 for the
/// smallest dimension. Fitted value.
pub const GEMM_HALF_DIM: f64 = 40.0;

/// Fraction of an Ampere-class peak a flash-attention kernel reaches on the work it
/// executes at head dimension 128 over long sequences: FlashAttention-2 reaches about
/// 70% of the A100's 312 TFLOP/s forward and backward (FlashAttention-2 paper, Fig. 6);
/// Hopper scales it by [`flash_arch_scale`]. Fitted value, at the lower bound of
/// FlashAttention-2's published range (50-73%).
pub const FLASH_ATTENTION_EFFICIENCY: f64 = 0.5316;

/// Backward work of a flash kernel relative to its forward: 2x for the two gradient
/// products plus the recomputed scores (FlashAttention paper, Sec. 3.1).
pub const FLASH_BACKWARD_RATIO: f64 = 2.5;

/// Fraction of HBM bandwidth reached by memory-bound kernels (elementwise, norms,
/// softmax). STREAM-like copies reach 85-92% of datasheet bandwidth on A100/H100;
/// the measured H200 device copy was 4.3 of 4.8 TB/s (90%). Fitted value.
pub const HBM_EFFICIENCY: f64 = 0.70;

/// Fraction of the NVLink per-GPU bandwidth that NCCL collectives reach (nccl-tests
/// bus bandwidth ~230 GB/s on 8x A100 NVLink3 at 300 GB/s; ~360-370 GB/s of 450 on H100).
pub const NVLINK_EFFICIENCY: f64 = 0.78;

/// Fraction of the InfiniBand per-GPU bandwidth that NCCL reaches across nodes
/// (nccl-tests on HDR/NDR rails: 80-90% of line rate). Fitted value: the fit sits at
/// the bound 1.0, i.e. the published runs were at least as fast across nodes as
/// the cluster files' line rates allow under this model.
pub const IB_EFFICIENCY: f64 = 1.0;

/// Fixed cost per graph op and pass, seconds: one op of the graph is several kernels in
/// a real framework (casts, bias, fused epilogues, layout changes) plus dispatch on the
/// host, 3-5 us each. Fitted value (at its lower bound, 3 us: the per-micro-batch
/// host cost below carries what separates small models from large ones).
pub const KERNEL_OVERHEAD_S: f64 = 3e-6;

/// Parameters per data-parallel gradient bucket (Megatron-LM's default bucket is
/// 40M elements).
pub const DP_BUCKET_PARAMS: f64 = 40e6;

/// Bytes of HBM traffic per parameter in one AdamW step with fp32 master weights:
/// read param, grad, m, v (4+4+4+4); write param, m, v (4+4+4); write the bf16 copy (2).
pub const ADAMW_BYTES_PER_PARAM: f64 = 30.0;

/// CUDA context, cuBLAS workspace and NCCL channel buffers per GPU, bytes
/// (PyTorch reports ~0.5-1 GiB of non-tensor memory per process on Hopper).
pub const RUNTIME_RESERVED_BYTES: f64 = 1.0 * 1024.0 * 1024.0 * 1024.0;

/// Tree AllReduce bandwidth cost relative to a ring's `2 M / bw` (assumed: nccl-tests
/// bus bandwidth with `NCCL_ALGO=Tree` on large buffers is roughly two thirds of Ring's).
pub const TREE_BANDWIDTH_FACTOR: f64 = 1.5;

/// The fitted constants a pricing reads at run time, so that a fit to published runs
/// (and its leave-one-out refits) can vary them without rebuilding: every field
/// defaults to the constant of the same meaning above. A cluster carries one set
/// ([`crate::Cluster::constants`]); the same set prices every configuration on it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Constants {
    /// [`HBM_EFFICIENCY`].
    pub hbm_efficiency: f64,
    /// [`NVLINK_EFFICIENCY`].
    pub nvlink_efficiency: f64,
    /// [`IB_EFFICIENCY`].
    pub ib_efficiency: f64,
    /// [`KERNEL_OVERHEAD_S`].
    pub kernel_overhead_s: f64,
    /// [`FLASH_ATTENTION_EFFICIENCY`]: the flash kernel's fraction of an Ampere-class
    /// peak (see [`flash_arch_scale`]).
    pub flash_efficiency: f64,
    /// [`COMM_COMPUTE_SLOWDOWN`].
    pub comm_compute_slowdown: f64,
    /// [`MICROBATCH_OVERHEAD_S`].
    pub microbatch_overhead_s: f64,
    /// [`STEP_OVERHEAD_S`].
    pub step_overhead_s: f64,
}

impl Default for Constants {
    fn default() -> Constants {
        Constants {
            hbm_efficiency: HBM_EFFICIENCY,
            nvlink_efficiency: NVLINK_EFFICIENCY,
            ib_efficiency: IB_EFFICIENCY,
            kernel_overhead_s: KERNEL_OVERHEAD_S,
            flash_efficiency: FLASH_ATTENTION_EFFICIENCY,
            comm_compute_slowdown: COMM_COMPUTE_SLOWDOWN,
            microbatch_overhead_s: MICROBATCH_OVERHEAD_S,
            step_overhead_s: STEP_OVERHEAD_S,
        }
    }
}

/// Compute time lost per second of communication that runs beside it: NCCL kernels
/// occupy SMs (one per channel, 8-32 of an A100's 108) and HBM bandwidth for their
/// copies and reductions, so a GEMM overlapped with a collective runs slower than
/// alone (measured slowdowns of 10-30% for overlapped GEMMs in the literature, e.g.
/// the Domino and FLUX papers). Fitted value.
pub const COMM_COMPUTE_SLOWDOWN: f64 = 0.231;

/// Host-side cost of one micro-batch on one pipeline stage, seconds: the framework's
/// schedule step, hooks, the loss's host synchronisation and the launch gap before
/// the first kernel. Fitted value; it matters where micro-batches are short.
pub const MICROBATCH_OVERHEAD_S: f64 = 0.0;

/// Host-side cost of one optimizer step outside the micro-batches, seconds: fetching
/// the next batch, the loss and gradient-norm reductions to the host, logging and
/// timers, the optimizer's kernel launches (one or a few per parameter tensor).
/// Fitted value; it matters where steps are short (small models, few micro-batches).
pub const STEP_OVERHEAD_S: f64 = 0.0474;

/// Head dimension at which a flash-attention kernel reaches half of its efficiency
/// along that axis: its inner products are `head_dim` long, so small heads run below
/// the kernel's best (FlashAttention-2 paper, Fig. 4-5: head dimension 64 reaches
/// about 85-90% of head dimension 128 at the same sequence length).
pub const FLASH_HALF_HEAD_DIM: f64 = 16.0;

/// Sequence length at which a flash kernel reaches half of its best rate: short
/// sequences give each thread block few key tiles to stream (FlashAttention-2 paper:
/// at 512 tokens about 70% of the 16k rate).
pub const FLASH_HALF_SEQ: f64 = 256.0;

/// How a flash-attention kernel's rate falls for heads of `head_dim` over `seq` keys,
/// relative to head dimension 128 over long sequences (1 there, below 1 for small
/// heads and short sequences; never above 1).
pub fn flash_shape(head_dim: f64, seq: f64) -> f64 {
    let hd = head_dim / (head_dim + FLASH_HALF_HEAD_DIM) * (128.0 + FLASH_HALF_HEAD_DIM) / 128.0;
    let s = seq / (seq + FLASH_HALF_SEQ) * (16384.0 + FLASH_HALF_SEQ) / 16384.0;
    (hd.min(1.0) * s.min(1.0)).max(1e-3)
}

/// A flash kernel's fraction of the dense peak on `gpu_name` relative to an
/// Ampere-class GPU. FlashAttention-2 is written for Ampere's `mma.sync`; on Hopper
/// it does not use the warp-group instructions that give Hopper its peak, so its
/// rate stays near what the same SMs reach with Ampere instructions.
pub fn flash_arch_scale(gpu_name: &str) -> f64 {
    if ["H100", "H200", "H800", "H20", "GH200"]
        .iter()
        .any(|k| gpu_name.contains(k))
    {
        FLASH_HOPPER_SCALE
    } else {
        1.0
    }
}

/// A flash kernel's fraction of peak on Hopper relative to its fraction on Ampere:
/// FlashAttention-2 reaches about 70% of the A100's 312 TFLOP/s (FlashAttention-2
/// paper, Fig. 6) and 335-350 of the H100's 989 (FlashAttention-3 paper, Fig. 1):
/// 0.35 / 0.70 = 0.5.
pub const FLASH_HOPPER_SCALE: f64 = 0.5;

/// Streaming multiprocessors per GPU family, for wave quantisation: the first entry
/// whose key the GPU's name contains wins; 0 (not modelled) for others. Sources: the
/// A100 (108 SMs) and H100 SXM (132 SMs) whitepapers; H200 and H800 are H100 dies.
pub const SMS_BY_GPU: &[(&str, f64)] = &[
    ("A100", 108.0),
    ("H100", 132.0),
    ("H200", 132.0),
    ("H800", 132.0),
];

/// The SM count of a GPU name (0 when unknown).
pub fn sms_for(gpu_name: &str) -> f64 {
    SMS_BY_GPU
        .iter()
        .find(|(k, _)| gpu_name.contains(k))
        .map_or(0.0, |(_, v)| *v)
}
