//! `meshplan export`: every target against golden files on several plans, every
//! emitted option name against the names the framework's released source defines
//! (`tests/data/frameworks/*_options.txt`, extracted by the script beside them), and
//! the refusals (exit 3) of plans a target cannot express.
//!
//! `UPDATE_GOLDEN=1 cargo test --release -p meshplan-tests --test it export`
//! rewrites `tests/data/golden/export/`.

use crate::bin::{meshplan, plan_file, temp_dir, ROOT};
use std::collections::BTreeSet;
use std::path::PathBuf;

const TARGETS: [&str; 6] = [
    "megatron",
    "torchtitan",
    "torchtitan-cli",
    "deepspeed",
    "sglang",
    "vllm",
];

/// The serving workload Mixtral (a training model file) is planned for.
const INFERENCE: &str = "tests/python/exports/inference-workload.yaml";

/// A plan the goldens are made from: name, model, cluster, plan flags, and the
/// targets expected to express it (the rest refuse).
struct Case {
    name: &'static str,
    model: &'static str,
    cluster: &'static str,
    flags: &'static [&'static str],
    expressible: &'static [&'static str],
}

const CASES: &[Case] = &[
    // Megatron-LM's GPT-3 layout on 3072 A100s (dp 48 divides the batch of 1536).
    Case {
        name: "gpt3-megatron",
        model: "models/gpt3-175b.yaml",
        cluster: "topologies/dgx-a100-80g.yaml",
        flags: &[
            "--nodes",
            "384",
            "--config",
            "dp=48,tp=8,pp=8,cp=1,mbs=1,recompute=full,zero=1,sp=false,vpp=1",
        ],
        expressible: &["megatron"],
    },
    // Interleaved virtual stages, sequence parallelism, selective recomputation.
    Case {
        name: "gpt3-interleaved",
        model: "models/gpt3-175b.yaml",
        cluster: "topologies/dgx-a100-80g.yaml",
        flags: &[
            "--nodes",
            "384",
            "--config",
            "dp=48,tp=8,pp=8,cp=1,mbs=1,recompute=selective,zero=1,sp=true,vpp=2",
        ],
        expressible: &["megatron"],
    },
    // The planner's own best for GPT-3 on 3840 GPUs: 96 layers over 20 stages, an
    // uneven split Megatron-LM cannot take.
    Case {
        name: "gpt3-3840-best",
        model: "models/gpt3-175b.yaml",
        cluster: "topologies/dgx-a100-80g.yaml",
        flags: &["--nodes", "480"],
        expressible: &[],
    },
    // GPT-3 on 3840 GPUs at dp=40, which does not divide the batch of 1536.
    Case {
        name: "gpt3-3840-padded",
        model: "models/gpt3-175b.yaml",
        cluster: "topologies/dgx-a100-80g.yaml",
        flags: &[
            "--nodes",
            "480",
            "--config",
            "dp=40,tp=4,pp=12,cp=2,mbs=1,zero=1,recompute=none,sp=true,vpp=1",
        ],
        expressible: &[],
    },
    // FSDP (ZeRO-3) on one node: every training target.
    Case {
        name: "llama3-8b-fsdp",
        model: "models/llama3-8b.yaml",
        cluster: "topologies/dgx-h100.yaml",
        flags: &[
            "--config",
            "dp=8,tp=1,pp=1,cp=1,mbs=1,zero=3,recompute=full",
        ],
        expressible: &["megatron", "torchtitan", "torchtitan-cli", "deepspeed"],
    },
    // ZeRO-2, two sequences per micro-batch: torchtitan as
    // FSDP that keeps parameters gathered from forward to backward.
    Case {
        name: "llama3-8b-zero2",
        model: "models/llama3-8b.yaml",
        cluster: "topologies/dgx-h100.yaml",
        flags: &[
            "--config",
            "dp=8,tp=1,pp=1,cp=1,mbs=2,zero=2,recompute=full",
        ],
        expressible: &["megatron", "torchtitan", "torchtitan-cli", "deepspeed"],
    },
    // 3D with FSDP and sequence parallelism on 64 H100s.
    Case {
        name: "llama3-70b-3d",
        model: "models/llama3-70b.yaml",
        cluster: "topologies/dgx-h100.yaml",
        flags: &[
            "--nodes",
            "8",
            "--config",
            "dp=4,tp=8,pp=2,cp=1,mbs=1,zero=3,sp=true,recompute=selective,vpp=1",
        ],
        expressible: &["megatron", "torchtitan", "torchtitan-cli"],
    },
    // Experts over 8 ranks, ZeRO-1: torchtitan has no ZeRO-1. Planned for
    // Megatron-LM.
    Case {
        name: "mixtral-ep",
        model: "models/mixtral-8x7b.yaml",
        cluster: "topologies/dgx-h100.yaml",
        flags: &[
            "--framework",
            "megatron-core",
            "--nodes",
            "4",
            "--config",
            "dp=16,tp=2,pp=1,cp=1,ep=8,mbs=1,zero=1,sp=true,recompute=selective",
        ],
        expressible: &["megatron"],
    },
    // Serving: the planner's best deployment.
    Case {
        name: "llama3-70b-serve",
        model: "models/llama3-70b-inference.yaml",
        cluster: "topologies/h200-node.yaml",
        flags: &["--config", "tp=8,pp=1"],
        expressible: &["sglang", "vllm"],
    },
    // DP-attention: SGLang's layout, not vLLM's.
    Case {
        name: "llama3-70b-dp-attention",
        model: "models/llama3-70b-inference.yaml",
        cluster: "topologies/h200-node.yaml",
        flags: &["--config", "tp=8,pp=1,dp_attention=true"],
        expressible: &["sglang"],
    },
    // Two replicas of tp=4: data parallelism in both servers.
    Case {
        name: "llama3-70b-serve-dp",
        model: "models/llama3-70b-inference.yaml",
        cluster: "topologies/h200-node.yaml",
        flags: &["--config", "tp=4,pp=1,dp=2,dp_attention=false"],
        expressible: &["sglang", "vllm"],
    },
    // One tp=16 server over two nodes: per-node launch lines.
    Case {
        name: "llama3-70b-2nodes",
        model: "models/llama3-70b-inference.yaml",
        cluster: "topologies/h200-node.yaml",
        flags: &[
            "--nodes",
            "2",
            "--config",
            "tp=16,pp=1,dp=1,dp_attention=false",
        ],
        expressible: &["sglang", "vllm"],
    },
    // Mixtral served with experts over two tp=4 replicas: one SGLang server of 8
    // GPUs with two attention groups.
    Case {
        name: "mixtral-serve-ep8",
        model: "models/mixtral-8x7b.yaml",
        cluster: "topologies/h200-node.yaml",
        flags: &[
            "--workload",
            INFERENCE,
            "--config",
            "tp=4,dp=2,ep=8,dp_attention=false",
        ],
        expressible: &["sglang", "vllm"],
    },
    // The planner's own Mixtral deployment.
    Case {
        name: "mixtral-serve",
        model: "models/mixtral-8x7b.yaml",
        cluster: "topologies/h200-node.yaml",
        flags: &["--workload", INFERENCE],
        expressible: &["sglang", "vllm"],
    },
];

