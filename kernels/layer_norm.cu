// layer_norm.cu: layer norm and RMS norm over `rows` contiguous rows of `cols` values, statistics
// in the accumulation type (f32 for the half types and f32, f64 for f64) whatever T. The affine
// parameters are W: T itself, or f32 for a half T (AMP's O2 keeps them f32); either may be null.
//
// Forward and the input's gradient: a warp per row (rows grid-strided over the grid's warps);
// lane l folds values l, l + 32, ... in order, then the warp's butterfly, so every lane holds the
// same sums and the results repeat bit for bit.
// Half rows of at most 8·32·LN_CHUNKS values (a multiple of 8) take a faster path with the
// same math: each lane loads its chunks lane, lane + 32, ... of 8 values once, with 16-byte
// accesses, and keeps them in registers for the statistics and the output (one pass over memory
// instead of three scalar ones); its sums fold in chunk order, so results still repeat bit for bit.
// Parameter gradients: block p sums rows [p·part_rows, (p+1)·part_rows) per column in row order
// into its own slice of `part`; then one thread per column adds the blocks' slices in block order.
// No atomics: deterministic.

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
    return warp_reduce(v, [](A a, A b) { return a + b; });
}

#define LN_CHUNKS 4

template <typename T> __device__ __forceinline__ bool ln_regs_fit(u64 cols, const void* a, const void* b) {
    return sizeof(T) == 2 && cols % 8 == 0 && cols <= 8 * 32 * LN_CHUNKS &&
           ((u64)a | (u64)b) % 16 == 0;
}

// The 8 values of chunk j of row `row`, widened.
template <typename T, typename A> __device__ __forceinline__ void ln_load8(const T* row, u64 j, A (&v)[8]) {
    const uint4 u = reinterpret_cast<const uint4*>(row)[j];
    const T* t = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = Num<T>::to(t[k]);
}

template <typename T, typename A> __device__ __forceinline__ void ln_store8(T* row, u64 j, const A (&v)[8]) {
    uint4 u;
    T* t = reinterpret_cast<T*>(&u);
#pragma unroll
    for (int k = 0; k < 8; k++) t[k] = Num<T>::from(v[k]);
    reinterpret_cast<uint4*>(row)[j] = u;
}

template <typename T, typename W>
__device__ void ln_fwd_regs(u64 r, u64 cols, double eps, int rms, const T* __restrict__ x,
                            const W* __restrict__ w, const W* __restrict__ b, T* __restrict__ y,
                            typename Num<T>::acc* __restrict__ mean, typename Num<T>::acc* __restrict__ rstd) {
    typedef typename Num<T>::acc A;
    const unsigned lane = threadIdx.x & 31;
    const u64 nch = cols / 8;
    const A n = (A)cols;
    const T* xr = x + r * cols;
    A v[LN_CHUNKS][8];
    A s = 0;
#pragma unroll
    for (int c = 0; c < LN_CHUNKS; c++) {
        const u64 j = lane + 32 * c;
        if (j < nch) {
            ln_load8(xr, j, v[c]);
#pragma unroll
            for (int k = 0; k < 8; k++) s += v[c][k];
        }
    }
    const A mu = rms ? (A)0 : warp_sum(s) / n;
    A ss = 0;
#pragma unroll
    for (int c = 0; c < LN_CHUNKS; c++) {
        if (lane + 32 * c < nch) {
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const A d = v[c][k] - mu;
                ss += d * d;
            }
        }
    }
    const A rs = (A)1 / m_sqrt(warp_sum(ss) / n + (A)eps);
#pragma unroll
    for (int c = 0; c < LN_CHUNKS; c++) {
        const u64 j = lane + 32 * c;
        if (j < nch) {
            A h[8];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                h[k] = (v[c][k] - mu) * rs;
                if (w) h[k] = h[k] * Num<W>::to(w[8 * j + k]);
                if (b) h[k] = h[k] + Num<W>::to(b[8 * j + k]);
            }
            ln_store8(y + r * cols, j, h);
        }
    }
    if (lane == 0) {
        mean[r] = mu;
        rstd[r] = rs;
    }
}

