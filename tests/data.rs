//! Data pipeline tests: the IDX reader on good and bad files, the bundled Fashion-MNIST subset,
//! the DataLoader (batching, shuffling, reproducibility, prefetch-thread shutdown), augmentation
//! and the synthetic dataset. All fast: the bundled subset is 12,000 images.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mixprec::data::fashion_mnist::{self, bundled_dir, MEAN, STD};
use mixprec::data::idx::{self, IdxImages};
use mixprec::data::{
    Augment, DataLoader, DataSource, Dataset, FashionMnist, ItemShape, Split, SyntheticDataset,
};
use mixprec::{DType, Device, Error, Result, Tensor};

/// A fresh scratch directory per test (no tempfile dependency).
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mixprec-data-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn bundled(file: &str) -> PathBuf {
    bundled_dir().join(file)
}

/// Asserts `r` is a DataFormat error about `path` whose detail contains `needle`.
fn assert_data_format<T: std::fmt::Debug>(r: Result<T>, path: &Path, needle: &str) {
    match r {
        Err(Error::DataFormat {
            path: p,
            format,
            detail,
        }) => {
            assert_eq!(format, "IDX");
            assert_eq!(p, path.display().to_string());
            assert!(
                detail.to_lowercase().contains(needle),
                "detail {detail:?} lacks {needle:?}"
            );
        }
        other => panic!("expected DataFormat for {}, got {other:?}", path.display()),
    }
}

// ---------------------------------------------------------------- bundled Fashion-MNIST

#[test]
fn bundled_subset_counts_labels_and_pixels() {
    let train = FashionMnist::load_dir(bundled_dir(), Split::Train).unwrap();
    let test = FashionMnist::load_dir(bundled_dir(), Split::Test).unwrap();
    assert_eq!(train.len(), 10_000);
    assert_eq!(test.len(), 2_000);
    assert_eq!(train.item_shape(), [1, 28, 28]);
    assert_eq!(train.num_classes(), 10);
    // The first items of the official files: train 9 (ankle boot), 0, 0, 3; test 9, 2, 1, 1.
    assert_eq!(&train.labels()[..4], &[9, 0, 0, 3]);
    assert_eq!(&test.labels()[..4], &[9, 2, 1, 1]);
    assert_eq!(
        fashion_mnist::CLASS_NAMES[train.labels()[0] as usize],
        "Ankle boot"
    );
    for ds in [&train, &test] {
        let classes: HashSet<u8> = ds.labels().iter().copied().collect();
        assert_eq!(classes, (0..10).collect::<HashSet<u8>>());
    }

    let (lo, hi) = (-MEAN / STD, (1.0 - MEAN) / STD); // ≈ -0.810, 2.023
    let (img, label) = train.get(0).unwrap();
    assert_eq!(label, 9);
    assert_eq!(img.len(), 784);
    let (mut min, mut max, mut sum) = (f32::MAX, f32::MIN, 0f64);
    let mut buf = vec![0f32; 784];
    for i in 0..train.len() {
        let l = train.read_into(i, &mut buf).unwrap();
        assert!((0..10).contains(&l));
        for &v in &buf {
            min = min.min(v);
            max = max.max(v);
            sum += v as f64;
        }
    }
    assert!((min - lo).abs() < 1e-6, "min {min} vs {lo}");
    assert!((max - hi).abs() < 1e-5, "max {max} vs {hi}");
    // Normalised with the full set's statistics, the subset's mean is close to 0.
    let mean = sum / (train.len() * 784) as f64;
    assert!(mean.abs() < 0.05, "normalised mean {mean}");
    assert!((train.pad_value() - lo).abs() < 1e-6);

    // Raw pixels are served with with_normalization(0, 1).
    let raw = train.clone().with_normalization(0.0, 1.0).unwrap();
    let (img, _) = raw.get(0).unwrap();
    let bytes = raw.raw_image(0).unwrap();
    for (v, &b) in img.iter().zip(bytes) {
        assert_eq!(*v, b as f32 / 255.0);
    }
    assert!(train.clone().with_normalization(0.0, 0.0).is_err());
}

