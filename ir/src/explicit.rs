//! The explicit `graph:` form of a model file: ops over named tensors with symbolic
//! dims, for models that are not standard transformers.
//!
//! ```yaml
//! graph:
//!   repeat: 4                      # the graph is one block, repeated (default 1)
//!   dims: {hidden: 1024, ffn: 4096}  # `batch`, `seq`, `kv` are reserved (symbolic)
//!   tensors:                       # ids in declaration order
//!     x:  {shape: [batch, seq, hidden]}
//!     w1: {shape: [hidden, ffn], kind: weight, split: sharded}
//!     h:  {shape: [batch, seq, ffn], split: sharded}
//!     g:  {shape: [batch, seq, ffn], split: sharded}
//!     w2: {shape: [ffn, hidden], kind: weight, split: sharded}
//!     y:  {shape: [batch, seq, hidden]}
//!   ops:                           # in execution order
//!     - {name: up, kind: matmul, einsum: "bsh,hf->bsf", inputs: [x, w1], outputs: [h], role: column_parallel}
//!     - {name: act, kind: gelu, inputs: [h], outputs: [g], role: local}
//!     - {name: down, kind: matmul, einsum: "bsf,fh->bsh", inputs: [g, w2], outputs: [y], role: row_parallel}
//! ```
//!
//! Tensors: `shape` (dim names or integers, required; `[]` for a scalar), `kind`
//! (`activation` default, `weight`, `index`, `mask`), `dtype` (default: the model dtype;
//! `i32` for index and `u8` for mask tensors), `split` (`replicated` default,
//! `sharded`, `experts`).
//!
//! Ops: `name`, `kind`, `inputs`, `outputs`, optional `role` (a [`TpRole`], default
//! `replicated`) and `saves` (tensors kept for backward, among the op's inputs and
//! outputs; default: the op's activation inputs, except `add` and `rope`, whose
//! backward needs nothing, and `dropout`, which keeps its mask). Kinds and their
//! operands:
//!
//! | kind | inputs | outputs | fields |
//! |---|---|---|---|
//! | `embedding` | ids (index), table `[rows, width]` (weight) | ids shape + `[width]` | |
//! | `matmul` | a, b[, bias] | einsum result | `einsum` (`ab,bc->ac`) |
//! | `layernorm`, `rmsnorm` | x[, scale[, shift]] `[last dim]` | shape of x | |
//! | `rope` | n tensors | n tensors of the same shapes | |
//! | `gelu` | x | shape of x | |
//! | `swiglu` | x (gate and up packed), or gate, up | x with its last dim halved, or shape of gate | |
//! | `attention` | qkv packed, or q, kv, or q, k, v | `heads * v_dim` per token | `heads`, `qk_dim`, `kv_heads` (= heads), `v_dim` (= qk_dim), `causal` (true) |
//! | `add` | two or more of one shape | that shape | |
//! | `dropout` | x | y[, mask] of the shape of x | |
//! | `router` | logits `[.., experts]` | any | `experts`, `top_k` |
//! | `experts` | x `[.., hidden]`, router logits, w_up, w_down | y (shape of x), any | `experts`, `top_k`, `ffn`, `mlp` (gelu) |
//! | `cross_entropy` | logits `[.., vocab]` (wider: padding the loss skips), labels (index) | loss | `vocab` |
//!
//! Sizes are positive and at most [`DIM_MAX`], as in the architecture form. Every
//! tensor is produced by at most one op, and only by an op listed before its
//! consumers; tensors that no op produces (and weights and index tensors) are the
//! graph's inputs.

use crate::dtype::DType;
use crate::error::IrError;
use crate::graph::{
    einsum_output_shape, AttentionShape, Dim, ExpertsShape, Graph, Op, OpKind, Segment,
    SegmentKind, Tensor, TensorId, TensorKind, TpRole, TpSplit,
};
use crate::spec::{MlpKind, NormKind, DIM_MAX};
use serde::de::{self, MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

/// Largest tensor rank the graph form accepts.
pub const MAX_RANK: usize = 16;

/// A mapping that keeps the order it was written in (tensor ids follow declaration
/// order) and rejects duplicate keys.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct NamedMap<V>(pub Vec<(String, V)>);

impl<V> NamedMap<V> {
    /// Entries in declaration order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &V)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The value under `name`.
    pub fn get(&self, name: &str) -> Option<&V> {
        self.0.iter().find(|(k, _)| k == name).map(|(_, v)| v)
    }

    /// Entries.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// No entries.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<V: Serialize> Serialize for NamedMap<V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for NamedMap<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct MapVisitor<V>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for MapVisitor<V> {
            type Value = NamedMap<V>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a mapping of names")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out: Vec<(String, V)> = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    if out.iter().any(|(k, _)| *k == key) {
                        return Err(de::Error::custom(format!("duplicate entry `{key}`")));
                    }
                    let value = map.next_value::<V>()?;
                    out.push((key, value));
                }
                Ok(NamedMap(out))
            }
        }
        d.deserialize_map(MapVisitor(PhantomData))
    }
}

/// One entry of a tensor shape: a dim name (declared in `dims:` or one of the reserved
/// `batch`, `seq`, `kv`) or a literal size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DimRef {
    /// A literal size.
    Size(u64),
    /// A named dim.
    Name(String),
}

impl Serialize for DimRef {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            DimRef::Size(n) => s.serialize_u64(*n),
            DimRef::Name(n) => s.serialize_str(n),
        }
    }
}

