//! The `meshplan` binary: the command line of the library (`src/lib.rs`).

/// The executor's allocator: freed activation buffers are kept for the next op.
#[global_allocator]
static ALLOC: meshplan_executor::alloc::Allocator = meshplan_executor::alloc::ALLOCATOR;

fn main() -> std::process::ExitCode {
    meshplan::cli_main()
}
