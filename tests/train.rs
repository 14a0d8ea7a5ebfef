//! The main job's run configuration and loop (src/train): TOML parsing with errors naming the
//! key, the documented defaults file, and an exact resume.

use std::path::PathBuf;

use mixprec::data::{FashionMnist, Split};
use mixprec::train::progress::ProgressMode;
use mixprec::train::{run, Resume, RunConfig, RunOptions, RunSummary};
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
        "config r.toml:2:14: key `data.batch_size` = \"big\": an integer from 1 to 16777216, \
         in digits (per process)"
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

/// The epochs both runs recorded have bitwise the same train and test losses.
#[track_caller]
fn assert_same_losses(what: &str, a: &RunSummary, b: &RunSummary) {
    for (x, y) in a.history.iter().zip(&b.history) {
        assert_eq!(
            (x.train_loss.to_bits(), x.test_loss.to_bits()),
            (y.train_loss.to_bits(), y.test_loss.to_bits()),
            "{what}: epoch {}: losses {} / {} vs {} / {}",
            x.epoch,
            x.train_loss,
            x.test_loss,
            y.train_loss,
            y.test_loss
        );
    }
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
                resume: Some(Resume::From(ckpt)),
                ..quiet()
            },
        )
        .unwrap();
        assert_eq!(resumed.history.len(), 3);
        assert_same_losses(&format!("{level} resumed"), &full, &resumed);
        for (a, b) in full.history.iter().zip(&resumed.history) {
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

/// A quick run for the run-directory tests: 4 steps an epoch.
fn quick(out: PathBuf, epochs: usize) -> RunConfig {
    let mut c = tiny(out, "O0", "sgd");
    c.epochs = epochs;
    c.data.train_limit = 256;
    c.data.test_limit = 100;
    c.data.augment = false;
    c
}

/// `run` with `--resume auto`, quiet; it must succeed.
fn resume_auto(cfg: &RunConfig) -> RunSummary {
    run(
        cfg,
        &RunOptions {
            resume: Some(Resume::Auto),
            ..quiet()
        },
    )
    .unwrap()
}

fn run_dir_error(r: mixprec::Result<mixprec::train::RunSummary>) -> String {
    match r {
        Err(e @ Error::RunDirectory { .. }) => e.to_string(),
        other => panic!("expected a run-directory error, got {other:?}"),
    }
}

/// Re-running into a used directory is refused and changes nothing; `overwrite` starts over
/// (the earlier run's epoch checkpoints go); a directory with other files is refused too.
#[test]
fn rerunning_into_a_used_directory_is_refused() {
    let dir = tempdir("rerun");
    let cfg = quick(dir.join("run"), 2);
    run(&cfg, &quiet()).unwrap();
    let before = std::fs::read(cfg.out.join("metrics.csv")).unwrap();
    let msg = run_dir_error(run(&quick(cfg.out.clone(), 1), &quiet()));
    assert!(
        msg.contains("not empty") && msg.contains("--resume auto") && msg.contains("--overwrite"),
        "{msg}"
    );
    assert_eq!(std::fs::read(cfg.out.join("metrics.csv")).unwrap(), before);
    assert!(cfg.out.join("checkpoints/epoch-002.safetensors").is_file());

    let again = run(
        &quick(cfg.out.clone(), 1),
        &RunOptions {
            overwrite: true,
            ..quiet()
        },
    )
    .unwrap();
    assert_eq!(again.history.len(), 1);
    assert!(!cfg.out.join("checkpoints/epoch-002.safetensors").exists());
    let csv = std::fs::read_to_string(cfg.out.join("metrics.csv")).unwrap();
    assert_eq!(csv.lines().count(), 2, "{csv}");

    // Somebody else's files: refused, and left alone.
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.txt"), "mine").unwrap();
    let msg = run_dir_error(run(&quick(other.clone(), 1), &quiet()));
    assert!(msg.contains("notes.txt"), "{msg}");
    assert_eq!(
        std::fs::read_to_string(other.join("notes.txt")).unwrap(),
        "mine"
    );
}

/// Two runs on one directory: the second is refused while the first holds the lock, naming
/// it; a lock left by a killed process is taken over.
#[test]
fn two_runs_on_one_directory_the_second_is_refused() {
    use mixprec::train::run_dir::{RunDir, Use, LOCK_FILE};
    let dir = tempdir("lock").join("run");
    let first = RunDir::open(&dir, Use::Fresh { overwrite: false }).unwrap();
    let msg = run_dir_error(run(&quick(dir.clone(), 1), &quiet()));
    assert!(
        msg.contains("in use by another run")
            && msg.contains(&format!("pid {}", std::process::id())),
        "{msg}"
    );
    // Even with --overwrite or a resume.
    let msg = run_dir_error(run(
        &quick(dir.clone(), 1),
        &RunOptions {
            overwrite: true,
            resume: Some(Resume::Auto),
            ..quiet()
        },
    ));
    assert!(msg.contains("in use"), "{msg}");
    drop(first);
    // A clean end leaves an empty lock file.
    assert_eq!(std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap(), "");

    // The lock file of a process that was killed (its lock went with it; its note stays).
    std::fs::write(
        dir.join(LOCK_FILE),
        "pid 4000000 on elsewhere since 0 (unix time)",
    )
    .unwrap();
    let s = run(&quick(dir.clone(), 1), &quiet()).unwrap();
    assert_eq!(s.history.len(), 1);
}

/// `Resume::Auto` starts a run when there is no checkpoint, continues from the newest that
/// verifies (skipping a corrupt `last`), and ends with the uninterrupted run's numbers, bit for
/// bit; an explicit older checkpoint, with newer ones beside it, needs `overwrite`.
#[test]
fn resume_auto_continues_from_the_newest_verified_checkpoint() {
    let dir = tempdir("auto");
    let full = run(&quick(dir.join("full"), 3), &quiet()).unwrap();
    let cfg = quick(dir.join("split"), 3);
    let auto = |stop: Option<usize>| {
        run(
            &cfg,
            &RunOptions {
                resume: Some(Resume::Auto),
                stop_after: stop,
                ..quiet()
            },
        )
    };
    assert_eq!(auto(Some(1)).unwrap().history.len(), 1);
    assert_eq!(auto(Some(2)).unwrap().history.len(), 2);
    // Flip a byte of `last` (epoch 2): epoch-002 holds the same state and is taken.
    let last = cfg.out.join("checkpoints/last.safetensors");
    let mut b = std::fs::read(&last).unwrap();
    let n = b.len();
    b[n - 5] ^= 1;
    std::fs::write(&last, b).unwrap();
    let resumed = auto(None).unwrap();
    assert_eq!(resumed.history.len(), 3);
    assert_same_losses("resumed", &full, &resumed);
    assert_eq!(
        std::fs::read(full.weights.unwrap()).unwrap(),
        std::fs::read(resumed.weights.unwrap()).unwrap()
    );

    // From epoch 1 while epochs 2 and 3 are there: refused, then allowed with overwrite.
    let older = Resume::From(cfg.out.join("checkpoints/epoch-001.safetensors"));
    let msg = run_dir_error(run(
        &cfg,
        &RunOptions {
            resume: Some(older.clone()),
            ..quiet()
        },
    ));
    assert!(msg.contains("newer") && msg.contains("epoch-003"), "{msg}");
    let again = run(
        &cfg,
        &RunOptions {
            resume: Some(older),
            overwrite: true,
            stop_after: Some(2),
            ..quiet()
        },
    )
    .unwrap();
    assert_eq!(again.history.len(), 2);
    assert!(!cfg.out.join("checkpoints/epoch-003.safetensors").exists());
}

/// A run killed after its last checkpoint but before its final weights (the window the kill
/// test in crash.rs hits at random): resuming it trains nothing and writes the weights the
/// uninterrupted run wrote, byte for byte.
#[test]
fn resuming_a_run_that_died_before_its_final_weights_writes_them() {
    let dir = tempdir("final-weights");
    let cfg = quick(dir.join("run"), 2);
    let done = run(&cfg, &quiet()).unwrap();
    let w = done.weights.unwrap();
    let want = std::fs::read(&w).unwrap();
    std::fs::remove_file(&w).unwrap();
    let resumed = resume_auto(&cfg);
    assert_eq!(resumed.history.len(), 2, "nothing left to train");
    assert_eq!(resumed.weights.as_deref(), Some(w.as_path()));
    assert_eq!(std::fs::read(&w).unwrap(), want, "the weights differ");
    assert!(resumed.written.contains(&"model.safetensors".into()));
    // Once they are there, a resume that trains nothing leaves them alone.
    let again = resume_auto(&cfg);
    assert!(again.weights.is_none(), "{:?}", again.written);
    assert!(!again.written.contains(&"model.safetensors".into()));
}

/// A run killed inside its last epoch's saves leaves half-written temporary files that no
/// later write of the resumed run replaces (it has nothing left to train): opening the run
/// directory removes those of processes that are gone, and leaves a live process's alone.
#[test]
fn resuming_removes_the_temporary_files_of_a_killed_save() {
    let dir = tempdir("killed-save");
    let cfg = quick(dir.join("run"), 2);
    run(&cfg, &quiet()).unwrap();
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    gone.wait().unwrap();
    let (gone, me) = (gone.id(), std::process::id());
    let ckpt = cfg.out.join("checkpoints");
    let killed = [
        ckpt.join(format!(".epoch-002.safetensors.tmp-{gone}-5")),
        cfg.out.join(format!(".model.safetensors.tmp-{gone}-7")),
    ];
    let live = ckpt.join(format!(".epoch-002.safetensors.tmp-{me}-999"));
    for f in killed.iter().chain([&live]) {
        std::fs::write(f, b"half a checkpoint").unwrap();
    }
    let resumed = resume_auto(&cfg);
    assert_eq!(resumed.history.len(), 2, "nothing left to train");
    for f in &killed {
        assert!(!f.exists(), "{} is still there", f.display());
    }
    assert!(live.exists(), "a live process's file was removed");
}

/// config.toml records the data the run used (never `auto`) and the device it was given (`auto`
/// stays: the same settings then resume under any number of processes), and a run that trains
/// nothing (`stop_after` 0) reports only the files it wrote.
#[test]
fn the_record_says_what_was_used_and_what_was_written() {
    let dir = tempdir("record");
    let mut cfg = quick(dir.join("run"), 1);
    cfg.device = "auto".into();
    cfg.data.dir = "auto".into();
    let s = run(
        &cfg,
        &RunOptions {
            stop_after: Some(0),
            ..quiet()
        },
    )
    .unwrap();
    assert!(s.history.is_empty());
    assert_eq!(s.last_checkpoint, None);
    assert_eq!(s.weights, None);
    let written: Vec<String> = s.written.iter().map(|p| p.display().to_string()).collect();
    assert_eq!(written, ["config.toml", "metrics.csv", "metrics.jsonl"]);
    assert!(!cfg.out.join("model.safetensors").exists());
    let recorded = RunConfig::from_toml_file(cfg.out.join("config.toml")).unwrap();
    assert_eq!(recorded.device, "auto");
    assert_ne!(recorded.data.dir, "auto");
    if s.device == mixprec::Device::Cpu && std::env::var_os("FASHION_MNIST_DIR").is_none() {
        // On a CPU `auto` is the bundled subset, whatever is installed.
        assert_eq!(recorded.data.dir, "bundled");
        assert!(s.data.contains("subset"), "{}", s.data);
    }
}

/// A run whose steps all overflow stops with an error naming the last good checkpoint (a
/// learning rate of 1000 after a good first epoch), instead of "training" on to a NaN loss.
#[test]
fn a_diverging_run_stops_with_an_error() {
    let dir = tempdir("diverge");
    let mut cfg = quick(dir.join("run"), 10);
    cfg.data.train_limit = 512;
    cfg.divergence_steps = 6;
    run(
        &cfg,
        &RunOptions {
            stop_after: Some(1),
            ..quiet()
        },
    )
    .unwrap();
    cfg.optimizer.lr = 1000.0;
    cfg.schedule.kind = "constant".into();
    let good = cfg.out.join("checkpoints/epoch-001.safetensors");
    let e = run(
        &cfg,
        &RunOptions {
            resume: Some(Resume::From(good.clone())),
            ..quiet()
        },
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Diverged { .. }), "{msg}");
    // How many epochs the blown-up weights survive before every step overflows depends on
    // rounding (a changed summation order moved it by two): the error names the last epoch
    // checkpoint written before the skipped steps, whichever that is, and it exists.
    assert!(msg.contains("skipped for a non-finite loss"), "{msg}");
    let named = msg
        .split("The last checkpoint from before it: ")
        .nth(1)
        .and_then(|rest| rest.split(" (epoch").next())
        .unwrap_or_else(|| panic!("no checkpoint named: {msg}"));
    assert!(named.contains("checkpoints/epoch-"), "{msg}");
    assert!(std::path::Path::new(named).exists(), "{msg}");
    // Limit 0: never stops (the run ends, with a NaN loss).
    cfg.divergence_steps = 0;
    let s = run(
        &cfg,
        &RunOptions {
            resume: Some(Resume::From(good)),
            overwrite: true,
            ..quiet()
        },
    )
    .unwrap();
    assert!(s
        .history
        .iter()
        .any(|r| !r.train_loss.is_finite() || r.skipped_steps > 0));
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
    assert_same_losses("png vs idx", &idx, &png);
    for (a, b) in idx.history.iter().zip(&png.history) {
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
    assert!(
        summary.weights.as_ref().unwrap().is_file()
            && summary.last_checkpoint.as_ref().unwrap().is_file()
    );
    let saved = std::fs::read_to_string(c.out.join("config.toml")).unwrap();
    assert!(
        saved.contains("resnet18") && saved.contains("imagefolder:"),
        "{saved}"
    );
}

/// `model.memory_format = "channels_last"` (the GPU's default; forced here on the CPU): the run
/// trains as the contiguous one does (the same values in another layout), writes weights in
/// torchvision's logical (NCHW) order, and resumes exactly.
#[test]
fn a_channels_last_run_trains_saves_and_resumes_like_a_contiguous_one() {
    let dir = tempdir("channels-last");
    let cfg = |out: &str, format: &str| {
        let mut c = quick(dir.join(out), 2);
        c.model.memory_format = format.into();
        c
    };
    let nchw = run(&cfg("nchw", "contiguous"), &quiet()).unwrap();
    let cl_cfg = cfg("cl", "channels_last");
    let cl = run(&cl_cfg, &quiet()).unwrap();
    for (a, b) in nchw.history.iter().zip(&cl.history) {
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-5 * x.abs().max(1.0);
        assert!(
            close(a.train_loss, b.train_loss) && close(a.test_loss, b.test_loss),
            "epoch {}: {a:?} vs {b:?}",
            a.epoch
        );
    }
    let weights = |s: &mixprec::train::RunSummary| {
        mixprec::io::safetensors::read(s.weights.as_ref().unwrap())
            .unwrap()
            .0
    };
    let (wa, wb) = (weights(&nchw), weights(&cl));
    assert_eq!(wa.len(), wb.len());
    for ((na, ta), (nb, tb)) in wa.iter().zip(&wb) {
        assert_eq!((na, ta.dims()), (nb, tb.dims()));
        if ta.dtype() != mixprec::DType::F32 {
            continue;
        }
        let (va, vb) = (ta.to_vec::<f32>().unwrap(), tb.to_vec::<f32>().unwrap());
        let worst = va
            .iter()
            .zip(&vb)
            .map(|(x, y)| (x - y).abs() / x.abs().max(1e-2))
            .fold(0f32, f32::max);
        assert!(
            worst < 1e-3,
            "{na}: values differ by {worst} (a permuted layout?)"
        );
    }
    // Interrupted after epoch 1 and resumed: the uninterrupted channels_last run, bit for bit.
    let split_cfg = cfg("cl-split", "channels_last");
    run(
        &split_cfg,
        &RunOptions {
            stop_after: Some(1),
            ..quiet()
        },
    )
    .unwrap();
    let resumed = resume_auto(&split_cfg);
    assert_same_losses("channels_last resumed", &cl, &resumed);
}
