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

mod host;
mod member;
mod wire;

use super::auth::{self, JobSecret, JOB_ID_BYTES, MAC_BYTES, NONCE_BYTES};
use host::*;
use std::collections::BTreeSet;
use std::fmt;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};
use wire::*;

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

/// Why a rendezvous failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RendezvousError {
    /// The ranks were launched inconsistently (world size, plan hash, protocol
    /// version, rank out of range or taken): bad input.
    #[error("{message}")]
    Refused {
        /// Names both values.
        message: String,
    },
    /// Ranks did not arrive in time.
    #[error("{message}")]
    Timeout {
        /// What was waited for, for how long, and who did not arrive.
        message: String,
        /// Ranks that did not arrive (empty where this rank cannot know).
        missing: Vec<usize>,
    },
    /// Rank 0 gave up and said why (relayed to every rank).
    #[error("rank 0 aborted: {message}")]
    Aborted {
        /// Rank 0's message.
        message: String,
        /// Whether rank 0 failed on bad input (a refusal).
        bad_input: bool,
    },
    /// Ranks called different operations, or a peer broke the protocol.
    #[error("{message}")]
    Mismatch {
        /// What differs.
        message: String,
    },
    /// The network failed.
    #[error("{message}")]
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
}

/// Rank 0 collects operation `seq`'s blob from every other rank (its own is
/// `mine`), in rank order; the first rank that leaves, calls another operation
/// or does not arrive by `deadline` fails it.
fn collect(
    events: &mpsc::Receiver<Event>,
    world: usize,
    (op, seq): (Op, u64),
    mine: &[u8],
    (deadline, timeout): (Instant, Duration),
) -> Result<Vec<Vec<u8>>, RendezvousError> {
    let mut blobs: Vec<Option<Vec<u8>>> = vec![None; world];
    blobs[0] = Some(mine.to_vec());
    let mut waiting: BTreeSet<usize> = (1..world).collect();
    while !waiting.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(ev) = events.recv_timeout(left) else {
            let missing: Vec<usize> = waiting.iter().copied().collect();
            let message = format!(
                "timed out after {:.1} s in {} #{seq}: {} did not arrive",
                timeout.as_secs_f64(),
                op.name(),
                ranks_text(&missing)
            );
            return Err(RendezvousError::Timeout { message, missing });
        };
        let (r, f) = match ev {
            Event::Closed(r, why) => {
                let message = format!("rank {r} {why} during {} #{seq} (did it exit?)", op.name());
                return Err(RendezvousError::Io { message });
            }
            Event::Frame(r, f) => (r, f),
        };
        let parsed = (f.kind == Kind::Data)
            .then(|| parse_data(&f.payload))
            .flatten();
        let message = match parsed {
            Some((s, o, b)) if s == seq && o == op && waiting.contains(&r) => {
                blobs[r] = Some(b.to_vec());
                waiting.remove(&r);
                continue;
            }
            Some((s, o, _)) => format!(
                "rank {r} called {} #{s} while rank 0 called {} #{seq}: every rank must make the same calls in the same order",
                o.name(),
                op.name()
            ),
            None => format!(
                "rank {r} sent an unexpected {:?} frame during {} #{seq}",
                f.kind,
                op.name()
            ),
        };
        return Err(RendezvousError::Mismatch { message });
    }
    Ok(blobs.into_iter().map(Option::unwrap_or_default).collect())
}

impl Rendezvous {
    /// A rendezvous of `cfg`'s rank and world size, before its first operation.
    fn new(cfg: &RendezvousConfig, role: Role, refused: Refusals) -> Rendezvous {
        Rendezvous {
            rank: cfg.rank,
            world_size: cfg.world_size,
            timeout: cfg.timeout,
            endpoint: cfg.endpoint(),
            seq: 0,
            role,
            refused,
        }
    }

    fn single(cfg: &RendezvousConfig) -> Rendezvous {
        Rendezvous::new(cfg, Role::Single, Refusals::default())
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
                let what = format!("{} #{seq}", Op::Broadcast.name());
                send_all(peers, &data_payload(seq, Op::Broadcast, blob), &what)?;
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
                let timeout = self.timeout;
                let gathered = collect(events, peers.len() + 1, (op, seq), blob, (deadline, timeout))
                    .and_then(|all| {
                        let encoded = encode_list(&all);
                        let payload = data_payload(seq, op, &encoded);
                        if payload.len() > BLOB_BYTES_MAX + 64 {
                            let message = format!(
                                "{} #{seq}: the gathered blobs ({} bytes) exceed the limit of {BLOB_BYTES_MAX}",
                                op.name(),
                                encoded.len()
                            );
                            return Err(RendezvousError::Mismatch { message });
                        }
                        Ok((encoded, payload))
                    });
                let (encoded, payload) = gathered
                    .inspect_err(|e| abort_all(peers.iter_mut(), e.message(), e.is_bad_input()))?;
                send_all(peers, &payload, &format!("{} #{seq}", op.name()))?;
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

/// Rank 0 sends `payload` to every peer (index `rank - 1`) as the result of `what`.
fn send_all(peers: &mut [TcpStream], payload: &[u8], what: &str) -> Result<(), RendezvousError> {
    for (i, p) in peers.iter_mut().enumerate() {
        write_frame(p, Kind::Data, payload).map_err(|e| RendezvousError::Io {
            message: format!("rank 0 cannot send {what} to rank {}: {e}", i + 1),
        })?;
    }
    Ok(())
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

/// FNV-1a 64 of `bytes`: the plan hash ranks compare (and, in the executor, the
/// checksum of version 1 checkpoint manifests and the key of a tensor's stream).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
