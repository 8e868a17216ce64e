//! What a serving deployment is asked to meet (the inference workload's optional
//! `serving:` mapping), and the deployment `meshplan deploy` chose (the plan's
//! `serving` section).
//!
//! `plan` prices one representative request (`prompt_len`, `output_len`) at a
//! fixed `concurrency`. `deploy` searches the concurrency per replica, the chunked
//! prefill size and the split into prefill and decode pools, over the length
//! distributions given here.

use crate::config::ParallelConfig;
use crate::error::IrError;
use crate::plan::Plan;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A request-length distribution: a few quantiles (percent -> tokens, linear
/// between them, flat beyond the outermost) or a histogram of `[tokens, weight]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LenDist {
    /// Percent (0-100) -> tokens, e.g. `{50: 1024, 90: 3000, 99: 6000}`.
    Quantiles {
        /// The quantiles.
        quantiles: BTreeMap<Percent, u64>,
    },
    /// `[tokens, weight]` pairs; weights need not sum to one.
    Histogram {
        /// The bins.
        histogram: Vec<(u64, f64)>,
    },
}

impl LenDist {
    /// Quantile points `(fraction, tokens)` in increasing order of fraction, or the
    /// histogram's cumulative steps.
    fn points(&self) -> Result<Vec<(f64, f64)>, String> {
        match self {
            LenDist::Quantiles { quantiles } => {
                let mut pts = Vec::new();
                for (Percent(k), &v) in quantiles {
                    let p: f64 = k.trim_start_matches(['p', 'P']).parse().map_err(|_| {
                        format!("quantile key `{k}` is not a percentage such as 50 or p90")
                    })?;
                    if !(0.0..=100.0).contains(&p) {
                        return Err(format!("quantile key `{k}` is outside 0-100"));
                    }
                    if v == 0 {
                        return Err(format!("quantile {k} must be at least 1 token"));
                    }
                    pts.push((p / 100.0, v as f64));
                }
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                if pts.is_empty() {
                    return Err("give at least one quantile, e.g. {50: 1024}".into());
                }
                if pts.windows(2).any(|w| w[1].1 < w[0].1) {
                    return Err("quantiles must not decrease as the percentage grows".into());
                }
                Ok(pts)
            }
            LenDist::Histogram { histogram } => {
                if histogram.is_empty() {
                    return Err("give at least one [tokens, weight] bin".into());
                }
                if let Some((t, w)) = histogram
                    .iter()
                    .find(|(t, w)| *t == 0 || !(w.is_finite() && *w >= 0.0))
                {
                    return Err(format!(
                        "bin [{t}, {w}]: tokens must be at least 1 and the weight a non-negative number"
                    ));
                }
                let total: f64 = histogram.iter().map(|b| b.1).sum();
                if total <= 0.0 {
                    return Err("the histogram's weights sum to zero".into());
                }
                let mut bins = histogram.clone();
                bins.sort_by_key(|b| b.0);
                let mut acc = 0.0;
                Ok(bins
                    .into_iter()
                    .map(|(t, w)| {
                        acc += w / total;
                        (acc, t as f64)
                    })
                    .collect())
            }
        }
    }

    /// Checks the distribution; the message says what is wrong.
    pub fn validate(&self) -> Result<(), String> {
        self.points().map(|_| ())
    }

    /// Tokens at quantile `q` (0-1).
    pub fn quantile(&self, q: f64) -> f64 {
        let Ok(pts) = self.points() else { return 0.0 };
        match self {
            LenDist::Histogram { .. } => pts
                .iter()
                .find(|(c, _)| *c >= q - 1e-12)
                .or(pts.last())
                .map_or(0.0, |p| p.1),
            LenDist::Quantiles { .. } => {
                let first = pts[0];
                let last = pts[pts.len() - 1];
                if q <= first.0 {
                    return first.1;
                }
                if q >= last.0 {
                    return last.1;
                }
                let w = pts.windows(2).find(|w| q <= w[1].0).unwrap_or(&pts[..2]);
                let (a, b) = (w[0], w[1]);
                a.1 + (b.1 - a.1) * (q - a.0) / (b.0 - a.0)
            }
        }
    }

    /// Mean tokens: the histogram's weighted mean, or the integral of the
    /// piecewise-linear quantile function.
    pub fn mean(&self) -> f64 {
        let Ok(pts) = self.points() else { return 0.0 };
        match self {
            LenDist::Histogram { .. } => {
                let mut prev = 0.0;
                pts.iter()
                    .map(|&(c, t)| {
                        let m = (c - prev) * t;
                        prev = c;
                        m
                    })
                    .sum()
            }
            LenDist::Quantiles { .. } => {
                let first = pts[0];
                let last = pts[pts.len() - 1];
                let inner: f64 = pts
                    .windows(2)
                    .map(|w| (w[1].0 - w[0].0) * (w[0].1 + w[1].1) / 2.0)
                    .sum();
                first.0 * first.1 + inner + (1.0 - last.0) * last.1
            }
        }
    }
}

/// A quantile's key as written: `50`, `99.9` or `p90` (YAML gives numbers or
/// strings; both are kept as text and read as a percentage when used).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Percent(pub String);

