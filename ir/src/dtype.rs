//! Element types.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of a tensor. Read in any spelling [`DType::parse`] takes (`fp32`,
/// `float32`, `bfloat16`, `half`, ...), written back in the canonical one
/// ([`DType::as_str`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum DType {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// 8-bit float (e4m3 or e5m2, same size).
    Fp8,
    /// 32-bit integer (token ids).
    I32,
    /// One byte (dropout masks).
    U8,
}

impl DType {
    /// Bytes per element.
    pub const fn size_bytes(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::Bf16 | DType::F16 => 2,
            DType::Fp8 | DType::U8 => 1,
        }
    }

    /// The spelling used in files.
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::Fp8 => "fp8",
            DType::I32 => "i32",
            DType::U8 => "u8",
        }
    }
}

impl DType {
    /// The spellings [`DType::parse`] takes, for messages.
    pub const SPELLINGS: &'static str =
        "f32 (or fp32, float32), bf16 (or bfloat16), f16 (or fp16, float16, half), fp8 (or float8)";

    /// A dtype as Megatron-LM, DeepSpeed, PyTorch (`torch.float32`) and the model
    /// files spell it, any case.
    pub fn parse(s: &str) -> Option<DType> {
        let lower = s.trim().to_ascii_lowercase();
        let name = lower.strip_prefix("torch.").unwrap_or(&lower);
        Some(match name {
            "f32" | "fp32" | "float32" | "float" => DType::F32,
            "bf16" | "bfloat16" => DType::Bf16,
            "f16" | "fp16" | "float16" | "half" => DType::F16,
            "fp8" | "f8" | "float8" | "float8_e4m3fn" | "float8_e5m2" => DType::Fp8,
            "i32" | "int32" => DType::I32,
            "u8" | "uint8" => DType::U8,
            _ => return None,
        })
    }
}

impl TryFrom<String> for DType {
    type Error = String;

    fn try_from(s: String) -> Result<DType, String> {
        DType::parse(&s).ok_or_else(|| {
            let shown: String = s.chars().take(40).collect();
            format!("unknown dtype `{shown}`; expected {}", DType::SPELLINGS)
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_reads_and_writes_back_canonical() {
        for (spellings, want) in [
            (
                &["f32", "fp32", "float32", "FP32", "torch.float32"][..],
                DType::F32,
            ),
            (
                &["bf16", "bfloat16", "BF16", "torch.bfloat16"][..],
                DType::Bf16,
            ),
            (&["f16", "fp16", "float16", "half"][..], DType::F16),
            (&["fp8", "float8"][..], DType::Fp8),
        ] {
            for s in spellings {
                let got: DType = serde_yaml_ng::from_str(s).unwrap_or_else(|e| panic!("{s}: {e}"));
                assert_eq!(got, want, "{s}");
                assert_eq!(
                    serde_json::to_string(&got).unwrap(),
                    format!("\"{}\"", want.as_str())
                );
            }
        }
        let e = serde_yaml_ng::from_str::<DType>("float64")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown dtype `float64`"), "{e}");
        assert!(
            e.contains("fp32") && e.contains("bfloat16") && e.contains("half"),
            "{e}"
        );
    }
}
