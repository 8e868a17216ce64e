//! [`Bf16Host`]: the host device with a GPU's rounding. Every activation, activation
//! gradient and weight compute copy is rounded to bf16 where the CUDA kernels store
//! bf16, and everything the CUDA kernels keep in fp32 (weight gradients, master
//! weights, moments, statistics, losses) stays fp32. Kernels take bf16-valued
//! inputs and compute in fp32 as the GPU's do, so a run on it differs from the fp32
//! run by what mixed precision costs: the yardstick for the tolerances of
//! [`super::check_mixed_precision`], measured here rather than guessed.

use super::{DResult, Device, HostDevice};
use meshplan_kernels::cpu::{AttnDims, Transpose};

/// The host device rounding what a GPU stores in bf16.
#[derive(Clone, Copy, Debug, Default)]
pub struct Bf16Host;

fn round(x: &mut [f32]) {
    for v in x {
        *v = half::bf16::from_f32(*v).to_f32();
    }
}

/// Runs `$call` on the host device, then rounds the listed outputs to bf16.
macro_rules! rounded {
    ($call:expr, $($out:expr),+) => {{
        $call?;
        $( round($out); )+
        Ok(())
    }};
}

#[allow(clippy::too_many_arguments)]
impl Device for Bf16Host {
    type Act = Vec<f32>;
    type F32 = Vec<f32>;
    type Ids = Vec<u32>;
    type Mark = std::time::Instant;
    type Reduction = Vec<f32>;

