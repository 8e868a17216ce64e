//! The rendezvous with ranks as threads on loopback: worlds of 1, 2 and 4, the NCCL
//! id broadcast, timeouts naming the missing ranks, refusals naming both values; and
//! the authenticated handshake of issue 16 against strangers: a wrong token, killer
//! frames, 100 idle connections, two jobs on one port, and the wire itself.

use super::auth::JobSecret;
use super::rendezvous::{fnv1a64, Rendezvous, RendezvousConfig, RendezvousError, HELLO_TIMEOUT};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

/// The job's token in these tests (what `MESHPLAN_JOB_TOKEN` would hold).
const TOKEN: &str = "issue-16-test-token-0123456789";

fn secret() -> JobSecret {
    JobSecret::from_token(TOKEN).expect("a valid token")
}

/// The secret of this process's environment, as `Rendezvous::connect` uses.
fn env_secret() -> JobSecret {
    JobSecret::from_env().expect("a valid MESHPLAN_JOB_TOKEN, or none")
}

fn listener() -> (TcpListener, u16) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let port = l.local_addr().expect("addr").port();
    (l, port)
}

fn cfg(port: u16, rank: usize, world: usize, timeout_ms: u64) -> RendezvousConfig {
    RendezvousConfig {
        master_addr: "127.0.0.1".into(),
        master_port: port,
        rank,
        world_size: world,
        plan_hash: 42,
        timeout: Duration::from_millis(timeout_ms),
    }
}

/// Runs `f` on ranks `0..world` (rank 0 on `l`), each with its own rendezvous.
fn world<T: Send + 'static>(
    world_size: usize,
    timeout_ms: u64,
    f: impl Fn(Result<Rendezvous, RendezvousError>) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let (l, port) = listener();
    world_on(l, port, world_size, timeout_ms, f)
}

fn world_on<T: Send + 'static>(
    l: TcpListener,
    port: u16,
    world_size: usize,
    timeout_ms: u64,
    f: impl Fn(Result<Rendezvous, RendezvousError>) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let mut handles = Vec::new();
    for rank in (1..world_size).rev() {
        let f = f.clone();
        handles.push(thread::spawn(move || {
            f(Rendezvous::connect_with(
                &cfg(port, rank, world_size, timeout_ms),
                &secret(),
            ))
        }));
    }
    let f0 = f.clone();
    let host = thread::spawn(move || {
        f0(Rendezvous::host_with(
            l,
            &cfg(port, 0, world_size, timeout_ms),
            &secret(),
        ))
    });
    let mut out = vec![host.join().expect("rank 0")];
    for h in handles.into_iter().rev() {
        out.push(h.join().expect("rank"));
    }
    out
}

#[test]
fn worlds_of_1_2_4_gather_broadcast_and_barrier() {
    for n in [1usize, 2, 4] {
        let results = world(n, 10_000, move |r| {
            let mut r = r.expect("rendezvous");
            let me = r.rank();
            assert_eq!(r.world_size(), n);
            let all = r
                .all_gather_bytes(format!("host-{} local {}", me / 2, me % 2).as_bytes())
                .expect("all_gather");
            // The NCCL unique id: 128 bytes from rank 0.
            let id: Vec<u8> = if me == 0 {
                (0..128u8).map(|b| b.wrapping_mul(7)).collect()
            } else {
                Vec::new()
            };
            let got = r.broadcast(&id).expect("broadcast");
            r.barrier().expect("barrier");
            (all, got)
        });
        let want_id: Vec<u8> = (0..128u8).map(|b| b.wrapping_mul(7)).collect();
        for (rank, (all, id)) in results.iter().enumerate() {
            assert_eq!(all.len(), n, "rank {rank}");
            for (i, b) in all.iter().enumerate() {
                assert_eq!(
                    String::from_utf8_lossy(b),
                    format!("host-{} local {}", i / 2, i % 2)
                );
            }
            assert_eq!(id, &want_id, "rank {rank} of {n}");
        }
    }
}

