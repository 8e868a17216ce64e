//! Expands a [`TransformerSpec`] into a [`Graph`]: embedding, the repeated blocks
//! (dense and MoE kinds as separate segments), final norm, LM head and loss.
//!
//! What each op saves for backward follows Korthikanti et al. 2022 (Table 2): norm
//! inputs, matmul inputs, the nonlinearity's input, dropout masks, and the attention
//! core's Q, K, V. Score-sized tensors of an unfused attention core are not graph
//! tensors: the cost model adds them by attention implementation.

use crate::dtype::DType;
use crate::graph::*;
use crate::spec::{MlpKind, NormKind, PositionKind, TransformerSpec};

struct Builder {
    tensors: Vec<Tensor>,
    dtype: DType,
}

const BS: [Dim; 2] = [Dim::Batch, Dim::Seq];

fn act_shape(width: u64) -> Vec<Dim> {
    vec![Dim::Batch, Dim::Seq, Dim::Fixed(width)]
}

impl Builder {
    fn tensor(
        &mut self,
        name: String,
        shape: Vec<Dim>,
        dtype: DType,
        kind: TensorKind,
        split: TpSplit,
    ) -> TensorId {
        let id = TensorId(self.tensors.len() as u32);
        self.tensors.push(Tensor {
            name,
            shape,
            dtype,
            kind,
            split,
        });
        id
    }

    fn act(&mut self, name: String, width: u64, split: TpSplit) -> TensorId {
        let dt = self.dtype;
        self.tensor(name, act_shape(width), dt, TensorKind::Activation, split)
    }

    fn weight(&mut self, name: String, shape: &[u64], split: TpSplit) -> TensorId {
        let dt = self.dtype;
        let shape = shape.iter().map(|&d| Dim::Fixed(d)).collect();
        self.tensor(name, shape, dt, TensorKind::Weight, split)
    }

