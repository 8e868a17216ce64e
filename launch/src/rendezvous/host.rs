//! Rank 0's side of the rendezvous: listening, each connection's handshake, the
//! refusals it logs, and the failures it relays to every rank.

use super::*;

/// Connections rank 0 refused: the first [`REFUSALS_LOGGED_MAX`] reasons, the last
/// one, and how many in all (bounded however many strangers call).
#[derive(Clone, Debug, Default)]
pub(super) struct Refusals {
    pub(super) logged: Vec<String>,
    pub(super) last: String,
    pub(super) count: usize,
}

impl Refusals {
    /// Logs one refused connection on stderr and keeps it for the timeout message.
    pub(super) fn note(&mut self, endpoint: &str, peer: &str, why: &str) {
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
    pub(super) fn summary(&self) -> String {
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
pub(super) struct Transcript {
    pub(super) server_nonce: [u8; NONCE_BYTES],
    pub(super) client_nonce: [u8; NONCE_BYTES],
    pub(super) job_id: [u8; JOB_ID_BYTES],
    pub(super) rank: u32,
    pub(super) world_size: u32,
    pub(super) plan_hash: u64,
}

impl Transcript {
    pub(super) fn tag(&self, secret: &JobSecret, label: &[u8]) -> [u8; MAC_BYTES] {
        self.with_parts(|parts| secret.mac(label, parts))
    }

    pub(super) fn verify(&self, secret: &JobSecret, label: &[u8], tag: &[u8]) -> bool {
        self.with_parts(|parts| secret.verify(label, parts, tag))
    }

    pub(super) fn with_parts<R>(&self, f: impl FnOnce(&[&[u8]]) -> R) -> R {
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
    pub(super) fn hello(&self, secret: &JobSecret) -> Vec<u8> {
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
pub(super) enum Handshake {
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
pub(super) fn handshake(
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
pub(super) fn listen_addr(cfg: &RendezvousConfig) -> Result<SocketAddr, RendezvousError> {
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
    /// Rank 0 on a listener the caller bound (tests bind port 0), with the given
    /// job secret.
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
        let mut lobby = Lobby::open(cfg, endpoint.clone(), secret);
        while !lobby.everyone_joined() {
            lobby.accept_waiting(&listener);
            if let Ok(event) = lobby.handshakes.recv_timeout(ACCEPT_POLL) {
                lobby.admit(event, cfg)?;
            }
            if Instant::now() >= lobby.deadline {
                return Err(lobby.timed_out(cfg));
            }
        }
        // Everyone is here: welcome them and start a reader per peer.
        let (tx, events) = mpsc::channel();
        let mut peers = Vec::with_capacity(cfg.world_size - 1);
        for (i, s) in lobby.joined.into_iter().enumerate() {
            let Some(mut s) = s else {
                unreachable!("every rank joined")
            };
            let rank = i + 1;
            let _ = s.set_write_timeout(Some(cfg.timeout));
            write_frame(&mut s, Kind::Welcome, &[])
                .map_err(|e| io(&format!("cannot welcome rank {rank}"), e))?;
            let reader = s.try_clone().map_err(|e| io("cannot clone a socket", e))?;
            read_peer(rank, reader, tx.clone())
                .map_err(|e| io("cannot start a reader thread", e))?;
            peers.push(s);
        }
        Ok(Rendezvous::new(
            cfg,
            Role::Host { peers, events },
            lobby.refused,
        ))
    }
}

/// Rank 0 waiting for the others: the connections that proved themselves, by
/// rank, and what it refused; each waiting connection has a handshake thread of
/// its own, so a silent one holds up no one but itself, and only for
/// [`HELLO_TIMEOUT`].
struct Lobby {
    endpoint: String,
    secret: Arc<JobSecret>,
    deadline: Instant,
    /// Ranks 1.. that joined.
    joined: Vec<Option<TcpStream>>,
    refused: Refusals,
    tx: mpsc::Sender<Handshake>,
    handshakes: mpsc::Receiver<Handshake>,
    /// Handshake threads running.
    pending: Arc<AtomicUsize>,
}

impl Lobby {
    fn open(cfg: &RendezvousConfig, endpoint: String, secret: &JobSecret) -> Lobby {
        let (tx, handshakes) = mpsc::channel::<Handshake>();
        Lobby {
            endpoint,
            secret: Arc::new(secret.clone()),
            deadline: Instant::now() + cfg.timeout,
            joined: (1..cfg.world_size).map(|_| None).collect(),
            refused: Refusals::default(),
            tx,
            handshakes,
            pending: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn everyone_joined(&self) -> bool {
        self.joined.iter().all(Option::is_some)
    }

    /// Starts a handshake for every connection waiting on the listener.
    fn accept_waiting(&mut self, listener: &TcpListener) {
        loop {
            match listener.accept() {
                Ok((stream, peer)) => self.start_handshake(stream, peer),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // Out of file descriptors under a flood, or a connection reset
                // before it was accepted: the strangers' problem, not the job's.
                Err(e) => {
                    let why = format!("accept failed: {e}");
                    self.refused.note(&self.endpoint, "a connection", &why);
                    break;
                }
            }
        }
    }

    fn start_handshake(&mut self, stream: TcpStream, peer: SocketAddr) {
        let endpoint = &self.endpoint;
        if self.pending.load(Ordering::SeqCst) >= PENDING_MAX {
            let why =
                format!("closed at once: {PENDING_MAX} connections already wait for their hello");
            self.refused.note(endpoint, &peer.to_string(), &why);
            return;
        }
        self.pending.fetch_add(1, Ordering::SeqCst);
        let (secret, pending, tx, endpoint_c) = (
            Arc::clone(&self.secret),
            Arc::clone(&self.pending),
            self.tx.clone(),
            endpoint.clone(),
        );
        let by = self.deadline.min(Instant::now() + HELLO_TIMEOUT);
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
                        let text = format!("rank 0 at {endpoint_c} refused this connection: {why}");
                        let _ = write_frame(&mut stream, Kind::Refuse, text.as_bytes());
                        Handshake::Refused { peer, why }
                    }
                };
                pending.fetch_sub(1, Ordering::SeqCst);
                let _ = tx.send(event);
            });
        if let Err(e) = spawned {
            self.pending.fetch_sub(1, Ordering::SeqCst);
            let why = format!("no thread for its handshake: {e}");
            self.refused.note(endpoint, &peer.to_string(), &why);
        }
    }

    /// One handshake's outcome: a proven rank admitted, or refused (and, with a
    /// private token, the job failed: only a process of this job can hold it, and a
    /// job with a misconfigured rank cannot succeed).
    fn admit(&mut self, event: Handshake, cfg: &RendezvousConfig) -> Result<(), RendezvousError> {
        let endpoint = &self.endpoint;
        let (mut stream, peer, transcript) = match event {
            Handshake::Proven {
                stream,
                peer,
                transcript,
            } => (stream, peer, transcript),
            Handshake::Refused { peer, why } => {
                self.refused.note(endpoint, &peer.to_string(), &why);
                return Ok(());
            }
        };
        match check_hello(&transcript, cfg, &self.joined) {
            Ok(r) => {
                let _ = stream.set_write_timeout(Some(cfg.timeout));
                let admit = transcript.tag(&self.secret, ADMIT_LABEL);
                match write_frame(&mut stream, Kind::Admit, &admit) {
                    Ok(()) => self.joined[r - 1] = Some(stream),
                    Err(e) => {
                        let why = format!(
                            "RANK={r} proved itself, but its admission could not be sent: {e}"
                        );
                        self.refused.note(endpoint, &peer.to_string(), &why)
                    }
                }
            }
            Err(msg) => {
                let _ = write_frame(&mut stream, Kind::Refuse, msg.as_bytes());
                if self.secret.is_private() {
                    abort_all(self.joined.iter_mut().flatten(), &msg, true);
                    return Err(RendezvousError::Refused { message: msg });
                }
                self.refused.note(endpoint, &peer.to_string(), &msg);
            }
        }
        Ok(())
    }

    /// The deadline passed: the ranks that joined are told, and the error names
    /// the missing ones.
    fn timed_out(mut self, cfg: &RendezvousConfig) -> RendezvousError {
        let missing: Vec<usize> = self
            .joined
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_none())
            .map(|(i, _)| i + 1)
            .collect();
        let msg = format!(
            "timed out after {:.1} s waiting at {} for {} of WORLD_SIZE={} to connect; start every rank with the same MASTER_ADDR and MASTER_PORT, or check that the missing ones started{}",
            cfg.timeout.as_secs_f64(),
            self.endpoint,
            ranks_text(&missing),
            cfg.world_size,
            self.refused.summary()
        );
        abort_all(self.joined.iter_mut().flatten(), &msg, false);
        RendezvousError::Timeout {
            message: msg,
            missing,
        }
    }
}

/// A thread reading rank `rank`'s frames into `tx` until its connection ends.
fn read_peer(rank: usize, mut reader: TcpStream, tx: mpsc::Sender<Event>) -> std::io::Result<()> {
    let closed = move |tx: &mpsc::Sender<Event>, why: String| {
        let _ = tx.send(Event::Closed(rank, why));
    };
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
                    Err(ReadFail::Closed) => return closed(&tx, "closed its connection".into()),
                    Err(ReadFail::Version(v)) => {
                        return closed(&tx, format!("switched to protocol version {v}"))
                    }
                    Err(ReadFail::Bad(why)) | Err(ReadFail::Io(why)) => return closed(&tx, why),
                }
            }
        })
        .map(|_| ())
}

/// Checks a proven `hello` against rank 0's own configuration: its rank, if
/// acceptable.
pub(super) fn check_hello(
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

/// Relays rank 0's failure (a refusal, a timeout) to `peers`, as far as they listen.
pub(super) fn abort_all<'a>(
    peers: impl IntoIterator<Item = &'a mut TcpStream>,
    msg: &str,
    bad_input: bool,
) {
    for s in peers {
        let _ = write_frame(s, Kind::Abort, &abort_payload(msg, bad_input));
    }
}
