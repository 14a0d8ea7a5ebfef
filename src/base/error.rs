//! The crate's one error type. Every variant names the operation and the values that were wrong,
//! so that a user reading the message knows what to change without a debugger.

use super::{DType, Device, Shape};

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

    /// A configuration value (policy TOML, run config, a command-line flag) is wrong. `value`
    /// is as the file spells it (or as a person would write the number); `at` is where the
    /// file says it, when it comes from a file.
    #[error("config {file}{}: key `{key}` = {value}: {allowed}", at_suffix(.at))]
    Config {
        file: String,
        at: Option<Location>,
        key: String,
        value: String,
        allowed: String,
    },

    /// A configuration file is not valid TOML (a duplicate key, an unquoted string, ...).
    #[error("config {file}{}: TOML syntax: {detail}", at_suffix(.at))]
    ConfigSyntax {
        file: String,
        at: Option<Location>,
        detail: String,
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

    /// An allocation that the shapes asked for does not fit in the device's memory.
    #[error("{op}: out of memory on {device}: {} requested ({detail})", fmt_bytes(*.bytes))]
    OutOfMemory {
        op: &'static str,
        /// Saturates at `u64::MAX` for sizes past the address space.
        bytes: u64,
        device: Device,
        detail: String,
    },

    /// Training stopped because it diverged (the loss or the gradients stayed non-finite).
    #[error("training diverged at step {step}: {detail}")]
    Diverged { step: u64, detail: String },

    /// A run directory cannot be used as asked (another run's files, a live lock, ...).
    #[error("run directory {dir}: {detail}")]
    RunDirectory { dir: String, detail: String },

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

/// A place in a text file: 1-based line and column (in characters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    pub line: u32,
    pub column: u32,
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

/// Bytes for people: `4.0 TiB (4398046511104 bytes)`.
pub fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} bytes");
    }
    let mut v = bytes as f64;
    let mut unit = "bytes";
    for u in UNITS {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    format!("{v:.1} {unit} ({bytes} bytes)")
}

/// `:line:column` after a file name, or nothing.
fn at_suffix(at: &Option<Location>) -> String {
    at.map(|l| format!(":{l}")).unwrap_or_default()
}

/// A number as a person writes it: the shorter of the plain and the exponent form (`0.1`,
/// `65536`, `1e9`, `2.2250738585072014e-308`), never a 300-digit decimal.
pub fn fmt_number(x: f64) -> String {
    if !x.is_finite() {
        return x.to_string();
    }
    let plain = x.to_string();
    let exp = format!("{x:e}");
    if exp.len() + 2 < plain.len() {
        exp
    } else {
        plain
    }
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

    /// A [`Error::Config`] not (yet) tied to a place in a file.
    pub fn config(
        file: impl Into<String>,
        key: impl Into<String>,
        value: impl Into<String>,
        allowed: impl Into<String>,
    ) -> Self {
        Error::Config {
            file: file.into(),
            at: None,
            key: key.into(),
            value: value.into(),
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