template <typename T, typename W>
__device__ void ln_bwd_regs(u64 r, u64 cols, int rms, const T* __restrict__ g, const T* __restrict__ x,
                            const typename Num<T>::acc* __restrict__ mean,
                            const typename Num<T>::acc* __restrict__ rstd, const W* __restrict__ w,
                            T* __restrict__ dx) {
    typedef typename Num<T>::acc A;
    const unsigned lane = threadIdx.x & 31;
    const u64 nch = cols / 8;
    const A n = (A)cols;
    const A mu = mean[r], rs = rstd[r];
    A u[LN_CHUNKS][8], h[LN_CHUNKS][8];
    A su = 0, suh = 0;
#pragma unroll
    for (int c = 0; c < LN_CHUNKS; c++) {
        const u64 j = lane + 32 * c;
        if (j < nch) {
            ln_load8(g + r * cols, j, u[c]);
            ln_load8(x + r * cols, j, h[c]);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                if (w) u[c][k] = u[c][k] * Num<W>::to(w[8 * j + k]);
                h[c][k] = (h[c][k] - mu) * rs;
                su += u[c][k];
                suh += u[c][k] * h[c][k];
            }
        }
    }
    const A mu_u = rms ? (A)0 : warp_sum(su) / n;
    const A mu_uh = warp_sum(suh) / n;
#pragma unroll
    for (int c = 0; c < LN_CHUNKS; c++) {
        const u64 j = lane + 32 * c;
        if (j < nch) {
            A d[8];
#pragma unroll
            for (int k = 0; k < 8; k++) d[k] = rs * (u[c][k] - mu_u - h[c][k] * mu_uh);
            ln_store8(dx + r * cols, j, d);
        }
    }
}

template <typename T, typename W>
__device__ void ln_fwd(u64 rows, u64 cols, double eps, int rms, const T* __restrict__ x,
                       const W* __restrict__ w, const W* __restrict__ b, T* __restrict__ y,
                       typename Num<T>::acc* __restrict__ mean, typename Num<T>::acc* __restrict__ rstd) {
    typedef typename Num<T>::acc A;
    const unsigned lane = threadIdx.x & 31;
    const u64 nwarps = global_stride() >> 5;
    const A n = (A)cols, e = (A)eps;
    if (ln_regs_fit<T>(cols, x, y)) {
        for (u64 r = global_tid() >> 5; r < rows; r += nwarps) ln_fwd_regs(r, cols, eps, rms, x, w, b, y, mean, rstd);
        return;
    }
    for (u64 r = global_tid() >> 5; r < rows; r += nwarps) {
        const T* xr = x + r * cols;
        T* yr = y + r * cols;
        A mu = 0, ss = 0;
        if (!rms) {
            A s = 0;
            for (u64 j = lane; j < cols; j += 32) s += Num<T>::to(xr[j]);
            mu = warp_sum(s) / n;
        }
        for (u64 j = lane; j < cols; j += 32) {
            A d = Num<T>::to(xr[j]) - mu;
            ss += d * d;
        }
        const A rs = (A)1 / m_sqrt(warp_sum(ss) / n + e);
        for (u64 j = lane; j < cols; j += 32) {
            A h = (Num<T>::to(xr[j]) - mu) * rs;
            if (w) h = h * Num<W>::to(w[j]);
            if (b) h = h + Num<W>::to(b[j]);
            yr[j] = Num<T>::from(h);
        }
        if (lane == 0) {
            mean[r] = mu;
            rstd[r] = rs;
        }
    }
}

// dx = rstd·(u − mean(u) − h·mean(u·h)), u = g·w, h = (x − mean)·rstd (RMS norm: no mean(u)).
template <typename T, typename W>
__device__ void ln_bwd(u64 rows, u64 cols, int rms, const T* __restrict__ g, const T* __restrict__ x,
                       const typename Num<T>::acc* __restrict__ mean,
                       const typename Num<T>::acc* __restrict__ rstd, const W* __restrict__ w,
                       T* __restrict__ dx) {
    typedef typename Num<T>::acc A;
    const unsigned lane = threadIdx.x & 31;
    const u64 nwarps = global_stride() >> 5;
    const A n = (A)cols;
    if (ln_regs_fit<T>(cols, g, x) && (u64)dx % 16 == 0) {
        for (u64 r = global_tid() >> 5; r < rows; r += nwarps) ln_bwd_regs(r, cols, rms, g, x, mean, rstd, w, dx);
        return;
    }
    for (u64 r = global_tid() >> 5; r < rows; r += nwarps) {
        const T* gr = g + r * cols;
        const T* xr = x + r * cols;
        T* dr = dx + r * cols;
        const A mu = mean[r], rs = rstd[r];
        A su = 0, suh = 0;
        for (u64 j = lane; j < cols; j += 32) {
            A u = Num<T>::to(gr[j]);
            if (w) u = u * Num<W>::to(w[j]);
            su += u;
            suh += u * ((Num<T>::to(xr[j]) - mu) * rs);
        }
        const A mu_u = rms ? (A)0 : warp_sum(su) / n;
        const A mu_uh = warp_sum(suh) / n;
        for (u64 j = lane; j < cols; j += 32) {
            A u = Num<T>::to(gr[j]);
            if (w) u = u * Num<W>::to(w[j]);
            A h = (Num<T>::to(xr[j]) - mu) * rs;
            dr[j] = Num<T>::from(rs * (u - mu_u - h * mu_uh));
        }
    }
}

