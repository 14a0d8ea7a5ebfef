//! A stop signal that lands exactly at an epoch's last step: the epoch is whole, saved as
//! done, and a resumed run starts at the next epoch (it trained the first one twice when the
//! stop was saved as a partial epoch of every step). A signal is raised after a chosen step
//! from inside the loop ([`signal_after`]), so the test does not depend on timing.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::distributed::signals;
use crate::train::progress::ProgressMode;
use crate::train::{run, Resume, RunConfig, RunOptions};

/// The step after which a SIGTERM is raised (0: none).
static RAISE_AFTER: AtomicU64 = AtomicU64::new(0);
/// The signal flag is the process's: one run of these tests at a time.
static ONE_RUN: Mutex<()> = Mutex::new(());

/// Called by the training loop after each step, before the stop vote.
pub(super) fn signal_after(step: u64) {
    if step != 0 && RAISE_AFTER.load(Ordering::SeqCst) == step {
        signals::raise_pending(libc::SIGTERM);
    }
}

/// Two epochs of the small ResNet on 256 bundled Fashion-MNIST images in batches of 64: four
/// steps an epoch.
fn config(out: PathBuf) -> RunConfig {
    let mut c = RunConfig {
        epochs: 2,
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
    c.amp.opt_level = "O2".into();
    c
}

fn options(resume: Option<Resume>) -> RunOptions {
    RunOptions {
        resume,
        progress: Some(ProgressMode::Off),
        ..Default::default()
    }
}

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mixprec-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn a_stop_at_an_epochs_last_step_resumes_at_the_next_epoch() {
    let _one = ONE_RUN.lock().unwrap_or_else(|e| e.into_inner());
    RAISE_AFTER.store(0, Ordering::SeqCst);
    let whole_dir = fresh_dir("stop-whole");
    let whole = run(&config(whole_dir.clone()), &options(None)).unwrap();
    assert_eq!(whole.stopped, None);
    assert_eq!(whole.history.len(), 2);
    assert_eq!(whole.history[0].step, 4, "four steps an epoch");

    let dir = fresh_dir("stop-last-step");
    // After step 4, epoch 1's last.
    RAISE_AFTER.store(4, Ordering::SeqCst);
    let stopped = run(&config(dir.clone()), &options(None));
    RAISE_AFTER.store(0, Ordering::SeqCst);
    let stopped = stopped.unwrap();
    assert_eq!(stopped.stopped, Some(libc::SIGTERM));
    // The epoch is complete: recorded as done, not saved as a partial epoch.
    assert_eq!(stopped.history.len(), 1, "{:?}", stopped.history);
    assert_eq!(stopped.history[0].step, 4);

    let resumed = run(&config(dir.clone()), &options(Some(Resume::Auto))).unwrap();
    assert_eq!(resumed.stopped, None);
    assert_eq!(resumed.history.len(), 2, "{:?}", resumed.history);
    // Epoch 2 starts at step 4 (epoch 1 not trained again) and ends as the uninterrupted run's.
    assert_eq!(resumed.history[1].step, 8, "{:?}", resumed.history);
    for (a, b) in resumed.history.iter().zip(&whole.history) {
        assert_eq!(a.epoch, b.epoch);
        assert_eq!(
            a.train_loss.to_bits(),
            b.train_loss.to_bits(),
            "{a:?} vs {b:?}"
        );
        assert_eq!(
            a.test_loss.to_bits(),
            b.test_loss.to_bits(),
            "{a:?} vs {b:?}"
        );
        assert_eq!(a.test_accuracy.to_bits(), b.test_accuracy.to_bits());
    }
    let _ = std::fs::remove_dir_all(&whole_dir);
    let _ = std::fs::remove_dir_all(&dir);
}
