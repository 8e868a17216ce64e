//! Plain f32 reference kernels on row-major slices.
//!
//! Conventions shared by every kernel in this module:
//!
//! - Inputs are `&[f32]` (or `&[u32]` for ids/labels), outputs `&mut [f32]`,
//!   with explicit sizes; every length is validated up front and a mismatch
//!   returns [`KernelError`] before any output is touched.
//! - Forward kernels **overwrite** their outputs. Backward kernels
//!   **accumulate** (`+=`) into every gradient output (activation gradients as
//!   well as parameter gradients), so the caller zeroes them once and can sum
//!   contributions from residual branches, ring blocks or micro-batches.
//! - Arithmetic is f32 with f32 accumulation unless a kernel's docs say
//!   otherwise, and every reduction runs in a fixed sequential order, so the
//!   same inputs give bit-identical outputs on the same machine.
//! - Called from inside a rayon pool, the heavy kernels (matmul, attention,
//!   the activations, RoPE, cross-entropy, AdamW) split their work over that
//!   pool's threads ([`intra_op_threads`]). The split is over independent rows,
//!   heads or output tiles, never inside a reduction, so the result does not
//!   depend on the number of threads; [`side_by_side`] runs two independent
//!   kernels on halves of the pool.
//!
//! Families: [`matmul`](mod@matmul), [`embedding`](mod@embedding),
//! [`norm`], [`rope`], [`activation`], [`attention`] (with the row
//! [`layout`]s around it), [`dropout`], [`loss`], [`adamw`], [`moe`].

use std::error::Error;
use std::fmt;

/// `exp(x)` to within a few ulp, written branch-free so that loops over
/// slices vectorise (the libm call does not). Cephes `expf` reduction:
/// `x = n ln2 + r` with `|r| <= ln2 / 2`, a degree-7 polynomial for
/// `exp(r)`, and `2^n` built from the exponent bits. Arguments below
/// `-87` (results under `1.7e-38`) give 0, `-inf` included; NaN stays NaN.
#[inline(always)]
pub(crate) fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.0, 88.0);
    let y = xc * LOG2E + MAGIC;
    let n = y - MAGIC;
    let r = xc - n * C1 - n * C2;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    let ni = (y.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let pow2 = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        e * pow2
    }
}

/// `tanh(u)` from [`fast_exp`] as `1 - 2 / (1 + e^(2u))`, so that GELU's loops
/// vectorise (libm's `tanhf` calls `expm1f` per element: 13% of a GPT-2-style
/// training step). Within 2.5e-7 of the exact value everywhere (absolute: near 0
/// the subtraction leaves an ulp of 1, not of `u`); `e^(2u)` saturates past
/// `|u| = 44` to exactly 1 and -1; NaN stays NaN.
#[inline(always)]
pub(crate) fn fast_tanh(u: f32) -> f32 {
    1.0 - 2.0 / (1.0 + fast_exp(2.0 * u))
}

pub mod activation;
pub mod adamw;
pub mod attention;
pub mod dropout;
pub mod embedding;
pub mod layout;
pub mod loss;
pub mod matmul;
pub mod moe;
pub mod norm;
pub mod rope;

// Every family's public kernels and types, so that a new kernel is written in its
// family's file alone.
pub use activation::*;
pub use adamw::*;
pub use attention::*;
pub use dropout::*;
pub use embedding::*;
pub use layout::*;
pub use loss::*;
pub use matmul::*;
pub use moe::*;
pub use norm::*;
pub use rope::*;

/// Why a kernel refused its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// A slice does not have the length implied by the size arguments.
    Length {
        /// Which argument (parameter name).
        name: &'static str,
        /// Length implied by the sizes.
        expected: usize,
        /// Length actually passed.
        actual: usize,
    },
    /// A size or scalar argument is invalid on its own (e.g. an odd RoPE
    /// head dimension, `hq` not a multiple of `hkv`, an id out of range).
    Invalid {
        /// Which argument (parameter name).
        name: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KernelError::Length {
                name,
                expected,
                actual,
            } => write!(
                f,
                "kernel argument `{name}` has length {actual}, expected {expected}"
            ),
            KernelError::Invalid { name, reason } => {
                write!(f, "kernel argument `{name}` is invalid: {reason}")
            }
        }
    }
}

