//! A bound on YAML nesting, checked before the parser sees the text: libyaml's
//! scanner keeps per-level state that it walks for every token, so 100,000 nested
//! `[` took the parser 24 s (quadratic) before serde's own recursion limit refused
//! the document.

use crate::error::IrError;

/// Deepest nesting of flow collections (`[`, `{`) a YAML input may have. Model,
/// cluster, overlay and workload files nest a few levels; serde's deserializer refuses
/// beyond 128 anyway, so nothing this refuses could have loaded.
pub const YAML_DEPTH_MAX: usize = 256;

/// Refuses `text` when its flow collections nest deeper than [`YAML_DEPTH_MAX`],
/// naming `file` and the line. Quoted strings and comments are skipped; a bracket
/// inside a block scalar counts, which can only refuse earlier, never later.
pub fn check_yaml_depth(text: &str, file: &str) -> Result<(), IrError> {
    let mut depth = 0usize;
    let mut line = 1usize;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\n' => line += 1,
            '#' => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        line += 1;
                        break;
                    }
                }
            }
            '"' | '\'' => {
                while let Some(q) = chars.next() {
                    match q {
                        '\\' if c == '"' => {
                            chars.next();
                        }
                        '\n' => line += 1,
                        _ if q == c => break,
                        _ => {}
                    }
                }
            }
            '[' | '{' => {
                depth += 1;
                if depth > YAML_DEPTH_MAX {
                    return Err(IrError::Parse {
                        file: file.to_string(),
                        line: Some(line),
                        column: None,
                        message: format!(
                            "nested more than {YAML_DEPTH_MAX} levels deep; no meshplan input nests so deep: give the right file"
                        ),
                    });
                }
            }
            ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn deep_flow_nesting_is_refused_at_once_and_shallow_text_passes() {
        let n = 100_000;
        let deep = format!("a: {}{}\n", "[".repeat(n), "]".repeat(n));
        let t = Instant::now();
        let e = check_yaml_depth(&deep, "m.yaml").unwrap_err().to_string();
        assert!(t.elapsed().as_secs_f64() < 1.0);
        assert!(
            e.contains("m.yaml:1") && e.contains("more than 256 levels"),
            "{e}"
        );
        let quoted = format!(
            "a: \"{}\" # {}\nb: [1, {{c: 2}}]\n",
            "[".repeat(1000),
            "{".repeat(1000)
        );
        check_yaml_depth(&quoted, "m.yaml").unwrap();
        let ok = format!(
            "a: {}{}\n",
            "[".repeat(YAML_DEPTH_MAX),
            "]".repeat(YAML_DEPTH_MAX)
        );
        check_yaml_depth(&ok, "m.yaml").unwrap();
    }
}
