//! The operands of the [`Device`] kernels that take more than a few, in structs
//! generic over the device's buffers, so that each kernel's signature is one line
//! in the trait and in each implementation.

use super::Device;
use meshplan_ir::NormKind;
use meshplan_kernels::cpu::{AttnDims, AttnDropout, MoeDims, Rope};

/// A norm over `rows` rows of `dim`: its kind, input, weight, LayerNorm's bias
/// (zeros for a bias-free one) and epsilon.
pub struct Norm<'a, D: Device + ?Sized> {
    pub kind: NormKind,
    pub x: &'a D::Act,
    pub w: &'a D::Act,
    pub b: Option<&'a D::Act>,
    pub rows: usize,
    pub dim: usize,
    pub eps: f32,
}

/// A norm's forward outputs: `y`, LayerNorm's row means, the rows' reciprocal
/// deviations.
pub struct NormOut<'a, D: Device + ?Sized> {
    pub y: &'a mut D::Act,
    pub mean: Option<&'a mut D::F32>,
    pub rstd: &'a mut D::F32,
}

/// A norm's backward: the forward's statistics and the output's gradient, and
/// the gradients it adds into (LayerNorm's bias gradient too).
pub struct NormBwd<'a, D: Device + ?Sized> {
    pub mean: Option<&'a D::F32>,
    pub rstd: &'a D::F32,
    pub dy: &'a D::Act,
    pub dx: &'a mut D::Act,
    pub dw: &'a mut D::F32,
    pub db: Option<&'a mut D::F32>,
}

/// Cross-entropy's operands: `logits [rows, v_local]`, this shard of the
/// vocabulary starting at column `vocab_start` (the whole of it: `v_local` the
/// vocabulary, `vocab_start` 0), the rows' labels, and the gradient's `scale`.
pub struct Ce<'a, D: Device + ?Sized> {
    pub logits: &'a D::Act,
    pub labels: &'a D::Ids,
    pub rows: usize,
    pub v_local: usize,
    pub vocab_start: usize,
    pub scale: f32,
}

/// Cross-entropy's outputs: each row's loss and the logits' gradient.
pub struct CeOut<'a, D: Device + ?Sized> {
    pub loss: &'a mut D::F32,
    pub dlogits: &'a mut D::Act,
}

/// One AdamW step: the fp32 master, its gradient and moments, the compute copy
/// to refresh (none where the master serves), the step (from 1), the learning
/// rate and `(beta1, beta2, eps, weight decay)`.
pub struct AdamW<'a, D: Device + ?Sized> {
    pub param: &'a mut D::F32,
    pub grad: &'a D::F32,
    pub m: &'a mut D::F32,
    pub v: &'a mut D::F32,
    pub compute: Option<&'a mut D::Act>,
    pub step: u64,
    pub lr: f32,
    pub hyper: (f32, f32, f32, f32),
}

/// RoPE over fused QKV rows `x [rows, width]` at `positions`: `shape` is (query
/// heads, key/value heads, head dim, row width); `backward` rotates a gradient
/// back.
pub struct RopeQkv<'a, D: Device + ?Sized> {
    pub x: &'a D::Act,
    pub positions: &'a D::Ids,
    pub rows: usize,
    pub shape: (usize, usize, usize, usize),
    pub rope: Rope,
    pub backward: bool,
}

/// One attention call: its sizes, its operands `[b, s, h, d]` (queries, keys and
/// values), and how it masks and scales its scores: the first query and key
/// positions of the blocks (ring attention, a KV cache), causal or not, `1 /
/// sqrt(d)`, and the probabilities' dropout.
pub struct Attn<'a, D: Device + ?Sized> {
    pub dims: &'a AttnDims,
    pub q: &'a D::Act,
    pub k: &'a D::Act,
    pub v: &'a D::Act,
    pub pos0: (usize, usize),
    pub causal: bool,
    pub scale: f32,
    pub dropout: Option<&'a AttnDropout>,
}

/// Attention's forward outputs: `o` `[b, s, hq, dv]` and the rows' log-sum-exps.
pub struct AttnOut<'a, D: Device + ?Sized> {
    pub o: &'a mut D::Act,
    pub lse: &'a mut D::F32,
}

/// Attention's backward: the forward's output and log-sum-exps and the output's
/// gradient, and the gradients it adds into.
pub struct AttnBwd<'a, D: Device + ?Sized> {
    pub o: &'a D::Act,
    pub lse: &'a D::F32,
    pub d_o: &'a D::Act,
    pub d_q: &'a mut D::Act,
    pub d_k: &'a mut D::Act,
    pub d_v: &'a mut D::Act,
}

/// Ring attention's merge of one key/value block's output and log-sum-exps into
/// the running ones.
pub struct Merge<'a, D: Device + ?Sized> {
    pub o_acc: &'a mut D::Act,
    pub lse_acc: &'a mut D::F32,
    pub o_blk: &'a D::Act,
    pub lse_blk: &'a D::F32,
}

/// An embedding lookup: the token ids, the first vocabulary row the table holds
/// (a vocabulary-parallel shard's), and the row width.
pub struct Embed<'a, D: Device + ?Sized> {
    pub ids: &'a D::Ids,
    pub vocab_start: usize,
    pub dim: usize,
}

/// A routing of tokens to experts on the device: its sizes, the softmax over every
/// expert `probs [tokens, experts]`, each token's `k` experts `idx` and their
/// weights `wts` (written by `moe_route`), and each dispatch slot's assignment
/// `perm` (`t k + j`) and each expert's count, on the host (written by
/// `moe_dispatch`).
pub struct Routed<D: Device + ?Sized> {
    pub m: MoeDims,
    pub probs: D::F32,
    pub idx: D::Ids,
    pub wts: D::F32,
    pub perm: D::Ids,
    pub counts: Vec<usize>,
}

/// The combine's backward: the output's gradient and the experts' outputs (slot
/// order), and the gradients it adds into.
pub struct CombineBwd<'a, D: Device + ?Sized> {
    pub dy: &'a D::Act,
    pub y: &'a D::Act,
    pub d_y: &'a mut D::Act,
    pub d_wts: &'a mut D::F32,
}
