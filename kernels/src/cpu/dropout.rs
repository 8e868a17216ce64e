//! Dropout masks drawn by a counter-based hash, never stored: an entry survives or
//! not as a pure function of the run's seed, the step, the dropout site and the
//! entry's global coordinates, so every rank that holds the entry, every sharding,
//! every recomputation and every device (the CUDA twins in `dropout.cu` and
//! `attention.cu` use the same hash and threshold) draws the same mask.

use super::{check_len, KernelError};

/// SplitMix64's output function (Steele, Lea, Flood, "Fast splittable pseudorandom
/// number generators", OOPSLA 2014): a bijective mix of 64 bits.
pub fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One dropout site's draw: the run's seed, the step, the site's key and the drop
/// probability `p`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutDraw {
    /// The run's seed.
    pub seed: u64,
    /// The optimizer step (masks change every step).
    pub step: u64,
    /// The site's key (op name and layer).
    pub site: u64,
    /// The drop probability, in `[0, 1)`.
    pub p: f64,
}

impl DropoutDraw {
    /// The hash state of this site before the coordinates are mixed in.
    pub fn base(&self) -> u64 {
        splitmix(self.seed ^ splitmix(self.step ^ splitmix(self.site)))
    }

    /// Whether the entry at `coords` survives: 53 bits of the hash as a uniform
    /// draw in `[0, 1)`, kept when at least `p`.
    pub fn keep(&self, coords: [u64; 3]) -> bool {
        let mut z = self.base();
        for c in coords {
            z = splitmix(z ^ c);
        }
        (z >> 11) >= self.threshold()
    }

    /// The draw in integer form: `(z >> 11) * 2^-53 >= p` holds exactly when
    /// `z >> 11 >= ceil(p * 2^53)` (scaling by a power of two is exact), which is
    /// what a GPU compares without doubles.
    pub fn threshold(&self) -> u64 {
        (self.p * (1u64 << 53) as f64).ceil() as u64
    }
}

/// Dropout over the rows of a sequence-major activation `[rows, width]` (row `r` is
/// sample `sample0 + r % mbs` at position `pos0 + r / mbs`): the entry at column `j`
/// is drawn at `[sample, position, j]`, and a survivor scaled by `1 / (1 - p)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowDropout {
    /// The site's draw.
    pub draw: DropoutDraw,
    /// The global index of the micro-batch's first sample on this rank.
    pub sample0: u64,
    /// Samples per micro-batch.
    pub mbs: usize,
    /// The global position of the first row (context and sequence blocks).
    pub pos0: u64,
}

impl RowDropout {
    /// A survivor's factor, rounded to f32 once from the f64 quotient.
    pub fn scale(&self) -> f32 {
        (1.0 / (1.0 - self.draw.p)) as f32
    }

    /// The global (sample, position) of local row `r`.
    pub fn coords(&self, r: usize) -> (u64, u64) {
        let b = self.mbs.max(1);
        (self.sample0 + (r % b) as u64, self.pos0 + (r / b) as u64)
    }
}

/// `y = x * mask` over `[rows, width]` (forward and backward alike: the backward
/// applies the same mask to the output's gradient).
pub fn dropout_rows(
    x: &[f32],
    rows: usize,
    width: usize,
    d: &RowDropout,
    y: &mut [f32],
) -> Result<(), KernelError> {
    check_len("x", x.len(), rows * width)?;
    check_len("y", y.len(), rows * width)?;
    let inv = d.scale();
    for r in 0..rows {
        let (sample, pos) = d.coords(r);
        let span = r * width..(r + 1) * width;
        for (j, (o, a)) in y[span.clone()].iter_mut().zip(&x[span]).enumerate() {
            let m = if d.draw.keep([sample, pos, j as u64]) {
                inv
            } else {
                0.0
            };
            *o = a * m;
        }
    }
    Ok(())
}

/// Dropout of attention probabilities: the entry (local batch row `b`, local head
/// `h`, query position `i`, key position `j`) is drawn at `[sample0 + b, i, j]`
/// with the site keyed by the global head `head0 + h`, so every split of heads,
/// samples and sequence blocks draws the same mask.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnDropout {
    /// The op's draw (each head mixes its index into the site).
    pub draw: DropoutDraw,
    /// The global index of this rank's first head.
    pub head0: u64,
    /// The global index of the micro-batch's first sample on this rank.
    pub sample0: u64,
}

