//! Linear layers (`Matmul` ops): `y = x w` (or `x wᵀ`) plus a bias, the input's
//! gradient (partial where the op is split) and the weight's.

use super::*;

impl<D: Device> DevRank<'_, D> {
    /// A linear op's input: a column-parallel op (or the vocabulary head) reads it
    /// gathered over the tensor axis under sequence parallelism.
    fn linear_input(&self, op: &Op, l: u64, t: &Task<D>) -> Res<Arc<D::Act>> {
        if matches!(op.role, TpRole::ColumnParallel | TpRole::VocabHead) {
            self.act_gathered(t, l, op.inputs[0])
        } else {
            self.act(t, l, op.inputs[0])
        }
    }

    pub(super) fn linear_fwd(&mut self, op: &Op, l: u64, t: &mut Task<D>) -> Res<D::Act> {
        let x = self.linear_input(op, l, t)?;
        let w = self.weight(op.inputs[1], l)?;
        let b = self.bias(op, l)?;
        self.site().linear(op, &x, w, b)
    }

    pub(super) fn linear_bwd(&mut self, op: &Op, l: u64, t: &mut Task<D>, dy: D::Act) -> Res {
        let in0 = self.name_of(op.inputs[0]);
        let e = derr(&op.name);
        let dev = &self.dev;
        let x = self.linear_input(op, l, t)?;
        let wkey = self.wkey(op.inputs[1], l)?;
        let held = (&self.weights.master, &self.weights.compute);
        let w = operand::<D>(held, &wkey)?;
        let (kk, n) = self.site().matmul_dims(op, w)?;
        let rows = D::act_len(&x) / kk.max(1);
        let dw = grad_in(dev, &mut self.weights.wgrads, held, &wkey)?;
        // The two products are independent: side by side on a host's threads.
        let (dx, acc) = if crate::shard::weight_transposed(op) {
            // `y = x wᵀ` with `w [n, k]`: `dx = dy w`, `dw += dyᵀ x`.
            dev.side_by_side(
                || dev.matmul_new(GemmAt::whole(No, No, rows, n, kk), &dy, w),
                || dev.matmul_acc(GemmAt::whole(Yes, No, n, rows, kk), &dy, &x, dw),
            )
        } else {
            dev.side_by_side(
                || dev.matmul_new(GemmAt::whole(No, Yes, rows, n, kk), &dy, w),
                || dev.matmul_acc(GemmAt::whole(Yes, No, kk, rows, n), &x, &dy, dw),
            )
        };
        let dx = dx.map_err(&e)?;
        acc.map_err(&e)?;
        if let Some(&b) = op.inputs.get(2) {
            let bk = self.wkey(b, l)?;
            let db = grad_in(dev, &mut self.weights.wgrads, held, &bk)?;
            dev.bias_grad(&dy, db).map_err(&e)?;
        }
        // A split op's input gradient is partial until the program sums it.
        if (matches!(op.role, TpRole::ColumnParallel | TpRole::VocabHead)
            || self.routes_split_experts(op))
            && self.tp.size > 1
        {
            self.add_partial(t, l, in0, dx)
        } else {
            self.add_grad(t, l, in0, dx)
        }
    }
}
