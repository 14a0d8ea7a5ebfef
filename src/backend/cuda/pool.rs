//! Max, average and adaptive average pooling and their backward (`kernels/pool.cu`), NCHW or
//! NHWC.

use super::common::float_sfx;
use super::launch::{launch, Grid};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::PoolOps;
use crate::backend::{AdaptivePoolParams, Pool2dParams};
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout, MemoryFormat};

/// Mirrors `PoolP` in pool.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct PoolP {
    n: i64,
    c: i64,
    h: i64,
    w: i64,
    kh: i64,
    kw: i64,
    sh: i64,
    sw: i64,
    ph: i64,
    pw: i64,
    oh: i64,
    ow: i64,
    count_include_pad: i64,
    /// 1: NHWC, 0: NCHW.
    nhwc: i64,
}

fn pool_p(p: &Pool2dParams) -> PoolP {
    PoolP {
        n: p.n as i64,
        c: p.c as i64,
        h: p.h as i64,
        w: p.w as i64,
        kh: p.kh as i64,
        kw: p.kw as i64,
        sh: p.stride.0 as i64,
        sw: p.stride.1 as i64,
        ph: p.padding.0 as i64,
        pw: p.padding.1 as i64,
        oh: p.out_h() as i64,
        ow: p.out_w() as i64,
        count_include_pad: p.count_include_pad as i64,
        nhwc: (p.format == MemoryFormat::ChannelsLast) as i64,
    }
}

fn adaptive_p(p: &AdaptivePoolParams) -> PoolP {
    PoolP {
        n: p.n as i64,
        c: p.c as i64,
        h: p.h as i64,
        w: p.w as i64,
        kh: 0,
        kw: 0,
        sh: 1,
        sw: 1,
        ph: 0,
        pw: 0,
        oh: p.out_h as i64,
        ow: p.out_w as i64,
        count_include_pad: 0,
        nhwc: (p.format == MemoryFormat::ChannelsLast) as i64,
    }
}

/// The elements per 16-byte pack when max pooling may run a thread per pack of channels
/// (`max_pool_vec` / `max_pool_backward_vec`): NHWC, the channels a whole number of packs, every
/// buffer 16-byte aligned, every position within 32 bits, and a window of at most 255 cells (its
/// argmax is a byte). ResNet's stem pool (64 channels, 112² in, bf16) spent most of its time
/// splitting indices once per channel.
fn channel_packs(p: &Pool2dParams, dtype: DType, ptrs: &[u64]) -> Option<usize> {
    let pack = 16 / dtype.size_in_bytes();
    let cells = p.n * p.c * (p.h * p.w).max(p.out_h() * p.out_w());
    (p.format == MemoryFormat::ChannelsLast
        && p.c.is_multiple_of(pack)
        && cells < (1 << 31)
        && p.kh * p.kw <= 255
        && ptrs.iter().all(|a| a % 16 == 0))
    .then_some(pack)
}

/// How a max pooling's argmax record holds the winners, told apart by its length (the only
/// reader is `max_pool2d_backward`, and the two lengths differ whenever the packed form is
/// possible: it needs at least 2 channels).
#[derive(Clone, Copy, PartialEq, Debug)]
enum ArgmaxRecord {
    /// An i64 per output: the flat `h·w` index in its plane (the CPU's form).
    FlatIndex,
    /// A byte per output, in the output's memory order: the winner's offset `i·kw + j` in its
    /// window; the bytes fill an I64 buffer of `outputs.div_ceil(8)` elements.
    WindowOffset,
}

impl ArgmaxRecord {
    fn len(self, outputs: usize) -> usize {
        match self {
            ArgmaxRecord::FlatIndex => outputs,
            ArgmaxRecord::WindowOffset => outputs.div_ceil(8),
        }
    }
    fn of(len: usize, outputs: usize) -> Result<Self> {
        [ArgmaxRecord::FlatIndex, ArgmaxRecord::WindowOffset]
            .into_iter()
            .find(|r| r.len(outputs) == len)
            .ok_or_else(|| {
                Error::invalid_arg(
                    "max_pool2d_backward",
                    "argmax length",
                    len,
                    format!(
                        "the record max_pool2d returned for {outputs} outputs: {outputs} flat \
                         indices or {} words of window offsets",
                        outputs.div_ceil(8)
                    ),
                )
            })
    }
}

