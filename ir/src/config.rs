//! The parallel configuration (CFG): `dp=60,tp=8,pp=8,mbs=1,recompute=full`.
//!
//! [`PartialConfig`] is what a user wrote (every key optional, so `plan --config`
//! can fix some keys and search the rest); [`ParallelConfig`] is a complete one,
//! with `dp` resolved from the number of GPUs.

use crate::error::IrError;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Activation recomputation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep every activation.
    None,
    /// Recompute the attention core only (Korthikanti et al. 2022).
    Selective,
    /// Keep only each layer's input and recompute the layer.
    Full,
}

/// Pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Schedule {
    /// All forwards, then all backwards.
    #[serde(rename = "gpipe")]
    Gpipe,
    /// One forward, one backward (PipeDream-flush).
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over `vpp` model chunks per rank.
    #[serde(rename = "interleaved")]
    Interleaved,
}

impl Schedule {
    /// The forwards pipeline stage `stage` runs before its steady state, where it
    /// alternates one forward and one backward, of `total` forwards in all
    /// (micro-batches x chunks). Megatron-LM's warm-up: one forward for each later
    /// stage (`pp - stage - 1`), or `2 (pp - stage - 1) + (vpp - 1) pp` interleaved;
    /// GPipe runs every forward first.
    pub fn warmup_forwards(self, pp: usize, vpp: usize, stage: usize, total: usize) -> usize {
        let later = pp.saturating_sub(stage + 1);
        match self {
            Schedule::Gpipe => total,
            _ if vpp <= 1 => later.min(total),
            _ => (later * 2 + (vpp - 1) * pp).min(total),
        }
    }
}

/// Attention kernel: a flash kernel (no score matrix in memory, causal half skipped)
/// or the unfused batched-GEMM + softmax form (score matrix materialised).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttnImpl {
    /// Tiled, online softmax.
    Flash,
    /// Scores, softmax and dropout as separate kernels.
    Unfused,
}

/// A complete parallel configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ParallelConfig {
    /// Data-parallel degree.
    pub dp: u64,
    /// Tensor-parallel degree.
    pub tp: u64,
    /// Pipeline stages.
    pub pp: u64,
    /// Context-parallel degree.
    pub cp: u64,
    /// Expert-parallel degree (MoE).
    pub ep: u64,
    /// Micro-batch size in sequences.
    pub mbs: u64,
    /// ZeRO stage 0-3.
    pub zero: u8,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// Megatron sequence parallelism on the tensor axis.
    pub sp: bool,
    /// Model chunks per pipeline rank.
    pub vpp: u64,
    /// Pipeline schedule.
    pub schedule: Schedule,
    /// Inference: attention data-parallel, MoE/FFN on tp/ep.
    pub dp_attention: bool,
    /// Attention kernel.
    pub attn: AttnImpl,
    /// Tensor-parallel communication overlapped with the adjacent GEMMs.
    pub tp_overlap: bool,
}

impl ParallelConfig {
    /// Ranks the configuration needs.
    pub fn world_size(&self) -> u64 {
        self.dp * self.tp * self.pp * self.cp
    }
}

/// A configuration as written: any key may be missing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PartialConfig {
    /// `dp`.
    pub dp: Option<u64>,
    /// `tp`.
    pub tp: Option<u64>,
    /// `pp`.
    pub pp: Option<u64>,
    /// `cp`.
    pub cp: Option<u64>,
    /// `ep`.
    pub ep: Option<u64>,
    /// `mbs`.
    pub mbs: Option<u64>,
    /// `zero`.
    pub zero: Option<u8>,
    /// `recompute`.
    pub recompute: Option<Recompute>,
    /// `sp`.
    pub sp: Option<bool>,
    /// `vpp`.
    pub vpp: Option<u64>,
    /// `schedule`.
    pub schedule: Option<Schedule>,
    /// `dp_attention`.
    pub dp_attention: Option<bool>,
    /// `attn`.
    pub attn: Option<AttnImpl>,
    /// `tp_overlap`.
    pub tp_overlap: Option<bool>,
}

const KEYS: &str =
    "dp, tp, pp, cp, ep, mbs, zero, recompute, sp, vpp, schedule, dp_attention, attn";

