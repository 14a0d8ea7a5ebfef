//! Fashion-MNIST (Xiao, Rasul, Vollgraf 2017; © Zalando SE, MIT licence): 28×28 grey-scale
//! images of 10 clothing classes, 60,000 for training and 10,000 for testing, as IDX files.
//!
//! Each file is `NAME.gz` (as distributed) or the uncompressed `NAME`, whichever is there (the
//! reader tells gzip from raw IDX by the first bytes). Where the files are looked for, first
//! found wins:
//! 1. the directory in the `FASHION_MNIST_DIR` environment variable (an error if the files are
//!    not there: a user who names a directory means it);
//! 2. `/usr/share/datasets/fashion-mnist` (Debian's `dataset-fashion-mnist` package);
//! 3. the subset bundled with this repository, `data/fashion-mnist-subset/` (the first 10,000
//!    training and first 2,000 test images of the official files), so examples and tests run
//!    on a machine with nothing installed.
//!
//! Images are served as `[1, 28, 28]` f32 normalised with `(x/255 - 0.2860) / 0.3530`.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::data::dataset::{check_read, Dataset, ItemShape};
use crate::data::idx;
use crate::error::{Error, Result};

/// Mean and standard deviation of the Fashion-MNIST training pixels scaled to [0, 1], over all
/// 60,000 training images (47,040,000 pixels) of the official `train-images-idx3-ubyte.gz`:
/// 0.28604 and 0.35302, rounded to the four places usually quoted for the dataset.
/// `examples/make_fashion_mnist_subset.rs` recomputes and prints them from the official file.
pub const MEAN: f32 = 0.2860;
pub const STD: f32 = 0.3530;

/// The environment variable naming a directory that holds the four Fashion-MNIST files.
pub const ENV_VAR: &str = "FASHION_MNIST_DIR";
/// Where Debian's `dataset-fashion-mnist` package installs the files.
pub const SYSTEM_DIR: &str = "/usr/share/datasets/fashion-mnist";
/// Number of classes.
pub const CLASSES: usize = 10;
/// Class names, by label.
pub const CLASS_NAMES: [&str; CLASSES] = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
];

/// The bundled subset, relative to the crate root.
pub fn bundled_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/fashion-mnist-subset")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    Train,
    Test,
}

impl Split {
    /// File names of the split's images and labels (gzip'd IDX, the official names).
    pub fn file_names(self) -> (&'static str, &'static str) {
        match self {
            Split::Train => ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
            Split::Test => ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
        }
    }

    /// The split's images and labels files in `dir`, each `NAME.gz` or the uncompressed
    /// `NAME`; the error names the first one found in neither form.
    pub fn files_in(self, dir: &Path) -> std::result::Result<(PathBuf, PathBuf), PathBuf> {
        let (i, l) = self.file_names();
        Ok((find_file(dir, i)?, find_file(dir, l)?))
    }
}

/// `dir/NAME.gz`, else `dir/NAME` (`gz_name` is the `.gz` form); `Err` is the path not found.
fn find_file(dir: &Path, gz_name: &str) -> std::result::Result<PathBuf, PathBuf> {
    let gz = dir.join(gz_name);
    if gz.is_file() {
        return Ok(gz);
    }
    let raw = dir.join(gz_name.trim_end_matches(".gz"));
    if raw.is_file() {
        Ok(raw)
    } else {
        Err(dir.join(format!("{}[.gz]", gz_name.trim_end_matches(".gz"))))
    }
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Split::Train => "train",
            Split::Test => "test",
        })
    }
}

/// Which copy of Fashion-MNIST was found, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataSource {
    /// The directory named by `FASHION_MNIST_DIR`.
    Env(PathBuf),
    /// The full dataset at the system location (`/usr/share/datasets/fashion-mnist`).
    Full(PathBuf),
    /// The subset bundled with the repository (10,000 train / 2,000 test images).
    Bundled(PathBuf),
    /// A directory named by the user (`train_resnet --data DIR`).
    Dir(PathBuf),
}

