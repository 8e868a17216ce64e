//! Vocabulary-parallel embedding lookup.
//!
//! Each rank holds rows `[vocab_start, vocab_start + vocab_local)` of the
//! table. Out-of-range ids produce zero rows so that an AllReduce (sum) over
//! the vocabulary axis reconstructs the full lookup.

use super::{check_len, invalid, prod, KernelError};

fn vocab_local(table_len: usize, dim: usize) -> Result<usize, KernelError> {
    if dim == 0 {
        return Err(invalid("dim", "must be positive"));
    }
    if !table_len.is_multiple_of(dim) {
        return Err(invalid(
            "table",
            format!("length {table_len} is not a multiple of dim {dim}"),
        ));
    }
    Ok(table_len / dim)
}

/// Local row of `id`, if this shard owns it.
fn local_row(id: u32, vocab_start: usize, vocab_local: usize) -> Option<usize> {
    (id as usize)
        .checked_sub(vocab_start)
        .filter(|&r| r < vocab_local)
}

/// `out[t, :] = table[ids[t] - vocab_start, :]` for ids owned by this shard,
/// zeros otherwise.
///
/// `table` is `[vocab_local, dim]` (vocab_local inferred from its length),
/// `out` is `[ids.len(), dim]`.
pub fn embedding_fwd(
    ids: &[u32],
    table: &[f32],
    vocab_start: usize,
    dim: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let vl = vocab_local(table.len(), dim)?;
    check_len("out", out.len(), prod("out", &[ids.len(), dim])?)?;
    for (&id, row) in ids.iter().zip(out.chunks_exact_mut(dim)) {
        match local_row(id, vocab_start, vl) {
            Some(r) => row.copy_from_slice(&table[r * dim..(r + 1) * dim]),
            None => row.fill(0.0),
        }
    }
    Ok(())
}

/// `d_table[ids[t] - vocab_start, :] += d_out[t, :]` for ids owned by this
/// shard; other tokens contribute nothing here.
///
/// Tokens are visited in order, so repeated ids accumulate deterministically.
pub fn embedding_bwd(
    ids: &[u32],
    d_out: &[f32],
    vocab_start: usize,
    dim: usize,
    d_table: &mut [f32],
) -> Result<(), KernelError> {
    let vl = vocab_local(d_table.len(), dim)?;
    check_len("d_out", d_out.len(), prod("d_out", &[ids.len(), dim])?)?;
    for (&id, g) in ids.iter().zip(d_out.chunks_exact(dim)) {
        if let Some(r) = local_row(id, vocab_start, vl) {
            for (t, &x) in d_table[r * dim..(r + 1) * dim].iter_mut().zip(g) {
                *t += x;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::Rng;

    #[test]
    fn forward_selects_rows_and_zeros_out_of_range() {
        // shard holds global ids 10..13
        let table = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let ids = [11, 9, 12, 13, 10];
        let mut out = [f32::NAN; 10];
        embedding_fwd(&ids, &table, 10, 2, &mut out).unwrap();
        assert_eq!(out, [3.0, 4.0, 0.0, 0.0, 5.0, 6.0, 0.0, 0.0, 1.0, 2.0]);
    }

    #[test]
    fn two_shards_sum_to_full_lookup_and_grads_partition() {
        let mut rng = Rng::new(3);
        let (vocab, dim, n) = (9, 4, 17);
        let table = rng.vec(vocab * dim);
        let ids: Vec<u32> = (0..n).map(|_| rng.below(vocab as u64) as u32).collect();
        let mut full = vec![0.0; n * dim];
        embedding_fwd(&ids, &table, 0, dim, &mut full).unwrap();
        let split = 4;
        let mut a = vec![0.0; n * dim];
        let mut b = vec![0.0; n * dim];
        embedding_fwd(&ids, &table[..split * dim], 0, dim, &mut a).unwrap();
        embedding_fwd(&ids, &table[split * dim..], split, dim, &mut b).unwrap();
        for i in 0..n * dim {
            assert_eq!(a[i] + b[i], full[i]);
        }

        let dy = rng.vec(n * dim);
        let mut g_full = vec![0.0; vocab * dim];
        embedding_bwd(&ids, &dy, 0, dim, &mut g_full).unwrap();
        // reference: scatter-add by hand
        let mut r = vec![0.0f32; vocab * dim];
        for (t, &id) in ids.iter().enumerate() {
            for c in 0..dim {
                r[id as usize * dim + c] += dy[t * dim + c];
            }
        }
        assert_eq!(g_full, r);
        let mut ga = vec![0.0; split * dim];
        let mut gb = vec![0.0; (vocab - split) * dim];
        embedding_bwd(&ids, &dy, 0, dim, &mut ga).unwrap();
        embedding_bwd(&ids, &dy, split, dim, &mut gb).unwrap();
        ga.extend_from_slice(&gb);
        assert_eq!(ga, g_full);
    }

    #[test]
    fn backward_accumulates_and_validates() {
        let mut g = vec![1.0; 4];
        embedding_bwd(&[1, 1], &[1.0, 2.0, 3.0, 4.0], 0, 2, &mut g).unwrap();
        assert_eq!(g, [1.0, 1.0, 5.0, 7.0]);
        assert!(embedding_bwd(&[1], &[1.0], 0, 2, &mut g).is_err());
        assert!(embedding_fwd(&[0], &[0.0; 3], 0, 2, &mut [0.0; 2]).is_err());
        assert!(embedding_fwd(&[0], &[0.0; 4], 0, 0, &mut []).is_err());
    }
}
