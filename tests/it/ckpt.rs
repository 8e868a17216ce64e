//! Checkpoints: a run saved after 3 steps and resumed equals the uninterrupted
//! 6-step run bit for bit on the same plan, and within fp32 tolerance on other
//! degrees; a save that fails half way leaves the previous checkpoint loadable, is
//! reported when it happens and retried; a damaged, edited or foreign checkpoint is
//! a clean error; and the `run` flags.
//!
//! Issue 16 (`r16_*`): a crash injected at every filesystem operation of a first
//! save, a re-save of the step `latest` names and a save after a resume
//! (`MESHPLAN_CRASH_AT`) always leaves a checkpoint that resumes bit for bit (or,
//! before the first save ever published, an exit 2), never losing the last good
//! one; a failure injected at each (`MESHPLAN_FAIL_AT`) is reported and the run
//! trains on; two runs saving into one folder; `--keep-last`; `latest` never moves
//! back; edited manifests are refused naming the field; bounded reads.

use crate::cli::{json_of, meshplan, plan_file};
use crate::executor::{model, plan, Model};
use meshplan_executor::ckpt::{step_folder, Checkpoint, SaveNotify, SaveOptions};
use meshplan_executor::train::{
    tensor_distance, train, TrainOptions, TrainReport, PARAM_TOLERANCE,
};
use meshplan_ir::plan::Plan;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// An empty folder unique to this process and test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("meshplan-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn opts(steps: u64) -> TrainOptions {
    TrainOptions {
        steps,
        ..TrainOptions::default()
    }
}

fn saving(steps: u64, dir: &Path, every: u64) -> TrainOptions {
    TrainOptions {
        save: Some(SaveOptions::new(dir, every)),
        ..opts(steps)
    }
}

fn resuming(steps: u64, dir: &Path) -> TrainOptions {
    let ck = Checkpoint::open(dir).unwrap_or_else(|e| panic!("{e}"));
    TrainOptions {
        resume: Some(Arc::new(ck)),
        ..opts(steps)
    }
}

#[track_caller]
fn run(p: &Plan, o: &TrainOptions) -> TrainReport {
    train(p, o).unwrap_or_else(|e| panic!("{}: {e}", p.strategy))
}

/// Trains 3 steps on `save_cfg` saving at step 3, resumes on `resume_cfg` to 6, and
/// compares with 6 uninterrupted steps on `resume_cfg`: bit for bit when the
/// configs are equal, else losses within 1e-5 relative and weights within
/// [`PARAM_TOLERANCE`].
#[track_caller]
fn save_and_resume(m: &Model, save_cfg: &str, resume_cfg: &str) {
    resumes_like_uninterrupted(m, save_cfg, resume_cfg, true);
}

#[track_caller]
pub(crate) fn resumes_like_uninterrupted(
    m: &Model,
    save_cfg: &str,
    resume_cfg: &str,
    golden: bool,
) {
    let (ps, pr) = (plan(m, save_cfg), plan(m, resume_cfg));
    let dir = temp_dir(&format!("{}-{save_cfg}-{resume_cfg}", m.spec.name));
    let first = run(&ps, &saving(3, &dir, 3));
    assert_eq!(first.saved.len(), 1);
    assert_eq!(first.saved[0].step, 3);
    assert_eq!(first.saved[0].path, dir.join(step_folder(3)));
    let resumed = run(&pr, &resuming(6, &dir));
    let whole = run(&pr, &opts(6));
    if golden {
        let tag = crate::exec_golden::model_tag(&m.spec);
        crate::exec_golden::check(
            &format!("ckpt-{}-{tag}-{save_cfg}-to-{resume_cfg}", m.spec.name),
            &resumed,
        );
    }
    assert_eq!(resumed.losses.len(), 3);
    if save_cfg == resume_cfg {
        assert!(
            first.losses == whole.losses[..3],
            "{save_cfg}: first 3 steps"
        );
        assert!(
            resumed.losses == whole.losses[3..],
            "{save_cfg}: resumed {:?} vs uninterrupted {:?}",
            resumed.losses,
            &whole.losses[3..]
        );
        for (a, b) in resumed.ranks.iter().zip(&whole.ranks) {
            assert!(
                a.weights == b.weights,
                "{save_cfg}: rank {} final weights differ",
                a.rank
            );
        }
        eprintln!("{save_cfg}: resumed losses equal bit for bit");
        return;
    }
    let mut worst: f64 = 0.0;
    for (a, b) in resumed.losses.iter().zip(&whole.losses[3..]) {
        worst = worst.max((a - b).abs() / b.abs());
    }
    assert!(
        worst <= 1e-5,
        "{save_cfg} -> {resume_cfg}: loss off by {worst:e} (resumed {:?}, uninterrupted {:?})",
        resumed.losses,
        &whole.losses[3..]
    );
    // The same measure as `check_against`: each tensor's rms difference over the
    // farthest AdamW can move an element in the run (lr per step).
    let reach = whole.lr * whole.losses.len() as f64;
    let mut worst_w: f64 = 0.0;
    for (a, b) in resumed.ranks.iter().zip(&whole.ranks) {
        for (k, w) in &a.weights {
            let (rms, _, _) = tensor_distance(w, &b.weights[k]);
            worst_w = worst_w.max(rms / reach);
        }
    }
    assert!(
        worst_w <= PARAM_TOLERANCE,
        "{save_cfg} -> {resume_cfg}: weights {worst_w:e} of lr x steps away"
    );
    eprintln!("{save_cfg} -> {resume_cfg}: loss within {worst:.1e} relative, weights within {worst_w:.1e} of lr x steps");
}

#[test]
fn ckpt_resume_on_the_same_plan_is_bit_exact() {
    let m = model("tiny-gpt");
    for cfg in [
        "dp=2,tp=2,pp=2,mbs=1",
        "dp=2,zero=3",
        "dp=2,tp=2,zero=2",
        "dp=2,zero=1,pp=2,mbs=1",
    ] {
        save_and_resume(&m, cfg, cfg);
    }
    save_and_resume(&model("tiny-moe"), "dp=2,ep=2", "dp=2,ep=2");
}

#[test]
fn ckpt_resume_on_other_degrees_reshards() {
    let m = model("tiny-gpt");
    let from = "dp=2,tp=2,pp=2,mbs=1";
    for to in ["dp=1", "dp=4,zero=2", "tp=2,dp=2,zero=1"] {
        save_and_resume(&m, from, to);
    }
    save_and_resume(&m, "dp=2,zero=3", "tp=2,pp=2,mbs=1");
    let moe = model("tiny-moe");
    save_and_resume(&moe, "dp=2,ep=2", "tp=2");
    save_and_resume(&moe, "tp=2", "dp=2,ep=2");
}

