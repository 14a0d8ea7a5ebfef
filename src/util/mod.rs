//! Small utilities that every floor may use and that import nothing of the crate but its error
//! type: atomic file replacement (`atomic`), the Philox counter-based generator (`philox`).

pub mod atomic;
pub mod philox;

pub use atomic::write_atomic;
