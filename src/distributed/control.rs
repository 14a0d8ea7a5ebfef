//! The control plane of a process group: the rendezvous's link from each rank to rank 0, kept
//! open for the life of the group and watched by a thread per link. It is how every rank learns,
//! within a bounded time, that the run has failed and which rank caused it:
//!
//! - a rank whose process dies closes its links (the kernel does it): rank 0 sees the end of the
//!   stream without a goodbye and fails the group, naming the rank; rank 0 dying is seen the same
//!   way by every other rank;
//! - a rank that detects a fault itself (a timed-out collective, NCCL's asynchronous error, a
//!   disagreement between ranks) sends it to rank 0, which relays it to everyone (for a timeout,
//!   with the ranks that had not reached the stalled collective, from their progress reports);
//! - a rank that shuts its group down says goodbye with its count of collectives, so that the
//!   others fail as soon as they need it for a later one instead of waiting for a timeout.
//!
//! A fault is recorded once (the first wins), runs the backends' abort actions (closing the CPU
//! backend's sockets, `ncclCommAbort`), and is the error of every later call on the group.
//! The plane also carries small host-side gathers (model signatures, object broadcasts).

use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::wire::{read_frame, tag, write_frame, Dec, Enc};
use crate::error::{Error, Result};

/// Why the group failed.
#[derive(Clone, Debug)]
pub(crate) struct Fault {
    pub(crate) culprit: Option<usize>,
    pub(crate) detail: String,
}

impl Fault {
    /// The FAULT frame's body, as `on_message` reads it: the culprit (`u64::MAX` for none), the
    /// stalled collective's sequence number (0 for none), the detail.
    fn frame(&self, stalled: u64) -> Vec<u8> {
        Enc::new()
            .u64(self.culprit.map_or(u64::MAX, |c| c as u64))
            .u64(stalled)
            .str(&self.detail)
            .done()
    }
}

type AbortAction = Box<dyn Fn() + Send + Sync>;

#[derive(Default)]
struct State {
    fault: Option<Fault>,
    /// Host gathers in flight by sequence number: rank 0 collects one entry per rank; the others
    /// receive the complete list.
    gathers: HashMap<u64, Vec<Option<Vec<u8>>>>,
    /// Rank 0: each rank's count of collectives issued (progress reports).
    progress: Vec<u64>,
    /// Ranks that shut their group down, with their count of collectives.
    departed: Vec<Option<u64>>,
    /// Reader threads still running.
    readers_alive: usize,
}

pub(crate) struct Control {
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    pub(crate) timeout: Duration,
    state: Mutex<State>,
    cond: Condvar,
    faulted: AtomicBool,
    closing: AtomicBool,
    /// Write halves of the control links, per peer rank.
    writers: Vec<Option<Mutex<TcpStream>>>,
    readers: Mutex<Vec<JoinHandle<()>>>,
    aborts: Mutex<Vec<AbortAction>>,
    /// Collectives issued by this rank so far (their sequence numbers are 1, 2, ...).
    issued: AtomicU64,
    gather_seq: AtomicU64,
    last_progress_sent: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// How much longer a non-zero rank waits for rank 0 than rank 0 waits for anyone: rank 0's
/// diagnosis (which rank stalled) should arrive first.
pub(crate) fn grace(timeout: Duration) -> Duration {
    timeout / 10 + Duration::from_secs(2)
}

impl Control {
    /// Starts watching `links` (per peer rank; rank 0 has one per other rank, the others one to
    /// rank 0).
    pub(crate) fn start(
        rank: usize,
        world_size: usize,
        timeout: Duration,
        links: Vec<Option<TcpStream>>,
    ) -> Result<Arc<Control>> {
        let mut writers = Vec::with_capacity(links.len());
        let mut read_halves = Vec::new();
        for (peer, l) in links.into_iter().enumerate() {
            match l {
                Some(s) => {
                    let w = s.try_clone().map_err(|e| Error::Distributed {
                        rank,
                        world_size,
                        culprit: None,
                        detail: format!("control link to rank {peer}: {e}"),
                    })?;
                    writers.push(Some(Mutex::new(w)));
                    read_halves.push((peer, s));
                }
                None => writers.push(None),
            }
        }
        let ctl = Arc::new(Control {
            rank,
            world_size,
            timeout,
            state: Mutex::new(State {
                progress: vec![0; world_size],
                departed: vec![None; world_size],
                readers_alive: read_halves.len(),
                ..Default::default()
            }),
            cond: Condvar::new(),
            faulted: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            writers,
            readers: Mutex::new(Vec::new()),
            aborts: Mutex::new(Vec::new()),
            issued: AtomicU64::new(0),
            gather_seq: AtomicU64::new(0),
            last_progress_sent: AtomicU64::new(0),
        });
        let mut handles = Vec::new();
        for (peer, s) in read_halves {
            let c = ctl.clone();
            let h = std::thread::Builder::new()
                .name(format!("mixprec-ctl-{peer}"))
                .spawn(move || c.read_loop(peer, s))
                .map_err(|e| ctl.error_now(None, format!("starting the control thread: {e}")))?;
            handles.push(h);
        }
        *lock(&ctl.readers) = handles;
        Ok(ctl)
    }

