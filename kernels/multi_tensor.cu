// multi_tensor.cu: scale (unscale + overflow flag), non-finite check, zero, axpby, norms (two stages:
// per-chunk partials, then per-tensor and global), the loss-scale update, and the batched
// gradient accumulation whose list is passed by value.

template <typename I, typename O>
__device__ void mt_scale(const TEnt* tens, const CEnt* chunks, const float* mult, float* found) {
    const float s = *mult;
    bool bad = false;
    MT_LOOP(tens, chunks) {
        float r[4];
        ld4<I>(te.p[0], i, end, vec, r);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            bad |= !finite_f(r[k]);
            r[k] *= s;
        }
        st4<O>(te.p[1], i, end, vec, r);
    }
    if (bad) *found = 1.0f;
}

template <typename I>
__device__ void mt_check(const TEnt* tens, const CEnt* chunks, float* found) {
    bool bad = false;
    MT_LOOP(tens, chunks) {
        float r[4];
        ld4<I>(te.p[0], i, end, vec, r);
#pragma unroll
        for (int k = 0; k < 4; k++) bad |= !finite_f(r[k]);
    }
    if (bad) *found = 1.0f;
}

// output = 0 (PyTorch's _foreach_zero_): one launch zeroes every persistent gradient of a dtype.
template <typename O>
__device__ void mt_zero(const TEnt* tens, const CEnt* chunks) {
    const float r[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    MT_LOOP(tens, chunks) { st4<O>(te.p[1], i, end, vec, r); }
}

struct AxpbyP { float a; float b; unsigned check; unsigned pad; };

template <typename X, typename Y, typename O>
__device__ void mt_axpby(const TEnt* tens, const CEnt* chunks, float* found, AxpbyP q) {
    bool bad = false;
    MT_LOOP(tens, chunks) {
        float x[4], y[4], o[4];
        ld4<X>(te.p[0], i, end, vec, x);
        ld4<Y>(te.p[1], i, end, vec, y);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (q.check & 1) bad |= !finite_f(x[k]);
            if (q.check & 2) bad |= !finite_f(y[k]);
            o[k] = q.a * x[k] + q.b * y[k];
        }
        st4<O>(te.p[2], i, end, vec, o);
    }
    if (bad) *found = 1.0f;
}

// Stage 1: partials[chunk0 + c] = sum of squares (or max abs) of this chunk of in·mult.
template <typename I>
__device__ void mt_norm(const TEnt* tens, const CEnt* chunks, const float* mult, float* found,
                        float* partials, unsigned inf) {
    __shared__ float sh[32];
    const float s = mult ? *mult : 1.0f;
    float acc = 0.0f;
    bool bad = false;
    MT_LOOP(tens, chunks) {
        float r[4];
        ld4<I>(te.p[0], i, end, vec, r);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float v = r[k] * s;
            bad |= !finite_f(v);
            acc = inf ? fmaxf(acc, fabsf(v)) : acc + v * v;
        }
    }
    if (bad && found) *found = 1.0f;
    acc = inf ? block_reduce(acc, MaxF(), 0.0f, sh) : block_reduce(acc, AddF(), 0.0f, sh);
    if (threadIdx.x == 0) partials[te.chunk0 + ce_.c] = acc;
}

// Stage 2: one block per tensor: spans[t] = (chunk0, chunks, slot); tensor_acc[t] = its total;
// per_out[slot] = its norm when per_out is given.
extern "C" __global__ void mt_norm_tensor(const u64* spans, const float* partials, float* tensor_acc,
                                          float* per_out, unsigned inf) {
    __shared__ float sh[32];
    const u64 c0 = spans[3 * blockIdx.x], nc = spans[3 * blockIdx.x + 1], slot = spans[3 * blockIdx.x + 2];
    float acc = 0.0f;
    for (u64 c = threadIdx.x; c < nc; c += blockDim.x) acc = inf ? fmaxf(acc, partials[c0 + c]) : acc + partials[c0 + c];
    acc = inf ? block_reduce(acc, MaxF(), 0.0f, sh) : block_reduce(acc, AddF(), 0.0f, sh);
    if (threadIdx.x == 0) {
        tensor_acc[blockIdx.x] = acc;
        if (per_out) per_out[slot] = inf ? acc : sqrtf(acc);
    }
}

// Stage 3: one block: total[0] = norm over all tensors.
extern "C" __global__ void mt_norm_total(const float* tensor_acc, u64 nt, float* total, unsigned inf) {
    __shared__ float sh[32];
    float acc = 0.0f;
    for (u64 t = threadIdx.x; t < nt; t += blockDim.x) acc = inf ? fmaxf(acc, tensor_acc[t]) : acc + tensor_acc[t];
    acc = inf ? block_reduce(acc, MaxF(), 0.0f, sh) : block_reduce(acc, AddF(), 0.0f, sh);
    if (threadIdx.x == 0) total[0] = inf ? acc : sqrtf(acc);
}

struct ScaleP { float growth; float backoff; float window; float mn; float mx; unsigned pad; };

// PyTorch's _amp_update_scale_ (one thread).
extern "C" __global__ void update_scale(float* scale, float* unskipped, float* skipped, float* found, ScaleP q) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    if (*found != 0.0f) {
        *scale = fmaxf(*scale * q.backoff, q.mn);
        *unskipped = 0.0f;
        *skipped = *skipped + 1.0f;
    } else {
        float u = *unskipped + 1.0f;
        if (u >= q.window) {
            *scale = fminf(*scale * q.growth, q.mx);
            *unskipped = 0.0f;
        } else {
            *unskipped = u;
        }
    }
    *found = 0.0f;
}

