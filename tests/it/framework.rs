//! `--framework`: the planner searches only what the named framework can run, never
//! pads the batch, and the plan it writes exports to that framework.

use crate::bin::{meshplan, temp_dir};

fn strategy(plan: &std::path::Path) -> serde_json::Value {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(plan).expect("plan")).expect("json");
    v["strategy"].clone()
}

fn global_batch(plan: &std::path::Path) -> u64 {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(plan).expect("plan")).expect("json");
    v["workload"]["global_batch"]
        .as_u64()
        .expect("global batch")
}

/// Plans `model` on `cluster` for `framework`; the plan's path, or the failed run.
fn plan_for(
    tag: &str,
    model: &str,
    cluster: &str,
    nodes: &str,
    framework: &str,
) -> Result<std::path::PathBuf, crate::bin::Run> {
    let out = temp_dir("framework").join(format!("{tag}-{framework}.json"));
    let o = out.display().to_string();
    let run = meshplan(&[
        "plan",
        model,
        cluster,
        "--nodes",
        nodes,
        "--framework",
        framework,
        "-o",
        &o,
        "--quiet",
    ]);
    if run.code == 0 {
        Ok(out)
    } else {
        Err(run)
    }
}

#[track_caller]
fn check_runnable(plan: &std::path::Path, framework: &str) {
    let s = strategy(plan);
    let (dp, mbs) = (
        s["dp"].as_u64().expect("dp"),
        s["mbs"].as_u64().expect("mbs"),
    );
    assert_eq!(
        global_batch(plan) % (dp * mbs),
        0,
        "{framework}: a padded batch: {s}"
    );
    if framework == "deepspeed" {
        for k in ["tp", "pp", "cp", "ep"] {
            assert_eq!(s[k], 1, "deepspeed with {k}>1: {s}");
        }
    }
    // `export` without --to writes the plan's framework's files.
    let p = plan.display().to_string();
    let run = meshplan(&["export", &p]);
    run.expect_code(0);
    assert!(!run.stdout.is_empty());
}

#[test]
fn gpt3_on_3840_a100s_plans_and_exports_for_each_framework_that_can_run_it() {
    let model = "models/gpt3-175b.yaml";
    let cluster = "topologies/dgx-a100-80g.yaml";
    let plan = plan_for("gpt3", model, cluster, "480", "megatron-core")
        .unwrap_or_else(|r| panic!("megatron-core: {}", r.stderr));
    check_runnable(&plan, "megatron-core");
    // 3840 GPUs and 1536 sequences: the factor of 5 in 3840 must go into tp, pp
    // or cp, since dp divides 1536. Data parallelism alone cannot; even stages of
    // 96 layers (torchtitan, megatron-deepspeed) cannot; only Megatron-Core's
    // uneven first and last stages (pp=20) can. Each of the others says so.
    for fw in ["deepspeed", "torchtitan", "megatron-deepspeed"] {
        let run = plan_for("gpt3", model, cluster, "480", fw).expect_err(fw);
        assert_eq!(run.code, 3, "{}", run.stderr);
        assert!(
            run.stderr
                .contains(&format!("--framework {fw} cannot run any of the"))
                && run.stderr.contains("does not divide"),
            "{}",
            run.stderr
        );
    }
    // On 192 nodes (1536 GPUs) every framework has a plan, and each exports.
    for fw in [
        "megatron-core",
        "megatron-deepspeed",
        "torchtitan",
        "deepspeed",
    ] {
        let plan = plan_for("gpt3-1536", model, cluster, "192", fw)
            .unwrap_or_else(|r| panic!("{fw}: {}", r.stderr));
        check_runnable(&plan, fw);
    }
}

/// Every plan written for a framework exports to it, over models whose features
/// constrain the frameworks differently (latent attention and experts, experts,
/// dense) and cluster sizes from 2 to 128 nodes: the search takes only what the
/// export accepts. DeepSeek-V3 for Megatron-Core once took context parallelism at
/// 32 and 128 nodes, which Megatron-LM does not run with multi-latent attention.
#[test]
fn every_plan_a_framework_gets_exports_to_it() {
    let mut exported = 0;
    for model in ["deepseek-v3", "mixtral-8x7b", "llama3-70b"] {
        for cluster in ["dgx-a100-80g", "dgx-h100"] {
            for nodes in ["2", "32", "128"] {
                for fw in [
                    "megatron-core",
                    "megatron-deepspeed",
                    "torchtitan",
                    "deepspeed",
                ] {
                    let tag = format!("{model}-{cluster}-{nodes}");
                    let path = format!("models/{model}.yaml");
                    let topo = format!("topologies/{cluster}.yaml");
                    match plan_for(&tag, &path, &topo, nodes, fw) {
                        Ok(plan) => {
                            check_runnable(&plan, fw);
                            exported += 1;
                        }
                        // No layout of this framework fits: said, exit 3.
                        Err(run) => assert_eq!(run.code, 3, "{tag} {fw}: {}", run.stderr),
                    }
                }
            }
        }
    }
    assert!(exported >= 40, "{exported} plans exported");
}

