//! Mutation fuzzing of every text and binary input a user hands meshplan, in
//! process: real files as seeds, byte-level and structural mutations, each case
//! under `catch_unwind`. Zero panics and zero hangs are required; memory stays
//! bounded (the peak resident size is printed and checked).
//!
//! `MESHPLAN_FUZZ_CASES` sets the cases per target (default 10,000, what CI runs).
//! The plan.json target is in `fuzz_plan.rs`.

use crate::bin::{temp_dir, ROOT};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Cases per target unless `MESHPLAN_FUZZ_CASES` says otherwise.
const DEFAULT_CASES: usize = 10_000;

/// A case that takes longer than this is a hang (the slowest real input parses
/// in milliseconds).
const CASE_LIMIT: Duration = Duration::from_secs(5);

/// Peak resident memory of the whole test process allowed after fuzzing: inputs
/// are read with size limits and specs validated before anything is allocated
/// from them.
const PEAK_RSS_LIMIT_MIB: u64 = 4096;

pub(crate) fn cases() -> usize {
    std::env::var("MESHPLAN_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

/// xorshift64*: deterministic, so a failing case is reproduced by its index.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub(crate) fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// Values that break parsers and arithmetic: zero, negatives, the edges of
/// integer types, floats where integers go, non-numbers, YAML's special forms.
const WORDS: &[&str] = &[
    "0",
    "-1",
    "1",
    "2",
    "3",
    "7",
    "1e9",
    "1e15",
    "1e308",
    "-1e308",
    "0.5",
    "1.5e-300",
    "4294967296",
    "18446744073709551615",
    "18446744073709551616",
    "9223372036854775807",
    "-9223372036854775808",
    ".nan",
    ".inf",
    "-.inf",
    "NaN",
    "null",
    "~",
    "true",
    "false",
    "\"\"",
    "''",
    "[]",
    "{}",
    "[[[[",
    "]]",
    "{{",
    "}",
    ": ",
    "- ",
    "? ",
    "&a ",
    "*a",
    "!!binary ",
    "!!str ",
    "<<: *a",
    "\n",
    "\n  ",
    "\t",
    "#",
    "'",
    "\"",
    ",",
    "\u{feff}",
    "\u{0}",
    "é",
    "👾",
    "bf16",
    "fp8",
    "f32",
    "gelu",
    "swiglu",
    "rmsnorm",
    "rope",
    "moe",
    "mla",
    "1f1b",
    "gpipe",
];

/// One mutation of `data`: byte flips, token insertion, deletion, duplication,
/// number replacement, or a splice with another seed.
pub(crate) fn mutate_bytes(rng: &mut Rng, data: &mut Vec<u8>, seeds: &[Vec<u8>]) {
    let len = data.len();
    match rng.below(7) {
        0 if len > 0 => {
            let i = rng.below(len);
            data[i] ^= 1 << rng.below(8);
        }
        1 => {
            let i = rng.below(len + 1);
            let w = rng.pick(WORDS).as_bytes();
            data.splice(i..i, w.iter().copied());
        }
        2 if len > 0 => {
            let i = rng.below(len);
            let n = 1 + rng.below(32.min(len - i));
            data.drain(i..i + n);
        }
        3 if len > 0 => {
            let i = rng.below(len);
            let n = 1 + rng.below(64.min(len - i));
            let piece: Vec<u8> = data[i..i + n].to_vec();
            let at = rng.below(len + 1);
            data.splice(at..at, piece);
        }
        4 => {
            // A run of digits becomes another number.
            let starts: Vec<usize> = (0..len)
                .filter(|&i| data[i].is_ascii_digit() && (i == 0 || !data[i - 1].is_ascii_digit()))
                .collect();
            if let Some(&i) = starts.get(rng.below(starts.len().max(1))) {
                let mut j = i;
                while j < len && (data[j].is_ascii_digit() || data[j] == b'.') {
                    j += 1;
                }
                let w = rng.pick(&WORDS[..20]).as_bytes();
                data.splice(i..j, w.iter().copied());
            }
        }
        5 if !seeds.is_empty() => {
            let other = rng.pick(seeds);
            let cut = rng.below(len + 1);
            let from = rng.below(other.len() + 1);
            data.truncate(cut);
            data.extend_from_slice(&other[from..]);
        }
        _ => {
            let i = rng.below(len + 1);
            data.insert(i, rng.next() as u8);
        }
    }
}

/// A random node of a YAML/JSON document replaced by a hostile value, or a key
/// removed: reaches validation that byte mutations rarely get past the parser to.
pub(crate) fn mutate_tree(rng: &mut Rng, v: &mut serde_yaml_ng::Value) {
    use serde_yaml_ng::Value;
    fn count(v: &Value) -> usize {
        1 + match v {
            Value::Mapping(m) => m.values().map(count).sum(),
            Value::Sequence(s) => s.iter().map(count).sum(),
            _ => 0,
        }
    }
    /// The `k`-th node in pre-order.
    fn nth<'v>(v: &'v mut Value, k: &mut usize) -> Option<&'v mut Value> {
        if *k == 0 {
            return Some(v);
        }
        *k -= 1;
        match v {
            Value::Mapping(m) => m.values_mut().find_map(|x| nth(x, k)),
            Value::Sequence(s) => s.iter_mut().find_map(|x| nth(x, k)),
            _ => None,
        }
    }
    let mut k = rng.below(count(v));
    let Some(node) = nth(v, &mut k) else { return };
    let word = *rng.pick(WORDS);
    *node = match rng.below(8) {
        0 => Value::Null,
        1 => Value::Sequence(vec![]),
        2 => Value::Mapping(Default::default()),
        3 => match node {
            Value::Mapping(m) if !m.is_empty() => {
                let key = m.keys().nth(rng.below(m.len())).cloned().expect("a key");
                m.remove(&key);
                return;
            }
            Value::Sequence(s) if !s.is_empty() => {
                let i = rng.below(s.len());
                let x = s[i].clone();
                s.push(x);
                return;
            }
            _ => Value::String(word.into()),
        },
        4 => Value::Number((rng.next() as i64).into()),
        5 => Value::Number(f64::from_bits(rng.next()).into()),
        _ => serde_yaml_ng::from_str(word).unwrap_or(Value::String(word.into())),
    };
}

