//! Max, average and adaptive average pooling over NCHW, one `(n, c)` plane at a time (planes are
//! spread over rayon's threads on big inputs). Windows follow PyTorch's floor-mode arithmetic.

use num_traits::{Float, Zero};
use rayon::prelude::*;

use super::{contiguous_only, map_float, CpuStorage};
use super::{Elem, PAR_THRESHOLD};
use crate::backend::PoolOps;
use crate::backend::{AdaptivePoolParams, Pool2dParams};
use crate::base::error::Result;
use crate::base::Layout;

/// Runs `f(plane, out_plane)` over the planes of `out` (`plane_len` elements each).
fn per_plane<T: Send>(
    out: &mut [T],
    plane_len: usize,
    total_work: usize,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) {
    if plane_len == 0 {
        return;
    }
    if total_work >= PAR_THRESHOLD {
        out.par_chunks_mut(plane_len)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    } else {
        out.chunks_mut(plane_len)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    }
}

/// Window `start..end` of output index `o` along one dim, clipped to the input, and the window
/// size PyTorch divides by with `count_include_pad` (clipped to the padded input only).
fn window(o: usize, k: usize, s: usize, pad: usize, len: usize) -> (usize, usize, usize) {
    let start = (o * s) as isize - pad as isize;
    let end = (start + k as isize).min((len + pad) as isize);
    let padded = (end - start) as usize;
    let (start, end) = (start.max(0) as usize, (end.max(0) as usize).min(len));
    (start, end.max(start), padded)
}

pub fn max_pool2d<T: Elem>(x: &[T], p: &Pool2dParams) -> (Vec<T>, Vec<i64>) {
    let (oh, ow, hw) = (p.out_h(), p.out_w(), p.h * p.w);
    let plane = oh * ow;
    let mut out = vec![T::default(); p.n * p.c * plane];
    let mut idx = vec![0i64; out.len()];
    let body = |(pi, (out, idx)): (usize, (&mut [T], &mut [i64]))| {
        let src = &x[pi * hw..][..hw];
        for oy in 0..oh {
            let (y0, y1, _) = window(oy, p.kh, p.stride.0, p.padding.0, p.h);
            for ox in 0..ow {
                let (x0, x1, _) = window(ox, p.kw, p.stride.1, p.padding.1, p.w);
                // Padding cells never win: start from -inf at the first real cell.
                let mut best = T::Acc::neg_infinity();
                let mut at = y0 * p.w + x0;
                for iy in y0..y1 {
                    for ix in x0..x1 {
                        let v = src[iy * p.w + ix].to_acc();
                        // First maximum wins ties; a NaN wins (and stays) as in PyTorch.
                        if v > best || (v.is_nan() && !best.is_nan()) {
                            best = v;
                            at = iy * p.w + ix;
                        }
                    }
                }
                out[oy * ow + ox] = src.get(at).copied().unwrap_or_default();
                idx[oy * ow + ox] = at as i64;
            }
        }
    };
    if plane > 0 && x.len() >= PAR_THRESHOLD {
        let chunks = out.par_chunks_mut(plane).zip(idx.par_chunks_mut(plane));
        chunks.enumerate().for_each(body);
    } else if plane > 0 {
        let chunks = out.chunks_mut(plane).zip(idx.chunks_mut(plane));
        chunks.enumerate().for_each(body);
    }
    (out, idx)
}

pub fn max_pool2d_backward<T: Elem>(g: &[T], idx: &[i64], p: &Pool2dParams) -> Vec<T> {
    let (plane, hw) = (p.out_h() * p.out_w(), p.h * p.w);
    let mut out = vec![T::default(); p.n * p.c * hw];
    per_plane(&mut out, hw, p.n * p.c * hw, |pi, dst| {
        // Overlapping windows may pick one cell several times: sum in Acc, round once.
        let mut acc = vec![T::Acc::zero(); hw];
        let (gs, is) = (&g[pi * plane..][..plane], &idx[pi * plane..][..plane]);
        for (&gv, &i) in gs.iter().zip(is) {
            if let Some(a) = usize::try_from(i).ok().and_then(|i| acc.get_mut(i)) {
                *a += gv.to_acc();
            }
        }
        for (d, a) in dst.iter_mut().zip(acc) {
            *d = T::from_acc(a);
        }
    });
    out
}

