//! How a convolution's plan is chosen (see `conv.rs`'s module docs): the candidates of both
//! cuDNN APIs and our own kernel, gathered for one convolution, timed on its first call's
//! buffers (or the heuristics' first taken), and a cached choice rebuilt without timing.

use std::ffi::c_void;

use cudarc::cudnn::sys as dsys;

use super::conv_cache::{self, CacheUse, Choice, Entry};
use super::conv_direct::DirectWgrad;
use super::conv_plan::*;
use super::conv_tune::{tune, EventTimer, Outcome, Scratch, Tuning};
use super::cudnn::Dnn;
use super::cudnn_graph::{GraphCandidate, GraphConv, GraphPlan};
use super::cudnn_legacy::{LegacyAlgo, LegacyConv};
use super::device::{cuda_err, CudaDevice};
use crate::backend::Conv2dParams;
use crate::base::error::{Error, Result};
use crate::base::{DType, MemoryFormat};

/// A candidate of the unified list: the k-th graph configuration or legacy algorithm, or our
/// own kernel.
#[derive(Clone, Copy, Debug)]
enum Cand {
    Graph(usize),
    Legacy(usize),
    Direct,
}

/// What a candidate is across convolutions: the graph engine with its knob choices, the legacy
/// algorithm with its math type, or our kernel.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum CandId {
    Graph(i64, Option<Vec<(u32, i64)>>),
    Legacy(i64, i64),
    Direct,
}

/// Whose rate: direction, dtype, memory format, TF32, candidate.
pub(super) type RateKey = (Dir, DType, MemoryFormat, bool, CandId);

/// Multiply-adds times two: the same for the three directions.
fn flops(p: &Conv2dParams) -> f64 {
    let per_out = (p.c_in / p.groups.max(1)) * p.kh * p.kw;
    2.0 * (p.n * p.c_out * p.out_h() * p.out_w()) as f64 * per_out as f64
}

/// The convolution a plan is chosen for: the device, the geometry, dtype and direction, and
/// the first call's buffers in cuDNN's argument order (the output is overwritten).
struct ConvRun<'a> {
    dev: &'a CudaDevice,
    p: &'a Conv2dParams,
    dtype: DType,
    dir: Dir,
    ptrs: [*mut c_void; 3],
}

/// Every candidate of one convolution: the graph API's configurations and the legacy API's
/// algorithms (each with the object that runs them), and our own kernel where it applies.
struct Candidates {
    graph: Option<(GraphConv, Vec<GraphCandidate>)>,
    legacy: Option<(LegacyConv, Vec<LegacyAlgo>)>,
    direct: Option<DirectWgrad>,
    /// Forced onto our kernel where it applies (`MIXPREC_CONV_DIRECT=only`).
    only_direct: bool,
    /// Whether the graph / legacy API was asked (before `only_direct` left them out).
    used_graph: bool,
    used_legacy: bool,
}

