//! Brief overview: the cost model prices a model on a cluster.
//!
//! - [`Cluster`] is a validated cluster file (GPUs, NVLink, InfiniBand) in SI units.
//! - [`CommModel`] prices collectives with the alpha-beta model, ring or tree, inside a
//!   node or hierarchically across nodes.
//! - [`PreparedGraph`] turns an `ir` graph into monomials once; [`estimate_train`] and
//!   [`estimate_inference`] price one parallel configuration end to end into an
//!   [`Estimate`] (the contract's JSON keys).
//!
//! Every calibration constant lives in [`calib`]; a cluster may carry measurements of
//! the user's GPUs instead ([`overlay`], written by `meshplan calibrate` through
//! [`calibrate`]). The cost model knows nothing of
//! which plan is chosen.
#![warn(missing_docs)]

pub mod calib;
pub mod calibrate;
pub mod cluster;
pub mod collective;
pub mod compute;
pub mod estimate;
pub mod framework;
pub mod graph_cost;
pub mod memory;
pub mod overlay;
pub mod pipeline;
pub mod serving;
pub mod timeline;

pub use cluster::{load_cluster, load_cluster_calibrated, parse_cluster_yaml, Cluster, GroupShape};
pub use collective::{Collective, CommModel};
pub use estimate::{
    estimate_inference, estimate_train, estimate_train_balanced_with, estimate_train_bounded,
    estimate_train_split, estimate_train_split_with, estimate_train_with, flops_per_token_forward,
    inference_timeline, prefill_service_s, prepare_model, replica_memory, state_bytes_per_param,
    train_ctx, train_timeline, train_timeline_with, Estimate, InferenceLoad, Unsupported,
};
pub use framework::Mechanisms;
pub use graph_cost::PreparedGraph;
pub use memory::MemoryLedger;
pub use timeline::{Lane, Span, SpanKind, Timeline};
