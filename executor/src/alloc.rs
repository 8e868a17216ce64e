//! The allocator a process running the executor should use.
//!
//! Every op allocates its outputs and frees its inputs' last uses, buffers of tens
//! of megabytes. glibc returns such buffers to the kernel on free, so the next op
//! faults in freshly zeroed pages: on `models/small-gpt.yaml` that is ~114 k page
//! faults (~445 MB zeroed) per training step. mimalloc with purging turned off keeps
//! freed pages mapped for reuse; after the first step a run faults almost nothing.
//!
//! A binary opts in with
//! `#[global_allocator] static ALLOC: Allocator = ALLOCATOR;` and calls
//! [`keep_freed_memory`] first thing in `main`.

/// The allocator type.
pub type Allocator = mimalloc::MiMalloc;

/// The allocator value, for `#[global_allocator]`.
pub const ALLOCATOR: Allocator = mimalloc::MiMalloc;

/// Turns off mimalloc's purging of freed memory (as `MIMALLOC_PURGE_DELAY=-1`
/// would), so freed buffers are reused instead of returned to the kernel. Call it
/// before starting threads; harmless when the process uses another allocator.
pub fn keep_freed_memory() {
    // `mi_option_purge_delay` in mimalloc.h's `mi_option_e` (v2 and v3); the
    // bindings' constants stop short of it.
    const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    // SAFETY: mi_option_set stores an integer into mimalloc's option table; it
    // takes no pointers and is safe to call at any time.
    #[allow(unsafe_code)]
    unsafe {
        libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1)
    };
}

/// Heap accounting for tests: the bytes the process has allocated and not freed,
/// and their peak, counted for every allocation of the test binary.
#[cfg(test)]
pub(crate) mod heap {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

    static LIVE: AtomicUsize = AtomicUsize::new(0);
    static PEAK: AtomicUsize = AtomicUsize::new(0);

    /// The system allocator, counted.
    struct Counting;

    fn grew(n: usize) {
        let live = LIVE.fetch_add(n, Relaxed) + n;
        PEAK.fetch_max(live, Relaxed);
    }

    #[allow(unsafe_code)]
    // SAFETY: forwards every call to the system allocator unchanged.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            grew(l.size());
            // SAFETY: the caller's contract, passed on.
            unsafe { System.alloc(l) }
        }
        unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
            grew(l.size());
            // SAFETY: as above.
            unsafe { System.alloc_zeroed(l) }
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            LIVE.fetch_sub(l.size(), Relaxed);
            // SAFETY: as above.
            unsafe { System.dealloc(p, l) }
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
            grew(new);
            LIVE.fetch_sub(l.size(), Relaxed);
            // SAFETY: as above.
            unsafe { System.realloc(p, l, new) }
        }
    }

    #[global_allocator]
    static COUNTING: Counting = Counting;

    /// Bytes allocated and not freed; the peak is reset to them.
    pub(crate) fn reset_peak() -> usize {
        let live = LIVE.load(Relaxed);
        PEAK.store(live, Relaxed);
        live
    }

    /// The most bytes held at once since [`reset_peak`].
    pub(crate) fn peak() -> usize {
        PEAK.load(Relaxed)
    }

    /// Whether this process should measure: counts are the whole process's, so
    /// test `name` (its full path) reruns alone in a child process of the test
    /// binary, which measures; the parent returns false once the child passed.
    pub(crate) fn measure_alone(name: &str) -> bool {
        const CHILD: &str = "MESHPLAN_HEAP_TEST_CHILD";
        if std::env::var_os(CHILD).is_some() {
            return true;
        }
        let exe = std::env::current_exe().expect("the test binary's path");
        let out = std::process::Command::new(exe)
            .args([name, "--exact", "--test-threads=1", "--nocapture"])
            .env(CHILD, "1")
            .output()
            .expect("the test binary runs");
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "{name} alone: {text}"
        );
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_option_set_is_the_purge_delay() {
        // SAFETY: reads an integer from mimalloc's option table.
        #[allow(unsafe_code)]
        let get = || unsafe { libmimalloc_sys::mi_option_get(15) };
        // mimalloc v3's default purge delay (options.c): option 15 is that one.
        assert_eq!(get(), 1000, "option 15 holds the purge delay's default");
        super::keep_freed_memory();
        assert_eq!(get(), -1);
    }
}
