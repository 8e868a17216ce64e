//! Per-rank byte accounting (conventions in the parent module's doc).

use super::CommKind;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Calls and bytes of one (kind, axis).
///
/// Bytes sent are kept exactly: ring volumes such as `2(n-1)/n * B` are fractions
/// for group sizes that do not divide `B`, and summing rounded floats would drift
/// from the planner's figures over a long run. Each group size keeps the integer
/// numerator of its sum over that size as the denominator.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KindCount {
    /// Operations completed.
    pub calls: u64,
    /// Sum of the full buffers `B` of those operations, in bytes (see the module
    /// doc for what `B` is per kind).
    pub payload_bytes: u64,
    /// Numerator of the bytes sent, by denominator.
    sent: BTreeMap<u64, u128>,
}

impl KindCount {
    /// Bytes sent, as the nearest `f64` of each group size's exact sum, added.
    pub fn bytes_sent(&self) -> f64 {
        self.sent
            .iter()
            .map(|(&den, &num)| num as f64 / den as f64)
            .sum()
    }

    fn merge(&mut self, other: &KindCount) {
        self.calls += other.calls;
        self.payload_bytes += other.payload_bytes;
        for (&den, &num) in &other.sent {
            *self.sent.entry(den).or_insert(0) += num;
        }
    }

    /// Takes `part`, counted into these before, back out: [`Self::merge`]'s inverse.
    fn take_out(&mut self, part: &KindCount) {
        self.calls = self.calls.saturating_sub(part.calls);
        self.payload_bytes = self.payload_bytes.saturating_sub(part.payload_bytes);
        for (den, num) in &part.sent {
            if let Some(n) = self.sent.get_mut(den) {
                *n = n.saturating_sub(*num);
            }
        }
    }

    fn add(&mut self, payload_bytes: u64, sent_num: u128, sent_den: u64) {
        self.calls += 1;
        self.payload_bytes += payload_bytes;
        if sent_num > 0 {
            *self.sent.entry(sent_den.max(1)).or_insert(0) += sent_num;
        }
    }
}

/// Per (kind, axis label): calls and bytes this rank sent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ByteCounts {
    entries: BTreeMap<(CommKind, String), KindCount>,
}

impl ByteCounts {
    /// No calls yet.
    pub fn new() -> ByteCounts {
        ByteCounts::default()
    }

    /// Adds one completed operation: `payload_bytes` is its `B`, and it sent
    /// `sent_num / sent_den` bytes.
    pub(crate) fn record(
        &mut self,
        kind: CommKind,
        axis: &str,
        payload_bytes: u64,
        sent_num: u128,
        sent_den: u64,
    ) {
        self.entries
            .entry((kind, axis.to_string()))
            .or_default()
            .add(payload_bytes, sent_num, sent_den);
    }

    /// These counts without `part`, which was counted into them (or, a copy of
    /// them taken earlier: what was counted since).
    pub(crate) fn without(&self, part: &ByteCounts) -> ByteCounts {
        let mut out = self.clone();
        for (key, c) in &part.entries {
            if let Some(o) = out.entries.get_mut(key) {
                o.take_out(c);
            }
        }
        out.entries.retain(|_, c| c.calls > 0);
        out
    }

    /// Every (kind, axis label, count), to rebuild these counts in another process
    /// ([`ByteCounts::from_entries`]).
    pub(crate) fn entries(&self) -> Vec<(CommKind, String, KindCount)> {
        (self.entries.iter())
            .map(|((k, a), c)| (*k, a.clone(), c.clone()))
            .collect()
    }

    /// The counts [`ByteCounts::entries`] listed.
    pub(crate) fn from_entries(entries: Vec<(CommKind, String, KindCount)>) -> ByteCounts {
        ByteCounts {
            entries: entries.into_iter().map(|(k, a, c)| ((k, a), c)).collect(),
        }
    }

    /// Adds one completed collective over `members` of `payload_bytes`, sent as
    /// the cost model's ring counts it ([`ring_bytes`]).
    pub(crate) fn record_ring(
        &mut self,
        kind: CommKind,
        axis: &str,
        members: usize,
        payload_bytes: u64,
    ) {
        let (num, den) = ring_bytes(kind, members, payload_bytes);
        self.record(kind, axis, payload_bytes, num, den);
    }

