// attention.cu: the scaled, causal-masked softmax of attention's math path and its backward, over
// `rows` contiguous rows of `seq_k` raw scores; row r is query i = r mod seq_q, whose keys j > i
// are masked (0 in the output) when `causal`. f32 math (f64 for f64), T in and out.
//
// A team per row: a warp (block_team 0, rows up to 32·MS_VALS values) or the whole block
// (block_team 1, rows up to blockDim·MS_VALS). Each thread keeps its MS_VALS values in registers,
// so a row is read once: V-wide packs (16 bytes) at j = (t·team + lane)·V when the rows are
// 16-byte aligned (V = 1 otherwise). Masked keys are never read. Longer rows: the `_long`
// kernels, a block per row reading the row again for each pass. A row whose every score is -inf
// gives zeros.

#define MS_VALS 32

template <typename A, typename F>
__device__ __forceinline__ A team_reduce(A v, F f, A identity, int block_team, A* sh) {
    return block_team ? block_reduce(v, f, identity, sh) : warp_reduce(v, f);
}

template <typename A> __device__ __forceinline__ A nan_max(A a, A b) { return (a > b || is_nan(a)) ? a : b; }

// Keys 0..n of query i are unmasked.
__device__ __forceinline__ u64 ms_unmasked(u64 r, u64 seq_q, u64 seq_k, int causal) {
    const u64 i = r % seq_q;
    return causal && i + 1 < seq_k ? i + 1 : seq_k;
}

// The team's rows: (first, step, lane, team size).
struct Team {
    u64 first, step;
    unsigned lane, size;
};
__device__ __forceinline__ Team ms_team(int block_team) {
    Team t;
    if (block_team) {
        t.first = blockIdx.x;
        t.step = gridDim.x;
        t.lane = threadIdx.x;
        t.size = blockDim.x;
    } else {
        t.first = global_tid() >> 5;
        t.step = global_stride() >> 5;
        t.lane = threadIdx.x & 31;
        t.size = 32;
    }
    return t;
}

// Loads values [j0, j0 + V) of a row (those at or past n are `fill`), a pack at once when whole.
template <typename T, int V>
__device__ __forceinline__ void ms_load(const T* __restrict__ row, u64 j0, u64 n,
                                        typename Num<T>::acc fill, typename Num<T>::acc* out) {
    typedef typename Pack<T>::type P;
    if (V > 1 && j0 + V <= n) {
        const P pk = *(const P*)(row + j0);
#pragma unroll
        for (int e = 0; e < V; e++) out[e] = Num<T>::to(pk.v[e]);
    } else {
#pragma unroll
        for (int e = 0; e < V; e++) out[e] = j0 + e < n ? Num<T>::to(row[j0 + e]) : fill;
    }
}

// Stores values [j0, j0 + V) of a row of seq_k values.
template <typename T, int V>
__device__ __forceinline__ void ms_store(T* __restrict__ row, u64 j0, u64 seq_k,
                                         const typename Num<T>::acc* in) {
    typedef typename Pack<T>::type P;
    if (V > 1 && j0 + V <= seq_k) {
        P pk;
#pragma unroll
        for (int e = 0; e < V; e++) pk.v[e] = Num<T>::from(in[e]);
        *(P*)(row + j0) = pk;
    } else {
#pragma unroll
        for (int e = 0; e < V; e++)
            if (j0 + e < seq_k) row[j0 + e] = Num<T>::from(in[e]);
    }
}

