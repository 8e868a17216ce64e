//! A TCP rendezvous of the processes of one run (std::net only): rank 0 listens on
//! `MASTER_ADDR:MASTER_PORT`, every other rank connects (retrying until the timeout)
//! and proves it belongs to the job; once all have arrived, rank 0 can
//! [`Rendezvous::broadcast`] a blob (the NCCL unique id, 128 bytes), and every rank
//! can [`Rendezvous::all_gather_bytes`] a small blob of its own (host name and local
//! rank, for the rank -> node map) and [`Rendezvous::barrier`].
//!
//! # Protocol (version 2)
//!
//! Every message is a frame: `MPRV`, the protocol version (u16), a kind (u8), the
//! payload length (u32) and the payload; integers little-endian, payloads at most
//! [`BLOB_BYTES_MAX`] bytes, and during the handshake at most [`HELLO_BYTES`].
//!
//! The handshake is a mutual challenge-response over the job's [`JobSecret`] (from
//! `MESHPLAN_JOB_TOKEN`; see [`super::auth`]), which never crosses the wire:
//!
//! 1. rank 0 → rank: `challenge(server_nonce[32])`, as soon as it accepts;
//! 2. rank → rank 0: `hello(rank u32, world_size u32, plan_hash u64, job_id[16],
//!    client_nonce[32], tag[32])`, `tag = HMAC-SHA256(key, "MPRV2 hello" ||
//!    server_nonce || client_nonce || job_id || rank || world_size || plan_hash)`
//!    (each part length-prefixed);
//! 3. rank 0 checks, in order, the version, the frame kind and size, the job id (in
//!    clear, so a rank of another job sharing the port is told so), the tag (in
//!    constant time), and then world size, plan hash, rank range and that the rank is
//!    free; it answers `admit(HMAC-SHA256(key, "MPRV2 admit" || the same parts))`,
//!    which the rank checks (rank 0 proves it holds the key too), or `refuse(text)`;
//! 4. once every rank is admitted, rank 0 sends `welcome` to all.
//!
//! Rank 0 computes no tag for a process that has not proven itself, so it is no
//! oracle. Operations are numbered: a rank sends `data(seq, op, blob)` to rank 0,
//! which answers every rank with the result, so ranks calling different operations
//! are caught by the number. A failure at rank 0 (a timeout, a rank that closed its
//! connection) is relayed to every connected rank as `abort(message)`, so all of them
//! report the same cause. The handshake decides who joins; later frames are neither
//! encrypted nor authenticated (an on-path attacker is out of scope, as for NCCL's
//! own bootstrap).
//!
//! # Strangers
//!
//! Every connection gets its own handshake thread and [`HELLO_TIMEOUT`] to prove
//! itself; at most [`PENDING_MAX`] wait at once (more are closed at once, and a real
//! rank whose connection was closed before its challenge connects again). A
//! connection that fails the handshake (garbage, another version, another job, a bad
//! tag, silence) is refused with a reason, logged on rank 0's stderr with its address,
//! and the rendezvous goes on. A process that proved it holds a private token (one
//! from `MESHPLAN_JOB_TOKEN`) but was started with another world size or plan, or
//! claims a rank already taken, is part of this job and the job cannot succeed: rank 0
//! then fails the whole rendezvous at once, naming both values. Without a private
//! token anyone can compute the tag, so such a hello is only refused.
//!
//! # Timeouts
//!
//! Every wait has one and says who did not arrive: rank 0 names the missing ranks
//! (and the last connection it refused); the others name rank 0 (and relay its list
//! when rank 0 gave up first).

use super::auth::{self, JobSecret, JOB_ID_BYTES, MAC_BYTES, NONCE_BYTES};
use std::collections::BTreeSet;
use std::fmt;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

/// First bytes of every frame.
pub const MAGIC: [u8; 4] = *b"MPRV";
/// The protocol version this build speaks (2: the authenticated handshake).
pub const VERSION: u16 = 2;
/// Largest payload of one frame.
pub const BLOB_BYTES_MAX: usize = 1 << 20;
/// Most ranks of one rendezvous.
pub const WORLD_MAX: usize = 65_536;
/// The payload of a `hello`: rank, world size, plan hash, job id, nonce, tag.
pub const HELLO_BYTES: usize = 4 + 4 + 8 + JOB_ID_BYTES + NONCE_BYTES + MAC_BYTES;
/// How long a connection has, from its accept, to prove itself. Short, so that idle
/// connections (a port scan, a stuck client, an attack) free their place quickly.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// Most connections rank 0 lets wait for their `hello` at once: each holds a thread
/// with a small stack and at most a `hello`'s bytes, so memory stays bounded.
pub const PENDING_MAX: usize = 256;

/// Refused connections logged one by one; later ones are only counted, so a flood
/// cannot fill rank 0's log.
const REFUSALS_LOGGED_MAX: usize = 20;
/// Stack of a handshake thread: it holds one frame of [`HELLO_BYTES`] and an HMAC.
const HANDSHAKE_STACK_BYTES: usize = 128 << 10;
/// How often rank 0's accept loop looks for new connections between handshakes.
const ACCEPT_POLL: Duration = Duration::from_millis(5);
/// Pause between connection attempts while rank 0 is not listening yet.
const RETRY_PAUSE: Duration = Duration::from_millis(50);
/// Extra time a non-zero rank waits for rank 0, so that rank 0's own timeout
/// (which names the missing ranks) arrives first.
const RELAY_GRACE: Duration = Duration::from_secs(2);

const HELLO_LABEL: &[u8] = b"MPRV2 hello";
const ADMIT_LABEL: &[u8] = b"MPRV2 admit";

