//! What a collective acts on: the typed protocol between the planner's lowering and
//! the executor's interpreters. The lowering writes a [`Target`]; an interpreter
//! matches it exhaustively, so a new kind of collective is a compile error in every
//! interpreter that does not handle it, not a string it fails to recognise at run
//! time.
//!
//! In plan.json a target is a tagged value (`"hidden_states"`,
//! `{"activation": {"tensor": "block.attn.proj.out"}}`,
//! `{"grad_bucket": {"set": "dense", "range": [0, 4096]}}`, ...). Plans written
//! before the protocol was typed hold a string (`params:block.dense`,
//! `grads:dense[0..4096]`, `head.xent.max`, ...); those still load, read by
//! [`Target::parse_legacy`], and [`Target`]'s `Display` spells that grammar for
//! traces and messages.

use serde::{Deserialize, Deserializer, Serialize};
use std::fmt;

/// Parameters a step collective or the optimizer acts on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamSet {
    /// Every parameter but the routed experts' (reduced over the data axis).
    Dense,
    /// The routed experts' (reduced over the expert-data axis).
    Experts,
}

impl ParamSet {
    /// The spelling in plans and messages.
    pub fn name(self) -> &'static str {
        match self {
            ParamSet::Dense => "dense",
            ParamSet::Experts => "experts",
        }
    }

    fn parse(s: &str) -> Option<ParamSet> {
        match s {
            "dense" => Some(ParamSet::Dense),
            "experts" => Some(ParamSet::Experts),
            _ => None,
        }
    }
}

impl fmt::Display for ParamSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A statistic of a vocabulary-parallel cross-entropy, reduced over the tensor axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossStat {
    /// Each row's largest logit (the log-sum-exp's shift).
    Max,
    /// Each row's sum of shifted exponentials.
    SumExp,
    /// Each row's target logit (held by one rank).
    Target,
}

impl LossStat {
    const ALL: [LossStat; 3] = [LossStat::Max, LossStat::SumExp, LossStat::Target];

    fn suffix(self) -> &'static str {
        match self {
            LossStat::Max => "max",
            LossStat::SumExp => "sum_exp",
            LossStat::Target => "target",
        }
    }
}

/// One of the token exchanges of an expert-parallel MoE layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Exchange {
    /// Tokens to their experts (forward).
    Dispatch,
    /// Expert outputs back to their tokens (forward).
    Combine,
    /// The combine's gradient (backward, first).
    GradCombine,
    /// The dispatch's gradient (backward, second).
    GradDispatch,
    /// The outputs of the tensor ranks' token slices gathered over the tensor axis
    /// (inference with experts over both `tp` and `ep`, where every tensor rank
    /// holds the same tokens and routes only its slice).
    Gather,
}

impl Exchange {
    const ALL: [Exchange; 5] = [
        Exchange::Dispatch,
        Exchange::Combine,
        Exchange::GradCombine,
        Exchange::GradDispatch,
        Exchange::Gather,
    ];

    fn suffix(self) -> &'static str {
        match self {
            Exchange::Dispatch => "dispatch",
            Exchange::Combine => "combine",
            Exchange::GradCombine => "grad:combine",
            Exchange::GradDispatch => "grad:dispatch",
            Exchange::Gather => "gather",
        }
    }
}

/// What a collective acts on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Target {
    /// A graph tensor's activation as this rank holds it; an AllGather's result is
    /// kept beside it (the gathered copy).
    Activation {
        /// Graph tensor name.
        tensor: String,
    },
    /// The gradient of a graph tensor's activation.
    ActivationGrad {
        /// Graph tensor name.
        tensor: String,
    },
    /// The hidden states a pipeline stage hands on (gathered from the sequence
    /// shards at a stage's end).
    HiddenStates,
    /// Their gradient.
    HiddenStatesGrad,
    /// A statistic of a cross-entropy op over a vocabulary split by the tensor axis.
    LossStat {
        /// The cross-entropy op.
        op: String,
        /// Which statistic.
        stat: LossStat,
    },
    /// A token exchange of an experts op (the op moves the tokens itself: their
    /// counts follow the router).
    Experts {
        /// The experts op.
        op: String,
        /// Which exchange.
        exchange: Exchange,
    },
    /// ZeRO-3: a segment's parameters gathered before its forward or backward.
    SegmentParams {
        /// Graph segment.
        segment: String,
        /// Which parameters.
        set: ParamSet,
    },
    /// ZeRO-3: a segment's gradients reduce-scattered after its backward.
    SegmentGrads {
        /// Graph segment.
        segment: String,
        /// Which parameters.
        set: ParamSet,
    },
    /// ZeRO-3 under sequence parallelism: a segment's weights whose gradients each
    /// tensor rank holds for its own sequence shard (norms, router), summed over the
    /// tensor axis.
    SegmentSeqPartialGrads {
        /// Graph segment.
        segment: String,
    },
    /// The tied embedding and head gradients of the first and last stage, summed.
    TiedGrads,
    /// Every sequence-partial weight gradient, summed over the tensor axis.
    SeqPartialGrads,
    /// A bucket of the flattened gradients of `set`: elements `range` (`None`: all).
    GradBucket {
        /// Which parameters.
        set: ParamSet,
        /// Elements `[start, end)` of the flat set.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        range: Option<(u64, u64)>,
    },
    /// A bucket of the flattened parameters of `set` (gathered after a sharded
    /// optimizer step).
    ParamBucket {
        /// Which parameters.
        set: ParamSet,
        /// Elements `[start, end)` of the flat set.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        range: Option<(u64, u64)>,
    },
}