fn golden_dir() -> PathBuf {
    PathBuf::from(ROOT).join("tests/data/golden/export")
}

fn extension(target: &str) -> &'static str {
    match target {
        "torchtitan" => "toml",
        "torchtitan-cli" => "args",
        "deepspeed" => "json",
        _ => "args",
    }
}

/// Compares `actual` with the golden file, or rewrites it under `UPDATE_GOLDEN=1`.
#[track_caller]
fn check_golden(file: &str, actual: &str) {
    let path = golden_dir().join(file);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(golden_dir()).expect("golden dir");
        std::fs::write(&path, actual).expect("write golden");
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with UPDATE_GOLDEN=1 to create it",
            path.display()
        )
    });
    assert_eq!(
        actual,
        want,
        "{} differs (UPDATE_GOLDEN=1 rewrites it after review)",
        path.display()
    );
}

fn case_plan(c: &Case) -> PathBuf {
    let dir = temp_dir("export");
    plan_file(&dir, c.name, c.model, c.cluster, c.flags)
}

/// The export of every case to every target: stdout for those that express it,
/// the refusal for the rest, each against its golden file.
#[test]
fn every_target_on_every_plan_matches_its_golden_file() {
    let mut expressed = BTreeSet::new();
    for c in CASES {
        let plan = case_plan(c);
        let plan = plan.display().to_string();
        for t in TARGETS {
            let r = meshplan(&["export", &plan, "--to", t]);
            if c.expressible.contains(&t) {
                r.expect_code(0);
                assert!(r.stderr.is_empty(), "{}: stderr {}", r.args, r.stderr);
                check_golden(&format!("{}.{t}.{}", c.name, extension(t)), &r.stdout);
                expressed.insert(t);
            } else {
                r.expect_code(3);
                assert!(r.stdout.is_empty(), "{}: refused but printed", r.args);
                let msg = r.stderr.trim_end();
                assert!(
                    msg.starts_with(&format!("error: cannot export this plan to {t}: ")),
                    "{msg}"
                );
                // The plan file's path differs per run; the message never names it.
                check_golden(&format!("{}.{t}.refused", c.name), &format!("{msg}\n"));
            }
        }
    }
    assert_eq!(
        expressed.len(),
        TARGETS.len(),
        "every target has a golden export"
    );
}