#[test]
fn bundled_subset_is_the_head_of_the_full_files() {
    let full = Path::new(fashion_mnist::SYSTEM_DIR);
    if !full.join("t10k-images-idx3-ubyte.gz").is_file() {
        eprintln!("skipped: the full dataset is not installed");
        return;
    }
    let sub = FashionMnist::load_dir(bundled_dir(), Split::Test).unwrap();
    let all = FashionMnist::load_dir(full, Split::Test).unwrap();
    assert_eq!(all.len(), 10_000);
    assert_eq!(sub.labels(), &all.labels()[..2_000]);
    for i in [0, 1, 999, 1_999] {
        assert_eq!(sub.raw_image(i), all.raw_image(i));
    }
}

#[test]
fn locate_reports_the_source_and_honours_the_env_var() {
    // The only test that touches FASHION_MNIST_DIR (no other test calls `locate`).
    std::env::remove_var(fashion_mnist::ENV_VAR);
    let (train, source) = FashionMnist::load(Split::Train).unwrap();
    let test = FashionMnist::load_from(&source, Split::Test).unwrap();
    match &source {
        DataSource::Full(p) => {
            assert_eq!(p, Path::new(fashion_mnist::SYSTEM_DIR));
            assert_eq!((train.len(), test.len()), (60_000, 10_000));
        }
        DataSource::Bundled(_) => assert_eq!((train.len(), test.len()), (10_000, 2_000)),
        DataSource::Env(_) | DataSource::Dir(_) => unreachable!(),
    }
    assert!(source
        .to_string()
        .contains(&source.dir().display().to_string()));

    std::env::set_var(fashion_mnist::ENV_VAR, bundled_dir());
    let located = DataSource::locate();
    let missing = scratch_dir("env-missing");
    std::env::set_var(fashion_mnist::ENV_VAR, &missing);
    let bad = DataSource::locate();
    std::env::remove_var(fashion_mnist::ENV_VAR);

    let located = located.unwrap();
    assert_eq!(located, DataSource::Env(bundled_dir()));
    assert!(located.to_string().contains("FASHION_MNIST_DIR"));
    let msg = bad.unwrap_err().to_string();
    assert!(
        msg.contains("FASHION_MNIST_DIR") && msg.contains("train-images-idx3-ubyte"),
        "{msg}"
    );
    assert!(DataSource::Bundled(bundled_dir())
        .to_string()
        .contains("subset"));
}

// ---------------------------------------------------------------- IDX reader

#[test]
fn idx_round_trip_raw_and_gzip() {
    let dir = scratch_dir("roundtrip");
    let images = IdxImages {
        count: 3,
        rows: 2,
        cols: 4,
        pixels: (0..24).collect(),
    };
    for name in ["imgs.idx", "imgs.idx.gz"] {
        idx::write_images(dir.join(name), &images).unwrap();
        assert_eq!(idx::read_images(dir.join(name)).unwrap(), images);
    }
    idx::write_labels(dir.join("l.gz"), &[1, 2, 3]).unwrap();
    assert_eq!(idx::read_labels(dir.join("l.gz")).unwrap(), vec![1, 2, 3]);
    // gzip is detected by content, not by name.
    std::fs::copy(dir.join("l.gz"), dir.join("l.bin")).unwrap();
    assert_eq!(idx::read_labels(dir.join("l.bin")).unwrap(), vec![1, 2, 3]);
    // Mismatched lengths are refused when writing.
    assert!(idx::write_labels(dir.join("x"), &[]).is_ok());
    let bad = IdxImages { count: 2, ..images };
    assert!(idx::write_images(dir.join("bad.gz"), &bad).is_err());
}

