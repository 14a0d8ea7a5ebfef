//! The main job's run configuration and loop (src/train): TOML parsing with errors naming the
//! key, the documented defaults file, and an exact resume.

use std::path::PathBuf;

use mixprec::train::progress::ProgressMode;
use mixprec::train::{run, RunConfig, RunOptions};
use mixprec::Error;

fn config_err(text: &str) -> (String, String) {
    match RunConfig::from_toml_str(text, "test.toml") {
        Err(Error::Config { key, allowed, .. }) => (key, allowed),
        other => panic!("expected a config error for {text:?}, got {other:?}"),
    }
}

#[test]
fn documented_defaults_file_is_the_default() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/configs/run_fashion_mnist.toml"
    );
    assert_eq!(
        RunConfig::from_toml_file(path).unwrap(),
        RunConfig::default()
    );
    let full = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/configs/run_fashion_mnist_full.toml"
    );
    let c = RunConfig::from_toml_file(full).unwrap();
    assert_eq!(c.model.widths, vec![32, 64, 128]);
    assert!(c.data.augment);
}

#[test]
fn keys_override_defaults() {
    let c = RunConfig::from_toml_str(
        "epochs = 3\n[optimizer]\nname = \"adamw\"\nlr = 0.002\nbetas = [0.8, 0.99]\n[amp]\npolicy = \"configs/O1.toml\"\n",
        "t",
    )
    .unwrap();
    assert_eq!(c.epochs, 3);
    assert_eq!(c.optimizer.name, "adamw");
    assert_eq!(c.optimizer.lr, 0.002);
    assert_eq!(c.optimizer.betas, (0.8, 0.99));
    assert_eq!(c.amp.policy.as_deref(), Some("configs/O1.toml"));
    assert_eq!(c.model, RunConfig::default().model);
}

#[test]
fn bad_keys_and_values_name_the_key() {
    let cases = [
        ("epoch = 3", "epoch"),
        ("[model]\nwidht = [1]", "model.widht"),
        ("[optimizer]\nname = \"rmsprop\"", "optimizer.name"),
        ("[optimizer]\nlr = -1.0", "optimizer.lr"),
        ("[optimizer]\nbetas = [0.9]", "optimizer.betas"),
        ("[data]\nbatch_size = 0", "data.batch_size"),
        ("[data]\naugment = \"yes\"", "data.augment"),
        ("[model]\nwidths = [8, 16]", "model.widths"),
        ("device = \"gpu\"", "device"),
        ("[schedule]\nkind = \"linear\"", "schedule.kind"),
        ("[amp]\nopt_level = \"O4\"", "amp.opt_level"),
        ("model = 3", "model"),
        ("epochs = ", "(syntax)"),
    ];
    for (text, key) in cases {
        let (got, allowed) = config_err(text);
        assert_eq!(got, key, "{text:?}");
        assert!(!allowed.is_empty());
    }
}

fn tiny(out: PathBuf, opt_level: &str, optimizer: &str) -> RunConfig {
    let mut c = RunConfig {
        epochs: 3,
        device: "cpu".into(),
        out,
        ..Default::default()
    };
    c.model.blocks = vec![1, 1];
    c.model.widths = vec![4, 8];
    c.data.dir = "bundled".into();
    c.data.batch_size = 64;
    c.data.train_limit = 640;
    c.data.test_limit = 200;
    c.data.augment = true;
    c.optimizer.name = optimizer.into();
    if optimizer != "sgd" {
        c.optimizer.lr = 3e-3;
    }
    c.amp.opt_level = opt_level.into();
    c
}

fn quiet() -> RunOptions {
    RunOptions {
        progress: Some(ProgressMode::Off),
        ..Default::default()
    }
}

/// A run stopped after epoch 1 and resumed from its checkpoint ends with exactly the losses of
/// an uninterrupted run (bit for bit), and writes the metrics, the plot and the weights.
#[test]
fn resume_reproduces_the_uninterrupted_run() {
    for (level, optimizer) in [("O0", "sgd"), ("O2", "adamw")] {
        let dir = tempdir(&format!("resume-{level}"));
        let full = run(&tiny(dir.join("full"), level, optimizer), &quiet()).unwrap();
        let cfg = tiny(dir.join("split"), level, optimizer);
        let first = run(
            &cfg,
            &RunOptions {
                stop_after: Some(1),
                ..quiet()
            },
        )
        .unwrap();
        assert_eq!(first.history.len(), 1);
        let ckpt = cfg.out.join("checkpoints/epoch-001.safetensors");
        let resumed = run(
            &cfg,
            &RunOptions {
                resume: Some(ckpt),
                ..quiet()
            },
        )
        .unwrap();
        assert_eq!(resumed.history.len(), 3);
        for (a, b) in full.history.iter().zip(&resumed.history) {
            assert_eq!(
                a.train_loss.to_bits(),
                b.train_loss.to_bits(),
                "{level}: epoch {} train loss {} vs resumed {}",
                a.epoch,
                a.train_loss,
                b.train_loss
            );
            assert_eq!(a.test_loss.to_bits(), b.test_loss.to_bits());
            assert_eq!(a.step, b.step);
        }
        for f in [
            "metrics.csv",
            "metrics.jsonl",
            "metrics.png",
            "config.toml",
            "model.safetensors",
        ] {
            assert!(cfg.out.join(f).is_file(), "{level}: {f} missing");
        }
        let lines = std::fs::read_to_string(cfg.out.join("metrics.jsonl")).unwrap();
        assert_eq!(
            lines.lines().count(),
            3,
            "{level}: metrics.jsonl keeps the epochs before the resume"
        );
    }
}

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mixprec-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
