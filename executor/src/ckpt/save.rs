//! Saving: the background writer that assembles every rank's parts into full
//! tensors and writes a step folder.

use super::*;
use crate::shard::held_runs;
use std::collections::HashSet;
use std::ops::Range;

/// What the writer needs of the run, owned so that it outlives the rank threads.
pub(super) struct RunMeta {
    pub(super) graph: Graph,
    pub(super) sites: Vec<WeightSite>,
    pub(super) model: String,
    pub(super) strategy: String,
    pub(super) workload: serde_json::Value,
    pub(super) seed: u64,
    pub(super) lr: f32,
    pub(super) world: usize,
    pub(super) data: serde_json::Value,
}

pub(super) type Writer = JoinHandle<Result<Vec<Saved>, String>>;

/// Collects the ranks' snapshots at each save step and writes them in order on a
/// writer thread, so ranks go on training while a checkpoint is written.
pub(crate) struct Saver {
    pub(super) opts: SaveOptions,
    pub(super) meta: Arc<RunMeta>,
    pub(super) pending: Mutex<BTreeMap<u64, Pending>>,
    pub(super) writer: Mutex<Option<Writer>>,
}

/// A save step's state so far.
#[derive(Default)]
pub(super) struct Pending {
    /// The full tensors, filled as the ranks deposit.
    assembly: Option<Arc<Assembly>>,
    /// Ranks whose snapshot is placed.
    deposits: usize,
    /// When the first rank handed its state over: a save is timed from then.
    since: Option<Instant>,
    /// The first piece that could not be placed: the save fails with it.
    error: Option<String>,
    /// The full-tensor elements of each piece kept, by weight: a data-parallel
    /// replica's piece of the same elements (or a tensor rank's of a weight every
    /// tensor rank holds whole) is not kept again, so the writer holds each value
    /// once however many ranks hold it.
    held: HashSet<(usize, Vec<Range<usize>>)>,
}

impl Pending {
    /// [`Saver::wanted`] for this step.
    pub(super) fn wanted(
        &mut self,
        graph: &Graph,
        sites: &[WeightSite],
        (tp, ep): (TpPos, TpPos),
        pieces: &[Offered],
    ) -> Result<Vec<bool>, String> {
        let index = site_indices(sites);
        let mut runs_cache: HashMap<usize, Vec<Range<usize>>> = HashMap::new();
        let mut wanted = Vec::with_capacity(pieces.len());
        for (key, start, len) in pieces {
            let i = site_index(&index, key)?;
            let runs = (runs_cache.entry(i)).or_insert_with(|| site_runs(graph, &sites[i], tp, ep));
            let global = piece_runs(runs, *start, start + len).map(|(at, _)| at);
            wanted.push(self.held.insert((i, global.collect())));
        }
        Ok(wanted)
    }
}

/// A piece as a rank offers it: its weight, first local element and length.
pub(crate) type Offered = (Key, usize, usize);

impl Saver {
    /// Prepares the folder ([`SaveOptions::prepare`]) unless the caller did.
    pub fn new(plan: &Plan, opts: &TrainOptions, save: &SaveOptions) -> Result<Saver, String> {
        let workload = match &plan.workload {
            Workload::Train {
                seq_len,
                global_batch,
                ..
            } => serde_json::json!({"seq_len": seq_len, "global_batch": global_batch}),
            _ => serde_json::Value::Null,
        };
        let mut save = save.clone();
        let start = opts.resume.as_ref().map_or(0, |c| c.step());
        save.prepare(start, opts.steps)?;
        Ok(Saver {
            opts: save,
            meta: Arc::new(RunMeta {
                graph: plan.graph.clone(),
                sites: model_weights(&plan.graph)?,
                model: plan.model.name.clone(),
                strategy: plan.strategy.to_string(),
                workload,
                seed: opts.seed,
                lr: opts.lr,
                world: plan.ranks.len(),
                data: opts.data.describe(),
            }),
            pending: Mutex::new(BTreeMap::new()),
            writer: Mutex::new(None),
        })
    }

    /// Which of the pieces a rank at places `(tp, ep)` offers for `step` are not
    /// copies of one kept so far (the same elements of the same weight); those are
    /// counted as kept. A piece overlapping a kept one in part is kept too: the
    /// writer places both, and replicas hold the same values.
    pub(crate) fn wanted(
        &self,
        step: u64,
        (tp, ep): (TpPos, TpPos),
        pieces: &[Offered],
    ) -> Result<Vec<bool>, String> {
        let mut pending = self.pending()?;
        let at = pending.entry(step).or_default();
        at.wanted(&self.meta.graph, &self.meta.sites, (tp, ep), pieces)
    }

