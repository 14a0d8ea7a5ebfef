//! 2-D convolution through cuDNN (NCHW or NHWC, groups, dilation): forward, backward-data and
//! backward-filter. Each (geometry, memory format, dtype, direction, TF32 setting) gets a plan
//! chosen once, on the first call's own buffers, and kept with its workspace size.
//!
//! **One candidate list, one timer.** The candidates are the graph API's engine configurations
//! (`cudnn_graph.rs`: heuristic modes A and B, then the fallback list), the legacy API's algorithms
//! (`cudnn_legacy.rs`: `cudnnGet*Algorithm_v7`, each with its math type), every one that keeps the
//! dtype's numerical promise and needs at most the workspace limit, and our own kernel where it
//! applies (`conv_direct.rs`: the weight gradient of small channels_last filters, such as a
//! one-channel stem). All are timed the same way on the same buffers (`conv_tune.rs`: warm-up,
//! median of three, slow ones abandoned early, near-equals re-timed) and the fastest runs; among
//! candidates within 3% of it, the one with the least workspace. A candidate is not run at all
//! where a tenth of the best rate it reached in a long run on an earlier convolution of the same
//! direction, dtype and layout (`conv_tune::Rates`) would still make it slow: cuDNN's generic
//! engine 0, run on each of ResNet-50's convolutions and far slower than the best on every one, was
//! most of a new machine's first step.
//!
//! Why: inside a real ResNet-50 step (batch 256) the former choice lost by several times to the
//! legacy API's untimed heuristic choice (benches/RESULTS.md has the figures). The graph API's
//! candidates were capped at 256 MiB of workspace, and so was `cudnnFind*AlgorithmEx`'s scratch.
//! cuDNN's fast tensor-core kernels for NCHW operands run NHWC internally and transpose both
//! operands in the workspace: the sizes it asked for are x + y exactly (layer1's 1x1 64->256
//! forward: 102.8 + 411.0 MB = 513.8 MB; the 56x56 downsample's backward-data: dx 411.0 + dy
//! 205.5 MB = 616.6 MB; the stem, its 3 channels padded to 8: 205.5 + 411.0 MB). At batch 256 that
//! is over 256 MiB for every early-layer convolution, so the graph API was left with its generic
//! engine 0 on the strided 1x1 backward-data (hundreds of times slower than the best), cudnnFind
//! returned no candidate at all there (elsewhere one algorithm at most passed its filter: success,
//! the scratch size, and a math type equal to the descriptor's), and an untimed side lost by
//! default. channels_last operands need no such transposes. Now the limit is what PyTorch allows in
//! spirit (a generous cap: a quarter of the free device memory, at most 2 GiB;
//! `MIXPREC_CUDNN_WORKSPACE_MB` overrides), the legacy algorithms are timed by our own timer rather
//! than by cudnnFind (whose single run per candidate includes a first-launch warm-up, whose scratch
//! it cannot share with the graph API's timing, and whose results report no workspace-aware
//! tie-break), and nothing wins untimed while timing is on ([`conv_plans`] reports each plan's time
//! and how many candidates of each API were timed).
//!
//! Engines that compile kernels at run time (cuDNN's `RUNTIME_COMPILATION` note) stay out by
//! default: their compile happens when their plan is built, in every process and for every
//! shape, and the plan cache cannot carry it (it records the engine and its knobs; cuDNN
//! serialises compiled plans only experimentally). `MIXPREC_CUDNN_RUNTIME_COMPILED=1` admits
//! them, to measure whether they pay (see `benches/conv_choice.sh`).
//!
//! **The plan cache** (`conv_cache.rs`) keeps each choice on disk, so a second process rebuilds
//! its plans without timing anything.
//!
//! Environment: `MIXPREC_CUDNN_API=graph` or `=legacy` limits the candidates to one API (with
//! `graph`, the legacy API still covers what no graph engine supports); `MIXPREC_CONV_DIRECT=0`
//! leaves our own kernels out, `=only` runs them alone where they apply; `MIXPREC_CUDNN_FIND=0`
//! turns the timing (and the plan cache) off: the graph heuristics' first choice, else the
//! legacy one; `MIXPREC_CUDNN_PLAN_CACHE=DIR|0` and `MIXPREC_CUDNN_RETUNE=1` steer the cache;
//! `RUST_LOG=mixprec=debug` logs every candidate's time and the choice. The workspace is one
//! grow-only buffer per device.
//!
//! A strided convolution over few channels (ResNet's stem) has one more candidate, decided
//! before the plan: its space-to-depth rewrite into a stride-1 convolution over more channels
//! (`conv_space_to_depth.rs`), timed against the convolution as given.
//!
//! Here: the op's checks and its three directions. The choice is in `conv_choice.rs`, a plan and
//! its settings in `conv_plan.rs`, the device's cuDNN state (handle, workspaces, plans, lock) in
//! `cudnn.rs`.