impl Error for KernelError {}

/// Threads a kernel may use: the size of the rayon pool the caller runs in, or 1
/// on any other thread. A rank thread outside a pool must not borrow the global
/// pool, which the other ranks of the process share.
pub fn intra_op_threads() -> usize {
    if let Some(n) = SHARE.with(|s| s.get()) {
        return n;
    }
    if rayon::current_thread_index().is_some() {
        rayon::current_num_threads()
    } else {
        1
    }
}

thread_local! {
    /// This thread's share of the pool while it runs one side of [`side_by_side`].
    static SHARE: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Runs `a` and `b`, independent kernels writing disjoint buffers, side by side
/// on halves of the pool of [`intra_op_threads`] (in sequence without one).
/// Two products that each run on half the threads scale better than one after
/// the other on all of them (a GEMM gains about 1.8x from a second thread,
/// two GEMMs side by side nearly 2x), and no result depends on the split.
pub fn side_by_side<A: Send, B: Send>(
    a: impl FnOnce() -> A + Send,
    b: impl FnOnce() -> B + Send,
) -> (A, B) {
    let threads = intra_op_threads();
    if threads < 2 {
        return (a(), b());
    }
    rayon::join(
        || on_share(threads / 2, a),
        || on_share(threads - threads / 2, b),
    )
}

/// `f()` with [`intra_op_threads`] reading `share` on this thread.
fn on_share<R>(share: usize, f: impl FnOnce() -> R) -> R {
    /// Puts the thread's previous share back, also when `f` panics.
    struct Restore(Option<usize>);
    impl Drop for Restore {
        fn drop(&mut self) {
            SHARE.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(SHARE.with(|s| s.replace(Some(share))));
    f()
}

/// Lanes of the kernels' fixed-order reductions (a maximum, attention's sums):
/// one AVX-512 register of `f32`; the order, hence the result, does not depend
/// on the target.
pub(crate) const LANES: usize = 16;

/// The largest of the lanes, halving them pairwise: a maximum is exact, so any
/// order gives the same value, and halves vectorise where a left-to-right fold
/// is a chain of sixteen dependent steps (most of a 64-key attention tile's
/// `scale_and_max`). Lanes are never NaN (they start at `-inf` and `max`
/// ignores a NaN).
pub(crate) fn lanes_max(mut m: [f32; LANES]) -> f32 {
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            m[i] = m[i].max(m[i + w]);
        }
    }
    m[0]
}

/// Work items per thread: enough pieces that an unlucky split does not leave a
/// thread idle for long, few enough that scheduling costs nothing.
const PIECES_PER_THREAD: usize = 4;

/// Calls `f(first_row, rows)` over `out` cut into runs of whole rows of
/// `row_len` elements: one call on this thread, or runs spread over the pool of
/// [`intra_op_threads`]. `f` must treat rows independently.
pub(crate) fn par_rows<T: Send>(
    out: &mut [T],
    row_len: usize,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) {
    let threads = intra_op_threads();
    let rows = out.len().checked_div(row_len).unwrap_or(0);
    if threads <= 1 || rows < 2 {
        f(0, out);
        return;
    }
    use rayon::prelude::*;
    let per = rows.div_ceil(threads * PIECES_PER_THREAD).max(1);
    out.par_chunks_mut(per * row_len)
        .enumerate()
        .for_each(|(i, c)| f(i * per, c));
}

/// Buffers at least this long are zeroed (or tested) over the pool: below it a
/// thread's `memset` is quicker than handing out the work.
pub(crate) const PAR_ZEROS_MIN: usize = 1 << 16;

/// `n` zeros. A long buffer is written over the pool of [`intra_op_threads`]:
/// every op's output starts as one, and on one thread their `memset`s are a few
/// percent of a training step that the other threads wait through.
pub fn zeros(n: usize) -> Vec<f32> {
    if intra_op_threads() <= 1 || n < PAR_ZEROS_MIN {
        return vec![0.0; n];
    }
    use rayon::prelude::*;
    let mut v = Vec::with_capacity(n);
    v.par_extend(rayon::iter::repeat_n(0.0f32, n));
    v
}

/// `(0..n).map(f)` collected in order, the items computed in parallel over the
/// pool of [`intra_op_threads`] when there is one.
pub(crate) fn par_map<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync + Send) -> Vec<T> {
    if intra_op_threads() <= 1 || n < 2 {
        return (0..n).map(f).collect();
    }
    use rayon::prelude::*;
    (0..n).into_par_iter().map(f).collect()
}