/// What one target's run found: how many mutants were accepted.
pub(crate) struct Report {
    pub(crate) accepted: usize,
}

/// Runs `case(i)` for `n` cases on a worker thread; fails on a panic (naming the
/// case index, which reproduces it), on a case over [`CASE_LIMIT`], and on a peak
/// resident size over [`PEAK_RSS_LIMIT_MIB`].
pub(crate) fn drive(
    name: &str,
    n: usize,
    case: impl Fn(usize) -> bool + Send + Sync + 'static,
) -> Report {
    let done = Arc::new(AtomicUsize::new(0));
    let seen = done.clone();
    let (tx, rx) = mpsc::channel();
    let start = Instant::now();
    std::thread::spawn(move || {
        let mut accepted = 0;
        let mut slowest = Duration::ZERO;
        for i in 0..n {
            let t = Instant::now();
            match catch_unwind(AssertUnwindSafe(|| case(i))) {
                Ok(ok) => accepted += usize::from(ok),
                Err(_) => {
                    let _ = tx.send(Err(i));
                    return;
                }
            }
            slowest = slowest.max(t.elapsed());
            seen.store(i + 1, Ordering::Relaxed);
        }
        let _ = tx.send(Ok((accepted, slowest)));
    });
    let mut last = (0, Instant::now());
    let (accepted, slowest) = loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(Ok(r)) => break r,
            Ok(Err(i)) => panic!("{name}: case {i} panicked (reproduce with its index)"),
            Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{name}: the fuzz thread died"),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let now = done.load(Ordering::Relaxed);
                if now != last.0 {
                    last = (now, Instant::now());
                } else if last.1.elapsed() > CASE_LIMIT {
                    panic!("{name}: case {now} hangs (over {CASE_LIMIT:?})");
                }
            }
        }
    };
    let seconds = start.elapsed().as_secs_f64();
    let peak = peak_rss_mib();
    eprintln!(
        "fuzz {name}: {n} cases ({accepted} accepted) in {seconds:.1} s ({:.0}/s), slowest {:.1} ms, process peak RSS {peak} MiB",
        n as f64 / seconds,
        slowest.as_secs_f64() * 1e3
    );
    assert!(peak <= PEAK_RSS_LIMIT_MIB, "{name}: peak RSS {peak} MiB");
    Report { accepted }
}

