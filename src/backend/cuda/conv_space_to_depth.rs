//! Space-to-depth: a strided convolution over few input channels run as a stride-1 convolution
//! over more (`kernels/conv.cu` has the index maps). ResNet's 7x7/2 stem over 3 channels is the
//! case: in bf16 cuDNN's best kernels for it take 1.77 ms forward and 1.13 ms for the weight
//! gradient of a batch-256 step on an H200 (f16: 0.56 and 0.55), while the 4x4/1 convolution
//! over 16 channels it becomes fits cuDNN's ordinary NHWC kernels (0.64 and 0.46 ms in either
//! dtype). The products are those of the strided convolution plus products with zeros, so the
//! result differs only in summation order.
//!
//! Each direction is a candidate against the convolution as given: on the first call of a
//! geometry both run on that call's buffers and the timer of the plan choice (`conv_tune.rs`)
//! keeps the faster, per (geometry, dtype, direction, TF32 and determinism settings). The
//! inner convolution gets its own timed plan (`conv_plan::run`). The forward and the input
//! gradient rebuild S and w' per call, the weight gradient rebuilds S from the saved input
//! rather than keeping it from the forward. On the H200 the bf16 stem is rewritten in both
//! directions (1.15 against 1.77 ms, 0.96 against 1.13 ms) and the f16 one is not; S's
//! transform (a thread per pixel of S) is ~0.5 ms of those, several times what its bytes need.
//!
//! `MIXPREC_CONV_SPACE_TO_DEPTH=0` leaves it out, `=only` runs it wherever it applies (for
//! tests and comparisons); with `MIXPREC_CUDNN_FIND=0` (no timing) it is left out too.
//! [`with_conv_space_to_depth`] sets either for one thread.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use super::conv_plan::{run, Dir};
use super::conv_tune::{tune, EventTimer};
use super::device::{allow_tf32, deterministic};
use super::launch::{launch, Grid};
use super::registry::Family;
use super::side_stream;
use super::storage::CudaStorage;
use crate::backend::{BackendStorage, Conv2dParams};
use crate::base::error::{Error, Result};
use crate::base::{DType, MemoryFormat};

/// The most channels S may have (s0·s1·c_in rounded up to a multiple of 8): beyond this the
/// strided convolution already has channels enough for cuDNN's kernels.
const MAX_CHANNELS: usize = 16;

/// Whether the rewrite competes: timed against the convolution as given (the default), never,
/// or wherever it applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpaceToDepth {
    Auto,
    Off,
    Only,
}

fn env_mode() -> SpaceToDepth {
    static MODE: OnceLock<SpaceToDepth> = OnceLock::new();
    *MODE.get_or_init(
        || match std::env::var("MIXPREC_CONV_SPACE_TO_DEPTH").as_deref() {
            Ok("0") | Ok("off") => SpaceToDepth::Off,
            Ok("only") => SpaceToDepth::Only,
            Ok("") | Ok("auto") | Err(_) => SpaceToDepth::Auto,
            Ok(other) => {
                log::warn!(
                    "MIXPREC_CONV_SPACE_TO_DEPTH={other:?}: expected auto, 0 or only; using auto"
                );
                SpaceToDepth::Auto
            }
        },
    )
}

thread_local! {
    static SCOPED: std::cell::Cell<Option<SpaceToDepth>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with `mode` as this thread's space-to-depth setting (other threads keep theirs).
pub fn with_conv_space_to_depth<R>(mode: SpaceToDepth, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<SpaceToDepth>);
    impl Drop for Restore {
        fn drop(&mut self) {
            SCOPED.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(SCOPED.with(|s| s.replace(Some(mode))));
    f()
}

fn mode() -> SpaceToDepth {
    SCOPED.with(|s| s.get()).unwrap_or_else(env_mode)
}

/// The geometry of the rewrite (`S2dP` in conv.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct S2dP {
    n: i32,
    c: i32,
    h: i32,
    w: i32,
    s0: i32,
    s1: i32,
    ph: i32,
    pw: i32,
    hs: i32,
    ws: i32,
    cs: i32,
    cp: i32,
    k: i32,
    kh: i32,
    kw: i32,
    kh2: i32,
    kw2: i32,
}

/// A convolution the rewrite applies to, with the stride-1 convolution it becomes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Rewrite {
    g: S2dP,
    inner: Conv2dParams,
}

