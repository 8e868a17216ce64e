//! Ring attention (context parallelism): each rank's queries meet every context
//! rank's key/value block in turn, the blocks passed round the `cp` group, and in
//! the backward the gradients of the blocks go back to their owners.

use super::*;
use crate::device::forward::AttnMask;
use crate::device::{AttnGrads, DeviceComm, Merge};

/// One rank's place on the ring, with the device and communicator it passes
/// blocks with ([`DevRank::ring`]).
pub(super) struct Ring<'r, D: Device> {
    dev: &'r D,
    comm: &'r mut D::Comm,
    group: Group,
    /// This rank's index in the group, and the global ranks after and before it.
    me: usize,
    next: usize,
    prev: usize,
    /// Rows of every sequence each rank holds.
    rows: usize,
}

impl<'a, D: Device> DevRank<'a, D> {
    /// This rank's place on the context group's ring.
    pub(super) fn ring(&mut self) -> Res<Ring<'_, D>> {
        let group = self.group("cp")?;
        let (n, me) = (group.size(), step::index_in(&group, self.rank)?);
        Ok(Ring {
            dev: &self.dev,
            comm: &mut *self.comm,
            next: group.ranks[(me + 1) % n],
            prev: group.ranks[(me + n - 1) % n],
            rows: self.sizes.seq_len / n,
            group,
            me,
        })
    }
}

