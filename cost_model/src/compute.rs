//! Compute time: FLOPs over an efficiency-scaled peak for matrix products, bytes over
//! HBM bandwidth for memory-bound kernels, and the larger of the two (roofline).

use crate::calib;
use crate::cluster::Gpu;
use meshplan_ir::DType;

/// Fraction of peak a `[m,k] x [k,n]` product reaches.
///
/// # Assumptions
/// Efficiency saturates in each dimension as `x / (x + GEMM_HALF_DIM)` towards
/// `GEMM_EFFICIENCY_MAX`: large square products run near the maximum, a product with
/// few rows (decode) or a short contraction (`head_dim`) runs slower. Wave
/// quantisation and tile shapes are not modelled.
#[inline]
pub fn gemm_efficiency(max: f64, m: f64, n: f64, k: f64) -> f64 {
    let s = |x: f64| x / (x + calib::GEMM_HALF_DIM);
    max * s(m) * s(n) * s(k)
}

/// Roofline throughput of one GPU for a compute dtype.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Roofline {
    /// Tensor-core peak, FLOP/s.
    pub peak_flops: f64,
    /// Achieved HBM bandwidth, bytes/s.
    pub hbm_bytes_per_s: f64,
    /// Fraction of peak large GEMMs reach.
    pub gemm_max: f64,
}

impl Roofline {
    /// The roofline of `gpu` computing in `dtype`.
    pub fn new(gpu: &Gpu, dtype: DType) -> Roofline {
        Roofline {
            peak_flops: gpu.peak_flops(dtype),
            hbm_bytes_per_s: gpu.hbm_bytes_per_s * calib::HBM_EFFICIENCY,
            gemm_max: gpu.gemm_efficiency,
        }
    }

    /// Time of a `[m,k] x [k,n]` product (`batch` of them) that also moves `bytes`.
    #[inline]
    pub fn gemm_s(&self, batch: f64, m: f64, n: f64, k: f64, bytes: f64) -> f64 {
        let flops = 2.0 * batch * m * n * k;
        if flops <= 0.0 {
            return 0.0;
        }
        let compute = flops / (self.peak_flops * gemm_efficiency(self.gemm_max, m, n, k));
        compute.max(bytes / self.hbm_bytes_per_s) + calib::KERNEL_OVERHEAD_S
    }

    /// Time of a memory-bound kernel moving `bytes`.
    #[inline]
    pub fn memory_s(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        bytes / self.hbm_bytes_per_s + calib::KERNEL_OVERHEAD_S
    }

    /// Time of a kernel that executes `flops` at `efficiency` and moves `bytes`.
    #[inline]
    pub fn kernel_s(&self, flops: f64, efficiency: f64, bytes: f64) -> f64 {
        if flops <= 0.0 && bytes <= 0.0 {
            return 0.0;
        }
        (flops / (self.peak_flops * efficiency)).max(bytes / self.hbm_bytes_per_s)
            + calib::KERNEL_OVERHEAD_S
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn efficiency_saturates_and_penalises_skinny() {
        let big = gemm_efficiency(0.8, 16384.0, 16384.0, 16384.0);
        assert!(big > 0.99 * 0.8);
        let decode = gemm_efficiency(0.8, 8.0, 16384.0, 16384.0);
        assert!(decode < 0.25 * big);
        let short_k = gemm_efficiency(0.8, 4096.0, 4096.0, 64.0);
        assert!(short_k < 0.7 * big);
    }

    #[test]
    fn gemm_time_is_2mnk_over_rate() {
        let r = Roofline {
            peak_flops: 100e12,
            hbm_bytes_per_s: 1e12,
            gemm_max: 0.8,
        };
        let (m, n, k) = (4096.0, 4096.0, 4096.0);
        let t = r.gemm_s(1.0, m, n, k, 0.0);
        let expect =
            2.0 * m * n * k / (100e12 * gemm_efficiency(0.8, m, n, k)) + calib::KERNEL_OVERHEAD_S;
        assert!((t - expect).abs() < 1e-15);
        // A decode-shaped product is bound by reading its weights.
        let w_bytes = 2.0 * 8192.0 * 8192.0;
        let t = r.gemm_s(1.0, 1.0, 8192.0, 8192.0, w_bytes);
        assert!((t - (w_bytes / 1e12 + calib::KERNEL_OVERHEAD_S)).abs() < 1e-12);
    }
}
