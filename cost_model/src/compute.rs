//! Compute time: FLOPs over an efficiency-scaled peak for matrix products, bytes over
//! HBM bandwidth for memory-bound kernels, and the larger of the two (roofline).
//!
//! A cluster with a calibration overlay ([`crate::overlay`]) replaces the datasheet
//! side with measurements: a [`GemmCurve`] of achieved GEMM FLOP/s, the measured HBM
//! bandwidth and the measured flash-attention rates.

use crate::calib;
use crate::cluster::Cluster;
use crate::overlay::{GemmPoint, GEMM_POINTS_MAX};
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

/// Output tile side a GEMM kernel uses along a dimension of `d`: 128 for large
/// dimensions (cuBLAS/CUTLASS's 128x128 and 128x256 tiles); a dimension below 128
/// gets a kernel shaped for it (narrow tiles, or a GEMV for decode's few rows),
/// which the shape term of [`gemm_efficiency`] prices instead.
#[inline]
pub fn tile_side(d: f64) -> f64 {
    if d >= 128.0 {
        128.0
    } else {
        d.max(1.0)
    }
}

/// Fraction of a `batch x [m,k] x [k,n]` product's tile work that is useful.
///
/// # Assumptions
/// - Tile quantisation: the output is computed in whole tiles ([`tile_side`]), so a
///   dimension of 129 costs two tiles (NVIDIA's Matrix Multiplication Background
///   guide, "Tile quantization"): `m n / (pad(m) pad(n))`.
/// - Wave quantisation: tiles run in waves of one tile per SM; a last partial wave
///   costs a whole one: `tiles / (ceil(tiles / sms) sms)` ("Wave quantization", same
///   guide). `sms = 0` leaves it out.
/// - Split-K: a product with fewer output tiles than SMs splits its contraction over
///   the idle SMs, as cuBLAS and CUTLASS do for skinny products (CUTLASS's split-K,
///   and Stream-K, Osama et al. 2023), in slices of at least [`SPLIT_K_MIN`]:
///   [`split_k`] times the tiles fill the waves.
#[inline]
pub fn quantisation(batch: f64, m: f64, n: f64, k: f64, sms: f64) -> f64 {
    let (tm, tn) = (tile_side(m), tile_side(n));
    let (pm, pn) = ((m / tm).ceil(), (n / tn).ceil());
    let tile = m * n / (pm * tm * pn * tn);
    if sms <= 0.0 {
        return tile;
    }
    let tiles = batch.max(1.0).ceil() * pm * pn * split_k(batch, m, n, k, sms);
    tile * tiles / ((tiles / sms).ceil() * sms)
}

/// Shortest contraction slice a split-K kernel gives one SM: below it the partial
/// sums' write and reduction outweigh the slice (CUTLASS's split-K examples slice a
/// 4096-long contraction at most 16 ways).
pub const SPLIT_K_MIN: f64 = 256.0;

/// Slices the contraction of a product with fewer output tiles than `sms` is split
/// into (1 when the tiles fill the SMs or the contraction is short).
#[inline]
pub fn split_k(batch: f64, m: f64, n: f64, k: f64, sms: f64) -> f64 {
    let tiles = batch.max(1.0).ceil() * (m / tile_side(m)).ceil() * (n / tile_side(n)).ceil();
    if sms <= 0.0 || tiles >= sms {
        return 1.0;
    }
    (sms / tiles)
        .floor()
        .min((k / SPLIT_K_MIN).floor())
        .max(1.0)
}

/// How much slower a `[m,k] x [k,n]` product runs than the cube of the same FLOPs
/// (side `c = (m n k)^(1/3)`), by the shape term of [`gemm_efficiency`]:
/// `s(m) s(n) s(k) / s(c)^3` with `s(x) = x / (x + GEMM_HALF_DIM)`.
///
/// 1 for a cube and below 1 for any other shape (`ln s` is concave in `ln x`, so
/// Jensen's inequality bounds the product by the cube's).
#[inline]
pub fn shape_factor(m: f64, n: f64, k: f64) -> f64 {
    let s = |x: f64| x / (x + calib::GEMM_HALF_DIM);
    let c = (m * n * k).cbrt();
    let sc = s(c);
    (s(m) * s(n) * s(k) / (sc * sc * sc)).min(1.0)
}

