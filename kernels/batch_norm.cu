// batch_norm.cu: training-mode batch norm over [n, c, spatial] with f32 statistics (f64 for f64).
// Parameters and statistics are of the acc type.
//
// Forward: one persistent kernel that reads x once and writes y once (see bn_fwd below).
// Backward: three launches, so that every SM works whatever the channel count:
//   partial: grid (c × S) blocks, block (ch, s) reduces its 1/S of the channel's n·spatial values;
//   finalize: one thread per channel merges the S partials;
//   apply: elementwise over the tensor with per-channel coefficients, 16-byte packs.

// Moments of a set of values: count, mean, and M2 = Σ(x − mean)². Two sets merge exactly
// (Chan, Golub & LeVeque): the merged mean moves by d·n_b/n, and M2 gains d²·n_a·n_b/n.
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

// ---- forward ------------------------------------------------------------------------------------
//
// A channel's m = n·spatial values are cut into P equal slices, one per block of a team; team t
// takes channels t, t + T, t + 2T, ... (T teams, grid = T·P blocks, all resident at once, so
// that a block may wait for the other blocks of its team). A block is two groups of warps that
// run their own loops over the team's channels and meet only in a ring buffer in shared memory:
//   readers: copy the block's slice of each channel into the ring (cp.async, several chunks in
//     flight; what the ring cannot hold stays in L2/DRAM and the writers read it again), summing
//     d = x − K and d² with a shift K (the slice's first value): mean_b = K + Σd/n_b and
//     M2_b = Σd² − (Σd)²/n_b, whose terms stay near M2_b in size (unlike Σx² − (Σx)²/n when the
//     mean is large against the spread). They publish (n_b, mean_b, M2_b) and count the block in
//     on the channel's arrival counter.
//   writers: for each channel, wait until the team's P blocks have arrived, merge their moments
//     in a fixed order (Chan's merge, above: every block gets the same mean and variance) and
//     write y = x·scale + shift from the ring, with scale = w/√(var + eps), shift = b − mean·scale;
//     every few hundred units they tell the readers how much of the ring is free again.
// Channel s of the team occupies ring units [s·L, (s+1)·L) (mod the ring's size R; L = the stored
// part of the slice, at most R). The readers may run up to R units ahead of the writers, so while
// the writers wait for the team's last block of channel s, or write it, the readers are already
// streaming channel s + 1 (and s + 2 when the slices are small): no step is the length of the
// slowest block, and there is no block-wide barrier between the groups. Statistics are in the acc
// type whatever T; var is the biased one (÷m) for normalising, the running variance takes the
// unbiased one (÷(m − 1)), as PyTorch does. Each thread sums its units in the same order on every
// run, so the results are deterministic.

// N values of T, read and written as one access (16 bytes when N = 16 / sizeof(T)).
template <typename T, int N> struct alignas(sizeof(T) * N) Vec {
    T v[N];
};

// Unit k of a channel (units of N values; a row of the channel holds spn = spatial/N units) lies
// at ((i·c + ch)·spn + j) for k = i·spn + j. Stepping by s moves (i, j) without a division per
// step when s < spn.
struct Cursor {
    u64 i, j;
    __device__ __forceinline__ Cursor(u64 k, u64 spn) : i(k / spn), j(k % spn) {}
    __device__ __forceinline__ u64 at(u64 c, u64 ch, u64 spn) const { return (i * c + ch) * spn + j; }
    __device__ __forceinline__ void step(u64 s, u64 spn) {
        j += s;
        if (j >= spn) {
            u64 q = j / spn;
            i += q;
            j -= q * spn;
        }
    }
};

// Threads per group (readers are threads [0, BN_GROUP), writers the rest); ops.rs launches bn_fwd
// with BN_THREADS and makes the ring at least BN_GROUP units.
#define BN_GROUP 256
#define BN_THREADS (2 * BN_GROUP)

