//! Data: the `Dataset` trait, a shuffling, augmenting, prefetching `DataLoader`, the IDX file
//! format, Fashion-MNIST (full or the bundled subset) and a synthetic dataset.
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

pub mod dataset;
pub mod fashion_mnist;
pub mod idx;
pub mod loader;
pub mod sampler;
pub mod synthetic;
pub mod transforms;

pub use dataset::{Dataset, First, ItemShape};
pub use fashion_mnist::{DataSource, FashionMnist, Split};
pub use loader::{Batch, DataLoader, EpochIter};
pub use sampler::DistributedSampler;
pub use synthetic::SyntheticDataset;
pub use transforms::{Augment, AugmentDraw};