impl<'de> Deserialize<'de> for Percent {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Percent, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Percent;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a percentage such as 50, 99.9 or p90")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Percent, E> {
                Ok(Percent(v.to_string()))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Percent, E> {
                Ok(Percent(v.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Percent, E> {
                Ok(Percent(v.to_string()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Percent, E> {
                Ok(Percent(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

/// A range of concurrent requests per deployment.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConcurrencyRange {
    /// Fewest requests in flight per replica.
    #[serde(default = "one")]
    pub min: u64,
    /// Most requests in flight per replica (the KV cache may bound it lower).
    pub max: u64,
}

fn one() -> u64 {
    1
}

fn is_one(v: &u64) -> bool {
    *v == 1
}

/// What the search maximises among deployments within the SLOs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// Output tokens per second per GPU.
    #[default]
    PerGpu,
    /// Output tokens per second per user (1 / TPOT).
    PerUser,
}

/// Which deployments to search.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModeChoice {
    /// Both, and say which wins.
    #[default]
    Both,
    /// Prefill and decode on the same GPUs (continuous batching with chunked prefill).
    Aggregated,
    /// A prefill pool and a decode pool.
    Disaggregated,
}

/// The inference workload's `serving:` mapping.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServingSpec {
    /// Prompt lengths (replaces `prompt_len` for `deploy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<LenDist>,
    /// Output lengths (replaces `output_len` for `deploy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<LenDist>,
    /// Requests in flight per replica to search (default 1 to the KV capacity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<ConcurrencyRange>,
    /// Offered load, requests per second, whole deployment: the search then finds
    /// the fewest GPUs that serve it within the SLOs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrival_rate: Option<f64>,
    /// What to maximise.
    #[serde(default)]
    pub objective: Objective,
    /// A floor on tokens per second per user (1 / TPOT), besides the SLO.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_tokens_per_s_per_user: Option<f64>,
    /// Chunked-prefill sizes (tokens per iteration) to search; default 512-8192.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunked_prefill: Vec<u64>,
    /// Which deployments to search.
    #[serde(default)]
    pub mode: ModeChoice,
}

impl ServingSpec {
    /// Checks the mapping, naming the field that is wrong.
    pub fn validate(&self, file: &str) -> Result<(), IrError> {
        for (field, d) in [
            ("workload.serving.prompt", &self.prompt),
            ("workload.serving.output", &self.output),
        ] {
            if let Some(d) = d {
                d.validate().map_err(|m| IrError::invalid(file, field, m))?;
            }
        }
        if let Some(c) = self.concurrency {
            if c.min == 0 || c.max < c.min {
                return Err(IrError::invalid(
                    file,
                    "workload.serving.concurrency",
                    format!("needs 1 <= min <= max, got min {} max {}", c.min, c.max),
                ));
            }
        }
        for (field, v) in [
            ("workload.serving.arrival_rate", self.arrival_rate),
            (
                "workload.serving.min_tokens_per_s_per_user",
                self.min_tokens_per_s_per_user,
            ),
        ] {
            if let Some(v) = v {
                if !(v.is_finite() && v > 0.0) {
                    return Err(IrError::invalid(
                        file,
                        field,
                        format!("must be a positive number, got {v}"),
                    ));
                }
            }
        }
        if self.chunked_prefill.contains(&0) {
            return Err(IrError::invalid(
                file,
                "workload.serving.chunked_prefill",
                "chunk sizes must be at least 1 token",
            ));
        }
        Ok(())
    }
}

/// How a deployment serves: both phases on every GPU, or two pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServingMode {
    /// Continuous batching: decode steps interleaved with prefill chunks.
    Aggregated,
    /// Prefill instances hand each request's KV cache to decode instances.
    Disaggregated,
}

/// One pool of a deployment: identical instances of one parallel configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolInfo {
    /// Instances (replicas) in the pool.
    pub instances: u64,
    /// GPUs of one instance.
    pub gpus_per_instance: u64,
    /// The instance's configuration (`dp` counts DP-attention ranks inside it).
    pub strategy: ParallelConfig,
    /// Decode context parallelism: tensor ranks that split each request's cached
    /// tokens (SGLang `--dcp-size`, vLLM `--decode-context-parallel-size`); 1: none.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub dcp: u64,
    /// Requests in flight per instance.
    pub concurrency: u64,
    /// Tokens per prefill chunk (aggregated), or the whole prompt (prefill pool).
    pub chunked_prefill: u64,
    /// The pool's predicted figures.
    pub predicted: serde_json::Value,
}

/// The KV cache's move from a prefill instance to a decode instance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvTransfer {
    /// Bytes one request's move sends (the mean prompt's cache, all layers, once
    /// per copy the decode instance keeps over its tensor ranks).
    pub bytes_per_request: f64,
    /// Seconds for that move, alpha-beta over the link it crosses.
    pub time_s: f64,
    /// `nvlink` when both pools share a node, else `infiniband`.
    pub link: String,
}

/// The plan's `serving` section, written by `deploy`.
///
/// The plan's own `strategy`, `programs` and `ranks` are the pool that decodes: the
/// whole aggregated deployment, or the decode pool. A disaggregated plan carries the
/// prefill pool's programs in `prefill_plan`, a plan of its own whose ranks are
/// numbered from 0; a run puts them before the decode pool's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServingInfo {
    /// Aggregated or disaggregated.
    pub mode: ServingMode,
    /// The pool that decodes (the whole deployment when aggregated).
    pub decode: PoolInfo,
    /// The prefill pool (disaggregated only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<PoolInfo>,
    /// The prefill pool's programs (disaggregated only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_plan: Option<Box<Plan>>,
    /// The KV move between pools (disaggregated only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer: Option<KvTransfer>,
    /// The deployment's figures: TTFT and TPOT at the SLO percentile, tokens/s per
    /// GPU and per user, GPUs used.
    pub predicted: serde_json::Value,
}
