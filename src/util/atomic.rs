//! Atomic file replacement: write a sibling temporary file, flush and fsync it, rename it over
//! the destination, fsync the directory. A reader sees the old file or the new one, never a
//! half-written one; the old file stays until the new one is durable. On any error the
//! temporary file is removed and an existing destination is untouched; temporary files that a
//! crashed process left behind (`.NAME.tmp-PID-N`) are removed by the next write to `NAME`, or
//! by [`remove_interrupted_writes`] (a run directory calls it when it takes its lock).
//!
//! [`fault`] injects a failure at any step of a write (tests of crash safety).

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::base::error::{Error, Result};

/// Writes `path` atomically with the bytes that `write` produces (buffered). `write`'s error,
/// or any I/O error, is returned after the temporary file is removed.
pub fn write_atomic(path: &Path, write: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let Some(name) = path.file_name() else {
        return Err(Error::invalid_arg(
            "write_atomic",
            "path",
            path.display(),
            "a path that names a file",
        ));
    };
    let name = name.to_string_lossy().into_owned();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    remove_stale_temps(dir, Some(&name));
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let tmp = dir.join(format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    // Another thread of this process may be writing the same name: its file is not stale.
    let _in_flight = InFlight::start(&tmp);
    let ctx = |what: &str| format!("writing {}: {what} {}", path.display(), tmp.display());
    fault::step().map_err(|e| Error::io(ctx("creating"), e))?;
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| Error::io(ctx("creating"), e))?;
    let mut guard = TempFile(Some(tmp.clone()));
    let replaced = (|| {
        let mut w = BufWriter::with_capacity(1 << 20, Faulty(file));
        write(&mut w)?;
        let file = w
            .into_inner()
            .map_err(|e| Error::io(ctx("flushing"), e.into_error()))?
            .0;
        fault::step()
            .and_then(|_| file.sync_all())
            .map_err(|e| Error::io(ctx("syncing"), e))?;
        drop(file);
        fault::step()
            .and_then(|_| std::fs::rename(&tmp, path))
            .map_err(|e| {
                Error::io(
                    format!(
                        "writing {}: renaming {} over it",
                        path.display(),
                        tmp.display()
                    ),
                    e,
                )
            })
    })();
    if fault::crashed() {
        // A simulated crash leaves what a killed process would: the temporary file as it is.
        guard.0 = None;
    }
    replaced?;
    guard.0 = None;
    // The rename is durable once the directory entry is. Some file systems refuse to sync a
    // directory (the new file is in place either way), so that failure is not an error.
    fault::step().map_err(|e| {
        Error::io(
            format!("writing {}: syncing {}", path.display(), dir.display()),
            e,
        )
    })?;
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The temporary files this process is writing now (several threads may write one name).
fn in_flight() -> &'static Mutex<HashSet<PathBuf>> {
    static SET: OnceLock<Mutex<HashSet<PathBuf>>> = OnceLock::new();
    SET.get_or_init(|| Mutex::new(HashSet::new()))
}

/// Marks a temporary file as being written for as long as it lives.
struct InFlight(PathBuf);

impl InFlight {
    fn start(tmp: &Path) -> InFlight {
        let mut set = in_flight().lock().unwrap_or_else(|e| e.into_inner());
        set.insert(tmp.to_path_buf());
        InFlight(tmp.to_path_buf())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut set = in_flight().lock().unwrap_or_else(|e| e.into_inner());
        set.remove(&self.0);
    }
}

/// Removes the temporary files in `dir` of writes whose process is gone (killed in the middle
/// of a write), whatever file they were for. Best effort, as the next write's own clean-up: a
/// file that cannot be removed stays, and so does one whose process id a live process now has.
pub fn remove_interrupted_writes(dir: &Path) {
    remove_stale_temps(dir, None);
}