fn bad(source: &str, key: &str, message: impl Into<String>) -> IrError {
    IrError::invalid(source, key, message)
}

fn parse_degree(source: &str, key: &str, v: &str) -> Result<u64, IrError> {
    match v.parse::<u64>() {
        Ok(0) | Err(_) => Err(bad(
            source,
            key,
            format!("expected a positive integer, got `{v}`"),
        )),
        Ok(n) => Ok(n),
    }
}

fn parse_bool(source: &str, key: &str, v: &str) -> Result<bool, IrError> {
    match v {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(bad(
            source,
            key,
            format!("expected `true` or `false`, got `{v}`"),
        )),
    }
}

impl PartialConfig {
    /// Whether `c` has every key this one names (the keys a serving instance sets:
    /// degrees, DP-attention, attention kernel).
    pub fn matches(&self, c: &ParallelConfig) -> bool {
        let eq = |k: Option<u64>, v: u64| k.is_none_or(|k| k == v);
        eq(self.dp, c.dp)
            && eq(self.tp, c.tp)
            && eq(self.pp, c.pp)
            && eq(self.cp, c.cp)
            && eq(self.ep, c.ep)
            && self.dp_attention.is_none_or(|d| d == c.dp_attention)
            && self.attn.is_none_or(|a| a == c.attn)
    }

    /// These keys, with the attention kernel `attn` where they leave it open (the
    /// kernel a framework has for the model, [`crate::Framework::default_attn`]).
    pub fn or_attn(&self, attn: AttnImpl) -> PartialConfig {
        PartialConfig {
            attn: self.attn.or(Some(attn)),
            ..*self
        }
    }

