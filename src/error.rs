//! The crate's one error type. Every variant names the operation and the values that were wrong,
//! so that a user reading the message knows what to change without a debugger.

use crate::tensor::{DType, Device, Shape};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Operand shapes do not fit the operation (broadcast, matmul, conv, ...).
    #[error("{op}: shape mismatch: {detail} (lhs {lhs:?}, rhs {rhs:?})")]
    ShapeMismatch {
        op: &'static str,
        lhs: Shape,
        rhs: Shape,
        detail: String,
    },

    /// A shape argument is invalid on its own (bad reshape, dim out of range, empty cat, ...).
    #[error("{op}: invalid shape: {detail} (shape {shape:?})")]
    InvalidShape {
        op: &'static str,
        shape: Shape,
        detail: String,
    },

    #[error("{op}: dimension {dim} out of range for a tensor of rank {rank}")]
    DimOutOfRange {
        op: &'static str,
        dim: isize,
        rank: usize,
    },

    #[error("{op}: dtype mismatch: lhs {lhs:?}, rhs {rhs:?}")]
    DTypeMismatch {
        op: &'static str,
        lhs: DType,
        rhs: DType,
    },

    #[error("{op}: dtype {got:?} is not supported; expected {expected}")]
    UnsupportedDType {
        op: &'static str,
        got: DType,
        expected: &'static str,
    },

    #[error("{op}: device mismatch: lhs on {lhs:?}, rhs on {rhs:?}")]
    DeviceMismatch {
        op: &'static str,
        lhs: Device,
        rhs: Device,
    },

    /// A numeric argument outside what the operation allows (negative stride, lr < 0, ...).
    #[error("{op}: invalid argument {name} = {value}: {allowed}")]
    InvalidArgument {
        op: &'static str,
        name: &'static str,
        value: String,
        allowed: String,
    },

    /// A value read from a tensor was not finite where it must be (a NaN loss, ...).
    #[error("{op}: non-finite value: {detail}")]
    NonFinite { op: &'static str, detail: String },

    /// Autograd misuse: backward of a tensor that is not scalar, a missing graph, ...
    #[error("backward: {0}")]
    Backward(String),

    /// A configuration file or value (policy TOML, run config) is wrong.
    #[error("config {file}: key `{key}` = {value}: {allowed}")]
    Config {
        file: String,
        key: String,
        value: String,
        allowed: String,
    },

    /// A data file (IDX, CIFAR, checkpoint) is truncated or corrupt.
    #[error("{path}: bad {format} data: {detail}")]
    DataFormat {
        path: String,
        format: &'static str,
        detail: String,
    },

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// CUDA is not usable here (no driver, no GPU, a missing library) or one of its calls failed.
    #[error("cuda: {0}")]
    Cuda(String),

    /// A kernel failed to compile; carries NVRTC's log.
    #[error("nvrtc: compiling {kernel} failed:\n{log}")]
    Compile { kernel: String, log: String },

    /// Something that the crate cannot do yet on this device or dtype.
    /// Work that cannot go into a CUDA graph met during capture (a host read, a CPU tensor op, an
    /// allocation a cache would keep, a first use that searches or compiles), or a captured graph
    /// that may no longer be replayed. The capture is abandoned; nothing was replayed wrong.
    #[error("{op}: CUDA-graph capture: {detail}")]
    Capture { op: &'static str, detail: String },

    #[error("{op}: not supported: {detail}")]
    Unsupported { op: &'static str, detail: String },

    /// A distributed run failed: a peer process died or hung, the rendezvous failed, the ranks
    /// disagree (models, dtypes, collectives), or a launch setting is wrong. `rank` is the
    /// process reporting it; `culprit`, when known, the rank that caused it.
    #[error("distributed (rank {rank} of {world_size}): {detail}")]
    Distributed {
        rank: usize,
        world_size: usize,
        culprit: Option<usize>,
        detail: String,
    },

    /// A state dict (a weights file, a checkpoint) does not fit the module or optimizer it is
    /// loaded into: every problem at once, each naming the tensor and both shapes/dtypes.
    #[error("{context}: does not match ({} problem(s)): {}", .problems.len(), join_problems(.problems))]
    StateMismatch {
        /// The operation and, when there is one, the file.
        context: String,
        problems: Vec<Mismatch>,
    },
}

/// One tensor of a state dict that does not fit where it is loaded ("expected" is the module's
/// or optimizer's side, "found" the state's).
#[derive(Clone, Debug, PartialEq)]
pub enum Mismatch {
    /// The destination has the tensor, the state does not.
    Missing {
        name: String,
        shape: Shape,
        dtype: DType,
    },
    /// The state has a tensor that the destination has not.
    Unexpected {
        name: String,
        shape: Shape,
        dtype: DType,
    },
    Shape {
        name: String,
        expected: Shape,
        found: Shape,
    },
    /// A kind of dtype that cannot be converted (a float where integers are kept, ...).
    DType {
        name: String,
        expected: DType,
        found: DType,
    },
    /// A mismatch of layout rather than of one tensor (the number of optimizer groups, ...).
    Layout { name: String, detail: String },
}

impl Mismatch {
    /// The tensor (or layout item) the problem is about.
    pub fn name(&self) -> &str {
        match self {
            Mismatch::Missing { name, .. }
            | Mismatch::Unexpected { name, .. }
            | Mismatch::Shape { name, .. }
            | Mismatch::DType { name, .. }
            | Mismatch::Layout { name, .. } => name,
        }
    }
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mismatch::Missing { name, shape, dtype } => {
                write!(f, "missing `{name}` ({dtype} {:?})", shape.dims())
            }
            Mismatch::Unexpected { name, shape, dtype } => {
                write!(f, "unexpected `{name}` ({dtype} {:?})", shape.dims())
            }
            Mismatch::Shape {
                name,
                expected,
                found,
            } => write!(
                f,
                "`{name}`: shape {:?} expected, {:?} found",
                expected.dims(),
                found.dims()
            ),
            Mismatch::DType {
                name,
                expected,
                found,
            } => write!(f, "`{name}`: dtype {expected} expected, {found} found"),
            Mismatch::Layout { name, detail } => write!(f, "`{name}`: {detail}"),
        }
    }
}

fn join_problems(problems: &[Mismatch]) -> String {
    problems
        .iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    pub fn invalid_arg(
        op: &'static str,
        name: &'static str,
        value: impl std::fmt::Display,
        allowed: impl Into<String>,
    ) -> Self {
        Error::InvalidArgument {
            op,
            name,
            value: value.to_string(),
            allowed: allowed.into(),
        }
    }

    pub fn invalid_shape(op: &'static str, shape: &Shape, detail: impl Into<String>) -> Self {
        Error::InvalidShape {
            op,
            shape: shape.clone(),
            detail: detail.into(),
        }
    }

    pub fn shape_mismatch(
        op: &'static str,
        lhs: &Shape,
        rhs: &Shape,
        detail: impl Into<String>,
    ) -> Self {
        Error::ShapeMismatch {
            op,
            lhs: lhs.clone(),
            rhs: rhs.clone(),
            detail: detail.into(),
        }
    }
}
