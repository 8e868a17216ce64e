//! Brief overview: the executor runs a plan's per-rank programs.
//!
//! - [`backend`]: the `Backend` trait (the kernels an interpreter runs) and the CPU
//!   implementation over `meshplan_kernels::cpu`; `backend_cuda` (feature `cuda`):
//!   the same trait on a GPU through host staging, for the plans the device
//!   interpreter does not take.
//! - [`comm`]: the `Communicator` trait and the in-process implementation (ranks as
//!   threads) that counts bytes per collective kind and axis.
//! - [`train`]: the training interpreter over the CPU kernels, `--check` against a
//!   single-rank run, and the byte comparison with the plan.
//! - [`ckpt`]: checkpoints of full tensors that any plan resumes from.
//! - [`infer`]: the inference interpreter (prefill, decode, per-rank KV cache),
//!   with [`sample`] (greedy, temperature and top-p) and `--check` against a
//!   single-rank run.
//! - [`weights`]: Hugging Face safetensors checkpoints, each rank reading its shard
//!   from a shared memory map; [`tokenize`]: `tokenizer.json` prompts.
//! - [`mapped`]: read-only maps of input files, and a clear stop when one is
//!   truncated under a run.
//! - [`alloc`]: the allocator a process running ranks should use.
//! - [`launch`]: processes as ranks: torchrun/Slurm variables, the TCP rendezvous
//!   (NCCL's unique id), and the `meshplan launch` supervisor.
//! - [`shard`], [`init`]: which slice of each weight a rank holds; deterministic
//!   weights and data, identical whatever the sharding.

pub mod alloc;
pub mod backend;
#[cfg(feature = "cuda")]
pub mod backend_cuda;
pub mod ckpt;
pub mod comm;
pub mod data;
pub mod device;
pub mod infer;
pub mod init;
pub mod launch;
pub mod mapped;
pub mod sample;
pub mod shard;
pub mod tokenize;
pub mod trace;
pub mod train;
pub mod weights;

pub use meshplan_ir as ir;
pub use meshplan_kernels as kernels;