    /// Parses `key=value,key=value`. `source` names where the text came from in
    /// error messages (e.g. `--config`).
    pub fn parse(text: &str, source: &str) -> Result<PartialConfig, IrError> {
        let mut c = PartialConfig::default();
        let mut seen: Vec<&str> = Vec::new();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let Some((key, v)) = item.split_once('=') else {
                return Err(bad(
                    source,
                    item,
                    format!("expected `key=value`; keys are {KEYS}"),
                ));
            };
            let (key, v) = (key.trim(), v.trim());
            // A key given twice (`dp=4,dp=8`) is a typo, not a choice: which one was
            // meant cannot be guessed.
            if seen.contains(&key) {
                return Err(bad(
                    source,
                    key,
                    format!("`{key}` is given twice in `{text}`; give it once"),
                ));
            }
            seen.push(key);
            match key {
                "dp" => c.dp = Some(parse_degree(source, key, v)?),
                "tp" => c.tp = Some(parse_degree(source, key, v)?),
                "pp" => c.pp = Some(parse_degree(source, key, v)?),
                "cp" => c.cp = Some(parse_degree(source, key, v)?),
                "ep" => c.ep = Some(parse_degree(source, key, v)?),
                "mbs" => c.mbs = Some(parse_degree(source, key, v)?),
                "vpp" => c.vpp = Some(parse_degree(source, key, v)?),
                "zero" => {
                    c.zero = Some(match v {
                        "0" => 0,
                        "1" => 1,
                        "2" => 2,
                        "3" => 3,
                        _ => {
                            return Err(bad(
                                source,
                                key,
                                format!("expected 0, 1, 2 or 3, got `{v}`"),
                            ))
                        }
                    })
                }
                "recompute" => {
                    c.recompute = Some(match v {
                        "none" => Recompute::None,
                        "selective" => Recompute::Selective,
                        "full" => Recompute::Full,
                        _ => {
                            return Err(bad(
                                source,
                                key,
                                format!("expected none, selective or full, got `{v}`"),
                            ))
                        }
                    })
                }
                "sp" => c.sp = Some(parse_bool(source, key, v)?),
                "dp_attention" => c.dp_attention = Some(parse_bool(source, key, v)?),
                "tp_overlap" => c.tp_overlap = Some(parse_bool(source, key, v)?),
                "schedule" => {
                    c.schedule = Some(match v {
                        "gpipe" => Schedule::Gpipe,
                        "1f1b" => Schedule::OneFOneB,
                        "interleaved" => Schedule::Interleaved,
                        _ => {
                            return Err(bad(
                                source,
                                key,
                                format!("expected gpipe, 1f1b or interleaved, got `{v}`"),
                            ))
                        }
                    })
                }
                "attn" => {
                    c.attn = Some(match v {
                        "flash" => AttnImpl::Flash,
                        "unfused" => AttnImpl::Unfused,
                        _ => {
                            return Err(bad(
                                source,
                                key,
                                format!("expected flash or unfused, got `{v}`"),
                            ))
                        }
                    })
                }
                _ => return Err(bad(source, key, format!("unknown key; keys are {KEYS}"))),
            }
        }
        Ok(c)
    }

    /// Refuses keys that mean nothing for the workload, so a configuration is never
    /// priced as something other than what it says: on inference the training keys
    /// (`mbs`, `zero`, `recompute`, `sp`, `vpp`, `schedule`), on training
    /// `dp_attention=true`. The values inference always runs with (`mbs=1`, `zero=0`,
    /// `recompute=none`, `sp=false`, `vpp=1`, `schedule=1f1b`) and `dp_attention=false`
    /// pass, so that a strategy string meshplan printed reads back.
    pub fn check_workload(&self, inference: bool, source: &str) -> Result<(), IrError> {
        if !inference {
            if self.dp_attention == Some(true) {
                return Err(bad(
                    source,
                    "dp_attention",
                    "dp_attention=true is an inference layout (attention data-parallel over the tensor ranks while serving) and means nothing for training; remove it, or plan an inference workload (`workload: {kind: inference, ...}` or --workload FILE)",
                ));
            }
            return Ok(());
        }
        let why = "inference has no micro-batches, optimizer states, recomputation, sequence parallelism or virtual stages";
        let fix = "remove it; inference configurations take dp, tp, pp, ep, dp_attention, attn and tp_overlap";
        let refuse = |key: &str, given: String| -> Result<(), IrError> {
            Err(bad(
                source,
                key,
                format!("`{key}={given}` means nothing for an inference workload ({why}); {fix}"),
            ))
        };
        if let Some(v) = self.mbs.filter(|&v| v != 1) {
            return refuse("mbs", v.to_string());
        }
        if let Some(v) = self.zero.filter(|&v| v != 0) {
            return refuse("zero", v.to_string());
        }
        match self.recompute {
            Some(Recompute::Selective) => return refuse("recompute", "selective".into()),
            Some(Recompute::Full) => return refuse("recompute", "full".into()),
            _ => {}
        }
        if self.sp == Some(true) {
            return refuse("sp", "true".into());
        }
        if let Some(v) = self.vpp.filter(|&v| v != 1) {
            return refuse("vpp", v.to_string());
        }
        match self.schedule {
            Some(Schedule::Gpipe) => refuse("schedule", "gpipe".into()),
            Some(Schedule::Interleaved) => refuse("schedule", "interleaved".into()),
            _ => Ok(()),
        }
    }

    /// Fills defaults and resolves `dp` from the number of GPUs. Errors state the
    /// arithmetic: `dp(2) * tp(4) * pp(2) * cp(1) = 16 != GPUs(8)`.
    pub fn resolve(&self, gpus: u64, source: &str) -> Result<ParallelConfig, IrError> {
        let tp = self.tp.unwrap_or(1);
        let pp = self.pp.unwrap_or(1);
        let cp = self.cp.unwrap_or(1);
        let Some(others) = tp.checked_mul(pp).and_then(|x| x.checked_mul(cp)) else {
            return Err(bad(
                source,
                "tp",
                format!("tp({tp}) * pp({pp}) * cp({cp}) is larger than any cluster; choose degrees whose product divides GPUs({gpus})"),
            ));
        };
        let dp = match self.dp {
            Some(d) => d,
            None => {
                if !gpus.is_multiple_of(others) {
                    return Err(bad(
                        source,
                        "dp",
                        format!("tp({tp}) * pp({pp}) * cp({cp}) = {others} does not divide GPUs({gpus}); choose degrees whose product divides {gpus}"),
                    ));
                }
                gpus / others
            }
        };
        if dp.checked_mul(others) != Some(gpus) {
            return Err(bad(
                source,
                "dp",
                format!(
                    "dp({dp}) * tp({tp}) * pp({pp}) * cp({cp}) = {} != GPUs({gpus}); {}",
                    u128::from(dp) * u128::from(others),
                    if gpus.is_multiple_of(others) {
                        format!("leave dp out to use dp={}", gpus / others)
                    } else {
                        format!("tp * pp * cp = {others} does not divide {gpus} either: choose degrees whose product divides {gpus}")
                    }
                ),
            ));
        }
        let ep = self.ep.unwrap_or(1);
        if !(dp * tp * cp).is_multiple_of(ep) {
            return Err(bad(
                source,
                "ep",
                format!(
                    "ep({ep}) must divide dp({dp}) * tp({tp}) * cp({cp}) = {}",
                    dp * tp * cp
                ),
            ));
        }
        let vpp = self.vpp.unwrap_or(1);
        let schedule = match self.schedule {
            Some(s) => s,
            None if vpp > 1 => Schedule::Interleaved,
            None => Schedule::OneFOneB,
        };
        if vpp > 1 && schedule != Schedule::Interleaved {
            return Err(bad(
                source,
                "vpp",
                format!("vpp({vpp}) > 1 needs schedule=interleaved"),
            ));
        }
        if vpp > 1 && pp == 1 {
            return Err(bad(source, "vpp", format!("vpp({vpp}) > 1 needs pp > 1")));
        }
        let sp = self.sp.unwrap_or(false);
        Ok(ParallelConfig {
            dp,
            tp,
            pp,
            cp,
            ep,
            mbs: self.mbs.unwrap_or(1),
            zero: self.zero.unwrap_or(0),
            recompute: self.recompute.unwrap_or(Recompute::None),
            sp,
            vpp,
            schedule,
            dp_attention: self.dp_attention.unwrap_or(false),
            attn: self.attn.unwrap_or(AttnImpl::Flash),
            tp_overlap: self.tp_overlap.unwrap_or(false),
        })
    }
}

