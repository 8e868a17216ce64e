//! A rank's snapshot sent to the rank that writes the checkpoint, when every rank
//! is a process of its own (`train_device_rank`): a header offering its pieces, the
//! writer's answer naming those it holds no copy of yet, then each of those
//! pieces' values and moments (`comm::wire`).

use super::{Offered, Piece, RankSnapshot};
use crate::comm::wire::{recv_bytes, recv_values, send_bytes, send_values};
use crate::comm::{CommError, Communicator};
use crate::shard::TpPos;
use serde::{Deserialize, Serialize};

/// Where the values count their bytes: not an axis of the plan's mesh.
const AXIS: &str = "ckpt";

/// Where the headers and the answers to them count theirs.
const HEADER: &str = "ckpt.header";

/// What the receiver needs to rebuild a snapshot: the rank's places on the tensor
/// and expert axes and, per piece, its weight's key, first element and length.
#[derive(Serialize, Deserialize)]
struct Header {
    tp: (usize, usize),
    ep: (usize, usize),
    pieces: Vec<(String, u64, usize, usize)>,
}

/// A rank's offer of its snapshot: its places `(tp, ep)` and its pieces.
pub(crate) struct Offer {
    pub place: (TpPos, TpPos),
    pub pieces: Vec<Offered>,
}

/// Offers rank `to` the pieces of a rank at places `(tp, ep)`: its answer, which
/// of them to send ([`send_pieces`]). A piece the writer holds already (a
/// replica's) is neither read back nor sent.
pub(crate) fn offer<C: Communicator + ?Sized>(
    comm: &mut C,
    to: usize,
    (tp, ep): (TpPos, TpPos),
    pieces: &[Offered],
) -> Result<Vec<bool>, CommError> {
    let header = Header {
        tp: (tp.rank, tp.size),
        ep: (ep.rank, ep.size),
        pieces: (pieces.iter())
            .map(|((name, layer), start, n)| (name.clone(), *layer, *start, *n))
            .collect(),
    };
    let bytes =
        serde_json::to_vec(&header).map_err(|e| internal(format!("checkpoint header: {e}")))?;
    send_bytes(comm, (to, HEADER), &bytes)?;
    let wanted = recv_bytes(comm, (to, HEADER))?;
    if wanted.len() != pieces.len() {
        return Err(internal(format!(
            "rank {to} answered for {} of {} checkpoint pieces",
            wanted.len(),
            pieces.len()
        )));
    }
    Ok(wanted.into_iter().map(|w| w != 0).collect())
}

/// Sends rank `to` the values and moments of `snap`'s pieces: those it asked for.
pub(crate) fn send_pieces<C: Communicator + ?Sized>(
    comm: &mut C,
    to: usize,
    snap: &RankSnapshot,
) -> Result<(), CommError> {
    for p in &snap.pieces {
        for values in [&p.w, &p.m, &p.v] {
            send_values(comm, (to, AXIS), values)?;
        }
    }
    Ok(())
}

/// The offer rank `from` makes with [`offer`].
pub(crate) fn recv_offer<C: Communicator + ?Sized>(
    comm: &mut C,
    from: usize,
) -> Result<Offer, CommError> {
    let bytes = recv_bytes(comm, (from, HEADER))?;
    let header: Header = serde_json::from_slice(&bytes)
        .map_err(|e| internal(format!("rank {from}'s checkpoint header: {e}")))?;
    let place = |(rank, size)| TpPos { rank, size };
    Ok(Offer {
        place: (place(header.tp), place(header.ep)),
        pieces: (header.pieces.into_iter())
            .map(|(name, layer, start, n)| ((name, layer), start, n))
            .collect(),
    })
}

/// Answers rank `from`'s `offer` with the pieces `wanted` marks, and receives
/// them ([`send_pieces`]): its snapshot, less the pieces not wanted.
pub(crate) fn take_offer<C: Communicator + ?Sized>(
    comm: &mut C,
    from: usize,
    offer: Offer,
    wanted: &[bool],
) -> Result<RankSnapshot, CommError> {
    let answer: Vec<u8> = wanted.iter().map(|&w| u8::from(w)).collect();
    send_bytes(comm, (from, HEADER), &answer)?;
    let mut pieces = Vec::new();
    for ((key, start, n), _) in offer.pieces.into_iter().zip(wanted).filter(|(_, w)| **w) {
        let w = recv_values(comm, (from, AXIS), n)?;
        let m = recv_values(comm, (from, AXIS), n)?;
        let v = recv_values(comm, (from, AXIS), n)?;
        pieces.push(Piece {
            key,
            start,
            w,
            m,
            v,
        });
    }
    let (tp, ep) = offer.place;
    Ok(RankSnapshot { tp, ep, pieces })
}

fn internal(detail: String) -> CommError {
    CommError::Internal { detail }
}
