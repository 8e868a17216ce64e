//! The explicit `graph:` form of a model file.

use crate::dtype::DType;
use crate::error::IrError;
use crate::graph::Graph;
use serde::{Deserialize, Serialize};

/// An explicit graph as written in a model file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GraphSpec {}

impl GraphSpec {
    /// Checks the graph.
    pub fn validate(&self, file: &str) -> Result<(), IrError> {
        Err(IrError::invalid(file, "graph", "the graph form is being written"))
    }

    /// Converts to a [`Graph`].
    pub fn to_graph(&self, name: &str, dtype: DType) -> Result<Graph, IrError> {
        let _ = (name, dtype);
        Err(IrError::invalid(name, "graph", "the graph form is being written"))
    }
}