    pub(crate) fn error_now(&self, culprit: Option<usize>, detail: String) -> Error {
        Error::Distributed {
            rank: self.rank,
            world_size: self.world_size,
            culprit,
            detail,
        }
    }

    /// The group's error, built from its fault.
    pub(crate) fn error(&self, f: &Fault) -> Error {
        self.error_now(f.culprit, f.detail.clone())
    }

    /// The recorded fault as an error, if the group has failed.
    pub(crate) fn check(&self) -> Result<()> {
        if !self.faulted.load(Ordering::Acquire) {
            return Ok(());
        }
        match &lock(&self.state).fault {
            Some(f) => Err(self.error(f)),
            None => Ok(()),
        }
    }

    pub(crate) fn is_faulted(&self) -> bool {
        self.faulted.load(Ordering::Acquire)
    }

    /// Waits up to `within` for a fault to be recorded (a peer that closes a data link after
    /// diagnosing a fault has sent the diagnosis on its control link first) and returns it.
    pub(crate) fn await_fault(&self, within: Duration) -> Option<Error> {
        let until = Instant::now() + within;
        let mut st = lock(&self.state);
        loop {
            if let Some(f) = &st.fault {
                return Some(self.error(f));
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            st = self
                .cond
                .wait_timeout(st, left.min(Duration::from_millis(50)))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Registers what to do when the group fails (unblock or abort the backend's transfers).
    pub(crate) fn on_abort(&self, f: impl Fn() + Send + Sync + 'static) {
        lock(&self.aborts).push(Box::new(f));
        // A fault that came first still gets its action.
        if self.is_faulted() {
            if let Some(a) = lock(&self.aborts).last() {
                a();
            }
        }
    }

    /// Records a fault detected on this rank (the first one wins), aborts the backends, tells
    /// the others (through rank 0), and returns the group's error.
    pub(crate) fn fail(&self, culprit: Option<usize>, detail: impl Into<String>) -> Error {
        self.record(
            Fault {
                culprit,
                detail: detail.into(),
            },
            None,
            true,
        )
    }

    /// `stalled`: the sequence number of a collective that timed out here (rank 0 then names
    /// the ranks that had not issued it). `spread`: tell the others.
    fn record(&self, f: Fault, stalled: Option<u64>, spread: bool) -> Error {
        let first = {
            let mut st = lock(&self.state);
            if st.fault.is_none() {
                let mut f = f;
                if let (Some(seq), 0) = (stalled, self.rank) {
                    st.progress[0] = self.issued.load(Ordering::Acquire);
                    let behind: Vec<usize> = (0..self.world_size)
                        .filter(|&r| st.progress[r] < seq)
                        .collect();
                    if !behind.is_empty() {
                        f.detail = format!(
                            "{}; rank(s) {behind:?} had not issued collective #{seq} (last \
                             reported: {:?})",
                            f.detail,
                            behind.iter().map(|&r| st.progress[r]).collect::<Vec<_>>()
                        );
                        f.culprit = f.culprit.or(behind.first().copied());
                    }
                }
                st.fault = Some(f);
                true
            } else {
                false
            }
        };
        let fault = lock(&self.state).fault.clone().unwrap_or(Fault {
            culprit: None,
            detail: "the group failed".into(),
        });
        if first {
            self.faulted.store(true, Ordering::Release);
            self.cond.notify_all();
            log::error!(
                "distributed: rank {} of {}: {}",
                self.rank,
                self.world_size,
                fault.detail
            );
            for a in lock(&self.aborts).iter() {
                a();
            }
            if spread {
                let msg = fault.frame(stalled.unwrap_or(0));
                for w in self.writers.iter().flatten() {
                    let _ = write_frame(&mut lock(w), tag::FAULT, &msg);
                }
            }
        }
        self.error(&fault)
    }

    fn read_loop(self: Arc<Self>, peer: usize, mut s: TcpStream) {
        loop {
            match read_frame(&mut s, None) {
                Ok((t, body)) => self.on_message(peer, t, &body),
                Err(e) => {
                    let departed = lock(&self.state).departed[peer].is_some();
                    if !departed && !self.closing.load(Ordering::Acquire) {
                        self.fail(
                            Some(peer),
                            format!(
                                "rank {peer} exited or lost its connection to rank {} without \
                                 shutting down its process group ({e})",
                                self.rank
                            ),
                        );
                    }
                    break;
                }
            }
        }
        let mut st = lock(&self.state);
        st.readers_alive = st.readers_alive.saturating_sub(1);
        self.cond.notify_all();
    }

    fn on_message(&self, peer: usize, t: u8, body: &[u8]) {
        let mut d = Dec::new(body);
        match t {
            tag::FAULT => {
                let culprit = d
                    .u64()
                    .and_then(|c| usize::try_from(c).ok())
                    .filter(|&c| c < self.world_size);
                let stalled = d.u64().filter(|&s| s > 0);
                let detail = d.str().unwrap_or_default();
                let detail = if self.rank == 0 {
                    format!("rank {peer} reports: {detail}")
                } else {
                    detail
                };
                // Rank 0 relays a fault to everyone; the others only record rank 0's.
                self.record(Fault { culprit, detail }, stalled, self.rank == 0);
            }
            tag::GOODBYE => {
                let count = d.u64().unwrap_or(0);
                lock(&self.state).departed[peer] = Some(count);
                self.cond.notify_all();
                // A collective this rank issued past the peer's last can never complete: fail
                // now, here, rather than when it is waited for. A thread blocked on the device
                // (or an NCCL kernel waiting for the peer) cannot notice, and the abort that
                // this fault triggers is what releases it.
                let issued = self.issued();
                if issued > count {
                    self.fail(
                        Some(peer),
                        format!(
                            "rank {peer} shut down its process group after {count} \
                             collective(s); collective #{} needs it (did rank {peer} stop \
                             early, or run fewer steps?)",
                            count + 1
                        ),
                    );
                }
            }
            tag::PROGRESS => {
                if let Some(n) = d.u64() {
                    lock(&self.state).progress[peer] = n;
                }
            }
            tag::GATHER => {
                if let (Some(seq), Some(bytes)) = (d.u64(), d.bytes()) {
                    let mut st = lock(&self.state);
                    let n = self.world_size;
                    let e = st.gathers.entry(seq).or_insert_with(|| vec![None; n]);
                    e[peer] = Some(bytes.to_vec());
                    self.cond.notify_all();
                }
            }
            tag::GATHER_RESULT => {
                let Some(seq) = d.u64() else { return };
                let n = d.u64().unwrap_or(0) as usize;
                let mut parts = Vec::with_capacity(n);
                for _ in 0..n {
                    parts.push(d.bytes().map(|b| b.to_vec()));
                }
                lock(&self.state).gathers.insert(seq, parts);
                self.cond.notify_all();
            }
            other => log::warn!("distributed: unknown control message {other} from rank {peer}"),
        }
    }

    /// The next collective's sequence number (1, 2, ...); fails when a rank it needs has shut
    /// its group down after fewer collectives.
    pub(crate) fn next_seq(&self) -> Result<u64> {
        self.check()?;
        let seq = self.issued.fetch_add(1, Ordering::AcqRel) + 1;
        let gone = {
            let st = lock(&self.state);
            st.departed
                .iter()
                .enumerate()
                .find_map(|(r, d)| d.filter(|&c| c < seq).map(|c| (r, c)))
        };
        if let Some((r, c)) = gone {
            return Err(self.fail(
                Some(r),
                format!(
                    "rank {r} shut down its process group after {c} collective(s); collective \
                     #{seq} needs it (did rank {r} stop early, or run fewer steps?)"
                ),
            ));
        }
        Ok(seq)
    }

    /// When `peer` has left the group: the number of collectives it had issued.
    pub(crate) fn departed(&self, peer: usize) -> Option<u64> {
        lock(&self.state).departed.get(peer).copied().flatten()
    }

    /// The number of collectives issued by this rank.
    pub(crate) fn issued(&self) -> u64 {
        self.issued.load(Ordering::Acquire)
    }

    /// Sends this rank's progress to rank 0 when it changed (the NCCL watchdog calls it).
    pub(crate) fn report_progress(&self) {
        let n = self.issued();
        if self.rank == 0 {
            lock(&self.state).progress[0] = n;
            return;
        }
        if self.last_progress_sent.swap(n, Ordering::AcqRel) == n {
            return;
        }
        if let Some(w) = self.writers.first().and_then(|w| w.as_ref()) {
            let _ = write_frame(&mut lock(w), tag::PROGRESS, &Enc::new().u64(n).done());
        }
    }

    /// A fault this rank noticed in a collective that did not complete in time: rank 0 adds
    /// which ranks had not issued it.
    pub(crate) fn fail_stalled(&self, seq: u64, detail: impl Into<String>) -> Error {
        let f = Fault {
            culprit: None,
            detail: detail.into(),
        };
        if self.rank == 0 {
            self.record(f, Some(seq), true)
        } else {
            // Rank 0 decorates and relays; this rank records its own view meanwhile.
            let msg = f.frame(seq);
            if let Some(w) = self.writers.first().and_then(|w| w.as_ref()) {
                let _ = write_frame(&mut lock(w), tag::FAULT, &msg);
            }
            // Give rank 0 a moment to name the rank that stalled.
            let until = Instant::now() + Duration::from_secs(2);
            let mut st = lock(&self.state);
            while st.fault.is_none() && Instant::now() < until {
                st = self
                    .cond
                    .wait_timeout(st, Duration::from_millis(50))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
            drop(st);
            self.record(f, None, false)
        }
    }

    /// Every rank's `mine`, in rank order (a host-side gather through rank 0; for metadata).
    pub(crate) fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.check()?;
        let n = self.world_size;
        if n == 1 {
            return Ok(vec![mine.to_vec()]);
        }
        let seq = self.gather_seq.fetch_add(1, Ordering::AcqRel) + 1;
        if self.rank == 0 {
            let deadline = Instant::now() + self.timeout;
            let mut st = lock(&self.state);
            loop {
                if let Some(f) = &st.fault {
                    return Err(self.error(f));
                }
                let missing: Vec<usize> = (1..n)
                    .filter(|&r| st.gathers.get(&seq).is_none_or(|e| e[r].is_none()))
                    .collect();
                if missing.is_empty() {
                    break;
                }
                if Instant::now() >= deadline {
                    drop(st);
                    return Err(self.fail(
                        missing.first().copied(),
                        format!(
                            "rank(s) {missing:?} did not reach host gather #{seq} within {} s",
                            self.timeout.as_secs()
                        ),
                    ));
                }
                st = self
                    .cond
                    .wait_timeout(st, Duration::from_millis(100))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
            let mut parts = st.gathers.remove(&seq).unwrap_or_default();
            drop(st);
            parts[0] = Some(mine.to_vec());
            let all: Vec<Vec<u8>> = parts.into_iter().map(|p| p.unwrap_or_default()).collect();
            let mut msg = Enc::new().u64(seq).u64(n as u64);
            for p in &all {
                msg = msg.bytes(p);
            }
            let msg = msg.done();
            for (r, w) in self.writers.iter().enumerate() {
                if let Some(w) = w {
                    write_frame(&mut lock(w), tag::GATHER_RESULT, &msg).map_err(|e| {
                        self.fail(
                            Some(r),
                            format!("sending host gather #{seq} to rank {r}: {e}"),
                        )
                    })?;
                }
            }
            Ok(all)
        } else {
            let msg = Enc::new().u64(seq).bytes(mine).done();
            if let Some(w) = self.writers.first().and_then(|w| w.as_ref()) {
                write_frame(&mut lock(w), tag::GATHER, &msg).map_err(|e| {
                    self.fail(
                        Some(0),
                        format!("sending host gather #{seq} to rank 0: {e}"),
                    )
                })?;
            }
            let deadline = Instant::now() + self.timeout + grace(self.timeout);
            let mut st = lock(&self.state);
            loop {
                if let Some(f) = &st.fault {
                    return Err(self.error(f));
                }
                if let Some(parts) = st.gathers.remove(&seq) {
                    return Ok(parts.into_iter().map(|p| p.unwrap_or_default()).collect());
                }
                if Instant::now() >= deadline {
                    drop(st);
                    return Err(self.fail(
                        Some(0),
                        format!(
                            "rank 0 did not complete host gather #{seq} within {} s",
                            self.timeout.as_secs()
                        ),
                    ));
                }
                st = self
                    .cond
                    .wait_timeout(st, Duration::from_millis(100))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
        }
    }

    /// Leaves the group: a goodbye with this rank's count of collectives, then the links are
    /// half-closed and, once the peers have closed theirs too (or after a bounded wait), shut.
    pub(crate) fn close(&self) {
        if self.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        let bye = Enc::new().u64(self.issued()).done();
        // After a fault, the fault goes out again ahead of the goodbye: the thread that recorded
        // it may not have sent it yet (it aborts the backends first, which can bring this rank
        // here sooner), and a peer that read the goodbye first would blame this rank for leaving.
        // A peer keeps the first fault it hears of, so a repeat changes nothing.
        let fault = lock(&self.state).fault.as_ref().map(|f| f.frame(0));
        for w in self.writers.iter().flatten() {
            let mut s = lock(w);
            if let Some(msg) = &fault {
                let _ = write_frame(&mut s, tag::FAULT, msg);
            }
            let _ = write_frame(&mut s, tag::GOODBYE, &bye);
            let _ = s.shutdown(Shutdown::Write);
        }
        // The peers see our end of stream and close theirs; wait for that a little, so that no
        // unread byte turns our close into a reset that could eat their last message. After a
        // fault there is nothing left to protect, and a hung peer would only delay the exit.
        let wait = if self.is_faulted() {
            Duration::ZERO
        } else {
            Duration::from_secs(5).min(self.timeout)
        };
        let until = Instant::now() + wait;
        let mut st = lock(&self.state);
        while st.readers_alive > 0 && Instant::now() < until {
            st = self
                .cond
                .wait_timeout(st, Duration::from_millis(20))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        drop(st);
        for w in self.writers.iter().flatten() {
            let _ = lock(w).shutdown(Shutdown::Both);
        }
        for h in std::mem::take(&mut *lock(&self.readers)) {
            let _ = h.join();
        }
    }
}