const HEADER_BYTES: usize = 4 + 2 + 1 + 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Hello = 1,
    Welcome = 2,
    Refuse = 3,
    Data = 4,
    Abort = 5,
    Challenge = 6,
    Admit = 7,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
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
enum Op {
    Broadcast = 1,
    AllGather = 2,
    Barrier = 3,
}

impl Op {
    fn from_u8(v: u8) -> Option<Op> {
        [Op::Broadcast, Op::AllGather, Op::Barrier]
            .into_iter()
            .find(|k| *k as u8 == v)
    }

    fn name(self) -> &'static str {
        match self {
            Op::Broadcast => "broadcast",
            Op::AllGather => "all_gather",
            Op::Barrier => "barrier",
        }
    }
}

/// Why a rendezvous failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RendezvousError {
    /// The ranks were launched inconsistently (world size, plan hash, protocol
    /// version, rank out of range or taken): bad input.
    Refused {
        /// Names both values.
        message: String,
    },
    /// Ranks did not arrive in time.
    Timeout {
        /// What was waited for, for how long, and who did not arrive.
        message: String,
        /// Ranks that did not arrive (empty where this rank cannot know).
        missing: Vec<usize>,
    },
    /// Rank 0 gave up and said why (relayed to every rank).
    Aborted {
        /// Rank 0's message.
        message: String,
        /// Whether rank 0 failed on bad input (a refusal).
        bad_input: bool,
    },
    /// Ranks called different operations, or a peer broke the protocol.
    Mismatch {
        /// What differs.
        message: String,
    },
    /// The network failed.
    Io {
        /// What failed.
        message: String,
    },
}

impl RendezvousError {
    /// Whether the cause is how the run was launched (exit code 2) rather than a
    /// runtime failure.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            RendezvousError::Refused { .. }
                | RendezvousError::Aborted {
                    bad_input: true,
                    ..
                }
        )
    }

    fn message(&self) -> &str {
        match self {
            RendezvousError::Refused { message }
            | RendezvousError::Timeout { message, .. }
            | RendezvousError::Aborted { message, .. }
            | RendezvousError::Mismatch { message }
            | RendezvousError::Io { message } => message,
        }
    }
}

impl fmt::Display for RendezvousError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RendezvousError::Aborted { message, .. } => write!(f, "rank 0 aborted: {message}"),
            other => f.write_str(other.message()),
        }
    }
}

impl std::error::Error for RendezvousError {}

/// Who this rank is and where rank 0 listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RendezvousConfig {
    /// Rank 0's host.
    pub master_addr: String,
    /// Rank 0's port.
    pub master_port: u16,
    /// This rank.
    pub rank: usize,
    /// Ranks of the run.
    pub world_size: usize,
    /// A hash of what every rank runs (the plan file); ranks must agree.
    pub plan_hash: u64,
    /// The longest any one wait may take.
    pub timeout: Duration,
}

