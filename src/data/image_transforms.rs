//! torchvision's image transforms, with its semantics and defaults, for decoded 8-bit images:
//! `RandomResizedCrop`, `Resize` + `CenterCrop`, `RandomHorizontalFlip`, `ToTensor` and
//! `Normalize`, run as one fused pass per image (decode → crop and resample → flip, scale to
//! [0, 1] and normalise into the batch buffer, CHW f32).
//!
//! Semantics follow torchvision 0.2x on PIL images:
//! - `RandomResizedCrop(size, scale=(0.08, 1.0), ratio=(3/4, 4/3))`: up to 10 tries of an area
//!   fraction uniform in `scale` and a log-uniform aspect ratio; `w = round(sqrt(area·ratio))`,
//!   `h = round(sqrt(area/ratio))` (Python's round: halves to even); a fitting box gets a
//!   uniform position, else the central crop clamped to the ratio range. The box is cropped,
//!   then resampled to `size` with PIL's antialiased bilinear filter.
//! - `Resize(s)`: the shorter side to `s`, the longer to `int(s · long / short)`; `Resize((h,
//!   w))` to exactly that. `CenterCrop((h, w))`: offsets `int(round((H - h) / 2))`, zero
//!   padding where the crop is larger than the image.
//! - `RandomHorizontalFlip(p=0.5)`: mirrors the result with probability `p`.
//! - `ToTensor` + `Normalize(mean, std)`: `(x / 255 - mean) / std` in f32, per channel.
//!
//! Random draws come from Philox keyed by `(seed, epoch, dataset index)`, like
//! `data::transforms::Augment`: an item's crop and flip do not depend on the thread that
//! decodes it or the batch it lands in, so a run stays reproducible and `--resume` exact. (They
//! are not torch's generator's numbers: a torchvision run and a mixprec run pick different crops
//! with the same distributions.)
//!
//! The resample is fast_image_resize's convolution with the bilinear (triangle) filter, the
//! algorithm of PIL's `resize(..., BILINEAR)`; pixel values agree with PIL's within one level.
//! When the crop is shrunk by 2x or more, a JPEG is decoded at reduced scale first (see
//! `data::image`), which changes pixels by a few levels, as PIL's `draft` does.

use std::path::Path;

use fast_image_resize as fr;

use crate::data::image::{self, ColorMode, DecodedImage, PixelColor};
use crate::error::{Error, Result};
use crate::tensor::random::{philox4x32, SeedStream};

/// ImageNet's per-channel mean and standard deviation of RGB in [0, 1] (torchvision's).
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// Distinguishes these draws from other Philox uses of the same seed.
const VISION_TAG: u32 = 0x715_1011;

/// The random numbers of one item in one epoch.
#[derive(Clone, Debug)]
pub struct ItemRng {
    stream: SeedStream,
}

impl ItemRng {
    pub fn new(seed: u64, epoch: usize, index: usize) -> Self {
        let (e, i) = (epoch as u64, index as u64);
        let b = philox4x32(
            [
                i as u32,
                (i >> 32) as u32,
                e as u32,
                (e >> 32) as u32 ^ VISION_TAG,
            ],
            [seed as u32, (seed >> 32) as u32],
        );
        ItemRng {
            stream: SeedStream::new(((b[0] as u64) << 32) | b[1] as u64),
        }
    }

    /// Uniform in `[lo, hi)` (torch's `empty(1).uniform_(lo, hi)`).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.stream.unit()
    }

    /// Uniform integer in `[lo, hi)` (torch's `randint(lo, hi)`); `lo` when the range is empty.
    pub fn randint(&mut self, lo: i64, hi: i64) -> i64 {
        if hi <= lo {
            lo
        } else {
            lo + self.stream.below((hi - lo) as usize) as i64
        }
    }
}

/// A crop box in torchvision's terms: `top`, `left` (negative where a center crop pads),
/// `height`, `width`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CropBox {
    pub top: i64,
    pub left: i64,
    pub height: usize,
    pub width: usize,
}

