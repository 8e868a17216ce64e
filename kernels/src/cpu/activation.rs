//! Pointwise activations: GELU (tanh approximation), SwiGLU, residual add; and
//! the pointwise passes over a rank's gradients (fill, scale, accumulate, the
//! finiteness test), over the pool like the rest.

use super::{
    check_len, fast_tanh, intra_op_threads, invalid, par_rows, prod, KernelError, PAR_ZEROS_MIN,
};

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

/// GELU forward, tanh approximation (GPT-2 / Megatron `gelu`):
/// `y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu_fwd(x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    check_len("y", y.len(), x.len())?;
    par_rows(y, 1, |i0, y| {
        for (o, &v) in y.iter_mut().zip(&x[i0..]) {
            let t = fast_tanh(SQRT_2_OVER_PI * (v + GELU_C * v * v * v));
            *o = 0.5 * v * (1.0 + t);
        }
    });
    Ok(())
}

/// GELU backward: `dx += dy * gelu'(x)` (recomputed from `x`).
pub fn gelu_bwd(x: &[f32], dy: &[f32], dx: &mut [f32]) -> Result<(), KernelError> {
    check_len("dy", dy.len(), x.len())?;
    check_len("dx", dx.len(), x.len())?;
    par_rows(dx, 1, |i0, dx| {
        for ((d, &v), &g) in dx.iter_mut().zip(&x[i0..]).zip(&dy[i0..]) {
            let t = fast_tanh(SQRT_2_OVER_PI * (v + GELU_C * v * v * v));
            let dt = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * v * v);
            *d += g * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * dt);
        }
    });
    Ok(())
}

/// With the vectorisable exponential: SwiGLU runs over every MLP activation.
#[inline(always)]
fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + super::fast_exp(-v))
}

fn check_swiglu(
    rows: usize,
    f: usize,
    x_len: usize,
    y_len: usize,
    yname: &'static str,
) -> Result<(), KernelError> {
    if f == 0 {
        return Err(invalid("f", "must be positive"));
    }
    check_len("x", x_len, prod("x", &[rows, 2, f])?)?;
    check_len(yname, y_len, prod(yname, &[rows, f])?)
}

/// SwiGLU forward: `x [rows, 2f]` laid out `[gate | up]` per row,
/// `y [rows, f] = silu(gate) * up` with `silu(g) = g * sigmoid(g)`.
pub fn swiglu_fwd(x: &[f32], rows: usize, f: usize, y: &mut [f32]) -> Result<(), KernelError> {
    check_swiglu(rows, f, x.len(), y.len(), "y")?;
    par_rows(y, f, |r0, y| {
        for (xr, yr) in x[r0 * 2 * f..]
            .chunks_exact(2 * f)
            .zip(y.chunks_exact_mut(f))
        {
            let (gate, up) = xr.split_at(f);
            for ((o, &g), &u) in yr.iter_mut().zip(gate).zip(up) {
                *o = g * sigmoid(g) * u;
            }
        }
    });
    Ok(())
}

/// SwiGLU backward: accumulates `dx [rows, 2f]` (`[d_gate | d_up]`) from
/// `dy [rows, f]`, recomputing the sigmoid from `x`.
pub fn swiglu_bwd(
    x: &[f32],
    dy: &[f32],
    rows: usize,
    f: usize,
    dx: &mut [f32],
) -> Result<(), KernelError> {
    check_swiglu(rows, f, x.len(), dy.len(), "dy")?;
    check_len("dx", dx.len(), x.len())?;
    par_rows(dx, 2 * f, |r0, dx| {
        for ((xr, gr), dr) in x[r0 * 2 * f..]
            .chunks_exact(2 * f)
            .zip(dy[r0 * f..].chunks_exact(f))
            .zip(dx.chunks_exact_mut(2 * f))
        {
            let (gate, up) = xr.split_at(f);
            let (dgate, dup) = dr.split_at_mut(f);
            for c in 0..f {
                let (g, u, d) = (gate[c], up[c], gr[c]);
                let s = sigmoid(g);
                dgate[c] += d * u * s * (1.0 + g * (1.0 - s));
                dup[c] += d * g * s;
            }
        }
    });
    Ok(())
}

/// Residual add: `out = a + b`.
pub fn add(a: &[f32], b: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
    check_len("b", b.len(), a.len())?;
    check_len("out", out.len(), a.len())?;
    par_rows(out, 1, |i0, out| {
        for ((o, &x), &y) in out.iter_mut().zip(&a[i0..]).zip(&b[i0..]) {
            *o = x + y;
        }
    });
    Ok(())
}

/// `acc += x` over the common length (gradient accumulation).
pub fn accumulate(acc: &mut [f32], x: &[f32]) {
    par_rows(acc, 1, |i0, acc| {
        for (a, &v) in acc.iter_mut().zip(&x[i0.min(x.len())..]) {
            *a += v;
        }
    });
}

/// Every element of `x` set to `v` (a step's gradients zeroed).
pub fn fill(x: &mut [f32], v: f32) {
    par_rows(x, 1, |_, x| x.fill(v));
}

/// `x *= a`, element by element.
pub fn scale(x: &mut [f32], a: f32) {
    par_rows(x, 1, |_, x| x.iter_mut().for_each(|v| *v *= a));
}

