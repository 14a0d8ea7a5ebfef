//! A run's output directory (`--out`): one writer at a time, and no run writing over another's
//! files.
//!
//! - **Lock**: `DIR/.lock` is held (an exclusive `flock`) for the whole run; a second process
//!   on the same directory is refused, naming the holder (pid, host, start time). The kernel
//!   releases the lock of a killed process, so a lock left by `kill -9` is taken over, and
//!   said so. (Advisory locks may not work across hosts on some network file systems.)
//! - **Fresh runs** need an empty (or new) directory; one that holds files is refused unless
//!   `--overwrite` (which deletes the earlier run's files first: config, metrics, plot,
//!   checkpoints, weights; other files stay).
//! - **Resumed runs** may use the directory their checkpoint is in; a checkpoint that is not
//!   the newest there would mix two runs' checkpoints, so it is refused unless `--overwrite`
//!   (which deletes the newer ones). Newer files that do not load or verify (passed over by
//!   `--resume auto`) are no run's state: they stay until the run's saves replace them.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::io::checkpoint::Checkpoint;

use super::metrics::{CSV_FILE, JSONL_FILE};

/// The lock file inside a run directory.
pub const LOCK_FILE: &str = ".lock";
/// The files of a run (beside `checkpoints/`), what `--overwrite` deletes.
pub const RUN_FILES: [&str; 5] = [
    "config.toml",
    CSV_FILE,
    JSONL_FILE,
    "metrics.png",
    "model.safetensors",
];
pub const CHECKPOINT_DIR: &str = "checkpoints";

/// How a run uses its directory.
#[derive(Clone, Copy, Debug)]
pub enum Use<'a> {
    /// A new run.
    Fresh { overwrite: bool },
    /// A new run in place of one that never saved a checkpoint (`--resume auto` found none):
    /// that run's own files are replaced; any other file makes it an error as for `Fresh`.
    Restart,
    /// A run continued from `checkpoint` (which may lie in this directory or elsewhere).
    /// `corrupt`: newer checkpoint files that did not load or verify (passed over for it):
    /// not a run's state, so they do not count as newer; the run's next saves replace them.
    Resume {
        checkpoint: &'a Path,
        overwrite: bool,
        corrupt: &'a [PathBuf],
    },
}

/// An open run directory; the lock is held until it is dropped.
#[derive(Debug)]
pub struct RunDir {
    root: PathBuf,
    lock: File,
}

