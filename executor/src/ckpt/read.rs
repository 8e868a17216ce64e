//! Opening a checkpoint: the manifest and its sums checked, the files mapped and
//! verified, tensors read whole or as one rank's slice.

use super::*;

/// Where a tensor's bytes are: file index, byte range in the file, shape.
pub(super) type Located = (usize, (usize, usize), Vec<usize>);

/// An opened checkpoint: manifest checked, files mapped and their checksums verified.
pub struct Checkpoint {
    pub(super) dir: PathBuf,
    pub(super) manifest: Manifest,
    pub(super) files: Vec<Mmap>,
    pub(super) tensors: HashMap<String, Located>,
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
        Checkpoint::open_shared(path, (0, 1))
    }

    /// [`Checkpoint::open`] verifying the checksum of data file `f` only where
    /// `f % n == i` for `share` `(i, n)`, every other check made: the `n`
    /// processes of one node that resume from the same folder verify it once
    /// between them instead of `n` times, each reading its own slices of the rest.
    pub fn open_shared(path: &Path, (i, n): (usize, usize)) -> Result<Checkpoint, String> {
        let dir = step_folder(path)?;
        let (manifest, sums) = read_manifest(&dir)?;
        let (mpath, spath) = (dir.join(MANIFEST), dir.join(SUMS));
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
            if fi % n.max(1) == i {
                check_file_sum(&fpath, &map, entry, sums.as_ref(), &spath)?;
            }
            locate_tensors(&fpath, &map, fi, &mut tensors)?;
            files.push(map);
        }
        for (name, t) in &manifest.tensors {
            let found = tensors
                .get(name)
                .map(|(fi, _, s)| (&manifest.files[*fi].name, s));
            if found != Some((&t.file, &t.shape)) {
                return Err(format!(
                    "{}: `{}` (shape {:?}) is not in {}",
                    mpath.display(),
                    quote(name),
                    t.shape,
                    quote(&t.file)
                ));
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
        if let Some(name) = self.tensors.keys().filter(|n| !want.contains(*n)).min() {
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
        self.held(
            name,
            shape,
            std::slice::from_ref(&(0..shape.iter().product())),
        )
    }

    /// The values at `runs` (element ranges of the full tensor, as
    /// [`crate::shard::held_runs`] gives a rank's part): a rank reads its part of
    /// the file, not the whole tensor.
    pub fn held(
        &self,
        name: &str,
        shape: &[usize],
        runs: &[std::ops::Range<usize>],
    ) -> Result<Vec<f32>, String> {
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
            .filter(|t| t.len() == 4 * shape.iter().product::<usize>())
            .ok_or_else(|| {
                format!(
                    "{}: `{name}` lies outside its file or does not hold its shape",
                    self.dir.display()
                )
            })?;
        let mut out = Vec::with_capacity(runs.iter().map(|r| r.len()).sum());
        for r in runs {
            let part = bytes
                .get(4 * r.start..4 * r.end)
                .ok_or_else(|| format!("{}: `{name}` has no elements {r:?}", self.dir.display()))?;
            out.extend(
                part.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
        Ok(out)
    }
}

/// The step folder `path` names: itself when it holds a manifest, else the one
/// its `latest` file points to.
fn step_folder(path: &Path) -> Result<PathBuf, String> {
    if exists(&path.join(MANIFEST)) {
        return Ok(path.to_path_buf());
    }
    match read_latest(path)? {
        Some((name, _)) => Ok(path.join(name)),
        None if path.is_dir() => Err(format!(
            "{}: no checkpoint here (neither manifest.json nor latest)",
            path.display()
        )),
        None => Err(format!("{}: no such checkpoint folder", path.display())),
    }
}

/// A step folder's manifest and checksums, checked against each other: the
/// format and version, the sums a version 2 folder must have, no file the
/// manifest does not name.
fn read_manifest(dir: &Path) -> Result<(Manifest, Option<Sums>), String> {
    let mpath = dir.join(MANIFEST);
    let text = read_bounded(&mpath, TEXT_LIMIT).map_err(|e| format!("{}: {e}", mpath.display()))?;
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
    // Only version 2 writes SHA-256 entries: a manifest with them that says version 1
    // was edited to skip the manifest's own checks.
    let v2 = manifest.version >= 2 || manifest.files.iter().any(|f| f.sha256.is_some());
    if v2 && sums.is_none() {
        return Err(format!(
            "{}: missing; a version {VERSION} checkpoint (its files have SHA-256 sums) lists the SHA-256 of its files there (the step folder is incomplete or was copied in part): copy the whole folder, or resume from another checkpoint",
            spath.display(),
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
    Ok((manifest, sums))
}

/// Where each tensor of file `fi` (mapped as `map`) lies; every one must be F32.
fn locate_tensors(
    fpath: &Path,
    map: &[u8],
    fi: usize,
    tensors: &mut HashMap<String, Located>,
) -> Result<(), String> {
    let (header, meta) = SafeTensors::read_metadata(map)
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
    Ok(())
}

pub(super) fn read_sums(path: &Path) -> Result<Sums, String> {
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
pub(super) fn check_manifest_bytes(mpath: &Path, bytes: &[u8], sums: &Sums) -> Result<(), String> {
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
    let keys: std::collections::BTreeSet<&String> =
        now.keys().chain(sums.manifest_fields.keys()).collect();
    let changed: Vec<&String> = keys
        .into_iter()
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
pub(super) fn check_file_sum(
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
