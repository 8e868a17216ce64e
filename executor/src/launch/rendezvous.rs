//! A TCP rendezvous of the processes of one run (std::net only): rank 0 listens on
//! `MASTER_ADDR:MASTER_PORT`, every other rank connects (retrying until the timeout)
//! and says who it is; once all have arrived, rank 0 can [`Rendezvous::broadcast`] a
//! blob (the NCCL unique id, 128 bytes), and every rank can
//! [`Rendezvous::all_gather_bytes`] a small blob of its own (host name and local
//! rank, for the rank -> node map) and [`Rendezvous::barrier`].
//!
//! # Protocol
//!
//! Every message is a frame: `MPRV`, the protocol version (u16), a kind (u8), the
//! payload length (u32) and the payload; integers little-endian, payloads at most
//! [`BLOB_BYTES_MAX`] bytes. A rank opens with `hello` (rank, world size, plan hash);
//! rank 0 refuses a rank whose world size, plan hash or protocol version differs from
//! its own, or whose rank is out of range or taken, with a message naming both
//! values, and then fails the whole rendezvous (a misconfigured run cannot proceed).
//! When every rank has arrived, rank 0 sends `welcome` to all. Operations are
//! numbered: a rank sends `data(seq, op, blob)` to rank 0, which answers every rank
//! with the result, so ranks calling different operations are caught by the number.
//! A failure at rank 0 (a timeout, a refusal, a rank that closed its connection)
//! is relayed to every connected rank as `abort(message)`, so all of them report
//! the same cause.
//!
//! # Timeouts
//!
//! Every wait has one and says who did not arrive: rank 0 names the missing ranks;
//! the others name rank 0 (and relay its list when rank 0 gave up first).

use std::collections::BTreeSet;
use std::fmt;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// First bytes of every frame.
pub const MAGIC: [u8; 4] = *b"MPRV";
/// The protocol version this build speaks.
pub const VERSION: u16 = 1;
/// Largest payload of one frame.
pub const BLOB_BYTES_MAX: usize = 1 << 20;
/// Most ranks of one rendezvous.
pub const WORLD_MAX: usize = 65_536;

/// How long rank 0 waits for a connection's `hello` before dropping it (something
/// other than a meshplan rank may connect to the port).
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between connection attempts while rank 0 is not listening yet.
const RETRY_PAUSE: Duration = Duration::from_millis(50);
/// Extra time a non-zero rank waits for rank 0, so that rank 0's own timeout
/// (which names the missing ranks) arrives first.
const RELAY_GRACE: Duration = Duration::from_secs(2);

const HEADER_BYTES: usize = 4 + 2 + 1 + 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Hello = 1,
    Welcome = 2,
    Refuse = 3,
    Data = 4,
    Abort = 5,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        [
            Kind::Hello,
            Kind::Welcome,
            Kind::Refuse,
            Kind::Data,
            Kind::Abort,
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
    Bad(String),
    Io(String),
}

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