    /// `y = x @ w (+ bias)`, saving `x`.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &mut self,
        ops: &mut Vec<Op>,
        name: &str,
        x: TensorId,
        in_width: u64,
        out_width: u64,
        bias: bool,
        role: TpRole,
    ) -> TensorId {
        let (w_split, out_split) = match role {
            TpRole::ColumnParallel | TpRole::VocabHead => (TpSplit::Sharded, TpSplit::Sharded),
            TpRole::RowParallel => (TpSplit::Sharded, TpSplit::Replicated),
            _ => (TpSplit::Replicated, TpSplit::Replicated),
        };
        let w = self.weight(format!("{name}.w"), &[in_width, out_width], w_split);
        let mut inputs = vec![x, w];
        if bias {
            let b_split = if role == TpRole::RowParallel {
                TpSplit::Replicated
            } else {
                w_split
            };
            inputs.push(self.weight(format!("{name}.b"), &[out_width], b_split));
        }
        let y = self.act(format!("{name}.out"), out_width, out_split);
        ops.push(Op {
            name: name.to_string(),
            kind: OpKind::Matmul {
                einsum: "bsh,hn->bsn".to_string(),
            },
            inputs,
            outputs: vec![y],
            saves: vec![x],
            role,
        });
        y
    }

    fn norm(
        &mut self,
        ops: &mut Vec<Op>,
        name: &str,
        x: TensorId,
        width: u64,
        kind: NormKind,
        split: TpSplit,
    ) -> TensorId {
        let mut inputs = vec![
            x,
            self.weight(format!("{name}.w"), &[width], TpSplit::Replicated),
        ];
        if kind == NormKind::Layernorm {
            inputs.push(self.weight(format!("{name}.b"), &[width], TpSplit::Replicated));
        }
        let y = self.act(format!("{name}.out"), width, split);
        ops.push(Op {
            name: name.to_string(),
            kind: OpKind::Norm(kind),
            inputs,
            outputs: vec![y],
            saves: vec![x],
            role: if split == TpSplit::Sharded {
                TpRole::Local
            } else {
                TpRole::Replicated
            },
        });
        y
    }

    fn dropout(&mut self, ops: &mut Vec<Op>, name: &str, x: TensorId, width: u64) -> TensorId {
        let y = self.act(format!("{name}.out"), width, TpSplit::Replicated);
        let mask = self.tensor(
            format!("{name}.mask"),
            act_shape(width),
            DType::U8,
            TensorKind::Mask,
            TpSplit::Replicated,
        );
        ops.push(Op {
            name: name.to_string(),
            kind: OpKind::Dropout,
            inputs: vec![x],
            outputs: vec![y, mask],
            saves: vec![mask],
            role: TpRole::Replicated,
        });
        y
    }

    fn add(
        &mut self,
        ops: &mut Vec<Op>,
        name: &str,
        a: TensorId,
        b: TensorId,
        width: u64,
    ) -> TensorId {
        let y = self.act(format!("{name}.out"), width, TpSplit::Replicated);
        ops.push(Op {
            name: name.to_string(),
            kind: OpKind::Add,
            inputs: vec![a, b],
            outputs: vec![y],
            saves: vec![],
            role: TpRole::Replicated,
        });
        y
    }

    /// A dense MLP: up (column), nonlinearity, down (row). Returns the output.
    fn mlp(
        &mut self,
        ops: &mut Vec<Op>,
        prefix: &str,
        x: TensorId,
        t: &TransformerSpec,
        ffn: u64,
    ) -> TensorId {
        let up_width = ffn * if t.mlp == MlpKind::Swiglu { 2 } else { 1 };
        let u = self.linear(
            ops,
            &format!("{prefix}.up"),
            x,
            t.hidden,
            up_width,
            t.bias || t.mlp_bias,
            TpRole::ColumnParallel,
        );
        let g = self.act(format!("{prefix}.act.out"), ffn, TpSplit::Sharded);
        ops.push(Op {
            name: format!("{prefix}.act"),
            kind: OpKind::Activation(t.mlp),
            inputs: vec![u],
            outputs: vec![g],
            saves: vec![u],
            role: TpRole::Local,
        });
        self.linear(
            ops,
            &format!("{prefix}.down"),
            g,
            ffn,
            t.hidden,
            t.bias || t.mlp_bias,
            TpRole::RowParallel,
        )
    }

    fn attention_core(
        &mut self,
        ops: &mut Vec<Op>,
        qkv: &[TensorId],
        shape: AttentionShape,
    ) -> TensorId {
        let out = self.act(
            "block.attn.core.out".into(),
            shape.heads * shape.v_dim,
            TpSplit::Sharded,
        );
        ops.push(Op {
            name: "block.attn.core".into(),
            kind: OpKind::Attention(shape),
            inputs: qkv.to_vec(),
            outputs: vec![out],
            saves: qkv.to_vec(),
            role: TpRole::Local,
        });
        out
    }

    fn rope(&mut self, ops: &mut Vec<Op>, name: &str, x: TensorId, width: u64) -> TensorId {
        let y = self.act(format!("{name}.out"), width, TpSplit::Sharded);
        ops.push(Op {
            name: name.to_string(),
            kind: OpKind::Rope,
            inputs: vec![x],
            outputs: vec![y],
            saves: vec![],
            role: TpRole::Local,
        });
        y
    }

    /// Standard (MHA/GQA) attention sub-block from the normed input; returns the
    /// projection output.
    fn attention(&mut self, ops: &mut Vec<Op>, n1: TensorId, t: &TransformerSpec) -> TensorId {
        let qkv_width = (t.heads + 2 * t.kv_heads) * t.head_dim;
        let qkv_bias = t.bias || t.qkv_bias;
        let mut qkv = self.linear(
            ops,
            "block.attn.qkv",
            n1,
            t.hidden,
            qkv_width,
            qkv_bias,
            TpRole::ColumnParallel,
        );
        if t.position == PositionKind::Rope {
            qkv = self.rope(ops, "block.attn.rope", qkv, qkv_width);
        }
        let shape = AttentionShape {
            heads: t.heads,
            kv_heads: t.kv_heads,
            qk_dim: t.head_dim,
            v_dim: t.head_dim,
            causal: true,
            alibi: t.position == PositionKind::Alibi,
        };
        let core = self.attention_core(ops, &[qkv], shape);
        self.linear(
            ops,
            "block.attn.proj",
            core,
            t.heads * t.head_dim,
            t.hidden,
            t.bias || t.attn_out_bias,
            TpRole::RowParallel,
        )
    }

    /// DeepSeek multi-head latent attention sub-block.
    fn mla_attention(&mut self, ops: &mut Vec<Op>, n1: TensorId, t: &TransformerSpec) -> TensorId {
        let Some(m) = t.mla.clone() else {
            return self.attention(ops, n1, t);
        };
        let qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim;
        let q = match m.q_lora_rank {
            Some(r) => {
                let qa = self.linear(
                    ops,
                    "block.attn.q_a",
                    n1,
                    t.hidden,
                    r,
                    false,
                    TpRole::Replicated,
                );
                let qn = self.norm(
                    ops,
                    "block.attn.q_a_norm",
                    qa,
                    r,
                    NormKind::Rmsnorm,
                    TpSplit::Replicated,
                );
                self.linear(
                    ops,
                    "block.attn.q_b",
                    qn,
                    r,
                    t.heads * qk_dim,
                    false,
                    TpRole::ColumnParallel,
                )
            }
            None => self.linear(
                ops,
                "block.attn.q",
                n1,
                t.hidden,
                t.heads * qk_dim,
                false,
                TpRole::ColumnParallel,
            ),
        };
        let kva = self.linear(
            ops,
            "block.attn.kv_a",
            n1,
            t.hidden,
            m.kv_lora_rank + m.qk_rope_head_dim,
            false,
            TpRole::Replicated,
        );
        let kvn = self.norm(
            ops,
            "block.attn.kv_a_norm",
            kva,
            m.kv_lora_rank,
            NormKind::Rmsnorm,
            TpSplit::Replicated,
        );
        let kv = self.linear(
            ops,
            "block.attn.kv_b",
            kvn,
            m.kv_lora_rank,
            t.heads * (m.qk_nope_head_dim + m.v_head_dim),
            false,
            TpRole::ColumnParallel,
        );
        let q = self.rope(ops, "block.attn.rope", q, t.heads * qk_dim);
        let shape = AttentionShape {
            heads: t.heads,
            kv_heads: t.heads,
            qk_dim,
            v_dim: m.v_head_dim,
            causal: true,
            alibi: false,
        };
        let core = self.attention_core(ops, &[q, kv], shape);
        self.linear(
            ops,
            "block.attn.proj",
            core,
            t.heads * m.v_head_dim,
            t.hidden,
            false,
            TpRole::RowParallel,
        )
    }

    fn block(&mut self, t: &TransformerSpec, moe: bool) -> Vec<Op> {
        let mut ops = Vec::new();
        let h = t.hidden;
        let x = self.act("block.in".into(), h, TpSplit::Replicated);
        let n1 = self.norm(&mut ops, "block.norm1", x, h, t.norm, TpSplit::Replicated);
        let mut a = if t.mla.is_some() {
            self.mla_attention(&mut ops, n1, t)
        } else {
            self.attention(&mut ops, n1, t)
        };
        if t.dropout {
            a = self.dropout(&mut ops, "block.attn.dropout", a, h);
        }
        let x1 = self.add(&mut ops, "block.attn.residual", x, a, h);
        let n2 = self.norm(&mut ops, "block.norm2", x1, h, t.norm, TpSplit::Replicated);
        let mut f = match (&t.moe, moe) {
            (Some(m), true) => {
                let logits = self.linear(
                    &mut ops,
                    "block.moe.router",
                    n2,
                    h,
                    m.experts,
                    false,
                    TpRole::Replicated,
                );
                let gated = t.mlp == MlpKind::Swiglu;
                let up_w = m.expert_ffn_hidden * if gated { 2 } else { 1 };
                let w_up = self.weight(
                    "block.moe.experts.up.w".into(),
                    &[m.experts, h, up_w],
                    TpSplit::Experts,
                );
                let w_down = self.weight(
                    "block.moe.experts.down.w".into(),
                    &[m.experts, m.expert_ffn_hidden, h],
                    TpSplit::Experts,
                );
                // Tokens as the experts see them: each token `top_k` times.
                // Sharded: balanced routing spreads a tensor-parallel group's tokens over its ranks.
                let routed = |b: &mut Builder, name: &str, width: u64| {
                    let dt = b.dtype;
                    b.tensor(
                        format!("block.moe.experts.{name}"),
                        vec![Dim::Batch, Dim::Seq, Dim::Fixed(m.top_k), Dim::Fixed(width)],
                        dt,
                        TensorKind::Activation,
                        TpSplit::Sharded,
                    )
                };
                let r_in = routed(self, "dispatched", h);
                let r_up = routed(self, "up", up_w);
                let r_act = routed(self, "act", m.expert_ffn_hidden);
                let y = self.act("block.moe.experts.out".into(), h, TpSplit::Replicated);
                ops.push(Op {
                    name: "block.moe.experts".into(),
                    kind: OpKind::Experts(ExpertsShape {
                        experts: m.experts,
                        top_k: m.top_k,
                        hidden: h,
                        ffn: m.expert_ffn_hidden,
                        mlp: t.mlp,
                        capacity_factor: m.capacity_factor,
                    }),
                    inputs: vec![n2, logits, w_up, w_down],
                    outputs: vec![y, r_in, r_up, r_act],
                    saves: vec![logits, r_in, r_up, r_act],
                    role: TpRole::Experts,
                });
                if m.shared_experts > 0 {
                    let sf = m.shared_experts
                        * m.shared_expert_ffn_hidden.unwrap_or(m.expert_ffn_hidden);
                    let s = self.mlp(&mut ops, "block.moe.shared", n2, t, sf);
                    self.add(&mut ops, "block.moe.combine", y, s, h)
                } else {
                    y
                }
            }
            _ => self.mlp(&mut ops, "block.mlp", n2, t, t.ffn_hidden),
        };
        if t.dropout {
            f = self.dropout(&mut ops, "block.mlp.dropout", f, h);
        }
        self.add(&mut ops, "block.mlp.residual", x1, f, h);
        ops
    }
}

