//! Small utilities that every floor may use and that import nothing of the crate but its error
//! type: atomic file replacement (`atomic`).

pub mod atomic;

pub use atomic::write_atomic;
