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
/// What they quote of the file is clipped, so a wrong file given as input (a
/// `calibration:` naming `/etc/passwd`) is not echoed whole.
fn strip_location(msg: &str) -> String {
    let msg = match msg.rfind(" at line ") {
        Some(i) => &msg[..i],
        None => msg,
    };
    clip_quotes(msg)
}

/// The longest stretch of file content a message quotes.
const QUOTE_CHARS: usize = 40;

/// Shortens every double-quoted stretch of `msg` longer than forty characters and
/// keeps only its first line.
pub fn clip_quotes(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len().min(512));
    let mut parts = msg.split('"');
    if let Some(first) = parts.next() {
        out.push_str(first);
    }
    for (i, part) in parts.enumerate() {
        out.push('"');
        let quoted = i % 2 == 0;
        if !quoted {
            out.push_str(part);
            continue;
        }
        let line = part.lines().next().unwrap_or("");
        let clipped: String = line.chars().take(QUOTE_CHARS).collect();
        out.push_str(&clipped);
        if clipped.len() < part.len() {
            out.push('…');
        }
    }
    out
}

#[cfg(test)]
mod clip_tests {
    use super::clip_quotes;

    #[test]
    fn long_quotes_are_clipped_to_forty_characters_and_one_line() {
        let long = "x".repeat(100);
        let msg = format!("invalid type: string \"{long}\", expected a map");
        let want = format!(
            "invalid type: string \"{}…\", expected a map",
            "x".repeat(40)
        );
        assert_eq!(clip_quotes(&msg), want);
        assert_eq!(clip_quotes("a \"b\nc\" d"), "a \"b…\" d");
        assert_eq!(clip_quotes("no quotes"), "no quotes");
        assert_eq!(
            clip_quotes("unknown field `x`, \"short\""),
            "unknown field `x`, \"short\""
        );
    }
}
