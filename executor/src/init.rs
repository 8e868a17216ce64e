//! Deterministic parameters and data: every value is a pure function of the seed and
//! its global coordinates, so any sharding of the same plan sees the same model and
//! the same tokens as the single-rank reference.

/// SplitMix64: a counter-based generator, so element `i` of a tensor needs no state.
pub use meshplan_kernels::cpu::splitmix;

pub use meshplan_launch::fnv1a64;

/// FNV-1a of a name, to key a tensor's stream.
pub fn name_hash(name: &str) -> u64 {
    fnv1a64(name.as_bytes())
}

/// A uniform in (0, 1) from a key.
fn uniform(key: u64) -> f64 {
    ((splitmix(key) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// How a weight starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum InitKind {
    /// Normal with this standard deviation (GPT-2's 0.02 for matrices).
    Normal(f32),
    /// Ones (norm scales).
    Ones,
    /// Zeros (biases).
    Zeros,
}

/// The full (unsharded) values of weight `name` of layer `layer`.
pub fn init_full(seed: u64, name: &str, layer: u64, elems: usize, kind: InitKind) -> Vec<f32> {
    init_held(seed, name, layer, std::slice::from_ref(&(0..elems)), kind)
}

/// The values at `runs` (ranges of element indices of the full tensor, in order)
/// of weight `name` of layer `layer`: a rank draws only the elements it holds, and
/// its kernel threads draw them together, each element a pure function of its
/// index, so any split gives the same bits.
pub fn init_held(
    seed: u64,
    name: &str,
    layer: u64,
    runs: &[std::ops::Range<usize>],
    kind: InitKind,
) -> Vec<f32> {
    use rayon::prelude::*;
    let len = runs.iter().map(|r| r.len()).sum();
    let std = match kind {
        InitKind::Ones => return vec![1.0; len],
        InitKind::Zeros => return vec![0.0; len],
        InitKind::Normal(std) => std,
    };
    let base = splitmix(seed ^ name_hash(name)) ^ splitmix(layer.wrapping_add(0x5151));
    let normal = |i: usize| {
        // Box-Muller on two independent uniforms per element.
        let k = base.wrapping_add((i as u64).wrapping_mul(2));
        let (u1, u2) = (uniform(k), uniform(k ^ 0xa5a5_a5a5_a5a5_a5a5));
        let r = (-2.0 * u1.ln()).sqrt();
        (r * (2.0 * std::f64::consts::PI * u2).cos()) as f32 * std
    };
    // Pieces small enough to share out however the runs fall (one whole tensor,
    // or a column block of every row), each written in place: the output is the
    // only copy.
    const PIECE: usize = 1 << 14;
    let mut out = vec![0.0f32; len];
    let mut pieces = Vec::new();
    let mut rest = out.as_mut_slice();
    for r in runs {
        for a in r.clone().step_by(PIECE) {
            let b = (a + PIECE).min(r.end);
            let (dst, tail) = rest.split_at_mut(b - a);
            pieces.push((dst, a..b));
            rest = tail;
        }
    }
    pieces.into_par_iter().for_each(|(dst, r)| {
        for (d, i) in dst.iter_mut().zip(r) {
            *d = normal(i);
        }
    });
    out
}

/// How weight `w` of `op` starts: norm scales at one, other vectors (biases) at
/// zero, matrices normal with standard deviation 0.02 (GPT-2's).
pub fn init_kind(op: &meshplan_ir::Op, w: meshplan_ir::TensorId, shape: &[usize]) -> InitKind {
    match op.kind {
        meshplan_ir::OpKind::Norm(_) if shape.len() == 1 && op.inputs.get(1) == Some(&w) => {
            InitKind::Ones
        }
        _ if shape.len() == 1 => InitKind::Zeros,
        _ => InitKind::Normal(0.02),
    }
}

/// The synthetic token stream: sequence `seq_index` of step `step` has `len + 1`
/// tokens (inputs and next-token labels) drawn from a fixed pattern plus noise, so a
/// model can learn it and the loss falls.
pub fn synthetic_sequence(
    seed: u64,
    step: u64,
    seq_index: u64,
    len: usize,
    vocab: u64,
) -> Vec<u32> {
    let start = splitmix(seed ^ splitmix(step.wrapping_mul(1_000_003).wrapping_add(seq_index)));
    let stride = 1 + start % 7;
    (0..=len as u64)
        .map(|i| {
            let noise = splitmix(start.wrapping_add(i)).is_multiple_of(8);
            let t = if noise {
                splitmix(start ^ i.wrapping_mul(31)) % vocab
            } else {
                (start.wrapping_add(i * stride)) % vocab
            };
            t as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_depend_only_on_coordinates() {
        let a = init_full(7, "block.attn.qkv.w", 3, 1000, InitKind::Normal(0.02));
        let b = init_full(7, "block.attn.qkv.w", 3, 1000, InitKind::Normal(0.02));
        assert_eq!(a, b);
        let c = init_full(7, "block.attn.qkv.w", 4, 1000, InitKind::Normal(0.02));
        assert_ne!(a, c);
        let mean: f32 = a.iter().sum::<f32>() / a.len() as f32;
        let var: f32 = a.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.003, "{mean}");
        assert!((var.sqrt() - 0.02).abs() < 0.002, "{}", var.sqrt());
    }

    /// Drawing only some runs (across the pieces the threads share out, and in the
    /// runs' order, not the tensor's) gives the same bits as slicing the whole.
    #[test]
    fn held_runs_draw_the_whole_tensors_values() {
        let full = init_full(7, "embed.tokens.w", 0, 50_000, InitKind::Normal(0.02));
        let runs = [40_000..40_003, 5..20_000, 0..0, 49_999..50_000];
        let want: Vec<f32> = runs.iter().flat_map(|r| full[r.clone()].to_vec()).collect();
        let got = init_held(7, "embed.tokens.w", 0, &runs, InitKind::Normal(0.02));
        assert_eq!(got.len(), 3 + 19_995 + 1);
        assert_eq!(got, want);
        let ones = init_held(7, "norm.w", 0, &runs, InitKind::Ones);
        assert_eq!(ones, vec![1.0; got.len()]);
    }

    #[test]
    fn tokens_are_in_range_and_reproducible() {
        let s = synthetic_sequence(1, 2, 3, 32, 256);
        assert_eq!(s.len(), 33);
        assert!(s.iter().all(|&t| t < 256));
        assert_eq!(s, synthetic_sequence(1, 2, 3, 32, 256));
        assert_ne!(s, synthetic_sequence(1, 2, 4, 32, 256));
    }
}
