//! Checkpoints: full (unsharded) weights and AdamW moments in safetensors files, a
//! manifest, and the step. Storing full tensors makes a checkpoint independent of
//! the plan that wrote it: every rank of any plan slices its part with
//! [`local_weight`], the rule that slices an initial weight, so resuming on the same
//! plan copies the saved bits back and resuming on other degrees reshards for free.
//!
//! # Layout
//!
//! `DIR/step-00000006/` holds `model-00001-of-0000N.safetensors` files of at most
//! [`SaveOptions::file_bytes`] each (a larger tensor gets a file of its own),
//! `manifest.json` (format, model, step, seed, optimizer, data position, strategy,
//! files with their SHA-256, and each tensor's file and shape) and `manifest.sha256`
//! (the SHA-256 of every file of the folder, `manifest.json` included, one per
//! top-level manifest field and per field of its small objects, so that an edit is
//! refused naming the field, and one of its own content). Tensors are `w/NAME`,
//! `adam_m/NAME`, `adam_v/NAME`, with `@LAYER` after the names of block weights.
//! `DIR/latest` names the newest complete step folder: `step-00000006`, or
//! `step-00000006.ID` for a moment while a save replaces a step folder that exists.
//! Version 1 checkpoints (FNV-1a 64 per data file, no `manifest.sha256`) are still
//! read; their manifest is not checked.
//!
//! # Saving safely
//!
//! A run holds an exclusive lock on `DIR/.meshplan.lock` (flock) from before its
//! first step to its end, so a second run saving into `DIR` is refused; the lock
//! also proves that every temporary (`.tmp-*`) and unnamed re-save folder found in
//! `DIR` when it is taken was left by a dead process, so they are removed then (not
//! a folder `latest` names). During the run, a save removes only its own
//! temporaries, which carry the run's id (pid and a random number).
//!
//! The invariant: `latest` always names a complete, synced step folder (or is
//! absent), and a folder is removed only after `latest` has stopped naming it.
//! Every step of `write_checkpoint` keeps it, so a crash between any two
//! filesystem operations leaves a loadable `latest`:
//!
//! 1. Write every file into `DIR/.tmp-step-N-ID/`, fsync each, fsync the folder.
//! 2. If `step-N` does not exist: rename the folder to `step-N`, fsync `DIR`, point
//!    `latest` at it. Pointing `latest` is a write of `.tmp-latest-ID`, fsync, a
//!    rename over `latest` (atomic), fsync `DIR`.
//! 3. If `step-N` exists (a re-save of a step): rename the new folder to
//!    `step-N.ID`, point `latest` at it, then move the old `step-N` aside, hard-link
//!    (or copy) the new files into `.tmp-link-step-N-ID/`, fsync it, rename it to
//!    `step-N`, point `latest` back at `step-N`, and remove `step-N.ID` and the old
//!    folder. A rename cannot replace a non-empty folder, so the old folder has to
//!    go before the new takes its name, and by then `latest` names the new copy.
//! 4. With `--keep-last K`, step folders older than the K newest are moved to a
//!    temporary name and removed; never the one `latest` names.
//!
//! A run whose first save would be at a step below the one `latest` names is
//! refused before it trains ([`SaveOptions::prepare`]): `latest` never goes back.
//! A save that fails (a full disk) is reported when it happens; the run trains on,
//! the next due save tries again, and the caller exits non-zero at the end (the
//! failed [`Saved`] carries the cause).
//!
//! # Testing hooks
//!
//! `MESHPLAN_CRASH_AT=N` kills the process (SIGKILL, as `kill -9`; abort off unix)
//! at the N-th filesystem operation of saving (mkdir, create, write, fsync, rename,
//! link, remove; a write is cut half way), and `MESHPLAN_FAIL_AT=N` makes that
//! operation fail as a full disk would. Both are read once per process.
//!
//! # Assembling full tensors
//!
//! At a save step each rank offers the pieces it owns (its slices; under ZeRO only
//! its optimizer partition, the part its own AdamW step just wrote), and reads back
//! only those the writer holds no copy of yet. Ranks that are threads of one
//! process hand them over directly; launched ranks send them to rank 0, one rank
//! after another. Each snapshot is placed into the step's full tensors as it
//! arrives and freed, so the writer holds the model's state about once; the last
//! rank to arrive starts a writer thread. Where a local value sits in the full
//! tensor is found by [`held_runs`], the runs of the full tensor that
//! `local_weight` copies, in order; every element must be covered, or the save
//! fails.

