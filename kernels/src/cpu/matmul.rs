//! General matrix multiply via the `gemm` crate.
//!
//! Backward of `C = A B` is two more calls of the same kernel:
//! `dA += dC B^T` (`matmul(No, Yes, .., beta = 1)`) and
//! `dB += A^T dC` (`matmul(Yes, No, .., beta = 1)`).

use super::{check_len, invalid, prod, KernelError};

/// Whether an operand is used as stored or transposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transpose {
    /// Use the operand as stored.
    No,
    /// Use the transpose of the stored operand.
    Yes,
}

/// The kernels `gemm` runs f32 products with on this CPU, named after its own
/// dispatch (which it does not expose): `avx512f` (with the `x86-v4` feature on a
/// CPU that has AVX-512F), `fma` (AVX2 and FMA), `neon` or `scalar`. Results are
/// bitwise the same among CPUs that take the same kernels and round differently
/// between them, since the vector width changes how a product's sums are split.
pub fn gemm_isa() -> &'static str {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    {
        #[cfg(feature = "x86-v4")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            return "avx512f";
        }
        if std::arch::is_x86_feature_detected!("fma") {
            "fma"
        } else {
            "scalar"
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            "neon"
        } else {
            "scalar"
        }
    }
    #[cfg(not(any(target_arch = "x86", target_arch = "x86_64", target_arch = "aarch64")))]
    {
        "scalar"
    }
}

/// One product of a grouped GEMM, placed in larger buffers:
/// `c[c_off..][m, n] = op(a[a_off..]) op(b[b_off..])` with `op(a)` of shape
/// `[m, k]` and `op(b)` of shape `[k, n]` (routed experts: each expert's rows of one
/// buffer against its block of a stacked weight).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmAt {
    /// Whether `a` is stored transposed.
    pub ta: Transpose,
    /// Whether `b` is stored transposed.
    pub tb: Transpose,
    /// Rows of the product.
    pub m: usize,
    /// The inner dimension.
    pub k: usize,
    /// Columns of the product.
    pub n: usize,
    /// Where `a` starts, in elements.
    pub a_off: usize,
    /// Where `b` starts, in elements.
    pub b_off: usize,
    /// Where `c` starts, in elements.
    pub c_off: usize,
}

impl GemmAt {
    /// The whole product `c [m, n] = op(a) op(b)`, every buffer from its start.
    pub fn whole(ta: Transpose, tb: Transpose, m: usize, k: usize, n: usize) -> GemmAt {
        let (a_off, b_off, c_off) = (0, 0, 0);
        GemmAt {
            ta,
            tb,
            m,
            k,
            n,
            a_off,
            b_off,
            c_off,
        }
    }

    /// The element ranges of `a`, `b` and `c` the product reads and writes.
    pub fn spans(&self) -> Result<[std::ops::Range<usize>; 3], KernelError> {
        let mk = super::prod("a", &[self.m, self.k])?;
        let kn = super::prod("b", &[self.k, self.n])?;
        let mn = super::prod("c", &[self.m, self.n])?;
        Ok([
            self.a_off..self.a_off + mk,
            self.b_off..self.b_off + kn,
            self.c_off..self.c_off + mn,
        ])
    }

    /// [`GemmAt::spans`], checked to lie within buffers of `lens` elements
    /// (`a`, `b`, `c`).
    pub fn spans_within(
        &self,
        lens: [usize; 3],
    ) -> Result<[std::ops::Range<usize>; 3], KernelError> {
        let spans = self.spans()?;
        for ((name, r), len) in ["a", "b", "c"].into_iter().zip(&spans).zip(lens) {
            if r.end > len {
                return Err(super::invalid(
                    name,
                    format!("span {}..{} past its {len} elements", r.start, r.end),
                ));
            }
        }
        Ok(spans)
    }
}

/// [`matmul`] on the spans of `g`.
pub fn matmul_at(
    g: &GemmAt,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) -> Result<(), KernelError> {
    let [ra, rb, rc] = g.spans_within([a.len(), b.len(), c.len()])?;
    matmul(g.ta, g.tb, g.m, g.k, g.n, &a[ra], &b[rb], beta, &mut c[rc])
}

