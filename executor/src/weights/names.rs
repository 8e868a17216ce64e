//! Which checkpoint tensors make up each graph weight: the Hugging Face names of
//! each family, their shapes, and the architecture sizes a checkpoint must agree
//! on.

use super::*;

impl Checkpoint {
    /// The checkpoint tensors that make up graph weight `w` of `op` at block `layer`,
    /// each checked against the shape the graph needs.
    pub(super) fn parts(
        &self,
        graph: &Graph,
        op: &Op,
        w: TensorId,
        layer: Option<u64>,
    ) -> Result<Vec<Part>, WeightsError> {
        let t = graph.tensor(w);
        let shape = weight_shape(graph, w)?;
        let (rows, cols) = match shape.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            _ => {
                return Err(werr(format!(
                    "`{}`: weights of rank {} are not read from checkpoints (MoE checkpoints are not supported yet)",
                    t.name,
                    shape.len()
                )))
            }
        };
        let one_d = shape.len() == 1;
        // Column widths of the fused blocks, from the graph's own shapes.
        let qkv_widths = || -> Option<Vec<usize>> {
            graph
                .segments
                .iter()
                .flat_map(|s| &s.ops)
                .find_map(|o| match &o.kind {
                    OpKind::Attention(a) => Some(vec![
                        (a.heads * a.qk_dim) as usize,
                        (a.kv_heads * a.qk_dim) as usize,
                        (a.kv_heads * a.v_dim) as usize,
                    ]),
                    _ => None,
                })
        };
        let l = layer.unwrap_or(0);
        let suffix = if one_d && t.name.ends_with(".b") {
            "bias"
        } else {
            "weight"
        };
        let (names, transpose, widths): (Vec<String>, bool, Vec<usize>) = match self.family {
            Family::Llama => {
                let p = format!("model.layers.{l}.");
                match t.name.as_str() {
                    "embed.tokens.w" if op.name == "head.lm" => {
                        // Tied: the head reads the embedding table itself.
                        (vec!["model.embed_tokens.weight".into()], false, vec![cols])
                    }
                    "embed.tokens.w" => {
                        (vec!["model.embed_tokens.weight".into()], false, vec![cols])
                    }
                    "block.norm1.w" => (
                        vec![format!("{p}input_layernorm.weight")],
                        false,
                        vec![cols],
                    ),
                    "block.norm2.w" => (
                        vec![format!("{p}post_attention_layernorm.weight")],
                        false,
                        vec![cols],
                    ),
                    "block.attn.qkv.w" | "block.attn.qkv.b" => (
                        ["q", "k", "v"]
                            .iter()
                            .map(|x| format!("{p}self_attn.{x}_proj.{suffix}"))
                            .collect(),
                        !one_d,
                        qkv_widths().unwrap_or_else(|| vec![cols]),
                    ),
                    "block.attn.proj.w" | "block.attn.proj.b" => (
                        vec![format!("{p}self_attn.o_proj.{suffix}")],
                        !one_d,
                        vec![cols],
                    ),
                    "block.mlp.up.w" | "block.mlp.up.b" => {
                        let gated = graph.segments.iter().flat_map(|s| &s.ops).any(|o| {
                            matches!(o.kind, OpKind::Activation(meshplan_ir::MlpKind::Swiglu))
                        });
                        if gated {
                            (
                                vec![
                                    format!("{p}mlp.gate_proj.{suffix}"),
                                    format!("{p}mlp.up_proj.{suffix}"),
                                ],
                                !one_d,
                                vec![cols / 2, cols / 2],
                            )
                        } else {
                            (vec![format!("{p}mlp.up_proj.{suffix}")], !one_d, vec![cols])
                        }
                    }
                    "block.mlp.down.w" | "block.mlp.down.b" => (
                        vec![format!("{p}mlp.down_proj.{suffix}")],
                        !one_d,
                        vec![cols],
                    ),
                    "head.norm.w" => (vec!["model.norm.weight".into()], false, vec![cols]),
                    "head.lm.w" => (vec!["lm_head.weight".into()], true, vec![cols]),
                    other => {
                        return Err(werr(format!(
                            "the plan's weight `{other}` has no Llama-family checkpoint name"
                        )))
                    }
                }
            }
            Family::Gpt2 => {
                let p = format!("h.{l}.");
                let (base, transpose) = match t.name.as_str() {
                    "embed.tokens.w" => ("wte".to_string(), false),
                    "embed.positions.w" => ("wpe".to_string(), false),
                    "block.norm1.w" | "block.norm1.b" => (format!("{p}ln_1"), false),
                    "block.norm2.w" | "block.norm2.b" => (format!("{p}ln_2"), false),
                    "block.attn.qkv.w" | "block.attn.qkv.b" => (format!("{p}attn.c_attn"), false),
                    "block.attn.proj.w" | "block.attn.proj.b" => (format!("{p}attn.c_proj"), false),
                    "block.mlp.up.w" | "block.mlp.up.b" => (format!("{p}mlp.c_fc"), false),
                    "block.mlp.down.w" | "block.mlp.down.b" => (format!("{p}mlp.c_proj"), false),
                    "head.norm.w" | "head.norm.b" => ("ln_f".to_string(), false),
                    "head.lm.w" => ("lm_head".to_string(), true),
                    other => {
                        return Err(werr(format!(
                            "the plan's weight `{other}` has no GPT-2 checkpoint name"
                        )))
                    }
                };
                (
                    vec![format!("{base}.{suffix}")],
                    transpose && !one_d,
                    vec![cols],
                )
            }
        };
        let total: usize = widths.iter().sum();
        if total != cols {
            return Err(werr(format!(
                "`{}`: the checkpoint's blocks give {total} columns, the plan's model {cols}",
                t.name
            )));
        }
        let mut parts = Vec::new();
        for (name, &c) in names.iter().zip(&widths) {
            let found = self.resolve(name).ok_or_else(|| {
                werr(format!(
                    "{}: tensor `{name}` is missing (needed for the plan's `{}`{}, shape {:?}); is this the checkpoint the plan was made for?",
                    self.dir.display(),
                    t.name,
                    layer.map(|l| format!(" of layer {l}")).unwrap_or_default(),
                    expected_shape(one_d, transpose, rows, c),
                ))
            })?;
            let e = &self.index[&found];
            let want = expected_shape(one_d, transpose, rows, c);
            if e.shape != want {
                return Err(werr(format!(
                    "{}: tensor `{found}` has shape {:?}, the plan's model needs {want:?} (for `{}`{})",
                    self.dir.display(),
                    e.shape,
                    t.name,
                    layer.map(|l| format!(" of layer {l}")).unwrap_or_default(),
                )));
            }
            if !matches!(e.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
                return Err(werr(format!(
                    "{}: tensor `{found}` is {:?}; --weights reads f32, f16 and bf16",
                    self.dir.display(),
                    e.dtype
                )));
            }
            parts.push(Part {
                name: found,
                transpose,
                cols: c,
            });
        }
        Ok(parts)
    }

    /// A checkpoint name as stored: with or without the model's prefix.
    fn resolve(&self, name: &str) -> Option<String> {
        let bare = name.strip_prefix("model.").unwrap_or(name);
        let candidates = match self.family {
            Family::Llama => vec![name.to_string(), bare.to_string()],
            Family::Gpt2 => vec![name.to_string(), format!("transformer.{name}")],
        };
        candidates.into_iter().find(|c| self.index.contains_key(c))
    }
}

