//! The main training job behind `examples/train_resnet.rs`: the run configuration (`config`:
//! TOML + flags), its datasets and loaders (`data`), the loop with checkpoints and exact resume
//! (`trainer`, `resume`), its output directory and lock (`run_dir`), the divergence stop
//! (`divergence`), the stop on SIGINT / SIGTERM at a step boundary the ranks agree on (`stop`),
//! several devices from one process (`data_parallel`: `--data-parallel`),
//! and its reports: per-epoch metrics files (`metrics`), the loss and accuracy plot (`plot`) and
//! the progress display (`progress`).

pub mod config;
pub mod data;
pub mod data_parallel;
pub mod distributed;
pub mod divergence;
pub mod gpt;
pub mod metrics;
mod model;
pub mod plot;
pub mod progress;
pub mod resume;
pub mod run_dir;
mod stop;
pub mod trainer;

pub use config::RunConfig;
pub use trainer::{auto_checkpoint, find_checkpoint, run, Resume, RunOptions, RunSummary};

/// Writes `bytes` to `path` atomically (through `io::write_atomic`: temp file, fsync, rename).
pub(crate) fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> crate::error::Result<()> {
    crate::io::write_atomic(path, |w| {
        w.write_all(bytes)
            .map_err(|e| crate::error::Error::io(format!("writing {}", path.display()), e))
    })
}
