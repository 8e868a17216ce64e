//! `meshplan explain`: the alternatives are re-priced by the same cost model (each
//! number is an `estimate` difference), the deciding term is named with its numbers,
//! and an axis that leaves the node is reported as crossing InfiniBand.

use crate::bin::{meshplan, plan_file, temp_dir};
use serde_json::Value;
use std::path::{Path, PathBuf};

const GPT3: &str = "models/gpt3-175b.yaml";
const A100: &str = "topologies/dgx-a100-80g.yaml";
/// Megatron-LM's GPT-3 layout on 3840 A100s (Narayanan et al. 2021).
const MEGATRON_CFG: &str = "dp=60,tp=8,pp=8,cp=1,mbs=1,recompute=full,zero=1,sp=false,vpp=1";

fn gpt3_plan() -> PathBuf {
    plan_file(
        &temp_dir("explain"),
        "gpt3-megatron-3840",
        GPT3,
        A100,
        &["--nodes", "480", "--config", MEGATRON_CFG],
    )
}

#[track_caller]
fn num(v: &Value, path: &str) -> f64 {
    v.pointer(path)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{path} missing in {v}"))
}

/// `meshplan estimate` of one configuration from the model and cluster files: a
/// path independent of the plan file.
fn estimate(cfg: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "estimate", GPT3, A100, "--nodes", "480", "--config", cfg, "--json",
    ];
    args.extend_from_slice(extra);
    meshplan(&args).expect_code(0).json()
}

fn explanation(plan: &Path) -> Value {
    let p = plan.display().to_string();
    meshplan(&["explain", &p, "--json"]).expect_code(0).json()
}

#[track_caller]
fn alternative<'a>(x: &'a Value, change_prefix: &str) -> &'a Value {
    x["alternatives"]
        .as_array()
        .expect("alternatives")
        .iter()
        .find(|a| {
            a["change"]
                .as_str()
                .is_some_and(|c| c.starts_with(change_prefix))
        })
        .unwrap_or_else(|| panic!("no alternative `{change_prefix}` in {}", x["alternatives"]))
}

#[track_caller]
fn close(a: f64, b: f64, what: &str) {
    assert!(
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-3),
        "{what}: {a} != {b}"
    );
}

#[test]
fn tp16_on_gpt3_3840_crosses_infiniband_and_is_slower_by_the_estimate_difference() {
    let x = explanation(&gpt3_plan());
    let base = estimate(MEGATRON_CFG, &[]);
    let base_step = num(&base, "/step_time_s");
    close(num(&x, "/baseline/step_time_s"), base_step, "baseline");
    close(num(&x, "/recorded_step_time_s"), base_step, "recorded");

    let tp16 = alternative(&x, "tp 8->16");
    assert_eq!(tp16["crosses_infiniband"], serde_json::json!(["tp"]));
    let alt = estimate(tp16["strategy"].as_str().expect("strategy"), &[]);
    let delta = num(&alt, "/step_time_s") - base_step;
    assert!(delta > 0.0, "tp=16 is slower: {delta}");
    close(num(tp16, "/delta_s"), delta, "tp=16 delta");
    close(
        num(tp16, "/delta_pct"),
        100.0 * delta / base_step,
        "tp=16 delta %",
    );
    let comm =
        num(&alt, "/time_breakdown_s/exposed_comm") - num(&base, "/time_breakdown_s/exposed_comm");
    close(
        num(tp16, "/term_deltas_s/exposed_comm"),
        comm,
        "exposed comm delta",
    );
    // Exposed communication decides it, with the number in the sentence.
    let deciding = tp16["deciding"].as_str().expect("deciding");
    assert!(
        deciding.starts_with("tp=16 would cross InfiniBand: exposed communication")
            && deciding.contains(&format!("{comm:+.3} s"))
            && deciding.contains(&format!("{:+.1}%", 100.0 * comm / base_step)),
        "{deciding}"
    );
    // tp halved stays inside the node.
    let tp4 = alternative(&x, "tp 8->4");
    assert_eq!(tp4["crosses_infiniband"], serde_json::json!([]));
    // Sensitivity is the same difference.
    let sens = x["sensitivity"]
        .as_array()
        .expect("sensitivity")
        .iter()
        .find(|s| s["key"] == "tp")
        .expect("tp sensitivity");
    close(
        num(sens, "/doubled_pct"),
        num(tp16, "/delta_pct"),
        "sensitivity",
    );
    close(num(sens, "/halved_pct"), num(tp4, "/delta_pct"), "halved");
}