/// The official names work uncompressed too (`NAME` beside `NAME.gz`), and a file with a valid
/// header and 0 items is a data error naming it (it was reported as a batch-size problem).
#[test]
fn fashion_mnist_files_raw_or_gzip_and_never_empty() {
    let dir = scratch_dir("raw-names");
    let images = |count: usize| IdxImages {
        count,
        rows: 28,
        cols: 28,
        pixels: (0..count * 784).map(|i| (i % 251) as u8).collect(),
    };
    for split in [Split::Train, Split::Test] {
        let (i, l) = split.file_names();
        let (i, l) = (i.trim_end_matches(".gz"), l.trim_end_matches(".gz"));
        idx::write_images(dir.join(i), &images(3)).unwrap();
        idx::write_labels(dir.join(l), &[1, 2, 3]).unwrap();
    }
    // Uncompressed: the first two bytes are the IDX magic's zeros, not gzip's.
    let raw = std::fs::read(dir.join("train-images-idx3-ubyte")).unwrap();
    assert_eq!(raw[..4], [0, 0, 8, 3]);
    let ds = FashionMnist::load_dir(&dir, Split::Train).unwrap();
    assert_eq!(ds.len(), 3);
    let source = DataSource::dir_given(&dir).unwrap();
    assert_eq!(
        source.to_string(),
        format!("Fashion-MNIST from {}", dir.display())
    );
    assert!(!source.to_string().contains("FASHION_MNIST_DIR"));

    // A header that says 0 images.
    idx::write_images(dir.join("t10k-images-idx3-ubyte"), &images(0)).unwrap();
    idx::write_labels(dir.join("t10k-labels-idx1-ubyte"), &[]).unwrap();
    let msg = FashionMnist::load_dir(&dir, Split::Test)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("t10k-images-idx3-ubyte") && msg.contains("0 images"),
        "{msg}"
    );
    // A missing file is named with both forms it may take.
    std::fs::remove_file(dir.join("t10k-labels-idx1-ubyte")).unwrap();
    let msg = DataSource::dir_given(&dir).unwrap_err().to_string();
    assert!(
        msg.contains("t10k-labels-idx1-ubyte[.gz] not found"),
        "{msg}"
    );
}

#[test]
fn idx_truncated_files_are_errors_naming_the_file() {
    let dir = scratch_dir("truncated");
    let gz = std::fs::read(bundled("t10k-images-idx3-ubyte.gz")).unwrap();

    // A gzip cut in half.
    let cut_gz = dir.join("t10k-images-idx3-ubyte.gz");
    std::fs::write(&cut_gz, &gz[..gz.len() / 2]).unwrap();
    assert_data_format(idx::read_images(&cut_gz), &cut_gz, "truncated");

    // Raw IDX: cut inside the data, inside the header, and empty.
    let raw = {
        use std::io::Read;
        let mut v = Vec::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_end(&mut v)
            .unwrap();
        v
    };
    let cut = dir.join("cut-data.idx");
    std::fs::write(&cut, &raw[..16 + 784 * 10 + 5]).unwrap();
    assert_data_format(idx::read_images(&cut), &cut, "only 7845 bytes follow");
    let cut = dir.join("cut-header.idx");
    std::fs::write(&cut, &raw[..10]).unwrap();
    assert_data_format(idx::read_images(&cut), &cut, "truncated");
    let empty = dir.join("empty.idx");
    std::fs::write(&empty, b"").unwrap();
    assert_data_format(idx::read_labels(&empty), &empty, "magic");

    // A header announcing 4 billion images over a few bytes: an error, not a huge allocation.
    let huge = dir.join("huge.idx");
    let mut bytes = vec![0, 0, 8, 3, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 28, 0, 0, 0, 28];
    bytes.extend_from_slice(&[0; 100]);
    std::fs::write(&huge, &bytes).unwrap();
    assert_data_format(idx::read_images(&huge), &huge, "truncated");

    // Trailing bytes after the data.
    let long = dir.join("long.idx");
    let mut bytes = vec![0, 0, 8, 1, 0, 0, 0, 2, 1, 2, 3];
    std::fs::write(&long, &bytes).unwrap();
    assert_data_format(idx::read_labels(&long), &long, "trailing");
    bytes.pop();
    std::fs::write(&long, &bytes).unwrap();
    assert_eq!(idx::read_labels(&long).unwrap(), vec![1, 2]);

    // A missing file is an I/O error naming it.
    let gone = dir.join("nope.gz");
    let msg = idx::read_labels(&gone).unwrap_err().to_string();
    assert!(msg.contains("nope.gz"), "{msg}");
}

