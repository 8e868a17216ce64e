//! Device-resident execution: the [`Device`] trait is a backend whose buffers live
//! where its kernels run (GPU memory for `cuda::CudaDevice` with the `cuda` feature,
//! host vectors for [`HostDevice`]), and [`train`] is the training interpreter over
//! it, which never moves an activation, weight or gradient to the host during a
//! step: a step uploads its batch's tokens and labels and reads back each token's
//! loss (in one read back a rank) and one finiteness flag (routed experts add
//! their counts and the indices made from them); [`Crossing`] names each, and a
//! test holds every mode to that list on the host device. It runs every parallel
//! mode (data, tensor, pipeline, context, expert, ZeRO 0 to 3), in the device's
//! compute precision: bf16 activations and weight copies for the kernels on a
//! GPU, fp32 master weights, gradients and AdamW moments.
//!
//! [`HostDevice`] runs the same interpreter on the CPU reference kernels in fp32:
//! it is `run --backend cpu` and the single-rank reference of `--check`. It
//! reproduces, bit for bit, the goldens the general interpreter (deleted since)
//! recorded. The CUDA device differs from it only in the kernels, each of which is
//! tested against its CPU reference.

use crate::comm::Communicator;
pub use buffers::Buffers;
pub use comm::{CResult, DeviceComm, Kind, On};
use meshplan_ir::NormKind;
use meshplan_kernels::cpu::{
    self as k, AttnDims, AttnDropout, Capacity, GemmAt, KernelError, MoeDims, Nucleus, Picks, Rope,
    RowDropout,
};

pub mod buffers;
pub mod comm;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod emulate;
mod error;
pub(crate) mod forward;
pub(crate) mod walk;
pub use emulate::{
    check_mixed_precision, Crossing, HostDevice, HostPrecision, MIXED_LOSS_TOLERANCE,
    MIXED_UPDATE_TOLERANCE,
};
pub(crate) use error::{derr, layernorm_parts, range_err};
pub use error::{DResult, DeviceError};
pub mod train;

// The operands of the kernels that take more than a few, in structs generic over
// the device's buffers, so that each kernel's signature is one line in the trait
// and in each implementation.

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
    /// `q`, `k` and `v` are one buffer, the fused rows `[s, batch, hq d | hkv d |
    /// hkv dv]` (only where [`Device::READS_FUSED_QKV`]); the output and its
    /// gradient are then sequence-major too, `[s, b, hq, dv]`.
    pub fused: bool,
}

/// Attention's forward outputs: `o` `[b, s, hq, dv]` (`[s, b, hq, dv]` beside
/// [`Attn::fused`] operands) and the rows' log-sum-exps.
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
    pub grads: AttnGrads<'a, D>,
}

/// Where attention's backward adds the gradients of `q`, `k` and `v`.
pub enum AttnGrads<'a, D: Device + ?Sized> {
    /// Three buffers in the layouts of [`Attn`]'s `q`, `k` and `v` apart.
    Apart(&'a mut D::Act, &'a mut D::Act, &'a mut D::Act),
    /// One buffer of fused rows, laid out as [`Attn::fused`] operands are (only
    /// where [`Device::READS_FUSED_QKV`]).
    Fused(&'a mut D::Act),
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

/// A routing of tokens to experts on the device: its sizes and expert capacity,
/// the softmax over every expert `probs [tokens, experts]`, each token's `k`
/// experts `idx` and their weights `wts` (written by `moe_route`), each dispatch
/// slot's assignment `perm` (`t k + j`) and each expert's count, on the host
/// (written by `moe_dispatch`). Under a capacity, `moe_dispatch` also writes the
/// padding (`padded`: `pad` and `at` of `kernels::cpu::moe_capacity`) and each
/// expert's kept slots, on the host with the counts.
pub struct Routed<D: Device + ?Sized> {
    pub m: MoeDims,
    pub capacity: Option<Capacity>,
    pub probs: D::F32,
    pub idx: D::Ids,
    pub wts: D::F32,
    pub perm: D::Ids,
    pub counts: Vec<usize>,
    pub padded: Option<[D::Ids; 2]>,
    pub kept: Vec<usize>,
}

/// The combine's backward: the output's gradient and the experts' outputs (slot
/// order), and the gradients it adds into.
pub struct CombineBwd<'a, D: Device + ?Sized> {
    pub dy: &'a D::Act,
    pub y: &'a D::Act,
    pub d_y: &'a mut D::Act,
    pub d_wts: &'a mut D::F32,
}

/// A draw of tokens: the sampling, and each row's request index.
pub type Draw<'a> = (Nucleus, &'a [u32]);