impl Rewrite {
    /// The rewrite of `p` when it applies: channels_last, ungrouped, undilated, a stride above 1
    /// with a kernel larger than it, s0·s1·c_in ≤ [`MAX_CHANNELS`] after rounding up to 8, a
    /// float dtype, and every operand under 2^31 elements.
    pub(super) fn new(p: &Conv2dParams, dtype: DType) -> Option<Rewrite> {
        let (s0, s1) = p.stride;
        if p.format != MemoryFormat::ChannelsLast
            || p.groups != 1
            || p.dilation != (1, 1)
            || s0 * s1 < 2
            || p.kh <= s0 && p.kw <= s1
            || !matches!(dtype, DType::F16 | DType::BF16 | DType::F32)
        {
            return None;
        }
        let cs = s0 * s1 * p.c_in;
        let cp = cs.next_multiple_of(8);
        if cp > MAX_CHANNELS {
            return None;
        }
        let (kh2, kw2) = (p.kh.div_ceil(s0), p.kw.div_ceil(s1));
        let (hs, ws) = (p.out_h() + kh2 - 1, p.out_w() + kw2 - 1);
        let fits = |v: usize| v < (1 << 31);
        let lens = [
            p.n * p.h * p.w * p.c_in,
            p.n * hs * ws * cp,
            p.n * p.out_h() * p.out_w() * p.c_out,
            p.c_out * kh2 * kw2 * cp,
        ];
        if !lens.iter().all(|&v| fits(v)) {
            return None;
        }
        let int = |v: usize| v as i32;
        Some(Rewrite {
            g: S2dP {
                n: int(p.n),
                c: int(p.c_in),
                h: int(p.h),
                w: int(p.w),
                s0: int(s0),
                s1: int(s1),
                ph: int(p.padding.0),
                pw: int(p.padding.1),
                hs: int(hs),
                ws: int(ws),
                cs: int(cs),
                cp: int(cp),
                k: int(p.c_out),
                kh: int(p.kh),
                kw: int(p.kw),
                kh2: int(kh2),
                kw2: int(kw2),
            },
            inner: Conv2dParams {
                c_in: cp,
                h: hs,
                w: ws,
                kh: kh2,
                kw: kw2,
                stride: (1, 1),
                padding: (0, 0),
                ..*p
            },
        })
    }

    /// The stride-1 convolution over S.
    #[cfg(test)]
    fn inner(&self) -> &Conv2dParams {
        &self.inner
    }

    fn s_len(&self) -> usize {
        let g = &self.g;
        (g.n * g.hs * g.ws * g.cp) as usize
    }

    fn w2_len(&self) -> usize {
        let g = &self.g;
        (g.k * g.kh2 * g.kw2 * g.cp) as usize
    }

    /// Launches `name` over `items` items with (g, src, dst).
    fn map(&self, name: &str, items: usize, src: &CudaStorage, dst: &CudaStorage) -> Result<()> {
        let dev = &src.dev;
        let sfx = match src.dtype() {
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            _ => "f32",
        };
        launch!(dev, Family::Conv, format!("{name}_{sfx}"), Grid::for_items(dev, items);
            self.g, src.ptr(), dst.ptr());
        Ok(())
    }

    fn s_of(&self, x: &CudaStorage) -> Result<CudaStorage> {
        let s = CudaStorage::alloc(&x.dev, x.dtype(), self.s_len())?;
        // A thread per 8 channels of a pixel of S.
        self.map("s2d_input", self.s_len() / 8, x, &s)?;
        Ok(s)
    }

    fn w2_of(&self, w: &CudaStorage) -> Result<CudaStorage> {
        let w2 = CudaStorage::alloc(&w.dev, w.dtype(), self.w2_len())?;
        self.map("s2d_weight", self.w2_len(), w, &w2)?;
        Ok(w2)
    }