use crate::program::fixed_shape;
use crate::shard::TpPos;
#[cfg(doc)]
use crate::shard::{held_runs, local_weight};
use crate::train::{Key, TrainOptions, NO_LAYER};
use memmap2::Mmap;
use meshplan_ir::input::{read_bounded, TEXT_LIMIT};
use meshplan_ir::plan::Plan;
use meshplan_ir::{Graph, Op, SegmentKind, TensorId, TensorKind, Workload};
use safetensors::tensor::{Dtype, SafeTensors, View};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

/// `format` of a manifest.
pub const FORMAT: &str = "meshplan-checkpoint";
/// Version of the layout described in the module doc (2: SHA-256 and
/// `manifest.sha256`; 1: FNV-1a 64, still read).
pub const VERSION: u64 = 2;
/// Default bound on one safetensors file.
pub const DEFAULT_FILE_BYTES: usize = 256 << 20;
/// AdamW hyper-parameters of the optimizer step: (beta1, beta2, eps, weight decay).
pub const ADAMW: (f32, f32, f32, f32) = (0.9, 0.95, 1e-8, 0.0);
/// The manifest's file name in a step folder.
pub const MANIFEST: &str = "manifest.json";
/// The checksums' file name in a step folder.
pub const SUMS: &str = "manifest.sha256";
/// `format` of [`SUMS`].
const SUMS_FORMAT: &str = "meshplan-checkpoint-sha256";
/// The lock file of a checkpoint folder; never removed, since removing a lock file
/// lets a third run lock a new file while the second still holds the old one.
pub const LOCK: &str = ".meshplan.lock";
/// `latest` holds one folder name; a larger file is not one meshplan wrote.
const LATEST_LIMIT: u64 = 1 << 20;
/// Environment variable of the crash hook (testing only; module doc).
pub const CRASH_AT_VAR: &str = "MESHPLAN_CRASH_AT";
/// Environment variable of the failure hook (testing only; module doc).
pub const FAIL_AT_VAR: &str = "MESHPLAN_FAIL_AT";

/// Reports a failed save when it happens (the CLI logs it; by default stderr).
#[derive(Clone)]
pub struct SaveNotify(pub Arc<dyn Fn(&str) + Send + Sync>);

impl std::fmt::Debug for SaveNotify {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SaveNotify")
    }
}

/// Where and how often a run saves.
#[derive(Clone, Debug)]
pub struct SaveOptions {
    /// The checkpoint folder (step folders and `latest` go inside).
    pub dir: PathBuf,
    /// Save after every this many steps (global step numbers); 0: only at the end.
    /// The last step always saves.
    pub every: u64,
    /// Keep only the newest this many step folders (at least 1; the one `latest`
    /// names is always kept); `None` keeps them all.
    pub keep_last: Option<u64>,
    /// Bound on one safetensors file.
    pub file_bytes: usize,
    /// For tests: the save after this many steps stops with an error after writing
    /// this many files and half of the next (or, past the last file, before the
    /// manifest), as a full disk would.
    pub fail_after_files: Option<(u64, usize)>,
    /// Told each failed save (and each failed tidy-up) when it happens.
    pub notify: Option<SaveNotify>,
    /// The folder's lock, once [`SaveOptions::prepare`] took it; shared by the
    /// clones, so it is held until the last of them (the writer's) is dropped.
    lock: Option<Arc<DirLock>>,
}

