// batch_norm.cu: training-mode batch norm over [n, c, spatial] with f32 statistics (f64 for f64).
// Parameters and statistics are of the acc type. Three launches each way, so that every SM
// works whatever the channel count:
//   partial: grid (c × S) blocks, block (ch, s) reduces its 1/S of the channel's n·spatial values;
//   finalize: one thread per channel merges the S partials (and updates running statistics);
//   apply: elementwise over the tensor with per-channel coefficients, 16-byte packs.

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


// Iterates the values of channel `ch` with flat index k in [lo, hi) over (batch i, spatial j),
// stepping by blockDim.x; the (i, j) cursor moves without a division per element.
template <typename F>
__device__ __forceinline__ void channel_range(u64 c, u64 sp, u64 ch, u64 lo, u64 hi, F f) {
    u64 k = lo + threadIdx.x;
    if (k >= hi) return;
    u64 i = k / sp, j = k - i * sp;
    const u64 step = blockDim.x;
    for (; k < hi; k += step) {
        f((i * c + ch) * sp + j);
        j += step;
        if (j >= sp) {
            u64 q = j / sp;
            i += q;
            j -= q * sp;
        }
    }
}

template <typename T>
__device__ void bn_partial(u64 n, u64 c, u64 sp, u64 S, const T* x, typename Num<T>::acc* part) {
    typedef typename Num<T>::acc A;
    __shared__ A sh[96];
    for (u64 b = blockIdx.x; b < c * S; b += gridDim.x) {
        u64 ch = b / S, s = b - ch * S;
        u64 m = n * sp, per = (m + S - 1) / S;
        u64 lo = s * per, hi = lo + per < m ? lo + per : m;
        Welford<A> st = {0, 0, 0};
        channel_range(c, sp, ch, lo, hi, [&](u64 at) {
            A v = Num<T>::to(x[at]);
            st.count += (A)1;
            A d = v - st.mean;
            st.mean += d / st.count;
            st.m2 += d * (v - st.mean);
        });
        st = wf_block(st, sh);
        if (threadIdx.x == 0) {
            part[3 * b] = st.count;
            part[3 * b + 1] = st.mean;
            part[3 * b + 2] = st.m2;
        }
    }
}

// coef[2·ch] = scale, coef[2·ch+1] = shift.
template <typename A>
__device__ void bn_finalize(u64 c, u64 S, u64 m, const A* part, const A* w, const A* b, A* rm, A* rv,
                            A* mean_out, A* invstd_out, A* coef, double eps, double momentum) {
    for (u64 ch = global_tid(); ch < c; ch += global_stride()) {
        Welford<A> st = {0, 0, 0};
        for (u64 s = 0; s < S; s++) {
            Welford<A> p = {part[3 * (ch * S + s)], part[3 * (ch * S + s) + 1], part[3 * (ch * S + s) + 2]};
            st = wf_merge(st, p);
        }
        A var = m > 0 ? st.m2 / (A)m : (A)0;
        A invstd = (A)1 / m_sqrt(var + (A)eps);
        A scale = w[ch] * invstd;
        coef[2 * ch] = scale;
        coef[2 * ch + 1] = b[ch] - st.mean * scale;
        mean_out[ch] = st.mean;
        invstd_out[ch] = invstd;
        A mom = (A)momentum;
        A unbiased = m > 1 ? st.m2 / (A)(m - 1) : var;
        rm[ch] = ((A)1 - mom) * rm[ch] + mom * st.mean;
        rv[ch] = ((A)1 - mom) * rv[ch] + mom * unbiased;
    }
}

// Elementwise over rows (i, ch) of `sp` values: `f(v, ch, extra)` with one channel lookup per
// row. Large rows: grid-stride over rows, 16-byte packs within. Small rows: several rows per
// block, one division per thread.
template <typename T, typename F>
__device__ void per_channel_map(u64 rows, u64 c, u64 sp, const T* x, T* y, F f) {
    typedef typename Pack<T>::type P;
    const int N = Pack<T>::N;
    if (sp >= blockDim.x) {
        bool packed = (sp % N) == 0;
        for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
            unsigned ch = (unsigned)(row % c);
            u64 base = row * sp;
            if (packed) {
                const P* xv = (const P*)(x + base);
                P* yv = (P*)(y + base);
                for (u64 q = threadIdx.x; q < sp / N; q += blockDim.x) {
                    P a = xv[q], r;
#pragma unroll
                    for (int k = 0; k < N; k++) r.v[k] = Num<T>::from(f(Num<T>::to(a.v[k]), ch, base + q * N + k));
                    yv[q] = r;
                }
            } else {
                for (u64 j = threadIdx.x; j < sp; j += blockDim.x)
                    y[base + j] = Num<T>::from(f(Num<T>::to(x[base + j]), ch, base + j));
            }
        }
    } else {
        u64 R = blockDim.x / sp;
        u64 r = threadIdx.x / sp, j = threadIdx.x - r * sp;
        if (r >= R) return;
        for (u64 row = blockIdx.x * R + r; row < rows; row += (u64)gridDim.x * R) {
            unsigned ch = (unsigned)(row % c);
            u64 at = row * sp + j;
            y[at] = Num<T>::from(f(Num<T>::to(x[at]), ch, at));
        }
    }
}