/// Python's `int(round(x))`: halves go to the even neighbour.
fn py_round(x: f64) -> i64 {
    x.round_ties_even() as i64
}

/// torchvision's `RandomResizedCrop`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RandomResizedCrop {
    /// Output `(height, width)`.
    pub size: (usize, usize),
    /// Range of the crop's area as a fraction of the image's.
    pub scale: (f64, f64),
    /// Range of the crop's aspect ratio (width / height), drawn log-uniformly.
    pub ratio: (f64, f64),
}

impl RandomResizedCrop {
    /// A square output of `size` with torchvision's defaults: scale (0.08, 1), ratio (3/4, 4/3).
    pub fn new(size: usize) -> Self {
        RandomResizedCrop {
            size: (size, size),
            scale: (0.08, 1.0),
            ratio: (3.0 / 4.0, 4.0 / 3.0),
        }
    }

    /// torchvision's `get_params` for an image of `width` x `height`.
    pub fn params(&self, width: usize, height: usize, rng: &mut ItemRng) -> CropBox {
        let (wf, hf) = (width as f64, height as f64);
        let area = wf * hf;
        let (lr0, lr1) = (self.ratio.0.ln(), self.ratio.1.ln());
        for _ in 0..10 {
            let target_area = area * rng.uniform(self.scale.0, self.scale.1);
            let aspect = rng.uniform(lr0, lr1).exp();
            let w = py_round((target_area * aspect).sqrt());
            let h = py_round((target_area / aspect).sqrt());
            if 0 < w && w <= width as i64 && 0 < h && h <= height as i64 {
                let top = rng.randint(0, height as i64 - h + 1);
                let left = rng.randint(0, width as i64 - w + 1);
                return CropBox {
                    top,
                    left,
                    height: h as usize,
                    width: w as usize,
                };
            }
        }
        // Fallback: the central crop, clamped to the ratio range.
        let in_ratio = wf / hf;
        let (min_r, max_r) = (
            self.ratio.0.min(self.ratio.1),
            self.ratio.0.max(self.ratio.1),
        );
        let (w, h) = if in_ratio < min_r {
            (width as i64, py_round(wf / min_r))
        } else if in_ratio > max_r {
            (py_round(hf * max_r), height as i64)
        } else {
            (width as i64, height as i64)
        };
        CropBox {
            top: (height as i64 - h).div_euclid(2),
            left: (width as i64 - w).div_euclid(2),
            height: h.max(1) as usize,
            width: w.max(1) as usize,
        }
    }
}

/// torchvision's `Resize` target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resize {
    /// `Resize(s)`: the shorter side becomes `s`, the aspect ratio is kept.
    Shorter(usize),
    /// `Resize((h, w))`.
    Exact { height: usize, width: usize },
}

impl Resize {
    /// The output `(width, height)` for an image of `width` x `height`.
    pub fn output_size(&self, width: usize, height: usize) -> (usize, usize) {
        match *self {
            Resize::Exact {
                height: h,
                width: w,
            } => (w, h),
            Resize::Shorter(s) => {
                let (short, long) = if width <= height {
                    (width, height)
                } else {
                    (height, width)
                };
                // Python's int(): truncation of the float product.
                let new_long = ((s as f64 * long as f64 / short as f64) as usize).max(1);
                if width <= height {
                    (s, new_long)
                } else {
                    (new_long, s)
                }
            }
        }
    }
}

/// torchvision's `CenterCrop((height, width))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CenterCrop {
    pub height: usize,
    pub width: usize,
}

impl CenterCrop {
    pub fn new(size: usize) -> Self {
        CenterCrop {
            height: size,
            width: size,
        }
    }

    /// The crop of an image of `width` x `height`; a crop larger than the image has negative
    /// offsets (torchvision pads `(crop - size) // 2` before, the rest after, then crops).
    pub fn params(&self, width: usize, height: usize) -> CropBox {
        let off = |img: usize, crop: usize| -> i64 {
            if crop > img {
                -(((crop - img) / 2) as i64)
            } else {
                py_round((img - crop) as f64 / 2.0)
            }
        };
        CropBox {
            top: off(height, self.height),
            left: off(width, self.width),
            height: self.height,
            width: self.width,
        }
    }
}

