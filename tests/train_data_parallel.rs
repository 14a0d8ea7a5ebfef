//! `train_resnet --data-parallel 2` on the CPU (two CPU replicas in one process): the main job's
//! small run trains through `DataParallel`, writes its metrics, `last` and the weights, and its
//! checkpoint (one copy, the module's names) loads into a plain ResNet and resumes as a run
//! without `--data-parallel`.

#[path = "common/train_run.rs"]
mod train_run;

use mixprec::io::Checkpoint;
use mixprec::nn::{Module, ResNet};
use mixprec::train::data_parallel::run_data_parallel;
use mixprec::train::distributed::Nproc;
use mixprec::train::trainer::model_config;
use mixprec::train::{run, Resume};
use train_run::{options, small_cpu_run};

#[test]
fn two_cpu_replicas_train_the_main_job_and_checkpoint_one_copy() {
    let out = std::env::temp_dir().join(format!("mixprec-train-dp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let cfg = small_cpu_run(out.clone(), 2);
    let summary = run_data_parallel(&cfg, &options(None, None), Nproc::Count(2)).unwrap();
    assert_eq!(summary.history.len(), 2);
    let last = summary.last().unwrap();
    assert!(
        last.train_loss.is_finite() && last.test_accuracy > 0.0,
        "{last:?}"
    );
    assert!(summary.history[1].train_loss < summary.history[0].train_loss * 1.5);
    for f in [
        "metrics.csv",
        "metrics.jsonl",
        "metrics.png",
        "model.safetensors",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let ck_path = summary.last_checkpoint.clone().unwrap();
    let ck = Checkpoint::load(&ck_path).unwrap();
    // One copy under the module's own names: a plain ResNet of the run's shape loads it.
    let (model_cfg, _) = model_config(&cfg, [1, 28, 28], 10);
    let plain = ResNet::new(&model_cfg, &mixprec::Device::Cpu).unwrap();
    plain.load_state_dict(&ck.model).unwrap();
    // And a run without --data-parallel continues it.
    let mut more = cfg.clone();
    more.epochs = 3;
    let resumed = run(&more, &options(Some(Resume::From(ck_path.clone())), None)).unwrap();
    assert_eq!(resumed.history.len(), 3, "{:?}", resumed.history);
    std::fs::remove_dir_all(&out).ok();
}