    /// One direction with `a`, `b` in cuDNN's argument order (`conv_plan::Dir`), of the
    /// convolution as given; `out_len` elements out.
    pub(super) fn run(
        &self,
        dir: Dir,
        a: &CudaStorage,
        b: &CudaStorage,
        out_len: usize,
    ) -> Result<CudaStorage> {
        let (dev, dtype) = (&a.dev, a.dtype());
        match dir {
            Dir::Forward => {
                let (s, w2) = (self.s_of(a)?, self.w2_of(b)?);
                run(dev, dir, &self.inner, dtype, &s, &w2, out_len)
            }
            Dir::BackwardFilter => {
                let s = self.s_of(b)?;
                let dw2 = run(dev, dir, &self.inner, dtype, a, &s, self.w2_len())?;
                let dw = CudaStorage::alloc(dev, dtype, out_len)?;
                self.map("s2d_weight_grad", out_len, &dw2, &dw)?;
                Ok(dw)
            }
            Dir::BackwardData => {
                let w2 = self.w2_of(b)?;
                let ds = run(dev, dir, &self.inner, dtype, a, &w2, self.s_len())?;
                let dx = CudaStorage::alloc(dev, dtype, out_len)?;
                self.map("s2d_input_grad", out_len, &ds, &dx)?;
                Ok(dx)
            }
            // `run_if_chosen` leaves it to the convolution as given.
            Dir::BackwardDataAdd => Err(Error::Cuda(
                "space-to-depth: a data gradient added into is not rewritten".into(),
            )),
        }
    }
}

type Key = (usize, Conv2dParams, DType, Dir, bool, bool);

/// A timed choice, as [`conv_space_to_depth_choices`] reports it.
#[derive(Clone, Debug)]
pub struct SpaceToDepthChoice {
    pub params: Conv2dParams,
    pub dtype: DType,
    /// "forward", "backward-data" or "backward-filter".
    pub direction: &'static str,
    /// The median device time of the convolution as given and of the rewrite (ms), when timed
    /// to the end.
    pub direct_ms: Option<f32>,
    pub rewritten_ms: Option<f32>,
    pub chosen: bool,
}

fn choices() -> &'static Mutex<HashMap<Key, SpaceToDepthChoice>> {
    static C: OnceLock<Mutex<HashMap<Key, SpaceToDepthChoice>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// The space-to-depth choices device `ordinal` has timed so far.
pub fn conv_space_to_depth_choices(ordinal: usize) -> Vec<SpaceToDepthChoice> {
    let map = choices().lock().unwrap_or_else(|e| e.into_inner());
    map.iter()
        .filter(|(k, _)| k.0 == ordinal)
        .map(|(_, c)| c.clone())
        .collect()
}

/// Runs direction `dir` through the rewrite when it applies and is chosen (timing both ways on
/// the first call of the geometry): `None` when the convolution as given should run.
pub(super) fn run_if_chosen(
    dir: Dir,
    p: &Conv2dParams,
    a: &CudaStorage,
    b: &CudaStorage,
    out_len: usize,
) -> Result<Option<CudaStorage>> {
    let dtype = a.dtype();
    let m = mode();
    if dir == Dir::BackwardDataAdd {
        // Adding into the gradient saves a pass only where cuDNN writes it.
        return Ok(None);
    }
    let rewrite = match (m, Rewrite::new(p, dtype)) {
        (SpaceToDepth::Off, _) | (_, None) => return Ok(None),
        (_, Some(r)) => r,
    };
    if out_len == 0 || a.is_empty() || b.is_empty() {
        return Ok(None);
    }
    if m == SpaceToDepth::Only {
        return rewrite.run(dir, a, b, out_len).map(Some);
    }
    let dev = &a.dev;
    let key = (dev.ordinal, *p, dtype, dir, allow_tf32(), deterministic());
    let known = choices()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&key)
        .map(|c| c.chosen);
    let chosen = match known {
        Some(c) => c,
        None => {
            // With the plan timing off (`MIXPREC_CUDNN_FIND=0`) nothing is timed: the
            // convolution as given, cuDNN's untimed choice, runs.
            if std::env::var("MIXPREC_CUDNN_FIND").is_ok_and(|v| v == "0") {
                return Ok(None);
            }
            super::graph::refuse(
                dev.ordinal,
                "conv2d",
                "timing the space-to-depth rewrite during capture: run a warm-up step of the \
                 same shapes first",
            )?;
            let choice = time_both(dir, p, &rewrite, a, b, out_len)?;
            let chosen = choice.chosen;
            log::debug!(
                "space-to-depth {:?} {dtype} {p:?}: given {:?} ms, rewritten {:?} ms: {}",
                dir,
                choice.direct_ms,
                choice.rewritten_ms,
                if chosen { "rewritten" } else { "as given" }
            );
            choices()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key, choice);
            chosen
        }
    };
    if chosen {
        rewrite.run(dir, a, b, out_len).map(Some)
    } else {
        Ok(None)
    }
}

