//! The main job's data: which dataset `data.dir` names, its transforms and augmentation, and the
//! loaders (shuffled with the run's seed, worker threads, batches delivered on the training
//! device through pinned memory).
//!
//! | `data.dir` | train / test | images | augmentation (`data.augment`) |
//! |---|---|---|---|
//! | `auto`, `bundled`, DIR | Fashion-MNIST IDX files | 1×28×28 | random crop (pad 2) + flip |
//! | `cifar10:DIR` | `data_batch_{1..5}.bin` / `test_batch.bin` | 3×32×32 | random crop (pad 4) + flip |
//! | `imagefolder:DIR` | `DIR/train` / `DIR/val` (or `DIR/test`) | 3 (or 1) × S × S | S ≥ 64: RandomResizedCrop(S) + flip; smaller: random crop + flip |
//!
//! Image folders are evaluated (and, without augmentation, trained) on Resize(S·256/224) +
//! CenterCrop(S) at S ≥ 64 (torchvision's 256/224), Resize(S) + CenterCrop(S) below.

use std::path::{Path, PathBuf};

use crate::data::fashion_mnist::bundled_dir;
use crate::data::image_transforms::{CenterCrop, Geometry, Resize};
use crate::data::loader::default_workers;
use crate::data::{
    Augment, BadFiles, Cifar10, DataLoader, DataSource, Dataset, DistributedSampler, FashionMnist,
    First, ImageFolder, ImageTransform, Split,
};
use crate::error::{Error, Result};
use crate::tensor::Device;

use super::config::RunConfig;

/// What `data.dir` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataKind {
    /// `auto`, `bundled` or a directory of IDX files.
    FashionMnist(String),
    ImageFolder(PathBuf),
    Cifar10(PathBuf),
}

impl DataKind {
    pub fn parse(dir: &str) -> DataKind {
        if let Some(d) = dir.strip_prefix("imagefolder:") {
            DataKind::ImageFolder(d.into())
        } else if let Some(d) = dir.strip_prefix("cifar10:") {
            DataKind::Cifar10(d.into())
        } else {
            DataKind::FashionMnist(dir.into())
        }
    }
}

/// Image folders of at least this side are ImageNet-style (RandomResizedCrop, ResNet stem).
pub const LARGE_IMAGE: usize = 64;

/// The default image side of image folders.
pub const DEFAULT_IMAGE_SIZE: usize = 224;

/// Datasets and loaders of a run.
pub struct JobData {
    pub train: DataLoader,
    pub test: DataLoader,
    /// One line: where the data came from, how many images, the transforms.
    pub description: String,
    /// Where the data came from (the first part of `description`).
    pub source: String,
    /// What `data.dir` resolved to, recorded in the run's config.toml (never `auto`).
    pub dir_used: String,
    /// `[C, H, W]` of the model's input.
    pub item_shape: [usize; 3],
    pub num_classes: usize,
    /// Image folders: what a file that does not decode does (other sources have no files
    /// that can go bad).
    pub bad_files: Option<BadFiles>,
}

impl JobData {
    /// `e` with, for a file that did not read or decode, the flag that skips such files.
    pub fn explain(&self, e: Error) -> Error {
        let hint = "; to train without such files, pass --skip-bad-files \
                    (data.skip_bad_files = true)";
        match (self.bad_files, e) {
            (
                Some(BadFiles::Error),
                Error::DataFormat {
                    path,
                    format,
                    detail,
                },
            ) => Error::DataFormat {
                path,
                format,
                detail: format!("{detail}{hint}"),
            },
            (Some(BadFiles::Error), Error::Io { context, source }) => Error::Io {
                context: format!("{context}{hint}"),
                source,
            },
            (_, e) => e,
        }
    }

    /// Reads the training images that epoch `epoch` left out (the last partial batch, dropped):
    /// a file there that does not decode is reported as it would be in a batch (an error
    /// without `--skip-bad-files`, a warning with it), not only in an epoch that happens to
    /// use it.
    pub fn check_dropped(&self, epoch: usize) -> Result<()> {
        if self.bad_files.is_none() {
            return Ok(());
        }
        let used = self.train.num_batches() * self.train.batch_size();
        let order = self.train.epoch_order(epoch);
        let dataset = self.train.dataset();
        let mut image = vec![0f32; self.item_shape.iter().product()];
        for &i in order.iter().skip(used) {
            dataset
                .read_item(epoch, i, &mut image)
                .map_err(|e| self.explain(e))?;
        }
        Ok(())
    }
}

fn limited(d: impl Dataset + 'static, limit: usize) -> Box<dyn Dataset> {
    if limit > 0 && limit < d.len() {
        Box::new(First::new(d, limit))
    } else {
        Box::new(d)
    }
}

