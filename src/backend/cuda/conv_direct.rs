//! Our own convolution kernels (`kernels/conv.cu`) as candidates of the plan choice: timed by
//! the same timer as cuDNN's engines (`conv.rs`), run only where they are the fastest.
//!
//! Today one: the weight gradient of a channels_last filter with few weights against a long
//! sum over pixels (a one-channel stem, the 1x1 shortcuts of a small net), where cuDNN's tiled
//! kernels leave most of the GPU idle: a 28x28 stem of 16 filters at batch 128 was the slowest
//! kernel of the main job's step. Two launches: partial sums per range of
//! pixels into the convolution's workspace, then a fixed-order sum of them per weight.

use std::ffi::c_void;

use super::conv_plan::Dir;
use super::device::CudaDevice;
use super::launch::{launch, Grid};
use super::registry::Family;
use crate::backend::Conv2dParams;
use crate::base::error::Result;
use crate::base::{DType, MemoryFormat};

/// Output channels one thread accumulates (`WG_KT` in conv.cu).
const KT: usize = 16;
/// Threads per block of the partial-sum stage (at most `WG_THREADS` in conv.cu).
const THREADS: usize = 256;
/// Threads per block of the final sum.
const SUM_THREADS: u32 = 128;
/// Pixels each copy of a slot walks at least. Each pixel's loads wait on the last one's, so
/// parallelism comes from many short walks: with 16 pixels a thread the stem's 224 blocks
/// were latency-bound, too few warps per multiprocessor to hide the loads.
const MIN_PIXELS_PER_THREAD: usize = 4;
/// The most weights a filter may have to be a candidate: beyond this cuDNN's tiles fill the GPU.
const MAX_WEIGHTS: usize = 1 << 14;

/// The kernels' geometry (`WgradP` in conv.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct WgradP {
    n: i32,
    c: i32,
    h: i32,
    w: i32,
    k: i32,
    r: i32,
    s: i32,
    oh: i32,
    ow: i32,
    sh: i32,
    sw: i32,
    ph: i32,
    pw: i32,
    dh: i32,
    dw: i32,
    tiles: i32,
    slots: i32,
    groups: i32,
    pixels_per_block: i32,
}

/// The direct weight-gradient kernel for one geometry and dtype, with its launch shape.
#[derive(Clone, Debug)]
pub(super) struct DirectWgrad {
    p: WgradP,
    dtype: DType,
    blocks: usize,
    threads: usize,
    weights: usize,
}

/// Values of `p` as the kernel's 32-bit ints, or None when one does not fit.
fn int(v: usize) -> Option<i32> {
    i32::try_from(v).ok()
}

impl DirectWgrad {
    /// The kernel for `p` when it applies: the backward-filter direction of a channels_last,
    /// ungrouped convolution in f16, bf16 or f32, with at most [`MAX_WEIGHTS`] weights and
    /// every operand under 2^31 elements.
    pub(super) fn new(
        dev: &CudaDevice,
        p: &Conv2dParams,
        dtype: DType,
        dir: Dir,
    ) -> Option<DirectWgrad> {
        if dir != Dir::BackwardFilter
            || p.format != MemoryFormat::ChannelsLast
            || p.groups != 1
            || !matches!(dtype, DType::F16 | DType::BF16 | DType::F32)
        {
            return None;
        }
        let (oh, ow) = (p.out_h(), p.out_w());
        let rsc = p.kh * p.kw * p.c_in;
        let weights = p.c_out * rsc;
        let pixels = p.n * oh * ow;
        let x_len = p.n * p.h * p.w * p.c_in;
        if weights == 0 || weights > MAX_WEIGHTS || pixels == 0 {
            return None;
        }
        int(x_len)?;
        int(pixels * p.c_out)?;
        let tiles = p.c_out.div_ceil(KT);
        let slots = tiles * rsc;
        // Copies of the slots per block when they are few (a stem: 9 slots, 28 copies).
        let groups = (THREADS / slots).max(1);
        let threads = if groups > 1 {
            groups * slots
        } else {
            slots.min(THREADS)
        }
        .next_multiple_of(32);
        // Enough blocks to fill the GPU several times over, each copy walking at least
        // MIN_PIXELS_PER_THREAD pixels.
        let blocks = pixels
            .div_ceil(groups * MIN_PIXELS_PER_THREAD)
            .clamp(1, 8 * dev.sm_count as usize);
        let per_block = pixels.div_ceil(blocks);
        let blocks = pixels.div_ceil(per_block);
        Some(DirectWgrad {
            p: WgradP {
                n: int(p.n)?,
                c: int(p.c_in)?,
                h: int(p.h)?,
                w: int(p.w)?,
                k: int(p.c_out)?,
                r: int(p.kh)?,
                s: int(p.kw)?,
                oh: int(oh)?,
                ow: int(ow)?,
                sh: int(p.stride.0)?,
                sw: int(p.stride.1)?,
                ph: int(p.padding.0)?,
                pw: int(p.padding.1)?,
                dh: int(p.dilation.0)?,
                dw: int(p.dilation.1)?,
                tiles: int(tiles)?,
                slots: int(slots)?,
                groups: int(groups)?,
                pixels_per_block: int(per_block)?,
            },
            dtype,
            blocks,
            threads,
            weights,
        })
    }

    /// Bytes of workspace it needs: a row of f32 partial sums per block.
    pub(super) fn workspace(&self) -> usize {
        self.blocks * self.weights * 4
    }

    /// What runs, for logs, `conv_plans` and the plan cache.
    pub(super) fn describe(&self) -> String {
        format!(
            "mixprec direct weight gradient ({} blocks of {} threads, {} copies of {} slots)",
            self.blocks, self.threads, self.p.groups, self.p.slots
        )
    }

    /// Runs it on cuDNN's argument order (`ptrs`: dy, x, dw) with `ws` holding
    /// [`DirectWgrad::workspace`] bytes.
    pub(super) fn execute(
        &self,
        dev: &CudaDevice,
        ptrs: [*mut c_void; 3],
        ws: *mut c_void,
    ) -> Result<()> {
        let sfx = match self.dtype {
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            _ => "f32",
        };
        let [dy, x, dw] = ptrs.map(|p| p as u64);
        let ws = ws as u64;
        let grid = Grid {
            blocks: self.blocks as u32,
            threads: self.threads as u32,
        };
        launch!(dev, Family::Conv, format!("wgrad_partial_{sfx}"), grid; self.p, dy, x, ws);
        launch!(dev, Family::Conv, format!("wgrad_reduce_{sfx}"), Grid::per_row(self.weights, SUM_THREADS);
            ws, self.blocks as i32, self.weights as i32, dw);
        Ok(())
    }
}