impl RendezvousConfig {
    fn endpoint(&self) -> String {
        if self.master_addr.contains(':') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

/// A frame read off the wire.
#[derive(Debug)]
struct Frame {
    kind: Kind,
    payload: Vec<u8>,
}

enum ReadFail {
    Timeout,
    Closed,
    /// A frame of another protocol version (its number).
    Version(u16),
    Bad(String),
    Io(String),
}

/// Frames from a peer that has proven itself (or from rank 0) carry blobs.
const FRAME_BYTES_MAX: usize = BLOB_BYTES_MAX + 64;

fn write_frame(stream: &mut TcpStream, kind: Kind, payload: &[u8]) -> std::io::Result<()> {
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
fn read_frame(
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

fn read_exact_by(
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

fn data_payload(seq: u64, op: Op, blob: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(9 + blob.len());
    p.extend_from_slice(&seq.to_le_bytes());
    p.push(op as u8);
    p.extend_from_slice(blob);
    p
}

fn parse_data(payload: &[u8]) -> Option<(u64, Op, &[u8])> {
    if payload.len() < 9 {
        return None;
    }
    let seq = u64::from_le_bytes(payload[..8].try_into().ok()?);
    Some((seq, Op::from_u8(payload[8])?, &payload[9..]))
}

/// `[count u32][len u32, bytes]...`
fn encode_list(blobs: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(blobs.len() as u32).to_le_bytes());
    for b in blobs {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    }
    out
}

fn decode_list(mut p: &[u8]) -> Option<Vec<Vec<u8>>> {
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

fn abort_payload(message: &str, bad_input: bool) -> Vec<u8> {
    let mut p = vec![u8::from(bad_input)];
    p.extend_from_slice(message.as_bytes());
    p
}

fn ranks_text(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    if ranks.len() == 1 {
        format!("rank {}", list[0])
    } else {
        format!("ranks {}", list.join(","))
    }
}

/// What rank 0's reader threads report.
enum Event {
    Frame(usize, Frame),
    Closed(usize, String),
}

enum Role {
    /// A world of one: every operation is local.
    Single,
    /// Rank 0: a write handle per peer (index `rank - 1`) and the readers' events.
    Host {
        peers: Vec<TcpStream>,
        events: mpsc::Receiver<Event>,
    },
    /// Any other rank: the connection to rank 0.
    Member { stream: TcpStream },
}

/// A completed rendezvous of `world_size` ranks.
pub struct Rendezvous {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    endpoint: String,
    seq: u64,
    role: Role,
    refused: Refusals,
}

impl fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rendezvous")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

/// Connections rank 0 refused: the first [`REFUSALS_LOGGED_MAX`] reasons, the last
/// one, and how many in all (bounded however many strangers call).
#[derive(Clone, Debug, Default)]
struct Refusals {
    logged: Vec<String>,
    last: String,
    count: usize,
}

impl Refusals {
    /// Logs one refused connection on stderr and keeps it for the timeout message.
    fn note(&mut self, endpoint: &str, peer: &str, why: &str) {
        self.count += 1;
        self.last = format!("{peer}: {why}");
        if self.logged.len() < REFUSALS_LOGGED_MAX {
            let line = format!("refused {peer}: {why}");
            eprintln!("warning: rendezvous at {endpoint}: {line}");
            self.logged.push(line);
            if self.logged.len() == REFUSALS_LOGGED_MAX {
                eprintln!(
                    "warning: rendezvous at {endpoint}: further refused connections are counted, not logged"
                );
            }
        }
    }

    /// A clause for rank 0's timeout message (empty when nothing was refused).
    fn summary(&self) -> String {
        match self.count {
            0 => String::new(),
            n => format!(
                "; meanwhile {n} connection(s) were refused, the last from {}",
                self.last
            ),
        }
    }
}

/// What both handshake tags cover, in this order.
#[derive(Clone, Debug)]
struct Transcript {
    server_nonce: [u8; NONCE_BYTES],
    client_nonce: [u8; NONCE_BYTES],
    job_id: [u8; JOB_ID_BYTES],
    rank: u32,
    world_size: u32,
    plan_hash: u64,
}

impl Transcript {
    fn tag(&self, secret: &JobSecret, label: &[u8]) -> [u8; MAC_BYTES] {
        self.with_parts(|parts| secret.mac(label, parts))
    }

    fn verify(&self, secret: &JobSecret, label: &[u8], tag: &[u8]) -> bool {
        self.with_parts(|parts| secret.verify(label, parts, tag))
    }

    fn with_parts<R>(&self, f: impl FnOnce(&[&[u8]]) -> R) -> R {
        let (r, w, p) = (
            self.rank.to_le_bytes(),
            self.world_size.to_le_bytes(),
            self.plan_hash.to_le_bytes(),
        );
        f(&[
            &self.server_nonce,
            &self.client_nonce,
            &self.job_id,
            &r,
            &w,
            &p,
        ])
    }

    /// The `hello` payload a rank sends (see the module doc for the layout).
    fn hello(&self, secret: &JobSecret) -> Vec<u8> {
        let mut p = Vec::with_capacity(HELLO_BYTES);
        p.extend_from_slice(&self.rank.to_le_bytes());
        p.extend_from_slice(&self.world_size.to_le_bytes());
        p.extend_from_slice(&self.plan_hash.to_le_bytes());
        p.extend_from_slice(&self.job_id);
        p.extend_from_slice(&self.client_nonce);
        p.extend_from_slice(&self.tag(secret, HELLO_LABEL));
        p
    }
}

/// What a handshake thread reports to rank 0's accept loop.
enum Handshake {
    /// The peer holds the job's key; its rank, world size and plan are yet unchecked.
    Proven {
        stream: TcpStream,
        peer: SocketAddr,
        transcript: Transcript,
    },
    /// The peer failed the handshake (already told why, where it listens).
    Refused { peer: SocketAddr, why: String },
}

/// Rank 0's side of one connection's handshake, before `by`.
fn handshake(
    stream: &mut TcpStream,
    secret: &JobSecret,
    by: Instant,
) -> Result<Transcript, String> {
    stream
        .set_nonblocking(false)
        .map_err(|e| format!("cannot use the connection: {e}"))?;
    let _ = stream.set_nodelay(true);
    stream
        .set_write_timeout(Some(HELLO_TIMEOUT))
        .map_err(|e| format!("cannot use the connection: {e}"))?;
    let server_nonce = auth::nonce()?;
    write_frame(stream, Kind::Challenge, &server_nonce)
        .map_err(|e| format!("cannot be sent the challenge: {e}"))?;
    let f = read_frame(stream, Some(by), HELLO_BYTES).map_err(|e| match e {
        ReadFail::Timeout => format!(
            "sent no hello within {:.1} s of connecting",
            HELLO_TIMEOUT.as_secs_f64()
        ),
        ReadFail::Closed => "closed the connection before its hello".to_string(),
        ReadFail::Version(v) => format!(
            "speaks rendezvous protocol version {v}, rank 0 speaks {VERSION}: run the same meshplan build on every node"
        ),
        ReadFail::Bad(why) | ReadFail::Io(why) => why,
    })?;
    if f.kind != Kind::Hello {
        return Err(format!("sent a {:?} frame where a hello was due", f.kind));
    }
    let p = f.payload.as_slice();
    if p.len() != HELLO_BYTES {
        return Err(format!(
            "sent a hello of {} bytes, not {HELLO_BYTES}",
            p.len()
        ));
    }
    let mut t = Transcript {
        server_nonce,
        client_nonce: [0; NONCE_BYTES],
        job_id: [0; JOB_ID_BYTES],
        rank: u32::from_le_bytes([p[0], p[1], p[2], p[3]]),
        world_size: u32::from_le_bytes([p[4], p[5], p[6], p[7]]),
        plan_hash: u64::from_le_bytes([p[8], p[9], p[10], p[11], p[12], p[13], p[14], p[15]]),
    };
    t.job_id.copy_from_slice(&p[16..16 + JOB_ID_BYTES]);
    let nonce_at = 16 + JOB_ID_BYTES;
    t.client_nonce
        .copy_from_slice(&p[nonce_at..nonce_at + NONCE_BYTES]);
    let tag = &p[nonce_at + NONCE_BYTES..];
    if t.job_id != secret.job_id() {
        return Err(format!(
            "it connected as RANK={} of another job: job id {}, but this rendezvous serves job {} (two jobs on one MASTER_PORT, or ranks given different {}s: every rank of a job needs the same one)",
            t.rank,
            auth::hex(&t.job_id),
            secret.job_id_hex(),
            auth::TOKEN_VAR
        ));
    }
    if !t.verify(secret, HELLO_LABEL, tag) {
        return Err(format!(
            "its hello as RANK={} carries a wrong tag: it does not hold this job's secret ({})",
            t.rank,
            auth::TOKEN_VAR
        ));
    }
    Ok(t)
}

/// The address rank 0 listens on: loopback if `MASTER_ADDR` is loopback, else every
/// interface of its family (a host name may resolve to an address other ranks
/// cannot reach from inside the node, e.g. 127.0.1.1).
fn listen_addr(cfg: &RendezvousConfig) -> Result<SocketAddr, RendezvousError> {
    let resolved: Vec<SocketAddr> = (cfg.master_addr.as_str(), cfg.master_port)
        .to_socket_addrs()
        .map_err(|e| RendezvousError::Io {
            message: format!(
                "rank 0 cannot resolve MASTER_ADDR={}: {e}; set MASTER_ADDR to this node's host name or address",
                cfg.master_addr
            ),
        })?
        .collect();
    let first = resolved
        .first()
        .copied()
        .ok_or_else(|| RendezvousError::Io {
            message: format!("MASTER_ADDR={} resolves to no address", cfg.master_addr),
        })?;
    Ok(if first.ip().is_loopback() {
        first
    } else if first.is_ipv4() {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), cfg.master_port)
    } else {
        SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), cfg.master_port)
    })
}

/// This process's job secret, as a rendezvous error (exit 2) when the token is bad.
fn env_secret() -> Result<JobSecret, RendezvousError> {
    JobSecret::from_env().map_err(|e| RendezvousError::Refused {
        message: e.to_string(),
    })
}

impl Rendezvous {
    /// Joins the rendezvous with the job secret of this process's environment
    /// ([`JobSecret::from_env`]): rank 0 binds `MASTER_ADDR:MASTER_PORT` and waits
    /// for everyone; the others connect. Returns once all `world_size` ranks have
    /// arrived.
    pub fn connect(cfg: &RendezvousConfig) -> Result<Rendezvous, RendezvousError> {
        check_config(cfg)?;
        if cfg.world_size == 1 {
            return Ok(Rendezvous::single(cfg));
        }
        Rendezvous::connect_with(cfg, &env_secret()?)
    }