/// Checks `actual == expected` for the slice called `name`.
pub fn check_len(name: &'static str, actual: usize, expected: usize) -> Result<(), KernelError> {
    if actual == expected {
        Ok(())
    } else {
        Err(KernelError::Length {
            name,
            expected,
            actual,
        })
    }
}

/// Multiplies sizes, turning overflow into an error rather than a wrong
/// length check that could let a short slice through.
pub(crate) fn prod(name: &'static str, dims: &[usize]) -> Result<usize, KernelError> {
    dims.iter().try_fold(1usize, |acc, &d| {
        acc.checked_mul(d)
            .ok_or_else(|| invalid(name, "size product overflows usize"))
    })
}

/// Shorthand for [`KernelError::Invalid`].
pub(crate) fn invalid(name: &'static str, reason: impl Into<String>) -> KernelError {
    KernelError::Invalid {
        name,
        reason: reason.into(),
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    //! Seeded data and finite-difference helpers shared by the kernel tests.

    /// xorshift64*: tiny, seeded, and identical on every platform.
    pub struct Rng(u64);

    impl Rng {
        pub fn new(seed: u64) -> Self {
            Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
        }

        pub fn next_u64(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            self.0 = x;
            x.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        /// Uniform in [-1, 1).
        pub fn f32(&mut self) -> f32 {
            ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }

        pub fn below(&mut self, n: u64) -> u64 {
            self.next_u64() % n
        }

        pub fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.f32()).collect()
        }
    }

    /// `sum_i w_i * y_i` in f64: the scalar loss whose gradient w.r.t. `y` is
    /// `w`, so a backward kernel fed `dy = w` must match its finite differences.
    pub fn dot64(w: &[f32], y: &[f32]) -> f64 {
        assert_eq!(w.len(), y.len());
        w.iter().zip(y).map(|(&a, &b)| a as f64 * b as f64).sum()
    }

    /// Central differences of `f` at `x`, in f64. The step actually taken is
    /// recomputed from the rounded f32 points so it does not add error.
    pub fn numeric_grad(x: &[f32], eps: f32, mut f: impl FnMut(&[f32]) -> f64) -> Vec<f64> {
        let mut xp = x.to_vec();
        (0..x.len())
            .map(|i| {
                let hi = x[i] + eps;
                let lo = x[i] - eps;
                xp[i] = hi;
                let fh = f(&xp);
                xp[i] = lo;
                let fl = f(&xp);
                xp[i] = x[i];
                (fh - fl) / (hi as f64 - lo as f64)
            })
            .collect()
    }

    /// Elementwise `|a - n| <= rtol * |n| + atol_frac * max|n|` (plus a tiny
    /// floor for all-zero gradients).
    pub fn assert_grad_close(
        what: &str,
        analytic: &[f32],
        numeric: &[f64],
        rtol: f64,
        atol_frac: f64,
    ) {
        assert_eq!(analytic.len(), numeric.len(), "{what}: length");
        let scale = numeric.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let atol = atol_frac * scale + 1e-4;
        for (i, (&a, &n)) in analytic.iter().zip(numeric).enumerate() {
            let err = (a as f64 - n).abs();
            assert!(
                err <= rtol * n.abs() + atol,
                "{what}[{i}]: analytic {a} vs numeric {n} (err {err}, scale {scale})"
            );
        }
    }

    /// Elementwise `|a - b| <= tol * (1 + |b|)`.
    pub fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len(), "{what}: length");
        for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= tol * (1.0 + y.abs()),
                "{what}[{i}]: {x} vs {y}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_display_names_argument() {
        let e = check_len("x", 3, 4).unwrap_err();
        assert_eq!(
            e.to_string(),
            "kernel argument `x` has length 3, expected 4"
        );
        let e = invalid("head_dim", "must be even");
        assert_eq!(
            e.to_string(),
            "kernel argument `head_dim` is invalid: must be even"
        );
        assert!(prod("n", &[usize::MAX, 2]).is_err());
        assert_eq!(prod("n", &[2, 3, 4]), Ok(24));
    }
}

