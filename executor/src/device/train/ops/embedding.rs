//! Embedding lookups: forward from the rows' ids, backward into the table's
//! gradient.

use super::*;

impl<D: Device> DevRank<'_, D> {
    pub(super) fn embedding_fwd(
        &mut self,
        op: &Op,
        l: u64,
        t: &mut Task<D>,
        out_rows: usize,
    ) -> Res<D::Act> {
        let all = self.rows();
        let rows = if out_rows > 0 && out_rows < all && op.role != TpRole::VocabEmbedding {
            out_rows
        } else {
            all
        };
        let ids = self.lookup_ids(op, t, rows)?;
        self.site()
            .embedding(op, ids, self.weight(op.inputs[1], l)?, rows)
    }

    pub(super) fn embedding_bwd(&mut self, op: &Op, l: u64, t: &mut Task<D>, dy: D::Act) -> Res {
        let e = derr(&op.name);
        let dev = &self.dev;
        let dim = *fixed_shape(self.graph.tensor(op.inputs[1]))?
            .last()
            .unwrap_or(&1);
        let key = self.wkey(op.inputs[1], l)?;
        let ids = self.lookup_ids(op, t, D::act_len(&dy) / dim.max(1))?;
        let start = self.site().vocab_start(op)?;
        let held = (&self.weights.master, &self.weights.compute);
        let dt = grad_in(dev, &mut self.weights.wgrads, held, &key)?;
        dev.embedding_bwd(
            &Embed {
                ids,
                vocab_start: start,
                dim,
            },
            &dy,
            dt,
        )
        .map_err(&e)
    }
}