    /// [`Rendezvous::connect`] with the given job secret.
    pub fn connect_with(
        cfg: &RendezvousConfig,
        secret: &JobSecret,
    ) -> Result<Rendezvous, RendezvousError> {
        check_config(cfg)?;
        if cfg.world_size == 1 {
            return Ok(Rendezvous::single(cfg));
        }
        if cfg.rank == 0 {
            let addr = listen_addr(cfg)?;
            let listener = TcpListener::bind(addr).map_err(|e| RendezvousError::Io {
                message: format!(
                    "rank 0 cannot listen on {addr} (MASTER_ADDR={}, MASTER_PORT={}): {e}; choose a free MASTER_PORT",
                    cfg.master_addr, cfg.master_port
                ),
            })?;
            Rendezvous::host_with(listener, cfg, secret)
        } else {
            Rendezvous::member(cfg, secret)
        }
    }

    /// Rank 0 on a listener the caller bound (tests bind port 0), with the job
    /// secret of this process's environment.
    pub fn host(
        listener: TcpListener,
        cfg: &RendezvousConfig,
    ) -> Result<Rendezvous, RendezvousError> {
        check_config(cfg)?;
        if cfg.world_size == 1 {
            return Ok(Rendezvous::single(cfg));
        }
        Rendezvous::host_with(listener, cfg, &env_secret()?)
    }

