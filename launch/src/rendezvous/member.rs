//! Every other rank's side of the rendezvous: connecting to rank 0 and proving
//! it belongs to the job.

use super::*;

impl Rendezvous {
    pub(super) fn member(
        cfg: &RendezvousConfig,
        secret: &JobSecret,
    ) -> Result<Rendezvous, RendezvousError> {
        let endpoint = cfg.endpoint();
        let start = Instant::now();
        let deadline = start + cfg.timeout;
        let (mut stream, server_nonce) = connect(cfg, &endpoint, deadline)?;
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
        let mut r = Rendezvous::new(cfg, Role::Member { stream }, Refusals::default());
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
}

/// Connects to rank 0 and reads its challenge, retrying until `deadline` while
/// rank 0 is not up or turns the connection away.
fn connect(
    cfg: &RendezvousConfig,
    endpoint: &str,
    deadline: Instant,
) -> Result<(TcpStream, [u8; NONCE_BYTES]), RendezvousError> {
    let mut last_error = String::from("no attempt");
    loop {
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
        let connected = addrs
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
        match challenge(&mut s, cfg, endpoint, deadline)? {
            Ok(nonce) => return Ok((s, nonce)),
            Err((why, pause)) => {
                last_error = why;
                if pause {
                    thread::sleep(RETRY_PAUSE);
                }
            }
        }
    }
}

/// Rank 0's challenge on a fresh connection; or why to try again (and whether
/// to pause first); or an error when the other end is not a meshplan rank 0 of
/// this build.
fn challenge(
    s: &mut TcpStream,
    cfg: &RendezvousConfig,
    endpoint: &str,
    deadline: Instant,
) -> Result<Result<[u8; NONCE_BYTES], (String, bool)>, RendezvousError> {
    match read_frame(s, Some(deadline), NONCE_BYTES) {
        Ok(f) if f.kind == Kind::Challenge && f.payload.len() == NONCE_BYTES => {
            let mut n = [0u8; NONCE_BYTES];
            n.copy_from_slice(&f.payload);
            Ok(Ok(n))
        }
        Ok(f) => Err(RendezvousError::Mismatch {
            message: format!(
                "rank {}: the process at {endpoint} opened with a {:?} frame of {} bytes, not rank 0's challenge; is another program listening on MASTER_PORT?",
                cfg.rank,
                f.kind,
                f.payload.len()
            ),
        }),
        Err(ReadFail::Version(v)) => Err(RendezvousError::Refused {
            message: format!(
                "rank 0 at {endpoint} speaks rendezvous protocol version {v}, rank {} speaks {VERSION}: run the same meshplan build on every node",
                cfg.rank
            ),
        }),
        Err(ReadFail::Bad(why)) => Err(RendezvousError::Mismatch {
            message: format!(
                "rank {}: the process at {endpoint} is not a meshplan rank 0: it {why}; is another program listening on MASTER_PORT?",
                cfg.rank
            ),
        }),
        // Rank 0 closes connections beyond PENDING_MAX at once: try again.
        Err(ReadFail::Closed) => Ok(Err((
            "rank 0 closed the connection before its challenge".into(),
            true,
        ))),
        Err(ReadFail::Timeout) => Ok(Err((
            "connected, but rank 0 sent no challenge".into(),
            false,
        ))),
        Err(ReadFail::Io(why)) => Ok(Err((why, true))),
    }
}
