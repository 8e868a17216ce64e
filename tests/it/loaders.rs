//! Loader robustness: bad input never panics, and every error names its source.
//!
//! Property tests mutate valid model YAML files (architecture and graph forms), CLI
//! configurations and Hugging Face `config.json` files, and check that the loaders
//! return (never panic) and that each error's message starts with the file name.
//! Deterministic tests pin the messages of common mistakes.

use meshplan_ir::hf::import_hf_config;
use meshplan_ir::{load_model, parse_model_yaml, IrError, PartialConfig, WorkloadOverrides};
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

const CASES: u32 = 256;

fn proptest_config() -> ProptestConfig {
    ProptestConfig {
        cases: CASES,
        // A failing case is printed in full; do not write regression files into the tree.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// === valid inputs the mutations start from ===

const DENSE_YAML: &str = "\
name: tiny-gpt
transformer:
  layers: 4
  hidden: 256
  heads: 8
  kv_heads: 4
  head_dim: 32
  ffn_hidden: 1024
  mlp: gelu
  norm: layernorm
  vocab: 32000
  tie_embeddings: true
  bias: true
  qkv_bias: false
  position: learned
  max_positions: 2048
  dropout: true
  norm_eps: 1.0e-5
dtype: bf16
workload:
  kind: train
  seq_len: 2048
  global_batch: 64
  optimizer: adamw
";

const MOE_YAML: &str = "\
name: tiny-moe
transformer:
  layers: 6
  hidden: 512
  heads: 8
  kv_heads: 8
  ffn_hidden: 2048
  mlp: swiglu
  norm: rmsnorm
  vocab: 50000
  rope_theta: 10000.0
  moe:
    experts: 16
    top_k: 2
    expert_ffn_hidden: 256
    shared_experts: 1
    shared_expert_ffn_hidden: 512
    first_dense_layers: 1
  mla:
    q_lora_rank: 128
    kv_lora_rank: 64
    qk_nope_head_dim: 32
    qk_rope_head_dim: 16
    v_head_dim: 32
dtype: fp8
workload:
  kind: inference
  prompt_len: 512
  output_len: 64
  concurrency: 8
  slo: {ttft_ms: 2000, tpot_ms: 50}
";

const GRAPH_YAML: &str = include_str!("../../models/examples/mlp-graph.yaml");

const YAML_BASES: [&str; 3] = [DENSE_YAML, MOE_YAML, GRAPH_YAML];

const LLAMA_JSON: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "hidden_act": "silu",
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "max_position_embeddings": 8192,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "vocab_size": 128256
}"#;

const LLAMA_TF5_JSON: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "dtype": "bfloat16",
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
  "tie_word_embeddings": false,
  "vocab_size": 128256
}"#;

const MIXTRAL_JSON: &str = r#"{
  "architectures": ["MixtralForCausalLM"],
  "hidden_act": "silu",
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "model_type": "mixtral",
  "num_attention_heads": 32,
  "num_experts_per_tok": 2,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "num_local_experts": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "vocab_size": 32000
}"#;

const GPT2_JSON: &str = r#"{
  "activation_function": "gelu_new",
  "architectures": ["GPT2LMHeadModel"],
  "layer_norm_epsilon": 1e-05,
  "model_type": "gpt2",
  "n_ctx": 1024,
  "n_embd": 768,
  "n_head": 12,
  "n_inner": null,
  "n_layer": 12,
  "n_positions": 1024,
  "resid_pdrop": 0.1,
  "vocab_size": 50257
}"#;

const DEEPSEEK_JSON: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"],
  "first_k_dense_replace": 3,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "num_attention_heads": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 128,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "rms_norm_eps": 1e-06,
  "rope_theta": 10000,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "v_head_dim": 128,
  "vocab_size": 129280
}"#;

const JSON_BASES: [&str; 5] = [
    LLAMA_JSON,
    LLAMA_TF5_JSON,
    MIXTRAL_JSON,
    GPT2_JSON,
    DEEPSEEK_JSON,
];

// === mutations ===

/// Numbers that parse but may be out of range: they reach validation.
const NUMBERS: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "7",
    "-1",
    "4294967296",
    "1099511627776",
    "18446744073709551616",
    "99999999999999999999999",
    "-9223372036854775809",
    "1.5",
    "-0.0",
    "1e308",
];

