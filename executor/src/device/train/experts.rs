//! Routed experts in training: the forward is [`moe::Exec::forward`] (shared with
//! inference), its state kept here for the backward: the combine's, the experts'
//! (weight gradients into their spans of the stacked gradients) and the routing's,
//! the gradients moving between ranks as the tokens did.

use super::*;
use crate::device::CombineBwd;
use crate::moe::{self, Routing};
use meshplan_ir::graph::ExpertsShape;
use meshplan_kernels::cpu::GemmAt;

impl<'a, D: Device> DevRank<'a, D> {
    pub(super) fn experts_forward(
        &mut self,
        op: &Op,
        e: &ExpertsShape,
        l: u64,
        t: &mut Task<D>,
    ) -> Result<(), RankError> {
        moe::check_split(&op.name, self.tp, self.ep, self.mesh.sp)?;
        let x = self.act_gathered(t, l, op.inputs[0])?;
        let logits = self.act_gathered(t, l, op.inputs[1])?;
        let sizes = (self.cp.size, self.tp.size, self.ep.size);
        let group = moe::group_tokens(self.opts.moe_group_tokens, self.sizes.seq_len, sizes);
        let (ku, kd) = (self.wkey(op.inputs[2], l)?, self.wkey(op.inputs[3], l)?);
        let (on, ep_group) = ((&self.dev, self.comm.as_mut()), self.mesh.groups.get("ep"));
        let mut exec = moe::Exec::new(on, (self.tp, self.ep), ep_group, &op.name);
        let held = (&self.weights.master, &self.weights.compute);
        let weights = (operand::<D>(held, &ku)?, operand::<D>(held, &kd)?);
        // Every member of the expert group pads the same capacity buffers.
        let routing = Routing {
            group_tokens: Some(group),
            even: true,
        };
        let (out, kept) = exec.forward(e, (&x, &logits), weights, routing)?;
        self.meter.expert_slots.0 += kept.slots.0;
        self.meter.expert_slots.1 += kept.slots.1;
        let out_name = crate::program::output_name(self.graph, op);
        t.acts.insert((l, out_name), Arc::new(out));
        t.experts.insert((l, op.name.clone()), kept);
        Ok(())
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
        let k = t.experts.remove(&(l, op.name.clone())).ok_or_else(|| {
            fail(format!(
                "{} (layer {l}): forward state was not kept",
                op.name
            ))
        })?;
        let (h, _, ne, kk) = moe::dims(e, self.tp, self.ep);
        let rows = D::act_len(&dy) / h;
        let mut d_y = self.zeros(D::act_len(&k.y_disp))?;
        let mut d_w = self.zeros_f32(rows * kk)?;
        if rows > 0 {
            self.dev
                .moe_combine_bwd(
                    &k.routed,
                    CombineBwd {
                        dy: &dy,
                        y: &k.y_disp,
                        d_y: &mut d_y,
                        d_wts: &mut d_w,
                    },
                )
                .map_err(&err)?;
        }
        // The outputs' gradients travel to the experts as the tokens did.
        let (on, group) = ((&self.dev, self.comm.as_mut()), self.mesh.groups.get("ep"));
        let d_local = moe::Exec::new(on, (self.tp, self.ep), group, &op.name)
            .send_to_experts(d_y, &k.route, &k.moves, h)?;
        let d_rows = self.expert_mlps_bwd(op, e, l, &k, d_local)?;
        let (on, group) = ((&self.dev, self.comm.as_mut()), self.mesh.groups.get("ep"));
        let d_disp = moe::Exec::new(on, (self.tp, self.ep), group, &op.name)
            .bring_back(d_rows, &k.route, &k.moves, h)?;
        let mut dx = self.zeros(rows * h)?;
        let mut d_logits = self.zeros(rows * ne)?;
        if rows > 0 {
            self.dev
                .moe_dispatch_bwd(&k.routed, &d_disp, &mut dx)
                .map_err(&err)?;
            self.dev
                .moe_route_bwd(&k.routed, &d_w, &mut d_logits)
                .map_err(&err)?;
        }
        let x_name = self.name_of(op.inputs[0]);
        let g_name = self.name_of(op.inputs[1]);
        // Split over tp, each rank's experts give a partial input gradient (and,
        // under sequence parallelism, partial router scores for every token: the
        // plan reduce-scatters them before the router's backward).
        if self.ep.size == 1 && self.tp.size > 1 {
            self.add_partial(t, l, x_name, dx)?;
            if self.mesh.sp {
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

    /// The backward of this rank's experts' MLPs over the rows they processed:
    /// their weights' gradients accumulated, and the rows' gradient returned.
    fn expert_mlps_bwd(
        &mut self,
        op: &Op,
        e: &ExpertsShape,
        l: u64,
        k: &moe::Kept<D>,
        d_local: D::Act,
    ) -> Res<D::Act> {
        let err = derr(&op.name);
        let (h, f, _, _) = moe::dims(e, self.tp, self.ep);
        let gated = e.mlp == MlpKind::Swiglu;
        let up_w = if gated { 2 * f } else { f };
        let total: usize = k.local_counts.iter().sum();
        let (ku, kd) = (self.wkey(op.inputs[2], l)?, self.wkey(op.inputs[3], l)?);
        let mut d_act = self.zeros(total * f)?;
        self.spans_bwd(
            op,
            (&kd, (f, h)),
            &k.local_counts,
            (&k.acts, &d_local),
            &mut d_act,
        )?;
        let mut d_up = self.zeros(total * up_w)?;
        if gated {
            self.dev
                .swiglu_bwd(&k.ups, &d_act, f, &mut d_up)
                .map_err(&err)?;
        } else {
            self.dev.gelu_bwd(&k.ups, &d_act, &mut d_up).map_err(&err)?;
        }
        let mut d_rows = self.zeros(total * h)?;
        let up = (&ku, (h, up_w));
        self.spans_bwd(op, up, &k.local_counts, (&k.local_rows, &d_up), &mut d_rows)?;
        Ok(d_rows)
    }

    /// [`linear_spans_bwd`] over stacked expert weight `key` (each expert's
    /// `dims`), its gradient accumulated.
    fn spans_bwd(
        &mut self,
        op: &Op,
        (key, dims): (&Key, (usize, usize)),
        counts: &[usize],
        (x, dy): (&D::Act, &D::Act),
        dx: &mut D::Act,
    ) -> Res {
        let held = (&self.weights.master, &self.weights.compute);
        let w = operand::<D>(held, key)?;
        let g = grad_in(&self.dev, &mut self.weights.wgrads, held, key)?;
        linear_spans_bwd(&self.dev, counts, dims, (x, w, dy), (dx, g)).map_err(derr(&op.name))
    }

    /// Whether `op` is a router whose experts split over tp without sequence
    /// parallelism: its input gradient is partial until the program sums it.
    pub(super) fn routes_split_experts(&self, op: &Op) -> bool {
        self.ep.size <= 1
            && self.tp.size > 1
            && !self.mesh.sp
            && op.outputs.first().is_some_and(|out| {
                self.graph
                    .ops()
                    .any(|o| matches!(o.kind, OpKind::Experts(_)) && o.inputs.get(1) == Some(out))
            })
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
        dev.matmul(data, dy, w, dx)?;
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
        dev.matmul_acc(weight, x, dy, dw)?;
    }
    Ok(())
}
