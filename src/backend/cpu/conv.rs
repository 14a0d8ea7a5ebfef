//! 2-D convolution (NCHW) as im2col + GEMM through the `gemm` crate, in the accumulation type.
//!
//! Per image and group the receptive fields are unfolded into `col` `[K, L]`, with
//! `K = c_in/groups·kh·kw` and `L = out_h·out_w`; then
//! - forward:         `y_g = W_g · col`                       (`[cog, K]·[K, L]`)
//! - backward input:  `col = W_gᵀ · g_g`, folded back into `dx` (col2im)
//! - backward weight: `dW_g += g_g · colᵀ`, summed over the batch.
//!
//! Images are spread over rayon's threads (each thread reuses its scratch buffers); a batch of
//! one image lets gemm parallelise the product instead.

use gemm::Parallelism;
use num_traits::Zero;
use rayon::prelude::*;

use super::Elem;
use super::{alloc, cast, contiguous_only, CpuStorage};
use crate::backend::Conv2dParams;
use crate::backend::{BackendStorage, ConvOps};
use crate::base::error::{Error, Result};
use crate::base::Layout;

/// Sizes derived from the parameters.
struct Geom {
    /// Input / output channels per group.
    cig: usize,
    cog: usize,
    /// Rows of `col`: one per (input channel of the group, ky, kx).
    k: usize,
    /// Columns of `col`: one per output position.
    l: usize,
    oh: usize,
    ow: usize,
    in_img: usize,
    out_img: usize,
}

impl Geom {
    fn new(p: &Conv2dParams) -> Self {
        let groups = p.groups.max(1);
        let (cig, cog) = (p.c_in / groups, p.c_out / groups);
        let (oh, ow) = (p.out_h(), p.out_w());
        Geom {
            cig,
            cog,
            k: cig * p.kh * p.kw,
            l: oh * ow,
            oh,
            ow,
            in_img: p.c_in * p.h * p.w,
            out_img: p.c_out * oh * ow,
        }
    }
}

/// How to spend the threads: over images (`true`), or inside each product.
fn plan(n: usize, work_per_image: usize) -> (bool, Parallelism) {
    let threads = rayon::current_num_threads();
    if threads > 1 && n > 1 {
        (true, Parallelism::None)
    } else if threads > 1 && work_per_image >= 1 << 18 {
        (false, Parallelism::Rayon(threads))
    } else {
        (false, Parallelism::None)
    }
}

/// A matrix in a flat buffer: `(offset, column stride, row stride)`.
type Mat = (usize, isize, isize);

/// `dst (m×n) = [dst +] lhs (m×k) · rhs (k×n)`.
fn gemm_acc<A: Copy + Zero + num_traits::One + 'static>(
    (m, n, k): (usize, usize, usize),
    (dst, d): (&mut [A], Mat),
    accumulate: bool,
    (lhs, a): (&[A], Mat),
    (rhs, b): (&[A], Mat),
    par: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // An empty sum: leave `dst` (accumulating) or zero it, without asking gemm about k = 0.
        if !accumulate {
            for r in 0..m {
                for c in 0..n {
                    dst[d.0 + r * d.2 as usize + c * d.1 as usize] = A::zero();
                }
            }
        }
        return;
    }
    // The last element each matrix reaches must lie inside its buffer (strides are non-negative).
    let last = |(off, cs, rs): Mat, rows: usize, cols: usize| {
        off + (rows.max(1) - 1) * rs as usize + (cols.max(1) - 1) * cs as usize
    };
    assert!(last(d, m, n) < dst.len(), "conv gemm: dst out of bounds");
    assert!(last(a, m, k) < lhs.len(), "conv gemm: lhs out of bounds");
    assert!(last(b, k, n) < rhs.len(), "conv gemm: rhs out of bounds");
    // SAFETY: the asserts above keep every access in bounds; `dst` is exclusively borrowed and
    // distinct from the shared `lhs`/`rhs`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().add(d.0),
            d.1,
            d.2,
            accumulate,
            lhs.as_ptr().add(a.0),
            a.1,
            a.2,
            rhs.as_ptr().add(b.0),
            b.1,
            b.2,
            if accumulate { A::one() } else { A::zero() },
            A::one(),
            false,
            false,
            false,
            par,
        );
    }
}