#[test]
fn idx_wrong_magic_is_an_error() {
    let labels = bundled("t10k-labels-idx1-ubyte.gz");
    assert_data_format(idx::read_images(&labels), &labels, "0x00000801");
    let images = bundled("t10k-images-idx3-ubyte.gz");
    assert_data_format(
        idx::read_labels(&images),
        &images,
        "magic number 0x00000803",
    );

    let dir = scratch_dir("magic");
    let text = dir.join("notes.txt");
    std::fs::write(&text, b"hello, world").unwrap();
    assert_data_format(idx::read_images(&text), &text, "not an idx file");
    let floats = dir.join("floats.idx");
    std::fs::write(&floats, [0, 0, 0x0d, 1, 0, 0, 0, 0]).unwrap();
    assert_data_format(idx::read_labels(&floats), &floats, "element type 0x0d");
}

#[test]
fn idx_corrupt_gzip_is_an_error() {
    let dir = scratch_dir("corrupt");
    let gz = std::fs::read(bundled("t10k-labels-idx1-ubyte.gz")).unwrap();

    // Flipped bytes in the deflate stream (caught by deflate or the CRC).
    let mut bad = gz.clone();
    for b in &mut bad[gz.len() / 2..gz.len() / 2 + 8] {
        *b ^= 0x5a;
    }
    let p = dir.join("flipped.gz");
    std::fs::write(&p, &bad).unwrap();
    assert_data_format(idx::read_labels(&p), &p, "gzip");

    // A wrong CRC in the trailer, data intact.
    let mut bad = gz.clone();
    let n = bad.len();
    bad[n - 8] ^= 0xff;
    let p = dir.join("crc.gz");
    std::fs::write(&p, &bad).unwrap();
    assert_data_format(idx::read_labels(&p), &p, "gzip");

    // The gzip magic followed by garbage.
    let p = dir.join("garbage.gz");
    std::fs::write(&p, [0x1f, 0x8b, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]).unwrap();
    assert_data_format(idx::read_labels(&p), &p, "gzip");
}

#[test]
fn fashion_mnist_rejects_inconsistent_files() {
    let dir = scratch_dir("inconsistent");
    let images = bundled("t10k-images-idx3-ubyte.gz");
    let labels = dir.join("labels.gz");
    idx::write_labels(&labels, &[1; 1999]).unwrap();
    assert_data_format(
        FashionMnist::from_files(&images, &labels, Split::Test),
        &labels,
        "1999 labels for the 2000 images",
    );
    let mut l = vec![1u8; 2000];
    l[17] = 10;
    idx::write_labels(&labels, &l).unwrap();
    assert_data_format(
        FashionMnist::from_files(&images, &labels, Split::Test),
        &labels,
        "label 10 of item 17",
    );
}

// ---------------------------------------------------------------- DataLoader

/// Item `i` is an image filled with `i` and label `i`: batches show exactly which items they hold.
struct Indexed {
    len: usize,
    shape: ItemShape,
}

impl Dataset for Indexed {
    fn len(&self) -> usize {
        self.len
    }
    fn item_shape(&self) -> ItemShape {
        self.shape
    }
    fn num_classes(&self) -> usize {
        self.len
    }
    fn read_into(&self, index: usize, out: &mut [f32]) -> Result<i64> {
        if index >= self.len {
            return Err(Error::invalid_arg("Indexed", "index", index, "in range"));
        }
        out.fill(index as f32);
        Ok(index as i64)
    }
}

fn indexed(len: usize) -> Indexed {
    Indexed {
        len,
        shape: [2, 3, 3],
    }
}

fn labels_of(loader: &DataLoader, epoch: usize) -> Vec<Vec<i64>> {
    loader
        .epoch(epoch)
        .map(|b| b.unwrap().1.to_vec::<i64>().unwrap())
        .collect()
}

