//! Routed experts on the device: top-k routing, tokens grouped by expert, padded to
//! expert capacity or dropless, exchanged with the ranks holding their experts
//! (All-to-All with the routed counts), each local expert's MLP as spans of one
//! grouped GEMM, and the weighted combine back in token order; and the backward.
//!
//! The counts (and, under a capacity, the slot order) come to the host: they size
//! the exchange. The rows stay on the device; the route and padding
//! ([`crate::moe`], shared with the inference interpreter) become index lists that
//! [`Device::gather_rows`] applies.

use super::*;
use crate::moe::{self, Padding, Route};
use meshplan_ir::graph::ExpertsShape;
use meshplan_kernels::cpu::GemmAt;

/// An experts op's forward state, kept for its backward.
pub(super) struct Kept<D: Device> {
    probs: D::F32,
    idx: D::Ids,
    wts: D::F32,
    perm: D::Ids,
    /// The rows this rank's experts processed (expert-major), their counts.
    local_rows: D::Act,
    local_counts: Vec<usize>,
    ups: D::Act,
    acts: D::Act,
    /// The experts' outputs back at this rank, in dispatch-slot order.
    y_disp: D::Act,
    route: Route,
    moves: Moves<D>,
}

/// The local experts' outputs, up projections and activations, rows expert-major.
type Mlp<D> = (<D as Device>::Act, <D as Device>::Act, <D as Device>::Act);

/// The row moves of one experts op as device index lists.
struct Moves<D: Device> {
    /// Under a capacity: slots into the padded buffer, and back.
    pad: Option<(D::Ids, D::Ids)>,
    /// Over ranks: source-major rows to expert-major, and back.
    order: Option<(D::Ids, D::Ids)>,
}

impl<'a, D: Device> DevRank<'a, D> {
    /// The expert group, when the experts are split over ranks.
    fn ep_group(&self) -> Result<Option<Group>, RankError> {
        if self.ep.size <= 1 {
            return Ok(None);
        }
        self.groups
            .get("ep")
            .cloned()
            .map(Some)
            .ok_or_else(|| fail("experts split over ep, but the plan has no `ep` group"))
    }

    fn gather(&self, src: &D::Act, idx: &D::Ids, h: usize) -> Result<D::Act, RankError> {
        let mut out = self.zeros(D::ids_len(idx) * h)?;
        self.dev
            .gather_rows(src, idx, h, &mut out)
            .map_err(derr("experts"))?;
        Ok(out)
    }

    /// Rows to the ranks holding their experts (`back`: from them), counts from
    /// `route`, on the device.
    fn exchange_rows(
        &mut self,
        rows: &D::Act,
        route: &Route,
        h: usize,
        back: bool,
    ) -> Result<D::Act, RankError> {
        let (sc, rc) = route.elements(h);
        let (sc, rc) = if back { (rc, sc) } else { (sc, rc) };
        let g = self.ep_group()?.ok_or_else(|| fail("no expert group"))?;
        let mut out = self.zeros(rc.iter().sum())?;
        self.dev
            .all_to_all_v_act(self.comm.as_mut(), (&g, "ep"), (rows, &sc), (&mut out, &rc))?;
        Ok(out)
    }

