//! The one timer every convolution candidate is measured with, whichever cuDNN API it comes from,
//! and the choice among them.
//!
//! Each candidate runs on the first call's own buffers, its runs bracketed by CUDA events on the
//! device's stream. A precise measurement enqueues one untimed run first, so that the timed runs
//! start on a busy GPU: the host's time to launch (building a variant pack, cuDNN's own host
//! work), which a real step hides behind the previous kernel, is not counted; neither is a first
//! launch's kernel loading.
//! 1. Every candidate runs once, timed coarsely (from an idle GPU: launch and first-launch costs
//!    included), unless its *floor* is already slow: a lower estimate of its time that the caller
//!    may give from the rate the candidate reached on other convolutions ([`Rates`]: a tenth of
//!    its best rate in runs of at least `RATE_MIN_MS`). cuDNN's generic engine 0 is orders of
//!    magnitude slower than the best candidate on each of ResNet-50's convolutions; run on every
//!    one, it took most of a cold plan choice's time (benches/RESULTS.md has the figures).
//! 2. In order of that time, each is measured precisely: `TIMED_RUNS` timed runs after an untimed
//!    one, the median its time. One whose coarse time was more than `SLOW` times (plus
//!    `SLACK_MS`) the best coarse time so far runs once more, coarsely, and is abandoned if that
//!    is slow too; one slower than that by more than `FIRST_LAUNCH_MS`, which no first launch
//!    costs, is abandoned at once. (The slack keeps launch costs from abandoning a candidate of a
//!    tiny convolution.)
//! 3. The finalists (within `FINALIST` of the best median) are measured `FINAL_ROUNDS` more
//!    times, interleaved, so that a drift of the clocks during the timing cannot decide between
//!    near-equals.
//! 4. Among the candidates within `WORKSPACE_TIE` of the fastest median, the one with the
//!    smallest workspace wins: the workspace is device memory for the whole run.
//!
//! The timing scratch is allocated outside the stream-ordered pool and freed afterwards, so the
//! largest candidate's workspace does not stay reserved in the pool.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::driver::sys as cu;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaEvent;

use super::device::{cuda_err, CudaDevice};
use crate::base::error::Result;

/// Timed runs per candidate after its warm-up; the median decides.
pub(super) const TIMED_RUNS: usize = 3;
/// A coarse time above `SLOW` times the best coarse time so far, plus `SLACK_MS`, marks a
/// candidate as too slow.
const SLOW: f32 = 2.0;
const SLACK_MS: f32 = 0.2;
/// More than this beyond the slow mark, a coarse time is the candidate's own, not a first
/// launch's (loading a kernel costs well under this): abandoned at once.
const FIRST_LAUNCH_MS: f32 = 50.0;
/// Candidates whose median is within this factor of the best are re-timed.
const FINALIST: f32 = 1.10;
/// Extra runs per finalist, interleaved across finalists.
const FINAL_ROUNDS: usize = 2;
/// Candidates within this fraction of the fastest median are equals: the least workspace wins.
pub(super) const WORKSPACE_TIE: f32 = 0.03;

/// A candidate's floor on a convolution is its time at this many times the best rate it reached
/// on another of the same direction, dtype and layout. Over ResNet-50's convolutions the rate of
/// cuDNN's engine 0 varied by a few times, less than this margin, and it stayed far slower than
/// the best candidate on every one (benches/RESULTS.md has the figures).
const RATE_MARGIN: f64 = 10.0;
/// Only a run at least this long gives a rate: a shorter one may be mostly launch costs, or too
/// small a problem to fill the GPU, and a fast engine first seen there would get a floor far
/// above its real time on a large convolution. Every candidate a floor should keep from running
/// takes longer than that on every convolution (engine 0, the CUDA-core legacy algorithms).
const RATE_MIN_MS: f32 = 1.0;

/// The best rate (work per ms) each candidate reached, and the floors it gives (step 1 of the
/// module doc). `K` says which candidate, and on what kind of problem.
#[derive(Debug)]
pub(super) struct Rates<K> {
    best: HashMap<K, f64>,
}

impl<K: std::hash::Hash + Eq> Rates<K> {
    pub(super) fn new() -> Rates<K> {
        Rates {
            best: HashMap::new(),
        }
    }

