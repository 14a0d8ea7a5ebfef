//! The CUDA backend: context and stream per device with a stream-ordered memory pool
//! (`device.rs`), library probing (`probe.rs`), the NVRTC kernel registry with its on-disk cache
//! (`registry.rs`), kernel launches (`launch.rs`), the buffer type (`storage.rs`) and its ops
//! (`ops.rs`), cuBLAS matmul (`matmul.rs`) and cuDNN convolution (`conv.rs`, with the graph API in
//! `cudnn_graph.rs`), and pinned host buffers with asynchronous uploads for the data loader
//! (`pinned.rs`).
//! Kernels are in `kernels/*.cu` at the crate root.

mod conv;
mod cudnn_graph;
mod device;
mod launch;
mod matmul;
mod multi_tensor;
mod ops;
mod pinned;
mod probe;
mod registry;
mod storage;

pub use conv::{conv_plans, ConvPlanInfo};
pub use device::{
    get as device, host_sync_count, set_allow_tf32, set_poison_allocations, CudaDevice,
};
pub use multi_tensor::{
    cached_lists, table_cache_clears, tables_built_on_this_thread, CudaMultiTensor,
};
pub use pinned::PinnedBuffer;
pub use probe::probe;
pub use storage::CudaStorage;

/// Whether f32 matmul/convolution may use TF32 (see [`set_allow_tf32`]).
pub fn allow_tf32() -> bool {
    device::allow_tf32()
}