impl SaveOptions {
    /// Saves into `dir` every `every` steps and at the end.
    pub fn new(dir: impl Into<PathBuf>, every: u64) -> SaveOptions {
        SaveOptions {
            dir: dir.into(),
            every,
            keep_last: None,
            file_bytes: DEFAULT_FILE_BYTES,
            fail_after_files: None,
            notify: None,
            lock: None,
        }
    }

    /// Whether a save follows the step that brings the count to `done` of `total`.
    pub fn due(&self, done: u64, total: u64) -> bool {
        done == total || (self.every > 0 && done.is_multiple_of(self.every))
    }

    /// The first save of a run from step `start` to `total`, if it saves at all.
    pub fn first_due(&self, start: u64, total: u64) -> Option<u64> {
        if start >= total {
            return None;
        }
        let periodic = (self.every > 0)
            .then(|| (start / self.every + 1).saturating_mul(self.every))
            .filter(|&d| d < total);
        Some(periodic.unwrap_or(total))
    }

    /// Takes the folder's lock (creating the folder), refused while another run
    /// holds it. Idempotent.
    pub fn lock(&mut self) -> Result<(), String> {
        if self.lock.is_none() {
            self.lock = Some(Arc::new(DirLock::acquire(&self.dir)?));
        }
        Ok(())
    }

    /// Makes the folder ready for a run from step `start` to `total`: takes the
    /// lock, refuses a run whose first save would move `latest` back (or a `latest`
    /// that does not name a step folder), and removes what dead runs left. Every
    /// error is bad input, naming the folder and the fix. Idempotent.
    pub fn prepare(&mut self, start: u64, total: u64) -> Result<(), String> {
        self.lock()?;
        let Some(lock) = self.lock.clone() else {
            return Err(format!("{}: not locked", self.dir.display()));
        };
        if lock.prepared.load(Ordering::Acquire) {
            return Ok(());
        }
        if self.keep_last == Some(0) {
            return Err(
                "--keep-last must be at least 1 (the checkpoint `latest` names is always kept)"
                    .into(),
            );
        }
        let latest = read_latest(&self.dir)?;
        if let (Some((name, at)), Some(first)) = (&latest, self.first_due(start, total)) {
            if first < *at {
                return Err(format!(
                    "{}: `latest` names {name} (step {at}), and this run's first save would be step {first}, moving `latest` back; continue that run with --resume {}, save into another directory, or remove the step folders above step {first} and `latest`",
                    self.dir.display(),
                    self.dir.display(),
                ));
            }
        }
        sweep(&self.dir, latest.as_ref().map(|(n, _)| n.as_str()))?;
        lock.prepared.store(true, Ordering::Release);
        Ok(())
    }
}

/// A checkpoint the run saved, or a due save that failed.
#[derive(Clone, Debug, PartialEq)]
pub struct Saved {
    /// Optimizer steps it holds.
    pub step: u64,
    /// Its step folder (where it would have gone, if it failed).
    pub path: PathBuf,
    /// Bytes of its safetensors files.
    pub bytes: u64,
    /// Safetensors files.
    pub files: usize,
    /// Seconds from the first rank handing its state over to the folder
    /// published: placing every rank's pieces, writing and publishing.
    pub seconds: f64,
    /// Why the save failed (reported when it happened); `latest` still names the
    /// checkpoint it named before.
    pub error: Option<String>,
}

/// A value range of one weight that a rank owns at a save: the weight's values and
/// AdamW moments from local element `start` on.
pub(crate) struct Piece {
    pub key: Key,
    pub start: usize,
    pub w: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// What one rank hands over at a save.
pub(crate) struct RankSnapshot {
    pub tp: TpPos,
    pub ep: TpPos,
    pub pieces: Vec<Piece>,
}

/// One weight of the model: its key, the first op using it (whose role slices it,
/// as when it is initialised) and its full shape.
#[derive(Clone, Debug)]
pub(crate) struct WeightSite {
    pub key: Key,
    pub id: TensorId,
    pub seg: usize,
    pub op: usize,
    pub shape: Vec<usize>,
}

impl WeightSite {
    fn op<'g>(&self, graph: &'g Graph) -> &'g Op {
        &graph.segments[self.seg].ops[self.op]
    }
}