impl DataSource {
    /// Finds the data: `FASHION_MNIST_DIR`, else the system directory, else the bundled subset.
    pub fn locate() -> Result<DataSource> {
        if let Some(dir) = std::env::var_os(ENV_VAR).filter(|v| !v.is_empty()) {
            let dir = PathBuf::from(dir);
            if let Some(missing) = first_missing(&dir) {
                return Err(Error::io(
                    format!(
                        "{ENV_VAR}={} does not hold the Fashion-MNIST files",
                        dir.display()
                    ),
                    std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        format!("{} not found", missing.display()),
                    ),
                ));
            }
            return Ok(DataSource::Env(dir));
        }
        let system = PathBuf::from(SYSTEM_DIR);
        if first_missing(&system).is_none() {
            return Ok(DataSource::Full(system));
        }
        let bundled = bundled_dir();
        match first_missing(&bundled) {
            None => Ok(DataSource::Bundled(bundled)),
            Some(missing) => Err(Error::io(
                format!(
                    "Fashion-MNIST not found: set {ENV_VAR}, install Debian's dataset-fashion-mnist \
                     ({SYSTEM_DIR}), or restore the bundled subset"
                ),
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("{} not found", missing.display()),
                ),
            )),
        }
    }

    /// The full set: `$FASHION_MNIST_DIR` when set, else the system location; an error saying
    /// how to install it when it is not there.
    pub fn full() -> Result<DataSource> {
        if std::env::var_os(ENV_VAR).is_some_and(|v| !v.is_empty()) {
            return Self::locate();
        }
        let system = PathBuf::from(SYSTEM_DIR);
        match first_missing(&system) {
            None => Ok(DataSource::Full(system)),
            Some(missing) => Err(Error::io(
                format!(
                    "the full Fashion-MNIST is not installed at {SYSTEM_DIR} (Debian: apt-get \
                     install dataset-fashion-mnist)"
                ),
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("{} not found", missing.display()),
                ),
            )),
        }
    }

    /// A directory the user named; an error naming the first file it lacks.
    pub fn dir_given(dir: impl Into<PathBuf>) -> Result<DataSource> {
        let dir = dir.into();
        match first_missing(&dir) {
            None => Ok(DataSource::Dir(dir)),
            Some(missing) => Err(Error::io(
                format!("{} does not hold the Fashion-MNIST files", dir.display()),
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("{} not found", missing.display()),
                ),
            )),
        }
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        match self {
            DataSource::Env(p)
            | DataSource::Full(p)
            | DataSource::Bundled(p)
            | DataSource::Dir(p) => p,
        }
    }

    pub fn is_bundled(&self) -> bool {
        matches!(self, DataSource::Bundled(_))
    }
}

impl fmt::Display for DataSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataSource::Env(p) => write!(f, "Fashion-MNIST from {ENV_VAR}={}", p.display()),
            DataSource::Full(p) => write!(f, "full Fashion-MNIST at {}", p.display()),
            DataSource::Bundled(p) => write!(
                f,
                "bundled Fashion-MNIST subset (10,000 train / 2,000 test images) at {}",
                p.display()
            ),
            DataSource::Dir(p) => write!(f, "Fashion-MNIST from {}", p.display()),
        }
    }
}

fn first_missing(dir: &Path) -> Option<PathBuf> {
    [Split::Train, Split::Test]
        .iter()
        .find_map(|s| s.files_in(dir).err())
}

/// One split of Fashion-MNIST in memory (as bytes: 784 B per image), served normalised.
#[derive(Clone, Debug)]
pub struct FashionMnist {
    split: Split,
    rows: usize,
    cols: usize,
    pixels: Vec<u8>,
    labels: Vec<u8>,
    /// byte → normalised value, so converting a pixel is one table load.
    lut: Box<[f32; 256]>,
    mean: f32,
    std: f32,
}

impl FashionMnist {
    /// Locates the data (see the module documentation) and loads `split`; returns the source
    /// too, so the other split can be loaded from the same place with `load_from`.
    pub fn load(split: Split) -> Result<(FashionMnist, DataSource)> {
        let source = DataSource::locate()?;
        let ds = Self::load_from(&source, split)?;
        Ok((ds, source))
    }

    /// Loads `split` from `source`.
    pub fn load_from(source: &DataSource, split: Split) -> Result<FashionMnist> {
        Self::load_dir(source.dir(), split)
    }

