//! Which checkpoint tensors make up each graph weight: the Hugging Face names of
//! each family, their shapes, and the architecture sizes a checkpoint must agree
//! on.

use super::*;

impl Checkpoint {
    /// The checkpoint tensors that make up graph weight `w` at block `layer`,
    /// each checked against the shape the graph needs: one list of column blocks,
    /// or for routed experts (`[experts, rows, cols]`) one list an expert, each
    /// expert's tensors being apart in a checkpoint.
    pub(super) fn parts(
        &self,
        graph: &Graph,
        w: TensorId,
        layer: Option<u64>,
    ) -> Result<Vec<Vec<Part>>, ExecError> {
        let t = graph.tensor(w);
        let shape = weight_shape(graph, w)?;
        let (experts, rows, cols) = match stored(graph, w, &shape).as_slice() {
            [n] => (None, 1, *n),
            [r, c] => (None, *r, *c),
            [e, r, c] => (Some(*e), *r, *c),
            _ => {
                return Err(werr(format!(
                    "`{}`: weights of rank {} are not read from checkpoints",
                    t.name,
                    shape.len()
                )))
            }
        };
        let one_d = shape.len() == 1;
        let at = (t.name.as_str(), layer);
        let expert_ids: Vec<Option<usize>> = match experts {
            Some(n) => (0..n).map(Some).collect(),
            None => vec![None],
        };
        let mut out = Vec::with_capacity(expert_ids.len());
        for expert in expert_ids {
            let block = Block {
                graph,
                name: &t.name,
                l: layer.unwrap_or(0),
                expert,
                one_d,
                cols,
            };
            let (names, transpose, widths) = match self.family {
                Family::Llama => block.llama()?,
                Family::Gpt2 => block.gpt2()?,
            };
            let total: usize = widths.iter().sum();
            if total != cols {
                return Err(werr(format!(
                    "`{}`: the checkpoint's blocks give {total} columns, the plan's model {cols}",
                    t.name
                )));
            }
            let parts = names.iter().zip(&widths);
            out.push(
                parts
                    .map(|(name, &c)| self.part(name, at, (one_d, transpose, rows, c)))
                    .collect::<Result<_, _>>()?,
            );
        }
        Ok(out)
    }

    /// The checkpoint tensor `name` for the plan's weight `at` (name, layer), a
    /// block of `c` columns: found, of the expected shape and a dtype read.
    fn part(
        &self,
        name: &str,
        (weight, layer): (&str, Option<u64>),
        (one_d, transpose, rows, c): (bool, bool, usize, usize),
    ) -> Result<Part, ExecError> {
        let of_layer = layer.map(|l| format!(" of layer {l}")).unwrap_or_default();
        let want = match (one_d, transpose) {
            (true, _) => vec![c],
            (false, true) => vec![c, rows],
            (false, false) => vec![rows, c],
        };
        let found = self.resolve(name).ok_or_else(|| {
            werr(format!(
                "{}: tensor `{name}` is missing (needed for the plan's `{weight}`{of_layer}, shape {want:?}); is this the checkpoint the plan was made for?",
                self.dir.display(),
            ))
        })?;
        let e = &self.index[&found];
        if e.shape != want {
            return Err(werr(format!(
                "{}: tensor `{found}` has shape {:?}, the plan's model needs {want:?} (for `{weight}`{of_layer})",
                self.dir.display(),
                e.shape,
            )));
        }
        if !matches!(e.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
            return Err(werr(format!(
                "{}: tensor `{found}` is {:?}; --weights reads f32, f16 and bf16",
                self.dir.display(),
                e.dtype
            )));
        }
        Ok(Part {
            name: found,
            transpose,
            cols: c,
        })
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

/// The part of graph weight `w` (of `shape`) a checkpoint holds: all of it but
/// the padded vocabulary rows of the token table and columns of the head
/// (`make_vocab_size_divisible_by`), which no checkpoint has and which start at
/// zero.
pub(super) fn stored(graph: &Graph, w: TensorId, shape: &[usize]) -> Vec<usize> {
    let mut s = shape.to_vec();
    let Some(tokens) = graph.vocab() else {
        return s;
    };
    let name = graph.tensor(w).name.as_str();
    let padded = match (name, s.as_mut_slice()) {
        ("embed.tokens.w", [rows, _]) => Some(rows),
        ("head.lm.w", [_, cols]) => Some(cols),
        _ => None,
    };
    if let Some(n) = padded {
        *n = (*n).min(tokens as usize);
    }
    s
}

/// The architecture sizes a checkpoint must agree on.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Arch {
    pub(super) layers: u64,
    pub(super) hidden: u64,
    pub(super) heads: u64,
    pub(super) kv_heads: u64,
    pub(super) head_dim: u64,
    /// The dense MLP's width, else the experts'.
    pub(super) ffn: u64,
    /// Routed experts and the experts a token takes (0 without experts).
    pub(super) experts: u64,
    pub(super) top_k: u64,
    pub(super) vocab: u64,
    pub(super) tied: bool,
}

pub(super) fn arch_of(graph: &Graph) -> Result<Arch, ExecError> {
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
        .ops()
        .find_map(|o| match &o.kind {
            OpKind::Attention(a) => Some((a.heads, a.kv_heads, a.qk_dim)),
            _ => None,
        })
        .unwrap_or((0, 0, 0));
    let experts = graph.ops().find_map(|o| match &o.kind {
        OpKind::Experts(e) => Some(e),
        _ => None,
    });
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
            .map_or(experts.map_or(0, |e| e.ffn), |f| f as u64),
        experts: experts.map_or(0, |e| e.experts),
        top_k: experts.map_or(0, |e| e.top_k),
        vocab: graph.vocab().unwrap_or(table[0] as u64),
        tied: find("head.lm.w").is_none(),
    })
}

