//! The attention family on CUDA.

/// Whether the fused (flash) attention kernels are built into this process: the one switch
/// [`crate::tensor::fused_supported`] reads. Off until the kernels are wired in.
pub fn flash_attention_available() -> bool {
    false
}
