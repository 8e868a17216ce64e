//! Inputs and outputs a careless operator or an adversary gives: special files in
//! place of inputs, a cluster file naming a file outside its folder, a device as
//! the output path, a token file truncated under a running job.

use crate::bin::{command, meshplan, temp_dir, within};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[cfg(unix)]
fn fifo(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    let _ = std::fs::remove_file(&p);
    let ok = std::process::Command::new("mkfifo")
        .arg(&p)
        .status()
        .expect("mkfifo")
        .success();
    assert!(ok, "mkfifo {}", p.display());
    p
}

#[cfg(unix)]
#[test]
fn special_files_as_inputs_are_refused_by_name_without_blocking_or_growing() {
    let dir = temp_dir("hostile-inputs");
    let zero = dir.join("zero.yaml");
    let _ = std::fs::remove_file(&zero);
    std::os::unix::fs::symlink("/dev/zero", &zero).expect("symlink");
    let pipe = fifo(&dir, "model.yaml");
    let plan = crate::cli::plan_file("hostile-plan.json", "models/tiny-gpt.yaml", "dp=8");
    let limit = Duration::from_secs(20);
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["inspect", s(&zero)],
            "is a character device, not a regular file",
        ),
        (vec!["inspect", s(&pipe)], "is a FIFO, not a regular file"),
        (
            vec![
                "plan",
                "models/tiny-gpt.yaml",
                s(&zero),
                "-o",
                "/tmp/unused.json",
            ],
            "is a character device",
        ),
        (vec!["run", s(&plan), "--data", s(&pipe)], "is a FIFO"),
        (vec!["run", s(&plan), "--data", s(&dir)], "is a directory"),
    ];
    for (args, want) in cases {
        let run = within(limit, &args);
        run.expect_code(2);
        assert!(
            run.stderr.contains(want),
            "{}: {}",
            args.join(" "),
            run.stderr
        );
    }
    std::fs::remove_dir_all(&dir).expect("clean");
}

#[test]
fn a_cluster_file_reads_overlays_only_beside_it_and_never_echoes_a_file() {
    let dir = temp_dir("hostile-calibration");
    let base = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../topologies/cpu-test-mesh.yaml"
    ))
    .expect("cluster");
    let secret = dir.join("secret.txt");
    let long_line = format!("s3cret-{}", "x".repeat(200));
    std::fs::write(&secret, format!("{long_line}\nsecond-line-of-the-secret\n")).expect("write");
    let plan_on = |cluster: &Path| {
        let run = meshplan(&[
            "plan",
            "models/tiny-gpt.yaml",
            s(cluster),
            "-o",
            "/tmp/unused.json",
        ]);
        run.expect_code(2);
        run
    };
    for named in [s(&secret).to_string(), "../elsewhere.yaml".into()] {
        let c = dir.join("outside.yaml");
        std::fs::write(&c, format!("{base}calibration: {named}\n")).expect("write");
        let run = plan_on(&c);
        assert!(
            run.stderr.contains("field `calibration`")
                && run.stderr.contains("outside the cluster file's folder"),
            "{}",
            run.stderr
        );
    }
    // Beside the cluster but not an overlay: the error quotes a clipped first line.
    let c = dir.join("beside.yaml");
    std::fs::write(
        dir.join("overlay.yaml"),
        std::fs::read(&secret).expect("read"),
    )
    .expect("copy");
    std::fs::write(&c, format!("{base}calibration: overlay.yaml\n")).expect("write");
    let run = plan_on(&c);
    assert!(run.stderr.contains("s3cret-xxx"), "{}", run.stderr);
    assert!(!run.stderr.contains(&long_line), "{}", run.stderr);
    assert!(!run.stderr.contains("second-line"), "{}", run.stderr);
    std::fs::remove_dir_all(&dir).expect("clean");
}

#[cfg(unix)]
#[test]
fn outputs_replace_only_regular_files_and_write_through_symlinks() {
    use std::os::unix::fs::FileTypeExt;
    let dir = temp_dir("hostile-outputs");
    let run = meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "-o",
        "/dev/null",
    ]);
    run.expect_code(2);
    assert!(run.stderr.contains("character device"), "{}", run.stderr);
    assert!(std::fs::metadata("/dev/null")
        .expect("stat")
        .file_type()
        .is_char_device());
    let run = meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "-o",
        s(&dir),
    ]);
    run.expect_code(2);
    assert!(run.stderr.contains("is a directory"), "{}", run.stderr);

    let real = dir.join("real.json");
    std::fs::write(&real, "old").expect("write");
    let link = dir.join("link.json");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&real, &link).expect("symlink");
    meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "-o",
        s(&link),
        "--quiet",
    ])
    .expect_code(0);
    assert!(std::fs::symlink_metadata(&link)
        .expect("stat")
        .file_type()
        .is_symlink());
    let text = std::fs::read_to_string(&real).expect("read");
    assert!(text.starts_with('{'), "the link's target holds the plan");
    // Nothing but the two names: no temporary left behind.
    let names: Vec<String> = std::fs::read_dir(&dir)
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    std::fs::remove_dir_all(&dir).expect("clean");
}

/// A trace is written when training ends; a path that cannot hold it (a device,
/// a folder, a missing folder) is refused before the first step, not after the
/// last.
#[cfg(unix)]
#[test]
fn a_run_refuses_a_trace_path_it_cannot_write_before_it_trains() {
    let dir = temp_dir("hostile-trace");
    let plan = dir.join("plan.json");
    meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "dp=2",
        "-o",
        s(&plan),
        "--quiet",
    ])
    .expect_code(0);
    let missing = dir.join("missing").join("trace.json");
    for (path, says) in [
        (Path::new("/dev/null"), "character device"),
        (dir.as_path(), "is a directory"),
        (missing.as_path(), "does not exist"),
    ] {
        let run = meshplan(&["run", s(&plan), "--steps", "1", "--trace", s(path)]);
        run.expect_code(2);
        assert!(
            run.stderr.contains(says),
            "{}: {}",
            path.display(),
            run.stderr
        );
        assert!(
            !run.stderr.contains("training 1 step"),
            "{}: refused only after training: {}",
            path.display(),
            run.stderr
        );
    }
    let trace = dir.join("trace.json");
    meshplan(&["run", s(&plan), "--steps", "1", "--trace", s(&trace)]).expect_code(0);
    assert!(std::fs::metadata(&trace).expect("the trace").len() > 0);
    std::fs::remove_dir_all(&dir).expect("clean");
}

#[cfg(unix)]
#[test]
fn a_token_file_truncated_under_a_run_stops_it_with_a_message() {
    let dir = temp_dir("hostile-truncate");
    let plan = crate::cli::plan_file("hostile-plan-1.json", "models/tiny-gpt.yaml", "dp=8");
    // 4 Mi tokens: far more than the steps below read before the truncation.
    let data = dir.join("tokens.bin");
    let bytes: Vec<u8> = (0..(4u32 << 20))
        .flat_map(|i| ((i % 251) as u16).to_le_bytes())
        .collect();
    std::fs::write(&data, bytes).expect("write tokens");
    let args = ["run", s(&plan), "--data", s(&data), "--steps", "1000000"];
    let mut child = command()
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        child.try_wait().expect("wait").is_none(),
        "the run ended too soon to test"
    );
    std::fs::File::options()
        .write(true)
        .open(&data)
        .expect("open")
        .set_len(0)
        .expect("truncate");
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the run went on over a truncated file");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("truncated or replaced while the run read it"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).expect("clean");
}