#[cfg(test)]
mod threads_tests {
    //! The kernels that split work over a pool give the same bits on 1, 2 and 3
    //! threads, so a rank's result does not depend on how many cores it got.

    use super::testutil::Rng;
    use super::*;

    /// Every parallel kernel's outputs on one input set, computed on the calling
    /// thread.
    fn outputs(seed: u64) -> Vec<Vec<f32>> {
        let mut rng = Rng::new(seed);
        let (rows, f, kdim) = (37, 24, 19);
        let x = rng.vec(rows * 2 * f);
        let dy = rng.vec(rows * f);
        let w = rng.vec(kdim * 2 * f);
        let mut out = Vec::new();

        let mut c = vec![0.0; rows * 2 * f];
        let a = rng.vec(rows * kdim);
        matmul(
            Transpose::No,
            Transpose::No,
            rows,
            kdim,
            2 * f,
            &a,
            &w,
            0.0,
            &mut c,
        )
        .unwrap();
        out.push(c);
        // Big enough for gemm to split it.
        let (m, k, n) = (300, 200, 260);
        let (a, b) = (rng.vec(m * k), rng.vec(k * n));
        let mut c = rng.vec(m * n);
        matmul(Transpose::Yes, Transpose::No, m, k, n, &a, &b, 1.0, &mut c).unwrap();
        out.push(c);

        let mut y = vec![0.0; rows * f];
        swiglu_fwd(&x, rows, f, &mut y).unwrap();
        out.push(y);
        let mut dx = vec![0.5; rows * 2 * f];
        swiglu_bwd(&x, &dy, rows, f, &mut dx).unwrap();
        out.push(dx);
        let mut g = vec![0.0; x.len()];
        gelu_fwd(&x, &mut g).unwrap();
        let mut dg = vec![0.25; x.len()];
        gelu_bwd(&x, &g, &mut dg).unwrap();
        out.push(dg);
        let mut sum = vec![0.0; x.len()];
        add(&x, &g, &mut sum).unwrap();
        let (mut da, mut db) = (vec![1.0; x.len()], vec![2.0; x.len()]);
        add_bwd(&sum, &mut da, &mut db).unwrap();
        let mut acc = x.clone();
        accumulate(&mut acc, &g);
        out.extend([sum, da, db, acc]);

        let (tokens, heads, hd) = (11, 3, 8);
        let xr = rng.vec(tokens * heads * hd);
        let pos: Vec<u32> = (0..tokens as u32).map(|p| p * 7 + 3).collect();
        let mut r = vec![0.0; xr.len()];
        rope_fwd(&xr, &pos, tokens, heads, hd, Rope::plain(10000.0), &mut r).unwrap();
        let mut dr = vec![0.1; xr.len()];
        rope_bwd(&r, &pos, tokens, heads, hd, Rope::plain(10000.0), &mut dr).unwrap();
        out.extend([r, dr]);

        let (cr, v) = (13, 50);
        let logits: Vec<f32> = rng.vec(cr * v).iter().map(|z| z * 6.0).collect();
        let labels: Vec<u32> = (0..cr as u64).map(|_| rng.below(v as u64) as u32).collect();
        let (mut mx, mut se) = (vec![0.0; cr], vec![0.0; cr]);
        ce_row_max(&logits, cr, v, &mut mx).unwrap();
        ce_row_sumexp(&logits, cr, v, &mx, &mut se).unwrap();
        let mut dl = vec![0.0; cr * v];
        ce_bwd(&logits, cr, v, &mx, &se, &labels, 0, 0.3, &mut dl).unwrap();
        out.extend([mx, se, dl]);

        let n = 70_001;
        let (mut p, grad) = (rng.vec(n), rng.vec(n));
        let mut m1 = rng.vec(n);
        let mut v1: Vec<f32> = rng.vec(n).iter().map(|z| z * z).collect();
        adamw_step(
            &mut p, &grad, &mut m1, &mut v1, 3, 1e-2, 0.9, 0.95, 1e-8, 0.1,
        )
        .unwrap();
        out.extend([p, m1, v1]);

        let dims = AttnDims {
            batch: 2,
            sq: 70,
            sk: 70,
            hq: 4,
            hkv: 2,
            d: 8,
            dv: 8,
        };
        let q = rng.vec(2 * 70 * 4 * 8);
        let kk = rng.vec(2 * 70 * 2 * 8);
        let vv = rng.vec(2 * 70 * 2 * 8);
        let mut o = vec![0.0; q.len()];
        let mut lse = vec![0.0; 2 * 4 * 70];
        attention_fwd(
            &dims, &q, &kk, &vv, 0, 0, true, 0.35, &mut o, &mut lse, None,
        )
        .unwrap();
        let d_o = rng.vec(o.len());
        let (mut dq, mut dk, mut dv) =
            (vec![0.0; q.len()], vec![0.0; kk.len()], vec![0.0; vv.len()]);
        attention_bwd(
            &dims, &q, &kk, &vv, &o, &lse, &d_o, 0, 0, true, 0.35, &mut dq, &mut dk, &mut dv, None,
        )
        .unwrap();
        out.extend([o, lse, dq, dk, dv]);
        out
    }

