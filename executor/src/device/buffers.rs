//! Where a device's buffers live and how they move: [`Buffers`], the half of a
//! [`super::Device`] that allocates, copies, uploads and downloads (the other half
//! is its kernels), and the host devices' buffers, vectors that report each
//! crossing a GPU run would make ([`Crossing`]).

use super::emulate::{Crossing, HostPrecision};
use super::error::range_err;
use super::DResult;
use meshplan_kernels::cpu as k;

/// A device's buffers: their types, and the moves between them and the host.
/// Launches may be asynchronous; a download waits for the work before it.
pub trait Buffers: Send + Sync {
    /// Activations and compute copies of weights (bf16 on a GPU).
    type Act: Send + Sync;
    /// fp32 buffers: master weights, their gradients, AdamW moments, kernel
    /// statistics, losses.
    type F32: Send + Sync;
    /// Token ids, labels, positions.
    type Ids: Send + Sync;
    /// A point on the device's timeline (for traces).
    type Mark: Send;

    /// Bytes per element of [`Buffers::Act`].
    fn act_bytes(&self) -> usize;
    /// The fp32 master itself as the kernels' operand, where the device computes
    /// in fp32 (`HostDevice`): no compute copy is kept beside it, 4 bytes a
    /// parameter saved. `None` where compute copies differ (bf16).
    fn master_as_act(w: &Self::F32) -> Option<&Self::Act> {
        let _ = w;
        None
    }

    /// A zeroed activation buffer of `n` elements.
    fn act_zeros(&self, n: usize) -> DResult<Self::Act>;
    /// A zeroed fp32 buffer.
    fn f32_zeros(&self, n: usize) -> DResult<Self::F32>;
    /// An fp32 buffer holding `host`.
    fn f32_upload(&self, host: &[f32]) -> DResult<Self::F32>;
    /// An id buffer holding `host`.
    fn ids_upload(&self, host: &[u32]) -> DResult<Self::Ids>;
    /// A zeroed id buffer, made where it lives: a kernel's output needs no upload.
    fn ids_zeros(&self, n: usize) -> DResult<Self::Ids>;
    /// The values of an fp32 buffer (waits for the work before it).
    fn f32_download(&self, x: &Self::F32) -> DResult<Vec<f32>>;
    /// The values of an id buffer (waits for the work before it).
    fn ids_download(&self, x: &Self::Ids) -> DResult<Vec<u32>>;
    /// The values of an activation buffer, widened to f32.
    fn act_download(&self, x: &Self::Act) -> DResult<Vec<f32>>;
    /// Elements of an activation buffer.
    fn act_len(x: &Self::Act) -> usize;
    /// Elements of an fp32 buffer.
    fn f32_len(x: &Self::F32) -> usize;
    /// Elements of an id buffer.
    fn ids_len(x: &Self::Ids) -> usize;

    /// `y = x` rounded to the compute precision (a weight's compute copy).
    fn to_act(&self, x: &Self::F32, y: &mut Self::Act) -> DResult<()>;
    /// `y.0[y.1..y.1 + n] = x.0[x.1..x.1 + n]`: `n` elements from buffer `x.0` at
    /// offset `x.1` to buffer `y.0` at offset `y.1`.
    fn f32_copy(&self, x: (&Self::F32, usize), y: (&mut Self::F32, usize), n: usize)
        -> DResult<()>;
    /// A new buffer holding the runs `(x, offset, n)` of `parts` one after
    /// another (a gradient bucket, a ZeRO part). The default zeroes the buffer
    /// and copies each run in; a host device builds its vector without the
    /// zeroing, which a data-parallel step would otherwise pay for every bucket.
    fn f32_concat(&self, parts: &[(&Self::F32, usize, usize)]) -> DResult<Self::F32> {
        let mut y = self.f32_zeros(parts.iter().map(|p| p.2).sum())?;
        let mut at = 0;
        for &(x, off, n) in parts {
            self.f32_copy((x, off), (&mut y, at), n)?;
            at += n;
        }
        Ok(y)
    }
    /// [`Buffers::f32_copy`] on activations.
    fn act_copy(&self, x: (&Self::Act, usize), y: (&mut Self::Act, usize), n: usize)
        -> DResult<()>;
    /// `host` as a compute buffer (rounded to the compute precision). The default
    /// uploads and converts; a host device keeps the vector itself.
    fn act_from_host(&self, host: Vec<f32>) -> DResult<Self::Act> {
        let f = self.f32_upload(&host)?;
        let mut a = self.act_zeros(host.len())?;
        self.to_act(&f, &mut a)?;
        Ok(a)
    }
    /// `buf` grown by `x[off..off + n]` at its end (a KV cache taking a pass's
    /// keys). The default copies into a new buffer; a host vector grows in place.
    fn act_append(&self, buf: &mut Self::Act, x: &Self::Act, at: (usize, usize)) -> DResult<()> {
        let (held, (off, n)) = (Self::act_len(buf), at);
        let mut grown = self.act_zeros(held + n)?;
        self.act_copy((buf, 0), (&mut grown, 0), held)?;
        self.act_copy((x, off), (&mut grown, held), n)?;
        *buf = grown;
        Ok(())
    }

