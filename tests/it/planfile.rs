//! Tampered and stale plan files exit 2 naming the field and the fix, through the
//! binary, for every command that reads a plan (issue 16, items 13 and 14). Each case
//! is one of the issue's: before the validator they divided by zero, indexed out of
//! range, aborted on an allocation, or ran with exit 0 and a wrong result.

use crate::bin::{meshplan, plan_file, temp_dir, ROOT};
use serde_json::Value;
use std::path::{Path, PathBuf};

const MODEL: &str = "models/tiny-gpt.yaml";
const MESH: &str = "topologies/cpu-test-mesh.yaml";

/// The 8-rank plan (dp=2, tp=2, pp=2) every case edits.
fn base(dir: &Path) -> Value {
    let p = plan_file(dir, "base", MODEL, MESH, &["--config", "dp=2,tp=2,pp=2"]);
    serde_json::from_str(&std::fs::read_to_string(p).expect("read plan")).expect("plan json")
}

/// `base` with `edit` applied, written to `dir/name.json`.
fn edited(dir: &Path, name: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let mut v = base(dir);
    edit(&mut v);
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, v.to_string()).expect("write plan");
    path
}

fn set(v: &mut Value, pointer: &str, x: Value) {
    *v.pointer_mut(pointer)
        .unwrap_or_else(|| panic!("no `{pointer}` in the plan")) = x;
}

/// Runs `meshplan ARGS PLAN` and wants exit 2 naming `field` and the fix.
#[track_caller]
fn refused(args: &[&str], plan: &Path, field: &str) {
    let p = plan.display().to_string();
    let mut all: Vec<&str> = args.to_vec();
    all.insert(1, &p);
    let r = meshplan(&all);
    r.expect_code(2);
    assert!(
        r.stderr.contains(&format!("field `{field}`"))
            && r.stderr.contains("re-run `meshplan plan`"),
        "meshplan {}: wanted field `{field}` and the fix named:\n{}",
        r.args,
        r.stderr
    );
}

/// The JSON pointer of the first attention op's `kv_heads` in the block segment.
fn attention_op(v: &Value) -> String {
    let ops = v
        .pointer("/graph/segments/1/ops")
        .and_then(Value::as_array)
        .expect("ops");
    let i = ops
        .iter()
        .position(|o| o.pointer("/kind/attention").is_some())
        .expect("an attention op");
    format!("/graph/segments/1/ops/{i}/kind/attention/kv_heads")
}

#[test]
fn r16_mbs_zero_is_refused_by_explain_and_export_not_divided_by() {
    let dir = temp_dir("planfile");
    let p = edited(&dir, "mbs0", |v| set(v, "/strategy/mbs", 0.into()));
    refused(&["explain"], &p, "strategy.mbs");
    refused(&["export", "--to", "megatron"], &p, "strategy.mbs");
    refused(
        &["draw", "-o", &dir.join("fig").display().to_string()],
        &p,
        "strategy.mbs",
    );
}

#[test]
fn r16_graph_ids_and_heads_out_of_range_are_named() {
    let dir = temp_dir("planfile");
    let p = edited(&dir, "input-range", |v| {
        set(v, "/graph/segments/1/ops/1/inputs/0", 999.into())
    });
    refused(
        &["run", "--steps", "1"],
        &p,
        "graph.segments[1].ops[1].inputs[0]",
    );
    refused(&["explain"], &p, "graph.segments[1].ops[1].inputs[0]");

    let p = edited(&dir, "kv0", |v| {
        set(v, "/model/transformer/kv_heads", 0.into())
    });
    refused(
        &["export", "--to", "megatron"],
        &p,
        "model.transformer.kv_heads",
    );
    let pointer = attention_op(&base(&dir));
    let p = edited(&dir, "graph-kv0", |v| set(v, &pointer, 0.into()));
    let op = pointer.split('/').nth(5).expect("op index");
    refused(
        &["run", "--steps", "1"],
        &p,
        &format!("graph.segments[1].ops[{op}].kind.attention.kv_heads"),
    );

    // A program naming an input the op does not read.
    let p = edited(&dir, "instr-input", |v| {
        set(
            v,
            "/programs/0/phases/0/chunks/0/forward/0/body/0/inputs/1/tensor",
            "block.norm1.w".into(),
        )
    });
    refused(
        &["run", "--steps", "1"],
        &p,
        "programs[0].phases[0].chunks[0].forward[0].body[0].inputs[1].tensor",
    );
}

#[test]
fn r16_ranks_coords_and_mesh_must_agree() {
    let dir = temp_dir("planfile");
    let p = edited(&dir, "coords", |v| set(v, "/ranks/3/coords/3", 7.into()));
    refused(&["run", "--steps", "1"], &p, "ranks[3].coords[3]");
    let p = edited(&dir, "coords-swap", |v| {
        set(v, "/ranks/3/coords", serde_json::json!([0, 1, 0, 0]))
    });
    refused(&["run", "--steps", "1"], &p, "ranks[3].coords[3]");
    // 16 ranks' worth of mesh over the 8 ranks the table holds.
    let p = edited(&dir, "shape", |v| {
        set(v, "/mesh/shape", serde_json::json!([2, 2, 1, 4]))
    });
    refused(&["run", "--steps", "1"], &p, "mesh.shape");
    // The strategy says dp=4 while the mesh and the programs run dp=2.
    let p = edited(&dir, "dp4", |v| set(v, "/strategy/dp", 4.into()));
    refused(&["run", "--steps", "1"], &p, "strategy.dp");
    refused(&["export", "--to", "megatron"], &p, "strategy.dp");
    // No ranks: it "trained" at inf tokens/s.
    let p = edited(&dir, "noranks", |v| set(v, "/ranks", serde_json::json!([])));
    refused(&["run", "--steps", "1"], &p, "ranks");
    let p = edited(&dir, "zero7", |v| set(v, "/strategy/zero", 7.into()));
    refused(&["run", "--steps", "1"], &p, "strategy.zero");
    refused(&["export", "--to", "deepspeed"], &p, "strategy.zero");
    let p = edited(&dir, "group", |v| set(v, "/mesh/groups/0/size", 5.into()));
    refused(&["run", "--steps", "1"], &p, "mesh.groups[0].size");
}