/// Output positions `o < out_len` whose input coordinate `o·stride + offset` lies in `0..in_len`:
/// a contiguous range `lo..hi`.
fn valid_range(out_len: usize, in_len: usize, stride: usize, offset: isize) -> (usize, usize) {
    let s = stride as isize;
    let lo = if offset >= 0 {
        0
    } else {
        (-offset + s - 1) / s
    };
    let room = in_len as isize - offset;
    let hi = if room <= 0 { 0 } else { (room + s - 1) / s };
    let hi = (hi.max(0) as usize).min(out_len);
    ((lo as usize).min(hi), hi)
}

/// One output row `oy` of one `col` row (a channel `ci` of the group and a kernel cell): it reads
/// input row `iy` (`None` when that row is padding) at columns `ox·stride_w + offx`, which are
/// inside the input for `ox` in `xlo..xhi` and padding elsewhere.
struct Tap {
    ci: usize,
    row: usize,
    oy: usize,
    iy: Option<usize>,
    xlo: usize,
    xhi: usize,
    offx: isize,
}

fn for_each_tap(p: &Conv2dParams, g: &Geom, mut f: impl FnMut(Tap)) {
    for ci in 0..g.cig {
        for ky in 0..p.kh {
            let offy = (ky * p.dilation.0) as isize - p.padding.0 as isize;
            let (ylo, yhi) = valid_range(g.oh, p.h, p.stride.0, offy);
            for kx in 0..p.kw {
                let offx = (kx * p.dilation.1) as isize - p.padding.1 as isize;
                let (xlo, xhi) = valid_range(g.ow, p.w, p.stride.1, offx);
                let row = (ci * p.kh + ky) * p.kw + kx;
                for oy in 0..g.oh {
                    let iy = (ylo..yhi)
                        .contains(&oy)
                        .then(|| ((oy * p.stride.0) as isize + offy) as usize);
                    f(Tap {
                        ci,
                        row,
                        oy,
                        iy,
                        xlo,
                        xhi,
                        offx,
                    });
                }
            }
        }
    }
}

/// Unfolds channels `c0..c0+cig` of one image `x` `[c_in, h, w]` into `col` `[K, L]`.
fn im2col<T: Elem>(x: &[T], p: &Conv2dParams, g: &Geom, c0: usize, col: &mut [T::Acc]) {
    let (hw, l, ow, sw) = (p.h * p.w, g.l, g.ow, p.stride.1);
    let zero = T::Acc::zero();
    for_each_tap(p, g, |t| {
        let dst = &mut col[t.row * l + t.oy * ow..][..ow];
        let Some(iy) = t.iy else {
            dst.fill(zero);
            return;
        };
        let src = &x[(c0 + t.ci) * hw + iy * p.w..][..p.w];
        dst[..t.xlo].fill(zero);
        dst[t.xhi..].fill(zero);
        if t.xlo == t.xhi {
            // Every column is padding; the span's start `xlo + offx` may be negative then.
        } else if sw == 1 {
            // Contiguous span: a plain widening copy.
            let s0 = (t.xlo as isize + t.offx) as usize;
            let n = t.xhi - t.xlo;
            for (d, s) in dst[t.xlo..t.xhi].iter_mut().zip(&src[s0..s0 + n]) {
                *d = s.to_acc();
            }
        } else {
            for (ox, d) in dst.iter_mut().enumerate().take(t.xhi).skip(t.xlo) {
                *d = src[((ox * sw) as isize + t.offx) as usize].to_acc();
            }
        }
    });
}

/// Adds `col` `[K, L]` back onto channels `c0..c0+cig` of `dx` `[c_in, h, w]` (im2col's adjoint).
fn col2im<A: Copy + std::ops::AddAssign>(
    col: &[A],
    p: &Conv2dParams,
    g: &Geom,
    c0: usize,
    dx: &mut [A],
) {
    let (hw, l, ow, sw) = (p.h * p.w, g.l, g.ow, p.stride.1);
    for_each_tap(p, g, |t| {
        let Some(iy) = t.iy else { return };
        let src = &col[t.row * l + t.oy * ow..][..ow];
        let dst = &mut dx[(c0 + t.ci) * hw + iy * p.w..][..p.w];
        if t.xlo == t.xhi {
            // Every column is padding (and `xlo + offx` may be negative): nothing to add.
        } else if sw == 1 {
            // Contiguous span: a vectorisable add.
            let d0 = (t.xlo as isize + t.offx) as usize;
            let n = t.xhi - t.xlo;
            for (d, &v) in dst[d0..d0 + n].iter_mut().zip(&src[t.xlo..t.xhi]) {
                *d += v;
            }
        } else {
            for (ox, &v) in src.iter().enumerate().take(t.xhi).skip(t.xlo) {
                dst[((ox * sw) as isize + t.offx) as usize] += v;
            }
        }
    });
}