/// `(y0, y1, x0, x1, divisor)` of each output cell of an average pooling, in row-major order.
fn avg_windows(p: &Pool2dParams) -> Vec<(usize, usize, usize, usize, usize)> {
    let (oh, ow) = (p.out_h(), p.out_w());
    let mut v = Vec::with_capacity(oh * ow);
    for oy in 0..oh {
        let (y0, y1, ph) = window(oy, p.kh, p.stride.0, p.padding.0, p.h);
        for ox in 0..ow {
            let (x0, x1, pw) = window(ox, p.kw, p.stride.1, p.padding.1, p.w);
            let div = if p.count_include_pad {
                ph * pw
            } else {
                (y1 - y0) * (x1 - x0)
            };
            v.push((y0, y1, x0, x1, div.max(1)));
        }
    }
    v
}

pub fn avg_pool2d<T: Elem>(x: &[T], p: &Pool2dParams) -> Vec<T> {
    let hw = p.h * p.w;
    let wins = avg_windows(p);
    let mut out = vec![T::default(); p.n * p.c * wins.len()];
    per_plane(&mut out, wins.len(), x.len(), |pi, dst| {
        let src = &x[pi * hw..][..hw];
        for (d, &(y0, y1, x0, x1, div)) in dst.iter_mut().zip(&wins) {
            let mut s = T::Acc::zero();
            for iy in y0..y1 {
                for v in &src[iy * p.w + x0..iy * p.w + x1] {
                    s += v.to_acc();
                }
            }
            *d = T::from_acc(s / T::acc(div as f64));
        }
    });
    out
}

pub fn avg_pool2d_backward<T: Elem>(g: &[T], p: &Pool2dParams) -> Vec<T> {
    let hw = p.h * p.w;
    let wins = avg_windows(p);
    let mut out = vec![T::default(); p.n * p.c * hw];
    per_plane(&mut out, hw, p.n * p.c * hw, |pi, dst| {
        let mut acc = vec![T::Acc::zero(); hw];
        for (gv, &(y0, y1, x0, x1, div)) in g[pi * wins.len()..].iter().zip(&wins) {
            let share = gv.to_acc() / T::acc(div as f64);
            for iy in y0..y1 {
                for a in &mut acc[iy * p.w + x0..iy * p.w + x1] {
                    *a += share;
                }
            }
        }
        for (d, a) in dst.iter_mut().zip(acc) {
            *d = T::from_acc(a);
        }
    });
    out
}

/// Row (or column) ranges of adaptive pooling: `floor(i·len/out) .. ceil((i+1)·len/out)`.
fn adaptive_ranges(len: usize, out: usize) -> Vec<(usize, usize)> {
    (0..out)
        .map(|i| (i * len / out, ((i + 1) * len).div_ceil(out)))
        .collect()
}

pub fn adaptive_avg_pool2d<T: Elem>(x: &[T], p: &AdaptivePoolParams) -> Vec<T> {
    let (hw, plane) = (p.h * p.w, p.out_h * p.out_w);
    let (rows, cols) = (adaptive_ranges(p.h, p.out_h), adaptive_ranges(p.w, p.out_w));
    let mut out = vec![T::default(); p.n * p.c * plane];
    per_plane(&mut out, plane, x.len(), |pi, dst| {
        let src = &x[pi * hw..][..hw];
        for (oy, &(y0, y1)) in rows.iter().enumerate() {
            for (ox, &(x0, x1)) in cols.iter().enumerate() {
                let mut s = T::Acc::zero();
                for iy in y0..y1 {
                    for v in &src[iy * p.w + x0..iy * p.w + x1] {
                        s += v.to_acc();
                    }
                }
                let count = ((y1 - y0) * (x1 - x0)).max(1);
                dst[oy * p.out_w + ox] = T::from_acc(s / T::acc(count as f64));
            }
        }
    });
    out
}

