//! `--resume auto` over damaged and missing checkpoints, what a run records, and bad image
//! files: the newest checkpoint that verifies is taken whatever is wrong with the newer ones,
//! each of those named once; a kept snapshot a kill cut short is written again; the config
//! records the device the run was given; a file that does not decode is reported (with the flag
//! that skips it) even in the dropped last batch.

use std::path::{Path, PathBuf};

use mixprec::data::{BadFiles, DataLoader, ImageFolder, ImageTransform};
use mixprec::io::checkpoint::Checkpoint;
use mixprec::train::trainer::checkpoint_config;
use mixprec::train::{auto_checkpoint, run, Resume, RunConfig, RunSummary};

#[path = "common/train_run.rs"]
mod train_run;
use train_run::{options, small_cpu_run};

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mixprec-resume-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// 4 steps an epoch, a small test set.
fn quick(out: PathBuf, epochs: usize) -> RunConfig {
    let mut c = small_cpu_run(out, epochs);
    c.data.augment = false;
    c.amp.opt_level = "O0".into();
    c
}

fn flip_a_data_byte(p: &Path) {
    let mut b = std::fs::read(p).unwrap();
    let n = b.len();
    b[n - 5] ^= 1;
    std::fs::write(p, b).unwrap();
}

fn assert_same_losses(a: &RunSummary, b: &RunSummary) {
    assert_eq!(a.history.len(), b.history.len());
    for (x, y) in a.history.iter().zip(&b.history) {
        assert_eq!(
            x.train_loss.to_bits(),
            y.train_loss.to_bits(),
            "epoch {}",
            x.epoch
        );
        assert_eq!(
            x.test_loss.to_bits(),
            y.test_loss.to_bits(),
            "epoch {}",
            x.epoch
        );
    }
}

