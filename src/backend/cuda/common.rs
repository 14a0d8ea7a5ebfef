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

/// The kernels' view of an index space `dims` read through strides `sa` and `sb`, simplified
/// first: dims of size 1 dropped, and neighbours merged where both views step through them as
/// through one dim (a broadcast scalar over a contiguous tensor becomes one dim). The kernels
/// split each index into coordinates, a division per dim: fewer dims, less of that work.
pub(crate) fn strided(
    op: &'static str,
    dims: &[usize],
    sa: &[usize],
    sb: &[usize],
) -> Result<Strided> {
    // (dim, stride a, stride b), innermost last.
    let mut kept: Vec<(usize, usize, usize)> = Vec::with_capacity(dims.len());
    for (k, &d) in dims.iter().enumerate() {
        if d == 1 {
            continue;
        }
        let (a, b) = (
            sa.get(k).copied().unwrap_or(0),
            sb.get(k).copied().unwrap_or(0),
        );
        match kept.last_mut() {
            // The previous (outer) dim steps as one more period of this one in both views.
            Some(last) if last.1 == a * d && last.2 == b * d => *last = (last.0 * d, a, b),
            _ => kept.push((d, a, b)),
        }
    }
    if kept.len() > MAX_DIMS {
        return Err(Error::Unsupported {
            op,
            detail: format!(
                "the CUDA backend handles up to {MAX_DIMS} dimensions here, got {} \
                 (after merging those laid out as one)",
                kept.len()
            ),
        });
    }
    let mut s = Strided {
        rank: kept.len() as i64,
        dims: [1; MAX_DIMS],
        sa: [0; MAX_DIMS],
        sb: [0; MAX_DIMS],
    };
    for (k, &(d, a, b)) in kept.iter().enumerate() {
        s.dims[k] = d as i64;
        s.sa[k] = a as i64;
        s.sb[k] = b as i64;
    }
    Ok(s)
}

/// The pack space of a strided op whose innermost dim is read and written in 16-byte packs:
/// `Some` when that dim's size is a multiple of the pack (`16 / elem` elements), view `b` (the
/// destination, or a binary op's second operand) and view `a` each step through it one element
/// at a time or not at all (stride 0, a broadcast), and every view that steps through it starts
/// 16-byte aligned with its other strides multiples of the pack. The inner dim becomes
/// `size / pack` with strides `× pack`: an index of the result is a pack, its offsets that of
/// the pack's first element. One index split then serves a pack instead of one element, which
/// is most of a strided kernel's time when the inner dim is as short as an attention head's.
/// `out` is a row-major result written alongside (always a unit inner stride), given by its
/// pointer for the alignment check.
pub(crate) fn packed(
    s: &Strided,
    elem: usize,
    (pa, pb, out): (u64, u64, Option<u64>),
) -> Option<Strided> {
    let v = (16 / elem) as i64;
    let r = usize::try_from(s.rank).ok()?.checked_sub(1)?;
    if s.dims[r] % v != 0 {
        return None;
    }
    let view_ok = |st: &[i64; MAX_DIMS], ptr: u64| match st[r] {
        0 => true,
        1 => ptr.is_multiple_of(16) && st[..r].iter().all(|&x| x % v == 0),
        _ => false,
    };
    if !view_ok(&s.sa, pa) || !view_ok(&s.sb, pb) || out.is_some_and(|p| p % 16 != 0) {
        return None;
    }
    let mut q = *s;
    q.dims[r] /= v;
    q.sa[r] *= v;
    q.sb[r] *= v;
    Some(q)
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
        // Nine dims that no merge can join.
        let sa: Vec<usize> = (0..9).map(|k| 1 << k).collect();
        assert!(strided("t", &[2; 9], &sa, &[0; 9]).is_err());
        // Dims of size 1 go; a scalar broadcast over a contiguous tensor is one dim.
        let s = strided("t", &[4, 1, 3, 5], &[0, 0, 0, 0], &[15, 15, 5, 1]).unwrap();
        assert_eq!((s.rank, s.dims[0], s.sa[0], s.sb[0]), (1, 60, 0, 1));
        // A transposed view stays split where its strides are not one dim's.
        let s = strided("t", &[2, 3, 4], &[12, 1, 3], &[12, 4, 1]).unwrap();
        assert_eq!(s.rank, 3);
        // Outer dims that are one dim of both views merge, inner ones stay.
        let s = strided("t", &[2, 3, 4, 5], &[60, 20, 1, 4], &[60, 20, 5, 1]).unwrap();
        assert_eq!((s.rank, s.dims[0], s.dims[1], s.dims[2]), (3, 6, 4, 5));
        assert_eq!((s.sa[0], s.sb[0]), (20, 20));
        // The kernels' view of the struct: 1 + 3·8 words.
        assert_eq!(std::mem::size_of::<Strided>(), 8 * (1 + 3 * MAX_DIMS));
    }

    #[test]
    fn pack_space_only_where_every_view_allows_it() {
        // A head view [B, H, T, D] of a [B, T, H, D] projection against a row-major operand, 2-byte
        // elements (8 per pack): D = 64 becomes 8 packs, the inner strides 8.
        let (dims, heads, rows) = ([2, 3, 9, 64], [1728, 64, 192, 1], [1728, 576, 64, 1]);
        let s = strided("t", &dims, &heads, &rows).unwrap();
        let q = packed(&s, 2, (0, 256, Some(512))).unwrap();
        let r = q.rank as usize - 1;
        assert_eq!((q.dims[r], q.sa[r], q.sb[r]), (8, 8, 8));
        assert_eq!(&q.dims[..r], &s.dims[..r]);
        // A view that starts off a 16-byte boundary, or an output that does, has no packs.
        assert!(packed(&s, 2, (2, 256, Some(512))).is_none());
        assert!(packed(&s, 2, (0, 256, Some(8))).is_none());
        // An inner dim that is no multiple of a pack (12 two-byte elements), or an outer stride
        // that would put a pack across a boundary.
        let s12 = strided("t", &[2, 3, 9, 12], &[324, 12, 36, 1], &[324, 108, 12, 1]).unwrap();
        assert!(packed(&s12, 2, (0, 0, None)).is_none());
        assert!(packed(&s12, 4, (0, 0, None)).is_some());
        // A broadcast scalar (stride 0) over a row-major tensor: one dim of packs, the scalar
        // repeated, at any address.
        let s = strided("t", &[4, 64], &[0, 0], &[64, 1]).unwrap();
        let q = packed(&s, 4, (6, 0, None)).unwrap();
        assert_eq!((q.rank, q.dims[0], q.sa[0], q.sb[0]), (1, 64, 0, 4));
        // A transposed view steps through the inner dim by a whole row: no packs.
        let s = strided("t", &[64, 64], &[1, 64], &[64, 1]).unwrap();
        assert!(packed(&s, 2, (0, 0, None)).is_none());
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
