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
