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
//! Ranks are threads of one process, so at a save step each rank hands over the
//! values it owns (its slices; under ZeRO only its optimizer partition, the part its
//! own AdamW step just wrote) and the last rank to arrive starts a writer thread.
//! Where a local value sits in the full tensor is found by slicing the element
//! indices with `local_weight`; every element must be covered, or the save fails.

use crate::shard::{local_weight, TpPos};
use crate::train::{fixed_shape, Key, TrainOptions};
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

const NO_LAYER: u64 = u64::MAX;

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
    /// Seconds to assemble, write and publish it.
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
                    let shape = fixed_shape(t).map_err(|e| format!("{e:?}"))?;
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
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// SHA-256 of `bytes`, 64 lowercase hex digits.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
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

/// What the writer needs of the run, owned so that it outlives the rank threads.
struct RunMeta {
    graph: Graph,
    sites: Vec<WeightSite>,
    model: String,
    strategy: String,
    workload: serde_json::Value,
    seed: u64,
    lr: f32,
    world: usize,
    data: serde_json::Value,
}

type Writer = JoinHandle<Result<Vec<Saved>, String>>;

/// Collects the ranks' snapshots at each save step and writes them in order on a
/// writer thread, so ranks go on training while a checkpoint is written.
pub(crate) struct Saver {
    opts: SaveOptions,
    meta: Arc<RunMeta>,
    pending: Mutex<BTreeMap<u64, Vec<RankSnapshot>>>,
    writer: Mutex<Option<Writer>>,
}

impl Saver {
    /// Prepares the folder ([`SaveOptions::prepare`]) unless the caller did.
    pub fn new(plan: &Plan, opts: &TrainOptions, save: &SaveOptions) -> Result<Saver, String> {
        let workload = match &plan.workload {
            Workload::Train {
                seq_len,
                global_batch,
                ..
            } => serde_json::json!({"seq_len": seq_len, "global_batch": global_batch}),
            _ => serde_json::Value::Null,
        };
        let mut save = save.clone();
        let start = opts.resume.as_ref().map_or(0, |c| c.step());
        save.prepare(start, opts.steps)?;
        Ok(Saver {
            opts: save,
            meta: Arc::new(RunMeta {
                graph: plan.graph.clone(),
                sites: model_weights(&plan.graph)?,
                model: plan.model.name.clone(),
                strategy: plan.strategy.to_string(),
                workload,
                seed: opts.seed,
                lr: opts.lr,
                world: plan.ranks.len(),
                data: opts.data.describe(),
            }),
            pending: Mutex::new(BTreeMap::new()),
            writer: Mutex::new(None),
        })
    }

    pub fn due(&self, done: u64, total: u64) -> bool {
        self.opts.due(done, total)
    }

    /// Hands over a rank's state after `step` steps; the last rank starts the write.
    pub fn deposit(&self, step: u64, snap: RankSnapshot) -> Result<(), String> {
        let mut pending = self
            .pending
            .lock()
            .map_err(|_| "checkpoint state poisoned")?;
        let all = pending.entry(step).or_default();
        all.push(snap);
        if all.len() < self.meta.world {
            return Ok(());
        }
        let snaps = pending.remove(&step).unwrap_or_default();
        drop(pending);
        let mut writer = self
            .writer
            .lock()
            .map_err(|_| "checkpoint writer poisoned")?;
        let prev = writer.take();
        let (meta, opts) = (self.meta.clone(), self.opts.clone());
        *writer = Some(std::thread::spawn(move || {
            // Saves publish in step order: `latest` never goes back. A failed save
            // does not stop the later ones: each is a retry.
            let mut done = match prev {
                Some(p) => p.join().map_err(|_| "checkpoint writer panicked")??,
                None => Vec::new(),
            };
            let t0 = Instant::now();
            let saved = write_checkpoint(&meta, &opts, step, snaps).unwrap_or_else(|e| {
                let latest = match read_latest(&opts.dir) {
                    Ok(Some((name, _))) => format!("{}", opts.dir.join(name).display()),
                    _ => "none".into(),
                };
                notify(
                    &opts,
                    &format!(
                        "checkpoint: saving step {step} failed: {e}; training goes on, the next due save tries again, and the run will end with an error (last good checkpoint: {latest})"
                    ),
                );
                Saved {
                    step,
                    path: opts.dir.join(step_folder(step)),
                    bytes: 0,
                    files: 0,
                    seconds: t0.elapsed().as_secs_f64(),
                    error: Some(e),
                }
            });
            done.push(saved);
            Ok(done)
        }));
        Ok(())
    }

