//! A rank's snapshot sent to the rank that writes the checkpoint, when every rank
//! is a process of its own (`train_device_rank`): a header naming its pieces, then
//! each piece's values and moments in messages of at most [`CHUNK`] values, so
//! that a communicator staging host buffers through GPU memory (NCCL's) never
//! needs more than one chunk of room for it.

use super::{Piece, RankSnapshot};
use crate::comm::{CommError, Communicator};
use crate::shard::TpPos;
use serde::{Deserialize, Serialize};

/// Values per message: 256 MiB of fp32.
const CHUNK: usize = 64 << 20;

/// Where the messages count their bytes: not an axis of the plan's mesh.
pub(crate) const AXIS: &str = "ckpt";

/// What the receiver needs to rebuild a snapshot: the rank's places on the tensor
/// and expert axes and, per piece, its weight's key, first element and length.
#[derive(Serialize, Deserialize)]
struct Header {
    tp: (usize, usize),
    ep: (usize, usize),
    pieces: Vec<(String, u64, usize, usize)>,
}

/// Sends `snap` to rank `to`.
pub(crate) fn send_snapshot<C: Communicator + ?Sized>(
    comm: &mut C,
    to: usize,
    snap: &RankSnapshot,
) -> Result<(), CommError> {
    let header = Header {
        tp: (snap.tp.rank, snap.tp.size),
        ep: (snap.ep.rank, snap.ep.size),
        pieces: (snap.pieces.iter())
            .map(|p| (p.key.0.clone(), p.key.1, p.start, p.w.len()))
            .collect(),
    };
    let bytes = serde_json::to_vec(&header).map_err(|e| CommError::Internal {
        detail: format!("checkpoint header: {e}"),
    })?;
    let len = u32::try_from(bytes.len()).map_err(|_| CommError::Internal {
        detail: format!("a checkpoint header of {} bytes", bytes.len()),
    })?;
    comm.send(to, AXIS, &[f32::from_bits(len)])?;
    comm.send(to, AXIS, &words(&bytes))?;
    for p in &snap.pieces {
        for values in [&p.w, &p.m, &p.v] {
            for chunk in values.chunks(CHUNK) {
                comm.send(to, AXIS, chunk)?;
            }
        }
    }
    Ok(())
}

/// Receives the snapshot rank `from` sends with [`send_snapshot`].
pub(crate) fn recv_snapshot<C: Communicator + ?Sized>(
    comm: &mut C,
    from: usize,
) -> Result<RankSnapshot, CommError> {
    let mut len = [0.0f32];
    comm.recv(from, AXIS, &mut len)?;
    let len = len[0].to_bits() as usize;
    let mut w = vec![0.0f32; len.div_ceil(4)];
    comm.recv(from, AXIS, &mut w)?;
    let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
    let header: Header =
        serde_json::from_slice(&bytes[..len]).map_err(|e| CommError::Internal {
            detail: format!("rank {from}'s checkpoint header: {e}"),
        })?;
    let mut pieces = Vec::with_capacity(header.pieces.len());
    for (name, layer, start, n) in header.pieces {
        let mut values = || -> Result<Vec<f32>, CommError> {
            let mut v = vec![0.0f32; n];
            for chunk in v.chunks_mut(CHUNK) {
                comm.recv(from, AXIS, chunk)?;
            }
            Ok(v)
        };
        let (w, m, v) = (values()?, values()?, values()?);
        pieces.push(Piece {
            key: (name, layer),
            start,
            w,
            m,
            v,
        });
    }
    let place = |(rank, size)| TpPos { rank, size };
    Ok(RankSnapshot {
        tp: place(header.tp),
        ep: place(header.ep),
        pieces,
    })
}

/// `bytes` as the bit patterns of fp32 values (4 a value, zero padded): a
/// communicator copies them unchanged.
fn words(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            f32::from_bits(u32::from_le_bytes(b))
        })
        .collect()
}