/// Whether every element of `x` is finite. Over the pool, 16 values at a time
/// without an early exit inside, so the test vectorises.
pub fn all_finite(x: &[f32]) -> bool {
    let finite = |c: &[f32]| c.iter().fold(true, |ok, v| ok & v.is_finite());
    let ok = |x: &[f32]| x.chunks(16).all(finite);
    if intra_op_threads() <= 1 || x.len() < PAR_ZEROS_MIN {
        return ok(x);
    }
    use rayon::prelude::*;
    x.par_chunks(x.len().div_ceil(intra_op_threads())).all(ok)
}

/// Backward of [`add`]: `da += d_out`, `db += d_out`.
pub fn add_bwd(d_out: &[f32], da: &mut [f32], db: &mut [f32]) -> Result<(), KernelError> {
    check_len("da", da.len(), d_out.len())?;
    check_len("db", db.len(), d_out.len())?;
    accumulate(da, d_out);
    accumulate(db, d_out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_grad_close, dot64, numeric_grad, Rng};

    /// Fill, scale and the finiteness test over pools of 1 and 2 threads, on
    /// buffers below and above the length that splits them: every element
    /// reached, and one non-finite value anywhere found.
    #[test]
    fn gradient_passes_reach_every_element_on_a_pool() {
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for n in [0, 5, PAR_ZEROS_MIN + 17] {
                pool.install(|| {
                    let mut x: Vec<f32> = (0..n).map(|i| i as f32).collect();
                    scale(&mut x, 0.5);
                    assert!(x.iter().enumerate().all(|(i, &v)| v == i as f32 * 0.5));
                    assert!(all_finite(&x));
                    for at in [0, n / 2, n.saturating_sub(1)]
                        .into_iter()
                        .filter(|_| n > 0)
                    {
                        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                            let keep = std::mem::replace(&mut x[at], bad);
                            assert!(!all_finite(&x), "n {n} at {at} {bad}");
                            x[at] = keep;
                        }
                    }
                    fill(&mut x, 0.0);
                    assert!(x.iter().all(|&v| v.to_bits() == 0));
                });
            }
        }
    }

    #[test]
    fn fast_tanh_is_within_its_bound_and_saturates() {
        use crate::cpu::fast_tanh;
        let mut worst = 0.0f64;
        for i in 0..=400_000 {
            let u = -50.0 + 100.0 * i as f32 / 400_000.0;
            worst = worst.max((fast_tanh(u) as f64 - (u as f64).tanh()).abs());
        }
        assert!(worst < 2.5e-7, "max absolute error {worst}");
        assert_eq!(fast_tanh(0.0), 0.0);
        assert_eq!(fast_tanh(60.0), 1.0);
        assert_eq!(fast_tanh(-60.0), -1.0);
        assert_eq!(fast_tanh(f32::INFINITY), 1.0);
        assert_eq!(fast_tanh(f32::NEG_INFINITY), -1.0);
        assert!(fast_tanh(f32::NAN).is_nan());
    }

    #[test]
    fn gelu_known_values() {
        let x = [0.0f32, 1.0, -1.0, 3.0];
        let mut y = [0.0; 4];
        gelu_fwd(&x, &mut y).unwrap();
        // torch.nn.functional.gelu(x, approximate="tanh")
        let expect = [0.0, 0.841_192, -0.158_808, 2.996_363_5];
        for (a, b) in y.iter().zip(expect) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn gelu_backward_matches_finite_differences() {
        let mut rng = Rng::new(31);
        let x: Vec<f32> = rng.vec(40).iter().map(|v| v * 4.0).collect();
        let dy = rng.vec(40);
        let mut dx = vec![0.0; 40];
        gelu_bwd(&x, &dy, &mut dx).unwrap();
        let n = numeric_grad(&x, 2e-3, |x| {
            let mut y = vec![0.0; x.len()];
            gelu_fwd(x, &mut y).unwrap();
            dot64(&dy, &y)
        });
        assert_grad_close("gelu dx", &dx, &n, 1e-2, 2e-3);
    }

    #[test]
    fn swiglu_by_hand_and_backward_matches_finite_differences() {
        // one row, f = 1: gate 1, up 2 -> silu(1) * 2 = 2 * 0.7310586
        let mut y = [0.0];
        swiglu_fwd(&[1.0, 2.0], 1, 1, &mut y).unwrap();
        assert!((y[0] - 1.462_117_2).abs() < 1e-6);

        let mut rng = Rng::new(32);
        let (rows, f) = (3, 5);
        let x: Vec<f32> = rng.vec(rows * 2 * f).iter().map(|v| v * 3.0).collect();
        let dy = rng.vec(rows * f);
        let mut dx = vec![0.0; x.len()];
        swiglu_bwd(&x, &dy, rows, f, &mut dx).unwrap();
        let n = numeric_grad(&x, 2e-3, |x| {
            let mut y = vec![0.0; rows * f];
            swiglu_fwd(x, rows, f, &mut y).unwrap();
            dot64(&dy, &y)
        });
        assert_grad_close("swiglu dx", &dx, &n, 1e-2, 2e-3);
        assert!(swiglu_fwd(&x, rows, f + 1, &mut vec![0.0; rows * (f + 1)]).is_err());
    }

    #[test]
    fn add_and_its_backward() {
        let mut out = [0.0; 2];
        add(&[1.0, 2.0], &[10.0, 20.0], &mut out).unwrap();
        assert_eq!(out, [11.0, 22.0]);
        let (mut da, mut db) = ([1.0, 1.0], [0.0, 0.0]);
        add_bwd(&[3.0, 4.0], &mut da, &mut db).unwrap();
        assert_eq!((da, db), ([4.0, 5.0], [3.0, 4.0]));
        assert!(add(&[1.0], &[1.0, 2.0], &mut out).is_err());
    }
}
