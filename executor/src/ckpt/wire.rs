//! A rank's snapshot sent to the rank that writes the checkpoint, when every rank
//! is a process of its own (`train_device_rank`): a header naming its pieces, then
//! each piece's values and moments (`comm::wire`).

use super::{Piece, RankSnapshot};
use crate::comm::wire::{recv_bytes, recv_values, send_bytes, send_values};
use crate::comm::{CommError, Communicator};
use crate::shard::TpPos;
use serde::{Deserialize, Serialize};

/// Where the messages count their bytes: not an axis of the plan's mesh.
const AXIS: &str = "ckpt";

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
    send_bytes(comm, (to, AXIS), &bytes)?;
    for p in &snap.pieces {
        for values in [&p.w, &p.m, &p.v] {
            send_values(comm, (to, AXIS), values)?;
        }
    }
    Ok(())
}

/// Receives the snapshot rank `from` sends with [`send_snapshot`].
pub(crate) fn recv_snapshot<C: Communicator + ?Sized>(
    comm: &mut C,
    from: usize,
) -> Result<RankSnapshot, CommError> {
    let bytes = recv_bytes(comm, (from, AXIS))?;
    let header: Header = serde_json::from_slice(&bytes).map_err(|e| CommError::Internal {
        detail: format!("rank {from}'s checkpoint header: {e}"),
    })?;
    let mut pieces = Vec::with_capacity(header.pieces.len());
    for (name, layer, start, n) in header.pieces {
        let w = recv_values(comm, (from, AXIS), n)?;
        let m = recv_values(comm, (from, AXIS), n)?;
        let v = recv_values(comm, (from, AXIS), n)?;
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
