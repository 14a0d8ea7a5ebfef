//! The backend contract by op family: each file holds one family's parameter types and its
//! trait, which both backends implement (`backend/cpu/X.rs`, `backend/cuda/X.rs` for the family
//! `X`). A new family is a new file here plus its two lines below (see ARCHITECTURE.md, "Adding
//! an op family").

mod activation;
mod attention;
mod batch_norm;
mod conv;
mod cross_entropy;
mod dropout;
mod elementwise;
mod embedding;
mod index;
mod layer_norm;
mod matmul;
mod pool;
mod reduce;
mod softmax;

pub use activation::*;
pub use attention::*;
pub use batch_norm::*;
pub use conv::*;
pub use cross_entropy::*;
pub use dropout::*;
pub use elementwise::*;
pub use embedding::*;
pub use index::*;
pub use layer_norm::*;
pub use matmul::*;
pub use pool::*;
pub use reduce::*;
pub use softmax::*;

/// `(outer, len, inner)`: a tensor seen as a 3-D block around one dimension.
pub type DimSplit = (usize, usize, usize);
