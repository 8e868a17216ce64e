//! Host data of any kind between processes over a [`Communicator`] (a checkpoint's
//! snapshots, `--check`'s final weights, both to rank 0 of a launch): bytes as the
//! bit patterns of fp32 values, which a communicator copies unchanged, and long
//! value vectors in messages of at most [`CHUNK`] values, so that a communicator
//! staging host buffers through GPU memory (NCCL's) needs room for one chunk only.

use super::{CommError, Communicator};

/// Values per message: 256 MiB of fp32.
pub(crate) const CHUNK: usize = 64 << 20;

/// Sends `bytes` to rank `to`: their length, then the bytes.
pub(crate) fn send_bytes<C: Communicator + ?Sized>(
    comm: &mut C,
    (to, axis): (usize, &str),
    bytes: &[u8],
) -> Result<(), CommError> {
    let len = u32::try_from(bytes.len()).map_err(|_| CommError::Internal {
        detail: format!("a message of {} bytes", bytes.len()),
    })?;
    comm.send(to, axis, &[f32::from_bits(len)])?;
    let words: Vec<f32> = bytes
        .chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            f32::from_bits(u32::from_le_bytes(b))
        })
        .collect();
    comm.send(to, axis, &words)
}

/// The bytes rank `from` sends with [`send_bytes`].
pub(crate) fn recv_bytes<C: Communicator + ?Sized>(
    comm: &mut C,
    (from, axis): (usize, &str),
) -> Result<Vec<u8>, CommError> {
    let mut len = [0.0f32];
    comm.recv(from, axis, &mut len)?;
    let len = len[0].to_bits() as usize;
    let mut words = vec![0.0f32; len.div_ceil(4)];
    comm.recv(from, axis, &mut words)?;
    let mut bytes: Vec<u8> = words
        .iter()
        .flat_map(|x| x.to_bits().to_le_bytes())
        .collect();
    bytes.truncate(len);
    Ok(bytes)
}

/// Sends `values` to rank `to` in chunks; the receiver knows their number.
pub(crate) fn send_values<C: Communicator + ?Sized>(
    comm: &mut C,
    (to, axis): (usize, &str),
    values: &[f32],
) -> Result<(), CommError> {
    for chunk in values.chunks(CHUNK) {
        comm.send(to, axis, chunk)?;
    }
    Ok(())
}

/// The `n` values rank `from` sends with [`send_values`].
pub(crate) fn recv_values<C: Communicator + ?Sized>(
    comm: &mut C,
    (from, axis): (usize, &str),
    n: usize,
) -> Result<Vec<f32>, CommError> {
    let mut v = vec![0.0f32; n];
    for chunk in v.chunks_mut(CHUNK) {
        comm.recv(from, axis, chunk)?;
    }
    Ok(v)
}
