//! dtype conversion.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::CpuStorage;
use crate::base::DType;

/// Converts through f64 only where needed: f32 → f16/bf16 rounds once (round to nearest even),
/// as the GPU's `cvt.rn` does.
pub fn to_dtype(s: &CpuStorage, dtype: DType) -> CpuStorage {
    use CpuStorage as S;
    if s.dtype_of() == dtype {
        return s.clone();
    }
    match (s, dtype) {
        (S::F32(v), DType::F16) => S::F16(narrow(v)),
        (S::F32(v), DType::BF16) => S::BF16(narrow(v)),
        (S::F32(v), DType::F64) => S::F64(v.iter().map(|&x| x as f64).collect()),
        (S::F16(v), DType::F32) => S::F32(widen(v)),
        (S::BF16(v), DType::F32) => S::F32(widen(v)),
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

/// A half type whose slices convert to and from f32 in bulk (half's vectorised F16C/SIMD paths
/// where the CPU has them; per element they cost a function call each).
pub(crate) trait HalfSlice: Sized + Copy + Default {
    fn widen_into(src: &[Self], dst: &mut [f32]);
    fn narrow_into(src: &[f32], dst: &mut [Self]);
}

impl HalfSlice for f16 {
    fn widen_into(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    fn narrow_into(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src)
    }
}

impl HalfSlice for bf16 {
    fn widen_into(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    fn narrow_into(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src)
    }
}

/// Exact widening of a half slice.
pub(crate) fn widen<H: HalfSlice>(src: &[H]) -> Vec<f32> {
    let mut out = vec![0.0; src.len()];
    H::widen_into(src, &mut out);
    out
}

/// Round-to-nearest-even narrowing of an f32 slice.
pub(crate) fn narrow<H: HalfSlice>(src: &[f32]) -> Vec<H> {
    let mut out = vec![H::default(); src.len()];
    H::narrow_into(src, &mut out);
    out
}

/// `f` over f32 copies of two half slices, rounded back once: how the CPU runs convolutions on
/// half inputs. The arithmetic is the generic kernels' (widen exactly, accumulate in f32, round
/// the result once), with the conversions done in two bulk passes instead of per tap.
pub(crate) fn via_f32<H: HalfSlice>(
    a: &[H],
    b: &[H],
    f: impl FnOnce(&[f32], &[f32]) -> Vec<f32>,
) -> Vec<H> {
    narrow(&f(&widen(a), &widen(b)))
}

impl CpuStorage {
    fn dtype_of(&self) -> DType {
        crate::backend::BackendStorage::dtype(self)
    }

    /// The first `len` values of `it` in `dtype`, for a count a user's shape decides:
    /// [`crate::base::Error::OutOfMemory`] naming `op` when the host cannot hold them.
    pub(crate) fn try_from_f64_iter(
        op: &'static str,
        dtype: DType,
        len: usize,
        it: impl Iterator<Item = f64>,
    ) -> crate::base::Result<CpuStorage> {
        use super::alloc::try_collect;
        Ok(match dtype {
            DType::F16 => CpuStorage::F16(try_collect(op, len, it.map(f16::from_f64))?),
            DType::BF16 => CpuStorage::BF16(try_collect(op, len, it.map(bf16::from_f64))?),
            DType::F32 => CpuStorage::F32(try_collect(op, len, it.map(|x| x as f32))?),
            DType::F64 => CpuStorage::F64(try_collect(op, len, it)?),
            DType::I64 => CpuStorage::I64(try_collect(op, len, it.map(|x| x as i64))?),
        })
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
