//! CUDA graphs: record a sequence of GPU work once, then replay it with one launch and no
//! per-kernel host work. [`capture`] runs a closure with the device's stream in capture mode
//! (nothing executes) and returns the [`Graph`]; [`Graph::launch`] replays it.
//!
//! ```no_run
//! # fn main() -> mixprec::Result<()> {
//! use mixprec::{graph, DType, Device, Tensor};
//! let dev = Device::cuda(0)?;
//! let x = Tensor::ones([1024], DType::F32, dev)?;
//! let y = Tensor::zeros([1024], DType::F32, dev)?;
//! let mut g = graph::capture(dev, || {
//!     let t = x.mul_scalar(2.0)?.exp()?; // temporaries: graph memory, freed inside the graph
//!     y.copy_in_place(&t)                // results go to buffers made before the capture
//! })?;
//! for _ in 0..100 {
//!     g.launch()?; // y = exp(2x), one launch
//! }
//! # Ok(()) }
//! ```
//!
//! The rules (see `backend/cuda/graph.rs` for how each is enforced):
//! - a replay reuses the capture's pointers: results must be written into buffers that exist
//!   before the capture (in place), and inputs read from them; tensors computed inside the
//!   closure are temporaries whose memory belongs to the graph and may not outlive the closure;
//! - whatever cannot be recorded (a host read such as `item()`, a copy from host memory, an op
//!   on CPU tensors, a first use that compiles, searches or allocates a cache) is an
//!   [`Error::Capture`] naming the op, and the capture fails even if the closure ignores it;
//! - a buffer the graph uses that is later dropped or replaced makes the graph stale, and
//!   launching it is an error (its memory is kept until the graph drops, never reused);
//! - other threads may not use the device while it is being captured (their work is refused).
//!
//! [`crate::amp::CapturedStep`] builds on this to capture a whole AMP training step.

use crate::backend::cuda;
use crate::base::error::{Error, Result};
use crate::tensor::Device;

pub use crate::backend::cuda::Graph;

/// Captures the GPU work `f` enqueues on `device` into a graph (nothing runs now). Errors: a
/// CPU device, an op `f` runs that cannot be captured (by name), CUDA invalidating the capture,
/// graph memory outliving `f`.
pub fn capture(device: Device, f: impl FnOnce() -> Result<()>) -> Result<Graph> {
    let Device::Cuda(i) = device else {
        return Err(Error::Capture {
            op: "graph::capture",
            detail: format!(
                "CUDA graphs need a CUDA device, not {device} (run the work eagerly there)"
            ),
        });
    };
    let dev = cuda::device(i)?;
    // Casts cached before the capture would be baked into the graph with their old values.
    crate::tensor::autocast::invalidate_casts();
    cuda::graph::begin(&dev)?;
    // Ends the capture if `f` panics, so that the device's stream is usable again.
    struct Abort<'a>(&'a std::sync::Arc<cuda::CudaDevice>, bool);
    impl Drop for Abort<'_> {
        fn drop(&mut self) {
            if self.1 {
                cuda::graph::abort(self.0);
            }
        }
    }
    let mut guard = Abort(&dev, true);
    let r = f();
    guard.1 = false;
    match r {
        Ok(()) => cuda::graph::end(&dev),
        Err(e) => {
            cuda::graph::abort(&dev);
            Err(e)
        }
    }
}

/// Whether this thread is inside [`capture`].
pub fn is_capturing() -> bool {
    cuda::graph::is_capturing()
}

/// An error when this thread is capturing on `device`: `op` must not be recorded (`why`).
pub(crate) fn refuse_in_capture(device: Device, op: &'static str, why: &str) -> Result<()> {
    match device {
        Device::Cuda(i) => cuda::graph::refuse(i, op, why),
        Device::Cpu => refuse_host_op(op),
    }
}

/// An error when this thread is capturing: `op` is an op on CPU tensors, computed now and not
/// repeated by a replay.
pub(crate) fn refuse_host_op(op: &'static str) -> Result<()> {
    cuda::graph::refuse_host_op(op)
}

/// Runs `hook` on the host after every replay of the graph this thread is capturing (host-side
/// bookkeeping an eager run does at this point); false when not capturing (the caller then does
/// the work now).
pub(crate) fn on_replay(hook: impl FnMut() -> Result<()> + Send + 'static) -> bool {
    cuda::graph::on_replay(Box::new(hook))
}