    /// Waits for every write; the checkpoints written and the saves that failed,
    /// in step order.
    pub fn finish(self) -> Result<Vec<Saved>, String> {
        let writer = self
            .writer
            .into_inner()
            .map_err(|_| "checkpoint writer poisoned")?;
        match writer {
            Some(w) => w.join().map_err(|_| "checkpoint writer panicked")?,
            None => Ok(Vec::new()),
        }
    }
}

fn notify(opts: &SaveOptions, message: &str) {
    match &opts.notify {
        Some(n) => (n.0)(message),
        None => eprintln!("{message}"),
    }
}

/// A full tensor: name, shape, values.
type Full = (String, Vec<usize>, Vec<f32>);

/// Full tensors from the ranks' pieces, in the order of `sites`: (name, shape,
/// values), weights then Adam moments of each weight.
fn assemble(
    graph: &Graph,
    sites: &[WeightSite],
    snaps: &[RankSnapshot],
) -> Result<Vec<Full>, String> {
    let by_key: HashMap<&Key, usize> = sites.iter().enumerate().map(|(i, s)| (&s.key, i)).collect();
    let mut full: Vec<[Vec<f32>; 3]> = sites
        .iter()
        .map(|s| {
            let n: usize = s.shape.iter().product();
            [vec![0.0; n], vec![0.0; n], vec![0.0; n]]
        })
        .collect();
    let mut covered: Vec<Vec<bool>> = sites
        .iter()
        .map(|s| vec![false; s.shape.iter().product()])
        .collect();
    let mut index_cache: HashMap<(usize, TpPos, TpPos), Vec<usize>> = HashMap::new();
    for snap in snaps {
        for p in &snap.pieces {
            let &i = by_key
                .get(&p.key)
                .ok_or_else(|| format!("`{}` is not a weight of the model", p.key.0))?;
            let site = &sites[i];
            let idx = index_cache.entry((i, snap.tp, snap.ep)).or_insert_with(|| {
                let all: Vec<usize> = (0..covered[i].len()).collect();
                let op = site.op(graph);
                local_weight(
                    graph,
                    op,
                    op.role,
                    site.id,
                    &all,
                    &site.shape,
                    snap.tp,
                    snap.ep,
                )
            });
            let end = p.start + p.w.len();
            if end > idx.len() || p.m.len() != p.w.len() || p.v.len() != p.w.len() {
                return Err(format!(
                    "`{}`: a piece {}..{end} outside the local size {}",
                    tensor_name("w", &p.key),
                    p.start,
                    idx.len()
                ));
            }
            for (j, &at) in idx[p.start..end].iter().enumerate() {
                full[i][0][at] = p.w[j];
                full[i][1][at] = p.m[j];
                full[i][2][at] = p.v[j];
                covered[i][at] = true;
            }
        }
    }
    let mut out = Vec::with_capacity(3 * sites.len());
    for ((site, [w, m, v]), cov) in sites.iter().zip(full).zip(&covered) {
        if let Some(at) = cov.iter().position(|c| !c) {
            return Err(format!(
                "no rank owns element {at} of `{}`; the checkpoint would be incomplete",
                tensor_name("w", &site.key)
            ));
        }
        out.push((tensor_name("w", &site.key), site.shape.clone(), w));
        out.push((tensor_name("adam_m", &site.key), site.shape.clone(), m));
        out.push((tensor_name("adam_v", &site.key), site.shape.clone(), v));
    }
    Ok(out)
}

/// An f32 tensor as safetensors writes it.
struct F32View<'a> {
    shape: &'a [usize],
    values: &'a [f32],
}

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.values.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
    fn data_len(&self) -> usize {
        4 * self.values.len()
    }
}

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

// === The filesystem operations of saving, and the testing hooks ===

/// Filesystem operations of saving so far in this process (counted only while a
/// testing hook is set).
static FS_OPS: AtomicU64 = AtomicU64::new(0);

fn hook(var: &str, cell: &'static OnceLock<Option<u64>>) -> Option<u64> {
    *cell.get_or_init(|| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .filter(|&n| n > 0)
    })
}

/// One filesystem operation of saving: at the crash point `partial` runs (a write
/// cut half way) and the process dies as under `kill -9`; at the failure point the
/// operation fails.
fn fs_op(what: &str, path: &Path, partial: impl FnOnce()) -> Result<(), String> {
    static CRASH: OnceLock<Option<u64>> = OnceLock::new();
    static FAIL: OnceLock<Option<u64>> = OnceLock::new();
    let (crash, fail) = (hook(CRASH_AT_VAR, &CRASH), hook(FAIL_AT_VAR, &FAIL));
    if crash.is_none() && fail.is_none() {
        return Ok(());
    }
    let n = FS_OPS.fetch_add(1, Ordering::SeqCst) + 1;
    if crash == Some(n) {
        partial();
        eprintln!("{CRASH_AT_VAR}={n}: killed at {what} {}", path.display());
        die();
    }
    if fail == Some(n) {
        return Err(format!(
            "{}: {what}: injected failure ({FAIL_AT_VAR}={n}), as a full disk would fail",
            path.display()
        ));
    }
    Ok(())
}

