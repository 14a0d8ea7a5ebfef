//! Training-set augmentation: random crop with zero padding and random horizontal flip (the
//! standard CIFAR/Fashion-MNIST recipe: pad by 2–4, crop back to the original size at a random
//! offset, mirror half of the images).
//!
//! Randomness is counter-based (Philox): the crop offset and the flip of an item depend only on
//! `(seed, epoch, dataset index)`. So the augmentation of an epoch is the same whether it runs in
//! a prefetch thread or not, in whatever batch order, and a resumed run sees the same images.

use crate::data::dataset::ItemShape;
use crate::error::{Error, Result};
use crate::tensor::random::philox4x32;

/// Distinguishes augmentation draws from other Philox uses of the same seed.
const AUGMENT_TAG: u32 = 0xa06_3e47;

/// Which augmentations a loader applies to each training image, and their seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Augment {
    /// Zero padding on each side before the random crop back to the original size; 0 = no crop.
    pub crop_padding: usize,
    /// Mirror left–right with probability 1/2.
    pub hflip: bool,
    pub seed: u64,
}

/// What `Augment` decided for one item (exposed for tests and for reproducing an image).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AugmentDraw {
    /// Crop offset in the padded image, each in `0..=2*crop_padding`; `(p, p)` is no shift.
    pub dy: usize,
    pub dx: usize,
    pub flip: bool,
}

impl Augment {
    /// No augmentation yet; add some with `random_crop` / `random_hflip`.
    pub fn new(seed: u64) -> Self {
        Augment {
            crop_padding: 0,
            hflip: false,
            seed,
        }
    }

    /// The usual recipe: pad by `padding` (2 or 4 for 28×28 / 32×32 images), random crop,
    /// random horizontal flip.
    pub fn crop_flip(padding: usize, seed: u64) -> Self {
        Augment::new(seed).random_crop(padding).random_hflip()
    }

    pub fn random_crop(mut self, padding: usize) -> Self {
        self.crop_padding = padding;
        self
    }

    pub fn random_hflip(mut self) -> Self {
        self.hflip = true;
        self
    }

    /// True when applying it changes nothing.
    pub fn is_identity(&self) -> bool {
        self.crop_padding == 0 && !self.hflip
    }

    /// The crop offset and flip for item `index` in `epoch`.
    pub fn draw(&self, epoch: usize, index: usize) -> AugmentDraw {
        let (e, i) = (epoch as u64, index as u64);
        let b = philox4x32(
            [
                i as u32,
                (i >> 32) as u32,
                e as u32,
                (e >> 32) as u32 ^ AUGMENT_TAG,
            ],
            [self.seed as u32, (self.seed >> 32) as u32],
        );
        let span = (self.crop_padding as u64)
            .saturating_mul(2)
            .saturating_add(1);
        AugmentDraw {
            dy: (b[0] as u64 % span) as usize,
            dx: (b[1] as u64 % span) as usize,
            flip: self.hflip && (b[2] & 1) == 1,
        }
    }

    /// Checks that the augmentation fits images of `shape`.
    pub fn check(&self, shape: ItemShape) -> Result<()> {
        let [_, h, w] = shape;
        if self.crop_padding > h.max(w) {
            return Err(Error::invalid_arg(
                "Augment",
                "crop_padding",
                self.crop_padding,
                format!("at most the image size ({h}×{w})"),
            ));
        }
        Ok(())
    }

    /// Augments `img` (CHW, `shape`) in place as item `index` of `epoch`; padding pixels get
    /// `pad_value`. `scratch` is reused between calls to avoid allocating per image.
    pub fn apply(
        &self,
        epoch: usize,
        index: usize,
        img: &mut [f32],
        shape: ItemShape,
        pad_value: f32,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        self.apply_padded(epoch, index, img, shape, &[pad_value], scratch)
    }

