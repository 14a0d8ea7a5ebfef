//! The CUDA backend: context and stream per device with a stream-ordered memory pool
//! (`device.rs`), library probing (`probe.rs`), the NVRTC kernel registry with its on-disk cache
//! (`registry.rs`), kernel launches (`launch.rs`), the buffer type and its [`BackendStorage`]
//! dispatch (`storage.rs`), diagnostics (`profile.rs`: per-op device time, pool memory), and one
//! file per op family, named as its kernels in `kernels/*.cu` at the crate root: `cast.rs`,
//! `elementwise.rs`, `layout.rs`, `reduce.rs`, `index.rs`, `softmax.rs`, `batch_norm.rs`,
//! `pool.rs`, cuBLAS `matmul.rs`, cuDNN `conv.rs` (with the graph API in `cudnn_graph.rs`),
//! `multi_tensor.rs`; `common.rs` holds what they share.
//!
//! [`BackendStorage`]: crate::backend::BackendStorage

mod batch_norm;
mod cast;
mod common;
mod conv;
mod cudnn_graph;
mod device;
mod elementwise;
mod index;
mod launch;
mod layout;
mod matmul;
mod multi_tensor;
mod pool;
mod probe;
mod profile;
mod reduce;
mod registry;
mod softmax;
mod storage;

pub use conv::{conv_plans, ConvPlanInfo};
pub use device::{
    get as device, host_sync_count, set_allow_tf32, set_poison_allocations, CudaDevice,
};
pub use multi_tensor::{
    cached_lists, table_cache_clears, tables_built_on_this_thread, CudaMultiTensor,
};
pub use probe::probe;
pub(crate) use profile::OpTimer;
pub use profile::{
    mem_get_info, memory_stats, op_profile, reset_peak_memory, set_op_profiling, MemoryStats,
    OpProfileRow,
};
pub use registry::compile_all_for;
pub use storage::CudaStorage;

/// Whether f32 matmul/convolution may use TF32 (see [`set_allow_tf32`]).
pub fn allow_tf32() -> bool {
    device::allow_tf32()
}