impl Candidates {
    /// The candidates of the APIs asked for (the legacy API's only when it competes: both APIs,
    /// or the graph API has none); an API that has none for this convolution is logged.
    fn gather(
        h: dsys::cudnnHandle_t,
        c: &ConvRun<'_>,
        s: &Settings,
        use_graph: bool,
        use_legacy: bool,
    ) -> Candidates {
        let (p, dtype, dir) = (c.p, c.dtype, c.dir);
        let direct = match s.direct {
            Direct::Off => None,
            Direct::On | Direct::Only => DirectWgrad::new(c.dev, p, dtype, dir),
        };
        // Forced onto our kernel where it applies: cuDNN's candidates stay out.
        let only_direct = s.direct == Direct::Only && direct.is_some();
        let graph = (use_graph && !only_direct)
            .then(|| {
                let g = super::probe::no_panic("cuDNN graph API", || {
                    let conv = GraphConv::new(h, p, dtype, dir)?;
                    let (cands, skipped) = conv.candidates(h, s.rules, s.limit, !s.timed)?;
                    Ok((conv, cands, skipped))
                });
                match g {
                    Ok((conv, cands, skipped)) => {
                        if !skipped.is_empty() {
                            log::debug!(
                                "{dir:?} {dtype} {p:?}, graph configurations not candidates: {}",
                                skipped.join("; ")
                            );
                        }
                        Some((conv, cands))
                    }
                    Err(e) => {
                        log::debug!("{dir:?} {dtype} {p:?}: no graph-API candidates: {e}");
                        None
                    }
                }
            })
            .flatten();
        let graph_empty = graph.as_ref().is_none_or(|(_, g)| g.is_empty());
        let legacy = (use_legacy && !only_direct && (s.api != Api::Graph || graph_empty))
            .then(|| {
                let l = LegacyConv::new(p, dtype, dir, s.rules.tf32).and_then(|conv| {
                    let (algos, skipped) = conv.candidates(h, s.rules, s.limit)?;
                    Ok((conv, algos, skipped))
                });
                match l {
                    Ok((conv, algos, skipped)) => {
                        if !skipped.is_empty() {
                            log::debug!(
                                "{dir:?} {dtype} {p:?}, legacy algorithms not candidates: {}",
                                skipped.join("; ")
                            );
                        }
                        Some((conv, algos))
                    }
                    Err(e) => {
                        log::debug!("{dir:?} {dtype} {p:?}: no legacy-API candidates: {e}");
                        None
                    }
                }
            })
            .flatten();
        Candidates {
            graph,
            legacy,
            direct,
            only_direct,
            used_graph: use_graph && !only_direct,
            used_legacy: use_legacy && !only_direct,
        }
    }

    /// The untimed choice: our kernel when forced onto it, else the heuristics' first (the
    /// graph API's, else the legacy API's).
    fn heuristic_plan(self, record: Record) -> Option<Plan> {
        if let (true, Some(d)) = (self.only_direct, self.direct) {
            return Some(Plan {
                runner: Runner::Direct(d),
                record,
            });
        }
        match (self.graph, self.legacy) {
            (Some((conv, mut cands)), _) if !cands.is_empty() => Some(Plan {
                runner: Runner::Graph(GraphPlan {
                    candidate: cands.swap_remove(0),
                    conv,
                }),
                record,
            }),
            (_, Some((conv, algos))) if !algos.is_empty() => Some(Plan {
                runner: Runner::Legacy {
                    conv,
                    algo: algos[0],
                },
                record,
            }),
            _ => None,
        }
    }

    /// The workspace candidate `c` needs.
    fn workspace(&self, c: &Cand) -> usize {
        match *c {
            Cand::Graph(k) => self.graph.as_ref().map_or(0, |(_, g)| g[k].workspace),
            Cand::Legacy(k) => self.legacy.as_ref().map_or(0, |(_, a)| a[k].workspace),
            Cand::Direct => self.direct.as_ref().map_or(0, DirectWgrad::workspace),
        }
    }

    /// Candidate `c` in words, for the log.
    fn describe(&self, c: &Cand) -> String {
        match *c {
            Cand::Graph(k) => self
                .graph
                .as_ref()
                .map_or_else(String::new, |(_, g)| format!("{:?}", g[k])),
            Cand::Legacy(k) => self
                .legacy
                .as_ref()
                .map_or_else(String::new, |(_, a)| a[k].describe()),
            Cand::Direct => self
                .direct
                .as_ref()
                .map_or_else(String::new, DirectWgrad::describe),
        }
    }

    /// What candidate `c` is across convolutions (its rate's key).
    fn id(&self, c: &Cand) -> CandId {
        match (*c, &self.graph, &self.legacy) {
            (Cand::Graph(k), Some((_, g)), _) => CandId::Graph(g[k].engine, g[k].knobs.clone()),
            (Cand::Legacy(k), _, Some((_, a))) => {
                CandId::Legacy(a[k].algo.code(), a[k].math_code())
            }
            _ => CandId::Direct,
        }
    }