fn widen<T: Elem>(v: &[T]) -> Vec<T::Acc> {
    v.iter().map(|x| x.to_acc()).collect()
}

fn store<T: Elem>(dst: &mut [T], src: &[T::Acc]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = T::from_acc(s);
    }
}

/// Runs `f(image, chunk, scratch)` for each image's `chunk` of `out`, over rayon's threads when
/// `outer`; `scratch` is built by `init` once per thread task and reused.
fn per_image<T: Send, S>(
    out: &mut [T],
    chunk: usize,
    outer: bool,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(usize, &mut [T], &mut S) + Sync + Send,
) {
    if chunk == 0 {
        return;
    }
    if outer {
        out.par_chunks_mut(chunk)
            .enumerate()
            .for_each_init(&init, |s, (i, c)| f(i, c, s));
    } else {
        let mut s = init();
        for (i, c) in out.chunks_mut(chunk).enumerate() {
            f(i, c, &mut s);
        }
    }
}

pub fn conv2d<T: Elem>(x: &[T], w: &[T], p: &Conv2dParams) -> Vec<T> {
    let g = Geom::new(p);
    let mut out = vec![T::default(); p.n * g.out_img];
    if g.k == 0 {
        return out;
    }
    let wa = widen(w);
    let (outer, par) = plan(p.n, p.c_out * g.k * g.l);
    let (k, l, cog) = (g.k, g.l, g.cog);
    per_image(
        &mut out,
        g.out_img,
        outer,
        || (vec![T::Acc::zero(); k * l], vec![T::Acc::zero(); g.out_img]),
        |i, dst, (col, acc)| {
            let xi = &x[i * g.in_img..][..g.in_img];
            for gi in 0..p.groups {
                im2col(xi, p, &g, gi * g.cig, col);
                gemm_acc(
                    (cog, l, k),
                    (acc, (gi * cog * l, 1, l as isize)),
                    false,
                    (&wa, (gi * cog * k, 1, k as isize)),
                    (col, (0, 1, l as isize)),
                    par,
                );
            }
            store(dst, acc);
        },
    );
    out
}

pub fn conv2d_backward_input<T: Elem>(g: &[T], w: &[T], p: &Conv2dParams) -> Vec<T> {
    let geo = Geom::new(p);
    let mut out = vec![T::default(); p.n * geo.in_img];
    if geo.k == 0 || geo.l == 0 {
        return out;
    }
    let wa = widen(w);
    let (outer, par) = plan(p.n, p.c_out * geo.k * geo.l);
    let (k, l, cog) = (geo.k, geo.l, geo.cog);
    per_image(
        &mut out,
        geo.in_img,
        outer,
        || {
            (
                vec![T::Acc::zero(); k * l],
                vec![T::Acc::zero(); geo.out_img],
                vec![T::Acc::zero(); geo.in_img],
            )
        },
        |i, dst, (col, ga, dx)| {
            for (a, v) in ga.iter_mut().zip(&g[i * geo.out_img..][..geo.out_img]) {
                *a = v.to_acc();
            }
            dx.fill(T::Acc::zero());
            for gi in 0..p.groups {
                // col [K, L] = W_gᵀ [K, cog] · g_g [cog, L]
                gemm_acc(
                    (k, l, cog),
                    (col, (0, 1, l as isize)),
                    false,
                    (&wa, (gi * cog * k, k as isize, 1)),
                    (ga, (gi * cog * l, 1, l as isize)),
                    par,
                );
                col2im(col, p, &geo, gi * geo.cig, dx);
            }
            store(dst, dx);
        },
    );
    out
}

