//! Element types. A tensor's dtype is a runtime value: AMP decides precisions while the program
//! runs, so nothing in the type system fixes them.

use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F16,
    BF16,
    F32,
    F64,
    /// Labels and indices.
    I64,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        !matches!(self, DType::I64)
    }

    /// The half types that AMP computes in.
    pub fn is_half(self) -> bool {
        matches!(self, DType::F16 | DType::BF16)
    }

    /// The name used in configs and messages: `f16`, `bf16`, `f32`, `f64`, `i64`.
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I64 => "i64",
        }
    }

    /// Parses the names of [`DType::as_str`] (plus torch's `float16`/`half`/`bfloat16`/`float32`).
    pub fn parse(s: &str) -> Option<DType> {
        Some(match s {
            "f16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "f32" | "float32" | "float" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            "i64" | "int64" | "long" => DType::I64,
            _ => return None,
        })
    }

    /// Type promotion for binary elementwise ops between floats, as PyTorch's: the widest wins;
    /// f16 with bf16 gives f32 (neither represents the other).
    pub fn promote(a: DType, b: DType) -> DType {
        use DType::*;
        match (a, b) {
            _ if a == b => a,
            (F64, _) | (_, F64) => F64,
            (F32, _) | (_, F32) => F32,
            (F16, BF16) | (BF16, F16) => F32,
            (I64, x) | (x, I64) => x,
            _ => F32,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Rust element types that map to a [`DType`].
pub trait WithDType: Copy + Send + Sync + 'static + std::fmt::Debug {
    const DTYPE: DType;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
}

macro_rules! with_dtype {
    ($t:ty, $d:ident, $to:expr, $from:expr) => {
        impl WithDType for $t {
            const DTYPE: DType = DType::$d;
            fn to_f64(self) -> f64 {
                $to(self)
            }
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
        }
    };
}
with_dtype!(f16, F16, |v: f16| v.to_f64(), f16::from_f64);
with_dtype!(bf16, BF16, |v: bf16| v.to_f64(), bf16::from_f64);
with_dtype!(f32, F32, |v: f32| v as f64, |v: f64| v as f32);
with_dtype!(f64, F64, |v: f64| v, |v: f64| v);
with_dtype!(i64, I64, |v: i64| v as f64, |v: f64| v as i64);
