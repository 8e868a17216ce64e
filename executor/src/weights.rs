//! Hugging Face checkpoints: a directory with `config.json` and one or many
//! `*.safetensors` files (Llama / Mistral / Qwen2 / Mixtral or GPT-2 tensor names).
//!
//! Every file is memory-mapped once per process and shared by the rank threads; a
//! rank copies out only the elements of its own shard ([`crate::shard::held_runs`],
//! the rule [`crate::shard::local_weight`] and the seeded weights follow, experts
//! over the expert axis included), converting bf16 / f16 to f32 as it reads. No
//! rank ever holds a full copy of a sharded weight.
//!
//! The graph stores a linear layer as `[in, out]`; Hugging Face's `nn.Linear` stores
//! `[out, in]` (read transposed) and GPT-2's `Conv1D` stores `[in, out]` (read as
//! is). Fused graph weights are column blocks of several checkpoint tensors: the
//! QKV projection is `q | k | v`, a SwiGLU up projection is `gate | up`. Rotary
//! embedding needs no permutation: the kernel uses Hugging Face's rotate-half pairs.

use crate::shard::TpPos;
use crate::train::ExecError;
use memmap2::Mmap;
use meshplan_ir::graph::OpKind;
use meshplan_ir::{Graph, Op, SegmentKind, TensorId, TensorKind};
use safetensors::tensor::{Dtype, SafeTensors};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// Why a checkpoint cannot serve a plan ([`ExecError::Checkpoint`]): names the
/// file, tensor or field and the fix.
fn werr(message: impl Into<String>) -> ExecError {
    ExecError::Checkpoint(message.into())
}

/// Tensor naming scheme of a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Llama, Mistral, Qwen2, Mixtral: `model.layers.{i}.self_attn.q_proj.weight`,
    /// ... (Mixtral's experts `block_sparse_moe.experts.{e}.w1.weight`, ...).
    Llama,
    /// GPT-2: `h.{i}.attn.c_attn.weight` (Conv1D, `[in, out]`), ...
    Gpt2,
}

/// One tensor's place in a mapped file.
#[derive(Clone, Debug)]
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range in the file.
    start: usize,
    end: usize,
}

/// An opened checkpoint.
pub struct Checkpoint {
    dir: PathBuf,
    family: Family,
    config_text: String,
    maps: Vec<Mmap>,
    files: Vec<PathBuf>,
    index: HashMap<String, Entry>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("family", &self.family)
            .field("files", &self.files)
            .field("tensors", &self.index.len())
            .finish()
    }
}

/// A checkpoint tensor giving a column block of a graph weight.
#[derive(Clone, Debug)]
struct Part {
    /// Checkpoint tensor name, as found.
    name: String,
    /// Stored `[cols, rows]` (`nn.Linear`): read transposed.
    transpose: bool,
    /// Graph columns it gives.
    cols: usize,
}

/// This rank's slice of weight `w` (an input of `op`, in block layer `layer` or
/// [`crate::train::NO_LAYER`]) as a run starts: read from the Hugging Face
/// checkpoint `hf`, or the seeded initial values, sliced over the tensor and
/// expert axes as training and inference both hold it.
pub(crate) fn starting_slice(
    graph: &Graph,
    (op, w): (&Op, TensorId),
    layer: u64,
    (tp, ep): (TpPos, TpPos),
    seed: u64,
    hf: Option<&Checkpoint>,
) -> Result<Vec<f32>, crate::comm::RankError> {
    let t = graph.tensor(w);
    let shape = crate::program::fixed_shape(t)?;
    match hf {
        Some(ck) => {
            let runs = crate::shard::held_runs(graph, (op, op.role, w), &shape, tp, ep);
            let l = (layer != crate::train::NO_LAYER).then_some(layer);
            ck.local(graph, w, l, &runs)
                .map_err(|e| crate::comm::RankError::Input(e.to_string()))
        }
        None => {
            let kind = crate::init::init_kind(op, w, &shape);
            let runs = crate::shard::held_runs(graph, (op, op.role, w), &shape, tp, ep);
            Ok(crate::init::init_held(seed, &t.name, layer, &runs, kind))
        }
    }
}

/// The fixed shape of a weight tensor.
fn weight_shape(graph: &Graph, id: TensorId) -> Result<Vec<usize>, ExecError> {
    crate::program::fixed_shape(graph.tensor(id)).map_err(|e| werr(e.to_string()))
}