/// The option names a framework defines, from the committed list.
fn defined(target: &str) -> (String, BTreeSet<String>) {
    let path = PathBuf::from(ROOT).join(format!("tests/data/frameworks/{target}_options.txt"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines();
    let header = lines.next().unwrap_or_default().to_string();
    (header, lines.map(str::to_string).collect())
}

/// The option names an export uses: `--flags` of an argument list, `section.key`
/// of a TOML file, top-level keys and `section.key` of a JSON config.
fn emitted(target: &str, text: &str) -> Vec<String> {
    match target {
        "torchtitan" => {
            let mut section = String::new();
            let mut out = Vec::new();
            for line in text.lines().map(str::trim) {
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                if let Some(s) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                    section = s.to_string();
                } else if let Some((k, _)) = line.split_once('=') {
                    out.push(format!("{section}.{}", k.trim()));
                } else {
                    panic!("not a TOML line: {line}");
                }
            }
            out
        }
        "deepspeed" => {
            let v: serde_json::Value = serde_json::from_str(text).expect("DeepSpeed JSON");
            let mut out = Vec::new();
            for (k, v) in v.as_object().expect("a JSON object") {
                out.push(k.clone());
                if let Some(o) = v.as_object() {
                    out.extend(o.keys().map(|k2| format!("{k}.{k2}")));
                }
            }
            out
        }
        _ => text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .map(|l| {
                let flag = l.split_whitespace().next().unwrap_or_default();
                assert!(
                    flag.starts_with("--") || flag.starts_with("activation_checkpoint:"),
                    "not an option line: {l}"
                );
                flag.to_string()
            })
            .collect(),
    }
}

/// Each option an exporter writes exists, spelled the same, in the framework's
/// released source (the version named in the list's header).
#[test]
fn every_emitted_option_is_spelled_as_the_framework_defines_it() {
    let mut checked = 0;
    // torchtitan 0.3's names are checked by its own parser
    // (tests/python/exports/test_torchtitan.py); the lists are 0.2.2's.
    for t in TARGETS.into_iter().filter(|&t| t != "torchtitan-cli") {
        let (header, names) = defined(t);
        assert!(
            header.starts_with("# ") && header.contains("extract_options.py"),
            "{t}: the list's first line names the package, version and script: {header}"
        );
        assert!(names.len() > 50, "{t}: only {} names", names.len());
        for c in CASES.iter().filter(|c| c.expressible.contains(&t)) {
            let plan = case_plan(c).display().to_string();
            let r = meshplan(&["export", &plan, "--to", t]);
            r.expect_code(0);
            let used = emitted(t, &r.stdout);
            assert!(!used.is_empty(), "{t}: nothing emitted for {}", c.name);
            for name in used {
                assert!(
                    names.contains(&name),
                    "{t} export of {} writes `{name}`, which {} does not define",
                    c.name,
                    header.trim_start_matches("# ")
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 100, "checked {checked} options");
}

/// The parser of the lists is not vacuous: names that frameworks do not define are
/// absent (another framework's spelling of the same thing among them).
#[test]
fn option_lists_reject_other_spellings() {
    for (t, wrong) in [
        ("megatron", "--tensor-parallel-size"),
        ("vllm", "--tp-size"),
        ("sglang", "--tensor-model-parallel-size"),
        ("torchtitan", "parallelism.tensor_model_parallel_size"),
        ("deepspeed", "zero_optimization.zero_stage"),
    ] {
        let (_, names) = defined(t);
        assert!(!names.contains(wrong), "{t} list contains {wrong}");
    }
}

#[track_caller]
fn refusal(case: &str, target: &str) -> String {
    let c = CASES
        .iter()
        .find(|c| c.name == case)
        .expect("a case of the table");
    let plan = case_plan(c).display().to_string();
    let r = meshplan(&["export", &plan, "--to", target]);
    r.expect_code(3);
    r.stderr
}

/// Refusals say what the framework lacks and what approximating would lose.
#[test]
fn refusals_name_what_the_target_lacks() {
    let m = refusal("gpt3-3840-padded", "megatron");
    assert!(
        m.contains("1536") && m.contains("1560") && m.contains("39 micro-batches"),
        "{m}"
    );
    let u = refusal("gpt3-3840-best", "megatron");
    assert!(
        u.contains("splits layers") && u.contains("--decoder-first"),
        "{u}"
    );
    let d = refusal("llama3-70b-3d", "deepspeed");
    assert!(
        d.contains("tp=8") && d.contains("pp=2") && d.contains("Megatron-DeepSpeed"),
        "{d}"
    );
    let t = refusal("mixtral-ep", "torchtitan");
    assert!(
        t.contains("no ZeRO-1") && t.contains("zero=0, zero=2 or zero=3"),
        "{t}"
    );
    let s = refusal("llama3-8b-zero2", "sglang");
    assert!(
        s.contains("training plan") && s.contains("--to megatron"),
        "{s}"
    );
    let v = refusal("llama3-70b-dp-attention", "vllm");
    assert!(
        v.contains("dp_attention") && v.contains("--to sglang"),
        "{v}"
    );
    let i = refusal("llama3-70b-serve", "torchtitan");
    assert!(i.contains("inference plan"), "{i}");
}

/// `-o FILE` writes what stdout would show; bad input exits 2 naming what is wrong.
#[test]
fn output_file_and_bad_input() {
    let c = CASES
        .iter()
        .find(|c| c.name == "llama3-8b-fsdp")
        .expect("the FSDP case");
    let plan = case_plan(c).display().to_string();
    let out = temp_dir("export").join("llama.toml");
    let out_s = out.display().to_string();
    let to_stdout = meshplan(&["export", &plan, "--to", "torchtitan"]);
    meshplan(&["export", &plan, "--to", "torchtitan", "-o", &out_s]).expect_code(0);
    assert_eq!(
        std::fs::read_to_string(&out).expect("written"),
        to_stdout.stdout
    );

    let r = meshplan(&["export", &plan, "--to", "colossalai"]);
    r.expect_code(2);
    assert!(
        r.stderr.contains("--to colossalai")
            && r.stderr
                .contains("megatron, torchtitan, torchtitan-cli, deepspeed, sglang, vllm"),
        "{}",
        r.stderr
    );
    let r = meshplan(&["export", "no/such/plan.json", "--to", "megatron"]);
    r.expect_code(2);
    assert!(r.stderr.contains("no/such/plan.json"), "{}", r.stderr);
    let r = meshplan(&["export", "models/gpt3-175b.yaml", "--to", "megatron"]);
    r.expect_code(2);
    assert!(
        r.stderr.contains("models/gpt3-175b.yaml") && r.stderr.contains("not a plan"),
        "{}",
        r.stderr
    );
}

/// A plan without the recorded architecture (an older plan file) cannot give
/// Megatron its model arguments: refused with the fix, not guessed.
#[test]
fn a_plan_without_its_architecture_is_refused_for_megatron() {
    let c = CASES
        .iter()
        .find(|c| c.name == "llama3-8b-fsdp")
        .expect("the FSDP case");
    let plan = case_plan(c);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).expect("plan")).expect("json");
    let model = v
        .get_mut("model")
        .and_then(|m| m.as_object_mut())
        .expect("model");
    assert!(model.remove("transformer").is_some(), "plans record it");
    let old = temp_dir("export").join("old-plan.json");
    std::fs::write(&old, serde_json::to_vec(&v).expect("json")).expect("write");
    let old = old.display().to_string();
    let r = meshplan(&["export", &old, "--to", "megatron"]);
    r.expect_code(3);
    assert!(
        r.stderr.contains("architecture") && r.stderr.contains("re-plan"),
        "{}",
        r.stderr
    );
    // Targets that need no model shape still export it.
    meshplan(&["export", &old, "--to", "deepspeed"]).expect_code(0);
}

/// DeepSeek-V3's architecture (multi-latent attention, a shared expert, dense first
/// layers) as Megatron model arguments. Its own plans do not lower yet, so the
/// architecture is put into a Mixtral plan of the same kind (experts over 8 ranks):
/// the exporter reads the shape from `model.transformer` and nothing else.
#[test]
fn deepseek_v3_architecture_as_megatron_arguments() {
    struct Exported {
        stdout: String,
    }
    let spec = meshplan_ir::load_model(
        &PathBuf::from(ROOT).join("models/deepseek-v3.yaml"),
        &meshplan_ir::WorkloadOverrides::default(),
    )
    .expect("DeepSeek-V3 loads");
    let t = spec.transformer().expect("a transformer").clone();
    let c = CASES
        .iter()
        .find(|c| c.name == "mixtral-ep")
        .expect("the Mixtral case");
    let plan = case_plan(c);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).expect("plan")).expect("json");
    v["model"]["transformer"] = serde_json::to_value(&t).expect("spec");
    v["model"]["layers"] = serde_json::json!(t.layers);
    // The spliced plan is inconsistent (DeepSeek's blocks over Mixtral's programs),
    // so `meshplan export` refuses it as tampered; the exporter reads only the
    // architecture and the strategy, which the library call shows.
    let plan: meshplan_ir::plan::Plan = serde_json::from_value(v).expect("plan");
    let stdout = meshplan_export::export(&plan, meshplan_export::Target::Megatron)
        .expect("Megatron takes DeepSeek-V3's architecture");
    let r = Exported { stdout };
    let (_, names) = defined("megatron");
    for name in emitted("megatron", &r.stdout) {
        assert!(names.contains(&name), "megatron does not define {name}");
    }
    for line in [
        "--multi-latent-attention",
        "--q-lora-rank 1536",
        "--kv-lora-rank 512",
        "--qk-head-dim 128",
        "--qk-pos-emb-head-dim 64",
        "--v-head-dim 128",
        "--num-experts 256",
        "--moe-router-topk 8",
        "--moe-shared-expert-intermediate-size 2048",
        "--moe-layer-freq ([0]*3+[1]*58)",
    ] {
        assert!(
            r.stdout.lines().any(|l| l == line),
            "missing `{line}`:\n{}",
            r.stdout
        );
    }
    assert!(
        !r.stdout.contains("--group-query-attention"),
        "MLA is not GQA"
    );
    check_golden("deepseek-v3-arch.megatron.args", &r.stdout);
}