/// `last` and the newest `epoch-N` both damaged (a flipped byte: their headers still read and
/// say they are newer): `--resume auto` falls back to `epoch-(N-1)` instead of refusing, names
/// each damaged file once, and the run ends as an uninterrupted one. A zero-byte `last` (its
/// header unreadable, so its age unknown) or one cut short is named too, not skipped silently.
#[test]
fn resume_auto_falls_back_past_damaged_checkpoints_naming_each_once() {
    let dir = tempdir("damaged");
    let full = run(&quick(dir.join("full"), 4), &options(None, None)).unwrap();
    let cfg = quick(dir.join("run"), 4);
    run(&cfg, &options(Some(Resume::Auto), Some(3))).unwrap();
    let ckpt = cfg.out.join("checkpoints");
    let last_bytes = std::fs::read(ckpt.join("last.safetensors")).unwrap();
    flip_a_data_byte(&ckpt.join("last.safetensors"));
    flip_a_data_byte(&ckpt.join("epoch-003.safetensors"));
    let found = auto_checkpoint(&cfg.out).unwrap().unwrap();
    assert_eq!(found.path, ckpt.join("epoch-002.safetensors"));
    let mut named: Vec<String> = found
        .skipped
        .iter()
        .map(|(p, _)| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    named.sort();
    assert_eq!(named, ["epoch-003.safetensors", "last.safetensors"]);

    // Zero bytes of `last`: named as well.
    std::fs::write(ckpt.join("last.safetensors"), b"").unwrap();
    let found = auto_checkpoint(&cfg.out).unwrap().unwrap();
    assert_eq!(found.path, ckpt.join("epoch-002.safetensors"));
    let named: Vec<_> = found.skipped.iter().map(|(p, _)| p.clone()).collect();
    assert_eq!(named.len(), 2, "{named:?}");
    assert!(named.contains(&ckpt.join("last.safetensors")), "{named:?}");

    // `last` cut short (its header whole, half its data gone): named as well.
    std::fs::write(
        ckpt.join("last.safetensors"),
        &last_bytes[..last_bytes.len() / 2],
    )
    .unwrap();
    let found = auto_checkpoint(&cfg.out).unwrap().unwrap();
    assert_eq!(found.path, ckpt.join("epoch-002.safetensors"));
    let named: Vec<_> = found.skipped.iter().map(|(p, _)| p.clone()).collect();
    assert_eq!(named.len(), 2, "{named:?}");
    assert!(named.contains(&ckpt.join("last.safetensors")), "{named:?}");

    let resumed = run(&cfg, &options(Some(Resume::Auto), None)).unwrap();
    assert_eq!(resumed.history.len(), 4);
    assert_same_losses(&full, &resumed);
    // The damaged files were replaced by the run's own saves.
    for f in ["last", "epoch-003"] {
        Checkpoint::load(&ckpt.join(format!("{f}.safetensors"))).unwrap();
    }
}

/// A kill during the save of `epoch-NNN` (after `last` was saved) left that snapshot missing:
/// the next start writes it again from `last`, which holds the same state; one that cannot be
/// made again (an earlier epoch's) is not invented.
#[test]
fn a_snapshot_cut_short_by_a_kill_is_written_again() {
    let dir = tempdir("snapshot");
    let cfg = quick(dir.join("run"), 3);
    run(&cfg, &options(Some(Resume::Auto), Some(2))).unwrap();
    let ckpt = cfg.out.join("checkpoints");
    let kept = ckpt.join("epoch-002.safetensors");
    let want = Checkpoint::load(&kept).unwrap();
    std::fs::remove_file(&kept).unwrap();
    std::fs::remove_file(ckpt.join("epoch-001.safetensors")).unwrap();
    let s = run(&cfg, &options(Some(Resume::Auto), Some(2))).unwrap();
    assert!(
        s.written
            .contains(&"checkpoints/epoch-002.safetensors".into()),
        "{:?}",
        s.written
    );
    let again = Checkpoint::load(&kept).unwrap();
    assert_eq!(again.progress, want.progress);
    assert_eq!(again.model.len(), want.model.len());
    for ((na, a), (nb, b)) in again.model.iter().zip(&want.model) {
        assert_eq!(na, nb);
        assert!(a.to_vec_f64().unwrap() == b.to_vec_f64().unwrap(), "{na}");
    }
    assert!(!ckpt.join("epoch-001.safetensors").exists());
}

/// The config a run records keeps the device it was given (`auto`), so that the same settings
/// resume under any number of processes; the data directory is the one it resolved to.
#[test]
fn the_record_keeps_the_device_given() {
    let dir = tempdir("device");
    let mut cfg = quick(dir.join("run"), 1);
    cfg.device = "auto".into();
    let s = run(&cfg, &options(None, None)).unwrap();
    let recorded = RunConfig::from_toml_file(cfg.out.join("config.toml")).unwrap();
    assert_eq!(recorded.device, "auto");
    let last = Checkpoint::load(s.last_checkpoint.as_ref().unwrap()).unwrap();
    assert_eq!(checkpoint_config(&last).unwrap().device, "auto");
}

/// A tiny image folder: `train/{a,b}` with 3 grey 8x8 PNGs each, `train/b/bad.png` that does
/// not decode, and `val/{a,b}` with one each.
fn image_folder(root: &Path) -> PathBuf {
    let write = |p: PathBuf, v: u8| {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let f = std::fs::File::create(p).unwrap();
        let mut enc = png::Encoder::new(std::io::BufWriter::new(f), 8, 8);
        enc.set_color(png::ColorType::Grayscale);
        enc.write_header()
            .unwrap()
            .write_image_data(&[v; 64])
            .unwrap();
    };
    for (c, v) in [("a", 40u8), ("b", 200)] {
        for i in 0..3 {
            write(root.join(format!("train/{c}/{i}.png")), v + i as u8);
        }
        write(root.join(format!("val/{c}/0.png")), v);
    }
    std::fs::write(root.join("train/b/bad.png"), b"not a png at all").unwrap();
    root.to_path_buf()
}

/// A file that does not decode stops the run with an error naming it and `--skip-bad-files`,
/// even when it falls into the last partial batch an epoch drops (a seed is chosen so that it
/// does); with `skip_bad_files` the run trains.
#[test]
fn a_bad_image_is_reported_with_the_flag_even_in_the_dropped_batch() {
    let dir = tempdir("bad-image");
    let root = image_folder(&dir.join("images"));
    let train = root.join("train");
    let folder = ImageFolder::with_bad_files(&train, BadFiles::Skip).unwrap();
    let bad = folder
        .samples()
        .iter()
        .position(|s| s.path.ends_with("bad.png"))
        .unwrap();
    let batch = 4;
    let dataset = folder
        .with_transform(ImageTransform::imagenet_eval(8, 8))
        .unwrap();
    let loader = DataLoader::new(dataset, batch).unwrap();
    // A seed whose first epoch leaves the bad file out (7 files, one batch of 4).
    let seed = (0..1000u64)
        .find(|&s| {
            let order = loader.clone().shuffle(s).epoch_order(0);
            order[batch..].contains(&bad)
        })
        .unwrap();
    let mut cfg = quick(dir.join("run"), 1);
    cfg.seed = seed;
    cfg.data.dir = format!("imagefolder:{}", root.display());
    cfg.data.image_size = 8;
    cfg.data.batch_size = batch;
    cfg.data.train_limit = 0;
    cfg.data.test_limit = 0;
    cfg.data.workers = 1;
    cfg.data.grayscale = true;
    // One step: a schedule that needs no warm-up.
    cfg.schedule.kind = "constant".into();
    let msg = run(&cfg, &options(None, None)).unwrap_err().to_string();
    assert!(
        msg.contains("bad.png") && msg.contains("--skip-bad-files"),
        "{msg}"
    );
    cfg.data.skip_bad_files = true;
    cfg.out = dir.join("skipping");
    let s = run(&cfg, &options(None, None)).unwrap();
    assert_eq!(s.history.len(), 1);
}