/// The process's peak resident size (VmHWM), MiB; 0 where /proc is missing.
pub(crate) fn peak_rss_mib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib / 1024)
}

fn read_seeds(paths: &[&str]) -> Vec<Vec<u8>> {
    paths
        .iter()
        .map(|p| std::fs::read(Path::new(ROOT).join(p)).unwrap_or_else(|e| panic!("{p}: {e}")))
        .collect()
}

/// A mutant of a random seed: one to four byte mutations, or a tree mutation
/// (for YAML and JSON) followed by at most one byte mutation.
fn mutant(rng: &mut Rng, seeds: &[Vec<u8>], tree: bool) -> Vec<u8> {
    let mut data = rng.pick(seeds).clone();
    if tree && rng.below(2) == 0 {
        if let Ok(mut v) = serde_yaml_ng::from_slice::<serde_yaml_ng::Value>(&data) {
            for _ in 0..1 + rng.below(3) {
                mutate_tree(rng, &mut v);
            }
            data = serde_yaml_ng::to_string(&v)
                .unwrap_or_default()
                .into_bytes();
            if rng.below(4) == 0 {
                mutate_bytes(rng, &mut data, seeds);
            }
            return data;
        }
    }
    for _ in 0..1 + rng.below(4) {
        mutate_bytes(rng, &mut data, seeds);
    }
    data
}

fn text_target(
    name: &'static str,
    seeds: Vec<Vec<u8>>,
    tree: bool,
    run: impl Fn(&str) -> bool + Send + Sync + 'static,
) -> Report {
    let seeds = Arc::new(seeds);
    let n = cases();
    let salt = name
        .bytes()
        .fold(0u64, |h, b| h.wrapping_mul(31) ^ u64::from(b));
    let report = drive(name, n, move |i| {
        let mut rng = Rng::new(salt ^ i as u64);
        let data = mutant(&mut rng, &seeds, tree);
        String::from_utf8(data).is_ok_and(|text| run(&text))
    });
    // Mutants the parser refuses test only the parser; some must get through.
    assert!(report.accepted > 0, "{name}: no mutant was accepted");
    report
}

// === the targets ===

#[test]
fn fuzz_model_yaml() {
    let seeds = read_seeds(&[
        "models/tiny-gpt.yaml",
        "models/tiny-moe.yaml",
        "models/tiny-moe-capacity.yaml",
        "models/tiny-llama-inference.yaml",
        "models/llama3-8b.yaml",
        "models/deepseek-v3.yaml",
        "models/mixtral-8x7b.yaml",
        "models/gpt3-175b.yaml",
    ]);
    text_target("model yaml", seeds, true, |text| {
        meshplan_ir::parse_model_yaml(text, "fuzz.yaml")
            .and_then(|spec| meshplan_ir::model_graph(&spec))
            .is_ok()
    });
}

#[test]
fn fuzz_hf_config() {
    let seeds = read_seeds(&[
        "models/hf/llama3-8b.json",
        "models/hf/llama3-8b-transformers5.json",
        "models/hf/deepseek-v3.json",
        "models/hf/qwen2-7b.json",
        "models/hf/mistral-7b.json",
        "models/hf/mixtral-8x7b.json",
        "models/hf/gpt2.json",
    ]);
    text_target("hf config.json", seeds, true, |text| {
        meshplan_ir::hf::import_hf_config(text, "config.json")
            .and_then(|spec| meshplan_ir::model_graph(&spec))
            .is_ok()
    });
}

#[test]
fn fuzz_cluster_yaml() {
    let seeds = read_seeds(&[
        "topologies/cpu-test-mesh.yaml",
        "topologies/dgx-a100-80g.yaml",
        "topologies/dgx-h100.yaml",
        "topologies/h200-node.yaml",
        "topologies/h800-node.yaml",
        "topologies/pcie-a100-node.yaml",
    ]);
    // The file name's folder is empty: a `calibration:` a mutant names is looked
    // up there and refused, never read from the test's working directory.
    let dir = temp_dir("fuzz-cluster");
    let file = dir.join("cluster.yaml").display().to_string();
    text_target("cluster yaml", seeds, true, move |text| {
        meshplan_cost_model::cluster::parse_cluster_yaml(text, &file, None).is_ok()
    });
}

