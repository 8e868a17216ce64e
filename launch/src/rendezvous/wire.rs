//! The rendezvous's wire format: frames, their kinds, and the payloads of data,
//! list and abort frames.

use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Kind {
    Hello = 1,
    Welcome = 2,
    Refuse = 3,
    Data = 4,
    Abort = 5,
    Challenge = 6,
    Admit = 7,
}

impl Kind {
    pub(super) fn from_u8(v: u8) -> Option<Kind> {
        [
            Kind::Hello,
            Kind::Welcome,
            Kind::Refuse,
            Kind::Data,
            Kind::Abort,
            Kind::Challenge,
            Kind::Admit,
        ]
        .into_iter()
        .find(|k| *k as u8 == v)
    }
}

/// The operations, as numbered in `data` frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Op {
    Broadcast = 1,
    AllGather = 2,
    Barrier = 3,
}

impl Op {
    pub(super) fn from_u8(v: u8) -> Option<Op> {
        [Op::Broadcast, Op::AllGather, Op::Barrier]
            .into_iter()
            .find(|k| *k as u8 == v)
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Op::Broadcast => "broadcast",
            Op::AllGather => "all_gather",
            Op::Barrier => "barrier",
        }
    }
}

/// A frame read off the wire.
#[derive(Debug)]
pub(super) struct Frame {
    pub(super) kind: Kind,
    pub(super) payload: Vec<u8>,
}

pub(super) enum ReadFail {
    Timeout,
    Closed,
    /// A frame of another protocol version (its number).
    Version(u16),
    Bad(String),
    Io(String),
}

/// Frames from a peer that has proven itself (or from rank 0) carry blobs.
pub(super) const FRAME_BYTES_MAX: usize = BLOB_BYTES_MAX + 64;

pub(super) fn write_frame(
    stream: &mut TcpStream,
    kind: Kind,
    payload: &[u8],
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(HEADER_BYTES + payload.len());
    buf.extend_from_slice(&MAGIC);
    buf.extend_from_slice(&VERSION.to_le_bytes());
    buf.push(kind as u8);
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    stream.write_all(&buf)?;
    stream.flush()
}

/// Reads one frame of at most `max_len` payload bytes before `deadline` (`None`: no
/// deadline beyond the socket's). The length is checked before anything is
/// allocated, so a stranger's header cannot make rank 0 reserve memory.
pub(super) fn read_frame(
    stream: &mut TcpStream,
    deadline: Option<Instant>,
    max_len: usize,
) -> Result<Frame, ReadFail> {
    let mut header = [0u8; HEADER_BYTES];
    read_exact_by(stream, &mut header, deadline)?;
    if header[..4] != MAGIC {
        return Err(ReadFail::Bad(format!(
            "sent bytes that are not a meshplan rendezvous frame (starting {:?})",
            String::from_utf8_lossy(&header[..4])
        )));
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != VERSION {
        return Err(ReadFail::Version(version));
    }
    let kind = Kind::from_u8(header[6])
        .ok_or_else(|| ReadFail::Bad(format!("sent a frame of unknown kind {}", header[6])))?;
    let len = u32::from_le_bytes([header[7], header[8], header[9], header[10]]) as usize;
    if len > max_len {
        return Err(ReadFail::Bad(format!(
            "sent a {kind:?} frame of {len} bytes where at most {max_len} are allowed"
        )));
    }
    let mut payload = vec![0u8; len];
    read_exact_by(stream, &mut payload, deadline)?;
    Ok(Frame { kind, payload })
}

pub(super) fn read_exact_by(
    stream: &mut TcpStream,
    mut buf: &mut [u8],
    deadline: Option<Instant>,
) -> Result<(), ReadFail> {
    while !buf.is_empty() {
        if let Some(d) = deadline {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ReadFail::Timeout);
            }
            stream
                .set_read_timeout(Some(left))
                .map_err(|e| ReadFail::Io(e.to_string()))?;
        }
        match stream.read(buf) {
            Ok(0) => return Err(ReadFail::Closed),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if deadline.is_none() {
                    return Err(ReadFail::Timeout);
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted
                ) =>
            {
                return Err(ReadFail::Closed)
            }
            Err(e) => return Err(ReadFail::Io(e.to_string())),
        }
    }
    Ok(())
}

pub(super) fn data_payload(seq: u64, op: Op, blob: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(9 + blob.len());
    p.extend_from_slice(&seq.to_le_bytes());
    p.push(op as u8);
    p.extend_from_slice(blob);
    p
}

pub(super) fn parse_data(payload: &[u8]) -> Option<(u64, Op, &[u8])> {
    if payload.len() < 9 {
        return None;
    }
    let seq = u64::from_le_bytes(payload[..8].try_into().ok()?);
    Some((seq, Op::from_u8(payload[8])?, &payload[9..]))
}

/// `[count u32][len u32, bytes]...`
pub(super) fn encode_list(blobs: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(blobs.len() as u32).to_le_bytes());
    for b in blobs {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    }
    out
}

pub(super) fn decode_list(mut p: &[u8]) -> Option<Vec<Vec<u8>>> {
    let take_u32 = |p: &mut &[u8]| -> Option<usize> {
        let (h, t) = p.split_at_checked(4)?;
        *p = t;
        Some(u32::from_le_bytes(h.try_into().ok()?) as usize)
    };
    let n = take_u32(&mut p)?;
    let mut out = Vec::with_capacity(n.min(WORLD_MAX));
    for _ in 0..n {
        let len = take_u32(&mut p)?;
        let (b, t) = p.split_at_checked(len)?;
        out.push(b.to_vec());
        p = t;
    }
    p.is_empty().then_some(out)
}

pub(super) fn abort_payload(message: &str, bad_input: bool) -> Vec<u8> {
    let mut p = vec![u8::from(bad_input)];
    p.extend_from_slice(message.as_bytes());
    p
}
