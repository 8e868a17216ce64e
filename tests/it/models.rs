//! Shipped models: parameter counts and HF import.
