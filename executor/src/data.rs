//! Token data: the nanoGPT / llm.c convention, a flat little-endian array of `u16`
//! token ids, optionally behind llm.c's 256-int32 header (magic 20240520, version 1,
//! token count).
//!
//! The file is read through a memory map, so every rank of a run shares the same
//! pages and nothing is copied. Training samples are windows of `seq_len + 1`
//! tokens (inputs and next-token labels) starting at multiples of `seq_len`; each
//! epoch visits them in a fresh pseudo-random order (a keyed Feistel permutation,
//! O(1) memory however large the file), and a step's `global_batch` samples are
//! consecutive positions of that order, so the data-parallel ranks of a step, which
//! take disjoint ranges of sample indices, never see the same window.

use crate::init::splitmix;
use crate::train::ExecError;
use memmap2::Mmap;
use std::path::{Path, PathBuf};

/// llm.c's header: 256 little-endian int32, the first three being magic, version
/// and token count.
const HEADER_BYTES: usize = 256 * 4;
const LLMC_MAGIC: i32 = 20240520;

/// A memory-mapped `u16` token file.
pub struct TokenFile {
    path: PathBuf,
    map: Mmap,
    /// Byte offset of the first token (0, or llm.c's header).
    start: usize,
    tokens: usize,
    /// SHA-256 of the tokens, computed the first time a checkpoint asks.
    digest: std::sync::OnceLock<String>,
}

impl std::fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenFile")
            .field("path", &self.path)
            .field("tokens", &self.tokens)
            .finish()
    }
}

impl TokenFile {
    /// Opens and validates `path`: llm.c header or none, whole `u16` tokens, every
    /// id below `vocab`.
    pub fn open(path: &Path, vocab: u64) -> Result<Self, ExecError> {
        let shown = path.display();
        let err = |m: String| ExecError::Data(format!("{shown}: {m}"));
        let map =
            crate::mapped::map_readonly(path).map_err(|e| err(format!("cannot read: {e}")))?;
        let word = |i: usize| -> Option<i32> {
            map.get(4 * i..4 * i + 4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        let (start, tokens) = if word(0) == Some(LLMC_MAGIC) && map.len() >= HEADER_BYTES {
            let version = word(1).unwrap_or(0);
            if version != 1 {
                return Err(err(format!(
                    "llm.c header version {version}: only version 1 (u16 tokens) is read"
                )));
            }
            let count = word(2).unwrap_or(-1);
            let body = map.len() - HEADER_BYTES;
            if count < 0 || count as usize * 2 != body {
                return Err(err(format!(
                    "llm.c header says {count} tokens but {body} bytes follow it (want 2 per token)"
                )));
            }
            (HEADER_BYTES, count as usize)
        } else {
            if map.len() % 2 != 0 {
                return Err(err(format!(
                    "{} bytes is not a whole number of u16 tokens",
                    map.len()
                )));
            }
            (0, map.len() / 2)
        };
        let tf = TokenFile {
            path: path.to_path_buf(),
            map,
            start,
            tokens,
            digest: std::sync::OnceLock::new(),
        };
        if let Some((i, t)) = (0..tf.tokens)
            .map(|i| (i, tf.token(i)))
            .find(|&(_, t)| u64::from(t) >= vocab)
        {
            return Err(err(format!(
                "token {t} at position {i} is outside the model's vocabulary ({vocab}); tokenize with the model's tokenizer"
            )));
        }
        Ok(tf)
    }

    /// Tokens in the file.
    pub fn len(&self) -> usize {
        self.tokens
    }

    /// Whether the file holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The SHA-256 of the tokens (not of a header), in hex: what tells two files of
    /// the same length apart.
    pub fn sha256(&self) -> &str {
        self.digest
            .get_or_init(|| crate::ckpt::sha256_hex(&self.map[self.start..]))
    }

    /// Token `i`.
    pub fn token(&self, i: usize) -> u16 {
        let b = self.start + 2 * i;
        u16::from_le_bytes([self.map[b], self.map[b + 1]])
    }
}

/// Which windows a run's samples read: `global_batch` samples per step, sample
/// `seq_index` of step `step` at [`Sampler::window`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampler {
    /// Windows of `seq_len + 1` tokens the file holds.
    pub windows: u64,
    /// Samples per optimizer step.
    pub global_batch: u64,
    /// Seed of the visiting order.
    pub seed: u64,
}

impl Sampler {
    /// A sampler over `tokens` tokens; an error if a step's samples would not be
    /// distinct windows.
    pub fn new(
        tokens: usize,
        seq_len: usize,
        global_batch: u64,
        seed: u64,
    ) -> Result<Self, String> {
        let windows = tokens.saturating_sub(1).checked_div(seq_len).unwrap_or(0) as u64;
        if windows < global_batch {
            return Err(format!(
                "{tokens} tokens hold {windows} sequences of {} tokens, but one step needs global_batch({global_batch}) distinct ones; use more data or a smaller batch",
                seq_len + 1
            ));
        }
        Ok(Sampler {
            windows,
            global_batch,
            seed,
        })
    }