    fn name(&self) -> &'static str {
        "cpu-bf16"
    }
    fn act_bytes(&self) -> usize {
        2
    }
    fn act_zeros(&self, n: usize) -> DResult<Vec<f32>> {
        HostDevice.act_zeros(n)
    }
    fn f32_zeros(&self, n: usize) -> DResult<Vec<f32>> {
        HostDevice.f32_zeros(n)
    }
    fn f32_upload(&self, host: &[f32]) -> DResult<Vec<f32>> {
        HostDevice.f32_upload(host)
    }
    fn ids_upload(&self, host: &[u32]) -> DResult<Vec<u32>> {
        HostDevice.ids_upload(host)
    }
    fn f32_download(&self, x: &Vec<f32>) -> DResult<Vec<f32>> {
        HostDevice.f32_download(x)
    }
    fn act_download(&self, x: &Vec<f32>) -> DResult<Vec<f32>> {
        HostDevice.act_download(x)
    }
    fn act_len(x: &Vec<f32>) -> usize {
        x.len()
    }
    fn f32_len(x: &Vec<f32>) -> usize {
        x.len()
    }
    fn to_act(&self, x: &Vec<f32>, y: &mut Vec<f32>) -> DResult<()> {
        rounded!(HostDevice.to_act(x, y), y)
    }
    fn f32_zero(&self, x: &mut Vec<f32>) -> DResult<()> {
        HostDevice.f32_zero(x)
    }
    fn f32_copy(
        &self,
        src: &Vec<f32>,
        src_off: usize,
        dst: &mut Vec<f32>,
        dst_off: usize,
        n: usize,
    ) -> DResult<()> {
        HostDevice.f32_copy(src, src_off, dst, dst_off, n)
    }
    fn accumulate(&self, acc: &mut Vec<f32>, x: &Vec<f32>) -> DResult<()> {
        rounded!(HostDevice.accumulate(acc, x), acc)
    }
    fn matmul(
        &self,
        ta: Transpose,
        tb: Transpose,
        m: usize,
        k: usize,
        n: usize,
        a: &Vec<f32>,
        b: &Vec<f32>,
        c: &mut Vec<f32>,
    ) -> DResult<()> {
        rounded!(HostDevice.matmul(ta, tb, m, k, n, a, b, c), c)
    }
    fn matmul_acc(
        &self,
        ta: Transpose,
        tb: Transpose,
        m: usize,
        k: usize,
        n: usize,
        a: &Vec<f32>,
        b: &Vec<f32>,
        c: &mut Vec<f32>,
    ) -> DResult<()> {
        HostDevice.matmul_acc(ta, tb, m, k, n, a, b, c)
    }
    fn bias_add(&self, y: &mut Vec<f32>, bias: &Vec<f32>, rows: usize, n: usize) -> DResult<()> {
        rounded!(HostDevice.bias_add(y, bias, rows, n), y)
    }
    fn bias_grad(&self, dy: &Vec<f32>, rows: usize, n: usize, db: &mut Vec<f32>) -> DResult<()> {
        HostDevice.bias_grad(dy, rows, n, db)
    }
    fn split_qkv(
        &self,
        x: &Vec<f32>,
        dims: &AttnDims,
        q: &mut Vec<f32>,
        k: &mut Vec<f32>,
        v: &mut Vec<f32>,
    ) -> DResult<()> {
        HostDevice.split_qkv(x, dims, q, k, v)
    }
    fn join_qkv(
        &self,
        dq: &Vec<f32>,
        dk: &Vec<f32>,
        dv: &Vec<f32>,
        dims: &AttnDims,
        dx: &mut Vec<f32>,
    ) -> DResult<()> {
        HostDevice.join_qkv(dq, dk, dv, dims, dx)
    }
    fn transpose_bs(
        &self,
        x: &Vec<f32>,
        b: usize,
        s: usize,
        w: usize,
        to_sbhd: bool,
        y: &mut Vec<f32>,
    ) -> DResult<()> {
        HostDevice.transpose_bs(x, b, s, w, to_sbhd, y)
    }
    fn rope_qkv(
        &self,
        x: &Vec<f32>,
        positions: &Vec<u32>,
        rows: usize,
        hq: usize,
        hkv: usize,
        d: usize,
        width: usize,
        theta: f32,
        backward: bool,
        y: &mut Vec<f32>,
    ) -> DResult<()> {
        rounded!(
            HostDevice.rope_qkv(x, positions, rows, hq, hkv, d, width, theta, backward, y),
            y
        )
    }
    fn attention_fwd(
        &self,
        dims: &AttnDims,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        causal: bool,
        scale: f32,
        out: &mut Vec<f32>,
        lse: &mut Vec<f32>,
    ) -> DResult<()> {
        rounded!(
            HostDevice.attention_fwd(dims, q, k, v, causal, scale, out, lse),
            out
        )
    }
    fn attention_bwd(
        &self,
        dims: &AttnDims,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        o: &Vec<f32>,
        lse: &Vec<f32>,
        d_o: &Vec<f32>,
        causal: bool,
        scale: f32,
        d_q: &mut Vec<f32>,
        d_k: &mut Vec<f32>,
        d_v: &mut Vec<f32>,
    ) -> DResult<()> {
        rounded!(
            HostDevice.attention_bwd(dims, q, k, v, o, lse, d_o, causal, scale, d_q, d_k, d_v),
            d_q,
            d_k,
            d_v
        )
    }
    fn embedding_fwd(
        &self,
        ids: &Vec<u32>,
        table: &Vec<f32>,
        dim: usize,
        out: &mut Vec<f32>,
    ) -> DResult<()> {
        HostDevice.embedding_fwd(ids, table, dim, out)
    }
    fn embedding_bwd(
        &self,
        ids: &Vec<u32>,
        d_out: &Vec<f32>,
        dim: usize,
        d_table: &mut Vec<f32>,
    ) -> DResult<()> {
        HostDevice.embedding_bwd(ids, d_out, dim, d_table)
    }
    fn layernorm_fwd(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        b: &Vec<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        y: &mut Vec<f32>,
        mean: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
    ) -> DResult<()> {
        rounded!(
            HostDevice.layernorm_fwd(x, w, b, rows, dim, eps, y, mean, rstd),
            y
        )
    }
    fn layernorm_bwd(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        mean: &Vec<f32>,
        rstd: &Vec<f32>,
        dy: &Vec<f32>,
        rows: usize,
        dim: usize,
        dx: &mut Vec<f32>,
        dw: &mut Vec<f32>,
        db: &mut Vec<f32>,
    ) -> DResult<()> {
        rounded!(
            HostDevice.layernorm_bwd(x, w, mean, rstd, dy, rows, dim, dx, dw, db),
            dx
        )
    }
    fn rmsnorm_fwd(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        y: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
    ) -> DResult<()> {
        rounded!(HostDevice.rmsnorm_fwd(x, w, rows, dim, eps, y, rstd), y)
    }
    fn rmsnorm_bwd(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rstd: &Vec<f32>,
        dy: &Vec<f32>,
        rows: usize,
        dim: usize,
        dx: &mut Vec<f32>,
        dw: &mut Vec<f32>,
    ) -> DResult<()> {
        rounded!(
            HostDevice.rmsnorm_bwd(x, w, rstd, dy, rows, dim, dx, dw),
            dx
        )
    }
    fn gelu_fwd(&self, x: &Vec<f32>, y: &mut Vec<f32>) -> DResult<()> {
        rounded!(HostDevice.gelu_fwd(x, y), y)
    }
    fn gelu_bwd(&self, x: &Vec<f32>, dy: &Vec<f32>, dx: &mut Vec<f32>) -> DResult<()> {
        rounded!(HostDevice.gelu_bwd(x, dy, dx), dx)
    }
    fn swiglu_fwd(&self, x: &Vec<f32>, rows: usize, f: usize, y: &mut Vec<f32>) -> DResult<()> {
        rounded!(HostDevice.swiglu_fwd(x, rows, f, y), y)
    }
    fn swiglu_bwd(
        &self,
        x: &Vec<f32>,
        dy: &Vec<f32>,
        rows: usize,
        f: usize,
        dx: &mut Vec<f32>,
    ) -> DResult<()> {
        rounded!(HostDevice.swiglu_bwd(x, dy, rows, f, dx), dx)
    }
    fn add(&self, a: &Vec<f32>, b: &Vec<f32>, out: &mut Vec<f32>) -> DResult<()> {
        rounded!(HostDevice.add(a, b, out), out)
    }
    fn cross_entropy(
        &self,
        logits: &Vec<f32>,
        labels: &Vec<u32>,
        rows: usize,
        vocab: usize,
        scale: f32,
        loss: &mut Vec<f32>,
        dlogits: &mut Vec<f32>,
    ) -> DResult<()> {
        rounded!(
            HostDevice.cross_entropy(logits, labels, rows, vocab, scale, loss, dlogits),
            dlogits
        )
    }
    fn adamw(
        &self,
        param: &mut Vec<f32>,
        grad: &Vec<f32>,
        m: &mut Vec<f32>,
        v: &mut Vec<f32>,
        compute: &mut Vec<f32>,
        step: u64,
        lr: f32,
        hyper: (f32, f32, f32, f32),
    ) -> DResult<()> {
        rounded!(
            HostDevice.adamw(param, grad, m, v, compute, step, lr, hyper),
            compute
        )
    }
    fn all_reduce_start(
        &self,
        comm: &mut dyn crate::comm::Communicator,
        group: &crate::comm::Group,
        axis: &str,
        buf: Vec<f32>,
    ) -> Result<Vec<f32>, crate::comm::CommError> {
        HostDevice.all_reduce_start(comm, group, axis, buf)
    }
    fn all_reduce_finish(
        &self,
        comm: &mut dyn crate::comm::Communicator,
        r: Vec<f32>,
    ) -> Result<Vec<f32>, crate::comm::CommError> {
        HostDevice.all_reduce_finish(comm, r)
    }
    fn synchronize(&self) -> DResult<()> {
        Ok(())
    }
    fn mark(&self) -> DResult<std::time::Instant> {
        HostDevice.mark()
    }
    fn seconds_between(&self, a: &std::time::Instant, b: &std::time::Instant) -> DResult<f64> {
        HostDevice.seconds_between(a, b)
    }
    fn memory_in_use(&self) -> Option<u64> {
        None
    }
}
