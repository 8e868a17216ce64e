//! Reading model files: the model YAML, or a Hugging Face `config.json` with the
//! workload from flags or a workload file.

use crate::builder::build_transformer;
use crate::error::IrError;
use crate::graph::Graph;
use crate::spec::{Architecture, ModelSpec, RawModel, Workload};
use std::path::{Path, PathBuf};

/// Workload settings given on the command line; they override the model file's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkloadOverrides {
    /// `--seq-len`: training sequence length.
    pub seq_len: Option<u64>,
    /// `--global-batch`: training sequences per step.
    pub global_batch: Option<u64>,
    /// `--workload FILE`: a YAML holding the `workload:` mapping's contents.
    pub workload_file: Option<PathBuf>,
    /// `--framework`: the framework that will run a training workload.
    pub framework: Option<crate::Framework>,
    /// `--make-vocab-size-divisible-by`: pads a transformer's vocabulary rows to a
    /// multiple of this (`transformer.make_vocab_size_divisible_by`), for a
    /// `config.json` model too.
    pub make_vocab_size_divisible_by: Option<u64>,
}

/// A text input file of at most [`crate::input::TEXT_LIMIT`] bytes, without the
/// UTF-8 byte order mark some editors write.
pub fn read_text(path: &Path) -> Result<String, IrError> {
    crate::input::read_text_bounded(path, crate::input::TEXT_LIMIT).map_err(|source| IrError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Whether `path` is a Hugging Face config rather than a model YAML.
fn is_hf_config(path: &Path, text: &str) -> bool {
    path.extension().is_some_and(|e| e == "json") || text.trim_start().starts_with('{')
}

/// Reads and validates a model file (YAML or `config.json`) and applies overrides.
pub fn load_model(path: &Path, overrides: &WorkloadOverrides) -> Result<ModelSpec, IrError> {
    let file = path.display().to_string();
    let text = read_text(path)?;
    let mut spec = if is_hf_config(path, &text) {
        crate::hf::import_hf_config(&text, &file)?
    } else {
        parse_model_yaml(&text, &file)?
    };
    apply_overrides(&mut spec, overrides, &file)?;
    Ok(spec)
}

/// Parses and validates model YAML text.
pub fn parse_model_yaml(text: &str, file: &str) -> Result<ModelSpec, IrError> {
    crate::yaml_depth::check_yaml_depth(text, file)?;
    let raw: RawModel = serde_yaml_ng::from_str(text)
        .map_err(|e| in_workload(IrError::from_yaml(file, &e), text, Some("workload")))?;
    raw.validate(file)
}

/// An error inside a workload, located again. serde reports an error inside an
/// internally tagged enum (a workload, whose `kind` picks the variant) at line 1,
/// column 1 and without the field's path, because it buffers the mapping before
/// the variant reads it. An error located elsewhere, or one [`workload_line`]
/// cannot place, is left as it was.
fn in_workload(err: IrError, text: &str, block: Option<&str>) -> IrError {
    let found = match &err {
        IrError::Parse {
            line: Some(1) | None,
            column: Some(1) | None,
            message,
            ..
        } => workload_line(text, block, message),
        _ => None,
    };
    match (err, found) {
        (IrError::Parse { file, message, .. }, Some((line, column, path))) => IrError::Parse {
            file,
            line: Some(line),
            column: Some(column),
            message: format!("{path}: {message}"),
        },
        (err, _) => err,
    }
}

/// Where the key or value `message` quotes stands among a workload's own lines:
/// the `block:` section of a model file (its indented lines), or a whole workload
/// file (`block` `None`). The line whose key is the quoted word (an unknown field),
/// or whose value is (an unknown variant, a value of the wrong type): its 1-based
/// line, column and field path.
fn workload_line(text: &str, block: Option<&str>, message: &str) -> Option<(usize, usize, String)> {
    let quoted = message.split('`').nth(1).filter(|q| !q.is_empty())?;
    let mut lines = text.lines().enumerate();
    if let Some(key) = block {
        let head = format!("{key}:");
        lines.find(|(_, l)| l.trim_end() == head)?;
    }
    let inside = |l: &str| block.is_none() || l.is_empty() || l.starts_with([' ', '\t', '#']);
    lines.take_while(|&(_, l)| inside(l)).find_map(|(n, l)| {
        let (key, value) = l.split_once(':')?;
        let (key, value) = (key.trim(), value.split('#').next().unwrap_or("").trim());
        let indent = l.len() - l.trim_start().len();
        let path = || block.map_or(key.to_string(), |b| format!("{b}.{key}"));
        (key == quoted || value == quoted).then(|| (n + 1, indent + 1, path()))
    })
}

fn apply_overrides(
    spec: &mut ModelSpec,
    ov: &WorkloadOverrides,
    file: &str,
) -> Result<(), IrError> {
    if let Some(d) = ov.make_vocab_size_divisible_by {
        let field = "--make-vocab-size-divisible-by";
        match &mut spec.arch {
            crate::Architecture::Transformer(t) => {
                t.make_vocab_size_divisible_by =
                    crate::spec::vocab_divisor("command line", field, t.vocab, d)?;
            }
            crate::Architecture::Graph(_) => {
                return Err(IrError::invalid(
                    file,
                    "graph",
                    format!("{field} pads a `transformer:` model's vocabulary; an explicit graph gives its tensors' shapes itself"),
                ))
            }
        }
    }
    if let Some(wf) = &ov.workload_file {
        let wfile = wf.display().to_string();
        let text = read_text(wf)?;
        let w: Workload = crate::yaml_depth::check_yaml_depth(&text, &wfile).and_then(|()| {
            serde_yaml_ng::from_str(&text)
                .map_err(|e| in_workload(IrError::from_yaml(&wfile, &e), &text, None))
        })?;
        w.validate(&wfile)?;
        spec.workload = Some(w);
    }
    if ov.seq_len.is_some() || ov.global_batch.is_some() {
        let (seq, gb, framework) = match &spec.workload {
            Some(Workload::Train {
                seq_len,
                global_batch,
                framework,
                ..
            }) => (
                ov.seq_len.unwrap_or(*seq_len),
                ov.global_batch.unwrap_or(*global_batch),
                *framework,
            ),
            _ => match (ov.seq_len, ov.global_batch) {
                (Some(s), Some(g)) => (s, g, crate::Framework::default()),
                _ => {
                    return Err(IrError::invalid(
                        file,
                        "workload",
                        "a training workload needs both --seq-len and --global-batch (or a workload in the file)",
                    ))
                }
            },
        };
        let w = Workload::Train {
            seq_len: seq,
            global_batch: gb,
            optimizer: "adamw".into(),
            framework,
        };
        w.validate("command line")?;
        spec.workload = Some(w);
    }
    if let Some(f) = ov.framework {
        match &mut spec.workload {
            Some(Workload::Train { framework, .. }) => *framework = f,
            _ => {
                return Err(IrError::invalid(
                    file,
                    "workload",
                    format!("--framework {f} plans training; this model's workload is not a training one (give --seq-len and --global-batch)"),
                ))
            }
        }
    }
    Ok(())
}

/// The op graph of a model.
pub fn model_graph(spec: &ModelSpec) -> Result<Graph, IrError> {
    match &spec.arch {
        Architecture::Transformer(t) => Ok(build_transformer(&spec.name, t, spec.dtype)),
        Architecture::Graph(g) => g.to_graph(&spec.name, spec.dtype),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::RopeScaling;

    const BASE: &str =
        "name: m\ntransformer:\n  layers: 2\n  hidden: 64\n  heads: 4\n  vocab: 256\n";

    /// A workload's errors name the field and its line (serde gives 1:1 and no
    /// path inside the tagged `kind`): an unknown variant, a value of the wrong
    /// type and an unknown key, in a model file and in a workload file.
    #[test]
    fn workload_errors_name_their_field_and_line() {
        let err = |text: String| parse_model_yaml(&text, "m.yaml").unwrap_err().to_string();
        let wl = |rest: &str| format!("{BASE}workload:\n  kind: train\n  seq_len: 32\n{rest}");
        // BASE is 6 lines: the workload is line 7, its third key line 10.
        assert_eq!(
            err(wl("  global_batch: 8\n  framework: megatron  # a typo\n")),
            "m.yaml:11:3: workload.framework: unknown variant `megatron`, expected one of \
             `meshplan`, `megatron-core`, `torchtitan`, `deepspeed`, `megatron-deepspeed`"
        );
        assert_eq!(
            err(wl("  global_batch: -8\n")),
            "m.yaml:10:3: workload.global_batch: invalid value: integer `-8`, expected u64"
        );
        let typo = err(wl("  global_batch: 8\n  optimiser: adamw\n"));
        assert!(
            typo.starts_with("m.yaml:11:3: workload.optimiser: unknown field `optimiser`"),
            "{typo}"
        );
        // A workload file is the workload itself.
        let text = "kind: train\nseq_len: 32\nglobal_batch: 8\nframework: megatron\n";
        let e = serde_yaml_ng::from_str::<Workload>(text)
            .map_err(|e| in_workload(IrError::from_yaml("w.yaml", &e), text, None))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("w.yaml:4:1: framework: unknown variant `megatron`"),
            "{e}"
        );
        // Errors serde located itself are left alone.
        let e = err(format!("{BASE}  heads: 4\n"));
        assert!(
            e.starts_with("m.yaml:3:3: transformer: duplicate field `heads`"),
            "{e}"
        );
    }

    #[test]
    fn rope_scaling_and_sliding_window_in_a_model_file() {
        let text = format!(
            "{BASE}  rope_scaling: {{type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_positions: 8192}}\n  sliding_window: 4096\n"
        );
        let spec = parse_model_yaml(&text, "m.yaml").unwrap_or_else(|e| panic!("{e}"));
        let Some(t) = spec.transformer() else {
            panic!("a transformer")
        };
        assert_eq!(
            t.rope_scaling,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_positions: 8192.0
            }
        );
        assert_eq!(t.sliding_window, Some(4096));
        let graph = crate::build_transformer(&spec.name, t, spec.dtype);
        assert_eq!(graph.constants.rope_scaling, t.rope_scaling);
        assert_eq!(graph.constants.sliding_window, Some(4096));
        // Checked like every other field.
        let bad = format!("{BASE}  rope_scaling: {{type: linear, factor: 0}}\n");
        let e = parse_model_yaml(&bad, "m.yaml").unwrap_err().to_string();
        assert!(e.contains("rope_scaling.factor"), "{e}");
        let bad = format!("{BASE}  sliding_window: 0\n");
        let e = parse_model_yaml(&bad, "m.yaml").unwrap_err().to_string();
        assert!(e.contains("sliding_window"), "{e}");
    }
}
