//! One pricing path: for the same configuration, `plan --json`, the plan file's
//! `predicted` (and its timeline), `explain --json`, `estimate --json`, `compare
//! --json` and `draw`'s memory figure give identical figures, for training (an even
//! and an uneven layer split) and inference.

use crate::cli::{meshplan, temp_file};
use serde_json::Value;

fn num(v: &Value, path: &[&str]) -> f64 {
    let mut at = v;
    for p in path {
        at = &at[*p];
    }
    at.as_f64().unwrap_or_else(|| {
        panic!(
            "{path:?} is not a number in {}",
            &v.to_string()[..300.min(v.to_string().len())]
        )
    })
}

/// The figures two commands must agree on.
fn figures(e: &Value, inference: bool) -> Vec<(&'static str, f64)> {
    let mut out = vec![
        ("step_time_s", num(e, &["step_time_s"])),
        ("memory total", num(e, &["memory_per_gpu_bytes", "total"])),
        ("memory params", num(e, &["memory_per_gpu_bytes", "params"])),
        ("tp bytes", num(e, &["comm_bytes_per_gpu", "tp"])),
        ("dp bytes", num(e, &["comm_bytes_per_gpu", "dp"])),
    ];
    if inference {
        out.push(("tpot_s", num(e, &["tpot_s"])));
        out.push(("ttft_s", num(e, &["ttft_s"])));
        out.push(("output_tokens_per_s", num(e, &["output_tokens_per_s"])));
    } else {
        out.push(("tokens_per_s", num(e, &["tokens_per_s"])));
    }
    out
}

#[track_caller]
fn same(what: &str, a: &Value, b: &Value, inference: bool) {
    for ((k, x), (_, y)) in figures(a, inference).into_iter().zip(figures(b, inference)) {
        assert!(x == y, "{what}: {k} differs: {x} vs {y}");
    }
}

fn check(name: &str, model: &str, cluster: &str, extra: &[&str], inference: bool) {
    let plan_path = temp_file(&format!("consistency-{name}.json"), "");
    let path = plan_path.to_str().expect("path");
    let mut args = vec!["plan", model, cluster, "-o", path, "--json"];
    args.extend_from_slice(extra);
    let planned = meshplan(&args);
    planned.expect_code(0);
    let out = planned.json();
    let file: Value =
        serde_json::from_str(&std::fs::read_to_string(&plan_path).expect("plan")).expect("json");
    let predicted = &file["predicted"];
    same(
        "plan --json vs plan.json",
        &out["predicted"],
        predicted,
        inference,
    );
    same(
        "plan --json top[0] vs plan.json",
        &out["top"][0]["predicted"],
        predicted,
        inference,
    );

    // The timeline holds the same memory ledger as the summary.
    let worst = predicted["timeline"]["memory"]
        .as_array()
        .map(|v| v.iter().map(|m| num(m, &["total"])).fold(0.0, f64::max))
        .or_else(|| {
            predicted["timeline"]["stages"].as_array().map(|v| {
                v.iter()
                    .map(|s| num(s, &["memory", "total"]))
                    .fold(0.0, f64::max)
            })
        })
        .expect("a timeline with memory");
    assert_eq!(
        worst,
        num(predicted, &["memory_per_gpu_bytes", "total"]),
        "{name}: timeline memory"
    );

    let explained = meshplan(&["explain", path, "--json"]);
    explained.expect_code(0);
    same(
        "explain --json vs plan.json",
        &explained.json()["baseline"],
        predicted,
        inference,
    );

    // The plan's full configuration, hand-given: estimate and compare price it as
    // the search does (layer split and placements included), so the figures agree.
    let mut rest = Vec::new();
    let mut it = extra.iter();
    while let Some(a) = it.next() {
        if *a == "--config" {
            it.next();
        } else {
            rest.push(*a);
        }
    }
    let s = &file["strategy"];
    let cfg = format!(
        "dp={},tp={},pp={},cp={},ep={},mbs={},zero={},recompute={},sp={},vpp={},schedule={}{}",
        s["dp"],
        s["tp"],
        s["pp"],
        s["cp"],
        s["ep"],
        s["mbs"],
        s["zero"],
        s["recompute"].as_str().unwrap_or_default(),
        s["sp"],
        s["vpp"],
        s["schedule"].as_str().unwrap_or_default(),
        if inference {
            format!(",dp_attention={}", s["dp_attention"])
        } else {
            String::new()
        },
    );
    let cfg = if inference {
        format!(
            "dp={},tp={},pp={},ep={},dp_attention={}",
            s["dp"], s["tp"], s["pp"], s["ep"], s["dp_attention"]
        )
    } else {
        cfg
    };
    let mut eargs = vec!["estimate", model, cluster, "--config", &cfg, "--json"];
    eargs.extend_from_slice(&rest);
    let est = meshplan(&eargs);
    est.expect_code(0);
    same(
        "estimate --json vs plan.json",
        &est.json(),
        predicted,
        inference,
    );
    let mut cargs = vec!["compare", model, cluster, "--config", &cfg, "--json"];
    cargs.extend_from_slice(&rest);
    let cmp = meshplan(&cargs);
    cmp.expect_code(0);
    let rows = cmp.json()["rows"].as_array().cloned().expect("rows");
    same(
        "compare --json planner row vs plan.json",
        &rows[0]["predicted"],
        predicted,
        inference,
    );
    same(
        "compare --json hand row vs plan.json",
        &rows[1]["predicted"],
        predicted,
        inference,
    );

    // draw's memory figure prints the fullest GPU's total.
    let dir = std::env::temp_dir().join(format!(
        "meshplan-consistency-{name}-{}",
        std::process::id()
    ));
    meshplan(&["draw", path, "-o", dir.to_str().expect("dir")]).expect_code(0);
    let svg = std::fs::read_to_string(dir.join("memory.svg")).expect("memory.svg");
    let gib = format!(
        ">{:.1}<",
        num(predicted, &["memory_per_gpu_bytes", "total"]) / (1u64 << 30) as f64
    );
    assert!(svg.contains(&gib), "{name}: memory.svg lacks {gib}");
}

#[test]
fn every_command_prices_a_training_plan_the_same() {
    check(
        "llama3-8b",
        "models/llama3-8b.yaml",
        "topologies/dgx-h100.yaml",
        &[],
        false,
    );
    // An uneven split of GPT-3's 96 layers over 20 stages.
    check(
        "gpt3",
        "models/gpt3-175b.yaml",
        "topologies/dgx-a100-80g.yaml",
        &["--nodes", "480", "--config", "pp=20"],
        false,
    );
}

#[test]
fn every_command_prices_an_inference_plan_the_same() {
    check(
        "llama3-70b-inference",
        "models/llama3-70b-inference.yaml",
        "topologies/dgx-h100.yaml",
        &[],
        true,
    );
}
