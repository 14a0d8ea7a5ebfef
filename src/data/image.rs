//! Decoding JPEG and PNG files into 8-bit pixels, as torchvision's default loader sees them
//! (PIL's `Image.open(path).convert("RGB")`, or `.convert("L")` for grey-scale models).
//!
//! - The format is sniffed from the bytes, not the file name (as PIL does).
//! - JPEG: zune-jpeg decodes at full size (RGB, grey or CMYK files; CMYK is converted to RGB).
//!   When the caller allows it (`max_reduction` > 1, because its crop will be shrunk by at least
//!   that much), jpeg-decoder decodes at 1/2, 1/4 or 1/8 of the size straight from the DCT
//!   coefficients, as libjpeg-turbo's scaled decoding and PIL's `draft` do: the smaller image
//!   costs less to reconstruct and to resample.
//! - PNG: the png crate, every colour type and depth reduced to 8 bits (16-bit samples keep their
//!   high byte); alpha is dropped as `convert("RGB")` drops it.
//! - A file that is not JPEG or PNG, is truncated or corrupt, or would decode to more pixels than
//!   PIL allows (its decompression-bomb limit), is an `Error::DataFormat` naming the file; a
//!   decoder that panics on a hostile file is caught and reported the same way.
//! - EXIF orientation is ignored, as PIL's `open` and torchvision ignore it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;

use crate::error::{Error, Result};

/// The most pixels one image may have: PIL's `MAX_IMAGE_PIXELS` doubled, past which PIL refuses
/// to open a file (a decompression bomb).
pub const MAX_PIXELS: u64 = 2 * 89_478_485;

/// The encodings this module decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageFormat {
    Jpeg,
    Png,
}

impl ImageFormat {
    /// The format of a file, from its first bytes; `None` when it is neither JPEG nor PNG.
    pub fn sniff(bytes: &[u8]) -> Option<ImageFormat> {
        if bytes.starts_with(&[0xff, 0xd8, 0xff]) {
            Some(ImageFormat::Jpeg)
        } else if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
            Some(ImageFormat::Png)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ImageFormat::Jpeg => "JPEG",
            ImageFormat::Png => "PNG",
        }
    }
}

/// What the pixels of a decoded image are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PixelColor {
    /// One grey value per pixel.
    Luma,
    /// Interleaved R, G, B.
    Rgb,
    /// Interleaved JPEG (JFIF) Y, Cb, Cr: what a colour JPEG holds before its colour
    /// conversion. Resampling is linear and the conversion is affine, so a pipeline may resample
    /// first and convert the (smaller) result.
    YCbCr,
}

impl PixelColor {
    pub fn channels(self) -> usize {
        match self {
            PixelColor::Luma => 1,
            PixelColor::Rgb | PixelColor::YCbCr => 3,
        }
    }
}

/// The colour a dataset serves: torchvision's `convert("RGB")` (3 channels) or `convert("L")`
/// (1 channel).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ColorMode {
    Rgb,
    Gray,
}

impl ColorMode {
    pub fn channels(self) -> usize {
        match self {
            ColorMode::Rgb => 3,
            ColorMode::Gray => 1,
        }
    }
}

/// An 8-bit decoded image, interleaved, row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodedImage {
    pub width: usize,
    pub height: usize,
    pub color: PixelColor,
    pub pixels: Vec<u8>,
}

impl DecodedImage {
    /// `pixels` must hold `width * height * color.channels()` bytes.
    pub fn new(width: usize, height: usize, color: PixelColor, pixels: Vec<u8>) -> Result<Self> {
        if width == 0
            || height == 0
            || Some(pixels.len())
                != width
                    .checked_mul(height)
                    .and_then(|n| n.checked_mul(color.channels()))
        {
            return Err(Error::invalid_arg(
                "DecodedImage::new",
                "pixels.len()",
                pixels.len(),
                format!(
                    "{width}x{height} {color:?} pixels, each side at least 1 ({} bytes)",
                    width * height * color.channels()
                ),
            ));
        }
        Ok(DecodedImage {
            width,
            height,
            color,
            pixels,
        })
    }

