// softmax.cu: softmax / log-softmax over the middle dimension of (outer, len, inner) and their
// backward passes, computed in f32 (f64 for f64) with the maximum subtracted.

// inner == 1: one block per row. inner > 1: one thread per lane.
template <typename T>
__device__ void softmax_fwd(u64 outer, u64 len, u64 inner, const T* x, T* y, bool lg) {
    typedef typename Num<T>::acc A;
    __shared__ A sh[32];
    if (inner == 1) {
        for (u64 o = blockIdx.x; o < outer; o += gridDim.x) {
            const T* xr = x + o * len;
            T* yr = y + o * len;
            A mx = -inf_of<A>();
            for (u64 j = threadIdx.x; j < len; j += blockDim.x) {
                A v = Num<T>::to(xr[j]);
                mx = (v > mx || is_nan(v)) ? v : mx;
            }
            mx = block_reduce(mx, [](A a, A b) { return (a > b || is_nan(a)) ? a : b; }, -inf_of<A>(), sh);
            A s = 0;
            for (u64 j = threadIdx.x; j < len; j += blockDim.x) s += m_exp(Num<T>::to(xr[j]) - mx);
            s = block_reduce(s, [](A a, A b) { return a + b; }, (A)0, sh);
            A lse = mx + m_log(s);
            for (u64 j = threadIdx.x; j < len; j += blockDim.x) {
                A v = Num<T>::to(xr[j]);
                yr[j] = Num<T>::from(lg ? v - lse : m_exp(v - mx) / s);
            }
        }
    } else {
        u64 n = outer * inner;
        for (u64 k = global_tid(); k < n; k += global_stride()) {
            u64 o = k / inner, i = k - o * inner;
            const T* xp = x + o * len * inner + i;
            T* yp = y + o * len * inner + i;
            A mx = -inf_of<A>();
            for (u64 j = 0; j < len; j++) {
                A v = Num<T>::to(xp[j * inner]);
                mx = (v > mx || is_nan(v)) ? v : mx;
            }
            A s = 0;
            for (u64 j = 0; j < len; j++) s += m_exp(Num<T>::to(xp[j * inner]) - mx);
            A lse = mx + m_log(s);
            for (u64 j = 0; j < len; j++) {
                A v = Num<T>::to(xp[j * inner]);
                yp[j * inner] = Num<T>::from(lg ? v - lse : m_exp(v - mx) / s);
            }
        }
    }
}

// softmax: dx = y·(g − Σ g·y); log-softmax: dx = g − exp(y)·Σ g.
template <typename T>
__device__ void softmax_bwd(u64 outer, u64 len, u64 inner, const T* g, const T* y, T* dx, bool lg) {
    typedef typename Num<T>::acc A;
    __shared__ A sh[32];
    if (inner == 1) {
        for (u64 o = blockIdx.x; o < outer; o += gridDim.x) {
            const T* gr = g + o * len;
            const T* yr = y + o * len;
            T* dr = dx + o * len;
            A s = 0;
            for (u64 j = threadIdx.x; j < len; j += blockDim.x)
                s += lg ? Num<T>::to(gr[j]) : Num<T>::to(gr[j]) * Num<T>::to(yr[j]);
            s = block_reduce(s, [](A a, A b) { return a + b; }, (A)0, sh);
            for (u64 j = threadIdx.x; j < len; j += blockDim.x) {
                A gv = Num<T>::to(gr[j]), yv = Num<T>::to(yr[j]);
                dr[j] = Num<T>::from(lg ? gv - m_exp(yv) * s : yv * (gv - s));
            }
        }
    } else {
        u64 n = outer * inner;
        for (u64 k = global_tid(); k < n; k += global_stride()) {
            u64 o = k / inner, i = k - o * inner;
            u64 base = o * len * inner + i;
            A s = 0;
            for (u64 j = 0; j < len; j++) {
                A gv = Num<T>::to(g[base + j * inner]);
                s += lg ? gv : gv * Num<T>::to(y[base + j * inner]);
            }
            for (u64 j = 0; j < len; j++) {
                A gv = Num<T>::to(g[base + j * inner]), yv = Num<T>::to(y[base + j * inner]);
                dx[base + j * inner] = Num<T>::from(lg ? gv - m_exp(yv) * s : yv * (gv - s));
            }
        }
    }
}

#define SOFTMAX(N, T)                                                                              \
    extern "C" __global__ void softmax_##N(u64 outer, u64 len, u64 inner, const T* x, T* y,        \
                                           int lg) {                                               \
        softmax_fwd<T>(outer, len, inner, x, y, lg != 0);                                          \
    }                                                                                              \
    extern "C" __global__ void softmax_backward_##N(u64 outer, u64 len, u64 inner, const T* g,     \
                                                    const T* y, T* dx, int lg) {                   \
        softmax_bwd<T>(outer, len, inner, g, y, dx, lg != 0);                                      \
    }
SOFTMAX(f16, f16)
SOFTMAX(bf16, bf16)
SOFTMAX(f32, float)
SOFTMAX(f64, double)