    /// The window sample `seq_index` of step `step` reads. An epoch is a whole
    /// number of steps, so a step never straddles two orders.
    pub fn window(&self, step: u64, seq_index: u64) -> u64 {
        let steps_per_epoch = (self.windows / self.global_batch).max(1);
        let epoch = step / steps_per_epoch;
        let pos = (step % steps_per_epoch) * self.global_batch + seq_index;
        permute(pos, self.windows, splitmix(self.seed ^ splitmix(epoch)))
    }
}

/// A bijection of `0..n` keyed by `key`: a four-round Feistel network on the
/// smallest even number of bits covering `n`, cycle-walking outside `0..n` (at most
/// four domain points per value, so a few rounds on average).
pub fn permute(i: u64, n: u64, key: u64) -> u64 {
    debug_assert!(i < n);
    if n <= 1 {
        return 0;
    }
    let bits = 64 - (n - 1).leading_zeros();
    let half = bits.div_ceil(2);
    let mask = (1u64 << half) - 1;
    let round = |x: u64| {
        let (mut l, mut r) = (x >> half, x & mask);
        for k in 0..4u64 {
            let f = splitmix(key ^ (k << 58) ^ r) & mask;
            (l, r) = (r, l ^ f);
        }
        (l << half) | r
    };
    let mut x = round(i);
    while x >= n {
        x = round(x);
    }
    x
}

/// Where a run's tokens come from.
#[derive(Clone, Debug)]
pub enum DataSource {
    /// [`crate::init::synthetic_sequence`]: a learnable pattern from the seed.
    Synthetic,
    /// Windows of a token file in the sampler's order.
    File {
        /// The mapped file, shared by every rank.
        file: std::sync::Arc<TokenFile>,
    },
}

impl DataSource {
    /// What a checkpoint records of the data, to continue only on the same tokens:
    /// the source and, for a file, its path, token count and the tokens' SHA-256.
    pub fn describe(&self) -> serde_json::Value {
        match self {
            DataSource::Synthetic => serde_json::json!({"source": "synthetic"}),
            DataSource::File { file } => serde_json::json!({
                "source": "file",
                "path": file.path().display().to_string(),
                "tokens": file.len(),
                "sha256": file.sha256(),
            }),
        }
    }

