//! Every `cargo run --release -- ...` command the README shows, and every
//! `meshplan ...` line that needs no GPU or second node, runs in order in a scratch
//! directory holding the repository's models and topologies (and the README's
//! calibration overlay, written as `h100-overlay.yaml` as the README says), and exits
//! 0: the README's examples do what they say.

use std::path::{Path, PathBuf};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// The README's `cargo run --release -- ARGS` commands (continuation lines joined),
/// as argument lists, with each one's README line.
fn readme_commands() -> Vec<(usize, Vec<String>)> {
    let text = std::fs::read_to_string(format!("{ROOT}/README.md")).expect("README.md");
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let start = i;
        let line = lines[i].trim_start();
        // `meshplan` lines that need GPUs, processes on other nodes or a launcher are
        // left to scripts/gpu-check.sh.
        let gpu = ["--backend cuda", "launch ", "calibrate -o"]
            .iter()
            .any(|w| line.contains(w));
        let rest = line
            .strip_prefix("cargo run --release -- ")
            .or_else(|| line.strip_prefix("meshplan ").filter(|_| !gpu));
        if let Some(rest) = rest {
            let mut cmd = rest.to_string();
            while cmd.trim_end().ends_with('\\') && i + 1 < lines.len() {
                cmd = cmd.trim_end().trim_end_matches('\\').to_string();
                i += 1;
                cmd.push(' ');
                cmd.push_str(lines[i].trim());
            }
            // A trailing shell comment is the README's, not the command's.
            let cmd = cmd.split(" #").next().unwrap_or_default();
            out.push((
                start + 1,
                cmd.split_whitespace().map(str::to_string).collect(),
            ));
        }
        i += 1;
    }
    out
}

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("meshplan-readme-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    for d in ["models", "topologies", "workloads"] {
        std::os::unix::fs::symlink(Path::new(ROOT).join(d), dir.join(d)).expect("symlink");
    }
    // The README's hand-written overlay, the first ```yaml block after its heading.
    let text = std::fs::read_to_string(format!("{ROOT}/README.md")).expect("README.md");
    let at = text
        .find("### Calibration overlays")
        .expect("the overlay section");
    let yaml = text[at..]
        .split("```yaml\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("the overlay example");
    std::fs::write(dir.join("h100-overlay.yaml"), yaml).expect("overlay");
    dir
}

#[test]
fn every_command_of_the_readme_that_runs_here_succeeds() {
    let cmds = readme_commands();
    assert!(cmds.len() >= 20, "only {} commands found", cmds.len());
    let dir = scratch();
    let mut failed = Vec::new();
    for (line, args) in &cmds {
        let out = crate::bin::command()
            .args(args)
            .current_dir(&dir)
            .output()
            .expect("run meshplan");
        if !out.status.success() {
            failed.push(format!(
                "README.md:{line}: meshplan {} exited {:?}:\n{}",
                args.join(" "),
                out.status.code(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
