//! Failures that must end every rank quickly and name where each waited: a rank's
//! error or panic, an abort, a timeout, a deadlock, mismatched or invalid calls.

use super::*;

#[test]
fn a_rank_returning_an_error_stops_everyone() {
    let start = Instant::now();
    let group = Group::new("tp", vec![0, 1, 2, 3]);
    let results: Vec<Result<(), RankError>> = run_ranks(4, LONG, 1, |mut c| {
        for _ in 0..7 {
            c.all_reduce(&group, "tp", &mut [1.0; 4])?;
        }
        if c.rank() == 3 {
            return Err("bad input".into());
        }
        c.all_reduce(&group, "tp", &mut [1.0; 4])?;
        Ok(())
    });
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
    assert!(results.iter().all(Result::is_err), "{results:?}");
    assert_eq!(results[3], Err(RankError::Failed("bad input".into())));
    for r in &results[..3] {
        match r {
            Err(RankError::Comm(CommError::Aborted {
                first_rank,
                reason,
                waiting_in,
            })) => {
                assert_eq!(*first_rank, 3);
                assert_eq!(reason, "bad input");
                assert_eq!(waiting_in.kind, CommKind::AllReduce);
                assert_eq!(waiting_in.seq, 7);
            }
            other => panic!("expected an abort, got {other:?}"),
        }
    }
    assert_eq!(
        failure_summary(&results).as_deref(),
        Some("rank 3 failed: bad input; ranks 0,1,2 were waiting in all_reduce on tp (seq 7)")
    );
}

#[test]
fn a_panicking_rank_stops_everyone() {
    // Also when the rank runs inside its own kernel pool: the panic crosses it.
    for threads in [1, 2] {
        let start = Instant::now();
        let results: Vec<Result<(), RankError>> = run_ranks(4, LONG, threads, |mut c| {
            let dp = Group::new("dp", vec![0, 1, 2, 3]);
            c.barrier(&dp)?;
            if c.rank() == 1 {
                panic!("boom at step {}", 2);
            }
            let mut out = [0.0; 8];
            c.all_gather(&dp, "dp", &[1.0, 2.0], &mut out)?;
            Ok(())
        });
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "took {:?}",
            start.elapsed()
        );
        assert!(results.iter().all(Result::is_err));
        assert_eq!(
            results[1],
            Err(RankError::Panicked("boom at step 2".into()))
        );
        assert_eq!(
            failure_summary(&results).as_deref(),
            Some(
                "rank 1 failed: panicked: boom at step 2; ranks 0,2,3 were waiting in all_gather \
             on dp (seq 1)"
            )
        );
    }
}

#[test]
fn run_with_hands_a_failure_to_communicators_that_cannot_see_it() {
    // `run_with` does not tell these communicators when a rank ends (as with
    // NCCL's), so without its abort handles the others would wait out `LONG`.
    for panics in [false, true] {
        let start = Instant::now();
        let comms: Vec<Box<dyn Communicator>> = ThreadComm::create(3, LONG)
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Communicator>)
            .collect();
        let results = run_with(3, comms, &|mut c: Box<dyn Communicator>| {
            let world = Group::world(3);
            c.all_reduce(&world, "dp", &mut [1.0; 4])?;
            if c.rank() == 2 {
                if panics {
                    panic!("device out of memory");
                }
                return Err(RankError::Failed("device out of memory".into()));
            }
            c.all_reduce(&world, "dp", &mut [1.0; 4])?;
            Ok(c.rank())
        })
        .expect("one communicator per rank");
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "took {:?}",
            start.elapsed()
        );
        let (reason, why) = if panics {
            (
                "panicked: device out of memory",
                RankError::Panicked("device out of memory".into()),
            )
        } else {
            (
                "device out of memory",
                RankError::Failed("device out of memory".into()),
            )
        };
        assert_eq!(results[2], Err(why));
        for r in &results[..2] {
            match r {
                Err(RankError::Comm(CommError::Aborted {
                    first_rank,
                    reason: got,
                    waiting_in,
                })) => {
                    assert_eq!((*first_rank, got.as_str()), (2, reason));
                    assert_eq!((waiting_in.kind, waiting_in.seq), (CommKind::AllReduce, 1));
                }
                other => panic!("expected an abort, got {other:?}"),
            }
        }
        assert_eq!(
            failure_summary(&results),
            Some(format!(
                "rank 2 failed: {reason}; ranks 0,1 were waiting in all_reduce on dp (group world, seq 1)"
            ))
        );
    }
}