#[test]
fn loader_batch_shapes_dtypes_and_devices() {
    let train = FashionMnist::load_dir(bundled_dir(), Split::Test).unwrap();
    let loader = DataLoader::new(train, 128).unwrap().shuffle(1);
    let mut n = 0;
    for (i, batch) in loader.epoch(0).enumerate() {
        let (x, y): (Tensor, Tensor) = batch.unwrap();
        let b = if i < 15 { 128 } else { 2000 - 15 * 128 };
        assert_eq!(x.dims(), &[b, 1, 28, 28]);
        assert_eq!(y.dims(), &[b]);
        assert_eq!((x.dtype(), y.dtype()), (DType::F32, DType::I64));
        assert_eq!((x.device(), y.device()), (Device::Cpu, Device::Cpu));
        n += 1;
    }
    assert_eq!(n, 16);
    assert_eq!(loader.num_batches(), 16);
}

#[test]
fn loader_drop_last_counts() {
    for (len, bs) in [(10, 3), (9, 3), (2, 5), (0, 4)] {
        for prefetch in [0, 2] {
            let keep = DataLoader::new(indexed(len), bs)
                .unwrap()
                .prefetch(prefetch);
            let sizes: Vec<usize> = labels_of(&keep, 0).iter().map(Vec::len).collect();
            let mut want = vec![bs; len / bs];
            if len % bs != 0 {
                want.push(len % bs);
            }
            assert_eq!(sizes, want, "len {len} bs {bs}");
            assert_eq!(keep.num_batches(), want.len());

            let drop = keep.clone().drop_last(true);
            let sizes: Vec<usize> = labels_of(&drop, 0).iter().map(Vec::len).collect();
            assert_eq!(sizes, vec![bs; len / bs], "len {len} bs {bs} drop_last");
            assert_eq!(drop.num_batches(), len / bs);
        }
    }
}

#[test]
fn loader_serves_every_index_once_per_epoch() {
    let loader = DataLoader::new(indexed(1000), 64).unwrap().shuffle(7);
    for epoch in 0..3 {
        let mut seen: Vec<i64> = Vec::new();
        for batch in loader.epoch(epoch) {
            let (x, y) = batch.unwrap();
            let (xv, yv) = (x.to_vec::<f32>().unwrap(), y.to_vec::<i64>().unwrap());
            // Image and label of each row belong together.
            for (row, &l) in xv.chunks(18).zip(&yv) {
                assert!(row.iter().all(|&v| v == l as f32));
            }
            seen.extend(yv);
        }
        assert_eq!(seen.len(), 1000);
        let mut sorted = seen.clone();
        sorted.sort();
        assert_eq!(sorted, (0..1000).collect::<Vec<i64>>());
        assert_ne!(seen, sorted, "epoch {epoch} is not shuffled");
    }
    // Without shuffle: dataset order.
    let flat: Vec<i64> = labels_of(&DataLoader::new(indexed(10), 4).unwrap(), 5).concat();
    assert_eq!(flat, (0..10).collect::<Vec<i64>>());
}

#[test]
fn loader_order_depends_only_on_seed_and_epoch() {
    let a = DataLoader::new(indexed(500), 50).unwrap().shuffle(42);
    let b = DataLoader::new(indexed(500), 50)
        .unwrap()
        .shuffle(42)
        .prefetch(0);
    let c = DataLoader::new(indexed(500), 50).unwrap().shuffle(43);
    // Same (seed, epoch): same batches, whether or not a thread prefetches, in any call order
    // (a run resumed at epoch 3 sees what an uninterrupted run saw).
    let a3 = labels_of(&a, 3);
    assert_eq!(labels_of(&b, 3), a3);
    assert_eq!(labels_of(&a, 3), a3);
    assert_eq!(
        a.epoch_order(3),
        a3.concat().iter().map(|&v| v as usize).collect::<Vec<_>>()
    );
    // Different epochs, different seeds: different orders.
    assert_ne!(labels_of(&a, 4), a3);
    assert_ne!(labels_of(&a, 0), labels_of(&a, 1));
    assert_ne!(labels_of(&c, 3), a3);
}

