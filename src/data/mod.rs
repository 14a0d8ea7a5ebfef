//! Data: the `Dataset` trait, a shuffling, augmenting, prefetching `DataLoader`, the IDX file
//! format and a synthetic dataset.

pub mod dataset;
pub mod idx;
pub mod loader;
pub mod synthetic;
pub mod transforms;

pub use dataset::{Dataset, ItemShape};
pub use loader::{Batch, DataLoader, EpochIter};
pub use synthetic::SyntheticDataset;
pub use transforms::{Augment, AugmentDraw};