// A barrier for one group (ids 1 and 2; __syncthreads is barrier 0).
__device__ __forceinline__ void group_sync(int id) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(BN_GROUP) : "memory");
}
__device__ __forceinline__ unsigned long long load_acquire(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void add_release(unsigned long long* p) {
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(1ull) : "memory");
}
__device__ __forceinline__ void nap() { asm volatile("nanosleep.u32 64;" ::: "memory"); }

// Asynchronous global → shared copies (cp.async, sm_80+) of one unit; 2-byte units have no
// cp.async form and are copied through a register.
__device__ __forceinline__ unsigned shared_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
template <typename V> __device__ __forceinline__ void copy_async(V* dst, const V* src) {
    if constexpr (sizeof(V) == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_addr(dst)), "l"(src) : "memory");
    else if constexpr (sizeof(V) == 8 || sizeof(V) == 4)
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(shared_addr(dst)), "l"(src),
                     "n"((int)sizeof(V))
                     : "memory");
    else
        *dst = *src;
}
__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int K> __device__ __forceinline__ void async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(K) : "memory");
}

struct BnFwd {
    u64 n, c, sp, P, T;
    u64 ring;  // units of the block's ring buffer (the whole dynamic shared memory), ≥ BN_GROUP
    double eps, momentum;
};