/// Names in `dir` that a finished save must not leave: temporaries and second
/// names of re-saved step folders.
fn leftovers(dir: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(dir)
        .expect("dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp-") || (n.starts_with("step-") && n.contains('.')))
        .collect();
    out.sort();
    out
}

#[test]
fn ckpt_a_save_failing_half_way_keeps_the_previous_checkpoint_and_is_retried() {
    let m = model("tiny-gpt");
    let p = plan(&m, "dp=2,tp=2,pp=2,mbs=1");
    let dir = temp_dir("killed");
    let mut o = saving(9, &dir, 3);
    let save = o.save.as_mut().expect("save");
    // Small files, so that the save at step 6 fails with some of them written.
    save.file_bytes = 64 << 10;
    save.fail_after_files = Some((6, 2));
    // Reported when it happens: before the save of step 9 exists.
    let told: Arc<std::sync::Mutex<Vec<(String, bool)>>> = Arc::default();
    let (sink, d9) = (told.clone(), dir.join(step_folder(9)));
    save.notify = Some(SaveNotify(Arc::new(move |m: &str| {
        sink.lock()
            .expect("notes")
            .push((m.to_string(), d9.exists()));
    })));
    let report = train(&p, &o).unwrap_or_else(|e| panic!("the run trains on: {e}"));
    assert_eq!(report.losses.len(), 9, "training went on after the failure");
    let outcome: Vec<(u64, bool)> = report
        .saved
        .iter()
        .map(|s| (s.step, s.error.is_none()))
        .collect();
    assert_eq!(outcome, vec![(3, true), (6, false), (9, true)]);
    let err = report.saved[1].error.as_deref().expect("error");
    assert!(
        err.contains("injected failure") && err.contains("file 3"),
        "{err}"
    );
    let told = told.lock().expect("notes").clone();
    assert_eq!(told.len(), 1, "{told:?}");
    assert!(told[0].0.contains("saving step 6 failed"), "{}", told[0].0);
    assert!(
        told[0].0.contains(&step_folder(3)),
        "names the last good one: {}",
        told[0].0
    );
    assert!(!told[0].1, "reported before the next save, not at the end");
    assert!(!dir.join(step_folder(6)).exists());
    // The failed save removed its own temporary; the next save went through.
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    let ck = Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ck.step(), 9);
    assert!(
        ck.manifest().files.len() > 2,
        "the failure must fall half way"
    );
    // Step 3 is still there and resumes to the uninterrupted curve.
    let whole = run(&p, &opts(9));
    let resumed = run(&p, &resuming(9, &dir.join(step_folder(3))));
    assert!(resumed.losses == whole.losses[3..]);
}

/// A copy of a checkpoint's step folder to damage.
fn copy_step(from: &Path, name: &str) -> PathBuf {
    let to = temp_dir(name);
    for e in std::fs::read_dir(from).expect("step folder").flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
    }
    to
}

fn open_err(dir: &Path) -> String {
    Checkpoint::open(dir).map(|_| ()).expect_err("damaged")
}

/// The processes of one node resuming from the same folder verify its files
/// between them: each checks the checksums of its share, and a damaged file fails
/// the one process whose share it is (and a plain open).
#[test]
fn ckpt_the_processes_of_a_node_verify_a_checkpoint_between_them() {
    let p = plan(&model("tiny-gpt"), "dp=2");
    let dir = temp_dir("shared-verify");
    let mut o = saving(2, &dir, 0);
    o.save.as_mut().expect("save").file_bytes = 64 << 10;
    run(&p, &o);
    let step = dir.join(step_folder(2));
    let files = Checkpoint::open(&step)
        .expect("opens")
        .manifest()
        .files
        .clone();
    assert!(files.len() >= 4, "{} files", files.len());
    let damaged = copy_step(&step, "shared-verify-damaged");
    let name = &files[4 % files.len()].name;
    let mut bytes = std::fs::read(damaged.join(name)).expect("file");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(damaged.join(name), &bytes).expect("write");
    let n = 3;
    let owner = (4 % files.len()) % n;
    for i in 0..n {
        let opened = Checkpoint::open_shared(&damaged, (i, n));
        if i == owner {
            let e = opened
                .map(|_| ())
                .expect_err("its share holds the damaged file");
            assert!(e.contains(name.as_str()) && e.contains("checksum"), "{e}");
        } else {
            opened.unwrap_or_else(|e| panic!("share {i}: {e}"));
        }
    }
    assert!(open_err(&damaged).contains("checksum"));
}

#[test]
fn ckpt_damaged_or_foreign_checkpoints_are_clean_errors() {
    let m = model("tiny-gpt");
    let p = plan(&m, "dp=2");
    let dir = temp_dir("good");
    run(&p, &saving(2, &dir, 0));
    let step = dir.join(step_folder(2));
    let file = "model-00001-of-00001.safetensors";

    let flipped = copy_step(&step, "flipped");
    let mut bytes = std::fs::read(flipped.join(file)).expect("file");
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(flipped.join(file), &bytes).expect("write");
    let err = open_err(&flipped);
    assert!(err.contains(file) && err.contains("checksum"), "{err}");

    let truncated = copy_step(&step, "truncated");
    std::fs::write(truncated.join(file), &bytes[..bytes.len() / 2]).expect("write");
    let err = open_err(&truncated);
    assert!(err.contains(file) && err.contains("truncated"), "{err}");

    let no_manifest = copy_step(&step, "no-manifest");
    std::fs::remove_file(no_manifest.join("manifest.json")).expect("rm");
    let err = open_err(&no_manifest);
    assert!(err.contains("no checkpoint here"), "{err}");

    let bad_manifest = copy_step(&step, "bad-manifest");
    std::fs::write(bad_manifest.join("manifest.json"), "{").expect("write");
    let err = open_err(&bad_manifest);
    assert!(
        err.contains("manifest.json") && err.contains("not a checkpoint manifest"),
        "{err}"
    );

    let err = open_err(&dir.join("nowhere"));
    assert!(err.contains("no such checkpoint folder"), "{err}");

    // Another model: tiny-moe's experts are not in a tiny-gpt checkpoint.
    let moe = model("tiny-moe");
    let err = train(&plan(&moe, "dp=2"), &resuming(4, &dir)).expect_err("foreign");
    assert!(
        err.message()
            .contains("manifest.json: field `model` is `tiny-gpt`")
            && err.message().contains("`tiny-moe`"),
        "{}",
        err.message()
    );
    // Another seed would not continue the data.
    let err = train(
        &p,
        &TrainOptions {
            seed: 7,
            ..resuming(4, &dir)
        },
    )
    .expect_err("seed");
    assert!(err.message().contains("seed"), "{}", err.message());
    // Nothing left to run.
    let err = train(&p, &resuming(2, &dir)).expect_err("done");
    assert!(
        err.message().contains("has done 2 steps"),
        "{}",
        err.message()
    );
}