template <typename T, int V>
__device__ void ms_fwd(u64 rows, u64 seq_q, u64 seq_k, double scale_d, int causal, int block_team,
                       const T* __restrict__ x, T* __restrict__ y) {
    typedef typename Num<T>::acc A;
    const int ITER = MS_VALS / V;
    __shared__ A sh[32];
    const Team tm = ms_team(block_team);
    const A scale = (A)scale_d, ninf = -inf_of<A>();
    for (u64 r = tm.first; r < rows; r += tm.step) {
        const u64 n = ms_unmasked(r, seq_q, seq_k, causal);
        const T* xr = x + r * seq_k;
        A val[MS_VALS];
        A mx = ninf;
#pragma unroll
        for (int t = 0; t < ITER; t++) {
            const u64 j0 = ((u64)t * tm.size + tm.lane) * V;
            ms_load<T, V>(xr, j0, n, ninf, val + t * V);
#pragma unroll
            for (int e = 0; e < V; e++) {
                A s = j0 + e < n ? val[t * V + e] * scale : ninf;
                val[t * V + e] = s;
                mx = nan_max(mx, s);
            }
        }
        mx = team_reduce(mx, [](A a, A b) { return nan_max(a, b); }, ninf, block_team, sh);
        A sum = 0;
#pragma unroll
        for (int k = 0; k < MS_VALS; k++) {
            A e = mx == ninf ? (A)0 : m_exp(val[k] - mx);
            val[k] = e;
            sum += e;
        }
        sum = team_reduce(sum, [](A a, A b) { return a + b; }, (A)0, block_team, sh);
        const A inv = sum > 0 ? (A)1 / sum : (A)0;
#pragma unroll
        for (int t = 0; t < ITER; t++) {
            const u64 j0 = ((u64)t * tm.size + tm.lane) * V;
            if (j0 >= seq_k) continue;
#pragma unroll
            for (int e = 0; e < V; e++) val[t * V + e] *= inv;
            ms_store<T, V>(y + r * seq_k, j0, seq_k, val + t * V);
        }
    }
}

// dx = scale·y∘(g − Σ g∘y) over the unmasked keys, 0 at the masked ones.
template <typename T, int V>
__device__ void ms_bwd(u64 rows, u64 seq_q, u64 seq_k, double scale_d, int causal, int block_team,
                       const T* __restrict__ g, const T* __restrict__ y, T* __restrict__ dx) {
    typedef typename Num<T>::acc A;
    const int ITER = MS_VALS / V;
    __shared__ A sh[32];
    const Team tm = ms_team(block_team);
    const A scale = (A)scale_d;
    for (u64 r = tm.first; r < rows; r += tm.step) {
        const u64 n = ms_unmasked(r, seq_q, seq_k, causal);
        A gv[MS_VALS], yv[MS_VALS];
        A dot = 0;
#pragma unroll
        for (int t = 0; t < ITER; t++) {
            const u64 j0 = ((u64)t * tm.size + tm.lane) * V;
            ms_load<T, V>(g + r * seq_k, j0, n, (A)0, gv + t * V);
            ms_load<T, V>(y + r * seq_k, j0, n, (A)0, yv + t * V);
#pragma unroll
            for (int e = 0; e < V; e++) dot += gv[t * V + e] * yv[t * V + e];
        }
        dot = team_reduce(dot, [](A a, A b) { return a + b; }, (A)0, block_team, sh);
#pragma unroll
        for (int t = 0; t < ITER; t++) {
            const u64 j0 = ((u64)t * tm.size + tm.lane) * V;
            if (j0 >= seq_k) continue;
#pragma unroll
            for (int e = 0; e < V; e++)
                gv[t * V + e] = j0 + e < n ? scale * yv[t * V + e] * (gv[t * V + e] - dot) : (A)0;
            ms_store<T, V>(dx + r * seq_k, j0, seq_k, gv + t * V);
        }
    }
}