impl Target {
    /// An activation target.
    pub fn activation(tensor: impl Into<String>) -> Target {
        Target::Activation {
            tensor: tensor.into(),
        }
    }

    /// Reads the string grammar of plans written before the protocol was typed, in
    /// the precedence their interpreters used: `params:` and `grads:` sets and
    /// buckets, `grad:` activation gradients, `hidden_states`, an expert exchange
    /// (`OP.dispatch`, ...), a cross-entropy statistic (`OP.max`, `OP.sum_exp`,
    /// `OP.target`), and any other name as an activation.
    pub fn parse_legacy(s: &str) -> Result<Target, String> {
        let bad = |what: &str| format!("`{s}` is not a {what}");
        let bucket = |rest: &str| -> Result<(ParamSet, Option<(u64, u64)>), String> {
            let (set, range) = match rest.split_once('[') {
                None => (rest, None),
                Some((set, r)) => {
                    let (a, b) = r
                        .strip_suffix(']')
                        .and_then(|r| r.split_once(".."))
                        .ok_or_else(|| bad("bucket `SET[a..b]`"))?;
                    let n = |x: &str| x.parse::<u64>().map_err(|_| bad("bucket `SET[a..b]`"));
                    (set, Some((n(a)?, n(b)?)))
                }
            };
            let set = ParamSet::parse(set).ok_or_else(|| bad("parameter set (dense, experts)"))?;
            Ok((set, range))
        };
        let segment_set = |rest: &str| -> Option<(String, ParamSet)> {
            let (seg, set) = rest.rsplit_once('.')?;
            Some((seg.to_string(), ParamSet::parse(set)?))
        };
        if let Some(rest) = s.strip_prefix("params:") {
            if let Some((segment, set)) = segment_set(rest) {
                return Ok(Target::SegmentParams { segment, set });
            }
            let (set, range) = bucket(rest)?;
            return Ok(Target::ParamBucket { set, range });
        }
        if let Some(rest) = s.strip_prefix("grads:") {
            return Ok(match rest {
                "tied" => Target::TiedGrads,
                "seq_partial" => Target::SeqPartialGrads,
                _ => {
                    if let Some(seg) = rest.strip_suffix(".seq_partial") {
                        Target::SegmentSeqPartialGrads {
                            segment: seg.to_string(),
                        }
                    } else if let Some((segment, set)) = segment_set(rest) {
                        Target::SegmentGrads { segment, set }
                    } else {
                        let (set, range) = bucket(rest)?;
                        Target::GradBucket { set, range }
                    }
                }
            });
        }
        if let Some(rest) = s.strip_prefix("grad:") {
            return Ok(if rest == "hidden_states" {
                Target::HiddenStatesGrad
            } else {
                Target::ActivationGrad {
                    tensor: rest.to_string(),
                }
            });
        }
        if s == "hidden_states" {
            return Ok(Target::HiddenStates);
        }
        for exchange in Exchange::ALL {
            if let Some(op) = s.strip_suffix(exchange.suffix()) {
                if let Some(op) = op.strip_suffix('.').filter(|op| op.contains("experts")) {
                    return Ok(Target::Experts {
                        op: op.to_string(),
                        exchange,
                    });
                }
            }
        }
        for stat in LossStat::ALL {
            if let Some(op) = s.strip_suffix(stat.suffix()) {
                if let Some(op) = op.strip_suffix('.').filter(|op| !op.is_empty()) {
                    return Ok(Target::LossStat {
                        op: op.to_string(),
                        stat,
                    });
                }
            }
        }
        if s.is_empty() {
            return Err("an empty collective target".into());
        }
        Ok(Target::activation(s))
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let range = |r: &Option<(u64, u64)>| match r {
            Some((a, b)) => format!("[{a}..{b}]"),
            None => String::new(),
        };
        match self {
            Target::Activation { tensor } => write!(f, "{tensor}"),
            Target::ActivationGrad { tensor } => write!(f, "grad:{tensor}"),
            Target::HiddenStates => f.write_str("hidden_states"),
            Target::HiddenStatesGrad => f.write_str("grad:hidden_states"),
            Target::LossStat { op, stat } => write!(f, "{op}.{}", stat.suffix()),
            Target::Experts { op, exchange } => write!(f, "{op}.{}", exchange.suffix()),
            Target::SegmentParams { segment, set } => write!(f, "params:{segment}.{set}"),
            Target::SegmentGrads { segment, set } => write!(f, "grads:{segment}.{set}"),
            Target::SegmentSeqPartialGrads { segment } => {
                write!(f, "grads:{segment}.seq_partial")
            }
            Target::TiedGrads => f.write_str("grads:tied"),
            Target::SeqPartialGrads => f.write_str("grads:seq_partial"),
            Target::GradBucket { set, range: r } => write!(f, "grads:{set}{}", range(r)),
            Target::ParamBucket { set, range: r } => write!(f, "params:{set}{}", range(r)),
        }
    }
}