#[test]
fn ckpt_run_flags_save_resume_and_exit_codes() {
    let out = plan_file(
        "plan-ckpt.json",
        "models/tiny-gpt.yaml",
        "dp=2,tp=2,pp=2,mbs=1",
    );
    let path = out.to_str().expect("utf-8 path");
    let dir = temp_dir("cli");
    let d = dir.to_str().expect("utf-8 path");
    let first = meshplan(&[
        "run",
        path,
        "--steps",
        "3",
        "--save",
        d,
        "--save-every",
        "2",
        "--json",
    ]);
    first.expect_code(0);
    let v = json_of(&first);
    let saved: Vec<u64> = v["checkpoints"]
        .as_array()
        .expect("checkpoints")
        .iter()
        .map(|c| c["step"].as_u64().expect("step"))
        .collect();
    assert_eq!(saved, vec![2, 3]);
    assert!(v["resumed_from_step"].is_null(), "{v}");
    let resumed = meshplan(&["run", path, "--steps", "6", "--resume", d, "--json"]);
    resumed.expect_code(0);
    let r = json_of(&resumed);
    assert_eq!(r["resumed_from_step"], 3, "{r}");
    let steps: Vec<u64> = r["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .map(|s| s["step"].as_u64().expect("step"))
        .collect();
    assert_eq!(steps, vec![3, 4, 5]);
    assert_eq!(r["bytes_match_plan"], true, "{r}");
    let whole = json_of(meshplan(&["run", path, "--steps", "6", "--json"]).expect_code(0));
    let losses = |v: &serde_json::Value| -> Vec<f64> {
        v["loss"]
            .as_array()
            .expect("loss")
            .iter()
            .map(|l| l.as_f64().expect("number"))
            .collect()
    };
    assert!(losses(&r) == losses(&whole)[3..], "{r}\n{whole}");
    // A step folder resumes too, and --check resumes the single-rank reference from
    // the same checkpoint.
    let step2 = dir.join(step_folder(2));
    let checked = meshplan(&[
        "run",
        path,
        "--steps",
        "4",
        "--resume",
        step2.to_str().expect("utf-8"),
        "--check",
    ]);
    checked.expect_code(0);
    assert!(
        checked.stdout.contains("step   2  loss"),
        "{}",
        checked.stdout
    );
    assert!(
        checked.stdout.contains("check        passed"),
        "{}",
        checked.stdout
    );

    meshplan(&["run", path, "--save-every", "2"])
        .expect_code(2)
        .stderr_has(&["--save-every needs --save"]);
    meshplan(&["run", path, "--save", d, "--save-every", "0"]).expect_code(2);
    meshplan(&["run", path, "--steps", "3", "--resume", d])
        .expect_code(2)
        .stderr_has(&["holds 3 steps already"]);
    let missing = dir.join("missing");
    meshplan(&["run", path, "--resume", missing.to_str().expect("utf-8")])
        .expect_code(2)
        .stderr_has(&["no such checkpoint folder"]);
    let damaged = dir
        .join(step_folder(3))
        .join("model-00001-of-00001.safetensors");
    let mut bytes = std::fs::read(&damaged).expect("file");
    bytes[100] ^= 0x40;
    std::fs::write(&damaged, &bytes).expect("write");
    meshplan(&["run", path, "--steps", "6", "--resume", d])
        .expect_code(2)
        .stderr_has(&["model-00001-of-00001.safetensors", "checksum"]);
    let moe_plan = plan_file("plan-ckpt-moe.json", "models/tiny-moe.yaml", "dp=2");
    let moe = moe_plan.to_str().expect("utf-8 path");
    meshplan(&[
        "run",
        moe,
        "--steps",
        "4",
        "--resume",
        step2.to_str().expect("utf-8"),
    ])
    .expect_code(2)
    .stderr_has(&["field `model`", "tiny-moe"]);
}

/// The update a mixed-precision run is judged against starts where the run did: after
/// a resume, the checkpoint's weights. Measured from the seeded start instead, the
/// yardstick grew with the steps before the checkpoint (about 12 times after 30), and a
/// 1.5x learning rate read 0.04 of the update, well inside the tolerance.
#[test]
fn ckpt_a_resumed_mixed_precision_check_measures_the_update_from_the_checkpoint() {
    use meshplan_executor::device::emulate::Bf16Host;
    use meshplan_executor::device::train::train_device;
    use meshplan_executor::device::{
        check_mixed_precision, MIXED_LOSS_TOLERANCE, MIXED_UPDATE_TOLERANCE,
    };
    let p = plan(&model("tiny-gpt"), "dp=2,mbs=1");
    let dir = temp_dir("bf16-resume");
    run(&p, &saving(30, &dir, 30));
    let opts = resuming(32, &dir);
    let reference = run(&p, &opts);
    let check = |lr: f32| {
        let o = TrainOptions { lr, ..opts.clone() };
        let bf16 = train_device(&p, &o, &|_| Ok(Bf16Host)).expect("bf16");
        let lines = check_mixed_precision(
            &p,
            &bf16,
            &reference,
            &opts,
            MIXED_LOSS_TOLERANCE,
            MIXED_UPDATE_TOLERANCE,
        );
        let text = lines.clone().unwrap_or_else(|e| vec![e]).join("\n");
        let at = text.find("weights ").expect("the update line") + "weights ".len();
        let share: String = (text[at..].chars())
            .take_while(|c| *c == '.' || c.is_ascii_digit())
            .collect();
        (lines.is_ok(), share.parse::<f64>().expect("a number"))
    };
    let (ok, share) = check(opts.lr);
    assert!(ok && share < MIXED_UPDATE_TOLERANCE, "{share}");
    let (ok, share) = check(opts.lr * 1.5);
    assert!(!ok && share > MIXED_UPDATE_TOLERANCE, "1.5x lr: {share}");
}

/// A run resumed on a token file continues only on the same tokens in the same
/// order: another file of the same length (it resumed before, silently training on
/// other data), no file, or a plan whose sequence length or batch reads the windows
/// in another order are bad input, exit 2, before anything runs.
#[test]
fn ckpt_resume_continues_only_on_the_same_tokens_in_the_same_order() {
    let dir = temp_dir("data-resume");
    let tokens = |seed: u32| -> PathBuf {
        let path = dir.join(format!("tokens-{seed}.bin"));
        let bytes: Vec<u8> = (0..2000u32)
            .map(|i| ((i * 7 + seed * 13 + i * i * seed) % 256) as u16)
            .flat_map(u16::to_le_bytes)
            .collect();
        std::fs::write(&path, bytes).expect("tokens");
        path
    };
    let (a, b) = (tokens(1), tokens(2));
    let (a, b) = (a.to_str().expect("utf-8"), b.to_str().expect("utf-8"));
    let out = plan_file("plan-data-resume.json", "models/tiny-gpt.yaml", "dp=2");
    let plan = out.to_str().expect("utf-8 path");
    let saved = dir.join("ck");
    let ck = saved.to_str().expect("utf-8");
    meshplan(&["run", plan, "--steps", "2", "--data", a, "--save", ck]).expect_code(0);
    let resume = |plan: &str, data: Option<&str>| {
        let mut args = vec!["run", plan, "--steps", "3", "--resume", ck];
        args.extend(data.map(|d| ["--data", d]).into_iter().flatten());
        meshplan(&args)
    };
    resume(plan, Some(b)).expect_code(2).stderr_has(&[
        "--resume",
        "the data would not continue",
        "give the same --data",
    ]);
    resume(plan, None)
        .expect_code(2)
        .stderr_has(&["--resume", "\"source\":\"synthetic\""]);
    let model = std::fs::read_to_string(format!("{}/models/tiny-gpt.yaml", crate::bin::ROOT))
        .expect("model");
    let bigger = dir.join("tiny-gpt-16.yaml");
    std::fs::write(
        &bigger,
        model.replace("global_batch: 8", "global_batch: 16"),
    )
    .expect("w");
    let other = dir.join("plan-16.json");
    let other = other.to_str().expect("utf-8");
    meshplan(&[
        "plan",
        bigger.to_str().expect("utf-8"),
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "dp=2",
        "--quiet",
        "-o",
        other,
    ])
    .expect_code(0);
    resume(other, Some(a))
        .expect_code(2)
        .stderr_has(&["global_batch 16", "plan the saved seq_len and global_batch"]);
    resume(plan, Some(a)).expect_code(0);
}

/// Checkpoints of the device interpreter: 3 steps saved, resumed to 6, equal bit
/// for bit to 6 uninterrupted steps, which equal the general interpreter's (its
/// goldens, `ckpt-whole-*`), with and without ZeRO (ZeRO-3 too), and with weights
/// split over tensor ranks and pipeline stages.
#[test]
fn ckpt_resumed_runs_equal_uninterrupted_ones_on_the_device_interpreter() {
    let (gpt, moe) = (model("tiny-gpt"), model("tiny-moe"));
    for (m, cfg) in [
        (&gpt, "dp=2"),
        (&gpt, "dp=2,zero=1"),
        (&gpt, "dp=2,tp=2,sp=false"),
        (&gpt, "tp=2,pp=2,mbs=1,sp=true"),
        (&gpt, "dp=2,zero=3"),
        (&gpt, "dp=2,cp=2"),
        // Routed experts split over ep, their moments in ZeRO parts of their own set.
        (&moe, "dp=2,ep=2,zero=1"),
        (&moe, "dp=4,ep=2,zero=3,mbs=1"),
    ] {
        let p = plan(m, cfg);
        let whole = run(&p, &opts(6));
        crate::exec_golden::check(
            &format!(
                "ckpt-whole-{}-{}-{cfg}",
                m.spec.name,
                crate::exec_golden::model_tag(&m.spec)
            ),
            &whole,
        );
        let dir = temp_dir(&format!("device-{cfg}"));
        let first = run(&p, &saving(3, &dir, 3));
        assert_eq!(first.saved.len(), 1, "{cfg}");
        assert!(first.losses == whole.losses[..3], "{cfg}: first 3 steps");
        let resumed = run(&p, &resuming(6, &dir));
        assert!(
            resumed.losses == whole.losses[3..],
            "{cfg}: resumed {:?} vs uninterrupted {:?}",
            resumed.losses,
            &whole.losses[3..]
        );
        for (a, b) in resumed.ranks.iter().zip(&whole.ranks) {
            assert!(a.weights == b.weights, "{cfg}: rank {} weights", a.rank);
        }
    }
}

// === Issue 16: crash injection, failures, locking, keep-last, tampering ===

/// One run of the binary that may die: its exit code (`None`: killed), output.
struct Outcome {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// `meshplan ARGS` with `env` set (the testing hooks).
fn run_with(args: &[&str], env: &[(&str, String)]) -> Outcome {
    let mut c = crate::bin::command();
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c
        .output()
        .unwrap_or_else(|e| panic!("meshplan {}: {e}", args.join(" ")));
    let o = Outcome {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert!(
        !o.stderr.contains("panicked"),
        "meshplan {} panicked:\n{}",
        args.join(" "),
        o.stderr
    );
    o
}

fn losses_of(stdout: &str) -> Vec<f64> {
    let v: serde_json::Value = serde_json::from_str(stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{stdout}"));
    v["loss"]
        .as_array()
        .unwrap_or_else(|| panic!("no `loss` in {v}"))
        .iter()
        .map(|l| l.as_f64().expect("number"))
        .collect()
}

const DATA_FILE: &str = "model-00001-of-00001.safetensors";

/// The weights and AdamW moments of a step folder, as bytes.
fn state_bytes(step_dir: &Path) -> Vec<u8> {
    std::fs::read(step_dir.join(DATA_FILE))
        .unwrap_or_else(|e| panic!("{}: {e}", step_dir.display()))
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir").flatten() {
        let target = to.join(e.file_name());
        if e.file_type().expect("type").is_dir() {
            copy_tree(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), &target).expect("copy");
        }
    }
}

/// The plan every issue-16 test trains (8 ranks, ZeRO-2, one data file a save),
/// the uninterrupted 5-step run's losses, and its checkpoint of every step.
struct Reference {
    plan: String,
    losses: Vec<f64>,
    saved: PathBuf,
}

fn reference(tag: &str) -> Reference {
    let plan = plan_file(
        &format!("plan-r16-{tag}.json"),
        "models/tiny-gpt.yaml",
        "dp=2",
    );
    let plan = plan.to_str().expect("utf-8").to_string();
    let saved = temp_dir(&format!("r16-ref-{tag}"));
    let s = saved.to_str().expect("utf-8");
    let r = run_with(
        &[
            "run",
            &plan,
            "--steps",
            "5",
            "--save",
            s,
            "--save-every",
            "1",
            "--json",
        ],
        &[],
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    Reference {
        losses: losses_of(&r.stdout),
        plan,
        saved,
    }
}

impl Reference {
    fn state(&self, step: u64) -> Vec<u8> {
        state_bytes(&self.saved.join(step_folder(step)))
    }

    /// A checkpoint folder holding the uninterrupted run's step 2 as a run saving
    /// at step 2 leaves it.
    fn template(&self, tag: &str) -> PathBuf {
        let t = temp_dir(&format!("r16-template-{tag}"));
        let d = t.to_str().expect("utf-8");
        let r = run_with(&["run", &self.plan, "--steps", "2", "--save", d], &[]);
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        assert!(state_bytes(&t.join(step_folder(2))) == self.state(2));
        t
    }

    /// Resumes `dir` to step 5 saving into it: the losses continue the
    /// uninterrupted run's bit for bit, and the final weights and moments are its
    /// own; the folder is left clean. Returns the step resumed from.
    #[track_caller]
    fn resumes_bit_for_bit(&self, dir: &Path, what: &str) -> u64 {
        let from = Checkpoint::open(dir)
            .unwrap_or_else(|e| panic!("{what}: the last good checkpoint is lost: {e}"))
            .step();
        let d = dir.to_str().expect("utf-8");
        let r = run_with(
            &[
                "run", &self.plan, "--steps", "5", "--resume", d, "--save", d, "--json",
            ],
            &[],
        );
        assert_eq!(
            r.code,
            Some(0),
            "{what}: resume from step {from}:\n{}",
            r.stderr
        );
        assert!(
            losses_of(&r.stdout) == self.losses[from as usize..],
            "{what}: resumed from step {from}: {:?} vs {:?}",
            losses_of(&r.stdout),
            &self.losses[from as usize..]
        );
        assert!(
            state_bytes(&dir.join(step_folder(5))) == self.state(5),
            "{what}: final weights differ from the uninterrupted run's"
        );
        assert_eq!(Checkpoint::open(dir).expect("latest").step(), 5, "{what}");
        assert!(leftovers(dir).is_empty(), "{what}: {:?}", leftovers(dir));
        from
    }
}

/// Kills `args` (with `{DIR}` for a fresh copy of `template`, or an empty folder)
/// at each filesystem operation of its saves in turn, until a run gets through;
/// after each kill the folder must resume bit for bit (from a step in `steps`), or,
/// where `template` is `None` and nothing was published, refuse with exit 2 and
/// accept a new run. The number of crash points.
fn crash_sweep(
    r: &Reference,
    tag: &str,
    template: Option<&Path>,
    args: &[&str],
    steps: &[u64],
) -> usize {
    let base = temp_dir(&format!("r16-crash-{tag}"));
    for n in 1..400u64 {
        let dir = base.join(format!("at-{n}"));
        match template {
            Some(t) => copy_tree(t, &dir),
            None => std::fs::create_dir_all(&dir).expect("mkdir"),
        }
        let d = dir.to_str().expect("utf-8");
        let args: Vec<&str> = args
            .iter()
            .map(|a| if *a == "{DIR}" { d } else { a })
            .collect();
        let o = run_with(&args, &[("MESHPLAN_CRASH_AT", n.to_string())]);
        if o.code == Some(0) {
            assert!(n > 5, "{tag}: only {} crash points", n - 1);
            assert!(!o.stderr.contains("killed at"), "{}", o.stderr);
            eprintln!(
                "{tag}: {} crash points, each resumed bit for bit or refused",
                n - 1
            );
            let _ = std::fs::remove_dir_all(&base);
            return n as usize - 1;
        }
        assert_eq!(o.code, None, "{tag} at {n}: not killed:\n{}", o.stderr);
        let point = o
            .stderr
            .lines()
            .find(|l| l.contains(&format!("MESHPLAN_CRASH_AT={n}: killed at")))
            .unwrap_or_else(|| panic!("{tag} at {n}: no crash line:\n{}", o.stderr))
            .to_string();
        let what = format!("{tag}, {point}");
        if template.is_none() && !dir.join("latest").exists() {
            // Nothing was published: a resume is refused, a new run starts clean.
            let e = run_with(&["run", &r.plan, "--steps", "5", "--resume", d], &[]);
            assert_eq!(e.code, Some(2), "{what}:\n{}", e.stderr);
            assert!(
                e.stderr.contains("no checkpoint here"),
                "{what}:\n{}",
                e.stderr
            );
            let fresh = run_with(&["run", &r.plan, "--steps", "2", "--save", d], &[]);
            assert_eq!(fresh.code, Some(0), "{what}: a new run:\n{}", fresh.stderr);
        }
        let from = r.resumes_bit_for_bit(&dir, &what);
        assert!(
            steps.contains(&from),
            "{what}: resumed from step {from}, expected one of {steps:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
    panic!("{tag}: the run never got through");
}

#[test]
fn r16_crash_at_every_point_of_a_first_save() {
    let r = reference("first");
    let args = ["run", &r.plan, "--steps", "2", "--save", "{DIR}"];
    crash_sweep(&r, "first save", None, &args, &[2]);
}

#[test]
fn r16_crash_at_every_point_of_a_re_save_of_the_step_latest_names() {
    let r = reference("resave");
    let t = r.template("resave");
    let args = ["run", &r.plan, "--steps", "2", "--save", "{DIR}"];
    let points = crash_sweep(&r, "re-save", Some(&t), &args, &[2]);
    // The re-save's extra protocol (second name, moving the old folder aside,
    // links, pointing back) is exercised, not only a first save's.
    assert!(points >= 30, "{points} crash points");
}

#[test]
fn r16_crash_at_every_point_of_saves_after_a_resume() {
    let r = reference("resumed");
    let t = r.template("resumed");
    // Two saves (steps 3 and 4), the second removing step 2 under --keep-last 2.
    let args = [
        "run",
        &r.plan,
        "--steps",
        "4",
        "--resume",
        "{DIR}",
        "--save",
        "{DIR}",
        "--save-every",
        "1",
        "--keep-last",
        "2",
    ];
    crash_sweep(&r, "after a resume", Some(&t), &args, &[2, 3, 4]);
}

/// A failure (a full disk) injected at each filesystem operation of two periodic
/// saves: the run trains to the end and prints its losses, reports the failure
/// naming the step and the cause when it happens, retries at the next save, exits
/// 1; the folder keeps a checkpoint that resumes bit for bit.
#[test]
fn r16_a_failed_save_is_reported_when_it_happens_and_retried() {
    let r = reference("fail");
    let t = r.template("fail");
    let base = temp_dir("r16-fail");
    let mut failed_saves = 0;
    for n in 1..400u64 {
        let dir = base.join(format!("at-{n}"));
        copy_tree(&t, &dir);
        let d = dir.to_str().expect("utf-8");
        let o = run_with(
            &[
                "run",
                &r.plan,
                "--steps",
                "4",
                "--save",
                d,
                "--save-every",
                "2",
                "--json",
            ],
            &[("MESHPLAN_FAIL_AT", n.to_string())],
        );
        let what = format!("failure at operation {n}");
        match o.code {
            Some(0) if !o.stderr.contains("injected failure") => {
                // Both saves' operations, the re-save's included, were reached.
                assert!(n > 45, "only {} failure points", n - 1);
                assert!(failed_saves >= 20, "{failed_saves} failed saves");
                eprintln!("{} failure points, {failed_saves} failed saves", n - 1);
                let _ = std::fs::remove_dir_all(&base);
                return;
            }
            // Only the tidy-up after a published save failed: reported, saved.
            Some(0) => assert!(o.stderr.contains("is saved"), "{what}:\n{}", o.stderr),
            // Taking the lock or sweeping the folder failed: refused before training.
            Some(2) => assert!(o.stderr.contains("--save:"), "{what}:\n{}", o.stderr),
            Some(1) => {
                failed_saves += 1;
                assert!(
                    losses_of(&o.stdout) == r.losses[..4],
                    "{what}: the loss report"
                );
                let v: serde_json::Value = serde_json::from_str(&o.stdout).expect("json");
                let bad: Vec<u64> = v["checkpoints"]
                    .as_array()
                    .expect("checkpoints")
                    .iter()
                    .filter(|c| c["saved"] == false)
                    .map(|c| c["step"].as_u64().expect("step"))
                    .collect();
                assert_eq!(bad.len(), 1, "{what}: {v}");
                let step = bad[0];
                let at_the_time = o
                    .stderr
                    .find(&format!("saving step {step} failed"))
                    .unwrap_or_else(|| panic!("{what}: not reported:\n{}", o.stderr));
                assert!(
                    o.stderr[at_the_time..].contains("injected failure"),
                    "{what}: the cause"
                );
                let summary = o.stderr.find("checkpoint saves failed").expect("summary");
                assert!(at_the_time < summary, "{what}: reported before the end");
                // The next due save retried: a failure at step 2 still saves step 4.
                let latest = Checkpoint::open(&dir).expect("latest").step();
                assert_eq!(latest, if step == 2 { 4 } else { 2 }, "{what}");
            }
            other => panic!("{what}: exit {other:?}:\n{}", o.stderr),
        }
        let from = r.resumes_bit_for_bit(&dir, &what);
        assert!([2, 4].contains(&from), "{what}: {from}");
        let _ = std::fs::remove_dir_all(&dir);
    }
    panic!("the run never got through");
}

#[test]
fn r16_two_runs_saving_into_one_folder() {
    let r = reference("lock");
    let dir = temp_dir("r16-lock");
    let d = dir.to_str().expect("utf-8");
    let mut first = crate::bin::command()
        .args([
            "run",
            &r.plan,
            "--steps",
            "150",
            "--save",
            d,
            "--save-every",
            "1",
            "--keep-last",
            "2",
            "--quiet",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let t0 = std::time::Instant::now();
    while !dir.join("latest").exists() {
        assert!(t0.elapsed().as_secs() < 60, "the first run saves nothing");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // A second writer is refused, whether it starts afresh or resumes the folder.
    for args in [
        vec!["run", &r.plan, "--steps", "3", "--save", d],
        vec!["run", &r.plan, "--steps", "200", "--resume", d, "--save", d],
    ] {
        let second = run_with(&args, &[]);
        assert_eq!(second.code, Some(2), "{}", second.stderr);
        assert!(
            second.stderr.contains(d)
                && second.stderr.contains("another run is saving checkpoints"),
            "{}",
            second.stderr
        );
    }
    let status = first.wait().expect("wait");
    let mut err = String::new();
    std::io::Read::read_to_string(first.stderr.as_mut().expect("stderr"), &mut err).expect("read");
    assert!(status.success(), "the first run: {err}");
    assert!(first_done_alone(&dir, 150), "{err}");
    // Reading is not writing: a resume from the folder while nobody saves works.
    let ck = Checkpoint::open(&dir).expect("latest");
    assert_eq!(ck.step(), 150);
}

/// The folder a run of `steps` steps with --keep-last 2 leaves, intact.
fn first_done_alone(dir: &Path, steps: u64) -> bool {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let want = vec![
        ".meshplan.lock".to_string(),
        "latest".into(),
        step_folder(steps - 1),
        step_folder(steps),
    ];
    names == want
        && Checkpoint::open(&dir.join(step_folder(steps - 1))).is_ok()
        && Checkpoint::open(dir).is_ok()
}

#[test]
fn r16_a_held_lock_refuses_a_writer_in_process_too() {
    let dir = temp_dir("r16-lock-api");
    let mut a = SaveOptions::new(&dir, 0);
    a.prepare(0, 3).expect("first");
    let mut b = SaveOptions::new(&dir, 0);
    let e = b.prepare(0, 3).expect_err("second");
    assert!(e.contains("another run is saving checkpoints"), "{e}");
    drop(a);
    b.prepare(0, 3).expect("free once the first is gone");
}

#[test]
fn r16_keep_last_and_latest_never_moves_back() {
    let r = reference("keep");
    let dir = temp_dir("r16-keep");
    let d = dir.to_str().expect("utf-8");
    let plan = r.plan.as_str();
    let keep = run_with(
        &[
            "run",
            plan,
            "--steps",
            "4",
            "--save",
            d,
            "--save-every",
            "1",
            "--keep-last",
            "2",
            "--json",
        ],
        &[],
    );
    assert_eq!(keep.code, Some(0), "{}", keep.stderr);
    let folders = |d: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .expect("dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("step-"))
            .collect();
        v.sort();
        v
    };
    assert_eq!(folders(&dir), vec![step_folder(3), step_folder(4)]);
    assert!(state_bytes(&dir.join(step_folder(3))) == r.state(3));
    // A fresh run would save step 1 below `latest`'s 4: refused, nothing changed.
    let back = run_with(
        &[
            "run",
            plan,
            "--steps",
            "3",
            "--save",
            d,
            "--save-every",
            "1",
        ],
        &[],
    );
    assert_eq!(back.code, Some(2), "{}", back.stderr);
    for needle in [d, "moving `latest` back", "--resume"] {
        assert!(
            back.stderr.contains(needle),
            "lacks `{needle}`:\n{}",
            back.stderr
        );
    }
    assert_eq!(Checkpoint::open(&dir).expect("latest").step(), 4);
    assert_eq!(folders(&dir), vec![step_folder(3), step_folder(4)]);
    // Resuming step 3 saves step 4 again: a re-save of the step `latest` names,
    // allowed, bit for bit the same state; --keep-last 1 leaves only it.
    let s3 = dir.join(step_folder(3));
    let again = run_with(
        &[
            "run",
            plan,
            "--steps",
            "4",
            "--resume",
            s3.to_str().expect("utf-8"),
            "--save",
            d,
            "--keep-last",
            "1",
        ],
        &[],
    );
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    assert_eq!(folders(&dir), vec![step_folder(4)]);
    assert!(state_bytes(&dir.join(step_folder(4))) == r.state(4));
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    for (args, needle) in [
        (
            vec!["run", plan, "--keep-last", "2"],
            "--keep-last needs --save",
        ),
        (
            vec!["run", plan, "--save", d, "--keep-last", "0"],
            "--keep-last must be at least 1",
        ),
    ] {
        let o = run_with(&args, &[]);
        assert_eq!(o.code, Some(2), "{}", o.stderr);
        assert!(o.stderr.contains(needle), "{}", o.stderr);
    }
}

#[test]
fn r16_an_edited_manifest_is_refused_naming_the_field() {
    let r = reference("edit");
    let step = r.saved.join(step_folder(2));
    let text = std::fs::read_to_string(step.join("manifest.json")).expect("manifest");
    let edits: [(&str, &str, &str, &str); 4] = [
        (
            "\"lr\": 0.003",
            "\"lr\": 1e30",
            "lr",
            "field `optimizer.lr` changed",
        ),
        ("\"step\": 2", "\"step\": 0", "step", "field `step` changed"),
        (
            "\"seed\": 1234",
            "\"seed\": 7",
            "seed",
            "field `seed` changed",
        ),
        (
            "\"model\": \"tiny-gpt\"",
            "\"model\": \"tiny-moe\"",
            "model",
            "field `model` changed",
        ),
    ];
    for (from, to, tag, needle) in edits {
        assert!(text.contains(from), "the manifest lacks `{from}`:\n{text}");
        let copy = copy_step(&step, &format!("r16-edit-{tag}"));
        std::fs::write(copy.join("manifest.json"), text.replacen(from, to, 1)).expect("write");
        let o = run_with(
            &[
                "run",
                &r.plan,
                "--steps",
                "4",
                "--resume",
                copy.to_str().expect("utf-8"),
            ],
            &[],
        );
        assert_eq!(o.code, Some(2), "{tag}: {}", o.stderr);
        assert!(
            o.stderr.contains("manifest.json") && o.stderr.contains(needle),
            "{tag}: lacks `{needle}`:\n{}",
            o.stderr
        );
    }
    // The checksum file itself: damaged, or missing from a version 2 folder.
    let copy = copy_step(&step, "r16-edit-sums");
    let sums = std::fs::read_to_string(copy.join("manifest.sha256")).expect("sums");
    let i = sums.find("\"files\"").expect("files") + 20;
    let mut bytes = sums.into_bytes();
    bytes[i] = if bytes[i] == b'0' { b'1' } else { b'0' };
    std::fs::write(copy.join("manifest.sha256"), &bytes).expect("write");
    let e = open_err(&copy);
    assert!(e.contains("manifest.sha256: damaged"), "{e}");
    std::fs::remove_file(copy.join("manifest.sha256")).expect("rm");
    let e = open_err(&copy);
    assert!(e.contains("manifest.sha256: missing"), "{e}");
    // Saying version 1 skips nothing: only version 2 gives its files SHA-256 sums.
    let mpath = copy.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mpath).expect("m")).expect("json");
    m["version"] = 1.into();
    std::fs::write(&mpath, serde_json::to_string_pretty(&m).expect("text")).expect("w");
    let e = open_err(&copy);
    assert!(e.contains("manifest.sha256: missing"), "{e}");
}

/// A version 1 checkpoint (FNV-1a 64 per data file, no manifest.sha256) still
/// resumes bit for bit.
#[test]
fn r16_a_version_1_checkpoint_still_resumes() {
    let r = reference("v1");
    let copy = copy_step(&r.saved.join(step_folder(2)), "r16-v1");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(copy.join("manifest.json")).expect("m"))
            .expect("json");
    m["version"] = 1.into();
    for f in m["files"].as_array_mut().expect("files") {
        let bytes = std::fs::read(copy.join(f["name"].as_str().expect("name"))).expect("file");
        let o = f.as_object_mut().expect("entry");
        o.remove("sha256");
        o.insert(
            "fnv1a64".into(),
            format!("{:016x}", meshplan_executor::ckpt::fnv1a64(&bytes)).into(),
        );
    }
    std::fs::write(
        copy.join("manifest.json"),
        serde_json::to_string_pretty(&m).expect("text"),
    )
    .expect("w");
    std::fs::remove_file(copy.join("manifest.sha256")).expect("rm");
    let o = run_with(
        &[
            "run",
            &r.plan,
            "--steps",
            "5",
            "--resume",
            copy.to_str().expect("utf-8"),
            "--json",
        ],
        &[],
    );
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert!(losses_of(&o.stdout) == r.losses[2..]);
}

/// `latest` and the manifest are read with bounds: a device or a FIFO is refused
/// without hanging, and a `latest` linked to another file never prints it.
#[cfg(unix)]
#[test]
fn r16_latest_and_manifest_are_read_with_bounds() {
    let r = reference("bounds");
    let resume = |dir: &Path| {
        run_with(
            &[
                "run",
                &r.plan,
                "--steps",
                "4",
                "--resume",
                dir.to_str().expect("utf-8"),
            ],
            &[],
        )
    };
    let dir = temp_dir("r16-bounds");
    copy_tree(&r.saved.join(step_folder(2)), &dir.join(step_folder(2)));
    let secret = dir.join("secret.txt");
    std::fs::write(&secret, "first line\nSECOND-LINE-NEVER-PRINTED\n").expect("w");
    let latest = dir.join("latest");
    for (target, needle) in [
        (secret.as_path(), "holds 2 lines"),
        (Path::new("/dev/zero"), "character device"),
    ] {
        let _ = std::fs::remove_file(&latest);
        std::os::unix::fs::symlink(target, &latest).expect("symlink");
        let o = resume(&dir);
        assert_eq!(o.code, Some(2), "{}", o.stderr);
        assert!(
            o.stderr.contains("latest") && o.stderr.contains(needle),
            "{}",
            o.stderr
        );
        assert!(!o.stderr.contains("SECOND-LINE"), "{}", o.stderr);
    }
    std::fs::remove_file(&latest).expect("rm");
    std::fs::write(&latest, "step-00000009\n").expect("w");
    let o = resume(&dir);
    assert_eq!(o.code, Some(2), "{}", o.stderr);
    assert!(
        o.stderr
            .contains("names step-00000009, which is not a folder"),
        "{}",
        o.stderr
    );
    // A manifest that is a FIFO: refused by kind, not opened.
    let step = dir.join(step_folder(2));
    std::fs::remove_file(step.join("manifest.json")).expect("rm");
    let fifo = std::process::Command::new("mkfifo")
        .arg(step.join("manifest.json"))
        .status();
    if fifo.is_ok_and(|s| s.success()) {
        let o = resume(&step);
        assert_eq!(o.code, Some(2), "{}", o.stderr);
        assert!(
            o.stderr.contains("manifest.json") && o.stderr.contains("FIFO"),
            "{}",
            o.stderr
        );
    }
}

/// Where strace is installed, the reproduction: the second rename of a
/// re-save killed (`strace -e inject=rename:signal=KILL:when=2`) leaves a `latest`
/// that resumes bit for bit. The crash sweeps above are the proof everywhere else.
#[test]
fn r16_strace_kill_at_the_second_rename_of_a_re_save() {
    let has_strace = std::process::Command::new("strace")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_strace {
        eprintln!("strace is not installed: skipped (the MESHPLAN_CRASH_AT sweeps cover it)");
        return;
    }
    let r = reference("strace");
    let dir = r.template("strace");
    let d = dir.to_str().expect("utf-8");
    let bin = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/release/meshplan");
    let _ = crate::bin::command(); // builds the binary
    let out = std::process::Command::new("strace")
        .args(["-f", "-o", "/dev/null", "-e", "trace=rename"])
        .args(["-e", "inject=rename:signal=KILL:when=2"])
        .args([bin, "run", &r.plan, "--steps", "2", "--save", d])
        .current_dir(crate::bin::ROOT)
        .output()
        .expect("strace");
    let err = String::from_utf8_lossy(&out.stderr);
    if err.contains("ptrace") {
        eprintln!("strace cannot trace here: skipped");
        return;
    }
    if out.status.success() {
        // The C library renames with another system call here: nothing injected.
        eprintln!("no rename system call was killed: {err}");
    } else {
        assert!(
            leftovers(&dir).iter().any(|n| n.starts_with("step-")),
            "killed between the renames: {:?}",
            leftovers(&dir)
        );
    }
    r.resumes_bit_for_bit(&dir, "strace kill at the second rename");
}

/// One process a rank (`train_device_rank`, what `meshplan launch` runs on GPUs,
/// here ranks as threads over the in-process communicator): at each save every
/// rank's state goes to rank 0, which alone takes the folder and writes, and the
/// checkpoint is the one a single process writes, byte for byte. ZeRO-3's parts,
/// tensor and pipeline slices and replicas all reach it. At the end rank 0 holds
/// every rank's report, as `--check` needs.
#[test]
fn ckpt_launched_ranks_save_and_report_what_one_process_does() {
    let m = model("tiny-gpt");
    for cfg in ["dp=2,tp=2,pp=2,sp=true,mbs=1", "dp=2,tp=2,zero=3"] {
        let p = plan(&m, cfg);
        let one = temp_dir(&format!("one-{cfg}"));
        let whole = run(&p, &saving(4, &one, 2));
        let apart = temp_dir(&format!("apart-{cfg}"));
        let o = saving(4, &apart, 2);
        let results = crate::executor::launched_ranks(&p, &o);
        let mut saved = Vec::new();
        let mut at_zero = Vec::new();
        for (rank, r) in results.into_iter().enumerate() {
            let (reports, s) = r.unwrap_or_else(|e| panic!("{cfg}: rank {rank}: {e}"));
            assert!(
                reports[0].weights == whole.ranks[rank].weights,
                "{cfg}: rank {rank}"
            );
            assert!(
                rank == 0 || (s.is_empty() && reports.len() == 1),
                "{cfg}: rank {rank}"
            );
            saved.extend(s);
            if rank == 0 {
                at_zero = reports;
            }
        }
        // With the final weights asked for (`--check`), rank 0 holds every rank's
        // report: its weights, and its bytes, which leave out what the saves moved.
        assert_eq!(at_zero.len(), whole.ranks.len(), "{cfg}");
        for (a, b) in at_zero.iter().zip(&whole.ranks) {
            assert_eq!(a.rank, b.rank, "{cfg}");
            assert!(a.weights == b.weights, "{cfg}: rank {}'s weights", a.rank);
            assert_eq!(a.counts, b.counts, "{cfg}: rank {}'s bytes", a.rank);
            assert_eq!(
                a.loss_parts, b.loss_parts,
                "{cfg}: rank {}'s losses",
                a.rank
            );
        }
        assert_eq!(
            saved
                .iter()
                .map(|s| (s.step, s.error.clone()))
                .collect::<Vec<_>>(),
            [(2, None), (4, None)],
            "{cfg}"
        );
        for step in [2, 4] {
            let (a, b) = (one.join(step_folder(step)), apart.join(step_folder(step)));
            assert!(state_bytes(&a) == state_bytes(&b), "{cfg}: step {step}");
        }
        let ck = Checkpoint::open(&apart).unwrap_or_else(|e| panic!("{cfg}: {e}"));
        assert_eq!(ck.step(), 4, "{cfg}");
    }
}
