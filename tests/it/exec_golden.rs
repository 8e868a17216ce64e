//! Bit-for-bit fingerprints of executor runs, kept as goldens: every step's loss,
//! every rank's share of it, a SHA-256 of every rank's final weights (each weight's
//! name, layer and f32 bits, in key order), its byte counts per collective kind and
//! axis, and its expert routing. A new interpreter must reproduce them exactly; the
//! files are written by the interpreter that was current when they were recorded
//! (`UPDATE_GOLDEN=1` rewrites them, which a change of results must justify).
//!
//! A GEMM's sums round differently with the vector width of its kernels, so the
//! fingerprints hold bitwise only among CPUs that take the same GEMM kernels
//! ([`gemm_isa`]). `exec/NAME.txt` is the base set, recorded with the AVX2/FMA
//! kernels; `exec/ISA/NAME.txt` holds a run's fingerprint under other kernels
//! where it differs from the base (about a third of the runs under AVX-512; the
//! rest do not change). Recording results that changed therefore takes two runs
//! on an AVX-512 CPU, the base first:
//!
//! ```sh
//! UPDATE_GOLDEN=1 cargo test --release -p meshplan-tests --no-default-features --test it
//! UPDATE_GOLDEN=1 cargo test --release -p meshplan-tests --test it
//! ```

use meshplan_executor::comm::ByteCounts;
use meshplan_executor::infer::InferReport;
use meshplan_executor::kernels::cpu::gemm_isa;
use meshplan_executor::train::TrainReport;
use sha2::{Digest, Sha256};
use std::fmt::Write;

/// The fingerprint of one training run, one line per fact.
pub(crate) fn fingerprint(run: &TrainReport) -> String {
    let mut out = String::new();
    for (i, l) in run.losses.iter().enumerate() {
        let _ = writeln!(out, "loss {i} {:016x} {l:e}", l.to_bits());
    }
    for r in &run.ranks {
        let parts: Vec<String> = r
            .loss_parts
            .iter()
            .map(|p| format!("{:016x}", p.to_bits()))
            .collect();
        let _ = writeln!(out, "rank {} loss_parts {}", r.rank, parts.join(" "));
        let mut h = Sha256::new();
        for ((name, layer), w) in &r.weights {
            h.update(name.as_bytes());
            h.update(layer.to_le_bytes());
            h.update((w.len() as u64).to_le_bytes());
            for v in w {
                h.update(v.to_bits().to_le_bytes());
            }
        }
        let digest: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        let elems: usize = r.weights.values().map(Vec::len).sum();
        let _ = writeln!(
            out,
            "rank {} weights {} tensors {elems} values sha256 {digest}",
            r.rank,
            r.weights.len()
        );
        counts(&mut out, r.rank, &r.counts);
        let _ = writeln!(
            out,
            "rank {} expert_slots {} over_capacity {}",
            r.rank, r.expert_slots.0, r.expert_slots.1
        );
    }
    out
}

fn counts(out: &mut String, rank: usize, counts: &ByteCounts) {
    for (kind, axis, c) in counts.iter() {
        let _ = writeln!(
            out,
            "rank {rank} {kind:?} {axis} calls {} payload {} sent {:?}",
            c.calls,
            c.payload_bytes,
            c.bytes_sent()
        );
    }
}

