//! The `Dataset` trait: indexed image/label pairs that a `DataLoader` batches.
//!
//! The trait is write-into rather than return-a-Vec so that a loader assembles a batch straight
//! into the batch buffer: no allocation per item, one `memcpy`-sized pass per image.

use std::sync::Arc;

use crate::error::{Error, Result};

/// Shape of one item's image: channels, height, width (the `[C, H, W]` of a `[B, C, H, W]`
/// batch).
pub type ItemShape = [usize; 3];

/// Images with class labels, addressable by index, shareable across threads (a loader reads
/// from its prefetch thread).
pub trait Dataset: Send + Sync {
    /// Number of items.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `[C, H, W]` of every image.
    fn item_shape(&self) -> ItemShape;

    /// Number of classes; labels are in `0..num_classes()`.
    fn num_classes(&self) -> usize;

    /// Writes image `index` (CHW, f32, already normalised) into `out`, whose length must be
    /// `C*H*W`, and returns its label. An index past the end or a wrong `out` length is an
    /// `Error`, never a panic.
    fn read_into(&self, index: usize, out: &mut [f32]) -> Result<i64>;

    /// Like `read_into`, as served in epoch `epoch`: datasets that draw each item afresh every
    /// epoch (random crops of image files) take their draws from the epoch and the index. The
    /// default ignores the epoch. Loaders call this one.
    fn read_item(&self, epoch: usize, index: usize, out: &mut [f32]) -> Result<i64> {
        let _ = epoch;
        self.read_into(index, out)
    }

    /// The value that stands for "no signal" in this dataset's (normalised) images: what zero
    /// padding pads with. A dataset normalised with `(x - mean) / std` pads with `-mean / std`,
    /// the normalised black pixel, as padding before normalising (torchvision's order) would.
    fn pad_value(&self) -> f32 {
        0.0
    }

    /// `pad_value` per channel, for datasets normalised per channel (CIFAR-10, ImageNet-style
    /// folders); the default repeats `pad_value`.
    fn pad_values(&self) -> Vec<f32> {
        vec![self.pad_value(); self.item_shape()[0]]
    }

    /// Image `index` as an owned CHW vector and its label (convenient, allocates; loaders use
    /// `read_into`).
    fn get(&self, index: usize) -> Result<(Vec<f32>, i64)> {
        let [c, h, w] = self.item_shape();
        let mut v = vec![0.0; c * h * w];
        let label = self.read_into(index, &mut v)?;
        Ok((v, label))
    }
}

impl<D: Dataset + ?Sized> Dataset for Arc<D> {
    fn len(&self) -> usize {
        (**self).len()
    }
    fn item_shape(&self) -> ItemShape {
        (**self).item_shape()
    }
    fn num_classes(&self) -> usize {
        (**self).num_classes()
    }
    fn read_into(&self, index: usize, out: &mut [f32]) -> Result<i64> {
        (**self).read_into(index, out)
    }
    fn read_item(&self, epoch: usize, index: usize, out: &mut [f32]) -> Result<i64> {
        (**self).read_item(epoch, index, out)
    }
    fn pad_value(&self) -> f32 {
        (**self).pad_value()
    }
    fn pad_values(&self) -> Vec<f32> {
        (**self).pad_values()
    }
}

impl<D: Dataset + ?Sized> Dataset for Box<D> {
    fn len(&self) -> usize {
        (**self).len()
    }
    fn item_shape(&self) -> ItemShape {
        (**self).item_shape()
    }
    fn num_classes(&self) -> usize {
        (**self).num_classes()
    }
    fn read_into(&self, index: usize, out: &mut [f32]) -> Result<i64> {
        (**self).read_into(index, out)
    }
    fn read_item(&self, epoch: usize, index: usize, out: &mut [f32]) -> Result<i64> {
        (**self).read_item(epoch, index, out)
    }
    fn pad_value(&self) -> f32 {
        (**self).pad_value()
    }
    fn pad_values(&self) -> Vec<f32> {
        (**self).pad_values()
    }
}

/// Checks the arguments of `read_into` for a dataset of `len` items of `item_elems` values;
/// for implementors.
pub fn check_read(
    op: &'static str,
    index: usize,
    len: usize,
    out_len: usize,
    item_elems: usize,
) -> Result<()> {
    if index >= len {
        return Err(Error::invalid_arg(
            op,
            "index",
            index,
            format!("the dataset has {len} items"),
        ));
    }
    if out_len != item_elems {
        return Err(Error::invalid_arg(
            op,
            "out.len()",
            out_len,
            format!("one image has {item_elems} values (C*H*W)"),
        ));
    }
    Ok(())
}

/// The first `len` items of a dataset (quick runs on part of the data).
pub struct First<D> {
    inner: D,
    len: usize,
}

impl<D: Dataset> First<D> {
    /// The first `len` items of `inner` (all of them when it has fewer).
    pub fn new(inner: D, len: usize) -> Self {
        let len = len.min(inner.len());
        First { inner, len }
    }
}

impl<D: Dataset> Dataset for First<D> {
    fn len(&self) -> usize {
        self.len
    }
    fn item_shape(&self) -> ItemShape {
        self.inner.item_shape()
    }
    fn num_classes(&self) -> usize {
        self.inner.num_classes()
    }
    fn read_into(&self, index: usize, out: &mut [f32]) -> Result<i64> {
        self.read_item(0, index, out)
    }
    fn read_item(&self, epoch: usize, index: usize, out: &mut [f32]) -> Result<i64> {
        if index >= self.len {
            return Err(Error::invalid_arg(
                "First::read_into",
                "index",
                index.to_string(),
                format!("below the subset's length {}", self.len),
            ));
        }
        self.inner.read_item(epoch, index, out)
    }
    fn pad_value(&self) -> f32 {
        self.inner.pad_value()
    }
    fn pad_values(&self) -> Vec<f32> {
        self.inner.pad_values()
    }
}