/// Reads one frame before `deadline` (`None`: no deadline beyond the socket's).
fn read_frame(stream: &mut TcpStream, deadline: Option<Instant>) -> Result<Frame, ReadFail> {
    let mut header = [0u8; HEADER_BYTES];
    read_exact_by(stream, &mut header, deadline)?;
    if header[..4] != MAGIC {
        return Err(ReadFail::Bad("not a meshplan rendezvous frame".into()));
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != VERSION {
        return Err(ReadFail::Bad(format!(
            "rendezvous protocol version {version}, this rank speaks {VERSION}: run the same meshplan build on every node"
        )));
    }
    let kind = Kind::from_u8(header[6])
        .ok_or_else(|| ReadFail::Bad(format!("unknown frame kind {}", header[6])))?;
    let len = u32::from_le_bytes([header[7], header[8], header[9], header[10]]) as usize;
    if len > BLOB_BYTES_MAX + 64 {
        return Err(ReadFail::Bad(format!(
            "a frame of {len} bytes exceeds the limit of {BLOB_BYTES_MAX}"
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

impl Rendezvous {
    /// Joins the rendezvous: rank 0 binds `MASTER_ADDR:MASTER_PORT` and waits for
    /// everyone; the others connect. Returns once all `world_size` ranks have arrived.
    pub fn connect(cfg: &RendezvousConfig) -> Result<Rendezvous, RendezvousError> {
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
            Rendezvous::host(listener, cfg)
        } else {
            Rendezvous::member(cfg)
        }
    }

    /// Rank 0 on a listener the caller bound (tests bind port 0).
    pub fn host(
        listener: TcpListener,
        cfg: &RendezvousConfig,
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
        let io = |what: &str, e: std::io::Error| RendezvousError::Io {
            message: format!("rank 0 at {endpoint}: {what}: {e}"),
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| io("cannot poll the listener", e))?;
        let deadline = Instant::now() + cfg.timeout;
        let mut joined: Vec<Option<TcpStream>> = (1..cfg.world_size).map(|_| None).collect();
        let mut count = 0usize;
        while count + 1 < cfg.world_size {
            match listener.accept() {
                Ok((stream, _)) => {
                    let mut stream = stream;
                    if stream.set_nonblocking(false).is_err() {
                        continue;
                    }
                    let hello_by = deadline.min(Instant::now() + HELLO_TIMEOUT);
                    let frame = match read_frame(&mut stream, Some(hello_by)) {
                        Ok(f) if f.kind == Kind::Hello => f,
                        Err(ReadFail::Bad(why)) if why.contains("protocol version") => {
                            let msg =
                                format!("a rank connected to {endpoint} with a different {why}");
                            let _ = write_frame(&mut stream, Kind::Refuse, msg.as_bytes());
                            abort_all(&mut joined, &msg, true);
                            return Err(RendezvousError::Refused { message: msg });
                        }
                        // Not a meshplan rank (a port scan, a health check): ignore it.
                        _ => continue,
                    };
                    match check_hello(&frame.payload, cfg, &joined) {
                        Ok(r) => {
                            joined[r - 1] = Some(stream);
                            count += 1;
                        }
                        Err(msg) => {
                            let _ = write_frame(&mut stream, Kind::Refuse, msg.as_bytes());
                            abort_all(&mut joined, &msg, true);
                            return Err(RendezvousError::Refused { message: msg });
                        }
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = joined
                            .iter()
                            .enumerate()
                            .filter(|(_, s)| s.is_none())
                            .map(|(i, _)| i + 1)
                            .collect();
                        let msg = format!(
                            "timed out after {:.1} s waiting at {endpoint} for {} of WORLD_SIZE={} to connect; start every rank with the same MASTER_ADDR and MASTER_PORT, or check that the missing ones started",
                            cfg.timeout.as_secs_f64(),
                            ranks_text(&missing),
                            cfg.world_size
                        );
                        abort_all(&mut joined, &msg, false);
                        return Err(RendezvousError::Timeout {
                            message: msg,
                            missing,
                        });
                    }
                    thread::sleep(Duration::from_millis(5));
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io("accept failed", e)),
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
                        match read_frame(&mut reader, None) {
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
        }
    }

    fn member(cfg: &RendezvousConfig) -> Result<Rendezvous, RendezvousError> {
        let endpoint = cfg.endpoint();
        let start = Instant::now();
        let deadline = start + cfg.timeout;
        let mut last_error = String::from("no attempt");
        let mut stream = loop {
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
            match connected {
                Some(s) => break s,
                None => thread::sleep(RETRY_PAUSE),
            }
        };
        let _ = stream.set_nodelay(true);
        let _ = stream.set_write_timeout(Some(cfg.timeout));
        let mut hello = Vec::with_capacity(16);
        hello.extend_from_slice(&(cfg.rank as u32).to_le_bytes());
        hello.extend_from_slice(&(cfg.world_size as u32).to_le_bytes());
        hello.extend_from_slice(&cfg.plan_hash.to_le_bytes());
        write_frame(&mut stream, Kind::Hello, &hello).map_err(|e| RendezvousError::Io {
            message: format!("rank {} cannot greet rank 0 at {endpoint}: {e}", cfg.rank),
        })?;
        let mut r = Rendezvous {
            rank: cfg.rank,
            world_size: cfg.world_size,
            timeout: cfg.timeout,
            endpoint,
            seq: 0,
            role: Role::Member { stream },
        };
        let f = r.member_read(deadline + RELAY_GRACE, "the rendezvous to complete")?;
        match f.kind {
            Kind::Welcome => Ok(r),
            _ => Err(r.protocol_error("a welcome", &f)),
        }
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
        let f = read_frame(stream, Some(deadline)).map_err(|e| match e {
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
                message: format!("rank {rank}: {why}"),
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

/// Checks a `hello` against rank 0's own configuration: its rank, if acceptable.
fn check_hello(
    p: &[u8],
    cfg: &RendezvousConfig,
    joined: &[Option<TcpStream>],
) -> Result<usize, String> {
    if p.len() != 16 {
        return Err(format!("a malformed hello of {} bytes", p.len()));
    }
    let rank = u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize;
    let world = u32::from_le_bytes([p[4], p[5], p[6], p[7]]) as usize;
    let hash = u64::from_le_bytes(p[8..16].try_into().unwrap_or_default());
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
