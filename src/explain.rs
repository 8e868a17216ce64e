//! `explain`: why a plan, from its neighbours re-priced by the same cost model.

use crate::export::read_plan;
use crate::{print_json, Failure};
use meshplan_planner::explain::{explain as explain_plan, Alternative, Explanation, Inputs};
use std::path::Path;

/// `meshplan explain`.
pub(crate) fn explain(plan_path: &Path, top: usize, json: bool) -> Result<(), Failure> {
    let plan = read_plan(plan_path)?;
    let file = plan_path.display().to_string();
    let inputs = Inputs::from_plan(&plan).map_err(|message| Failure {
        code: 2,
        message: format!("{file}: {message}"),
    })?;
    let bar = crate::log::spinner("re-pricing the plan's neighbours".into());
    let x = explain_plan(&plan, &inputs);
    bar.finish_and_clear();
    let x = x.map_err(|message| Failure {
        code: 1,
        message: format!("{file}: {message}"),
    })?;
    tracing::debug!(
        "{} alternatives priced, {} cannot run",
        x.alternatives.len(),
        x.cannot_run.len()
    );
    if json {
        print_json(&serde_json::to_value(&x).unwrap_or_default());
    } else {
        if let Some(s) = &plan.serving {
            // `explain` re-prices the plan's own programs: the pool that decodes,
            // without the prompts a deployment interleaves or hands over.
            eprintln!(
                "note: this plan is a deployment from `deploy` ({}); below is its decoding pool alone as `plan` prices it; the deployment itself: {:.1} tokens/s per GPU, TTFT {:.1} ms, TPOT {:.2} ms",
                match s.mode {
                    meshplan_ir::serving::ServingMode::Aggregated => "aggregated",
                    meshplan_ir::serving::ServingMode::Disaggregated => "disaggregated",
                },
                s.predicted["output_tokens_per_s_per_gpu"].as_f64().unwrap_or(0.0),
                s.predicted["ttft_s"].as_f64().unwrap_or(0.0) * 1e3,
                s.predicted["tpot_s"].as_f64().unwrap_or(0.0) * 1e3,
            );
        }
        print_text(&x, top);
    }
    Ok(())
}

fn line(i: usize, a: &Alternative, inference: bool) -> String {
    let speed = if inference {
        format!(
            "{:>9.0} tok/s  TPOT {:>6.2} ms",
            a.tokens_per_s,
            a.tpot_s.unwrap_or(0.0) * 1e3
        )
    } else {
        format!(
            "{:>7.3} s  {:>+7.3} s ({:>+6.1}%)",
            a.step_time_s, a.delta_s, a.delta_pct
        )
    };
    // A move that does not fit is no improvement, however fast it would be.
    let verdict = if a.feasible { "" } else { "does not fit: " };
    format!(
        "{:>3}. {:<44} {speed}  {:>6.1} GiB  {verdict}{}",
        i + 1,
        a.change,
        a.memory_gib,
        a.deciding
    )
}

