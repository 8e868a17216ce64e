//! `run --backend cuda` on a machine without a GPU: exit 1 with a message that says
//! what to do, never a panic. The default build says it was built without CUDA and
//! how to rebuild; a `--features cuda` binary (`MESHPLAN_BIN_FEATURES=cuda`, as
//! scripts/test.sh runs it) names the missing driver or libraries. On a GPU machine
//! a data-parallel plan trains and `--check` passes against the fp32 CPU reference.

use crate::bin::{bin_features, meshplan, plan_file, temp_dir};

#[test]
fn run_backend_cuda_exits_1_with_what_to_do() {
    let dir = temp_dir("cuda");
    let plan = plan_file(
        &dir,
        "tiny-gpt-dp8",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        &["--config", "dp=8,tp=1,pp=1,cp=1,zero=0"],
    );
    let plan = plan.to_str().expect("utf-8 path");
    // `meshplan` fails the test on any panic text or signal.
    let run = meshplan(&["run", plan, "--backend", "cuda", "--steps", "5", "--check"]);
    if bin_features().is_some() && run.code == 0 {
        // A GPU machine: trained, and within bf16 tolerances of the fp32 reference.
        assert!(run.stdout.contains("check        passed"), "{}", run.stdout);
        println!("--backend cuda on a GPU:\n{}", run.stdout);
        return;
    }
    run.expect_code(1);
    let err = run.stderr.trim();
    assert!(err.contains("--backend cuda: "), "{err}");
    assert!(
        run.stdout.trim().is_empty(),
        "no run happened: {}",
        run.stdout
    );
    match bin_features() {
        None => {
            assert!(err.contains("built without CUDA support"), "{err}");
            assert!(
                err.contains("--features cuda"),
                "says how to rebuild: {err}"
            );
        }
        Some(features) => {
            assert!(features.contains("cuda"), "{features}");
            let no_driver = err.contains("libcuda.so.1") && err.contains("LD_LIBRARY_PATH");
            let no_device = err.contains("reports no CUDA device");
            assert!(no_driver || no_device, "the probe's reason: {err}");
            println!("--backend cuda with --features {features}: {err}");
        }
    }
}

/// `calibrate` without a usable GPU: exit 1, nothing written, no panic; a
/// `--features cuda` binary names what is missing (the probe's answer).
#[test]
fn cuda_calibrate_without_a_gpu_exits_1_and_writes_nothing() {
    let dir = temp_dir("cuda-calibrate");
    let out = dir.join("overlay.yaml");
    let o = out.to_str().expect("utf-8 path");
    let run = meshplan(&["calibrate", "-o", o]);
    if bin_features().is_some() && run.code == 0 {
        // A GPU machine: the overlay was measured.
        assert!(out.exists());
        return;
    }
    run.expect_code(1);
    let err = run.stderr.trim();
    assert!(err.contains("no CUDA backend"), "{err}");
    assert!(!out.exists());
    if bin_features().is_some() {
        assert!(
            err.contains("libcuda.so.1") || err.contains("reports no CUDA device"),
            "the probe's reason: {err}"
        );
    }
}