    /// Adds one point-to-point transfer of `bytes`: a send sends them all, a
    /// receive nothing.
    pub(crate) fn record_p2p(&mut self, kind: CommKind, axis: &str, bytes: u64) {
        let sent = if kind == CommKind::Send { bytes } else { 0 };
        self.record(kind, axis, bytes, u128::from(sent), 1);
    }

    /// Adds one All-to-All(v) of `elems` elements of `size` bytes in which member
    /// `me` sent `send_counts[j]` elements to member `j`: what it sent itself
    /// leaves no wire, so the bytes sent are the others' shares.
    pub(crate) fn record_a2av(
        &mut self,
        axis: &str,
        elems: usize,
        (me, send_counts): (usize, &[usize]),
        size: u64,
    ) {
        let to_others: usize = (send_counts.iter().enumerate())
            .filter(|&(j, _)| j != me)
            .map(|(_, &c)| c)
            .sum();
        let payload = elems as u64 * size;
        let sent = u128::from(to_others as u64 * size);
        self.record(CommKind::AllToAllV, axis, payload, sent, 1);
    }

    /// These counts with every element at `elem_bytes` bytes instead of the 4 of
    /// the `f32` the communicators count in: bytes in the unit of a plan whose
    /// model is in another dtype, so that a run compares with it element for
    /// element whatever precision moved (the CPU's fp32, a GPU's bf16 activations).
    fn at_element_size(mut self, elem_bytes: u64) -> ByteCounts {
        if elem_bytes == 4 {
            return self;
        }
        for c in self.entries.values_mut() {
            c.payload_bytes = c.payload_bytes / 4 * elem_bytes;
            let sent = std::mem::take(&mut c.sent).into_iter();
            c.sent = sent
                .map(|(den, num)| (den * 4, num * u128::from(elem_bytes)))
                .collect();
        }
        self
    }

    /// `at_element_size` for all but `fixed`, a part of these counts
    /// (recorded twice) that the plan prices at 4 bytes an element whatever the
    /// model's dtype: a vocabulary-parallel loss's fp32 statistics.
    pub fn at_element_size_but(self, elem_bytes: u64, fixed: &ByteCounts) -> ByteCounts {
        if elem_bytes == 4 {
            return self;
        }
        let mut rest = self;
        for (key, f) in &fixed.entries {
            if let Some(c) = rest.entries.get_mut(key) {
                c.take_out(f);
            }
        }
        let mut out = rest.at_element_size(elem_bytes);
        out.merge(fixed);
        out
    }

    /// Adds another rank's (or phase's) counts to these.
    pub fn merge(&mut self, other: &ByteCounts) {
        for (key, count) in &other.entries {
            self.entries.entry(key.clone()).or_default().merge(count);
        }
    }

    /// Every (kind, axis, count), ordered by kind then axis.
    pub fn iter(&self) -> impl Iterator<Item = (CommKind, &str, &KindCount)> {
        self.entries
            .iter()
            .map(|((kind, axis), count)| (*kind, axis.as_str(), count))
    }

    /// Bytes sent per axis label, all kinds together.
    pub fn per_axis(&self) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for ((_, axis), count) in &self.entries {
            *out.entry(axis.clone()).or_insert(0.0) += count.bytes_sent();
        }
        out
    }

    /// Bytes sent on one axis label, all kinds together.
    pub fn axis_bytes_sent(&self, axis: &str) -> f64 {
        self.entries
            .iter()
            .filter(|((_, a), _)| a == axis)
            .map(|(_, c)| c.bytes_sent())
            .sum()
    }
}

/// `label: measured GOT bytes, plan WANT` where the two differ beyond rounding (a
/// relative 1e-9, absolute below one byte).
pub(crate) fn byte_gap(label: impl std::fmt::Display, got: f64, want: f64) -> Option<String> {
    // Both sides are exact sums of a few thousand terms at most, so they differ only
    // by f64 rounding, around 1e-13 of the total: 1e-9 of it lets that pass and
    // still sees a small collective missing beside gigabytes (1 byte in a GB).
    ((got - want).abs() > 1e-9 * want.max(1.0))
        .then(|| format!("{label}: measured {got} bytes, plan {want}"))
}