/// The export of one case to one target (exit 0).
#[track_caller]
fn exported(case: &str, target: &str) -> String {
    let c = CASES
        .iter()
        .find(|c| c.name == case)
        .expect("a case of the table");
    let plan = case_plan(c).display().to_string();
    let r = meshplan(&["export", &plan, "--to", target]);
    r.expect_code(0);
    r.stdout
}

fn has_line(text: &str, line: &str) -> bool {
    text.lines().any(|l| l == line)
}

/// Megatron-FSDP (ZeRO-2/3) saves only `fsdp_dtensor` checkpoints; validate_args
/// refuses it without `--ckpt-format fsdp_dtensor`, and refuses
/// CUDA_DEVICE_MAX_CONNECTIONS=1 with it.
#[test]
fn megatron_fsdp_exports_its_checkpoint_format() {
    for case in ["llama3-8b-fsdp", "llama3-8b-zero2", "llama3-70b-3d"] {
        let m = exported(case, "megatron");
        assert!(has_line(&m, "--use-megatron-fsdp"), "{m}");
        assert!(has_line(&m, "--ckpt-format fsdp_dtensor"), "{m}");
        assert!(!m.contains("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun"), "{m}");
        assert!(m.contains("leave CUDA_DEVICE_MAX_CONNECTIONS unset"), "{m}");
    }
    let m = exported("gpt3-megatron", "megatron");
    assert!(!m.contains("--ckpt-format"), "{m}");
}