impl Checkpoint {
    /// Opens `dir`: reads `config.json`, maps every `*.safetensors` file and indexes
    /// its tensors.
    pub fn open(dir: &Path) -> Result<Checkpoint, ExecError> {
        let shown = dir.display();
        let config_path = dir.join("config.json");
        let config_text = meshplan_ir::input::read_text_bounded(
            &config_path,
            meshplan_ir::input::TEXT_LIMIT,
        )
        .map_err(|e| {
            werr(format!(
                "{}: {e} (--weights takes a Hugging Face checkpoint directory holding config.json and *.safetensors)",
                config_path.display()
            ))
        })?;
        let config: serde_json::Value = serde_json::from_str(&config_text)
            .map_err(|e| werr(format!("{}: not JSON: {e}", config_path.display())))?;
        let model_type = config
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        let family = match model_type {
            "llama" | "mistral" | "qwen2" | "mixtral" => Family::Llama,
            "gpt2" => Family::Gpt2,
            other => {
                return Err(werr(format!(
                    "{}: field `model_type` is `{other}`; --weights reads llama, mistral, qwen2, mixtral and gpt2 checkpoints",
                    config_path.display()
                )))
            }
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| werr(format!("{shown}: {e}")))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(werr(format!(
                "{shown}: no *.safetensors file (PyTorch .bin checkpoints are not read; convert them to safetensors)"
            )));
        }
        let mut maps = Vec::new();
        let mut index = HashMap::new();
        for (fi, path) in files.iter().enumerate() {
            let map = crate::mapped::map_readonly(path)
                .map_err(|e| werr(format!("{}: {e}", path.display())))?;
            let (header, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| werr(format!("{}: not a safetensors file: {e}", path.display())))?;
            let base = 8 + header;
            for (name, info) in meta.tensors() {
                let (a, b) = info.data_offsets;
                if base + b > map.len() || a > b {
                    return Err(werr(format!(
                        "{}: tensor `{name}` lies outside the file",
                        path.display()
                    )));
                }
                if let Some(prev) = index.insert(
                    name.clone(),
                    Entry {
                        file: fi,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start: base + a,
                        end: base + b,
                    },
                ) {
                    return Err(werr(format!(
                        "{shown}: tensor `{name}` is in both {} and {}",
                        files[prev.file].display(),
                        path.display()
                    )));
                }
            }
            maps.push(map);
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            family,
            config_text,
            maps,
            files,
            index,
        })
    }

    /// Checks `config.json` describes the plan's model: each architecture field the
    /// graph fixes, named by its `config.json` key.
    pub fn check_config(&self, graph: &Graph) -> Result<(), ExecError> {
        let file = self.dir.join("config.json").display().to_string();
        let spec = meshplan_ir::hf::import_hf_config(&self.config_text, &file)
            .map_err(|e| werr(e.to_string()))?;
        let Some(t) = spec.transformer() else {
            return Err(werr(format!("{file}: not a transformer config")));
        };
        let got = arch_of(graph)?;
        let gpt2 = self.family == Family::Gpt2;
        let key = |llama: &'static str, gpt: &'static str| if gpt2 { gpt } else { llama };
        let fields: [(&str, u64, u64); 7] = [
            (key("num_hidden_layers", "n_layer"), t.layers, got.layers),
            (key("hidden_size", "n_embd"), t.hidden, got.hidden),
            (key("num_attention_heads", "n_head"), t.heads, got.heads),
            (
                key("num_key_value_heads", "n_head"),
                t.kv_heads,
                got.kv_heads,
            ),
            (key("head_dim", "n_embd / n_head"), t.head_dim, got.head_dim),
            (key("intermediate_size", "n_inner"), t.ffn_hidden, got.ffn),
            ("vocab_size", t.vocab, got.vocab),
        ];
        let moe = t.moe.as_ref().map_or((0, 0), |m| (m.experts, m.top_k));
        let experts = [
            ("num_local_experts", moe.0, got.experts),
            ("num_experts_per_tok", moe.1, got.top_k),
        ];
        for (field, w, g) in fields.into_iter().chain(experts) {
            if w != g {
                return Err(werr(format!(
                    "{file}: field `{field}` gives {w} but the plan's model has {g}; plan this checkpoint's model (meshplan plan {file} CLUSTER --workload FILE) or pass the matching --weights"
                )));
            }
        }
        same_parts(&file, &spec, graph)?;
        if t.tie_embeddings != got.tied {
            return Err(werr(format!(
                "{file}: field `tie_word_embeddings` is {} but the plan's model has {} embeddings",
                t.tie_embeddings,
                if got.tied { "tied" } else { "untied" }
            )));
        }
        same_constants(&file, t, graph, key("rms_norm_eps", "layer_norm_epsilon"))?;
        if let Some(u) = t.unexecutable.first() {
            return Err(werr(format!(
                "{file}: field `{}`: {}. The executor refuses it rather than compute a different model",
                u.field, u.reason
            )));
        }
        Ok(())
    }

    /// The end-of-sequence tokens `generate` stops at: `eos_token_id` of
    /// `generation_config.json` when the checkpoint has one (transformers reads it
    /// first), else of `config.json`; an id or a list of ids, none when absent.
    pub fn eos_tokens(&self) -> Result<Vec<u32>, ExecError> {
        let gen_path = self.dir.join("generation_config.json");
        let (path, text) = if gen_path.is_file() {
            let text =
                meshplan_ir::input::read_text_bounded(&gen_path, meshplan_ir::input::TEXT_LIMIT)
                    .map_err(|e| werr(format!("{}: {e}", gen_path.display())))?;
            (gen_path, text)
        } else {
            (self.dir.join("config.json"), self.config_text.clone())
        };
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| werr(format!("{}: not JSON: {e}", path.display())))?;
        let bad = |v: &serde_json::Value| {
            werr(format!(
                "{}: field `eos_token_id` is {v}; expected a token id, a list of them, or null",
                path.display()
            ))
        };
        let id = |v: &serde_json::Value| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| bad(v))
        };
        match value.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => Ok(Vec::new()),
            Some(serde_json::Value::Array(a)) => a.iter().map(id).collect(),
            Some(v) => Ok(vec![id(v)?]),
        }
    }

    /// Checks every weight of the graph is in the checkpoint with the shape the plan's
    /// model needs, for every layer.
    pub fn validate(&self, graph: &Graph) -> Result<(), ExecError> {
        for s in crate::ckpt::model_weights(graph).map_err(werr)? {
            let l = (s.key.1 != crate::train::NO_LAYER).then_some(s.key.1);
            self.parts(graph, s.id, l)?;
        }
        Ok(())
    }

    /// One element, converted to f32.
    fn elem(&self, e: &Entry, i: usize) -> f32 {
        let bytes = &self.maps[e.file][e.start..e.end];
        match e.dtype {
            Dtype::F32 => {
                let b = &bytes[4 * i..4 * i + 4];
                f32::from_le_bytes([b[0], b[1], b[2], b[3]])
            }
            Dtype::BF16 => half::bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
            _ => half::f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        }
    }

    /// The elements `runs` of graph weight `w` (block `layer`; flat indices of
    /// its full tensor, what [`crate::shard::held_runs`] gives a rank), read from
    /// the mapped files element by element.
    pub fn local(
        &self,
        graph: &Graph,
        w: TensorId,
        layer: Option<u64>,
        runs: &[std::ops::Range<usize>],
    ) -> Result<Vec<f32>, ExecError> {
        let shape = weight_shape(graph, w)?;
        // One list of parts, or one an expert.
        let blocks = self.parts(graph, w, layer)?;
        let (rows, cols) = match shape.as_slice() {
            [n] => (1, *n),
            [.., r, c] => (*r, *c),
            [] => (1, 1),
        };
        // Padded vocabulary rows or columns past the checkpoint's read as zeros.
        let (held_rows, held_cols) = match names::stored(graph, w, &shape).as_slice() {
            [r, c] => (*r, *c),
            _ => (rows, cols),
        };
        // Per block, column -> (part, column inside it).
        let starts: Vec<Vec<usize>> = (blocks.iter())
            .map(|parts| {
                let mut acc = 0;
                (parts.iter())
                    .map(|p| {
                        acc += p.cols;
                        acc - p.cols
                    })
                    .collect()
            })
            .collect();
        let entries: Vec<Vec<&Entry>> = (blocks.iter())
            .map(|parts| parts.iter().map(|p| &self.index[&p.name]).collect())
            .collect();
        // Element `i` of the full tensor: its part, entry and index there (none
        // for a padded row or column).
        let locate = |i: usize| -> Option<(&Part, &Entry, usize)> {
            let (b, r, c) = (i / (rows * cols), i / cols % rows, i % cols);
            if r >= held_rows || c >= held_cols {
                return None;
            }
            let pi = starts[b].partition_point(|&s| s <= c) - 1;
            let (p, e) = (&blocks[b][pi], entries[b][pi]);
            let cc = c - starts[b][pi];
            let at = if p.transpose {
                cc * held_rows + r
            } else {
                r * p.cols + cc
            };
            Some((p, e, at))
        };
        let indices = || runs.iter().flat_map(|run| run.clone());
        let out: Vec<f32> = indices()
            .map(|i| locate(i).map_or(0.0, |(_, e, at)| self.elem(e, at)))
            .collect();
        // NaN or infinity would generate (or train on) garbage without a word.
        if let Some((i, bad)) = indices().zip(&out).find(|(_, x)| !x.is_finite()) {
            let name = locate(i).map_or("", |(p, ..)| p.name.as_str());
            return Err(werr(format!(
                "{}: `{name}` holds {bad}: the weights are damaged or were saved from a diverged run; use an intact checkpoint",
                self.dir.display(),
            )));
        }
        Ok(out)
    }
}

