//! Image datasets (src/data/image*.rs, cifar10.rs): ImageFolder's indexing against torchvision's
//! rules on a generated tree of JPEG and PNG files, decoding (RGB, grey, CMYK, 16-bit PNG, reduced
//! scale), corrupt and truncated files, torchvision's transforms against hand-computed crop
//! boxes, flips and normalisation and against PIL's resampling (a committed fixture), CIFAR-10's
//! binary batches, and reproducible loading through the worker pool.

use std::path::{Path, PathBuf};

use mixprec::data::cifar10::{self, Cifar10};
use mixprec::data::fashion_mnist::Split;
use mixprec::data::image::{self, ColorMode, PixelColor};
use mixprec::data::image_transforms::{
    CenterCrop, Geometry, ImageTransform, ItemRng, Plan, RandomResizedCrop, Resize,
    TransformScratch,
};
use mixprec::data::{BadFiles, DataLoader, Dataset, ImageFolder};
use mixprec::Error;

fn scratch_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mixprec-image-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A smooth RGB test pattern (compresses well, so JPEG round trips stay close).
fn pattern(w: usize, h: usize, seed: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            v.push(((x * 255) / w.max(1)) as u8);
            v.push(((y * 255) / h.max(1)) as u8);
            v.push(((seed * 40 + (x + y) * 2) % 256) as u8);
        }
    }
    v
}

fn jpeg(pixels: &[u8], w: usize, h: usize, color: jpeg_encoder::ColorType, q: u8) -> Vec<u8> {
    let mut out = Vec::new();
    let mut enc = jpeg_encoder::Encoder::new(&mut out, q);
    enc.set_sampling_factor(jpeg_encoder::SamplingFactor::F_1_1);
    enc.encode(pixels, w as u16, h as u16, color).unwrap();
    out
}

fn png_bytes(
    pixels: &[u8],
    w: usize,
    h: usize,
    color: png::ColorType,
    depth: png::BitDepth,
) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, w as u32, h as u32);
        enc.set_color(color);
        enc.set_depth(depth);
        let mut wr = enc.write_header().unwrap();
        wr.write_image_data(pixels).unwrap();
    }
    out
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn max_diff(a: &[u8], b: &[u8]) -> u8 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap_or(0)
}

// ---------------------------------------------------------------- ImageFolder indexing

#[test]
fn image_folder_indexes_like_torchvision() {
    let root = scratch_dir("index");
    let j = jpeg(&pattern(8, 6, 0), 8, 6, jpeg_encoder::ColorType::Rgb, 90);
    let p = png_bytes(
        &pattern(8, 6, 1),
        8,
        6,
        png::ColorType::Rgb,
        png::BitDepth::Eight,
    );
    // Classes: every directory, sorted by code point (upper case first, hidden ones included).
    for f in [
        "b_cls/2.jpg",
        "b_cls/10.JPG",
        "b_cls/sub/a.png",
        "b_cls/sub-2/z.jpeg",
        "b_cls/sub/deeper/y.png",
        "Zebra/x.PNG",
        "a_cls/only.jpg",
        ".hidden/h.jpg",
    ] {
        let bytes = if f.to_lowercase().ends_with("png") {
            &p
        } else {
            &j
        };
        write(&root.join(f), bytes);
    }
    // Not samples: other extensions, a file at the root.
    write(&root.join("b_cls/notes.txt"), b"hello");
    write(&root.join("b_cls/.DS_Store"), b"\0");
    write(&root.join("README.md"), b"a dataset");

    let folder = ImageFolder::new(&root).unwrap();
    assert_eq!(folder.classes(), [".hidden", "Zebra", "a_cls", "b_cls"]);
    assert_eq!(folder.class_to_idx()["b_cls"], 3);
    let rel: Vec<(String, usize)> = folder
        .samples()
        .iter()
        .map(|s| {
            (
                s.path.strip_prefix(&root).unwrap().display().to_string(),
                s.class,
            )
        })
        .collect();
    // Within a class: os.walk's directories sorted by their path strings ("b_cls" <
    // "b_cls/sub" < "b_cls/sub-2" < "b_cls/sub/deeper": a prefix first, and '-' before '/'),
    // files sorted by name ("10.JPG" < "2.jpg").
    let expected = [
        (".hidden/h.jpg", 0),
        ("Zebra/x.PNG", 1),
        ("a_cls/only.jpg", 2),
        ("b_cls/10.JPG", 3),
        ("b_cls/2.jpg", 3),
        ("b_cls/sub/a.png", 3),
        ("b_cls/sub-2/z.jpeg", 3),
        ("b_cls/sub/deeper/y.png", 3),
    ];
    let expected: Vec<(String, usize)> =
        expected.iter().map(|(p, c)| (p.to_string(), *c)).collect();
    assert_eq!(rel, expected);
    assert_eq!(folder.targets(), vec![0, 1, 2, 3, 3, 3, 3, 3]);

    // Loading decodes as torchvision's loader would.
    let (img, class) = folder.load(5, ColorMode::Rgb).unwrap();
    assert_eq!(
        (img.width, img.height, img.color, class),
        (8, 6, PixelColor::Rgb, 3)
    );
    assert_eq!(img.pixels, pattern(8, 6, 1));
}