/// Tensor or context parallelism without FSDP: validate_args (before Blackwell)
/// requires CUDA_DEVICE_MAX_CONNECTIONS=1, which the launch line sets; a multi-node
/// launch line names the node rank and the master address.
#[test]
fn megatron_launch_line_sets_cuda_device_max_connections() {
    for case in ["gpt3-megatron", "gpt3-interleaved", "mixtral-ep"] {
        let m = exported(case, "megatron");
        let launch = m
            .lines()
            .find(|l| l.contains("torchrun"))
            .expect("a launch line");
        assert!(
            launch.starts_with("# CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nnodes "),
            "{launch}"
        );
        assert!(
            launch.contains("--node-rank $NODE_RANK --master-addr $MASTER_ADDR"),
            "{launch}"
        );
    }
    // dp only, one node: neither.
    let m = exported("llama3-8b-fsdp", "megatron");
    assert!(
        m.contains("# torchrun --nnodes 1 --nproc-per-node 8 pretrain_gpt.py"),
        "{m}"
    );
}

/// torchtitan 0.3 reads no TOML: `--to torchtitan-cli` writes its command-line
/// overrides, every degree explicit, the activation checkpointing as the last word,
/// and CUDA graphs off under pipeline parallelism (0.3 refuses them there).
#[test]
fn torchtitan_0_3_command_line() {
    let t = exported("llama3-70b-3d", "torchtitan-cli");
    assert!(!t.contains('['), "no TOML sections: {t}");
    for line in [
        "--parallelism.data_parallel_replicate_degree 1",
        "--parallelism.data_parallel_shard_degree 4",
        "--parallelism.fsdp_reshard_after_forward always",
        "--parallelism.tensor_parallel_degree 8",
        "--parallelism.enable_sequence_parallel",
        "--parallelism.pipeline_parallel_degree 2",
        "--parallelism.pipeline_parallel_layers_per_stage 40",
        "--training.disable_cuda_graphs",
        "--compile.no-enable-async-tensor-parallel",
    ] {
        assert!(has_line(&t, line), "missing `{line}`:\n{t}");
    }
    assert_eq!(
        t.lines().last(),
        Some("activation_checkpoint:selective"),
        "{t}"
    );
    assert!(t.contains("--module MODULE --config CONFIG"), "{t}");
    let f = exported("llama3-8b-fsdp", "torchtitan-cli");
    assert!(!f.contains("--training.disable_cuda_graphs"), "{f}");
    assert_eq!(f.lines().last(), Some("activation_checkpoint:full"), "{f}");
    // The same refusals as the TOML.
    let r = refusal("mixtral-ep", "torchtitan-cli");
    assert!(r.contains("no ZeRO-1"), "{r}");
}

