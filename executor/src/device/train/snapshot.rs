//! This rank's part of a checkpoint: offered as (weight, first element, length)
//! before anything is read back, so that the device copies back only the pieces the
//! writer holds no copy of.

use super::step::pieces_of;
use super::*;
use crate::ckpt::{Offered, Piece, RankSnapshot};
use crate::device::Buffers;
use std::collections::hash_map::Entry;

/// Where an offered piece's values are: a whole weight with its moments, or
/// `(part, offset)` in one of the flat parts of [`DevRank::parts`].
type Source = Option<(usize, usize)>;

/// A flat range of weights with its moments: its layout, its first element, its
/// moments and the part of the masters it holds, if the masters are not whole.
type Part<'r, D> = (
    &'r [(Key, usize)],
    usize,
    &'r Moments<D>,
    Option<&'r <D as Buffers>::F32>,
);

impl<D: Device> DevRank<'_, D> {
    /// The pieces this rank holds at a save: the weights whose moments it holds
    /// (whole weights, or under ZeRO its parts of the flat vector).
    pub(super) fn offer(&self) -> Result<Vec<Offered>, RankError> {
        let parts = self.parts()?;
        Ok(self.sources(&parts).into_iter().map(|(o, _)| o).collect())
    }

    /// The pieces of [`DevRank::offer`] that `wanted` marks, read back with their
    /// weights' values. Under ZeRO each part and each master is read back once,
    /// however many pieces it holds.
    pub(super) fn snapshot(&self, wanted: &[bool]) -> Result<RankSnapshot, RankError> {
        let e = derr("checkpoint");
        let down = |x: &D::F32| self.dev.f32_download(x).map_err(&e);
        let missing = || fail("checkpoint: a weight or its moments missing");
        let parts = self.parts()?;
        let mut read: HashMap<usize, [Vec<f32>; 3]> = HashMap::new();
        let mut masters: HashMap<Key, Vec<f32>> = HashMap::new();
        let mut pieces = Vec::new();
        let sources = self.sources(&parts).into_iter().zip(wanted);
        for ((key, start, len), from) in sources.filter(|(_, w)| **w).map(|(s, _)| s) {
            let Some((i, dst)) = from else {
                let (m, v) = self.weights.adam.get(&key).ok_or_else(missing)?;
                let w = self.weights.master.get(&key).ok_or_else(missing)?;
                let (w, m, v) = (down(w)?, down(m)?, down(v)?);
                pieces.push(Piece {
                    key,
                    start,
                    w,
                    m,
                    v,
                });
                continue;
            };
            let [m, v, held] = &*match read.entry(i) {
                Entry::Occupied(read) => read.into_mut(),
                Entry::Vacant(slot) => {
                    let (_, _, (m, v), held) = &parts[i];
                    let held = held.map_or(Ok(Vec::new()), down)?;
                    slot.insert([down(m)?, down(v)?, held])
                }
            };
            let w = if parts[i].3.is_some() {
                held[dst..dst + len].to_vec()
            } else {
                let w = match masters.entry(key.clone()) {
                    Entry::Occupied(w) => w.into_mut(),
                    Entry::Vacant(slot) => {
                        slot.insert(down(self.weights.master.get(&key).ok_or_else(missing)?)?)
                    }
                };
                w[start..start + len].to_vec()
            };
            let (m, v) = (m[dst..dst + len].to_vec(), v[dst..dst + len].to_vec());
            pieces.push(Piece {
                key,
                start,
                w,
                m,
                v,
            });
        }
        Ok(RankSnapshot {
            tp: self.tp,
            ep: self.ep,
            pieces,
        })
    }

    /// Every piece [`DevRank::offer`] offers, with where its values are among
    /// the whole weights and `parts`.
    fn sources(&self, parts: &[Part<'_, D>]) -> Vec<(Offered, Source)> {
        let mut out: Vec<(Offered, Source)> = (self.weights.adam.iter())
            .map(|(key, (m, _))| ((key.clone(), 0, D::f32_len(m)), None))
            .collect();
        for (i, (layout, start, (m, _), _)) in parts.iter().enumerate() {
            for (key, src, dst, len) in pieces_of(layout, *start, start + D::f32_len(m)) {
                out.push(((key, src, len), Some((i, dst))));
            }
        }
        out
    }

    /// ZeRO's flat parts: of the flat vector (ZeRO 1 and 2), where this rank's
    /// masters (or its part of them) are the up-to-date ones, and under ZeRO-3 of
    /// each segment copy's.
    fn parts(&self) -> Result<Vec<Part<'_, D>>, RankError> {
        let mut parts: Vec<Part<'_, D>> = (self.zero.shard_adam.iter())
            .map(|(&(set, start), mv)| {
                let held = self.zero.master_parts.get(&(set, start));
                (self.zero.layout(set), start, mv, held)
            })
            .collect();
        for (copy, mv) in &self.zero.z3.adam {
            let (layout, start, part) = self.zero.z3.part(*copy)?;
            parts.push((layout.as_slice(), start, mv, Some(part)));
        }
        Ok(parts)
    }
}