/// Times the convolution as given against the rewrite on this call's buffers, on the main
/// stream (both streams waited for before and after when this runs beside).
fn time_both(
    dir: Dir,
    p: &Conv2dParams,
    rewrite: &Rewrite,
    a: &CudaStorage,
    b: &CudaStorage,
    out_len: usize,
) -> Result<SpaceToDepthChoice> {
    let dev = &a.dev;
    let beside = side_stream::is_beside(dev.ordinal);
    if beside {
        side_stream::synchronize_both(dev)?;
    }
    let tuning = side_stream::on_main(|| -> Result<_> {
        let go = |i: usize| -> Result<()> {
            if i == 0 {
                run(dev, dir, p, a.dtype(), a, b, out_len).map(drop)
            } else {
                rewrite.run(dir, a, b, out_len).map(drop)
            }
        };
        // First runs choose both plans (their own timing), outside this timing.
        go(0)?;
        go(1)?;
        let mut timer = EventTimer::new(dev);
        tune(&[0, 0], &[], |i, k, pre| timer.measure(|| go(i), k, pre))
    })?;
    if beside {
        side_stream::synchronize_both(dev)?;
    }
    Ok(SpaceToDepthChoice {
        params: *p,
        dtype: a.dtype(),
        direction: dir.name(),
        direct_ms: tuning.outcomes[0].median_ms(),
        rewritten_ms: tuning.outcomes[1].median_ms(),
        chosen: tuning.chosen == Some(1),
    })
}

#[cfg(test)]
mod tests {
    //! The index maps of conv.cu, written again on the host and checked against direct
    //! convolutions in f64: the forward, the weight gradient and the input gradient of the
    //! rewrite equal those of the strided convolution.
    use super::*;

    fn params(
        n: usize,
        c: usize,
        hw: (usize, usize),
        k: usize,
        kernel: (usize, usize),
        stride: (usize, usize),
        pad: (usize, usize),
    ) -> Conv2dParams {
        Conv2dParams {
            n,
            c_in: c,
            h: hw.0,
            w: hw.1,
            c_out: k,
            kh: kernel.0,
            kw: kernel.1,
            stride,
            padding: pad,
            dilation: (1, 1),
            groups: 1,
            format: MemoryFormat::ChannelsLast,
        }
    }