    /// What runs candidate `c`.
    fn into_runner(mut self, c: Cand) -> Result<Runner> {
        match (c, self.graph, self.legacy) {
            (Cand::Graph(k), Some((conv, mut cands)), _) => Ok(Runner::Graph(GraphPlan {
                candidate: cands.swap_remove(k),
                conv,
            })),
            (Cand::Legacy(k), _, Some((conv, algos))) => Ok(Runner::Legacy {
                conv,
                algo: algos[k],
            }),
            (Cand::Direct, _, _) => match self.direct.take() {
                Some(d) => Ok(Runner::Direct(d)),
                None => Err(Error::Cuda("cuDNN plan choice: candidate list".into())),
            },
            _ => Err(Error::Cuda("cuDNN plan choice: candidate list".into())),
        }
    }
}

impl Dnn {
    /// The plan for one direction (see the module doc), chosen on the first call's buffers
    /// (`ptrs`, argument order; the output is overwritten): from the plan cache when it holds
    /// one, else timed (or heuristic) and then written to the cache.
    pub(super) fn make_plan(
        &mut self,
        dev: &CudaDevice,
        p: &Conv2dParams,
        dtype: DType,
        dir: Dir,
        ptrs: [*mut c_void; 3],
    ) -> Result<Plan> {
        dev.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        let s = Settings::now(dev, dtype);
        let key = conv_cache::key(&self.device_id, &s.label(), p, dtype, dir, s.rules.tf32);
        if let CacheUse::ReadWrite(cache) = &s.cache {
            if let Some(entry) = conv_cache::load(cache, &key) {
                match self.restore(dev, &entry, p, dir, &s) {
                    Ok(plan) => return Ok(plan),
                    Err(e) => log::warn!(
                        "cuDNN plan cache: {} no longer builds ({e}); choosing the plan again",
                        conv_cache::path(cache, &key).display()
                    ),
                }
            }
        }
        let run = ConvRun {
            dev,
            p,
            dtype,
            dir,
            ptrs,
        };
        let plan = match self.choose(&run, &s, s.api != Api::Legacy, true)? {
            Some(plan) => plan,
            None => {
                return Err(Error::Cuda(format!(
                    "cuDNN: no {dir:?} convolution algorithm ran for {dtype} {p:?} within {} \
                     bytes of workspace (RUST_LOG=mixprec=debug lists the candidates)",
                    s.limit
                )))
            }
        };
        if let (Some(cache), PlanSource::Timed, Some(time_ms), Some(choice)) = (
            s.cache.dir(),
            plan.record.source,
            plan.record.time_ms,
            plan.choice(),
        ) {
            let r = plan.record;
            conv_cache::store(
                cache,
                &Entry {
                    format: conv_cache::FORMAT,
                    key,
                    choice,
                    workspace: plan.workspace(),
                    time_ms,
                    graph_candidates: r.graph_candidates,
                    legacy_candidates: r.legacy_candidates,
                    graph_timed: r.graph_timed,
                    legacy_timed: r.legacy_timed,
                    algorithm: plan.describe(),
                },
            );
        }
        Ok(plan)
    }

