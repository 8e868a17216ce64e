//! Checkpoints: full (unsharded) weights and AdamW moments in safetensors files, a
//! manifest, and the step. Storing full tensors makes a checkpoint independent of
//! the plan that wrote it: every rank of any plan slices its part with
//! [`local_weight`], the rule that slices an initial weight, so resuming on the same
//! plan copies the saved bits back and resuming on other degrees reshards for free.
//!
//! # Layout
//!
//! `DIR/step-00000006/` holds `model-00001-of-0000N.safetensors` files of at most
//! [`SaveOptions::file_bytes`] each (a larger tensor gets a file of its own) and
//! `manifest.json` (format, model, step, seed, optimizer, data position, strategy,
//! files with their FNV-1a 64 checksums, and each tensor's file and shape). Tensors
//! are `w/NAME`, `adam_m/NAME`, `adam_v/NAME`, with `@LAYER` after the names of
//! block weights. `DIR/latest` names the newest complete step folder.
//!
//! # Atomicity
//!
//! A save writes into `DIR/.tmp-step-N-PID/`, fsyncs every file and the folder,
//! renames it to `step-N`, then replaces `latest` by a write to a temporary name,
//! fsync and rename. A crash at any point leaves the previous `latest` and its folder
//! untouched; a leftover temporary folder is ignored by loads and removed by the next
//! save.
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
use meshplan_ir::plan::Plan;
use meshplan_ir::{Graph, Op, SegmentKind, TensorId, TensorKind, Workload};
use safetensors::tensor::{Dtype, SafeTensors, View};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// `format` of a manifest.
pub const FORMAT: &str = "meshplan-checkpoint";
/// Version of the layout described in the module doc.
pub const VERSION: u64 = 1;
/// Default bound on one safetensors file.
pub const DEFAULT_FILE_BYTES: usize = 256 << 20;
/// AdamW hyper-parameters of the optimizer step: (beta1, beta2, eps, weight decay).
pub const ADAMW: (f32, f32, f32, f32) = (0.9, 0.95, 1e-8, 0.0);

const NO_LAYER: u64 = u64::MAX;

/// Where and how often a run saves.
#[derive(Clone, Debug)]
pub struct SaveOptions {
    /// The checkpoint folder (step folders and `latest` go inside).
    pub dir: PathBuf,
    /// Save after every this many steps (global step numbers); 0: only at the end.
    /// The last step always saves.
    pub every: u64,
    /// Bound on one safetensors file.
    pub file_bytes: usize,
    /// For tests: the save after this many steps stops with an error after writing
    /// this many files and half of the next (or, past the last file, before the
    /// manifest), leaving the folder as a crash would.
    pub fail_after_files: Option<(u64, usize)>,
}

impl SaveOptions {
    /// Saves into `dir` every `every` steps and at the end.
    pub fn new(dir: impl Into<PathBuf>, every: u64) -> SaveOptions {
        SaveOptions {
            dir: dir.into(),
            every,
            file_bytes: DEFAULT_FILE_BYTES,
            fail_after_files: None,
        }
    }

    /// Whether a save follows the step that brings the count to `done` of `total`.
    pub fn due(&self, done: u64, total: u64) -> bool {
        done == total || (self.every > 0 && done.is_multiple_of(self.every))
    }
}

/// A written checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Saved {
    /// Optimizer steps it holds.
    pub step: u64,
    /// Its step folder.
    pub path: PathBuf,
    /// Bytes of its safetensors files.
    pub bytes: u64,
    /// Safetensors files.
    pub files: usize,
    /// Seconds to assemble, write and publish it.
    pub seconds: f64,
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

/// FNV-1a 64 of a file's bytes, the manifest's checksum.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
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
    /// FNV-1a 64 of its bytes, 16 hex digits.
    pub fnv1a64: String,
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
    pub fn new(plan: &Plan, opts: &TrainOptions, save: &SaveOptions) -> Result<Saver, String> {
        let workload = match &plan.workload {
            Workload::Train {
                seq_len,
                global_batch,
                ..
            } => serde_json::json!({"seq_len": seq_len, "global_batch": global_batch}),
            _ => serde_json::Value::Null,
        };
        Ok(Saver {
            opts: save.clone(),
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
            // Saves publish in step order: `latest` never goes back.
            let mut done = match prev {
                Some(p) => p.join().map_err(|_| "checkpoint writer panicked")??,
                None => Vec::new(),
            };
            done.push(write_checkpoint(&meta, &opts, step, snaps)?);
            Ok(done)
        }));
        Ok(())
    }

    /// Waits for every write; the checkpoints written, in step order.
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

/// Maps a checkpoint file read-only.
#[allow(unsafe_code)]
fn map_file(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: checkpoint files are written once under a temporary folder name and
    // renamed into place, never modified afterwards, and the map is read-only.
    unsafe { Mmap::map(file) }
}

/// Writes `bytes` to `path` and flushes them to the disk.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let mut f = File::create(path).map_err(io(path, "create"))?;
    f.write_all(bytes).map_err(io(path, "write"))?;
    f.sync_all().map_err(io(path, "fsync"))
}

/// Makes a folder's entries (new names, renames) durable.
fn sync_dir(path: &Path) -> Result<(), String> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(io(path, "fsync folder"))
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

