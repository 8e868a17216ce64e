//! Hugging Face `config.json` import.

use crate::error::IrError;
use crate::spec::ModelSpec;

/// Imports a Hugging Face `config.json`.
pub fn import_hf_config(text: &str, file: &str) -> Result<ModelSpec, IrError> {
    let _ = text;
    Err(IrError::invalid(file, "model_type", "config.json import is being written"))
}
