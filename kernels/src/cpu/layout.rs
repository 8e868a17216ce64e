//! Row layouts around the attention kernels: sequence-major fused QKV rows split
//! into batch-major per-head operands and joined back, and rows swapped between
//! batch-major and sequence-major order. Copies only: every value lands unchanged.
//! The output rows are spread over the pool: each row is one copy, so the split
//! changes nothing, while on one thread of two the copies are a serial stretch
//! of every attention op as long as its operands.

use super::{check_len, par_rows, AttnDims, KernelError};

/// Where the query, key and value columns start in a fused row of `hq d + hkv d
/// + hkv dv`, how wide each is, and the row's width.
pub(super) fn qkv_columns(dims: &AttnDims) -> ([usize; 3], [usize; 3], usize) {
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
    let outs = [q, k, v];
    for (i, out) in outs.iter().enumerate() {
        check_len(["q", "k", "v"][i], out.len(), b * s * width[i])?;
    }
    for (i, out) in outs.into_iter().enumerate() {
        let (start, width) = (start[i], width[i]);
        if width == 0 {
            continue;
        }
        // Output row `t = bi s + si` is the fused row `si b + bi`'s columns.
        par_rows(out, width, |t0, rows| {
            for (t, dst) in (t0..).zip(rows.chunks_exact_mut(width)) {
                let (bi, si) = (t / s, t % s);
                dst.copy_from_slice(&x[(si * b + bi) * row + start..][..width]);
            }
        });
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
    if row == 0 {
        return Ok(());
    }
    par_rows(dx, row, |r0, rows| {
        for (r, dst) in (r0..).zip(rows.chunks_exact_mut(row)) {
            let t = (r % b) * s + r / b;
            for (i, x) in ins.iter().enumerate() {
                dst[start[i]..][..width[i]].copy_from_slice(&x[t * width[i]..][..width[i]]);
            }
        }
    });
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
    if w == 0 {
        return Ok(());
    }
    // Output row `r` of `[s, b]` order is input row `(r % b) s + r / b` of
    // `[b, s]` order, and the other way round.
    let (outer, inner) = if to_sbhd { (b, s) } else { (s, b) };
    par_rows(y, w, |r0, rows| {
        for (r, dst) in (r0..).zip(rows.chunks_exact_mut(w)) {
            let from = (r % outer) * inner + r / outer;
            dst.copy_from_slice(&x[from * w..][..w]);
        }
    });
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

    /// On pools of 1 to 3 threads, over sizes whose rows do not split evenly,
    /// every copy lands where an index-by-index reading of the layouts says.
    #[test]
    fn copies_over_a_pool_land_where_the_layouts_say() {
        let dims = AttnDims {
            batch: 3,
            sq: 7,
            sk: 7,
            hq: 4,
            hkv: 2,
            d: 3,
            dv: 5,
        };
        let (b, s) = (dims.batch, dims.sq);
        let widths = [4 * 3, 2 * 3, 2 * 5];
        let row: usize = widths.iter().sum();
        let x: Vec<f32> = (0..s * b * row).map(|i| i as f32).collect();
        // Fused row (si, bi) holds q | k | v; operand row (bi, si) holds one part.
        let part = |i: usize| -> Vec<f32> {
            let start: usize = widths[..i].iter().sum();
            (0..b * s)
                .flat_map(|t| {
                    let fused = (t % s) * b + t / s;
                    x[fused * row + start..][..widths[i]].to_vec()
                })
                .collect()
        };
        let want = [part(0), part(1), part(2)];
        for threads in 1..=3 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut qkv = widths.map(|w| vec![f32::NAN; b * s * w]);
                let [q, k, v] = &mut qkv;
                split_qkv(&x, &dims, q, k, v).unwrap();
                assert_eq!(qkv, want, "{threads} threads");
                let mut back = vec![f32::NAN; x.len()];
                join_qkv(&qkv[0], &qkv[1], &qkv[2], &dims, &mut back).unwrap();
                assert_eq!(back, x, "{threads} threads");
                // [b, s, w] -> [s, b, w] is the fused order of q's rows.
                let w = widths[0];
                let mut sb = vec![f32::NAN; b * s * w];
                transpose_bs(&qkv[0], (b, s, w), true, &mut sb).unwrap();
                let by_hand: Vec<f32> = (0..s * b)
                    .flat_map(|r| x[r * row..][..w].to_vec())
                    .collect();
                assert_eq!(sb, by_hand, "{threads} threads");
                let mut bs = vec![f32::NAN; sb.len()];
                transpose_bs(&sb, (b, s, w), false, &mut bs).unwrap();
                assert_eq!(bs, qkv[0], "{threads} threads");
            });
        }
    }
}