    /// [`crate::moe::forward`] on the device.
    pub(super) fn experts_forward(
        &mut self,
        op: &Op,
        e: &ExpertsShape,
        l: u64,
        t: &mut Task<D>,
    ) -> Result<(), RankError> {
        moe::check_split(&op.name, self.tp, self.ep, self.sp)?;
        let err = derr(&op.name);
        let x = self.act_gathered(t, l, op.inputs[0])?;
        let logits = self.act_gathered(t, l, op.inputs[1])?;
        let sizes = (self.cp.size, self.tp.size, self.ep.size);
        let group = moe::group_tokens(self.opts.moe_group_tokens, self.seq_len, sizes);
        let (h, f, ne, kk) = moe::dims(e, self.tp, self.ep);
        let rows = D::act_len(&x) / h;
        let m = moe::route_dims(rows, h, ne, kk);
        let mut probs = self.zeros_f32(rows * ne)?;
        let mut idx = self.ids(rows * kk)?;
        let mut wts = self.zeros_f32(rows * kk)?;
        let mut disp = self.zeros(rows * kk * h)?;
        let mut perm = self.ids(rows * kk)?;
        let mut counts = vec![0usize; ne];
        if rows > 0 {
            self.dev
                .moe_route(&m, &logits, &mut probs, &mut idx, &mut wts)
                .map_err(&err)?;
            counts = self
                .dev
                .moe_dispatch(&m, &x, &idx, &mut disp, &mut perm)
                .map_err(&err)?;
        }
        // Capacity: which slots each expert keeps depends on their token order.
        let padding = if rows > 0 && e.capacity(group as u64).is_some() {
            let perm_host = self.dev.ids_download(&perm).map_err(&err)?;
            moe::capacity_padding(e, group, &counts, &perm_host, kk, rows)?
        } else {
            None
        };
        let pad = match &padding {
            Some(p) => Some((self.ids_of(&p.pad_index())?, self.ids_of(&p.unpad_index())?)),
            None => None,
        };
        let (send, send_counts) = match (&padding, &pad) {
            (Some(p), Some((to_pad, _))) => (self.gather(&disp, to_pad, h)?, p.counts()),
            _ => (disp, counts),
        };
        self.expert_slots.0 += (rows * kk) as u64;
        if let Some(p) = &padding {
            self.expert_slots.1 += p.at.iter().filter(|&&a| a == Padding::DROPPED).count() as u64;
        }
        let group = self.ep_group()?;
        let place = moe::Place {
            tp: self.tp,
            ep: self.ep,
            group: group.as_ref(),
        };
        let route = moe::route_of(
            self.comm.as_mut(),
            &place,
            &send_counts,
            ne,
            padding.is_some(),
        )?;
        let (local_rows, order) = if route.is_local() {
            (send, None)
        } else {
            let src_major = self.exchange_rows(&send, &route, h, false)?;
            let to_em = self.ids_of(&route.expert_major_index())?;
            let to_sm = self.ids_of(&route.source_major_index())?;
            (self.gather(&src_major, &to_em, h)?, Some((to_em, to_sm)))
        };
        let local_counts = route.local_counts();
        let (y, ups, acts) = self.local_experts(op, e, l, f, &local_rows, &local_counts)?;
        let back = match &order {
            Some((_, to_sm)) => {
                let sm = self.gather(&y, to_sm, h)?;
                self.exchange_rows(&sm, &route, h, true)?
            }
            None => y,
        };
        let y_disp = match &pad {
            Some((_, from_pad)) => self.gather(&back, from_pad, h)?,
            None => back,
        };
        let mut out = self.zeros(rows * h)?;
        if rows > 0 {
            self.dev
                .moe_combine(&m, &y_disp, &perm, &wts, &mut out)
                .map_err(&err)?;
        }
        let out_name = op
            .outputs
            .first()
            .map(|&o| self.name_of(o))
            .unwrap_or_default();
        t.acts.insert((l, out_name), Arc::new(out));
        t.experts.insert(
            (l, op.name.clone()),
            Kept {
                probs,
                idx,
                wts,
                perm,
                local_rows,
                local_counts,
                ups,
                acts,
                y_disp,
                route,
                moves: Moves { pad, order },
            },
        );
        Ok(())
    }

    /// Each local expert's MLP (`f` wide) on its rows, as spans of the stacked
    /// weights: outputs, up projections and activations, rows expert-major.
    fn local_experts(
        &self,
        op: &Op,
        e: &ExpertsShape,
        l: u64,
        f: usize,
        rows: &D::Act,
        counts: &[usize],
    ) -> Result<Mlp<D>, RankError> {
        let weights = (self.weight(op.inputs[2], l)?, self.weight(op.inputs[3], l)?);
        moe::local_mlp(&self.dev, e, f, rows, counts, weights).map_err(derr(&op.name))
    }