#[test]
fn fuzz_overlay_yaml() {
    let overlay = r#"format: 1
device: NVIDIA H100 80GB HBM3
measured_at: 2025-06-01T12:00:00Z
measured_with: hand-written seed
gpus_per_node: 8
gemm:
  bf16:
    - {m: 4096, n: 4096, k: 4096, tflops: 600}
    - {m: 8192, n: 8192, k: 8192, tflops: 700}
  fp8:
    - {m: 4096, n: 4096, k: 4096, tflops: 1200}
hbm_gbps: 3000
attention:
  bf16: {forward_tflops: 400, backward_tflops: 300}
intra_node:
  - {collective: all_reduce, ranks: 8, alpha_us: 20, beta_gbps: 180}
  - {collective: all_gather, ranks: 2, alpha_us: 8, beta_gbps: 300}
"#;
    let cluster =
        meshplan_cost_model::load_cluster(&Path::new(ROOT).join("topologies/dgx-h100.yaml"), None)
            .expect("cluster");
    let seeds = vec![overlay.as_bytes().to_vec()];
    assert!(
        meshplan_cost_model::overlay::parse_overlay_yaml(overlay, "seed.yaml")
            .and_then(|raw| raw.validate("seed.yaml", &cluster, "dgx-h100.yaml"))
            .is_ok(),
        "the seed overlay is valid"
    );
    text_target("overlay yaml", seeds, true, move |text| {
        meshplan_cost_model::overlay::parse_overlay_yaml(text, "overlay.yaml")
            .and_then(|raw| raw.validate("overlay.yaml", &cluster, "dgx-h100.yaml"))
            .is_ok()
    });
}

#[test]
fn fuzz_config_flag() {
    let seeds: Vec<Vec<u8>> = [
        "dp=60,tp=8,pp=8,mbs=1,recompute=full",
        "dp=2,tp=2,pp=2,zero=3,sp=true,schedule=interleaved,vpp=2",
        "cp=2,ep=4,attn=flash,tp_overlap=true,recompute=selective",
        "tp=4,pp=2,schedule=gpipe,mbs=4,zero=1",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    text_target("--config", seeds, false, |text| {
        meshplan_ir::PartialConfig::parse(text, "--config")
            .and_then(|p| p.resolve(3840, "--config"))
            .is_ok()
    });
}

#[test]
fn fuzz_token_file() {
    let dir = temp_dir("fuzz-tokens");
    let tokens: Vec<u8> = (0..600u16).flat_map(|t| (t % 256).to_le_bytes()).collect();
    let mut llmc: Vec<u8> = [20240520i32, 1, 600]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    llmc.resize(1024, 0);
    llmc.extend_from_slice(&tokens);
    let seeds = Arc::new(vec![tokens, llmc]);
    let n = cases();
    let report = drive("token file", n, move |i| {
        let mut rng = Rng::new(0x70_6b ^ i as u64);
        let data = mutant(&mut rng, &seeds, false);
        let path: PathBuf = dir.join(format!("t{}.bin", i % 8));
        std::fs::write(&path, &data).expect("write");
        meshplan_executor::data::TokenFile::open(&path, 256).is_ok()
    });
    assert!(report.accepted > 0);
}

#[test]
fn fuzz_safetensors_header() {
    let dir = temp_dir("fuzz-safetensors");
    let config =
        std::fs::read_to_string(Path::new(ROOT).join("models/hf/gpt2.json")).expect("config");
    // A real header: two tensors, the layout a checkpoint writer produces.
    let a: Vec<u8> = (0..24u32).flat_map(|x| (x as f32).to_le_bytes()).collect();
    let b: Vec<u8> = (0..8u32)
        .flat_map(|x| half::bf16::from_f32(x as f32).to_le_bytes())
        .collect();
    let views = vec![
        (
            "wte.weight",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![4, 6], &a)
                .expect("view"),
        ),
        (
            "ln_f.bias",
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![8], &b)
                .expect("view"),
        ),
    ];
    let seed = safetensors::serialize(views, None).expect("serialize");
    let seeds = Arc::new(vec![seed]);
    let n = cases();
    let report = drive("safetensors header", n, move |i| {
        let mut rng = Rng::new(0x5afe ^ i as u64);
        let mut data = rng.pick(&seeds).clone();
        // Mutations aimed at the 8-byte length and the JSON header that follows.
        let header_end = 8 + u64::from_le_bytes(data[..8].try_into().expect("8 bytes")) as usize;
        for _ in 0..1 + rng.below(3) {
            let mut head = data[..header_end.min(data.len())].to_vec();
            let tail = data[header_end.min(data.len())..].to_vec();
            mutate_bytes(&mut rng, &mut head, &[]);
            if rng.below(4) == 0 && head.len() >= 8 {
                let len = match rng.below(3) {
                    0 => u64::MAX,
                    1 => rng.next() % 4096,
                    _ => (head.len() - 8) as u64,
                };
                head[..8].copy_from_slice(&len.to_le_bytes());
            }
            data = head;
            data.extend_from_slice(&tail);
        }
        let ck = dir.join(format!("c{}", i % 4));
        std::fs::create_dir_all(&ck).expect("dir");
        std::fs::write(ck.join("config.json"), &config).expect("config");
        std::fs::write(ck.join("model.safetensors"), &data).expect("weights");
        meshplan_executor::weights::Checkpoint::open(&ck).is_ok()
    });
    assert!(report.accepted > 0);
}