    /// A lower estimate of `key`'s time (ms) on `work`: None when it has no rate yet.
    pub(super) fn floor_ms(&self, key: &K, work: f64) -> Option<f32> {
        self.best
            .get(key)
            .map(|rate| (work / (RATE_MARGIN * rate)) as f32)
    }

    /// Records what `outcome` says of `key`'s rate on `work`.
    pub(super) fn observe(&mut self, key: K, work: f64, outcome: &Outcome) {
        let Some(ms) = outcome.seen_ms().filter(|&ms| ms >= RATE_MIN_MS) else {
            return;
        };
        if work > 0.0 {
            let rate = self.best.entry(key).or_insert(0.0);
            *rate = rate.max(work / ms as f64);
        }
    }
}

/// What the timing found for one candidate.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Outcome {
    /// Its median over the timed runs (ms) and how many runs it made, warm-up included.
    Timed { median_ms: f32, runs: usize },
    /// Stopped early as too slow: its fastest run (ms) and how many runs it made.
    Abandoned { best_ms: f32, runs: usize },
    /// A run failed (it is never chosen).
    Failed { runs: usize },
    /// Not run: its floor (ms) was already slow against the best coarse time before it.
    Skipped { floor_ms: f32 },
}

impl Outcome {
    /// Whether at least one run of it was timed.
    pub(super) fn was_timed(&self) -> bool {
        matches!(self, Outcome::Timed { .. } | Outcome::Abandoned { .. })
    }

    /// As logs and reports print it.
    pub(super) fn describe(&self) -> String {
        match self {
            Outcome::Timed { median_ms, runs } => format!("{median_ms:.4} ms ({runs} runs)"),
            Outcome::Abandoned { best_ms, runs } => {
                format!("abandoned at {best_ms:.3} ms ({runs} runs)")
            }
            Outcome::Failed { runs } => format!("failed (run {runs})"),
            Outcome::Skipped { floor_ms } => format!("not run (at least {floor_ms:.3} ms)"),
        }
    }

    /// Its fastest time seen (ms), for a rate: the median of a timed candidate, the best run
    /// of an abandoned one.
    pub(super) fn seen_ms(&self) -> Option<f32> {
        match self {
            Outcome::Timed { median_ms, .. } => Some(*median_ms),
            Outcome::Abandoned { best_ms, .. } => Some(*best_ms),
            _ => None,
        }
    }

    pub(super) fn median_ms(&self) -> Option<f32> {
        match self {
            Outcome::Timed { median_ms, .. } => Some(*median_ms),
            _ => None,
        }
    }
}

/// The timing of a candidate list and the choice.
#[derive(Debug)]
pub(super) struct Tuning {
    pub(super) outcomes: Vec<Outcome>,
    /// The index of the chosen candidate (None: every candidate failed).
    pub(super) chosen: Option<usize>,
}

fn median(times: &[f32]) -> f32 {
    let mut t = times.to_vec();
    t.sort_by(f32::total_cmp);
    t[t.len() / 2]
}