#[test]
fn a_missing_rank_times_out_naming_it_on_every_rank() {
    // WORLD_SIZE=4 but rank 3 never starts.
    let (l, port) = listener();
    let members: Vec<_> = (1..3)
        .map(|rank| {
            thread::spawn(move || Rendezvous::connect(&cfg(port, rank, 4, 1500)).map(|_| ()))
        })
        .collect();
    let t0 = Instant::now();
    let host = Rendezvous::host_with(l, &cfg(port, 0, 4, 1500), &env_secret()).map(|_| ());
    let e = host.expect_err("rank 0 times out");
    assert!(t0.elapsed() < Duration::from_secs(5));
    match &e {
        RendezvousError::Timeout { missing, message } => {
            assert_eq!(missing, &[3]);
            assert!(message.contains("rank 3 of WORLD_SIZE=4"), "{message}");
            assert!(message.contains("MASTER_PORT"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    for m in members {
        let e = m.join().expect("member").expect_err("aborted");
        assert!(
            matches!(
                e,
                RendezvousError::Aborted {
                    bad_input: false,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("rank 3 of WORLD_SIZE=4"), "{e}");
    }
}

#[test]
fn nobody_listening_times_out_naming_rank_0() {
    let (l, port) = listener();
    drop(l);
    let e = Rendezvous::connect(&cfg(port, 1, 2, 300)).expect_err("no rank 0");
    assert!(
        matches!(&e, RendezvousError::Timeout { missing, .. } if missing == &[0]),
        "{e:?}"
    );
    assert!(e.to_string().contains("rank 0 at 127.0.0.1:"), "{e}");
    assert!(
        e.to_string().contains("same MASTER_ADDR and MASTER_PORT"),
        "{e}"
    );
}

#[test]
fn a_different_world_size_is_refused_naming_both() {
    let (l, port) = listener();
    let member = thread::spawn(move || {
        Rendezvous::connect_with(&cfg(port, 1, 3, 5000), &secret()).map(|_| ())
    });
    let e = Rendezvous::host_with(l, &cfg(port, 0, 2, 5000), &secret()).expect_err("refused");
    assert!(e.is_bad_input());
    let msg = e.to_string();
    assert!(
        msg.contains("rank 1 was started with WORLD_SIZE=3, but rank 0 with WORLD_SIZE=2"),
        "{msg}"
    );
    let m = member.join().expect("member").expect_err("refused");
    assert!(m.is_bad_input());
    assert_eq!(m.to_string(), msg);
}

#[test]
fn a_different_plan_and_a_taken_rank_are_refused() {
    let (l, port) = listener();
    let member = thread::spawn(move || {
        let mut c = cfg(port, 1, 2, 5000);
        c.plan_hash = 7;
        Rendezvous::connect_with(&c, &secret()).map(|_| ())
    });
    let e = Rendezvous::host_with(l, &cfg(port, 0, 2, 5000), &secret()).expect_err("refused");
    assert!(
        e.to_string()
            .contains("hash 0000000000000007, but rank 0 one with hash 000000000000002a"),
        "{e}"
    );
    assert!(member.join().expect("member").is_err());

    // Two processes holding the job's token claim rank 1 of 3: the second is
    // refused, and so is the first (the job cannot succeed, so it fails as a whole).
    let (l, port) = listener();
    let first = thread::spawn(move || {
        Rendezvous::connect_with(&cfg(port, 1, 3, 5000), &secret()).map(|_| ())
    });
    thread::sleep(Duration::from_millis(200));
    let second = thread::spawn(move || {
        Rendezvous::connect_with(&cfg(port, 1, 3, 5000), &secret()).map(|_| ())
    });
    let e = Rendezvous::host_with(l, &cfg(port, 0, 3, 5000), &secret()).expect_err("refused");
    assert!(
        e.to_string().contains("two processes connected as RANK=1"),
        "{e}"
    );
    let (a, b) = (first.join().expect("a"), second.join().expect("b"));
    assert!(a.is_err() && b.is_err());
    assert!(a.unwrap_err().is_bad_input());
}

#[test]
fn a_rank_missing_from_a_collective_is_named() {
    // Rank 2 joins but never calls all_gather: rank 0 names it, rank 1 hears why.
    let results = world(3, 1500, |r| {
        let mut r = r.expect("rendezvous");
        if r.rank() == 2 {
            thread::sleep(Duration::from_millis(3500));
            return None;
        }
        Some(r.all_gather_bytes(b"x").map(|_| ()))
    });
    let e0 = results[0]
        .clone()
        .expect("rank 0 called")
        .expect_err("timeout");
    assert!(
        matches!(&e0, RendezvousError::Timeout { missing, .. } if missing == &[2]),
        "{e0:?}"
    );
    assert!(
        e0.to_string()
            .contains("all_gather #1: rank 2 did not arrive"),
        "{e0}"
    );
    let e1 = results[1]
        .clone()
        .expect("rank 1 called")
        .expect_err("aborted");
    assert!(e1.to_string().contains("rank 2 did not arrive"), "{e1}");
}

#[test]
fn a_rank_that_exits_and_mismatched_calls_are_reported() {
    let results = world(3, 5000, |r| {
        let mut r = r.expect("rendezvous");
        match r.rank() {
            2 => {
                drop(r);
                None
            }
            _ => Some(r.barrier().map_err(|e| e.to_string())),
        }
    });
    let e0 = results[0].clone().expect("rank 0").expect_err("closed");
    assert!(
        e0.contains("rank 2 closed its connection during barrier #1"),
        "{e0}"
    );

    let results = world(2, 5000, |r| {
        let mut r = r.expect("rendezvous");
        if r.rank() == 1 {
            r.barrier().map_err(|e| e.to_string())
        } else {
            r.all_gather_bytes(b"")
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    });
    let e0 = results[0].clone().expect_err("mismatch");
    assert!(
        e0.contains("rank 1 called barrier #1 while rank 0 called all_gather #1"),
        "{e0}"
    );
}

#[test]
fn strangers_on_the_port_are_ignored() {
    let (l, port) = listener();
    let stranger = thread::spawn(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let _ = s.write_all(b"GET / HTTP/1.0\r\n\r\n");
        thread::sleep(Duration::from_millis(100));
    });
    thread::sleep(Duration::from_millis(50));
    let member = thread::spawn(move || {
        let mut r = Rendezvous::connect(&cfg(port, 1, 2, 5000)).expect("member");
        r.broadcast(&[]).expect("broadcast")
    });
    let mut r = Rendezvous::host_with(l, &cfg(port, 0, 2, 5000), &env_secret()).expect("host");
    r.broadcast(b"id").expect("broadcast");
    assert_eq!(member.join().expect("member"), b"id");
    stranger.join().expect("stranger");
}

#[test]
fn fnv_is_the_reference_hash() {
    assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
}

// === Issue 16: strangers on the rendezvous port ===

/// A frame as the protocol documents it, written by hand so that these tests pin
/// the wire format rather than reuse the implementation's encoder.
fn raw_frame(version: u16, kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut b = b"MPRV".to_vec();
    b.extend_from_slice(&version.to_le_bytes());
    b.push(kind);
    b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    b.extend_from_slice(payload);
    b
}

/// Reads one frame (kind, payload), or `None` at end of stream or after 5 s.
fn read_raw_frame(s: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let mut h = [0u8; 11];
    s.read_exact(&mut h).ok()?;
    assert_eq!(&h[..4], b"MPRV");
    assert_eq!(u16::from_le_bytes([h[4], h[5]]), 2, "protocol version");
    let len = u32::from_le_bytes([h[7], h[8], h[9], h[10]]) as usize;
    let mut p = vec![0u8; len];
    s.read_exact(&mut p).ok()?;
    Some((h[6], p))
}

const KIND_HELLO: u8 = 1;
const KIND_REFUSE: u8 = 3;
const KIND_CHALLENGE: u8 = 6;
const KIND_ADMIT: u8 = 7;

/// A stranger: connects, takes the challenge, sends `bytes`, and returns what rank 0
/// answered (its refusal's text, if any).
fn stranger(port: u16, bytes: Vec<u8>) -> thread::JoinHandle<Option<String>> {
    thread::spawn(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let (kind, nonce) = read_raw_frame(&mut s).expect("a challenge");
        assert_eq!((kind, nonce.len()), (KIND_CHALLENGE, 32));
        s.write_all(&bytes).expect("send");
        let _ = s.shutdown(std::net::Shutdown::Write);
        match read_raw_frame(&mut s) {
            Some((KIND_REFUSE, text)) => Some(String::from_utf8_lossy(&text).into_owned()),
            _ => None,
        }
    })
}

/// A hello's payload for rank 1 of `world` with plan hash 42 and the given job id,
/// carrying a tag the sender could not compute (it lacks the key).
fn forged_hello(world: u32, job_id: [u8; 16]) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&1u32.to_le_bytes());
    p.extend_from_slice(&world.to_le_bytes());
    p.extend_from_slice(&42u64.to_le_bytes());
    p.extend_from_slice(&job_id);
    p.extend_from_slice(&[7u8; 32]);
    p.extend_from_slice(&[0u8; 32]);
    p
}

/// Ranks 1 and 2 of the real job (after the strangers), and rank 0's rendezvous; the
/// job runs an all_gather and a broadcast, and rank 0's rendezvous is returned.
fn real_job_of_3(l: TcpListener, port: u16, strangers_first: impl FnOnce()) -> Rendezvous {
    let host = thread::spawn(move || {
        let mut r = Rendezvous::host_with(l, &cfg(port, 0, 3, 10_000), &secret())
            .expect("rank 0 completes the rendezvous");
        let all = r.all_gather_bytes(b"r0").expect("all_gather");
        assert_eq!(all.len(), 3);
        r.broadcast(b"nccl-id").expect("broadcast");
        r
    });
    strangers_first();
    let members: Vec<_> = (1..3)
        .map(|rank| {
            thread::spawn(move || {
                let mut r = Rendezvous::connect_with(&cfg(port, rank, 3, 10_000), &secret())
                    .expect("a real rank joins");
                r.all_gather_bytes(b"rN").expect("all_gather");
                r.broadcast(&[]).expect("broadcast")
            })
        })
        .collect();
    for m in members {
        assert_eq!(m.join().expect("member"), b"nccl-id");
    }
    host.join().expect("rank 0")
}

#[test]
fn r16_a_stranger_with_the_plan_hash_but_not_the_token_is_refused() {
    let (l, port) = listener();
    let rv = real_job_of_3(l, port, || {
        // Right plan hash, world size and rank, wrong token: before the fix it was
        // admitted as rank 1 and the real rank 1 was locked out.
        let wrong = JobSecret::from_token("not-the-job-token-0123456789").expect("token");
        let e = Rendezvous::connect_with(&cfg(port, 1, 3, 5000), &wrong)
            .expect_err("a stranger is refused");
        assert!(e.is_bad_input(), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains("of another job"), "{msg}");
        assert!(msg.contains(&secret().job_id_hex()), "{msg}");
        // A stranger who copied the job id off the wire still lacks the key.
        let answer = stranger(
            port,
            raw_frame(2, KIND_HELLO, &forged_hello(3, secret().job_id())),
        )
        .join()
        .expect("stranger");
        let answer = answer.expect("a refusal");
        assert!(answer.contains("carries a wrong tag"), "{answer}");
        assert!(answer.contains("MESHPLAN_JOB_TOKEN"), "{answer}");
    });
    assert_eq!(rv.refused_connections(), 2, "{:?}", rv.refusal_log());
    for line in rv.refusal_log() {
        assert!(line.starts_with("refused 127.0.0.1:"), "{line}");
    }
}

#[test]
fn r16_killer_frames_do_not_stop_the_job() {
    let (l, port) = listener();
    let job = secret().job_id();
    let mut v1_hello = Vec::new();
    v1_hello.extend_from_slice(&1u32.to_le_bytes());
    v1_hello.extend_from_slice(&3u32.to_le_bytes());
    v1_hello.extend_from_slice(&42u64.to_le_bytes());
    let mut oversized = raw_frame(2, KIND_HELLO, &[]);
    oversized[7..11].copy_from_slice(&u32::MAX.to_le_bytes());
    let killers: Vec<(Vec<u8>, &str)> = vec![
        // Before the fix, a hello of another version made rank 0 exit.
        (raw_frame(1, KIND_HELLO, &v1_hello), "protocol version 1"),
        // Before the fix, a hello with another WORLD_SIZE made rank 0 exit.
        (
            raw_frame(2, KIND_HELLO, &forged_hello(7, job)),
            "carries a wrong tag",
        ),
        (
            b"GET / HTTP/1.0\r\n\r\n".to_vec(),
            "not a meshplan rendezvous frame",
        ),
        (oversized, "of 4294967295 bytes where at most 96"),
        (raw_frame(2, 200, &[]), "unknown kind 200"),
        (raw_frame(2, KIND_HELLO, &[1, 2, 3]), "a hello of 3 bytes"),
        (raw_frame(2, KIND_HELLO, &[0; 40])[..30].to_vec(), "closed"),
    ];
    let wants: Vec<&str> = killers.iter().map(|k| k.1).collect();
    let t0 = Instant::now();
    let rv = real_job_of_3(l, port, move || {
        let answers: Vec<_> = killers
            .into_iter()
            .map(|(bytes, want)| (stranger(port, bytes), want))
            .collect();
        for (h, want) in answers {
            let answer = h.join().expect("stranger");
            // The peer that closed mid-frame cannot hear its refusal.
            if want != "closed" {
                let answer = answer.unwrap_or_else(|| panic!("no refusal naming `{want}`"));
                assert!(answer.contains(want), "`{want}` missing from: {answer}");
            }
        }
    });
    let elapsed = t0.elapsed();
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
    let log = rv.refusal_log().join("\n");
    assert_eq!(rv.refused_connections(), wants.len(), "{log}");
    for want in wants {
        assert!(
            log.contains(want),
            "`{want}` missing from rank 0's log:\n{log}"
        );
    }
}

#[test]
fn r16_without_a_token_a_wrong_world_size_is_refused_and_the_job_goes_on() {
    // With the public key of a run without MESHPLAN_JOB_TOKEN anyone can compute a
    // valid tag, so a hello with another WORLD_SIZE may be a stranger's: rank 0 refuses
    // it and goes on, where before it exited.
    let (l, port) = listener();
    let open = JobSecret::open();
    let host = {
        let open = open.clone();
        thread::spawn(move || {
            let mut r = Rendezvous::host_with(l, &cfg(port, 0, 2, 10_000), &open)?;
            r.barrier()?;
            Ok::<_, RendezvousError>(r.refusal_log().to_vec())
        })
    };
    let e = Rendezvous::connect_with(&cfg(port, 1, 7, 5000), &open).expect_err("refused");
    assert!(e.is_bad_input());
    assert!(
        e.to_string()
            .contains("rank 1 was started with WORLD_SIZE=7, but rank 0 with WORLD_SIZE=2"),
        "{e}"
    );
    // A second RANK=1 cannot take the slot from the first either.
    let mut first = Rendezvous::connect_with(&cfg(port, 1, 2, 5000), &open).expect("rank 1");
    first.barrier().expect("barrier");
    let log = host.join().expect("rank 0").expect("rank 0 completes");
    assert_eq!(log.len(), 1, "{log:?}");
    assert!(log[0].contains("WORLD_SIZE=7"), "{log:?}");
}

#[test]
fn r16_a_hundred_idle_connections_do_not_delay_the_real_ranks() {
    let (l, port) = listener();
    // Connected before rank 0 even starts, and silent throughout: before the fix
    // rank 0 waited 5 s on each, one after another.
    let idle: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).expect("connect"))
        .collect();
    let t0 = Instant::now();
    let results = world_on(l, port, 3, 10_000, |r| {
        let mut r = r.expect("rendezvous");
        r.barrier().expect("barrier");
        r.refused_connections()
    });
    let elapsed = t0.elapsed();
    eprintln!("a job of 3 ranks behind 100 idle connections joined in {elapsed:?}");
    // Faster than one idle connection's deadline: nobody waited on a stranger.
    assert!(elapsed < HELLO_TIMEOUT, "{elapsed:?}");
    assert_eq!(results.len(), 3);
    drop(idle);
}

#[test]
fn r16_two_jobs_on_one_port_do_not_mix() {
    let (l, port) = listener();
    let host = thread::spawn(move || {
        let mut r = Rendezvous::host_with(l, &cfg(port, 0, 2, 10_000), &secret())?;
        r.broadcast(b"job A")
    });
    // Job B, same plan, same world size, its own token, started on the same port.
    let b = JobSecret::from_token("job-B-token-abcdefghijklmnop").expect("token");
    let e = Rendezvous::connect_with(&cfg(port, 1, 2, 5000), &b).expect_err("refused");
    assert!(e.is_bad_input(), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains(&format!(
            "of another job: job id {}, but this rendezvous serves job {}",
            b.job_id_hex(),
            secret().job_id_hex()
        )),
        "{msg}"
    );
    assert!(msg.contains("two jobs on one MASTER_PORT"), "{msg}");
    // Job A's own rank 1 joins and gets job A's broadcast.
    let mut a1 = Rendezvous::connect_with(&cfg(port, 1, 2, 5000), &secret()).expect("rank 1");
    assert_eq!(a1.broadcast(&[]).expect("broadcast"), b"job A");
    assert_eq!(host.join().expect("rank 0").expect("job A"), b"job A");
}

#[test]
fn r16_the_token_never_crosses_the_wire_and_rank_0_must_prove_itself() {
    use hmac::{Hmac, KeyInit, Mac};
    use sha2::{Digest, Sha256};
    // A fake rank 0 that records what a rank sends and cannot prove it holds the key.
    let (l, port) = listener();
    let nonce = [0x5au8; 32];
    let fake = thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        s.write_all(&raw_frame(2, KIND_CHALLENGE, &nonce))
            .expect("challenge");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut hello = vec![0u8; 11 + 96];
        s.read_exact(&mut hello).expect("a hello");
        s.write_all(&raw_frame(2, KIND_ADMIT, &[0u8; 32]))
            .expect("admit");
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        hello.extend_from_slice(&rest);
        hello
    });
    let e = Rendezvous::connect_with(&cfg(port, 1, 2, 5000), &secret())
        .expect_err("a rank 0 without the key is refused");
    assert!(e.is_bad_input(), "{e:?}");
    assert!(
        e.to_string()
            .contains("could not prove it holds this job's secret"),
        "{e}"
    );
    let wire = fake.join().expect("fake rank 0");
    let contains = |needle: &[u8]| wire.windows(needle.len()).any(|w| w == needle);
    assert!(!contains(TOKEN.as_bytes()), "the token went out in clear");
    // The key is a hash of the token, and never goes out either.
    let key: [u8; 32] = Sha256::new()
        .chain_update(b"meshplan rendezvous key v2\0token\0")
        .chain_update(TOKEN.as_bytes())
        .finalize()
        .into();
    assert!(!contains(&key), "the key went out in clear");
    // What went out is the documented hello, and its tag is the documented HMAC.
    assert_eq!(wire.len(), 11 + 96, "nothing after the refused admission");
    assert_eq!(&wire[..11], &raw_frame(2, KIND_HELLO, &[0; 96])[..11]);
    let p = &wire[11..];
    assert_eq!(&p[..4], &1u32.to_le_bytes());
    assert_eq!(&p[4..8], &2u32.to_le_bytes());
    assert_eq!(&p[8..16], &42u64.to_le_bytes());
    assert_eq!(p[16..32], secret().job_id());
    let client_nonce = &p[32..64];
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("key");
    mac.update(b"MPRV2 hello");
    for part in [
        &nonce[..],
        client_nonce,
        &p[16..32],
        &p[..4],
        &p[4..8],
        &p[8..16],
    ] {
        mac.update(&(part.len() as u32).to_le_bytes());
        mac.update(part);
    }
    assert!(
        mac.verify_slice(&p[64..96]).is_ok(),
        "the tag is HMAC-SHA256 of the transcript"
    );
}