#[test]
fn llama3_405b_on_16384_h100s_plans_and_exports_for_each_framework() {
    let (model, cluster) = ("models/llama3-405b.yaml", "topologies/dgx-h100.yaml");
    // 16384 GPUs and 2048 sequences: DeepSpeed alone cannot divide the batch.
    let run = plan_for("llama405", model, cluster, "2048", "deepspeed").expect_err("deepspeed");
    assert_eq!(run.code, 3, "{}", run.stderr);
    assert!(run.stderr.contains("does not divide"), "{}", run.stderr);
    for fw in ["megatron-core", "megatron-deepspeed", "torchtitan"] {
        let plan = plan_for(
            "llama405",
            "models/llama3-405b.yaml",
            "topologies/dgx-h100.yaml",
            "2048",
            fw,
        )
        .unwrap_or_else(|r| panic!("{fw}: {}", r.stderr));
        check_runnable(&plan, fw);
    }
}

#[test]
fn what_a_framework_cannot_run_exits_2_naming_it() {
    let tiny = ["models/tiny-gpt.yaml", "topologies/cpu-test-mesh.yaml"];
    let run = meshplan(&[
        "plan",
        tiny[0],
        tiny[1],
        "--framework",
        "deepspeed",
        "--config",
        "tp=2",
        "-o",
        "/tmp/unused.json",
    ]);
    run.expect_code(2);
    assert!(
        run.stderr.contains("--framework deepspeed") && run.stderr.contains("tp=2"),
        "{}",
        run.stderr
    );
    let run = meshplan(&[
        "estimate",
        tiny[0],
        tiny[1],
        "--framework",
        "torchtitan",
        "--config",
        "dp=4,tp=2,sp=false",
    ]);
    run.expect_code(2);
    assert!(
        run.stderr.contains("--framework torchtitan") && run.stderr.contains("sp=true"),
        "{}",
        run.stderr
    );
    let run = meshplan(&[
        "plan",
        tiny[0],
        tiny[1],
        "--framework",
        "colossal",
        "-o",
        "/tmp/unused.json",
    ]);
    run.expect_code(2);
    assert!(
        run.stderr.contains("unknown framework `colossal`") && run.stderr.contains("megatron-core"),
        "{}",
        run.stderr
    );
    // meshplan's own search never pads where an exact batch exists: 8 GPUs and
    // 12 sequences give dp x mbs dividing 12; pinning dp=8 pads, and says so.
    let dir = temp_dir("framework");
    let out = dir.join("batch12.json");
    let o = out.display().to_string();
    let batch = ["--global-batch", "12", "--seq-len", "32"];
    let mut args = vec!["plan", tiny[0], tiny[1], "-o", &o];
    args.extend(batch);
    meshplan(&args).expect_code(0);
    let s = strategy(&out);
    assert_eq!(
        12 % (s["dp"].as_u64().expect("dp") * s["mbs"].as_u64().expect("mbs")),
        0,
        "{s}"
    );
    args.extend(["--config", "dp=8"]);
    let run = meshplan(&args);
    run.expect_code(0);
    assert!(
        run.stderr.contains("computes 16 sequences per step"),
        "{}",
        run.stderr
    );
}

#[test]
fn a_plan_edited_to_claim_a_framework_that_cannot_run_it_is_refused() {
    let plan = crate::cli::plan_file("framework-tp.json", "models/tiny-gpt.yaml", "dp=4,tp=2");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).expect("plan")).expect("json");
    v["workload"]["framework"] = "deepspeed".into();
    let edited = temp_dir("framework").join("claims-deepspeed.json");
    std::fs::write(&edited, v.to_string()).expect("write");
    let run = meshplan(&["export", edited.to_str().expect("utf-8")]);
    run.expect_code(2);
    assert!(
        run.stderr.contains("workload.framework") && run.stderr.contains("tp=2"),
        "{}",
        run.stderr
    );
}