/// Times candidates `0..workspaces.len()` and chooses one, as the module doc describes.
/// `floors[i]`, where given, is a lower estimate of candidate `i`'s time in ms (step 1).
/// `measure(i, k, pre_run)` runs candidate `i` once untimed when `pre_run`, then `k` times timed,
/// and returns the `k` times in ms, or None when a run failed.
pub(super) fn tune(
    workspaces: &[usize],
    floors: &[Option<f32>],
    mut measure: impl FnMut(usize, usize, bool) -> Result<Option<Vec<f32>>>,
) -> Result<Tuning> {
    let n = workspaces.len();
    let slow = |t: f32, reference: f32| t > SLOW * reference + SLACK_MS;
    // Precise times per candidate, and how many runs it made.
    let mut times: Vec<Vec<f32>> = vec![Vec::new(); n];
    let mut runs = vec![0usize; n];
    let mut measure = |i: usize, k: usize, pre: bool| -> Result<Option<Vec<f32>>> {
        runs[i] += k + pre as usize;
        measure(i, k, pre)
    };
    // A candidate is out once failed or abandoned.
    let mut out: Vec<Option<Outcome>> = vec![None; n];
    let mut coarse = vec![f32::INFINITY; n];
    let mut best_so_far = f32::INFINITY;
    for (i, o) in out.iter_mut().enumerate() {
        if let Some(floor_ms) = floors.get(i).copied().flatten() {
            if slow(floor_ms, best_so_far) {
                *o = Some(Outcome::Skipped { floor_ms });
                continue;
            }
        }
        match measure(i, 1, false)? {
            Some(t) => {
                coarse[i] = t[0];
                best_so_far = best_so_far.min(t[0]);
            }
            None => *o = Some(Outcome::Failed { runs: 0 }),
        }
    }
    let mut order: Vec<usize> = (0..n).filter(|&i| out[i].is_none()).collect();
    order.sort_by(|&a, &b| coarse[a].total_cmp(&coarse[b]));
    let (mut best, mut best_coarse) = (f32::INFINITY, f32::INFINITY);
    for &i in &order {
        let mut c = coarse[i];
        if slow(c - FIRST_LAUNCH_MS, best_coarse) {
            out[i] = Some(Outcome::Abandoned {
                best_ms: c,
                runs: 0,
            });
            continue;
        }
        if slow(c, best_coarse) {
            // Slow, or slowed once (a first launch, the clocks): one more run decides.
            let Some(again) = measure(i, 1, false)? else {
                out[i] = Some(Outcome::Failed { runs: 0 });
                continue;
            };
            c = c.min(again[0]);
            if slow(again[0], best_coarse) {
                out[i] = Some(Outcome::Abandoned {
                    best_ms: c,
                    runs: 0,
                });
                continue;
            }
        }
        match measure(i, TIMED_RUNS, true)? {
            Some(t) => times[i] = t,
            None => {
                out[i] = Some(Outcome::Failed { runs: 0 });
                continue;
            }
        }
        best = best.min(median(&times[i]));
        best_coarse = best_coarse.min(c);
    }
    let finalists: Vec<usize> = order
        .iter()
        .copied()
        .filter(|&i| out[i].is_none() && median(&times[i]) <= FINALIST * best)
        .collect();
    if finalists.len() > 1 {
        for _ in 0..FINAL_ROUNDS {
            for &i in &finalists {
                if out[i].is_some() {
                    continue;
                }
                match measure(i, 1, true)? {
                    Some(t) => times[i].extend(t),
                    None => out[i] = Some(Outcome::Failed { runs: 0 }),
                }
            }
        }
    }
    let outcomes: Vec<Outcome> = out
        .into_iter()
        .enumerate()
        .map(|(i, o)| match o {
            None => Outcome::Timed {
                median_ms: median(&times[i]),
                runs: runs[i],
            },
            Some(Outcome::Abandoned { best_ms, .. }) => Outcome::Abandoned {
                best_ms,
                runs: runs[i],
            },
            Some(skipped @ Outcome::Skipped { .. }) => skipped,
            Some(_) => Outcome::Failed { runs: runs[i] },
        })
        .collect();
    let chosen = choose(&outcomes, workspaces);
    Ok(Tuning { outcomes, chosen })
}

/// The fastest timed candidate, or among those within `WORKSPACE_TIE` of it the one with the
/// least workspace (then the faster).
fn choose(outcomes: &[Outcome], workspaces: &[usize]) -> Option<usize> {
    let timed = || {
        outcomes
            .iter()
            .enumerate()
            .filter_map(|(i, o)| o.median_ms().map(|m| (i, m)))
    };
    let fastest = timed().map(|(_, m)| m).min_by(f32::total_cmp)?;
    timed()
        .filter(|&(_, m)| m <= fastest * (1.0 + WORKSPACE_TIE))
        .min_by(|a, b| {
            workspaces[a.0]
                .cmp(&workspaces[b.0])
                .then(a.1.total_cmp(&b.1))
        })
        .map(|(i, _)| i)
}

/// Device memory for the candidates' workspace while they are timed: allocated with cuMemAlloc
/// and freed on drop, outside the stream-ordered pool (whose memory, once reserved, stays with
/// the process).
pub(super) struct Scratch {
    ptr: cu::CUdeviceptr,
    pub(super) len: usize,
}

