//! LayerNorm and RMSNorm: forward keeping their statistics, backward from them.

use super::*;

impl<D: Device> DevRank<'_, D> {
    pub(super) fn norm_fwd(
        &mut self,
        op: &Op,
        kind: &NormKind,
        l: u64,
        t: &mut Task<D>,
    ) -> Res<D::Act> {
        let x = self.act(t, l, op.inputs[0])?;
        let w = self.weight(op.inputs[1], l)?;
        let b = self.bias(op, l)?;
        let (y, mean, rstd) = self.site().norm(op, *kind, &x, w, b)?;
        if let Some(mean) = mean {
            t.stats.insert((l, op.name.clone(), Stat::Mean), mean);
        }
        t.stats.insert((l, op.name.clone(), Stat::Rstd), rstd);
        Ok(y)
    }

    pub(super) fn norm_bwd(
        &mut self,
        op: &Op,
        kind: &NormKind,
        l: u64,
        t: &mut Task<D>,
        dy: D::Act,
    ) -> Res {
        let in0 = self.name_of(op.inputs[0]);
        let e = derr(&op.name);
        let dev = &self.dev;
        let x = self.act(t, l, op.inputs[0])?;
        let dim = fixed_shape(self.graph.tensor(op.inputs[1]))?[0];
        let rows = D::act_len(&x) / dim;
        let mut dx = self.zeros(D::act_len(&x))?;
        let wkey = self.wkey(op.inputs[1], l)?;
        let bkey = op.inputs.get(2).map(|&b| self.wkey(b, l)).transpose()?;
        let held = (&self.weights.master, &self.weights.compute);
        let w = operand::<D>(held, &wkey)?;
        let rstd = stat(t, l, &op.name, Stat::Rstd)?;
        // Taken out (made first where missing) to be held beside the bias's.
        grad_in(&self.dev, &mut self.weights.wgrads, held, &wkey)?;
        let mut dw =
            (self.weights.wgrads.remove(&wkey)).ok_or_else(|| fail("norm gradient missing"))?;
        let layer = *kind == NormKind::Layernorm;
        let mean = layer
            .then(|| stat(t, l, &op.name, Stat::Mean))
            .transpose()?;
        // A bias-less norm's bias gradient goes to a scratch buffer.
        let mut scratch = (layer && bkey.is_none())
            .then(|| self.zeros_f32(dim))
            .transpose()?;
        let db = match &bkey {
            Some(k) => Some(grad_in(&self.dev, &mut self.weights.wgrads, held, k)?),
            None => scratch.as_mut(),
        };
        let (x, kind, eps) = (&*x, *kind, self.graph.constants.norm_eps as f32);
        let n = Norm {
            kind,
            x,
            w,
            b: None,
            rows,
            dim,
            eps,
        };
        let g = NormBwd {
            mean,
            rstd,
            dy: &dy,
            dx: &mut dx,
            dw: &mut dw,
            db,
        };
        let r = dev.norm_bwd(&n, g);
        self.weights.wgrads.insert(wkey, dw);
        r.map_err(&e)?;
        self.add_grad(t, l, in0, dx)
    }
}