/// Dies without unwinding, flushing or closing anything, as a killed process does.
fn die() -> ! {
    #[cfg(unix)]
    {
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
    std::process::abort()
}

fn mkdir(path: &Path) -> Result<(), String> {
    fs_op("mkdir", path, || {})?;
    fs::create_dir(path).map_err(io(path, "create folder"))
}

fn rename(from: &Path, to: &Path) -> Result<(), String> {
    fs_op("rename", to, || {})?;
    fs::rename(from, to).map_err(|e| format!("{}: rename to {}: {e}", from.display(), to.display()))
}

/// Writes `bytes` to a new `path` and flushes them to the disk.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), String> {
    fs_op("create", path, || {})?;
    let mut f = File::create(path).map_err(io(path, "create"))?;
    fs_op("write", path, || {
        let _ = (&f).write_all(&bytes[..bytes.len() / 2]);
    })?;
    f.write_all(bytes).map_err(io(path, "write"))?;
    fs_op("fsync", path, || {})?;
    f.sync_all().map_err(io(path, "fsync"))
}

/// Makes a folder's entries (new names, renames) durable.
fn sync_dir(path: &Path) -> Result<(), String> {
    fs_op("fsync", path, || {})?;
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(io(path, "fsync folder"))
}

/// A second name for an immutable checkpoint file, or a synced copy where the
/// filesystem has no hard links.
fn link_or_copy(from: &Path, to: &Path) -> Result<(), String> {
    fs_op("link", to, || {})?;
    if fs::hard_link(from, to).is_ok() {
        return Ok(());
    }
    fs::copy(from, to).map_err(io(to, "copy"))?;
    File::open(to)
        .and_then(|f| f.sync_all())
        .map_err(io(to, "fsync"))
}

fn remove_tree(path: &Path) -> Result<(), String> {
    fs_op("remove", path, || {})?;
    let meta = fs::symlink_metadata(path).map_err(io(path, "remove"))?;
    if meta.is_dir() {
        fs::remove_dir_all(path).map_err(io(path, "remove"))
    } else {
        fs::remove_file(path).map_err(io(path, "remove"))
    }
}

/// Removes a step folder in two steps, so that a crash half way through leaves a
/// `.tmp-` name, never a step folder with files missing.
fn retire(dir: &Path, name: &str, id: &str) -> Result<(), String> {
    let gone = dir.join(format!(".tmp-rm-{name}-{id}"));
    rename(&dir.join(name), &gone)?;
    remove_tree(&gone)
}

fn exists(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
}

