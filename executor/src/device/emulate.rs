//! [`Bf16Host`]: the host device with a GPU's rounding. Every activation, activation
//! gradient and weight compute copy is rounded to bf16 where the CUDA kernels store
//! bf16, and everything the CUDA kernels keep in fp32 (weight gradients, master
//! weights, moments, statistics, losses) stays fp32. Kernels take bf16-valued
//! inputs and compute in fp32 as the GPU's do, so a run on it differs from the fp32
//! run by what mixed precision costs: the yardstick for the tolerances of
//! [`super::check_mixed_precision`], measured here rather than guessed.

use super::HostPrecision;

/// The host device rounding what a GPU stores in bf16 (its [`super::Device`]
/// implementation is [`super::HostDevice`]'s, with [`HostPrecision::round`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Bf16Host;

impl HostPrecision for Bf16Host {
    const NAME: &'static str = "cpu-bf16";
    const ACT_BYTES: usize = 2;
    fn round(x: &mut [f32]) {
        for v in x {
            *v = half::bf16::from_f32(*v).to_f32();
        }
    }
}