impl<'de> Deserialize<'de> for DimRef {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = DimRef;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a dim name or a positive integer")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<DimRef, E> {
                Ok(DimRef::Size(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<DimRef, E> {
                u64::try_from(v).map(DimRef::Size).map_err(|_| {
                    E::custom(format!(
                        "shape entries are dim names or positive integers, got {v}"
                    ))
                })
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<DimRef, E> {
                Ok(DimRef::Name(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

/// A tensor as declared under `graph.tensors`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorSpec {
    /// Dim names or sizes; `[]` for a scalar.
    pub shape: Vec<DimRef>,
    /// Element type; default the model dtype (`i32` for index, `u8` for mask tensors).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<DType>,
    /// What it holds.
    #[serde(default = "default_kind")]
    pub kind: TensorKind,
    /// Standard tensor-parallel split.
    #[serde(default = "default_split")]
    pub split: TpSplit,
}

fn default_kind() -> TensorKind {
    TensorKind::Activation
}
fn default_split() -> TpSplit {
    TpSplit::Replicated
}
fn one() -> u64 {
    1
}

/// The kind of an op as written (`kind:` of an entry under `graph.ops`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKindSpec {
    /// Row lookup.
    Embedding,
    /// Einsum contraction.
    Matmul,
    /// Layer normalisation.
    Layernorm,
    /// RMS normalisation.
    Rmsnorm,
    /// Rotary embedding.
    Rope,
    /// GELU.
    Gelu,
    /// SwiGLU.
    Swiglu,
    /// Attention core.
    Attention,
    /// Elementwise sum.
    Add,
    /// Dropout.
    Dropout,
    /// Top-k expert selection.
    Router,
    /// Routed expert MLPs.
    Experts,
    /// Softmax cross-entropy.
    CrossEntropy,
}

impl OpKindSpec {
    fn as_str(self) -> &'static str {
        match self {
            OpKindSpec::Embedding => "embedding",
            OpKindSpec::Matmul => "matmul",
            OpKindSpec::Layernorm => "layernorm",
            OpKindSpec::Rmsnorm => "rmsnorm",
            OpKindSpec::Rope => "rope",
            OpKindSpec::Gelu => "gelu",
            OpKindSpec::Swiglu => "swiglu",
            OpKindSpec::Attention => "attention",
            OpKindSpec::Add => "add",
            OpKindSpec::Dropout => "dropout",
            OpKindSpec::Router => "router",
            OpKindSpec::Experts => "experts",
            OpKindSpec::CrossEntropy => "cross_entropy",
        }
    }

    /// The kind-specific fields an op of this kind may carry.
    fn fields(self) -> &'static [&'static str] {
        match self {
            OpKindSpec::Matmul => &["einsum"],
            OpKindSpec::Attention => &["heads", "kv_heads", "qk_dim", "v_dim", "causal"],
            OpKindSpec::Router => &["experts", "top_k"],
            OpKindSpec::Experts => &["experts", "top_k", "ffn", "mlp"],
            OpKindSpec::CrossEntropy => &["vocab"],
            _ => &[],
        }
    }
}

/// An op as written under `graph.ops`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpSpec {
    /// Unique name.
    pub name: String,
    /// What it computes.
    pub kind: OpKindSpec,
    /// Input tensors (activations first, then weights).
    #[serde(default)]
    pub inputs: Vec<String>,
    /// Output tensors.
    pub outputs: Vec<String>,
    /// Tensors kept for backward; see the module docs for the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saves: Option<Vec<String>>,
    /// Standard tensor-parallel role; default `replicated`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<TpRole>,
    /// `matmul`: einsum signature over the first two inputs, e.g. `bsh,hf->bsf`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub einsum: Option<String>,
    /// `attention`: query heads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heads: Option<u64>,
    /// `attention`: key/value heads (default `heads`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<u64>,
    /// `attention`: query/key width per head.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qk_dim: Option<u64>,
    /// `attention`: value width per head (default `qk_dim`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub v_dim: Option<u64>,
    /// `attention`: causal mask (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub causal: Option<bool>,
    /// `router`, `experts`: routed experts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<u64>,
    /// `router`, `experts`: experts per token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u64>,
    /// `experts`: expert MLP width.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ffn: Option<u64>,
    /// `experts`: expert nonlinearity (default gelu).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp: Option<MlpKind>,
    /// `cross_entropy`: vocabulary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab: Option<u64>,
}

impl OpSpec {
    /// Kind-specific fields that are set, by name.
    fn given_fields(&self) -> [(&'static str, bool); 11] {
        [
            ("einsum", self.einsum.is_some()),
            ("heads", self.heads.is_some()),
            ("kv_heads", self.kv_heads.is_some()),
            ("qk_dim", self.qk_dim.is_some()),
            ("v_dim", self.v_dim.is_some()),
            ("causal", self.causal.is_some()),
            ("experts", self.experts.is_some()),
            ("top_k", self.top_k.is_some()),
            ("ffn", self.ffn.is_some()),
            ("mlp", self.mlp.is_some()),
            ("vocab", self.vocab.is_some()),
        ]
    }
}

/// An explicit graph as written in a model file (see the module docs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GraphSpec {
    /// Consecutive copies of the graph (it becomes one block segment).
    #[serde(default = "one")]
    pub repeat: u64,
    /// Named sizes; `batch`, `seq` and `kv` are reserved for the symbolic dims.
    #[serde(default)]
    pub dims: NamedMap<u64>,
    /// Tensors, in id order.
    pub tensors: NamedMap<TensorSpec>,
    /// Ops, in execution order.
    pub ops: Vec<OpSpec>,
}

const RESERVED: [(&str, Dim); 3] = [("batch", Dim::Batch), ("seq", Dim::Seq), ("kv", Dim::Kv)];

fn fmt_dim(d: Dim) -> String {
    match d {
        Dim::Batch => "batch".into(),
        Dim::Seq => "seq".into(),
        Dim::Kv => "kv".into(),
        Dim::Fixed(n) => n.to_string(),
    }
}

fn fmt_shape(shape: &[Dim]) -> String {
    let parts: Vec<String> = shape.iter().map(|d| fmt_dim(*d)).collect();
    format!("[{}]", parts.join(", "))
}

/// Powers of the symbolic dims in a shape.
fn symbolic(shape: &[Dim]) -> (usize, usize, usize) {
    let count = |x: Dim| shape.iter().filter(|d| **d == x).count();
    (count(Dim::Batch), count(Dim::Seq), count(Dim::Kv))
}

/// A size must be positive and at most [`DIM_MAX`], as in the architecture form.
fn size_ok(v: u64) -> Result<(), String> {
    if v == 0 {
        return Err("must be a positive integer, got 0".into());
    }
    if v > DIM_MAX {
        return Err(format!(
            "{v} is larger than the supported maximum {DIM_MAX}"
        ));
    }
    Ok(())
}

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn is_tensor_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| !c.is_whitespace() && !c.is_control() && c != ',')
}

/// Tensor indices of one op's inputs and outputs.
type OpIo = (Vec<usize>, Vec<usize>);

/// The checked, resolved graph: everything `to_graph` needs.
struct Checked {
    tensors: Vec<Tensor>,
    ops: Vec<Op>,
}

/// Validation state over one [`GraphSpec`].
struct Checker<'a> {
    g: &'a GraphSpec,
    file: &'a str,
    dtype: DType,
    dims: BTreeMap<&'a str, u64>,
    ids: BTreeMap<&'a str, usize>,
    tensors: Vec<Tensor>,
    /// Product of the fixed dims of each tensor (elements per token for activations).
    fixed: Vec<u64>,
    /// Index of the op producing each tensor.
    producer: Vec<Option<usize>>,
}

impl<'a> Checker<'a> {
    fn err(&self, field: impl AsRef<str>, message: impl Into<String>) -> IrError {
        IrError::invalid(self.file, field.as_ref(), message)
    }

    fn op_field(i: usize, what: &str) -> String {
        format!("graph.ops[{i}].{what}")
    }

    fn known_dims(&self) -> String {
        let mut names: Vec<&str> = RESERVED.iter().map(|(n, _)| *n).collect();
        names.extend(self.g.dims.iter().map(|(n, _)| n));
        names.join(", ")
    }

    fn check_dims(&mut self) -> Result<(), IrError> {
        for (name, &size) in self.g.dims.iter() {
            let field = format!("graph.dims.{name}");
            if let Some((_, d)) = RESERVED.iter().find(|(n, _)| *n == name) {
                return Err(self.err(
                    field,
                    format!("`{name}` is reserved for the symbolic {d:?} dim; pick another name"),
                ));
            }
            if !is_identifier(name) {
                return Err(self.err(
                    field,
                    format!("`{name}` is not a valid dim name (letters, digits and `_`, not starting with a digit)"),
                ));
            }
            size_ok(size).map_err(|m| self.err(&field, m))?;
            self.dims.insert(name, size);
        }
        Ok(())
    }

    fn resolve_dim(&self, field: &str, d: &DimRef) -> Result<Dim, IrError> {
        match d {
            DimRef::Size(n) => {
                size_ok(*n).map_err(|m| self.err(field, m))?;
                Ok(Dim::Fixed(*n))
            }
            DimRef::Name(name) => {
                if let Some((_, d)) = RESERVED.iter().find(|(n, _)| n == name) {
                    return Ok(*d);
                }
                match self.dims.get(name.as_str()) {
                    Some(&n) => Ok(Dim::Fixed(n)),
                    None => Err(self.err(
                        field,
                        format!(
                            "unknown dim `{name}`; dims are {} (declare it under `graph.dims`)",
                            self.known_dims()
                        ),
                    )),
                }
            }
        }
    }