#[test]
fn alternatives_are_ranked_and_what_ifs_are_estimates() {
    let x = explanation(&gpt3_plan());
    let alts = x["alternatives"].as_array().expect("alternatives");
    assert!(alts.len() >= 10, "{} alternatives", alts.len());
    // (0 for feasible, step time): sorted means feasible first, then by step time.
    let keys: Vec<(u8, f64)> = alts
        .iter()
        .map(|a| (u8::from(a["feasible"] == false), num(a, "/step_time_s")))
        .collect();
    assert!(
        keys.windows(2)
            .all(|w| w[0].0 < w[1].0 || (w[0].0 == w[1].0 && w[0].1 <= w[1].1)),
        "feasible first, then by step time: {keys:?}"
    );
    // Full recomputation is what Megatron's layout pays for memory; the cost model
    // says dropping it is the largest single gain, and that compute decides it.
    let first = &alts[0];
    assert!(
        first["change"]
            .as_str()
            .is_some_and(|c| c.starts_with("recompute full->")),
        "{first}"
    );
    assert!(
        first["deciding"]
            .as_str()
            .is_some_and(|d| d.starts_with("compute -")),
        "{first}"
    );
    let base_step = num(&x, "/baseline/step_time_s");
    let longer = x["what_if"]
        .as_array()
        .expect("what_if")
        .iter()
        .find(|a| {
            a["change"]
                .as_str()
                .is_some_and(|c| c.starts_with("sequence 2048->4096"))
        })
        .expect("a longer sequence");
    let est = estimate(MEGATRON_CFG, &["--seq-len", "4096"]);
    close(
        num(longer, "/delta_s"),
        num(&est, "/step_time_s") - base_step,
        "sequence x2",
    );
    let bigger_mbs = x["what_if"]
        .as_array()
        .expect("what_if")
        .iter()
        .find(|a| a["change"] == "micro-batch 1->2")
        .expect("a larger micro-batch");
    let est = estimate(&MEGATRON_CFG.replace("mbs=1", "mbs=2"), &[]);
    close(
        num(bigger_mbs, "/step_time_s"),
        num(&est, "/step_time_s"),
        "mbs x2",
    );
    let nodes = x["what_if"]
        .as_array()
        .expect("what_if")
        .iter()
        .find(|a| {
            a["change"]
                .as_str()
                .is_some_and(|c| c.contains("more node"))
        })
        .expect("more nodes");
    // tp x pp = 64 GPUs = 8 nodes: the fewest added nodes that keep dp whole.
    assert!(
        nodes["change"]
            .as_str()
            .is_some_and(|c| c.starts_with("8 more nodes") && c.contains("dp 60->61")),
        "{nodes}"
    );
}