/// Expands a transformer into its op graph.
pub fn build_transformer(name: &str, t: &TransformerSpec, dtype: DType) -> Graph {
    let mut b = Builder {
        tensors: Vec::new(),
        dtype,
    };
    let h = t.hidden;
    let mut segments = Vec::new();

    // Embedding.
    let mut ops = Vec::new();
    let ids = b.tensor(
        "tokens".into(),
        BS.to_vec(),
        DType::I32,
        TensorKind::Index,
        TpSplit::Replicated,
    );
    // Padded rows (`make_vocab_size_divisible_by`) are never looked up, and the
    // loss and sampling skip their logits: only the widths change.
    let rows = t.padded_vocab();
    let wte = b.weight("embed.tokens.w".into(), &[rows, h], TpSplit::Sharded);
    let tok = b.act("embed.tokens.out".into(), h, TpSplit::Replicated);
    ops.push(Op {
        name: "embed.tokens".into(),
        kind: OpKind::Embedding,
        inputs: vec![ids, wte],
        outputs: vec![tok],
        saves: vec![],
        role: TpRole::VocabEmbedding,
    });
    if t.position == PositionKind::Learned {
        let wpe = b.weight(
            "embed.positions.w".into(),
            &[t.max_positions, h],
            TpSplit::Replicated,
        );
        let pos = b.act("embed.positions.out".into(), h, TpSplit::Replicated);
        ops.push(Op {
            name: "embed.positions".into(),
            kind: OpKind::Embedding,
            inputs: vec![ids, wpe],
            outputs: vec![pos],
            saves: vec![],
            role: TpRole::Replicated,
        });
        b.add(&mut ops, "embed.sum", tok, pos, h);
    }
    segments.push(Segment {
        name: "embed".into(),
        kind: SegmentKind::Embed,
        repeat: 1,
        ops,
    });

    // Blocks: dense first (DeepSeek keeps a few), then MoE.
    let moe_layers = t.moe_layers();
    let dense_layers = t.layers - moe_layers;
    if dense_layers > 0 {
        let ops = b.block(t, false);
        segments.push(Segment {
            name: "dense_block".into(),
            kind: SegmentKind::Block,
            repeat: dense_layers,
            ops,
        });
    }
    if moe_layers > 0 {
        let ops = b.block(t, true);
        segments.push(Segment {
            name: "moe_block".into(),
            kind: SegmentKind::Block,
            repeat: moe_layers,
            ops,
        });
    }

    // Head.
    let mut ops = Vec::new();
    let x = b.act("head.in".into(), h, TpSplit::Replicated);
    let n = b.norm(&mut ops, "head.norm", x, h, t.norm, TpSplit::Replicated);
    let w_head = if t.tie_embeddings {
        wte
    } else {
        b.weight("head.lm.w".into(), &[h, rows], TpSplit::Sharded)
    };
    let logits = b.tensor(
        "head.lm.out".into(),
        act_shape(rows),
        DType::F32,
        TensorKind::Activation,
        TpSplit::Sharded,
    );
    // The tied table is stored `[vocab, hidden]`, hence the transposed signature.
    let einsum = if t.tie_embeddings {
        "bsh,vh->bsv"
    } else {
        "bsh,hv->bsv"
    };
    ops.push(Op {
        name: "head.lm".into(),
        kind: OpKind::Matmul {
            einsum: einsum.into(),
        },
        inputs: vec![n, w_head],
        outputs: vec![logits],
        saves: vec![n],
        role: TpRole::VocabHead,
    });
    let labels = b.tensor(
        "labels".into(),
        BS.to_vec(),
        DType::I32,
        TensorKind::Index,
        TpSplit::Replicated,
    );
    let loss = b.tensor(
        "loss".into(),
        vec![],
        DType::F32,
        TensorKind::Activation,
        TpSplit::Replicated,
    );
    ops.push(Op {
        name: "head.loss".into(),
        kind: OpKind::CrossEntropy { vocab: t.vocab },
        inputs: vec![logits, labels],
        outputs: vec![loss],
        saves: vec![logits],
        role: TpRole::VocabLoss,
    });
    segments.push(Segment {
        name: "head".into(),
        kind: SegmentKind::Head,
        repeat: 1,
        ops,
    });

    Graph {
        name: name.to_string(),
        tensors: b.tensors,
        segments,
        constants: Constants {
            rope_theta: t.rope_theta,
            rope_scaling: t.rope_scaling,
            sliding_window: t.sliding_window,
            unexecutable: t.unexecutable.clone(),
            norm_eps: t.norm_eps,
            dropout_p: crate::graph::DEFAULT_DROPOUT_P,
        },
    }
}