/// A measured GEMM curve: achieved FLOP/s of cube-shaped products over their FLOPs,
/// in a fixed-size form so that a pricing context stays `Copy`.
///
/// # Assumptions
/// - The rate is linear in `ln(FLOPs)` between measured points and flat beyond the
///   first and the last (small products are dominated by the per-kernel overhead,
///   large ones are saturated).
/// - A product of another shape runs at the rate of its FLOPs times
///   [`shape_factor`]; a point measured at a non-cube shape enters the curve divided
///   by its shape factor, so it reproduces its own time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmCurve {
    len: usize,
    ln_flops: [f64; GEMM_POINTS_MAX],
    flops_per_s: [f64; GEMM_POINTS_MAX],
}

impl GemmCurve {
    /// The curve through `points` (at most [`GEMM_POINTS_MAX`], validated positive);
    /// points of equal FLOPs are averaged. `None` for no points.
    pub fn from_points(points: &[GemmPoint]) -> Option<GemmCurve> {
        let mut pts: Vec<(f64, f64)> = points
            .iter()
            .take(GEMM_POINTS_MAX)
            .map(|p| {
                let (m, n, k) = (p.m as f64, p.n as f64, p.k as f64);
                (
                    (2.0 * m * n * k).ln(),
                    p.flops_per_s / shape_factor(m, n, k),
                )
            })
            .collect();
        if pts.is_empty() {
            return None;
        }
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut c = GemmCurve {
            len: 0,
            ln_flops: [0.0; GEMM_POINTS_MAX],
            flops_per_s: [0.0; GEMM_POINTS_MAX],
        };
        let mut i = 0;
        while i < pts.len() {
            let x = pts[i].0;
            let same: Vec<f64> = pts[i..]
                .iter()
                .take_while(|p| p.0 == x)
                .map(|p| p.1)
                .collect();
            c.ln_flops[c.len] = x;
            c.flops_per_s[c.len] = same.iter().sum::<f64>() / same.len() as f64;
            c.len += 1;
            i += same.len();
        }
        Some(c)
    }

    /// Rate of a cube-shaped product of `flops` FLOPs.
    #[inline]
    pub fn cube_rate(&self, flops: f64) -> f64 {
        let x = flops.ln();
        let (xs, ys) = (&self.ln_flops[..self.len], &self.flops_per_s[..self.len]);
        if x <= xs[0] {
            return ys[0];
        }
        let last = self.len - 1;
        if x >= xs[last] {
            return ys[last];
        }
        let j = xs.partition_point(|&v| v <= x);
        let (x0, x1, y0, y1) = (xs[j - 1], xs[j], ys[j - 1], ys[j]);
        y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    }

    /// Rate of a `[m,k] x [k,n]` product, FLOP/s.
    #[inline]
    pub fn rate(&self, m: f64, n: f64, k: f64) -> f64 {
        self.cube_rate(2.0 * m * n * k) * shape_factor(m, n, k)
    }
}

/// Roofline throughput of one GPU for a compute dtype.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Roofline {
    /// Tensor-core peak, FLOP/s.
    pub peak_flops: f64,
    /// Achieved HBM bandwidth, bytes/s.
    pub hbm_bytes_per_s: f64,
    /// Fraction of peak large GEMMs reach (the datasheet model, without a curve).
    pub gemm_max: f64,
    /// Measured GEMM rates; replaces `peak_flops x gemm_efficiency` when present.
    pub gemm_curve: Option<GemmCurve>,
    /// Fraction of peak the flash-attention forward reaches.
    pub flash_fwd_efficiency: f64,
    /// Fraction of peak the flash-attention backward reaches (on
    /// `FLASH_BACKWARD_RATIO` x the forward's FLOPs).
    pub flash_bwd_efficiency: f64,
    /// Fixed cost of one kernel, s (`calib::Constants::kernel_overhead_s`).
    pub kernel_overhead_s: f64,
    /// Streaming multiprocessors, for wave quantisation (0: not modelled).
    pub sms: f64,
}

