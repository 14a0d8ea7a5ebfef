// index.cu: gather and scatter_add along the middle dimension of (outer, len, inner).
// An index outside 0..len sets *bad (read back by the host, which returns an Error).

// out[o, j, i] = x[o, idx[o, j, i], i]; by element size.
#define GATHER(N, T)                                                                               \
    extern "C" __global__ void gather_##N(u64 outer, u64 len, u64 inner, u64 idx_len, const T* x,  \
                                          const i64* idx, T* y, int* bad) {                         \
        u64 n = outer * idx_len * inner;                                                           \
        for (u64 k = global_tid(); k < n; k += global_stride()) {                                  \
            u64 o = k / (idx_len * inner), i = k % inner;                                          \
            i64 s = idx[k];                                                                        \
            if (s < 0 || (u64)s >= len) {                                                          \
                *bad = 1;                                                                          \
                y[k] = x[0];                                                                       \
            } else {                                                                               \
                y[k] = x[(o * len + (u64)s) * inner + i];                                          \
            }                                                                                      \
        }                                                                                          \
    }
GATHER(2, unsigned short)
GATHER(4, unsigned int)
GATHER(8, u64)

// acc (f32, f64 for f64; zeroed) += g at the indexed positions. The caller casts acc to the dtype.
#define SCATTER_ADD(N, T)                                                                          \
    extern "C" __global__ void scatter_add_##N(u64 outer, u64 len, u64 inner, u64 idx_len,         \
                                               const T* g, const i64* idx, Num<T>::acc* acc,       \
                                               int* bad) {                                         \
        u64 n = outer * idx_len * inner;                                                           \
        for (u64 k = global_tid(); k < n; k += global_stride()) {                                  \
            u64 o = k / (idx_len * inner), i = k % inner;                                          \
            i64 s = idx[k];                                                                        \
            if (s < 0 || (u64)s >= len) {                                                          \
                *bad = 1;                                                                          \
            } else {                                                                               \
                atomicAdd(&acc[(o * len + (u64)s) * inner + i], Num<T>::to(g[k]));                 \
            }                                                                                      \
        }                                                                                          \
    }
SCATTER_ADD(f16, f16)
SCATTER_ADD(bf16, bf16)
SCATTER_ADD(f32, float)
SCATTER_ADD(f64, double)
