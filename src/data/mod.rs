//! Data: the `Dataset` trait, a shuffling, augmenting `DataLoader` with a pool of worker threads
//! (and pinned-memory uploads to a GPU), the IDX file format, Fashion-MNIST (full or the bundled
//! subset), CIFAR-10 (binary version), torchvision's `ImageFolder` with JPEG/PNG decoding and
//! its image transforms, and a synthetic dataset.
//!
//! ```no_run
//! use mixprec::data::{Augment, DataLoader, FashionMnist, Split};
//! # fn main() -> mixprec::Result<()> {
//! let (train, source) = FashionMnist::load(Split::Train)?;
//! let test = FashionMnist::load_from(&source, Split::Test)?;
//! println!("data: {source}");
//! let loader = DataLoader::new(train, 128)?
//!     .shuffle(42)
//!     .drop_last(true)
//!     .augment(Augment::crop_flip(2, 42))
//!     .prefetch(2);
//! for epoch in 0..2 {
//!     for batch in loader.epoch(epoch) {
//!         let (x, y) = batch?; // [128, 1, 28, 28] F32, [128] I64
//!     }
//! }
//! # let _ = test;
//! # Ok(())
//! # }
//! ```

pub mod cifar10;
pub mod dataset;
pub mod fashion_mnist;
pub mod idx;
#[cfg(feature = "images")]
pub mod image;
#[cfg(feature = "images")]
pub mod image_folder;
#[cfg(feature = "images")]
pub mod image_transforms;
pub mod loader;
pub mod sampler;
pub mod synthetic;
pub mod token_corpus;
pub mod token_loader;
pub mod token_shards;
pub mod tokenizer;
pub mod transforms;
mod workers;

pub use cifar10::Cifar10;
pub use dataset::{Dataset, First, ItemShape};
pub use fashion_mnist::{DataSource, FashionMnist, Split};
#[cfg(feature = "images")]
pub use image::{ColorMode, DecodedImage};
#[cfg(feature = "images")]
pub use image_folder::{BadFiles, ImageFolder, ImageFolderDataset};
#[cfg(feature = "images")]
pub use image_transforms::{
    CenterCrop, ImageTransform, RandomResizedCrop, Resize, IMAGENET_MEAN, IMAGENET_STD,
};
pub use loader::{Batch, DataLoader, EpochIter};
pub use sampler::DistributedSampler;
pub use synthetic::SyntheticDataset;
pub use token_corpus::{prepare_token_shards, tokenize_dir, CorpusOptions, TokenSplit};
pub use token_loader::{TokenLoader, TokenLoaderConfig, TokenLoaderState};
pub use token_shards::{write_token_shard, TokenShard};
pub use tokenizer::Gpt2Tokenizer;
pub use transforms::{Augment, AugmentDraw};
