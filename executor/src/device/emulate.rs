//! The host devices: the CPU reference kernels behind [`super::Device`] (one
//! implementation, in `mod.rs`, for every [`HostPrecision`]), in fp32
//! ([`HostDevice`]) or as a GPU rounds them ([`Bf16Host`]), and the buffers a GPU
//! run would move over the bus, which they report ([`Crossing`]).
//!
//! [`Bf16Host`]: the host device with a GPU's rounding. Every activation, activation
//! gradient and weight compute copy is rounded to bf16 where the CUDA kernels store
//! bf16, and everything the CUDA kernels keep in fp32 (weight gradients, master
//! weights, moments, statistics, losses) stays fp32. Kernels take bf16-valued
//! inputs and compute in fp32 as the GPU's do, so a run on it differs from the fp32
//! run by what mixed precision costs: the yardstick for the tolerances of
//! [`check_mixed_precision`], measured here rather than guessed.

/// The CPU reference kernels in fp32 behind the [`super::Device`] trait: the device
/// interpreter on a machine without a GPU, and the proof of its bookkeeping.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostDevice;

/// What distinguishes the host devices, which share one implementation of
/// [`super::Device`] over the CPU kernels: how they store what a GPU stores in bf16.
pub trait HostPrecision: Copy + Send + Sync + 'static {
    /// [`super::Buffers::act_bytes`].
    const ACT_BYTES: usize;
    /// Applied to each buffer a GPU kernel would store in bf16, after the kernel.
    fn round(x: &mut [f32]);
    /// Told of each buffer that would cross between the host and a GPU's memory
    /// (`elems` elements): where a GPU run would wait on the bus. The host devices
    /// ignore it; an audit counts what a step moves.
    fn crossed(what: Crossing, elems: usize) {
        let _ = (what, elems);
    }
}

/// A buffer crossing between the host and the device's memory, as a GPU run
/// makes it ([`HostPrecision::crossed`]): an upload, a download, or what a
/// kernel hands the host (the finiteness check's flag, the experts' counts).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Crossing {
    /// fp32 values to the device ([`super::Buffers::f32_upload`]).
    F32Up,
    /// Values to the device as a compute buffer ([`super::Buffers::act_from_host`]).
    ActUp,
    /// Token ids, labels, positions or indices to the device.
    IdsUp,
    /// fp32 values to the host ([`super::Buffers::f32_download`]).
    F32Down,
    /// A compute buffer to the host ([`super::Buffers::act_download`]).
    ActDown,
    /// Ids to the host ([`super::Buffers::ids_download`]).
    IdsDown,
    /// [`super::Device::first_non_finite`]'s answer.
    Flag,
    /// Each expert's count, which [`super::Device::moe_dispatch`] leaves on the host.
    ExpertCounts,
}

impl HostPrecision for HostDevice {
    const ACT_BYTES: usize = 4;
    fn round(_: &mut [f32]) {}
}

/// The host device rounding what a GPU stores in bf16 (its [`super::Device`]
/// implementation is [`HostDevice`]'s, with [`HostPrecision::round`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Bf16Host;

impl HostPrecision for Bf16Host {
    const ACT_BYTES: usize = 2;
    fn round(x: &mut [f32]) {
        for v in x {
            *v = half::bf16::from_f32(*v).to_f32();
        }
    }
}

/// Largest relative difference of a step's loss allowed between a mixed-precision
/// run and its fp32 reference. Over the bf16 mode matrix (141 configurations of
/// dense, tied + dropout and routed-expert models, the `..._within_the_bf16_tolerances`
/// tests of `tests/it/matrix.rs`, 5 steps), [`Bf16Host`] measures at most
/// 2.4e-4 on the dense models and 6.7e-4 with routed experts; the headroom is for
/// GPU kernels that also sum in another order than the CPU's.
pub const MIXED_LOSS_TOLERANCE: f64 = 1e-3;

