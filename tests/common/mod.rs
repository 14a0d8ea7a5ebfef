//! Helpers shared by the integration tests (each test file includes this with `mod common;`).

pub mod gradcheck;