    /// [`Rendezvous::host`] with the given job secret.
    pub fn host_with(
        listener: TcpListener,
        cfg: &RendezvousConfig,
        secret: &JobSecret,
    ) -> Result<Rendezvous, RendezvousError> {
        check_config(cfg)?;
        if cfg.rank != 0 {
            return Err(RendezvousError::Refused {
                message: format!(
                    "rank {} cannot host the rendezvous: rank 0 listens",
                    cfg.rank
                ),
            });
        }
        if cfg.world_size == 1 {
            return Ok(Rendezvous::single(cfg));
        }
        let endpoint = cfg.endpoint();
        if let Some(w) = secret.warning() {
            eprintln!("warning: rendezvous at {endpoint}: {w}");
        }
        let io = |what: &str, e: std::io::Error| RendezvousError::Io {
            message: format!("rank 0 at {endpoint}: {what}: {e}"),
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| io("cannot poll the listener", e))?;
        let secret = Arc::new(secret.clone());
        let deadline = Instant::now() + cfg.timeout;
        let mut joined: Vec<Option<TcpStream>> = (1..cfg.world_size).map(|_| None).collect();
        let mut count = 0usize;
        let mut refused = Refusals::default();
        let (tx, handshakes) = mpsc::channel::<Handshake>();
        let pending = Arc::new(AtomicUsize::new(0));
        while count + 1 < cfg.world_size {
            // Every waiting connection gets its own handshake thread, so a silent one
            // holds up no one but itself, and only for HELLO_TIMEOUT.
            loop {
                match listener.accept() {
                    Ok((stream, peer)) => {
                        if pending.load(Ordering::SeqCst) >= PENDING_MAX {
                            refused.note(
                                &endpoint,
                                &peer.to_string(),
                                &format!("closed at once: {PENDING_MAX} connections already wait for their hello"),
                            );
                            continue;
                        }
                        pending.fetch_add(1, Ordering::SeqCst);
                        let (secret, pending_c, tx, endpoint_c) = (
                            Arc::clone(&secret),
                            Arc::clone(&pending),
                            tx.clone(),
                            endpoint.clone(),
                        );
                        let by = deadline.min(Instant::now() + HELLO_TIMEOUT);
                        let spawned = thread::Builder::new()
                            .name("rendezvous-handshake".into())
                            .stack_size(HANDSHAKE_STACK_BYTES)
                            .spawn(move || {
                                let mut stream = stream;
                                let event = match handshake(&mut stream, &secret, by) {
                                    Ok(transcript) => Handshake::Proven {
                                        stream,
                                        peer,
                                        transcript,
                                    },
                                    Err(why) => {
                                        let text = format!(
                                            "rank 0 at {endpoint_c} refused this connection: {why}"
                                        );
                                        let _ =
                                            write_frame(&mut stream, Kind::Refuse, text.as_bytes());
                                        Handshake::Refused { peer, why }
                                    }
                                };
                                pending_c.fetch_sub(1, Ordering::SeqCst);
                                let _ = tx.send(event);
                            });
                        if let Err(e) = spawned {
                            pending.fetch_sub(1, Ordering::SeqCst);
                            refused.note(
                                &endpoint,
                                &peer.to_string(),
                                &format!("no thread for its handshake: {e}"),
                            );
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    // Out of file descriptors under a flood, or a connection reset
                    // before it was accepted: the strangers' problem, not the job's.
                    Err(e) => {
                        refused.note(&endpoint, "a connection", &format!("accept failed: {e}"));
                        break;
                    }
                }
            }
            match handshakes.recv_timeout(ACCEPT_POLL) {
                Ok(Handshake::Refused { peer, why }) => {
                    refused.note(&endpoint, &peer.to_string(), &why);
                }
                Ok(Handshake::Proven {
                    mut stream,
                    peer,
                    transcript,
                }) => match check_hello(&transcript, cfg, &joined) {
                    Ok(r) => {
                        let _ = stream.set_write_timeout(Some(cfg.timeout));
                        let admit = transcript.tag(&secret, ADMIT_LABEL);
                        match write_frame(&mut stream, Kind::Admit, &admit) {
                            Ok(()) => {
                                joined[r - 1] = Some(stream);
                                count += 1;
                            }
                            Err(e) => refused.note(
                                &endpoint,
                                &peer.to_string(),
                                &format!("RANK={r} proved itself, but its admission could not be sent: {e}"),
                            ),
                        }
                    }
                    Err(msg) => {
                        let _ = write_frame(&mut stream, Kind::Refuse, msg.as_bytes());
                        // Only a process of this job can hold a private token, and a
                        // job with a misconfigured rank cannot succeed: fail it now.
                        if secret.is_private() {
                            abort_all(&mut joined, &msg, true);
                            return Err(RendezvousError::Refused { message: msg });
                        }
                        refused.note(&endpoint, &peer.to_string(), &msg);
                    }
                },
                Err(_) => {}
            }
            if Instant::now() >= deadline {
                let missing: Vec<usize> = joined
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.is_none())
                    .map(|(i, _)| i + 1)
                    .collect();
                let msg = format!(
                    "timed out after {:.1} s waiting at {endpoint} for {} of WORLD_SIZE={} to connect; start every rank with the same MASTER_ADDR and MASTER_PORT, or check that the missing ones started{}",
                    cfg.timeout.as_secs_f64(),
                    ranks_text(&missing),
                    cfg.world_size,
                    refused.summary()
                );
                abort_all(&mut joined, &msg, false);
                return Err(RendezvousError::Timeout {
                    message: msg,
                    missing,
                });
            }
        }
        // Everyone is here: welcome them and start a reader per peer.
        let (tx, events) = mpsc::channel();
        let mut peers = Vec::with_capacity(cfg.world_size - 1);
        for (i, s) in joined.into_iter().enumerate() {
            let Some(mut s) = s else {
                unreachable!("every rank joined")
            };
            let rank = i + 1;
            let _ = s.set_write_timeout(Some(cfg.timeout));
            write_frame(&mut s, Kind::Welcome, &[])
                .map_err(|e| io(&format!("cannot welcome rank {rank}"), e))?;
            let mut reader = s.try_clone().map_err(|e| io("cannot clone a socket", e))?;
            let tx = tx.clone();
            thread::Builder::new()
                .name(format!("rendezvous-rank-{rank}"))
                .spawn(move || {
                    let _ = reader.set_read_timeout(None);
                    loop {
                        match read_frame(&mut reader, None, FRAME_BYTES_MAX) {
                            Ok(f) => {
                                if tx.send(Event::Frame(rank, f)).is_err() {
                                    return;
                                }
                            }
                            Err(ReadFail::Timeout) => {}
                            Err(ReadFail::Closed) => {
                                let _ =
                                    tx.send(Event::Closed(rank, "closed its connection".into()));
                                return;
                            }
                            Err(ReadFail::Version(v)) => {
                                let _ = tx.send(Event::Closed(
                                    rank,
                                    format!("switched to protocol version {v}"),
                                ));
                                return;
                            }
                            Err(ReadFail::Bad(why)) | Err(ReadFail::Io(why)) => {
                                let _ = tx.send(Event::Closed(rank, why));
                                return;
                            }
                        }
                    }
                })
                .map_err(|e| io("cannot start a reader thread", e))?;
            peers.push(s);
        }
        Ok(Rendezvous {
            rank: 0,
            world_size: cfg.world_size,
            timeout: cfg.timeout,
            endpoint,
            seq: 0,
            role: Role::Host { peers, events },
            refused,
        })
    }

    fn single(cfg: &RendezvousConfig) -> Rendezvous {
        Rendezvous {
            rank: 0,
            world_size: 1,
            timeout: cfg.timeout,
            endpoint: cfg.endpoint(),
            seq: 0,
            role: Role::Single,
            refused: Refusals::default(),
        }
    }

    fn member(cfg: &RendezvousConfig, secret: &JobSecret) -> Result<Rendezvous, RendezvousError> {
        let endpoint = cfg.endpoint();
        let start = Instant::now();
        let deadline = start + cfg.timeout;
        let mut last_error = String::from("no attempt");
        let (mut stream, server_nonce) = loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(RendezvousError::Timeout {
                    message: format!(
                        "rank {} timed out after {:.1} s: rank 0 at {endpoint} did not accept a connection (last error: {last_error}); is rank 0 running, with the same MASTER_ADDR and MASTER_PORT?",
                        cfg.rank,
                        cfg.timeout.as_secs_f64()
                    ),
                    missing: vec![0],
                });
            }
            let addrs: Vec<SocketAddr> =
                match (cfg.master_addr.as_str(), cfg.master_port).to_socket_addrs() {
                    Ok(a) => a.collect(),
                    Err(e) => {
                        last_error = format!("cannot resolve MASTER_ADDR={}: {e}", cfg.master_addr);
                        thread::sleep(RETRY_PAUSE);
                        continue;
                    }
                };
            let attempt = (deadline - now).min(Duration::from_secs(1));
            let connected =
                addrs
                    .iter()
                    .find_map(|a| match TcpStream::connect_timeout(a, attempt) {
                        Ok(s) => Some(s),
                        Err(e) => {
                            last_error = e.to_string();
                            None
                        }
                    });
            let Some(mut s) = connected else {
                thread::sleep(RETRY_PAUSE);
                continue;
            };
            let _ = s.set_nodelay(true);
            match read_frame(&mut s, Some(deadline), NONCE_BYTES) {
                Ok(f) if f.kind == Kind::Challenge && f.payload.len() == NONCE_BYTES => {
                    let mut n = [0u8; NONCE_BYTES];
                    n.copy_from_slice(&f.payload);
                    break (s, n);
                }
                Ok(f) => {
                    return Err(RendezvousError::Mismatch {
                        message: format!(
                            "rank {}: the process at {endpoint} opened with a {:?} frame of {} bytes, not rank 0's challenge; is another program listening on MASTER_PORT?",
                            cfg.rank,
                            f.kind,
                            f.payload.len()
                        ),
                    })
                }
                Err(ReadFail::Version(v)) => {
                    return Err(RendezvousError::Refused {
                        message: format!(
                            "rank 0 at {endpoint} speaks rendezvous protocol version {v}, rank {} speaks {VERSION}: run the same meshplan build on every node",
                            cfg.rank
                        ),
                    })
                }
                Err(ReadFail::Bad(why)) => {
                    return Err(RendezvousError::Mismatch {
                        message: format!(
                            "rank {}: the process at {endpoint} is not a meshplan rank 0: it {why}; is another program listening on MASTER_PORT?",
                            cfg.rank
                        ),
                    })
                }
                // Rank 0 closes connections beyond PENDING_MAX at once: try again.
                Err(ReadFail::Closed) => {
                    last_error = "rank 0 closed the connection before its challenge".into();
                    thread::sleep(RETRY_PAUSE);
                }
                Err(ReadFail::Timeout) => {
                    last_error = "connected, but rank 0 sent no challenge".into();
                }
                Err(ReadFail::Io(why)) => {
                    last_error = why;
                    thread::sleep(RETRY_PAUSE);
                }
            }
        };
        let _ = stream.set_write_timeout(Some(cfg.timeout));
        let client_nonce = auth::nonce().map_err(|message| RendezvousError::Io { message })?;
        let transcript = Transcript {
            server_nonce,
            client_nonce,
            job_id: secret.job_id(),
            rank: cfg.rank as u32,
            world_size: cfg.world_size as u32,
            plan_hash: cfg.plan_hash,
        };
        write_frame(&mut stream, Kind::Hello, &transcript.hello(secret)).map_err(|e| {
            RendezvousError::Io {
                message: format!("rank {} cannot greet rank 0 at {endpoint}: {e}", cfg.rank),
            }
        })?;
        let mut r = Rendezvous {
            rank: cfg.rank,
            world_size: cfg.world_size,
            timeout: cfg.timeout,
            endpoint,
            seq: 0,
            role: Role::Member { stream },
            refused: Refusals::default(),
        };
        let f = r.member_read(deadline + RELAY_GRACE, "its admission")?;
        match f.kind {
            Kind::Admit if transcript.verify(secret, ADMIT_LABEL, &f.payload) => {}
            Kind::Admit => {
                return Err(RendezvousError::Refused {
                    message: format!(
                        "rank {}: the process at {} answered as rank 0 but could not prove it holds this job's secret: it is another job's rank 0 on the same MASTER_PORT, or it was given a different {}; give every rank of the job the same one",
                        cfg.rank,
                        r.endpoint,
                        auth::TOKEN_VAR
                    ),
                })
            }
            _ => return Err(r.protocol_error("an admission", &f)),
        }
        let f = r.member_read(deadline + RELAY_GRACE, "the rendezvous to complete")?;
        match f.kind {
            Kind::Welcome => Ok(r),
            _ => Err(r.protocol_error("a welcome", &f)),
        }
    }