pub(crate) fn max_pool2d(
    x: &CudaStorage,
    l: &Layout,
    p: &Pool2dParams,
) -> Result<(CudaStorage, CudaStorage)> {
    let s = float_sfx("max_pool2d", x.dtype())?;
    let src = x.ptr_at(l)?;
    let n = p.n * p.c * p.out_h() * p.out_w();
    let out = CudaStorage::alloc(&x.dev, x.dtype(), n)?;
    if n == 0 {
        return Ok((out, CudaStorage::alloc(&x.dev, DType::I64, 0)?));
    }
    // The record's base is aligned as any allocation is; pack k's bytes start at k·pack.
    if let Some(pack) = channel_packs(p, x.dtype(), &[src, out.ptr()]) {
        let arg = CudaStorage::alloc(&x.dev, DType::I64, ArgmaxRecord::WindowOffset.len(n))?;
        launch!(x.dev, Family::Pool, format!("max_pool_vec_{s}"), Grid::for_items(&x.dev, n / pack);
            pool_p(p), src, out.ptr(), arg.ptr());
        Ok((out, arg))
    } else {
        let arg = CudaStorage::alloc(&x.dev, DType::I64, ArgmaxRecord::FlatIndex.len(n))?;
        launch!(x.dev, Family::Pool, format!("max_pool_{s}"), Grid::for_items(&x.dev, n);
            pool_p(p), src, out.ptr(), arg.ptr());
        Ok((out, arg))
    }
}

pub(crate) fn max_pool2d_backward(
    g: &CudaStorage,
    l: &Layout,
    argmax: &CudaStorage,
    al: &Layout,
    p: &Pool2dParams,
) -> Result<CudaStorage> {
    let s = float_sfx("max_pool2d_backward", g.dtype())?;
    let outputs = p.n * p.c * p.out_h() * p.out_w();
    let record = ArgmaxRecord::of(al.shape().elem_count(), outputs)?;
    let (mut pg, pa) = (g.ptr_at(l)?, argmax.ptr_at(al)?);
    let n = p.n * p.c * p.h * p.w;
    let dx = CudaStorage::alloc(&g.dev, g.dtype(), n)?;
    if n == 0 {
        return Ok(dx);
    }
    match record {
        ArgmaxRecord::WindowOffset => {
            // Only the pack kernel reads window offsets. The forward's checks hold for the same
            // parameters; the gradient alone may sit at an unaligned offset of its buffer, and
            // then it is copied to a fresh (aligned) one.
            let aligned;
            if pg % 16 != 0 {
                aligned = CudaStorage::alloc(&g.dev, g.dtype(), outputs)?;
                aligned.copy_from_device(pg, outputs)?;
                pg = aligned.ptr();
            }
            let pack = channel_packs(p, g.dtype(), &[pg, dx.ptr()]).ok_or_else(|| {
                Error::invalid_arg(
                    "max_pool2d_backward",
                    "argmax",
                    "window offsets",
                    format!("a record of this pooling's forward ({p:?})"),
                )
            })?;
            launch!(g.dev, Family::Pool, format!("max_pool_backward_vec_{s}"), Grid::for_items(&g.dev, n / pack);
                pool_p(p), pg, pa, dx.ptr());
        }
        ArgmaxRecord::FlatIndex => {
            launch!(g.dev, Family::Pool, format!("max_pool_backward_{s}"), Grid::for_items(&g.dev, n);
                pool_p(p), pg, pa, dx.ptr());
        }
    }
    Ok(dx)
}

pub(crate) fn avg_pool2d(x: &CudaStorage, l: &Layout, p: &Pool2dParams) -> Result<CudaStorage> {
    let s = float_sfx("avg_pool2d", x.dtype())?;
    let src = x.ptr_at(l)?;
    let n = p.n * p.c * p.out_h() * p.out_w();
    let out = CudaStorage::alloc(&x.dev, x.dtype(), n)?;
    if n > 0 {
        launch!(x.dev, Family::Pool, format!("avg_pool_{s}"), Grid::for_items(&x.dev, n);
            pool_p(p), src, out.ptr());
    }
    Ok(out)
}

pub(crate) fn avg_pool2d_backward(
    g: &CudaStorage,
    l: &Layout,
    p: &Pool2dParams,
) -> Result<CudaStorage> {
    let s = float_sfx("avg_pool2d_backward", g.dtype())?;
    let src = g.ptr_at(l)?;
    let n = p.n * p.c * p.h * p.w;
    let dx = CudaStorage::alloc(&g.dev, g.dtype(), n)?;
    if n > 0 {
        launch!(g.dev, Family::Pool, format!("avg_pool_backward_{s}"), Grid::for_items(&g.dev, n);
            pool_p(p), src, dx.ptr());
    }
    Ok(dx)
}

pub(crate) fn adaptive_avg_pool2d(
    x: &CudaStorage,
    l: &Layout,
    p: &AdaptivePoolParams,
) -> Result<CudaStorage> {
    let s = float_sfx("adaptive_avg_pool2d", x.dtype())?;
    let src = x.ptr_at(l)?;
    let n = p.n * p.c * p.out_h * p.out_w;
    let out = CudaStorage::alloc(&x.dev, x.dtype(), n)?;
    if n > 0 {
        launch!(x.dev, Family::Pool, format!("adaptive_pool_{s}"), Grid::for_items(&x.dev, n);
            adaptive_p(p), src, out.ptr());
    }
    Ok(out)
}

