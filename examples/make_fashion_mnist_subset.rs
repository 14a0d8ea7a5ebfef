//! Writes the bundled Fashion-MNIST subset, `data/fashion-mnist-subset/`: the first 10,000
//! training and the first 2,000 test images and labels of the official files, in the same
//! gzip'd IDX format and file names. Also prints the pixel mean and standard deviation of the
//! full training set (the normalisation constants in `src/data/fashion_mnist.rs`).
//!
//!     cargo run --release --example make_fashion_mnist_subset [SOURCE_DIR] [OUT_DIR]
//!
//! SOURCE_DIR defaults to /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist),
//! OUT_DIR to data/fashion-mnist-subset. The output is byte-for-byte reproducible (the gzip
//! header carries no time stamp).

use std::path::PathBuf;

use mixprec::data::fashion_mnist::{Split, SYSTEM_DIR};
use mixprec::data::idx::{self, IdxImages};

const TRAIN_COUNT: usize = 10_000;
const TEST_COUNT: usize = 2_000;

fn main() -> mixprec::Result<()> {
    let mut args = std::env::args().skip(1);
    let src = PathBuf::from(args.next().unwrap_or_else(|| SYSTEM_DIR.into()));
    let out = PathBuf::from(args.next().unwrap_or_else(|| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/data/fashion-mnist-subset").into()
    }));
    std::fs::create_dir_all(&out)
        .map_err(|e| mixprec::Error::io(format!("creating {}", out.display()), e))?;

    for (split, count) in [(Split::Train, TRAIN_COUNT), (Split::Test, TEST_COUNT)] {
        let (iname, lname) = split.file_names();
        let images = idx::read_images(src.join(iname))?;
        let labels = idx::read_labels(src.join(lname))?;
        if split == Split::Train {
            let n = images.pixels.len() as f64;
            let mean = images.pixels.iter().map(|&p| p as f64 / 255.0).sum::<f64>() / n;
            let var = images
                .pixels
                .iter()
                .map(|&p| (p as f64 / 255.0 - mean).powi(2))
                .sum::<f64>()
                / n;
            println!(
                "full training set: {} images, pixel mean {mean:.5}, std {:.5}",
                images.count,
                var.sqrt()
            );
        }
        let count = count.min(images.count).min(labels.len());
        let n = images.rows * images.cols;
        let subset = IdxImages {
            count,
            rows: images.rows,
            cols: images.cols,
            pixels: images.pixels[..count * n].to_vec(),
        };
        idx::write_images(out.join(iname), &subset)?;
        idx::write_labels(out.join(lname), &labels[..count])?;
        let mut hist = [0usize; 10];
        for &l in &labels[..count] {
            hist[(l as usize).min(9)] += 1;
        }
        println!(
            "{split}: wrote {count} of {} images to {} (labels per class {hist:?})",
            images.count,
            out.display()
        );
    }
    Ok(())
}