    /// Waits for everything launched so far.
    fn synchronize(&self) -> DResult<()>;
    /// Records a point on the device's timeline after the work launched so far.
    fn mark(&self) -> DResult<Self::Mark>;
    /// Seconds from `a` to `b` (after [`Buffers::synchronize`]).
    fn seconds_between(&self, a: &Self::Mark, b: &Self::Mark) -> DResult<f64>;
    /// Bytes of device memory in use by this process's buffers, where known.
    fn memory_in_use(&self) -> Option<u64>;
}

impl<H: HostPrecision> Buffers for H {
    type Act = Vec<f32>;
    type F32 = Vec<f32>;
    type Ids = Vec<u32>;
    type Mark = std::time::Instant;
    fn act_bytes(&self) -> usize {
        H::ACT_BYTES
    }
    fn master_as_act(w: &Vec<f32>) -> Option<&Vec<f32>> {
        // An fp32 compute copy would equal its master.
        (H::ACT_BYTES == 4).then_some(w)
    }
    fn act_zeros(&self, n: usize) -> DResult<Vec<f32>> {
        Ok(k::zeros(n))
    }
    fn f32_zeros(&self, n: usize) -> DResult<Vec<f32>> {
        Ok(k::zeros(n))
    }
    fn f32_upload(&self, host: &[f32]) -> DResult<Vec<f32>> {
        H::crossed(Crossing::F32Up, host.len());
        Ok(host.to_vec())
    }
    fn ids_upload(&self, host: &[u32]) -> DResult<Vec<u32>> {
        H::crossed(Crossing::IdsUp, host.len());
        Ok(host.to_vec())
    }
    fn ids_zeros(&self, n: usize) -> DResult<Vec<u32>> {
        Ok(vec![0; n])
    }
    fn f32_download(&self, x: &Vec<f32>) -> DResult<Vec<f32>> {
        H::crossed(Crossing::F32Down, x.len());
        Ok(x.clone())
    }
    fn ids_download(&self, x: &Vec<u32>) -> DResult<Vec<u32>> {
        H::crossed(Crossing::IdsDown, x.len());
        Ok(x.clone())
    }
    fn act_download(&self, x: &Vec<f32>) -> DResult<Vec<f32>> {
        H::crossed(Crossing::ActDown, x.len());
        Ok(x.clone())
    }
    fn act_len(x: &Vec<f32>) -> usize {
        x.len()
    }
    fn f32_len(x: &Vec<f32>) -> usize {
        x.len()
    }
    fn ids_len(x: &Vec<u32>) -> usize {
        x.len()
    }
    fn to_act(&self, x: &Vec<f32>, y: &mut Vec<f32>) -> DResult<()> {
        k::check_len("y", y.len(), x.len())?;
        y.copy_from_slice(x);
        H::round(y);
        Ok(())
    }
    fn f32_copy(&self, x: (&Vec<f32>, usize), y: (&mut Vec<f32>, usize), n: usize) -> DResult<()> {
        let s = (x.0)
            .get(x.1..x.1 + n)
            .ok_or_else(|| range_err("f32_copy source"))?;
        (y.0)
            .get_mut(y.1..y.1 + n)
            .ok_or_else(|| range_err("f32_copy destination"))?
            .copy_from_slice(s);
        Ok(())
    }
    fn f32_concat(&self, parts: &[(&Vec<f32>, usize, usize)]) -> DResult<Vec<f32>> {
        let mut y = Vec::with_capacity(parts.iter().map(|p| p.2).sum());
        for &(x, off, n) in parts {
            let run = x.get(off..off + n);
            y.extend_from_slice(run.ok_or_else(|| range_err("f32_concat source"))?);
        }
        Ok(y)
    }
    fn act_copy(&self, x: (&Vec<f32>, usize), y: (&mut Vec<f32>, usize), n: usize) -> DResult<()> {
        self.f32_copy(x, y, n)
    }
    fn act_from_host(&self, mut host: Vec<f32>) -> DResult<Vec<f32>> {
        H::crossed(Crossing::ActUp, host.len());
        H::round(&mut host);
        Ok(host)
    }
    fn act_append(&self, buf: &mut Self::Act, x: &Self::Act, at: (usize, usize)) -> DResult<()> {
        let s = x
            .get(at.0..at.0 + at.1)
            .ok_or_else(|| range_err("act_append source"))?;
        buf.extend_from_slice(s);
        Ok(())
    }
    fn synchronize(&self) -> DResult<()> {
        Ok(())
    }
    fn mark(&self) -> DResult<std::time::Instant> {
        Ok(std::time::Instant::now())
    }
    fn seconds_between(&self, a: &std::time::Instant, b: &std::time::Instant) -> DResult<f64> {
        Ok(b.saturating_duration_since(*a).as_secs_f64())
    }
    fn memory_in_use(&self) -> Option<u64> {
        None
    }
}
