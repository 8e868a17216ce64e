//! The rendezvous with ranks as threads on loopback: worlds of 1, 2 and 4, the NCCL
//! id broadcast, timeouts naming the missing ranks, refusals naming both values.

use super::rendezvous::{fnv1a64, Rendezvous, RendezvousConfig, RendezvousError};
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

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
    let mut handles = Vec::new();
    for rank in (1..world_size).rev() {
        let f = f.clone();
        handles.push(thread::spawn(move || {
            f(Rendezvous::connect(&cfg(
                port, rank, world_size, timeout_ms,
            )))
        }));
    }
    let f0 = f.clone();
    let host =
        thread::spawn(move || f0(Rendezvous::host(l, &cfg(port, 0, world_size, timeout_ms))));
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
    let host = Rendezvous::host(l, &cfg(port, 0, 4, 1500)).map(|_| ());
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
    let member = thread::spawn(move || Rendezvous::connect(&cfg(port, 1, 3, 5000)).map(|_| ()));
    let e = Rendezvous::host(l, &cfg(port, 0, 2, 5000)).expect_err("refused");
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
        Rendezvous::connect(&c).map(|_| ())
    });
    let e = Rendezvous::host(l, &cfg(port, 0, 2, 5000)).expect_err("refused");
    assert!(
        e.to_string()
            .contains("hash 0000000000000007, but rank 0 one with hash 000000000000002a"),
        "{e}"
    );
    assert!(member.join().expect("member").is_err());

    // Two processes claiming rank 1 of 3: the second is refused, and so is the first
    // (the rendezvous fails as a whole).
    let (l, port) = listener();
    let first = thread::spawn(move || Rendezvous::connect(&cfg(port, 1, 3, 5000)).map(|_| ()));
    thread::sleep(Duration::from_millis(200));
    let second = thread::spawn(move || Rendezvous::connect(&cfg(port, 1, 3, 5000)).map(|_| ()));
    let e = Rendezvous::host(l, &cfg(port, 0, 3, 5000)).expect_err("refused");
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
    let mut r = Rendezvous::host(l, &cfg(port, 0, 2, 5000)).expect("host");
    r.broadcast(b"id").expect("broadcast");
    assert_eq!(member.join().expect("member"), b"id");
    stranger.join().expect("stranger");
}

#[test]
fn fnv_is_the_reference_hash() {
    assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
}