// part[p][0..cols) = Σ g·h, part[p][cols..2·cols) = Σ g over block p's rows (grid = the blocks).
template <typename T>
__device__ void ln_param_partial(u64 rows, u64 cols, u64 part_rows, const T* __restrict__ g,
                                 const T* __restrict__ x, const typename Num<T>::acc* __restrict__ mean,
                                 const typename Num<T>::acc* __restrict__ rstd,
                                 typename Num<T>::acc* __restrict__ part) {
    typedef typename Num<T>::acc A;
    const u64 p = blockIdx.x;
    const u64 lo = p * part_rows;
    const u64 hi = lo + part_rows < rows ? lo + part_rows : rows;
    A* pw = part + p * 2 * cols;
    for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
        A sw = 0, sb = 0;
        for (u64 r = lo; r < hi; r++) {
            A gv = Num<T>::to(g[r * cols + j]);
            sw += gv * ((Num<T>::to(x[r * cols + j]) - mean[r]) * rstd[r]);
            sb += gv;
        }
        pw[j] = sw;
        pw[cols + j] = sb;
    }
}

// The same partials for half rows whose chunks of 8 load as 16 bytes (cols a multiple of 8, at
// most 8·LN_PV_THREADS, 16-byte aligned rows): a block of (cols/8)·lanes threads, thread
// (lane, c) summing chunk c of rows lo + lane, lo + lane + lanes, ... in row order, then lane 0
// adding the lanes' sums in lane order. The scalar kernel's two-byte loads left most of each
// memory transaction unused.
#define LN_PV_THREADS 256
template <typename T>
__device__ void ln_param_partial_vec(u64 rows, u64 cols, u64 part_rows, const T* __restrict__ g,
                                     const T* __restrict__ x, const float* __restrict__ mean,
                                     const float* __restrict__ rstd, float* __restrict__ part) {
    __shared__ float shw[LN_PV_THREADS * 8], shb[LN_PV_THREADS * 8];
    const u64 groups = cols / 8, lanes = blockDim.x / groups;
    const u64 c = threadIdx.x % groups, lane = threadIdx.x / groups;
    const u64 p = blockIdx.x;
    const u64 lo = p * part_rows;
    const u64 hi = lo + part_rows < rows ? lo + part_rows : rows;
    float sw[8], sb[8];
#pragma unroll
    for (int k = 0; k < 8; k++) sw[k] = sb[k] = 0.f;
    for (u64 r = lo + lane; r < hi; r += lanes) {
        float gv[8], xv[8];
        ln_load8(g + r * cols, c, gv);
        ln_load8(x + r * cols, c, xv);
        const float mu = mean[r], rs = rstd[r];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            sw[k] += gv[k] * ((xv[k] - mu) * rs);
            sb[k] += gv[k];
        }
    }
#pragma unroll
    for (int k = 0; k < 8; k++) {
        shw[threadIdx.x * 8 + k] = sw[k];
        shb[threadIdx.x * 8 + k] = sb[k];
    }
    __syncthreads();
    if (lane == 0) {
        for (u64 l = 1; l < lanes; l++) {
#pragma unroll
            for (int k = 0; k < 8; k++) {
                sw[k] += shw[(l * groups + c) * 8 + k];
                sb[k] += shb[(l * groups + c) * 8 + k];
            }
        }
        float* pw = part + p * 2 * cols + 8 * c;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            pw[k] = sw[k];
            pw[cols + k] = sb[k];
        }
    }
}

