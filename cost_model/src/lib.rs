//! cost model