impl Roofline {
    /// The roofline of a datasheet GPU (no measurements): `peak_flops` FLOP/s,
    /// `hbm_bytes_per_s` achieved, GEMMs up to `gemm_max` of peak.
    pub fn uncalibrated(peak_flops: f64, hbm_bytes_per_s: f64, gemm_max: f64) -> Roofline {
        Roofline {
            peak_flops,
            hbm_bytes_per_s,
            gemm_max,
            gemm_curve: None,
            flash_fwd_efficiency: calib::FLASH_ATTENTION_EFFICIENCY,
            flash_bwd_efficiency: calib::FLASH_ATTENTION_EFFICIENCY,
            kernel_overhead_s: calib::KERNEL_OVERHEAD_S,
            sms: 0.0,
        }
    }

    /// The roofline of `cluster`'s GPU computing in `dtype`: the datasheet with the
    /// fitted fractions of [`calib`], or what the cluster's calibration overlay
    /// measured for this dtype where it has it.
    pub fn new(cluster: &Cluster, dtype: DType) -> Roofline {
        let gpu = &cluster.gpu;
        let peak = gpu.peak_flops(dtype);
        let k = &cluster.constants;
        let mut r = Roofline::uncalibrated(
            peak,
            gpu.hbm_bytes_per_s * k.hbm_efficiency,
            gpu.gemm_efficiency,
        );
        r.kernel_overhead_s = k.kernel_overhead_s;
        r.sms = calib::sms_for(&gpu.name);
        r.flash_fwd_efficiency = k.flash_efficiency * calib::flash_arch_scale(&gpu.name);
        r.flash_bwd_efficiency = r.flash_fwd_efficiency;
        if let Some(c) = &cluster.calibration {
            if let Some(points) = c.gemm_points(dtype) {
                r.gemm_curve = GemmCurve::from_points(points);
            }
            if let Some(h) = c.hbm_bytes_per_s {
                r.hbm_bytes_per_s = h;
            }
            if let Some(a) = c.attention_rate(dtype) {
                r.flash_fwd_efficiency = a.forward_flops_per_s / peak;
                r.flash_bwd_efficiency = a.backward_flops_per_s / peak;
            }
        }
        r
    }

    /// FLOP/s of a `[m,k] x [k,n]` product.
    #[inline]
    pub fn gemm_rate(&self, m: f64, n: f64, k: f64) -> f64 {
        match &self.gemm_curve {
            Some(c) => c.rate(m, n, k),
            None => self.peak_flops * gemm_efficiency(self.gemm_max, m, n, k),
        }
    }

    /// Time of a `[m,k] x [k,n]` product (`batch` of them) that also moves `bytes`.
    #[inline]
    pub fn gemm_s(&self, batch: f64, m: f64, n: f64, k: f64, bytes: f64) -> f64 {
        let flops = 2.0 * batch * m * n * k;
        if flops <= 0.0 {
            return 0.0;
        }
        // A measured curve's points carry their own tile and wave losses.
        let q = if self.gemm_curve.is_some() {
            1.0
        } else {
            quantisation(batch, m, n, k, self.sms)
        };
        let compute = flops / (self.gemm_rate(m, n, k) * q);
        // Split-K writes each slice's fp32 partial sums and reads them back to reduce.
        let splits = if self.gemm_curve.is_some() {
            1.0
        } else {
            split_k(batch, m, n, k, self.sms)
        };
        let partials = (splits - 1.0) * batch.max(1.0) * m * n * 4.0 * 2.0;
        compute.max((bytes + partials) / self.hbm_bytes_per_s) + self.kernel_overhead_s
    }