    fn check_tensors(&mut self) -> Result<(), IrError> {
        if self.g.tensors.is_empty() {
            return Err(self.err("graph.tensors", "must declare at least one tensor"));
        }
        for (id, (name, spec)) in self.g.tensors.iter().enumerate() {
            let base = format!("graph.tensors.{name}");
            if !is_tensor_name(name) {
                return Err(self.err(
                    &base,
                    format!("`{name}` is not a valid tensor name (non-empty, no spaces or commas)"),
                ));
            }
            if spec.shape.len() > MAX_RANK {
                return Err(self.err(
                    format!("{base}.shape"),
                    format!(
                        "rank {} is more than the {MAX_RANK} supported",
                        spec.shape.len()
                    ),
                ));
            }
            let mut shape = Vec::with_capacity(spec.shape.len());
            let mut fixed: u64 = 1;
            for (k, d) in spec.shape.iter().enumerate() {
                let field = format!("{base}.shape[{k}]");
                let dim = self.resolve_dim(&field, d)?;
                if let Dim::Fixed(n) = dim {
                    fixed = fixed.checked_mul(n).ok_or_else(|| {
                        self.err(&field, "the product of the fixed dims overflows 64 bits")
                    })?;
                }
                shape.push(dim);
            }
            let dtype = spec.dtype.unwrap_or(match spec.kind {
                TensorKind::Index => DType::I32,
                TensorKind::Mask => DType::U8,
                TensorKind::Activation | TensorKind::Weight => self.dtype,
            });
            self.ids.insert(name, id);
            self.tensors.push(Tensor {
                name: name.to_string(),
                shape,
                dtype,
                kind: spec.kind,
                split: spec.split,
            });
            self.fixed.push(fixed);
            self.producer.push(None);
        }
        Ok(())
    }

    fn lookup(&self, field: &str, op: &OpSpec, name: &str) -> Result<usize, IrError> {
        self.ids.get(name).copied().ok_or_else(|| {
            let hint = if self.g.tensors.len() <= 16 {
                let names: Vec<&str> = self.g.tensors.iter().map(|(n, _)| n).collect();
                format!("; tensors are {}", names.join(", "))
            } else {
                String::new()
            };
            self.err(
                field,
                format!("op `{}` refers to unknown tensor `{name}`{hint} (declare it under `graph.tensors`)", op.name),
            )
        })
    }

    /// Names, references, producers and kind-specific fields of every op.
    fn check_references(&mut self) -> Result<Vec<OpIo>, IrError> {
        if self.g.ops.is_empty() {
            return Err(self.err("graph.ops", "must list at least one op"));
        }
        let mut names: BTreeMap<&str, usize> = BTreeMap::new();
        let mut io = Vec::with_capacity(self.g.ops.len());
        for (i, op) in self.g.ops.iter().enumerate() {
            if op.name.trim().is_empty() {
                return Err(self.err(Self::op_field(i, "name"), "must not be empty"));
            }
            if let Some(prev) = names.insert(&op.name, i) {
                return Err(self.err(
                    Self::op_field(i, "name"),
                    format!("op name `{}` is already used by graph.ops[{prev}]", op.name),
                ));
            }
            let allowed = op.kind.fields();
            for (field, given) in op.given_fields() {
                if given && !allowed.contains(&field) {
                    let message = if allowed.is_empty() {
                        format!("`{}` ops take no `{field}`", op.kind.as_str())
                    } else {
                        format!(
                            "`{}` ops take no `{field}` (their fields are {})",
                            op.kind.as_str(),
                            allowed.join(", ")
                        )
                    };
                    return Err(self.err(Self::op_field(i, field), message));
                }
            }
            let mut inputs = Vec::with_capacity(op.inputs.len());
            for (j, t) in op.inputs.iter().enumerate() {
                inputs.push(self.lookup(&Self::op_field(i, &format!("inputs[{j}]")), op, t)?);
            }
            if op.outputs.is_empty() {
                return Err(self.err(
                    Self::op_field(i, "outputs"),
                    format!("op `{}` has no outputs", op.name),
                ));
            }
            let mut outputs = Vec::with_capacity(op.outputs.len());
            for (j, t) in op.outputs.iter().enumerate() {
                let field = Self::op_field(i, &format!("outputs[{j}]"));
                let id = self.lookup(&field, op, t)?;
                let kind = self.tensors[id].kind;
                if matches!(kind, TensorKind::Weight | TensorKind::Index) {
                    return Err(self.err(
                        field,
                        format!(
                            "op `{}` cannot produce `{t}`: {kind:?} tensors are graph inputs; declare it `kind: activation`",
                            op.name
                        ),
                    ));
                }
                if let Some(p) = self.producer[id] {
                    let by = &self.g.ops[p].name;
                    return Err(self.err(
                        field,
                        format!(
                            "tensor `{t}` is already produced by op `{by}` (graph.ops[{p}]); every tensor has at most one producer"
                        ),
                    ));
                }
                self.producer[id] = Some(i);
                outputs.push(id);
            }
            if let Some(saves) = &op.saves {
                for (j, t) in saves.iter().enumerate() {
                    let field = Self::op_field(i, &format!("saves[{j}]"));
                    let id = self.lookup(&field, op, t)?;
                    if !inputs.contains(&id) && !outputs.contains(&id) {
                        return Err(self.err(
                            field,
                            format!(
                                "`{t}` is neither an input nor an output of op `{}`",
                                op.name
                            ),
                        ));
                    }
                }
            }
            io.push((inputs, outputs));
        }
        Ok(io)
    }

