//! dtype conversion.

use half::{bf16, f16};

use super::CpuStorage;
use crate::tensor::DType;

/// Converts through f64 only where needed: f32 → f16/bf16 rounds once (round to nearest even),
/// as the GPU's `cvt.rn` does.
pub fn to_dtype(s: &CpuStorage, dtype: DType) -> CpuStorage {
    use CpuStorage as S;
    if s.dtype_of() == dtype {
        return s.clone();
    }
    match (s, dtype) {
        (S::F32(v), DType::F16) => S::F16(v.iter().map(|&x| f16::from_f32(x)).collect()),
        (S::F32(v), DType::BF16) => S::BF16(v.iter().map(|&x| bf16::from_f32(x)).collect()),
        (S::F32(v), DType::F64) => S::F64(v.iter().map(|&x| x as f64).collect()),
        (S::F16(v), DType::F32) => S::F32(v.iter().map(|x| x.to_f32()).collect()),
        (S::BF16(v), DType::F32) => S::F32(v.iter().map(|x| x.to_f32()).collect()),
        (S::F16(v), DType::BF16) => S::BF16(v.iter().map(|x| bf16::from_f32(x.to_f32())).collect()),
        (S::BF16(v), DType::F16) => S::F16(v.iter().map(|x| f16::from_f32(x.to_f32())).collect()),
        (S::F64(v), DType::F32) => S::F32(v.iter().map(|&x| x as f32).collect()),
        (S::F64(v), DType::F16) => S::F16(v.iter().map(|&x| f16::from_f64(x)).collect()),
        (S::F64(v), DType::BF16) => S::BF16(v.iter().map(|&x| bf16::from_f64(x)).collect()),
        (S::I64(v), _) => CpuStorage::from_f64_iter(dtype, v.iter().map(|&x| x as f64)),
        (src, DType::I64) => S::I64(src.to_f64_vec().into_iter().map(|x| x as i64).collect()),
        (src, _) => CpuStorage::from_f64_iter(dtype, src.to_f64_vec().into_iter()),
    }
}

impl CpuStorage {
    fn dtype_of(&self) -> DType {
        crate::backend::BackendStorage::dtype(self)
    }

    pub(crate) fn from_f64_iter(dtype: DType, it: impl Iterator<Item = f64>) -> CpuStorage {
        match dtype {
            DType::F16 => CpuStorage::F16(it.map(f16::from_f64).collect()),
            DType::BF16 => CpuStorage::BF16(it.map(bf16::from_f64).collect()),
            DType::F32 => CpuStorage::F32(it.map(|x| x as f32).collect()),
            DType::F64 => CpuStorage::F64(it.collect()),
            DType::I64 => CpuStorage::I64(it.map(|x| x as i64).collect()),
        }
    }
}
