//! Small CPU runs of the main job for the tests that stop, kill and resume it (train_stop, crash,
//! train_resume): the net, data and device those share, each test changing what it needs.
#![allow(dead_code)]

use std::path::PathBuf;

use mixprec::train::progress::ProgressMode;
use mixprec::train::{Resume, RunConfig, RunOptions};

/// A run of `epochs` on the CPU: the small ResNet (blocks 1-1, widths 4-8) on 256 bundled
/// Fashion-MNIST images in batches of 64 (4 steps an epoch), tested on 100, at O2 with
/// augmentation.
pub fn small_cpu_run(out: PathBuf, epochs: usize) -> RunConfig {
    let mut c = RunConfig {
        epochs,
        device: "cpu".into(),
        out,
        ..Default::default()
    };
    c.model.blocks = vec![1, 1];
    c.model.widths = vec![4, 8];
    c.data.dir = "bundled".into();
    c.data.batch_size = 64;
    c.data.train_limit = 256;
    c.data.test_limit = 100;
    c.data.augment = true;
    c.amp.opt_level = "O2".into();
    c
}

/// The run's options: `resume` and `stop_after` as `--resume` and `--stop-after`, no progress.
pub fn options(resume: Option<Resume>, stop_after: Option<usize>) -> RunOptions {
    RunOptions {
        resume,
        stop_after,
        progress: Some(ProgressMode::Off),
        ..Default::default()
    }
}

/// `--resume auto`, no progress.
pub fn auto() -> RunOptions {
    options(Some(Resume::Auto), None)
}