fn print_text(x: &Explanation, top: usize) {
    let b = &x.baseline;
    let inference = x.kind == "inference";
    println!("{}", x.setting);
    println!("plan         {}", x.strategy);
    if inference {
        println!(
            "             {:.0} output tokens/s, TPOT {:.2} ms, TTFT {:.1} ms, {:.1} GiB per GPU",
            b.output_tokens_per_s.unwrap_or(0.0),
            b.tpot_s.unwrap_or(0.0) * 1e3,
            b.ttft_s.unwrap_or(0.0) * 1e3,
            meshplan_cost_model::estimate::gib(b.memory_per_gpu_bytes.total)
        );
    } else {
        let t = &b.time_breakdown_s;
        println!(
            "             step {:.3} s = compute {:.3} + exposed comm {:.3} + bubble {:.3}; {:.1} GiB per GPU",
            b.step_time_s,
            t.compute,
            t.exposed_comm,
            t.bubble,
            meshplan_cost_model::estimate::gib(b.memory_per_gpu_bytes.total)
        );
        if let Some(r) = x.recorded_step_time_s {
            if (r - b.step_time_s).abs() > 1e-9 * r.abs().max(1.0) {
                println!(
                    "             (the plan file recorded {r:.3} s: the cost model changed since)"
                );
            }
        }
    }
    if let Some(t) = &x.near_ties {
        let within = t["within"].as_f64().unwrap_or(0.0) * 100.0;
        let rule = t["rule"].as_str().unwrap_or_default();
        println!();
        println!("near-ties (within {within:.0}% of the fastest; the cost model cannot tell them apart, so the simplest was chosen: {rule}):");
        for c in t["candidates"].as_array().into_iter().flatten() {
            let speed = match c["output_tokens_per_s"].as_f64() {
                Some(tps) => format!("{tps:.0} tok/s"),
                None => format!("{:.3} s", c["step_time_s"].as_f64().unwrap_or(0.0)),
            };
            let me = c["config"].as_str() == Some(x.strategy.as_str());
            println!(
                "  {} {}  {speed}  {:.2} GB sent per GPU, {} parallel axes, {:.1} GiB",
                if me { "*" } else { " " },
                c["config"].as_str().unwrap_or_default(),
                c["network_bytes_per_gpu"].as_f64().unwrap_or(0.0) / 1e9,
                c["parallel_axes"].as_u64().unwrap_or(0),
                meshplan_cost_model::estimate::gib(
                    c["memory_per_gpu_bytes"].as_f64().unwrap_or(0.0)
                ),
            );
        }
    }
    println!();
    println!(
        "alternatives, one change each, {} (same cost model):",
        if inference {
            "most tokens/s first"
        } else {
            "fastest first"
        }
    );
    for (i, a) in x.alternatives.iter().take(top).enumerate() {
        println!("{}", line(i, a, inference));
    }
    if x.alternatives.len() > top {
        println!(
            "     ... {} more (--top N, or --json for all)",
            x.alternatives.len() - top
        );
    }
    let crossing: Vec<&Alternative> = x
        .alternatives
        .iter()
        .skip(top)
        .filter(|a| !a.crosses_infiniband.is_empty())
        .collect();
    for a in crossing {
        println!("     {}: {}", a.change, a.deciding);
    }
    if !x.cannot_run.is_empty() {
        println!("cannot run:");
        for r in &x.cannot_run {
            println!("     {}: {}", r.change, r.reason);
        }
    }
    if !x.sensitivity.is_empty() {
        println!();
        println!("sensitivity of step time to each degree (x2 / /2, dp takes up the rest):");
        let f = |v: Option<f64>, bad: &Option<String>| match (v, bad) {
            (Some(p), _) => format!("{p:>+6.1}%    "),
            (None, Some(_)) => "infeasible".to_string(),
            (None, None) => "      -    ".to_string(),
        };
        for s in &x.sensitivity {
            println!(
                "     {:<4} = {:<5} x2 {}   /2 {}",
                s.key,
                s.value,
                f(s.doubled_pct, &s.doubled_infeasible),
                f(s.halved_pct, &s.halved_infeasible)
            );
            for (what, why) in [("x2", &s.doubled_infeasible), ("/2", &s.halved_infeasible)] {
                if let Some(why) = why {
                    println!("            {} {what} does not fit: {why}", s.key);
                }
            }
        }
    }
    if !x.what_if.is_empty() {
        println!();
        println!("what if:");
        for a in &x.what_if {
            let verdict = if a.feasible { "" } else { "does not fit: " };
            if inference {
                println!(
                    "     {}: {:.0} tokens/s, {verdict}{}",
                    a.change, a.tokens_per_s, a.deciding
                );
            } else {
                println!(
                    "     {}: step {:.3} s ({:+.3} s, {:+.1}%), {:.0} tokens/s; {verdict}{}",
                    a.change, a.step_time_s, a.delta_s, a.delta_pct, a.tokens_per_s, a.deciding
                );
            }
        }
    }
}