impl<D: Device> Ring<'_, D> {
    fn n(&self) -> usize {
        self.group.size()
    }

    fn zeros(&self, n: usize) -> Res<D::Act> {
        self.dev.act_zeros(n).map_err(derr("alloc"))
    }

    fn f32_zeros(&self, n: usize) -> Res<D::F32> {
        self.dev.f32_zeros(n).map_err(derr("alloc"))
    }

    /// `[k | v]`, the block a ring passes on.
    fn kv_block(&self, k: &D::Act, v: &D::Act) -> Result<D::Act, RankError> {
        let (kl, vl) = (D::act_len(k), D::act_len(v));
        let e = derr("ring block");
        let mut block = self.zeros(kl + vl)?;
        self.dev.act_copy((k, 0), (&mut block, 0), kl).map_err(&e)?;
        self.dev
            .act_copy((v, 0), (&mut block, kl), vl)
            .map_err(&e)?;
        Ok(block)
    }

    /// One step of the ring: `block` to the next rank, the previous rank's in return.
    fn pass_block(
        &mut self,
        next: usize,
        prev: usize,
        block: &D::Act,
    ) -> Result<D::Act, RankError> {
        let mut passed = self.zeros(D::act_len(block))?;
        let whole = (0, D::act_len(block));
        self.comm.exchange_act(
            self.dev,
            "cp",
            &[(next, block, whole)],
            &mut [(prev, &mut passed)],
        )?;
        Ok(passed)
    }

    /// `block[at..at + n]` as a buffer of its own.
    fn act_part(&self, block: &D::Act, at: usize, n: usize) -> Result<D::Act, RankError> {
        let mut out = self.zeros(n)?;
        self.dev
            .act_copy((block, at), (&mut out, 0), n)
            .map_err(derr("ring block"))?;
        Ok(out)
    }

    /// A ring block's keys (its first `kl` elements) and values (the rest).
    fn kv_halves(&self, block: &D::Act, kl: usize) -> Result<(D::Act, D::Act), RankError> {
        let len = D::act_len(block);
        Ok((
            self.act_part(block, 0, kl)?,
            self.act_part(block, kl, len - kl)?,
        ))
    }

    /// Ring attention's forward: this rank's queries against every context rank's
    /// key/value block in turn (each passed on to the next rank), the partial
    /// outputs merged by their log-sum-exps into `o` (zero on entry) and `lse`.
    pub(super) fn forward(
        &mut self,
        dims: &AttnDims,
        (q, k, v): (&D::Act, &D::Act, &D::Act),
        mask: &AttnMask,
        o: &mut D::Act,
        lse: &mut D::F32,
    ) -> Result<(), RankError> {
        let (me, next, prev, n, s_l) = (self.me, self.next, self.prev, self.n(), self.rows);
        let e = derr("ring attention");
        let kl = D::act_len(k);
        let mut block = self.kv_block(k, v)?;
        for t in 0..n {
            let owner = (me + n - t) % n;
            let (kb, vb) = self.kv_halves(&block, kl)?;
            let a = mask.attn(dims, (q, &kb, &vb), (me * s_l, owner * s_l));
            if t == 0 {
                // The own block first, straight into `o` and `lse`: merged into
                // an empty accumulator (`lse = -inf`) it would come out as itself.
                self.dev.attention_fwd(&a, AttnOut { o, lse }).map_err(&e)?;
            } else {
                let mut ob = self.zeros(D::act_len(o))?;
                let mut lb = self.f32_zeros(D::f32_len(lse))?;
                let out = AttnOut {
                    o: &mut ob,
                    lse: &mut lb,
                };
                self.dev.attention_fwd(&a, out).map_err(&e)?;
                let m = Merge {
                    o_acc: o,
                    lse_acc: lse,
                    o_blk: &ob,
                    lse_blk: &lb,
                };
                self.dev.attention_merge(dims, m).map_err(&e)?;
            }
            if t + 1 < n {
                block = self.pass_block(next, prev, &block)?;
            }
        }
        Ok(())
    }

    /// Ring attention's backward: the key/value blocks go round again; the gradient
    /// computed for every other rank's block goes straight to its owner (in
    /// pairwise exchanges), which adds them in rank order.
    pub(super) fn backward(
        &mut self,
        dims: &AttnDims,
        (q, k, v): (&D::Act, &D::Act, &D::Act),
        (o, lse, d_o): (&D::Act, &D::F32, &D::Act),
        mask: &AttnMask,
        (dq, dk, dv): (&mut D::Act, &mut D::Act, &mut D::Act),
    ) -> Result<(), RankError> {
        let (me, next, prev, n, s_l) = (self.me, self.next, self.prev, self.n(), self.rows);
        let e = derr("ring attention");
        let kl = D::act_len(k);
        let mut block = self.kv_block(k, v)?;
        let len = D::act_len(&block);
        let mut grads: Vec<Option<D::Act>> = (0..n).map(|_| None).collect();
        for t in 0..n {
            let owner = (me + n - t) % n;
            let (kb, vb) = self.kv_halves(&block, kl)?;
            let (mut gk, mut gv) = (self.zeros(kl)?, self.zeros(len - kl)?);
            let pos = (me * s_l, owner * s_l);
            let b = AttnBwd {
                o,
                lse,
                d_o,
                grads: AttnGrads::Apart(&mut *dq, &mut gk, &mut gv),
            };
            let a = mask.attn(dims, (q, &kb, &vb), pos);
            self.dev.attention_bwd(&a, b).map_err(&e)?;
            grads[owner] = Some(self.kv_block(&gk, &gv)?);
            if t + 1 < n {
                block = self.pass_block(next, prev, &block)?;
            }
        }
        let mut grads: Vec<D::Act> = grads
            .into_iter()
            .collect::<Option<_>>()
            .ok_or_else(|| fail("a ring block was not visited"))?;
        // Round r sends rank me + r its block's gradient and receives its own
        // from rank me - r: pairwise exchanges, none waiting on another.
        let mut got: Vec<Option<D::Act>> = (0..n).map(|_| None).collect();
        for r in 1..n {
            let (to, from) = ((me + r) % n, (me + n - r) % n);
            let mut buf = self.zeros(len)?;
            self.comm.exchange_act(
                self.dev,
                "cp",
                &[(self.group.ranks[to], &grads[to], (0, len))],
                &mut [(self.group.ranks[from], &mut buf)],
            )?;
            got[from] = Some(buf);
        }
        // Added in rank order, as the goldens were recorded.
        let mut total = grads.swap_remove(me);
        for buf in got.iter().flatten() {
            self.dev.accumulate(&mut total, buf).map_err(&e)?;
        }
        let (tk, tv) = self.kv_halves(&total, kl)?;
        self.dev.accumulate(dk, &tk).map_err(&e)?;
        self.dev.accumulate(dv, &tv).map_err(&e)
    }
}