/// One weight of the plan as a checkpoint family names it: the plan's name, the
/// layer, the routed expert (of an experts op's weight), whether it is a vector (a
/// norm's or a bias), its columns.
struct Block<'g> {
    graph: &'g Graph,
    name: &'g str,
    l: u64,
    expert: Option<usize>,
    one_d: bool,
    cols: usize,
}

/// The checkpoint tensors holding a weight, side by side: their names, whether
/// they are stored transposed, and each one's columns.
type Named = (Vec<String>, bool, Vec<usize>);

impl Block<'_> {
    fn suffix(&self) -> &'static str {
        if self.one_d && self.name.ends_with(".b") {
            "bias"
        } else {
            "weight"
        }
    }

    /// Column widths of the fused `q | k | v` blocks, from the graph's own shapes.
    fn qkv_widths(&self) -> Option<Vec<usize>> {
        self.graph.ops().find_map(|o| match &o.kind {
            OpKind::Attention(a) => Some(vec![
                (a.heads * a.qk_dim) as usize,
                (a.kv_heads * a.qk_dim) as usize,
                (a.kv_heads * a.v_dim) as usize,
            ]),
            _ => None,
        })
    }

    /// Hugging Face's Llama names (`model.layers.{l}.…`): Linear weights stored
    /// `[out, in]`, q, k, v and SwiGLU's gate and up as separate tensors.
    fn llama(&self) -> Result<Named, ExecError> {
        let (p, suffix, one_d, cols) = (
            format!("model.layers.{}.", self.l),
            self.suffix(),
            self.one_d,
            self.cols,
        );
        let one = |name: String, transpose: bool| (vec![name], transpose, vec![cols]);
        Ok(match self.name {
            // Tied or not, the head reads the embedding table itself.
            "embed.tokens.w" => one("model.embed_tokens.weight".into(), false),
            "block.norm1.w" => one(format!("{p}input_layernorm.weight"), false),
            "block.norm2.w" => one(format!("{p}post_attention_layernorm.weight"), false),
            "block.attn.qkv.w" | "block.attn.qkv.b" => (
                ["q", "k", "v"]
                    .iter()
                    .map(|x| format!("{p}self_attn.{x}_proj.{suffix}"))
                    .collect(),
                !one_d,
                self.qkv_widths().unwrap_or_else(|| vec![cols]),
            ),
            "block.attn.proj.w" | "block.attn.proj.b" => {
                one(format!("{p}self_attn.o_proj.{suffix}"), !one_d)
            }
            "block.mlp.up.w" | "block.mlp.up.b" => {
                let gated = self
                    .graph
                    .ops()
                    .any(|o| matches!(o.kind, OpKind::Activation(meshplan_ir::MlpKind::Swiglu)));
                if gated {
                    let names = ["gate", "up"].map(|x| format!("{p}mlp.{x}_proj.{suffix}"));
                    (names.to_vec(), !one_d, vec![cols / 2, cols / 2])
                } else {
                    one(format!("{p}mlp.up_proj.{suffix}"), !one_d)
                }
            }
            "block.mlp.down.w" | "block.mlp.down.b" => {
                one(format!("{p}mlp.down_proj.{suffix}"), !one_d)
            }
            "head.norm.w" => one("model.norm.weight".into(), false),
            "head.lm.w" => one("lm_head.weight".into(), true),
            // Mixtral's: the router `[experts, hidden]`, and each expert's SwiGLU
            // as Llama's MLP under other names (w1 gate, w3 up, w2 down).
            "block.moe.router.w" => one(format!("{p}block_sparse_moe.gate.weight"), true),
            "block.moe.experts.up.w" | "block.moe.experts.down.w" => {
                let e = self.expert.ok_or_else(|| {
                    werr(format!("`{}` is not an experts op's weight", self.name))
                })?;
                let x = format!("{p}block_sparse_moe.experts.{e}.");
                if self.name.ends_with("up.w") {
                    let names = ["w1", "w3"].map(|w| format!("{x}{w}.weight"));
                    (names.to_vec(), true, vec![cols / 2, cols / 2])
                } else {
                    one(format!("{x}w2.weight"), true)
                }
            }
            other => {
                return Err(werr(format!(
                    "the plan's weight `{other}` has no Llama-family checkpoint name"
                )))
            }
        })
    }

    /// GPT-2's names (`h.{l}.…`): Conv1D weights stored `[in, out]`, as the plan
    /// holds them, q, k and v fused in `c_attn`.
    fn gpt2(&self) -> Result<Named, ExecError> {
        let p = format!("h.{}.", self.l);
        let (base, transpose) = match self.name {
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
        Ok((
            vec![format!("{base}.{}", self.suffix())],
            transpose && !self.one_d,
            vec![self.cols],
        ))
    }
}