pub fn adaptive_avg_pool2d_backward<T: Elem>(g: &[T], p: &AdaptivePoolParams) -> Vec<T> {
    let (hw, plane) = (p.h * p.w, p.out_h * p.out_w);
    let (rows, cols) = (adaptive_ranges(p.h, p.out_h), adaptive_ranges(p.w, p.out_w));
    let mut out = vec![T::default(); p.n * p.c * hw];
    per_plane(&mut out, hw, p.n * p.c * hw, |pi, dst| {
        let gs = &g[pi * plane..][..plane];
        let mut acc = vec![T::Acc::zero(); hw];
        for (oy, &(y0, y1)) in rows.iter().enumerate() {
            for (ox, &(x0, x1)) in cols.iter().enumerate() {
                let count = ((y1 - y0) * (x1 - x0)).max(1);
                let share = gs[oy * p.out_w + ox].to_acc() / T::acc(count as f64);
                for iy in y0..y1 {
                    for a in &mut acc[iy * p.w + x0..iy * p.w + x1] {
                        *a += share;
                    }
                }
            }
        }
        for (d, a) in dst.iter_mut().zip(acc) {
            *d = T::from_acc(a);
        }
    });
    out
}

impl PoolOps for CpuStorage {
    fn max_pool2d(&self, l: &Layout, p: &Pool2dParams) -> Result<(Self, Self)> {
        contiguous_only("max_pool2d", p.format)?;
        let argmax;
        let out = map_float!(&*self.span(l), "max_pool2d", |x| {
            let (out, idx) = max_pool2d(x, p);
            argmax = idx;
            out
        });
        Ok((out, CpuStorage::I64(argmax)))
    }
    fn max_pool2d_backward(
        &self,
        l: &Layout,
        argmax: &Self,
        al: &Layout,
        p: &Pool2dParams,
    ) -> Result<Self> {
        contiguous_only("max_pool2d_backward", p.format)?;
        let idx = argmax.span(al);
        let idx = idx.as_i64("max_pool2d_backward")?;
        Ok(map_float!(&*self.span(l), "max_pool2d_backward", |g| {
            max_pool2d_backward(g, idx, p)
        }))
    }
    fn avg_pool2d(&self, l: &Layout, p: &Pool2dParams) -> Result<Self> {
        contiguous_only("avg_pool2d", p.format)?;
        Ok(map_float!(&*self.span(l), "avg_pool2d", |x| {
            avg_pool2d(x, p)
        }))
    }
    fn avg_pool2d_backward(&self, l: &Layout, p: &Pool2dParams) -> Result<Self> {
        contiguous_only("avg_pool2d_backward", p.format)?;
        Ok(map_float!(&*self.span(l), "avg_pool2d_backward", |g| {
            avg_pool2d_backward(g, p)
        }))
    }
    fn adaptive_avg_pool2d(&self, l: &Layout, p: &AdaptivePoolParams) -> Result<Self> {
        contiguous_only("adaptive_avg_pool2d", p.format)?;
        Ok(map_float!(&*self.span(l), "adaptive_avg_pool2d", |x| {
            adaptive_avg_pool2d(x, p)
        }))
    }
    fn adaptive_avg_pool2d_backward(&self, l: &Layout, p: &AdaptivePoolParams) -> Result<Self> {
        contiguous_only("adaptive_avg_pool2d_backward", p.format)?;
        Ok(map_float!(
            &*self.span(l),
            "adaptive_avg_pool2d_backward",
            |g| adaptive_avg_pool2d_backward(g, p)
        ))
    }
}
