//! Backward of the 2-D convolution: the weight gradient (beside the main stream where it may
//! be) and the data gradient, both in the format the forward ran in.

use super::{Op, Wanted};
use crate::base::error::{Error, Result};
use crate::tensor::{Layout, Tensor};

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    let Op::Conv2d {
        x,
        w: weight,
        x_shape,
        w_shape,
        p,
    } = op
    else {
        return Err(op.misrouted("conv"));
    };
    let missing = |what: &str| Error::Backward(format!("conv2d: the {what} was not saved"));
    // The gradient in the format the forward ran in; both results come out in it.
    let g = g.packed_as(p.format)?;
    // The weight gradient first, beside where it can: the data gradient, which the rest of
    // backward waits for, then runs while it does.
    let dw = if w.need(1) {
        let x = x.as_ref().ok_or_else(|| missing("input"))?;
        let weight_grad = || {
            let s =
                g.storage()
                    .conv2d_backward_weight(&g.layout(), &x.storage(), &x.layout(), p)?;
            Ok(Tensor::from_storage(
                s,
                Layout::with_format(w_shape.clone(), p.format),
            ))
        };
        // Beside only when the data gradient is computed too: what it overlaps.
        let (dw, went) = if w.need(0) && w.may_beside(1) {
            crate::autograd::beside::weight_grad(&g, x, p, weight_grad)?
        } else {
            (weight_grad()?, false)
        };
        if went {
            w.went_beside(1);
        }
        Some(dw)
    } else {
        None
    };
    if !w.need(0) {
        return Ok(vec![None, dw]);
    }
    let weight = weight.as_ref().ok_or_else(|| missing("weight"))?;
    let dx_layout = Layout::with_format(x_shape.clone(), p.format);
    // Added into the gradient summed so far when the engine offers one laid out as ours.
    if let Some(sum) = w.take_offer(0) {
        let fits = sum.dtype() == g.dtype()
            && *sum.layout() == dx_layout
            && sum.storage().len() == dx_layout.elem_count();
        if !fits {
            w.decline(0, sum);
        } else {
            g.storage().conv2d_backward_input_add(
                &g.layout(),
                &weight.storage(),
                &weight.layout(),
                p,
                &mut sum.storage_mut(),
            )?;
            return Ok(vec![Some(sum), dw]);
        }
    }
    let s =
        g.storage()
            .conv2d_backward_input(&g.layout(), &weight.storage(), &weight.layout(), p)?;
    Ok(vec![Some(Tensor::from_storage(s, dx_layout)), dw])
}