    /// Converts to what `mode` serves without changing the size: grey for `Gray` (PIL's
    /// `convert("L")` weights), RGB for `Rgb` (grey is kept as it is: consumers replicate it).
    pub fn into_mode(self, mode: ColorMode) -> DecodedImage {
        match (mode, self.color) {
            (ColorMode::Gray, PixelColor::Luma) | (ColorMode::Rgb, PixelColor::Luma) => self,
            (ColorMode::Rgb, PixelColor::Rgb) => self,
            (ColorMode::Rgb, PixelColor::YCbCr) => DecodedImage {
                pixels: self.pixels.chunks_exact(3).flat_map(ycbcr_to_rgb).collect(),
                color: PixelColor::Rgb,
                ..self
            },
            (ColorMode::Gray, PixelColor::Rgb) => DecodedImage {
                pixels: self
                    .pixels
                    .chunks_exact(3)
                    .map(|p| rgb_to_luma(p[0], p[1], p[2]))
                    .collect(),
                color: PixelColor::Luma,
                ..self
            },
            // Y is the luma.
            (ColorMode::Gray, PixelColor::YCbCr) => DecodedImage {
                pixels: self.pixels.chunks_exact(3).map(|p| p[0]).collect(),
                color: PixelColor::Luma,
                ..self
            },
        }
    }
}

/// PIL's RGB → L: `L = R*299/1000 + G*587/1000 + B*114/1000`, in its 16-bit fixed point.
pub fn rgb_to_luma(r: u8, g: u8, b: u8) -> u8 {
    ((r as u32 * 19595 + g as u32 * 38470 + b as u32 * 7471 + 0x8000) >> 16) as u8
}

/// JFIF's YCbCr → RGB (ITU-R BT.601, full range), rounded and clamped to 8 bits.
pub fn ycbcr_to_rgb(p: &[u8]) -> [u8; 3] {
    let (y, cb, cr) = (p[0] as f32, p[1] as f32 - 128.0, p[2] as f32 - 128.0);
    let q = |v: f32| (v + 0.5).clamp(0.0, 255.0) as u8;
    [
        q(y + 1.402 * cr),
        q(y - 0.344_136 * cb - 0.714_136 * cr),
        q(y + 1.772 * cb),
    ]
}

/// What a file's header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageHeader {
    pub format: ImageFormat,
    pub width: usize,
    pub height: usize,
}

fn bad(path: &Path, format: &'static str, detail: impl Into<String>) -> Error {
    Error::DataFormat {
        path: path.display().to_string(),
        format,
        detail: detail.into(),
    }
}

/// Runs a decoder, turning a panic inside it into an error about `path`.
fn guarded<T>(path: &Path, format: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(bad(path, format, format!("the decoder failed: {msg}")))
    })
}

fn zune_options(out: ColorSpace) -> DecoderOptions {
    DecoderOptions::new_fast()
        .jpeg_set_out_colorspace(out)
        .set_max_width(u16::MAX as usize)
        .set_max_height(u16::MAX as usize)
        // Truncated or corrupt data is an error, as it is for PIL, not grey blocks.
        .set_strict_mode(true)
}

fn check_size(path: &Path, format: ImageFormat, w: usize, h: usize) -> Result<()> {
    if w == 0 || h == 0 {
        return Err(bad(path, format.name(), format!("the image is {w}x{h}")));
    }
    if (w as u64) * (h as u64) > MAX_PIXELS {
        return Err(bad(
            path,
            format.name(),
            format!("{w}x{h} is more than {MAX_PIXELS} pixels (PIL's decompression-bomb limit)"),
        ));
    }
    Ok(())
}

/// Reads the size and format from the header only.
pub fn read_header(bytes: &[u8], path: &Path) -> Result<ImageHeader> {
    let format = ImageFormat::sniff(bytes).ok_or_else(|| not_an_image(bytes, path))?;
    let (width, height) = match format {
        ImageFormat::Jpeg => guarded(path, "JPEG", || {
            let mut d = zune_jpeg::JpegDecoder::new_with_options(
                ZCursor::new(bytes),
                zune_options(ColorSpace::RGB),
            );
            d.decode_headers()
                .map_err(|e| bad(path, "JPEG", format!("{e:?}")))?;
            d.dimensions()
                .ok_or_else(|| bad(path, "JPEG", "no frame header"))
        })?,
        ImageFormat::Png => guarded(path, "PNG", || {
            let r = png::Decoder::new(std::io::Cursor::new(bytes))
                .read_info()
                .map_err(|e| bad(path, "PNG", e.to_string()))?;
            let i = r.info();
            Ok((i.width as usize, i.height as usize))
        })?,
    };
    check_size(path, format, width, height)?;
    Ok(ImageHeader {
        format,
        width,
        height,
    })
}