impl Scratch {
    /// The largest of `sizes` that can be allocated (the pool's unused memory is returned to the
    /// driver first when the largest does not fit); None when not even the smallest fits.
    pub(super) fn alloc(dev: &CudaDevice, sizes: &[usize]) -> Result<Option<Scratch>> {
        dev.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        let mut sizes: Vec<usize> = sizes.to_vec();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        sizes.dedup();
        let mut trimmed = false;
        let mut k = 0;
        while k < sizes.len() {
            let len = sizes[k];
            if len == 0 {
                return Ok(Some(Scratch { ptr: 0, len: 0 }));
            }
            // SAFETY: a plain device allocation, freed once in Drop.
            match unsafe { cudarc::driver::result::malloc_sync(len) } {
                Ok(ptr) => return Ok(Some(Scratch { ptr, len })),
                Err(e) if e.0 == cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                    if !trimmed {
                        trimmed = true;
                        trim_pool(dev)?;
                        continue;
                    }
                    k += 1;
                }
                Err(e) => return Err(cuda_err(&format!("allocating {len} bytes of scratch"), e)),
            }
        }
        Ok(None)
    }

    pub(super) fn ptr(&self) -> *mut c_void {
        self.ptr as *mut c_void
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // SAFETY: allocated by malloc_sync, freed once; the timed runs using it have
            // completed (each timing waits for its end event).
            let _ = unsafe { cudarc::driver::result::free_sync(self.ptr) };
        }
    }
}

/// Returns the default pool's unused memory to the driver (it is re-reserved on demand).
fn trim_pool(dev: &CudaDevice) -> Result<()> {
    let mut pool: cu::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid device handle and out-pointer.
    unsafe { cu::cuDeviceGetDefaultMemPool(&mut pool, dev.ctx.cu_device()) }
        .result()
        .map_err(|e| cuda_err("cuDeviceGetDefaultMemPool", e))?;
    // The pool's freed blocks may still be waited on by queued work: finish it first.
    dev.stream
        .synchronize()
        .map_err(|e| cuda_err("synchronizing the stream", e))?;
    // SAFETY: a live pool.
    unsafe { cu::cuMemPoolTrimTo(pool, 0) }
        .result()
        .map_err(|e| cuda_err("cuMemPoolTrimTo", e))
}

/// Times runs of a closure on the device's stream with CUDA events.
pub(super) struct EventTimer<'a> {
    dev: &'a CudaDevice,
    events: Vec<CudaEvent>,
    /// How many runs it made (untimed ones included).
    pub(super) runs: u64,
}

