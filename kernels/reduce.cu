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

// A block's threads fold row[j0, j1) into `acc`: where the span starts 16-byte aligned, whole
// 16-byte packs first (thread t takes packs t, t + blockDim, ...; four in flight), then the
// tail one element at a time. One- and two-byte loads left most of each memory transaction
// unused. The order depends only on the shape and the alignment: results repeat.
template <typename T, typename A>
__device__ __forceinline__ A fold_span(const Red<A>& r, A acc, const T* row, u64 j0, u64 j1) {
    constexpr u64 V = 16 / sizeof(T);
    u64 j = j0;
    if ((((u64)(row + j0)) & 15) == 0) {
        const u64 nv = (j1 - j0) / V;
        const uint4* p = reinterpret_cast<const uint4*>(row + j0);
#pragma unroll 4
        for (u64 v = threadIdx.x; v < nv; v += blockDim.x) {
            const uint4 u = p[v];
            const T* t = reinterpret_cast<const T*>(&u);
#pragma unroll
            for (u64 k = 0; k < V; k++) acc = r(acc, Num<T>::to(t[k]));
        }
        j = j0 + nv * V;
    }
    for (u64 k = j + threadIdx.x; k < j1; k += blockDim.x) acc = r(acc, Num<T>::to(row[k]));
    return acc;
}

// inner == 1: one block per row.
template <typename T>
__device__ void reduce_rows(int op, u64 outer, u64 len, const T* x, T* y) {
    typedef typename Num<T>::acc A;
    __shared__ A sh[32];
    Red<A> r{op};
    for (u64 o = blockIdx.x; o < outer; o += gridDim.x) {
        const T* row = x + o * len;
        A acc = fold_span(r, r.init(), row, 0, len);
        acc = block_reduce(acc, r, r.init(), sh);
        if (threadIdx.x == 0) y[o] = Num<T>::from(acc);
    }
}

// inner == 1 with few, long rows (a whole tensor's sum): a block would walk its row alone with
// the GPU idle, so each row is cut into `splits` chunks of `chunk` elements, a block per chunk
// writing its partial (accumulator type); `reduce_parts` folds each row's partials in order.
template <typename T>
__device__ void reduce_row_chunks(int op, u64 len, u64 splits, u64 chunk, const T* x,
                                  typename Num<T>::acc* part) {
    typedef typename Num<T>::acc A;
    __shared__ A sh[32];
    Red<A> r{op};
    const u64 o = blockIdx.x / splits, s = blockIdx.x - o * splits;
    const u64 j0 = s * chunk, j1 = j0 + chunk < len ? j0 + chunk : len;
    const T* row = x + o * len;
    A acc = fold_span(r, r.init(), row, j0, j1);
    acc = block_reduce(acc, r, r.init(), sh);
    if (threadIdx.x == 0) part[blockIdx.x] = acc;
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

// inner > 1 with many long lanes (a linear layer's bias gradient: 3072 lanes of 16384 rows). A
// thread per lane would walk 16384 rows alone with a few warps on the whole device; a block per
// lane reads one element per 32-byte sector. Instead each block of 256 threads takes a tile of
// 32 neighbouring lanes (a warp reads them side by side) and `chunk` rows (its 8 warps
// interleave them), folds its 8 warp rows in shared memory in a fixed order and writes one
// partial per lane; `reduce_parts` then folds each lane's partials in order (deterministic).
template <typename T>
__device__ void reduce_tiles(int op, u64 len, u64 inner, u64 col_tiles, u64 splits, u64 chunk,
                             const T* x, typename Num<T>::acc* part) {
    typedef typename Num<T>::acc A;
    __shared__ A sh[8][33];
    Red<A> r{op};
    const u64 tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const u64 per_outer = col_tiles * splits;
    const u64 o = blockIdx.x / per_outer;
    const u64 rest = blockIdx.x - o * per_outer;
    const u64 tile = rest / splits, s = rest - tile * splits;
    const u64 i = tile * 32 + tx;
    const u64 j0 = s * chunk, j1 = j0 + chunk < len ? j0 + chunk : len;
    A acc = r.init();
    if (i < inner) {
        const T* p = x + o * len * inner + i;
        for (u64 j = j0 + ty; j < j1; j += 8) acc = r(acc, Num<T>::to(p[j * inner]));
    }
    sh[ty][tx] = acc;
    __syncthreads();
    if (ty == 0 && i < inner) {
        A a = sh[0][tx];
        for (int k = 1; k < 8; k++) a = r(a, sh[k][tx]);
        part[(o * splits + s) * inner + i] = a;
    }
}

template <typename T>
__device__ void reduce_parts(int op, u64 outer, u64 splits, u64 inner,
                             const typename Num<T>::acc* part, T* y) {
    typedef typename Num<T>::acc A;
    Red<A> r{op};
    for (u64 k = global_tid(); k < outer * inner; k += global_stride()) {
        u64 o = k / inner, i = k - o * inner;
        A acc = r.init();
        for (u64 s = 0; s < splits; s++) acc = r(acc, part[(o * splits + s) * inner + i]);
        y[k] = Num<T>::from(acc);
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
    extern "C" __global__ void reduce_row_chunks_##N(int op, u64 len, u64 splits, u64 chunk,        \
                                                     const T* x, Num<T>::acc* part) {               \
        reduce_row_chunks<T>(op, len, splits, chunk, x, part);                                      \
    }                                                                                               \
    extern "C" __global__ void reduce_lanes_##N(int op, u64 outer, u64 len, u64 inner, const T* x,  \
                                                T* y) {                                             \
        reduce_lanes<T>(op, outer, len, inner, x, y);                                               \
    }                                                                                               \
    extern "C" __global__ void reduce_lanes_wide_##N(int op, u64 outer, u64 len, u64 inner,         \
                                                     const T* x, T* y) {                            \
        reduce_lanes_wide<T>(op, outer, len, inner, x, y);                                          \
    }                                                                                               \
    extern "C" __global__ void reduce_tiles_##N(int op, u64 len, u64 inner, u64 col_tiles,          \
                                                u64 splits, u64 chunk, const T* x,                  \
                                                Num<T>::acc* part) {                                \
        reduce_tiles<T>(op, len, inner, col_tiles, splits, chunk, x, part);                         \
    }                                                                                               \
    extern "C" __global__ void reduce_parts_##N(int op, u64 outer, u64 splits, u64 inner,           \
                                                const Num<T>::acc* part, T* y) {                    \
        reduce_parts<T>(op, outer, splits, inner, part, y);                                         \
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