/// What the model computes beyond its sizes: the graph `plan` builds from the
/// checkpoint's `config.json` (`spec`) must hold the plan's weights (biases, a gated
/// MLP, learned positions, LayerNorm's shift) and its activations, norms and
/// rotations. A checkpoint weight the plan lacks would otherwise be left unread
/// without a word, and a plan weight it lacks would be missing.
fn same_parts(file: &str, spec: &meshplan_ir::ModelSpec, graph: &Graph) -> Result<(), ExecError> {
    let parts = |g: &Graph| -> BTreeSet<String> {
        let ops = g.ops().filter_map(|o| match &o.kind {
            OpKind::Activation(k) => Some(format!("a {k:?} activation")),
            OpKind::Norm(k) => Some(format!("a {k:?} norm")),
            OpKind::Rope => Some("rotary positions".into()),
            _ => None,
        });
        (g.tensors.iter())
            .filter(|t| t.kind == TensorKind::Weight)
            .map(|t| format!("weight `{}`", t.name))
            .chain(ops)
            .collect()
    };
    let theirs = parts(&meshplan_ir::model_graph(spec).map_err(|e| werr(e.to_string()))?);
    let ours = parts(graph);
    let differ = |a: &BTreeSet<String>, b: &BTreeSet<String>| a.difference(b).next().cloned();
    if let Some(x) = differ(&theirs, &ours) {
        return Err(werr(format!(
            "{file}: the checkpoint's model has {x}, which the plan's model lacks (see its \
                 bias, activation and position fields); plan this checkpoint's config.json instead"
        )));
    }
    if let Some(x) = differ(&ours, &theirs) {
        return Err(werr(format!(
            "{file}: the plan's model has {x}, which this checkpoint's model lacks (see its \
                 bias, activation and position fields); plan this checkpoint's config.json instead"
        )));
    }
    Ok(())
}