#[test]
fn image_folder_errors_name_the_problem() {
    let root = scratch_dir("folder-errors");
    let no_class = ImageFolder::new(&root).unwrap_err().to_string();
    assert!(no_class.contains("no class folder"), "{no_class}");
    let missing = ImageFolder::new(root.join("nope")).unwrap_err().to_string();
    assert!(missing.contains("nope"), "{missing}");

    let j = jpeg(&pattern(4, 4, 0), 4, 4, jpeg_encoder::ColorType::Rgb, 90);
    write(&root.join("cat/1.jpg"), &j);
    write(&root.join("dog/readme.txt"), b"no images here");
    let empty = ImageFolder::new(&root).unwrap_err().to_string();
    assert!(
        empty.contains("dog") && empty.contains("no image file"),
        "{empty}"
    );

    // A format torchvision lists but mixprec does not decode: an error, or left out on request.
    write(&root.join("dog/1.bmp"), b"BM....");
    write(&root.join("dog/2.jpg"), &j);
    let bmp = ImageFolder::new(&root).unwrap_err().to_string();
    assert!(
        bmp.contains("1.bmp") && bmp.contains("does not decode"),
        "{bmp}"
    );
    let folder = ImageFolder::with_bad_files(&root, BadFiles::Skip).unwrap();
    assert_eq!(folder.len(), 2);
    assert_eq!(folder.left_out().len(), 1);
    assert_eq!(folder.classes(), ["cat", "dog"]);
}

// ---------------------------------------------------------------- decoding