template <typename T>
__device__ void bn_apply(u64 n, u64 c, u64 sp, const T* x, const typename Num<T>::acc* coef, T* y) {
    typedef typename Num<T>::acc A;
    per_channel_map(n * c, c, sp, x, y, [coef](A v, unsigned ch, u64) { return v * coef[2 * ch] + coef[2 * ch + 1]; });
}

// Backward partial sums per (channel, part): Σg and Σg·(x − mean).
template <typename T>
__device__ void bn_bwd_partial(u64 n, u64 c, u64 sp, u64 S, const T* g, const T* x,
                               const typename Num<T>::acc* mean, typename Num<T>::acc* part) {
    typedef typename Num<T>::acc A;
    __shared__ A sh[32];
    for (u64 b = blockIdx.x; b < c * S; b += gridDim.x) {
        u64 ch = b / S, s = b - ch * S;
        u64 m = n * sp, per = (m + S - 1) / S;
        u64 lo = s * per, hi = lo + per < m ? lo + per : m;
        A mu = mean[ch];
        A sg = 0, sgx = 0;
        channel_range(c, sp, ch, lo, hi, [&](u64 at) {
            A gv = Num<T>::to(g[at]);
            sg += gv;
            sgx += gv * (Num<T>::to(x[at]) - mu);
        });
        sg = block_reduce(sg, [](A p, A q) { return p + q; }, (A)0, sh);
        sgx = block_reduce(sgx, [](A p, A q) { return p + q; }, (A)0, sh);
        if (threadIdx.x == 0) {
            part[2 * b] = sg;
            part[2 * b + 1] = sgx;
        }
    }
}

// coef per channel: [w·invstd, w·invstd/m, Σg, Σg·x̂, mean, invstd].
template <typename A>
__device__ void bn_bwd_finalize(u64 c, u64 S, u64 m, const A* part, const A* w, const A* mean,
                                const A* invstd, A* dw, A* db, A* coef) {
    for (u64 ch = global_tid(); ch < c; ch += global_stride()) {
        A sg = 0, sgx = 0;
        for (u64 s = 0; s < S; s++) {
            sg += part[2 * (ch * S + s)];
            sgx += part[2 * (ch * S + s) + 1];
        }
        A is = invstd[ch];
        sgx *= is;
        dw[ch] = sgx;
        db[ch] = sg;
        A* k = coef + 6 * ch;
        k[0] = w[ch] * is;
        k[1] = w[ch] * is / (A)m;
        k[2] = sg;
        k[3] = sgx;
        k[4] = mean[ch];
        k[5] = is;
    }
}

// dx = w·invstd/m · (m·g − Σg − x̂·Σg·x̂), as k1·m·g − k1·(Σg + x̂·Σgx̂).
template <typename T>
__device__ void bn_bwd_apply(u64 n, u64 c, u64 sp, const T* g, const T* x, const typename Num<T>::acc* coef, T* dx) {
    typedef typename Num<T>::acc A;
    per_channel_map(n * c, c, sp, g, dx, [coef, x](A gv, unsigned ch, u64 at) {
        const A* k = coef + 6 * ch;
        A xh = (Num<T>::to(x[at]) - k[4]) * k[5];
        return k[0] * gv - k[1] * (k[2] + xh * k[3]);
    });
}

#define BN(N, T)                                                                                   \
    extern "C" __global__ void bn_partial_##N(u64 n, u64 c, u64 sp, u64 S, const T* x,             \
                                              Num<T>::acc* part) {                                 \
        bn_partial<T>(n, c, sp, S, x, part);                                                       \
    }                                                                                              \
    extern "C" __global__ void bn_apply_##N(u64 n, u64 c, u64 sp, const T* x,                      \
                                            const Num<T>::acc* coef, T* y) {                       \
        bn_apply<T>(n, c, sp, x, coef, y);                                                         \
    }                                                                                              \
    extern "C" __global__ void bn_bwd_partial_##N(u64 n, u64 c, u64 sp, u64 S, const T* g,         \
                                                  const T* x, const Num<T>::acc* mean,             \
                                                  Num<T>::acc* part) {                             \
        bn_bwd_partial<T>(n, c, sp, S, g, x, mean, part);                                          \
    }                                                                                              \
    extern "C" __global__ void bn_bwd_apply_##N(u64 n, u64 c, u64 sp, const T* g, const T* x,      \
                                                const Num<T>::acc* coef, T* dx) {                  \
        bn_bwd_apply<T>(n, c, sp, g, x, coef, dx);                                                 \
    }
BN(f16, f16)
BN(bf16, bf16)
BN(f32, float)
BN(f64, double)

#define BN_ACC(N, A)                                                                               \
    extern "C" __global__ void bn_finalize_##N(u64 c, u64 S, u64 m, const A* part, const A* w,     \
                                               const A* b, A* rm, A* rv, A* mean, A* invstd,       \
                                               A* coef, double eps, double momentum) {             \
        bn_finalize<A>(c, S, m, part, w, b, rm, rv, mean, invstd, coef, eps, momentum);            \
    }                                                                                              \
    extern "C" __global__ void bn_bwd_finalize_##N(u64 c, u64 S, u64 m, const A* part,            \
                                                   const A* w, const A* mean, const A* invstd,     \
                                                   A* dw, A* db, A* coef) {                        \
        bn_bwd_finalize<A>(c, S, m, part, w, mean, invstd, dw, db, coef);                          \
    }
BN_ACC(f32, float)
BN_ACC(f64, double)