/// A device: its [`Buffers`] and the kernels over them, launched in order (maybe
/// asynchronously).
///
/// Overwrite/accumulate rules follow the CPU kernels of the same name
/// (`meshplan_kernels::cpu`), except where a method says otherwise.
#[allow(clippy::too_many_arguments)] // the kernels' own argument lists
pub trait Device: Buffers {
    /// A reduction in flight ([`DeviceComm::all_reduce_start`]).
    type Reduction: Send;
    /// The communicator a rank of this device holds.
    type Comm: DeviceComm<Self> + ?Sized;

    /// A host communicator (the in-process one, or a launched process's) as this
    /// device's: where the device has a collective engine of its own, its buffers
    /// are staged through the host.
    fn host_comm(comm: Box<dyn Communicator>) -> Box<Self::Comm>;

    /// Whether [`Device::attention_fwd`] and [`Device::attention_bwd`] take
    /// [`Attn::fused`] operands: the `q | k | v` rows as the projection wrote them,
    /// read in place, so no split copies are made. The host kernels do; the CUDA
    /// ones take `q`, `k` and `v` apart.
    const READS_FUSED_QKV: bool = false;
    /// The index of the first of `xs` holding a NaN or an infinity (waits for the
    /// work before it).
    fn first_non_finite(&self, xs: &[&Self::F32]) -> DResult<Option<usize>>;
    /// Sets every element to zero.
    fn f32_zero(&self, x: &mut Self::F32) -> DResult<()>;
    /// `x *= a`, element by element.
    fn f32_scale(&self, x: &mut Self::F32, a: f32) -> DResult<()>;
    /// `acc += x`, element by element.
    fn f32_accumulate(&self, acc: &mut Self::F32, x: &Self::F32) -> DResult<()>;
    /// `acc += x`, elementwise.
    fn accumulate(&self, acc: &mut Self::Act, x: &Self::Act) -> DResult<()>;

    /// `c = op(a) op(b)` with `op(a) [m, k]`, `op(b) [k, n]`, on the spans `g`
    /// places (`c`'s span overwritten).
    fn matmul(&self, g: GemmAt, a: &Self::Act, b: &Self::Act, c: &mut Self::Act) -> DResult<()>;
    /// `op(a) op(b)` into a new `[m, n]` buffer (`g.c_off` is 0): [`Device::matmul`]
    /// into zeros, which a device may skip writing since the product overwrites them.
    fn matmul_new(&self, g: GemmAt, a: &Self::Act, b: &Self::Act) -> DResult<Self::Act> {
        let mut c = self.act_zeros(g.m * g.n)?;
        self.matmul(g, a, b, &mut c)?;
        Ok(c)
    }
    /// Runs `a` and `b`, independent kernel calls on disjoint buffers: in order,
    /// or side by side where the device splits its threads between them (the
    /// host devices; a GPU's stream orders them anyway). Results do not depend on
    /// which.
    fn side_by_side<A: Send, B: Send>(
        &self,
        a: impl FnOnce() -> A + Send,
        b: impl FnOnce() -> B + Send,
    ) -> (A, B) {
        (a(), b())
    }
    /// `c += op(a) op(b)` into an fp32 buffer (weight gradients), on the spans
    /// `g` places.
    fn matmul_acc(&self, g: GemmAt, a: &Self::Act, b: &Self::Act, c: &mut Self::F32)
        -> DResult<()>;
    /// `y[r, c] += bias[c]` over the rows of `y`, as wide as `bias`.
    fn bias_add(&self, y: &mut Self::Act, bias: &Self::Act) -> DResult<()>;
    /// `dbias[c] += sum_r dy[r, c]` over the rows of `dy`, as wide as `dbias`, in
    /// order.
    fn bias_grad(&self, dy: &Self::Act, dbias: &mut Self::F32) -> DResult<()>;

