//! Loader robustness: bad input never panics.
