//! Checkpoints' filesystem operations: each one synced and counted for the crash
//! and failure hooks, the folder lock, step folders and `latest`.

use super::*;

/// Filesystem operations of saving so far in this process (counted only while a
/// testing hook is set).
pub(super) static FS_OPS: AtomicU64 = AtomicU64::new(0);

pub(super) fn hook(var: &str, cell: &'static OnceLock<Option<u64>>) -> Option<u64> {
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
pub(super) fn fs_op(what: &str, path: &Path, partial: impl FnOnce()) -> Result<(), String> {
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
pub(super) fn die() -> ! {
    #[cfg(unix)]
    {
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
    std::process::abort()
}

pub(super) fn mkdir(path: &Path) -> Result<(), String> {
    fs_op("mkdir", path, || {})?;
    fs::create_dir(path).map_err(io(path, "create folder"))
}

pub(super) fn rename(from: &Path, to: &Path) -> Result<(), String> {
    fs_op("rename", to, || {})?;
    fs::rename(from, to).map_err(|e| format!("{}: rename to {}: {e}", from.display(), to.display()))
}

/// Writes `bytes` to a new `path` and flushes them to the disk.
pub(super) fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), String> {
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
pub(super) fn sync_dir(path: &Path) -> Result<(), String> {
    fs_op("fsync", path, || {})?;
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(io(path, "fsync folder"))
}

/// A second name for an immutable checkpoint file, or a synced copy where the
/// filesystem has no hard links.
pub(super) fn link_or_copy(from: &Path, to: &Path) -> Result<(), String> {
    fs_op("link", to, || {})?;
    if fs::hard_link(from, to).is_ok() {
        return Ok(());
    }
    fs::copy(from, to).map_err(io(to, "copy"))?;
    File::open(to)
        .and_then(|f| f.sync_all())
        .map_err(io(to, "fsync"))
}

pub(super) fn remove_tree(path: &Path) -> Result<(), String> {
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
pub(super) fn retire(dir: &Path, name: &str, id: &str) -> Result<(), String> {
    let gone = dir.join(format!(".tmp-rm-{name}-{id}"));
    rename(&dir.join(name), &gone)?;
    remove_tree(&gone)
}

pub(super) fn exists(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
}

/// An id unique to this run, in the names of its temporaries.
pub(super) fn run_id() -> String {
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
pub(super) struct DirLock {
    pub(super) _file: File,
    /// This run's id ([`run_id`]).
    pub(super) id: String,
    /// Whether [`SaveOptions::prepare`] has checked and swept the folder.
    pub(super) prepared: std::sync::atomic::AtomicBool,
}

impl DirLock {
    pub(super) fn acquire(dir: &Path) -> Result<DirLock, String> {
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
        file.try_lock().map_err(|e| match e {
            fs::TryLockError::WouldBlock => format!(
                "{}: another run is saving checkpoints into this folder (it holds {}); wait for it to end, or give another --save folder",
                dir.display(),
                path.display()
            ),
            fs::TryLockError::Error(e) => format!(
                "{}: cannot lock: {e}; save into a folder on a filesystem with file locks",
                path.display()
            ),
        })?;
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
pub(super) fn read_latest(dir: &Path) -> Result<Option<(String, u64)>, String> {
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
pub(super) fn sweep(dir: &Path, latest: Option<&str>) -> Result<(), String> {
    for name in list_names(dir)? {
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

/// The names in `dir` that are UTF-8, sorted.
pub(super) fn list_names(dir: &Path) -> Result<Vec<String>, String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map_err(io(dir, "list"))?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    Ok(names)
}

/// Points `DIR/latest` at `name` atomically: a reader sees the old name or the new.
pub(super) fn point_latest(dir: &Path, name: &str, id: &str) -> Result<(), String> {
    let tmp = dir.join(format!(".tmp-latest-{id}"));
    write_synced(&tmp, format!("{name}\n").as_bytes())?;
    rename(&tmp, &dir.join("latest"))?;
    sync_dir(dir)
}

/// Whether `latest` names `name` now (after an error half way through pointing it).
pub(super) fn latest_is(dir: &Path, name: &str) -> bool {
    matches!(read_latest(dir), Ok(Some((n, _))) if n == name)
}
