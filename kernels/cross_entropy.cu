// cross_entropy.cu: the fused cross-entropy of `rows` contiguous rows of `V` logits T against
// one i64 target per row, in A = Num<T>::acc (f32 for the half types and f32, f64 for f64),
// with no copy of the logits in A.
//
// Forward, a block per row (rows grid-strided): each thread folds its share of the row into a
// running (max m, Σ exp(x − m), Σ x), 16-byte packs at a time (8 halves), the sum rescaled once
// per pack; then the block combines the threads' triples in a fixed tree (results repeat bit for
// bit). Thread 0 writes loss = lse − (1−ε)·x_t − (ε/V)·Σx and lse = m + log Σ exp(x − m).
// Backward, a block per row: dx_j = (exp(x_j − lse) − (1−ε)·[j = t] − ε/V)·g, one pass, packs in
// and packs out.
//
// A row whose target is ignore_index (when has_ignore) has loss 0 and gradient 0; `count`
// (zeroed by the host; may be null) gets 1 added per row not ignored, atomically (an exact sum
// of integers in A up to 2^24 rows for f32). A target outside 0..V that is not ignored raises
// *bad (the thread's sticky index flag, read by the host at its next read from the device) and
// makes the row's loss and gradient NaN: no host synchronisation.

// The running state of a share of a row.
template <typename A> struct LseState {
    A m;   // maximum so far (−inf before any value)
    A s;   // Σ exp(x − m)
    A sum; // Σ x
};

// m as the reference point of exp: 0 while m is −inf (no value yet, or a row of −inf), so that
// exp(−inf − ref) is 0 and never NaN.
template <typename A> __device__ __forceinline__ A lse_ref(A m) { return m == -inf_of<A>() ? (A)0 : m; }
__device__ __forceinline__ float m_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double m_max(double a, double b) { return fmax(a, b); }

template <typename A> __device__ __forceinline__ LseState<A> lse_combine(LseState<A> a, LseState<A> b) {
    LseState<A> r;
    r.m = m_max(a.m, b.m);
    const A ref = lse_ref(r.m);
    r.s = a.s * m_exp(a.m - ref) + b.s * m_exp(b.m - ref);
    r.sum = a.sum + b.sum;
    return r;
}

// Folds one pack of N values into st: one rescale of the sum per pack.
template <typename T, int N>
__device__ __forceinline__ void lse_fold_pack(LseState<typename Num<T>::acc>& st, const T* v) {
    typedef typename Num<T>::acc A;
    A a[N];
#pragma unroll
    for (int k = 0; k < N; k++) a[k] = Num<T>::to(v[k]);
    A lm = a[0], ls = a[0];
#pragma unroll
    for (int k = 1; k < N; k++) {
        lm = m_max(lm, a[k]);
        ls += a[k];
    }
    const A m = m_max(st.m, lm);
    const A ref = lse_ref(m);
    A e = 0;
#pragma unroll
    for (int k = 0; k < N; k++) e += m_exp(a[k] - ref);
    st.s = st.s * m_exp(st.m - ref) + e;
    st.m = m;
    st.sum += ls;
}

template <typename A> __device__ __forceinline__ LseState<A> lse_shfl(LseState<A> v, int o) {
    LseState<A> r;
    r.m = __shfl_xor_sync(0xffffffffu, v.m, o);
    r.s = __shfl_xor_sync(0xffffffffu, v.s, o);
    r.sum = __shfl_xor_sync(0xffffffffu, v.sum, o);
    return r;
}

// The block's combination of every thread's state, in a fixed tree; every thread gets it.
template <typename A> __device__ LseState<A> lse_block(LseState<A> v, LseState<A>* sh /* >= 32 */) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = lse_combine(v, lse_shfl(v, o));
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        LseState<A> w;
        if (lane < nw) {
            w = sh[lane];
        } else {
            w.m = -inf_of<A>();
            w.s = 0;
            w.sum = 0;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) w = lse_combine(w, lse_shfl(w, o));
        if (lane == 0) sh[0] = w;
    }
    __syncthreads();
    LseState<A> r = sh[0];
    __syncthreads();
    return r;
}

// A row's split into a scalar head (up to the first 16-byte boundary), packs, a scalar tail.
struct RowSplit {
    u64 head, packs, tail_start;
};
template <typename T> __device__ __forceinline__ RowSplit row_split(const T* row, u64 V) {
    const int N = Pack<T>::N;
    RowSplit s;
    const u64 mis = ((u64)row & 15) / sizeof(T);
    s.head = mis ? (u64)N - mis : 0;
    if (s.head > V) s.head = V;
    s.packs = (V - s.head) / N;
    s.tail_start = s.head + s.packs * N;
    return s;
}

