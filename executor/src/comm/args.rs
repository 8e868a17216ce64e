//! Argument checks every communicator makes before a collective, with one wording,
//! so an in-process and an NCCL run refuse the same call the same way.

use super::{CommError, CommKind, Group};

fn invalid(kind: CommKind, detail: String) -> CommError {
    CommError::InvalidArgument { kind, detail }
}

/// This rank's index in `group`.
pub(crate) fn index_in(group: &Group, rank: usize, kind: CommKind) -> Result<usize, CommError> {
    group.index_of(rank).ok_or_else(|| {
        invalid(
            kind,
            format!("rank {rank} is not in group {} {:?}", group.id, group.ranks),
        )
    })
}

/// A group names each rank once, all within a world of `world`.
pub(crate) fn check_members(group: &Group, world: usize, kind: CommKind) -> Result<(), CommError> {
    let mut sorted = group.ranks.clone();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[0] == w[1]) {
        return Err(invalid(
            kind,
            format!("group {} repeats a rank: {:?}", group.id, group.ranks),
        ));
    }
    if let Some(&r) = sorted.last().filter(|&&r| r >= world) {
        return Err(invalid(
            kind,
            format!("group {} names rank {r} in a world of {world}", group.id),
        ));
    }
    Ok(())
}

/// AllGather (`out` holds `n` members' `input`) or ReduceScatter (`input` holds `n`
/// members' worth of `out`).
pub(crate) fn gather_scatter(
    kind: CommKind,
    n: usize,
    input: usize,
    out: usize,
) -> Result<(), CommError> {
    let (which, whole, part) = match kind {
        CommKind::AllGather => ("output", out, input),
        _ => ("input", input, out),
    };
    if whole != n * part {
        return Err(invalid(
            kind,
            format!("{which} holds {whole} elements, expected {n} members x {part}"),
        ));
    }
    Ok(())
}

/// Elements of a reduce-scatter's or an all-gather's result from `input` elements
/// on each of `n` members; a reduce-scatter whose input is not `n` whole parts is
/// refused by [`gather_scatter`].
pub(crate) fn collected_len(kind: CommKind, n: usize, input: usize) -> Result<usize, CommError> {
    match kind {
        CommKind::AllGather => Ok(input * n),
        CommKind::ReduceScatter => Ok(input / n.max(1)),
        other => Err(invalid(
            other,
            "a collective into a new buffer is a reduce-scatter or an all-gather".into(),
        )),
    }
}

/// Broadcast: the root is a member.
pub(crate) fn broadcast(n: usize, root_index: usize) -> Result<(), CommError> {
    if root_index >= n {
        return Err(invalid(
            CommKind::Broadcast,
            format!("root index {root_index} in a group of {n}"),
        ));
    }
    Ok(())
}

/// All-to-All: equal send and receive lengths, split evenly over `n` members.
pub(crate) fn all_to_all(n: usize, send: usize, recv: usize) -> Result<(), CommError> {
    if send != recv || n == 0 || !send.is_multiple_of(n) {
        return Err(invalid(
            CommKind::AllToAll,
            format!(
                "send holds {send} and recv {recv} elements; both must be the same multiple of \
                 {n} members"
            ),
        ));
    }
    Ok(())
}

/// All-to-All-v: one count per member each way, adding up to the buffers.
pub(crate) fn all_to_all_v(
    n: usize,
    (send, send_counts): (usize, &[usize]),
    (recv, recv_counts): (usize, &[usize]),
) -> Result<(), CommError> {
    let kind = CommKind::AllToAllV;
    if send_counts.len() != n || recv_counts.len() != n {
        return Err(invalid(
            kind,
            format!(
                "{} send and {} recv counts for {n} members",
                send_counts.len(),
                recv_counts.len()
            ),
        ));
    }
    if send_counts.iter().sum::<usize>() != send {
        return Err(invalid(
            kind,
            format!("send counts {send_counts:?} do not add up to the {send} elements sent"),
        ));
    }
    if recv_counts.iter().sum::<usize>() != recv {
        return Err(invalid(
            kind,
            format!("recv counts {recv_counts:?} do not add up to the {recv} elements of recv"),
        ));
    }
    Ok(())
}