/// Every weight of the model, keyed as ranks key them: block weights by global layer
/// (block copies numbered in segment order), others with no layer.
pub(crate) fn model_weights(graph: &Graph) -> Result<Vec<WeightSite>, String> {
    let mut out: Vec<WeightSite> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut layer = 0u64;
    for (s, seg) in graph.segments.iter().enumerate() {
        let copies: Vec<u64> = if seg.kind == SegmentKind::Block {
            let l = (layer..layer + seg.repeat).collect();
            layer += seg.repeat;
            l
        } else {
            vec![NO_LAYER]
        };
        for l in copies {
            for (o, op) in seg.ops.iter().enumerate() {
                for &w in &op.inputs {
                    let t = graph.tensor(w);
                    if t.kind != TensorKind::Weight {
                        continue;
                    }
                    let key = (t.name.clone(), l);
                    if !seen.insert(key.clone()) {
                        continue;
                    }
                    let shape = fixed_shape(t).map_err(|e| e.to_string())?;
                    out.push(WeightSite {
                        key,
                        id: w,
                        seg: s,
                        op: o,
                        shape,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// `w/blocks.attn.qkv.w@3`.
pub fn tensor_name(kind: &str, key: &Key) -> String {
    if key.1 == NO_LAYER {
        format!("{kind}/{}", key.0)
    } else {
        format!("{kind}/{}@{}", key.0, key.1)
    }
}

/// FNV-1a 64 of a file's bytes, the checksum of version 1 manifests.
pub use crate::init::fnv1a64;

/// SHA-256 of `bytes`, 64 lowercase hex digits.
pub fn sha256_hex(bytes: &[u8]) -> String {
    meshplan_launch::auth::hex(&Sha256::digest(bytes))
}

/// `manifest.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u64,
    /// The model's name.
    pub model: String,
    /// Optimizer steps done; a resumed run starts at this global step.
    pub step: u64,
    /// Seed of the initial weights and the synthetic data.
    pub seed: u64,
    /// Optimizer and its hyper-parameters.
    pub optimizer: serde_json::Value,
    /// Where the next batch comes from.
    pub data: serde_json::Value,
    /// Sequence length and global batch of the run that saved.
    pub workload: serde_json::Value,
    /// The saving plan's strategy (informative: any plan can resume).
    pub strategy: String,
    /// The safetensors files.
    pub files: Vec<FileEntry>,
    /// Each tensor's file and shape.
    pub tensors: BTreeMap<String, TensorEntry>,
}

/// A file of a checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name in the step folder.
    pub name: String,
    /// Its size.
    pub bytes: u64,
    /// SHA-256 of its bytes, 64 hex digits (version 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// FNV-1a 64 of its bytes, 16 hex digits (version 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fnv1a64: Option<String>,
}

/// Where a tensor is.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TensorEntry {
    /// File name in the step folder.
    pub file: String,
    /// Full shape.
    pub shape: Vec<usize>,
    /// Always `F32`.
    pub dtype: String,
}

/// `manifest.sha256`: what the save wrote, so that a changed byte anywhere in the
/// folder is found, and a changed manifest field is named.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Sums {
    /// [`SUMS_FORMAT`].
    format: String,
    /// Every file of the step folder but this one, by name.
    files: BTreeMap<String, String>,
    /// Each top-level field of the manifest (`step`), and each field of its objects
    /// of at most [`FIELD_OBJECT_MAX`] fields (`optimizer.lr`), as compact JSON.
    manifest_fields: BTreeMap<String, String>,
    /// Of the two maps above ([`Sums::digest`]): damage to this file is named as
    /// such rather than blamed on the manifest.
    sha256: String,
}

/// Objects of more fields (the tensor table) get one digest for the whole.
const FIELD_OBJECT_MAX: usize = 32;

impl Sums {
    fn digest(&self) -> String {
        let body = serde_json::json!({
            "files": self.files,
            "manifest_fields": self.manifest_fields,
        });
        sha256_hex(body.to_string().as_bytes())
    }
}

fn field_digests(manifest: &serde_json::Value) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Some(top) = manifest.as_object() else {
        return out;
    };
    for (k, v) in top {
        out.insert(k.clone(), sha256_hex(v.to_string().as_bytes()));
        if let Some(o) = v.as_object().filter(|o| o.len() <= FIELD_OBJECT_MAX) {
            for (k2, v2) in o {
                out.insert(format!("{k}.{k2}"), sha256_hex(v2.to_string().as_bytes()));
            }
        }
    }
    out
}

mod files;
mod read;
mod save;
#[cfg(test)]
mod tests;
mod wire;

pub use files::parse_step_folder;
use files::*;
pub use read::Checkpoint;
pub(crate) use save::Offered;
pub(crate) use save::Saver;
use save::*;
pub(crate) use wire::{offer, recv_offer, send_pieces, take_offer};

fn io<'a>(path: &'a Path, what: &'a str) -> impl Fn(std::io::Error) -> String + 'a {
    move |e| format!("{}: {what}: {e}", path.display())
}

/// At most one line of text from a file, shortened, for a message: a `latest`
/// linked to a secret file must not print it.
fn quote(text: &str) -> String {
    const MAX: usize = 80;
    let line = text.lines().next().unwrap_or("");
    let mut out: String = line
        .chars()
        .take(MAX)
        .flat_map(char::escape_debug)
        .collect();
    if line.chars().count() > MAX || text.lines().nth(1).is_some() {
        out.push('…');
    }
    out
}

/// The shortest decimal of an f32 as an f64 (`0.9`, not `0.8999999761581421`); it
/// reads back to the same f32.
fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// `step-00000006`.
pub fn step_folder(step: u64) -> String {
    format!("step-{step:08}")
}

/// Writes and publishes the checkpoint of `step`, whose save began at `t0` (module
/// doc, "Saving safely").
/// An error leaves `latest` naming a complete folder (the previous one, or this
/// one when only the tidy-up failed, which is reported through `notify`).
fn write_checkpoint(
    meta: &RunMeta,
    opts: &SaveOptions,
    (step, t0): (u64, Instant),
    assembly: Assembly,
) -> Result<Saved, String> {
    let id = opts
        .lock
        .as_ref()
        .map(|l| l.id.clone())
        .ok_or_else(|| format!("{}: saving into a folder not locked", opts.dir.display()))?;
    let tensors = assembly.finish(&meta.sites)?;
    let dir = &opts.dir;
    let name = step_folder(step);
    let tmp = dir.join(format!(".tmp-{name}-{id}"));
    let (bytes, files) = match write_folder(meta, opts, step, &tensors, &tmp) {
        Ok(done) => done,
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    drop(tensors);
    let fin = dir.join(&name);
    let mut published = name.clone();
    if !exists(&fin) {
        rename(&tmp, &fin)
            .and_then(|()| sync_dir(dir))
            .inspect_err(|_| {
                let _ = fs::remove_dir_all(&tmp);
            })?;
        // On an error `fin` stays: complete but not named, and a later save of the
        // step replaces it.
        point_latest(dir, &name, &id).or_else(|e| switched_anyway(opts, step, &name, e))?;
    } else {
        // A re-save: the new folder is published under a second name first, so
        // that `latest` names a complete folder while `step-N` is replaced.
        let second = format!("{name}.{id}");
        let second_path = dir.join(&second);
        let unpublished = |e: String| {
            if !latest_is(dir, &second) {
                let _ = fs::remove_dir_all(&tmp);
                let _ = fs::remove_dir_all(&second_path);
            }
            e
        };
        rename(&tmp, &second_path)
            .and_then(|()| sync_dir(dir))
            .and_then(|()| point_latest(dir, &second, &id))
            .or_else(|e| switched_anyway(opts, step, &second, e))
            .map_err(unpublished)?;
        published = second.clone();
        match take_canonical_name(dir, &name, &second, &id) {
            Ok(()) => published = name.clone(),
            Err(e) => {
                if latest_is(dir, &name) {
                    published = name.clone();
                }
                notify(
                    opts,
                    &format!("checkpoint: step {step} is saved as {} (`latest` names it), but giving it the name {name} failed: {e}", dir.join(&published).display()),
                );
            }
        }
    }
    if let Err(e) = tidy(dir, step, &published, opts.keep_last, &id) {
        notify(
            opts,
            &format!(
                "checkpoint: step {step} is saved, but removing older step folders failed: {e}"
            ),
        );
    }
    Ok(Saved {
        step,
        path: dir.join(&published),
        bytes,
        files,
        seconds: t0.elapsed().as_secs_f64(),
        error: None,
    })
}

/// After an error pointing `latest` at `name`: whether it points there anyway (the
/// rename went through, a later fsync failed), which is reported, since the switch
/// may not survive a power cut.
fn switched_anyway(opts: &SaveOptions, step: u64, name: &str, e: String) -> Result<(), String> {
    if !latest_is(&opts.dir, name) {
        return Err(e);
    }
    notify(
        opts,
        &format!("checkpoint: step {step} is saved (`latest` names {name}), but making that durable failed: {e}"),
    );
    Ok(())
}

/// The tensors (in model order) split into files of at most `file_bytes` each
/// (a larger tensor alone in its file), as indices.
fn file_groups(tensors: &[Full], file_bytes: usize) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut size = 0usize;
    for (i, (_, _, v)) in tensors.iter().enumerate() {
        let b = 4 * v.len();
        match groups.last_mut() {
            Some(g) if size + b <= file_bytes => g.push(i),
            _ => {
                groups.push(vec![i]);
                size = 0;
            }
        }
        size += b;
    }
    groups
}

/// The manifest of step `step`'s folder: the run it continues, its files and
/// where each tensor lies.
fn manifest_of(
    meta: &RunMeta,
    step: u64,
    files: Vec<FileEntry>,
    entries: BTreeMap<String, TensorEntry>,
) -> Manifest {
    let (b1, b2, eps, wd) = ADAMW;
    Manifest {
        format: FORMAT.into(),
        version: VERSION,
        model: meta.model.clone(),
        step,
        seed: meta.seed,
        optimizer: serde_json::json!({
            "kind": "adamw", "lr": decimal(meta.lr), "beta1": decimal(b1),
            "beta2": decimal(b2), "eps": decimal(eps), "weight_decay": decimal(wd),
        }),
        data: {
            let mut d = meta.data.clone();
            d["seed"] = serde_json::json!(meta.seed);
            d["next_step"] = serde_json::json!(step);
            d
        },
        workload: meta.workload.clone(),
        strategy: meta.strategy.clone(),
        files,
        tensors: entries,
    }
}

/// Writes a complete step folder at `tmp` (files, manifest, checksums, each
/// synced, then the folder): its safetensors bytes and file count.
fn write_folder(
    meta: &RunMeta,
    opts: &SaveOptions,
    step: u64,
    tensors: &[Full],
    tmp: &Path,
) -> Result<(u64, usize), String> {
    let groups = file_groups(tensors, opts.file_bytes);
    mkdir(tmp)?;
    let n = groups.len();
    let mut files = Vec::new();
    let mut entries = BTreeMap::new();
    let mut sums = BTreeMap::new();
    let mut total = 0u64;
    for (f, group) in groups.iter().enumerate() {
        let name = format!("model-{:05}-of-{n:05}.safetensors", f + 1);
        let views = group.iter().map(|&i| {
            let (tname, shape, v) = &tensors[i];
            (tname.clone(), F32View { shape, values: v })
        });
        let bytes = safetensors::tensor::serialize(views, None)
            .map_err(|e| format!("{name}: serialize: {e}"))?;
        if opts.fail_after_files == Some((step, f)) {
            write_synced(&tmp.join(&name), &bytes[..bytes.len() / 2])?;
            return Err(format!(
                "injected failure while saving step {step}, half way through file {} of {n}",
                f + 1
            ));
        }
        write_synced(&tmp.join(&name), &bytes)?;
        for &i in group {
            let (tname, shape, _) = &tensors[i];
            entries.insert(
                tname.clone(),
                TensorEntry {
                    file: name.clone(),
                    shape: shape.clone(),
                    dtype: "F32".into(),
                },
            );
        }
        total += bytes.len() as u64;
        let digest = sha256_hex(&bytes);
        sums.insert(name.clone(), digest.clone());
        files.push(FileEntry {
            name,
            bytes: bytes.len() as u64,
            sha256: Some(digest),
            fnv1a64: None,
        });
    }
    if opts.fail_after_files == Some((step, n)) {
        return Err(format!(
            "injected failure while saving step {step}, after all {n} files, before the manifest"
        ));
    }
    let manifest = manifest_of(meta, step, files, entries);
    let text = serde_json::to_string_pretty(&manifest).map_err(|e| e.to_string())?;
    // The field digests are of the text as a reader parses it, so that reading and
    // writing agree however serde_json orders or prints numbers.
    let parsed: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    sums.insert(MANIFEST.to_string(), sha256_hex(text.as_bytes()));
    let mut sums = Sums {
        format: SUMS_FORMAT.into(),
        files: sums,
        manifest_fields: field_digests(&parsed),
        sha256: String::new(),
    };
    sums.sha256 = sums.digest();
    write_synced(&tmp.join(MANIFEST), text.as_bytes())?;
    let sums_text = serde_json::to_string_pretty(&sums).map_err(|e| e.to_string())?;
    write_synced(&tmp.join(SUMS), sums_text.as_bytes())?;
    sync_dir(tmp)?;
    Ok((total, n))
}

/// The second half of a re-save (`latest` names `second`, a complete copy):
/// replaces `step-N` by the new files and points `latest` back at it.
fn take_canonical_name(dir: &Path, name: &str, second: &str, id: &str) -> Result<(), String> {
    let (fin, new) = (dir.join(name), dir.join(second));
    let old = dir.join(format!(".tmp-old-{name}-{id}"));
    let link = dir.join(format!(".tmp-link-{name}-{id}"));
    let run = || -> Result<(), String> {
        rename(&fin, &old)?;
        mkdir(&link)?;
        for f in &list_names(&new)? {
            link_or_copy(&new.join(f), &link.join(f))?;
        }
        sync_dir(&link)?;
        rename(&link, &fin)?;
        sync_dir(dir)?;
        point_latest(dir, name, id)?;
        retire(dir, second, id)?;
        remove_tree(&old)
    };
    run().inspect_err(|_| {
        // Only this run's temporaries; `latest` names `second` or `step-N`.
        let _ = fs::remove_dir_all(&link);
        let _ = fs::remove_dir_all(&old);
    })
}

/// After a save of `step` published as `published`: removes the second names
/// `latest` no longer names (one it named when the run began, or a dead run's),
/// and with `keep_last` step folders older than the newest `keep_last`; never the
/// one `latest` names.
fn tidy(
    dir: &Path,
    step: u64,
    published: &str,
    keep_last: Option<u64>,
    id: &str,
) -> Result<(), String> {
    let mut folders: Vec<(u64, bool, String)> = list_names(dir)?
        .into_iter()
        .filter_map(|n| parse_step_folder(&n).map(|(s, second)| (s, second, n)))
        .filter(|(_, _, n)| n != published)
        .collect();
    folders.sort();
    for (_, second, n) in &folders {
        if *second {
            retire(dir, n, id)?;
        }
    }
    let Some(keep) = keep_last else {
        return Ok(());
    };
    // Older complete folders, newest first; the one published counts as one kept.
    let older: Vec<&String> = folders
        .iter()
        .rev()
        .filter(|(s, second, _)| *s < step && !*second)
        .map(|(_, _, n)| n)
        .collect();
    for n in older.iter().skip(keep.saturating_sub(1) as usize) {
        retire(dir, n, id)?;
    }
    Ok(())
}
