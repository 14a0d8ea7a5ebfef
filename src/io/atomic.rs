//! Atomic file replacement: write a sibling temporary file, flush and fsync it, rename it over
//! the destination. A reader sees the old file or the new one, never a half-written one; on any
//! error the temporary file is removed and an existing destination is untouched.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

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
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{}",
        name.to_string_lossy(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| {
            Error::io(
                format!("writing {}: creating {}", path.display(), tmp.display()),
                e,
            )
        })?;
    let mut guard = TempFile(Some(tmp.clone()));
    let ctx = |what: &str| format!("writing {}: {what} {}", path.display(), tmp.display());

    let mut w = BufWriter::with_capacity(1 << 20, file);
    write(&mut w)?;
    let file: File = w
        .into_inner()
        .map_err(|e| Error::io(ctx("flushing"), e.into_error()))?;
    file.sync_all().map_err(|e| Error::io(ctx("syncing"), e))?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(|e| {
        Error::io(
            format!(
                "writing {}: renaming {} over it",
                path.display(),
                tmp.display()
            ),
            e,
        )
    })?;
    guard.0 = None;
    // The rename is durable once the directory entry is: best effort (the new file is in place
    // either way, and some file systems refuse to sync a directory).
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
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