pub fn conv2d_backward_weight<T: Elem>(g: &[T], x: &[T], p: &Conv2dParams) -> Vec<T> {
    let geo = Geom::new(p);
    let (k, l, cog) = (geo.k, geo.l, geo.cog);
    let wlen = p.c_out * k;
    if wlen == 0 || l == 0 {
        return vec![T::default(); wlen];
    }
    let (outer, par) = plan(p.n, p.c_out * k * l);
    // Per task: the partial weight gradient, the im2col buffer, the widened output gradient.
    type Scratch<A> = (Vec<A>, Vec<A>, Vec<A>);
    // Adds image i's contribution to `dw`.
    let image = |i: usize, (dw, col, ga): &mut Scratch<T::Acc>| {
        let xi = &x[i * geo.in_img..][..geo.in_img];
        for (a, v) in ga.iter_mut().zip(&g[i * geo.out_img..][..geo.out_img]) {
            *a = v.to_acc();
        }
        for gi in 0..p.groups {
            im2col(xi, p, &geo, gi * geo.cig, col);
            // dW_gᵀ [K, cog] += col [K, L] · g_gᵀ [L, cog]: the big `col` is read along its rows.
            gemm_acc(
                (k, cog, l),
                (dw, (gi * cog * k, k as isize, 1)),
                true,
                (col, (0, 1, l as isize)),
                (ga, (gi * cog * l, l as isize, 1)),
                par,
            );
        }
    };
    let init = || {
        (
            vec![T::Acc::zero(); wlen],
            vec![T::Acc::zero(); k * l],
            vec![T::Acc::zero(); geo.out_img],
        )
    };
    let dw = if outer {
        // One partial sum per fixed, contiguous range of images, added in range order: the sum's
        // order depends on the batch size and thread count alone, never on scheduling, so a run
        // (and a resumed run) is bit-reproducible.
        let parts = rayon::current_num_threads().min(p.n);
        let per = p.n.div_ceil(parts);
        let partials: Vec<Vec<T::Acc>> = (0..p.n.div_ceil(per))
            .into_par_iter()
            .map(|part| {
                let mut s = init();
                for i in part * per..((part + 1) * per).min(p.n) {
                    image(i, &mut s);
                }
                s.0
            })
            .collect();
        let mut partials = partials.into_iter();
        let mut dw = partials
            .next()
            .unwrap_or_else(|| vec![T::Acc::zero(); wlen]);
        for b in partials {
            for (x, y) in dw.iter_mut().zip(b) {
                *x += y;
            }
        }
        dw
    } else {
        let mut s = init();
        for i in 0..p.n {
            image(i, &mut s);
        }
        s.0
    };
    dw.into_iter().map(T::from_acc).collect()
}

/// [`map_float2!`] for convolutions: half operands run the f32 kernels on bulk-widened copies
/// (`cast::via_f32`), which is the same arithmetic without a conversion call per tap.
macro_rules! map_conv {
    ($a:expr, $b:expr, $op:expr, |$x:ident, $y:ident| $body:expr) => {
        match ($a, $b) {
            (CpuStorage::F16(a), CpuStorage::F16(b)) => {
                CpuStorage::F16(cast::via_f32(a, b, |$x, $y| $body))
            }
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => {
                CpuStorage::BF16(cast::via_f32(a, b, |$x, $y| $body))
            }
            (CpuStorage::F32($x), CpuStorage::F32($y)) => CpuStorage::F32($body),
            (CpuStorage::F64($x), CpuStorage::F64($y)) => CpuStorage::F64($body),
            (a, b) => {
                return Err(Error::DTypeMismatch {
                    op: $op,
                    lhs: a.dtype(),
                    rhs: b.dtype(),
                })
            }
        }
    };
}

impl ConvOps for CpuStorage {
    fn conv2d(&self, l: &Layout, weight: &Self, wl: &Layout, p: &Conv2dParams) -> Result<Self> {
        contiguous_only("conv2d", p.format)?;
        let elems = [p.n, p.c_out, p.out_h(), p.out_w()]
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .unwrap_or(usize::MAX);
        alloc::probe_output("conv2d", elems, self.dtype())?;
        let (x, w) = (self.span(l), weight.span(wl));
        Ok(map_conv!(&*x, &*w, "conv2d", |x, w| conv2d(x, w, p)))
    }
    fn conv2d_backward_input(
        &self,
        l: &Layout,
        weight: &Self,
        wl: &Layout,
        p: &Conv2dParams,
    ) -> Result<Self> {
        contiguous_only("conv2d_backward_input", p.format)?;
        let (g, w) = (self.span(l), weight.span(wl));
        Ok(map_conv!(&*g, &*w, "conv2d_backward_input", |g, w| {
            conv2d_backward_input(g, w, p)
        }))
    }
    fn conv2d_backward_weight(
        &self,
        l: &Layout,
        input: &Self,
        il: &Layout,
        p: &Conv2dParams,
    ) -> Result<Self> {
        contiguous_only("conv2d_backward_weight", p.format)?;
        let (g, x) = (self.span(l), input.span(il));
        Ok(map_conv!(&*g, &*x, "conv2d_backward_weight", |g, x| {
            conv2d_backward_weight(g, x, p)
        }))
    }
}