// dw[j] = Σ_p part[p][j], db[j] = Σ_p part[p][cols + j]; either may be null. A block of 256
// threads takes 32 columns: its 8 warps each sum every 8th block's partials in block order, then
// warp 0 adds the 8 sums in warp order (a fixed association: deterministic). One thread per
// column walking all the parts alone was latency-bound (hundreds of serial loads, few warps).
template <typename A, typename W>
__device__ void ln_param_finalize(u64 cols, u64 parts, const A* __restrict__ part, W* __restrict__ dw,
                                  W* __restrict__ db) {
    __shared__ A shw[8][33], shb[8][33];
    const u64 tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    for (u64 tile = blockIdx.x; tile * 32 < cols; tile += gridDim.x) {
        const u64 j = tile * 32 + tx;
        A sw = 0, sb = 0;
        if (j < cols) {
            for (u64 p = ty; p < parts; p += 8) {
                sw += part[p * 2 * cols + j];
                sb += part[p * 2 * cols + cols + j];
            }
        }
        shw[ty][tx] = sw;
        shb[ty][tx] = sb;
        __syncthreads();
        if (ty == 0 && j < cols) {
            A w = shw[0][tx], b = shb[0][tx];
            for (int k = 1; k < 8; k++) {
                w += shw[k][tx];
                b += shb[k][tx];
            }
            if (dw) dw[j] = Num<W>::from(w);
            if (db) db[j] = Num<W>::from(b);
        }
        __syncthreads();
    }
}

// One forward and one backward per (input, parameter) dtype pair; statistics of type A.
#define LAYER_NORM(N, T, WN, W, A)                                                                 \
    extern "C" __global__ void layer_norm_##N##_##WN(u64 rows, u64 cols, double eps, int rms,      \
                                                     const T* x, const W* w, const W* b, T* y,     \
                                                     A* mean, A* rstd) {                           \
        ln_fwd<T, W>(rows, cols, eps, rms, x, w, b, y, mean, rstd);                                \
    }                                                                                              \
    extern "C" __global__ void layer_norm_backward_##N##_##WN(u64 rows, u64 cols, int rms,         \
                                                              const T* g, const T* x,              \
                                                              const A* mean, const A* rstd,        \
                                                              const W* w, T* dx) {                 \
        ln_bwd<T, W>(rows, cols, rms, g, x, mean, rstd, w, dx);                                    \
    }
LAYER_NORM(f16, f16, f16, f16, float)
LAYER_NORM(f16, f16, f32, float, float)
LAYER_NORM(bf16, bf16, bf16, bf16, float)
LAYER_NORM(bf16, bf16, f32, float, float)
LAYER_NORM(f32, float, f32, float, float)
LAYER_NORM(f64, double, f64, double, double)

#define LAYER_NORM_PARAMS(N, T, A)                                                                 \
    extern "C" __global__ void layer_norm_param_partial_##N(u64 rows, u64 cols, u64 part_rows,     \
                                                            const T* g, const T* x, const A* mean, \
                                                            const A* rstd, A* part) {              \
        ln_param_partial<T>(rows, cols, part_rows, g, x, mean, rstd, part);                        \
    }
LAYER_NORM_PARAMS(f16, f16, float)
LAYER_NORM_PARAMS(bf16, bf16, float)
#define LAYER_NORM_PARAMS_VEC(N, T)                                                                \
    extern "C" __global__ void layer_norm_param_partial_vec_##N(                                   \
        u64 rows, u64 cols, u64 part_rows, const T* g, const T* x, const float* mean,               \
        const float* rstd, float* part) {                                                          \
        ln_param_partial_vec<T>(rows, cols, part_rows, g, x, mean, rstd, part);                    \
    }
LAYER_NORM_PARAMS_VEC(f16, f16)
LAYER_NORM_PARAMS_VEC(bf16, bf16)
LAYER_NORM_PARAMS(f32, float, float)
LAYER_NORM_PARAMS(f64, double, double)

#define LAYER_NORM_FINALIZE(AN, A, WN, W)                                                          \
    extern "C" __global__ void layer_norm_param_finalize_##AN##_##WN(u64 cols, u64 parts,          \
                                                                     const A* part, W* dw,         \
                                                                     W* db) {                      \
        ln_param_finalize<A, W>(cols, parts, part, dw, db);                                        \
    }
LAYER_NORM_FINALIZE(f32, float, f16, f16)
LAYER_NORM_FINALIZE(f32, float, bf16, bf16)
LAYER_NORM_FINALIZE(f32, float, f32, float)
LAYER_NORM_FINALIZE(f64, double, f64, double)