/// The geometric stage of an [`ImageTransform`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Geometry {
    RandomResizedCrop(RandomResizedCrop),
    /// `Resize` then `CenterCrop` (no crop: the resized image, which then must have a fixed
    /// size, i.e. `Resize::Exact`).
    ResizeCenterCrop {
        resize: Resize,
        crop: Option<CenterCrop>,
    },
}

/// How one item is drawn: where its pixels come from and whether it is mirrored.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Plan {
    /// The source rectangle in full-size image pixels: `left, top, width, height`.
    pub src: [f64; 4],
    /// Crop first and resample only the crop (RandomResizedCrop: the filter stops at the
    /// crop's edges), or resample the whole image and cut the window (Resize + CenterCrop).
    pub crop_first: bool,
    /// The output rectangle the source maps to: `left, top, width, height`; outside it the
    /// output is zero padding (a center crop larger than the resized image).
    pub window: [usize; 4],
    pub flip: bool,
}

/// A torchvision-style pipeline for one image: geometry, optional random horizontal flip,
/// `ToTensor` and `Normalize`; its output is CHW f32 of [`ImageTransform::output_shape`].
#[derive(Clone, Debug, PartialEq)]
pub struct ImageTransform {
    pub geometry: Geometry,
    /// Probability of the horizontal flip; 0 = none.
    pub hflip: f64,
    /// Per-channel mean and std of `Normalize` (one value per output channel).
    pub mean: Vec<f32>,
    pub std: Vec<f32>,
    pub color: ColorMode,
    /// Seeds the random draws (with the epoch and the dataset index).
    pub seed: u64,
}

impl ImageTransform {
    /// ImageNet training: `RandomResizedCrop(size)`, `RandomHorizontalFlip()`, `ToTensor()`,
    /// `Normalize(IMAGENET_MEAN, IMAGENET_STD)`.
    pub fn imagenet_train(size: usize, seed: u64) -> Self {
        ImageTransform {
            geometry: Geometry::RandomResizedCrop(RandomResizedCrop::new(size)),
            hflip: 0.5,
            mean: IMAGENET_MEAN.to_vec(),
            std: IMAGENET_STD.to_vec(),
            color: ColorMode::Rgb,
            seed,
        }
    }

    /// ImageNet evaluation: `Resize(resize)`, `CenterCrop(crop)`, `ToTensor()`, `Normalize`
    /// (torchvision's reference: 256 and 224).
    pub fn imagenet_eval(resize: usize, crop: usize) -> Self {
        ImageTransform {
            geometry: Geometry::ResizeCenterCrop {
                resize: Resize::Shorter(resize),
                crop: Some(CenterCrop::new(crop)),
            },
            hflip: 0.0,
            mean: IMAGENET_MEAN.to_vec(),
            std: IMAGENET_STD.to_vec(),
            color: ColorMode::Rgb,
            seed: 0,
        }
    }

    /// Serve one grey channel (`convert("L")`) normalised with `mean`, `std`.
    pub fn grayscale(mut self, mean: f32, std: f32) -> Self {
        self.color = ColorMode::Gray;
        self.mean = vec![mean];
        self.std = vec![std];
        self
    }

    pub fn with_normalize(mut self, mean: &[f32], std: &[f32]) -> Self {
        self.mean = mean.to_vec();
        self.std = std.to_vec();
        self
    }