    /// Gathers the candidates of the APIs asked for and chooses among them: timed, or the
    /// heuristics' first. `None` when no candidate ran.
    fn choose(
        &mut self,
        c: &ConvRun<'_>,
        s: &Settings,
        use_graph: bool,
        use_legacy: bool,
    ) -> Result<Option<Plan>> {
        let cands = Candidates::gather(self.handle, c, s, use_graph, use_legacy);
        let record = Record {
            source: PlanSource::Heuristic,
            time_ms: None,
            choice_ms: 0.0,
            graph_candidates: cands.graph.as_ref().map_or(0, |(_, g)| g.len()),
            legacy_candidates: cands.legacy.as_ref().map_or(0, |(_, a)| a.len()),
            graph_timed: 0,
            legacy_timed: 0,
        };
        if !s.timed {
            return Ok(cands.heuristic_plan(record));
        }
        let (order, tuning) = self.time_candidates(c, s, &cands)?;
        let Some(chosen) = tuning.chosen else {
            // Every candidate failed to run. Forced onto the graph API, the legacy API may
            // still cover this convolution.
            if s.api == Api::Graph
                && cands.used_graph
                && cands.used_legacy
                && cands.legacy.is_none()
            {
                return self.choose(c, s, false, true);
            }
            return Ok(None);
        };
        let mut record = record;
        for (cand, o) in order.iter().zip(&tuning.outcomes) {
            if o.was_timed() {
                match cand {
                    Cand::Graph(_) => record.graph_timed += 1,
                    Cand::Legacy(_) => record.legacy_timed += 1,
                    Cand::Direct => {}
                }
            }
        }
        record.source = PlanSource::Timed;
        record.time_ms = tuning.outcomes[chosen].median_ms();
        let runner = cands.into_runner(order[chosen])?;
        Ok(Some(Plan { runner, record }))
    }

    /// Times `cands` in the unified order (the graph API's mode-A configurations, its best
    /// guesses; the legacy algorithms; the graph API's other configurations; our kernel) on the
    /// convolution's own buffers, within the scratch that could be allocated, and records each
    /// candidate's rate for the floors of later convolutions.
    fn time_candidates(
        &mut self,
        c: &ConvRun<'_>,
        s: &Settings,
        cands: &Candidates,
    ) -> Result<(Vec<Cand>, Tuning)> {
        let (dev, p, dtype, dir) = (c.dev, c.p, c.dtype, c.dir);
        let (h, tf32) = (self.handle, s.rules.tf32);
        let gc: &[GraphCandidate] = cands.graph.as_ref().map_or(&[], |(_, g)| g);
        let la: &[LegacyAlgo] = cands.legacy.as_ref().map_or(&[], |(_, a)| a);
        let is_a =
            |c: &GraphCandidate| c.mode == Some(dsys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A);
        let mut order: Vec<Cand> = (0..gc.len())
            .filter(|&k| is_a(&gc[k]))
            .map(Cand::Graph)
            .chain((0..la.len()).map(Cand::Legacy))
            .chain((0..gc.len()).filter(|&k| !is_a(&gc[k])).map(Cand::Graph))
            .chain(cands.direct.as_ref().map(|_| Cand::Direct))
            .collect();
        let sizes: Vec<usize> = order.iter().map(|k| cands.workspace(k)).collect();
        let scratch = Scratch::alloc(dev, &sizes)?;
        let room = scratch.as_ref().map_or(0, |s| s.len);
        order.retain(|k| {
            let fits = cands.workspace(k) <= room;
            if !fits {
                log::debug!(
                    "{dir:?} {dtype} {p:?}: {} not timed: only {room} bytes of scratch could be \
                     allocated",
                    cands.describe(k)
                );
            }
            fits
        });
        let workspaces: Vec<usize> = order.iter().map(|k| cands.workspace(k)).collect();
        let rate_keys: Vec<RateKey> = order
            .iter()
            .map(|k| (dir, dtype, p.format, tf32, cands.id(k)))
            .collect();
        let work = flops(p);
        let floors: Vec<Option<f32>> = rate_keys
            .iter()
            .map(|k| self.rates.floor_ms(k, work))
            .collect();
        let ws_ptr = scratch.as_ref().map_or(std::ptr::null_mut(), |s| s.ptr());
        let ptrs = c.ptrs;
        let mut timer = EventTimer::new(dev);
        let tuning = tune(&workspaces, &floors, |i, runs, pre_run| match order[i] {
            Cand::Graph(k) => match cands.graph.as_ref() {
                Some((conv, _)) => {
                    timer.measure(|| conv.execute(h, &gc[k], ptrs, ws_ptr), runs, pre_run)
                }
                None => Ok(None),
            },
            Cand::Legacy(k) => match cands.legacy.as_ref() {
                Some((conv, _)) => timer.measure(
                    || conv.execute(h, &la[k], ptrs, ws_ptr, room),
                    runs,
                    pre_run,
                ),
                None => Ok(None),
            },
            Cand::Direct => match cands.direct.as_ref() {
                Some(d) => timer.measure(|| d.execute(dev, ptrs, ws_ptr), runs, pre_run),
                None => Ok(None),
            },
        });
        self.timing_runs += timer.runs;
        drop(scratch);
        let tuning = tuning?;
        for (key, o) in rate_keys.into_iter().zip(&tuning.outcomes) {
            self.rates.observe(key, work, o);
        }
        log::debug!(
            "{dir:?} {dtype} {p:?}: {} -> {}",
            order
                .iter()
                .zip(&tuning.outcomes)
                .map(|(k, o)| format!("{} {}", cands.describe(k), Outcome::describe(o)))
                .collect::<Vec<_>>()
                .join(", "),
            tuning
                .chosen
                .map_or_else(|| "none".into(), |i| cands.describe(&order[i]))
        );
        Ok((order, tuning))
    }