/// Sizes that fit a `u64` but overflow when the loaders or the transformer builder
/// multiply them; `spec.rs` rejects every size over `DIM_MAX`.
const OVERFLOWING: &[&str] = &[
    "4611686018427387904",
    "9223372036854775807",
    "18446744073709551615",
];

/// Other values that replace a YAML value or token.
const YAML_GARBAGE: &[&str] = &[
    ".nan",
    ".inf",
    "-.inf",
    "abc",
    "\"\"",
    "''",
    "~",
    "null",
    "[]",
    "{}",
    "[1, 2]",
    "{a: 1}",
    "true",
    "0x10",
    "0o17",
    "!!binary aGVsbG8=",
    "&anchor 3",
    "*anchor",
    "\"\\u0000\"",
    "é",
    "|",
    ">-",
    "- 1",
    ": :",
    "{",
    "]",
    "#",
    "\"unterminated",
    "batch",
    "seq",
    "kv",
    "matmul",
    "x",
    "learned",
    "swiglu",
    "inference",
];

/// Other values that replace a JSON value.
const JSON_GARBAGE: &[&str] = &[
    "1e400",
    "\"abc\"",
    "\"\"",
    "null",
    "[]",
    "{}",
    "[1, 2]",
    "{\"a\": 1}",
    "true",
    "\"llama\"",
    "\"gpt2\"",
    "\"mixtral\"",
    "\"deepseek_v3\"",
    "\"float16\"",
    "\"gelu\"",
    "\"\\ud800\"",
    "NaN",
    "{",
    "\"unterminated",
];

/// Keys the schemas do not know (or know elsewhere).
const UNKNOWN_KEYS: &[&str] = &[
    "bogus",
    "hidden_size",
    "layer",
    "Heads",
    "kv-heads",
    "shape",
    "repeat",
    "\"quoted key\"",
];

/// One edit, drawn as raw numbers and applied modulo the text's size.
#[derive(Clone, Debug)]
struct Edit {
    kind: u8,
    at: usize,
    pick: usize,
}

fn edit_strategy() -> impl Strategy<Value = Edit> {
    // Mostly value replacements, which get past the parser and reach validation.
    let kind = prop_oneof![
        4 => Just(1u8),
        4 => Just(2u8),
        1 => Just(0u8),
        1 => Just(3u8),
        1 => Just(4u8),
        1 => Just(5u8),
    ];
    (kind, any::<usize>(), any::<usize>()).prop_map(|(kind, at, pick)| Edit { kind, at, pick })
}

/// Which replacement values an edit may draw.
#[derive(Clone, Copy, Debug)]
struct Values {
    json: bool,
    overflowing: bool,
}

/// A replacement value: a number (more often) or other garbage.
fn garbage(pick: usize, v: Values) -> &'static str {
    let other = if v.json { JSON_GARBAGE } else { YAML_GARBAGE };
    match pick % 10 {
        0..=5 => NUMBERS[(pick / 10) % NUMBERS.len()],
        6 if v.overflowing => OVERFLOWING[(pick / 10) % OVERFLOWING.len()],
        _ => other[(pick / 10) % other.len()],
    }
}

/// Byte ranges of the word-like tokens of `text` (names, numbers) that are values,
/// not keys (not followed by `:`).
fn value_tokens(text: &str) -> Vec<(usize, usize)> {
    let is_key = |end: usize| text[end..].trim_start_matches([' ', '"']).starts_with(':');
    tokens(text)
        .into_iter()
        .filter(|&(_, end)| !is_key(end))
        .collect()
}

