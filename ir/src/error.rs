//! The one error type of the `ir` crate.

use std::path::PathBuf;

/// Everything that can go wrong while reading or validating a model or a configuration.
///
/// Every variant names the file and, where known, the field, so the message tells the
/// user what to change.
#[derive(Debug, thiserror::Error)]
pub enum IrError {
    // === reading ===
    /// The file could not be read at all.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid YAML/JSON for the expected schema.
    #[error("{file}{}: {message}", location(*line, *column))]
    Parse {
        /// The file.
        file: String,
        /// 1-based line, where the parser knows it.
        line: Option<usize>,
        /// 1-based column, where the parser knows it.
        column: Option<usize>,
        /// What the parser said, including the field it stopped at.
        message: String,
    },
    // === validation ===
    /// A field has a value the model cannot have.
    #[error("{file}: field `{field}`: {message}")]
    Invalid {
        /// The file (or `--config` for command-line configurations).
        file: String,
        /// Dotted path of the field, e.g. `transformer.kv_heads`.
        field: String,
        /// What is wrong and what is expected.
        message: String,
    },
    // === shapes ===
    /// Two shapes that must agree do not.
    #[error("op `{op}`: shape mismatch: {message}")]
    Shape {
        /// The op whose inputs disagree.
        op: String,
        /// The shapes involved.
        message: String,
    },
}

fn location(line: Option<usize>, column: Option<usize>) -> String {
    match (line, column) {
        (Some(l), Some(c)) => format!(":{l}:{c}"),
        (Some(l), None) => format!(":{l}"),
        _ => String::new(),
    }
}

impl IrError {
    /// Builds an [`IrError::Invalid`].
    pub fn invalid(file: &str, field: &str, message: impl Into<String>) -> Self {
        IrError::Invalid {
            file: file.to_string(),
            field: field.to_string(),
            message: message.into(),
        }
    }

    /// Wraps a YAML parser error with the file name and its location.
    pub fn from_yaml(file: &str, err: &serde_yaml_ng::Error) -> Self {
        let loc = err.location();
        IrError::Parse {
            file: file.to_string(),
            line: loc.as_ref().map(|l| l.line()),
            column: loc.as_ref().map(|l| l.column()),
            message: strip_location(&err.to_string()),
        }
    }

    /// Wraps a JSON parser error with the file name and its location.
    pub fn from_json(file: &str, err: &serde_json::Error) -> Self {
        IrError::Parse {
            file: file.to_string(),
            line: Some(err.line()).filter(|&l| l > 0),
            column: Some(err.column()).filter(|&c| c > 0),
            message: strip_location(&err.to_string()),
        }
    }
}

/// serde's messages end with "at line L column C"; the error already carries both.
fn strip_location(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg.to_string(),
    }
}
