//! Brief overview: CPU reference kernels (forward and backward of every op the
//! executor runs) and, later, their CUDA counterparts.
//!
//! - [`cpu`]: plain f32 kernels on row-major slices, each checked against finite
//!   differences; the reference every GPU kernel is tested against.
#![warn(missing_docs)]

pub mod cpu;