    /// The experts op's backward: the combine's, the experts' (weight gradients
    /// into their spans of the stacked gradients) and the routing's.
    pub(super) fn experts_backward(
        &mut self,
        op: &Op,
        e: &ExpertsShape,
        l: u64,
        t: &mut Task<D>,
        dy: D::Act,
    ) -> Result<(), RankError> {
        let err = derr(&op.name);
        let Kept {
            probs,
            idx,
            wts,
            perm,
            local_rows,
            local_counts,
            ups,
            acts,
            y_disp,
            route,
            moves,
        } = t.experts.remove(&(l, op.name.clone())).ok_or_else(|| {
            fail(format!(
                "{} (layer {l}): forward state was not kept",
                op.name
            ))
        })?;
        let (h, f, ne, kk) = moe::dims(e, self.tp, self.ep);
        let rows = D::act_len(&dy) / h;
        let m = moe::route_dims(rows, h, ne, kk);
        let mut d_y = self.zeros(D::act_len(&y_disp))?;
        let mut d_w = self.zeros_f32(rows * kk)?;
        if rows > 0 {
            self.dev
                .moe_combine_bwd(&m, (&dy, &y_disp), (&perm, &wts), &mut d_y, &mut d_w)
                .map_err(&err)?;
        }
        // The outputs' gradients travel to the experts as the tokens did.
        let d_y = match &moves.pad {
            Some((to_pad, _)) => self.gather(&d_y, to_pad, h)?,
            None => d_y,
        };
        let d_local = match &moves.order {
            Some((to_em, _)) => {
                let src_major = self.exchange_rows(&d_y, &route, h, false)?;
                self.gather(&src_major, to_em, h)?
            }
            None => d_y,
        };
        let gated = e.mlp == MlpKind::Swiglu;
        let up_w = if gated { 2 * f } else { f };
        let total: usize = local_counts.iter().sum();
        let (ku, kd) = (self.wkey(op.inputs[2], l)?, self.wkey(op.inputs[3], l)?);
        let missing = || fail(format!("{}: expert weights or gradients missing", op.name));
        let mut d_act = self.zeros(total * f)?;
        {
            let w_down = operand::<D>(&self.master, &self.compute, &kd)?;
            let gd = self.wgrads.get_mut(&kd).ok_or_else(missing)?;
            let (x, dy) = (&acts, &d_local);
            linear_spans_bwd(
                &self.dev,
                &local_counts,
                (f, h),
                (x, w_down, dy),
                (&mut d_act, gd),
            )
            .map_err(&err)?;
        }
        let mut d_up = self.zeros(total * up_w)?;
        if gated {
            self.dev
                .swiglu_bwd(&ups, &d_act, total, f, &mut d_up)
                .map_err(&err)?;
        } else {
            self.dev.gelu_bwd(&ups, &d_act, &mut d_up).map_err(&err)?;
        }
        let mut d_rows = self.zeros(total * h)?;
        {
            let w_up = operand::<D>(&self.master, &self.compute, &ku)?;
            let gu = self.wgrads.get_mut(&ku).ok_or_else(missing)?;
            let (x, dy) = (&local_rows, &d_up);
            linear_spans_bwd(
                &self.dev,
                &local_counts,
                (h, up_w),
                (x, w_up, dy),
                (&mut d_rows, gu),
            )
            .map_err(&err)?;
        }
        let d_disp = match &moves.order {
            Some((_, to_sm)) => {
                let sm = self.gather(&d_rows, to_sm, h)?;
                self.exchange_rows(&sm, &route, h, true)?
            }
            None => d_rows,
        };
        let d_disp = match &moves.pad {
            Some((_, from_pad)) => self.gather(&d_disp, from_pad, h)?,
            None => d_disp,
        };
        let mut dx = self.zeros(rows * h)?;
        let mut d_logits = self.zeros(rows * ne)?;
        if rows > 0 {
            self.dev
                .moe_dispatch_bwd(&m, &d_disp, &perm, &mut dx)
                .map_err(&err)?;
            self.dev
                .moe_route_bwd(&m, (&probs, &idx, &wts), &d_w, &mut d_logits)
                .map_err(&err)?;
        }
        let x_name = self.name_of(op.inputs[0]);
        let g_name = self.name_of(op.inputs[1]);
        // Split over tp, each rank's experts give a partial input gradient (and,
        // under sequence parallelism, partial router scores for every token: the
        // plan reduce-scatters them before the router's backward).
        if self.ep.size == 1 && self.tp.size > 1 {
            self.add_partial(t, l, x_name, dx)?;
            if self.sp {
                self.add_partial(t, l, g_name, d_logits)?;
            } else {
                self.add_grad(t, l, g_name, d_logits)?;
            }
        } else {
            self.add_grad(t, l, x_name, dx)?;
            self.add_grad(t, l, g_name, d_logits)?;
        }
        Ok(())
    }

    /// Whether `op` is a router whose experts split over tp without sequence
    /// parallelism: its input gradient is partial until the program sums it.
    pub(super) fn routes_split_experts(&self, op: &Op) -> bool {
        self.ep.size <= 1
            && self.tp.size > 1
            && !self.sp
            && op.outputs.first().is_some_and(|out| {
                self.graph
                    .segments
                    .iter()
                    .flat_map(|s| &s.ops)
                    .any(|o| matches!(o.kind, OpKind::Experts(_)) && o.inputs.get(1) == Some(out))
            })
    }

    fn ids(&self, n: usize) -> Result<D::Ids, RankError> {
        self.ids_of(&vec![0u32; n])
    }

    fn ids_of(&self, host: &[u32]) -> Result<D::Ids, RankError> {
        self.dev.ids_upload(host).map_err(derr("experts"))
    }
}

/// The backward of [`moe::linear_spans`]: per expert, `dx = dy w[j]ᵀ` (written) and
/// `dw[j] += xᵀ dy`.
fn linear_spans_bwd<D: Device>(
    dev: &D,
    counts: &[usize],
    (k, cols): (usize, usize),
    (x, w, dy): (&D::Act, &D::Act, &D::Act),
    (dx, dw): (&mut D::Act, &mut D::F32),
) -> DResult<()> {
    for (j, off, n) in moe::spans(counts) {
        let data = GemmAt {
            ta: Transpose::No,
            tb: Transpose::Yes,
            m: n,
            k: cols,
            n: k,
            a_off: off * cols,
            b_off: j * k * cols,
            c_off: off * k,
        };
        dev.matmul_at(&data, dy, w, dx)?;
        let weight = GemmAt {
            ta: Transpose::Yes,
            tb: Transpose::No,
            m: k,
            k: n,
            n: cols,
            a_off: off * k,
            b_off: off * cols,
            c_off: j * k * cols,
        };
        dev.matmul_acc_at(&weight, x, dy, dw)?;
    }
    Ok(())
}
