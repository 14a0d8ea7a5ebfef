// batch_norm.cu: training-mode batch norm over [n, c, spatial] with f32 statistics (f64 for f64),
// one block per channel; backward likewise. Parameters and statistics are of the acc type.

// Welford state merged across threads (Chan et al.).
template <typename A> struct Welford {
    A count, mean, m2;
};
template <typename A> __device__ __forceinline__ Welford<A> wf_merge(Welford<A> a, Welford<A> b) {
    if (b.count == (A)0) return a;
    if (a.count == (A)0) return b;
    A n = a.count + b.count;
    A d = b.mean - a.mean;
    Welford<A> r;
    r.count = n;
    r.mean = a.mean + d * (b.count / n);
    r.m2 = a.m2 + b.m2 + d * d * (a.count * b.count / n);
    return r;
}

template <typename A> __device__ Welford<A> wf_block(Welford<A> w, A* sh /* 3*32 */) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        Welford<A> b;
        b.count = __shfl_xor_sync(0xffffffffu, w.count, o);
        b.mean = __shfl_xor_sync(0xffffffffu, w.mean, o);
        b.m2 = __shfl_xor_sync(0xffffffffu, w.m2, o);
        w = wf_merge(w, b);
    }
    __syncthreads();
    if (lane == 0) { sh[warp] = w.count; sh[32 + warp] = w.mean; sh[64 + warp] = w.m2; }
    __syncthreads();
    if (threadIdx.x == 0) {
        Welford<A> t = {sh[0], sh[32], sh[64]};
        for (int k = 1; k < nw; k++) {
            Welford<A> b = {sh[k], sh[32 + k], sh[64 + k]};
            t = wf_merge(t, b);
        }
        sh[0] = t.count; sh[32] = t.mean; sh[64] = t.m2;
    }
    __syncthreads();
    Welford<A> r = {sh[0], sh[32], sh[64]};
    __syncthreads();
    return r;
}

template <typename T>
__device__ void bn_forward(u64 n, u64 c, u64 sp, const T* x, const typename Num<T>::acc* w,
                           const typename Num<T>::acc* b, typename Num<T>::acc* rm,
                           typename Num<T>::acc* rv, T* y, typename Num<T>::acc* mean_out,
                           typename Num<T>::acc* invstd_out, double eps, double momentum) {
    typedef typename Num<T>::acc A;
    __shared__ A sh[96];
    for (u64 ch = blockIdx.x; ch < c; ch += gridDim.x) {
        Welford<A> st = {0, 0, 0};
        u64 m = n * sp;
        for (u64 k = threadIdx.x; k < m; k += blockDim.x) {
            u64 i = k / sp, s = k - i * sp;
            A v = Num<T>::to(x[(i * c + ch) * sp + s]);
            st.count += (A)1;
            A d = v - st.mean;
            st.mean += d / st.count;
            st.m2 += d * (v - st.mean);
        }
        st = wf_block(st, sh);
        A mean = st.mean;
        A var = m > 0 ? st.m2 / (A)m : (A)0;
        A invstd = (A)1 / m_sqrt(var + (A)eps);
        A scale = w[ch] * invstd, shift = b[ch] - mean * scale;
        for (u64 k = threadIdx.x; k < m; k += blockDim.x) {
            u64 i = k / sp, s = k - i * sp;
            u64 at = (i * c + ch) * sp + s;
            y[at] = Num<T>::from(Num<T>::to(x[at]) * scale + shift);
        }
        if (threadIdx.x == 0) {
            mean_out[ch] = mean;
            invstd_out[ch] = invstd;
            A mom = (A)momentum;
            A unbiased = m > 1 ? st.m2 / (A)(m - 1) : var;
            rm[ch] = ((A)1 - mom) * rm[ch] + mom * mean;
            rv[ch] = ((A)1 - mom) * rv[ch] + mom * unbiased;
        }
    }
}

template <typename T>
__device__ void bn_backward(u64 n, u64 c, u64 sp, const T* g, const T* x,
                            const typename Num<T>::acc* w, const typename Num<T>::acc* mean,
                            const typename Num<T>::acc* invstd, T* dx, typename Num<T>::acc* dw,
                            typename Num<T>::acc* db) {
    typedef typename Num<T>::acc A;
    __shared__ A sh[32];
    for (u64 ch = blockIdx.x; ch < c; ch += gridDim.x) {
        u64 m = n * sp;
        A mu = mean[ch], is = invstd[ch];
        A sg = 0, sgx = 0;
        for (u64 k = threadIdx.x; k < m; k += blockDim.x) {
            u64 i = k / sp, s = k - i * sp;
            u64 at = (i * c + ch) * sp + s;
            A gv = Num<T>::to(g[at]);
            sg += gv;
            sgx += gv * (Num<T>::to(x[at]) - mu) * is;
        }
        sg = block_reduce(sg, [](A a, A b) { return a + b; }, (A)0, sh);
        sgx = block_reduce(sgx, [](A a, A b) { return a + b; }, (A)0, sh);
        A k1 = w[ch] * is / (A)m;
        for (u64 k = threadIdx.x; k < m; k += blockDim.x) {
            u64 i = k / sp, s = k - i * sp;
            u64 at = (i * c + ch) * sp + s;
            A xh = (Num<T>::to(x[at]) - mu) * is;
            dx[at] = Num<T>::from(k1 * ((A)m * Num<T>::to(g[at]) - sg - xh * sgx));
        }
        if (threadIdx.x == 0) {
            dw[ch] = sgx;
            db[ch] = sg;
        }
    }
}

#define BN(N, T)                                                                                   \
    extern "C" __global__ void bn_forward_##N(u64 n, u64 c, u64 sp, const T* x,                    \
                                              const Num<T>::acc* w, const Num<T>::acc* b,          \
                                              Num<T>::acc* rm, Num<T>::acc* rv, T* y,              \
                                              Num<T>::acc* mean, Num<T>::acc* invstd, double eps,  \
                                              double momentum) {                                   \
        bn_forward<T>(n, c, sp, x, w, b, rm, rv, y, mean, invstd, eps, momentum);                  \
    }                                                                                              \
    extern "C" __global__ void bn_backward_##N(u64 n, u64 c, u64 sp, const T* g, const T* x,       \
                                               const Num<T>::acc* w, const Num<T>::acc* mean,      \
                                               const Num<T>::acc* invstd, T* dx, Num<T>::acc* dw,  \
                                               Num<T>::acc* db) {                                  \
        bn_backward<T>(n, c, sp, g, x, w, mean, invstd, dx, dw, db);                               \
    }
BN(f16, f16)
BN(bf16, bf16)
BN(f32, float)
BN(f64, double)