    /// How many connections rank 0 refused during the rendezvous (0 on other ranks).
    pub fn refused_connections(&self) -> usize {
        self.refused.count
    }

    /// Rank 0's log of refused connections (`refused ADDRESS: why`), the first
    /// few of them.
    pub fn refusal_log(&self) -> &[String] {
        &self.refused.logged
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks of the run.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Rank 0's `blob` on every rank (the others' `blob` is ignored; pass `&[]`).
    pub fn broadcast(&mut self, blob: &[u8]) -> Result<Vec<u8>, RendezvousError> {
        check_blob(blob)?;
        self.seq += 1;
        let seq = self.seq;
        match &mut self.role {
            Role::Single => Ok(blob.to_vec()),
            Role::Host { peers, .. } => {
                let payload = data_payload(seq, Op::Broadcast, blob);
                for (i, p) in peers.iter_mut().enumerate() {
                    write_frame(p, Kind::Data, &payload).map_err(|e| RendezvousError::Io {
                        message: format!(
                            "rank 0 cannot send broadcast #{seq} to rank {}: {e}",
                            i + 1
                        ),
                    })?;
                }
                Ok(blob.to_vec())
            }
            Role::Member { .. } => {
                let deadline = Instant::now() + self.timeout + RELAY_GRACE;
                self.member_result(seq, Op::Broadcast, deadline)
            }
        }
    }

