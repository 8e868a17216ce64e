//! Structural fuzzing of plan.json (issue 16, item 13): real plans of every mode,
//! lowered in-process, mutated as JSON values (keys deleted, numbers replaced by 0,
//! -1, huge, fractional or strings, array elements duplicated, dropped or swapped,
//! enum and name strings exchanged), then given to what the commands do with a plan:
//! parse and validate ([`Plan::from_json`]) and, when accepted, `export` to every
//! target, `explain`, `draw`'s figures and trace, and for a few of them one step of
//! the CPU executor. Nothing may panic, in this thread or in a rank's.
//!
//! `MESHPLAN_FUZZ_CASES` sets the number of cases (default 10,000), and
//! `MESHPLAN_FUZZ_SEED` the first seed; a failure prints the seed that reproduces it.

use crate::executor::{model, plan as lower_plan};
use meshplan_executor::infer::{check_inputs, infer, InferOptions};
use meshplan_executor::train::{train, TrainOptions};
use meshplan_ir::plan::Plan;
use serde_json::Value;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// splitmix64: small, seedable, no dependency, and every case reproducible from its
/// seed alone.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The seed plans: one per mode the issue names.
fn seeds() -> Vec<(&'static str, Value)> {
    let gpt = model("tiny-gpt");
    let moe = model("tiny-moe");
    let inf = model("tiny-llama-inference");
    let mut out = Vec::new();
    for (name, m, cfg) in [
        ("dp", &gpt, "dp=4"),
        ("tp+sp", &gpt, "dp=2,tp=2,sp=true"),
        ("pp", &gpt, "dp=2,pp=2"),
        ("zero3", &gpt, "dp=4,zero=3"),
        ("cp", &gpt, "dp=1,cp=2,tp=2"),
        ("ep", &moe, "dp=4,ep=4"),
        ("inference", &inf, "tp=2,pp=2"),
    ] {
        let p = lower_plan(m, cfg);
        p.validate()
            .unwrap_or_else(|e| panic!("the {name} seed plan ({cfg}) is refused: {e}"));
        out.push((name, serde_json::to_value(&p).expect("serialise")));
    }
    out
}

/// Every path (object keys and array indices) of `v`, with the top-level key first.
fn paths(v: &Value, prefix: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    out.push(prefix.clone());
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                prefix.push(Step::Key(k.clone()));
                paths(x, prefix, out);
                prefix.pop();
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                prefix.push(Step::Index(i));
                paths(x, prefix, out);
                prefix.pop();
            }
        }
        _ => {}
    }
}

#[derive(Clone, Debug)]
enum Step {
    Key(String),
    Index(usize),
}

fn get_mut<'a>(v: &'a mut Value, path: &[Step]) -> Option<&'a mut Value> {
    let mut cur = v;
    for s in path {
        cur = match s {
            Step::Key(k) => cur.get_mut(k.as_str())?,
            Step::Index(i) => cur.get_mut(*i)?,
        };
    }
    Some(cur)
}