/// Removes temporary files (`.NAME.tmp-PID-N`) in `dir` that no write will finish: those of
/// processes that are gone, whatever their name, and this process's own for `name` (when given)
/// that no thread is writing (left by failed or simulated-crashed writes). Best effort: a file
/// that cannot be removed stays.
fn remove_stale_temps(dir: &Path, name: Option<&str>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let me = std::process::id();
    for e in entries.flatten() {
        let file = e.file_name();
        let Some((target, pid)) = file.to_str().and_then(parse_temp_name) else {
            continue;
        };
        let p = e.path();
        let writing = || {
            in_flight()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&p)
        };
        let stale =
            (pid == me && Some(target) == name && !writing()) || (pid != me && !process_alive(pid));
        if stale && std::fs::remove_file(&p).is_ok() {
            log::debug!("removed {}, left by an interrupted write", p.display());
        }
    }
}

/// `.NAME.tmp-PID-N` → (NAME, PID).
fn parse_temp_name(file: &str) -> Option<(&str, u32)> {
    let rest = file.strip_prefix('.')?;
    let (target, tail) = rest.rsplit_once(".tmp-")?;
    let (pid, n) = tail.split_once('-')?;
    n.parse::<u64>().ok()?;
    Some((target, pid.parse().ok()?))
}

/// Whether process `pid` is running (on Linux, by /proc; elsewhere every process counts as
/// running, so no other process's file is ever removed).
pub(crate) fn process_alive(pid: u32) -> bool {
    let proc = Path::new("/proc");
    if !proc.join("self").exists() {
        return true;
    }
    proc.join(pid.to_string()).exists()
}

/// Removes the temporary file on drop unless it was renamed into place.
struct TempFile(Option<PathBuf>);

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The temporary file, with every write a step that [`fault`] may fail.
struct Faulty(File);

impl Write for Faulty {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        fault::step()?;
        self.0.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// Fault injection for crash-safety tests: counts the I/O steps of [`write_atomic`] on this
/// thread (create, each write of the buffer, fsync, rename, directory fsync) and fails the one
/// chosen, either as an error (the temporary file is cleaned up) or as a simulated crash (it
/// is left behind, as after `kill -9`). Thread-local: other threads' writes are unaffected.
#[doc(hidden)]
pub mod fault {
    use std::cell::Cell;

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Mode {
        /// The step fails with an I/O error; the write cleans up.
        Error,
        /// The step fails and the write stops where it is, leaving its temporary file.
        Crash,
    }

    thread_local! {
        static STEPS: Cell<u64> = const { Cell::new(0) };
        static FAIL_AT: Cell<Option<(u64, Mode)>> = const { Cell::new(None) };
        static CRASHED: Cell<bool> = const { Cell::new(false) };
    }

    /// Fails step `n` (0-based, counted from now) with `mode`; `None` clears it. Resets the
    /// step count.
    pub fn fail_at(n: Option<u64>, mode: Mode) {
        STEPS.with(|s| s.set(0));
        CRASHED.with(|c| c.set(false));
        FAIL_AT.with(|f| f.set(n.map(|n| (n, mode))));
    }

    /// Steps taken since the last [`fail_at`].
    pub fn steps() -> u64 {
        STEPS.with(|s| s.get())
    }

    pub(super) fn crashed() -> bool {
        CRASHED.with(|c| c.get())
    }

    pub(super) fn step() -> std::io::Result<()> {
        let n = STEPS.with(|s| {
            let n = s.get();
            s.set(n + 1);
            n
        });
        match FAIL_AT.with(|f| f.get()) {
            Some((at, mode)) if at == n => {
                if mode == Mode::Crash {
                    CRASHED.with(|c| c.set(true));
                }
                Err(std::io::Error::other(format!("injected fault at step {n}")))
            }
            // After a simulated crash nothing more happens.
            _ if crashed() => Err(std::io::Error::other("after an injected crash")),
            _ => Ok(()),
        }
    }
}
