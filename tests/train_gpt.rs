//! The GPT job (`train::gpt::run_gpt`, behind `examples/train_gpt.rs`) on the CPU: a tiny model
//! trained for a few steps on a small corpus lowers its loss, writes its files, samples text, and
//! continues exactly from its checkpoint.

use std::path::Path;

use mixprec::train::gpt::{run_gpt, GptRunConfig, GptRunOptions};
use mixprec::train::progress::ProgressMode;
use mixprec::Device;

fn corpus(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let line = "To be, or not to be, that is the question: whether 'tis nobler in the mind to \
                suffer the slings and arrows of outrageous fortune.\n";
    std::fs::write(dir.join("hamlet.txt"), line.repeat(60)).unwrap();
}

fn config(data: &Path, steps: u64) -> GptRunConfig {
    GptRunConfig {
        model: Some("tiny".into()),
        data: Some(data.to_path_buf()),
        context: Some(32),
        batch_size: Some(4),
        steps: Some(steps),
        lr: Some(3e-3),
        warmup: Some(2),
        eval_every: Some(10),
        eval_batches: Some(2),
        sample_tokens: Some(8),
        prompt: Some("To be".into()),
        ..Default::default()
    }
}

fn options(out: &Path) -> GptRunOptions {
    GptRunOptions {
        out: out.to_path_buf(),
        device: Device::Cpu,
        resume: None,
        overwrite: false,
        progress: ProgressMode::Off,
        stop_after: None,
    }
}

#[test]
fn a_tiny_gpt_learns_writes_its_files_and_resumes() {
    let tmp = scratch("gpt-run");
    let data = tmp.join("text");
    corpus(&data);
    let out = tmp.join("run");
    let s = run_gpt(&config(&data, 20), &options(&out)).unwrap();
    assert_eq!(s.steps, 20);
    // ln(50304) ≈ 10.8 at the start; a repeated line is learnt fast.
    assert!(s.train_loss < 7.0, "train loss {}", s.train_loss);
    assert!(s.val_loss < 7.0, "val loss {}", s.val_loss);
    assert!(s.sample.starts_with("To be"), "{}", s.sample);
    for f in [
        "metrics.csv",
        "metrics.jsonl",
        "metrics.png",
        "model.safetensors",
        "config.json",
    ] {
        assert!(out.join(f).is_file(), "{f}");
    }
    let csv = std::fs::read_to_string(out.join("metrics.csv")).unwrap();
    assert_eq!(
        csv.lines().count(),
        3,
        "a header and one row per evaluation:\n{csv}"
    );
    // The next run in the same place refuses to mix files.
    assert!(run_gpt(&config(&data, 20), &options(&out)).is_err());

    // Stopped after 10 steps and resumed, the run ends where the straight one did, exactly.
    let split = tmp.join("split");
    let mut o = options(&split);
    o.stop_after = Some(10);
    let half = run_gpt(&config(&data, 20), &o).unwrap();
    assert_eq!(half.steps, 10);
    let mut o = options(&split);
    o.resume = Some(split.join("checkpoints/last.safetensors"));
    let mut other = config(&data, 20);
    other.lr = Some(1.0); // ignored: the checkpoint's recipe wins
    let rest = run_gpt(&other, &o).unwrap();
    assert_eq!(rest.steps, 20);
    assert_eq!(rest.train_loss.to_bits(), s.train_loss.to_bits());
    assert_eq!(rest.val_loss.to_bits(), s.val_loss.to_bits());
    assert_eq!(rest.sample, s.sample);
}

#[test]
fn bad_settings_are_errors() {
    let tmp = scratch("gpt-bad");
    let data = tmp.join("text");
    corpus(&data);
    let bad = [
        GptRunConfig {
            model: Some("gpt5".into()),
            ..config(&data, 5)
        },
        GptRunConfig {
            steps: Some(0),
            ..config(&data, 5)
        },
        GptRunConfig {
            half: Some("f8".into()),
            ..config(&data, 5)
        },
        GptRunConfig {
            captured: Some(true),
            ..config(&data, 5)
        },
        GptRunConfig {
            warmup: Some(9),
            ..config(&data, 5)
        },
    ];
    for (i, c) in bad.iter().enumerate() {
        let err = run_gpt(c, &options(&tmp.join(format!("r{i}"))));
        assert!(err.is_err(), "{c:?}");
    }
}

/// A fresh scratch directory for one test (removed first if a crashed run left it).
fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("mixprec-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