    /// Hands over a rank's state after `step` steps: the pieces [`Saver::wanted`]
    /// chose of those it offered, placed into the step's full tensors and freed
    /// piece by piece. The last rank starts the write.
    pub(crate) fn deposit(&self, step: u64, snap: RankSnapshot) -> Result<(), String> {
        let sites = &self.meta.sites;
        let assembly = {
            let mut pending = self.pending()?;
            let at = pending.entry(step).or_default();
            at.since.get_or_insert_with(Instant::now);
            Arc::clone((at.assembly).get_or_insert_with(|| Arc::new(Assembly::new(sites))))
        };
        // Outside the step's lock: ranks depositing together place side by side,
        // each weight under its own lock.
        let placed = assembly.place(&self.meta.graph, sites, snap);
        drop(assembly);
        let mut pending = self.pending()?;
        let at = pending.entry(step).or_default();
        at.deposits += 1;
        if let Err(e) = placed {
            at.error.get_or_insert(e);
        }
        if at.deposits < self.meta.world {
            return Ok(());
        }
        let done = pending.remove(&step).unwrap_or_default();
        drop(pending);
        let t0 = done.since.unwrap_or_else(Instant::now);
        // Every depositor dropped its handle before it counted itself.
        let assembly = match (done.error, done.assembly.map(Arc::try_unwrap)) {
            (Some(e), _) => Err(e),
            (None, Some(Ok(a))) => Ok(a),
            (None, _) => Err("the checkpoint's tensors are still being filled".into()),
        };
        let mut writer = self
            .writer
            .lock()
            .map_err(|_| "checkpoint writer poisoned")?;
        let prev = writer.take();
        let (meta, opts) = (self.meta.clone(), self.opts.clone());
        *writer = Some(std::thread::spawn(move || {
            // Saves publish in step order: `latest` never goes back. A failed save
            // does not stop the later ones: each is a retry.
            let mut done = match prev {
                Some(p) => p.join().map_err(|_| "checkpoint writer panicked")??,
                None => Vec::new(),
            };
            let written = assembly.and_then(|a| write_checkpoint(&meta, &opts, (step, t0), a));
            let saved = written.unwrap_or_else(|e| {
                let latest = match read_latest(&opts.dir) {
                    Ok(Some((name, _))) => format!("{}", opts.dir.join(name).display()),
                    _ => "none".into(),
                };
                notify(
                    &opts,
                    &format!(
                        "checkpoint: saving step {step} failed: {e}; training goes on, the next due save tries again, and the run will end with an error (last good checkpoint: {latest})"
                    ),
                );
                Saved {
                    step,
                    path: opts.dir.join(step_folder(step)),
                    bytes: 0,
                    files: 0,
                    seconds: t0.elapsed().as_secs_f64(),
                    error: Some(e),
                }
            });
            done.push(saved);
            Ok(done)
        }));
        Ok(())
    }

    fn pending(&self) -> Result<std::sync::MutexGuard<'_, BTreeMap<u64, Pending>>, String> {
        (self.pending.lock()).map_err(|_| "checkpoint state poisoned".into())
    }

    /// Waits for every write; the checkpoints written and the saves that failed,
    /// in step order.
    pub fn finish(self) -> Result<Vec<Saved>, String> {
        let writer = self
            .writer
            .into_inner()
            .map_err(|_| "checkpoint writer poisoned")?;
        match writer {
            Some(w) => w.join().map_err(|_| "checkpoint writer panicked")?,
            None => Ok(Vec::new()),
        }
    }
}

pub(super) fn notify(opts: &SaveOptions, message: &str) {
    match &opts.notify {
        Some(n) => (n.0)(message),
        None => eprintln!("{message}"),
    }
}

/// A full tensor: name, shape, values.
pub(super) type Full = (String, Vec<usize>, Vec<f32>);

/// Every weight's values and moments, filled as the ranks' snapshots arrive and
/// each snapshot freed once placed: the writer holds the model's state once.
/// (Keeping the snapshots until the last arrived, then assembling, held it twice.)
pub(super) struct Assembly {
    sites: Vec<Mutex<Filling>>,
}

/// One weight's full tensors (values, first and second moments) and the runs of
/// elements placed so far.
struct Filling {
    full: [Vec<f32>; 3],
    placed: Vec<Range<usize>>,
}

impl Assembly {
    pub(super) fn new(sites: &[WeightSite]) -> Assembly {
        let filling = |s: &WeightSite| {
            let n: usize = s.shape.iter().product();
            Mutex::new(Filling {
                full: [vec![0.0; n], vec![0.0; n], vec![0.0; n]],
                placed: Vec::new(),
            })
        };
        Assembly {
            sites: sites.iter().map(filling).collect(),
        }
    }

