//! NCCL against the serial reference ([`ThreadComm`]): the same program on both,
//! comparing every output and the byte counts. Needs a GPU and NCCL; without them
//! each test prints why and passes, unless `REQUIRE_GPU=1`.

use std::time::Duration;

use super::*;
use crate::comm::ThreadComm;

fn required() -> bool {
    std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// `true` (after printing why) when the test cannot run here.
fn skip(test: &str, min_devices: usize) -> bool {
    match nccl_available() {
        Err(e) => {
            assert!(
                !required(),
                "{test}: REQUIRE_GPU=1 but NCCL cannot be used: {e}"
            );
            eprintln!("{test}: skipped: {e}");
            true
        }
        Ok(info) if info.device_count < min_devices => {
            eprintln!(
                "{test}: skipped: {} device(s), {min_devices} needed",
                info.device_count
            );
            true
        }
        Ok(_) => false,
    }
}

/// Every collective, on `world` ranks; returns each output in order and the counts.
fn program(c: &mut dyn Communicator) -> (Vec<Vec<f32>>, ByteCounts) {
    let r = c.rank();
    let n = c.world();
    let world = Group::world(n);
    let val = |k: usize| (r * 100 + k) as f32 * 0.5;
    let mut outs = Vec::new();

    let mut buf: Vec<f32> = (0..37).map(val).collect();
    c.all_reduce(&world, "dp", &mut buf).unwrap();
    outs.push(buf);

    let local: Vec<f32> = (0..5).map(val).collect();
    let mut out = vec![0.0; 5 * n];
    c.all_gather(&world, "tp", &local, &mut out).unwrap();
    outs.push(out);

    let input: Vec<f32> = (0..6 * n).map(val).collect();
    let mut out = vec![0.0; 6];
    c.reduce_scatter(&world, "tp", &input, &mut out).unwrap();
    outs.push(out);

    let mut buf: Vec<f32> = (0..9).map(val).collect();
    c.broadcast(&world, "dp", &mut buf, n - 1).unwrap();
    outs.push(buf);

    let send: Vec<f32> = (0..4 * n).map(val).collect();
    let mut recv = vec![0.0; 4 * n];
    c.all_to_all(&world, "ep", &send, &mut recv).unwrap();
    outs.push(recv);

    // Member j sends j + 1 + r elements to each member; receives r' + 1 + me from r'.
    let send_counts: Vec<usize> = (0..n).map(|j| j + 1 + r).collect();
    let recv_counts: Vec<usize> = (0..n).map(|j| r + 1 + j).collect();
    let send: Vec<f32> = (0..send_counts.iter().sum()).map(val).collect();
    let mut recv = vec![0.0; recv_counts.iter().sum()];
    c.all_to_all_v(&world, "ep", &send, &send_counts, &mut recv, &recv_counts)
        .unwrap();
    outs.push(recv);

    // A sub-group in reverse order (its own communicator) and a singleton.
    let rev = Group::new("rev", (0..n).rev().collect());
    let mut buf: Vec<f32> = (0..11).map(val).collect();
    c.all_reduce(&rev, "dp", &mut buf).unwrap();
    outs.push(buf);
    let mut out = vec![0.0; 3 * n];
    c.all_gather(&rev, "tp", &[val(1), val(2), val(3)], &mut out)
        .unwrap();
    outs.push(out);
    let single = Group::new(format!("self{r}"), vec![r]);
    let mut buf: Vec<f32> = (0..3).map(val).collect();
    c.all_reduce(&single, "tp", &mut buf).unwrap();
    outs.push(buf);

    // Pipeline p2p: a ring.
    if n > 1 {
        let next = (r + 1) % n;
        let prev = (r + n - 1) % n;
        let msg: Vec<f32> = (0..13).map(val).collect();
        let mut got = vec![0.0; 13];
        if r.is_multiple_of(2) {
            c.send(next, "pp", &msg).unwrap();
            c.recv(prev, "pp", &mut got).unwrap();
        } else {
            c.recv(prev, "pp", &mut got).unwrap();
            c.send(next, "pp", &msg).unwrap();
        }
        outs.push(got);
    }
    c.barrier(&world).unwrap();
    (outs, c.counts())
}

fn compare(nccl: Vec<(Vec<Vec<f32>>, ByteCounts)>, reference: Vec<(Vec<Vec<f32>>, ByteCounts)>) {
    for (rank, ((o, c), (ro, rc))) in nccl.iter().zip(&reference).enumerate() {
        assert_eq!(o.len(), ro.len());
        for (k, (a, b)) in o.iter().zip(ro).enumerate() {
            assert_eq!(a.len(), b.len(), "rank {rank} output {k}");
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                    "rank {rank} output {k}: {a:?} vs {b:?}"
                );
            }
        }
        assert_eq!(c, rc, "rank {rank}: byte counts differ from ThreadComm's");
    }
}