fn not_an_image(bytes: &[u8], path: &Path) -> Error {
    let head: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
    bad(
        path,
        "image",
        format!(
            "not a JPEG or PNG file (first bytes: {}{})",
            head.join(" "),
            if bytes.is_empty() {
                "none, the file is empty"
            } else {
                ""
            }
        ),
    )
}

/// Decodes `bytes` (a JPEG or PNG file; `path` names it in errors) for `mode`. A JPEG may come
/// back reduced by a factor `r` in {2, 4, 8}, `r <= max_reduction`, when that is cheaper: the
/// caller reads the size it got. Grey files decode to `Luma` in either mode. With
/// `allow_ycbcr`, a colour JPEG may come back as `YCbCr` for the caller to convert.
pub fn decode(
    bytes: &[u8],
    path: &Path,
    mode: ColorMode,
    max_reduction: usize,
    allow_ycbcr: bool,
) -> Result<DecodedImage> {
    match ImageFormat::sniff(bytes) {
        Some(ImageFormat::Jpeg) => guarded(path, "JPEG", || {
            decode_jpeg(bytes, path, mode, max_reduction, allow_ycbcr)
        }),
        Some(ImageFormat::Png) => {
            guarded(path, "PNG", || Ok(decode_png(bytes, path)?.into_mode(mode)))
        }
        None => Err(not_an_image(bytes, path)),
    }
}

fn decode_jpeg(
    bytes: &[u8],
    path: &Path,
    mode: ColorMode,
    max_reduction: usize,
    allow_ycbcr: bool,
) -> Result<DecodedImage> {
    let err = |e: &dyn std::fmt::Debug| bad(path, "JPEG", format!("{e:?}"));
    let mut d = zune_jpeg::JpegDecoder::new_with_options(
        ZCursor::new(bytes),
        zune_options(ColorSpace::RGB),
    );
    d.decode_headers().map_err(|e| err(&e))?;
    let (w, h) = d
        .dimensions()
        .ok_or_else(|| bad(path, "JPEG", "no frame header"))?;
    check_size(path, ImageFormat::Jpeg, w, h)?;
    let input = d.input_colorspace().unwrap_or(ColorSpace::Unknown);
    let grey_in = matches!(input, ColorSpace::Luma);
    let ycc_in = matches!(input, ColorSpace::YCbCr);
    if max_reduction >= 2 && (grey_in || ycc_in) {
        if let Some(img) = decode_jpeg_scaled(bytes, path, w, h, max_reduction)? {
            return Ok(img.into_mode(mode));
        }
    }
    // What to ask zune for: the cheapest colour that `mode` can use.
    let (out, color) = match (mode, input) {
        (_, ColorSpace::Luma) | (ColorMode::Gray, ColorSpace::YCbCr) => {
            (ColorSpace::Luma, PixelColor::Luma)
        }
        (ColorMode::Rgb, ColorSpace::YCbCr) if allow_ycbcr => {
            (ColorSpace::YCbCr, PixelColor::YCbCr)
        }
        _ => (ColorSpace::RGB, PixelColor::Rgb),
    };
    d.set_options(zune_options(out));
    let pixels = d.decode().map_err(|e| err(&e))?;
    let img = DecodedImage::new(w, h, color, pixels)?;
    // YCbCr was asked for: the caller converts after resampling.
    Ok(if color == PixelColor::YCbCr {
        img
    } else {
        img.into_mode(mode)
    })
}

