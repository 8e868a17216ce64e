//! Brief overview: the planner searches placements on a device mesh and pipeline
//! schedules for the cheapest plan under the cost model.
//!
//! This crate is a shell until the planner issue lands; it exists now so that the
//! dependency arrows (`planner -> cost_model -> ir`) are fixed and tested from the start.
#![warn(missing_docs)]

pub use meshplan_cost_model as cost_model;