    /// Places a rank's pieces, each freed once copied.
    pub(super) fn place(
        &self,
        graph: &Graph,
        sites: &[WeightSite],
        snap: RankSnapshot,
    ) -> Result<(), String> {
        let index = site_indices(sites);
        let mut runs_cache: HashMap<usize, Vec<Range<usize>>> = HashMap::new();
        for p in snap.pieces {
            let i = site_index(&index, &p.key)?;
            let runs = (runs_cache.entry(i))
                .or_insert_with(|| site_runs(graph, &sites[i], snap.tp, snap.ep));
            let held: usize = runs.iter().map(|r| r.len()).sum();
            let end = p.start + p.w.len();
            if end > held || p.m.len() != p.w.len() || p.v.len() != p.w.len() {
                return Err(format!(
                    "`{}`: a piece {}..{end} outside the local size {held}",
                    tensor_name("w", &p.key),
                    p.start,
                ));
            }
            let mut f = (self.sites[i].lock()).map_err(|_| "checkpoint tensors poisoned")?;
            for (at, from) in piece_runs(runs, p.start, end) {
                for (dst, src) in f.full.iter_mut().zip([&p.w, &p.m, &p.v]) {
                    dst[at.clone()].copy_from_slice(&src[from.clone()]);
                }
                f.placed.push(at);
            }
        }
        Ok(())
    }

    /// The full tensors in the order of `sites`, (name, shape, values): weights
    /// then Adam moments of each weight; an error where an element was never
    /// placed.
    pub(super) fn finish(self, sites: &[WeightSite]) -> Result<Vec<Full>, String> {
        let mut out = Vec::with_capacity(3 * sites.len());
        for (site, filling) in sites.iter().zip(self.sites) {
            let f = filling
                .into_inner()
                .map_err(|_| "checkpoint tensors poisoned")?;
            let (n, mut placed) = (f.full[0].len(), f.placed);
            placed.sort_unstable_by_key(|r| r.start);
            let mut covered = 0;
            for r in &placed {
                if r.start > covered {
                    break;
                }
                covered = covered.max(r.end);
            }
            if covered < n {
                return Err(format!(
                    "no rank owns element {covered} of `{}`; the checkpoint would be incomplete",
                    tensor_name("w", &site.key)
                ));
            }
            let [w, m, v] = f.full;
            out.push((tensor_name("w", &site.key), site.shape.clone(), w));
            out.push((tensor_name("adam_m", &site.key), site.shape.clone(), m));
            out.push((tensor_name("adam_v", &site.key), site.shape.clone(), v));
        }
        Ok(out)
    }
}

/// Each weight's index among `sites`, by key.
fn site_indices(sites: &[WeightSite]) -> HashMap<&Key, usize> {
    sites.iter().enumerate().map(|(i, s)| (&s.key, i)).collect()
}

/// The index of weight `key` in `index` ([`site_indices`]).
fn site_index(index: &HashMap<&Key, usize>, key: &Key) -> Result<usize, String> {
    (index.get(key).copied()).ok_or_else(|| format!("`{}` is not a weight of the model", key.0))
}

/// The runs of the full tensor a rank at places `(tp, ep)` holds of `site`.
fn site_runs(graph: &Graph, site: &WeightSite, tp: TpPos, ep: TpPos) -> Vec<Range<usize>> {
    let op = site.op(graph);
    held_runs(graph, (op, op.role, site.id), &site.shape, tp, ep)
}

/// The local elements `start..end` of a rank holding the full tensor's `runs` (in
/// order), run by run: (where in the full tensor, where in the piece).
fn piece_runs(
    runs: &[Range<usize>],
    start: usize,
    end: usize,
) -> impl Iterator<Item = (Range<usize>, Range<usize>)> + '_ {
    let locals = runs.iter().scan(0, |local, r| {
        let first = *local;
        *local += r.len();
        Some((first, r))
    });
    locals
        .take_while(move |&(first, _)| first < end)
        .filter_map(move |(first, r)| {
            let (a, b) = (first.max(start), (first + r.len()).min(end));
            (a < b).then(|| {
                (
                    r.start + (a - first)..r.start + (b - first),
                    a - start..b - start,
                )
            })
        })
}

/// An f32 tensor as safetensors writes it.
pub(super) struct F32View<'a> {
    pub(super) shape: &'a [usize],
    pub(super) values: &'a [f32],
}

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        // safetensors is little-endian, as the targets meshplan builds for.
        #[cfg(target_endian = "little")]
        return Cow::Borrowed(bytemuck::cast_slice(self.values));
        #[cfg(not(target_endian = "little"))]
        Cow::Owned(self.values.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
    fn data_len(&self) -> usize {
        4 * self.values.len()
    }
}
