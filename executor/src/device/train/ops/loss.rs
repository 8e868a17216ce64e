//! The cross-entropy loss: whole, or (vocabulary-parallel) its first part, the
//! program's collectives on its statistics finishing it.

use super::*;

impl<D: Device> DevRank<'_, D> {
    pub(super) fn loss_fwd(&mut self, op: &Op, l: u64, t: &mut Task<D>) -> Res {
        let e = derr(&op.name);
        let logits = self.masked_logits(op, l, t)?;
        let dev = &self.dev;
        let rows = self.rows();
        if op.role == TpRole::VocabLoss && self.tp.size > 1 {
            // Each rank holds a slice of the vocabulary: the program's
            // collectives on the loss's statistics finish it
            // (`loss_collective`).
            let mut max = self.zeros_f32(rows)?;
            let c = self.ce(&logits, &t.batch.labels, 0, 1.0);
            dev.ce_row_max(&c, &mut max).map_err(&e)?;
            t.loss_stats
                .insert((l, op.name.clone(), LossStat::Max), max);
            return Ok(());
        }
        let scale = self.loss_scale();
        let mut loss = self.zeros_f32(rows)?;
        let mut dlogits = self.zeros(D::act_len(&logits))?;
        let c = self.ce(&logits, &t.batch.labels, 0, scale as f32);
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

    /// The loss's logits with the padded vocabulary's columns
    /// (`make_vocab_size_divisible_by`) at -inf, in place: they are no token, so
    /// they drop out of the softmax (`exp(-inf) = 0`) and get a zero gradient,
    /// and the loss is the unpadded model's.
    fn masked_logits(&mut self, op: &Op, l: u64, t: &mut Task<D>) -> Res<Arc<D::Act>> {
        let logits = self.act(t, l, op.inputs[0])?;
        let OpKind::CrossEntropy { vocab } = op.kind else {
            return Ok(logits);
        };
        let v_local = D::act_len(&logits) / self.rows().max(1);
        let sharded = op.role == TpRole::VocabLoss && self.tp.size > 1;
        let start = if sharded { self.tp.rank * v_local } else { 0 };
        let real = (vocab as usize).saturating_sub(start).min(v_local);
        if real == v_local {
            return Ok(logits);
        }
        if real == 0 {
            // The statistics' sums would hold -inf - -inf.
            return Err(fail(format!(
                "`{}`: tensor rank {} holds only padded vocabulary columns ({start}..{}, the tokens end at {vocab}); use a smaller make_vocab_size_divisible_by or tp",
                op.name,
                self.tp.rank,
                start + v_local
            )));
        }
        let e = derr(&op.name);
        if (self.fixed.vocab_mask.as_ref()).is_none_or(|m| D::act_len(m) != v_local) {
            let mut mask = vec![0.0f32; v_local];
            mask[real..].fill(f32::NEG_INFINITY);
            self.fixed.vocab_mask = Some(self.dev.act_from_host(mask).map_err(&e)?);
        }
        let key = (l, self.name_of(op.inputs[0]));
        drop(logits);
        let held = t.acts.remove(&key).ok_or_else(|| fail("the logits went"))?;
        let mut y = match Arc::try_unwrap(held) {
            Ok(y) => y,
            Err(shared) => {
                let n = D::act_len(&shared);
                let mut y = self.zeros(n)?;
                self.dev
                    .act_copy((&shared, 0), (&mut y, 0), n)
                    .map_err(&e)?;
                y
            }
        };
        let mask = (self.fixed.vocab_mask.as_ref()).ok_or_else(|| fail("no vocabulary mask"))?;
        self.dev.bias_add(&mut y, mask).map_err(&e)?;
        let y = Arc::new(y);
        t.acts.insert(key, Arc::clone(&y));
        Ok(y)
    }
}