/// Experts over two tp=4 replicas: SGLang's --ep-size must divide its --tp-size
/// (MoE TP = tp / ep would be 0), so the export is one 8-GPU server with two
/// attention groups of 4, which SGLang runs with whole experts per GPU.
#[test]
fn sglang_ep_over_replicas_is_one_server_with_attention_groups() {
    let s = exported("mixtral-serve-ep8", "sglang");
    for line in ["--tp-size 8", "--attn-dp-size 2", "--ep-size 8"] {
        assert!(has_line(&s, line), "missing `{line}`:\n{s}");
    }
    assert!(!s.contains("--dp-size"), "{s}");
    // 64 requests over 2 attention groups: 32 each, so 64 for the server (SGLang
    // gives each group max_running_requests // attn_dp_size).
    assert!(has_line(&s, "--max-running-requests 64"), "{s}");
    // The planner's own Mixtral deployment exports too: tp=8, since experts over
    // both tp and ep gather their tensor ranks' token slices, which tp=8 does not.
    let own = exported("mixtral-serve", "sglang");
    assert!(has_line(&own, "--tp-size 8"), "{own}");
    assert!(!own.contains("--ep-size"), "{own}");
}

/// SGLang applies --max-running-requests to each --dp-size replica: the plan's
/// concurrency is split over them.
#[test]
fn sglang_max_running_requests_is_per_replica() {
    let s = exported("llama3-70b-serve-dp", "sglang");
    assert!(has_line(&s, "--dp-size 2"), "{s}");
    assert!(has_line(&s, "--max-running-requests 32"), "{s}");
    let s = exported("llama3-70b-serve", "sglang");
    assert!(has_line(&s, "--max-running-requests 64"), "{s}");
}

/// A server over two nodes: one launch line per node with its --node-rank, and
/// --dist-init-addr from an environment variable the user sets on every node.
#[test]
fn sglang_multi_node_has_per_node_launch_lines() {
    let s = exported("llama3-70b-2nodes", "sglang");
    assert!(has_line(&s, "--nnodes 2"), "{s}");
    assert!(s.contains("set SGLANG_DIST_INIT_ADDR=HOST:PORT"), "{s}");
    for i in 0..2 {
        assert!(
            s.lines().any(|l| l.starts_with(&format!("# node {i}: "))
                && l.ends_with(&format!(
                    "--node-rank {i} --dist-init-addr $SGLANG_DIST_INIT_ADDR"
                ))),
            "node {i}:\n{s}"
        );
    }
}