    /// Fused QKV rows `[s, b, (hq d | hkv d | hkv dv)]` into `q [b, s, hq, d]`,
    /// `k [b, s, hkv, d]`, `v [b, s, hkv, dv]` (overwritten).
    fn split_qkv(&self, x: &Self::Act, dims: &AttnDims, qkv: [&mut Self::Act; 3]) -> DResult<()>;
    /// The inverse of [`Device::split_qkv`] (`dx` overwritten).
    fn join_qkv(&self, dqkv: [&Self::Act; 3], dims: &AttnDims, dx: &mut Self::Act) -> DResult<()>;
    /// `x [p, q, w]` into `y [q, p, w]` (overwritten): `[b, s, w]` to `[s, b, w]`,
    /// or back with `[s, b, w]`.
    fn swap_axes(&self, x: &Self::Act, pqw: [usize; 3], y: &mut Self::Act) -> DResult<()>;
    /// RoPE on the query and key heads of fused QKV rows `[rows, width]` (the
    /// value columns copied), forward or, with `backward`, the inverse rotation of
    /// a gradient; `y` overwritten.
    fn rope_qkv(&self, r: &RopeQkv<'_, Self>, y: &mut Self::Act) -> DResult<()>;

    /// Causal (or full) attention over `[b, s, h, d]` operands; `out.o` and
    /// `out.lse` overwritten.
    fn attention_fwd(&self, a: &Attn<'_, Self>, out: AttnOut<'_, Self>) -> DResult<()>;
    /// Attention backward; `d_q`, `d_k`, `d_v` zeroed by the caller, accumulated.
    fn attention_bwd(&self, a: &Attn<'_, Self>, b: AttnBwd<'_, Self>) -> DResult<()>;
    /// Ring attention: merges one key/value block's `(o_blk, lse_blk)` into the
    /// running `(o_acc, lse_acc)` by their log-sum-exps.
    fn attention_merge(&self, dims: &AttnDims, m: Merge<'_, Self>) -> DResult<()>;

    /// `y[t] = w[ids[t] - vocab_start]` (overwritten), zero for an id outside the
    /// rows the table `w` holds (a vocabulary-parallel shard starting at
    /// `vocab_start`).
    fn embedding_fwd(&self, e: &Embed<'_, Self>, w: &Self::Act, y: &mut Self::Act) -> DResult<()>;
    /// `dw[ids[t] - vocab_start] += dy[t]` for the ids the table holds.
    fn embedding_bwd(&self, e: &Embed<'_, Self>, dy: &Self::Act, dw: &mut Self::F32)
        -> DResult<()>;

    /// LayerNorm or RMSNorm forward: `y`, the means (LayerNorm) and the
    /// reciprocal deviations overwritten.
    fn norm_fwd(&self, n: &Norm<'_, Self>, out: NormOut<'_, Self>) -> DResult<()>;
    /// The norm's backward: accumulates `dx`, `dw` (and LayerNorm's `db`).
    fn norm_bwd(&self, n: &Norm<'_, Self>, g: NormBwd<'_, Self>) -> DResult<()>;

    /// GELU (tanh) forward, `y` overwritten.
    fn gelu_fwd(&self, x: &Self::Act, y: &mut Self::Act) -> DResult<()>;
    /// GELU backward, accumulates `dx`.
    fn gelu_bwd(&self, x: &Self::Act, dy: &Self::Act, dx: &mut Self::Act) -> DResult<()>;
    /// SwiGLU forward over the rows `[2f]` (`[gate | up]`) of `x`, `y [rows, f]`
    /// overwritten.
    fn swiglu_fwd(&self, x: &Self::Act, f: usize, y: &mut Self::Act) -> DResult<()>;
    /// SwiGLU backward from the output's gradient `g`, accumulates `dx [rows, 2f]`.
    fn swiglu_bwd(&self, x: &Self::Act, g: &Self::Act, f: usize, dx: &mut Self::Act)
        -> DResult<()>;
    /// `out = a + b` (overwritten).
    fn add(&self, a: &Self::Act, b: &Self::Act, out: &mut Self::Act) -> DResult<()>;
    /// Dropout over the rows of width `w` of `x`: `y = x * mask`, the mask drawn
    /// from `d` (the backward applies it to the output's gradient).
    fn dropout(&self, x: &Self::Act, w: usize, d: &RowDropout, y: &mut Self::Act) -> DResult<()>;

    /// Routing of `logits [tokens, experts]`: `r.probs` (softmax over every
    /// expert), each token's `k` experts `r.idx` and their weights `r.wts`.
    fn moe_route(&self, logits: &Self::Act, r: &mut Routed<Self>) -> DResult<()>;
    /// Routing backward: the logits' gradient `dx +=` from the weights' gradient
    /// `dw`.
    fn moe_route_bwd(&self, r: &Routed<Self>, dw: &Self::F32, dx: &mut Self::Act) -> DResult<()>;
    /// Rows of `x` grouped by expert (stable): `y [tokens k, dim]`, `r.perm` (each
    /// slot's assignment `t k + j`) and each expert's count `r.counts`, on the
    /// host (the exchange's sizes); under `r.capacity`, `r.padded` and `r.kept`.
    fn moe_dispatch(&self, r: &mut Routed<Self>, x: &Self::Act, y: &mut Self::Act) -> DResult<()>;
    /// Dispatch backward: `dx +=` each slot's gradient `dy` at its token.
    fn moe_dispatch_bwd(&self, r: &Routed<Self>, dy: &Self::Act, dx: &mut Self::Act)
        -> DResult<()>;
    /// `out [tokens, dim]` = each token's expert outputs `y` (slot order) weighted
    /// by `r.wts`.
    fn moe_combine(&self, r: &Routed<Self>, y: &Self::Act, out: &mut Self::Act) -> DResult<()>;
    /// Combine backward: `g.d_y +=` and `g.d_wts +=`.
    fn moe_combine_bwd(&self, r: &Routed<Self>, g: CombineBwd<'_, Self>) -> DResult<()>;
    /// `y[r] = x[i[r]]` for rows of width `w`, zeros where `i[r]` is `NO_ROW`.
    fn gather_rows(&self, x: &Self::Act, i: &Self::Ids, w: usize, y: &mut Self::Act)
        -> DResult<()>;

    /// Cross-entropy of `c.logits` against `c.labels` (the whole vocabulary),
    /// forward and backward at once: `loss[r]` and `dlogits = scale * d loss[r] /
    /// d logits`, both overwritten.
    fn cross_entropy(&self, c: &Ce<'_, Self>, out: CeOut<'_, Self>) -> DResult<()>;

    /// Vocabulary-parallel cross-entropy, first part: each row's largest logit of
    /// this shard (`max` overwritten). The program sums the shards' maxima before
    /// [`Device::ce_sums`].
    fn ce_row_max(&self, c: &Ce<'_, Self>, max: &mut Self::F32) -> DResult<()>;
    /// Second part, with the rows' common shift `max`: this shard's sum of
    /// `exp(logit - max)` and its logit of each row's label (0 where another shard
    /// holds the label), both overwritten.
    fn ce_sums(&self, c: &Ce<'_, Self>, max: &Self::F32, out: [&mut Self::F32; 2]) -> DResult<()>;
    /// Last part, from `[max, sumexp, target]` summed over every shard: `loss[r] =
    /// max + ln(sumexp) - target` and this shard's `dlogits = scale * (softmax -
    /// onehot)`, both overwritten.
    fn ce_finish(&self, c: &Ce<'_, Self>, s: [&Self::F32; 3], out: CeOut<'_, Self>) -> DResult<()>;

    /// `x` in fp32 (exact) in a new buffer: logits before their gather and pick.
    fn act_to_f32(&self, x: &Self::Act) -> DResult<Self::F32>;
    /// The token of each row of logits gathered `[parts, rows, cols]`: greedy
    /// (`kernels::cpu::argmax_parts`), or drawn for each row's request with a
    /// temperature and nucleus (`kernels::cpu::sample_parts`; the request indices go
    /// up). Only the tokens leave the device.
    fn pick(&self, x: &Self::F32, d: Picks, draw: Option<Draw<'_>>) -> DResult<Vec<u32>>;

    /// One AdamW step of `a.param` (fp32 master) in place, and its compute copy
    /// refreshed.
    fn adamw(&self, a: AdamW<'_, Self>) -> DResult<()>;
}

/// The rows of a buffer of `len` elements in rows of `width`, or an error naming
/// it where `len` is not a whole number of rows.
pub(crate) fn rows_of(what: &str, len: usize, width: usize) -> DResult<usize> {
    match (len, width) {
        (0, _) => Ok(0),
        (_, 0) => Err(DeviceError(format!("{what}: {len} values in rows of 0"))),
        _ if len.is_multiple_of(width) => Ok(len / width),
        _ => Err(DeviceError(format!(
            "{what}: {len} values are not whole rows of {width}"
        ))),
    }
}

/// Runs a CPU attention kernel with `dropout`'s mask as the kernel's keep function
/// (drop probability rounded to f32 as the kernel takes it).
fn with_attn_dropout(
    dropout: Option<&AttnDropout>,
    run: impl FnOnce(Option<&k::Dropout<'_>>) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    match dropout {
        None => run(None),
        Some(a) => {
            let keep = |b, h, i, j| a.keep(b, h, i, j);
            run(Some(&k::Dropout {
                p: a.draw.p as f32,
                keep: &keep,
            }))
        }
    }
}

/// Where a host attention call reads its operands.
fn qkv_of<'a, H: HostPrecision>(a: &Attn<'a, H>) -> k::Qkv<'a> {
    if a.fused {
        k::Qkv::Fused(a.q)
    } else {
        k::Qkv::Apart(a.q, a.k, a.v)
    }
}

impl<H: HostPrecision> Device for H {
    const READS_FUSED_QKV: bool = true;
    type Reduction = Vec<f32>;
    type Comm = dyn Communicator;

    fn host_comm(comm: Box<dyn Communicator>) -> Box<dyn Communicator> {
        comm
    }
    fn first_non_finite(&self, xs: &[&Vec<f32>]) -> DResult<Option<usize>> {
        H::crossed(Crossing::Flag, 1);
        Ok(xs.iter().position(|x| !k::all_finite(x)))
    }
    fn f32_zero(&self, x: &mut Vec<f32>) -> DResult<()> {
        k::fill(x, 0.0);
        Ok(())
    }
    fn f32_scale(&self, x: &mut Vec<f32>, a: f32) -> DResult<()> {
        k::scale(x, a);
        Ok(())
    }
    fn f32_accumulate(&self, acc: &mut Vec<f32>, x: &Vec<f32>) -> DResult<()> {
        if acc.len() != x.len() {
            return Err(range_err("accumulate"));
        }
        k::accumulate(acc, x);
        Ok(())
    }
    fn accumulate(&self, acc: &mut Vec<f32>, x: &Vec<f32>) -> DResult<()> {
        k::check_len("x", x.len(), acc.len())?;
        k::accumulate(acc, x);
        H::round(acc);
        Ok(())
    }
    fn matmul(&self, g: GemmAt, a: &Self::Act, b: &Self::Act, c: &mut Self::Act) -> DResult<()> {
        k::matmul_at(&g, a, b, 0.0, c)?;
        H::round(&mut c[g.spans()?[2].clone()]);
        Ok(())
    }
    fn side_by_side<A: Send, B: Send>(
        &self,
        a: impl FnOnce() -> A + Send,
        b: impl FnOnce() -> B + Send,
    ) -> (A, B) {
        k::side_by_side(a, b)
    }
    fn matmul_new(&self, g: GemmAt, a: &Self::Act, b: &Self::Act) -> DResult<Self::Act> {
        let mut c = k::matmul_new(&g, a, b)?;
        H::round(&mut c);
        Ok(c)
    }
    fn matmul_acc(&self, g: GemmAt, a: &Vec<f32>, b: &Vec<f32>, c: &mut Vec<f32>) -> DResult<()> {
        Ok(k::matmul_at(&g, a, b, 1.0, c)?)
    }
    fn bias_add(&self, y: &mut Self::Act, bias: &Self::Act) -> DResult<()> {
        k::bias_add(y, bias)?;
        H::round(y);
        Ok(())
    }
    fn bias_grad(&self, dy: &Self::Act, db: &mut Self::F32) -> DResult<()> {
        Ok(k::bias_grad(dy, db)?)
    }
    fn split_qkv(&self, x: &Vec<f32>, dims: &AttnDims, qkv: [&mut Vec<f32>; 3]) -> DResult<()> {
        let [q, kk, v] = qkv;
        Ok(k::split_qkv(x, dims, q, kk, v)?)
    }
    fn join_qkv(&self, dqkv: [&Vec<f32>; 3], dims: &AttnDims, dx: &mut Vec<f32>) -> DResult<()> {
        let [dq, dk, dv] = dqkv;
        Ok(k::join_qkv(dq, dk, dv, dims, dx)?)
    }
    fn swap_axes(&self, x: &Self::Act, [p, q, w]: [usize; 3], y: &mut Self::Act) -> DResult<()> {
        Ok(k::transpose_bs(x, (p, q, w), true, y)?)
    }
    fn rope_qkv(&self, r: &RopeQkv<'_, Self>, y: &mut Vec<f32>) -> DResult<()> {
        k::rope_qkv(r.x, r.positions, r.rows, r.shape, (r.rope, r.backward), y)?;
        H::round(y);
        Ok(())
    }
    fn attention_fwd(&self, a: &Attn<'_, Self>, out: AttnOut<'_, Self>) -> DResult<()> {
        with_attn_dropout(a.dropout, |dr| {
            let (causal, scale) = (a.causal, a.scale);
            k::attention_fwd_qkv(a.dims, qkv_of(a), a.pos0, causal, scale, out.o, out.lse, dr)
        })?;
        H::round(out.o);
        Ok(())
    }
    fn attention_bwd(&self, a: &Attn<'_, Self>, b: AttnBwd<'_, Self>) -> DResult<()> {
        let ins = (&b.o[..], &b.lse[..], &b.d_o[..]);
        let run = |grads: k::QkvGrads<'_>| {
            with_attn_dropout(a.dropout, |dr| {
                let (causal, scale) = (a.causal, a.scale);
                k::attention_bwd_qkv(a.dims, qkv_of(a), ins, a.pos0, causal, scale, grads, dr)
            })
        };
        match b.grads {
            AttnGrads::Apart(d_q, d_k, d_v) => {
                run(k::QkvGrads::Apart(d_q, d_k, d_v))?;
                H::round(d_q);
                H::round(d_k);
                H::round(d_v);
            }
            AttnGrads::Fused(dx) => {
                run(k::QkvGrads::Fused(dx))?;
                H::round(dx);
            }
        }
        Ok(())
    }
    fn attention_merge(&self, dims: &AttnDims, m: Merge<'_, Self>) -> DResult<()> {
        k::attention_merge(dims, m.o_acc, m.lse_acc, m.o_blk, m.lse_blk)?;
        H::round(m.o_acc);
        Ok(())
    }
    fn embedding_fwd(&self, e: &Embed<'_, Self>, w: &Self::Act, y: &mut Self::Act) -> DResult<()> {
        Ok(k::embedding_fwd(e.ids, w, e.vocab_start, e.dim, y)?)
    }
    fn embedding_bwd(&self, e: &Embed<'_, Self>, dy: &Vec<f32>, dw: &mut Vec<f32>) -> DResult<()> {
        Ok(k::embedding_bwd(e.ids, dy, e.vocab_start, e.dim, dw)?)
    }
    fn norm_fwd(&self, n: &Norm<'_, Self>, out: NormOut<'_, Self>) -> DResult<()> {
        let NormOut { y, mean, rstd } = out;
        if n.kind == NormKind::Rmsnorm {
            k::rmsnorm_fwd(n.x, n.w, n.rows, n.dim, n.eps, y, rstd)?;
        } else {
            let (b, mean) = layernorm_parts(n.b, mean)?;
            k::layernorm_fwd(n.x, n.w, b, n.rows, n.dim, n.eps, y, mean, rstd)?;
        }
        H::round(y);
        Ok(())
    }
    fn norm_bwd(&self, n: &Norm<'_, Self>, g: NormBwd<'_, Self>) -> DResult<()> {
        let (dx, dw) = (&mut *g.dx, g.dw);
        if n.kind == NormKind::Rmsnorm {
            k::rmsnorm_bwd(n.x, n.w, g.rstd, g.dy, n.rows, n.dim, dx, dw)?;
        } else {
            let (mean, db) = layernorm_parts(g.mean, g.db)?;
            k::layernorm_bwd(n.x, n.w, mean, g.rstd, g.dy, n.rows, n.dim, dx, dw, db)?;
        }
        H::round(g.dx);
        Ok(())
    }
    fn gelu_fwd(&self, x: &Vec<f32>, y: &mut Vec<f32>) -> DResult<()> {
        k::gelu_fwd(x, y)?;
        H::round(y);
        Ok(())
    }
    fn gelu_bwd(&self, x: &Vec<f32>, dy: &Vec<f32>, dx: &mut Vec<f32>) -> DResult<()> {
        k::gelu_bwd(x, dy, dx)?;
        H::round(dx);
        Ok(())
    }
    fn swiglu_fwd(&self, x: &Self::Act, f: usize, y: &mut Self::Act) -> DResult<()> {
        k::swiglu_fwd(x, rows_of("x", x.len(), 2 * f)?, f, y)?;
        H::round(y);
        Ok(())
    }
    fn swiglu_bwd(&self, x: &Vec<f32>, g: &Vec<f32>, f: usize, dx: &mut Vec<f32>) -> DResult<()> {
        k::swiglu_bwd(x, g, rows_of("x", x.len(), 2 * f)?, f, dx)?;
        H::round(dx);
        Ok(())
    }
    fn dropout(&self, x: &Self::Act, w: usize, d: &RowDropout, y: &mut Self::Act) -> DResult<()> {
        k::dropout_rows(x, rows_of("x", x.len(), w)?, w, d, y)?;
        H::round(y);
        Ok(())
    }
    fn moe_route(&self, logits: &Self::Act, r: &mut Routed<Self>) -> DResult<()> {
        let m = r.m;
        let (probs, idx, wts) = (&mut r.probs, &mut r.idx, &mut r.wts);
        let (tokens, experts, kk, renorm) = (m.tokens, m.experts, m.k, m.renormalize);
        Ok(k::moe_route_fwd(
            logits, tokens, experts, kk, renorm, probs, idx, wts,
        )?)
    }
    fn moe_route_bwd(&self, r: &Routed<Self>, dw: &Self::F32, dx: &mut Self::Act) -> DResult<()> {
        let m = r.m;
        let (tokens, experts, kk, renorm) = (m.tokens, m.experts, m.k, m.renormalize);
        let (probs, idx, wts) = (&r.probs, &r.idx, &r.wts);
        k::moe_route_bwd(probs, idx, wts, dw, tokens, experts, kk, renorm, dx)?;
        H::round(dx);
        Ok(())
    }
    fn moe_dispatch(&self, r: &mut Routed<Self>, x: &Self::Act, y: &mut Self::Act) -> DResult<()> {
        let m = r.m;
        r.counts.clear();
        r.counts.resize(m.experts, 0);
        let (idx, perm, counts) = (&r.idx, &mut r.perm, &mut r.counts);
        k::moe_dispatch_fwd(x, idx, m.tokens, m.k, m.experts, m.dim, y, counts, perm)?;
        let Some(c) = r.capacity else {
            H::crossed(Crossing::ExpertCounts, m.experts);
            return Ok(());
        };
        let (mut at, mut pad) = (
            vec![0; perm.len()],
            vec![0; m.experts * c.per_expert(m.tokens)],
        );
        r.kept.resize(m.experts, 0);
        k::moe_capacity(perm, counts, m.k, c, (&mut at, &mut pad), &mut r.kept)?;
        r.padded = Some([pad, at]);
        H::crossed(Crossing::ExpertCounts, 2 * m.experts);
        Ok(())
    }
    fn moe_dispatch_bwd(&self, r: &Routed<Self>, dy: &Vec<f32>, dx: &mut Vec<f32>) -> DResult<()> {
        k::moe_dispatch_bwd(dy, &r.perm, r.m.tokens, r.m.k, r.m.dim, dx)?;
        H::round(dx);
        Ok(())
    }
    fn moe_combine(&self, r: &Routed<Self>, y: &Self::Act, out: &mut Self::Act) -> DResult<()> {
        let m = r.m;
        k::moe_combine_fwd(y, &r.perm, &r.wts, m.tokens, m.k, m.dim, out)?;
        H::round(out);
        Ok(())
    }
    fn moe_combine_bwd(&self, r: &Routed<Self>, g: CombineBwd<'_, Self>) -> DResult<()> {
        let (m, perm, wts) = (r.m, &r.perm, &r.wts);
        k::moe_combine_bwd(g.dy, g.y, perm, wts, m.tokens, m.k, m.dim, g.d_y, g.d_wts)?;
        H::round(g.d_y);
        Ok(())
    }
    fn gather_rows(&self, x: &Vec<f32>, i: &Vec<u32>, w: usize, y: &mut Vec<f32>) -> DResult<()> {
        Ok(k::gather_rows(x, i, w, y)?)
    }
    fn add(&self, a: &Vec<f32>, b: &Vec<f32>, out: &mut Vec<f32>) -> DResult<()> {
        k::add(a, b, out)?;
        H::round(out);
        Ok(())
    }
    fn cross_entropy(&self, c: &Ce<'_, Self>, out: CeOut<'_, Self>) -> DResult<()> {
        // Bit for bit the three parts below (the goldens' sequence), in one pass.
        k::cross_entropy(
            c.logits,
            c.labels,
            c.rows,
            c.v_local,
            c.vocab_start,
            c.scale,
            out.loss,
            out.dlogits,
        )?;
        H::round(out.dlogits);
        Ok(())
    }
    fn ce_row_max(&self, c: &Ce<'_, Self>, max: &mut Vec<f32>) -> DResult<()> {
        Ok(k::ce_row_max(c.logits, c.rows, c.v_local, max)?)
    }
    fn ce_sums(&self, c: &Ce<'_, Self>, max: &Vec<f32>, out: [&mut Vec<f32>; 2]) -> DResult<()> {
        let [sumexp, target] = out;
        let (logits, labels, rows, v) = (c.logits, c.labels, c.rows, c.v_local);
        k::ce_row_sumexp(logits, rows, v, max, sumexp)?;
        Ok(k::ce_target_logit(
            logits,
            labels,
            rows,
            v,
            c.vocab_start,
            target,
        )?)
    }
    fn ce_finish(&self, c: &Ce<'_, Self>, s: [&Self::F32; 3], out: CeOut<'_, Self>) -> DResult<()> {
        let [max, sumexp, target] = s;
        k::ce_loss(max, sumexp, target, out.loss)?;
        let (logits, labels, rows, v) = (c.logits, c.labels, c.rows, c.v_local);
        k::fill(out.dlogits, 0.0);
        let d = &mut *out.dlogits;
        k::ce_bwd(
            logits,
            rows,
            v,
            max,
            sumexp,
            labels,
            c.vocab_start,
            c.scale,
            d,
        )?;
        H::round(out.dlogits);
        Ok(())
    }
    fn act_to_f32(&self, x: &Vec<f32>) -> DResult<Vec<f32>> {
        Ok(x.clone())
    }
    fn pick(&self, x: &Vec<f32>, d: Picks, draw: Option<Draw<'_>>) -> DResult<Vec<u32>> {
        let tokens = match draw {
            None => k::argmax_parts(x, d)?,
            Some((s, requests)) => {
                H::crossed(Crossing::IdsUp, requests.len());
                k::sample_parts(x, d, s, requests)?
            }
        };
        H::crossed(Crossing::IdsDown, d.rows);
        Ok(tokens)
    }
    fn adamw(&self, a: AdamW<'_, Self>) -> DResult<()> {
        let (b1, b2, eps, wd) = a.hyper;
        k::adamw_step(a.param, a.grad, a.m, a.v, a.step, a.lr, b1, b2, eps, wd)?;
        if let Some(compute) = a.compute {
            compute.copy_from_slice(a.param);
            H::round(compute);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