    pub fn with_hflip(mut self, p: f64) -> Self {
        self.hflip = p;
        self
    }

    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// `(height, width)` of every output.
    pub fn output_size(&self) -> Result<(usize, usize)> {
        match self.geometry {
            Geometry::RandomResizedCrop(r) => Ok(r.size),
            Geometry::ResizeCenterCrop { crop: Some(c), .. } => Ok((c.height, c.width)),
            Geometry::ResizeCenterCrop {
                resize: Resize::Exact { height, width },
                crop: None,
            } => Ok((height, width)),
            Geometry::ResizeCenterCrop {
                resize: Resize::Shorter(s),
                crop: None,
            } => Err(Error::invalid_arg(
                "ImageTransform",
                "geometry",
                format!("Resize({s}) without CenterCrop"),
                "a fixed output size: add a CenterCrop or resize to (height, width)",
            )),
        }
    }

    /// `[C, H, W]` of every output.
    pub fn output_shape(&self) -> Result<[usize; 3]> {
        let (h, w) = self.output_size()?;
        Ok([self.color.channels(), h, w])
    }

    /// Checks every parameter; the error names the bad one.
    pub fn check(&self) -> Result<()> {
        let op = "ImageTransform";
        let (h, w) = self.output_size()?;
        if h == 0 || w == 0 || h > 1 << 15 || w > 1 << 15 {
            return Err(Error::invalid_arg(
                op,
                "size",
                format!("({h}, {w})"),
                "each side in 1..=32768",
            ));
        }
        match self.geometry {
            Geometry::RandomResizedCrop(r) => {
                let (s0, s1) = r.scale;
                if !(s0.is_finite() && s1.is_finite() && 0.0 < s0 && s0 <= s1) {
                    return Err(Error::invalid_arg(
                        op,
                        "scale",
                        format!("({s0}, {s1})"),
                        "(min, max) with 0 < min <= max",
                    ));
                }
                let (r0, r1) = r.ratio;
                if !(r0.is_finite() && r1.is_finite() && 0.0 < r0 && r0 <= r1) {
                    return Err(Error::invalid_arg(
                        op,
                        "ratio",
                        format!("({r0}, {r1})"),
                        "(min, max) with 0 < min <= max",
                    ));
                }
            }
            Geometry::ResizeCenterCrop { resize, .. } => {
                let bad = match resize {
                    Resize::Shorter(s) => s == 0 || s > 1 << 15,
                    Resize::Exact { height, width } => {
                        height == 0 || width == 0 || height > 1 << 15 || width > 1 << 15
                    }
                };
                if bad {
                    return Err(Error::invalid_arg(
                        op,
                        "resize",
                        format!("{resize:?}"),
                        "each size in 1..=32768",
                    ));
                }
            }
        }
        if !(0.0..=1.0).contains(&self.hflip) {
            return Err(Error::invalid_arg(
                op,
                "hflip",
                self.hflip,
                "a probability in [0, 1]",
            ));
        }
        let c = self.color.channels();
        if self.mean.len() != c || self.std.len() != c {
            return Err(Error::invalid_arg(
                op,
                "mean/std",
                format!("{:?} / {:?}", self.mean, self.std),
                format!("one value per output channel ({c} for {:?})", self.color),
            ));
        }
        if self.mean.iter().chain(&self.std).any(|v| !v.is_finite())
            || self.std.iter().any(|&s| s <= 0.0)
        {
            return Err(Error::invalid_arg(
                op,
                "mean/std",
                format!("{:?} / {:?}", self.mean, self.std),
                "finite, with every std > 0",
            ));
        }
        Ok(())
    }

    /// The normalised value of a black (0) pixel in each channel: what padding becomes.
    pub fn pad_values(&self) -> Vec<f32> {
        self.mean
            .iter()
            .zip(&self.std)
            .map(|(m, s)| (0.0 - m) / s)
            .collect()
    }