#[test]
fn r16_workload_sizes_are_bounded_and_consistent() {
    let dir = temp_dir("planfile");
    // These aborted on allocation; both are beyond the loader's DIM_MAX (2^24).
    let p = edited(&dir, "seq1e9", |v| {
        set(v, "/workload/seq_len", 1_000_000_000u64.into())
    });
    refused(&["run", "--steps", "1"], &p, "workload.seq_len");
    let p = edited(&dir, "gb1e15", |v| {
        set(v, "/workload/global_batch", 1_000_000_000_000_000u64.into())
    });
    refused(&["run", "--steps", "1"], &p, "workload.global_batch");
    refused(&["explain"], &p, "workload.global_batch");
    let p = edited(&dir, "gb0", |v| set(v, "/workload/global_batch", 0.into()));
    refused(&["run", "--steps", "1"], &p, "workload.global_batch");
    // Within the limit, but not what the programs were lowered for.
    let p = edited(&dir, "seq64", |v| set(v, "/workload/seq_len", 64.into()));
    refused(
        &["run", "--steps", "1"],
        &p,
        "programs[0].phases[0].dims.seq",
    );
    // A plan claiming few parameters would slip under run's host-memory budget.
    let p = edited(&dir, "params", |v| set(v, "/model/params", 1.into()));
    refused(&["run", "--steps", "1"], &p, "model.params");
}

#[test]
fn r16_a_stale_format_or_a_fifo_is_refused_with_exit_2() {
    let dir = temp_dir("planfile");
    let p = edited(&dir, "format2", |v| set(v, "/format", 2.into()));
    let r = meshplan(&["explain", &p.display().to_string()]);
    r.expect_code(2);
    assert!(
        r.stderr.contains("plan format 2 is not supported") && r.stderr.contains("meshplan plan"),
        "{}",
        r.stderr
    );
    #[cfg(unix)]
    {
        let fifo = dir.join("fifo.json");
        let _ = std::fs::remove_file(&fifo);
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            for args in [
                &["run"][..],
                &["explain"],
                &["export", "--to", "vllm"],
                &["draw"],
            ] {
                let mut all = args.to_vec();
                let f = fifo.display().to_string();
                all.insert(1, &f);
                let r = meshplan(&all);
                r.expect_code(2);
                assert!(r.stderr.contains("a FIFO"), "{}: {}", r.args, r.stderr);
            }
        }
    }
    // The untouched plan still runs.
    let ok = plan_file(&dir, "base", MODEL, MESH, &["--config", "dp=2,tp=2,pp=2"]);
    meshplan(&["run", &ok.display().to_string(), "--steps", "1"]).expect_code(0);
    let _ = ROOT;
}

/// Item 14: user numbers that wrapped or ran away are refused at once, naming the
/// field and the limit.
#[test]
fn r16_huge_clusters_threads_and_deep_yaml_exit_2_at_once() {
    let dir = temp_dir("planfile");
    let t = std::time::Instant::now();
    // 2^61 nodes of 8 GPUs wrapped to "0 GPUs".
    let r = meshplan(&["plan", MODEL, MESH, "--nodes", "2305843009213693952"]);
    r.expect_code(2);
    assert!(
        r.stderr.contains("`--nodes`") && r.stderr.contains("1048576 GPUs"),
        "{}",
        r.stderr
    );
    // u64::MAX nodes looped forever in the divisor search (`d * d` wrapped).
    let text = std::fs::read_to_string(format!("{ROOT}/{MESH}")).expect("mesh");
    let huge: String = text
        .lines()
        .map(|l| {
            if l.starts_with("nodes:") {
                "nodes: 18446744073709551615"
            } else {
                l
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let cluster = dir.join("huge-cluster.yaml");
    std::fs::write(&cluster, huge).expect("write cluster");
    let r = meshplan(&["plan", MODEL, &cluster.display().to_string()]);
    r.expect_code(2);
    assert!(
        r.stderr.contains("field `nodes`") && r.stderr.contains("limit"),
        "{}",
        r.stderr
    );
    // 100,000 kernel threads per rank aborted after 25 s.
    let ok = plan_file(&dir, "base", MODEL, MESH, &["--config", "dp=2,tp=2,pp=2"]);
    let r = meshplan(&["run", &ok.display().to_string(), "--threads", "100000"]);
    r.expect_code(2);
    assert!(
        r.stderr.contains("--threads 100000") && r.stderr.contains("1024"),
        "{}",
        r.stderr
    );
    // 100,000 nested flow collections took the YAML parser 24 s.
    let n = 100_000;
    let deep = format!("name: x\ntransformer: {}{}\n", "[".repeat(n), "]".repeat(n));
    let model = dir.join("deep.yaml");
    std::fs::write(&model, deep).expect("write model");
    let r = meshplan(&["inspect", &model.display().to_string()]);
    r.expect_code(2);
    assert!(r.stderr.contains("more than 256 levels"), "{}", r.stderr);
    let r = meshplan(&["plan", MESH, &model.display().to_string()]);
    r.expect_code(2);
    let secs = t.elapsed().as_secs_f64();
    assert!(secs < 10.0, "the refusals took {secs:.1} s");
}