impl AttnDropout {
    /// The draw of global head `head`: its own site.
    pub fn head_draw(&self, head: u64) -> DropoutDraw {
        DropoutDraw {
            site: self.draw.site ^ (head << 40),
            ..self.draw
        }
    }

    /// Whether entry (local batch row `b`, local head `h`, query position `i`, key
    /// position `j`) survives.
    pub fn keep(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        self.head_draw(self.head0 + h as u64)
            .keep([self.sample0 + b as u64, i as u64, j as u64])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_the_reference_sequence() {
        // SplitMix64 seeded with 0: its first output is mix(0 + golden gamma).
        assert_eq!(splitmix(0), 0xe220_a839_7b1d_cdaf);
        assert_eq!(splitmix(0x9e37_79b9_7f4a_7c15), 0x6e78_9e6a_a1b9_65f4);
    }

    #[test]
    fn integer_threshold_agrees_with_the_f64_draw() {
        for &p in &[0.0, 0.1, 0.25, 0.5, 1.0 / 3.0, 0.9] {
            let d = DropoutDraw {
                seed: 7,
                step: 3,
                site: 11,
                p,
            };
            for c in 0..2000u64 {
                let mut z = d.base();
                for x in [c, c / 7, c % 5] {
                    z = splitmix(z ^ x);
                }
                let by_f64 = ((z >> 11) as f64) * (1.0 / (1u64 << 53) as f64) >= p;
                assert_eq!(d.keep([c, c / 7, c % 5]), by_f64, "p {p} c {c}");
            }
        }
        // ceil(0.5 * 2^53) = 2^52 exactly; p = 0 keeps everything.
        let half = DropoutDraw {
            seed: 0,
            step: 0,
            site: 0,
            p: 0.5,
        };
        assert_eq!(half.threshold(), 1 << 52);
        assert_eq!(DropoutDraw { p: 0.0, ..half }.threshold(), 0);
    }

    #[test]
    fn rows_scale_survivors_and_zero_the_rest() {
        let d = RowDropout {
            draw: DropoutDraw {
                seed: 1,
                step: 2,
                site: 3,
                p: 0.2,
            },
            sample0: 4,
            mbs: 2,
            pos0: 8,
        };
        // Row 3 of a two-sample micro-batch: sample 4 + 1, position 8 + 1.
        assert_eq!(d.coords(3), (5, 9));
        assert_eq!(d.scale(), 1.25);
        let (rows, width) = (64, 16);
        let x: Vec<f32> = (0..rows * width).map(|i| 1.0 + i as f32).collect();
        let mut y = vec![f32::NAN; x.len()];
        dropout_rows(&x, rows, width, &d, &mut y).unwrap();
        let mut kept = 0;
        for r in 0..rows {
            let (s, p) = d.coords(r);
            for j in 0..width {
                let i = r * width + j;
                if d.draw.keep([s, p, j as u64]) {
                    kept += 1;
                    assert_eq!(y[i], x[i] * 1.25);
                } else {
                    assert_eq!(y[i], 0.0);
                }
            }
        }
        // 1024 draws at p = 0.2: 819 expected, 4 standard deviations is +-51.
        assert!((768..=870).contains(&kept), "{kept} kept");
        assert!(dropout_rows(&x, rows, width + 1, &d, &mut y).is_err());
    }

    #[test]
    fn attention_heads_draw_from_their_own_sites() {
        let a = AttnDropout {
            draw: DropoutDraw {
                seed: 5,
                step: 1,
                site: 0xa77e_0000,
                p: 0.5,
            },
            head0: 2,
            sample0: 6,
        };
        // Local head 1 of a rank whose first head is 2 is global head 3.
        let d3 = DropoutDraw {
            site: 0xa77e_0000 ^ (3 << 40),
            ..a.draw
        };
        for (b, i, j) in [(0, 0, 0), (1, 5, 2), (3, 9, 9)] {
            assert_eq!(
                a.keep(b, 1, i, j),
                d3.keep([6 + b as u64, i as u64, j as u64])
            );
        }
        let differs = (0..64).filter(|&j| a.keep(0, 0, 7, j) != a.keep(0, 1, 7, j));
        assert!(differs.count() > 8, "two heads share a mask");
    }
}