#[test]
fn run_with_refuses_communicators_out_of_rank_order() {
    let mut comms: Vec<Box<dyn Communicator>> = ThreadComm::create(2, LONG)
        .into_iter()
        .map(|c| Box::new(c) as Box<dyn Communicator>)
        .collect();
    comms.swap(0, 1);
    let e = run_with(2, comms, &|c: Box<dyn Communicator>| Ok(c.rank()));
    assert_eq!(
        e.err().as_deref(),
        Some("2 communicators for a plan of 2 ranks (one per rank, in rank order)")
    );
}

#[test]
fn a_blocked_receive_is_aborted_too() {
    // Rank 0 waits for a message rank 1 never sends; rank 1 fails instead.
    let start = Instant::now();
    let results: Vec<Result<(), RankError>> = run_ranks(2, LONG, 1, |mut c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(50));
            return Err("out of memory".into());
        }
        c.recv(1, "pp", &mut [0.0; 4])?;
        Ok(())
    });
    assert!(start.elapsed() < Duration::from_secs(2));
    assert_eq!(
        failure_summary(&results).as_deref(),
        Some("rank 1 failed: out of memory; rank 0 was waiting in recv on pp from rank 1 (seq 0)")
    );
}

#[test]
fn a_timeout_names_the_ranks_that_did_not_arrive() {
    let start = Instant::now();
    let group = Group::new("dp", vec![0, 1, 2]);
    let results: Vec<Result<(), RankError>> =
        run_ranks(3, Some(Duration::from_millis(200)), 1, |mut c| {
            if c.rank() == 2 {
                // Late, but not finished: only the timeout can end the wait.
                std::thread::sleep(Duration::from_millis(800));
            }
            c.all_reduce(&group, "dp", &mut [1.0])?;
            Ok(())
        });
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "took {:?}",
        start.elapsed()
    );
    assert!(results.iter().all(Result::is_err), "{results:?}");
    let timeouts: Vec<&CommError> = results
        .iter()
        .filter_map(|r| match r {
            Err(RankError::Comm(e @ CommError::Timeout { .. })) => Some(e),
            _ => None,
        })
        .collect();
    assert!(!timeouts.is_empty(), "{results:?}");
    for e in timeouts {
        let CommError::Timeout {
            kind,
            axis,
            seq,
            missing,
            ..
        } = e
        else {
            unreachable!()
        };
        assert_eq!((*kind, axis.as_str(), *seq), (CommKind::AllReduce, "dp", 0));
        assert_eq!(*missing, vec![2]);
        assert!(
            e.to_string()
                .ends_with("in all_reduce on dp (seq 0): rank 2 did not arrive"),
            "{e}"
        );
    }
    // The late rank finds the world aborted rather than waiting again.
    assert!(matches!(
        &results[2],
        Err(RankError::Comm(CommError::Aborted { first_rank, .. })) if *first_rank < 2
    ));
    let summary = failure_summary(&results).unwrap_or_default();
    assert!(summary.contains("timed out"), "{summary}");
    assert!(summary.contains("rank 2 did not arrive"), "{summary}");
}

