//! The executor's mode matrix, generated rather than listed: every configuration the
//! planner's own search space emits on the CPU test mesh (1 to 8 ranks; dense, tied +
//! dropout and MoE models, with and without an expert capacity; the default and the
//! GPipe schedule), reduced to a set that covers every 3-way combination of mode
//! values that occurs in the space, each trained against the single-rank run (losses,
//! weights and bytes, as `executor::check_plan`). A mode the search gains enters the
//! matrix without a line here; a pair of modes that trains wrongly together (ZeRO-3
//! with tensor and sequence parallelism was one) fails it.
//!
//! `MESHPLAN_MATRIX_STRENGTH` (default 3) sets the interaction strength; 4 and more
//! run a longer matrix (522 configurations at 4, about 6 minutes on 2 cores), whose
//! configurations without a recorded golden are compared with their single-rank
//! run alone. At the default strength every configuration must have its golden.
//!
//! The same covering runs again on the bf16-emulating host device, each
//! configuration within the mixed-precision tolerances of its fp32 single-rank
//! reference and a 1.5x learning rate outside them: what `run --check` on a GPU
//! requires of a correct run, and refuses of a wrong one.

use crate::executor::{check_plan_with, mesh, Model};
use meshplan_cost_model::estimate::{check_train_shapes, estimate_train};
use meshplan_cost_model::prepare_model;
use meshplan_ir::{model_graph, ParallelConfig, PartialConfig, Schedule, Workload};
use meshplan_planner::output::plan_for_config_with_buckets;
use meshplan_planner::search::training_space;
use std::collections::BTreeSet;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// Model `file` of `models/` with each `(from, to)` text edit applied (each must match).
pub(crate) fn variant(file: &str, edits: &[(&str, &str)], name: &str) -> Model {
    let mut text =
        std::fs::read_to_string(format!("{ROOT}/models/{file}.yaml")).expect("model file");
    for (from, to) in edits {
        assert!(text.contains(from), "{file}: `{from}` not found");
        text = text.replace(from, to);
    }
    let spec = meshplan_ir::parse_model_yaml(&text, name).unwrap_or_else(|e| panic!("{e}"));
    let graph = model_graph(&spec).unwrap_or_else(|e| panic!("{e}"));
    let pg = prepare_model(&spec).unwrap_or_else(|e| panic!("{e}"));
    Model { spec, graph, pg }
}

fn models() -> Vec<(&'static str, Model)> {
    // Four layers, so that two stages can hold two chunks each and four stages exist.
    let four = ("layers: 2", "layers: 4");
    vec![
        ("dense", variant("tiny-gpt", &[four], "dense.yaml")),
        (
            "tied+dropout",
            variant(
                "tiny-gpt",
                &[
                    four,
                    ("tie_embeddings: false", "tie_embeddings: true"),
                    ("position: rope", "position: rope\n  dropout: true"),
                ],
                "tied-dropout.yaml",
            ),
        ),
        ("moe", variant("tiny-moe", &[four], "moe.yaml")),
        (
            "moe-capacity",
            variant("tiny-moe-capacity", &[four], "moe-capacity.yaml"),
        ),
    ]
}

/// The mode values of a configuration, one per factor of the covering.
fn factors(model: &str, c: &ParallelConfig) -> Vec<String> {
    // The configuration's own `key=value` text: every key the search varies.
    std::iter::once(format!("model={model}"))
        .chain(c.to_string().split(',').map(str::to_string))
        .collect()
}

/// Every `t`-subset of factor indices.
fn subsets(n: usize, t: usize) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    let mut cur = Vec::new();
    fn rec(start: usize, n: usize, t: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if cur.len() == t {
            out.push(cur.clone());
            return;
        }
        for i in start..n {
            cur.push(i);
            rec(i + 1, n, t, cur, out);
            cur.pop();
        }
    }
    rec(0, n, t, &mut cur, &mut out);
    out
}

