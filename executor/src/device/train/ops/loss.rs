//! The cross-entropy loss: whole, or (vocabulary-parallel) its first part, the
//! program's collectives on its statistics finishing it.

use super::*;

impl<D: Device> DevRank<'_, D> {
    pub(super) fn loss_fwd(&mut self, op: &Op, l: u64, t: &mut Task<D>) -> Res {
        let e = derr(&op.name);
        let dev = &self.dev;
        let logits = self.act(t, l, op.inputs[0])?;
        let rows = self.rows();
        if op.role == TpRole::VocabLoss && self.tp.size > 1 {
            // Each rank holds a slice of the vocabulary: the program's
            // collectives on the loss's statistics finish it
            // (`loss_collective`).
            let mut max = self.zeros_f32(rows)?;
            let c = self.ce(&logits, &t.labels, 0, 1.0);
            dev.ce_row_max(&c, &mut max).map_err(&e)?;
            t.loss_stats
                .insert((l, op.name.clone(), LossStat::Max), max);
            return Ok(());
        }
        let scale = self.loss_scale();
        let mut loss = self.zeros_f32(rows)?;
        let mut dlogits = self.zeros(D::act_len(&logits))?;
        let c = self.ce(&logits, &t.labels, 0, scale as f32);
        let out = CeOut {
            loss: &mut loss,
            dlogits: &mut dlogits,
        };
        dev.cross_entropy(&c, out).map_err(&e)?;
        // Read at the end of the step: a download here would stall the
        // launches of the backward behind the forward's kernels. Every
        // tensor rank computes the same loss; the first reports it.
        if self.tp.rank == 0 {
            self.meter.losses.push(loss);
        }
        // The backward is done: the gradient waits for the backward pass.
        t.saved
            .insert((l, op.name.clone(), Saved::LogitsGrad), Arc::new(dlogits));
        Ok(())
    }
}
