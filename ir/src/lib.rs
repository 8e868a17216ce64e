//! Brief overview: `ir` is the language every other crate speaks.
//!
//! - [`ModelSpec`] is a validated model file (architecture or explicit graph form,
//!   dtype, workload), read from YAML by [`load_model`] or imported from a Hugging Face
//!   `config.json` by [`hf::import_hf_config`].
//! - [`Graph`] is the op graph the transformer builder expands a model into: tensors
//!   with symbolic shapes ([`Dim`]), ops in topological order, grouped in repeated
//!   [`Segment`]s so that a block is described once.
//! - [`ParallelConfig`] is a parallel configuration (the CFG of the contract).
//!
//! `ir` knows nothing of clusters, costs or devices.
#![warn(missing_docs)]

pub mod builder;
pub mod config;
pub mod dtype;
pub mod error;
pub mod explicit;
pub mod framework;
pub mod graph;
pub mod hf;
pub mod input;
pub mod kv_move;
pub mod load;
pub mod plan;
pub mod plan_check;
pub mod serving;
pub mod spec;
pub mod target;
pub mod trace;
pub mod yaml_depth;

pub use builder::build_transformer;
pub use config::{AttnImpl, ParallelConfig, PartialConfig, Recompute, Schedule};
pub use dtype::DType;
pub use error::IrError;
pub use framework::Framework;
pub use graph::{
    Constants, Dim, DimEnv, Graph, Mono, Op, OpKind, Segment, SegmentKind, Tensor, TensorId,
    TensorKind, TpRole, TpSplit,
};
pub use load::{load_model, model_graph, parse_model_yaml, WorkloadOverrides};
pub use spec::{
    Architecture, MlaSpec, MlpKind, ModelSpec, MoeSpec, NormKind, PositionKind, TransformerSpec,
    Workload,
};
