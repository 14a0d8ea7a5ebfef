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
        ("out = \"\"", "out"),
        ("[optimizer]\nlr = 1e9", "optimizer.lr"),
        ("[optimizer]\nlr = nan", "optimizer.lr"),
        ("[optimizer]\nbetas = [0.9, 1]", "optimizer.betas"),
        ("[data]\ntrain_limit = -1", "data.train_limit"),
        ("[amp]\npolicy = \"\"", "amp.policy"),
    ];
    for (text, key) in cases {
        let (got, allowed) = config_err(text);
        assert_eq!(got, key, "{text:?}");
        assert!(!allowed.is_empty());
    }
}

/// Every error names the file, the line and column, the key, the value as written and what is
/// allowed; numbers print as people write them.
#[test]
fn config_errors_say_where_and_what() {
    let e =
        RunConfig::from_toml_str("epochs = 3\n[optimizer]\nlr = 1e9\n", "run.toml").unwrap_err();
    assert_eq!(
        e.to_string(),
        "config run.toml:3:6: key `optimizer.lr` = 1e9: a number > 0 and <= 1000"
    );
    let e = RunConfig::from_toml_str("[optimizer]\n  lr = nan", "run.toml").unwrap_err();
    assert_eq!(
        e.to_string(),
        "config run.toml:2:8: key `optimizer.lr` = nan: a number > 0 and <= 1000"
    );
    let e = RunConfig::from_toml_str("[optimizer]\nnmae = \"adam\"", "r.toml").unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.starts_with("config r.toml:2:1: key `optimizer.nmae` = \"adam\": not a known key"),
        "{msg}"
    );
    assert!(msg.contains("`name`") && msg.contains("`lr`"), "{msg}");
    let e = RunConfig::from_toml_str("[data]\nbatch_size = \"big\"", "r.toml").unwrap_err();
    assert_eq!(
        e.to_string(),
        "config r.toml:2:14: key `data.batch_size` = \"big\": an integer >= 1"
    );
    // A default that disagrees with a key the file sets names the key, without a place.
    let e = RunConfig::from_toml_str("[model]\nwidths = [8, 16]", "r.toml").unwrap_err();
    assert!(
        matches!(&e, Error::Config { key, at: Some(_), .. } if key == "model.widths"),
        "{e}"
    );
    // Syntax errors have a place too.
    match RunConfig::from_toml_str("epochs = 3\nseed = 1\nepochs = 4\n", "r.toml") {
        Err(e @ Error::ConfigSyntax { at: Some(at), .. }) => {
            assert_eq!((at.line, at.column), (3, 1), "{e}");
            let msg = e.to_string();
            assert!(
                msg.contains("duplicate key") && msg.contains("epochs"),
                "{msg}"
            );
            assert!(msg.starts_with("config r.toml:3:1: TOML syntax: "), "{msg}");
        }
        other => panic!("expected a syntax error, got {other:?}"),
    }
    assert!(matches!(
        RunConfig::from_toml_str("epochs = ", "r.toml"),
        Err(Error::ConfigSyntax { at: Some(_), .. })
    ));
    // Integers are numbers: betas = [0, 0.999] is two numbers.
    let c = RunConfig::from_toml_str("[optimizer]\nbetas = [0, 0.999]\nlr = 1", "r.toml").unwrap();
    assert_eq!(c.optimizer.betas, (0.0, 0.999));
    assert_eq!(c.optimizer.lr, 1.0);
}

/// A flag is held to the limits of its key (one validation for both).
#[test]
fn flags_and_keys_share_their_limits() {
    for (set, key) in [
        (
            (|c: &mut RunConfig| c.optimizer.lr = 1e9) as fn(&mut RunConfig),
            "optimizer.lr",
        ),
        (|c| c.optimizer.lr = -1.0, "optimizer.lr"),
        (|c| c.optimizer.lr = f64::NAN, "optimizer.lr"),
        (|c| c.epochs = 0, "epochs"),
        (|c| c.out = PathBuf::new(), "out"),
        (|c| c.model.widths = vec![8], "model.widths"),
        (|c| c.data.batch_size = 0, "data.batch_size"),
        (|c| c.optimizer.momentum = 2.0, "optimizer.momentum"),
    ] {
        let mut c = RunConfig::default();
        set(&mut c);
        match c.validate("command line") {
            Err(Error::Config { key: k, value, .. }) => {
                assert_eq!(k, key);
                assert!(value.len() < 30, "{value}");
            }
            other => panic!("{key}: {other:?}"),
        }
    }
    let mut c = RunConfig::default();
    c.optimizer.lr = f64::MIN_POSITIVE;
    assert!(c.validate("x").is_ok());
    c.optimizer.lr = -f64::MIN_POSITIVE;
    let msg = c.validate("x").unwrap_err().to_string();
    assert!(msg.len() < 120, "{msg}");
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
