//! Where a training plan runs, chosen once: the binary names a backend and gets an
//! [`Engine`], and [`Engine::train`] wires the devices, the communicators (NCCL
//! between GPUs, threads otherwise) and the interpreter. The GPU lives behind one
//! type, [`Gpu`]: with the `cuda` feature it is the probed device count; without it
//! it has no values, so an engine on the GPU cannot be built and every arm that
//! would use one compiles without a stub.

use crate::device::train::{supported, train_device};
use crate::train::{RankReport, TrainOptions, TrainReport};
use meshplan_ir::plan::Plan;
use meshplan_launch::{LaunchEnv, RendezvousConfig};

/// Where a training plan runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// The device interpreter on the CPU kernels, fp32 (the reference).
    Cpu,
    /// The device interpreter on the CPU kernels with a GPU's bf16 rounding.
    CpuBf16,
    /// The device interpreter on the GPUs.
    Cuda(Gpu),
}

/// Why an engine cannot be had or cannot run a plan.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The backend's name is not one of ours (bad input).
    #[error("--backend {0}: expected cpu, cpu-bf16 or cuda")]
    UnknownBackend(String),
    /// No GPU, driver or library, or a build without the feature.
    #[error("--backend cuda: {0}")]
    NoGpu(String),
    /// The engine does not run this plan.
    #[error("{0}")]
    Unsupported(String),
    /// The run could not start or did not finish.
    #[error("{0}")]
    Run(#[from] crate::train::ExecError),
    /// Setting up a launched rank (rendezvous, NCCL, its GPU) failed.
    #[error("{0}")]
    Failed(String),
    /// The launched ranks disagree on their input (world size, plan, job secret, a
    /// rank taken twice): bad input, as `rendezvous-check` says.
    #[error("{0}")]
    Launch(String),
}

impl From<meshplan_launch::rendezvous::RendezvousError> for EngineError {
    fn from(e: meshplan_launch::rendezvous::RendezvousError) -> Self {
        match e.is_bad_input() {
            true => EngineError::Launch(e.to_string()),
            false => EngineError::Failed(e.to_string()),
        }
    }
}

impl Engine {
    /// The engine `--backend` names: `cuda` needs a build with the feature, a
    /// driver, NVRTC, cuBLASLt and a device, and says which is missing.
    pub fn parse(backend: &str) -> Result<Engine, EngineError> {
        match backend {
            "cpu" => Ok(Engine::Cpu),
            "cpu-bf16" => Ok(Engine::CpuBf16),
            "cuda" => Gpu::probe().map(Engine::Cuda),
            other => Err(EngineError::UnknownBackend(other.to_string())),
        }
    }

    /// This engine for `plan`, or why the interpreter does not take it (a
    /// separate router op, a mesh axis it does not split).
    pub fn for_plan(self, plan: &Plan) -> Result<Engine, EngineError> {
        supported(plan).map_err(|why| {
            EngineError::Unsupported(format!("the executor does not run this plan: {why}"))
        })?;
        Ok(self)
    }

    /// Whether the ranks' state lives in this process's memory (every engine but
    /// the device interpreter on the GPU).
    pub fn on_host(self) -> bool {
        !matches!(self, Engine::Cuda(_))
    }

