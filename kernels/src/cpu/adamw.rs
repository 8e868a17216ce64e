//! AdamW optimizer step (decoupled weight decay), as `torch.optim.AdamW`.

#![allow(clippy::too_many_arguments)]

use super::{check_len, intra_op_threads, invalid, KernelError};

/// Below this many elements a step is too short to be worth splitting.
const PAR_MIN: usize = 1 << 16;

/// One AdamW step in place, elementwise over `param`, `grad`, `m`, `v`
/// (all the same length; with ZeRO each rank passes its shard).
///
/// Matches PyTorch's (non-amsgrad, non-fused) update for 1-based `step`:
///
/// ```text
/// param *= 1 - lr * weight_decay
/// m = beta1 * m + (1 - beta1) * grad
/// v = beta2 * v + (1 - beta2) * grad^2
/// param -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
/// ```
///
/// The bias corrections are computed in f64 (PyTorch computes them as
/// Python floats) and rounded once; everything elementwise is f32.
pub fn adamw_step(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    step: u64,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
) -> Result<(), KernelError> {
    let n = param.len();
    check_len("grad", grad.len(), n)?;
    check_len("m", m.len(), n)?;
    check_len("v", v.len(), n)?;
    if step == 0 {
        return Err(invalid("step", "is 1-based; got 0"));
    }
    let t = step.min(i32::MAX as u64) as i32;
    let bc1 = 1.0 - (beta1 as f64).powi(t);
    let bc2 = 1.0 - (beta2 as f64).powi(t);
    let step_size = (lr as f64 / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let decay = 1.0 - lr * weight_decay;
    let update = |param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]| {
        for i in 0..param.len() {
            let g = grad[i];
            let mi = beta1 * m[i] + (1.0 - beta1) * g;
            let vi = beta2 * v[i] + (1.0 - beta2) * g * g;
            m[i] = mi;
            v[i] = vi;
            let denom = vi.sqrt() / bc2_sqrt + eps;
            param[i] = param[i] * decay - step_size * mi / denom;
        }
    };
    let threads = intra_op_threads();
    if threads <= 1 || n < PAR_MIN {
        update(param, grad, m, v);
        return Ok(());
    }
    use rayon::prelude::*;
    let c = n.div_ceil(threads);
    param
        .par_chunks_mut(c)
        .zip(grad.par_chunks(c))
        .zip(m.par_chunks_mut(c))
        .zip(v.par_chunks_mut(c))
        .for_each(|(((p, g), m), v)| update(p, g, m, v));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_step_matches_hand_computation() {
        // First step: m = 0.1 g, v = 0.001 g^2; bias-corrected m/sqrt(v) = sign(g)
        // (up to eps), so p1 = p0 (1 - lr wd) - lr * g / (|g| + eps).
        let (lr, wd, eps) = (0.01f32, 0.1f32, 1e-8f32);
        let mut p = [1.0f32, -2.0, 0.5];
        let g = [0.5f32, -0.25, 0.0];
        let mut m = [0.0; 3];
        let mut v = [0.0; 3];
        adamw_step(&mut p, &g, &mut m, &mut v, 1, lr, 0.9, 0.999, eps, wd).unwrap();
        let expect = [1.0 * 0.999 - 0.01, -2.0 * 0.999 + 0.01, 0.5 * 0.999];
        for (a, b) in p.iter().zip(expect) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        // (1 - beta) is rounded to f32, hence the relative tolerance
        assert!((m[0] / 0.05 - 1.0).abs() < 1e-5, "{}", m[0]);
        assert!((v[0] / 0.000_25 - 1.0).abs() < 1e-4, "{}", v[0]);
    }

    #[test]
    fn two_steps_match_f64_reference() {
        let (lr, b1, b2, eps, wd) = (1e-3f32, 0.9f32, 0.95f32, 1e-6f32, 0.01f32);
        let grads = [[0.3f32, -1.2], [-0.1, 0.7]];
        let mut p = [0.2f32, -0.4];
        let (mut m, mut v) = ([0.0f32; 2], [0.0f32; 2]);
        let mut rp = [0.2f64, -0.4];
        let (mut rm, mut rv) = ([0.0f64; 2], [0.0f64; 2]);
        for (s, g) in grads.iter().enumerate() {
            let t = s as i32 + 1;
            adamw_step(&mut p, g, &mut m, &mut v, t as u64, lr, b1, b2, eps, wd).unwrap();
            for i in 0..2 {
                let gi = g[i] as f64;
                rp[i] *= 1.0 - lr as f64 * wd as f64;
                rm[i] = b1 as f64 * rm[i] + (1.0 - b1 as f64) * gi;
                rv[i] = b2 as f64 * rv[i] + (1.0 - b2 as f64) * gi * gi;
                let bc1 = 1.0 - (b1 as f64).powi(t);
                let bc2 = 1.0 - (b2 as f64).powi(t);
                rp[i] -= lr as f64 / bc1 * rm[i] / (rv[i].sqrt() / bc2.sqrt() + eps as f64);
            }
        }
        for i in 0..2 {
            assert!((p[i] as f64 - rp[i]).abs() < 1e-6, "{} vs {}", p[i], rp[i]);
            assert!((m[i] as f64 - rm[i]).abs() < 1e-6);
        }
    }

    #[test]
    fn rejects_step_zero_and_length_mismatch() {
        let mut p = [0.0; 2];
        let (mut m, mut v) = ([0.0; 2], [0.0; 2]);
        assert!(matches!(
            adamw_step(&mut p, &[0.0; 2], &mut m, &mut v, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0),
            Err(KernelError::Invalid { name: "step", .. })
        ));
        assert!(
            adamw_step(&mut p, &[0.0; 3], &mut m, &mut v, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0).is_err()
        );
    }
}
