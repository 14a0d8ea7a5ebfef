//! The floor every other layer stands on: element types, shapes, layouts, devices and the
//! crate's error type. Nothing here imports anything of the crate outside `base`, so backends,
//! tensors and everything above may import it without a cycle.

pub mod device;
pub mod dtype;
pub mod error;
pub mod layout;
pub mod shape;

pub use device::Device;
pub use dtype::{DType, WithDType};
pub use error::{Error, Mismatch, Result};
pub use layout::{Layout, MemoryFormat};
pub use shape::Shape;
