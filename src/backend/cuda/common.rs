//! What the op families of the CUDA backend share: kernel-name suffixes, the `Strided` launch
//! argument (mirrors the kernels' shared header) and the accumulation dtype.

use crate::base::error::{Error, Result};
use crate::base::DType;

/// The kernel-name suffix of a dtype.
pub(crate) fn sfx(d: DType) -> &'static str {
    d.as_str()
}

/// The kernel-name suffix of a float dtype, or an error naming `op` (a second line of defence:
/// the tensor layer checks dtypes first).
pub(crate) fn float_sfx(op: &'static str, d: DType) -> Result<&'static str> {
    if d.is_float() {
        Ok(sfx(d))
    } else {
        Err(Error::UnsupportedDType {
            op,
            got: d,
            expected: "a float dtype",
        })
    }
}

/// The accumulation dtype of a float dtype: f32, f64 for f64.
pub(crate) fn acc_dtype(d: DType) -> DType {
    if d == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Two operands of one dtype: a kernel reading one as the other's type would read out of
/// bounds, so this holds even for direct backend calls the tensor layer did not check.
pub(crate) fn same_dtype(
    op: &'static str,
    a: &super::storage::CudaStorage,
    b: &super::storage::CudaStorage,
) -> Result<()> {
    use crate::backend::BackendStorage;
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    Ok(())
}

/// The element-size suffix of the kernels that only move data.
pub(crate) fn esz(d: DType) -> usize {
    d.size_in_bytes()
}

/// Mirrors `Strided` in the kernels' shared header: an index space and two stride vectors over it.
pub(crate) const MAX_DIMS: usize = 8;
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Strided {
    pub rank: i64,
    pub dims: [i64; MAX_DIMS],
    pub sa: [i64; MAX_DIMS],
    pub sb: [i64; MAX_DIMS],
}

pub(crate) fn strided(
    op: &'static str,
    dims: &[usize],
    sa: &[usize],
    sb: &[usize],
) -> Result<Strided> {
    if dims.len() > MAX_DIMS {
        return Err(Error::Unsupported {
            op,
            detail: format!(
                "the CUDA backend handles up to {MAX_DIMS} dimensions here, got {}",
                dims.len()
            ),
        });
    }
    let mut s = Strided {
        rank: dims.len() as i64,
        dims: [1; MAX_DIMS],
        sa: [0; MAX_DIMS],
        sb: [0; MAX_DIMS],
    };
    for (k, &d) in dims.iter().enumerate() {
        s.dims[k] = d as i64;
        s.sa[k] = sa.get(k).copied().unwrap_or(0) as i64;
        s.sb[k] = sb.get(k).copied().unwrap_or(0) as i64;
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_args_pad_and_reject_high_ranks() {
        let s = strided("t", &[2, 3], &[3, 1], &[0, 1]).unwrap();
        assert_eq!(s.rank, 2);
        assert_eq!(&s.dims[..3], &[2, 3, 1]);
        assert_eq!(&s.sa[..2], &[3, 1]);
        assert_eq!(&s.sb[..2], &[0, 1]);
        assert!(strided("t", &[1; 9], &[0; 9], &[0; 9]).is_err());
        // The kernels' view of the struct: 1 + 3·8 words.
        assert_eq!(std::mem::size_of::<Strided>(), 8 * (1 + 3 * MAX_DIMS));
    }

    #[test]
    fn accumulation_dtypes() {
        assert_eq!(acc_dtype(DType::F16), DType::F32);
        assert_eq!(acc_dtype(DType::BF16), DType::F32);
        assert_eq!(acc_dtype(DType::F64), DType::F64);
        assert!(float_sfx("t", DType::I64).is_err());
        assert_eq!(float_sfx("t", DType::BF16).unwrap(), "bf16");
    }
}