    /// `apply` with a pad value per channel (`pad_values[c]`; a single value serves every
    /// channel): datasets normalised per channel pad each with its normalised black.
    pub fn apply_padded(
        &self,
        epoch: usize,
        index: usize,
        img: &mut [f32],
        shape: ItemShape,
        pad_values: &[f32],
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        self.check(shape)?;
        if pad_values.is_empty() {
            return Err(Error::invalid_arg(
                "Augment::apply",
                "pad_values",
                "[]",
                "one value, or one per channel",
            ));
        }
        let [c, h, w] = shape;
        if Some(img.len()) != c.checked_mul(h).and_then(|v| v.checked_mul(w)) {
            return Err(Error::invalid_arg(
                "Augment::apply",
                "img.len()",
                img.len(),
                format!("shape {shape:?} has C*H*W values"),
            ));
        }
        let d = self.draw(epoch, index);
        let p = self.crop_padding;
        if d.dy == p && d.dx == p && !d.flip {
            return Ok(());
        }
        scratch.clear();
        scratch.extend_from_slice(img);
        // Output pixel (y, x) comes from source pixel (y + dy - p, x + dx - p) of the crop, read
        // mirrored when flipping: out[y][x] = crop[y][w-1-x].
        let sx0 = d.dx as isize - p as isize; // source column of crop column 0
                                              // Crop columns whose source column is inside the image: xs in [x_lo, x_hi).
        let x_lo = (-sx0).clamp(0, w as isize) as usize;
        let x_hi = (w as isize - sx0).clamp(0, w as isize) as usize;
        for ch in 0..c {
            let pad_value = pad_values[ch.min(pad_values.len() - 1)];
            let src_plane = &scratch[ch * h * w..(ch + 1) * h * w];
            let dst_plane = &mut img[ch * h * w..(ch + 1) * h * w];
            for y in 0..h {
                let sy = y as isize + d.dy as isize - p as isize;
                let dst = &mut dst_plane[y * w..(y + 1) * w];
                if sy < 0 || sy >= h as isize || x_lo >= x_hi {
                    dst.fill(pad_value);
                    continue;
                }
                let src_row = &src_plane[sy as usize * w..(sy as usize + 1) * w];
                let src = &src_row[(x_lo as isize + sx0) as usize..(x_hi as isize + sx0) as usize];
                if d.flip {
                    // crop column x lands at output column w-1-x.
                    dst[..w - x_hi].fill(pad_value);
                    dst[w - x_lo..].fill(pad_value);
                    for (o, v) in dst[w - x_hi..w - x_lo].iter_mut().zip(src.iter().rev()) {
                        *o = *v;
                    }
                } else {
                    dst[..x_lo].fill(pad_value);
                    dst[x_hi..].fill(pad_value);
                    dst[x_lo..x_hi].copy_from_slice(src);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Straightforward reference: pad, crop, flip.
    fn reference(
        img: &[f32],
        [c, h, w]: ItemShape,
        d: AugmentDraw,
        p: usize,
        fill: f32,
    ) -> Vec<f32> {
        let mut out = vec![0.0; img.len()];
        for ch in 0..c {
            for y in 0..h {
                for x in 0..w {
                    let cx = if d.flip { w - 1 - x } else { x };
                    let sy = y as isize + d.dy as isize - p as isize;
                    let sx = cx as isize + d.dx as isize - p as isize;
                    out[ch * h * w + y * w + x] =
                        if sy < 0 || sx < 0 || sy >= h as isize || sx >= w as isize {
                            fill
                        } else {
                            img[ch * h * w + sy as usize * w + sx as usize]
                        };
                }
            }
        }
        out
    }

    #[test]
    fn matches_reference() {
        let shape = [2, 5, 7];
        let img: Vec<f32> = (0..70).map(|v| v as f32).collect();
        for p in [0, 1, 2, 4, 7] {
            let aug = Augment::crop_flip(p, 11);
            let mut scratch = Vec::new();
            for i in 0..200 {
                let mut x = img.clone();
                aug.apply(3, i, &mut x, shape, -1.0, &mut scratch).unwrap();
                assert_eq!(
                    x,
                    reference(&img, shape, aug.draw(3, i), p, -1.0),
                    "p {p} i {i}"
                );
            }
        }
    }

    #[test]
    fn draws_cover_offsets_and_flips() {
        let aug = Augment::crop_flip(2, 5);
        let draws: Vec<_> = (0..1000).map(|i| aug.draw(0, i)).collect();
        for off in 0..=4 {
            assert!(draws.iter().any(|d| d.dy == off));
            assert!(draws.iter().any(|d| d.dx == off));
        }
        let flips = draws.iter().filter(|d| d.flip).count();
        assert!((400..600).contains(&flips), "{flips}");
    }
}