    /// Loads `split` from the official file names in `dir` (each gzip'd or not).
    pub fn load_dir(dir: impl AsRef<Path>, split: Split) -> Result<FashionMnist> {
        let (i, l) = split.files_in(dir.as_ref()).map_err(|missing| {
            Error::io(
                format!("loading the Fashion-MNIST {split} split"),
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("{} not found", missing.display()),
                ),
            )
        })?;
        Self::from_files(i, l, split)
    }

    /// Loads an images file and a labels file (IDX, gzip'd or raw) and checks that they agree.
    pub fn from_files(
        images: impl AsRef<Path>,
        labels: impl AsRef<Path>,
        split: Split,
    ) -> Result<FashionMnist> {
        let (ipath, lpath) = (images.as_ref(), labels.as_ref());
        let imgs = idx::read_images(ipath)?;
        let labs = idx::read_labels(lpath)?;
        if imgs.count == 0 {
            return Err(Error::DataFormat {
                path: ipath.display().to_string(),
                format: "IDX",
                detail: "the file holds 0 images (a valid header with no items): nothing to \
                         train or test on"
                    .into(),
            });
        }
        if imgs.count != labs.len() {
            return Err(Error::DataFormat {
                path: lpath.display().to_string(),
                format: "IDX",
                detail: format!(
                    "{} labels for the {} images of {}",
                    labs.len(),
                    imgs.count,
                    ipath.display()
                ),
            });
        }
        if let Some((i, &l)) = labs
            .iter()
            .enumerate()
            .find(|(_, &l)| l as usize >= CLASSES)
        {
            return Err(Error::DataFormat {
                path: lpath.display().to_string(),
                format: "IDX",
                detail: format!("label {l} of item {i} is not a class (0..{CLASSES})"),
            });
        }
        let mut ds = FashionMnist {
            split,
            rows: imgs.rows,
            cols: imgs.cols,
            pixels: imgs.pixels,
            labels: labs,
            lut: Box::new([0.0; 256]),
            mean: MEAN,
            std: STD,
        };
        ds.fill_lut();
        Ok(ds)
    }

    /// Normalises with `(x/255 - mean) / std` instead of the Fashion-MNIST statistics
    /// (`with_normalization(0.0, 1.0)` serves raw pixels in [0, 1]).
    pub fn with_normalization(mut self, mean: f32, std: f32) -> Result<FashionMnist> {
        if !(mean.is_finite() && std.is_finite() && std > 0.0) {
            return Err(Error::invalid_arg(
                "FashionMnist::with_normalization",
                "(mean, std)",
                format!("({mean}, {std})"),
                "finite, with std > 0",
            ));
        }
        self.mean = mean;
        self.std = std;
        self.fill_lut();
        Ok(self)
    }

    fn fill_lut(&mut self) {
        for (b, v) in self.lut.iter_mut().enumerate() {
            *v = (b as f32 / 255.0 - self.mean) / self.std;
        }
    }

    pub fn split(&self) -> Split {
        self.split
    }

    /// The label bytes, item by item.
    pub fn labels(&self) -> &[u8] {
        &self.labels
    }

    /// The raw pixels of item `index` (`rows*cols` bytes), or `None` past the end.
    pub fn raw_image(&self, index: usize) -> Option<&[u8]> {
        let n = self.rows * self.cols;
        self.pixels
            .get(index.checked_mul(n)?..index.checked_add(1)?.checked_mul(n)?)
    }
}

impl Dataset for FashionMnist {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn item_shape(&self) -> ItemShape {
        [1, self.rows, self.cols]
    }

    fn num_classes(&self) -> usize {
        CLASSES
    }

    fn read_into(&self, index: usize, out: &mut [f32]) -> Result<i64> {
        let n = self.rows * self.cols;
        check_read("FashionMnist::read_into", index, self.len(), out.len(), n)?;
        let src = &self.pixels[index * n..(index + 1) * n];
        for (o, &p) in out.iter_mut().zip(src) {
            *o = self.lut[p as usize];
        }
        Ok(self.labels[index] as i64)
    }

    fn pad_value(&self) -> f32 {
        self.lut[0]
    }
}
