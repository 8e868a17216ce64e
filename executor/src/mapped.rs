//! Read-only memory maps of the files a run reads in place (token data, safetensors
//! weights, checkpoints), and what happens when one of them shrinks underneath.
//!
//! Reading a mapped page that a truncation removed raises SIGBUS, which would end
//! the process with no word. The first map installs a handler that names the cause
//! and exits with status 1; copying multi-GiB token files to be immune would cost
//! their size in memory.

use memmap2::Mmap;
use std::fs::File;
use std::path::Path;

/// Maps `path` read-only after checking it is a regular file (a directory or a FIFO
/// would give the kernel's bare "No such device").
#[allow(unsafe_code)]
pub fn map_readonly(path: &Path) -> std::io::Result<Mmap> {
    meshplan_ir::input::check_regular(path)?;
    let file = File::open(path)?;
    guard_truncation();
    // SAFETY: the map is read-only; a file truncated while mapped faults, and the
    // fault is turned into a message and exit status 1 by `guard_truncation`.
    unsafe { Mmap::map(&file) }
}

/// The words the SIGBUS handler writes; a handler may only call
/// async-signal-safe functions, so the text is fixed.
const TRUNCATED: &[u8] = b"error: a memory-mapped input (--data, --weights or a checkpoint) was \
truncated or replaced while the run read it; restore the file and run again (resume from the \
last checkpoint with --resume)\n";

#[cfg(unix)]
fn guard_truncation() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        extern "C" fn on_sigbus(_: libc::c_int) {
            // SAFETY: write(2) and _exit(2) are async-signal-safe.
            #[allow(unsafe_code)]
            unsafe {
                libc::write(2, TRUNCATED.as_ptr().cast(), TRUNCATED.len());
                libc::_exit(1);
            }
        }
        #[allow(unsafe_code)]
        // SAFETY: installs a handler that only calls async-signal-safe functions.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_sigbus as *const () as usize;
            libc::sigemptyset(&mut act.sa_mask);
            libc::sigaction(libc::SIGBUS, &act, std::ptr::null_mut());
        }
    });
}

#[cfg(not(unix))]
fn guard_truncation() {}