#[test]
fn a_framework_plan_uses_the_framework_s_own_placements() {
    // Llama 3 8B on one DGX H100 with tp=2 fixed: meshplan's executor may use the
    // tensor axis as the ILP finds best (here not Megatron's tensor parallelism);
    // under megatron-core tp is Megatron tensor parallelism, so the plan keeps the
    // standard placements and its prediction is for the run `export` writes.
    let layout = |fw: &str| {
        let out = temp_dir("framework").join(format!("l8b-tp2-{fw}.json"));
        let o = out.display().to_string();
        let run = meshplan(&[
            "plan",
            "models/llama3-8b.yaml",
            "topologies/dgx-h100.yaml",
            "--config",
            "tp=2",
            "--framework",
            fw,
            "-o",
            &o,
            "--quiet",
        ]);
        assert_eq!(run.code, 0, "{}", run.stderr);
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).expect("plan")).expect("json");
        v["search"]["extra"]["layout"]
            .as_str()
            .expect("layout")
            .to_string()
    };
    assert_eq!(layout("meshplan"), "ilp");
    let mc = layout("megatron-core");
    assert!(
        mc == "standard" || mc == "ilp (equals the standard layout)",
        "{mc}"
    );
}

#[test]
fn explain_offers_only_neighbours_the_plan_s_framework_runs() {
    // tiny-gpt on the 8-rank CPU mesh for DeepSpeed: dp=8, one sequence each (global
    // batch 8). Splitting over tp, pp or cp, two sequences per micro-batch (16 per
    // step > 8) and selective recomputation are neighbours DeepSpeed cannot run;
    // explain lists them as such, naming the framework, and ranks only the rest.
    let out = temp_dir("framework").join("tiny-deepspeed.json");
    let o = out.display().to_string();
    let run = meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--framework",
        "deepspeed",
        "-o",
        &o,
        "--quiet",
    ]);
    run.expect_code(0);
    let run = meshplan(&["explain", &o, "--json"]);
    run.expect_code(0);
    let v = run.json();
    let refused: Vec<String> = v["cannot_run"]
        .as_array()
        .expect("cannot_run")
        .iter()
        .filter(|r| {
            r["reason"]
                .as_str()
                .is_some_and(|s| s.starts_with("--framework deepspeed cannot run it"))
        })
        .map(|r| r["change"].as_str().expect("change").to_string())
        .collect();
    for want in [
        "tp 1->2",
        "pp 1->2",
        "cp 1->2",
        "mbs 1->2",
        "recompute none->selective",
    ] {
        assert!(
            refused.iter().any(|c| c.starts_with(want)),
            "{want} refused: {refused:?}"
        );
    }
    for a in v["alternatives"].as_array().expect("alternatives") {
        let change = a["change"].as_str().expect("change");
        assert!(
            !refused.iter().any(|c| c == change),
            "{change} both refused and offered"
        );
        assert!(
            !["tp ", "pp ", "cp "].iter().any(|k| change.starts_with(k)),
            "{change} offered to a DeepSpeed plan"
        );
    }
}

/// Fixed keys that leave only layer counts the stages cannot share evenly: the
/// search prices each candidate at a split the framework takes (Megatron-Core's
/// uneven ends), never at one it does not, so the plan is written (this exited 3,
/// "no layout priced", when GPT-3's 96 layers over 15 stages were priced evenly in
/// the sweep and then found unrunnable).
#[test]
fn megatron_core_with_fixed_tp_plans_at_a_split_it_takes() {
    let out = temp_dir("framework").join("gpt3-tp8-megatron-core.json");
    let o = out.display().to_string();
    meshplan(&[
        "plan",
        "models/gpt3-175b.yaml",
        "topologies/dgx-a100-80g.yaml",
        "--nodes",
        "480",
        "--config",
        "tp=8",
        "--framework",
        "megatron-core",
        "-o",
        &o,
        "--quiet",
    ])
    .expect_code(0);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("plan")).expect("json");
    let split: Vec<u64> = serde_json::from_value(v["layer_split"].clone()).expect("split");
    let pp = v["strategy"]["pp"].as_u64().expect("pp") as usize;
    assert_eq!(split.len(), pp);
    assert_eq!(split.iter().sum::<u64>(), 96);
    assert!(
        split[1..pp - 1].windows(2).all(|w| w[0] == w[1]),
        "only the ends may differ: {split:?}"
    );
    check_runnable(&out, "megatron-core");
}

