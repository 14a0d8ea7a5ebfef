//! `ImageFolder`: images stored one folder per class (`root/dog/xxx.jpg`, `root/cat/123.png`),
//! indexed exactly as torchvision's `datasets.ImageFolder` indexes them, so labels and sample
//! order match a PyTorch run on the same tree:
//! - classes are the sub-directories of `root` (symbolic links followed, hidden ones included),
//!   sorted by name; class `i` is the `i`-th name;
//! - a class's samples are found by walking its directory recursively (links followed), the
//!   directories in sorted order of their paths, the files of each in sorted order of their
//!   names; a file is a sample when its name ends, in any case, with one of torchvision's image
//!   extensions;
//! - a class with no sample, or a root with no class, is an error (torchvision's
//!   `FileNotFoundError`).
//!
//! mixprec decodes JPEG and PNG (sniffed from the bytes). A sample with another of torchvision's
//! extensions (`.bmp`, `.webp`, `.tif`, ...) is an error at construction that names it, or, with
//! [`BadFiles::Skip`], is left out and counted. A file that does not read or decode is an error
//! naming it when it is read; with `BadFiles::Skip` the next readable sample (in dataset order)
//! is served in its place, logged once per file and counted (`skipped_files`).
//!
//! [`ImageFolder::with_transform`] pairs the folder with an [`ImageTransform`] and gives a
//! [`Dataset`] for a `DataLoader`: every read decodes the file and draws its crop and flip from
//! `(seed, epoch, index)`.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::data::dataset::{check_read, Dataset, ItemShape};
use crate::data::image::{self, ColorMode, DecodedImage};
use crate::data::image_transforms::{ImageTransform, TransformScratch};
use crate::error::{Error, Result};

/// torchvision's `IMG_EXTENSIONS`: the file names `ImageFolder` takes as samples.
pub const IMAGE_EXTENSIONS: [&str; 9] = [
    ".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp",
];
/// The ones mixprec decodes.
pub const DECODED_EXTENSIONS: [&str; 3] = [".jpg", ".jpeg", ".png"];

/// What to do with a sample that mixprec cannot use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BadFiles {
    /// Fail, naming the file (the default).
    #[default]
    Error,
    /// Leave it out (at construction) or serve the next readable sample in its place (at
    /// read time), and count it.
    Skip,
}

/// One sample: the file and its class index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    pub path: PathBuf,
    pub class: usize,
}

/// The sample list of a class-per-folder tree; see the module documentation.
#[derive(Clone, Debug)]
pub struct ImageFolder {
    root: PathBuf,
    classes: Vec<String>,
    samples: Vec<Sample>,
    bad_files: BadFiles,
    /// Samples left out at construction (extensions mixprec does not decode).
    left_out: Vec<PathBuf>,
}

fn io_err(context: String, e: std::io::Error) -> Error {
    Error::io(context, e)
}

fn has_extension(name: &str, exts: &[&str]) -> bool {
    let lower = name.to_lowercase();
    exts.iter().any(|e| lower.ends_with(e))
}

/// Byte order of the path's text, which is Python's string order for UTF-8 names.
fn sort_key(p: &Path) -> Vec<u8> {
    p.as_os_str().as_encoded_bytes().to_vec()
}

/// `os.walk(dir, followlinks=True)` sorted by directory path: each directory with its file
/// names (anything that is not a directory), sorted. A link back to a directory being walked
/// (which would make os.walk loop forever) is skipped with a warning.
fn walk(dir: &Path) -> Result<Vec<(PathBuf, Vec<String>)>> {
    let mut out = Vec::new();
    let mut ancestors = HashSet::new();
    walk_into(dir, &mut ancestors, &mut out)?;
    out.sort_by_key(|(d, _)| sort_key(d));
    Ok(out)
}

