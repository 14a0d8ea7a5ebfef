//! The loss scaler's history in train_resnet's metrics: each epoch's record carries the scale
//! at its end and the steps skipped in that epoch (not the run's total), in memory and in
//! metrics.jsonl alike.

use mixprec::train::metrics::read_jsonl;
use mixprec::train::progress::ProgressMode;
use mixprec::train::{run, RunConfig, RunOptions};

#[test]
fn each_epoch_records_its_own_skipped_steps_and_the_scale() {
    let out = std::env::temp_dir().join(format!("mixprec-scaler-metrics-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut c = RunConfig {
        epochs: 4,
        device: "cpu".into(),
        out: out.clone(),
        divergence_steps: 0,
        ..Default::default()
    };
    c.model.blocks = vec![1, 1];
    c.model.widths = vec![4, 8];
    c.data.dir = "bundled".into();
    c.data.batch_size = 64;
    c.data.train_limit = 256; // 4 steps an epoch
    c.data.test_limit = 64;
    c.optimizer.lr = 1000.0; // diverges: steps are skipped, epoch after epoch
    c.schedule.kind = "constant".into();
    c.amp.opt_level = "O2".into();
    let opts = RunOptions {
        progress: Some(ProgressMode::Off),
        ..Default::default()
    };
    let s = run(&c, &opts).unwrap();
    let steps_per_epoch = 4;
    assert_eq!(s.history.len(), 4);
    for r in &s.history {
        assert!(
            r.skipped_steps <= steps_per_epoch,
            "epoch {}: {} skipped of {steps_per_epoch} steps",
            r.epoch,
            r.skipped_steps
        );
        assert!(r.loss_scale > 0.0 && r.loss_scale.is_finite(), "{r:?}");
    }
    let total: u64 = s.history.iter().map(|r| r.skipped_steps).sum();
    assert!(
        total > steps_per_epoch,
        "the run skips steps in more than one epoch: {total}"
    );
    let scaler = |h: &[mixprec::train::metrics::EpochRecord]| -> Vec<(u64, f64)> {
        h.iter().map(|r| (r.skipped_steps, r.loss_scale)).collect()
    };
    let file = read_jsonl(&out.join("metrics.jsonl")).unwrap();
    assert_eq!(scaler(&file), scaler(&s.history));
    let _ = std::fs::remove_dir_all(&out);
}