template <typename T, int N>
__device__ void bn_fwd(BnFwd p, const T* x_, const typename Num<T>::acc* w, const typename Num<T>::acc* b,
                       typename Num<T>::acc* rm, typename Num<T>::acc* rv, typename Num<T>::acc* mean_out,
                       typename Num<T>::acc* invstd_out, T* y_, typename Num<T>::acc* part,
                       unsigned long long* arrived) {
    typedef typename Num<T>::acc A;
    typedef Vec<T, N> V;
    const int W = BN_GROUP / 32;  // warps per group
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ A sums[W][2];
    __shared__ Welford<A> moments[W];
    __shared__ A coef[2];
    __shared__ u64 freed;  // ring units (counted from the start) the writers are done with
    V* ring = (V*)smem;
    const V* __restrict__ x = (const V*)x_;
    V* __restrict__ y = (V*)y_;
    const u64 spn = p.sp / N, M = p.n * spn;  // units per row, per channel
    const u64 team = blockIdx.x / p.P, r = blockIdx.x % p.P;
    const u64 per = (M + p.P - 1) / p.P, lo = r * per < M ? r * per : M, hi = lo + per < M ? lo + per : M;
    const bool reader = threadIdx.x < BN_GROUP;
    const unsigned t = threadIdx.x % BN_GROUP, lane = t % 32, warp = t / 32;
    const unsigned G = BN_GROUP, R = (unsigned)p.ring;
    // S units in the slice, L of them kept in the ring (the rest is read again by the writers).
    const u64 S = hi - lo, L = S < R ? S : R;
    // Readers: chunks of U units per thread, up to D chunks in flight (16 bytes each: 32–64 KB
    // per block; more in flight measured slower on an H200). Writers: F units per thread between
    // reports of their progress.
    const int U = 8, D = 2, F = 4;
    // The ring position `q` moved on by one group stride.
    auto next = [&](unsigned& q) {
        q += G;
        if (q >= R) q -= R;
    };

    if (threadIdx.x == 0) freed = 0;
    __syncthreads();

    if (reader) {
        u64 base = 0;        // ring units used before this channel
        unsigned first = 0;  // base mod R
        for (u64 ch = team; ch < p.c; ch += p.T) {
            A K = 0, s1 = 0, s2 = 0;
            if (lo < hi) K = Num<T>::to(x[Cursor(lo, spn).at(p.c, ch, spn)].v[0]);
            Cursor in(lo + t, spn);
            unsigned qin = first + t, qout;
            if (qin >= R) qin -= R;
            qout = qin;
            const u64 chunk = (u64)G * U, chunks = (S + chunk - 1) / chunk;
            for (u64 i = 0; i < chunks + D - 1; i++) {
                if (i < chunks) {
                    const u64 off = i * chunk, end = off + chunk < L ? off + chunk : L;
                    // The chunk's ring units must have been written out by the writers.
                    if (off < L && base + end > R) {
                        for (unsigned spins = 0; *(volatile u64*)&freed < base + end - R; spins++) {
                            if (spins == 1u << 26) __trap();
                            nap();
                        }
                        __threadfence_block();
                    }
#pragma unroll
                    for (int u = 0; u < U; u++) {
                        if (off + u * G + t < L) copy_async(ring + qin, x + in.at(p.c, ch, spn));
                        in.step(G, spn);
                        next(qin);
                    }
                }
                async_commit();
                if (i + 1 >= D) {
                    async_wait<D - 1>();  // chunk i + 1 − D has landed
                    const u64 off = (i + 1 - D) * chunk;
#pragma unroll
                    for (int u = 0; u < U; u++) {
                        const u64 o = off + u * G + t;
                        if (o < S) {
                            const V v = o < L ? ring[qout] : x[Cursor(lo + o, spn).at(p.c, ch, spn)];
#pragma unroll
                            for (int e = 0; e < N; e++) {
                                A d = Num<T>::to(v.v[e]) - K;
                                s1 += d;
                                s2 += d * d;
                            }
                        }
                        next(qout);
                    }
                }
            }
            s1 = warp_reduce(s1, [](A a, A c) { return a + c; });
            s2 = warp_reduce(s2, [](A a, A c) { return a + c; });
            if (lane == 0) {
                sums[warp][0] = s1;
                sums[warp][1] = s2;
            }
            group_sync(1);
            if (t == 0) {
                A S1 = 0, S2 = 0;
                for (int q = 0; q < W; q++) {
                    S1 += sums[q][0];
                    S2 += sums[q][1];
                }
                const A nb = (A)(S * N);
                A* q = part + 3 * (ch * p.P + r);
                q[0] = nb;
                q[1] = nb > (A)0 ? K + S1 / nb : (A)0;
                q[2] = nb > (A)0 ? S2 - S1 * (S1 / nb) : (A)0;
                add_release(arrived + ch);  // orders the stores (and the group's ring) before the count
            }
            group_sync(1);  // sums[] is free again
            base += L;
            first += (unsigned)L;
            if (first >= R) first -= R;
        }
        return;
    }

    // Writers.
    u64 base = 0;
    unsigned first = 0;
    for (u64 ch = team; ch < p.c; ch += p.T) {
        if (t == 0) {
            // Seconds of polling mean a block that never comes (a grid that was not all
            // resident): an error, not a hang.
            for (unsigned spins = 0; load_acquire(arrived + ch) < p.P; spins++)
                if (spins == 1u << 24) __trap();
        }
        group_sync(2);
        const volatile A* q = part + 3 * ch * p.P;  // volatile: past L1, written by other SMs
        Welford<A> st = {0, 0, 0};
        for (u64 k = t; k < p.P; k += BN_GROUP) {
            Welford<A> o = {q[3 * k], q[3 * k + 1], q[3 * k + 2]};
            st = wf_merge(st, o);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            Welford<A> other;
            other.count = __shfl_xor_sync(0xffffffffu, st.count, o);
            other.mean = __shfl_xor_sync(0xffffffffu, st.mean, o);
            other.m2 = __shfl_xor_sync(0xffffffffu, st.m2, o);
            st = wf_merge(st, other);
        }
        if (lane == 0) moments[warp] = st;
        group_sync(2);
        if (t == 0) {
            st = moments[0];
            for (int k = 1; k < W; k++) st = wf_merge(st, moments[k]);
            const u64 m = p.n * p.sp;
            A var = m > 0 ? st.m2 / (A)m : (A)0;
            A invstd = (A)1 / m_sqrt(var + (A)p.eps);
            A scale = w[ch] * invstd;
            coef[0] = scale;
            coef[1] = b[ch] - st.mean * scale;
            if (r == 0) {
                mean_out[ch] = st.mean;
                invstd_out[ch] = invstd;
                A mom = (A)p.momentum;
                A unbiased = m > 1 ? st.m2 / (A)(m - 1) : var;
                rm[ch] = ((A)1 - mom) * rm[ch] + mom * st.mean;
                rv[ch] = ((A)1 - mom) * rv[ch] + mom * unbiased;
            }
        }
        group_sync(2);
        const A scale = coef[0], shift = coef[1];
        Cursor cur(lo + t, spn);
        unsigned qw = first + t;
        if (qw >= R) qw -= R;
        for (u64 off = 0; off < S; off += (u64)G * F) {
            V v[F];
            u64 at[F];
#pragma unroll
            for (int f = 0; f < F; f++) {
                const u64 o = off + f * G + t;
                at[f] = cur.at(p.c, ch, spn);
                if (o < S) v[f] = o < L ? ring[qw] : x[at[f]];
                cur.step(G, spn);
                next(qw);
            }
#pragma unroll
            for (int f = 0; f < F; f++) {
                if (off + f * G + t < S) {
                    V o;
#pragma unroll
                    for (int e = 0; e < N; e++) o.v[e] = Num<T>::from(Num<T>::to(v[f].v[e]) * scale + shift);
                    y[at[f]] = o;
                }
            }
            // Every writer has read its units below `off + G·F`: the readers may reuse them.
            group_sync(2);
            if (t == 0) {
                const u64 done = off + (u64)G * F < L ? off + (u64)G * F : L;
                __threadfence_block();
                *(volatile u64*)&freed = base + done;
            }
        }
        base += L;
        first += (unsigned)L;
        if (first >= R) first -= R;
    }
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

#define BN(NAME, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(BN_THREADS, 1)                                           \
        bn_fwd_##NAME(BnFwd p, const T* x, const Num<T>::acc* w, const Num<T>::acc* b,                \
                   Num<T>::acc* rm, Num<T>::acc* rv, Num<T>::acc* mean, Num<T>::acc* invstd, T* y,  \
                   Num<T>::acc* part, unsigned long long* arrived) {                               \
        if (p.sp % Pack<T>::N == 0)                                                                \
            bn_fwd<T, Pack<T>::N>(p, x, w, b, rm, rv, mean, invstd, y, part, arrived);             \
        else                                                                                       \
            bn_fwd<T, 1>(p, x, w, b, rm, rv, mean, invstd, y, part, arrived);                      \
    }                                                                                              \
    extern "C" __global__ void bn_bwd_partial_##NAME(u64 n, u64 c, u64 sp, u64 S, const T* g,         \
                                                  const T* x, const Num<T>::acc* mean,             \
                                                  Num<T>::acc* part) {                             \
        bn_bwd_partial<T>(n, c, sp, S, g, x, mean, part);                                          \
    }                                                                                              \
    extern "C" __global__ void bn_bwd_apply_##NAME(u64 n, u64 c, u64 sp, const T* g, const T* x,      \
                                                const Num<T>::acc* coef, T* dx) {                  \
        bn_bwd_apply<T>(n, c, sp, g, x, coef, dx);                                                 \
    }
BN(f16, f16)
BN(bf16, bf16)
BN(f32, float)
BN(f64, double)

#define BN_ACC(N, A)                                                                               \
    extern "C" __global__ void bn_bwd_finalize_##N(u64 c, u64 S, u64 m, const A* part,            \
                                                   const A* w, const A* mean, const A* invstd,     \
                                                   A* dw, A* db, A* coef) {                        \
        bn_bwd_finalize<A>(c, S, m, part, w, mean, invstd, dw, db, coef);                          \
    }
BN_ACC(f32, float)
BN_ACC(f64, double)