    /// Time of a memory-bound kernel moving `bytes`.
    #[inline]
    pub fn memory_s(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        bytes / self.hbm_bytes_per_s + self.kernel_overhead_s
    }

    /// Time of a kernel that executes `flops` at `efficiency` and moves `bytes`.
    #[inline]
    pub fn kernel_s(&self, flops: f64, efficiency: f64, bytes: f64) -> f64 {
        if flops <= 0.0 && bytes <= 0.0 {
            return 0.0;
        }
        (flops / (self.peak_flops * efficiency)).max(bytes / self.hbm_bytes_per_s)
            + self.kernel_overhead_s
    }

    /// Forward and backward time of a flash-attention kernel executing `flops`
    /// forward FLOPs (causal share applied) and moving `io_bytes`, for heads of
    /// `head_dim` over `seq` keys: the kernel's rate falls for small heads and short
    /// sequences ([`calib::flash_shape`]), measured rates included.
    pub fn flash_s(&self, flops: f64, io_bytes: f64, head_dim: f64, seq: f64) -> (f64, f64) {
        let shape = calib::flash_shape(head_dim, seq);
        (
            self.kernel_s(flops, self.flash_fwd_efficiency * shape, io_bytes),
            self.kernel_s(
                flops * calib::FLASH_BACKWARD_RATIO,
                self.flash_bwd_efficiency * shape,
                2.0 * io_bytes,
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_and_waves_waste_what_they_pad() {
        // 8192 x 8192 on 128x128 tiles: 64 x 64 = 4096 tiles, no padding; on 108 SMs
        // 38 waves hold 4104 tiles: 4096 / 4104 = 0.99805.
        let q = quantisation(1.0, 8192.0, 8192.0, 8192.0, 108.0);
        assert!((q - 4096.0 / 4104.0).abs() < 1e-12, "{q}");
        // 8320 = 65 x 128 (no padding) but 8321 needs 66 tiles: 8321 / 8448 along m.
        assert!((quantisation(1.0, 8321.0, 128.0, 4096.0, 0.0) - 8321.0 / 8448.0).abs() < 1e-12);
        // A hidden size of 5120 split 8 ways (640 = 5 tiles) pads nothing;
        // 5000 / 8 = 625 pads to 640: 625 / 640 = 0.977.
        assert!((quantisation(1.0, 4096.0, 625.0, 4096.0, 0.0) - 625.0 / 640.0).abs() < 1e-12);
        // Decode's few rows get a kernel of their own: no padding.
        assert!((quantisation(1.0, 8.0, 4096.0, 4096.0, 0.0) - 1.0).abs() < 1e-12);
        // 200 columns: two 128-wide tiles, 200 / 256.
        assert!((quantisation(1.0, 4096.0, 200.0, 4096.0, 0.0) - 200.0 / 256.0).abs() < 1e-12);
        // 132 tiles on 132 SMs: one full wave; 133 tiles: two waves, 133 / 264.
        assert!(
            (quantisation(1.0, 128.0 * 133.0, 128.0, 4096.0, 132.0) - 133.0 / 264.0).abs() < 1e-12
        );
    }

    #[test]
    fn skinny_products_split_their_contraction_over_idle_sms() {
        // Decode's 64 x 7168 output on 132 SMs: 1 x 56 tiles of 64 x 128; split 2 ways
        // (132 / 56 = 2.36, and 8192 / 256 = 32 slices possible): 112 tiles in one
        // wave of 132, 112 / 132 of it useful instead of 56 / 132.
        assert_eq!(split_k(1.0, 64.0, 7168.0, 8192.0, 132.0), 2.0);
        let q = quantisation(1.0, 64.0, 7168.0, 8192.0, 132.0);
        assert!((q - 112.0 / 132.0).abs() < 1e-12, "{q}");
        // A short contraction cannot be split (k = 256: one slice).
        assert_eq!(split_k(1.0, 64.0, 1024.0, 256.0, 132.0), 1.0);
        // Tiles that fill the SMs are not split.
        assert_eq!(split_k(1.0, 4096.0, 8192.0, 8192.0, 132.0), 1.0);
        // 8 x 1024 on 108 SMs: 8 tiles, 13 ways (108 / 8 = 13.5; 4096 / 256 = 16).
        assert_eq!(split_k(1.0, 8.0, 1024.0, 4096.0, 108.0), 13.0);
    }

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
        let r = Roofline::uncalibrated(100e12, 1e12, 0.8);
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

    fn point(m: u64, n: u64, k: u64, tflops: f64) -> GemmPoint {
        GemmPoint {
            m,
            n,
            k,
            flops_per_s: tflops * 1e12,
        }
    }

    #[test]
    fn shape_factor_is_one_for_cubes_and_below_for_skinny() {
        assert!((shape_factor(4096.0, 4096.0, 4096.0) - 1.0).abs() < 1e-12);
        let skinny = shape_factor(8.0, 16384.0, 16384.0);
        assert!(skinny < 0.5, "{skinny}");
        // Equal to the datasheet model's ratio of the two shapes.
        let c = (8.0f64 * 16384.0 * 16384.0).cbrt();
        let want = gemm_efficiency(1.0, 8.0, 16384.0, 16384.0) / gemm_efficiency(1.0, c, c, c);
        assert!((skinny - want).abs() < 1e-12);
    }

    #[test]
    fn curve_interpolates_in_log_flops_and_holds_the_ends() {
        // 1024^3 at 200 TFLOP/s and 4096^3 at 600: 2048^3 has 8x the FLOPs of the
        // first and 1/8 of the second, the midpoint in ln(FLOPs): 400 TFLOP/s.
        let c = GemmCurve::from_points(&[
            point(4096, 4096, 4096, 600.0),
            point(1024, 1024, 1024, 200.0),
        ])
        .expect("two points");
        let at = |d: f64| c.rate(d, d, d) / 1e12;
        assert!((at(2048.0) - 400.0).abs() < 1e-9, "{}", at(2048.0));
        assert!((at(1024.0) - 200.0).abs() < 1e-9);
        assert!((at(4096.0) - 600.0).abs() < 1e-9);
        assert!(
            (at(256.0) - 200.0).abs() < 1e-9,
            "flat below the first point"
        );
        assert!(
            (at(16384.0) - 600.0).abs() < 1e-9,
            "flat beyond the last point"
        );
    }

    #[test]
    fn every_measured_point_reproduces_its_own_time() {
        let pts = [
            point(1024, 1024, 1024, 250.0),
            point(8192, 8192, 8192, 700.0),
            point(8, 8192, 8192, 40.0),
            point(4096, 4096, 128, 300.0),
        ];
        let c = GemmCurve::from_points(&pts).expect("points");
        for p in pts {
            let (m, n, k) = (p.m as f64, p.n as f64, p.k as f64);
            let got = c.rate(m, n, k);
            assert!(
                (got - p.flops_per_s).abs() < 1e-6 * p.flops_per_s,
                "{p:?}: {got}"
            );
        }
    }

    #[test]
    fn halved_curve_doubles_compute_bound_gemm_time() {
        let full = GemmCurve::from_points(&[point(4096, 4096, 4096, 600.0)]);
        let half = GemmCurve::from_points(&[point(4096, 4096, 4096, 300.0)]);
        let mut r = Roofline::uncalibrated(989e12, 3e12, 0.6);
        r.gemm_curve = full;
        let t_full = r.gemm_s(1.0, 4096.0, 4096.0, 4096.0, 0.0) - calib::KERNEL_OVERHEAD_S;
        r.gemm_curve = half;
        let t_half = r.gemm_s(1.0, 4096.0, 4096.0, 4096.0, 0.0) - calib::KERNEL_OVERHEAD_S;
        // 2 * 4096^3 / 600e12 = 229.0649 us; twice that at 300 TFLOP/s.
        assert!((t_full - 2.0 * 4096f64.powi(3) / 600e12).abs() < 1e-15);
        assert!((t_half - 2.0 * t_full).abs() < 1e-15);
    }
}