fn show(path: &[Step]) -> String {
    let mut s = String::new();
    for p in path {
        match p {
            Step::Key(k) if s.is_empty() => s.push_str(k),
            Step::Key(k) => {
                s.push('.');
                s.push_str(k);
            }
            Step::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

/// Strings a swapped enum or name may take: the plan's own vocabulary.
const WORDS: &[&str] = &[
    "",
    "tp",
    "dp",
    "pp",
    "cp",
    "ep",
    "edp",
    "embed",
    "train",
    "inference",
    "prefill",
    "decode",
    "F",
    "B",
    "matmul",
    "norm",
    "attention",
    "add",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "segment",
    "compute",
    "collective",
    "send",
    "recv",
    "ring_pass",
    "optimizer",
    "recompute",
    "block",
    "head",
    "dense_block",
    "grads:dense",
    "params:dense",
    "grads:dense[0..7]",
    "grads:dense[9..3]",
    "grad:x",
    "S(0)",
    "S(9)",
    "R",
    "P",
    "f32",
    "bf16",
    "i32",
    "weight",
    "activation",
    "Batch",
    "Seq",
    "Kv",
    "experts",
    "dense",
    "1f1b",
    "gpipe",
    "interleaved",
    "full",
    "selective",
    "column_parallel",
    "row_parallel",
    "vocab_head",
    "replicated",
    "sharded",
    "adamw",
];

fn number(rng: &mut Rng, old: &Value) -> Value {
    let o = old.as_f64().unwrap_or(1.0);
    match rng.below(13) {
        0 => Value::from(0),
        1 => Value::from(-1),
        2 => Value::from(1),
        3 => Value::from(2),
        4 => Value::from(1e15),
        5 => Value::from(u64::MAX),
        6 => Value::from(1u64 << 53),
        7 => Value::from(0.5),
        8 => Value::from(o * 2.0),
        9 => Value::from(o + 1.0),
        10 => Value::from("x"),
        11 => Value::from(1_000_000_000u64),
        _ => Value::Null,
    }
}

/// One structural mutation at a random place; its description.
fn mutate(rng: &mut Rng, v: &mut Value, all: &[Vec<Step>]) -> String {
    // Half the time a section first, so that the small sections (strategy,
    // workload, mesh) are hit as often as the large ones (programs, graph).
    let path = if rng.below(2) == 0 {
        all[rng.below(all.len())].clone()
    } else {
        let tops: Vec<&Vec<Step>> = all.iter().filter(|p| p.len() == 1).collect();
        let top = tops[rng.below(tops.len())].clone();
        let inside: Vec<&Vec<Step>> = all
            .iter()
            .filter(|p| {
                !p.is_empty() && matches!((&p[0], &top[0]), (Step::Key(a), Step::Key(b)) if a == b)
            })
            .collect();
        inside[rng.below(inside.len())].clone()
    };
    let Some(node) = get_mut(v, &path) else {
        return format!("{} (gone)", show(&path));
    };
    let what = match node {
        Value::Number(_) => {
            let n = number(rng, node);
            let d = format!("= {n}");
            *node = n;
            d
        }
        Value::String(_) => {
            let w = WORDS[rng.below(WORDS.len())];
            *node = if rng.below(8) == 0 {
                Value::from(7)
            } else {
                Value::from(w)
            };
            format!("= {node}")
        }
        Value::Bool(b) => {
            *b = !*b;
            "flipped".to_string()
        }
        Value::Null => {
            *node = Value::from(1);
            "= 1".to_string()
        }
        Value::Array(a) => {
            let n = a.len();
            match rng.below(6) {
                0 if n > 0 => {
                    let i = rng.below(n);
                    let x = a[i].clone();
                    a.insert(i, x);
                    format!("duplicate [{i}]")
                }
                1 if n > 0 => {
                    let i = rng.below(n);
                    a.remove(i);
                    format!("drop [{i}]")
                }
                2 if n > 1 => {
                    let (i, j) = (rng.below(n), rng.below(n));
                    a.swap(i, j);
                    format!("swap [{i}] [{j}]")
                }
                3 => {
                    a.clear();
                    "emptied".to_string()
                }
                4 if n > 1 => {
                    a.truncate(n / 2);
                    "halved".to_string()
                }
                _ => {
                    a.push(Value::from(3));
                    "push 3".to_string()
                }
            }
        }
        Value::Object(m) => {
            let keys: Vec<String> = m.keys().cloned().collect();
            if keys.is_empty() || rng.below(4) == 0 {
                *node = Value::from(0);
                "= 0".to_string()
            } else {
                let k = &keys[rng.below(keys.len())];
                m.remove(k);
                format!("delete `{k}`")
            }
        }
    };
    format!("{} {what}", show(&path))
}

/// A rank thread's panic comes back as an error `panicked: ...`.
fn no_rank_panic(what: &str, err: &str) -> Result<(), String> {
    if err.contains("panicked") {
        Err(format!("{what}: a rank panicked: {err}"))
    } else {
        Ok(())
    }
}

/// What the commands do with a plan; `Err` only for a panic.
fn exercise(text: &str, run: bool) -> Result<bool, String> {
    let Ok(plan) = Plan::from_json(text) else {
        return Ok(false);
    };
    for target in meshplan_export::Target::ALL {
        let _ = meshplan_export::export(&plan, target);
    }
    if let Ok(inputs) = meshplan_planner::explain::Inputs::from_plan(&plan) {
        let _ = meshplan_planner::explain::explain(&plan, &inputs);
    }
    if let Ok(figures) = meshplan_viz::plan_figures(&plan) {
        for f in &figures {
            let _ = meshplan_viz::render(&f.canvas, false);
        }
    }
    let _ = meshplan_viz::plan_trace(&plan);
    let _ = plan.busiest_bytes(meshplan_ir::plan::PhaseKind::Train);
    if run && plan.ranks.len() <= 8 {
        match plan.kind {
            meshplan_ir::plan::PlanKind::Train => {
                let opts = TrainOptions {
                    steps: 1,
                    timeout: Some(Duration::from_secs(2)),
                    ..TrainOptions::default()
                };
                if let Err(e) = train(&plan, &opts) {
                    no_rank_panic("train", e.message())?;
                }
            }
            meshplan_ir::plan::PlanKind::Inference => {
                let opts = InferOptions {
                    max_new_tokens: 2,
                    timeout: Some(Duration::from_secs(2)),
                    ..InferOptions::default()
                };
                if check_inputs(&plan, &opts).is_ok() {
                    if let Err(e) = infer(&plan, &opts) {
                        no_rank_panic("infer", e.message())?;
                    }
                }
            }
        }
    }
    Ok(true)
}

fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn r16_structurally_fuzzed_plans_never_panic() {
    let cases = env_u64("MESHPLAN_FUZZ_CASES", 10_000);
    let first = env_u64("MESHPLAN_FUZZ_SEED", 0x16_0013);
    let seeds = seeds();
    let all: Vec<Vec<Vec<Step>>> = seeds
        .iter()
        .map(|(_, v)| {
            let mut out = Vec::new();
            paths(v, &mut Vec::new(), &mut out);
            out
        })
        .collect();
    let t0 = Instant::now();
    let (mut accepted, mut ran) = (0u64, 0u64);
    let mut failures = Vec::new();
    for case in 0..cases {
        let seed = first.wrapping_add(case);
        let mut rng = Rng(seed);
        let k = rng.below(seeds.len());
        let (mode, base) = &seeds[k];
        let mut v = base.clone();
        let n = 1 + rng.below(3);
        let edits: Vec<String> = (0..n).map(|_| mutate(&mut rng, &mut v, &all[k])).collect();
        let text = v.to_string();
        // One accepted mutant in 4 also runs a step: the executor is the costly
        // part, and what reaches it is what validation let through.
        let run = rng.below(4) == 0;
        match catch_unwind(AssertUnwindSafe(|| exercise(&text, run))) {
            Ok(Ok(ok)) => {
                accepted += u64::from(ok);
                ran += u64::from(ok && run);
            }
            Ok(Err(why)) => failures.push(format!("seed {seed} ({mode}: {edits:?}): {why}")),
            Err(_) => failures.push(format!("seed {seed} ({mode}: {edits:?}): panicked")),
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "fuzz_plan: {cases} cases in {secs:.1} s ({:.0} cases/s), {accepted} accepted by validation, {ran} run one step; peak RSS {} MiB",
        cases as f64 / secs,
        peak_rss_kib().map_or("?".into(), |k| (k / 1024).to_string())
    );
    assert!(
        failures.is_empty(),
        "{} of {cases} mutated plans panicked (rerun one with MESHPLAN_FUZZ_SEED=seed MESHPLAN_FUZZ_CASES=1):\n{}",
        failures.len(),
        failures.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn plan_limits_match_the_planners() {
    assert_eq!(
        meshplan_ir::plan_check::RANKS_MAX,
        meshplan_planner::lower::RANKS_MAX
    );
    assert_eq!(
        meshplan_ir::plan_check::SCHEDULE_TASKS_MAX,
        meshplan_planner::lower::SCHEDULE_TASKS_MAX
    );
}
