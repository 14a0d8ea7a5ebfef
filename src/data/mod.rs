//! Data: the `Dataset` trait and the IDX file format (MNIST / Fashion-MNIST).

pub mod dataset;
pub mod idx;

pub use dataset::{Dataset, ItemShape};