    /// What item `index` of `epoch` gets from an image of `width` x `height`.
    pub fn plan(&self, epoch: usize, index: usize, width: usize, height: usize) -> Plan {
        let mut rng = ItemRng::new(self.seed, epoch, index);
        let (src, crop_first, window) = match self.geometry {
            Geometry::RandomResizedCrop(r) => {
                let b = r.params(width, height, &mut rng);
                (
                    [b.left as f64, b.top as f64, b.width as f64, b.height as f64],
                    true,
                    [0, 0, r.size.1, r.size.0],
                )
            }
            Geometry::ResizeCenterCrop { resize, crop } => {
                let (rw, rh) = resize.output_size(width, height);
                let b = crop.map(|c| c.params(rw, rh)).unwrap_or(CropBox {
                    top: 0,
                    left: 0,
                    height: rh,
                    width: rw,
                });
                // The part of the crop inside the resized image, in output and source pixels.
                let x0 = b.left.max(0) as usize;
                let y0 = b.top.max(0) as usize;
                let x1 = ((b.left + b.width as i64).min(rw as i64)).max(x0 as i64) as usize;
                let y1 = ((b.top + b.height as i64).min(rh as i64)).max(y0 as i64) as usize;
                let (sx, sy) = (width as f64 / rw as f64, height as f64 / rh as f64);
                (
                    [
                        x0 as f64 * sx,
                        y0 as f64 * sy,
                        (x1 - x0) as f64 * sx,
                        (y1 - y0) as f64 * sy,
                    ],
                    false,
                    [
                        (x0 as i64 - b.left) as usize,
                        (y0 as i64 - b.top) as usize,
                        x1 - x0,
                        y1 - y0,
                    ],
                )
            }
        };
        // torchvision: `if torch.rand(1) < p`; drawn after the crop, every time, so the crop
        // draws do not depend on whether flipping is on.
        let flip = rng.uniform(0.0, 1.0) < self.hflip;
        Plan {
            src,
            crop_first,
            window,
            flip,
        }
    }

    /// The strongest decode-time reduction (1, 2, 4 or 8) that leaves the plan's source at
    /// least as large as its output window on both axes.
    pub fn max_reduction(plan: &Plan) -> usize {
        let [_, _, sw, sh] = plan.src;
        let [_, _, ww, wh] = plan.window;
        [8usize, 4, 2]
            .into_iter()
            .find(|&r| sw / r as f64 >= ww as f64 && sh / r as f64 >= wh as f64)
            .unwrap_or(1)
    }

    /// Decodes an encoded image (`bytes`, named `path` in errors) as item `index` of `epoch`
    /// and writes the result, CHW f32 normalised, into `out` (`C*H*W` values).
    pub fn apply(
        &self,
        bytes: &[u8],
        path: &Path,
        epoch: usize,
        index: usize,
        out: &mut [f32],
        scratch: &mut TransformScratch,
    ) -> Result<()> {
        let header = image::read_header(bytes, path)?;
        let plan = self.plan(epoch, index, header.width, header.height);
        let img = image::decode(
            bytes,
            path,
            self.color,
            Self::max_reduction(&plan),
            scratch.ycbcr,
        )?;
        self.render(&img, header.width, header.height, &plan, out, scratch)
    }