#[test]
fn decodes_rgb_grey_cmyk_jpegs_and_every_png_kind() {
    let (w, h) = (16, 12);
    let rgb = pattern(w, h, 3);
    let p = Path::new("mem.jpg");
    // RGB JPEG at quality 100, no subsampling: within a few levels.
    let bytes = jpeg(&rgb, w, h, jpeg_encoder::ColorType::Rgb, 100);
    for ycbcr in [false, true] {
        let img = image::decode(&bytes, p, ColorMode::Rgb, 1, ycbcr)
            .unwrap()
            .into_mode(ColorMode::Rgb);
        assert_eq!((img.width, img.height, img.color), (w, h, PixelColor::Rgb));
        assert!(
            max_diff(&img.pixels, &rgb) <= 4,
            "{}",
            max_diff(&img.pixels, &rgb)
        );
    }
    let hdr = image::read_header(&bytes, p).unwrap();
    assert_eq!((hdr.width, hdr.height), (w, h));
    // Grey mode: PIL's luma of the RGB.
    let grey = image::decode(&bytes, p, ColorMode::Gray, 1, false).unwrap();
    assert_eq!(grey.color, PixelColor::Luma);
    let want: Vec<u8> = rgb
        .chunks(3)
        .map(|c| image::rgb_to_luma(c[0], c[1], c[2]))
        .collect();
    assert!(max_diff(&grey.pixels, &want) <= 4);

    // A grey JPEG decodes to one channel in either mode.
    let luma: Vec<u8> = (0..w * h).map(|i| (i * 2) as u8).collect();
    let gj = jpeg(&luma, w, h, jpeg_encoder::ColorType::Luma, 100);
    let img = image::decode(&gj, p, ColorMode::Rgb, 1, true).unwrap();
    assert_eq!(img.color, PixelColor::Luma);
    assert!(max_diff(&img.pixels, &luma) <= 2);

    // CMYK: white, red, black and 50% grey come out as RGB.
    let cmyk: Vec<u8> = [
        [0u8, 0, 0, 0],
        [0, 255, 255, 0],
        [0, 0, 0, 255],
        [0, 0, 0, 128],
    ]
    .iter()
    .cycle()
    .take(w * h)
    .flatten()
    .copied()
    .collect();
    let cj = jpeg(&cmyk, w, h, jpeg_encoder::ColorType::Cmyk, 100);
    let img = image::decode(&cj, p, ColorMode::Rgb, 1, true)
        .unwrap()
        .into_mode(ColorMode::Rgb);
    assert_eq!(img.color, PixelColor::Rgb);
    let near = |got: &[u8], want: [u8; 3]| got.iter().zip(want).all(|(a, b)| a.abs_diff(b) <= 40);
    assert!(
        near(&img.pixels[0..3], [255, 255, 255]),
        "{:?}",
        &img.pixels[0..12]
    );
    assert!(
        near(&img.pixels[3..6], [255, 0, 0]),
        "{:?}",
        &img.pixels[0..12]
    );
    assert!(
        near(&img.pixels[6..9], [0, 0, 0]),
        "{:?}",
        &img.pixels[0..12]
    );

    // PNG: exact, every colour type, 16-bit keeps the high byte, alpha dropped.
    let pp = Path::new("mem.png");
    let dec = |b: &[u8], m| image::decode(b, pp, m, 1, true).unwrap();
    let g8 = dec(
        &png_bytes(&luma, w, h, png::ColorType::Grayscale, png::BitDepth::Eight),
        ColorMode::Rgb,
    );
    assert_eq!((g8.color, &g8.pixels), (PixelColor::Luma, &luma));
    let g16: Vec<u8> = luma.iter().flat_map(|&v| [v, 0x7f]).collect();
    let g16 = dec(
        &png_bytes(
            &g16,
            w,
            h,
            png::ColorType::Grayscale,
            png::BitDepth::Sixteen,
        ),
        ColorMode::Gray,
    );
    assert_eq!(g16.pixels, luma);
    let rgba: Vec<u8> = rgb.chunks(3).flat_map(|c| [c[0], c[1], c[2], 9]).collect();
    let a = dec(
        &png_bytes(&rgba, w, h, png::ColorType::Rgba, png::BitDepth::Eight),
        ColorMode::Rgb,
    );
    assert_eq!((a.color, &a.pixels), (PixelColor::Rgb, &rgb));
    let la: Vec<u8> = luma.iter().flat_map(|&v| [v, 200]).collect();
    let la = dec(
        &png_bytes(
            &la,
            w,
            h,
            png::ColorType::GrayscaleAlpha,
            png::BitDepth::Eight,
        ),
        ColorMode::Rgb,
    );
    assert_eq!(la.pixels, luma);
}

#[test]
fn reduced_scale_jpeg_decoding_keeps_the_picture() {
    // 64x48 of smooth colour: decoded at 1/2, 1/4, 1/8 it is the full decode, shrunk.
    let (w, h) = (64, 48);
    let rgb: Vec<u8> = (0..w * h)
        .flat_map(|i| {
            let (x, y) = (i % w, i / w);
            [(x * 4) as u8, (y * 5) as u8, ((x + y) * 2) as u8]
        })
        .collect();
    let bytes = jpeg(&rgb, w, h, jpeg_encoder::ColorType::Rgb, 95);
    let p = Path::new("big.jpg");
    let full = image::decode(&bytes, p, ColorMode::Rgb, 1, false).unwrap();
    for r in [2, 4, 8] {
        let small = image::decode(&bytes, p, ColorMode::Rgb, r, false).unwrap();
        assert_eq!((small.width, small.height), (w / r, h / r), "1/{r}");
        // Compare with the block means of the full decode.
        let mut worst = 0u8;
        for y in 0..h / r {
            for x in 0..w / r {
                for c in 0..3 {
                    let mut s = 0u32;
                    for dy in 0..r {
                        for dx in 0..r {
                            s += full.pixels[((y * r + dy) * w + x * r + dx) * 3 + c] as u32;
                        }
                    }
                    let mean = (s / (r * r) as u32) as u8;
                    worst = worst.max(mean.abs_diff(small.pixels[(y * (w / r) + x) * 3 + c]));
                }
            }
        }
        assert!(worst <= 12, "1/{r}: {worst}");
    }
    // A request that allows no reduction decodes at full size.
    let one = image::decode(&bytes, p, ColorMode::Rgb, 1, false).unwrap();
    assert_eq!((one.width, one.height), (w, h));
}

