//! CIFAR-10 (Krizhevsky 2009): 32×32 colour images of 10 classes, 50,000 for training and
//! 10,000 for testing, in the "binary version" (`cifar-10-binary.tar.gz`): `data_batch_1.bin` …
//! `data_batch_5.bin` and `test_batch.bin`, each a run of 3,073-byte records — one label byte,
//! then the red, green and blue planes of 1,024 bytes each (rows top to bottom).
//!
//! Images are served as `[3, 32, 32]` f32 normalised per channel with `(x/255 - mean) / std`,
//! by default the training set's statistics ([`MEAN`], [`STD`]); padding for random crops is
//! each channel's normalised black, as torchvision's `RandomCrop(32, padding=4)` before
//! `Normalize` gives.

use std::path::{Path, PathBuf};

use crate::data::dataset::{check_read, Dataset, ItemShape};
use crate::data::fashion_mnist::Split;
use crate::error::{Error, Result};

/// Per-channel mean and standard deviation of the 50,000 training images scaled to [0, 1].
pub const MEAN: [f32; 3] = [0.4914, 0.4822, 0.4465];
pub const STD: [f32; 3] = [0.2470, 0.2435, 0.2616];
pub const CLASSES: usize = 10;
pub const CLASS_NAMES: [&str; CLASSES] = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
];
/// Side of an image.
pub const SIZE: usize = 32;
/// Bytes of one record: the label and three 32×32 planes.
pub const RECORD: usize = 1 + 3 * SIZE * SIZE;
/// The folder the official archive unpacks to.
pub const ARCHIVE_DIR: &str = "cifar-10-batches-bin";

/// The files of a split, in the order their records are served.
pub fn file_names(split: Split) -> Vec<String> {
    match split {
        Split::Train => (1..=5).map(|i| format!("data_batch_{i}.bin")).collect(),
        Split::Test => vec!["test_batch.bin".into()],
    }
}

/// One split of CIFAR-10 in memory (3,072 bytes per image), served normalised.
#[derive(Clone, Debug)]
pub struct Cifar10 {
    split: Split,
    /// Images as CHW planes, one after another.
    pixels: Vec<u8>,
    labels: Vec<u8>,
    luts: Box<[[f32; 256]; 3]>,
}

impl Cifar10 {
    /// Loads `split` from `dir`, which holds the `.bin` files or the `cifar-10-batches-bin`
    /// folder that holds them. A missing file is an error naming it.
    pub fn load(dir: impl AsRef<Path>, split: Split) -> Result<Cifar10> {
        let dir = dir.as_ref();
        let names = file_names(split);
        let base = if dir.join(&names[0]).is_file() || !dir.join(ARCHIVE_DIR).is_dir() {
            dir.to_path_buf()
        } else {
            dir.join(ARCHIVE_DIR)
        };
        let paths: Vec<PathBuf> = names.iter().map(|n| base.join(n)).collect();
        Self::from_files(&paths, split)
    }

    /// Loads the records of `files`, in order.
    pub fn from_files(files: &[PathBuf], split: Split) -> Result<Cifar10> {
        let mut pixels = Vec::new();
        let mut labels = Vec::new();
        for path in files {
            let bytes = std::fs::read(path).map_err(|e| {
                Error::io(
                    format!(
                        "reading CIFAR-10 {split} file {} (the binary version: {})",
                        path.display(),
                        file_names(split).join(", ")
                    ),
                    e,
                )
            })?;
            let bad = |detail: String| Error::DataFormat {
                path: path.display().to_string(),
                format: "CIFAR-10 binary",
                detail,
            };
            if bytes.is_empty() || bytes.len() % RECORD != 0 {
                return Err(bad(format!(
                    "{} bytes is not a whole number of {RECORD}-byte records (truncated, or \
                     not the binary version?)",
                    bytes.len()
                )));
            }
            for (i, rec) in bytes.chunks_exact(RECORD).enumerate() {
                if rec[0] as usize >= CLASSES {
                    return Err(bad(format!(
                        "record {i}: label {} is not a class (0..{CLASSES})",
                        rec[0]
                    )));
                }
                labels.push(rec[0]);
                pixels.extend_from_slice(&rec[1..]);
            }
        }
        let mut ds = Cifar10 {
            split,
            pixels,
            labels,
            luts: Box::new([[0.0; 256]; 3]),
        };
        ds.fill_luts(MEAN, STD);
        Ok(ds)
    }

    /// Normalises with other per-channel statistics (`([0.0; 3], [1.0; 3])` serves [0, 1]).
    pub fn with_normalization(mut self, mean: [f32; 3], std: [f32; 3]) -> Result<Cifar10> {
        if mean.iter().chain(&std).any(|v| !v.is_finite()) || std.iter().any(|&s| s <= 0.0) {
            return Err(Error::invalid_arg(
                "Cifar10::with_normalization",
                "(mean, std)",
                format!("({mean:?}, {std:?})"),
                "finite, with every std > 0",
            ));
        }
        self.fill_luts(mean, std);
        Ok(self)
    }

    fn fill_luts(&mut self, mean: [f32; 3], std: [f32; 3]) {
        for c in 0..3 {
            for (b, v) in self.luts[c].iter_mut().enumerate() {
                *v = (b as f32 / 255.0 - mean[c]) / std[c];
            }
        }
    }

    pub fn split(&self) -> Split {
        self.split
    }

    pub fn labels(&self) -> &[u8] {
        &self.labels
    }

    /// The raw CHW bytes of item `index`, or `None` past the end.
    pub fn raw_image(&self, index: usize) -> Option<&[u8]> {
        let n = RECORD - 1;
        self.pixels
            .get(index.checked_mul(n)?..index.checked_add(1)?.checked_mul(n)?)
    }
}

impl Dataset for Cifar10 {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn item_shape(&self) -> ItemShape {
        [3, SIZE, SIZE]
    }

    fn num_classes(&self) -> usize {
        CLASSES
    }

    fn read_into(&self, index: usize, out: &mut [f32]) -> Result<i64> {
        let n = RECORD - 1;
        check_read("Cifar10::read_into", index, self.len(), out.len(), n)?;
        let src = &self.pixels[index * n..(index + 1) * n];
        let plane = SIZE * SIZE;
        for c in 0..3 {
            let lut = &self.luts[c];
            for (o, &p) in out[c * plane..(c + 1) * plane]
                .iter_mut()
                .zip(&src[c * plane..(c + 1) * plane])
            {
                *o = lut[p as usize];
            }
        }
        Ok(self.labels[index] as i64)
    }

    fn pad_value(&self) -> f32 {
        self.luts[0][0]
    }

    fn pad_values(&self) -> Vec<f32> {
        self.luts.iter().map(|l| l[0]).collect()
    }
}