/// Largest distance allowed between a mixed-precision run's weights and its fp32
/// reference's, relative to how far the reference moved them from their start
/// (`‖w_run − w_ref‖ / ‖w_ref − w_0‖` over all weights): AdamW turns any rounding of
/// a small gradient into a full-size step, so a per-element bound would measure the
/// optimizer, not the run. Over the bf16 mode matrix [`Bf16Host`] measures
/// 0.05–0.06 on the dense models, 0.11–0.18 with dropless routed experts and
/// 0.13–0.25 under an expert capacity: rounding flips some routing decisions, and
/// a token sent to another expert, or dropped, is a discrete change that the
/// weights carry on. A 1.5× learning rate measures 0.63–0.72 on the same
/// configurations, and 0.56 on the two-layer models of
/// `mixed_precision_stays_within_the_check_tolerances_and_a_wrong_run_does_not`.
/// The bound sits between the two, near their geometric mean (0.37), leaving a
/// margin of 1.6× above the farthest correct run and 1.4× below the nearest wrong
/// one.
pub const MIXED_UPDATE_TOLERANCE: f64 = 0.4;

/// The whole value weight `name` (block layer `layer`) starts from under `opts`, as
/// the training interpreter reads it: the resumed checkpoint's, a Hugging Face
/// checkpoint's, or the seeded initialisation. The yardstick of a run's updates is
/// the distance from there, not from a seeded start the run never had.
fn starting_full(
    graph: &meshplan_ir::Graph,
    name: &str,
    layer: u64,
    opts: &crate::train::TrainOptions,
) -> Result<Vec<f32>, String> {
    let (op, id, shape) = crate::program::weight_site(graph, name)?;
    if let Some(ck) = &opts.resume {
        return ck.values(
            &crate::ckpt::tensor_name("w", &(name.into(), layer)),
            &shape,
        );
    }
    // A fine-tuned or seeded start, as one rank without tensor or expert axes reads it.
    let one = crate::shard::TpPos::ONE;
    let hf = opts.weights.as_deref();
    crate::weights::starting_slice(graph, (op, id), layer, (one, one), opts.seed, hf)
        .map_err(|e| e.to_string())
}

/// Compares a run in mixed precision with its fp32 reference (each rank's weights
/// against the same slice of the reference's):
/// per-step losses (relative) and the weights' distance relative to the reference's
/// updates ([`MIXED_UPDATE_TOLERANCE`]). `Ok` holds the report lines; `Err` them with
/// the failure.
pub fn check_mixed_precision(
    plan: &meshplan_ir::plan::Plan,
    run: &crate::train::TrainReport,
    reference: &crate::train::TrainReport,
    start: &crate::train::TrainOptions,
    loss_tolerance: f64,
    update_tolerance: f64,
) -> Result<Vec<String>, String> {
    let (mut lines, worst_loss) = crate::train::loss_lines(run, reference);
    let graph = &plan.graph;
    let (mut diff2, mut moved2) = (0.0f64, 0.0f64);
    let mut worst = (0.0f64, String::new());
    crate::train::each_weight_slice(plan, run, reference, |w| {
        let (name, layer) = (w.name, w.layer);
        let w0 = starting_full(graph, name, layer, start)?;
        let w0 = crate::program::rank_slice(plan, w.rank, name, &w0)?;
        let d: f64 = (w.local.iter().zip(&w.want))
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let m: f64 = (w.want.iter().zip(&w0))
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        diff2 += d;
        moved2 += m;
        let rel = d.sqrt() / m.sqrt().max(1e-30);
        if rel > worst.0 {
            let at = crate::program::layer_label(layer);
            worst = (rel, format!("rank {} `{name}`{at}", w.rank));
        }
        Ok(())
    })?;
    let update = diff2.sqrt() / moved2.sqrt().max(1e-30);
    lines.push(format!(
        "worst relative loss difference {worst_loss:.2e} (tolerance {loss_tolerance:.0e}); weights {update:.3} of the reference's update away (tolerance {update_tolerance}), farthest {} at {:.3}",
        worst.1, worst.0
    ));
    // A NaN loss or weight fails too: it is never within a tolerance.
    if worst_loss.is_nan()
        || worst_loss > loss_tolerance
        || update > update_tolerance
        || !update.is_finite()
    {
        return Err(lines.join("\n"));
    }
    Ok(lines)
}
