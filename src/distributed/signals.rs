//! SIGINT / SIGTERM as a request to stop, not a death: while a [`StopSignals`] guard lives,
//! either signal only records its number in a process-wide atomic (the one thing a handler may
//! safely do), which the launcher's supervision loop and the trainer's step boundaries poll
//! ([`pending`]). Dropping the guard restores the handlers that were there before.
//!
//! Unix only; elsewhere the guard installs nothing and [`pending`] is always `None`.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

/// The signals a guard catches.
pub const STOP_SIGNALS: [i32; 2] = [libc::SIGINT, libc::SIGTERM];

/// The first stop signal received since [`clear`] (0: none).
static PENDING: AtomicI32 = AtomicI32::new(0);
/// How many were received since [`clear`].
static RECEIVED: AtomicUsize = AtomicUsize::new(0);

extern "C" fn record(sig: libc::c_int) {
    // Async-signal-safe: atomic operations only; the first signal is the one reported.
    let _ = PENDING.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
    RECEIVED.fetch_add(1, Ordering::SeqCst);
}

/// How many stop signals arrived since [`clear`] (the launcher escalates on a second one).
pub fn received() -> usize {
    RECEIVED.load(Ordering::SeqCst)
}

/// The stop signal received while a guard was installed, if any.
pub fn pending() -> Option<i32> {
    match PENDING.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// Forgets a received signal (a new run or launch starts with none).
pub fn clear() {
    PENDING.store(0, Ordering::SeqCst);
    RECEIVED.store(0, Ordering::SeqCst);
}

/// Records `sig` as if it had been received (tests, and a stop decided by another rank).
pub fn raise_pending(sig: i32) {
    record(sig);
}

/// `SIGTERM`, `SIGINT` or `signal N`.
pub fn name(sig: i32) -> String {
    match sig {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGKILL => "SIGKILL".into(),
        libc::SIGHUP => "SIGHUP".into(),
        s => format!("signal {s}"),
    }
}

/// Catches SIGINT and SIGTERM until dropped (see the module doc).
pub struct StopSignals {
    #[cfg(unix)]
    previous: Vec<(i32, libc::sigaction)>,
}

impl StopSignals {
    /// Installs the handlers. `once`: a second signal of the same kind gets the default
    /// (deadly) action, so that a second Ctrl-C ends a process that does
    /// not stop soon enough; a rank under a launcher, which may get each signal twice (from the
    /// terminal and forwarded), passes false.
    pub fn install(once: bool) -> StopSignals {
        #[cfg(unix)]
        {
            let mut previous = Vec::new();
            for sig in STOP_SIGNALS {
                // SAFETY: a zeroed sigaction is a valid value to fill; `record` is an
                // async-signal-safe `extern "C" fn(c_int)`, as sa_handler requires without
                // SA_SIGINFO.
                unsafe {
                    let mut act: libc::sigaction = std::mem::zeroed();
                    act.sa_sigaction = record as extern "C" fn(libc::c_int) as usize;
                    act.sa_flags = libc::SA_RESTART | if once { libc::SA_RESETHAND } else { 0 };
                    libc::sigemptyset(&mut act.sa_mask);
                    let mut old: libc::sigaction = std::mem::zeroed();
                    if libc::sigaction(sig, &act, &mut old) == 0 {
                        previous.push((sig, old));
                    }
                }
            }
            StopSignals { previous }
        }
        #[cfg(not(unix))]
        {
            let _ = once;
            StopSignals {}
        }
    }
}

impl Drop for StopSignals {
    fn drop(&mut self) {
        #[cfg(unix)]
        for (sig, old) in self.previous.drain(..).rev() {
            // SAFETY: restores an action that sigaction itself returned.
            unsafe {
                libc::sigaction(sig, &old, std::ptr::null_mut());
            }
        }
    }
}
