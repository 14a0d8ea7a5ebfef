// reduce.cu: sum/max/min over the middle dimension of (outer, len, inner), accumulated in f32
// (f64 for f64); argmax (first maximum, NaN counts as the maximum).

template <typename A> struct Red {
    int op;  // 0 sum, 1 max, 2 min (backend::ReduceOp order)
    __device__ A init() const { return op == 0 ? (A)0 : (op == 1 ? -inf_of<A>() : inf_of<A>()); }
    __device__ A operator()(A a, A b) const {
        if (op == 0) return a + b;
        if (is_nan(a) || is_nan(b)) return nan_of<A>();
        if (op == 1) return a > b ? a : b;
        return a < b ? a : b;
    }
};

// inner == 1: one block per row.
template <typename T>
__device__ void reduce_rows(int op, u64 outer, u64 len, const T* x, T* y) {
    typedef typename Num<T>::acc A;
    __shared__ A sh[32];
    Red<A> r{op};
    for (u64 o = blockIdx.x; o < outer; o += gridDim.x) {
        const T* row = x + o * len;
        A acc = r.init();
        for (u64 j = threadIdx.x; j < len; j += blockDim.x) acc = r(acc, Num<T>::to(row[j]));
        acc = block_reduce(acc, r, r.init(), sh);
        if (threadIdx.x == 0) y[o] = Num<T>::from(acc);
    }
}

// inner > 1: one thread per (outer, inner) lane; neighbouring threads read neighbouring elements.
template <typename T>
__device__ void reduce_lanes(int op, u64 outer, u64 len, u64 inner, const T* x, T* y) {
    typedef typename Num<T>::acc A;
    Red<A> r{op};
    u64 n = outer * inner;
    for (u64 k = global_tid(); k < n; k += global_stride()) {
        u64 o = k / inner, i = k - o * inner;
        const T* p = x + o * len * inner + i;
        A acc = r.init();
        for (u64 j = 0; j < len; j++) acc = r(acc, Num<T>::to(p[j * inner]));
        y[k] = Num<T>::from(acc);
    }
}

// inner > 1 with few lanes and long ones (a bias gradient: 10 lanes of 128 rows): one block per
// lane (`block_fold`: its threads striding the length, then the block's fixed-order tree). A thread per
// lane would leave the GPU idle while a handful of threads each walk their lane alone.
template <typename T>
__device__ void reduce_lanes_wide(int op, u64 outer, u64 len, u64 inner, const T* x, T* y) {
    typedef typename Num<T>::acc A;
    __shared__ A sh[32];
    Red<A> r{op};
    for (u64 k = blockIdx.x; k < outer * inner; k += gridDim.x) {
        u64 o = k / inner, i = k - o * inner;
        const T* p = x + o * len * inner + i;
        A acc = block_fold(len, r, r.init(), [&](u64 j) { return Num<T>::to(p[j * inner]); }, sh);
        if (threadIdx.x == 0) y[k] = Num<T>::from(acc);
    }
}

template <typename T>
__device__ void argmax_lanes(u64 outer, u64 len, u64 inner, const T* x, i64* y) {
    u64 n = outer * inner;
    for (u64 k = global_tid(); k < n; k += global_stride()) {
        u64 o = k / inner, i = k - o * inner;
        const T* p = x + o * len * inner + i;
        double best = 0.0;
        i64 bj = 0;
        for (u64 j = 0; j < len; j++) {
            double v = (double)Num<T>::to(p[j * inner]);
            if (is_nan(v)) { bj = (i64)j; break; }
            if (j == 0 || v > best) { best = v; bj = (i64)j; }
        }
        y[k] = bj;
    }
}

#define REDUCE(N, T)                                                                                \
    extern "C" __global__ void reduce_rows_##N(int op, u64 outer, u64 len, const T* x, T* y) {      \
        reduce_rows<T>(op, outer, len, x, y);                                                       \
    }                                                                                               \
    extern "C" __global__ void reduce_lanes_##N(int op, u64 outer, u64 len, u64 inner, const T* x,  \
                                                T* y) {                                             \
        reduce_lanes<T>(op, outer, len, inner, x, y);                                               \
    }                                                                                               \
    extern "C" __global__ void reduce_lanes_wide_##N(int op, u64 outer, u64 len, u64 inner,         \
                                                     const T* x, T* y) {                            \
        reduce_lanes_wide<T>(op, outer, len, inner, x, y);                                          \
    }
REDUCE(f16, f16)
REDUCE(bf16, bf16)
REDUCE(f32, float)
REDUCE(f64, double)

#define ARGMAX(N, T)                                                                                \
    extern "C" __global__ void argmax_##N(u64 outer, u64 len, u64 inner, const T* x, i64* y) {      \
        argmax_lanes<T>(outer, len, inner, x, y);                                                   \
    }
ARGMAX(f16, f16)
ARGMAX(bf16, bf16)
ARGMAX(f32, float)
ARGMAX(f64, double)
ARGMAX(i64, i64)
