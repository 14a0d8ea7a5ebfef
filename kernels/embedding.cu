// embedding.cu: rows of a [num, dim] table gathered by i64 indices, and the gradient added back
// into the table rows, deterministically.
//
// Forward: one thread per output value. An index outside the table cannot be reported without a
// host read, so its row is NaN (and the backward skips it): visible, never out of bounds.
// Backward: the table rows are cut into ranges; thread (range, column) walks every position in
// increasing order (the indices staged through shared memory a tile at a time) and adds the
// gradient of the positions whose index falls in its range into acc[index, column], which no other
// thread touches. Every sum is in position order: the results repeat bit for bit and equal the
// CPU's. `acc` is the zeroed output itself for f32/f64 tables, an f32 buffer cast afterwards for
// half ones. That walk reads every index once per (range, column block): fine for a small
// batch, slow for a language model's (16k positions into a 50k-row table). By default the
// backward is therefore `embedding_backward_atomic`, one thread per gradient value adding into
// acc with atomics (fast, the order of a row's sums unspecified); the ordered walk runs under the
// determinism switch (`set_deterministic`).

#define EMB_TILE 256

#define EMBEDDING(N, T)                                                                            \
    extern "C" __global__ void embedding_##N(u64 count, u64 num, u64 dim, const T* table,          \
                                             const i64* idx, T* y) {                               \
        u64 n = count * dim;                                                                       \
        for (u64 k = global_tid(); k < n; k += global_stride()) {                                  \
            u64 i = k / dim, d = k - i * dim;                                                      \
            i64 v = idx[i];                                                                        \
            y[k] = (v < 0 || (u64)v >= num) ? Num<T>::from(nan_of<typename Num<T>::acc>())         \
                                            : table[(u64)v * dim + d];                             \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void embedding_backward_##N(u64 count, u64 num, u64 dim, u64 range_rows, \
                                                      u64 col_blocks, i64 padding, const T* g,     \
                                                      const i64* idx, Num<T>::acc* acc) {          \
        __shared__ i64 tile[EMB_TILE];                                                             \
        const u64 range = blockIdx.x / col_blocks;                                                 \
        const u64 d = (blockIdx.x - range * col_blocks) * blockDim.x + threadIdx.x;                \
        const i64 lo = (i64)(range * range_rows);                                                  \
        const i64 hi = (i64)((range + 1) * range_rows < num ? (range + 1) * range_rows : num);     \
        for (u64 t0 = 0; t0 < count; t0 += EMB_TILE) {                                             \
            u64 m = count - t0 < EMB_TILE ? count - t0 : EMB_TILE;                                 \
            __syncthreads();                                                                       \
            for (u64 j = threadIdx.x; j < m; j += blockDim.x) tile[j] = idx[t0 + j];               \
            __syncthreads();                                                                       \
            if (d >= dim) continue;                                                                \
            for (u64 j = 0; j < m; j++) {                                                          \
                i64 v = tile[j];                                                                   \
                if (v >= lo && v < hi && v != padding)                                             \
                    acc[(u64)v * dim + d] += Num<T>::to(g[(t0 + j) * dim + d]);                    \
            }                                                                                      \
        }                                                                                          \
    }
EMBEDDING(f16, f16)
EMBEDDING(bf16, bf16)
EMBEDDING(f32, float)
EMBEDDING(f64, double)

// y = acc rounded once to T (the half tables' gradients).
#define EMBEDDING_ATOMIC(N, T)                                                                     \
    extern "C" __global__ void embedding_backward_atomic_##N(u64 count, u64 num, u64 dim,          \
                                                             i64 padding, const T* g,              \
                                                             const i64* idx, Num<T>::acc* acc) {   \
        u64 n = count * dim;                                                                       \
        for (u64 k = global_tid(); k < n; k += global_stride()) {                                  \
            u64 i = k / dim, d = k - i * dim;                                                      \
            i64 v = idx[i];                                                                        \
            if (v >= 0 && (u64)v < num && v != padding)                                            \
                atomicAdd(&acc[(u64)v * dim + d], Num<T>::to(g[k]));                               \
        }                                                                                          \
    }
EMBEDDING_ATOMIC(f16, f16)
EMBEDDING_ATOMIC(bf16, bf16)
EMBEDDING_ATOMIC(f32, float)
EMBEDDING_ATOMIC(f64, double)

#define EMBEDDING_ROUND(N, T)                                                                      \
    extern "C" __global__ void embedding_round_##N(u64 n, const float* acc, T* y) {                \
        for (u64 k = global_tid(); k < n; k += global_stride()) y[k] = Num<T>::from(acc[k]);       \
    }
EMBEDDING_ROUND(f16, f16)
EMBEDDING_ROUND(bf16, bf16)
