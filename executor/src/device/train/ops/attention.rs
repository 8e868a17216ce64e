//! Attention: forward and backward over this rank's heads, the ring over the
//! context axis where there is one.

use super::*;
use crate::device::Buffers;
use crate::device::{Attn, AttnGrads};
use meshplan_ir::graph::AttentionShape;

/// An attention op's input (fused `q | k | v`), its sizes, `q`, `k` and `v`
/// apart (`None` where the kernels read them in place), and the mask.
type AttnInputs<D> = (Arc<<D as Buffers>::Act>, AttnDims, Option<Qkv<D>>, AttnMask);

impl<D: Device> DevRank<'_, D> {
    /// What attention's forward and backward start from. The split copies are
    /// made only for a ring (its blocks travel apart) or a device whose kernels
    /// take `q`, `k` and `v` apart.
    fn attention_inputs(
        &self,
        op: &Op,
        a: &AttentionShape,
        l: u64,
        t: &Task<D>,
    ) -> Res<AttnInputs<D>> {
        let x = self.act(t, l, op.inputs[0])?;
        let (dims, _) = self.site().attention_dims_of(op, self.sizes.mbs, &x)?;
        let qkv = if D::READS_FUSED_QKV && self.cp.size == 1 {
            None
        } else {
            let rows = dims.batch * dims.sq;
            let mut q = self.zeros(rows * dims.hq * dims.d)?;
            let mut k = self.zeros(rows * dims.hkv * dims.d)?;
            let mut v = self.zeros(rows * dims.hkv * dims.dv)?;
            self.dev
                .split_qkv(&x, &dims, [&mut q, &mut k, &mut v])
                .map_err(derr(&op.name))?;
            Some((q, k, v))
        };
        let mask = AttnMask {
            causal: a.causal,
            scale: 1.0 / (a.qk_dim as f32).sqrt(),
            dropout: self.attention_dropout(op, l, t),
        };
        Ok((x, dims, qkv, mask))
    }

    pub(super) fn attention_fwd(
        &mut self,
        op: &Op,
        a: &AttentionShape,
        l: u64,
        t: &mut Task<D>,
    ) -> Res<Arc<D::Act>> {
        let e = derr(&op.name);
        let (x, dims, qkv, mask) = self.attention_inputs(op, a, l, t)?;
        let mut o = self.zeros(dims.batch * dims.sq * dims.hq * dims.dv)?;
        let mut lse = self.zeros_f32(dims.batch * dims.hq * dims.sq)?;
        if let (true, Some((q, kk, v))) = (self.cp.size > 1, &qkv) {
            self.ring()?
                .forward(&dims, (q, kk, v), &mask, &mut o, &mut lse)?;
        } else {
            let a = attn_on(&mask, &dims, &*x, &qkv);
            let out = AttnOut {
                o: &mut o,
                lse: &mut lse,
            };
            self.dev.attention_fwd(&a, out).map_err(&e)?;
        }
        t.stats.insert((l, op.name.clone(), Stat::Lse), lse);
        let kept = (l, op.name.clone(), Saved::AttnOut);
        if qkv.is_none() {
            // Beside fused rows the kernel wrote `o` sequence-major: the op's output
            // as it is, kept for the backward in the same buffer.
            let o = Arc::new(o);
            t.saved.insert(kept, o.clone());
            return Ok(o);
        }
        let mut y = self.zeros(D::act_len(&o))?;
        self.dev
            .swap_axes(&o, [dims.batch, dims.sq, dims.hq * dims.dv], &mut y)
            .map_err(&e)?;
        t.saved.insert(kept, Arc::new(o));
        Ok(Arc::new(y))
    }

    pub(super) fn attention_bwd(
        &mut self,
        op: &Op,
        a: &AttentionShape,
        l: u64,
        t: &mut Task<D>,
        dy: D::Act,
    ) -> Res {
        let in0 = self.name_of(op.inputs[0]);
        let e = derr(&op.name);
        let dev = &self.dev;
        let (x, dims, qkv, mask) = self.attention_inputs(op, a, l, t)?;
        let o = t
            .saved
            .get(&(l, op.name.clone(), Saved::AttnOut))
            .cloned()
            .ok_or_else(|| fail("attention output was not kept"))?;
        let lse = stat(t, l, &op.name, Stat::Lse)?;
        // `o`'s gradient in `o`'s layout: sequence-major beside fused rows, as the
        // op's output gradient is.
        let d_o = if qkv.is_none() {
            dy
        } else {
            let mut d_o = self.zeros(D::act_len(&dy))?;
            dev.swap_axes(&dy, [dims.sq, dims.batch, dims.hq * dims.dv], &mut d_o)
                .map_err(&e)?;
            d_o
        };
        let bwd = |grads| AttnBwd {
            o: &*o,
            lse,
            d_o: &d_o,
            grads,
        };
        let mut dx = self.zeros(D::act_len(&x))?;
        let Some((q, kk, v)) = &qkv else {
            // Fused operands: the gradients go straight into the fused rows.
            let a = attn_on(&mask, &dims, &*x, &qkv);
            self.dev
                .attention_bwd(&a, bwd(AttnGrads::Fused(&mut dx)))
                .map_err(&e)?;
            return self.add_grad(t, l, in0, dx);
        };
        let mut dq = self.zeros(D::act_len(q))?;
        let mut dk = self.zeros(D::act_len(kk))?;
        let mut dv = self.zeros(D::act_len(v))?;
        if self.cp.size > 1 {
            let grads = (&mut dq, &mut dk, &mut dv);
            self.ring()?
                .backward(&dims, (q, kk, v), (&o, lse, &d_o), &mask, grads)?;
        } else {
            let a = mask.attn(&dims, (q, kk, v), (0, 0));
            let grads = AttnGrads::Apart(&mut dq, &mut dk, &mut dv);
            self.dev.attention_bwd(&a, bwd(grads)).map_err(&e)?;
        }
        self.dev
            .join_qkv([&dq, &dk, &dv], &dims, &mut dx)
            .map_err(&e)?;
        self.add_grad(t, l, in0, dx)
    }
}

/// One attention call over the whole sequence: on `q`, `k` and `v` apart where
/// they were split, else in place on the fused rows `x`.
fn attn_on<'a, D: Device>(
    mask: &'a AttnMask,
    dims: &'a AttnDims,
    x: &'a D::Act,
    qkv: &'a Option<Qkv<D>>,
) -> Attn<'a, D> {
    match qkv {
        Some((q, k, v)) => mask.attn(dims, (q, k, v), (0, 0)),
        None => Attn {
            fused: true,
            ..mask.attn(dims, (x, x, x), (0, 0))
        },
    }
}