impl fmt::Display for ParallelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rc = match self.recompute {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        };
        let sched = match self.schedule {
            Schedule::Gpipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
            Schedule::Interleaved => "interleaved",
        };
        write!(
            f,
            "dp={},tp={},pp={},cp={},ep={},mbs={},zero={},recompute={rc},sp={},vpp={},schedule={sched}",
            self.dp, self.tp, self.pp, self.cp, self.ep, self.mbs, self.zero, self.sp, self.vpp
        )?;
        if self.dp_attention {
            write!(f, ",dp_attention=true")?;
        }
        if self.tp_overlap {
            write!(f, ",tp_overlap=true")?;
        }
        if self.attn == AttnImpl::Unfused {
            write!(f, ",attn=unfused")?;
        }
        Ok(())
    }
}

/// The greatest common divisor of two degrees or widths; `gcd(0, n) = n`, so it
/// folds from 0 over a list.
pub fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::Schedule;

    /// Megatron-LM's warm-up counts, by hand: 1F1B over pp=4 with 8 micro-batches
    /// runs 3, 2, 1, 0 forwards first; interleaved over pp=4, vpp=2 with 4
    /// micro-batches (8 forwards) runs 2*3+4 = 10 capped at 8, 2*2+4 = 8, 2+4 = 6
    /// and 4; GPipe all of them.
    #[test]
    fn warmup_forwards_are_megatrons() {
        let one = Schedule::OneFOneB;
        let counts: Vec<usize> = (0..4).map(|s| one.warmup_forwards(4, 1, s, 8)).collect();
        assert_eq!(counts, [3, 2, 1, 0]);
        assert_eq!(one.warmup_forwards(4, 1, 0, 2), 2);
        let il = Schedule::Interleaved;
        let counts: Vec<usize> = (0..4).map(|s| il.warmup_forwards(4, 2, s, 8)).collect();
        assert_eq!(counts, [8, 8, 6, 4]);
        assert_eq!(Schedule::Gpipe.warmup_forwards(4, 1, 3, 8), 8);
    }

    #[test]
    fn gcd_of_degrees_and_widths() {
        assert_eq!(super::gcd(12, 18), 6);
        assert_eq!(super::gcd(18, 12), 6);
        // Folding from 0 starts at the first value.
        assert_eq!(super::gcd(0, 129), 129);
        assert_eq!(super::gcd(8, 0), 8);
        assert_eq!(super::gcd(50257, 8), 1);
    }
}