/// A target as plan.json holds it: typed, or a string of the older grammar.
#[derive(Deserialize)]
#[serde(untagged)]
enum Wire {
    Typed(Target),
    Legacy(String),
}

/// Reads a [`Target`] in either form (`#[serde(deserialize_with)]`).
pub fn deserialize_target<'de, D: Deserializer<'de>>(d: D) -> Result<Target, D::Error> {
    match Wire::deserialize(d)? {
        Wire::Typed(t) => Ok(t),
        Wire::Legacy(s) => Target::parse_legacy(&s).map_err(serde::de::Error::custom),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_kind() -> Vec<Target> {
        vec![
            Target::activation("block.attn.proj.out"),
            Target::ActivationGrad {
                tensor: "block.mlp.fc2.out".into(),
            },
            Target::HiddenStates,
            Target::HiddenStatesGrad,
            Target::LossStat {
                op: "head.xent".into(),
                stat: LossStat::SumExp,
            },
            Target::Experts {
                op: "block.moe.experts".into(),
                exchange: Exchange::GradCombine,
            },
            Target::SegmentParams {
                segment: "block".into(),
                set: ParamSet::Experts,
            },
            Target::SegmentGrads {
                segment: "block".into(),
                set: ParamSet::Dense,
            },
            Target::SegmentSeqPartialGrads {
                segment: "block".into(),
            },
            Target::TiedGrads,
            Target::SeqPartialGrads,
            Target::GradBucket {
                set: ParamSet::Dense,
                range: Some((0, 4096)),
            },
            Target::ParamBucket {
                set: ParamSet::Experts,
                range: None,
            },
        ]
    }

    #[derive(Serialize, Deserialize)]
    struct Holder {
        #[serde(deserialize_with = "deserialize_target")]
        t: Target,
    }

    #[test]
    fn typed_and_legacy_forms_read_back_the_same_target() {
        for t in every_kind() {
            let json = serde_json::to_string(&Holder { t: t.clone() }).expect("serialises");
            let back: Holder = serde_json::from_str(&json).expect("typed form reads");
            assert_eq!(back.t, t, "{json}");
            // The older plans' string, as Display spells it, parses to the same.
            let legacy = format!(r#"{{"t": {:?}}}"#, t.to_string());
            let old: Holder = serde_json::from_str(&legacy).expect("legacy form reads");
            assert_eq!(old.t, t, "{legacy}");
        }
    }

    #[test]
    fn legacy_strings_by_hand() {
        let p = |s: &str| Target::parse_legacy(s).expect(s);
        assert_eq!(
            p("grads:experts[8..16]"),
            Target::GradBucket {
                set: ParamSet::Experts,
                range: Some((8, 16))
            }
        );
        assert_eq!(
            p("params:dense"),
            Target::ParamBucket {
                set: ParamSet::Dense,
                range: None
            }
        );
        assert_eq!(
            p("head.xent.max"),
            Target::LossStat {
                op: "head.xent".into(),
                stat: LossStat::Max
            }
        );
        assert_eq!(p("grad:hidden_states"), Target::HiddenStatesGrad);
        assert_eq!(
            p("block.attn.qkv.out"),
            Target::activation("block.attn.qkv.out")
        );
        for bad in [
            "grads:dense[4..]",
            "params:weights",
            "grads:dense[a..b]",
            "",
        ] {
            assert!(Target::parse_legacy(bad).is_err(), "{bad}");
        }
    }
}
