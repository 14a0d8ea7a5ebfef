//! A synthetic image-classification dataset of any shape, for benchmarks and tests: no files,
//! reproducible from a seed, cheap to read, and learnable (each class has its own pattern).
//!
//! Item `i` has label `philox(seed, i) % classes` and image `prototype[label] + noise[i % P]`,
//! where the `classes` prototypes and the `P = min(len, 256)` noise images are drawn once, at
//! construction, from N(0, 1) and N(0, noise_std²). Memory is `(classes + P) · C·H·W` floats
//! whatever `len` is, and reading an item is one fused add.

use crate::data::dataset::{check_read, Dataset, ItemShape};
use crate::error::{Error, Result};
use crate::tensor::random::{normal, philox4x32, SeedStream};

const NOISE_POOL: usize = 256;
const LABEL_TAG: u32 = 0x1abe_1000;

#[derive(Clone, Debug)]
pub struct SyntheticDataset {
    len: usize,
    shape: ItemShape,
    classes: usize,
    seed: u64,
    prototypes: Vec<f32>,
    noise: Vec<f32>,
}

impl SyntheticDataset {
    /// `len` items of `shape` (`[C, H, W]`) in `classes` classes, noise std 1.
    pub fn new(len: usize, shape: ItemShape, classes: usize, seed: u64) -> Result<Self> {
        Self::with_noise(len, shape, classes, seed, 1.0)
    }

    /// Like `new` with the noise standard deviation given (0 gives exactly the class
    /// prototypes; larger values make the task harder).
    pub fn with_noise(
        len: usize,
        shape: ItemShape,
        classes: usize,
        seed: u64,
        noise_std: f32,
    ) -> Result<Self> {
        let op = "SyntheticDataset::new";
        if shape.contains(&0) {
            return Err(Error::invalid_arg(
                op,
                "shape",
                format!("{shape:?}"),
                "every dimension at least 1",
            ));
        }
        if classes == 0 || classes > i64::MAX as usize {
            return Err(Error::invalid_arg(op, "classes", classes, "at least 1"));
        }
        if !(noise_std.is_finite() && noise_std >= 0.0) {
            return Err(Error::invalid_arg(
                op,
                "noise_std",
                noise_std,
                "finite and >= 0",
            ));
        }
        let item = shape[0]
            .checked_mul(shape[1])
            .and_then(|v| v.checked_mul(shape[2]))
            .filter(|&v| v <= (1 << 28))
            .ok_or_else(|| {
                Error::invalid_arg(
                    op,
                    "shape",
                    format!("{shape:?}"),
                    "at most 2^28 values per image",
                )
            })?;
        if classes.checked_mul(item).is_none_or(|v| v > (1 << 28)) {
            return Err(Error::invalid_arg(
                op,
                "classes",
                classes,
                format!("at most 2^28 prototype values in all ({item} per class)"),
            ));
        }
        let mut seeds = SeedStream::new(seed);
        let prototypes = normal(seeds.next_seed(), classes * item, 0.0, 1.0)
            .into_iter()
            .map(|v| v as f32)
            .collect();
        let pool = len.clamp(1, NOISE_POOL);
        let noise = normal(seeds.next_seed(), pool * item, 0.0, noise_std as f64)
            .into_iter()
            .map(|v| v as f32)
            .collect();
        Ok(SyntheticDataset {
            len,
            shape,
            classes,
            seed,
            prototypes,
            noise,
        })
    }

    /// The label of item `index` (without reading its image).
    pub fn label(&self, index: usize) -> i64 {
        let i = index as u64;
        let b = philox4x32(
            [i as u32, (i >> 32) as u32, LABEL_TAG, 0],
            [self.seed as u32, (self.seed >> 32) as u32],
        );
        ((((b[0] as u64) << 32) | b[1] as u64) % self.classes as u64) as i64
    }
}

impl Dataset for SyntheticDataset {
    fn len(&self) -> usize {
        self.len
    }

    fn item_shape(&self) -> ItemShape {
        self.shape
    }

    fn num_classes(&self) -> usize {
        self.classes
    }

    fn read_into(&self, index: usize, out: &mut [f32]) -> Result<i64> {
        let item = self.shape.iter().product::<usize>();
        check_read(
            "SyntheticDataset::read_into",
            index,
            self.len,
            out.len(),
            item,
        )?;
        let label = self.label(index);
        let proto = &self.prototypes[label as usize * item..(label as usize + 1) * item];
        let n = index % (self.noise.len() / item);
        let noise = &self.noise[n * item..(n + 1) * item];
        for ((o, p), z) in out.iter_mut().zip(proto).zip(noise) {
            *o = p + z;
        }
        Ok(label)
    }
}