    /// What the engine is, for logs.
    pub fn describe(self) -> &'static str {
        match self {
            Engine::Cpu => "CPU threads, fp32",
            Engine::CpuBf16 => "CPU threads, bf16 rounding",
            Engine::Cuda(_) => "threads on the GPUs, bf16 compute",
        }
    }

    /// Trains this process's rank of a launched plan (one process per GPU, NCCL
    /// between them, its id shared through the TCP rendezvous) on the engine's GPU,
    /// and gathers every rank's loss parts and step times to all: the report's
    /// losses are the sums, its ranks this process's (on rank 0 of a run keeping
    /// its final weights, every rank's, for `--check`), and on rank 0 the
    /// checkpoints written (`opts.save`: every rank's state goes to rank 0).
    pub fn train_launched_rank(
        self,
        plan: &Plan,
        opts: &TrainOptions,
        env: &LaunchEnv,
        cfg: &RendezvousConfig,
    ) -> Result<TrainReport, EngineError> {
        let gpu = match self {
            Engine::Cuda(g) => g,
            Engine::Cpu | Engine::CpuBf16 => {
                return Err(EngineError::Unsupported(
                    "a launch of one process per GPU trains on --backend cuda".into(),
                ))
            }
        };
        self.for_plan(plan)?;
        let mut rv = meshplan_launch::Rendezvous::connect(cfg)?;
        let (reps, saved) = gpu.train_rank(plan, opts, env, &mut rv)?;
        let rep = reps
            .first()
            .ok_or_else(|| EngineError::Failed("no report".into()))?;
        // Every rank's loss parts, and its start and step ends on the Unix clock
        // (the processes' own clocks differ), exactly (f64 bits), to every rank.
        let steps = rep.loss_parts.len();
        let mine: Vec<u8> = launch_values(rep)
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let all = rv.all_gather_bytes(&mine)?;
        let ranks: Vec<Vec<f64>> = all
            .iter()
            .map(|blob| {
                blob.chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                    .collect()
            })
            .collect();
        let (losses, step_s) = merge_launch_values(&ranks, steps).map_err(EngineError::Failed)?;
        let tokens_per_step = match plan.workload {
            meshplan_ir::Workload::Train {
                seq_len,
                global_batch,
                ..
            } => seq_len * global_batch,
            _ => 0,
        };
        Ok(TrainReport {
            losses,
            step_s,
            tokens_per_step,
            ranks: reps,
            saved,
            lr: f64::from(opts.lr),
        })
    }

    /// Generates with an inference plan, every rank a thread of this process (the
    /// in-process communicator between them).
    pub fn infer(
        self,
        plan: &Plan,
        opts: &crate::infer::InferOptions,
    ) -> Result<crate::infer::InferReport, EngineError> {
        match self {
            Engine::Cpu => Ok(crate::infer::infer(plan, opts)?),
            Engine::CpuBf16 => Ok(crate::infer::infer_on(plan, opts, &|_| {
                Ok(crate::device::emulate::Bf16Host)
            })?),
            Engine::Cuda(g) => g.infer(plan, opts),
        }
    }

    /// Runs a disaggregated deployment's two pools, every rank a thread of this
    /// process.
    pub fn infer_disaggregated(
        self,
        plan: &Plan,
        opts: &crate::infer::InferOptions,
    ) -> Result<crate::disagg::DisaggReport, EngineError> {
        match self {
            Engine::Cpu => Ok(crate::disagg::infer_disaggregated(plan, opts)?),
            Engine::CpuBf16 => Ok(crate::disagg::infer_disaggregated_on(plan, opts, &|_| {
                Ok(crate::device::emulate::Bf16Host)
            })?),
            Engine::Cuda(g) => g.infer_disaggregated(plan, opts),
        }
    }

    /// Trains `plan`, every rank a thread of this process.
    pub fn train(self, plan: &Plan, opts: &TrainOptions) -> Result<TrainReport, EngineError> {
        match self {
            Engine::Cpu => Ok(crate::train::train(plan, opts)?),
            Engine::CpuBf16 => Ok(train_device(plan, opts, &|_| {
                Ok(crate::device::emulate::Bf16Host)
            })?),
            Engine::Cuda(g) => g.train(plan, opts),
        }
    }
}

/// What a launched rank shares with the others: its loss parts, then its first
/// step's start and each step's end in seconds since the Unix epoch.
fn launch_values(rep: &RankReport) -> Vec<f64> {
    let c0 = rep.clock0_unix_s;
    rep.loss_parts
        .iter()
        .copied()
        .chain(std::iter::once(c0 + rep.steps_at.0))
        .chain(rep.steps_at.1.iter().map(|t| c0 + t))
        .collect()
}