    /// Every rank's `blob`, in rank order, on every rank.
    pub fn all_gather_bytes(&mut self, blob: &[u8]) -> Result<Vec<Vec<u8>>, RendezvousError> {
        let out = self.gather(Op::AllGather, blob)?;
        decode_list(&out).ok_or_else(|| RendezvousError::Mismatch {
            message: format!(
                "rank {}: malformed all_gather result from rank 0",
                self.rank
            ),
        })
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&mut self) -> Result<(), RendezvousError> {
        self.gather(Op::Barrier, &[]).map(|_| ())
    }

    /// Gathers every rank's blob at rank 0 and returns the encoded list everywhere.
    fn gather(&mut self, op: Op, blob: &[u8]) -> Result<Vec<u8>, RendezvousError> {
        check_blob(blob)?;
        self.seq += 1;
        let seq = self.seq;
        let deadline = Instant::now() + self.timeout;
        match &mut self.role {
            Role::Single => Ok(encode_list(&[blob.to_vec()])),
            Role::Host { peers, events } => {
                let world = peers.len() + 1;
                let mut blobs: Vec<Option<Vec<u8>>> = vec![None; world];
                blobs[0] = Some(blob.to_vec());
                let mut waiting: BTreeSet<usize> = (1..world).collect();
                let fail = |peers: &mut Vec<TcpStream>, e: RendezvousError| {
                    let bad = e.is_bad_input();
                    for p in peers.iter_mut() {
                        let _ = write_frame(p, Kind::Abort, &abort_payload(e.message(), bad));
                    }
                    Err(e)
                };
                while !waiting.is_empty() {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let ev = match events.recv_timeout(left) {
                        Ok(ev) => ev,
                        Err(_) => {
                            let missing: Vec<usize> = waiting.iter().copied().collect();
                            let message = format!(
                                "timed out after {:.1} s in {} #{seq}: {} did not arrive",
                                self.timeout.as_secs_f64(),
                                op.name(),
                                ranks_text(&missing)
                            );
                            return fail(peers, RendezvousError::Timeout { message, missing });
                        }
                    };
                    match ev {
                        Event::Closed(r, why) => {
                            let message = format!(
                                "rank {r} {why} during {} #{seq} (did it exit?)",
                                op.name()
                            );
                            return fail(peers, RendezvousError::Io { message });
                        }
                        Event::Frame(r, f) => {
                            let parsed = (f.kind == Kind::Data)
                                .then(|| parse_data(&f.payload))
                                .flatten();
                            match parsed {
                                Some((s, o, b)) if s == seq && o == op && waiting.contains(&r) => {
                                    blobs[r] = Some(b.to_vec());
                                    waiting.remove(&r);
                                }
                                Some((s, o, _)) => {
                                    let message = format!(
                                        "rank {r} called {} #{s} while rank 0 called {} #{seq}: every rank must make the same calls in the same order",
                                        o.name(),
                                        op.name()
                                    );
                                    return fail(peers, RendezvousError::Mismatch { message });
                                }
                                None => {
                                    let message = format!(
                                        "rank {r} sent an unexpected {:?} frame during {} #{seq}",
                                        f.kind,
                                        op.name()
                                    );
                                    return fail(peers, RendezvousError::Mismatch { message });
                                }
                            }
                        }
                    }
                }
                let all: Vec<Vec<u8>> = blobs.into_iter().map(Option::unwrap_or_default).collect();
                let encoded = encode_list(&all);
                let payload = data_payload(seq, op, &encoded);
                if payload.len() > BLOB_BYTES_MAX + 64 {
                    let message = format!(
                        "{} #{seq}: the gathered blobs ({} bytes) exceed the limit of {BLOB_BYTES_MAX}",
                        op.name(),
                        encoded.len()
                    );
                    return fail(peers, RendezvousError::Mismatch { message });
                }
                for (i, p) in peers.iter_mut().enumerate() {
                    write_frame(p, Kind::Data, &payload).map_err(|e| RendezvousError::Io {
                        message: format!(
                            "rank 0 cannot send {} #{seq} to rank {}: {e}",
                            op.name(),
                            i + 1
                        ),
                    })?;
                }
                Ok(encoded)
            }
            Role::Member { stream } => {
                write_frame(stream, Kind::Data, &data_payload(seq, op, blob)).map_err(|e| {
                    RendezvousError::Io {
                        message: format!(
                            "rank {} cannot send {} #{seq} to rank 0: {e}",
                            self.rank,
                            op.name()
                        ),
                    }
                })?;
                self.member_result(seq, op, deadline + RELAY_GRACE)
            }
        }
    }

