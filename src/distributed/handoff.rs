//! Handing work to a thread of its own and waiting for the outcome, bounded by the group: the
//! NCCL engine's issuing thread takes its jobs from a [`Queue`] and leaves each outcome in a
//! [`Slot`]; whoever waits for one polls it ([`poll`]) and gives up with the group's error when
//! the group fails, or with its own error after a time limit, never waiting on the worker
//! itself (which may be inside a library call that does not return).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::control::Control;
use crate::error::{Error, Result};

/// How long a wait polls without sleeping: sleeping between polls of a non-blocking NCCL call
/// from the start made SyncBatchNorm's eager DDP step at 2 ranks much slower than polling
/// without sleeping for this long first (benches/RESULTS.md has the figures). Longer waits (a
/// peer still busy) sleep between polls.
pub(crate) const SPIN: Duration = Duration::from_millis(2);

/// How long a worker polls for its next job before it sleeps on the queue: a training step's
/// collectives come in bursts, and waking a sleeping thread costs tens of µs.
pub(crate) const IDLE_SPIN: Duration = Duration::from_millis(2);

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Polls `ready` until it gives a value, the group fails (its error) or `limit` passes
/// (`late()`): yielding for the first [`SPIN`], then sleeping 200 µs between polls.
pub(crate) fn poll<T>(
    ctl: &Control,
    limit: Duration,
    mut ready: impl FnMut() -> Option<T>,
    late: impl FnOnce() -> Error,
) -> Result<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = ready() {
            return Ok(v);
        }
        ctl.check()?;
        let t = start.elapsed();
        if t >= limit {
            return Err(late());
        }
        if t < SPIN {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// Where a worker leaves the outcome of one job: a value, or why there is none.
pub(crate) struct Slot<T: Clone> {
    /// The job, for the error of a wait that ran out of time.
    pub(crate) what: String,
    state: Mutex<Option<std::result::Result<T, String>>>,
}

impl<T: Clone> Slot<T> {
    pub(crate) fn new(what: String) -> std::sync::Arc<Slot<T>> {
        std::sync::Arc::new(Slot {
            what,
            state: Mutex::new(None),
        })
    }

    pub(crate) fn set(&self, r: Result<T>) {
        *lock(&self.state) = Some(r.map_err(|e| e.to_string()));
    }

    /// The outcome, if the worker has left one.
    pub(crate) fn peek(&self) -> Option<std::result::Result<T, String>> {
        lock(&self.state).clone()
    }

    /// Waits up to `limit` for the outcome. A failure is the group's error when the group has
    /// failed (the worker's failures fail it), else the group's kind of error with the worker's
    /// words (`Error::Distributed`, naming no rank); the
    /// limit passing is `late()`'s error (which should fail the group).
    pub(crate) fn wait(
        &self,
        ctl: &Control,
        limit: Duration,
        late: impl FnOnce() -> Error,
    ) -> Result<T> {
        let r = poll(ctl, limit, || self.peek(), late)?;
        r.map_err(|detail| {
            ctl.check()
                .err()
                .unwrap_or_else(|| ctl.error_now(None, detail))
        })
    }
}

/// Jobs for one worker, taken in the order they were posted.
pub(crate) struct Queue<J> {
    jobs: Mutex<VecDeque<J>>,
    cond: Condvar,
    stop: AtomicBool,
    exited: AtomicBool,
}

impl<J> Queue<J> {
    pub(crate) fn new() -> Queue<J> {
        Queue {
            jobs: Mutex::new(VecDeque::new()),
            cond: Condvar::new(),
            stop: AtomicBool::new(false),
            exited: AtomicBool::new(false),
        }
    }

    pub(crate) fn post(&self, job: J) {
        lock(&self.jobs).push_back(job);
        self.cond.notify_one();
    }

    /// The worker's next job: polled for [`IDLE_SPIN`], then slept for; `None` once stopped
    /// with nothing left (the jobs posted before the stop are all handed out).
    pub(crate) fn next(&self) -> Option<J> {
        let start = Instant::now();
        loop {
            let mut jobs = lock(&self.jobs);
            if let Some(j) = jobs.pop_front() {
                return Some(j);
            }
            if self.stop.load(Ordering::Acquire) {
                return None;
            }
            if start.elapsed() < IDLE_SPIN {
                drop(jobs);
                std::thread::yield_now();
            } else {
                let _ = self.cond.wait_timeout(jobs, Duration::from_millis(50));
            }
        }
    }

    /// Asks the worker to end once the queue is empty.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.cond.notify_all();
    }

    /// The worker says it has ended (after its last job).
    pub(crate) fn mark_exited(&self) {
        self.exited.store(true, Ordering::Release);
    }

    pub(crate) fn has_exited(&self) -> bool {
        self.exited.load(Ordering::Acquire)
    }

    /// Waits up to `within` for the worker to end.
    pub(crate) fn await_exit(&self, within: Duration) -> bool {
        let until = Instant::now() + within;
        while !self.has_exited() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.has_exited()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn group(timeout: Duration) -> Arc<Control> {
        Control::start(0, 1, timeout, vec![None]).unwrap()
    }

    #[test]
    fn a_worker_takes_jobs_in_order_and_drains_before_it_stops() {
        let q = Arc::new(Queue::new());
        for j in 0..100 {
            q.post(j);
        }
        let worker = {
            let q = q.clone();
            std::thread::spawn(move || {
                let mut got = Vec::new();
                while let Some(j) = q.next() {
                    got.push(j);
                }
                q.mark_exited();
                got
            })
        };
        std::thread::sleep(Duration::from_millis(5)); // past IDLE_SPIN: asleep on the queue
        q.post(100);
        q.stop();
        assert!(q.await_exit(Duration::from_secs(5)));
        assert_eq!(worker.join().unwrap(), (0..=100).collect::<Vec<_>>());
    }

    #[test]
    fn a_slot_gives_the_outcome_left_by_another_thread() {
        let ctl = group(Duration::from_secs(10));
        let slot: Arc<Slot<u32>> = Slot::new("job 1".into());
        let s = slot.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            s.set(Ok(7));
        });
        let late = || Error::Cuda("late".into());
        assert_eq!(slot.wait(&ctl, Duration::from_secs(5), late).unwrap(), 7);
        let failed: Arc<Slot<u32>> = Slot::new("job 2".into());
        failed.set(Err(Error::Cuda("the call failed".into())));
        let e = failed.wait(&ctl, Duration::from_secs(5), late).unwrap_err();
        assert!(e.to_string().contains("the call failed"), "{e}");
    }

    #[test]
    fn a_wait_ends_with_the_group_when_the_worker_never_answers() {
        // Out of time: the group fails, naming the job.
        let ctl = group(Duration::from_secs(10));
        let slot: Arc<Slot<u32>> = Slot::new("collective #3".into());
        let t0 = Instant::now();
        let e = slot
            .wait(&ctl, Duration::from_millis(100), || {
                ctl.fail(None, format!("{}: not done", slot.what))
            })
            .unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert!(e.to_string().contains("collective #3: not done"), "{e}");
        assert!(ctl.check().is_err());
        // A group that fails meanwhile (another thread saw a dead peer): its error, at once.
        let ctl = group(Duration::from_secs(10));
        let slot: Arc<Slot<u32>> = Slot::new("collective #4".into());
        let c = ctl.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            c.fail(Some(1), "rank 1 exited");
        });
        let t0 = Instant::now();
        let e = slot
            .wait(&ctl, Duration::from_secs(600), || {
                Error::Cuda("late".into())
            })
            .unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert!(e.to_string().contains("rank 1 exited"), "{e}");
    }
}