/// jpeg-decoder's DCT-scaled decode at the strongest reduction `r <= max_reduction` (2, 4, 8);
/// `None` when it does not apply (an 8-bit grey or YCbCr file is needed).
fn decode_jpeg_scaled(
    bytes: &[u8],
    path: &Path,
    w: usize,
    h: usize,
    max_reduction: usize,
) -> Result<Option<DecodedImage>> {
    let r = [8usize, 4, 2]
        .into_iter()
        .find(|&r| r <= max_reduction)
        .unwrap_or(1);
    // jpeg-decoder picks the smallest of its scales (1/8, 2/8, 4/8, 8/8) whose output reaches
    // the requested size on some axis; asking for exactly the size at 8/r eighths selects it.
    let eighths = 8 / r;
    let want = |n: usize| (n * eighths).div_ceil(8).clamp(1, u16::MAX as usize) as u16;
    let mut d = jpeg_decoder::Decoder::new(bytes);
    d.read_info()
        .map_err(|e| bad(path, "JPEG", e.to_string()))?;
    let Some(info) = d.info() else {
        return Ok(None);
    };
    let color = match info.pixel_format {
        jpeg_decoder::PixelFormat::L8 => PixelColor::Luma,
        jpeg_decoder::PixelFormat::RGB24 => PixelColor::Rgb,
        _ => return Ok(None),
    };
    let (sw, sh) = d
        .scale(want(w), want(h))
        .map_err(|e| bad(path, "JPEG", e.to_string()))?;
    let pixels = d.decode().map_err(|e| bad(path, "JPEG", e.to_string()))?;
    Ok(Some(DecodedImage::new(
        sw as usize,
        sh as usize,
        color,
        pixels,
    )?))
}

fn decode_png(bytes: &[u8], path: &Path) -> Result<DecodedImage> {
    let err = |e: png::DecodingError| bad(path, "PNG", e.to_string());
    let mut dec = png::Decoder::new(std::io::Cursor::new(bytes));
    dec.set_transformations(png::Transformations::normalize_to_color8());
    let mut reader = dec.read_info().map_err(err)?;
    let (w, h) = (reader.info().width as usize, reader.info().height as usize);
    check_size(path, ImageFormat::Png, w, h)?;
    let size = reader
        .output_buffer_size()
        .ok_or_else(|| bad(path, "PNG", "the image does not fit in memory"))?;
    let mut buf = vec![0u8; size];
    let out = reader.next_frame(&mut buf).map_err(err)?;
    buf.truncate(out.buffer_size());
    let (w, h) = (out.width as usize, out.height as usize);
    use png::ColorType as C;
    let (color, pixels) = match out.color_type {
        C::Grayscale => (PixelColor::Luma, buf),
        C::GrayscaleAlpha => (
            PixelColor::Luma,
            buf.chunks_exact(2).map(|p| p[0]).collect(),
        ),
        C::Rgb => (PixelColor::Rgb, buf),
        C::Rgba => (
            PixelColor::Rgb,
            buf.chunks_exact(4)
                .flat_map(|p| [p[0], p[1], p[2]])
                .collect(),
        ),
        // normalize_to_color8 expands palettes; a decoder that did not is a bug to report.
        C::Indexed => return Err(bad(path, "PNG", "palette not expanded")),
    };
    DecodedImage::new(w, h, color, pixels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn luma_weights_are_pils() {
        assert_eq!(rgb_to_luma(255, 255, 255), 255);
        assert_eq!(rgb_to_luma(255, 0, 0), 76); // PIL: 299*255/1000 = 76.2
        assert_eq!(rgb_to_luma(0, 255, 0), 150);
        assert_eq!(rgb_to_luma(0, 0, 255), 29);
    }

    #[test]
    fn ycbcr_round_trip_of_greys_and_primaries() {
        assert_eq!(ycbcr_to_rgb(&[77, 128, 128]), [77, 77, 77]);
        // Pure red in JFIF: Y 76, Cb 85, Cr 255.
        let [r, g, b] = ycbcr_to_rgb(&[76, 85, 255]);
        assert!(r >= 253 && g <= 2 && b <= 2, "{r} {g} {b}");
    }

    #[test]
    fn sniffing() {
        assert_eq!(
            ImageFormat::sniff(&[0xff, 0xd8, 0xff, 0xe0]),
            Some(ImageFormat::Jpeg)
        );
        assert_eq!(
            ImageFormat::sniff(b"\x89PNG\r\n\x1a\n...."),
            Some(ImageFormat::Png)
        );
        assert_eq!(ImageFormat::sniff(b"GIF89a"), None);
        let e = decode(b"", Path::new("x.jpg"), ColorMode::Rgb, 1, false).unwrap_err();
        assert!(
            e.to_string().contains("x.jpg") && e.to_string().contains("empty"),
            "{e}"
        );
    }
}
