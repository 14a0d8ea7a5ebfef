//! The CUDA backend (see the CUDA issue): context and stream, NVRTC kernel registry, cuBLASLt
//! matmul, cuDNN convolution, multi-tensor apply.
