//! The inference executor's mode matrix, generated rather than listed: every layout
//! the planner's inference search emits and prices on the CPU test mesh (1 to 8
//! ranks; dense and MoE models, with and without an expert capacity, and one whose
//! first layer is dense and the next MoE) either
//! generates the single-rank run's tokens and logits with the plan's bytes on every
//! rank and axis, or is one the executor names as not run yet (DP-attention). A
//! layout the search gains enters the matrix without a line here; one the planner
//! may write and `run` cannot execute fails it, as experts over both `tp` and `ep`
//! once did.

use crate::executor::{mesh, Model};
use crate::matrix::variant;
use meshplan_cost_model::{estimate_inference, InferenceLoad};
use meshplan_executor::infer::{
    byte_mismatches, check_inference, infer, InferOptions, InferReport,
};
use meshplan_ir::plan::Plan;
use meshplan_ir::{PartialConfig, Workload};
use meshplan_planner::output::plan_for_config;
use meshplan_planner::search::inference_space;

/// Two requests of 12 prompt tokens and 4 new ones: at dp=2 each replica decodes
/// one request, which a tp=2 expert layout splits unevenly (one row, two slices).
const WORKLOAD: &str =
    "workload:\n  kind: inference\n  prompt_len: 12\n  output_len: 4\n  concurrency: 2\n";

/// `models/FILE.yaml` with the inference workload above.
fn inference_model(file: &str) -> Model {
    let text = std::fs::read_to_string(format!(
        "{}/../models/{file}.yaml",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("model file");
    let train = &text[text.find("workload:").expect("a workload")..];
    variant(
        file,
        &[(train, WORKLOAD)],
        &format!("{file}-inference.yaml"),
    )
}

/// `run` of plan `p` on the plan's own workload `opts` generates the tokens and
/// logits of the single-rank plan `single`, and moves the plan's bytes.
#[track_caller]
pub(crate) fn generates_like_one_rank(
    what: &str,
    (p, single): (&Plan, &Plan),
    opts: &InferOptions,
    run: &InferReport,
) {
    let reference =
        infer(single, &opts.reference_of(p)).unwrap_or_else(|e| panic!("{what} reference: {e}"));
    if let Err(e) = check_inference(run, &reference) {
        panic!("{what}: {e}");
    }
    let bytes = byte_mismatches(p, opts, run).expect("the plan's own workload");
    assert!(bytes.is_empty(), "{what}:\n{}", bytes.join("\n"));
}

#[test]
fn every_inference_layout_the_planner_emits_generates_like_one_rank() {
    let mut ran = 0;
    let mut expert_layouts = 0;
    let mut dp_attention = 0;
    for file in [
        "tiny-gpt",
        "tiny-llama-inference",
        "tiny-moe",
        "tiny-moe-capacity",
        "tiny-moe-dense-first",
    ] {
        let m = inference_model(file);
        let workload = m.spec.workload.clone().expect("workload");
        let Workload::Inference { prompt_len, .. } = workload else {
            unreachable!("an inference workload")
        };
        let load = InferenceLoad::from_workload(&workload).expect("inference load");
        let opts = InferOptions {
            requests: (0..2)
                .map(|i| {
                    (0..prompt_len)
                        .map(|t| ((i * 37 + t * 11) % 200) as u32)
                        .collect()
                })
                .collect(),
            max_new_tokens: 4,
            ..InferOptions::default()
        };
        let single = plan_for_config(
            &m.spec.name,
            &m.graph,
            &m.pg,
            &mesh(1),
            &workload,
            &PartialConfig::parse("dp=1", "test")
                .and_then(|p| p.resolve(1, "test"))
                .unwrap_or_else(|e| panic!("{e}")),
        )
        .unwrap_or_else(|e| panic!("{file} single rank: {e}"));
        for gpus in [1u64, 2, 4, 8] {
            let cl = mesh(gpus);
            for c in inference_space(&m.pg, &cl, &PartialConfig::default()) {
                if estimate_inference(&m.pg, &cl, &c, &load).is_err() {
                    continue;
                }
                let what = format!("{file} {c}");
                let p = plan_for_config(&m.spec.name, &m.graph, &m.pg, &cl, &workload, &c)
                    .unwrap_or_else(|e| {
                        panic!("{what}: priced by the search, refused by the lowering: {e}")
                    });
                let run = match infer(&p, &opts) {
                    Ok(r) => r,
                    Err(e) if c.dp_attention => {
                        let e = e.to_string();
                        assert!(e.contains("dp_attention plans are not run"), "{what}: {e}");
                        dp_attention += 1;
                        continue;
                    }
                    Err(e) => panic!("{what}: the planner may write it, `run` refuses it: {e}"),
                };
                generates_like_one_rank(&what, (&p, &single), &opts, &run);
                ran += 1;
                expert_layouts += usize::from(c.tp > 1 && c.ep > 1);
            }
        }
    }
    println!(
        "{ran} layouts generated like one rank ({expert_layouts} with experts over tp and ep); {dp_attention} DP-attention layouts refused"
    );
    // The covering is the search's: these bound it from below, so that a search
    // that lost its layouts does not pass by running none.
    assert!(ran >= 100, "{ran} layouts ran");
    assert!(
        expert_layouts >= 25,
        "{expert_layouts} layouts with experts over tp and ep"
    );
    assert!(dp_attention >= 40, "{dp_attention} DP-attention layouts");
}
