//! Checkpoints: a run saved after 3 steps and resumed equals the uninterrupted
//! 6-step run bit for bit on the same plan, and within fp32 tolerance on other
//! degrees; a save that dies half way leaves the previous checkpoint loadable; a
//! damaged or foreign checkpoint is a clean error; and the `run` flags.

use crate::cli::{json_of, meshplan, plan_file};
use crate::executor::{model, plan, Model};
use meshplan_executor::ckpt::{step_folder, Checkpoint, SaveOptions};
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
    let (ps, pr) = (plan(m, save_cfg), plan(m, resume_cfg));
    let dir = temp_dir(&format!("{}-{save_cfg}-{resume_cfg}", m.spec.name));
    let first = run(&ps, &saving(3, &dir, 3));
    assert_eq!(first.saved.len(), 1);
    assert_eq!(first.saved[0].step, 3);
    assert_eq!(first.saved[0].path, dir.join(step_folder(3)));
    let resumed = run(&pr, &resuming(6, &dir));
    let whole = run(&pr, &opts(6));
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

#[test]
fn ckpt_a_save_killed_half_way_keeps_the_previous_checkpoint() {
    let m = model("tiny-gpt");
    let p = plan(&m, "dp=2,tp=2,pp=2,mbs=1");
    let dir = temp_dir("killed");
    let mut o = saving(6, &dir, 3);
    let save = o.save.as_mut().expect("save");
    // Small files, so that the save at step 6 dies with some of them written.
    save.file_bytes = 64 << 10;
    save.fail_after_files = Some((6, 2));
    let err = train(&p, &o).expect_err("the save at step 6 fails");
    assert!(err.message.contains("injected failure"), "{}", err.message);
    let manifest = |d: &Path| {
        let ck = Checkpoint::open(d).unwrap_or_else(|e| panic!("{e}"));
        (ck.step(), ck.manifest().files.len())
    };
    let (step, files) = manifest(&dir);
    assert_eq!(step, 3, "latest still names the step-3 checkpoint");
    assert!(files > 2, "{files} files: the failure must fall half way");
    assert!(!dir.join(step_folder(6)).exists());
    let leftovers = |d: &Path| -> Vec<String> {
        std::fs::read_dir(d)
            .expect("dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tmp-"))
            .collect()
    };
    let tmp = leftovers(&dir);
    assert_eq!(tmp.len(), 1, "{tmp:?}");
    let written = std::fs::read_dir(dir.join(&tmp[0])).expect("tmp").count();
    assert_eq!(
        written, 3,
        "the interrupted save wrote 2 files, half of a third and no manifest"
    );
    let err = open_err(&dir.join(&tmp[0]));
    assert!(err.contains("no checkpoint here"), "{err}");
    // The previous checkpoint resumes to the uninterrupted curve, and the next save
    // removes the leftover.
    let whole = run(&p, &opts(6));
    let resumed = run(
        &p,
        &TrainOptions {
            save: Some(SaveOptions::new(&dir, 3)),
            ..resuming(6, &dir)
        },
    );
    assert!(resumed.losses == whole.losses[3..]);
    assert_eq!(manifest(&dir).0, 6);
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
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
    assert!(err.message.contains("has no `"), "{}", err.message);
    // Another seed would not continue the data.
    let err = train(
        &p,
        &TrainOptions {
            seed: 7,
            ..resuming(4, &dir)
        },
    )
    .expect_err("seed");
    assert!(err.message.contains("seed"), "{}", err.message);
    // Nothing left to run.
    let err = train(&p, &resuming(2, &dir)).expect_err("done");
    assert!(err.message.contains("has done 2 steps"), "{}", err.message);
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
    .stderr_has(&["has no `", "tiny-moe"]);
}

/// The device interpreter writes and reads the general interpreter's checkpoints:
/// 3 steps saved by one, resumed to 6 by the other (and by itself), equal bit for
/// bit to 6 uninterrupted steps, with and without ZeRO.
#[test]
fn ckpt_device_and_general_interpreters_resume_each_other() {
    use meshplan_executor::device::{train::train_device, HostDevice};
    let m = model("tiny-gpt");
    let device = |p: &Plan, o: &TrainOptions| {
        train_device(p, o, &|_| Ok(HostDevice)).unwrap_or_else(|e| panic!("{}: {e}", p.strategy))
    };
    for cfg in ["dp=2", "dp=2,zero=1"] {
        let p = plan(&m, cfg);
        let whole = run(&p, &opts(6));
        type Trainer<'a> = &'a dyn Fn(&Plan, &TrainOptions) -> TrainReport;
        let pairs: [(&str, Trainer, Trainer); 3] = [
            ("device -> general", &device, &run),
            ("general -> device", &run, &device),
            ("device -> device", &device, &device),
        ];
        for (what, save, resume) in pairs {
            let dir = temp_dir(&format!("device-{cfg}-{}", what.replace(' ', "")));
            let first = save(&p, &saving(3, &dir, 3));
            assert_eq!(first.saved.len(), 1, "{cfg} {what}");
            assert!(
                first.losses == whole.losses[..3],
                "{cfg} {what}: first 3 steps"
            );
            let resumed = resume(&p, &resuming(6, &dir));
            assert!(
                resumed.losses == whole.losses[3..],
                "{cfg} {what}: resumed {:?} vs uninterrupted {:?}",
                resumed.losses,
                &whole.losses[3..]
            );
            for (a, b) in resumed.ranks.iter().zip(&whole.ranks) {
                assert!(
                    a.weights == b.weights,
                    "{cfg} {what}: rank {} weights",
                    a.rank
                );
            }
        }
    }
}