impl<'a> EventTimer<'a> {
    pub(super) fn new(dev: &'a CudaDevice) -> EventTimer<'a> {
        EventTimer {
            dev,
            events: Vec::new(),
            runs: 0,
        }
    }

    /// Runs `run` once untimed when `pre_run`, then `k` times between events, and waits: the
    /// device time of each timed run in ms, or None when a run failed. Work other threads
    /// enqueue meanwhile counts too (a slower choice then, never a wrong one).
    pub(super) fn measure(
        &mut self,
        mut run: impl FnMut() -> Result<()>,
        k: usize,
        pre_run: bool,
    ) -> Result<Option<Vec<f32>>> {
        while self.events.len() < k + 1 {
            let e = self
                .dev
                .ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| cuda_err("creating a timing event", e))?;
            self.events.push(e);
        }
        let stream = &self.dev.stream;
        let record = |e: &CudaEvent| {
            e.record(stream)
                .map_err(|e| cuda_err("recording an event", e))
        };
        let mut ok = true;
        if pre_run {
            self.runs += 1;
            ok = run().is_ok();
        }
        let mut recorded = 0;
        if ok {
            record(&self.events[0])?;
            for j in 1..=k {
                self.runs += 1;
                if run().is_err() {
                    ok = false;
                    break;
                }
                record(&self.events[j])?;
                recorded = j;
            }
        }
        // Everything enqueued has finished before the scratch or the buffers are reused.
        stream
            .synchronize()
            .map_err(|e| cuda_err("synchronizing the stream", e))?;
        if !ok {
            return Ok(None);
        }
        (1..=recorded)
            .map(|j| {
                self.events[j - 1]
                    .elapsed_ms(&self.events[j])
                    .map_err(|e| cuda_err("reading a timing event", e))
            })
            .collect::<Result<Vec<f32>>>()
            .map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Candidates with scripted timed-run times (ms): `times[i][k]` is timed run k of candidate
    /// i (the last repeats); a NaN run fails. Returns the tuning and how many runs each candidate
    /// made, untimed ones included.
    fn run(times: &[Vec<f32>], workspaces: &[usize]) -> (Tuning, Vec<usize>) {
        run_with_floors(times, workspaces, &[])
    }

    /// [`run`] with floors for the candidates.
    fn run_with_floors(
        times: &[Vec<f32>],
        workspaces: &[usize],
        floors: &[Option<f32>],
    ) -> (Tuning, Vec<usize>) {
        let mut next = vec![0usize; times.len()];
        let mut calls = vec![0usize; times.len()];
        let t = tune(workspaces, floors, |i, k, pre| {
            calls[i] += k + pre as usize;
            let mut out = Vec::new();
            for _ in 0..k {
                let v = times[i][next[i].min(times[i].len() - 1)];
                next[i] += 1;
                if v.is_nan() {
                    return Ok(None);
                }
                out.push(v);
            }
            Ok(Some(out))
        })
        .unwrap();
        for (i, o) in t.outcomes.iter().enumerate() {
            let runs = match o {
                Outcome::Timed { runs, .. }
                | Outcome::Abandoned { runs, .. }
                | Outcome::Failed { runs } => *runs,
                Outcome::Skipped { .. } => 0,
            };
            assert_eq!(runs, calls[i], "candidate {i}: {o:?}");
        }
        (t, calls)
    }

    /// The runs of a candidate measured in full: one coarse, one untimed, `TIMED_RUNS` timed.
    const FULL: usize = 2 + TIMED_RUNS;

    #[test]
    fn the_median_decides_not_the_coarse_time() {
        // Candidate 1's coarse run was slowed (a first launch): its precise median wins.
        let (t, calls) = run(&[vec![0.5, 1.0], vec![1.8, 0.6]], &[0, 0]);
        assert_eq!(t.chosen, Some(1));
        assert_eq!(t.outcomes[1].median_ms(), Some(0.6));
        // It was re-checked (1.8 > 2 x 0.5 + slack) before its precise runs.
        assert_eq!(calls, [FULL, FULL + 1]);
    }

    #[test]
    fn a_slow_candidate_costs_two_runs() {
        // 30 ms against 0.3: within FIRST_LAUNCH_MS of the slow mark, where a first launch
        // could explain it, so a second run decides.
        let (t, calls) = run(&[vec![0.3], vec![30.0], vec![0.31]], &[0, 0, 0]);
        assert_eq!(t.chosen, Some(0));
        assert_eq!(calls[1], 2, "{:?}", t.outcomes);
        assert!(matches!(t.outcomes[1], Outcome::Abandoned { best_ms, .. } if best_ms == 30.0));
        // The two close ones were finalists: each final round is an untimed and a timed run.
        assert_eq!(calls[0], FULL + 2 * FINAL_ROUNDS);
        assert_eq!(calls[2], FULL + 2 * FINAL_ROUNDS);
    }

    #[test]
    fn a_candidate_slower_than_any_first_launch_costs_one_run() {
        // Like the 140 ms engine 0 of the strided 1x1 backward-data in bf16: more than
        // FIRST_LAUNCH_MS beyond the slow mark, the one run decides.
        let (t, calls) = run(&[vec![0.3], vec![140.0], vec![0.31]], &[0, 0, 0]);
        assert_eq!(t.chosen, Some(0));
        assert_eq!(calls[1], 1, "{:?}", t.outcomes);
        assert!(matches!(
            t.outcomes[1],
            Outcome::Abandoned { best_ms, runs: 1 } if best_ms == 140.0
        ));
    }

    #[test]
    fn a_candidate_whose_floor_is_slow_is_not_run() {
        // Candidate 2's floor (5 ms) is slow against the best coarse time before it (0.3 ms):
        // it is not run, even though it would have been the fastest (a floor is an estimate).
        // Candidate 0's floor comes before any time to compare it with; candidate 3's is not
        // slow: both run.
        let floors = [Some(9.0), None, Some(5.0), Some(0.5)];
        let times = [vec![0.3], vec![0.35], vec![0.2], vec![0.32]];
        let (t, calls) = run_with_floors(&times, &[0; 4], &floors);
        assert!(matches!(t.outcomes[2], Outcome::Skipped { floor_ms } if floor_ms == 5.0));
        assert!(!t.outcomes[2].was_timed());
        assert_eq!(calls[2], 0);
        assert!([0, 1, 3].iter().all(|&i| t.outcomes[i].was_timed()));
        assert_eq!(t.chosen, Some(0));
        // Without floors it would have won.
        let (t, _) = run(&times, &[0; 4]);
        assert_eq!(t.chosen, Some(2));
    }

    #[test]
    fn floors_come_from_long_runs_only() {
        let mut rates = Rates::new();
        assert_eq!(rates.floor_ms(&"engine 0", 1e9), None);
        // 0.05 ms on a small problem: maybe mostly launch costs, so no rate.
        rates.observe(
            "engine 62",
            1e6,
            &Outcome::Timed {
                median_ms: 0.05,
                runs: 5,
            },
        );
        assert_eq!(rates.floor_ms(&"engine 62", 1e9), None);
        // 100 ms for 1e9: at ten times that rate, 1e10 takes at least 100 ms.
        let slow = Outcome::Abandoned {
            best_ms: 100.0,
            runs: 1,
        };
        rates.observe("engine 0", 1e9, &slow);
        assert_eq!(rates.floor_ms(&"engine 0", 1e10), Some(100.0));
        // The best rate counts; a failure or a skip says nothing.
        rates.observe(
            "engine 0",
            1e9,
            &Outcome::Timed {
                median_ms: 50.0,
                runs: 5,
            },
        );
        rates.observe("engine 0", 1e9, &Outcome::Failed { runs: 1 });
        rates.observe("engine 0", 1e9, &Outcome::Skipped { floor_ms: 1.0 });
        rates.observe(
            "engine 0",
            1e9,
            &Outcome::Timed {
                median_ms: 80.0,
                runs: 5,
            },
        );
        assert_eq!(rates.floor_ms(&"engine 0", 1e10), Some(50.0));
    }

    #[test]
    fn a_slow_first_launch_alone_does_not_abandon() {
        // Its coarse run loaded a kernel (8 ms), then it is the fastest.
        let (t, calls) = run(&[vec![0.5], vec![8.0, 0.2]], &[0, 0]);
        assert_eq!(t.chosen, Some(1));
        assert_eq!(t.outcomes[1].median_ms(), Some(0.2));
        assert_eq!(calls[1], FULL + 1);
    }

    #[test]
    fn launch_costs_do_not_abandon_small_candidates() {
        // A 15 us convolution: launch costs triple one candidate's coarse time.
        let (t, calls) = run(&[vec![0.015, 0.012], vec![0.045, 0.011]], &[0, 0]);
        assert!(t
            .outcomes
            .iter()
            .all(|o| matches!(o, Outcome::Timed { .. })));
        assert_eq!(t.chosen, Some(1));
        assert_eq!(calls[1], FULL + 2 * FINAL_ROUNDS);
    }

    #[test]
    fn near_equals_go_to_the_smaller_workspace() {
        let mb = 1 << 20;
        // Within 3%: the one with less workspace.
        let (t, _) = run(&[vec![1.00], vec![1.02]], &[600 * mb, 0]);
        assert_eq!(t.chosen, Some(1));
        // 10% apart: the faster, whatever its workspace.
        let (t, _) = run(&[vec![1.00], vec![1.10]], &[600 * mb, 0]);
        assert_eq!(t.chosen, Some(0));
    }

    #[test]
    fn failures_are_never_chosen() {
        let nan = f32::NAN;
        let (t, _) = run(&[vec![nan], vec![0.1, nan], vec![0.9]], &[0, 0, 0]);
        assert_eq!(t.chosen, Some(2));
        assert!(matches!(t.outcomes[0], Outcome::Failed { runs: 1 }));
        assert!(matches!(t.outcomes[1], Outcome::Failed { .. }));
        let (t, _) = run(&[vec![nan], vec![nan]], &[0, 0]);
        assert_eq!(t.chosen, None);
        assert!(t.outcomes.iter().all(|o| !o.was_timed()));
    }

    #[test]
    fn every_candidate_is_timed() {
        let (t, calls) = run(&[vec![0.4], vec![0.5], vec![0.45]], &[0, 0, 0]);
        assert!(t.outcomes.iter().all(Outcome::was_timed));
        assert!(calls.iter().all(|&c| c > TIMED_RUNS));
        assert_eq!(t.chosen, Some(0));
    }
}