    /// The `len + 1` tokens of sample `seq_index` of step `step`.
    pub fn sequence(
        &self,
        seed: u64,
        step: u64,
        seq_index: u64,
        len: usize,
        global_batch: u64,
        vocab: u64,
    ) -> Result<Vec<u32>, String> {
        match self {
            DataSource::Synthetic => Ok(crate::init::synthetic_sequence(
                seed, step, seq_index, len, vocab,
            )),
            DataSource::File { file } => {
                let sampler = Sampler::new(file.len(), len, global_batch, seed)
                    .map_err(|m| format!("{}: {m}", file.path().display()))?;
                let w = sampler.window(step, seq_index) as usize;
                Ok((w * len..=w * len + len)
                    .map(|i| u32::from(file.token(i)))
                    .collect())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::io::Write;

    #[test]
    fn permute_is_a_bijection_for_awkward_sizes() {
        for n in [1u64, 2, 3, 5, 17, 64, 100, 1000, 4097] {
            let seen: BTreeSet<u64> = (0..n).map(|i| permute(i, n, 42)).collect();
            assert_eq!(seen.len() as u64, n, "n = {n}");
            assert!(seen.iter().all(|&x| x < n));
        }
        // Another key, another order.
        let a: Vec<u64> = (0..100).map(|i| permute(i, 100, 1)).collect();
        let b: Vec<u64> = (0..100).map(|i| permute(i, 100, 2)).collect();
        assert_ne!(a, b);
    }

    #[test]
    fn data_parallel_ranks_see_disjoint_windows_and_an_epoch_repeats_none() {
        // 1000 windows, global batch 8 over dp = 4 ranks of 2 samples each.
        let s = Sampler {
            windows: 1000,
            global_batch: 8,
            seed: 7,
        };
        let mut epoch: BTreeSet<u64> = BTreeSet::new();
        for step in 0..125 {
            let ranks: Vec<BTreeSet<u64>> = (0..4)
                .map(|r| (0..2).map(|k| s.window(step, r * 2 + k)).collect())
                .collect();
            for a in 0..4 {
                for b in a + 1..4 {
                    assert!(
                        ranks[a].is_disjoint(&ranks[b]),
                        "step {step}: ranks {a} and {b}"
                    );
                }
                for &w in &ranks[a] {
                    assert!(epoch.insert(w), "window {w} twice in the first epoch");
                }
            }
        }
        assert_eq!(epoch.len(), 1000);
        // The next epoch visits them in another order.
        assert_ne!(s.window(125, 0), s.window(0, 0));
    }

    fn write(name: &str, bytes: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("meshplan-data-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
        p
    }

    fn u16s(t: &[u16]) -> Vec<u8> {
        t.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn reads_raw_and_llmc_files_and_rejects_bad_ones() {
        let toks: Vec<u16> = (0..100).map(|i| (i * 7 % 50) as u16).collect();
        let raw = TokenFile::open(&write("raw.bin", &u16s(&toks)), 50).unwrap();
        assert_eq!(raw.len(), 100);
        assert_eq!(raw.token(3), 21);
        let mut header = vec![0i32; 256];
        header[0] = LLMC_MAGIC;
        header[1] = 1;
        header[2] = 100;
        let mut bytes: Vec<u8> = header.iter().flat_map(|x| x.to_le_bytes()).collect();
        bytes.extend(u16s(&toks));
        let llmc = TokenFile::open(&write("llmc.bin", &bytes), 50).unwrap();
        assert_eq!(llmc.len(), 100);
        assert!((0..100).all(|i| llmc.token(i) == raw.token(i)));
        // Wrong count in the header, odd length, token outside the vocabulary.
        let mut short = bytes.clone();
        short.truncate(bytes.len() - 2);
        let e = TokenFile::open(&write("short.bin", &short), 50).unwrap_err();
        assert!(
            e.to_string().contains("short.bin") && e.to_string().contains("header says 100"),
            "{e}"
        );
        let e = TokenFile::open(&write("odd.bin", &[1, 2, 3]), 50).unwrap_err();
        assert!(e.to_string().contains("whole number"), "{e}");
        let e = TokenFile::open(&write("big.bin", &u16s(&[1, 2, 60])), 50).unwrap_err();
        assert!(e.to_string().contains("token 60 at position 2"), "{e}");
        let e = TokenFile::open(Path::new("/nonexistent/t.bin"), 50).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/t.bin"), "{e}");
    }

    #[test]
    fn a_sample_is_a_window_of_seq_len_plus_one_tokens() {
        let toks: Vec<u16> = (0..81).map(|i| i as u16).collect();
        let file =
            std::sync::Arc::new(TokenFile::open(&write("win.bin", &u16s(&toks)), 100).unwrap());
        let src = DataSource::File { file };
        // 81 tokens, seq_len 8: 10 windows starting at multiples of 8.
        let mut starts = BTreeSet::new();
        for i in 0..10 {
            let s = src.sequence(3, 0, i, 8, 10, 100).unwrap();
            assert_eq!(s.len(), 9);
            assert!(s.windows(2).all(|p| p[1] == p[0] + 1), "{s:?}");
            assert_eq!(s[0] % 8, 0);
            starts.insert(s[0]);
        }
        assert_eq!(starts.len(), 10);
        let e = src.sequence(3, 0, 0, 8, 11, 100).unwrap_err();
        assert!(e.contains("global_batch(11)"), "{e}");
    }
}