impl RunDir {
    /// Creates `root` if needed, takes its lock, and checks (or, with `overwrite`, clears) what
    /// is there for the way the run uses it. See the module documentation.
    pub fn open(root: &Path, how: Use<'_>) -> Result<RunDir> {
        let err = |detail: String| Error::RunDirectory {
            dir: root.display().to_string(),
            detail,
        };
        std::fs::create_dir_all(root.join(CHECKPOINT_DIR))
            .map_err(|e| Error::io(format!("creating {}", root.display()), e))?;
        let lock = take_lock(root)?;
        // Saves a killed run left half-written: the run that takes over may have nothing left
        // to save (its checkpoint is the last epoch), so no write of its own would remove them.
        crate::io::atomic::remove_interrupted_writes(root);
        crate::io::atomic::remove_interrupted_writes(&root.join(CHECKPOINT_DIR));
        let dir = RunDir {
            root: root.to_path_buf(),
            lock,
        };
        let overwrite = match how {
            Use::Fresh { overwrite } | Use::Resume { overwrite, .. } => overwrite,
            Use::Restart => false,
        };
        let inside = match how {
            Use::Resume { checkpoint, .. } => dir.holds(checkpoint),
            Use::Fresh { .. } | Use::Restart => false,
        };
        if inside {
            let Use::Resume {
                checkpoint,
                corrupt,
                ..
            } = how
            else {
                unreachable!("inside implies a resume")
            };
            let mut newer = dir.checkpoints_newer_than(checkpoint)?;
            newer.retain(|p| !corrupt.iter().any(|c| same_file(c, p)));
            if !newer.is_empty() && !overwrite {
                return Err(err(format!(
                    "holds checkpoints newer than {} ({}): continuing from it would mix two \
                     runs' checkpoints; use --resume auto to continue from the newest, or add \
                     --overwrite to delete the newer ones",
                    checkpoint.display(),
                    names(&newer)
                )));
            }
            for p in newer {
                remove(&p)?;
                println!(
                    "deleted {} (newer than the resumed checkpoint)",
                    p.display()
                );
            }
            return Ok(dir);
        }
        let found = dir.contents()?;
        if found.is_empty() {
            return Ok(dir);
        }
        let only_a_runs_files = found.iter().all(|p| {
            p.parent() == Some(dir.root.as_path())
                && p.file_name()
                    .is_some_and(|n| RUN_FILES.iter().any(|f| n == *f))
        });
        if matches!(how, Use::Restart) && only_a_runs_files {
            dir.clear()?;
            return Ok(dir);
        }
        if !overwrite {
            let what = match how {
                Use::Fresh { .. } | Use::Restart => "start a new run there",
                Use::Resume { .. } => "continue a run from a checkpoint elsewhere there",
            };
            return Err(err(format!(
                "is not empty ({}): to {what} would mix two runs' files; continue its run with \
                 --resume auto, start over with --overwrite (deletes its config, metrics, plot, \
                 checkpoints and weights), or choose another --out",
                names(&found)
            )));
        }
        dir.clear()?;
        Ok(dir)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether `path` lies inside this directory.
    fn holds(&self, path: &Path) -> bool {
        match (self.root.canonicalize(), path.canonicalize()) {
            (Ok(root), Ok(p)) => p.starts_with(root),
            _ => false,
        }
    }

    /// Everything in the directory but the lock, an empty `checkpoints/` and temporary files
    /// of interrupted writes (`.NAME.tmp-PID-N`, garbage that opening the directory or the next
    /// write removes).
    fn contents(&self) -> Result<Vec<PathBuf>> {
        let mut out = Vec::new();
        for p in list(&self.root)? {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            match name.as_deref() {
                Some(LOCK_FILE) => {}
                Some(n) if is_temp(n) => {}
                Some(CHECKPOINT_DIR) if p.is_dir() => out.extend(
                    list(&p)?
                        .into_iter()
                        .filter(|c| !c.file_name().is_some_and(|n| is_temp(&n.to_string_lossy()))),
                ),
                _ => out.push(p),
            }
        }
        out.sort();
        Ok(out)
    }

    /// The checkpoints in `checkpoints/` whose progress is past `resumed`'s (unreadable ones
    /// are left alone: they are not a run's state, and a later save replaces them).
    fn checkpoints_newer_than(&self, resumed: &Path) -> Result<Vec<PathBuf>> {
        let at = Checkpoint::peek(resumed)?;
        let mut newer = Vec::new();
        for p in list(&self.root.join(CHECKPOINT_DIR))? {
            if p.extension().is_some_and(|e| e == "safetensors") {
                if let Ok(g) = Checkpoint::peek(&p) {
                    if (g.step, g.epoch) > (at.step, at.epoch) {
                        newer.push(p);
                    }
                }
            }
        }
        newer.sort();
        Ok(newer)
    }

    /// Deletes an earlier run's files (`--overwrite`), and temporary files of its writes.
    fn clear(&self) -> Result<()> {
        let mut deleted = Vec::new();
        for name in RUN_FILES {
            let p = self.root.join(name);
            if p.is_file() {
                remove(&p)?;
                deleted.push(p);
            }
        }
        for p in list(&self.root)? {
            if p.is_file() && p.file_name().is_some_and(|n| is_temp(&n.to_string_lossy())) {
                remove(&p)?;
            }
        }
        for p in list(&self.root.join(CHECKPOINT_DIR))? {
            if p.is_file() {
                remove(&p)?;
                deleted.push(p);
            }
        }
        if !deleted.is_empty() {
            println!(
                "--overwrite: deleted the earlier run's files in {} ({})",
                self.root.display(),
                names(&deleted)
            );
        }
        Ok(())
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        // An empty lock file says the last holder ended cleanly; the lock itself goes with the
        // file handle.
        let _ = self.lock.set_len(0);
    }
}

/// Takes `root/.lock`, or says who holds it.
fn take_lock(root: &Path) -> Result<File> {
    let path = root.join(LOCK_FILE);
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    let mut holder = String::new();
    let _ = f.read_to_string(&mut holder);
    let holder = holder.trim().to_string();
    match f.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(Error::RunDirectory {
                dir: root.display().to_string(),
                detail: format!(
                    "in use by another run ({}); wait for it to end or choose another --out",
                    if holder.is_empty() {
                        "a process that is starting".to_string()
                    } else {
                        holder
                    }
                ),
            })
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(Error::io(format!("locking {}", path.display()), e))
        }
    }
    if !holder.is_empty() {
        println!(
            "{}: taking over the lock of a run that did not end cleanly ({holder}, no longer running)",
            root.display()
        );
    }
    let me = format!(
        "pid {} on {} since {}",
        std::process::id(),
        hostname(),
        utc_now()
    );
    f.set_len(0)
        .and_then(|_| f.rewind())
        .and_then(|_| f.write_all(me.as_bytes()))
        .and_then(|_| f.flush())
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    Ok(f)
}

/// The time as `2026-11-23 12:58:43 UTC` (the civil date from days since 1970-01-01, by the
/// proleptic Gregorian calendar's 400-year cycle).
fn utc_now() -> String {
    utc(std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()))
}

/// [`utc_now`] for `secs` since 1970-01-01 00:00:00 UTC.
fn utc(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// A temporary file of `io::write_atomic` (`.NAME.tmp-PID-N`).
fn is_temp(name: &str) -> bool {
    name.starts_with('.') && name.contains(".tmp-")
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "this host".into())
}

/// Whether two paths name the same existing file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

fn list(dir: &Path) -> Result<Vec<PathBuf>> {
    match std::fs::read_dir(dir) {
        Ok(entries) => Ok(entries.filter_map(|e| e.ok().map(|e| e.path())).collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(Error::io(format!("listing {}", dir.display()), e)),
    }
}

fn remove(p: &Path) -> Result<()> {
    std::fs::remove_file(p).map_err(|e| Error::io(format!("deleting {}", p.display()), e))
}

/// Up to five file names, then how many more.
fn names(paths: &[PathBuf]) -> String {
    let mut v: Vec<String> = paths
        .iter()
        .take(5)
        .map(|p| {
            p.file_name().map_or_else(
                || p.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            )
        })
        .collect();
    if paths.len() > 5 {
        v.push(format!("and {} more", paths.len() - 5));
    }
    v.join(", ")
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_dates() {
        assert_eq!(super::utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(super::utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(super::utc(1_795_438_723), "2026-11-23 12:58:43 UTC");
    }
}
