//! Data movement: broadcast, permute, narrow, cat.

use crate::backend::DimSplit;
use crate::tensor::Shape;

pub fn broadcast_to<T: Copy + Default>(x: &[T], src: &Shape, dst: &Shape) -> Vec<T> {
    let strides = src.broadcast_strides(dst);
    strided_copy(x, dst.dims(), &strides)
}

/// `out[i0, .., ir] = x[Σ ik·strides[k]]` over the index space `dims`, row by row.
fn strided_copy<T: Copy + Default>(x: &[T], dims: &[usize], strides: &[usize]) -> Vec<T> {
    let n: usize = dims.iter().product();
    if n == 0 {
        return Vec::new();
    }
    let rank = dims.len();
    if rank == 0 {
        return vec![x[0]];
    }
    let last = dims[rank - 1];
    let ls = strides[rank - 1];
    let mut out = vec![T::default(); n];
    for (r, dst) in out.chunks_mut(last).enumerate() {
        let (mut off, mut rem) = (0usize, r);
        for d in (0..rank - 1).rev() {
            off += (rem % dims[d]) * strides[d];
            rem /= dims[d];
        }
        for (j, o) in dst.iter_mut().enumerate() {
            *o = x[off + j * ls];
        }
    }
    out
}

pub fn permute<T: Copy + Default>(x: &[T], shape: &Shape, perm: &[usize]) -> Vec<T> {
    let src_strides = shape.strides();
    let dims: Vec<usize> = perm.iter().map(|&p| shape.dims()[p]).collect();
    let strides: Vec<usize> = perm.iter().map(|&p| src_strides[p]).collect();
    strided_copy(x, &dims, &strides)
}

pub fn narrow<T: Copy>(
    x: &[T],
    (outer, len, inner): DimSplit,
    start: usize,
    count: usize,
) -> Vec<T> {
    let mut out = Vec::with_capacity(outer * count * inner);
    for o in 0..outer {
        let base = (o * len + start) * inner;
        out.extend_from_slice(&x[base..base + count * inner]);
    }
    out
}

pub fn cat<T: Copy>(parts: &[&[T]], outer: usize, lens: &[usize], inner: usize) -> Vec<T> {
    let total: usize = lens.iter().sum();
    let mut out = Vec::with_capacity(outer * total * inner);
    for o in 0..outer {
        for (p, &l) in parts.iter().zip(lens) {
            out.extend_from_slice(&p[o * l * inner..(o + 1) * l * inner]);
        }
    }
    out
}