    /// Draws `img` (a decode of a `full_width` x `full_height` image, possibly reduced) per
    /// `plan` into `out`.
    pub fn render(
        &self,
        img: &DecodedImage,
        full_width: usize,
        full_height: usize,
        plan: &Plan,
        out: &mut [f32],
        scratch: &mut TransformScratch,
    ) -> Result<()> {
        let [c, oh, ow] = self.output_shape()?;
        if out.len() != c * oh * ow {
            return Err(Error::invalid_arg(
                "ImageTransform::render",
                "out.len()",
                out.len(),
                format!("C*H*W = {}", c * oh * ow),
            ));
        }
        if self.mean.len() != c || self.std.len() != c {
            self.check()?;
        }
        let [wx, wy, ww, wh] = plan.window;
        let ch = img.color.channels();
        scratch.lut.fill(&self.mean, &self.std);
        // Scale the source rectangle to the decoded size (1 unless decoded reduced).
        let (kx, ky) = (
            img.width as f64 / full_width.max(1) as f64,
            img.height as f64 / full_height.max(1) as f64,
        );
        let [l, t, w, h] = plan.src;
        let src = [l * kx, t * ky, w * kx, h * ky];
        let identity = src == [0.0, 0.0, img.width as f64, img.height as f64]
            && (ww, wh) == (img.width, img.height);
        let pixels: &[u8] = if identity || ww == 0 || wh == 0 {
            &img.pixels
        } else {
            scratch.resample(img, src, plan.crop_first && (kx, ky) == (1.0, 1.0), ww, wh)?;
            &scratch.resampled
        };
        let plane = oh * ow;
        let lut = &scratch.lut.table;
        // Output columns that show the window: [x0, x0 + ww), mirrored when flipping (the flip
        // mirrors the final output, padding included).
        let x0 = if plan.flip { ow - wx - ww } else { wx };
        let row = &mut scratch.row;
        for y in 0..oh {
            let o = y * ow;
            if y < wy || y >= wy + wh || ww == 0 {
                for (k, t) in lut.iter().enumerate() {
                    out[k * plane + o..k * plane + o + ow].fill(t[0]);
                }
                continue;
            }
            let src = &pixels[(y - wy) * ww * ch..(y - wy + 1) * ww * ch];
            convert_row(src, img.color, c, row);
            for (k, t) in lut.iter().enumerate() {
                let dst = &mut out[k * plane + o..k * plane + o + ow];
                dst[..x0].fill(t[0]);
                dst[x0 + ww..].fill(t[0]);
                let win = &mut dst[x0..x0 + ww];
                let vals = row[k * ww..(k + 1) * ww].iter();
                if plan.flip {
                    for (d, &v) in win.iter_mut().rev().zip(vals) {
                        *d = t[v as usize];
                    }
                } else {
                    for (d, &v) in win.iter_mut().zip(vals) {
                        *d = t[v as usize];
                    }
                }
            }
        }
        Ok(())
    }
}

/// One row of `color` pixels (interleaved, `src.len() / channels` of them) converted to `c`
/// output channels, planar: `row[k * n + x]`.
fn convert_row(src: &[u8], color: PixelColor, c: usize, row: &mut Vec<u8>) {
    let n = src.len() / color.channels();
    row.clear();
    row.resize(n * c, 0);
    let (r0, rest) = row.split_at_mut(n);
    let (r1, r2) = rest.split_at_mut(if c == 3 { n } else { 0 });
    match (color, c) {
        (PixelColor::Luma, 1) => r0.copy_from_slice(src),
        (PixelColor::Luma, _) => {
            r0.copy_from_slice(src);
            r1.copy_from_slice(src);
            r2.copy_from_slice(src);
        }
        (PixelColor::Rgb, 1) => {
            for (d, p) in r0.iter_mut().zip(src.chunks_exact(3)) {
                *d = image::rgb_to_luma(p[0], p[1], p[2]);
            }
        }
        (PixelColor::YCbCr, 1) => {
            for (d, p) in r0.iter_mut().zip(src.chunks_exact(3)) {
                *d = p[0];
            }
        }
        (PixelColor::Rgb, _) => {
            for (i, p) in src.chunks_exact(3).enumerate() {
                (r0[i], r1[i], r2[i]) = (p[0], p[1], p[2]);
            }
        }
        (PixelColor::YCbCr, _) => {
            for (i, p) in src.chunks_exact(3).enumerate() {
                [r0[i], r1[i], r2[i]] = image::ycbcr_to_rgb(p);
            }
        }
    }
}

/// Per-thread working memory of [`ImageTransform::apply`]: the resampler (its filter
/// coefficients are cached between calls of the same geometry), the resampled pixels and the
/// normalisation tables.
pub struct TransformScratch {
    resizer: fr::Resizer,
    resampled: Vec<u8>,
    row: Vec<u8>,
    lut: Lut,
    /// Let colour JPEGs come out of the decoder as YCbCr and convert after resampling (fewer
    /// pixels to convert); on by default.
    pub ycbcr: bool,
}