#[test]
fn ranks_that_wait_for_each_other_fail_at_once_naming_every_wait() {
    // The limit only keeps a regression from hanging the suite.
    let limit = Some(Duration::from_secs(20));
    let start = Instant::now();
    let results = run_ranks(2, limit, 1, |mut c| {
        let peer = 1 - c.rank();
        c.recv(peer, "pp", &mut [0.0; 2])?;
        c.send(peer, "pp", &[0.0; 2])?;
        Ok(())
    });
    assert!(start.elapsed() < Duration::from_secs(2), "{results:?}");
    assert_eq!(
        failure_summary(&results).as_deref(),
        Some(
            "deadlock: every rank still running waits for another (rank 0 in recv on pp \
             from rank 1 (seq 0), rank 1 in recv on pp from rank 0 (seq 0))"
        ),
    );
    // Collectives entered in crossed order, while a third rank computes: no one
    // is stuck for good until it has finished, and then both are.
    let busy = Duration::from_millis(300);
    let start = Instant::now();
    let (tp, dp) = (Group::new("tp", vec![0, 1]), Group::new("dp", vec![0, 1]));
    let results = run_ranks(3, limit, 1, |mut c| {
        match c.rank() {
            0 => {
                c.all_reduce(&tp, "tp", &mut [1.0])?;
                c.all_reduce(&dp, "dp", &mut [1.0])?;
            }
            1 => {
                c.all_reduce(&dp, "dp", &mut [1.0])?;
                c.all_reduce(&tp, "tp", &mut [1.0])?;
            }
            _ => std::thread::sleep(busy),
        }
        Ok(())
    });
    let took = start.elapsed();
    assert!(took >= busy && took < Duration::from_secs(2), "{took:?}");
    assert!(results[2].is_ok());
    let summary = failure_summary(&results).unwrap_or_default();
    assert!(
        summary
            .contains("(rank 0 in all_reduce on tp (seq 0), rank 1 in all_reduce on dp (seq 0))"),
        "{summary}"
    );
    assert!(
        results[..2].iter().any(
            |r| matches!(r, Err(RankError::Comm(CommError::Deadlock { waits })) if waits.len() == 2)
        ),
        "{results:?}"
    );
}

#[test]
fn a_wait_without_a_limit_outlasts_a_peer_that_computes() {
    let group = Group::new("dp", vec![0, 1]);
    let results = all_ok(run_ranks(2, None, 1, |mut c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(300));
        }
        let mut x = [c.rank() as f32 + 1.0];
        c.all_reduce(&group, "dp", &mut x)?;
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(500));
            c.send(0, "pp", &x)?;
        } else {
            c.recv(1, "pp", &mut x)?;
        }
        Ok(x[0])
    }));
    assert_eq!(results, vec![3.0, 3.0]);
    // A message, or a completed rendezvous, lets its waiter go on: a rank that
    // sleeps right after its peer's wake-up, before the peer ran again, is not a
    // deadlock. Ping-pong makes that the common case.
    let results = all_ok(run_ranks(2, None, 1, |mut c| {
        let (me, peer) = (c.rank(), 1 - c.rank());
        let mut x = [0.0f32];
        for _ in 0..300 {
            if me == 0 {
                x[0] += 1.0;
                c.send(peer, "pp", &x)?;
                c.recv(peer, "pp", &mut x)?;
            } else {
                c.recv(peer, "pp", &mut x)?;
                c.send(peer, "pp", &x)?;
            }
            c.all_reduce(&group, "dp", &mut [1.0])?;
        }
        Ok(x[0])
    }));
    assert_eq!(results, vec![300.0, 300.0]);
}

#[test]
fn a_rank_that_finishes_without_joining_fails_its_peers_at_once() {
    let start = Instant::now();
    let group = Group::new("tp", vec![0, 1]);
    let results: Vec<Result<(), RankError>> = run_ranks(2, LONG, 1, |mut c| {
        if c.rank() == 0 {
            c.all_reduce(&group, "tp", &mut [1.0])?;
        }
        Ok(())
    });
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(results[1].is_ok());
    match &results[0] {
        Err(RankError::Comm(CommError::Unmatched { finished, .. })) => {
            assert_eq!(*finished, vec![1])
        }
        other => panic!("expected unmatched, got {other:?}"),
    }
}