template <typename T>
__device__ void xent_fwd(u64 rows, u64 V, double smoothing, int has_ignore, i64 ignore,
                         const T* __restrict__ x, const i64* __restrict__ tgt,
                         typename Num<T>::acc* __restrict__ loss, typename Num<T>::acc* __restrict__ lse,
                         typename Num<T>::acc* __restrict__ count, int* __restrict__ bad) {
    typedef typename Num<T>::acc A;
    typedef typename Pack<T>::type P;
    const int N = Pack<T>::N;
    __shared__ LseState<A> sh[32];
    const u64 step = blockDim.x;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * V;
        const RowSplit sp = row_split(xr, V);
        LseState<A> st;
        st.m = -inf_of<A>();
        st.s = 0;
        st.sum = 0;
        for (u64 j = threadIdx.x; j < sp.head; j += step) lse_fold_pack<T, 1>(st, xr + j);
        const P* xv = (const P*)(xr + sp.head);
        u64 i = threadIdx.x;
        for (; i + step < sp.packs; i += 2 * step) {
            P a = xv[i], b = xv[i + step];
            lse_fold_pack<T, N>(st, a.v);
            lse_fold_pack<T, N>(st, b.v);
        }
        if (i < sp.packs) {
            P a = xv[i];
            lse_fold_pack<T, N>(st, a.v);
        }
        for (u64 j = sp.tail_start + threadIdx.x; j < V; j += step) lse_fold_pack<T, 1>(st, xr + j);
        st = lse_block(st, sh);
        if (threadIdx.x == 0) {
            const A l = st.m + m_log(st.s); // −inf for a row of −inf (s = 0), NaN with a NaN
            const i64 t = tgt[r];
            A out;
            if (has_ignore && t == ignore) {
                out = 0;
            } else {
                if (count) atomicAdd(count, (A)1);
                if (t < 0 || (u64)t >= V) {
                    *bad = 1;
                    out = nan_of<A>();
                } else {
                    const A eps = (A)smoothing;
                    out = l - ((A)1 - eps) * Num<T>::to(xr[t]);
                    if (smoothing != 0.0) out -= eps * st.sum / (A)V;
                }
            }
            loss[r] = out;
            lse[r] = l;
        }
    }
}

template <typename T>
__device__ void xent_bwd(u64 rows, u64 V, double smoothing, int has_ignore, i64 ignore,
                         const typename Num<T>::acc* __restrict__ g, const T* __restrict__ x,
                         const i64* __restrict__ tgt, const typename Num<T>::acc* __restrict__ lse,
                         T* __restrict__ dx, int* __restrict__ bad) {
    typedef typename Num<T>::acc A;
    typedef typename Pack<T>::type P;
    const int N = Pack<T>::N;
    const u64 step = blockDim.x;
    const A eps = (A)smoothing;
    const A off = eps / (A)V, hit = (A)1 - eps;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * V;
        T* dr = dx + r * V;
        const i64 t = tgt[r];
        // dx and x share their alignment when both rows start alike (dx is a fresh buffer; x
        // may be a view at an offset): packs then, else scalar all along.
        const bool together = (((u64)xr ^ (u64)dr) & 15) == 0;
        RowSplit sp = row_split(xr, V);
        if (!together) {
            sp.head = V;
            sp.packs = 0;
            sp.tail_start = V;
        }
        const P* xv = (const P*)(xr + sp.head);
        P* dv = (P*)(dr + sp.head);
        if (has_ignore && t == ignore) {
            P z;
#pragma unroll
            for (int k = 0; k < N; k++) z.v[k] = Num<T>::from((A)0);
            for (u64 j = threadIdx.x; j < sp.head; j += step) dr[j] = z.v[0];
            for (u64 i = threadIdx.x; i < sp.packs; i += step) dv[i] = z;
            for (u64 j = sp.tail_start + threadIdx.x; j < V; j += step) dr[j] = z.v[0];
            continue;
        }
        A gr = g[r];
        if (t < 0 || (u64)t >= V) {
            if (threadIdx.x == 0) *bad = 1;
            gr = nan_of<A>();
        }
        const A l = lse[r];
        for (u64 j = threadIdx.x; j < sp.head; j += step)
            dr[j] = Num<T>::from((m_exp(Num<T>::to(xr[j]) - l) - off - ((i64)j == t ? hit : (A)0)) * gr);
        for (u64 i = threadIdx.x; i < sp.packs; i += step) {
            P a = xv[i], o;
            const i64 j0 = (i64)(sp.head + i * N);
#pragma unroll
            for (int k = 0; k < N; k++)
                o.v[k] = Num<T>::from((m_exp(Num<T>::to(a.v[k]) - l) - off - (j0 + k == t ? hit : (A)0)) * gr);
            dv[i] = o;
        }
        for (u64 j = sp.tail_start + threadIdx.x; j < V; j += step)
            dr[j] = Num<T>::from((m_exp(Num<T>::to(xr[j]) - l) - off - ((i64)j == t ? hit : (A)0)) * gr);
    }
}

#define CROSS_ENTROPY(N, T, A)                                                                     \
    extern "C" __global__ void cross_entropy_##N(u64 rows, u64 V, double smoothing, int has_ignore, \
                                                 i64 ignore, const T* x, const i64* tgt, A* loss,  \
                                                 A* lse, A* count, int* bad) {                     \
        xent_fwd<T>(rows, V, smoothing, has_ignore, ignore, x, tgt, loss, lse, count, bad);        \
    }                                                                                              \
    extern "C" __global__ void cross_entropy_backward_##N(u64 rows, u64 V, double smoothing,       \
                                                          int has_ignore, i64 ignore, const A* g,  \
                                                          const T* x, const i64* tgt,              \
                                                          const A* lse, T* dx, int* bad) {         \
        xent_bwd<T>(rows, V, smoothing, has_ignore, ignore, g, x, tgt, lse, dx, bad);              \
    }
CROSS_ENTROPY(f16, f16, float)
CROSS_ENTROPY(bf16, bf16, float)
CROSS_ENTROPY(f32, float, float)
CROSS_ENTROPY(f64, double, double)