pub(crate) fn adaptive_avg_pool2d_backward(
    g: &CudaStorage,
    l: &Layout,
    p: &AdaptivePoolParams,
) -> Result<CudaStorage> {
    let s = float_sfx("adaptive_avg_pool2d_backward", g.dtype())?;
    let src = g.ptr_at(l)?;
    let n = p.n * p.c * p.h * p.w;
    let dx = CudaStorage::alloc(&g.dev, g.dtype(), n)?;
    if n > 0 {
        launch!(g.dev, Family::Pool, format!("adaptive_pool_backward_{s}"), Grid::for_items(&g.dev, n);
            adaptive_p(p), src, dx.ptr());
    }
    Ok(dx)
}

impl PoolOps for CudaStorage {
    fn max_pool2d(&self, l: &Layout, p: &Pool2dParams) -> Result<(Self, Self)> {
        max_pool2d(self, l, p)
    }
    fn max_pool2d_backward(
        &self,
        l: &Layout,
        argmax: &Self,
        al: &Layout,
        p: &Pool2dParams,
    ) -> Result<Self> {
        max_pool2d_backward(self, l, argmax, al, p)
    }
    fn avg_pool2d(&self, l: &Layout, p: &Pool2dParams) -> Result<Self> {
        avg_pool2d(self, l, p)
    }
    fn avg_pool2d_backward(&self, l: &Layout, p: &Pool2dParams) -> Result<Self> {
        avg_pool2d_backward(self, l, p)
    }
    fn adaptive_avg_pool2d(&self, l: &Layout, p: &AdaptivePoolParams) -> Result<Self> {
        adaptive_avg_pool2d(self, l, p)
    }
    fn adaptive_avg_pool2d_backward(&self, l: &Layout, p: &AdaptivePoolParams) -> Result<Self> {
        adaptive_avg_pool2d_backward(self, l, p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_params_match_the_kernel_struct() {
        let p = Pool2dParams {
            n: 2,
            c: 3,
            h: 9,
            w: 7,
            kh: 3,
            kw: 2,
            stride: (2, 1),
            padding: (1, 0),
            count_include_pad: true,
            format: MemoryFormat::Contiguous,
        };
        let k = pool_p(&p);
        assert_eq!((k.oh, k.ow), (p.out_h() as i64, p.out_w() as i64));
        assert_eq!(
            (k.sh, k.sw, k.ph, k.pw, k.count_include_pad),
            (2, 1, 1, 0, 1)
        );
        assert_eq!(std::mem::size_of::<PoolP>(), 14 * 8);
    }

    #[test]
    fn channel_packs_only_for_whole_aligned_packs_in_nhwc() {
        let stem = Pool2dParams {
            n: 256,
            c: 64,
            h: 112,
            w: 112,
            kh: 3,
            kw: 3,
            stride: (2, 2),
            padding: (1, 1),
            count_include_pad: true,
            format: MemoryFormat::ChannelsLast,
        };
        assert_eq!(channel_packs(&stem, DType::BF16, &[0, 256, 4096]), Some(8));
        assert_eq!(channel_packs(&stem, DType::F32, &[0, 256, 4096]), Some(4));
        // NCHW, a misaligned buffer, channels not a whole number of packs: element by element.
        let nchw = Pool2dParams {
            format: MemoryFormat::Contiguous,
            ..stem
        };
        assert_eq!(channel_packs(&nchw, DType::BF16, &[0, 256, 4096]), None);
        assert_eq!(channel_packs(&stem, DType::BF16, &[0, 258, 4096]), None);
        let c12 = Pool2dParams { c: 12, ..stem };
        assert_eq!(channel_packs(&c12, DType::F16, &[0, 256, 4096]), None);
        assert_eq!(channel_packs(&c12, DType::F32, &[0, 256, 4096]), Some(4));
        // A window of 256 cells has offsets past a byte.
        let wide = Pool2dParams {
            kh: 16,
            kw: 16,
            padding: (0, 0),
            ..stem
        };
        assert_eq!(channel_packs(&wide, DType::BF16, &[0, 256, 4096]), None);
        let wide = Pool2dParams {
            kh: 15,
            kw: 17,
            padding: (0, 0),
            ..stem
        };
        assert_eq!(channel_packs(&wide, DType::BF16, &[0, 256, 4096]), Some(8));
    }

    #[test]
    fn argmax_records_are_told_apart_by_length() {
        // ResNet-50's stem pool at batch 256: 8 times fewer bytes as window offsets.
        let outputs = 256 * 64 * 56 * 56;
        assert_eq!(ArgmaxRecord::WindowOffset.len(outputs), outputs / 8);
        assert_eq!(
            ArgmaxRecord::of(outputs, outputs).unwrap(),
            ArgmaxRecord::FlatIndex
        );
        assert_eq!(
            ArgmaxRecord::of(outputs / 8, outputs).unwrap(),
            ArgmaxRecord::WindowOffset
        );
        // Two channels (the fewest a pack holds) at one position: 2 flat indices or 1 word.
        assert_eq!(ArgmaxRecord::of(1, 2).unwrap(), ArgmaxRecord::WindowOffset);
        let e = ArgmaxRecord::of(7, outputs).unwrap_err().to_string();
        assert!(
            e.contains("max_pool2d_backward") && e.contains("argmax length = 7"),
            "{e}"
        );
    }
}
