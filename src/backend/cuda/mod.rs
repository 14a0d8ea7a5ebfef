//! The CUDA backend: context and stream per device with a stream-ordered memory pool
//! (`device.rs`), library probing (`probe.rs`), the NVRTC kernel registry with its on-disk cache
//! (`registry.rs`), kernel launches (`launch.rs`), the buffer type and its [`BackendStorage`]
//! (`storage.rs`), diagnostics (`profile.rs`: per-op device time, pool memory), and one
//! file per op family, named as its kernels in `kernels/*.cu` at the crate root and holding
//! the family trait's impl for [`CudaStorage`]: `cast.rs`,
//! `elementwise.rs`, `layout.rs`, `reduce.rs`, `index.rs`, `softmax.rs`, `batch_norm.rs`,
//! `pool.rs` (batch norm's cuDNN candidate: `cudnn_batch_norm.rs`), cuBLAS `matmul.rs`, cuDNN `conv.rs` (the plan choice; the two cuDNN APIs in
//! `cudnn_graph.rs` and `cudnn_legacy.rs`, the timer in `conv_tune.rs`, the on-disk plan cache in
//! `conv_cache.rs`), `multi_tensor.rs`; `common.rs` holds what they share. In-place updates of a
//! buffer that keeps its address are `in_place.rs`; CUDA-graph capture (refusals, graph memory,
//! pinned buffers, replay hooks) is `graph.rs`; the second stream, for backward's weight
//! gradients, is `side_stream.rs`; pinned host buffers with asynchronous uploads for
//! the data loader are `pinned.rs`.
//!
//! [`BackendStorage`]: crate::backend::BackendStorage

mod activation;
mod attention;
mod batch_norm;
mod batch_norm_choice;
mod batch_norm_launch;
mod batch_norm_sync;
mod cast;
mod common;
mod conv;
mod conv_cache;
mod conv_choice;
mod conv_direct;
mod conv_plan;
mod conv_report;
mod conv_space_to_depth;
mod conv_tune;
mod cross_entropy;
mod cudnn;
pub mod cudnn_attention;
mod cudnn_batch_norm;
mod cudnn_graph;
mod cudnn_legacy;
mod cudnn_op_graph;
mod device;
mod dropout;
mod elementwise;
mod embedding;
pub mod flash_attention;
pub(crate) mod generated;
pub(crate) mod graph;
pub(crate) mod in_place;
mod index;
mod launch;
mod layer_norm;
mod layout;
mod matmul;
mod matmul_lt;
pub(crate) mod multi_tensor;
mod peer;
mod pinned;
mod pool;
mod probe;
mod profile;
mod reduce;
mod registry;
pub(crate) mod side_stream;
mod softmax;
mod storage;

pub use attention::flash_attention_available;
pub use batch_norm_choice::{
    batch_norm_choices, batch_norm_impl, set_batch_norm_impl, with_batch_norm_impl,
    BatchNormChoice, BatchNormImpl,
};
pub(crate) use conv::conv2d_backward_input_add;
pub use conv_plan::PlanSource;
pub use conv_report::{
    clear_conv_plans, conv_plan_cache_dir, conv_plans, conv_timing_runs, ConvPlanInfo,
};
pub use conv_space_to_depth::{
    conv_space_to_depth_choices, with_conv_space_to_depth, SpaceToDepth, SpaceToDepthChoice,
};
pub use device::{
    allocation_count, deterministic, device_count, get as device, host_sync_count, set_allow_tf32,
    set_deterministic, set_poison_allocations, CudaDevice, ReadCheck,
};
/// The capture rule for work on the host: an op on CPU tensors is refused while this thread
/// captures a CUDA graph (it would run once now and a replay would not repeat it).
pub(crate) use graph::refuse_host_op;
pub use graph::{Graph, GraphNodes};
pub use multi_tensor::{
    cached_lists, table_cache_clears, tables_built_on_this_thread, CudaMultiTensor,
};
pub use pinned::PinnedBuffer;
pub(crate) use probe::no_panic;
pub use probe::probe;
pub(crate) use profile::OpTimer;
pub use profile::{
    external_profiler_range, mem_get_info, memory_stats, op_profile, reset_peak_memory,
    set_op_profiling, MemoryStats, OpProfileRow,
};
pub use registry::{compile_all_for, compile_generated_for, kernel_families};
pub use side_stream::{set_side_stream, side_stream_forks};
pub use storage::CudaStorage;

/// Whether f32 matmul/convolution may use TF32 (see [`set_allow_tf32`]).
pub fn allow_tf32() -> bool {
    device::allow_tf32()
}