impl Default for TransformScratch {
    fn default() -> Self {
        TransformScratch {
            resizer: fr::Resizer::new(),
            resampled: Vec::new(),
            row: Vec::new(),
            lut: Lut::default(),
            ycbcr: true,
        }
    }
}

impl std::fmt::Debug for TransformScratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransformScratch")
            .field("ycbcr", &self.ycbcr)
            .finish_non_exhaustive()
    }
}

/// `ToTensor` + `Normalize` as one table per channel: byte → `(b / 255 - mean) / std`, the
/// same f32 operations as torchvision's.
#[derive(Default)]
struct Lut {
    key: Vec<u32>,
    table: Vec<[f32; 256]>,
}

impl Lut {
    fn fill(&mut self, mean: &[f32], std: &[f32]) {
        let key: Vec<u32> = mean.iter().chain(std).map(|v| v.to_bits()).collect();
        if key == self.key {
            return;
        }
        self.table = mean
            .iter()
            .zip(std)
            .map(|(&m, &s)| {
                let mut t = [0f32; 256];
                for (b, v) in t.iter_mut().enumerate() {
                    *v = (b as f32 / 255.0 - m) / s;
                }
                t
            })
            .collect();
        self.key = key;
    }
}

impl TransformScratch {
    /// Resamples `src` (`left, top, width, height` in `img`'s pixels) of `img` to `ww` x `wh`
    /// into `self.resampled`, with PIL's bilinear filter. `crop_first` (an integer box) makes the
    /// filter stop at the box's edges, as resampling a cropped copy does.
    fn resample(
        &mut self,
        img: &DecodedImage,
        src: [f64; 4],
        crop_first: bool,
        ww: usize,
        wh: usize,
    ) -> Result<()> {
        let fail = |e: &dyn std::fmt::Display| Error::Unsupported {
            op: "ImageTransform: resample",
            detail: format!(
                "{}x{} {:?} image, source {src:?} to {ww}x{wh}: {e}",
                img.width, img.height, img.color
            ),
        };
        let pt = match img.color.channels() {
            1 => fr::PixelType::U8,
            _ => fr::PixelType::U8x3,
        };
        let ch = img.color.channels();
        self.resampled.clear();
        self.resampled.resize(ww * wh * ch, 0);
        let source =
            fr::images::ImageRef::new(img.width as u32, img.height as u32, &img.pixels, pt)
                .map_err(|e| fail(&e))?;
        let mut dst =
            fr::images::Image::from_slice_u8(ww as u32, wh as u32, &mut self.resampled, pt)
                .map_err(|e| fail(&e))?;
        let filter = fr::ResizeOptions::new()
            .resize_alg(fr::ResizeAlg::Convolution(fr::FilterType::Bilinear));
        let [l, t, w, h] = src;
        let integral = [l, t, w, h].iter().all(|v| v.fract() == 0.0);
        if crop_first && integral {
            let view =
                fr::images::CroppedImage::new(&source, l as u32, t as u32, w as u32, h as u32)
                    .map_err(|e| fail(&e))?;
            self.resizer
                .resize(&view, &mut dst, &filter)
                .map_err(|e| fail(&e))
        } else {
            self.resizer
                .resize(&source, &mut dst, &filter.crop(l, t, w, h))
                .map_err(|e| fail(&e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_rounding() {
        assert_eq!(py_round(0.5), 0);
        assert_eq!(py_round(1.5), 2);
        assert_eq!(py_round(2.5), 2);
        assert_eq!(py_round(2.6), 3);
    }

    #[test]
    fn item_draws_depend_on_seed_epoch_index_only() {
        let a = ItemRng::new(1, 2, 3).uniform(0.0, 1.0);
        assert_eq!(a, ItemRng::new(1, 2, 3).uniform(0.0, 1.0));
        assert_ne!(a, ItemRng::new(1, 2, 4).uniform(0.0, 1.0));
        assert_ne!(a, ItemRng::new(1, 3, 3).uniform(0.0, 1.0));
        assert_ne!(a, ItemRng::new(2, 2, 3).uniform(0.0, 1.0));
    }
}