fn write_checkpoint(
    meta: &RunMeta,
    opts: &SaveOptions,
    step: u64,
    snaps: Vec<RankSnapshot>,
) -> Result<Saved, String> {
    let t0 = Instant::now();
    let tensors = assemble(&meta.graph, &meta.sites, &snaps)?;
    drop(snaps);
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
    let dir = &opts.dir;
    fs::create_dir_all(dir).map_err(io(dir, "create folder"))?;
    // Leftovers of interrupted saves: never read, removed here.
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(".tmp-") {
                let p = e.path();
                let _ = if p.is_dir() {
                    fs::remove_dir_all(&p)
                } else {
                    fs::remove_file(&p)
                };
            }
        }
    }
    let tmp = dir.join(format!(".tmp-{}-{}", step_folder(step), std::process::id()));
    fs::create_dir(&tmp).map_err(io(&tmp, "create folder"))?;
    let n = groups.len();
    let mut files = Vec::new();
    let mut entries = BTreeMap::new();
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
        files.push(FileEntry {
            name,
            bytes: bytes.len() as u64,
            fnv1a64: format!("{:016x}", fnv1a64(&bytes)),
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
    write_synced(&tmp.join("manifest.json"), text.as_bytes())?;
    sync_dir(&tmp)?;
    let fin = dir.join(step_folder(step));
    if fin.exists() {
        // An older run's folder of the same step: moved aside first, since a rename
        // does not replace a non-empty folder.
        let old = dir.join(format!(
            ".tmp-old-{}-{}",
            step_folder(step),
            std::process::id()
        ));
        fs::rename(&fin, &old).map_err(io(&fin, "move aside"))?;
        fs::rename(&tmp, &fin).map_err(io(&fin, "rename"))?;
        let _ = fs::remove_dir_all(&old);
    } else {
        fs::rename(&tmp, &fin).map_err(io(&fin, "rename"))?;
    }
    sync_dir(dir)?;
    let latest_tmp = dir.join(format!(".tmp-latest-{}", std::process::id()));
    write_synced(&latest_tmp, format!("{}\n", step_folder(step)).as_bytes())?;
    let latest = dir.join("latest");
    fs::rename(&latest_tmp, &latest).map_err(io(&latest, "rename"))?;
    sync_dir(dir)?;
    Ok(Saved {
        step,
        path: fin,
        bytes: total,
        files: n,
        seconds: t0.elapsed().as_secs_f64(),
    })
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
    /// Opens a step folder, or the one `latest` names in a checkpoint folder.
    /// Every error names the file and what is wrong.
    pub fn open(path: &Path) -> Result<Checkpoint, String> {
        let dir = if path.join("manifest.json").is_file() {
            path.to_path_buf()
        } else if path.join("latest").is_file() {
            let latest = path.join("latest");
            let name = fs::read_to_string(&latest).map_err(io(&latest, "read"))?;
            let name = name.trim();
            if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') {
                return Err(format!(
                    "{}: `{name}` is not a step folder name",
                    latest.display()
                ));
            }
            path.join(name)
        } else if path.is_dir() {
            return Err(format!(
                "{}: no checkpoint here (neither manifest.json nor latest)",
                path.display()
            ));
        } else {
            return Err(format!("{}: no such checkpoint folder", path.display()));
        };
        let mpath = dir.join("manifest.json");
        let text = fs::read_to_string(&mpath).map_err(io(&mpath, "read"))?;
        let manifest: Manifest = serde_json::from_str(&text)
            .map_err(|e| format!("{}: not a checkpoint manifest: {e}", mpath.display()))?;
        if manifest.format != FORMAT || manifest.version != VERSION {
            return Err(format!(
                "{}: format {} version {}, expected {FORMAT} version {VERSION}",
                mpath.display(),
                manifest.format,
                manifest.version
            ));
        }
        let mut files = Vec::new();
        let mut tensors = HashMap::new();
        for (fi, entry) in manifest.files.iter().enumerate() {
            if entry.name.contains(['/', '\\']) || entry.name.starts_with('.') {
                return Err(format!(
                    "{}: file name `{}` is outside the folder",
                    mpath.display(),
                    entry.name
                ));
            }
            let fpath = dir.join(&entry.name);
            let file = File::open(&fpath).map_err(io(&fpath, "open"))?;
            let map = map_file(&file).map_err(io(&fpath, "map"))?;
            if map.len() as u64 != entry.bytes {
                return Err(format!(
                    "{}: {} bytes, the manifest says {} (truncated or damaged)",
                    fpath.display(),
                    map.len(),
                    entry.bytes
                ));
            }
            let sum = format!("{:016x}", fnv1a64(&map));
            if sum != entry.fnv1a64 {
                return Err(format!(
                    "{}: checksum {sum} differs from the manifest's {} (the file is damaged)",
                    fpath.display(),
                    entry.fnv1a64
                ));
            }
            let (header, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| format!("{}: not a safetensors file: {e}", fpath.display()))?;
            for (name, info) in meta.tensors() {
                if info.dtype != Dtype::F32 {
                    return Err(format!(
                        "{}: `{name}` is {:?}, expected F32",
                        fpath.display(),
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
                        "{}: `{name}` (shape {:?}) is not in {}",
                        mpath.display(),
                        t.shape,
                        t.file
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

    /// Checks that the checkpoint holds exactly the weights (and their moments) of
    /// `graph`, with the same shapes.
    pub fn check_model(&self, graph: &Graph) -> Result<(), String> {
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
    fn checksum_is_fnv1a() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
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