// Rows longer than a block's registers hold: a block per row, the row read once per pass.
template <typename T>
__device__ void ms_fwd_long(u64 rows, u64 seq_q, u64 seq_k, double scale_d, int causal,
                            const T* __restrict__ x, T* __restrict__ y) {
    typedef typename Num<T>::acc A;
    __shared__ A sh[32];
    const A scale = (A)scale_d, ninf = -inf_of<A>();
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 n = ms_unmasked(r, seq_q, seq_k, causal);
        const T* xr = x + r * seq_k;
        T* yr = y + r * seq_k;
        A mx = ninf;
        for (u64 j = threadIdx.x; j < n; j += blockDim.x) mx = nan_max(mx, Num<T>::to(xr[j]) * scale);
        mx = block_reduce(mx, [](A a, A b) { return nan_max(a, b); }, ninf, sh);
        A sum = 0;
        if (mx != ninf)
            for (u64 j = threadIdx.x; j < n; j += blockDim.x) sum += m_exp(Num<T>::to(xr[j]) * scale - mx);
        sum = block_reduce(sum, [](A a, A b) { return a + b; }, (A)0, sh);
        const A inv = sum > 0 ? (A)1 / sum : (A)0;
        for (u64 j = threadIdx.x; j < seq_k; j += blockDim.x)
            yr[j] = Num<T>::from(j < n && mx != ninf ? m_exp(Num<T>::to(xr[j]) * scale - mx) * inv : (A)0);
    }
}

template <typename T>
__device__ void ms_bwd_long(u64 rows, u64 seq_q, u64 seq_k, double scale_d, int causal,
                            const T* __restrict__ g, const T* __restrict__ y, T* __restrict__ dx) {
    typedef typename Num<T>::acc A;
    __shared__ A sh[32];
    const A scale = (A)scale_d;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 n = ms_unmasked(r, seq_q, seq_k, causal);
        const T* gr = g + r * seq_k;
        const T* yr = y + r * seq_k;
        A dot = 0;
        for (u64 j = threadIdx.x; j < n; j += blockDim.x) dot += Num<T>::to(gr[j]) * Num<T>::to(yr[j]);
        dot = block_reduce(dot, [](A a, A b) { return a + b; }, (A)0, sh);
        for (u64 j = threadIdx.x; j < seq_k; j += blockDim.x)
            dx[r * seq_k + j] =
                Num<T>::from(j < n ? scale * Num<T>::to(yr[j]) * (Num<T>::to(gr[j]) - dot) : (A)0);
    }
}

#define MASKED_SOFTMAX(N, T, V)                                                                    \
    extern "C" __global__ void masked_softmax_##N##_v##V(u64 rows, u64 seq_q, u64 seq_k,           \
                                                         double scale, int causal, int block_team, \
                                                         const T* x, T* y) {                       \
        ms_fwd<T, V>(rows, seq_q, seq_k, scale, causal, block_team, x, y);                         \
    }                                                                                              \
    extern "C" __global__ void masked_softmax_backward_##N##_v##V(                                 \
        u64 rows, u64 seq_q, u64 seq_k, double scale, int causal, int block_team, const T* g,      \
        const T* y, T* dx) {                                                                       \
        ms_bwd<T, V>(rows, seq_q, seq_k, scale, causal, block_team, g, y, dx);                     \
    }
MASKED_SOFTMAX(f16, f16, 1)
MASKED_SOFTMAX(f16, f16, 8)
MASKED_SOFTMAX(bf16, bf16, 1)
MASKED_SOFTMAX(bf16, bf16, 8)
MASKED_SOFTMAX(f32, float, 1)
MASKED_SOFTMAX(f32, float, 4)
MASKED_SOFTMAX(f64, double, 1)
MASKED_SOFTMAX(f64, double, 2)

#define MASKED_SOFTMAX_LONG(N, T)                                                                  \
    extern "C" __global__ void masked_softmax_long_##N(u64 rows, u64 seq_q, u64 seq_k,             \
                                                       double scale, int causal, const T* x,       \
                                                       T* y) {                                     \
        ms_fwd_long<T>(rows, seq_q, seq_k, scale, causal, x, y);                                   \
    }                                                                                              \
    extern "C" __global__ void masked_softmax_backward_long_##N(u64 rows, u64 seq_q, u64 seq_k,    \
                                                                double scale, int causal,          \
                                                                const T* g, const T* y, T* dx) {   \
        ms_bwd_long<T>(rows, seq_q, seq_k, scale, causal, g, y, dx);                               \
    }
MASKED_SOFTMAX_LONG(f16, f16)
MASKED_SOFTMAX_LONG(bf16, bf16)
MASKED_SOFTMAX_LONG(f32, float)
MASKED_SOFTMAX_LONG(f64, double)