/// Every rank's [`launch_values`] into the run's losses (summed over ranks) and
/// step times (the slowest rank's step ends on the shared clock, as
/// [`crate::train::run_step_times`] reads one process's ranks).
fn merge_launch_values(ranks: &[Vec<f64>], steps: usize) -> Result<(Vec<f64>, Vec<f64>), String> {
    let mut losses = vec![0.0; steps];
    let mut spans = Vec::new();
    for vals in ranks {
        if vals.len() != 2 * steps + 1 {
            return Err(format!(
                "a rank reported {} values, expected {}",
                vals.len(),
                2 * steps + 1
            ));
        }
        for (l, v) in losses.iter_mut().zip(vals) {
            *l += v;
        }
        spans.push((vals[steps], &vals[steps + 1..]));
    }
    Ok((losses, crate::train::step_times(&spans, steps)))
}

pub use gpu::Gpu;

#[cfg(feature = "cuda")]
mod gpu {
    use super::EngineError;
    use crate::ckpt::Saved;
    use crate::comm::nccl::{nccl_available, NcclComm};
    use crate::device::cuda::{CudaComm, CudaDevice};
    use crate::device::train::{train_device_rank, train_device_with};
    use crate::train::{RankReport, TrainOptions, TrainReport};
    use meshplan_ir::plan::Plan;
    use meshplan_launch::{LaunchEnv, Rendezvous};