#[test]
fn corrupt_and_truncated_files_are_errors_naming_them() {
    let (w, h) = (32, 32);
    let good = jpeg(&pattern(w, h, 1), w, h, jpeg_encoder::ColorType::Rgb, 90);
    let good_png = png_bytes(
        &pattern(w, h, 1),
        w,
        h,
        png::ColorType::Rgb,
        png::BitDepth::Eight,
    );
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty.jpg", Vec::new()),
        ("text.jpg", b"this is not an image at all".to_vec()),
        ("trunc.jpg", good[..good.len() / 2].to_vec()),
        ("header-only.jpg", good[..200].to_vec()),
        ("trunc.png", good_png[..good_png.len() / 2].to_vec()),
        ("bad-crc.png", {
            let mut v = good_png.clone();
            let n = v.len();
            v[n / 2] ^= 0xff;
            v
        }),
    ];
    for (name, bytes) in &cases {
        for reduction in [1, 2] {
            let r = image::decode(bytes, Path::new(name), ColorMode::Rgb, reduction, true);
            match r {
                Err(Error::DataFormat { path, .. }) => assert_eq!(path, *name),
                other => {
                    panic!("{name} (1/{reduction}): expected a data-format error, got {other:?}")
                }
            }
        }
    }
    // A decompression bomb: a header claiming 60000x60000 pixels.
    let mut bomb = png_bytes(&[0u8; 3], 1, 1, png::ColorType::Rgb, png::BitDepth::Eight);
    bomb[16..20].copy_from_slice(&60000u32.to_be_bytes());
    bomb[20..24].copy_from_slice(&60000u32.to_be_bytes());
    let e = image::decode(&bomb, Path::new("bomb.png"), ColorMode::Rgb, 1, true).unwrap_err();
    assert!(e.to_string().contains("bomb.png"), "{e}");

    // Through a dataset: an error naming the file, or skipped and counted on request.
    let root = scratch_dir("corrupt");
    write(&root.join("a/0.jpg"), &good);
    write(&root.join("a/1.jpg"), &cases[2].1);
    write(&root.join("b/0.png"), &good_png);
    let t = ImageTransform::imagenet_eval(32, 16);
    let ds = ImageFolder::new(&root)
        .unwrap()
        .with_transform(t.clone())
        .unwrap();
    let mut out = vec![0f32; 3 * 16 * 16];
    let e = ds.read_item(0, 1, &mut out).unwrap_err().to_string();
    assert!(e.contains("1.jpg"), "{e}");
    let batches: Vec<_> = DataLoader::new(
        ImageFolder::new(&root)
            .unwrap()
            .with_transform(t.clone())
            .unwrap(),
        1,
    )
    .unwrap()
    .epoch(0)
    .collect();
    assert_eq!(batches.len(), 2, "the good first batch, then the error");
    assert!(batches[1]
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("1.jpg"));

    let ds = ImageFolder::with_bad_files(&root, BadFiles::Skip)
        .unwrap()
        .with_transform(t)
        .unwrap();
    // Item 1 is served as item 2 (the next readable one), with its label.
    let label = ds.read_item(0, 1, &mut out).unwrap();
    let mut want = vec![0f32; out.len()];
    assert_eq!(ds.read_item(0, 2, &mut want).unwrap(), label);
    assert_eq!(out, want);
    let skipped = ds.skipped_files();
    assert_eq!(skipped.len(), 1);
    assert!(skipped[0].0.ends_with("a/1.jpg"));
    let all: usize = DataLoader::new(ds, 2)
        .unwrap()
        .epoch(0)
        .map(|b| b.unwrap().1.dims()[0])
        .sum();
    assert_eq!(all, 3);
}

// ---------------------------------------------------------------- transforms

/// torchvision's RandomResizedCrop.get_params written out plainly, on the same draws.
fn reference_rrc(
    w: usize,
    h: usize,
    t: &RandomResizedCrop,
    rng: &mut ItemRng,
) -> (i64, i64, i64, i64) {
    let area = (w * h) as f64;
    for _ in 0..10 {
        let target = area * rng.uniform(t.scale.0, t.scale.1);
        let ar = rng.uniform(t.ratio.0.ln(), t.ratio.1.ln()).exp();
        let cw = (target * ar).sqrt().round_ties_even() as i64;
        let ch = (target / ar).sqrt().round_ties_even() as i64;
        if cw > 0 && cw <= w as i64 && ch > 0 && ch <= h as i64 {
            let i = rng.randint(0, h as i64 - ch + 1);
            let j = rng.randint(0, w as i64 - cw + 1);
            return (i, j, ch, cw);
        }
    }
    unreachable!("the fallback is checked separately")
}

