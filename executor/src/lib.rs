//! Brief overview: the executor runs a plan's per-rank programs.
//!
//! - [`device`]: the one compute trait, `Device` (buffers where the kernels run:
//!   `HostDevice` in fp32, `Bf16Host` with a GPU's rounding, `CudaDevice`), and the
//!   training interpreter over it (`device::train`).
//! - [`comm`]: the `Communicator` trait and the in-process implementation (ranks as
//!   threads) that counts bytes per collective kind and axis.
//! - [`train`]: training options and reports, [`train::train`] on the CPU,
//!   `--check` against a single-rank run, and the byte comparison with the plan.
//! - [`ckpt`]: checkpoints of full tensors that any plan resumes from.
//! - [`infer`]: the inference interpreter (prefill, decode, per-rank KV cache),
//!   with [`sample`] (greedy, temperature and top-p) and `--check` against a
//!   single-rank run.
//! - `moe` (crate-private): routed experts' forward (routing, capacity, the
//!   expert-parallel exchange), shared by the training and inference interpreters.
//! - [`weights`]: Hugging Face safetensors checkpoints, each rank reading its shard
//!   from a shared memory map; [`tokenize`]: `tokenizer.json` prompts.
//! - [`mapped`]: read-only maps of input files, and a clear stop when one is
//!   truncated under a run.
//! - [`alloc`]: the allocator a process running ranks should use.
//! - Processes as ranks (torchrun/Slurm variables, the TCP rendezvous that shares
//!   NCCL's unique id, the `meshplan launch` supervisor) are the `meshplan-launch`
//!   crate below this one; `engine` wires it to NCCL.
//! - [`shard`], [`init`]: which slice of each weight a rank holds; deterministic
//!   weights and data, identical whatever the sharding.

pub mod alloc;
pub mod ckpt;
pub mod comm;
pub mod data;
pub mod device;
pub mod disagg;
pub mod engine;
pub mod infer;
pub mod init;
pub mod mapped;
mod moe;
mod program;
pub mod sample;
pub mod shard;
pub mod tokenize;
pub mod trace;
pub mod train;
pub mod weights;

pub use meshplan_ir as ir;
pub use meshplan_kernels as kernels;

/// The rotary frequencies of a graph's constants, in the kernels' form.
pub(crate) fn rope_of(c: &ir::graph::Constants) -> kernels::cpu::Rope {
    let (factor, low, high) = c.rope_scaling.wavelength_form();
    kernels::cpu::Rope {
        theta: c.rope_theta as f32,
        factor: factor as f32,
        low_wavelength: low as f32,
        high_wavelength: high as f32,
    }
}

/// A per-row statistic a forward kernel keeps for its backward: the interpreters
/// key it by (layer, op, `Stat`), so a statistic saved under one name and read
/// under another is a compile error, not a run-time "was not kept".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Stat {
    /// LayerNorm's row means.
    Mean,
    /// A norm's reciprocal standard deviations.
    Rstd,
    /// Attention's log-sum-exps of the scores.
    Lse,
}

/// Why `meshplan run` refuses `plan` before any rank starts, whatever is asked of
/// it: an inference layout not run yet ([`infer::layout_not_run`]), a graph the
/// interpreters cannot feed or an op they do not compute (latent attention), or a
/// model feature they do not implement for the plan's own sequences
/// ([`check_executable`]). `plan` and `deploy` say it as they write such a plan.
pub fn refusal(plan: &ir::plan::Plan) -> Option<String> {
    if plan.kind == ir::plan::PlanKind::Inference {
        if let Some(why) = infer::layout_not_run(plan) {
            return Some(why);
        }
    }
    // The tokens one sequence runs through: a generated sequence's last token is
    // sampled, never fed back.
    let tokens = match &plan.workload {
        ir::Workload::Train { seq_len, .. } => *seq_len,
        ir::Workload::Inference {
            prompt_len,
            output_len,
            ..
        } => (prompt_len + output_len).saturating_sub(1),
    };
    program::runnable(plan)
        .and_then(|()| check_executable(&plan.graph, tokens as usize))
        .err()
}

/// Refuses a model whose math the executor does not implement, naming the field,
/// rather than computing another model: ALiBi attention, the `config.json` fields
/// recorded as unexecutable, and a sliding attention window shorter than the `tokens` one
/// sequence runs through the model (within the window every query sees its whole
/// causal prefix, so the window changes nothing and the run is exact).
pub fn check_executable(graph: &ir::Graph, tokens: usize) -> Result<(), String> {
    let c = &graph.constants;
    let alibi = graph
        .ops()
        .any(|o| matches!(o.kind, ir::OpKind::Attention(a) if a.alibi));
    if alibi {
        return Err("the model's position is ALiBi (`position: alibi`, or a BLOOM config.json): the executor's attention kernels add no ALiBi biases, so it refuses rather than compute a different model; planning and estimates price it".into());
    }
    if let Some(u) = c.unexecutable.first() {
        let more = match c.unexecutable.len() {
            1 => String::new(),
            n => format!(
                " (and {} more: {})",
                n - 1,
                c.unexecutable[1..]
                    .iter()
                    .map(|u| format!("`{}`", u.field))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        return Err(format!(
            "the model's config.json field `{}`: {}{more}. The executor refuses it rather than compute a different model; planning and estimates are unaffected",
            u.field, u.reason
        ));
    }
    if let Some(w) = c.sliding_window {
        if tokens as u64 > w {
            return Err(format!(
                "the model's config.json field `sliding_window` ({w}): a sequence of {tokens} tokens would need the window, which the executor does not implement; keep prompt + new tokens - 1 (or the training seq_len) at most {w}"
            ));
        }
    }
    Ok(())
}