#[test]
fn human_text_names_the_crossing_and_json_is_one_object() {
    let plan = gpt3_plan().display().to_string();
    let r = meshplan(&["explain", &plan, "--top", "20"]);
    r.expect_code(0);
    assert!(
        r.stdout
            .contains("tp=16 would cross InfiniBand: exposed communication +"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("sensitivity of step time"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("what if:"), "{}", r.stdout);
    // --json: nothing but the object on stdout.
    let j = meshplan(&["explain", &plan, "--json"]);
    j.expect_code(0);
    assert!(j.json().is_object());
}

#[test]
fn inference_plans_rank_by_tokens_per_second() {
    let plan = plan_file(
        &temp_dir("explain"),
        "llama70b-serve",
        "models/llama3-70b-inference.yaml",
        "topologies/h200-node.yaml",
        &["--config", "tp=8,pp=1"],
    );
    let x = explanation(&plan);
    assert_eq!(x["kind"], "inference");
    let feasible: Vec<f64> = x["alternatives"]
        .as_array()
        .expect("alternatives")
        .iter()
        .filter(|a| a["feasible"] == true)
        .map(|a| num(a, "/tokens_per_s"))
        .collect();
    assert!(!feasible.is_empty());
    assert!(
        feasible.windows(2).all(|w| w[0] >= w[1]),
        "most tokens/s first: {feasible:?}"
    );
    let dpa = alternative(&x, "dp_attention false->true");
    assert!(
        dpa["deciding"].as_str().is_some_and(|d| d.contains("TPOT")),
        "{dpa}"
    );
}

#[test]
fn bad_plans_exit_2_with_the_fix() {
    let r = meshplan(&["explain", "no/such/plan.json"]);
    r.expect_code(2);
    assert!(r.stderr.contains("no/such/plan.json"), "{}", r.stderr);
    // A plan written before plans recorded their cluster's links.
    let plan = gpt3_plan();
    let mut v: Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).expect("plan")).expect("json");
    v["cluster"]
        .as_object_mut()
        .expect("cluster")
        .remove("spec")
        .expect("plans record the cluster");
    let old = temp_dir("explain").join("old.json");
    std::fs::write(&old, serde_json::to_vec(&v).expect("json")).expect("write");
    let old = old.display().to_string();
    let r = meshplan(&["explain", &old]);
    r.expect_code(2);
    assert!(
        r.stderr.contains(&old) && r.stderr.contains("re-plan"),
        "{}",
        r.stderr
    );
}

/// Logs: `--quiet` leaves only the result, the default adds the search summary,
/// `-v` adds debug detail, and `--quiet -v` is a bad flag (exit 2).
#[test]
fn quiet_and_verbose_control_the_logs() {
    let dir = temp_dir("explain");
    let out = dir.join("logs.json").display().to_string();
    let run = |extra: &[&str]| {
        let mut a = vec![
            "plan",
            "models/tiny-gpt.yaml",
            "topologies/cpu-test-mesh.yaml",
            "-o",
            out.as_str(),
        ];
        a.extend_from_slice(extra);
        meshplan(&a)
    };
    let quiet = run(&["--quiet"]);
    quiet.expect_code(0);
    assert!(!quiet.stderr.contains("searched"), "{}", quiet.stderr);
    let normal = run(&[]);
    normal.expect_code(0);
    assert!(
        normal.stderr.contains("INFO") && normal.stderr.contains("searched"),
        "{}",
        normal.stderr
    );
    assert!(!normal.stderr.contains("DEBUG"), "{}", normal.stderr);
    let verbose = run(&["-v"]);
    verbose.expect_code(0);
    assert!(
        verbose.stderr.contains("DEBUG") && verbose.stderr.contains("layers"),
        "{}",
        verbose.stderr
    );
    run(&["--quiet", "-v"]).expect_code(2);
}

/// The search and explain price with the same functions: no neighbour of the
/// planner's own best for GPT-3 on 3840 GPUs that the search space holds (tensor
/// parallelism inside a node) is faster.
#[test]
fn the_planners_best_has_no_faster_neighbour() {
    let plan = plan_file(
        &temp_dir("explain"),
        "gpt3-best-3840",
        GPT3,
        A100,
        &["--nodes", "480"],
    );
    let x = explanation(&plan);
    let base = num(&x, "/baseline/step_time_s");
    let mut compared = 0;
    for a in x["alternatives"].as_array().expect("alternatives") {
        let s = a["strategy"].as_str().expect("strategy");
        let tp: u64 = s
            .split(',')
            .find_map(|kv| kv.strip_prefix("tp="))
            .and_then(|v| v.parse().ok())
            .expect("tp");
        if a["feasible"] == true && tp <= 8 {
            assert!(
                num(a, "/step_time_s") >= base * (1.0 - 1e-9),
                "{} is faster than the plan's {base} s: {a}",
                a["change"]
            );
            compared += 1;
        }
    }
    assert!(compared >= 8, "compared {compared} neighbours");
}
