//! Reading a user's input file with a size bound, refusing what is not a regular
//! file: a symlink to `/dev/zero` would otherwise grow memory without end, and a
//! FIFO would block the reader forever.

use std::fs::File;
use std::io::{Error, ErrorKind, Read};
use std::path::Path;

/// Text inputs written by hand or by a tool (model YAML, `config.json`, cluster,
/// overlay, workload, manifest, prompt): 64 MiB is thousands of times the largest
/// real one and small enough to hold.
pub const TEXT_LIMIT: u64 = 64 << 20;

/// `plan.json`: a per-rank program for every rank; the GPT-3 plan on 3840 GPUs is a
/// few MiB, a million-GPU plan some hundreds.
pub const PLAN_LIMIT: u64 = 2 << 30;

/// Refuses a path that is not a regular file (after following symlinks), naming
/// what it is, before anything opens it.
pub fn check_regular(path: &Path) -> std::io::Result<std::fs::Metadata> {
    let meta = std::fs::metadata(path)?;
    if meta.is_file() {
        return Ok(meta);
    }
    let ft = meta.file_type();
    let what = if ft.is_dir() {
        "a directory"
    } else {
        kind_of_special(&ft)
    };
    Err(Error::new(
        ErrorKind::InvalidInput,
        format!("is {what}, not a regular file; give the path of a file"),
    ))
}

#[cfg(unix)]
fn kind_of_special(ft: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "a special file"
    }
}

#[cfg(not(unix))]
fn kind_of_special(_: &std::fs::FileType) -> &'static str {
    "a special file"
}

/// The whole of a regular file of at most `limit` bytes.
pub fn read_bounded(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    let meta = check_regular(path)?;
    if meta.len() > limit {
        return Err(too_large(meta.len(), limit));
    }
    let file = File::open(path)?;
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // The file may grow after the size check; `take` keeps the bound honest.
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64, limit));
    }
    Ok(bytes)
}

/// [`read_bounded`] as UTF-8 text, without the byte order mark some editors write
/// (YAML and JSON parsers would take it for content).
pub fn read_text_bounded(path: &Path, limit: u64) -> std::io::Result<String> {
    let bytes = read_bounded(path, limit)?;
    let text = String::from_utf8(bytes).map_err(|e| {
        Error::new(
            ErrorKind::InvalidData,
            format!(
                "is not UTF-8 text (invalid byte at offset {}); save it as UTF-8",
                e.utf8_error().valid_up_to()
            ),
        )
    })?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_string(),
        None => text,
    })
}

fn too_large(len: u64, limit: u64) -> Error {
    Error::new(
        ErrorKind::InvalidInput,
        format!(
            "is {} bytes, more than the {} MiB this input may hold; give the right file",
            len,
            limit >> 20
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_devices_directories_and_fifos_and_bounds_files() {
        let dir = std::env::temp_dir().join(format!("meshplan-input-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("a.yaml");
        std::fs::write(&f, "\u{feff}abc").unwrap();
        assert_eq!(read_text_bounded(&f, 16).unwrap(), "abc");
        let e = read_bounded(&f, 2).unwrap_err().to_string();
        assert!(e.contains("is 6 bytes, more than"), "{e}");
        let e = check_regular(&dir).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        #[cfg(unix)]
        {
            let e = read_bounded(Path::new("/dev/zero"), TEXT_LIMIT).unwrap_err();
            assert!(e.to_string().contains("character device"), "{e}");
            let link = dir.join("zero");
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
            assert!(read_bounded(&link, TEXT_LIMIT).is_err());
            let fifo = dir.join("fifo");
            let _ = std::fs::remove_file(&fifo);
            let made = std::process::Command::new("mkfifo").arg(&fifo).status();
            if made.is_ok_and(|s| s.success()) {
                let e = read_bounded(&fifo, TEXT_LIMIT).unwrap_err().to_string();
                assert!(e.contains("a FIFO"), "{e}");
            }
        }
        std::fs::write(&f, [0xff, 0xfe]).unwrap();
        let e = read_text_bounded(&f, 16).unwrap_err().to_string();
        assert!(e.contains("not UTF-8"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