/// Fashion-MNIST's source, the value `data.dir` resolves to, and a note on the choice. `auto`
/// is `$FASHION_MNIST_DIR` when set; else, on a GPU, the full set when installed; else the
/// bundled subset, so that the main command ends in minutes on a CPU whatever is installed.
fn fashion_source(dir: &str, device: Device) -> Result<(DataSource, String, String)> {
    let bundled = || DataSource::Bundled(bundled_dir());
    Ok(match dir {
        "auto" if std::env::var_os(crate::data::fashion_mnist::ENV_VAR).is_some() => {
            let s = DataSource::locate()?;
            let key = s.dir().display().to_string();
            (s, key, String::new())
        }
        "auto" if device.is_cuda() => {
            let s = DataSource::locate()?;
            let key = if s.is_bundled() { "bundled" } else { "full" };
            (s, key.into(), String::new())
        }
        "auto" => {
            let note = match DataSource::full() {
                Ok(full) => format!(
                    " (auto on a CPU; --data full trains on the 60k images at {})",
                    full.dir().display()
                ),
                Err(_) => " (auto on a CPU)".into(),
            };
            (bundled(), "bundled".into(), note)
        }
        "bundled" => (bundled(), "bundled".into(), String::new()),
        "full" => (DataSource::full()?, "full".into(), String::new()),
        d => (DataSource::dir_given(d)?, d.into(), String::new()),
    })
}

/// The crop-and-flip padding of the small-image recipes: 2 up to 28 pixels (MNIST's), else 4
/// (CIFAR's).
fn crop_padding(side: usize) -> usize {
    if side <= 28 {
        2
    } else {
        4
    }
}

/// `DIR/val`, else `DIR/test`.
fn eval_dir(root: &Path) -> Result<PathBuf> {
    for name in ["val", "test"] {
        if root.join(name).is_dir() {
            return Ok(root.join(name));
        }
    }
    Err(Error::io(
        format!(
            "imagefolder:{}: no evaluation folder (DIR/val or DIR/test, beside DIR/train)",
            root.display()
        ),
        std::io::Error::new(std::io::ErrorKind::NotFound, "val/ and test/ not found"),
    ))
}

fn describe_geometry(g: &Geometry) -> String {
    match g {
        Geometry::RandomResizedCrop(r) => format!(
            "RandomResizedCrop({}, scale=({}, {}), ratio=({:.3}, {:.3}))",
            r.size.0, r.scale.0, r.scale.1, r.ratio.0, r.ratio.1
        ),
        Geometry::ResizeCenterCrop { resize, crop } => {
            let r = match resize {
                Resize::Shorter(s) => format!("Resize({s})"),
                Resize::Exact { height, width } => format!("Resize(({height}, {width}))"),
            };
            match crop {
                Some(c) => format!("{r} + CenterCrop({})", c.height),
                None => r,
            }
        }
    }
}

/// What a kind of data contributes before the loaders are made.
struct Chosen {
    train: Box<dyn Dataset>,
    test: Box<dyn Dataset>,
    description: String,
    augment: Option<Augment>,
    /// The default number of worker threads.
    workers: usize,
    /// What `data.dir` resolved to, and a note on why.
    dir_used: String,
    note: String,
}

/// The default worker threads for Fashion-MNIST and CIFAR-10 (images held in memory, cropped and
/// flipped per batch): two on a GPU, where a captured step of the main job's net consumes a batch
/// of 128 a little faster than one thread assembles one (benches/RESULTS.md has the figures); one
/// on the CPU, whose cores the training step needs. The batches are the same for any count.
fn small_image_workers(device: Device) -> usize {
    if device.is_cuda() {
        default_workers().saturating_sub(1).clamp(1, 2)
    } else {
        1
    }
}

/// Builds the run's datasets and loaders. `shard`: `(rank, world)` of a data-parallel run,
/// whose ranks each train on their shard of the same shuffle and evaluate on their share of
/// the test set (every test image counted once).
pub fn build(cfg: &RunConfig, device: Device, shard: Option<(usize, usize)>) -> Result<JobData> {
    let d = &cfg.data;
    let seed = cfg.seed;
    let bad_files = matches!(DataKind::parse(&d.dir), DataKind::ImageFolder(_)).then_some(
        if d.skip_bad_files {
            BadFiles::Skip
        } else {
            BadFiles::Error
        },
    );
    let Chosen {
        train,
        test,
        mut description,
        augment,
        workers,
        dir_used,
        note,
    } = match DataKind::parse(&d.dir) {
        DataKind::FashionMnist(dir) => {
            let (source, dir_used, note) = fashion_source(&dir, device)?;
            let train = FashionMnist::load_from(&source, Split::Train)?;
            let test = FashionMnist::load_from(&source, Split::Test)?;
            let aug = d.augment.then(|| Augment::crop_flip(2, seed));
            Chosen {
                train: limited(train, d.train_limit),
                test: limited(test, d.test_limit),
                description: format!("{source}"),
                augment: aug,
                workers: small_image_workers(device),
                dir_used,
                note,
            }
        }
        DataKind::Cifar10(dir) => {
            let train = Cifar10::load(&dir, Split::Train)?;
            let test = Cifar10::load(&dir, Split::Test)?;
            let aug = d.augment.then(|| Augment::crop_flip(4, seed));
            Chosen {
                train: limited(train, d.train_limit),
                test: limited(test, d.test_limit),
                description: format!("CIFAR-10 from {}", dir.display()),
                augment: aug,
                workers: small_image_workers(device),
                dir_used: d.dir.clone(),
                note: String::new(),
            }
        }
        DataKind::ImageFolder(root) => image_folder(d, &root, seed)?,
    };
    let workers = if d.workers == 0 { workers } else { d.workers };
    let source = description.clone();
    description.push_str(&format!(
        "; training on {} images, testing on {}; {workers} worker thread(s){note}",
        train.len(),
        test.len()
    ));
    let item_shape = train.item_shape();
    let num_classes = train.num_classes();
    let mut train_loader = DataLoader::new(train, d.batch_size)?
        .shuffle(seed)
        .drop_last(true)
        .workers(workers)
        .device(device)
        .prefetch(2);
    if let Some(a) = augment {
        train_loader = train_loader.augment(a);
    }
    let mut test_loader = DataLoader::new(test, d.eval_batch_size)?
        .workers(workers)
        .device(device)
        .prefetch(2);
    if let Some((rank, world)) = shard.filter(|&(_, world)| world > 1) {
        // The same shuffle on every rank, cut into shards; every test image counted once.
        train_loader = train_loader.sampler(DistributedSampler::new(rank, world)?);
        test_loader = test_loader.sampler(DistributedSampler::uneven(rank, world)?);
    }
    Ok(JobData {
        train: train_loader,
        test: test_loader,
        description,
        source,
        dir_used,
        item_shape,
        num_classes,
        bad_files,
    })
}

