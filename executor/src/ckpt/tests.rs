//! Checkpoint unit tests.

use super::read::*;
use super::*;

#[test]
fn due_every_k_and_at_the_end() {
    let s = SaveOptions::new("x", 3);
    let due: Vec<u64> = (1..=7).filter(|&d| s.due(d, 7)).collect();
    assert_eq!(due, vec![3, 6, 7]);
    let end = SaveOptions::new("x", 0);
    assert_eq!((1..=7).filter(|&d| end.due(d, 7)).count(), 1);
}

#[test]
fn first_due_is_the_first_step_due_after_the_start() {
    for every in [0, 1, 2, 3, 5] {
        let s = SaveOptions::new("x", every);
        for total in 1..9 {
            for start in 0..10 {
                let want = (start + 1..=total).find(|&d| s.due(d, total));
                assert_eq!(
                    s.first_due(start, total),
                    want,
                    "every {every} start {start} total {total}"
                );
            }
        }
    }
}

#[test]
fn checksums_are_fnv1a_and_sha256() {
    assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(
        sha256_hex(b"abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
}

#[test]
fn step_folder_names_parse_and_others_do_not() {
    assert_eq!(parse_step_folder("step-00000006"), Some((6, false)));
    assert_eq!(parse_step_folder("step-00000006.12-ab"), Some((6, true)));
    assert_eq!(
        parse_step_folder(&step_folder(123_456_789_012)),
        Some((123_456_789_012, false))
    );
    for bad in [
        "step-6",
        "step-0000000x",
        "step-00000006.",
        "step-00000006./x",
        ".tmp-step-00000006",
        "../step-00000006",
        "root:x:0:0",
    ] {
        assert_eq!(parse_step_folder(bad), None, "{bad}");
    }
}

#[test]
fn quote_keeps_one_shortened_line() {
    assert_eq!(quote("step-1"), "step-1");
    assert_eq!(quote("root:x:0:0\nsecret\n"), "root:x:0:0…");
    assert_eq!(quote(&"a".repeat(200)).chars().count(), 81);
    assert_eq!(quote("a\u{1b}b"), "a\\u{1b}b");
}

#[test]
fn an_edited_manifest_names_the_field() {
    let text = r#"{"step": 6, "seed": 1, "optimizer": {"lr": 0.001, "kind": "adamw"}}"#;
    let value: serde_json::Value = serde_json::from_str(text).unwrap();
    let mut sums = Sums {
        format: SUMS_FORMAT.into(),
        files: BTreeMap::from([(MANIFEST.to_string(), sha256_hex(text.as_bytes()))]),
        manifest_fields: field_digests(&value),
        sha256: String::new(),
    };
    sums.sha256 = sums.digest();
    let m = Path::new("ck/manifest.json");
    check_manifest_bytes(m, text.as_bytes(), &sums).unwrap();
    let lr = text.replace("0.001", "0.1");
    let e = check_manifest_bytes(m, lr.as_bytes(), &sums).unwrap_err();
    assert!(e.contains("field `optimizer.lr` changed"), "{e}");
    let two = text.replace("6", "0").replace("\"seed\": 1", "\"seed\": 2");
    let e = check_manifest_bytes(m, two.as_bytes(), &sums).unwrap_err();
    assert!(e.contains("fields `seed`, `step` changed"), "{e}");
    let spaced = text.replace(", ", ",");
    let e = check_manifest_bytes(m, spaced.as_bytes(), &sums).unwrap_err();
    assert!(e.contains("every field reads the same"), "{e}");
    let e = check_manifest_bytes(m, b"{", &sums).unwrap_err();
    assert!(e.contains("not a checkpoint manifest"), "{e}");
}

mod round_trip {
    use super::super::*;
    use crate::shard::local_weight;
    use meshplan_ir::{load_model, model_graph, WorkloadOverrides};

    fn graph(name: &str) -> Graph {
        let path = format!("{}/../models/{name}.yaml", env!("CARGO_MANIFEST_DIR"));
        let spec = load_model(Path::new(&path), &WorkloadOverrides::default())
            .unwrap_or_else(|e| panic!("{e}"));
        model_graph(&spec).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Every rank's slices of distinct values, each handed over as two pieces (as a
    /// ZeRO partition boundary would cut them).
    fn snapshots(graph: &Graph, sites: &[WeightSite], tp: usize, ep: usize) -> Vec<RankSnapshot> {
        let places = (0..ep).flat_map(|e| (0..tp).map(move |t| (t, e)));
        let place = |(t, e)| (TpPos { rank: t, size: tp }, TpPos { rank: e, size: ep });
        places.map(|at| snapshot(graph, sites, place(at))).collect()
    }

    /// The snapshot of the rank at places `(tp, ep)` ([`snapshots`]).
    fn snapshot(graph: &Graph, sites: &[WeightSite], (tp, ep): (TpPos, TpPos)) -> RankSnapshot {
        let mut pieces = Vec::new();
        for s in sites {
            let n: usize = s.shape.iter().product();
            let full: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
            let op = s.op(graph);
            let local = local_weight(graph, op, op.role, s.id, &full, &s.shape, tp, ep);
            let half = local.len() / 2;
            for (a, b) in [(0, half), (half, local.len())] {
                let w = local[a..b].to_vec();
                pieces.push(Piece {
                    key: s.key.clone(),
                    start: a,
                    m: w.iter().map(|x| 2.0 * x).collect(),
                    v: w.iter().map(|x| 3.0 * x).collect(),
                    w,
                });
            }
        }
        RankSnapshot { tp, ep, pieces }
    }

    fn copy(s: &RankSnapshot) -> RankSnapshot {
        RankSnapshot {
            tp: s.tp,
            ep: s.ep,
            pieces: (s.pieces.iter())
                .map(|p| Piece {
                    key: p.key.clone(),
                    start: p.start,
                    w: p.w.clone(),
                    m: p.m.clone(),
                    v: p.v.clone(),
                })
                .collect(),
        }
    }

    /// The full tensors of `snaps`, placed one after another as a save does.
    fn assemble(
        graph: &Graph,
        sites: &[WeightSite],
        snaps: &[RankSnapshot],
    ) -> Result<Vec<Full>, String> {
        let assembly = Assembly::new(sites);
        for snap in snaps {
            assembly.place(graph, sites, copy(snap))?;
        }
        assembly.finish(sites)
    }

    #[test]
    fn assembling_inverts_local_weight_for_every_role() {
        for (model, tp, ep) in [
            ("tiny-gpt", 2, 1),
            ("tiny-gpt", 4, 1),
            ("tiny-moe", 2, 1),
            ("tiny-moe", 4, 1),
            ("tiny-moe", 1, 2),
        ] {
            let g = graph(model);
            let sites = model_weights(&g).unwrap();
            let roles: std::collections::HashSet<String> = sites
                .iter()
                .map(|s| format!("{:?}", s.op(&g).role))
                .collect();
            assert!(roles.len() >= 3, "{model}: roles {roles:?}");
            let tensors = assemble(&g, &sites, &snapshots(&g, &sites, tp, ep)).unwrap();
            assert_eq!(tensors.len(), 3 * sites.len());
            for (name, shape, values) in &tensors {
                let n: usize = shape.iter().product();
                let scale = if name.starts_with("adam_m/") {
                    2.0
                } else if name.starts_with("adam_v/") {
                    3.0
                } else {
                    1.0
                };
                let want: Vec<f32> = (0..n).map(|i| scale * (i as f32 + 0.5)).collect();
                assert!(*values == want, "{model} tp={tp} ep={ep}: `{name}` differs");
            }
        }
    }

    /// A writer for a world of `world` ranks of graph `g` saving every step into
    /// a fresh `dir`, in files of at most 64 KiB.
    fn saver(g: &Graph, dir: &Path, world: usize) -> Saver {
        let _ = fs::remove_dir_all(dir);
        let mut opts = SaveOptions::new(dir, 1);
        opts.prepare(0, 1).unwrap();
        // Files of 64 KiB: one file's bytes, serialized before written, stay small.
        opts.file_bytes = 64 << 10;
        Saver {
            opts,
            meta: Arc::new(RunMeta {
                graph: g.clone(),
                sites: model_weights(g).unwrap(),
                model: "tiny-gpt".into(),
                strategy: format!("tp={world}"),
                workload: serde_json::Value::Null,
                seed: 1,
                lr: 1e-3,
                world,
                data: serde_json::json!({"kind": "synthetic"}),
            }),
            pending: Mutex::new(BTreeMap::new()),
            writer: Mutex::new(None),
        }
    }

    /// A save is timed from the first rank's hand-over, not from the writer's
    /// start: the ranks' placing (here, waits between the two deposits) counts.
    #[test]
    fn a_save_is_timed_from_the_first_hand_over() {
        let g = graph("tiny-gpt");
        let sites = model_weights(&g).unwrap();
        let dir = std::env::temp_dir().join(format!("meshplan-timed-{}", std::process::id()));
        let saver = saver(&g, &dir, 2);
        for snap in snapshots(&g, &sites, 2, 1) {
            saver.deposit(1, snap).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        let saved = saver.finish().unwrap();
        let _ = fs::remove_dir_all(&dir);
        assert!(saved[0].error.is_none(), "{:?}", saved[0].error);
        assert!(saved[0].seconds >= 0.2, "{} s", saved[0].seconds);
    }

    /// A save holds the model's state about once: each rank's snapshot is placed
    /// into the full tensors as it arrives and freed. Four tensor ranks of tiny-gpt
    /// deposit one after another, as rank 0 receives them under a launch, each
    /// snapshot made just before its deposit; the heap's peak from the first
    /// deposit to the written folder is the full tensors, one snapshot and one
    /// file's bytes. Keeping the snapshots until the last one arrived would add
    /// the model's state again.
    #[test]
    fn a_save_holds_the_model_state_once() {
        let name = "ckpt::tests::round_trip::a_save_holds_the_model_state_once";
        if !crate::alloc::heap::measure_alone(name) {
            return;
        }
        let g = graph("tiny-gpt");
        let sites = model_weights(&g).unwrap();
        let dir = std::env::temp_dir().join(format!("meshplan-heap-{}", std::process::id()));
        let tp = 4;
        let saver = saver(&g, &dir, tp);
        let values = |s: &RankSnapshot| s.pieces.iter().map(|p| p.w.len()).sum::<usize>();
        let model: usize = (sites.iter())
            .map(|s| s.shape.iter().product::<usize>())
            .sum();
        let (mut largest, mut tensor) = (0, 0);
        let start = crate::alloc::heap::reset_peak();
        for rank in 0..tp {
            let place = (TpPos { rank, size: tp }, TpPos { rank: 0, size: 1 });
            let snap = snapshot(&g, &sites, place);
            largest = largest.max(values(&snap));
            saver.deposit(1, snap).unwrap();
        }
        let saved = saver.finish().unwrap();
        let peak = crate::alloc::heap::peak() - start;
        assert_eq!(saved.len(), 1);
        assert!(saved[0].error.is_none(), "{:?}", saved[0].error);
        for s in &sites {
            tensor = tensor.max(s.shape.iter().product::<usize>());
        }
        let _ = fs::remove_dir_all(&dir);
        // 12 bytes a value (weight, two moments): the full tensors, the largest
        // snapshot, and one file (at most 64 KiB, or a tensor of its own).
        let bound = 12 * (model + largest) + (64 << 10).max(4 * tensor);
        let slack = bound / 10;
        eprintln!(
            "model {model} values, largest snapshot {largest}: peak {peak} bytes, bound {bound} + {slack}"
        );
        assert!(peak <= bound + slack, "peak {peak} > {bound} + {slack}");
    }

    #[test]
    fn a_missing_rank_is_an_incomplete_checkpoint() {
        let g = graph("tiny-gpt");
        let sites = model_weights(&g).unwrap();
        let mut snaps = snapshots(&g, &sites, 2, 1);
        snaps.pop();
        let err = assemble(&g, &sites, &snaps).map(|_| ()).unwrap_err();
        assert!(err.contains("no rank owns element"), "{err}");
    }

    /// Launched ranks (threads here) offer their snapshots to rank 0, which takes
    /// only the pieces it has no copy of: of 2 data-parallel replicas of tp=2, rank
    /// 0 receives the values of tensor rank 1's shards, once, and nothing of the
    /// weights every rank holds whole; the tensors still assemble whole.
    #[test]
    fn replicas_send_the_writer_each_value_once() {
        use crate::comm::{CommKind, Communicator, ThreadComm};
        let g = graph("tiny-gpt");
        let sites = model_weights(&g).unwrap();
        let every: Vec<RankSnapshot> = (0..2).flat_map(|_| snapshots(&g, &sites, 2, 1)).collect();
        let (g, sites, every) = (&g, &sites, &every);
        let offered = |s: &RankSnapshot| -> Vec<Offered> {
            (s.pieces.iter())
                .map(|p| (p.key.clone(), p.start, p.w.len()))
                .collect()
        };
        let (kept, received) = std::thread::scope(|s| {
            let ranks: Vec<_> = ThreadComm::create(4, None)
                .into_iter()
                .enumerate()
                .map(|(rank, mut comm)| {
                    s.spawn(move || {
                        let mine = &every[rank];
                        if rank != 0 {
                            let wanted = offer(&mut comm, 0, (mine.tp, mine.ep), &offered(mine));
                            let mut sent = copy(mine);
                            let mut wanted = wanted.unwrap().into_iter();
                            sent.pieces.retain(|_| wanted.next().unwrap());
                            send_pieces(&mut comm, 0, &sent).unwrap();
                            return None;
                        }
                        let mut pending = Pending::default();
                        let own = pending.wanted(g, sites, (mine.tp, mine.ep), &offered(mine));
                        assert!(own.unwrap().iter().all(|&w| w));
                        let mut kept = vec![copy(mine)];
                        for from in 1..4 {
                            let offer = recv_offer(&mut comm, from).unwrap();
                            let wanted = pending.wanted(g, sites, offer.place, &offer.pieces);
                            kept.push(
                                take_offer(&mut comm, from, offer, &wanted.unwrap()).unwrap(),
                            );
                        }
                        let counts = comm.counts();
                        let recv = counts.get(CommKind::Recv, "ckpt");
                        Some((kept, recv.map_or(0, |c| c.payload_bytes)))
                    })
                })
                .collect();
            let out: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
            out.into_iter().flatten().next().unwrap()
        });
        let model: usize = sites
            .iter()
            .map(|s| s.shape.iter().product::<usize>())
            .sum();
        let own: usize = every[0].pieces.iter().map(|p| p.w.len()).sum();
        // Weight, first and second moment, 4 bytes each, of what rank 0 lacks.
        assert_eq!(received, 12 * (model - own) as u64);
        assert!(kept[2].pieces.is_empty() && kept[3].pieces.is_empty());
        let all = assemble(g, sites, every).unwrap();
        assert!(assemble(g, sites, &kept).unwrap() == all);
    }
}