#define MT_T1(M, A, TA) M(A, TA, f32, float) M(A, TA, f16, f16) M(A, TA, bf16, bf16)
#define MT_ALL1(M) M(f32, float) M(f16, f16) M(bf16, bf16)

#define SCALE(IN, I, ON, O) \
    extern "C" __global__ void mt_scale_##IN##_##ON(const TEnt* t, const CEnt* c, const float* m, float* f) { mt_scale<I, O>(t, c, m, f); }
MT_T1(SCALE, f32, float)
MT_T1(SCALE, f16, f16)
MT_T1(SCALE, bf16, bf16)

#define CHECK(IN, I) \
    extern "C" __global__ void mt_check_##IN(const TEnt* t, const CEnt* c, float* f) { mt_check<I>(t, c, f); }
MT_ALL1(CHECK)

#define ZERO(ON, O) \
    extern "C" __global__ void mt_zero_##ON(const TEnt* t, const CEnt* c) { mt_zero<O>(t, c); }
MT_ALL1(ZERO)

#define NORM(IN, I) \
    extern "C" __global__ void mt_norm_##IN(const TEnt* t, const CEnt* c, const float* m, float* f, float* p, unsigned inf) { mt_norm<I>(t, c, m, f, p, inf); }
MT_ALL1(NORM)

#define AXPBY(XN, X, YN, Y, ON, O) \
    extern "C" __global__ void mt_axpby_##XN##_##YN##_##ON(const TEnt* t, const CEnt* c, float* f, AxpbyP q) { mt_axpby<X, Y, O>(t, c, f, q); }
#define AXPBY_O(XN, X, YN, Y) AXPBY(XN, X, YN, Y, f32, float) AXPBY(XN, X, YN, Y, f16, f16) AXPBY(XN, X, YN, Y, bf16, bf16)
#define AXPBY_Y(XN, X) AXPBY_O(XN, X, f32, float) AXPBY_O(XN, X, f16, f16) AXPBY_O(XN, X, bf16, bf16)
AXPBY_Y(f32, float)
AXPBY_Y(f16, f16)
AXPBY_Y(bf16, bf16)

// Up to MT_ADD_MAX gradient accumulations `dst[t] += src[t]` by value: a backward's fresh
// gradients have new addresses every eager step, so their list travels in the launch's
// arguments (apex's original TensorListMetadata) rather than in a cached table. Tensor t owns
// blocks block0[t] .. block0[t + 1], one MT_CHUNK chunk each. Mirrors AddList in
// src/backend/cuda/in_place.rs.
#define MT_ADD_MAX 64
struct AddList {
    u64 dst[MT_ADD_MAX];
    u64 src[MT_ADD_MAX];
    u64 n[MT_ADD_MAX];
    unsigned block0[MT_ADD_MAX + 1];
    unsigned count;
};

// dst += src in f32, rounded once on store: the bits of the single `accumulate` kernel.
template <typename T>
__device__ void mt_add(const AddList& q) {
    unsigned t = 0;
    while (t + 1 < q.count && q.block0[t + 1] <= blockIdx.x) t++;
    const u64 dst = q.dst[t], src = q.src[t];
    const u64 start = (u64)(blockIdx.x - q.block0[t]) * MT_CHUNK;
    const u64 end = umin64(q.n[t], start + MT_CHUNK);
    const bool vec = ((dst | src) & 15ULL) == 0;
    for (u64 i = start + (u64)threadIdx.x * 4; i < end; i += (u64)blockDim.x * 4) {
        float a[4], b[4];
        ld4<T>(dst, i, end, vec, a);
        ld4<T>(src, i, end, vec, b);
#pragma unroll
        for (int k = 0; k < 4; k++) a[k] += b[k];
        st4<T>(dst, i, end, vec, a);
    }
}
#define ADD(N, T) \
    extern "C" __global__ void mt_add_##N(AddList q) { mt_add<T>(q); }
MT_ALL1(ADD)

// Up to 16 floats by value: what write_words stores.
struct Words16 { float w[16]; };

// dst[0..n) = q.w[0..n): how the host writes an optimizer's hyperparameter block (a launch, so
// no host staging and no synchronisation; stream-ordered before the kernels that read it).
extern "C" __global__ void write_words(float* dst, Words16 q, unsigned n) {
    const unsigned i = threadIdx.x;
    if (i < n && i < 16) dst[i] = q.w[i];
}

// dst[i] += src[i], in the dtype's arithmetic (half types in f32, rounded once on store: the same
// bits as the elementwise add). How a persistent gradient accumulates in place.
template <typename T>
__device__ void accumulate(u64 n, T* dst, const T* src) {
    typedef typename Num<T>::acc A;
    for (u64 i = global_tid(); i < n; i += global_stride()) {
        const A a = Num<T>::to(dst[i]), b = Num<T>::to(src[i]);
        dst[i] = Num<T>::from(a + b);
    }
}
#define ACCUMULATE(N, T) \
    extern "C" __global__ void accumulate_##N(u64 n, T* dst, const T* src) { accumulate<T>(n, dst, src); }
ACCUMULATE(f32, float)
ACCUMULATE(f16, f16)
ACCUMULATE(bf16, bf16)
ACCUMULATE(f64, double)