/// `C = beta * C + op(A) op(B)` with `op(A)` of shape `[m, k]`, `op(B)` of
/// shape `[k, n]` and `C` of shape `[m, n]`, all row-major.
///
/// `a` is stored `[m, k]` (or `[k, m]` when `trans_a` is [`Transpose::Yes`]),
/// `b` is stored `[k, n]` (or `[n, k]`). With `beta == 0` the old contents of
/// `c` are never read, so uninitialised garbage (even NaN) is harmless.
/// Inside a rayon pool it splits output tiles over the pool's threads
/// ([`intra_op_threads`](super::intra_op_threads)); each element's sum over `k`
/// is still formed by one thread in one order.
#[allow(clippy::too_many_arguments)] // flat BLAS-style signature on purpose
pub fn matmul(
    trans_a: Transpose,
    trans_b: Transpose,
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) -> Result<(), KernelError> {
    let threads = super::intra_op_threads();
    matmul_on(threads, trans_a, trans_b, m, k, n, a, b, beta, c)
}

/// [`matmul`] on `threads` threads of the caller's pool (1: the calling thread
/// only, for the small tile products of a kernel that already runs its tiles in
/// parallel).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_on(
    threads: usize,
    trans_a: Transpose,
    trans_b: Transpose,
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) -> Result<(), KernelError> {
    check_len("a", a.len(), prod("a", &[m, k])?)?;
    check_len("b", b.len(), prod("b", &[k, n])?)?;
    check_len("c", c.len(), prod("c", &[m, n])?)?;
    fits_gemm_strides([a.len(), b.len(), c.len()])?;
    gemm_unchecked(threads, trans_a, trans_b, m, k, n, a, b, beta, c);
    Ok(())
}

/// gemm takes isize strides: checks that every offset it may form into buffers
/// of these lengths (`a`, `b`, `c`) is representable.
fn fits_gemm_strides(lens: [usize; 3]) -> Result<(), KernelError> {
    for (name, len) in ["a", "b", "c"].into_iter().zip(lens) {
        if len > isize::MAX as usize / 4 {
            return Err(invalid(name, "too large for gemm strides"));
        }
    }
    Ok(())
}

/// [`matmul`] over a leading batch dimension: `a` is `[batch, ..a shape..]`,
/// and so on; batch entries are independent and run in order.
#[allow(clippy::too_many_arguments)]
pub fn matmul_batched(
    batch: usize,
    trans_a: Transpose,
    trans_b: Transpose,
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) -> Result<(), KernelError> {
    let sa = prod("a", &[m, k])?;
    let sb = prod("b", &[k, n])?;
    let sc = prod("c", &[m, n])?;
    check_len("a", a.len(), prod("a", &[batch, sa])?)?;
    check_len("b", b.len(), prod("b", &[batch, sb])?)?;
    check_len("c", c.len(), prod("c", &[batch, sc])?)?;
    for i in 0..batch {
        matmul(
            trans_a,
            trans_b,
            m,
            k,
            n,
            &a[i * sa..(i + 1) * sa],
            &b[i * sb..(i + 1) * sb],
            beta,
            &mut c[i * sc..(i + 1) * sc],
        )?;
    }
    Ok(())
}

/// `op(a) op(b)` into a new `[m, n]` buffer: [`matmul_at`] with `beta = 0` on the
/// spans of `g` for `a` and `b` (`g.c_off` is 0), without zeroing the buffer
/// first, since the product overwrites every element (an op's output or input
/// gradient; zero-filling them was several percent of a CPU training step).
pub fn matmul_new(g: &GemmAt, a: &[f32], b: &[f32]) -> Result<Vec<f32>, KernelError> {
    if g.c_off != 0 {
        return Err(invalid("c", "a new product starts at 0"));
    }
    let mn = prod("c", &[g.m, g.n])?;
    let [ra, rb, _] = g.spans_within([a.len(), b.len(), mn])?;
    let (a, b) = (&a[ra], &b[rb]);
    fits_gemm_strides([a.len(), b.len(), mn])?;
    if mn == 0 || g.k == 0 {
        // An empty product, or empty inner products: zeros.
        return Ok(vec![0.0; mn]);
    }
    let mut c: Vec<f32> = Vec::with_capacity(mn);
    let threads = super::intra_op_threads();
    let (m, k, n) = (g.m, g.k, g.n);
    // SAFETY: the spans of `a` and `b` hold m*k and k*n elements (checked above),
    // `c` has room for m*n; with `read_dst` false gemm writes each of the m*n
    // elements once and reads none of them (the NaN test below), so every
    // element is initialised when the length is set.
    #[allow(unsafe_code)]
    unsafe {
        gemm_raw(threads, g.ta, g.tb, (m, k, n), a, b, 0.0, c.as_mut_ptr());
        c.set_len(mn);
    }
    Ok(c)
}