#[test]
fn fuzz_checkpoint_manifest() {
    let plan = crate::cli::plan_file(
        "fuzz-ckpt-plan.json",
        "models/tiny-gpt.yaml",
        "dp=2,tp=2,pp=2",
    );
    let dir = temp_dir("fuzz-manifest");
    let saved = dir.join("saved");
    let _ = std::fs::remove_dir_all(&saved);
    crate::bin::meshplan(&[
        "run",
        plan.to_str().expect("utf-8"),
        "--steps",
        "1",
        "--save",
        saved.to_str().expect("utf-8"),
    ])
    .expect_code(0);
    let step = saved.join(meshplan_executor::ckpt::step_folder(1));
    let manifest = std::fs::read(step.join("manifest.json")).expect("manifest");
    let sums = std::fs::read(step.join("manifest.sha256")).expect("sums");
    // An old-format seed (no checksum file) lets mutants reach the manifest's own
    // checks instead of stopping at the checksum.
    let text = String::from_utf8(manifest.clone()).expect("utf-8");
    let v1 = text
        .replacen("\"version\": 2", "\"version\": 1", 1)
        .into_bytes();
    assert_ne!(v1, manifest, "the manifest names its version");
    // Four case folders holding the real data files; each case rewrites the two
    // small files only.
    let folders: Vec<PathBuf> = (0..4)
        .map(|k| {
            let f = dir.join(format!("case{k}"));
            let _ = std::fs::remove_dir_all(&f);
            std::fs::create_dir_all(&f).expect("dir");
            for e in std::fs::read_dir(&step).expect("list") {
                let e = e.expect("entry");
                std::fs::copy(e.path(), f.join(e.file_name())).expect("copy");
            }
            f
        })
        .collect();
    let seeds = Arc::new((manifest, sums, v1));
    let n = cases();
    let report = drive("checkpoint manifest", n, move |i| {
        let mut rng = Rng::new(0xc4e7 ^ i as u64);
        let (manifest, sums, v1) = &*seeds;
        let f = &folders[i % folders.len()];
        let (m, s) = match rng.below(3) {
            0 => (
                mutant(&mut rng, std::slice::from_ref(manifest), true),
                Some(sums.clone()),
            ),
            1 => (
                manifest.clone(),
                Some(mutant(&mut rng, std::slice::from_ref(sums), true)),
            ),
            _ => (mutant(&mut rng, std::slice::from_ref(v1), true), None),
        };
        std::fs::write(f.join("manifest.json"), &m).expect("write");
        match s {
            Some(s) => std::fs::write(f.join("manifest.sha256"), s).expect("write"),
            None => {
                let _ = std::fs::remove_file(f.join("manifest.sha256"));
            }
        }
        let Ok(ck) = meshplan_executor::ckpt::Checkpoint::open(f) else {
            return false;
        };
        for (name, t) in &ck.manifest().tensors {
            let _ = ck.values(name, &t.shape);
        }
        true
    });
    assert!(report.accepted > 0);
}