    #[test]
    fn zeros_are_zeros_on_a_pool_over_reused_memory() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for n in [
            0,
            7,
            PAR_ZEROS_MIN - 1,
            PAR_ZEROS_MIN,
            3 * PAR_ZEROS_MIN + 5,
        ] {
            // Freed ones first, so an allocator handing the same memory back
            // would show through a buffer not written.
            drop(vec![1.0f32; n]);
            let z = pool.install(|| zeros(n));
            assert_eq!(z.len(), n);
            assert!(z.iter().all(|&x| x.to_bits() == 0), "n = {n}");
        }
        assert_eq!(zeros(5), vec![0.0; 5]);
    }

    #[test]
    fn parallel_kernels_give_the_same_bits_on_any_thread_count() {
        assert_eq!(intra_op_threads(), 1, "a plain test thread is not a pool");
        let serial = outputs(5);
        for threads in [2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let par = pool.install(|| {
                assert_eq!(intra_op_threads(), threads);
                outputs(5)
            });
            for (i, (a, b)) in serial.iter().zip(&par).enumerate() {
                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "output {i} differs on {threads} threads");
            }
        }
    }

    #[test]
    fn side_by_side_splits_the_pool_and_gives_it_back() {
        let shares = || side_by_side(intra_op_threads, intra_op_threads);
        assert_eq!(shares(), (1, 1), "no pool: in order, one thread each");
        for (threads, want) in [(2, (1, 1)), (3, (1, 2)), (4, (2, 2))] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                assert_eq!(shares(), want, "{threads} threads");
                // A side that panics still hands its share back.
                let hurt = std::panic::catch_unwind(|| side_by_side(|| panic!("a side"), || 1));
                assert!(hurt.is_err());
                assert_eq!(intra_op_threads(), threads, "after a panic");
                assert_eq!(shares(), want, "{threads} threads, again");
            });
        }
    }
}