/// Byte ranges of the word-like tokens of `text` (names, numbers).
fn tokens(text: &str) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in text.char_indices() {
        let word = c.is_alphanumeric() || matches!(c, '_' | '.' | '-' | '+');
        match (word, start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                out.push((s, i));
                start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = start {
        out.push((s, text.len()));
    }
    out
}

fn floor_char_boundary(text: &str, mut i: usize) -> usize {
    i = i.min(text.len());
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Applies one edit; `v.json` selects JSON spellings for inserted keys and values.
fn apply(text: &str, e: &Edit, v: Values) -> String {
    let json = v.json;
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    if lines.is_empty() {
        lines.push(String::new());
    }
    let n = lines.len();
    let i = e.at % n;
    let indent = |l: &str| l.len() - l.trim_start().len();
    match e.kind {
        // Delete a line.
        0 => {
            lines.remove(i);
        }
        // Replace the value after a line's first `:`.
        1 => {
            let g = garbage(e.pick, v);
            if let Some(c) = lines[i].find(':') {
                let trail = if json && lines[i].trim_end().ends_with(',') {
                    ","
                } else {
                    ""
                };
                lines[i] = format!("{}: {g}{trail}", &lines[i][..c]);
            } else {
                lines[i] = g.to_string();
            }
        }
        // Replace one value token anywhere (reaches into flow mappings and lists).
        2 => {
            let toks = value_tokens(text);
            if toks.is_empty() {
                return text.to_string();
            }
            let (s, t) = toks[e.at % toks.len()];
            let g = garbage(e.pick, v);
            return format!("{}{g}{}", &text[..s], &text[t..]);
        }
        // Insert an unknown key next to a line, at its indentation.
        3 => {
            let key = UNKNOWN_KEYS[e.pick % UNKNOWN_KEYS.len()];
            let pad = " ".repeat(indent(&lines[i]));
            let line = if json {
                format!("{pad}\"{}\": 1,", key.trim_matches('"'))
            } else {
                format!("{pad}{key}: 1")
            };
            lines.insert(i + 1, line);
        }
        // Truncate at a byte.
        4 => {
            let cut = floor_char_boundary(text, e.pick % (text.len() + 1));
            return text[..cut].to_string();
        }
        // Duplicate a line (a duplicate key, or a duplicate list entry).
        _ => {
            let copy = lines[i].clone();
            lines.insert(i, copy);
        }
    }
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

fn mutate(base: &str, edits: &[Edit], v: Values) -> String {
    edits.iter().fold(base.to_string(), |t, e| apply(&t, e, v))
}

/// Runs `f`, failing the property (instead of the process) on a panic, and checks
/// that an error's message starts with `file`.
fn check_loader<T>(
    what: &str,
    input: &str,
    file: &str,
    f: impl FnOnce() -> Result<T, IrError>,
) -> Result<Option<T>, TestCaseError> {
    let result = catch_unwind(AssertUnwindSafe(f));
    let result = match result {
        Ok(r) => r,
        Err(_) => return Err(TestCaseError::fail(format!("{what} panicked on:\n{input}"))),
    };
    match result {
        Ok(v) => Ok(Some(v)),
        Err(e) => {
            let msg = e.to_string();
            prop_assert!(
                msg.starts_with(file),
                "{what}: error does not start with `{file}`: {msg}\ninput:\n{input}"
            );
            prop_assert!(msg.len() > file.len() + 2, "{what}: empty message: {msg}");
            Ok(None)
        }
    }
}

/// One mutated model YAML: it loads or fails cleanly, and an accepted model
/// expands into its op graph without panicking.
fn yaml_case(base: &str, edits: &[Edit], overflowing: bool) -> Result<(), TestCaseError> {
    let text = mutate(
        base,
        edits,
        Values {
            json: false,
            overflowing,
        },
    );
    let spec = check_loader("parse_model_yaml", &text, "model.yaml", || {
        parse_model_yaml(&text, "model.yaml")
    })?;
    if let Some(spec) = spec {
        check_loader("model_graph", &text, "model.yaml", || {
            meshplan_ir::model_graph(&spec)
        })?;
    }
    Ok(())
}

/// One mutated `config.json`, as [`yaml_case`].
fn hf_case(base: &str, edits: &[Edit], overflowing: bool) -> Result<(), TestCaseError> {
    let text = mutate(
        base,
        edits,
        Values {
            json: true,
            overflowing,
        },
    );
    let spec = check_loader("import_hf_config", &text, "config.json", || {
        import_hf_config(&text, "config.json")
    })?;
    if let Some(spec) = spec {
        check_loader("model_graph", &text, "config.json", || {
            meshplan_ir::model_graph(&spec)
        })?;
    }
    Ok(())
}

#[test]
fn bases_are_valid() {
    for (i, text) in YAML_BASES.iter().enumerate() {
        if let Err(e) = parse_model_yaml(text, "model.yaml") {
            panic!("YAML base {i}: {e}");
        }
    }
    for (i, text) in JSON_BASES.iter().enumerate() {
        if let Err(e) = import_hf_config(text, "config.json") {
            panic!("JSON base {i}: {e}");
        }
    }
}

proptest! {
    #![proptest_config(proptest_config())]

    /// (a) Mutated model YAML never panics; errors start with the file name; accepted
    /// models build their op graph.
    #[test]
    fn model_yaml_mutations_never_panic(
        base in 0..YAML_BASES.len(),
        edits in prop::collection::vec(edit_strategy(), 1..3),
    ) {
        yaml_case(YAML_BASES[base], &edits, false)?;
    }

    /// (a) Arbitrary text as model YAML.
    #[test]
    fn model_yaml_random_text_never_panics(text in "\\PC{0,200}") {
        check_loader("parse_model_yaml", &text, "model.yaml", || parse_model_yaml(&text, "model.yaml"))?;
    }

    /// (b) Random strings as a `--config`.
    #[test]
    fn config_random_strings_never_panic(text in "\\PC{0,80}") {
        check_loader("PartialConfig::parse", &text, "--config", || PartialConfig::parse(&text, "--config"))?;
    }

    /// (b) Random `key=value` lists, known and unknown keys, good and bad values.
    #[test]
    fn config_key_values_never_panic(
        items in prop::collection::vec(
            (
                prop::sample::select(vec![
                    "dp", "tp", "pp", "cp", "ep", "mbs", "zero", "recompute", "sp", "vpp",
                    "schedule", "dp_attention", "attn", "bogus", "TP", "", " tp ",
                ]),
                prop::sample::select(vec![
                    "0", "1", "2", "3", "4", "8", "-1", "1.5", "18446744073709551615",
                    "18446744073709551616", "true", "false", "yes", "none", "full",
                    "selective", "gpipe", "1f1b", "interleaved", "flash", "unfused", "",
                    "=", ",", "é",
                ]),
                prop::sample::select(vec!["=", "==", ":", " = ", ""]),
            ),
            0..8,
        ),
    ) {
        let text = items
            .iter()
            .map(|(k, v, sep)| format!("{k}{sep}{v}"))
            .collect::<Vec<_>>()
            .join(",");
        check_loader("PartialConfig::parse", &text, "--config", || PartialConfig::parse(&text, "--config"))?;
    }

    /// (c) Mutated `config.json` never panics; errors start with the file name;
    /// accepted models build their op graph.
    #[test]
    fn hf_config_mutations_never_panic(
        base in 0..JSON_BASES.len(),
        edits in prop::collection::vec(edit_strategy(), 1..3),
    ) {
        hf_case(JSON_BASES[base], &edits, false)?;
    }

    /// (c) Arbitrary text as `config.json`.
    #[test]
    fn hf_config_random_text_never_panics(text in "\\PC{0,200}") {
        check_loader("import_hf_config", &text, "config.json", || import_hf_config(&text, "config.json"))?;
    }

    /// (a) with sizes near `u64::MAX`.
    #[test]
    fn model_yaml_overflowing_sizes_never_panic(
        base in 0..YAML_BASES.len(),
        edits in prop::collection::vec(edit_strategy(), 1..3),
    ) {
        yaml_case(YAML_BASES[base], &edits, true)?;
    }

    /// (c) with sizes near `u64::MAX`.
    #[test]
    fn hf_config_overflowing_sizes_never_panic(
        base in 0..JSON_BASES.len(),
        edits in prop::collection::vec(edit_strategy(), 1..3),
    ) {
        hf_case(JSON_BASES[base], &edits, true)?;
    }
}

// === (d) specific mistakes, specific messages ===

fn yaml_error(text: &str) -> String {
    match parse_model_yaml(text, "model.yaml") {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => e.to_string(),
    }
}

/// `DENSE_YAML` with one line replaced (the line must exist).
fn dense_with(from: &str, to: &str) -> String {
    assert!(DENSE_YAML.contains(from), "no `{from}` in the base");
    DENSE_YAML.replacen(from, to, 1)
}

#[test]
fn unknown_key_names_the_key_and_its_location() {
    let e = yaml_error(&dense_with("  hidden: 256\n", "  hiden: 256\n"));
    // `hiden` is on line 4, column 3.
    assert!(e.starts_with("model.yaml:4:3: "), "{e}");
    assert!(e.contains("unknown field `hiden`"), "{e}");
    assert!(
        e.contains("hidden"),
        "the message should list the expected fields: {e}"
    );
}

#[test]
fn unknown_top_level_key() {
    let e = yaml_error(&format!("{DENSE_YAML}optimiser: adam\n"));
    assert!(e.starts_with("model.yaml:25:1: "), "{e}");
    assert!(e.contains("unknown field `optimiser`"), "{e}");
}

#[test]
fn zero_heads() {
    let e = yaml_error(&dense_with("  heads: 8\n", "  heads: 0\n"));
    assert_eq!(
        e,
        "model.yaml: field `transformer.heads`: must be a positive integer, got 0"
    );
}

#[test]
fn kv_heads_must_divide_heads() {
    let e = yaml_error(&dense_with("  kv_heads: 4\n", "  kv_heads: 3\n"));
    assert!(
        e.starts_with("model.yaml: field `transformer.kv_heads`: "),
        "{e}"
    );
    assert!(e.contains("heads(8) % kv_heads(3) != 0"), "{e}");
}

#[test]
fn missing_vocab() {
    let e = yaml_error(&dense_with("  vocab: 32000\n", ""));
    assert!(e.starts_with("model.yaml:"), "{e}");
    assert!(e.contains("missing field `vocab`"), "{e}");
}

#[test]
fn learned_positions_need_max_positions() {
    let e = yaml_error(&dense_with("  max_positions: 2048\n", ""));
    assert!(
        e.starts_with("model.yaml: field `transformer.max_positions`: "),
        "{e}"
    );
    assert!(e.contains("position: learned"), "{e}");
}

#[test]
fn wrong_type_names_the_field_and_line() {
    let e = yaml_error(&dense_with("  layers: 4\n", "  layers: four\n"));
    assert!(e.starts_with("model.yaml:3:"), "{e}");
    assert!(e.contains("transformer.layers"), "{e}");
}

#[test]
fn negative_size() {
    let e = yaml_error(&dense_with("  layers: 4\n", "  layers: -4\n"));
    assert!(e.starts_with("model.yaml:3:"), "{e}");
    assert!(e.contains("-4"), "{e}");
}

#[test]
fn duplicate_key() {
    let e = yaml_error(&dense_with("  layers: 4\n", "  layers: 4\n  layers: 5\n"));
    assert!(e.starts_with("model.yaml:"), "{e}");
    assert!(e.contains("layers"), "{e}");
}

#[test]
fn both_forms_or_neither() {
    let both = format!("{DENSE_YAML}graph: {{tensors: {{x: {{shape: [1]}}}}, ops: []}}\n");
    let e = yaml_error(&both);
    assert!(e.contains("not both"), "{e}");
    let neither = "name: x\nworkload: {kind: train, seq_len: 8, global_batch: 1}\n";
    let e = yaml_error(neither);
    assert!(
        e.starts_with("model.yaml: field `transformer`: missing"),
        "{e}"
    );
}

#[test]
fn workload_errors() {
    let e = yaml_error(&dense_with("  global_batch: 64\n", "  global_batch: 0\n"));
    assert_eq!(
        e,
        "model.yaml: field `workload.global_batch`: must be a positive integer, got 0"
    );
    let e = yaml_error(&dense_with("  optimizer: adamw\n", "  optimizer: sgd\n"));
    assert!(
        e.starts_with("model.yaml: field `workload.optimizer`: "),
        "{e}"
    );
}

#[test]
fn graph_form_errors_name_the_field() {
    let bad = GRAPH_YAML.replacen(
        "inputs: [g, down.w, down.b]",
        "inputs: [g, down.v, down.b]",
        1,
    );
    assert_ne!(bad, GRAPH_YAML);
    let e = yaml_error(&bad);
    assert!(
        e.starts_with("model.yaml: field `graph.ops[3].inputs[1]`: "),
        "{e}"
    );
    assert!(e.contains("unknown tensor `down.v`"), "{e}");

    let bad = GRAPH_YAML.replacen("ffn: 4096", "ffn: 0", 1);
    let e = yaml_error(&bad);
    assert!(e.starts_with("model.yaml: field `graph.dims.ffn`: "), "{e}");

    let bad = GRAPH_YAML.replacen("einsum: \"bsf,fh->bsh\"", "einsum: \"bsf,hf->bsh\"", 1);
    let e = yaml_error(&bad);
    assert!(
        e.starts_with("model.yaml: field `graph.ops[3].einsum`: "),
        "{e}"
    );
}

#[test]
fn graph_example_loads_from_disk() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/examples/mlp-graph.yaml");
    let spec = match load_model(&path, &WorkloadOverrides::default()) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(spec.name, "mlp-graph");
    let graph = match meshplan_ir::model_graph(&spec) {
        Ok(g) => g,
        Err(e) => panic!("{e}"),
    };
    let (h, f) = (1024.0, 4096.0);
    let env = meshplan_ir::DimEnv {
        batch: 2.0,
        seq: 1024.0,
        kv: 1024.0,
    };
    assert_eq!(
        graph.forward_flops(&env),
        4.0 * 2.0 * 2.0 * 1024.0 * (h * f + f * h)
    );
}

#[test]
fn config_errors_name_the_key() {
    let e = match PartialConfig::parse("tp=0", "--config") {
        Ok(c) => panic!("accepted {c:?}"),
        Err(e) => e.to_string(),
    };
    assert_eq!(
        e,
        "--config: field `tp`: expected a positive integer, got `0`"
    );
    let e = match PartialConfig::parse("dp=2,tpp=4", "--config") {
        Ok(c) => panic!("accepted {c:?}"),
        Err(e) => e.to_string(),
    };
    assert!(e.starts_with("--config: field `tpp`: unknown key"), "{e}");
}

/// Loads `text` and builds its graph, reporting a panic as `Err("panic")`.
fn load_and_build(text: &str) -> Result<Result<(), String>, &'static str> {
    catch_unwind(|| {
        let spec = parse_model_yaml(text, "model.yaml").map_err(|e| e.to_string())?;
        meshplan_ir::model_graph(&spec)
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .map_err(|_| "panic")
}

#[test]
fn huge_hidden_is_an_error_not_a_panic() {
    let text = dense_with("  hidden: 256\n", "  hidden: 18446744073709551615\n");
    match load_and_build(&text) {
        Ok(Err(e)) => assert!(e.starts_with("model.yaml: field `transformer."), "{e}"),
        Ok(Ok(())) => panic!("accepted hidden = u64::MAX"),
        Err(p) => panic!("{p}"),
    }
}

#[test]
fn huge_head_dim_is_an_error_not_a_panic() {
    let text = dense_with("  head_dim: 32\n", "  head_dim: 9223372036854775807\n");
    match load_and_build(&text) {
        Ok(Err(e)) => assert!(e.starts_with("model.yaml: field `transformer."), "{e}"),
        Ok(Ok(())) => panic!("accepted head_dim = 2^63 - 1"),
        Err(p) => panic!("{p}"),
    }
}

#[test]
fn huge_shared_experts_is_an_error_not_a_panic() {
    let text = MOE_YAML.replacen(
        "shared_experts: 1",
        "shared_experts: 18446744073709551615",
        1,
    );
    match load_and_build(&text) {
        Ok(Err(e)) => assert!(
            e.starts_with("model.yaml: field `transformer.moe.shared_experts`"),
            "{e}"
        ),
        Ok(Ok(())) => panic!("accepted shared_experts = u64::MAX"),
        Err(p) => panic!("{p}"),
    }
}

#[test]
fn products_of_allowed_sizes_are_errors_not_panics() {
    let text = dense_with("  heads: 8\n", "  heads: 4294967296\n").replacen(
        "  head_dim: 32\n",
        "  head_dim: 4294967296\n",
        1,
    );
    match load_and_build(&text) {
        Ok(Err(e)) => assert!(e.starts_with("model.yaml: field `transformer."), "{e}"),
        Ok(Ok(())) => panic!("accepted heads = head_dim = 2^32"),
        Err(p) => panic!("{p}"),
    }
}

#[test]
fn huge_graph_dims_are_errors_not_panics() {
    let text = GRAPH_YAML.replacen("ffn: 4096", "ffn: 18446744073709551615", 1);
    match load_and_build(&text) {
        Ok(Err(e)) => assert!(e.starts_with("model.yaml: field `graph.dims.ffn`: "), "{e}"),
        Ok(Ok(())) => panic!("accepted ffn = u64::MAX"),
        Err(p) => panic!("{p}"),
    }
    // Dims over the bound are refused before any product is formed.
    let text = GRAPH_YAML
        .replacen("hidden: 1024", "hidden: 4294967296", 1)
        .replacen("ffn: 4096", "ffn: 4294967296", 1);
    match load_and_build(&text) {
        Ok(Err(e)) => assert!(e.starts_with("model.yaml: field `graph.dims."), "{e}"),
        Ok(Ok(())) => panic!("accepted a 2^64-element weight"),
        Err(p) => panic!("{p}"),
    }
}

#[test]
fn hf_errors_name_the_json_key() {
    let bad = LLAMA_JSON.replacen(
        "\"num_key_value_heads\": 8",
        "\"num_key_value_heads\": 5",
        1,
    );
    let e = match import_hf_config(&bad, "config.json") {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };
    assert!(e.starts_with("config.json"), "{e}");
    assert!(e.contains("num_key_value_heads"), "{e}");
    let e = match import_hf_config("{\"model_type\": \"llama\",", "config.json") {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };
    assert!(e.starts_with("config.json:1:"), "{e}");
}

/// A valid cluster file whose lines the property below mutates.
const CLUSTER_YAML: &str = "name: c
nodes: 2
gpus_per_node: 8
gpu:
  name: A100-SXM4-80GB
  memory_gib: 80
  peak_tflops: {bf16: 312, fp32: 19.5}
  hbm_gbps: 2039
intra_node:
  link: nvlink3
  bandwidth_gbps: 300
  latency_us: 3
inter_node:
  link: ib
  bandwidth_gbps: 25
  latency_us: 8
";

const CLUSTER_VALUES: &[&str] = &[
    "0",
    "-1",
    "1e400",
    "nan",
    "abc",
    "[]",
    "{}",
    "~",
    "0.0",
    "18446744073709551616",
    "-0.5",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Mutated cluster files give an error naming the file, never a panic.
    #[test]
    fn cluster_mutations_never_panic(line in 0usize..16, value in 0usize..11, mode in 0u8..4, cut in 0usize..400) {
        let lines: Vec<&str> = CLUSTER_YAML.lines().collect();
        let text = match mode {
            0 => lines.iter().enumerate().filter(|(i, _)| *i != line).map(|(_, l)| *l).collect::<Vec<_>>().join("\n"),
            1 => lines
                .iter()
                .enumerate()
                .map(|(i, l)| match (i == line, l.split_once(':')) {
                    (true, Some((k, _))) => format!("{k}: {}", CLUSTER_VALUES[value]),
                    _ => l.to_string(),
                })
                .collect::<Vec<_>>()
                .join("\n"),
            2 => format!("{CLUSTER_YAML}unknown_{line}: {}\n", CLUSTER_VALUES[value]),
            _ => CLUSTER_YAML.chars().take(cut).collect(),
        };
        let r = catch_unwind(AssertUnwindSafe(|| {
            meshplan_cost_model::parse_cluster_yaml(&text, "cluster.yaml", None).map(|_| ()).map_err(|e| e.to_string())
        }));
        match r {
            Err(_) => return Err(TestCaseError::fail(format!("cluster loader panicked on:\n{text}"))),
            Ok(Err(e)) => prop_assert!(e.starts_with("cluster.yaml"), "{}", e),
            Ok(Ok(())) => {}
        }
    }
}

#[test]
fn cluster_errors_name_the_field() {
    let bad = CLUSTER_YAML.replace("bandwidth_gbps: 300", "bandwidth_gbps: 0");
    let e = meshplan_cost_model::parse_cluster_yaml(&bad, "cluster.yaml", None)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("intra_node.bandwidth_gbps"), "{e}");
    let no_ib = CLUSTER_YAML
        .split("inter_node")
        .next()
        .unwrap_or_default()
        .to_string();
    let e = meshplan_cost_model::parse_cluster_yaml(&no_ib, "cluster.yaml", None)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("inter_node"), "{e}");
    // One node needs no inter-node link; --nodes 0 is refused.
    assert!(meshplan_cost_model::parse_cluster_yaml(&no_ib, "cluster.yaml", Some(1)).is_ok());
    let e = meshplan_cost_model::parse_cluster_yaml(CLUSTER_YAML, "cluster.yaml", Some(0))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("--nodes"), "{e}");
    let e = meshplan_cost_model::parse_cluster_yaml(
        &format!("{CLUSTER_YAML}typo: 1\n"),
        "cluster.yaml",
        None,
    )
    .map(|_| ())
    .unwrap_err()
    .to_string();
    assert!(e.contains("typo") && e.starts_with("cluster.yaml:"), "{e}");
}