/// bigscience/bloom's config.json, the keys that shape the model.
const BLOOM: &str = r#"{"apply_residual_connection_post_layernorm": false, "attention_dropout": 0.0,
    "hidden_dropout": 0.0, "layer_norm_epsilon": 1e-05, "model_type": "bloom", "n_embed": 14336,
    "n_layer": 70, "num_attention_heads": 112, "torch_dtype": "bfloat16", "vocab_size": 250880}"#;

#[test]
fn alibi_runs_where_a_framework_has_it_with_the_kernel_it_has() {
    let dir = temp_dir("framework-alibi");
    let model = dir.join("bloom.json");
    std::fs::write(&model, BLOOM).expect("write config");
    let m = model.display().to_string();
    let on = |framework: &str, cmd: &str, extra: &[&str]| {
        let out = dir.join(format!("{framework}.json")).display().to_string();
        let mut args = vec![
            cmd,
            &m,
            "topologies/dgx-a100-80g.yaml",
            "--nodes",
            "48",
            "--seq-len",
            "2048",
            "--global-batch",
            "1536",
            "--framework",
            framework,
        ];
        if cmd == "plan" {
            args.extend(["-o", &out, "--quiet"]);
        }
        args.extend(extra);
        (meshplan(&args), std::path::PathBuf::from(out))
    };
    // Megatron-DeepSpeed runs ALiBi in its fused softmax over the materialised
    // scores: the search keeps to that kernel, and the export asks for ALiBi.
    let (run, plan) = on("megatron-deepspeed", "plan", &[]);
    run.expect_code(0);
    assert_eq!(strategy(&plan)["attn"], "unfused");
    let p = plan.display().to_string();
    let export = meshplan(&["export", &p]);
    export.expect_code(0);
    assert!(
        export.stdout.contains("--position-embedding-type alibi"),
        "{}",
        export.stdout
    );
    // meshplan plans FlashAttention (slopes inside the kernel), faster than the
    // materialised scores on the same layout.
    let (run, plan) = on("meshplan", "plan", &[]);
    run.expect_code(0);
    assert_eq!(strategy(&plan)["attn"], "flash");
    let layout = "dp=384,zero=3,mbs=4,recompute=full";
    let step = |framework: &str, cfg: &str| {
        let (run, _) = on(framework, "estimate", &["--config", cfg, "--json"]);
        run.expect_code(0);
        let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("json");
        (
            v["step_time_s"].as_f64().expect("step time"),
            v["config"].to_string(),
        )
    };
    let (_, cfg) = step("deepspeed", layout);
    assert!(
        cfg.contains(r#""attn":"unfused""#),
        "deepspeed's default kernel: {cfg}"
    );
    let (flash, cfg) = step("meshplan", layout);
    assert!(
        cfg.contains(r#""attn":"flash""#),
        "meshplan's default kernel: {cfg}"
    );
    let (unfused, _) = step("meshplan", &format!("{layout},attn=unfused"));
    assert!(flash < unfused, "flash {flash} s vs unfused {unfused} s");
    // Asked for a kernel or a position the framework lacks: exit 2 naming both.
    let (run, _) = on(
        "deepspeed",
        "estimate",
        &["--config", &format!("{layout},attn=flash")],
    );
    run.expect_code(2);
    assert!(
        run.stderr.contains("--framework deepspeed") && run.stderr.contains("ALiBi"),
        "{}",
        run.stderr
    );
    for framework in ["megatron-core", "torchtitan"] {
        let (run, _) = on(framework, "plan", &[]);
        assert_ne!(run.code, 0);
        assert!(run.stderr.contains("ALiBi"), "{framework}: {}", run.stderr);
    }
}

#[test]
fn the_executor_refuses_alibi_rather_than_run_another_model() {
    let dir = temp_dir("framework-alibi-run");
    let model = dir.join("bloom-tiny.json");
    let tiny = BLOOM
        .replace("14336", "64")
        .replace("\"n_layer\": 70", "\"n_layer\": 2")
        .replace("112", "4")
        .replace("250880", "256")
        .replace("bfloat16", "float32");
    std::fs::write(&model, tiny).expect("write config");
    let plan = dir.join("plan.json").display().to_string();
    let m = model.display().to_string();
    meshplan(&[
        "plan",
        &m,
        "topologies/cpu-test-mesh.yaml",
        "--seq-len",
        "16",
        "--global-batch",
        "8",
        "-o",
        &plan,
        "--quiet",
    ])
    .expect_code(0);
    let run = meshplan(&["run", &plan, "--steps", "1"]);
    run.expect_code(2);
    assert!(run.stderr.contains("ALiBi"), "{}", run.stderr);
}
