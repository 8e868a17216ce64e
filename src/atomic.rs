//! Writing an output file (a plan, a trace, a figure, an export) so that whatever
//! was at the path is either replaced whole or left as it was, and nothing that is
//! not a regular file is ever replaced.

use crate::Failure;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` through a temporary file in the same folder, synced
/// and renamed over the old file, then syncs the folder. A symlink is written
/// through (its target is replaced, the link stays); a device, FIFO, socket or
/// folder at the path is refused with exit 2, because renaming over it would turn
/// `/dev/null` into a regular file. The temporary is removed on any failure.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8], what: &str) -> Result<(), Failure> {
    let target = destination(path, what)?;
    let io = |e: std::io::Error| Failure {
        code: 1,
        message: format!("{}: cannot write the {what}: {e}", path.display()),
    };
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| what.into());
    // The pid keeps two writers of one path from sharing (and deleting) a temporary.
    let tmp = target.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let written = write_synced(&tmp, bytes, &target).and_then(|()| fs::rename(&tmp, &target));
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(io(e));
    }
    // Without the folder's sync a power cut may forget the rename.
    if let Some(dir) = target.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// The regular file `path` names, following symlinks; refuses anything else.
pub(crate) fn destination(path: &Path, what: &str) -> Result<PathBuf, Failure> {
    let refuse = |why: String| Failure {
        code: 2,
        message: format!(
            "{}: {why}; meshplan writes the {what} only to a regular file: give a file path",
            path.display()
        ),
    };
    let link = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(_) => return Ok(path.to_path_buf()),
    };
    let target = if link.file_type().is_symlink() {
        fs::canonicalize(path).map_err(|_| refuse("is a symlink to a missing file".into()))?
    } else {
        path.to_path_buf()
    };
    match meshplan_ir::input::check_regular(&target) {
        Ok(_) => Ok(target),
        Err(e) => Err(refuse(e.to_string().split(';').next().unwrap_or("").into())),
    }
}

fn write_synced(tmp: &Path, bytes: &[u8], keep_mode_of: &Path) -> std::io::Result<()> {
    let mut f = OpenOptions::new().write(true).create_new(true).open(tmp)?;
    if let Ok(m) = fs::metadata(keep_mode_of) {
        f.set_permissions(m.permissions())?;
    }
    f.write_all(bytes)?;
    f.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("meshplan-atomic-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn replaces_a_file_whole_and_leaves_no_temporary() {
        let d = scratch("file");
        let p = d.join("plan.json");
        fs::write(&p, "old").unwrap();
        write_atomically(&p, b"new", "plan").unwrap();
        assert_eq!(fs::read_to_string(&p).unwrap(), "new");
        assert_eq!(fs::read_dir(&d).unwrap().count(), 1);
        fs::remove_dir_all(&d).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn writes_through_a_symlink_and_refuses_devices_and_folders() {
        let d = scratch("link");
        let real = d.join("real.json");
        fs::write(&real, "old").unwrap();
        let link = d.join("link.json");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        write_atomically(&link, b"new", "plan").unwrap();
        assert!(fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(fs::read_to_string(&real).unwrap(), "new");

        let e = write_atomically(Path::new("/dev/null"), b"x", "plan").unwrap_err();
        assert_eq!(e.code, 2);
        assert!(e.message.contains("character device"), "{}", e.message);
        use std::os::unix::fs::FileTypeExt;
        assert!(fs::metadata("/dev/null")
            .unwrap()
            .file_type()
            .is_char_device());
        let e = write_atomically(&d, b"x", "trace").unwrap_err();
        assert_eq!(e.code, 2);
        assert!(e.message.contains("directory"), "{}", e.message);
        let dangling = d.join("dangling");
        std::os::unix::fs::symlink(d.join("missing/x"), &dangling).unwrap();
        let e = write_atomically(&dangling, b"x", "trace").unwrap_err();
        assert!(e.message.contains("missing file"), "{}", e.message);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_failed_write_removes_its_temporary_and_keeps_the_old_file() {
        let d = scratch("fail");
        let p = d.join("out.json");
        fs::write(&p, "old").unwrap();
        // A folder where the temporary would go makes creating it fail.
        fs::create_dir(d.join(format!(".out.json.{}.tmp", std::process::id()))).unwrap();
        let e = write_atomically(&p, b"new", "plan").unwrap_err();
        assert_eq!(e.code, 1);
        assert_eq!(fs::read_to_string(&p).unwrap(), "old");
        fs::remove_dir_all(&d).unwrap();
    }
}