    /// A channels_last convolution (KRSC weights) and the gradients of Σ y·dy, by one loop:
    /// (y, dx, dw).
    fn conv(p: &Conv2dParams, x: &[f64], w: &[f64], dy: &[f64]) -> [Vec<f64>; 3] {
        let (oh, ow) = (p.out_h(), p.out_w());
        let mut y = vec![0.0; p.n * oh * ow * p.c_out];
        let (mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; w.len()]);
        for n in 0..p.n {
            for oy in 0..oh {
                for ox in 0..ow {
                    for k in 0..p.c_out {
                        let yi = ((n * oh + oy) * ow + ox) * p.c_out + k;
                        for r in 0..p.kh {
                            for s in 0..p.kw {
                                let iy = (oy * p.stride.0 + r) as isize - p.padding.0 as isize;
                                let ix = (ox * p.stride.1 + s) as isize - p.padding.1 as isize;
                                if iy < 0 || ix < 0 || iy >= p.h as isize || ix >= p.w as isize {
                                    continue;
                                }
                                for c in 0..p.c_in {
                                    let xi =
                                        ((n * p.h + iy as usize) * p.w + ix as usize) * p.c_in + c;
                                    let wi = ((k * p.kh + r) * p.kw + s) * p.c_in + c;
                                    y[yi] += x[xi] * w[wi];
                                    dx[xi] += dy[yi] * w[wi];
                                    dw[wi] += dy[yi] * x[xi];
                                }
                            }
                        }
                    }
                }
            }
        }
        [y, dx, dw]
    }

    // The host twins of conv.cu's s2d_input, s2d_weight, s2d_weight_grad, s2d_input_grad.
    fn s_of(g: &S2dP, x: &[f64]) -> Vec<f64> {
        // As the kernel walks it: 8 channels of a pixel per item, stepped one channel at a time.
        let mut out = vec![0.0; (g.n * g.hs * g.ws * g.cp) as usize];
        let chunks = g.cp / 8;
        for i in 0..(g.n * g.hs * g.ws * chunks) {
            let (q0, pix) = ((i % chunks) * 8, i / chunks);
            let (xx, y, n) = (pix % g.ws, (pix / g.ws) % g.hs, pix / (g.ws * g.hs));
            let (mut ci, pq) = (q0 % g.c, q0 / g.c);
            let (mut pr, mut qc) = (pq / g.s1, pq % g.s1);
            for e in 0..8 {
                let (iy, ix) = (g.s0 * y + pr - g.ph, g.s1 * xx + qc - g.pw);
                if q0 + e < g.cs && iy >= 0 && iy < g.h && ix >= 0 && ix < g.w {
                    out[(pix * g.cp + q0 + e) as usize] =
                        x[(((n * g.h + iy) * g.w + ix) * g.c + ci) as usize];
                }
                ci += 1;
                if ci == g.c {
                    ci = 0;
                    qc += 1;
                    if qc == g.s1 {
                        qc = 0;
                        pr += 1;
                    }
                }
            }
        }
        out
    }

    fn w2_of(g: &S2dP, w: &[f64]) -> Vec<f64> {
        let mut out = vec![0.0; (g.k * g.kh2 * g.kw2 * g.cp) as usize];
        for (i, o) in out.iter_mut().enumerate() {
            let i = i as i32;
            let (q0, b, a) = (i % g.cp, (i / g.cp) % g.kw2, (i / (g.cp * g.kw2)) % g.kh2);
            let k = i / (g.cp * g.kw2 * g.kh2);
            if q0 < g.cs {
                let (ci, pq) = (q0 % g.c, q0 / g.c);
                let (ky, kx) = (g.s0 * a + pq / g.s1, g.s1 * b + pq % g.s1);
                if ky < g.kh && kx < g.kw {
                    *o = w[(((k * g.kh + ky) * g.kw + kx) * g.c + ci) as usize];
                }
            }
        }
        out
    }

    fn dw_of(g: &S2dP, dw2: &[f64]) -> Vec<f64> {
        (0..g.k * g.kh * g.kw * g.c)
            .map(|i| {
                let (ci, kx, ky) = (i % g.c, (i / g.c) % g.kw, (i / (g.c * g.kw)) % g.kh);
                let k = i / (g.c * g.kw * g.kh);
                let q0 = ((ky % g.s0) * g.s1 + kx % g.s1) * g.c + ci;
                dw2[(((k * g.kh2 + ky / g.s0) * g.kw2 + kx / g.s1) * g.cp + q0) as usize]
            })
            .collect()
    }

    fn dx_of(g: &S2dP, ds: &[f64]) -> Vec<f64> {
        (0..g.n * g.h * g.w * g.c)
            .map(|i| {
                let (ci, ix, iy) = (i % g.c, (i / g.c) % g.w, (i / (g.c * g.w)) % g.h);
                let n = i / (g.c * g.w * g.h);
                let (y, xx) = ((iy + g.ph) / g.s0, (ix + g.pw) / g.s1);
                if y < g.hs && xx < g.ws {
                    let q0 = (((iy + g.ph) % g.s0) * g.s1 + (ix + g.pw) % g.s1) * g.c + ci;
                    ds[(((n * g.hs + y) * g.ws + xx) * g.cp + q0) as usize]
                } else {
                    0.0
                }
            })
            .collect()
    }

    fn values(len: usize, seed: u64) -> Vec<f64> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f64 / 1000.0 - 1.0
            })
            .collect()
    }

    fn close(a: &[f64], b: &[f64], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() < 1e-9, "{what}[{i}]: {x} vs {y}");
        }
    }

    #[test]
    fn the_rewrite_gives_the_strided_convolution_and_its_gradients() {
        let cases = [
            // A small ResNet stem: 7x7/2, padding 3, 3 channels.
            params(2, 3, (13, 11), 4, (7, 7), (2, 2), (3, 3)),
            // Odd sizes, a kernel the stride divides, no padding.
            params(1, 2, (9, 10), 3, (4, 4), (2, 2), (0, 0)),
            // Unequal strides and kernel sides, padding larger than the stride.
            params(2, 1, (12, 9), 2, (5, 3), (3, 2), (2, 1)),
            // 3x3/2 over 4 channels: 16 channels of S with no pad channel.
            params(1, 4, (8, 8), 5, (3, 3), (2, 2), (1, 1)),
        ];
        for (i, p) in cases.iter().enumerate() {
            let r = Rewrite::new(p, DType::F32).unwrap_or_else(|| panic!("case {i} applies"));
            let inner = r.inner();
            assert_eq!(
                (inner.out_h(), inner.out_w()),
                (p.out_h(), p.out_w()),
                "case {i}"
            );
            let x = values(p.n * p.h * p.w * p.c_in, 1 + i as u64);
            let w = values(p.c_out * p.kh * p.kw * p.c_in, 11 + i as u64);
            let dy = values(p.n * p.out_h() * p.out_w() * p.c_out, 21 + i as u64);
            let (s, w2) = (s_of(&r.g, &x), w2_of(&r.g, &w));
            let [y, dx, dw] = conv(p, &x, &w, &dy);
            let [y2, ds, dw2] = conv(inner, &s, &w2, &dy);
            close(&y2, &y, &format!("case {i} forward"));
            close(
                &dw_of(&r.g, &dw2),
                &dw,
                &format!("case {i} weight gradient"),
            );
            close(&dx_of(&r.g, &ds), &dx, &format!("case {i} input gradient"));
        }
    }

    #[test]
    fn it_applies_only_where_it_can_help() {
        let stem = params(256, 3, (224, 224), 64, (7, 7), (2, 2), (3, 3));
        let r = Rewrite::new(&stem, DType::BF16).expect("the stem");
        let i = r.inner();
        assert_eq!(
            (i.c_in, i.h, i.w, i.kh, i.kw, i.stride),
            (16, 115, 115, 4, 4, (1, 1))
        );
        let nchw = Conv2dParams {
            format: MemoryFormat::Contiguous,
            ..stem
        };
        assert!(Rewrite::new(&nchw, DType::BF16).is_none(), "NCHW");
        let unit = params(2, 3, (8, 8), 4, (3, 3), (1, 1), (1, 1));
        assert!(Rewrite::new(&unit, DType::F16).is_none(), "stride 1");
        let wide = params(2, 8, (8, 8), 4, (3, 3), (2, 2), (1, 1));
        assert!(
            Rewrite::new(&wide, DType::F16).is_none(),
            "32 channels of S"
        );
        let one_by_one = params(2, 3, (8, 8), 4, (1, 1), (2, 2), (0, 0));
        assert!(
            Rewrite::new(&one_by_one, DType::F16).is_none(),
            "a 1x1 kernel"
        );
        assert!(Rewrite::new(&stem, DType::F64).is_none(), "f64");
    }
}