use super::conv_plan::*;
use super::storage::CudaStorage;
use crate::backend::ConvOps;
use crate::backend::{BackendStorage, Conv2dParams};
use crate::base::error::{Error, Result};
use crate::base::Layout;

/// Checks the geometry before anything computes output sizes (which would underflow).
fn check(op: &'static str, p: &Conv2dParams) -> Result<()> {
    let bad = |name: &'static str, v: String, allowed: &str| {
        Err(Error::invalid_arg(op, name, v, allowed))
    };
    if p.groups == 0 || !p.c_in.is_multiple_of(p.groups) || !p.c_out.is_multiple_of(p.groups) {
        return bad(
            "groups",
            p.groups.to_string(),
            &format!(
                "a positive divisor of c_in {} and c_out {}",
                p.c_in, p.c_out
            ),
        );
    }
    if p.kh == 0
        || p.kw == 0
        || p.stride.0 == 0
        || p.stride.1 == 0
        || p.dilation.0 == 0
        || p.dilation.1 == 0
    {
        return bad("kernel/stride/dilation", format!("{p:?}"), "positive sizes");
    }
    if p.h + 2 * p.padding.0 < p.dilation.0 * (p.kh - 1) + 1
        || p.w + 2 * p.padding.1 < p.dilation.1 * (p.kw - 1) + 1
    {
        return bad(
            "kernel",
            format!("{}x{}", p.kh, p.kw),
            "must fit the padded input",
        );
    }
    Ok(())
}

fn sizes(p: &Conv2dParams) -> (usize, usize, usize) {
    (
        p.n * p.c_in * p.h * p.w,
        p.c_out * (p.c_in / p.groups) * p.kh * p.kw,
        p.n * p.c_out * p.out_h() * p.out_w(),
    )
}

/// The checks of one direction: the geometry, and `a`, `b` (as [`run`] takes them) and `into`
/// (the buffer an add-into direction adds to) of its sizes. Returns the output's length.
fn checked(
    dir: Dir,
    a: &CudaStorage,
    b: &CudaStorage,
    into: Option<&CudaStorage>,
    p: &Conv2dParams,
) -> Result<usize> {
    let op = op_name(dir);
    check(op, p)?;
    let (nx, nw, ny) = sizes(p);
    let (na, a_what, nb, b_what, n_out) = match dir {
        Dir::Forward => (nx, "the input", nw, "the weight", ny),
        Dir::BackwardData | Dir::BackwardDataAdd => {
            (ny, "the output gradient", nw, "the weight", nx)
        }
        Dir::BackwardFilter => (ny, "the output gradient", nx, "the input", nw),
    };
    let into = into.map(|s| (s, n_out, "the input gradient"));
    for (s, n, what) in [(a, na, a_what), (b, nb, b_what)].into_iter().chain(into) {
        if s.len() != n {
            return Err(Error::invalid_arg(
                op,
                "len",
                s.len(),
                format!("{what} must have {n} elements"),
            ));
        }
    }
    Ok(n_out)
}

