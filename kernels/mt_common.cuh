// mt_common.cuh: multi-tensor apply (prepended to multi_tensor.cu and fused_optim.cu after
// common.cuh). apex's design with the chunk→tensor table in device memory: the launcher builds
// one table per tensor list (and dtype signature), caches it, and launches one block per chunk.
// MT_CHUNK (elements per chunk) is defined by the launcher from backend::MT_CHUNK, the one
// value the CPU backend's chunked norms share.

// One tensor: up to six buffers by role (0 when absent), its length, its slot in per-tensor
// arrays, the global index of its first chunk (into norm partials). Mirrors MtTensor in
// src/backend/cuda/multi_tensor.rs.
struct TEnt {
    u64 p[6];
    u64 n;
    u64 slot;
    u64 chunk0;
    u64 pad;
};
// One block's work: tensor index into the table and chunk index within the tensor.
struct CEnt {
    unsigned t;
    unsigned c;
};

__device__ __forceinline__ u64 umin64(u64 a, u64 b) { return a < b ? a : b; }
__device__ __forceinline__ bool finite_f(float v) { return fabsf(v) <= 3.40282347e38f; }

template <typename T> struct alignas(4 * sizeof(T)) V4 { T v[4]; };

// Four consecutive elements from i (relative to the tensor start) as f32; vectorised when the
// tensor's buffers are 16-byte aligned and all four are in range, scalar at the tail.
template <typename T>
__device__ __forceinline__ void ld4(u64 base, u64 i, u64 end, bool vec, float r[4]) {
    const T* p = (const T*)base;
    if (vec && i + 4 <= end) {
        V4<T> a = *(const V4<T>*)(p + i);
#pragma unroll
        for (int k = 0; k < 4; k++) r[k] = (float)Num<T>::to(a.v[k]);
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++) r[k] = (i + k < end) ? (float)Num<T>::to(p[i + k]) : 0.0f;
    }
}
template <typename T>
__device__ __forceinline__ void st4(u64 base, u64 i, u64 end, bool vec, const float r[4]) {
    T* p = (T*)base;
    if (vec && i + 4 <= end) {
        V4<T> a;
#pragma unroll
        for (int k = 0; k < 4; k++) a.v[k] = Num<T>::from(r[k]);
        *(V4<T>*)(p + i) = a;
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (i + k < end) p[i + k] = Num<T>::from(r[k]);
    }
}

// Declares `te` (the tensor), `start`/`end` (this block's chunk) and `vec`, then loops `i` over
// the chunk four elements per thread.
#define MT_LOOP(tens, chunks)                                                                  \
    const CEnt ce_ = chunks[blockIdx.x];                                                        \
    const TEnt te = tens[ce_.t];                                                                \
    const u64 start = (u64)ce_.c * MT_CHUNK;                                                    \
    const u64 end = umin64(te.n, start + MT_CHUNK);                                             \
    const bool vec = ((te.p[0] | te.p[1] | te.p[2] | te.p[3] | te.p[4] | te.p[5]) & 15ULL) == 0; \
    for (u64 i = start + (u64)threadIdx.x * 4; i < end; i += (u64)blockDim.x * 4)

struct AddF { __device__ __forceinline__ float operator()(float a, float b) const { return a + b; } };
struct MaxF { __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); } };

__device__ __forceinline__ float bias_corr(float on, float beta, float step) {
    return on != 0.0f ? 1.0f - powf(beta, step) : 1.0f;
}