#[test]
fn random_resized_crop_boxes() {
    let t = RandomResizedCrop::new(224);
    assert_eq!((t.scale, t.ratio), ((0.08, 1.0), (0.75, 4.0 / 3.0)));
    let (w, h) = (500, 375);
    let mut areas = Vec::new();
    for index in 0..2000 {
        let b = t.params(w, h, &mut ItemRng::new(7, 3, index));
        let r = reference_rrc(w, h, &t, &mut ItemRng::new(7, 3, index));
        assert_eq!(
            (b.top, b.left, b.height as i64, b.width as i64),
            r,
            "index {index}"
        );
        assert!(b.top >= 0 && b.left >= 0);
        assert!(b.top as usize + b.height <= h && b.left as usize + b.width <= w);
        let frac = (b.width * b.height) as f64 / (w * h) as f64;
        let ratio = b.width as f64 / b.height as f64;
        assert!((0.075..=1.0).contains(&frac), "{frac}");
        assert!((0.74..=1.35).contains(&ratio), "{ratio}");
        areas.push(frac);
    }
    // Draws above ~0.56 of a 4:3 image often do not fit at the drawn ratio and are redrawn,
    // which pulls the mean below the uniform (0.08 + 1) / 2.
    let mean = areas.iter().sum::<f64>() / areas.len() as f64;
    assert!((0.35..0.54).contains(&mean), "mean area fraction {mean}");

    // The fallback: no draw can fit (areas larger than the image), so the central crop at the
    // nearest allowed ratio. 100x10 is wider than 4/3: h = 10, w = round(10 * 4/3) = 13,
    // left = (100 - 13) // 2 = 43.
    let big = RandomResizedCrop {
        scale: (2.0, 3.0),
        ..t
    };
    let b = big.params(100, 10, &mut ItemRng::new(0, 0, 0));
    assert_eq!((b.top, b.left, b.height, b.width), (0, 43, 10, 13));
    // Taller than 3/4: w = 10, h = round(10 / 0.75) = 13 (13.33), top = (100 - 13) // 2.
    let b = big.params(10, 100, &mut ItemRng::new(0, 0, 0));
    assert_eq!((b.top, b.left, b.height, b.width), (43, 0, 13, 10));
    // Within the ratios: the whole image.
    let b = big.params(50, 40, &mut ItemRng::new(0, 0, 0));
    assert_eq!((b.top, b.left, b.height, b.width), (0, 0, 40, 50));
}

#[test]
fn resize_and_center_crop_geometry() {
    // Resize(256): shorter side 256, longer int(256 * long / short).
    assert_eq!(Resize::Shorter(256).output_size(500, 375), (341, 256));
    assert_eq!(Resize::Shorter(256).output_size(375, 500), (256, 341));
    assert_eq!(Resize::Shorter(256).output_size(300, 300), (256, 256));
    assert_eq!(
        Resize::Exact {
            height: 5,
            width: 7
        }
        .output_size(100, 3),
        (7, 5)
    );
    // CenterCrop(224) of 341x256: left = round(117 / 2) = round(58.5) = 58 (halves to even),
    // top = 16.
    let b = CenterCrop::new(224).params(341, 256);
    assert_eq!((b.top, b.left, b.height, b.width), (16, 58, 224, 224));
    let b = CenterCrop::new(224).params(343, 256);
    assert_eq!(b.left, 60, "round(59.5) = 60");
    // Larger than the image: padded by (crop - size) // 2 before.
    let b = CenterCrop {
        height: 9,
        width: 10,
    }
    .params(7, 4);
    assert_eq!((b.top, b.left), (-2, -1));
}

fn decoded_png(name: &str) -> image::DecodedImage {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/vision")
        .join(name);
    let bytes = std::fs::read(&p).unwrap();
    image::decode(&bytes, &p, ColorMode::Rgb, 1, false).unwrap()
}

/// `t`'s output scaled back to bytes (mean 0, std 1: x / 255), CHW → HWC.
fn render_bytes(t: &ImageTransform, img: &image::DecodedImage, plan: &Plan) -> Vec<u8> {
    let [c, h, w] = t.output_shape().unwrap();
    let mut out = vec![0f32; c * h * w];
    t.render(
        img,
        img.width,
        img.height,
        plan,
        &mut out,
        &mut TransformScratch::default(),
    )
    .unwrap();
    let mut hwc = vec![0u8; c * h * w];
    for k in 0..c {
        for i in 0..h * w {
            hwc[i * c + k] = (out[k * h * w + i] * 255.0).round() as u8;
        }
    }
    hwc
}

