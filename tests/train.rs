//! The main job's run configuration and loop (src/train): TOML parsing with errors naming the
//! key, the documented defaults file, and an exact resume.

use std::path::PathBuf;

use mixprec::data::{FashionMnist, Split};
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
        ("[model]\narch = \"vgg16\"", "model.arch"),
        ("[data]\ndir = \"imagenet:/data\"", "data.dir"),
        ("[data]\nmean = [0.5]", "data.mean"),
        ("[data]\nstd = [0.0]", "data.std"),
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

/// Writes the first `n` items of `ds`, sorted by (label, index) — the order an ImageFolder of
/// them serves — as IDX files under `idx/` and as grey PNGs under `png/{split}/{label}/`.
fn export_sorted(ds: &FashionMnist, n: usize, split: &str, root: &std::path::Path) {
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| (ds.labels()[i], i));
    let mut pixels = Vec::new();
    let mut labels = Vec::new();
    for (pos, &i) in order.iter().enumerate() {
        let img = ds.raw_image(i).unwrap();
        pixels.extend_from_slice(img);
        labels.push(ds.labels()[i]);
        let dir = root
            .join("png")
            .join(split)
            .join(ds.labels()[i].to_string());
        std::fs::create_dir_all(&dir).unwrap();
        let f = std::fs::File::create(dir.join(format!("{pos:05}.png"))).unwrap();
        let mut enc = png::Encoder::new(std::io::BufWriter::new(f), 28, 28);
        enc.set_color(png::ColorType::Grayscale);
        enc.write_header().unwrap().write_image_data(img).unwrap();
    }
    let (images, labels_file) = Split::file_names(if split == "train" {
        Split::Train
    } else {
        Split::Test
    });
    std::fs::create_dir_all(root.join("idx")).unwrap();
    let idx_images = mixprec::data::idx::IdxImages {
        count: n,
        rows: 28,
        cols: 28,
        pixels,
    };
    mixprec::data::idx::write_images(root.join("idx").join(images), &idx_images).unwrap();
    mixprec::data::idx::write_labels(root.join("idx").join(labels_file), &labels).unwrap();
}

/// The main job on Fashion-MNIST exported as a PNG ImageFolder (grey, the IDX normalisation)
/// trains exactly as on the IDX files holding the same images in the same order: the same
/// batches, augmentation, losses and accuracy, bit for bit.
#[test]
fn png_image_folder_trains_exactly_as_the_idx_files() {
    let dir = tempdir("imagefolder-vs-idx");
    let bundled = mixprec::data::fashion_mnist::bundled_dir();
    let train = FashionMnist::load_dir(&bundled, Split::Train).unwrap();
    let test = FashionMnist::load_dir(&bundled, Split::Test).unwrap();
    export_sorted(&train, 1280, "train", &dir);
    export_sorted(&test, 400, "val", &dir);

    let base = |out: &str, data: String| {
        let mut c = tiny(dir.join(out), "O0", "sgd");
        c.epochs = 2;
        c.data.dir = data;
        c.data.train_limit = 0;
        c.data.test_limit = 0;
        c
    };
    let idx = run(
        &base("idx-run", dir.join("idx").display().to_string()),
        &quiet(),
    )
    .unwrap();
    let mut folder_cfg = base(
        "png-run",
        format!("imagefolder:{}", dir.join("png").display()),
    );
    folder_cfg.data.image_size = 28;
    folder_cfg.data.grayscale = true;
    folder_cfg.data.mean = vec![mixprec::data::fashion_mnist::MEAN as f64];
    folder_cfg.data.std = vec![mixprec::data::fashion_mnist::STD as f64];
    folder_cfg.data.workers = 3;
    let png = run(&folder_cfg, &quiet()).unwrap();
    assert_eq!(idx.history.len(), 2);
    for (a, b) in idx.history.iter().zip(&png.history) {
        assert_eq!(
            a.train_loss.to_bits(),
            b.train_loss.to_bits(),
            "epoch {}",
            a.epoch
        );
        assert_eq!(
            a.test_loss.to_bits(),
            b.test_loss.to_bits(),
            "epoch {}",
            a.epoch
        );
        assert_eq!(a.test_accuracy, b.test_accuracy, "epoch {}", a.epoch);
    }
    // It learned (10 classes: chance is 0.1).
    assert!(png.history[1].test_accuracy > 0.2, "{:?}", png.history[1]);
}

/// `--data imagefolder:DIR` with an ImageNet-style model: torchvision's ResNet-18 on generated
/// JPEGs at 64 px (RandomResizedCrop + flip), one epoch on the CPU, with its outputs.
#[test]
fn image_folder_trains_a_torchvision_resnet() {
    let dir = tempdir("imagefolder-resnet18");
    for (split, n) in [("train", 16), ("val", 4)] {
        for i in 0..n {
            let class = i % 2;
            let (w, h) = (70 + i * 3, 60 + i * 2);
            let mut px = Vec::new();
            for y in 0..h {
                for x in 0..w {
                    let v = if class == 0 { x * 3 } else { y * 3 };
                    px.extend_from_slice(&[(v % 256) as u8, 128, (255 - v % 256) as u8]);
                }
            }
            let d = dir.join(split).join(format!("class{class}"));
            std::fs::create_dir_all(&d).unwrap();
            let mut bytes = Vec::new();
            jpeg_encoder::Encoder::new(&mut bytes, 85)
                .encode(&px, w as u16, h as u16, jpeg_encoder::ColorType::Rgb)
                .unwrap();
            std::fs::write(d.join(format!("{i}.jpg")), bytes).unwrap();
        }
    }
    let mut c = tiny(dir.join("out"), "O0", "sgd");
    c.epochs = 1;
    c.data.dir = format!("imagefolder:{}", dir.display());
    c.data.image_size = 64;
    c.data.batch_size = 8;
    c.data.eval_batch_size = 4;
    c.data.train_limit = 0;
    c.data.test_limit = 0;
    c.model.arch = "resnet18".into();
    let summary = run(&c, &quiet()).unwrap();
    let last = summary.last().unwrap();
    assert_eq!(last.step, 2);
    assert!(last.train_loss.is_finite() && last.test_loss.is_finite());
    assert!(summary.weights.is_file() && summary.last_checkpoint.is_file());
    let saved = std::fs::read_to_string(c.out.join("config.toml")).unwrap();
    assert!(
        saved.contains("resnet18") && saved.contains("imagefolder:"),
        "{saved}"
    );
}