fn op_name(dir: Dir) -> &'static str {
    match dir {
        Dir::Forward => "conv2d",
        Dir::BackwardData => "conv2d_backward_input",
        Dir::BackwardFilter => "conv2d_backward_weight",
        Dir::BackwardDataAdd => "conv2d_backward_input_add",
    }
}

/// The checks and the run of one direction: `a`, `b` as [`run`] takes them.
fn conv(dir: Dir, a: &CudaStorage, b: &CudaStorage, p: &Conv2dParams) -> Result<CudaStorage> {
    let n_out = checked(dir, a, b, None, p)?;
    if let Some(out) = super::conv_space_to_depth::run_if_chosen(dir, p, a, b, n_out)? {
        return Ok(out);
    }
    run(&a.dev, dir, p, a.dtype(), a, b, n_out)
}

/// The operands of a convolution are packed in the params' format at offset 0 (the tensor
/// layer's `packed_as`), which is what cuDNN's descriptors describe.
fn packed(op: &'static str, s: &CudaStorage, l: &Layout) -> Result<()> {
    if l.offset() != 0 || l.elem_count() != s.len() {
        return Err(Error::invalid_arg(
            op,
            "layout",
            format!(
                "offset {} over {} of {} elements",
                l.offset(),
                l.elem_count(),
                s.len()
            ),
            "a packed operand (offset 0, the whole buffer)",
        ));
    }
    Ok(())
}

pub(crate) fn conv2d(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    p: &Conv2dParams,
) -> Result<CudaStorage> {
    packed("conv2d", x, lx)?;
    packed("conv2d", w, lw)?;
    conv(Dir::Forward, x, w, p)
}

/// `g` is the output gradient; returns the input gradient.
pub(crate) fn conv2d_backward_input(
    g: &CudaStorage,
    lg: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    p: &Conv2dParams,
) -> Result<CudaStorage> {
    packed("conv2d_backward_input", g, lg)?;
    packed("conv2d_backward_input", w, lw)?;
    conv(Dir::BackwardData, g, w, p)
}

/// `g` is the output gradient; adds the input gradient into `dx` (cuDNN's beta = 1), which is
/// packed in the params' format and of `g`'s dtype.
pub(crate) fn conv2d_backward_input_add(
    g: &CudaStorage,
    lg: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    p: &Conv2dParams,
    dx: &CudaStorage,
) -> Result<()> {
    packed("conv2d_backward_input_add", g, lg)?;
    packed("conv2d_backward_input_add", w, lw)?;
    checked(Dir::BackwardDataAdd, g, w, Some(dx), p)?;
    if dx.dtype() != g.dtype() || w.dtype() != g.dtype() {
        return Err(Error::invalid_arg(
            op_name(Dir::BackwardDataAdd),
            "dtype",
            format!("{} / {} / {}", g.dtype(), w.dtype(), dx.dtype()),
            "one dtype for the output gradient, the weight and the input gradient",
        ));
    }
    run_into(&g.dev, Dir::BackwardDataAdd, p, g.dtype(), g, w, dx)
}

/// `g` is the output gradient; returns the weight gradient.
pub(crate) fn conv2d_backward_weight(
    g: &CudaStorage,
    lg: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    p: &Conv2dParams,
) -> Result<CudaStorage> {
    packed("conv2d_backward_weight", g, lg)?;
    packed("conv2d_backward_weight", x, lx)?;
    conv(Dir::BackwardFilter, g, x, p)
}

impl ConvOps for CudaStorage {
    fn conv2d(&self, l: &Layout, w: &Self, wl: &Layout, p: &Conv2dParams) -> Result<Self> {
        conv2d(self, l, w, wl, p)
    }
    fn conv2d_backward_input(
        &self,
        l: &Layout,
        w: &Self,
        wl: &Layout,
        p: &Conv2dParams,
    ) -> Result<Self> {
        conv2d_backward_input(self, l, w, wl, p)
    }
    fn conv2d_backward_weight(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        p: &Conv2dParams,
    ) -> Result<Self> {
        conv2d_backward_weight(self, l, x, xl, p)
    }
}