    /// Rebuilds a cached choice (no timing): an error when it no longer builds as recorded.
    fn restore(
        &self,
        dev: &CudaDevice,
        e: &Entry,
        p: &Conv2dParams,
        dir: Dir,
        s: &Settings,
    ) -> Result<Plan> {
        let h = self.handle;
        let dtype = s.rules.dtype;
        if e.workspace > s.limit {
            return Err(Error::Cuda(format!(
                "it needs {} bytes of workspace, the limit is now {}",
                e.workspace, s.limit
            )));
        }
        let record = Record {
            source: PlanSource::Cache,
            time_ms: Some(e.time_ms),
            choice_ms: 0.0,
            graph_candidates: e.graph_candidates,
            legacy_candidates: e.legacy_candidates,
            graph_timed: e.graph_timed,
            legacy_timed: e.legacy_timed,
        };
        let runner = match &e.choice {
            Choice::Graph { engine, knobs } => {
                let (conv, candidate) = super::probe::no_panic("cuDNN graph API", || {
                    let conv = GraphConv::new(h, p, dtype, dir)?;
                    let c = conv.rebuild(h, *engine, knobs, s.rules, s.limit)?;
                    Ok((conv, c))
                })?;
                if candidate.workspace != e.workspace {
                    return Err(Error::Cuda(format!(
                        "engine {engine} now needs {} bytes of workspace, not {}",
                        candidate.workspace, e.workspace
                    )));
                }
                Runner::Graph(GraphPlan { candidate, conv })
            }
            Choice::Legacy { algo, math } => {
                let conv = LegacyConv::new(p, dtype, dir, s.rules.tf32)?;
                let (algos, _) = conv.candidates(h, s.rules, s.limit)?;
                let found = algos
                    .into_iter()
                    .find(|a| a.algo.code() == *algo && a.math_code() == *math)
                    .ok_or_else(|| {
                        Error::Cuda(format!(
                            "cuDNN no longer lists legacy algorithm {algo} with math type {math}"
                        ))
                    })?;
                if found.workspace != e.workspace {
                    return Err(Error::Cuda(format!(
                        "legacy algorithm {algo} now needs {} bytes of workspace, not {}",
                        found.workspace, e.workspace
                    )));
                }
                Runner::Legacy { conv, algo: found }
            }
            Choice::Direct { kernel } => {
                let d = DirectWgrad::new(dev, p, dtype, dir)
                    .filter(|d| d.describe() == *kernel && d.workspace() == e.workspace)
                    .ok_or_else(|| {
                        Error::Cuda(format!("the direct kernel no longer launches as {kernel}"))
                    })?;
                Runner::Direct(d)
            }
        };
        Ok(Plan { runner, record })
    }
}
