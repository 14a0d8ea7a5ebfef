//! The one strided copy every view materialises through, and concatenation.

use crate::base::Layout;

/// The elements of `src` (read through its strides) written at their positions in `dst`, a
/// dense layout at offset 0.
pub fn copy_strided<T: Copy + Default>(x: &[T], src: &Layout, dst: &Layout) -> Vec<T> {
    let mut out = vec![T::default(); dst.storage_end()];
    if src.elem_count() == 0 {
        // An empty view's offset may lie past its (empty) buffer.
        return out;
    }
    if src.is_contiguous() && dst.is_contiguous() {
        let (a, n) = (src.offset(), src.elem_count());
        out.copy_from_slice(&x[a..a + n]);
        return out;
    }
    for (s, d) in src.positions().zip(dst.positions()) {
        out[d] = x[s];
    }
    out
}

/// Concatenates contiguous parts along the middle of `(outer, lens[i], inner)`.
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