#[test]
fn mismatched_collectives_are_reported() {
    let group = Group::world(2);
    // Different kinds at the same sequence number.
    let results: Vec<Result<(), RankError>> = run_ranks(2, LONG, 1, |mut c| {
        if c.rank() == 0 {
            c.all_reduce(&group, "tp", &mut [0.0; 4])?;
        } else {
            c.all_gather(&group, "tp", &[0.0; 2], &mut [0.0; 4])?;
        }
        Ok(())
    });
    assert!(results.iter().all(Result::is_err));
    let summary = failure_summary(&results).unwrap_or_default();
    assert!(
        summary.contains("all_reduce on tp with 4 elements")
            && summary.contains("all_gather on tp with 2 elements"),
        "{summary}"
    );
    // Same kind, different sizes.
    let results: Vec<Result<(), RankError>> = run_ranks(2, LONG, 1, |mut c| {
        let len = 4 + c.rank();
        c.all_reduce(&group, "tp", &mut vec![0.0; len])?;
        Ok(())
    });
    let summary = failure_summary(&results).unwrap_or_default();
    assert!(
        summary.contains("with 4 elements") && summary.contains("with 5 elements"),
        "{summary}"
    );
    // A message that does not fit the receive.
    let results: Vec<Result<(), RankError>> = run_ranks(2, LONG, 1, |mut c| {
        if c.rank() == 0 {
            c.send(1, "pp", &[0.0; 3])?;
        } else {
            c.recv(0, "pp", &mut [0.0; 2])?;
        }
        Ok(())
    });
    assert!(matches!(
        &results[1],
        Err(RankError::Comm(CommError::Mismatch { detail, .. }))
            if detail.contains("sent 3 elements") && detail.contains("receives 2")
    ));
}

#[test]
fn invalid_arguments_are_errors_not_panics() {
    let mut comms = ThreadComm::create(2, LONG);
    let c = &mut comms[0];
    let not_member = Group::new("tp", vec![1]);
    assert!(matches!(
        c.all_reduce(&not_member, "tp", &mut [0.0]),
        Err(CommError::InvalidArgument { .. })
    ));
    // Any error aborts the world, so later calls report that first failure.
    assert_eq!(c.failure().map(|f| f.first_rank), Some(0));
    let mut comms = ThreadComm::create(2, LONG);
    let c = &mut comms[0];
    let e = c.all_gather(&Group::world(2), "dp", &[0.0; 2], &mut [0.0; 3]);
    assert_eq!(
        e.map_err(|e| e.to_string()),
        Err("invalid all_gather arguments: output holds 3 elements, expected 2 members x 2".into())
    );
    let mut comms = ThreadComm::create(2, LONG);
    let e = comms[0].reduce_scatter(&Group::world(2), "dp", &[0.0; 3], &mut [0.0; 2]);
    assert_eq!(
        e.map_err(|e| e.to_string()),
        Err(
            "invalid reduce_scatter arguments: input holds 3 elements, expected 2 members x 2"
                .into()
        )
    );
    let mut comms = ThreadComm::create(2, LONG);
    let e = comms[0].send(5, "pp", &[0.0]);
    assert!(matches!(
        e,
        Err(CommError::InvalidArgument {
            kind: CommKind::Send,
            ..
        })
    ));
    let mut comms = ThreadComm::create(2, LONG);
    let e = comms[0].barrier(&Group::new("x", vec![0, 0]));
    assert!(matches!(e, Err(CommError::InvalidArgument { .. })));
}

#[test]
fn abort_reaches_ranks_not_yet_communicating() {
    let mut comms = ThreadComm::create(2, LONG);
    comms[1].abort("disk full".into());
    match comms[0].all_reduce(&Group::world(2), "dp", &mut [0.0]) {
        Err(CommError::Aborted {
            first_rank,
            reason,
            waiting_in,
        }) => {
            assert_eq!((first_rank, reason.as_str()), (1, "disk full"));
            assert_eq!(
                waiting_in.to_string(),
                "all_reduce on dp (group world, seq 0)"
            );
        }
        other => panic!("expected an abort, got {other:?}"),
    }
    // A later abort does not replace the first failure.
    comms[0].abort("second".into());
    assert_eq!(
        comms[0].failure(),
        Some(Failure {
            first_rank: 1,
            reason: "disk full".into()
        })
    );
}

#[test]
fn summary_is_none_when_every_rank_succeeds() {
    let results = run_ranks(3, LONG, 1, |mut c| {
        c.barrier(&Group::world(3))?;
        Ok(c.rank())
    });
    assert_eq!(failure_summary(&results), None);
    assert_eq!(all_ok(results), vec![0, 1, 2]);
}