#[test]
fn resampling_matches_pil() {
    // tests/fixtures/make_vision_fixture.py: what PIL (torchvision's backend) makes of src.png.
    let src = decoded_png("src.png");
    assert_eq!((src.width, src.height), (23, 17));
    let unit = |geometry| ImageTransform {
        geometry,
        hflip: 0.0,
        mean: vec![0.0; 3],
        std: vec![1.0; 3],
        color: ColorMode::Rgb,
        seed: 0,
    };
    let crop = |h, w| {
        unit(Geometry::RandomResizedCrop(RandomResizedCrop {
            size: (h, w),
            ..RandomResizedCrop::new(1)
        }))
    };
    let cases = [
        (
            crop(6, 8),
            [3.0, 2.0, 15.0, 11.0],
            [0, 0, 8, 6],
            "rrc_down.png",
        ),
        (
            crop(8, 10),
            [0.0, 1.0, 5.0, 4.0],
            [0, 0, 10, 8],
            "rrc_up.png",
        ),
    ];
    for (t, src_box, window, fixture) in cases {
        let plan = Plan {
            src: src_box,
            crop_first: true,
            window,
            flip: false,
        };
        let got = render_bytes(&t, &src, &plan);
        let want = decoded_png(fixture).pixels;
        assert!(
            max_diff(&got, &want) <= 1,
            "{fixture}: {}",
            max_diff(&got, &want)
        );
    }
    // Resize(9) + CenterCrop(7), planned by the transform itself.
    let t = unit(Geometry::ResizeCenterCrop {
        resize: Resize::Shorter(9),
        crop: Some(CenterCrop::new(7)),
    });
    let plan = t.plan(0, 0, 23, 17);
    assert_eq!(plan.window, [0, 0, 7, 7]);
    assert!(!plan.crop_first && !plan.flip);
    let got = render_bytes(&t, &src, &plan);
    let want = decoded_png("eval.png").pixels;
    assert!(
        max_diff(&got, &want) <= 1,
        "eval: {}",
        max_diff(&got, &want)
    );
}

#[test]
fn flip_normalise_pad_and_identity() {
    // A 5x3 grey image with distinct columns.
    let px: Vec<u8> = (0..15).map(|i| (i * 10) as u8).collect();
    let img = image::DecodedImage::new(5, 3, PixelColor::Luma, px.clone()).unwrap();
    let t = ImageTransform {
        geometry: Geometry::ResizeCenterCrop {
            resize: Resize::Exact {
                height: 3,
                width: 5,
            },
            crop: None,
        },
        hflip: 1.0,
        mean: vec![0.5, 0.25, 0.0],
        std: vec![0.5, 2.0, 1.0],
        color: ColorMode::Rgb,
        seed: 0,
    };
    let plan = t.plan(0, 0, 5, 3);
    assert!(plan.flip, "p = 1 always flips");
    let mut out = vec![0f32; 3 * 15];
    t.render(
        &img,
        5,
        3,
        &plan,
        &mut out,
        &mut TransformScratch::default(),
    )
    .unwrap();
    for c in 0..3 {
        for y in 0..3 {
            for x in 0..5 {
                // Mirrored, the grey value replicated, then (v / 255 - mean) / std in f32.
                let v = px[y * 5 + (4 - x)] as f32;
                let want = (v / 255.0 - t.mean[c]) / t.std[c];
                assert_eq!(out[c * 15 + y * 5 + x], want, "c{c} y{y} x{x}");
            }
        }
    }
    // No flip at p = 0; flips drawn at p = 0.5 are about half.
    let t0 = t.clone().with_hflip(0.0);
    assert!(!t0.plan(0, 0, 5, 3).flip);
    let half = t.clone().with_hflip(0.5).with_seed(9);
    let flips = (0..1000).filter(|&i| half.plan(2, i, 5, 3).flip).count();
    assert!((430..570).contains(&flips), "{flips}");

    // CenterCrop larger than the image: zero padding, normalised (-mean / std), flipped too.
    let pad = ImageTransform {
        geometry: Geometry::ResizeCenterCrop {
            resize: Resize::Exact {
                height: 3,
                width: 5,
            },
            crop: Some(CenterCrop {
                height: 5,
                width: 8,
            }),
        },
        hflip: 0.0,
        ..t.clone()
    };
    let plan = pad.plan(0, 0, 5, 3);
    // left = -(8-5)//2 = -1, top = -(5-3)//2 = -1: the image sits at column 1, row 1.
    assert_eq!(plan.window, [1, 1, 5, 3]);
    let mut out = vec![0f32; 3 * 40];
    pad.render(
        &img,
        5,
        3,
        &plan,
        &mut out,
        &mut TransformScratch::default(),
    )
    .unwrap();
    let pads = pad.pad_values();
    assert_eq!(pads, vec![-1.0, -0.125, 0.0]);
    for c in 0..3 {
        let o = &out[c * 40..(c + 1) * 40];
        assert_eq!(o[0], pads[c]);
        assert_eq!(o[7], pads[c]);
        assert_eq!(o[4 * 8 + 3], pads[c]);
        assert_eq!(o[8 + 1], (0.0 - pad.mean[c]) / pad.std[c]); // pixel (0, 0)
        assert_eq!(o[8 + 5], (40.0 / 255.0 - pad.mean[c]) / pad.std[c]); // pixel (0, 4)
        assert_eq!(o[3 * 8 + 6], pads[c], "column 6 is padding");
    }

    // Resize to the same size is the identity, bit for bit (PIL returns a copy).
    let same = ImageTransform::imagenet_eval(3, 3).grayscale(0.0, 1.0);
    let mut out = vec![0f32; 9];
    let img = image::DecodedImage::new(3, 3, PixelColor::Luma, (0..9).collect()).unwrap();
    same.render(
        &img,
        3,
        3,
        &same.plan(0, 0, 3, 3),
        &mut out,
        &mut TransformScratch::default(),
    )
    .unwrap();
    assert_eq!(out, (0..9).map(|v| v as f32 / 255.0).collect::<Vec<_>>());
}