fn tuples(f: &[String], sets: &[Vec<usize>]) -> Vec<String> {
    sets.iter()
        .map(|s| {
            s.iter()
                .map(|&i| f[i].as_str())
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect()
}

/// Greedy covering (the classic AETG-style reduction): the candidates `kept` first,
/// each once (those whose goldens are recorded, so that a change to the space
/// keeps checking every configuration already fingerprinted), then repeatedly the candidate that covers
/// the most `t`-way combinations not yet covered, until every combination that
/// occurs in the space is covered. Deterministic: ties go to the earlier one.
fn cover(cands: &[Vec<String>], t: usize, kept: &[usize]) -> (Vec<usize>, usize) {
    let sets = subsets(cands.first().map_or(0, |f| f.len()), t);
    let per: Vec<Vec<String>> = cands.iter().map(|f| tuples(f, &sets)).collect();
    let mut left: BTreeSet<&str> = per.iter().flatten().map(|s| s.as_str()).collect();
    let total = left.len();
    let mut chosen = Vec::new();
    for &i in kept {
        if !chosen.contains(&i) {
            for s in &per[i] {
                left.remove(s.as_str());
            }
            chosen.push(i);
        }
    }
    while !left.is_empty() {
        let (best, gain) = per
            .iter()
            .enumerate()
            .map(|(i, ts)| {
                let mut seen = BTreeSet::new();
                let gain = ts
                    .iter()
                    .filter(|s| left.contains(s.as_str()) && seen.insert(s.as_str()))
                    .count();
                (i, gain)
            })
            .fold((0, 0), |a, b| if b.1 > a.1 { b } else { a });
        assert!(
            gain > 0,
            "covering stalled with {} combinations left",
            left.len()
        );
        for s in &per[best] {
            left.remove(s.as_str());
        }
        chosen.push(best);
    }
    (chosen, total)
}

#[test]
fn covering_selects_every_pair_and_no_more_than_needed() {
    // Three two-valued factors: pairwise coverage needs 4 rows of the 8 (an
    // orthogonal array), and the greedy reduction finds 4 or 5.
    let mut all = Vec::new();
    for a in 0..2 {
        for b in 0..2 {
            for c in 0..2 {
                all.push(vec![format!("a={a}"), format!("b={b}"), format!("c={c}")]);
            }
        }
    }
    let (chosen, total) = cover(&all, 2, &[]);
    assert_eq!(total, 12);
    assert!((4..=5).contains(&chosen.len()), "{chosen:?}");
    let mut covered = BTreeSet::new();
    for &i in &chosen {
        covered.extend(tuples(&all[i], &subsets(3, 2)));
    }
    assert_eq!(covered.len(), 12);
    // Rows kept come first, once each, whatever they add.
    let (kept, _) = cover(&all, 2, &[7, 0, 7]);
    assert_eq!(kept[..2], [7, 0]);
    assert!(!kept[2..].contains(&7) && !kept[2..].contains(&0));
    let mut covered = BTreeSet::new();
    for &i in &kept {
        covered.extend(tuples(&all[i], &subsets(3, 2)));
    }
    assert_eq!(covered.len(), 12);
}

// The matrix in two halves (alternate configurations of the covering), so the test
// harness trains them on two cores at once.
#[test]
fn every_mode_combination_the_planner_emits_trains_like_one_rank_half_1() {
    mode_matrix(0, 2, false);
}

#[test]
fn every_mode_combination_the_planner_emits_trains_like_one_rank_half_2() {
    mode_matrix(1, 2, false);
}

#[test]
fn every_mode_combination_the_planner_emits_trains_within_the_bf16_tolerances_half_1() {
    mode_matrix(0, 2, true);
}

#[test]
fn every_mode_combination_the_planner_emits_trains_within_the_bf16_tolerances_half_2() {
    mode_matrix(1, 2, true);
}

/// Trains configurations `part`, `part + parts`, ... of the covering, in fp32
/// against the single-rank run, or (`bf16`) on the bf16-emulating device within
/// the mixed-precision tolerances.
fn mode_matrix(part: usize, parts: usize, bf16: bool) {
    let strength: usize = std::env::var("MESHPLAN_MATRIX_STRENGTH")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let models = models();
    let mut cands: Vec<(usize, ParallelConfig)> = Vec::new();
    for (mi, (_, m)) in models.iter().enumerate() {
        let Some(Workload::Train {
            seq_len,
            global_batch,
            ..
        }) = m.spec.workload.clone()
        else {
            panic!("training workload");
        };
        for gpus in [1u64, 2, 4, 8] {
            let cl = mesh(gpus);
            for schedule in [None, Some(Schedule::Gpipe)] {
                let fixed = PartialConfig {
                    schedule,
                    ..PartialConfig::default()
                };
                for c in training_space(&m.pg, &cl, &fixed, seq_len, global_batch) {
                    if !cands.iter().any(|(i, d)| *i == mi && *d == c) {
                        cands.push((mi, c));
                    }
                }
            }
        }
    }
    // What the lowering refuses, the search must refuse too (its shape rules or its
    // pricing), so that the planner never writes a plan `run` cannot execute.
    let mut lowered = Vec::new();
    let mut refused = 0usize;
    let mut emitted_but_refused = Vec::new();
    for (mi, c) in cands {
        let m = &models[mi].1;
        let gpus = c.dp * c.tp * c.pp * c.cp;
        let cl = mesh(gpus);
        let workload = m.spec.workload.clone().expect("workload");
        let Workload::Train {
            seq_len,
            global_batch,
            ..
        } = workload
        else {
            unreachable!("training workload");
        };
        match plan_for_config_with_buckets(
            &m.spec.name,
            &m.graph,
            &m.pg,
            &cl,
            &workload,
            &c,
            meshplan_cost_model::calib::DP_BUCKET_PARAMS,
        ) {
            Ok(p) => lowered.push((mi, c, p)),
            Err(why) => {
                refused += 1;
                let searched = check_train_shapes(&m.pg, &c, seq_len).is_ok()
                    && estimate_train(&m.pg, &cl, &c, seq_len, global_batch).is_ok();
                if searched {
                    emitted_but_refused.push(format!("{} {c}: {why}", models[mi].0));
                }
            }
        }
    }
    assert!(
        emitted_but_refused.is_empty(),
        "the search prices configurations the lowering refuses:\n{}",
        emitted_but_refused.join("\n")
    );
    let feats: Vec<Vec<String>> = lowered
        .iter()
        .map(|(mi, c, _)| factors(models[*mi].0, c))
        .collect();
    let kept: Vec<usize> = (lowered.iter().enumerate())
        .filter(|(_, (mi, c, _))| {
            let m = &models[*mi];
            crate::exec_golden::recorded(&crate::executor::golden_name(
                &m.1,
                &format!("{} {c}", m.0),
            ))
        })
        .map(|(i, _)| i)
        .collect();
    let (chosen, combos) = cover(&feats, strength, &kept);
    eprintln!(
        "mode matrix: {} configurations in the space ({refused} refused by the lowering), \
         {} chosen to cover all {combos} {strength}-way combinations",
        lowered.len(),
        chosen.len()
    );
    let mut failures = Vec::new();
    let mine: Vec<usize> = chosen.iter().copied().skip(part).step_by(parts).collect();
    for &i in &mine {
        let (mi, c, p) = &lowered[i];
        let m = &models[*mi].1;
        let name = format!("{} {c}", models[*mi].0);
        let plan = p.clone();
        if let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if bf16 {
                check_bf16(m, &name, &plan);
            } else {
                check_plan_with(m, &name, plan, strength <= 3);
            }
        })) {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            failures.push(format!(
                "{name}: {}",
                msg.lines().take(3).collect::<Vec<_>>().join(" | ")
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} configurations differ from the single-rank run{}:\n{}",
        failures.len(),
        mine.len(),
        if bf16 {
            " beyond bf16's tolerances"
        } else {
            ""
        },
        failures.join("\n")
    );
}

/// Trains `p` on the bf16-emulating host device and requires it within the
/// mixed-precision tolerances of its fp32 reference, the single-rank run sliced
/// as each rank holds its weights (as `run --check` compares).
#[track_caller]
pub(crate) fn check_bf16(m: &Model, cfg: &str, p: &meshplan_ir::plan::Plan) {
    use meshplan_executor::device::emulate::Bf16Host;
    use meshplan_executor::device::train::train_device;
    use meshplan_executor::device::{
        check_mixed_precision, MIXED_LOSS_TOLERANCE, MIXED_UPDATE_TOLERANCE,
    };
    use meshplan_executor::train::{train, TrainOptions};
    let opts = TrainOptions::default();
    let one = crate::executor::plan(m, &format!("dp=1,mbs={}", p.strategy.mbs));
    let reference =
        train(&one, &opts.reference_of(p)).unwrap_or_else(|e| panic!("{cfg}: reference: {e}"));
    // `run --check`'s comparison; a wrong run is still measured from `opts`.
    let bf16 = |o: &TrainOptions| {
        let run = train_device(p, o, &|_| Ok(Bf16Host)).unwrap_or_else(|e| panic!("{cfg}: {e}"));
        let checked = check_mixed_precision(
            p,
            &run,
            &reference,
            &opts,
            MIXED_LOSS_TOLERANCE,
            MIXED_UPDATE_TOLERANCE,
        );
        (run, checked)
    };
    let (run, checked) = bf16(&opts);
    let lines = checked.unwrap_or_else(|e| panic!("{cfg}: bf16 outside the tolerances: {e}"));
    eprintln!("{cfg}: {}", lines.last().cloned().unwrap_or_default());
    // Not a check that cannot fail: bf16 does move the run, and a 1.5x learning
    // rate is refused.
    assert_ne!(
        run.losses, reference.losses,
        "{cfg}: bf16 rounding changed nothing"
    );
    let wrong = TrainOptions {
        lr: opts.lr * 1.5,
        ..opts.clone()
    };
    let e = (bf16(&wrong).1).expect_err("a 1.5x learning rate passes the check");
    eprintln!("{cfg}, 1.5x lr: {}", e.lines().last().unwrap_or_default());
}