/// The numbers the math reads beyond the shapes (`config.json`'s `t`): a plan made
/// from another file would otherwise run this checkpoint with its own. `eps_key`
/// names the norm's epsilon in the family's `config.json`.
fn same_constants(
    file: &str,
    t: &meshplan_ir::TransformerSpec,
    graph: &Graph,
    eps_key: &str,
) -> Result<(), ExecError> {
    let c = &graph.constants;
    let replan = "plan this checkpoint's config.json instead";
    if t.position == meshplan_ir::PositionKind::Rope && c.rope_theta != t.rope_theta {
        return Err(werr(format!(
            "{file}: field `rope_theta` is {} but the plan's model has {}; {replan}",
            t.rope_theta, c.rope_theta
        )));
    }
    if c.rope_scaling != t.rope_scaling {
        return Err(werr(format!(
            "{file}: field `rope_scaling` gives {} but the plan's model has {}; {replan}",
            t.rope_scaling, c.rope_scaling
        )));
    }
    if c.norm_eps != t.norm_eps {
        return Err(werr(format!(
            "{file}: field `{}` is {} but the plan's model has {}; {replan}",
            eps_key, t.norm_eps, c.norm_eps
        )));
    }
    if c.sliding_window != t.sliding_window {
        let show = |w: Option<u64>| w.map_or("none".to_string(), |w| w.to_string());
        return Err(werr(format!(
            "{file}: field `sliding_window` is {} but the plan's model has {}; {replan}",
            show(t.sliding_window),
            show(c.sliding_window)
        )));
    }
    Ok(())
}

mod names;
use names::arch_of;