#[test]
fn transform_arguments_are_checked() {
    let ok = ImageTransform::imagenet_train(224, 0);
    ok.check().unwrap();
    assert_eq!(ok.output_shape().unwrap(), [3, 224, 224]);
    let bad_scale = ImageTransform {
        geometry: Geometry::RandomResizedCrop(RandomResizedCrop {
            scale: (0.9, 0.1),
            ..RandomResizedCrop::new(224)
        }),
        ..ok.clone()
    };
    assert!(bad_scale.check().unwrap_err().to_string().contains("scale"));
    assert!(ok.clone().with_hflip(1.5).check().is_err());
    assert!(ok.clone().with_normalize(&[0.5], &[0.5]).check().is_err());
    assert!(ok
        .clone()
        .with_normalize(&[0.5; 3], &[0.0; 3])
        .check()
        .is_err());
    let no_size = ImageTransform {
        geometry: Geometry::ResizeCenterCrop {
            resize: Resize::Shorter(256),
            crop: None,
        },
        ..ok
    };
    assert!(no_size.check().is_err());
}

// ---------------------------------------------------------------- reading through a loader

#[test]
fn image_folder_batches_are_reproducible_with_any_worker_count() {
    let root = scratch_dir("loader");
    for i in 0..24 {
        let (w, h) = (40 + i, 30 + (i * 7) % 20);
        let bytes = if i % 3 == 0 {
            png_bytes(
                &pattern(w, h, i),
                w,
                h,
                png::ColorType::Rgb,
                png::BitDepth::Eight,
            )
        } else {
            jpeg(&pattern(w, h, i), w, h, jpeg_encoder::ColorType::Rgb, 85)
        };
        let ext = if i % 3 == 0 { "png" } else { "jpg" };
        write(&root.join(format!("c{}/{i:02}.{ext}", i % 3)), &bytes);
    }
    let make = || {
        ImageFolder::new(&root)
            .unwrap()
            .with_transform(ImageTransform::imagenet_train(16, 5))
            .unwrap()
    };
    let batches = |workers, prefetch, epoch| -> Vec<(Vec<f32>, Vec<i64>)> {
        DataLoader::new(make(), 5)
            .unwrap()
            .shuffle(11)
            .workers(workers)
            .prefetch(prefetch)
            .epoch(epoch)
            .map(|b| {
                let (x, y) = b.unwrap();
                assert_eq!(&x.dims()[1..], &[3, 16, 16]);
                (x.to_vec::<f32>().unwrap(), y.to_vec::<i64>().unwrap())
            })
            .collect()
    };
    let one = batches(1, 2, 1);
    assert_eq!(one.len(), 5);
    assert_eq!(batches(4, 1, 1), one, "4 workers");
    assert_eq!(batches(3, 0, 1), one, "no threads");
    assert_eq!(batches(8, 3, 1), one, "8 workers, deeper queue");
    let other_epoch = batches(4, 2, 2);
    assert_ne!(other_epoch, one, "epochs draw new crops and orders");
    // Labels follow the folder's classes.
    let ds = make();
    let labels: Vec<i64> = (0..24)
        .map(|i| ds.read_item(0, i, &mut vec![0f32; 768]).unwrap())
        .collect();
    assert_eq!(labels, (0..24).map(|i| (i / 8) as i64).collect::<Vec<_>>());
}