    /// A non-zero rank waits for rank 0's result of operation `seq`.
    fn member_result(
        &mut self,
        seq: u64,
        op: Op,
        deadline: Instant,
    ) -> Result<Vec<u8>, RendezvousError> {
        let f = self.member_read(deadline, &format!("{} #{seq}", op.name()))?;
        match (f.kind, parse_data(&f.payload)) {
            (Kind::Data, Some((s, o, b))) if s == seq && o == op => Ok(b.to_vec()),
            (Kind::Data, Some((s, o, _))) => Err(RendezvousError::Mismatch {
                message: format!(
                    "rank 0 called {} #{s} while rank {} called {} #{seq}: every rank must make the same calls in the same order",
                    o.name(),
                    self.rank,
                    op.name()
                ),
            }),
            _ => Err(self.protocol_error(&format!("the result of {} #{seq}", op.name()), &f)),
        }
    }

    /// Reads rank 0's next frame; `abort` and `refuse` become errors.
    fn member_read(&mut self, deadline: Instant, what: &str) -> Result<Frame, RendezvousError> {
        let Role::Member { stream } = &mut self.role else {
            unreachable!("only a non-zero rank reads from rank 0")
        };
        let (rank, endpoint) = (self.rank, &self.endpoint);
        let f = read_frame(stream, Some(deadline), FRAME_BYTES_MAX).map_err(|e| match e {
            ReadFail::Timeout => RendezvousError::Timeout {
                message: format!(
                    "rank {rank} timed out after {:.1} s waiting for rank 0 at {endpoint} ({what})",
                    self.timeout.as_secs_f64()
                ),
                missing: vec![0],
            },
            ReadFail::Closed => RendezvousError::Io {
                message: format!("rank 0 at {endpoint} closed the connection while rank {rank} waited for {what} (did rank 0 exit?)"),
            },
            ReadFail::Bad(why) => RendezvousError::Mismatch {
                message: format!("rank {rank}: rank 0 at {endpoint} {why}"),
            },
            ReadFail::Version(v) => RendezvousError::Mismatch {
                message: format!("rank {rank}: rank 0 at {endpoint} switched to protocol version {v}"),
            },
            ReadFail::Io(why) => RendezvousError::Io {
                message: format!("rank {rank} waiting for {what}: {why}"),
            },
        })?;
        match f.kind {
            Kind::Refuse => Err(RendezvousError::Refused {
                message: String::from_utf8_lossy(&f.payload).into_owned(),
            }),
            Kind::Abort => {
                let bad_input = f.payload.first() == Some(&1);
                Err(RendezvousError::Aborted {
                    message: String::from_utf8_lossy(f.payload.get(1..).unwrap_or_default())
                        .into_owned(),
                    bad_input,
                })
            }
            _ => Ok(f),
        }
    }

    fn protocol_error(&self, wanted: &str, f: &Frame) -> RendezvousError {
        RendezvousError::Mismatch {
            message: format!(
                "rank {}: rank 0 sent a {:?} frame where {wanted} was due",
                self.rank, f.kind
            ),
        }
    }
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        // Closing the sockets ends rank 0's reader threads.
        match &self.role {
            Role::Host { peers, .. } => {
                for p in peers {
                    let _ = p.shutdown(std::net::Shutdown::Both);
                }
            }
            Role::Member { stream } => {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
            Role::Single => {}
        }
    }
}

fn check_config(cfg: &RendezvousConfig) -> Result<(), RendezvousError> {
    if cfg.world_size == 0 || cfg.world_size > WORLD_MAX {
        return Err(RendezvousError::Refused {
            message: format!("WORLD_SIZE={} must be in 1..={WORLD_MAX}", cfg.world_size),
        });
    }
    if cfg.rank >= cfg.world_size {
        return Err(RendezvousError::Refused {
            message: format!(
                "RANK={} is not below WORLD_SIZE={}",
                cfg.rank, cfg.world_size
            ),
        });
    }
    Ok(())
}

fn check_blob(blob: &[u8]) -> Result<(), RendezvousError> {
    if blob.len() > BLOB_BYTES_MAX {
        return Err(RendezvousError::Mismatch {
            message: format!(
                "a blob of {} bytes exceeds the rendezvous limit of {BLOB_BYTES_MAX}",
                blob.len()
            ),
        });
    }
    Ok(())
}

/// Checks a proven `hello` against rank 0's own configuration: its rank, if
/// acceptable.
fn check_hello(
    t: &Transcript,
    cfg: &RendezvousConfig,
    joined: &[Option<TcpStream>],
) -> Result<usize, String> {
    let (rank, world, hash) = (t.rank as usize, t.world_size as usize, t.plan_hash);
    if world != cfg.world_size {
        return Err(format!(
            "rank {rank} was started with WORLD_SIZE={world}, but rank 0 with WORLD_SIZE={}: start every rank with the same WORLD_SIZE",
            cfg.world_size
        ));
    }
    if hash != cfg.plan_hash {
        return Err(format!(
            "rank {rank} runs a plan with hash {hash:016x}, but rank 0 one with hash {:016x}: give every rank the same plan file",
            cfg.plan_hash
        ));
    }
    if rank == 0 || rank >= cfg.world_size {
        return Err(format!(
            "a process connected as RANK={rank}, which is not in 1..{} of WORLD_SIZE={} (rank 0 is the listener): give each process its own RANK",
            cfg.world_size - 1,
            cfg.world_size
        ));
    }
    if joined[rank - 1].is_some() {
        return Err(format!(
            "two processes connected as RANK={rank}: give each process its own RANK"
        ));
    }
    Ok(rank)
}

/// Relays a refusal or a timeout of the connect phase to the ranks already joined.
fn abort_all(joined: &mut [Option<TcpStream>], msg: &str, bad_input: bool) {
    for s in joined.iter_mut().flatten() {
        let _ = write_frame(s, Kind::Abort, &abort_payload(msg, bad_input));
    }
}

/// FNV-1a 64 of `bytes` (the plan hash ranks compare).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}