fn run_world(comms: Vec<Box<dyn Communicator>>) -> Vec<(Vec<Vec<f32>>, ByteCounts)> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut c| s.spawn(move || program(c.as_mut())))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn check_world(test: &str, n: usize) {
    if skip(test, n) {
        return;
    }
    let devices: Vec<usize> = (0..n).collect();
    let nccl = NcclComm::in_process(&devices).unwrap_or_else(|e| panic!("{test}: {e}"));
    let nccl = run_world(
        nccl.into_iter()
            .map(|c| Box::new(c) as Box<dyn Communicator>)
            .collect(),
    );
    let reference = run_world(
        ThreadComm::create(n, Some(Duration::from_secs(30)))
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Communicator>)
            .collect(),
    );
    compare(nccl, reference);
}

#[test]
fn nccl_world_1_matches_thread_comm() {
    check_world("nccl_world_1_matches_thread_comm", 1);
}

#[test]
fn nccl_world_2_matches_thread_comm() {
    check_world("nccl_world_2_matches_thread_comm", 2);
}

#[test]
fn an_aborted_nccl_communicator_fails_every_later_call_naming_the_first_failure() {
    let test = "an_aborted_nccl_communicator_fails_every_later_call_naming_the_first_failure";
    if skip(test, 1) {
        return;
    }
    let mut c = NcclComm::in_process(&[0])
        .unwrap_or_else(|e| panic!("{test}: {e}"))
        .remove(0);
    let world = Group::world(1);
    c.all_reduce(&world, "dp", &mut [1.0; 4])
        .expect("before the abort");
    c.abort_handle().abort(3, "disk full".into());
    match c.all_reduce(&world, "dp", &mut [1.0; 4]) {
        Err(CommError::Aborted {
            first_rank, reason, ..
        }) => assert_eq!((first_rank, reason.as_str()), (3, "disk full")),
        other => panic!("{test}: expected an abort, got {other:?}"),
    }
    // Dropped without destroying what the abort freed.
}

#[test]
fn nccl_world_2_stops_when_a_rank_fails() {
    let test = "nccl_world_2_stops_when_a_rank_fails";
    if skip(test, 2) {
        return;
    }
    let comms = NcclComm::in_process(&[0, 1]).unwrap_or_else(|e| panic!("{test}: {e}"));
    let comms: Vec<Box<NcclComm>> = comms.into_iter().map(Box::new).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    // On a thread of its own, so that a hang fails the test instead of stalling it.
    std::thread::spawn(move || {
        let results = crate::comm::run_with(2, comms, &|mut c: Box<NcclComm>| {
            let world = Group::world(2);
            c.all_reduce(&world, "dp", &mut [1.0; 4])?;
            if c.rank() == 1 {
                return Err(crate::comm::RankError::Failed(
                    "device out of memory".into(),
                ));
            }
            c.all_reduce(&world, "dp", &mut [1.0; 4])?;
            Ok(())
        });
        let _ = tx.send(results);
    });
    let results = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{test}: rank 0 still waits for rank 1 after 60 s"))
        .expect("one communicator per rank");
    match &results[0] {
        Err(crate::comm::RankError::Comm(CommError::Aborted {
            first_rank, reason, ..
        })) => assert_eq!((*first_rank, reason.as_str()), (1, "device out of memory")),
        other => panic!("{test}: expected an abort, got {other:?}"),
    }
}

#[test]
fn nccl_missing_message_names_the_symlink_fix() {
    let m = nccl_missing_message();
    assert!(m.contains("libnccl.so.2"), "{m}");
    assert!(m.contains("ln -sf"), "{m}");
    assert!(nccl_library_candidates().contains(&"libnccl.so".to_string()));
    // Never a panic, whatever is installed.
    let _ = nccl_available();
    eprintln!("libnccl loadable by cudarc's names: {}", nccl_loadable());
    if std::env::var("REQUIRE_NCCL_LIB").is_ok_and(|v| v == "1") {
        assert!(nccl_loadable(), "REQUIRE_NCCL_LIB=1: {m}");
    }
}