// ---------------------------------------------------------------- CIFAR-10

/// `n` records: label `i % 10`, channel c of pixel p = (i + 3c + p) % 256.
fn cifar_records(n: usize, first: usize) -> Vec<u8> {
    let mut v = Vec::new();
    for i in first..first + n {
        v.push((i % 10) as u8);
        for c in 0..3 {
            for p in 0..1024 {
                v.push(((i + 3 * c + p) % 256) as u8);
            }
        }
    }
    v
}

#[test]
fn cifar10_binary_batches() {
    let dir = scratch_dir("cifar");
    let sub = dir.join(cifar10::ARCHIVE_DIR);
    std::fs::create_dir_all(&sub).unwrap();
    for b in 1..=5 {
        std::fs::write(
            sub.join(format!("data_batch_{b}.bin")),
            cifar_records(7, (b - 1) * 7),
        )
        .unwrap();
    }
    std::fs::write(sub.join("test_batch.bin"), cifar_records(4, 100)).unwrap();
    // The folder the archive unpacks to is found from its parent.
    let train = Cifar10::load(&dir, Split::Train).unwrap();
    let test = Cifar10::load(&sub, Split::Test).unwrap();
    assert_eq!((train.len(), test.len()), (35, 4));
    assert_eq!(train.item_shape(), [3, 32, 32]);
    assert_eq!(train.num_classes(), 10);
    assert_eq!(train.labels()[13], 3);
    let mut out = vec![0f32; 3072];
    assert_eq!(train.read_into(13, &mut out).unwrap(), 3);
    for c in 0..3 {
        for p in [0, 1, 500, 1023] {
            let v = ((13 + 3 * c + p) % 256) as f32;
            let want = (v / 255.0 - cifar10::MEAN[c]) / cifar10::STD[c];
            assert_eq!(out[c * 1024 + p], want);
        }
    }
    let pads = train.pad_values();
    for (c, &pad) in pads.iter().enumerate() {
        assert_eq!(pad, -cifar10::MEAN[c] / cifar10::STD[c]);
    }
    // Random crops pad each channel with its own normalised black.
    let aug = mixprec::data::transforms::Augment::crop_flip(4, 1);
    let loader = DataLoader::new(train.clone(), 35)
        .unwrap()
        .augment(aug)
        .workers(2);
    let (x, _) = loader.epoch(0).next().unwrap().unwrap();
    let xv = x.to_vec::<f32>().unwrap();
    let padded: Vec<usize> = (0..35)
        .filter(|i| {
            let d = aug.draw(0, *i);
            d.dy == 0 && !d.flip
        })
        .collect();
    assert!(!padded.is_empty());
    for &i in padded.iter().take(3) {
        for c in 0..3 {
            assert_eq!(
                xv[i * 3072 + c * 1024 + 5],
                pads[c],
                "item {i} channel {c}: top rows are padding"
            );
        }
    }

    // Broken files name the file.
    let bad = dir.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    for b in 1..=5 {
        std::fs::write(bad.join(format!("data_batch_{b}.bin")), cifar_records(2, 0)).unwrap();
    }
    std::fs::write(bad.join("data_batch_3.bin"), &cifar_records(2, 0)[..5000]).unwrap();
    let e = Cifar10::load(&bad, Split::Train).unwrap_err().to_string();
    assert!(
        e.contains("data_batch_3.bin") && e.contains("records"),
        "{e}"
    );
    let mut wrong = cifar_records(2, 0);
    wrong[cifar10::RECORD] = 12;
    std::fs::write(bad.join("data_batch_3.bin"), wrong).unwrap();
    let e = Cifar10::load(&bad, Split::Train).unwrap_err().to_string();
    assert!(e.contains("label 12"), "{e}");
    let e = Cifar10::load(&bad, Split::Test).unwrap_err().to_string();
    assert!(e.contains("test_batch.bin"), "{e}");
}