/// An id unique to this run, in the names of its temporaries.
fn run_id() -> String {
    let nonce = getrandom::u64().unwrap_or_else(|_| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    format!("{}-{:08x}", std::process::id(), nonce as u32)
}

/// The exclusive lock of a checkpoint folder, held as long as the file is open;
/// the operating system releases it when the process dies, however it dies.
#[derive(Debug)]
struct DirLock {
    _file: File,
    /// This run's id ([`run_id`]).
    id: String,
    /// Whether [`SaveOptions::prepare`] has checked and swept the folder.
    prepared: std::sync::atomic::AtomicBool,
}

impl DirLock {
    fn acquire(dir: &Path) -> Result<DirLock, String> {
        fs_op("mkdir", dir, || {})?;
        fs::create_dir_all(dir).map_err(|e| {
            format!(
                "{}: cannot create the checkpoint folder: {e}; give a --save folder you can write",
                dir.display()
            )
        })?;
        let path = dir.join(LOCK);
        if let Ok(meta) = fs::symlink_metadata(&path) {
            if !meta.is_file() {
                return Err(format!(
                    "{}: not a regular file; meshplan locks the checkpoint folder with it: remove it",
                    path.display()
                ));
            }
        }
        fs_op("create", &path, || {})?;
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| {
                format!(
                    "{}: cannot create the lock file: {e}; give a --save folder you can write",
                    path.display()
                )
            })?;
        match file.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                return Err(format!(
                    "{}: another run is saving checkpoints into this folder (it holds {}); wait for it to end, or give another --save folder",
                    dir.display(),
                    path.display()
                ))
            }
            Err(fs::TryLockError::Error(e)) => {
                return Err(format!(
                    "{}: cannot lock: {e}; save into a folder on a filesystem with file locks",
                    path.display()
                ))
            }
        }
        Ok(DirLock {
            _file: file,
            id: run_id(),
            prepared: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

/// The step of a step folder name (`step-00000006`), and whether it is a re-save's
/// temporary second name (`step-00000006.ID`).
pub fn parse_step_folder(name: &str) -> Option<(u64, bool)> {
    let rest = name.strip_prefix("step-")?;
    let (digits, id) = match rest.split_once('.') {
        Some((d, id)) => (d, Some(id)),
        None => (rest, None),
    };
    if digits.len() < 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if let Some(id) = id {
        let ok = |b: u8| b.is_ascii_alphanumeric() || b == b'-';
        if id.is_empty() || id.len() > 40 || !id.bytes().all(ok) {
            return None;
        }
    }
    Some((digits.parse().ok()?, id.is_some()))
}

/// The step folder `DIR/latest` names and its step, `None` without a `latest`. It
/// must hold one step folder name, of a folder that exists.
fn read_latest(dir: &Path) -> Result<Option<(String, u64)>, String> {
    let path = dir.join("latest");
    if !exists(&path) {
        return Ok(None);
    }
    let bytes =
        read_bounded(&path, LATEST_LIMIT).map_err(|e| format!("{}: {e}", path.display()))?;
    let text = String::from_utf8_lossy(&bytes);
    let fix =
        "write the name of one of its step folders (such as step-00000003) into it, or remove it";
    let lines = text.lines().count();
    if lines != 1 {
        return Err(format!(
            "{}: holds {lines} lines, not the name of a step folder; {fix}",
            path.display()
        ));
    }
    let name = text.trim();
    let Some((step, _)) = parse_step_folder(name) else {
        return Err(format!(
            "{}: `{}` is not a step folder name; {fix}",
            path.display(),
            quote(name)
        ));
    };
    if !dir.join(name).is_dir() {
        return Err(format!(
            "{}: names {name}, which is not a folder of {} (an interrupted save of a meshplan older than checkpoint version 2 leaves this, with the data in a `.tmp-old-{name}-*` folder: rename that folder to {name}); or {fix}",
            path.display(),
            dir.display()
        ));
    }
    Ok(Some((name.to_string(), step)))
}

/// Removes what dead runs left in a locked folder: temporaries, and re-save
/// folders `latest` does not name. The lock is what makes this safe: no live run
/// writes here.
fn sweep(dir: &Path, latest: Option<&str>) -> Result<(), String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map_err(io(dir, "list"))?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    for name in names {
        let resave = matches!(parse_step_folder(&name), Some((_, true)));
        if name.starts_with(".tmp-") || (resave && Some(name.as_str()) != latest) {
            let path = dir.join(&name);
            remove_tree(&path).map_err(|e| {
                format!("removing what an interrupted save left: {e}; remove it by hand")
            })?;
        }
    }
    Ok(())
}

/// Points `DIR/latest` at `name` atomically: a reader sees the old name or the new.
fn point_latest(dir: &Path, name: &str, id: &str) -> Result<(), String> {
    let tmp = dir.join(format!(".tmp-latest-{id}"));
    write_synced(&tmp, format!("{name}\n").as_bytes())?;
    rename(&tmp, &dir.join("latest"))?;
    sync_dir(dir)
}

/// Whether `latest` names `name` now (after an error half way through pointing it).
fn latest_is(dir: &Path, name: &str) -> bool {
    matches!(read_latest(dir), Ok(Some((n, _))) if n == name)
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

/// Writes and publishes the checkpoint of `step` (module doc, "Saving safely").
/// An error leaves `latest` naming a complete folder (the previous one, or this
/// one when only the tidy-up failed, which is reported through `notify`).
fn write_checkpoint(
    meta: &RunMeta,
    opts: &SaveOptions,
    step: u64,
    snaps: Vec<RankSnapshot>,
) -> Result<Saved, String> {
    let t0 = Instant::now();
    let id = opts
        .lock
        .as_ref()
        .map(|l| l.id.clone())
        .ok_or_else(|| format!("{}: saving into a folder not locked", opts.dir.display()))?;
    let tensors = assemble(&meta.graph, &meta.sites, &snaps)?;
    drop(snaps);
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

/// Writes a complete step folder at `tmp` (files, manifest, checksums, each
/// synced, then the folder): its safetensors bytes and file count.
fn write_folder(
    meta: &RunMeta,
    opts: &SaveOptions,
    step: u64,
    tensors: &[Full],
    tmp: &Path,
) -> Result<(u64, usize), String> {
    // Files of bounded size, tensors in model order.
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut size = 0usize;
    for (i, (_, _, v)) in tensors.iter().enumerate() {
        let b = 4 * v.len();
        match groups.last_mut() {
            Some(g) if size + b <= opts.file_bytes => g.push(i),
            _ => {
                groups.push(vec![i]);
                size = 0;
            }
        }
        size += b;
    }
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
    let (b1, b2, eps, wd) = ADAMW;
    let manifest = Manifest {
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
    };
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
        let mut files: Vec<String> = fs::read_dir(&new)
            .map_err(io(&new, "list"))?
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        files.sort();
        for f in &files {
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
    let mut folders: Vec<(u64, bool, String)> = fs::read_dir(dir)
        .map_err(io(dir, "list"))?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
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

/// Where a tensor's bytes are: file index, byte range in the file, shape.
type Located = (usize, (usize, usize), Vec<usize>);

/// An opened checkpoint: manifest checked, files mapped and their checksums verified.
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
    files: Vec<Mmap>,
    tensors: HashMap<String, Located>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Checkpoint({}, step {})",
            self.dir.display(),
            self.manifest.step
        )
    }
}

impl Checkpoint {
    /// Opens a step folder, or the one `latest` names in a checkpoint folder, and
    /// verifies it: `manifest.sha256` against itself, the manifest against it (an
    /// edited field is named), every data file against both. Every error names the
    /// file and what is wrong, quoting at most a line of any file.
    pub fn open(path: &Path) -> Result<Checkpoint, String> {
        let dir = if exists(&path.join(MANIFEST)) {
            path.to_path_buf()
        } else {
            match read_latest(path)? {
                Some((name, _)) => path.join(name),
                None if path.is_dir() => {
                    return Err(format!(
                        "{}: no checkpoint here (neither manifest.json nor latest)",
                        path.display()
                    ))
                }
                None => return Err(format!("{}: no such checkpoint folder", path.display())),
            }
        };
        let mpath = dir.join(MANIFEST);
        let text =
            read_bounded(&mpath, TEXT_LIMIT).map_err(|e| format!("{}: {e}", mpath.display()))?;
        let spath = dir.join(SUMS);
        let sums = if exists(&spath) {
            let s = read_sums(&spath)?;
            check_manifest_bytes(&mpath, &text, &s)?;
            Some(s)
        } else {
            None
        };
        let manifest: Manifest = serde_json::from_slice(&text)
            .map_err(|e| format!("{}: not a checkpoint manifest: {e}", mpath.display()))?;
        if manifest.format != FORMAT || !(1..=VERSION).contains(&manifest.version) {
            return Err(format!(
                "{}: format {} version {}, expected {FORMAT} version 1 to {VERSION}",
                mpath.display(),
                quote(&manifest.format),
                manifest.version
            ));
        }
        if manifest.version >= 2 && sums.is_none() {
            return Err(format!(
                "{}: missing; a version {} checkpoint lists the SHA-256 of its files there (the step folder is incomplete or was copied in part): copy the whole folder, or resume from another checkpoint",
                spath.display(),
                manifest.version
            ));
        }
        if let Some(s) = &sums {
            let named = |n: &String| n == MANIFEST || manifest.files.iter().any(|f| f.name == *n);
            if let Some(extra) = s.files.keys().find(|n| !named(n)) {
                return Err(format!(
                    "{}: lists `{}`, which {} does not name; restore the step folder from a copy",
                    spath.display(),
                    quote(extra),
                    mpath.display()
                ));
            }
        }
        let mut files = Vec::new();
        let mut tensors = HashMap::new();
        for (fi, entry) in manifest.files.iter().enumerate() {
            if entry.name.contains(['/', '\\']) || entry.name.starts_with('.') {
                return Err(format!(
                    "{}: file name `{}` is outside the folder",
                    mpath.display(),
                    quote(&entry.name)
                ));
            }
            let fpath = dir.join(&entry.name);
            let map = crate::mapped::map_readonly(&fpath)
                .map_err(|e| format!("{}: {e}", fpath.display()))?;
            if map.len() as u64 != entry.bytes {
                return Err(format!(
                    "{}: {} bytes, the manifest says {} (truncated or damaged)",
                    fpath.display(),
                    map.len(),
                    entry.bytes
                ));
            }
            check_file_sum(&fpath, &map, entry, sums.as_ref(), &spath)?;
            let (header, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| format!("{}: not a safetensors file: {e}", fpath.display()))?;
            for (name, info) in meta.tensors() {
                if info.dtype != Dtype::F32 {
                    return Err(format!(
                        "{}: `{}` is {:?}, expected F32",
                        fpath.display(),
                        quote(&name),
                        info.dtype
                    ));
                }
                let (a, b) = info.data_offsets;
                let base = 8 + header;
                tensors.insert(name, (fi, (base + a, base + b), info.shape.clone()));
            }
            files.push(map);
        }
        for (name, t) in &manifest.tensors {
            match tensors.get(name) {
                Some((fi, _, shape)) if manifest.files[*fi].name == t.file && *shape == t.shape => {
                }
                _ => {
                    return Err(format!(
                        "{}: `{}` (shape {:?}) is not in {}",
                        mpath.display(),
                        quote(name),
                        t.shape,
                        quote(&t.file)
                    ))
                }
            }
        }
        Ok(Checkpoint {
            dir,
            manifest,
            files,
            tensors,
        })
    }

    /// The step folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Optimizer steps done.
    pub fn step(&self) -> u64 {
        self.manifest.step
    }

    /// Checks that the checkpoint is of `graph`'s model: the same name, exactly its
    /// weights (and their moments), with the same shapes.
    pub fn check_model(&self, graph: &Graph) -> Result<(), String> {
        if self.manifest.model != graph.name {
            return Err(format!(
                "{}: field `model` is `{}`, but the plan's model is `{}`; resume with a plan of `{}`, or from a checkpoint of `{}`",
                self.dir.join(MANIFEST).display(),
                quote(&self.manifest.model),
                graph.name,
                quote(&self.manifest.model),
                graph.name
            ));
        }
        let sites = model_weights(graph)?;
        let mut want = std::collections::HashSet::new();
        for s in &sites {
            for kind in ["w", "adam_m", "adam_v"] {
                let name = tensor_name(kind, &s.key);
                match self.tensors.get(&name) {
                    None => {
                        return Err(format!(
                        "{}: the checkpoint (model `{}`) has no `{name}`, a tensor of model `{}`",
                        self.dir.display(),
                        self.manifest.model,
                        graph.name
                    ))
                    }
                    Some((fi, _, shape)) if *shape != s.shape => {
                        return Err(format!(
                            "{}: `{name}` has shape {shape:?}; model `{}` needs {:?}",
                            self.dir.join(&self.manifest.files[*fi].name).display(),
                            graph.name,
                            s.shape
                        ))
                    }
                    _ => {}
                }
                want.insert(name);
            }
        }
        let mut extra: Vec<&String> = self.tensors.keys().filter(|n| !want.contains(*n)).collect();
        extra.sort();
        if let Some(name) = extra.first() {
            return Err(format!(
                "{}: `{name}` is not a tensor of model `{}` (the checkpoint is of model `{}`)",
                self.dir.display(),
                graph.name,
                self.manifest.model
            ));
        }
        Ok(())
    }

    /// A full tensor's values.
    pub fn values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, String> {
        let (fi, (a, b), have) = self
            .tensors
            .get(name)
            .ok_or_else(|| format!("{}: no tensor `{name}`", self.dir.display()))?;
        if have != shape {
            return Err(format!(
                "{}: `{name}` has shape {have:?}, expected {shape:?}",
                self.dir.display()
            ));
        }
        let bytes = self.files[*fi]
            .get(*a..*b)
            .ok_or_else(|| format!("{}: `{name}` lies outside its file", self.dir.display()))?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

fn read_sums(path: &Path) -> Result<Sums, String> {
    let fix = "restore the step folder from a copy, or resume from another checkpoint";
    let text = read_bounded(path, TEXT_LIMIT).map_err(|e| format!("{}: {e}", path.display()))?;
    let sums: Sums = serde_json::from_slice(&text).map_err(|e| {
        format!(
            "{}: not a checkpoint's checksum file: {e}; {fix}",
            path.display()
        )
    })?;
    if sums.format != SUMS_FORMAT {
        return Err(format!(
            "{}: format `{}`, expected {SUMS_FORMAT}; {fix}",
            path.display(),
            quote(&sums.format)
        ));
    }
    if sums.sha256 != sums.digest() {
        return Err(format!(
            "{}: damaged (its field `sha256` is not the SHA-256 of its content); {fix}",
            path.display()
        ));
    }
    Ok(sums)
}

/// The manifest's bytes against `manifest.sha256`; on a difference, the fields that
/// changed.
fn check_manifest_bytes(mpath: &Path, bytes: &[u8], sums: &Sums) -> Result<(), String> {
    let fix = "a checkpoint's manifest must not be edited: restore the step folder from a copy, or resume from another checkpoint";
    let Some(want) = sums.files.get(MANIFEST) else {
        return Err(format!(
            "{}: has no SHA-256 of {MANIFEST}; {fix}",
            mpath.with_file_name(SUMS).display()
        ));
    };
    if sha256_hex(bytes) == *want {
        return Ok(());
    }
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
        format!(
            "{}: not a checkpoint manifest ({e}), and its SHA-256 differs from the one {SUMS} recorded at the save: the file is damaged; {fix}",
            mpath.display()
        )
    })?;
    let now = field_digests(&value);
    let mut keys: Vec<&String> = now.keys().chain(sums.manifest_fields.keys()).collect();
    keys.sort();
    keys.dedup();
    let changed: Vec<&String> = keys
        .iter()
        .copied()
        .filter(|k| now.get(*k) != sums.manifest_fields.get(*k))
        .collect();
    // The most precise names: `optimizer.lr` rather than `optimizer` as well.
    let precise: Vec<String> = changed
        .iter()
        .filter(|k| !changed.iter().any(|c| c.starts_with(&format!("{k}."))))
        .map(|k| format!("`{}`", quote(k)))
        .collect();
    if precise.is_empty() {
        return Err(format!(
            "{}: its SHA-256 differs from the one {SUMS} recorded at the save, though every field reads the same (its spacing or order changed); {fix}",
            mpath.display()
        ));
    }
    let shown = precise.len().min(5);
    Err(format!(
        "{}: field{} {}{} changed after the save (the SHA-256 differs from the one {SUMS} recorded); {fix}",
        mpath.display(),
        if precise.len() > 1 { "s" } else { "" },
        precise[..shown].join(", "),
        if precise.len() > shown { ", ..." } else { "" }
    ))
}

/// A data file's bytes against the manifest (SHA-256, or FNV-1a 64 in version 1)
/// and `manifest.sha256`.
fn check_file_sum(
    fpath: &Path,
    bytes: &[u8],
    entry: &FileEntry,
    sums: Option<&Sums>,
    spath: &Path,
) -> Result<(), String> {
    let damaged = |sum: &str, want: &str| {
        format!(
            "{}: checksum {sum} differs from the manifest's {} (the file is damaged); restore the step folder from a copy, or resume from another checkpoint",
            fpath.display(),
            quote(want)
        )
    };
    match (&entry.sha256, &entry.fnv1a64) {
        (Some(want), _) => {
            let sum = sha256_hex(bytes);
            if sum != *want {
                return Err(damaged(&sum, want));
            }
            if let Some(s) = sums {
                if s.files.get(&entry.name) != Some(want) {
                    return Err(format!(
                        "{}: its SHA-256 in {} differs from the manifest's; restore the step folder from a copy",
                        fpath.display(),
                        spath.display()
                    ));
                }
            }
            Ok(())
        }
        (None, Some(want)) if sums.is_none() => {
            let sum = format!("{:016x}", fnv1a64(bytes));
            if sum != *want {
                return Err(damaged(&sum, want));
            }
            Ok(())
        }
        _ => Err(format!(
            "{}: the manifest gives no checksum of `{}`; restore the step folder from a copy",
            fpath.with_file_name(MANIFEST).display(),
            quote(&entry.name)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_every_k_and_at_the_end() {
        let s = SaveOptions::new("x", 3);
        let due: Vec<u64> = (1..=7).filter(|&d| s.due(d, 7)).collect();
        assert_eq!(due, vec![3, 6, 7]);
        let end = SaveOptions::new("x", 0);
        assert_eq!((1..=7).filter(|&d| end.due(d, 7)).count(), 1);
    }

    #[test]
    fn first_due_is_the_first_step_due_after_the_start() {
        for every in [0, 1, 2, 3, 5] {
            let s = SaveOptions::new("x", every);
            for total in 1..9 {
                for start in 0..10 {
                    let want = (start + 1..=total).find(|&d| s.due(d, total));
                    assert_eq!(
                        s.first_due(start, total),
                        want,
                        "every {every} start {start} total {total}"
                    );
                }
            }
        }
    }

    #[test]
    fn checksums_are_fnv1a_and_sha256() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn step_folder_names_parse_and_others_do_not() {
        assert_eq!(parse_step_folder("step-00000006"), Some((6, false)));
        assert_eq!(parse_step_folder("step-00000006.12-ab"), Some((6, true)));
        assert_eq!(
            parse_step_folder(&step_folder(123_456_789_012)),
            Some((123_456_789_012, false))
        );
        for bad in [
            "step-6",
            "step-0000000x",
            "step-00000006.",
            "step-00000006./x",
            ".tmp-step-00000006",
            "../step-00000006",
            "root:x:0:0",
        ] {
            assert_eq!(parse_step_folder(bad), None, "{bad}");
        }
    }

    #[test]
    fn quote_keeps_one_shortened_line() {
        assert_eq!(quote("step-1"), "step-1");
        assert_eq!(quote("root:x:0:0\nsecret\n"), "root:x:0:0…");
        assert_eq!(quote(&"a".repeat(200)).chars().count(), 81);
        assert_eq!(quote("a\u{1b}b"), "a\\u{1b}b");
    }

    #[test]
    fn an_edited_manifest_names_the_field() {
        let text = r#"{"step": 6, "seed": 1, "optimizer": {"lr": 0.001, "kind": "adamw"}}"#;
        let value: serde_json::Value = serde_json::from_str(text).unwrap();
        let mut sums = Sums {
            format: SUMS_FORMAT.into(),
            files: BTreeMap::from([(MANIFEST.to_string(), sha256_hex(text.as_bytes()))]),
            manifest_fields: field_digests(&value),
            sha256: String::new(),
        };
        sums.sha256 = sums.digest();
        let m = Path::new("ck/manifest.json");
        check_manifest_bytes(m, text.as_bytes(), &sums).unwrap();
        let lr = text.replace("0.001", "0.1");
        let e = check_manifest_bytes(m, lr.as_bytes(), &sums).unwrap_err();
        assert!(e.contains("field `optimizer.lr` changed"), "{e}");
        let two = text.replace("6", "0").replace("\"seed\": 1", "\"seed\": 2");
        let e = check_manifest_bytes(m, two.as_bytes(), &sums).unwrap_err();
        assert!(e.contains("fields `seed`, `step` changed"), "{e}");
        let spaced = text.replace(", ", ",");
        let e = check_manifest_bytes(m, spaced.as_bytes(), &sums).unwrap_err();
        assert!(e.contains("every field reads the same"), "{e}");
        let e = check_manifest_bytes(m, b"{", &sums).unwrap_err();
        assert!(e.contains("not a checkpoint manifest"), "{e}");
    }
}

#[cfg(test)]
mod round_trip {
    use super::*;
    use meshplan_ir::{load_model, model_graph, WorkloadOverrides};

    fn graph(name: &str) -> Graph {
        let path = format!("{}/../models/{name}.yaml", env!("CARGO_MANIFEST_DIR"));
        let spec = load_model(Path::new(&path), &WorkloadOverrides::default())
            .unwrap_or_else(|e| panic!("{e}"));
        model_graph(&spec).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Every rank's slices of distinct values, each handed over as two pieces (as a
    /// ZeRO partition boundary would cut them).
    fn snapshots(graph: &Graph, sites: &[WeightSite], tp: usize, ep: usize) -> Vec<RankSnapshot> {
        let mut out = Vec::new();
        for e in 0..ep {
            for t in 0..tp {
                let (tp, ep) = (TpPos { rank: t, size: tp }, TpPos { rank: e, size: ep });
                let mut pieces = Vec::new();
                for s in sites {
                    let n: usize = s.shape.iter().product();
                    let full: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
                    let op = s.op(graph);
                    let local = local_weight(graph, op, op.role, s.id, &full, &s.shape, tp, ep);
                    let half = local.len() / 2;
                    for (a, b) in [(0, half), (half, local.len())] {
                        let w = local[a..b].to_vec();
                        pieces.push(Piece {
                            key: s.key.clone(),
                            start: a,
                            m: w.iter().map(|x| 2.0 * x).collect(),
                            v: w.iter().map(|x| 3.0 * x).collect(),
                            w,
                        });
                    }
                }
                out.push(RankSnapshot { tp, ep, pieces });
            }
        }
        out
    }

    #[test]
    fn assembling_inverts_local_weight_for_every_role() {
        for (model, tp, ep) in [
            ("tiny-gpt", 2, 1),
            ("tiny-gpt", 4, 1),
            ("tiny-moe", 2, 1),
            ("tiny-moe", 4, 1),
            ("tiny-moe", 1, 2),
        ] {
            let g = graph(model);
            let sites = model_weights(&g).unwrap();
            let roles: std::collections::HashSet<String> = sites
                .iter()
                .map(|s| format!("{:?}", s.op(&g).role))
                .collect();
            assert!(roles.len() >= 3, "{model}: roles {roles:?}");
            let tensors = assemble(&g, &sites, &snapshots(&g, &sites, tp, ep)).unwrap();
            assert_eq!(tensors.len(), 3 * sites.len());
            for (name, shape, values) in &tensors {
                let n: usize = shape.iter().product();
                let scale = if name.starts_with("adam_m/") {
                    2.0
                } else if name.starts_with("adam_v/") {
                    3.0
                } else {
                    1.0
                };
                let want: Vec<f32> = (0..n).map(|i| scale * (i as f32 + 0.5)).collect();
                assert!(*values == want, "{model} tp={tp} ep={ep}: `{name}` differs");
            }
        }
    }

    #[test]
    fn a_missing_rank_is_an_incomplete_checkpoint() {
        let g = graph("tiny-gpt");
        let sites = model_weights(&g).unwrap();
        let mut snaps = snapshots(&g, &sites, 2, 1);
        snaps.pop();
        let err = assemble(&g, &sites, &snaps).map(|_| ()).unwrap_err();
        assert!(err.contains("no rank owns element"), "{err}");
    }
}