/// A linear's bias: `y[r, c] += bias[c]` over the rows of `y` (as wide as
/// `bias`), the rows over the pool of [`intra_op_threads`](super::intra_op_threads).
pub fn bias_add(y: &mut [f32], bias: &[f32]) -> Result<(), KernelError> {
    let n = bias.len();
    if y.is_empty() {
        return Ok(());
    }
    if n == 0 || !y.len().is_multiple_of(n) {
        return Err(invalid("y", format!("{} values in rows of {n}", y.len())));
    }
    super::par_rows(y, n, |_, rows| {
        for row in rows.chunks_exact_mut(n) {
            row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
        }
    });
    Ok(())
}

/// Its gradient: `dbias[c] += sum_r dy[r, c]` over the rows of `dy` (as wide as
/// `dbias`), each column's sum in row order; the columns over the pool.
pub fn bias_grad(dy: &[f32], dbias: &mut [f32]) -> Result<(), KernelError> {
    let n = dbias.len();
    if dy.is_empty() {
        return Ok(());
    }
    if n == 0 || !dy.len().is_multiple_of(n) {
        return Err(invalid("dy", format!("{} values in rows of {n}", dy.len())));
    }
    super::par_rows(dbias, 1, |c0, db| {
        for row in dy.chunks_exact(n) {
            db.iter_mut().zip(&row[c0..]).for_each(|(d, g)| *d += g);
        }
    });
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn gemm_unchecked(
    threads: usize,
    trans_a: Transpose,
    trans_b: Transpose,
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // Empty inner product: only the scaling of C remains, and gemm's
        // handling of k == 0 is not something we want to depend on.
        for x in c.iter_mut() {
            *x = if beta == 0.0 { 0.0 } else { beta * *x };
        }
        return;
    }
    // SAFETY: `c` holds m*n elements (checked by the callers) and is a unique
    // borrow, so the destination aliases neither input.
    #[allow(unsafe_code)]
    unsafe {
        gemm_raw(
            threads,
            trans_a,
            trans_b,
            (m, k, n),
            a,
            b,
            beta,
            c.as_mut_ptr(),
        );
    }
}

/// gemm's product into `c` (`beta = 0`: `c` is neither read nor needs to be
/// initialised). `m`, `n`, `k` are positive.
///
/// # Safety
/// `a` and `b` hold `m*k` and `k*n` elements; `c` points to `m*n` writable
/// elements that alias neither.
#[allow(clippy::too_many_arguments, unsafe_code)]
unsafe fn gemm_raw(
    threads: usize,
    trans_a: Transpose,
    trans_b: Transpose,
    (m, k, n): (usize, usize, usize),
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: *mut f32,
) {
    // (row stride, column stride) of op(X) in the stored row-major buffer.
    let (a_rs, a_cs) = match trans_a {
        Transpose::No => (k as isize, 1),
        Transpose::Yes => (1, m as isize),
    };
    let (b_rs, b_cs) = match trans_b {
        Transpose::No => (n as isize, 1),
        Transpose::Yes => (1, k as isize),
    };
    // SAFETY: the lengths of `a`, `b`, `c` are m*k, k*n and m*n (the
    // contract), and the strides above address exactly those row-major (or
    // transposed) layouts, so every element gemm touches is in bounds.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c,
            1,
            n as isize,
            beta != 0.0,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            beta,
            1.0,
            false,
            false,
            false,
            if threads > 1 {
                gemm::Parallelism::Rayon(threads)
            } else {
                gemm::Parallelism::None
            },
        );
    }
}

#[cfg(test)]
mod tests {