/// An image folder's datasets (`DIR/train`, `DIR/val` or `DIR/test`) and transforms, per the
/// table in the module doc.
fn image_folder(d: &super::config::DataConfig, root: &Path, seed: u64) -> Result<Chosen> {
    let side = if d.image_size == 0 {
        DEFAULT_IMAGE_SIZE
    } else {
        d.image_size
    };
    let bad = if d.skip_bad_files {
        BadFiles::Skip
    } else {
        BadFiles::Error
    };
    let large = side >= LARGE_IMAGE;
    let eval_geometry = Geometry::ResizeCenterCrop {
        resize: Resize::Shorter(if large {
            (side as f64 * 256.0 / 224.0).round() as usize
        } else {
            side
        }),
        crop: Some(CenterCrop::new(side)),
    };
    let mut eval = ImageTransform::imagenet_eval(side, side);
    eval.geometry = eval_geometry;
    if !d.mean.is_empty() {
        let m: Vec<f32> = d.mean.iter().map(|&v| v as f32).collect();
        let s: Vec<f32> = d.std.iter().map(|&v| v as f32).collect();
        eval = eval.with_normalize(&m, &s);
    }
    if d.grayscale {
        eval.color = crate::data::ColorMode::Gray;
        if d.mean.is_empty() {
            // ImageNet's statistics through PIL's luma weights.
            eval.mean = vec![0.449];
            eval.std = vec![0.226];
        }
    }
    let train_t = if large && d.augment {
        ImageTransform {
            geometry: ImageTransform::imagenet_train(side, seed).geometry,
            hflip: 0.5,
            seed,
            ..eval.clone()
        }
    } else {
        eval.clone()
    };
    let aug = (!large && d.augment).then(|| Augment::crop_flip(crop_padding(side), seed));
    let train_dir = root.join("train");
    let train_folder = ImageFolder::with_bad_files(&train_dir, bad)?;
    let test_folder = ImageFolder::with_bad_files(eval_dir(root)?, bad)?;
    if test_folder.classes() != train_folder.classes() {
        return Err(Error::DataFormat {
            path: root.display().to_string(),
            format: "ImageFolder",
            detail: format!(
                "train/ has classes {:?}, the evaluation folder {:?}: they must match",
                head(train_folder.classes()),
                head(test_folder.classes())
            ),
        });
    }
    let mut text = format!(
        "ImageFolder {} ({} classes); train: {}{}{}; eval: {}; {}",
        root.display(),
        train_folder.classes().len(),
        describe_geometry(&train_t.geometry),
        if train_t.hflip > 0.0 {
            " + RandomHorizontalFlip"
        } else {
            ""
        },
        if aug.is_some() {
            " + random crop/flip"
        } else {
            ""
        },
        describe_geometry(&eval.geometry),
        if d.grayscale { "grey" } else { "RGB" },
    );
    let skipped = train_folder.left_out().len() + test_folder.left_out().len();
    if skipped > 0 {
        text.push_str(&format!("; {skipped} file(s) left out"));
    }
    let workers = default_workers().saturating_sub(1).max(1);
    Ok(Chosen {
        train: limited(train_folder.with_transform(train_t)?, d.train_limit),
        test: limited(test_folder.with_transform(eval)?, d.test_limit),
        description: text,
        augment: aug,
        workers,
        dir_used: d.dir.clone(),
        note: String::new(),
    })
}

fn head(v: &[String]) -> Vec<&String> {
    v.iter().take(5).collect()
}