/// Bytes of `elements` `f32`s.
pub(crate) fn bytes_of(elements: usize) -> u64 {
    (elements as u64) * 4
}

/// Bytes one member sends in a collective of `n` members over a full buffer of
/// `payload` bytes, as `(numerator, denominator)`; the cost model's
/// `bytes_sent_per_rank` (All-to-All-v and point-to-point are counted by their
/// callers).
pub(crate) fn ring_bytes(kind: CommKind, n: usize, payload: u64) -> (u128, u64) {
    if n <= 1 {
        return (0, 1);
    }
    let n = n as u64;
    let b = u128::from(payload);
    let share = u128::from(n - 1) * b;
    match kind {
        CommKind::AllReduce => (2 * share, n),
        CommKind::AllGather | CommKind::ReduceScatter | CommKind::AllToAll => (share, n),
        CommKind::Broadcast => (b, 1),
        CommKind::AllToAllV | CommKind::Send | CommKind::Recv | CommKind::Barrier => (0, 1),
    }
}

/// Exact sums and lookups, which only the tests use.
#[cfg(test)]
mod test_only {
    use super::{ByteCounts, CommKind, KindCount};
    use meshplan_ir::plan::AxisBytes;

    impl KindCount {
        /// Bytes sent as an exact reduced fraction `(numerator, denominator)`; `None`
        /// only if the common denominator overflows `u128`.
        pub fn bytes_sent_exact(&self) -> Option<(u128, u128)> {
            let mut acc: (u128, u128) = (0, 1);
            for (&den, &num) in &self.sent {
                acc = add_fraction(acc, (num, u128::from(den)))?;
            }
            Some(acc)
        }
    }

    fn gcd(mut a: u128, mut b: u128) -> u128 {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    }

    fn add_fraction(a: (u128, u128), b: (u128, u128)) -> Option<(u128, u128)> {
        let g = gcd(a.1, b.1).max(1);
        let den = (a.1 / g).checked_mul(b.1)?;
        let num =
            a.0.checked_mul(b.1 / g)?
                .checked_add(b.0.checked_mul(a.1 / g)?)?;
        let r = gcd(num, den).max(1);
        Some((num / r, den / r))
    }

    impl ByteCounts {
        /// The count of one (kind, axis), if any call was made.
        pub fn get(&self, kind: CommKind, axis: &str) -> Option<&KindCount> {
            self.entries.get(&(kind, axis.to_string()))
        }

        /// Calls of one (kind, axis).
        pub fn calls(&self, kind: CommKind, axis: &str) -> u64 {
            self.get(kind, axis).map_or(0, |c| c.calls)
        }

        /// Bytes sent by one (kind, axis).
        pub fn bytes_sent(&self, kind: CommKind, axis: &str) -> f64 {
            self.get(kind, axis).map_or(0.0, KindCount::bytes_sent)
        }

        /// Bytes sent on one axis label as an exact reduced fraction (`None` on
        /// overflow).
        pub fn axis_bytes_sent_exact(&self, axis: &str) -> Option<(u128, u128)> {
            let mut acc = (0, 1);
            for ((_, a), count) in &self.entries {
                if a == axis {
                    acc = add_fraction(acc, count.bytes_sent_exact()?)?;
                }
            }
            Some(acc)
        }

        /// Bytes per axis in the plan's `comm_bytes_per_gpu` shape; an error names a
        /// label that is not one of `dp`, `tp`, `pp`, `cp`, `ep`.
        pub fn to_axis_bytes(&self) -> Result<AxisBytes, String> {
            let mut out = AxisBytes::default();
            for (axis, bytes) in self.per_axis() {
                let slot = match axis.as_str() {
                    "dp" => &mut out.dp,
                    "tp" => &mut out.tp,
                    "pp" => &mut out.pp,
                    "cp" => &mut out.cp,
                    "ep" => &mut out.ep,
                    other => return Err(format!("bytes counted on unknown axis label `{other}`")),
                };
                *slot += bytes;
            }
            Ok(out)
        }
    }
}
