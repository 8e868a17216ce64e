//! The on-disk PTX cache: NVRTC output keyed by everything that decides it.
//!
//! A module compiled for one device is written to
//! `DIR/<key>.ptx`, `key` a 128-bit hash (two FNV-1a 64 passes with different
//! offsets) of the source, the target architecture, the NVRTC version and the
//! compile options, so a changed kernel, another GPU or another compiler never
//! reads a stale file. `DIR` is `$MESHPLAN_PTX_CACHE` when set (`off` disables the
//! cache), else `$XDG_CACHE_HOME/meshplan/ptx`, else `$HOME/.cache/meshplan/ptx`.
//! Files are written to a temporary name and renamed, so concurrent ranks never read
//! a partial file, and end with a line holding the hash of the PTX above it: a file
//! damaged later (or not ours) is a miss, recompiled and replaced.

use std::io;
use std::path::{Path, PathBuf};

/// The cache folder from the environment, or `None` when disabled or no home.
pub fn cache_dir() -> Option<PathBuf> {
    dir_from(
        std::env::var_os("MESHPLAN_PTX_CACHE"),
        std::env::var_os("XDG_CACHE_HOME"),
        std::env::var_os("HOME"),
    )
}

fn dir_from(
    explicit: Option<std::ffi::OsString>,
    xdg: Option<std::ffi::OsString>,
    home: Option<std::ffi::OsString>,
) -> Option<PathBuf> {
    let nonempty = |v: Option<std::ffi::OsString>| v.filter(|s| !s.is_empty());
    if let Some(dir) = nonempty(explicit) {
        return (dir != "off").then(|| PathBuf::from(dir));
    }
    if let Some(xdg) = nonempty(xdg) {
        return Some(PathBuf::from(xdg).join("meshplan").join("ptx"));
    }
    nonempty(home).map(|h| PathBuf::from(h).join(".cache").join("meshplan").join("ptx"))
}

fn fnv1a64(offset: u64, parts: &[&[u8]]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = offset;
    for part in parts {
        // The length first, so ("ab", "c") and ("a", "bc") differ.
        for b in (part.len() as u64).to_le_bytes().iter().chain(part.iter()) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(PRIME);
        }
    }
    h
}

/// The cache key of a module: 32 hex digits over source, architecture (`sm_90`),
/// NVRTC version and options.
pub fn key(source: &str, arch: &str, nvrtc_version: (i32, i32), options: &[String]) -> String {
    let version = format!("{}.{}", nvrtc_version.0, nvrtc_version.1);
    let opts = options.join("\u{1f}");
    let parts: [&[u8]; 4] = [
        source.as_bytes(),
        arch.as_bytes(),
        version.as_bytes(),
        opts.as_bytes(),
    ];
    // FNV-1a's standard offset, then an arbitrary second one.
    let a = fnv1a64(0xcbf2_9ce4_8422_2325, &parts);
    let b = fnv1a64(0x6c62_272e_07bb_0142, &parts);
    format!("{a:016x}{b:016x}")
}

/// The file a key is stored in.
pub fn path(dir: &Path, key: &str) -> PathBuf {
    dir.join(format!("{key}.ptx"))
}

/// Whether `text` looks like complete NVRTC output (a truncated or foreign file is
/// treated as absent).
pub fn looks_like_ptx(text: &str) -> bool {
    text.contains(".version")
        && text.contains(".target")
        && text.contains(".entry")
        && !text.contains('\0')
}

/// The last line of a cache file: the marker and the hash of the PTX before it.
const TRAILER: &str = "// meshplan-ptx-fnv1a64 ";

fn trailer(ptx: &str) -> String {
    format!(
        "{TRAILER}{:016x}\n",
        fnv1a64(0xcbf2_9ce4_8422_2325, &[ptx.as_bytes()])
    )
}

/// The cached PTX of `key`, if present, complete and plausible.
pub fn read(dir: &Path, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(path(dir, key)).ok()?;
    let body = text.strip_suffix('\n')?;
    let at = body.rfind('\n').map_or(0, |i| i + 1);
    let (ptx, last) = text.split_at(at);
    (last == trailer(ptx) && looks_like_ptx(ptx)).then(|| ptx.to_string())
}

/// Stores `ptx` under `key`: written to a temporary file of this process, then
/// renamed over the final name.
pub fn write(dir: &Path, key: &str, ptx: &str) -> io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let target = path(dir, key);
    let tmp = dir.join(format!(".{key}.{}.tmp", std::process::id()));
    let mut text = String::with_capacity(ptx.len() + 64);
    text.push_str(ptx);
    if !ptx.ends_with('\n') {
        text.push('\n');
    }
    let body_len = text.len();
    let tail = trailer(&text[..body_len]);
    text.push_str(&tail);
    std::fs::write(&tmp, text)?;
    if let Err(e) = std::fs::rename(&tmp, &target) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    #[test]
    fn folder_follows_the_environment_order() {
        let s = |v: &str| Some(OsString::from(v));
        assert_eq!(
            dir_from(s("/c"), s("/x"), s("/h")),
            Some(PathBuf::from("/c"))
        );
        assert_eq!(dir_from(s("off"), s("/x"), s("/h")), None);
        assert_eq!(
            dir_from(None, s("/x"), s("/h")),
            Some(PathBuf::from("/x/meshplan/ptx"))
        );
        assert_eq!(
            dir_from(s(""), None, s("/h")),
            Some(PathBuf::from("/h/.cache/meshplan/ptx"))
        );
        assert_eq!(dir_from(None, None, None), None);
    }

    #[test]
    fn key_changes_with_every_input() {
        let o = vec!["--std=c++17".to_string()];
        let k = key("src", "sm_90", (13, 0), &o);
        assert_eq!(k.len(), 32);
        assert!(k.chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(k, key("src", "sm_90", (13, 0), &o));
        for other in [
            key("src2", "sm_90", (13, 0), &o),
            key("src", "sm_80", (13, 0), &o),
            key("src", "sm_90", (13, 1), &o),
            key("src", "sm_90", (13, 0), &[]),
        ] {
            assert_ne!(k, other);
        }
    }

    #[test]
    fn write_then_read_round_trips_and_rejects_junk() {
        let dir = std::env::temp_dir().join(format!("meshplan-ptx-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ptx = "//\n.version 9.0\n.target sm_90\n.visible .entry k()\n{\n}\n";
        assert_eq!(read(&dir, "abc"), None);
        let p = write(&dir, "abc", ptx).unwrap();
        assert_eq!(p, path(&dir, "abc"));
        assert_eq!(read(&dir, "abc").as_deref(), Some(ptx));
        let whole = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, &whole[..whole.len() - 3]).unwrap();
        assert_eq!(read(&dir, "abc"), None, "a truncated file is a miss");
        std::fs::write(&p, whole.replace("k()", "j()")).unwrap();
        assert_eq!(read(&dir, "abc"), None, "an altered file is a miss");
        std::fs::write(&p, ptx).unwrap();
        assert_eq!(
            read(&dir, "abc"),
            None,
            "a file without the trailer is a miss"
        );
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
