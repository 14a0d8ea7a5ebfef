//! Channels-last convolutions on the CPU: the operands are permuted to NCHW / KCRS, convolved by
//! the NCHW reference (`conv.rs`), and the result permuted back. The reference for the GPU's
//! NHWC convolutions is then the same arithmetic as for NCHW, bit for bit.

use super::CpuStorage;
use crate::backend::{BackendStorage, Conv2dParams, MemoryFormat};
use crate::error::{Error, Result};
use crate::tensor::Shape;

/// Which operand of a convolution a buffer is, for its logical dims.
#[derive(Clone, Copy)]
pub(super) enum Operand {
    /// The input or its gradient, `[n, c_in, h, w]`.
    Input,
    /// The weight or its gradient, `[c_out, c_in/groups, kh, kw]`.
    Weight,
    /// The output or its gradient, `[n, c_out, out_h, out_w]`.
    Output,
}

impl Operand {
    fn dims(self, p: &Conv2dParams) -> [usize; 4] {
        match self {
            Operand::Input => [p.n, p.c_in, p.h, p.w],
            Operand::Weight => [p.c_out, p.c_in / p.groups.max(1), p.kh, p.kw],
            Operand::Output => [p.n, p.c_out, p.out_h(), p.out_w()],
        }
    }

    fn what(self) -> &'static str {
        match self {
            Operand::Input => "input",
            Operand::Weight => "weight",
            Operand::Output => "output",
        }
    }
}

/// `v`, stored channels-last (`[d0, d2, d3, d1]` row-major), in the logical order.
fn to_channels_first(
    op: &'static str,
    v: &CpuStorage,
    dims: [usize; 4],
    what: &str,
) -> Result<CpuStorage> {
    let [a, b, c, d] = dims;
    if v.len() != a * b * c * d {
        return Err(Error::invalid_arg(
            op,
            "operand length",
            v.len(),
            format!(
                "{} elements for the channels_last {what} {dims:?}",
                a * b * c * d
            ),
        ));
    }
    v.permute(&Shape::new(vec![a, c, d, b]), &[0, 3, 1, 2])
}

/// `v`, in the logical order, stored channels-last.
fn to_channels_last(v: &CpuStorage, dims: [usize; 4]) -> Result<CpuStorage> {
    v.permute(&Shape::new(dims.to_vec()), &[0, 2, 3, 1])
}

/// Runs `f` (an NCHW convolution op) on `a` and `b` stored in `p.format`, the result stored in
/// `p.format` too. `roles` names what `a`, `b` and the result are.
pub(super) fn in_format(
    op: &'static str,
    p: &Conv2dParams,
    (a, b): (&CpuStorage, &CpuStorage),
    roles: [Operand; 3],
    f: impl FnOnce(&CpuStorage, &CpuStorage, &Conv2dParams) -> Result<CpuStorage>,
) -> Result<CpuStorage> {
    if p.format == MemoryFormat::Contiguous {
        return f(a, b, p);
    }
    let [ra, rb, rout] = roles;
    let a = to_channels_first(op, a, ra.dims(p), ra.what())?;
    let b = to_channels_first(op, b, rb.dims(p), rb.what())?;
    let nchw = Conv2dParams {
        format: MemoryFormat::Contiguous,
        ..*p
    };
    to_channels_last(&f(&a, &b, &nchw)?, rout.dims(p))
}
