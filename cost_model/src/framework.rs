//! What a training framework does with a layout, as mechanisms with a physical
//! meaning: the same layout runs at different speeds in Megatron-LM, DeepSpeed and
//! PyTorch FSDP because they hold and reduce gradients in different precisions,
//! block or overlap pipeline sends, and gather ZeRO-3 parameters at different
//! granularities. Which layouts a framework can run at all is `ir::Framework`; how
//! it runs them is here. A framework's older release is a release of the same
//! framework ([`Mechanisms::release`]), never a separate efficiency constant.

use meshplan_ir::Framework;

/// How one framework runs a layout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mechanisms {
    /// The framework.
    pub framework: Framework,
    /// Bytes per element of the gradients each rank holds and the data axis reduces:
    /// Megatron-LM accumulates bf16/fp16 gradients into fp32 main gradients and
    /// reduces those (4), as DeepSpeed's BF16 optimizer does; DeepSpeed's fp16 ZeRO and
    /// FSDP with a bf16 reduce dtype reduce in the compute precision (2).
    pub grad_bytes: f64,
    /// Pipeline sends and receives block the stage's compute stream (Megatron-LM
    /// before `--overlap-p2p-communication`, DeepSpeed's pipeline engine): each
    /// micro-batch's transfer is added to the stage's busy time instead of running
    /// beside the next task.
    pub p2p_blocking: bool,
    /// ZeRO-3 / FSDP gathers parameters one unit (a transformer layer) at a time and
    /// prefetches this many units ahead: a gather hides only behind the compute of the
    /// units before it that are still running.
    pub zero3_prefetch_layers: f64,
    /// Separate ZeRO-3 collectives per layer and pass: DeepSpeed gathers each
    /// parameter tensor of a module on its own (the weights of a transformer layer:
    /// 4), FSDP one flat buffer per wrapped block (1). Each pays the ring latency.
    pub zero3_calls_per_layer: f64,
    /// The pipeline engine sends each tensor-parallel rank's whole activation to its
    /// peer (DeepSpeed's `PipelineEngine`), instead of Megatron's scatter-gather, which
    /// sends a `1/tp` slice and gathers it over NVLink on the receiving stage
    /// (Narayanan et al. 2021, Sec. 4.1).
    pub p2p_whole_activation: bool,
}

impl Default for Mechanisms {
    fn default() -> Mechanisms {
        Mechanisms::of(Framework::Meshplan)
    }
}

impl Mechanisms {
    /// The framework's current release.
    pub fn of(framework: Framework) -> Mechanisms {
        let base = Mechanisms {
            framework,
            grad_bytes: 2.0,
            p2p_blocking: false,
            zero3_prefetch_layers: 1.0,
            zero3_calls_per_layer: 1.0,
            p2p_whole_activation: false,
        };
        match framework {
            // meshplan's executor accumulates every gradient in fp32 and reduces it
            // so on every device (its `F32` buffers), partitions the fp32 masters
            // under ZeRO and gathers compute copies, as Megatron-LM's distributed
            // optimizer does; it overlaps sends through its communicator threads.
            Framework::Meshplan => Mechanisms {
                grad_bytes: 4.0,
                ..base
            },
            Framework::MegatronCore => Mechanisms {
                grad_bytes: 4.0,
                ..base
            },
            // torchtitan's FSDP2 default `mixed_precision_reduce = float32`.
            Framework::Torchtitan => Mechanisms {
                grad_bytes: 4.0,
                ..base
            },
            Framework::Deepspeed => Mechanisms {
                zero3_calls_per_layer: 4.0,
                ..base
            },
            Framework::MegatronDeepspeed => Mechanisms {
                grad_bytes: 4.0,
                p2p_blocking: true,
                p2p_whole_activation: true,
                zero3_calls_per_layer: 4.0,
                ..base
            },
        }
    }

    /// The framework as it was in `year`: Megatron-LM before 2023 blocked on its
    /// pipeline sends (`--overlap-p2p-communication` arrived with Megatron-Core).
    pub fn release(framework: Framework, year: u32) -> Mechanisms {
        let now = Mechanisms::of(framework);
        match framework {
            Framework::MegatronCore if year < 2023 => Mechanisms {
                p2p_blocking: true,
                ..now
            },
            _ => now,
        }
    }

    /// How this framework holds the model states of a model computing in
    /// `compute_bytes` per element.
    pub fn holding(self, compute_bytes: f64) -> crate::memory::Holding {
        crate::memory::Holding {
            compute_bytes,
            grad_bytes: self.grad_bytes,
        }
    }

    /// Bytes per element of the gradient sums (data-parallel reductions, a tied
    /// table's, sequence parallelism's partial norms) of a model computing in
    /// `compute_bytes` per element: the framework's gradient precision, never below
    /// the compute dtype's.
    pub fn grad_sum_bytes(self, compute_bytes: f64) -> f64 {
        self.grad_bytes.max(compute_bytes)
    }

    /// With gradients reduced in `bytes` per element instead of the framework's
    /// default (FSDP's `reduce_dtype`, a run's setting).
    pub fn with_grad_bytes(self, bytes: f64) -> Mechanisms {
        Mechanisms {
            grad_bytes: bytes,
            ..self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_keeps_fp32_gradients_and_its_old_release_blocks_on_sends() {
        let now = Mechanisms::of(Framework::MegatronCore);
        assert_eq!(now.grad_bytes, 4.0);
        assert!(!now.p2p_blocking);
        assert!(Mechanisms::release(Framework::MegatronCore, 2021).p2p_blocking);
        assert!(Mechanisms::of(Framework::MegatronDeepspeed).p2p_blocking);
        // meshplan's own executor: fp32 gradients.
        let own = Mechanisms::default();
        assert_eq!(own.grad_sum_bytes(2.0), 4.0);
        let ds = Mechanisms::of(Framework::Deepspeed);
        assert_eq!((ds.grad_sum_bytes(2.0), ds.grad_sum_bytes(4.0)), (2.0, 4.0));
    }
}