#[test]
fn loader_early_drop_does_not_hang() {
    // Big batches, a slow consumer, prefetch 1: the producer is blocked in `send` when dropped.
    let ds = SyntheticDataset::new(100_000, [3, 32, 32], 10, 1).unwrap();
    let loader = DataLoader::new(ds, 256).unwrap().shuffle(3).prefetch(1);
    let t = Instant::now();
    for _ in 0..20 {
        let mut it = loader.epoch(0);
        let (x, _) = it.next().unwrap().unwrap();
        assert_eq!(x.dims(), &[256, 3, 32, 32]);
        std::thread::sleep(Duration::from_millis(5));
        drop(it); // joins the producer
        drop(loader.epoch(1)); // dropped before any batch was taken
    }
    // `break` out of a for loop.
    for (i, batch) in loader.epoch(2).enumerate() {
        batch.unwrap();
        if i == 2 {
            break;
        }
    }
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
}

#[test]
fn loader_reports_errors_as_items() {
    // A batch size of 0 is refused when the loader is made (as PyTorch's DataLoader).
    let msg = DataLoader::new(indexed(10), 0).unwrap_err().to_string();
    assert!(
        msg.contains("batch_size") && msg.contains("at least 1"),
        "{msg}"
    );

    /// Fails on item 5.
    struct Failing;
    impl Dataset for Failing {
        fn len(&self) -> usize {
            10
        }
        fn item_shape(&self) -> ItemShape {
            [1, 1, 1]
        }
        fn num_classes(&self) -> usize {
            2
        }
        fn read_into(&self, index: usize, _: &mut [f32]) -> Result<i64> {
            if index == 5 {
                Err(Error::invalid_arg("Failing", "index", 5, "not 5"))
            } else {
                Ok(0)
            }
        }
    }
    for prefetch in [0, 2] {
        let items: Vec<_> = DataLoader::new(Failing, 2)
            .unwrap()
            .prefetch(prefetch)
            .epoch(0)
            .collect();
        assert_eq!(
            items.len(),
            3,
            "two good batches, then the error, then the end"
        );
        assert!(items[0].is_ok() && items[1].is_ok() && items[2].is_err());
    }

    let too_much = Augment::new(0).random_crop(100);
    let mut it = DataLoader::new(indexed(4), 2)
        .unwrap()
        .augment(too_much)
        .epoch(0);
    assert!(it.next().unwrap().is_err());

    let ds = FashionMnist::load_dir(bundled_dir(), Split::Test).unwrap();
    let mut buf = vec![0.0; 784];
    assert!(ds.read_into(2_000, &mut buf).is_err());
    assert!(ds.read_into(0, &mut buf[..10]).is_err());
}

// ---------------------------------------------------------------- augmentation

#[test]
fn augmentation_keeps_shapes_and_is_deterministic_per_seed() {
    let test = FashionMnist::load_dir(bundled_dir(), Split::Test).unwrap();
    let plain = DataLoader::new(test.clone(), 100).unwrap().prefetch(0);
    let aug = |seed| {
        DataLoader::new(test.clone(), 100)
            .unwrap()
            .augment(Augment::crop_flip(2, seed))
    };
    let first = |l: &DataLoader, epoch| l.epoch(epoch).next().unwrap().unwrap();

    let (x0, y0) = first(&plain, 0);
    let (xa, ya) = first(&aug(5), 0);
    assert_eq!(xa.dims(), &[100, 1, 28, 28]);
    assert_eq!(
        ya.to_vec::<i64>().unwrap(),
        y0.to_vec::<i64>().unwrap(),
        "labels untouched"
    );
    let (v0, va) = (x0.to_vec::<f32>().unwrap(), xa.to_vec::<f32>().unwrap());
    assert_ne!(v0, va);
    // Values stay in the normalised range; padding is the normalised black pixel.
    let lo = -MEAN / STD;
    assert!(va
        .iter()
        .all(|&v| v >= lo - 1e-6 && v <= (1.0 - MEAN) / STD + 1e-5));

    // Deterministic per (seed, epoch); different for another seed or epoch.
    let again = first(&aug(5), 0).0.to_vec::<f32>().unwrap();
    assert_eq!(va, again);
    assert_ne!(first(&aug(6), 0).0.to_vec::<f32>().unwrap(), va);
    assert_ne!(first(&aug(5), 1).0.to_vec::<f32>().unwrap(), va);
    // Same with the prefetch thread off.
    let sync = first(&aug(5).prefetch(0), 0).0.to_vec::<f32>().unwrap();
    assert_eq!(sync, va);

    // Each augmented image is a shifted/mirrored copy: its pixel multiset minus padding is a
    // subset of the original's, and the pixel sum never grows (padding is the minimum value).
    for (a, o) in va.chunks(784).zip(v0.chunks(784)) {
        let (sa, so): (f32, f32) = (
            a.iter().map(|v| v - lo).sum(),
            o.iter().map(|v| v - lo).sum(),
        );
        assert!(sa <= so + 1e-2, "{sa} > {so}");
    }
}