    /// The ops must form a DAG, listed in an execution order.
    fn check_order(&self, io: &[OpIo]) -> Result<(), IrError> {
        let mut dag = petgraph::graph::DiGraph::<usize, ()>::new();
        let nodes: Vec<_> = (0..io.len()).map(|i| dag.add_node(i)).collect();
        let mut succ: Vec<Vec<usize>> = vec![Vec::new(); io.len()];
        for (i, (inputs, _)) in io.iter().enumerate() {
            for &t in inputs {
                if let Some(p) = self.producer[t] {
                    dag.add_edge(nodes[p], nodes[i], ());
                    succ[p].push(i);
                }
            }
        }
        for s in &mut succ {
            s.sort_unstable();
            s.dedup();
        }
        for scc in petgraph::algo::tarjan_scc(&dag) {
            let members: Vec<usize> = scc.iter().map(|n| dag[*n]).collect();
            let cyclic = members.len() > 1 || members.iter().any(|&m| succ[m].contains(&m));
            if !cyclic {
                continue;
            }
            // Walk inside the component from its first op until an op repeats.
            let Some(&start) = members.iter().min() else {
                continue;
            };
            let mut path = vec![start];
            let mut cur = start;
            let cycle = loop {
                let Some(&next) = succ[cur].iter().find(|n| members.contains(n)) else {
                    break path.clone();
                };
                if let Some(pos) = path.iter().position(|&p| p == next) {
                    let mut c = path[pos..].to_vec();
                    c.push(next);
                    break c;
                }
                path.push(next);
                cur = next;
            };
            let names: Vec<String> = cycle
                .iter()
                .map(|&i| format!("`{}` (graph.ops[{i}])", self.g.ops[i].name))
                .collect();
            return Err(self.err(
                "graph.ops",
                format!(
                    "the ops form a cycle: {}; each op must consume only tensors produced before it",
                    names.join(" -> ")
                ),
            ));
        }
        for (i, (inputs, _)) in io.iter().enumerate() {
            for (j, &t) in inputs.iter().enumerate() {
                if let Some(p) = self.producer[t] {
                    if p >= i {
                        return Err(self.err(
                            Self::op_field(i, &format!("inputs[{j}]")),
                            format!(
                                "op `{}` consumes `{}`, which is produced later by op `{}` (graph.ops[{p}]); list ops in execution order",
                                self.g.ops[i].name, self.tensors[t].name, self.g.ops[p].name
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    fn arity(
        &self,
        i: usize,
        op: &OpSpec,
        io: &OpIo,
        ins: (usize, usize),
        outs: (usize, usize),
        what: &str,
    ) -> Result<(), IrError> {
        let range = |(lo, hi): (usize, usize)| match (lo, hi) {
            (lo, hi) if lo == hi => lo.to_string(),
            (lo, usize::MAX) => format!("at least {lo}"),
            (lo, hi) => format!("{lo} to {hi}"),
        };
        for (field, n, (lo, hi)) in [("inputs", io.0.len(), ins), ("outputs", io.1.len(), outs)] {
            if n < lo || n > hi {
                return Err(self.err(
                    Self::op_field(i, field),
                    format!(
                        "a `{}` op takes {} {field} ({what}), got {n}",
                        op.kind.as_str(),
                        range((lo, hi))
                    ),
                ));
            }
        }
        Ok(())
    }

    fn shape(&self, t: usize) -> &[Dim] {
        &self.tensors[t].shape
    }

    fn expect_shape(
        &self,
        field: String,
        t: usize,
        want: &[Dim],
        why: &str,
    ) -> Result<(), IrError> {
        if self.shape(t) != want {
            return Err(self.err(
                field,
                format!(
                    "`{}` is declared {} but {why} gives {}",
                    self.tensors[t].name,
                    fmt_shape(self.shape(t)),
                    fmt_shape(want)
                ),
            ));
        }
        Ok(())
    }

    fn expect_kind(
        &self,
        field: String,
        t: usize,
        kind: TensorKind,
        role: &str,
    ) -> Result<(), IrError> {
        if self.tensors[t].kind != kind {
            return Err(self.err(
                field,
                format!(
                    "{role} `{}` must be a {} tensor, not {:?}",
                    self.tensors[t].name,
                    format!("{kind:?}").to_lowercase(),
                    self.tensors[t].kind
                ),
            ));
        }
        Ok(())
    }

    /// The last dim of tensor `t`, which must be fixed.
    fn last_fixed(&self, field: String, t: usize, what: &str) -> Result<u64, IrError> {
        match self.shape(t).last() {
            Some(Dim::Fixed(n)) => Ok(*n),
            other => Err(self.err(
                field,
                format!(
                    "the last dim of `{}` ({what}) must be a fixed size, got {}",
                    self.tensors[t].name,
                    other.map_or("a scalar".to_string(), |d| fmt_dim(*d))
                ),
            )),
        }
    }

    fn positive(&self, i: usize, field: &str, v: Option<u64>, kind: &str) -> Result<u64, IrError> {
        match v {
            None => Err(self.err(
                Self::op_field(i, field),
                format!("required for `{kind}` ops"),
            )),
            Some(n) => {
                size_ok(n).map_err(|m| self.err(Self::op_field(i, field), m))?;
                Ok(n)
            }
        }
    }

    fn mul(&self, i: usize, field: &str, factors: &[u64]) -> Result<u64, IrError> {
        factors
            .iter()
            .try_fold(1u64, |acc, &f| acc.checked_mul(f))
            .ok_or_else(|| self.err(Self::op_field(i, field), "sizes overflow 64 bits"))
    }

    fn expect_width(&self, field: String, t: usize, want: u64, what: &str) -> Result<(), IrError> {
        if self.fixed[t] != want {
            return Err(self.err(
                field,
                format!(
                    "`{}` {} holds {} elements per token but {what} needs {want}",
                    self.tensors[t].name,
                    fmt_shape(self.shape(t)),
                    self.fixed[t]
                ),
            ));
        }
        Ok(())
    }

    /// Arity, shapes and fields of op `i`; returns the graph op kind.
    fn check_op(&self, i: usize, op: &OpSpec, io: &OpIo) -> Result<OpKind, IrError> {
        let (inputs, outputs) = io;
        let inf = |j: usize| Self::op_field(i, &format!("inputs[{j}]"));
        let outf = |j: usize| Self::op_field(i, &format!("outputs[{j}]"));
        let kind = op.kind.as_str();
        Ok(match op.kind {
            OpKindSpec::Embedding => {
                self.arity(i, op, io, (2, 2), (1, 1), "ids and table in, rows out")?;
                let (ids, table) = (inputs[0], inputs[1]);
                self.expect_kind(inf(0), ids, TensorKind::Index, "ids")?;
                self.expect_kind(inf(1), table, TensorKind::Weight, "table")?;
                let tshape = self.shape(table);
                if tshape.len() != 2 {
                    return Err(self.err(
                        inf(1),
                        format!(
                            "table `{}` must be [rows, width], got {}",
                            self.tensors[table].name,
                            fmt_shape(tshape)
                        ),
                    ));
                }
                let mut want = self.shape(ids).to_vec();
                want.push(tshape[1]);
                self.expect_shape(outf(0), outputs[0], &want, "the embedding lookup")?;
                OpKind::Embedding
            }
            OpKindSpec::Matmul => {
                self.arity(i, op, io, (2, 3), (1, 1), "a, b and an optional bias")?;
                let einsum = match &op.einsum {
                    Some(e) => e,
                    None => {
                        return Err(self.err(
                            Self::op_field(i, "einsum"),
                            "required for `matmul` ops, e.g. `bsh,hf->bsf`",
                        ))
                    }
                };
                let want =
                    einsum_output_shape(einsum, self.shape(inputs[0]), self.shape(inputs[1]))
                        .map_err(|e| {
                            let detail = match e {
                                IrError::Shape { message, .. } => message,
                                other => other.to_string(),
                            };
                            self.err(
                                Self::op_field(i, "einsum"),
                                format!(
                                    "`{einsum}` does not fit inputs `{}` {} and `{}` {}: {detail}",
                                    self.tensors[inputs[0]].name,
                                    fmt_shape(self.shape(inputs[0])),
                                    self.tensors[inputs[1]].name,
                                    fmt_shape(self.shape(inputs[1]))
                                ),
                            )
                        })?;
                self.expect_shape(outf(0), outputs[0], &want, &format!("einsum `{einsum}`"))?;
                if let Some(&bias) = inputs.get(2) {
                    let b = self.shape(bias);
                    if b.is_empty() || !want.ends_with(b) {
                        return Err(self.err(
                            inf(2),
                            format!(
                                "bias `{}` {} must match the trailing dims of the output {}",
                                self.tensors[bias].name,
                                fmt_shape(b),
                                fmt_shape(&want)
                            ),
                        ));
                    }
                }
                OpKind::Matmul {
                    einsum: einsum.clone(),
                }
            }
            OpKindSpec::Layernorm | OpKindSpec::Rmsnorm => {
                self.arity(i, op, io, (1, 3), (1, 1), "x and optional scale and shift")?;
                let x = self.shape(inputs[0]);
                let Some(&last) = x.last() else {
                    return Err(self.err(
                        inf(0),
                        format!(
                            "cannot normalise the scalar `{}`",
                            self.tensors[inputs[0]].name
                        ),
                    ));
                };
                for (j, &w) in inputs.iter().enumerate().skip(1) {
                    self.expect_shape(inf(j), w, &[last], "the normalised dim")?;
                }
                self.expect_shape(outf(0), outputs[0], x, "the input")?;
                OpKind::Norm(if op.kind == OpKindSpec::Layernorm {
                    NormKind::Layernorm
                } else {
                    NormKind::Rmsnorm
                })
            }
            OpKindSpec::Rope => {
                self.arity(
                    i,
                    op,
                    io,
                    (1, usize::MAX),
                    (1, usize::MAX),
                    "one output per input",
                )?;
                if inputs.len() != outputs.len() {
                    return Err(self.err(
                        Self::op_field(i, "outputs"),
                        format!(
                            "a `rope` op has one output per input: {} inputs, {} outputs",
                            inputs.len(),
                            outputs.len()
                        ),
                    ));
                }
                for (j, (&x, &y)) in inputs.iter().zip(outputs).enumerate() {
                    self.expect_shape(outf(j), y, self.shape(x), &format!("input {j}"))?;
                }
                OpKind::Rope
            }
            OpKindSpec::Gelu => {
                self.arity(i, op, io, (1, 1), (1, 1), "elementwise")?;
                self.expect_shape(outf(0), outputs[0], self.shape(inputs[0]), "the input")?;
                OpKind::Activation(MlpKind::Gelu)
            }
            OpKindSpec::Swiglu => {
                self.arity(i, op, io, (1, 2), (1, 1), "gate and up packed, or gate, up")?;
                if inputs.len() == 2 {
                    self.expect_shape(inf(1), inputs[1], self.shape(inputs[0]), "the gate input")?;
                    self.expect_shape(
                        outf(0),
                        outputs[0],
                        self.shape(inputs[0]),
                        "the gate input",
                    )?;
                } else {
                    let w = self.last_fixed(inf(0), inputs[0], "gate and up packed")?;
                    if w % 2 != 0 {
                        return Err(self.err(
                            inf(0),
                            format!(
                                "the last dim of `{}` packs gate and up, so must be even, got {w}",
                                self.tensors[inputs[0]].name
                            ),
                        ));
                    }
                    let mut want = self.shape(inputs[0]).to_vec();
                    if let Some(l) = want.last_mut() {
                        *l = Dim::Fixed(w / 2);
                    }
                    self.expect_shape(outf(0), outputs[0], &want, "halving the packed input")?;
                }
                OpKind::Activation(MlpKind::Swiglu)
            }
            OpKindSpec::Attention => {
                self.arity(
                    i,
                    op,
                    io,
                    (1, 3),
                    (1, 1),
                    "qkv packed, or q, kv, or q, k, v",
                )?;
                let heads = self.positive(i, "heads", op.heads, kind)?;
                let qk_dim = self.positive(i, "qk_dim", op.qk_dim, kind)?;
                let kv_heads =
                    self.positive(i, "kv_heads", Some(op.kv_heads.unwrap_or(heads)), kind)?;
                let v_dim = self.positive(i, "v_dim", Some(op.v_dim.unwrap_or(qk_dim)), kind)?;
                if heads % kv_heads != 0 {
                    return Err(self.err(
                        Self::op_field(i, "kv_heads"),
                        format!("heads({heads}) % kv_heads({kv_heads}) != 0: kv_heads must divide heads"),
                    ));
                }
                let q_width = self.mul(i, "heads", &[heads, qk_dim])?;
                let k_width = self.mul(i, "kv_heads", &[kv_heads, qk_dim])?;
                let v_width = self.mul(i, "kv_heads", &[kv_heads, v_dim])?;
                match inputs.len() {
                    1 => {
                        let packed = q_width
                            .checked_add(k_width)
                            .and_then(|s| s.checked_add(v_width))
                            .ok_or_else(|| {
                                self.err(Self::op_field(i, "heads"), "sizes overflow 64 bits")
                            })?;
                        self.expect_width(inf(0), inputs[0], packed, "packed q, k, v")?;
                    }
                    2 => self.expect_width(inf(0), inputs[0], q_width, "q (heads * qk_dim)")?,
                    _ => {
                        self.expect_width(inf(0), inputs[0], q_width, "q (heads * qk_dim)")?;
                        self.expect_width(inf(1), inputs[1], k_width, "k (kv_heads * qk_dim)")?;
                        self.expect_width(inf(2), inputs[2], v_width, "v (kv_heads * v_dim)")?;
                    }
                }
                let out_width = self.mul(i, "v_dim", &[heads, v_dim])?;
                self.expect_width(
                    outf(0),
                    outputs[0],
                    out_width,
                    "the attention output (heads * v_dim)",
                )?;
                if symbolic(self.shape(outputs[0])) != symbolic(self.shape(inputs[0])) {
                    return Err(self.err(
                        outf(0),
                        format!(
                            "`{}` {} must have the batch/seq/kv dims of the queries `{}` {}",
                            self.tensors[outputs[0]].name,
                            fmt_shape(self.shape(outputs[0])),
                            self.tensors[inputs[0]].name,
                            fmt_shape(self.shape(inputs[0]))
                        ),
                    ));
                }
                OpKind::Attention(AttentionShape {
                    heads,
                    kv_heads,
                    qk_dim,
                    v_dim,
                    causal: op.causal.unwrap_or(true),
                    alibi: false,
                })
            }
            OpKindSpec::Add => {
                self.arity(i, op, io, (2, usize::MAX), (1, 1), "elementwise")?;
                let first = self.shape(inputs[0]);
                for (j, &t) in inputs.iter().enumerate().skip(1) {
                    self.expect_shape(inf(j), t, first, "the first input")?;
                }
                self.expect_shape(outf(0), outputs[0], first, "the inputs")?;
                OpKind::Add
            }
            OpKindSpec::Dropout => {
                self.arity(
                    i,
                    op,
                    io,
                    (1, 1),
                    (1, 2),
                    "x in, y and an optional mask out",
                )?;
                for (j, &t) in outputs.iter().enumerate() {
                    self.expect_shape(outf(j), t, self.shape(inputs[0]), "the input")?;
                }
                OpKind::Dropout
            }
            OpKindSpec::Router => {
                self.arity(i, op, io, (1, 1), (1, usize::MAX), "router logits in")?;
                let experts = self.positive(i, "experts", op.experts, kind)?;
                let top_k = self.positive(i, "top_k", op.top_k, kind)?;
                self.check_top_k(i, top_k, experts)?;
                let w = self.last_fixed(inf(0), inputs[0], "one logit per expert")?;
                if w != experts {
                    return Err(self.err(
                        inf(0),
                        format!(
                            "`{}` has {w} logits per token but experts is {experts}",
                            self.tensors[inputs[0]].name
                        ),
                    ));
                }
                OpKind::Router { experts, top_k }
            }
            OpKindSpec::Experts => {
                self.arity(
                    i,
                    op,
                    io,
                    (4, 4),
                    (1, usize::MAX),
                    "x, router logits, w_up, w_down",
                )?;
                let experts = self.positive(i, "experts", op.experts, kind)?;
                let top_k = self.positive(i, "top_k", op.top_k, kind)?;
                let ffn = self.positive(i, "ffn", op.ffn, kind)?;
                self.check_top_k(i, top_k, experts)?;
                let mlp = op.mlp.unwrap_or(MlpKind::Gelu);
                let hidden = self.last_fixed(inf(0), inputs[0], "the model width")?;
                let logits = self.last_fixed(inf(1), inputs[1], "one logit per expert")?;
                if logits != experts {
                    return Err(self.err(
                        inf(1),
                        format!(
                            "`{}` has {logits} logits per token but experts is {experts}",
                            self.tensors[inputs[1]].name
                        ),
                    ));
                }
                let gate = if mlp == MlpKind::Swiglu { 2 } else { 1 };
                self.expect_kind(inf(2), inputs[2], TensorKind::Weight, "w_up")?;
                self.expect_kind(inf(3), inputs[3], TensorKind::Weight, "w_down")?;
                let up = self.mul(i, "ffn", &[experts, hidden, ffn, gate])?;
                let down = self.mul(i, "ffn", &[experts, ffn, hidden])?;
                self.expect_width(
                    inf(2),
                    inputs[2],
                    up,
                    "experts * hidden * ffn (x2 for swiglu)",
                )?;
                self.expect_width(inf(3), inputs[3], down, "experts * ffn * hidden")?;
                self.expect_shape(outf(0), outputs[0], self.shape(inputs[0]), "the input")?;
                OpKind::Experts(ExpertsShape {
                    experts,
                    top_k,
                    hidden,
                    ffn,
                    mlp,
                    capacity_factor: None,
                })
            }
            OpKindSpec::CrossEntropy => {
                self.arity(i, op, io, (2, 2), (1, 1), "logits and labels in, loss out")?;
                let vocab = self.positive(i, "vocab", op.vocab, kind)?;
                let w = self.last_fixed(inf(0), inputs[0], "the vocabulary")?;
                // Wider logits are padding (`make_vocab_size_divisible_by`): the
                // loss skips the columns past `vocab`.
                if w < vocab {
                    return Err(self.err(
                        inf(0),
                        format!(
                            "`{}` has {w} logits per token but vocab is {vocab}: the logits need a column for every token",
                            self.tensors[inputs[0]].name
                        ),
                    ));
                }
                self.expect_kind(inf(1), inputs[1], TensorKind::Index, "labels")?;
                let logits = self.shape(inputs[0]);
                self.expect_shape(
                    inf(1),
                    inputs[1],
                    &logits[..logits.len() - 1],
                    "the logits without the vocabulary",
                )?;
                OpKind::CrossEntropy { vocab }
            }
        })
    }

    fn check_top_k(&self, i: usize, top_k: u64, experts: u64) -> Result<(), IrError> {
        if top_k > experts {
            return Err(self.err(
                Self::op_field(i, "top_k"),
                format!("top_k({top_k}) > experts({experts}): top_k must be at most experts"),
            ));
        }
        Ok(())
    }

    fn default_saves(&self, op: &OpSpec, io: &OpIo) -> Vec<usize> {
        match op.kind {
            OpKindSpec::Add | OpKindSpec::Rope => Vec::new(),
            OpKindSpec::Dropout => io.1.iter().skip(1).copied().collect(),
            _ => {
                io.0.iter()
                    .copied()
                    .filter(|&t| self.tensors[t].kind == TensorKind::Activation)
                    .collect()
            }
        }
    }

    fn run(mut self) -> Result<Checked, IrError> {
        size_ok(self.g.repeat).map_err(|m| self.err("graph.repeat", m))?;
        self.check_dims()?;
        self.check_tensors()?;
        let io = self.check_references()?;
        self.check_order(&io)?;
        let mut ops = Vec::with_capacity(io.len());
        for (i, (op, io)) in self.g.ops.iter().zip(&io).enumerate() {
            let kind = self.check_op(i, op, io)?;
            let saves = match &op.saves {
                Some(s) => s
                    .iter()
                    .filter_map(|n| self.ids.get(n.as_str()).copied())
                    .collect(),
                None => self.default_saves(op, io),
            };
            let id = |t: &usize| TensorId(*t as u32);
            ops.push(Op {
                name: op.name.clone(),
                kind,
                inputs: io.0.iter().map(id).collect(),
                outputs: io.1.iter().map(id).collect(),
                saves: saves.iter().map(id).collect(),
                role: op.role.unwrap_or(TpRole::Replicated),
            });
        }
        Ok(Checked {
            tensors: self.tensors,
            ops,
        })
    }
}

impl GraphSpec {
    fn check(&self, file: &str, dtype: DType) -> Result<Checked, IrError> {
        if u32::try_from(self.tensors.len()).is_err() {
            return Err(IrError::invalid(file, "graph.tensors", "too many tensors"));
        }
        Checker {
            g: self,
            file,
            dtype,
            dims: BTreeMap::new(),
            ids: BTreeMap::new(),
            tensors: Vec::with_capacity(self.tensors.len()),
            fixed: Vec::with_capacity(self.tensors.len()),
            producer: Vec::with_capacity(self.tensors.len()),
        }
        .run()
    }

    /// Checks the graph: dims and tensors exist and are positive, each tensor has at
    /// most one producer, the ops form a DAG listed in execution order, and every op's
    /// operands fit its kind (einsum against shapes, elementwise shapes, widths).
    /// Errors are [`IrError::Invalid`] naming the field, e.g. `graph.ops[2].inputs[1]`.
    pub fn validate(&self, file: &str) -> Result<(), IrError> {
        // The dtype only fills defaults; it cannot make a graph invalid.
        self.check(file, DType::Bf16).map(|_| ())
    }

    /// Converts to a [`Graph`]: the declared tensors (ids in declaration order) and one
    /// [`SegmentKind::Block`] segment holding the ops, repeated `repeat` times.
    /// Tensors without a `dtype` get `dtype` (index tensors `i32`, masks `u8`).
    /// Errors name `name` in place of the file.
    pub fn to_graph(&self, name: &str, dtype: DType) -> Result<Graph, IrError> {
        let checked = self.check(name, dtype)?;
        Ok(Graph {
            name: name.to_string(),
            tensors: checked.tensors,
            segments: vec![Segment {
                name: "block".to_string(),
                kind: SegmentKind::Block,
                repeat: self.repeat,
                ops: checked.ops,
            }],
            constants: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::DimEnv;
    use crate::load::{load_model, parse_model_yaml, WorkloadOverrides};
    use crate::spec::{Architecture, Workload};

    const MLP: &str = r#"
name: mlp
dtype: bf16
graph:
  repeat: 1
  dims: {hidden: 64, ffn: 256}
  tensors:
    x:  {shape: [batch, seq, hidden]}
    w1: {shape: [hidden, ffn], kind: weight, split: sharded}
    h:  {shape: [batch, seq, ffn], split: sharded}
    g:  {shape: [batch, seq, ffn], split: sharded}
    w2: {shape: [ffn, hidden], kind: weight, split: sharded}
    y:  {shape: [batch, seq, hidden]}
  ops:
    - {name: up, kind: matmul, einsum: "bsh,hf->bsf", inputs: [x, w1], outputs: [h], role: column_parallel}
    - {name: act, kind: gelu, inputs: [h], outputs: [g], role: local}
    - {name: down, kind: matmul, einsum: "bsf,fh->bsh", inputs: [g, w2], outputs: [y], role: row_parallel}
workload: {kind: train, seq_len: 128, global_batch: 8}
"#;

    fn graph_of(text: &str) -> Graph {
        let spec = match parse_model_yaml(text, "m.yaml") {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        };
        match &spec.arch {
            Architecture::Graph(g) => match g.to_graph(&spec.name, spec.dtype) {
                Ok(graph) => graph,
                Err(e) => panic!("{e}"),
            },
            Architecture::Transformer(_) => panic!("not a graph"),
        }
    }

    /// The error of `text` after replacing `from` by `to`.
    fn error_after(from: &str, to: &str) -> String {
        assert!(MLP.contains(from), "{from}");
        let text = MLP.replacen(from, to, 1);
        match parse_model_yaml(&text, "m.yaml") {
            Ok(_) => panic!("accepted:\n{text}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn mlp_flops_and_params() {
        let g = graph_of(MLP);
        let (h, f) = (64.0, 256.0);
        let env = DimEnv {
            batch: 2.0,
            seq: 128.0,
            kv: 128.0,
        };
        assert_eq!(
            g.forward_flops(&env),
            2.0 * env.batch * env.seq * (h * f + f * h)
        );
        assert_eq!(g.param_count(false), h * f + f * h);
        assert_eq!(g.segments.len(), 1);
        assert_eq!(g.segments[0].kind, SegmentKind::Block);
        assert_eq!(g.segments[0].repeat, 1);
        // `repeat` multiplies both.
        let g3 = graph_of(&MLP.replace("repeat: 1", "repeat: 3"));
        assert_eq!(g3.segments[0].repeat, 3);
        assert_eq!(
            g3.forward_flops(&env),
            3.0 * 2.0 * env.batch * env.seq * (h * f + f * h)
        );
        assert_eq!(g3.param_count(false), 3.0 * (h * f + f * h));
        // Declaration order gives the ids.
        let names: Vec<&str> = g.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["x", "w1", "h", "g", "w2", "y"]);
        let up = &g.segments[0].ops[0];
        assert_eq!(up.inputs, [TensorId(0), TensorId(1)]);
        assert_eq!(up.saves, [TensorId(0)]);
        assert_eq!(up.role, TpRole::ColumnParallel);
        assert_eq!(g.tensors[1].shape, [Dim::Fixed(64), Dim::Fixed(256)]);
        assert_eq!(g.tensors[1].split, TpSplit::Sharded);
        assert_eq!(g.tensors[0].dtype, DType::Bf16);
    }

    #[test]
    fn model_dtype_is_the_default() {
        let g = graph_of(&MLP.replace("dtype: bf16", "dtype: f32"));
        assert!(g.tensors.iter().all(|t| t.dtype == DType::F32));
    }

    #[test]
    fn serde_round_trip() {
        let spec = match parse_model_yaml(MLP, "m.yaml") {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        };
        let Architecture::Graph(g) = &spec.arch else {
            panic!()
        };
        let yaml = serde_yaml_ng::to_string(g).unwrap();
        let back: GraphSpec = serde_yaml_ng::from_str(&yaml).unwrap();
        assert_eq!(&back, g);
        let json = serde_json::to_string(&spec).unwrap();
        assert!(
            json.find("\"x\"").unwrap() < json.find("\"w1\"").unwrap(),
            "{json}"
        );
        let back: crate::spec::ModelSpec = serde_json::from_str(&json).unwrap();
        assert_eq!(back, spec);
    }

    #[test]
    fn example_file_loads() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../models/examples/mlp-graph.yaml");
        let spec = match load_model(&path, &WorkloadOverrides::default()) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        };
        assert!(matches!(spec.workload, Some(Workload::Train { .. })));
        let graph = match crate::load::model_graph(&spec) {
            Ok(g) => g,
            Err(e) => panic!("{e}"),
        };
        // Four blocks of layernorm + MLP (hidden 1024, ffn 4096) with biases.
        let (h, f) = (1024.0, 4096.0);
        assert_eq!(
            graph.param_count(false),
            4.0 * (h * f + f + f * h + h + 2.0 * h)
        );
        let env = DimEnv {
            batch: 1.0,
            seq: 1.0,
            kv: 1.0,
        };
        assert_eq!(graph.forward_flops(&env), 4.0 * 2.0 * (h * f + f * h));
    }

    #[test]
    fn unknown_tensor() {
        let e = error_after("inputs: [g, w2]", "inputs: [g, w3]");
        assert!(e.contains("graph.ops[2].inputs[1]"), "{e}");
        assert!(e.contains("unknown tensor `w3`"), "{e}");
        assert!(e.starts_with("m.yaml: "), "{e}");
    }

    #[test]
    fn unknown_dim() {
        let e = error_after("w2: {shape: [ffn, hidden]", "w2: {shape: [ffn, hiden]");
        assert!(e.contains("graph.tensors.w2.shape[1]"), "{e}");
        assert!(e.contains("unknown dim `hiden`"), "{e}");
    }

    #[test]
    fn zero_dim() {
        let e = error_after("w1: {shape: [hidden, ffn]", "w1: {shape: [0, ffn]");
        assert!(e.contains("graph.tensors.w1.shape[0]"), "{e}");
        let e = error_after("ffn: 256", "ffn: 0");
        assert!(e.contains("graph.dims.ffn"), "{e}");
        let e = error_after("repeat: 1", "repeat: 0");
        assert!(e.contains("graph.repeat"), "{e}");
    }

    #[test]
    fn reserved_dim() {
        let e = error_after("dims: {hidden: 64", "dims: {seq: 7, hidden: 64");
        assert!(e.contains("graph.dims.seq"), "{e}");
        assert!(e.contains("reserved"), "{e}");
    }

    #[test]
    fn cycle() {
        // up consumes y, which down produces from up's output: up -> act -> down -> up.
        let e = error_after("inputs: [x, w1]", "inputs: [y, w1]");
        assert!(e.contains("field `graph.ops`"), "{e}");
        assert!(e.contains("cycle: `up` (graph.ops[0]) -> `act` (graph.ops[1]) -> `down` (graph.ops[2]) -> `up`"), "{e}");
        // An op consuming its own output.
        let e = error_after("inputs: [h], outputs: [g]", "inputs: [g], outputs: [g]");
        assert!(e.contains("cycle: `act` (graph.ops[1]) -> `act`"), "{e}");
    }

    #[test]
    fn out_of_order() {
        let text = MLP.replace(
            "    - {name: up, kind: matmul, einsum: \"bsh,hf->bsf\", inputs: [x, w1], outputs: [h], role: column_parallel}\n",
            "",
        );
        let text = text.replace(
            "role: row_parallel}\n",
            "role: row_parallel}\n    - {name: up, kind: matmul, einsum: \"bsh,hf->bsf\", inputs: [x, w1], outputs: [h]}\n",
        );
        let e = parse_model_yaml(&text, "m.yaml").unwrap_err().to_string();
        assert!(e.contains("graph.ops[0].inputs[0]"), "{e}");
        assert!(
            e.contains("produced later by op `up` (graph.ops[2])"),
            "{e}"
        );
    }

    #[test]
    fn einsum_mismatch() {
        // Contracting over the wrong operand dim.
        let e = error_after("einsum: \"bsf,fh->bsh\"", "einsum: \"bsf,hf->bsh\"");
        assert!(e.contains("graph.ops[2].einsum"), "{e}");
        // A consistent einsum whose result disagrees with the declared output.
        let e = error_after("einsum: \"bsf,fh->bsh\"", "einsum: \"bsf,fh->bhs\"");
        assert!(e.contains("graph.ops[2].outputs[0]"), "{e}");
        assert!(e.contains("[batch, 64, seq]"), "{e}");
        // Rank mismatch.
        let e = error_after("einsum: \"bsh,hf->bsf\"", "einsum: \"sh,hf->sf\"");
        assert!(e.contains("graph.ops[0].einsum"), "{e}");
        // Missing.
        let e = error_after("einsum: \"bsh,hf->bsf\", ", "");
        assert!(e.contains("graph.ops[0].einsum"), "{e}");
        assert!(e.contains("required"), "{e}");
    }

    #[test]
    fn elementwise_shape_mismatch() {
        let e = error_after(
            "g:  {shape: [batch, seq, ffn]",
            "g:  {shape: [batch, seq, hidden]",
        );
        // gelu's output no longer matches its input.
        assert!(e.contains("graph.ops[1].outputs[0]"), "{e}");
    }

    #[test]
    fn duplicate_producer() {
        let e = error_after("outputs: [g]", "outputs: [h]");
        assert!(e.contains("graph.ops[1].outputs[0]"), "{e}");
        assert!(e.contains("already produced by op `up`"), "{e}");
    }

    #[test]
    fn weight_cannot_be_produced() {
        let e = error_after("outputs: [g]", "outputs: [w2]");
        assert!(e.contains("graph.ops[1].outputs[0]"), "{e}");
    }

    #[test]
    fn duplicate_op_name_and_tensor() {
        let e = error_after("name: act", "name: up");
        assert!(e.contains("graph.ops[1].name"), "{e}");
        let e = error_after("    y:  {shape", "    x:  {shape");
        assert!(e.contains("duplicate entry `x`"), "{e}");
    }

    #[test]
    fn field_of_the_wrong_kind() {
        let e = error_after("kind: gelu,", "kind: gelu, heads: 4,");
        assert!(e.contains("graph.ops[1].heads"), "{e}");
    }

    #[test]
    fn unknown_field_is_a_parse_error() {
        let e = error_after("split: sharded}", "split: sharded, shard: 1}");
        assert!(e.starts_with("m.yaml:"), "{e}");
        assert!(e.contains("shard"), "{e}");
    }

    #[test]
    fn negative_size_is_a_parse_error() {
        let e = error_after("w1: {shape: [hidden, ffn]", "w1: {shape: [-4, ffn]");
        assert!(e.starts_with("m.yaml:"), "{e}");
        assert!(e.contains("-4"), "{e}");
    }

    const FULL: &str = r#"
name: tiny-lm
graph:
  dims: {hidden: 32, vocab: 100, ffn: 64, experts: 4, qkv: 96}
  tensors:
    tokens: {shape: [batch, seq], kind: index}
    labels: {shape: [batch, seq], kind: index}
    wte:    {shape: [vocab, hidden], kind: weight, split: sharded}
    x:      {shape: [batch, seq, hidden]}
    ln_w:   {shape: [hidden], kind: weight}
    ln_b:   {shape: [hidden], kind: weight}
    n:      {shape: [batch, seq, hidden]}
    wqkv:   {shape: [hidden, qkv], kind: weight}
    qkv:    {shape: [batch, seq, qkv]}
    qkv_r:  {shape: [batch, seq, qkv]}
    att:    {shape: [batch, seq, hidden]}
    d:      {shape: [batch, seq, hidden]}
    mask:   {shape: [batch, seq, hidden], kind: mask}
    r:      {shape: [batch, seq, hidden]}
    wr:     {shape: [hidden, experts], kind: weight}
    logits_r: {shape: [batch, seq, experts]}
    w_up:   {shape: [experts, hidden, 128], kind: weight, split: experts}
    w_down: {shape: [experts, ffn, hidden], kind: weight, split: experts}
    e:      {shape: [batch, seq, hidden]}
    u:      {shape: [batch, seq, qkv]}
    s:      {shape: [batch, seq, 48]}
    head:   {shape: [hidden, vocab], kind: weight}
    logits: {shape: [batch, seq, vocab], dtype: f32}
    loss:   {shape: [], dtype: f32}
    spare:  {shape: [batch, seq, hidden]}
  ops:
    - {name: embed, kind: embedding, inputs: [tokens, wte], outputs: [x], role: vocab_embedding}
    - {name: ln, kind: layernorm, inputs: [x, ln_w, ln_b], outputs: [n]}
    - {name: qkv, kind: matmul, einsum: "bsh,hq->bsq", inputs: [n, wqkv], outputs: [qkv]}
    - {name: rope, kind: rope, inputs: [qkv], outputs: [qkv_r]}
    - {name: attn, kind: attention, heads: 4, kv_heads: 4, qk_dim: 8, inputs: [qkv_r], outputs: [att], role: local}
    - {name: drop, kind: dropout, inputs: [att], outputs: [d, mask]}
    - {name: res, kind: add, inputs: [x, d], outputs: [r]}
    - {name: router, kind: matmul, einsum: "bsh,he->bse", inputs: [r, wr], outputs: [logits_r]}
    - {name: moe, kind: experts, experts: 4, top_k: 2, ffn: 64, mlp: swiglu, inputs: [r, logits_r, w_up, w_down], outputs: [e], role: experts}
    - {name: up, kind: matmul, einsum: "bsh,hu->bsu", inputs: [e, wqkv], outputs: [u]}
    - {name: act, kind: swiglu, inputs: [u], outputs: [s]}
    - {name: lm, kind: matmul, einsum: "bsh,hv->bsv", inputs: [e, head], outputs: [logits], role: vocab_head}
    - {name: loss, kind: cross_entropy, vocab: 100, inputs: [logits, labels], outputs: [loss], role: vocab_loss}
"#;

    #[test]
    fn every_kind() {
        let g = graph_of(FULL);
        let ops = &g.segments[0].ops;
        assert_eq!(ops.len(), 13);
        assert_eq!(ops[5].saves, [TensorId(12)], "dropout keeps its mask");
        assert!(ops[6].saves.is_empty(), "add keeps nothing");
        assert!(ops[3].saves.is_empty(), "rope keeps nothing");
        assert_eq!(ops[1].saves, [TensorId(3)]);
        assert_eq!(g.tensors[0].dtype, DType::I32);
        assert_eq!(g.tensors[12].dtype, DType::U8);
        assert_eq!(g.tensors[23].shape, []);
        assert!(
            matches!(ops[4].kind, OpKind::Attention(a) if a.heads == 4 && a.v_dim == 8 && a.causal)
        );
        assert!(matches!(ops[8].kind, OpKind::Experts(e) if e.hidden == 32 && e.ffn == 64));
        // Embedding table counted once; all weights are op inputs.
        let (wte, ln, wqkv, wr, w_up, w_down, head) = (
            100.0 * 32.0,
            2.0 * 32.0,
            32.0 * 96.0,
            32.0 * 4.0,
            4.0 * 32.0 * 128.0,
            4.0 * 64.0 * 32.0,
            32.0 * 100.0,
        );
        // wqkv feeds two ops and counts once.
        let params = wte + ln + wqkv + wr + w_up + w_down + head;
        assert_eq!(g.param_count(false), params);
        let env = DimEnv {
            batch: 1.0,
            seq: 16.0,
            kv: 16.0,
        };
        let tokens = 16.0;
        let flops = tokens * 2.0 * 32.0 * 96.0
            + tokens * 16.0 * 2.0 * 4.0 * 16.0
            + tokens * 2.0 * 32.0 * 4.0
            + tokens * 2.0 * 2.0 * 32.0 * 64.0 * 3.0
            + tokens * 2.0 * 32.0 * 96.0
            + tokens * 2.0 * 32.0 * 100.0;
        assert_eq!(g.forward_flops(&env), flops);
    }

    #[test]
    fn kind_checks() {
        let bad = |from: &str, to: &str, field: &str| {
            assert!(FULL.contains(from), "{from}");
            let text = FULL.replacen(from, to, 1);
            let e = match parse_model_yaml(&text, "m.yaml") {
                Ok(_) => panic!("accepted {to}"),
                Err(e) => e.to_string(),
            };
            assert!(e.contains(field), "{to}: {e}");
        };
        bad(
            "heads: 4, kv_heads: 4",
            "heads: 4, kv_heads: 3",
            "graph.ops[4].kv_heads",
        );
        bad(
            "heads: 4, kv_heads: 4",
            "heads: 4, kv_heads: 2",
            "graph.ops[4].inputs[0]",
        );
        bad(
            "heads: 4, kv_heads: 4, qk_dim: 8",
            "kv_heads: 4, qk_dim: 8",
            "graph.ops[4].heads",
        );
        bad(
            "vocab: 100, inputs",
            "vocab: 101, inputs",
            "graph.ops[12].inputs[0]",
        );
        bad("vocab: 100, inputs", "inputs", "graph.ops[12].vocab");
        bad("top_k: 2, ffn", "top_k: 5, ffn", "graph.ops[8].top_k");
        bad(
            "inputs: [tokens, wte]",
            "inputs: [ln_w, wte]",
            "graph.ops[0].inputs[0]",
        );
        bad(
            "inputs: [x, ln_w, ln_b]",
            "inputs: [x, ln_w, wte]",
            "graph.ops[1].inputs[2]",
        );
        bad(
            "inputs: [x, d]",
            "inputs: [x, qkv]",
            "graph.ops[6].inputs[1]",
        );
        bad(
            "outputs: [d, mask]",
            "outputs: [d, mask, spare]",
            "graph.ops[5].outputs",
        );
        bad(
            "kind: dropout,",
            "kind: dropout, saves: [x],",
            "graph.ops[5].saves[0]",
        );
        bad(
            "inputs: [logits, labels]",
            "inputs: [logits, tokens, labels]",
            "graph.ops[12].inputs",
        );
        // `up` reuses wqkv [32, 96]: a 128-wide output does not fit the einsum.
        bad(
            "u:      {shape: [batch, seq, qkv]}",
            "u:      {shape: [batch, seq, 128]}",
            "graph.ops[9].outputs[0]",
        );
        bad(
            "s:      {shape: [batch, seq, 48]}",
            "s:      {shape: [batch, seq, 96]}",
            "graph.ops[10].outputs[0]",
        );
        bad(
            "inputs: [r, logits_r, w_up, w_down]",
            "inputs: [r, logits_r, w_down, w_up]",
            "graph.ops[8].inputs[2]",
        );
        bad(
            "kind: rope, inputs: [qkv]",
            "kind: rope, inputs: [qkv, x]",
            "graph.ops[3].outputs",
        );
    }

    #[test]
    fn big_sizes_do_not_overflow() {
        let e = error_after(
            "dims: {hidden: 64, ffn: 256}",
            "dims: {hidden: 18446744073709551615, ffn: 256}",
        );
        assert!(e.contains("graph.dims.hidden"), "{e}");
        assert!(e.contains("larger than the supported maximum"), "{e}");
        // Each size allowed, their product not.
        let e = error_after(
            "w1: {shape: [hidden, ffn]",
            "w1: {shape: [16777216, 16777216, 16777216]",
        );
        assert!(e.contains("graph.tensors.w1.shape[2]"), "{e}");
        assert!(e.contains("overflows"), "{e}");
        let e = error_after(
            "kind: gelu,",
            "kind: attention, heads: 99999999999, qk_dim: 8,",
        );
        assert!(e.contains("graph.ops[1].heads"), "{e}");
    }
}
