//! Logs and progress: `tracing` events on stderr at the level `--quiet` /
//! `--verbose` choose, and progress bars only where someone watches (a terminal,
//! not `--quiet`, not `--json`).

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use tracing::level_filters::LevelFilter;

static QUIET: AtomicBool = AtomicBool::new(false);

/// Installs the stderr subscriber: warnings and errors under `--quiet`, progress
/// notes (info) by default, the search's and executor's detail (debug) with `-v`,
/// everything (trace) with `-vv`.
pub(crate) fn init(quiet: bool, verbose: u8) {
    QUIET.store(quiet, Ordering::Relaxed);
    let level = match (quiet, verbose) {
        (true, _) => LevelFilter::WARN,
        (false, 0) => LevelFilter::INFO,
        (false, 1) => LevelFilter::DEBUG,
        (false, _) => LevelFilter::TRACE,
    };
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .with_target(verbose > 0)
        .without_time()
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Whether a progress bar may be drawn.
pub(crate) fn progress_visible() -> bool {
    !QUIET.load(Ordering::Relaxed) && std::io::stderr().is_terminal()
}

/// A spinner with a message and the elapsed time, or a hidden bar.
pub(crate) fn spinner(message: String) -> indicatif::ProgressBar {
    if !progress_visible() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new_spinner();
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    bar.set_message(message);
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    bar
}

/// [`bar`], and the hook that moves it to the count the executor reports (steps
/// trained, tokens generated).
pub(crate) fn bar_with_hook(
    len: u64,
    message: String,
) -> (indicatif::ProgressBar, meshplan_executor::train::StepHook) {
    let bar = bar(len, message);
    let shown = bar.clone();
    let hook = move |done| shown.set_position(done);
    (
        bar,
        meshplan_executor::train::StepHook(std::sync::Arc::new(hook)),
    )
}

/// A bar of `len` steps with a message, or a hidden bar.
pub(crate) fn bar(len: u64, message: String) -> indicatif::ProgressBar {
    if !progress_visible() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} {bar:30} {pos}/{len} steps [{elapsed}, {eta} left]",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(message);
    bar
}