fn walk_into(
    dir: &Path,
    ancestors: &mut HashSet<PathBuf>,
    out: &mut Vec<(PathBuf, Vec<String>)>,
) -> Result<()> {
    let canon = std::fs::canonicalize(dir)
        .map_err(|e| io_err(format!("ImageFolder: resolving {}", dir.display()), e))?;
    if !ancestors.insert(canon.clone()) {
        log::warn!(
            "ImageFolder: {} links back to a directory above it; not followed",
            dir.display()
        );
        return Ok(());
    }
    let entries = std::fs::read_dir(dir)
        .map_err(|e| io_err(format!("ImageFolder: listing {}", dir.display()), e))?;
    let mut files = Vec::new();
    let mut subdirs = Vec::new();
    for entry in entries {
        let entry =
            entry.map_err(|e| io_err(format!("ImageFolder: listing {}", dir.display()), e))?;
        let path = entry.path();
        // is_dir follows links, as os.walk(followlinks=True) does; a broken link is a file.
        if path.is_dir() {
            subdirs.push(path);
        } else {
            files.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    files.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    out.push((dir.to_path_buf(), files));
    for d in subdirs {
        walk_into(&d, ancestors, out)?;
    }
    ancestors.remove(&canon);
    Ok(())
}

impl ImageFolder {
    /// Scans `root`; an unsupported sample is an error ([`BadFiles::Error`]).
    pub fn new(root: impl AsRef<Path>) -> Result<ImageFolder> {
        Self::with_bad_files(root, BadFiles::Error)
    }

    /// Scans `root` with the given policy for unusable files.
    pub fn with_bad_files(root: impl AsRef<Path>, bad_files: BadFiles) -> Result<ImageFolder> {
        let root = root.as_ref().to_path_buf();
        let entries = std::fs::read_dir(&root).map_err(|e| {
            io_err(
                format!("ImageFolder: reading the root directory {}", root.display()),
                e,
            )
        })?;
        let mut classes = Vec::new();
        for entry in entries {
            let entry =
                entry.map_err(|e| io_err(format!("ImageFolder: listing {}", root.display()), e))?;
            if entry.path().is_dir() {
                classes.push(entry.file_name());
            }
        }
        classes.sort_by(|a, b| a.as_encoded_bytes().cmp(b.as_encoded_bytes()));
        if classes.is_empty() {
            return Err(Error::DataFormat {
                path: root.display().to_string(),
                format: "ImageFolder",
                detail: "no class folder: the root must hold one sub-directory per class".into(),
            });
        }
        let mut samples = Vec::new();
        let mut left_out = Vec::new();
        let mut empty = Vec::new();
        for (class, name) in classes.iter().enumerate() {
            let before = samples.len() + left_out.len();
            for (dir, files) in walk(&root.join(name))? {
                for f in files {
                    if !has_extension(&f, &IMAGE_EXTENSIONS) {
                        continue;
                    }
                    let path = dir.join(&f);
                    if has_extension(&f, &DECODED_EXTENSIONS) {
                        samples.push(Sample { path, class });
                    } else {
                        left_out.push(path);
                    }
                }
            }
            if samples.len() + left_out.len() == before {
                empty.push(name.to_string_lossy().into_owned());
            }
        }
        if !empty.is_empty() {
            return Err(Error::DataFormat {
                path: root.display().to_string(),
                format: "ImageFolder",
                detail: format!(
                    "no image file for the class(es) {} (extensions: {})",
                    empty.join(", "),
                    IMAGE_EXTENSIONS.join(" ")
                ),
            });
        }
        if !left_out.is_empty() {
            let first: Vec<String> = left_out
                .iter()
                .take(3)
                .map(|p| p.display().to_string())
                .collect();
            let msg = format!(
                "{} file(s) in a format mixprec does not decode (it decodes {}): {}{}",
                left_out.len(),
                DECODED_EXTENSIONS.join(" "),
                first.join(", "),
                if left_out.len() > 3 { ", ..." } else { "" }
            );
            match bad_files {
                BadFiles::Error => {
                    return Err(Error::DataFormat {
                        path: root.display().to_string(),
                        format: "ImageFolder",
                        detail: format!("{msg}; convert them, or skip them (BadFiles::Skip)"),
                    })
                }
                BadFiles::Skip => log::warn!("ImageFolder {}: skipping {msg}", root.display()),
            }
        }
        Ok(ImageFolder {
            root,
            classes: classes
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect(),
            samples,
            bad_files,
            left_out,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Class names, by index (torchvision's `classes`).
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// Name → index (torchvision's `class_to_idx`).
    pub fn class_to_idx(&self) -> BTreeMap<String, usize> {
        self.classes
            .iter()
            .enumerate()
            .map(|(i, c)| (c.clone(), i))
            .collect()
    }

    /// Every sample in dataset order (torchvision's `samples`).
    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// The class of every sample (torchvision's `targets`).
    pub fn targets(&self) -> Vec<usize> {
        self.samples.iter().map(|s| s.class).collect()
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    pub fn bad_files(&self) -> BadFiles {
        self.bad_files
    }

    /// Samples left out at construction (formats mixprec does not decode, with
    /// `BadFiles::Skip`).
    pub fn left_out(&self) -> &[PathBuf] {
        &self.left_out
    }

    /// The bytes of sample `index`'s file.
    pub fn read(&self, index: usize) -> Result<Vec<u8>> {
        let s = self.sample(index)?;
        std::fs::read(&s.path).map_err(|e| io_err(format!("reading {}", s.path.display()), e))
    }

    fn sample(&self, index: usize) -> Result<&Sample> {
        self.samples.get(index).ok_or_else(|| {
            Error::invalid_arg(
                "ImageFolder",
                "index",
                index,
                format!("the folder has {} samples", self.samples.len()),
            )
        })
    }

    /// Sample `index` decoded at full size in `mode`, with its class: torchvision's default
    /// loader (`Image.open(path).convert("RGB")` or `"L"`). Grey files come back as one channel
    /// in either mode.
    pub fn load(&self, index: usize, mode: ColorMode) -> Result<(DecodedImage, usize)> {
        let s = self.sample(index)?;
        let bytes = self.read(index)?;
        Ok((image::decode(&bytes, &s.path, mode, 1, false)?, s.class))
    }

    /// A dataset serving every sample through `transform`.
    pub fn with_transform(self, transform: ImageTransform) -> Result<ImageFolderDataset> {
        transform.check()?;
        let shape = transform.output_shape()?;
        if shape.iter().product::<usize>() > 1 << 28 {
            return Err(Error::invalid_arg(
                "ImageFolder::with_transform",
                "output size",
                format!("{shape:?}"),
                "at most 2^28 values per image",
            ));
        }
        let pads = transform.pad_values();
        Ok(ImageFolderDataset {
            folder: self,
            transform,
            shape,
            pads,
            skipped: Mutex::new(BTreeMap::new()),
        })
    }
}

thread_local! {
    /// Each loader thread's resampler and buffers.
    static SCRATCH: std::cell::RefCell<TransformScratch> = Default::default();
}

/// An [`ImageFolder`] read through an [`ImageTransform`]: a [`Dataset`] of `[C, H, W]` f32
/// images, decoded when read.
#[derive(Debug)]
pub struct ImageFolderDataset {
    folder: ImageFolder,
    transform: ImageTransform,
    shape: ItemShape,
    pads: Vec<f32>,
    /// Samples that failed to read, with the error (with `BadFiles::Skip`).
    skipped: Mutex<BTreeMap<usize, String>>,
}

impl ImageFolderDataset {
    pub fn folder(&self) -> &ImageFolder {
        &self.folder
    }

    pub fn transform(&self) -> &ImageTransform {
        &self.transform
    }

    /// Samples that could not be read and were replaced (with `BadFiles::Skip`), with why.
    pub fn skipped_files(&self) -> Vec<(PathBuf, String)> {
        self.skipped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(&i, why)| (self.folder.samples[i].path.clone(), why.clone()))
            .collect()
    }

    fn decode_into(&self, epoch: usize, index: usize, out: &mut [f32]) -> Result<()> {
        let bytes = self.folder.read(index)?;
        let path = &self.folder.samples[index].path;
        SCRATCH.with(|s| {
            let mut s = s.try_borrow_mut().map_err(|_| Error::Unsupported {
                op: "ImageFolderDataset::read_item",
                detail: "re-entered on the same thread".into(),
            })?;
            self.transform
                .apply(&bytes, path, epoch, index, out, &mut s)
        })
    }
}

impl Dataset for ImageFolderDataset {
    fn len(&self) -> usize {
        self.folder.len()
    }

    fn item_shape(&self) -> ItemShape {
        self.shape
    }

    fn num_classes(&self) -> usize {
        self.folder.classes.len()
    }

    fn read_into(&self, index: usize, out: &mut [f32]) -> Result<i64> {
        self.read_item(0, index, out)
    }

    fn read_item(&self, epoch: usize, index: usize, out: &mut [f32]) -> Result<i64> {
        let n = self.len();
        check_read(
            "ImageFolderDataset::read_item",
            index,
            n,
            out.len(),
            self.shape.iter().product(),
        )?;
        let none_readable = |first: &str| Error::DataFormat {
            path: self.folder.root.display().to_string(),
            format: "ImageFolder",
            detail: format!("none of the {n} files could be read; the first error: {first}"),
        };
        let mut i = index;
        loop {
            if self.folder.bad_files == BadFiles::Skip {
                let skipped = self.skipped.lock().unwrap_or_else(|p| p.into_inner());
                if skipped.len() >= n {
                    let first = skipped.values().next().cloned().unwrap_or_default();
                    return Err(none_readable(&first));
                }
                if skipped.contains_key(&i) {
                    i = (i + 1) % n;
                    continue;
                }
            }
            match self.decode_into(epoch, i, out) {
                Ok(()) => return Ok(self.folder.samples[i].class as i64),
                Err(e) if self.folder.bad_files == BadFiles::Error => return Err(e),
                Err(e) => {
                    let mut skipped = self.skipped.lock().unwrap_or_else(|p| p.into_inner());
                    if skipped.insert(i, e.to_string()).is_none() {
                        log::warn!(
                            "ImageFolder: skipping an unreadable file ({} so far): {e}",
                            skipped.len()
                        );
                    }
                    i = (i + 1) % n;
                }
            }
        }
    }

    fn pad_value(&self) -> f32 {
        self.pads[0]
    }

    fn pad_values(&self) -> Vec<f32> {
        self.pads.clone()
    }
}
