//! The release `meshplan` binary for the export, explain and CUDA tests: built once
//! per run (`cargo build --release --bin meshplan`, a no-op when fresh), because
//! these tests plan GPT-3 on 3840 GPUs and want the optimised search.
//!
//! `MESHPLAN_BIN_FEATURES=cuda` builds it with those cargo features instead
//! (scripts/test.sh runs the CUDA test so, against a `--features cuda` binary).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Once;

pub const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
const BIN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/release/meshplan");

static BUILD: Once = Once::new();

/// The cargo features the binary is built with (`MESHPLAN_BIN_FEATURES`), if any.
pub fn bin_features() -> Option<String> {
    std::env::var("MESHPLAN_BIN_FEATURES")
        .ok()
        .filter(|f| !f.trim().is_empty())
}

fn binary() -> &'static Path {
    BUILD.call_once(|| {
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "--release", "--bin", "meshplan", "--target-dir"])
            .arg(PathBuf::from(ROOT).join("target"))
            .current_dir(ROOT);
        if let Some(features) = bin_features() {
            cmd.args(["--features", &features]);
        }
        let out = cmd.output();
        let ok = matches!(&out, Ok(o) if o.status.success());
        if !ok {
            let why = match out {
                Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
                Err(e) => e.to_string(),
            };
            panic!("cannot build the release meshplan binary:\n{why}");
        }
    });
    Path::new(BIN)
}

/// One run of the binary.
pub struct Run {
    pub args: String,
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    #[track_caller]
    pub fn expect_code(&self, code: i32) -> &Self {
        assert_eq!(
            self.code, code,
            "meshplan {}: exit {} (want {code})\nstdout:\n{}\nstderr:\n{}",
            self.args, self.code, self.stdout, self.stderr
        );
        self
    }

    #[track_caller]
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "meshplan {}: stdout is not one JSON object ({e}):\n{}",
                self.args, self.stdout
            )
        })
    }
}

/// A `meshplan` command in the workspace root, to add arguments and environment to.
pub fn command() -> Command {
    let mut c = Command::new(binary());
    c.current_dir(ROOT);
    c
}

/// Runs `meshplan ARGS` in the workspace root; fails the test on a panic or signal.
#[track_caller]
pub fn meshplan(args: &[&str]) -> Run {
    let mut c = command();
    c.args(args);
    finish(
        args,
        &c.output()
            .unwrap_or_else(|e| panic!("cannot run {BIN}: {e}")),
    )
}

/// Runs `meshplan ARGS`, killing it (and failing the test) after `limit`: for
/// runs that must end by themselves (a FIFO given as input refused, not waited
/// on; a deadlock found, not slept in), so that a regression fails, not hangs.
/// Its output must fit the pipes (64 KiB), which a message does.
#[track_caller]
pub fn within(limit: std::time::Duration, args: &[&str]) -> Run {
    let mut child = command()
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn meshplan");
    let start = std::time::Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("meshplan {} still running after {limit:?}", args.join(" "));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    finish(args, &child.wait_with_output().expect("output"))
}

/// The [`Run`] of a finished `meshplan ARGS`; fails the test on a panic or signal.
#[track_caller]
pub fn finish(args: &[&str], out: &std::process::Output) -> Run {
    let run = Run {
        args: args.join(" "),
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert!(
        !run.stderr.contains("panicked"),
        "meshplan {} panicked:\n{}",
        run.args,
        run.stderr
    );
    assert!(
        out.status.code().is_some(),
        "meshplan {} was killed",
        run.args
    );
    run
}

/// A directory of this process for `tag`'s files.
pub fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("meshplan-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Plans `model` on `cluster` with `extra` flags into `dir/name.json`, once per
/// process (several tests share a plan).
#[track_caller]
pub fn plan_file(dir: &Path, name: &str, model: &str, cluster: &str, extra: &[&str]) -> PathBuf {
    let path = dir.join(format!("{name}.json"));
    let tmp = dir.join(format!("{name}.json.{:?}", std::thread::current().id()));
    if !path.exists() {
        let tmp_s = tmp.display().to_string();
        let mut args = vec!["plan", model, cluster, "-o", tmp_s.as_str(), "--quiet"];
        args.extend_from_slice(extra);
        meshplan(&args).expect_code(0);
        std::fs::rename(&tmp, &path).expect("rename plan");
    }
    path
}
