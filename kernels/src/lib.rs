//! Brief overview: CPU reference kernels and CUDA sources for the executor.
//!
//! This crate is a shell until the executor issue lands.