    /// The bias and its gradient by hand, the same on one thread and on three
    /// (each column's sum in row order), and ragged rows refused.
    #[test]
    fn bias_add_and_grad_by_hand_and_on_any_thread_count() {
        let mut y = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        bias_add(&mut y, &[10.0, 20.0, 30.0]).unwrap();
        assert_eq!(y, [11.0, 22.0, 33.0, 14.0, 25.0, 36.0]);
        let mut db = [1.0, 1.0, 1.0];
        bias_grad(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &mut db).unwrap();
        assert_eq!(db, [6.0, 8.0, 10.0]);
        assert!(bias_add(&mut [1.0; 5], &[1.0, 2.0]).is_err());
        assert!(bias_grad(&[1.0; 5], &mut [0.0; 2]).is_err());
        let mut rng = Rng::new(11);
        let (dy, b) = (rng.vec(64 * 37), rng.vec(37));
        let run = || {
            let (mut y, mut db) = (dy.clone(), b.clone());
            bias_add(&mut y, &b).unwrap();
            bias_grad(&dy, &mut db).unwrap();
            (y, db)
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let ((y1, d1), (y3, d3)) = (run(), pool.install(run));
        assert_eq!((bits(&y1), bits(&d1)), (bits(&y3), bits(&d3)));
        let want: Vec<f32> = (0..37)
            .map(|c| (0..64).fold(b[c], |s, r| s + dy[r * 37 + c]))
            .collect();
        assert_eq!(bits(&d1), bits(&want), "each column summed in row order");
    }

    /// A new product equals the product into zeros bit for bit (every
    /// transpose, operands at offsets, on one thread and on two), and an empty
    /// one is zeros.
    #[test]
    fn matmul_new_equals_the_product_into_zeros() {
        let mut rng = Rng::new(7);
        let (a, b) = (rng.vec(40 * 33 + 5), rng.vec(33 * 29 + 3));
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for ta in [Transpose::No, Transpose::Yes] {
            for tb in [Transpose::No, Transpose::Yes] {
                for (m, k, n) in [(40, 33, 29), (1, 1, 1), (7, 0, 3), (0, 4, 5)] {
                    let g = GemmAt {
                        a_off: 5,
                        b_off: 3,
                        ..GemmAt::whole(ta, tb, m, k, n)
                    };
                    let mut want = vec![0.0; m * n];
                    matmul_at(&GemmAt { c_off: 0, ..g }, &a, &b, 0.0, &mut want).unwrap();
                    for got in [
                        matmul_new(&g, &a, &b).unwrap(),
                        pool.install(|| matmul_new(&g, &a, &b).unwrap()),
                    ] {
                        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got), bits(&want), "{ta:?} {tb:?} {m}x{k}x{n}");
                    }
                }
            }
        }
        let placed = GemmAt {
            c_off: 1,
            ..GemmAt::whole(Transpose::No, Transpose::No, 1, 1, 1)
        };
        assert!(matmul_new(&placed, &a, &b).is_err());
        let past = GemmAt {
            a_off: a.len(),
            ..GemmAt::whole(Transpose::No, Transpose::No, 1, 1, 1)
        };
        assert!(matmul_new(&past, &a, &b).is_err());
    }

    #[test]
    fn matmul_at_multiplies_the_placed_blocks() {
        // Two experts' rows of one buffer, each against its block of a stacked
        // weight: rows [1, 2] and [3, 4] by 2 x 1 blocks [1, 1] and [2, 0].
        let a = [1.0, 2.0, 3.0, 4.0];
        let b = [1.0, 1.0, 2.0, 0.0];
        let mut c = [0.0; 2];
        let g = |i: usize| GemmAt {
            ta: Transpose::No,
            tb: Transpose::No,
            m: 1,
            k: 2,
            n: 1,
            a_off: 2 * i,
            b_off: 2 * i,
            c_off: i,
        };
        matmul_at(&g(0), &a, &b, 0.0, &mut c).unwrap();
        matmul_at(&g(1), &a, &b, 0.0, &mut c).unwrap();
        assert_eq!(c, [3.0, 6.0]);
        matmul_at(&g(1), &a, &b, 1.0, &mut c).unwrap();
        assert_eq!(c, [3.0, 12.0]);
        let past = GemmAt { c_off: 2, ..g(1) };
        assert!(matmul_at(&past, &a, &b, 0.0, &mut c).is_err());
    }
    use super::*;
    use crate::cpu::testutil::{assert_close, Rng};
    use proptest::prelude::*;

    fn at(x: &[f32], trans: Transpose, rows: usize, cols: usize, i: usize, j: usize) -> f64 {
        // element (i, j) of op(X) where op(X) is [rows, cols]
        match trans {
            Transpose::No => x[i * cols + j] as f64,
            Transpose::Yes => x[j * rows + i] as f64,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn naive(
        ta: Transpose,
        tb: Transpose,
        m: usize,
        k: usize,
        n: usize,
        a: &[f32],
        b: &[f32],
        beta: f32,
        c: &[f32],
    ) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for p in 0..k {
                    s += at(a, ta, m, k, i, p) * at(b, tb, k, n, p, j);
                }
                let old = if beta == 0.0 {
                    0.0
                } else {
                    beta as f64 * c[i * n + j] as f64
                };
                out[i * n + j] = (old + s) as f32;
            }
        }
        out
    }

    #[test]
    fn all_transpose_combinations_match_naive() {
        let mut rng = Rng::new(1);
        let (m, k, n) = (7, 13, 5);
        for ta in [Transpose::No, Transpose::Yes] {
            for tb in [Transpose::No, Transpose::Yes] {
                for beta in [0.0f32, 1.0, 0.5] {
                    let a = rng.vec(m * k);
                    let b = rng.vec(k * n);
                    let c0 = rng.vec(m * n);
                    let mut c = c0.clone();
                    matmul(ta, tb, m, k, n, &a, &b, beta, &mut c).unwrap();
                    let r = naive(ta, tb, m, k, n, &a, &b, beta, &c0);
                    assert_close(&format!("{ta:?}{tb:?} beta={beta}"), &c, &r, 1e-5);
                }
            }
        }
    }

    #[test]
    fn hand_worked_2x2_and_beta_zero_ignores_nan() {
        let a = [1.0, 2.0, 3.0, 4.0];
        let b = [5.0, 6.0, 7.0, 8.0];
        let mut c = [f32::NAN; 4];
        matmul(Transpose::No, Transpose::No, 2, 2, 2, &a, &b, 0.0, &mut c).unwrap();
        assert_eq!(c, [19.0, 22.0, 43.0, 50.0]);
        // A^T B: [[1,3],[2,4]] * [[5,6],[7,8]]
        matmul(Transpose::Yes, Transpose::No, 2, 2, 2, &a, &b, 1.0, &mut c).unwrap();
        assert_eq!(c, [19.0 + 26.0, 22.0 + 30.0, 43.0 + 38.0, 50.0 + 44.0]);
    }

    #[test]
    fn empty_inner_dim_scales_c() {
        let mut c = [2.0f32, f32::NAN];
        matmul(Transpose::No, Transpose::No, 1, 0, 2, &[], &[], 0.0, &mut c).unwrap();
        assert_eq!(c, [0.0, 0.0]);
        let mut c = [2.0f32, 4.0];
        matmul(Transpose::No, Transpose::No, 1, 0, 2, &[], &[], 0.5, &mut c).unwrap();
        assert_eq!(c, [1.0, 2.0]);
    }

    #[test]
    fn length_mismatch_is_an_error() {
        let mut c = [0.0; 4];
        let e = matmul(
            Transpose::No,
            Transpose::No,
            2,
            2,
            2,
            &[0.0; 3],
            &[0.0; 4],
            0.0,
            &mut c,
        );
        assert_eq!(
            e,
            Err(KernelError::Length {
                name: "a",
                expected: 4,
                actual: 3
            })
        );
        let e = matmul(
            Transpose::No,
            Transpose::No,
            2,
            2,
            2,
            &[0.0; 4],
            &[0.0; 4],
            0.0,
            &mut c[..3],
        );
        assert!(matches!(e, Err(KernelError::Length { name: "c", .. })));
    }

    #[test]
    fn batched_matches_per_batch_and_is_deterministic() {
        let mut rng = Rng::new(2);
        let (bt, m, k, n) = (3, 4, 6, 5);
        let a = rng.vec(bt * k * m);
        let b = rng.vec(bt * k * n);
        let mut c = vec![0.0; bt * m * n];
        matmul_batched(
            bt,
            Transpose::Yes,
            Transpose::No,
            m,
            k,
            n,
            &a,
            &b,
            0.0,
            &mut c,
        )
        .unwrap();
        for i in 0..bt {
            let r = naive(
                Transpose::Yes,
                Transpose::No,
                m,
                k,
                n,
                &a[i * m * k..(i + 1) * m * k],
                &b[i * k * n..(i + 1) * k * n],
                0.0,
                &[],
            );
            assert_close("batched", &c[i * m * n..(i + 1) * m * n], &r, 1e-5);
        }
        let mut c2 = vec![0.0; bt * m * n];
        matmul_batched(
            bt,
            Transpose::Yes,
            Transpose::No,
            m,
            k,
            n,
            &a,
            &b,
            0.0,
            &mut c2,
        )
        .unwrap();
        assert_eq!(
            c.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            c2.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn prop_matmul_matches_naive(
            m in 1usize..40, k in 0usize..40, n in 1usize..40,
            ta in any::<bool>(), tb in any::<bool>(), seed in any::<u64>(),
        ) {
            let ta = if ta { Transpose::Yes } else { Transpose::No };
            let tb = if tb { Transpose::Yes } else { Transpose::No };
            let mut rng = Rng::new(seed);
            let a = rng.vec(m * k);
            let b = rng.vec(k * n);
            let c0 = rng.vec(m * n);
            let mut c = c0.clone();
            matmul(ta, tb, m, k, n, &a, &b, 1.0, &mut c).unwrap();
            let r = naive(ta, tb, m, k, n, &a, &b, 1.0, &c0);
            for (x, y) in c.iter().zip(&r) {
                prop_assert!(x.is_finite());
                prop_assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "{} vs {}", x, y);
            }
        }
    }
}
