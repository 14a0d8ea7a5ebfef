//! The main training job behind `examples/train_resnet.rs`: the run configuration (`config`:
//! TOML + flags), the loop with checkpoints and exact resume (`trainer`), and its reports:
//! per-epoch metrics files (`metrics`), the loss and accuracy plot (`plot`) and the progress
//! display (`progress`).

pub mod config;
pub mod metrics;
pub mod plot;
pub mod progress;
pub mod trainer;

pub use config::RunConfig;
pub use trainer::{run, RunOptions, RunSummary};

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Writes `bytes` to `path` through a temporary file beside it and a rename, so that a reader (or
/// a crash) never sees a half-written file. On failure the temporary file is removed and `path`
/// is left as it was.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_path(path);
    let result = (|| -> std::io::Result<()> {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(format!("writing {}", tmp.display()), e));
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(
            format!("renaming {} to {}", tmp.display(), path.display()),
            e,
        )
    })
}

/// `dir/name` → `dir/.name.tmp` (hidden, and never a name the job itself writes).
fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp"))
}