#[test]
fn augmentation_flip_only_mirrors() {
    let aug = Augment::new(9).random_hflip();
    let img: Vec<f32> = (0..2 * 3 * 4).map(|v| v as f32).collect();
    let mut scratch = Vec::new();
    let mut flipped = 0;
    for i in 0..64 {
        let mut x = img.clone();
        aug.apply(0, i, &mut x, [2, 3, 4], 0.0, &mut scratch)
            .unwrap();
        if aug.draw(0, i).flip {
            flipped += 1;
            for (row, orig) in x.chunks(4).zip(img.chunks(4)) {
                assert_eq!(row, orig.iter().rev().copied().collect::<Vec<_>>());
            }
        } else {
            assert_eq!(x, img);
        }
    }
    assert!((16..48).contains(&flipped), "{flipped}");
}

// ---------------------------------------------------------------- synthetic

#[test]
fn synthetic_dataset_shapes_and_determinism() {
    let ds = SyntheticDataset::new(1000, [3, 8, 8], 7, 11).unwrap();
    assert_eq!(
        (ds.len(), ds.item_shape(), ds.num_classes()),
        (1000, [3, 8, 8], 7)
    );
    let (img, label) = ds.get(999).unwrap();
    assert_eq!(img.len(), 192);
    assert!((0..7).contains(&label));
    assert_eq!(
        ds.get(999).unwrap(),
        SyntheticDataset::new(1000, [3, 8, 8], 7, 11)
            .unwrap()
            .get(999)
            .unwrap()
    );
    assert_ne!(
        ds.get(0).unwrap().0,
        SyntheticDataset::new(1000, [3, 8, 8], 7, 12)
            .unwrap()
            .get(0)
            .unwrap()
            .0
    );
    assert!(ds.get(1000).is_err());

    let loader = DataLoader::new(ds, 100).unwrap().shuffle(0);
    let batches: Vec<_> = loader.epoch(0).map(|b| b.unwrap()).collect();
    assert_eq!(batches.len(), 10);
    assert_eq!(batches[0].0.dims(), &[100, 3, 8, 8]);
    let labels: HashSet<i64> = batches
        .iter()
        .flat_map(|b| b.1.to_vec::<i64>().unwrap())
        .collect();
    assert_eq!(labels, (0..7).collect());

    // Same-class images share a prototype: with no noise they are identical.
    let clean = SyntheticDataset::with_noise(50, [1, 4, 4], 3, 1, 0.0).unwrap();
    let (a, la) = clean.get(0).unwrap();
    let j = (1..50).find(|&j| clean.label(j) == la).unwrap();
    assert_eq!(clean.get(j).unwrap().0, a);

    assert!(SyntheticDataset::new(10, [0, 4, 4], 3, 1).is_err());
    assert!(SyntheticDataset::new(10, [1, 4, 4], 0, 1).is_err());
    assert!(SyntheticDataset::with_noise(10, [1, 4, 4], 3, 1, f32::NAN).is_err());
    assert!(SyntheticDataset::new(10, [1 << 20, 1 << 20, 1 << 20], 3, 1).is_err());
}
