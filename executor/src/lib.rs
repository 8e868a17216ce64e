//! Brief overview: the executor interprets per-rank programs of a plan on a backend.
//!
//! This crate is a shell until the executor issue lands; it exists now so that the
//! dependency arrows (`executor -> ir + kernels`) are fixed and tested from the start.

pub mod comm;

pub use meshplan_ir as ir;
pub use meshplan_kernels as kernels;