    /// The GPUs of this machine, probed.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Gpu {
        devices: usize,
    }

    impl Gpu {
        pub(super) fn probe() -> Result<Gpu, EngineError> {
            let info = meshplan_kernels::cuda::probe()
                .map_err(|why| EngineError::NoGpu(why.to_string()))?;
            tracing::info!("--backend cuda: {info}");
            Ok(Gpu {
                devices: info.device_count.max(1),
            })
        }

        /// With as many GPUs as ranks (and NCCL), one NCCL communicator per GPU,
        /// rank `r` on GPU `r` (`ncclCommInitAll`); otherwise none: rank `r` runs on
        /// GPU `r mod GPUs`, summing through the host with the in-process
        /// communicator.
        #[allow(clippy::vec_box)] // boxed as a host device's trait-object communicators are
        fn comms(self, plan: &Plan) -> Result<Option<Vec<Box<CudaComm>>>, EngineError> {
            let (gpus, ranks) = (self.devices, plan.ranks.len());
            if ranks < 2 || ranks != gpus || nccl_available().is_err() {
                return Ok(None);
            }
            tracing::info!("{ranks} ranks on {gpus} GPUs, NCCL between them");
            let devices: Vec<usize> = (0..gpus).collect();
            let comms =
                NcclComm::in_process(&devices).map_err(|e| EngineError::Failed(e.to_string()))?;
            Ok(Some(
                comms
                    .into_iter()
                    .map(|c| Box::new(CudaComm::Nccl(c)))
                    .collect(),
            ))
        }

        /// The ranks as threads of this process, over [`Gpu::comms`].
        pub(super) fn train(
            self,
            plan: &Plan,
            opts: &TrainOptions,
        ) -> Result<TrainReport, EngineError> {
            let gpus = self.devices;
            let make = |r| CudaDevice::on(r % gpus);
            Ok(train_device_with(plan, opts, &make, self.comms(plan)?)?)
        }

        /// Inference as training runs, over [`Gpu::comms`].
        pub(super) fn infer(
            self,
            plan: &Plan,
            opts: &crate::infer::InferOptions,
        ) -> Result<crate::infer::InferReport, EngineError> {
            let gpus = self.devices;
            let make = |r| CudaDevice::on(r % gpus);
            Ok(crate::infer::infer_on_with(
                plan,
                opts,
                &make,
                self.comms(plan)?,
            )?)
        }

        /// A disaggregated deployment with world rank `r` on GPU `r mod GPUs`.
        pub(super) fn infer_disaggregated(
            self,
            plan: &Plan,
            opts: &crate::infer::InferOptions,
        ) -> Result<crate::disagg::DisaggReport, EngineError> {
            let gpus = self.devices;
            Ok(crate::disagg::infer_disaggregated_on(plan, opts, &|r| {
                CudaDevice::on(r % gpus)
            })?)
        }

        pub(super) fn train_rank(
            self,
            plan: &Plan,
            opts: &TrainOptions,
            env: &LaunchEnv,
            rv: &mut Rendezvous,
        ) -> Result<(Vec<RankReport>, Vec<Saved>), EngineError> {
            let comm =
                NcclComm::from_launch(env, rv).map_err(|e| EngineError::Failed(e.to_string()))?;
            let dev =
                CudaDevice::on(env.local_rank).map_err(|e| EngineError::Failed(e.to_string()))?;
            train_device_rank(plan, opts, dev, Box::new(CudaComm::Nccl(comm)))
                .map_err(EngineError::Run)
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod gpu {
    use super::EngineError;
    use crate::ckpt::Saved;
    use crate::train::{RankReport, TrainOptions, TrainReport};
    use meshplan_ir::plan::Plan;
    use meshplan_launch::{LaunchEnv, Rendezvous};

    /// No GPU in a build without the `cuda` feature: this type has no values, so
    /// no engine on the GPU exists and its arms never run.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Gpu {}

    impl Gpu {
        pub(super) fn probe() -> Result<Gpu, EngineError> {
            let why = meshplan_kernels::cuda::probe().err().map_or_else(
                || "this build has no GPU support".to_string(),
                |e| e.to_string(),
            );
            Err(EngineError::NoGpu(why))
        }

        pub(super) fn train(self, _: &Plan, _: &TrainOptions) -> Result<TrainReport, EngineError> {
            match self {}
        }

        pub(super) fn infer(
            self,
            _: &Plan,
            _: &crate::infer::InferOptions,
        ) -> Result<crate::infer::InferReport, EngineError> {
            match self {}
        }

        pub(super) fn infer_disaggregated(
            self,
            _: &Plan,
            _: &crate::infer::InferOptions,
        ) -> Result<crate::disagg::DisaggReport, EngineError> {
            match self {}
        }

        pub(super) fn train_rank(
            self,
            _: &Plan,
            _: &TrainOptions,
            _: &LaunchEnv,
            _: &mut Rendezvous,
        ) -> Result<(Vec<RankReport>, Vec<Saved>), EngineError> {
            match self {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::merge_launch_values;

    /// Two processes whose clocks started half a second apart (hand-worked):
    /// rank A starts at Unix 1000 and ends its steps at 1001 and 1002; rank B
    /// starts at 1000.5 and ends at 1000.9 and 1002.3. The run's steps end when the
    /// slower rank does: 1001 and 1002.3, so 1.0 s and 1.3 s, adding up to the
    /// 2.3 s of wall clock (each rank's own slowest step, 1.0 and 1.4, would not).
    #[test]
    fn launched_step_times_line_up_the_processes_clocks() {
        let a = [1.5, 2.5, 1000.0, 1001.0, 1002.0];
        let b = [0.5, 0.25, 1000.5, 1000.9, 1002.3];
        let (losses, steps) = merge_launch_values(&[a.to_vec(), b.to_vec()], 2).unwrap();
        assert_eq!(losses, vec![2.0, 2.75]);
        assert_eq!(steps.len(), 2);
        assert!((steps[0] - 1.0).abs() < 1e-9, "{steps:?}");
        assert!((steps[1] - 1.3).abs() < 1e-9, "{steps:?}");
        assert!((steps.iter().sum::<f64>() - 2.3).abs() < 1e-9);
    }

    #[test]
    fn a_rank_with_the_wrong_count_is_named() {
        let e = merge_launch_values(&[vec![0.0; 5], vec![0.0; 4]], 2).unwrap_err();
        assert_eq!(e, "a rank reported 4 values, expected 5");
    }
}
