//! Brief overview: the planner finds, for a model on a cluster, the parallel layout
//! with the shortest predicted step time that fits in memory.
//!
//! - [`placement`], [`mesh`]: DTensor-style placements (`Shard(dim)`, `Replicate`,
//!   `Partial`) per axis of a device mesh.
//! - [`strategy`]: per op family, the sharding strategies an op can run under, with
//!   their forward and backward cost.
//! - [`redistribute`]: the one collective (or none, or infeasible) between two
//!   placements of a tensor, with its alpha-beta cost.
//! - [`intra`], [`ilp`]: choosing one strategy per op of a block (an ILP through
//!   good_lp), checked against brute force on small graphs.
//! - [`stages`]: splitting layers into pipeline stages (dynamic programming).
//! - [`search`]: the driver over mesh shapes, micro-batch sizes, ZeRO, recomputation
//!   and schedules, for training and inference.
//! - [`lower`]: the chosen plan as per-stage program templates and ranks (`plan.json`).
//! - [`output`]: the best candidate as a plan file.
//! - [`compare`]: the planner's best beside hand-given configurations.
//! - [`deploy`]: serving deployments (aggregated or prefill/decode pools) within SLOs,
//!   and their throughput-latency frontier.
#![warn(missing_docs)]

pub use meshplan_cost_model as cost_model;

pub mod compare;
pub mod deploy;
pub mod explain;
pub mod ilp;
pub mod intra;
pub mod layout;
pub mod lower;
pub mod mesh;
pub mod output;
pub mod placement;
pub mod redistribute;
pub mod search;
pub mod stages;
pub mod strategy;
