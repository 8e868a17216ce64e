//! The planner's best beside hand-given configurations: the same cost model for
//! every row, the ratio of step times, and one line on what differs.

use crate::cost_model::estimate::gib;
use crate::cost_model::Estimate;
use meshplan_ir::ParallelConfig;
use serde::Serialize;

/// One row of a comparison.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// `planner` for the search's best, else the name the user gave.
    pub name: String,
    /// The configuration (its CFG text).
    pub strategy: String,
    /// The prediction (the contract's keys); `None` if the configuration cannot run.
    pub predicted: Option<Estimate>,
    /// Why the configuration cannot run on this model and cluster.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Block layers per pipeline chunk, when uneven.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layer_split: Option<Vec<u64>>,
    /// This row's step time over the planner's (1.0 for the planner's row). For
    /// inference, the planner's output tokens/s over this row's.
    pub ratio_to_planner: Option<f64>,
    /// What differs from the planner's choice and which time term it costs.
    pub account: String,
}

/// The keys of `b` that differ from `a`, as `key a->b`.
pub fn config_diff(a: &ParallelConfig, b: &ParallelConfig) -> Vec<String> {
    let mut d = Vec::new();
    let mut num = |k: &str, x: u64, y: u64| {
        if x != y {
            d.push(format!("{k} {x}->{y}"));
        }
    };
    num("dp", a.dp, b.dp);
    num("tp", a.tp, b.tp);
    num("pp", a.pp, b.pp);
    num("cp", a.cp, b.cp);
    num("ep", a.ep, b.ep);
    num("mbs", a.mbs, b.mbs);
    num("zero", a.zero as u64, b.zero as u64);
    num("vpp", a.vpp, b.vpp);
    let mut other = |k: &str, x: String, y: String| {
        if x != y {
            d.push(format!("{k} {x}->{y}"));
        }
    };
    other(
        "recompute",
        format!("{:?}", a.recompute).to_lowercase(),
        format!("{:?}", b.recompute).to_lowercase(),
    );
    other("sp", a.sp.to_string(), b.sp.to_string());
    other(
        "dp_attention",
        a.dp_attention.to_string(),
        b.dp_attention.to_string(),
    );
    other(
        "tp_overlap",
        a.tp_overlap.to_string(),
        b.tp_overlap.to_string(),
    );
    d
}

fn signed(x: f64) -> String {
    if x >= 0.0 {
        format!("+{x:.3}")
    } else {
        format!("{x:.3}")
    }
}

/// One line: which keys differ and how each time term moves, largest first.
pub fn account(
    best: &Estimate,
    best_split: Option<&[u64]>,
    other: &Estimate,
    other_split: Option<&[u64]>,
) -> String {
    let diff = config_diff(&best.config, &other.config);
    let mut parts = Vec::new();
    if diff.is_empty() && best_split == other_split {
        return "same configuration".into();
    }
    if !diff.is_empty() {
        parts.push(diff.join(", "));
    }
    if best_split != other_split {
        match best_split {
            Some(s) => parts.push(format!("planner splits layers {s:?}")),
            None => parts.push("planner splits layers evenly".into()),
        }
    }
    if let (Some(a), Some(b)) = (best.tpot_s, other.tpot_s) {
        parts.push(format!(
            "TPOT {:.2}->{:.2} ms, TTFT {:.0}->{:.0} ms, memory {:.1}->{:.1} GiB",
            a * 1e3,
            b * 1e3,
            best.ttft_s.unwrap_or(0.0) * 1e3,
            other.ttft_s.unwrap_or(0.0) * 1e3,
            gib(best.memory_per_gpu_bytes.total),
            gib(other.memory_per_gpu_bytes.total)
        ));
        if !other.feasible {
            parts.push(does_not_fit(other));
        }
        return parts.join("; ");
    }
    let (a, b) = (&best.time_breakdown_s, &other.time_breakdown_s);
    let mut terms = [
        ("compute", b.compute - a.compute),
        ("exposed comm", b.exposed_comm - a.exposed_comm),
        ("bubble", b.bubble - a.bubble),
    ];
    terms.sort_by(|x, y| y.1.abs().total_cmp(&x.1.abs()));
    let total = other.step_time_s - best.step_time_s;
    parts.push(format!(
        "step {} s ({}): {}",
        signed(total),
        if total > 0.0 { "slower" } else { "not slower" },
        terms
            .iter()
            .map(|(n, v)| format!("{n} {} s", signed(*v)))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    if !other.feasible {
        parts.push(does_not_fit(other));
    }
    parts.join("; ")
}

fn does_not_fit(e: &Estimate) -> String {
    format!(
        "does not fit: {}",
        e.infeasible_reason.as_deref().unwrap_or("over memory")
    )
}

/// The ratio of a row to the planner's: step time over the planner's for training,
/// the planner's output tokens/s over the row's for inference.
pub fn ratio(best: &Estimate, other: &Estimate) -> f64 {
    match (best.output_tokens_per_s, other.output_tokens_per_s) {
        (Some(a), Some(b)) if b > 0.0 => a / b,
        _ => other.step_time_s / best.step_time_s,
    }
}

/// The rows: the planner's best first, then each hand-given configuration (its
/// estimate, or why it cannot run).
pub fn rows(
    best: &Estimate,
    best_split: Option<&[u64]>,
    hand: &[(String, String, Result<Estimate, String>)],
) -> Vec<Row> {
    let mut out = vec![Row {
        name: "planner".into(),
        strategy: best.config.to_string(),
        predicted: Some(best.clone()),
        error: None,
        layer_split: best_split.map(<[u64]>::to_vec),
        ratio_to_planner: Some(1.0),
        account: "the search's best".into(),
    }];
    for (name, text, r) in hand {
        out.push(match r {
            Ok(e) => Row {
                name: name.clone(),
                strategy: e.config.to_string(),
                predicted: Some(e.clone()),
                error: None,
                layer_split: None,
                ratio_to_planner: Some(ratio(best, e)),
                account: account(best, best_split, e, None),
            },
            Err(why) => Row {
                name: name.clone(),
                strategy: text.clone(),
                predicted: None,
                error: Some(why.clone()),
                layer_split: None,
                ratio_to_planner: None,
                account: format!("cannot run: {why}"),
            },
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshplan_ir::PartialConfig;

    fn cfg(s: &str, gpus: u64) -> ParallelConfig {
        PartialConfig::parse(s, "test")
            .and_then(|p| p.resolve(gpus, "test"))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn diff_names_each_changed_key() {
        let a = cfg("dp=60,tp=8,pp=8,mbs=1,recompute=full", 3840);
        let b = cfg("dp=30,tp=8,pp=16,mbs=2,recompute=selective,sp=true", 3840);
        assert_eq!(
            config_diff(&a, &b),
            vec![
                "dp 60->30",
                "pp 8->16",
                "mbs 1->2",
                "recompute full->selective",
                "sp false->true"
            ]
        );
        assert!(config_diff(&a, &a).is_empty());
    }
}
