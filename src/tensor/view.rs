//! Views and layout changes: reshape, permute/transpose, narrow and expand change the layout
//! and share the buffer (reshape copies only when the strides cannot express it); contiguous(),
//! to_memory_format() and the crate's own `compact`/`laid_out_like` make the one copy an op
//! cannot do without; cat copies.

use super::{Layout, MemoryFormat, Shape, Tensor};
use crate::autograd::Op;
use crate::base::error::{Error, Result};
use crate::tensor::storage::Storage;

impl Tensor {
    /// The same elements with another shape of the same element count; shares the buffer.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if super::check_size("reshape", &shape, self.dtype())? != self.elem_count() {
            return Err(Error::shape_mismatch(
                "reshape",
                self.shape(),
                &shape,
                format!(
                    "{} elements cannot be viewed as {}",
                    self.elem_count(),
                    shape.elem_count()
                ),
            ));
        }
        if &shape == self.shape() {
            return Ok(self.clone());
        }
        let src = match self.layout().reshape(&shape) {
            Some(_) => self.clone(),
            None => self.contiguous()?,
        };
        let layout = src
            .layout()
            .reshape(&shape)
            .ok_or_else(|| Error::invalid_shape("reshape", src.shape(), "contiguous copy"))?;
        Ok(src.view_with_op(layout, || Op::Reshape {
            from: self.shape().clone(),
        }))
    }

    /// Merges dims `start..=end` into one.
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        if self.rank() == 0 {
            return self.reshape(vec![1]);
        }
        let (s, e) = (
            self.shape().dim("flatten", start)?,
            self.shape().dim("flatten", end)?,
        );
        if s > e {
            return Err(Error::invalid_arg(
                "flatten",
                "start",
                s,
                format!("at most end = {e}"),
            ));
        }
        let d = self.dims();
        let mut out = d[..s].to_vec();
        out.push(d[s..=e].iter().product());
        out.extend_from_slice(&d[e + 1..]);
        self.reshape(out)
    }

    /// All dims in one.
    pub fn flatten_all(&self) -> Result<Tensor> {
        self.reshape(vec![self.elem_count()])
    }

    /// Inserts a dim of size 1 at `dim`.
    pub fn unsqueeze(&self, dim: usize) -> Result<Tensor> {
        if dim > self.rank() {
            return Err(Error::DimOutOfRange {
                op: "unsqueeze",
                dim: dim as isize,
                rank: self.rank(),
            });
        }
        let mut d = self.dims().to_vec();
        d.insert(dim, 1);
        self.reshape(d)
    }

    /// Removes a dim of size 1.
    pub fn squeeze(&self, dim: isize) -> Result<Tensor> {
        let d = self.shape().dim("squeeze", dim)?;
        if self.dims()[d] != 1 {
            return Err(Error::invalid_shape(
                "squeeze",
                self.shape(),
                format!("dim {d} has size {}, not 1", self.dims()[d]),
            ));
        }
        let mut dims = self.dims().to_vec();
        dims.remove(d);
        self.reshape(dims)
    }

    /// Reorders the dims: output dim `i` is input dim `perm[i]`. A view.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let rank = self.rank();
        let mut seen = vec![false; rank];
        let valid = perm.len() == rank
            && perm
                .iter()
                .all(|&p| p < rank && !std::mem::replace(&mut seen[p], true));
        if !valid {
            return Err(Error::invalid_arg(
                "permute",
                "perm",
                format!("{perm:?}"),
                format!("a permutation of 0..{rank}"),
            ));
        }
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(self.clone());
        }
        Ok(
            self.view_with_op(self.layout().permute(perm), || Op::Permute {
                perm: perm.to_vec(),
            }),
        )
    }

    /// Swaps two dims. A view.
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let (a, b) = (
            self.shape().dim("transpose", d0)?,
            self.shape().dim("transpose", d1)?,
        );
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// Elements `start..start+len` along `dim`. A view.
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let d = self.shape().dim("narrow", dim)?;
        let n = self.dims()[d];
        if start.checked_add(len).is_none_or(|end| end > n) {
            return Err(Error::invalid_arg(
                "narrow",
                "start + len",
                format!("{start} + {len}"),
                format!("at most the size of dim {d}, {n}"),
            ));
        }
        if start == 0 && len == n {
            return Ok(self.clone());
        }
        Ok(
            self.view_with_op(self.layout().narrow(d, start, len), || Op::Narrow {
                from: self.shape().clone(),
                dim: d,
                start,
            }),
        )
    }

    /// Concatenates along `dim`; all tensors share dtype, device and every other dim.
    pub fn cat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        if let Some(cast) = super::autocast::inputs_n(super::autocast::OpKind::Cat, tensors)? {
            return Tensor::cat(&cast.iter().collect::<Vec<_>>(), dim);
        }
        let first = tensors.first().ok_or_else(|| {
            Error::invalid_shape("cat", &Shape::scalar(), "no tensors to concatenate")
        })?;
        let d = first.shape().dim("cat", dim)?;
        for t in &tensors[1..] {
            first.same_device("cat", t)?;
            if t.dtype() != first.dtype() {
                return Err(Error::DTypeMismatch {
                    op: "cat",
                    lhs: first.dtype(),
                    rhs: t.dtype(),
                });
            }
            let ok = t.rank() == first.rank()
                && (0..t.rank()).all(|i| i == d || t.dims()[i] == first.dims()[i]);
            if !ok {
                return Err(Error::shape_mismatch(
                    "cat",
                    first.shape(),
                    t.shape(),
                    format!("every dim but {d} must match"),
                ));
            }
        }
        if tensors.len() == 1 {
            return Ok((*first).clone());
        }
        let lens: Vec<usize> = tensors.iter().map(|t| t.dims()[d]).collect();
        let parts: Vec<Tensor> = tensors
            .iter()
            .map(|t| t.contiguous())
            .collect::<Result<_>>()?;
        let guards: Vec<_> = parts.iter().map(|t| t.storage()).collect();
        let layouts: Vec<_> = parts.iter().map(|t| t.layout()).collect();
        let operands: Vec<(&Storage, &Layout)> = guards
            .iter()
            .zip(&layouts)
            .map(|(g, l)| (&**g, &**l))
            .collect();
        let s = Storage::cat(&operands, d)?;
        drop(guards);
        let mut shape = first.dims().to_vec();
        shape[d] = lens
            .iter()
            .try_fold(0usize, |a, &l| a.checked_add(l))
            .unwrap_or(usize::MAX);
        let shape = Shape::new(shape);
        super::check_size("cat", &shape, first.dtype())?;
        Ok(Tensor::from_op(s, shape, tensors, || Op::Cat {
            lens: tensors.iter().map(|t| t.dims()[d]).collect(),
            dim: d,
        }))
    }

    /// This tensor broadcast (numpy rules) to `shape`: a view with stride 0 along the broadcast
    /// dims.
    pub fn broadcast_as(&self, shape: &Shape) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        super::check_size("broadcast_as", shape, self.dtype())?;
        let b = self.shape().broadcast_with("broadcast_as", shape)?;
        if &b != shape {
            return Err(Error::shape_mismatch(
                "broadcast_as",
                self.shape(),
                shape,
                "cannot broadcast to the target",
            ));
        }
        Ok(
            self.view_with_op(self.layout().expand(shape), || Op::BroadcastTo {
                from: self.shape().clone(),
            }),
        )
    }

    /// The same values in a row-major layout: this tensor when it already is, else a copy
    /// (recorded: the gradient passes through).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.layout().is_contiguous() {
            return Ok(self.clone());
        }
        self.relayout(Layout::contiguous(self.shape().clone()))
    }

    /// The same values laid out in `format` (PyTorch's `to(memory_format=...)`): this tensor
    /// when its strides already are in it (as [`Tensor::memory_format`] reads them: a `[n, 1,
    /// h, w]` row-major tensor asked for channels_last gets channels_last strides, so that the
    /// ops after it run channels_last), else a copy. Channels_last applies to 4-D tensors;
    /// other ranks are laid out contiguous.
    pub fn to_memory_format(&self, format: MemoryFormat) -> Result<Tensor> {
        let target = Layout::with_format(self.shape().clone(), format);
        let l = self.layout();
        if l.memory_format() == Some(format) || (self.rank() != 4 && l.is_contiguous()) {
            return Ok(self.clone());
        }
        self.relayout(target)
    }

    /// Whether the strides are those of `format` (PyTorch's `is_contiguous(memory_format=...)`).
    pub fn is_contiguous_for(&self, format: MemoryFormat) -> bool {
        self.layout().is_format(format)
    }

    /// The memory format of the strides (PyTorch's `suggest_memory_format`; see
    /// [`Layout::memory_format`] for tensors both fit), `None` for other strided views.
    pub fn memory_format(&self) -> Option<MemoryFormat> {
        self.layout().memory_format()
    }

    /// Row-major at offset 0 over a buffer of exactly its elements: what raw buffer access
    /// (host reads, files, device transfers) needs. This tensor when it already is.
    pub(crate) fn compact(&self) -> Result<Tensor> {
        let l = self.layout();
        if l.is_contiguous() && l.offset() == 0 && self.storage().len() == l.elem_count() {
            return Ok(self.clone());
        }
        self.relayout(Layout::contiguous(self.shape().clone()))
    }

    /// These values with `other`'s strides (for a gradient and its variable): this tensor when
    /// the strides already match, else a copy.
    pub(crate) fn laid_out_like(&self, other: &Tensor) -> Result<Tensor> {
        if self.layout().strides() == other.layout().strides() && self.layout().is_dense() {
            return Ok(self.clone());
        }
        let target = if other.layout().is_dense() {
            other.layout().dense_like()
        } else {
            Layout::contiguous(other.shape().clone())
        };
        if self.layout().strides() == target.strides() {
            return Ok(self.clone());
        }
        self.relayout(target)
    }

    /// A copy laid out as `target` (dense, offset 0).
    fn relayout(&self, target: Layout) -> Result<Tensor> {
        let s = self.storage().copy_strided(&self.layout(), &target)?;
        Ok(Tensor::from_op(s, target, &[self], || Op::Relayout))
    }

    /// The formats a 4-D op (convolution, batch norm, pooling) runs and returns in: it keeps
    /// its input's format (channels_last also when a convolution's `weight` is, as PyTorch's
    /// cuDNN convolution chooses), and runs in it where the backend has kernels for it (else
    /// on contiguous copies, converting the result back).
    pub(crate) fn op_formats(&self, weight: Option<&Tensor>) -> (MemoryFormat, MemoryFormat) {
        let cl =
            |t: &Tensor| t.rank() == 4 && t.memory_format() == Some(MemoryFormat::ChannelsLast);
        let keep = if cl(self) || weight.is_some_and(cl) {
            MemoryFormat::ChannelsLast
        } else {
            MemoryFormat::Contiguous
        };
        let run = if keep == MemoryFormat::ChannelsLast && self.storage().channels_last_native() {
            keep
        } else {
            MemoryFormat::Contiguous
        };
        (run, keep)
    }

    /// The values in `format` at offset 0 over a buffer of their own size where needed: what
    /// kernels that take a format (not strides) read. This tensor when it already is.
    pub(crate) fn packed_as(&self, format: MemoryFormat) -> Result<Tensor> {
        let l = self.layout();
        if l.is_format(format) && l.offset() == 0 && self.storage().len() == l.elem_count() {
            return Ok(self.clone());
        }
        self.relayout(Layout::with_format(self.shape().clone(), format))
    }
}
