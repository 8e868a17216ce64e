//! Brief overview: CPU reference kernels (forward and backward of every op the
//! executor runs) and their CUDA counterparts.
//!
//! - [`cpu`]: plain f32 kernels on row-major slices, each checked against finite
//!   differences; the reference every GPU kernel is tested against.
//! - [`cuda`]: the CUDA C sources (compiled at run time with NVRTC), the PTX cache
//!   and [`cuda::probe`] in every build; with the `cuda` (CUDA 13) or `cuda-12`
//!   feature also `cuda::Gpu`, its launch wrappers and the cuBLASLt GEMM.
#![warn(missing_docs)]

pub mod cpu;
pub mod cuda;