pub(super) fn expected_shape(one_d: bool, transpose: bool, rows: usize, cols: usize) -> Vec<usize> {
    if one_d {
        vec![cols]
    } else if transpose {
        vec![cols, rows]
    } else {
        vec![rows, cols]
    }
}

/// The architecture sizes a checkpoint must agree on.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Arch {
    pub(super) layers: u64,
    pub(super) hidden: u64,
    pub(super) heads: u64,
    pub(super) kv_heads: u64,
    pub(super) head_dim: u64,
    pub(super) ffn: u64,
    pub(super) vocab: u64,
    pub(super) tied: bool,
}

pub(super) fn arch_of_spec(t: &TransformerSpec) -> Arch {
    Arch {
        layers: t.layers,
        hidden: t.hidden,
        heads: t.heads,
        kv_heads: t.kv_heads,
        head_dim: t.head_dim,
        ffn: t.ffn_hidden,
        vocab: t.vocab,
        tied: t.tie_embeddings,
    }
}

pub(super) fn arch_of(graph: &Graph) -> Result<Arch, WeightsError> {
    let find = |name: &str| -> Option<Vec<usize>> {
        graph
            .tensors
            .iter()
            .position(|t| t.name == name)
            .and_then(|i| weight_shape(graph, TensorId(i as u32)).ok())
    };
    let table =
        find("embed.tokens.w").ok_or_else(|| werr("the plan's model has no token embedding"))?;
    let (heads, kv_heads, head_dim) = graph
        .segments
        .iter()
        .flat_map(|s| &s.ops)
        .find_map(|o| match &o.kind {
            OpKind::Attention(a) => Some((a.heads, a.kv_heads, a.qk_dim)),
            _ => None,
        })
        .unwrap_or((0, 0, 0));
    Ok(Arch {
        layers: graph
            .segments
            .iter()
            .filter(|s| s.kind == SegmentKind::Block)
            .map(|s| s.repeat)
            .sum(),
        hidden: table.get(1).copied().unwrap_or(0) as u64,
        heads,
        kv_heads,
        head_dim,
        ffn: find("block.mlp.down.w")
            .and_then(|s| s.first().copied())
            .unwrap_or(0) as u64,
        vocab: table[0] as u64,
        tied: find("head.lm.w").is_none(),
    })
}
