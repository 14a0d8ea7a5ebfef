//! The GPT job with `checkpoint_activations` on the CPU: with dropout, the run's losses and
//! sample are bitwise those of the plain run, and the recipe it writes records the setting.

use std::path::Path;

use mixprec::train::gpt::{run_gpt, GptRunConfig, GptRunOptions};
use mixprec::train::progress::ProgressMode;
use mixprec::Device;

fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("mixprec-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn config(data: &Path, checkpointed: bool) -> GptRunConfig {
    GptRunConfig {
        model: Some("tiny".into()),
        data: Some(data.to_path_buf()),
        context: Some(16),
        batch_size: Some(2),
        steps: Some(4),
        warmup: Some(1),
        dropout: Some(0.1),
        eval_every: Some(4),
        eval_batches: Some(1),
        sample_tokens: Some(4),
        prompt: Some("To be".into()),
        checkpoint_activations: Some(checkpointed),
        ..Default::default()
    }
}

#[test]
fn a_checkpointed_run_is_the_plain_run() {
    let tmp = scratch("gpt-ckpt");
    let data = tmp.join("text");
    std::fs::create_dir_all(&data).unwrap();
    let line = "To be, or not to be, that is the question: whether 'tis nobler in the mind.\n";
    std::fs::write(data.join("hamlet.txt"), line.repeat(40)).unwrap();
    let run = |checkpointed: bool, dir: &str| {
        let out = tmp.join(dir);
        let opts = GptRunOptions {
            out: out.clone(),
            device: Device::Cpu,
            resume: None,
            overwrite: false,
            progress: ProgressMode::Off,
            stop_after: None,
        };
        let s = run_gpt(&config(&data, checkpointed), &opts).unwrap();
        let recipe = std::fs::read_to_string(out.join("config.json")).unwrap();
        assert!(
            recipe.contains(&format!("\"checkpoint_activations\": {checkpointed}")),
            "{recipe}"
        );
        s
    };
    let plain = run(false, "plain");
    let ck = run(true, "checkpointed");
    assert_eq!(plain.steps, 4);
    assert_eq!(plain.train_loss.to_bits(), ck.train_loss.to_bits());
    assert_eq!(plain.val_loss.to_bits(), ck.val_loss.to_bits());
    assert_eq!(plain.sample, ck.sample);
}
