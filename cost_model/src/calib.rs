//! Every calibration constant of the cost model, in one place, with its source.
//!
//! These were set once against the published runs in `tests/data/published.yaml`
//! (Narayanan et al. 2021 Table 1 on A100; Megatron-Core weak scaling on H100) by a
//! coarse grid search over the few free constants below, the same constants for every
//! run; a calibration overlay (`meshplan calibrate`, [`crate::overlay`]) replaces the
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
    ("A100", 0.70),
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

/// Fraction of peak a flash-attention kernel reaches on the work it executes.
/// FlashAttention-2 reaches ~350 of 989 TFLOP/s forward on H100 at head_dim 128 and
/// less backward (FlashAttention-3 paper, Fig. 1-2); the H100 runs replayed here predate
/// FA3. Fitted value (only the H100 runs use a flash kernel).
pub const FLASH_ATTENTION_EFFICIENCY: f64 = 0.35;

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
/// (nccl-tests on HDR/NDR rails: 80-90% of line rate).
pub const IB_EFFICIENCY: f64 = 0.85;

/// Fixed cost per graph op and pass, seconds: one op of the graph is several kernels in
/// a real framework (casts, bias, fused epilogues, layout changes) plus dispatch on the
/// host, 3-5 us each. Fitted value; it is what separates small models from large ones.
pub const KERNEL_OVERHEAD_S: f64 = 20e-6;

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