fn sha256_f32(values: &[f32]) -> String {
    let mut h = Sha256::new();
    for v in values {
        h.update(v.to_bits().to_le_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The fingerprint of one inference run: each request's tokens and the SHA-256 of
/// its first and last logits, and every rank's byte counts.
pub(crate) fn infer_fingerprint(run: &InferReport) -> String {
    let mut out = String::new();
    for (i, r) in run.requests.iter().enumerate() {
        let _ = writeln!(
            out,
            "request {i} prompt {} tokens {:?} eos {}",
            r.prompt_len, r.tokens, r.ended_at_eos
        );
        let _ = writeln!(
            out,
            "request {i} first_logits sha256 {}",
            sha256_f32(&r.first_logits)
        );
        let _ = writeln!(out, "request {i} logits sha256 {}", sha256_f32(&r.logits));
        for (s, l) in r.step_logits.iter().enumerate() {
            let _ = writeln!(out, "request {i} step {s} logits sha256 {}", sha256_f32(l));
        }
    }
    for (rank, c) in run.counts.iter().enumerate() {
        counts(&mut out, rank, c);
    }
    let _ = writeln!(
        out,
        "kv_cache_bytes {} weight_bytes {}",
        run.kv_cache_bytes, run.weight_bytes
    );
    out
}

/// Eight hex digits of the SHA-256 of the model's specification: variants of one
/// model file (more layers, dropout, tied embeddings) keep its name but not its tag.
pub(crate) fn model_tag(spec: &meshplan_ir::ModelSpec) -> String {
    let json = serde_json::to_string(spec).expect("a model serialises");
    Sha256::digest(json.as_bytes())
        .iter()
        .take(4)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Compares the fingerprint of `run` with the golden `exec/NAME.txt` (`name`
/// made file-safe; `exec/ISA/NAME.txt` where this CPU's GEMM kernels recorded
/// one of their own), or records it under `UPDATE_GOLDEN=1`.
#[track_caller]
pub(crate) fn check(name: &str, run: &TrainReport) {
    compare(name, &fingerprint(run));
}

/// [`check`] where a golden of `name` is recorded (base or this CPU's own);
/// false, and nothing compared, where none is.
#[track_caller]
pub(crate) fn check_where_recorded(name: &str, run: &TrainReport) -> bool {
    if !recorded(name) {
        return false;
    }
    check(name, run);
    true
}

/// Whether a golden of `name` is recorded (base or this CPU's own).
pub(crate) fn recorded(name: &str) -> bool {
    let (base, own) = golden_names(name);
    golden_path(&base).exists() || golden_path(&own).exists()
}

/// [`check`] for an inference run.
#[track_caller]
pub(crate) fn check_infer(name: &str, run: &InferReport) {
    compare(name, &infer_fingerprint(run));
}

/// The goldens of `name` (made file-safe): the base set's `exec/NAME.txt`, and
/// `exec/ISA/NAME.txt` for this CPU's GEMM kernels.
fn golden_names(name: &str) -> (String, String) {
    let safe: String = name
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | '=' | '-' => c,
            _ => '_',
        })
        .collect();
    (
        format!("exec/{safe}.txt"),
        format!("exec/{}/{safe}.txt", gemm_isa()),
    )
}

#[track_caller]
fn compare(name: &str, text: &str) {
    let (base, own) = golden_names(name);
    if gemm_isa() == BASE_ISA {
        return crate::draw::golden(&base, text);
    }
    let own_path = golden_path(&own);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        let recorded = std::fs::read_to_string(golden_path(&base)).unwrap_or_else(|e| {
            panic!(
                "{base}: {e}; record the base set first, with the {BASE_ISA} GEMM kernels: \
                 UPDATE_GOLDEN=1 cargo test --release -p meshplan-tests --no-default-features --test it"
            )
        });
        if recorded == text {
            if own_path.exists() {
                std::fs::remove_file(&own_path).expect("remove a golden equal to the base");
            }
        } else {
            crate::draw::golden(&own, text);
        }
        return;
    }
    crate::draw::golden(if own_path.exists() { &own } else { &base }, text);
}

/// The GEMM kernels the base set of fingerprints was recorded with.
const BASE_ISA: &str = "fma";

fn golden_path(name: &str) -> std::path::PathBuf {
    std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/data/golden")).join(name)
}

/// Each fingerprint recorded under other GEMM kernels than the base's differs from
/// the base fingerprint of its run, which exists: an override equal to its base, or
/// one whose base was renamed or deleted, is a stale file.
#[test]
fn every_per_kernel_fingerprint_differs_from_an_existing_base() {
    let root = golden_path("exec");
    let mut seen = 0;
    for dir in std::fs::read_dir(&root).expect("exec goldens") {
        let dir = dir.expect("entry").path();
        if !dir.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(&dir).expect("a kernel's goldens") {
            let file = file.expect("entry").path();
            let name = file.file_name().expect("name");
            let base = std::fs::read_to_string(root.join(name))
                .unwrap_or_else(|e| panic!("{}: no base fingerprint: {e}", file.display()));
            let own = std::fs::read_to_string(&file).expect("read");
            assert_ne!(own, base, "{} equals its base: delete it", file.display());
            seen += 1;
        }
    }
    assert!(
        seen > 0,
        "the AVX-512 fingerprints are recorded under exec/avx512f"
    );
}
