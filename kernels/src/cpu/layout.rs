//! Row layouts around the attention kernels: sequence-major fused QKV rows split
//! into batch-major per-head operands and joined back, and rows swapped between
//! batch-major and sequence-major order. Copies only: every value lands unchanged.

use super::{check_len, AttnDims, KernelError};

/// Where the query, key and value columns start in a fused row of `hq d + hkv d
/// + hkv dv`, how wide each is, and the row's width.
fn qkv_columns(dims: &AttnDims) -> ([usize; 3], [usize; 3], usize) {
    let (q, k, v) = (dims.hq * dims.d, dims.hkv * dims.d, dims.hkv * dims.dv);
    ([0, q, q + k], [q, k, v], q + k + v)
}

/// Fused rows `x [s, b, hq d | hkv d | hkv dv]` (`s = dims.sq`, `b = dims.batch`)
/// into `q [b, s, hq, d]`, `k [b, s, hkv, d]` and `v [b, s, hkv, dv]`
/// (overwritten).
pub fn split_qkv(
    x: &[f32],
    dims: &AttnDims,
    q: &mut [f32],
    k: &mut [f32],
    v: &mut [f32],
) -> Result<(), KernelError> {
    let ((start, width, row), b, s) = (qkv_columns(dims), dims.batch, dims.sq);
    check_len("x", x.len(), s * b * row)?;
    let mut outs = [q, k, v];
    for (i, out) in outs.iter_mut().enumerate() {
        check_len(["q", "k", "v"][i], out.len(), b * s * width[i])?;
    }
    for si in 0..s {
        for bi in 0..b {
            let src = &x[(si * b + bi) * row..][..row];
            let t = bi * s + si;
            for (i, out) in outs.iter_mut().enumerate() {
                out[t * width[i]..][..width[i]].copy_from_slice(&src[start[i]..][..width[i]]);
            }
        }
    }
    Ok(())
}

/// The inverse of [`split_qkv`]: `dq`, `dk`, `dv` (batch-major) into fused
/// sequence-major rows `dx` (overwritten).
pub fn join_qkv(
    dq: &[f32],
    dk: &[f32],
    dv: &[f32],
    dims: &AttnDims,
    dx: &mut [f32],
) -> Result<(), KernelError> {
    let ((start, width, row), b, s) = (qkv_columns(dims), dims.batch, dims.sq);
    check_len("dx", dx.len(), s * b * row)?;
    let ins = [dq, dk, dv];
    for (i, x) in ins.iter().enumerate() {
        check_len(["dq", "dk", "dv"][i], x.len(), b * s * width[i])?;
    }
    for si in 0..s {
        for bi in 0..b {
            let dst = &mut dx[(si * b + bi) * row..][..row];
            let t = bi * s + si;
            for (i, x) in ins.iter().enumerate() {
                dst[start[i]..][..width[i]].copy_from_slice(&x[t * width[i]..][..width[i]]);
            }
        }
    }
    Ok(())
}

/// Rows of width `w` from `[b, s]` order to `[s, b]` (`to_sbhd`) or back, into
/// `y` (overwritten).
pub fn transpose_bs(
    x: &[f32],
    (b, s, w): (usize, usize, usize),
    to_sbhd: bool,
    y: &mut [f32],
) -> Result<(), KernelError> {
    check_len("x", x.len(), b * s * w)?;
    check_len("y", y.len(), b * s * w)?;
    for bi in 0..b {
        for si in 0..s {
            let (bs, sb) = ((bi * s + si) * w, (si * b + bi) * w);
            let (from, to) = if to_sbhd { (bs, sb) } else { (sb, bs) };
            y[to..][..w].copy_from_slice(&x[from..][..w]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One sequence position, two samples, one query head and one key/value head
    /// of width 2 (hand-worked): row `[q0 q1 k0 k1 v0 v1]` per (position, sample).
    #[test]
    fn split_and_join_are_inverse_copies() {
        let dims = AttnDims {
            batch: 2,
            sq: 2,
            sk: 2,
            hq: 1,
            hkv: 1,
            d: 2,
            dv: 2,
        };
        // Rows (s0,b0), (s0,b1), (s1,b0), (s1,b1); values 10 * row + column.
        let x: Vec<f32> = (0..4)
            .flat_map(|r| (0..6).map(move |c| (10 * r + c) as f32))
            .collect();
        let (mut q, mut k, mut v) = (vec![0.0; 8], vec![0.0; 8], vec![0.0; 8]);
        split_qkv(&x, &dims, &mut q, &mut k, &mut v).unwrap();
        // Batch-major: (b0,s0)=row 0, (b0,s1)=row 2, (b1,s0)=row 1, (b1,s1)=row 3.
        assert_eq!(q, vec![0.0, 1.0, 20.0, 21.0, 10.0, 11.0, 30.0, 31.0]);
        assert_eq!(k, vec![2.0, 3.0, 22.0, 23.0, 12.0, 13.0, 32.0, 33.0]);
        assert_eq!(v, vec![4.0, 5.0, 24.0, 25.0, 14.0, 15.0, 34.0, 35.0]);
        let mut back = vec![0.0; x.len()];
        join_qkv(&q, &k, &v, &dims, &mut back).unwrap();
        assert_eq!(back, x);
        let mut sb = vec![0.0; 8];
        transpose_bs(&q, (2, 2, 2), true, &mut sb).unwrap();
        assert_eq!(sb, vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0, 30.0, 31.0]);
        let mut bs = vec![0.0; 8];
        transpose_bs(&sb, (2, 2, 2), false, &mut bs).unwrap();
        assert_eq!(bs, q);
        assert!(split_qkv(&x[1..], &dims, &mut q, &mut k, &mut v).is_err());
    }
}
