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

// Value k of a pack as f32. A bf16 pack is widened a 32-bit word at a time (a shift for the low
// value, an AND for the high one): value by value, ptxas extracted each 16 bits first (a PRMT and
// an IMAD.U32 per value, against f16's one HADD2.F32), and the NHWC batch norm ran ~35% slower
// in bf16 than in f16.
template <typename T, int V> __device__ __forceinline__ float vto(const Vec<T, V>& v, int k) {
    return Num<T>::to(v.v[k]);
}
template <int V> __device__ __forceinline__ float vto(const Vec<bf16, V>& v, int k) {
    if constexpr (V % 2 == 0) {
        const unsigned w = reinterpret_cast<const unsigned*>(v.v)[k >> 1];
        return __uint_as_float(k & 1 ? (w & 0xffff0000u) : (w << 16));
    } else {
        return Num<bf16>::to(v.v[k]);
    }
}

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
    // per block; more in flight measured slower). Writers: F units per thread between
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

// The two sums of one channel's S partials, part[(ch·S + s)·2 + q], in F (`block_fold`). A block
// per channel, because the NHWC reductions leave hundreds of partials per channel on early
// layers (a thread per channel walking them serially was slow, latency-bound, on CIFAR's 32x32
// layers); the order depends only on S and the block size, so the result repeats bitwise.
template <typename F, typename P>
__device__ __forceinline__ void channel_sums(const P* part, u64 ch, u64 S, F& a, F& b, F* sh) {
    auto add = [](F p, F q) { return p + q; };
    const P* row = part + 2 * ch * S;
    a = block_fold(S, add, (F)0, [&](u64 s) { return (F)row[2 * s]; }, sh);
    b = block_fold(S, add, (F)0, [&](u64 s) { return (F)row[2 * s + 1]; }, sh);
}

// coef per channel: [w·invstd, w·invstd/m, Σg, Σg·x̂, mean, invstd]. One block per channel.
template <typename A>
__device__ void bn_bwd_finalize(u64 c, u64 S, u64 m, const A* part, const A* w, const A* mean,
                                const A* invstd, A* dw, A* db, A* coef) {
    __shared__ A sh[32];
    for (u64 ch = blockIdx.x; ch < c; ch += gridDim.x) {
        A sg, sgx;
        channel_sums(part, ch, S, sg, sgx, sh);
        if (threadIdx.x != 0) continue;
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

// ---- fused and channels_last ---------------------------------------------------------------------
//
// Batch norm with an optional residual add and ReLU after it, y = relu(bn(x) + r), in either
// memory format: NHWC ([m, c] rows, m = n·spatial) or NCHW. Three launches each way:
//   forward:  stats (per channel and row part: Σd, Σd² with d = x − K, K the channel's first
//             value, so the sums stay near the spread, not the mean) → stats_finalize (per
//             channel, in double: mean, invstd, running statistics, scale and shift) → apply
//             (y = x·scale + shift (+ r) (relu), 16-byte packs);
//   backward: bwd_reduce (Σg', Σg'·(x − mean) with g' = g·(y > 0) under ReLU) → bn_bwd_finalize
//             (above) → bwd_dx (dx from g' and the coefficients; g' itself is the residual's
//             gradient, written beside dx when there is a residual).
// Partials are channel-major, part[(ch·S + s)·2 + k], as bn_bwd_finalize reads them.

struct BnGeo {
    u64 n, c, sp;   // x is [n, c, sp] in NCHW or [n, sp, c] in NHWC
    u64 S;          // row parts per channel (NHWC: row blocks; NCHW: blocks per channel)
    i64 relu;       // apply ReLU after the add
    i64 has_res;    // add (forward) / write the gradient of (backward) a residual
    double eps, momentum;
};

// NHWC tiles: block b = chunk·S + s covers GX·V channels (chunk; V per thread, one 16-byte pack
// when V > 1) of the rows [s·per, (s+1)·per); its GY row lanes stride those rows, R rows at a
// time, so that each thread has R loads of each operand in flight. A thread's channels are fixed:
// their per-channel values (shift, mean, scale, coefficients) sit in registers, and no index is
// divided per element.
#define BN_RED_THREADS 256
#define BN_ROWS 4

struct Tile {
    u64 lo, hi, c0, gy, ty, s;
    bool live;
};

template <int V> __device__ __forceinline__ Tile nhwc_tile(const BnGeo& g) {
    Tile t;
    u64 m = g.n * g.sp;
    u64 groups = g.c / V;
    u64 gx = groups < 32 ? groups : 32;
    t.gy = BN_RED_THREADS / gx;
    u64 tx = threadIdx.x % gx;
    t.ty = threadIdx.x / gx;
    t.s = blockIdx.x % g.S;
    u64 cg = (blockIdx.x / g.S) * gx + tx;
    u64 per = (m + g.S - 1) / g.S;
    t.lo = t.s * per;
    t.hi = t.lo + per < m ? t.lo + per : m;
    t.c0 = cg * V;
    t.live = t.ty < t.gy && cg < groups;
    return t;
}

// Calls f(u, row) for BN_ROWS rows of the lane at once (u the slot, rows past hi skipped), first
// `load` for every slot, then `use` for every slot: the loads of a batch are all in flight
// before the first is used.
template <typename L, typename U>
__device__ __forceinline__ void nhwc_lane(const Tile& t, L load, U use) {
    if (!t.live) return;
    for (u64 r = t.lo + t.ty; r < t.hi; r += BN_ROWS * t.gy) {
#pragma unroll
        for (int u = 0; u < BN_ROWS; u++) {
            u64 rr = r + u * t.gy;
            if (rr < t.hi) load(u, rr);
        }
#pragma unroll
        for (int u = 0; u < BN_ROWS; u++) {
            u64 rr = r + u * t.gy;
            if (rr < t.hi) use(u, rr);
        }
    }
}

// Merges each thread's V pairs (a[k], b[k]) over the GY lanes of its channel group and writes
// the block's partials for its channels.
template <int V>
__device__ __forceinline__ void nhwc_merge(BnGeo g, float (&a)[V], float (&b)[V], float* part) {
    __shared__ float sh[2 * BN_RED_THREADS * 8];
    u64 groups = g.c / V;
    u64 GX = groups < 32 ? groups : 32;
    u64 GY = BN_RED_THREADS / GX;
    u64 tx = threadIdx.x % GX, ty = threadIdx.x / GX;
    bool live = ty < GY;
#pragma unroll
    for (int k = 0; k < V; k++) {
        if (live) {
            sh[(ty * GX * V + tx * V + k) * 2] = a[k];
            sh[(ty * GX * V + tx * V + k) * 2 + 1] = b[k];
        }
    }
    __syncthreads();
    // One thread per (channel of the block, quantity) sums the lanes in a fixed order.
    for (u64 t = threadIdx.x; t < GX * V * 2; t += blockDim.x) {
        u64 q = t % 2, cl = t / 2;
        u64 ch = (blockIdx.x / g.S) * GX * V + cl;
        if (ch >= g.c) continue;
        float acc = 0.f;
        for (u64 y = 0; y < GY; y++) acc += sh[(y * GX * V + cl) * 2 + q];
        part[(ch * g.S + blockIdx.x % g.S) * 2 + q] = acc;
    }
}

template <typename T, int V>
__device__ void bn_stats_nhwc(BnGeo g, const T* x, float* part, float* shift) {
    Tile t = nhwc_tile<V>(g);
    float a[V], b[V], K[V];
#pragma unroll
    for (int k = 0; k < V; k++) a[k] = b[k] = K[k] = 0.f;
    if (t.live) {
        // The channel's first value (row 0): the same shift in every block.
#pragma unroll
        for (int k = 0; k < V; k++) K[k] = Num<T>::to(x[t.c0 + k]);
        if (t.s == 0 && t.ty == 0)
            for (int k = 0; k < V; k++) shift[t.c0 + k] = K[k];
    }
    Vec<T, V> v[BN_ROWS];
    nhwc_lane(
        t, [&](int u, u64 r) { v[u] = *(const Vec<T, V>*)(x + r * g.c + t.c0); },
        [&](int u, u64) {
#pragma unroll
            for (int k = 0; k < V; k++) {
                float d = vto(v[u], k) - K[k];
                a[k] += d;
                b[k] += d * d;
            }
        });
    nhwc_merge<V>(g, a, b, part);
}

template <typename T>
__device__ void bn_stats_nchw(BnGeo g, const T* x, float* part, float* shift) {
    __shared__ float sh[32];
    for (u64 blk = blockIdx.x; blk < g.c * g.S; blk += gridDim.x) {
        u64 ch = blk / g.S, s = blk - ch * g.S;
        u64 m = g.n * g.sp, per = (m + g.S - 1) / g.S;
        u64 lo = s * per, hi = lo + per < m ? lo + per : m;
        float K = Num<T>::to(x[ch * g.sp]);
        if (s == 0 && threadIdx.x == 0) shift[ch] = K;
        float a = 0.f, b = 0.f;
        channel_range(g.c, g.sp, ch, lo, hi, [&](u64 at) {
            float d = Num<T>::to(x[at]) - K;
            a += d;
            b += d * d;
        });
        a = block_reduce(a, [](float p, float q) { return p + q; }, 0.f, sh);
        b = block_reduce(b, [](float p, float q) { return p + q; }, 0.f, sh);
        if (threadIdx.x == 0) {
            part[(ch * g.S + s) * 2] = a;
            part[(ch * g.S + s) * 2 + 1] = b;
        }
    }
}

// Per channel: mean, invstd (saved for backward), the running statistics, and coef = [scale,
// shift] with scale = w·invstd, shift = b − mean·scale. Sums in double; one block per channel.
extern "C" __global__ void bn_stats_finalize(BnGeo g, const float* part, const float* shift,
                                             const float* w, const float* bias, float* rm, float* rv,
                                             float* mean, float* invstd, float* coef) {
    __shared__ double sh[32];
    for (u64 ch = blockIdx.x; ch < g.c; ch += gridDim.x) {
        double a, b;
        channel_sums(part, ch, g.S, a, b, sh);
        if (threadIdx.x != 0) continue;
        double m = (double)(g.n * g.sp);
        double mu = (double)shift[ch] + a / m;
        double var = (b - a * a / m) / m;
        if (var < 0) var = 0;
        double is = 1.0 / sqrt(var + g.eps);
        mean[ch] = (float)mu;
        invstd[ch] = (float)is;
        double unbiased = m > 1 ? var * m / (m - 1) : var;
        rm[ch] = (float)((1.0 - g.momentum) * (double)rm[ch] + g.momentum * mu);
        rv[ch] = (float)((1.0 - g.momentum) * (double)rv[ch] + g.momentum * unbiased);
        double sc = (double)w[ch] * is;
        coef[2 * ch] = (float)sc;
        coef[2 * ch + 1] = (float)((double)bias[ch] - mu * sc);
    }
}

__device__ __forceinline__ float bn_epilogue(float v, float r, const BnGeo& g) {
    if (g.has_res) v += r;
    return g.relu && !(v > 0.f) ? 0.f : v;
}

// y = x·scale + shift (+ r) (relu), over the tiles of the reductions (same grid).
template <typename T, int V>
__device__ void bn_apply_nhwc(BnGeo g, const T* x, const T* r, const float* coef, T* y) {
    Tile t = nhwc_tile<V>(g);
    if (!t.live) return;
    float sc[V], sf[V];
#pragma unroll
    for (int k = 0; k < V; k++) {
        sc[k] = coef[2 * (t.c0 + k)];
        sf[k] = coef[2 * (t.c0 + k) + 1];
    }
    Vec<T, V> xv[BN_ROWS], rv[BN_ROWS];
    nhwc_lane(
        t,
        [&](int u, u64 row) {
            u64 e = row * g.c + t.c0;
            xv[u] = *(const Vec<T, V>*)(x + e);
            if (g.has_res) rv[u] = *(const Vec<T, V>*)(r + e);
        },
        [&](int u, u64 row) {
            Vec<T, V> out;
#pragma unroll
            for (int k = 0; k < V; k++) {
                float v = vto(xv[u], k) * sc[k] + sf[k];
                out.v[k] = Num<T>::from(bn_epilogue(v, g.has_res ? vto(rv[u], k) : 0.f, g));
            }
            *(Vec<T, V>*)(y + row * g.c + t.c0) = out;
        });
}

template <typename T>
__device__ void bn_apply_nchw(BnGeo g, const T* x, const T* r, const float* coef, T* y) {
    per_channel_map(g.n * g.c, g.c, g.sp, x, y, [&](float v, unsigned ch, u64 at) {
        float t = v * coef[2 * ch] + coef[2 * ch + 1];
        return bn_epilogue(t, g.has_res ? Num<T>::to(r[at]) : 0.f, g);
    });
}

// g' = g·(y > 0) under ReLU, else g.
template <typename T> __device__ __forceinline__ float masked(const BnGeo& g, T gv, T yv) {
    float v = Num<T>::to(gv);
    return g.relu && !(Num<T>::to(yv) > 0.f) ? 0.f : v;
}

template <typename T, int V>
__device__ void bn_bwd_reduce_nhwc(BnGeo g, const T* gr, const T* x, const T* y, const float* mean,
                                   float* part) {
    Tile t = nhwc_tile<V>(g);
    float a[V], b[V], mu[V];
#pragma unroll
    for (int k = 0; k < V; k++) {
        a[k] = b[k] = 0.f;
        mu[k] = t.live ? mean[t.c0 + k] : 0.f;
    }
    Vec<T, V> gv[BN_ROWS], xv[BN_ROWS], yv[BN_ROWS];
    nhwc_lane(
        t,
        [&](int u, u64 row) {
            u64 e = row * g.c + t.c0;
            gv[u] = *(const Vec<T, V>*)(gr + e);
            xv[u] = *(const Vec<T, V>*)(x + e);
            if (g.relu) yv[u] = *(const Vec<T, V>*)(y + e);
        },
        [&](int u, u64) {
#pragma unroll
            for (int k = 0; k < V; k++) {
                float gg = g.relu && !(vto(yv[u], k) > 0.f) ? 0.f : vto(gv[u], k);
                a[k] += gg;
                b[k] += gg * (vto(xv[u], k) - mu[k]);
            }
        });
    nhwc_merge<V>(g, a, b, part);
}

template <typename T>
__device__ void bn_bwd_reduce_nchw(BnGeo g, const T* gr, const T* x, const T* y, const float* mean,
                                   float* part) {
    __shared__ float sh[32];
    for (u64 blk = blockIdx.x; blk < g.c * g.S; blk += gridDim.x) {
        u64 ch = blk / g.S, s = blk - ch * g.S;
        u64 m = g.n * g.sp, per = (m + g.S - 1) / g.S;
        u64 lo = s * per, hi = lo + per < m ? lo + per : m;
        float mu = mean[ch], a = 0.f, b = 0.f;
        channel_range(g.c, g.sp, ch, lo, hi, [&](u64 at) {
            float gg = g.relu ? masked(g, gr[at], y[at]) : Num<T>::to(gr[at]);
            a += gg;
            b += gg * (Num<T>::to(x[at]) - mu);
        });
        a = block_reduce(a, [](float p, float q) { return p + q; }, 0.f, sh);
        b = block_reduce(b, [](float p, float q) { return p + q; }, 0.f, sh);
        if (threadIdx.x == 0) {
            part[(ch * g.S + s) * 2] = a;
            part[(ch * g.S + s) * 2 + 1] = b;
        }
    }
}

// dx = k0·g' − k1·(Σg' + x̂·Σg'x̂) with coef (bn_bwd_finalize) [k0, k1, Σg', Σg'x̂, mean, invstd];
// the residual's gradient is g'.
__device__ __forceinline__ float bn_dx(const float* k, float gg, float xv) {
    float xh = (xv - k[4]) * k[5];
    return k[0] * gg - k[1] * (k[2] + xh * k[3]);
}

// dx = A·g' + B·(x − mean) + C per channel, from bn_bwd_finalize's coefficients:
// A = k0, B = −k1·invstd·Σg'x̂, C = −k1·Σg' (the same formula as bn_dx, folded per channel).
template <typename T, int V>
__device__ void bn_bwd_dx_nhwc(BnGeo g, const T* gr, const T* x, const T* y, const float* coef,
                               T* dx, T* dres) {
    Tile t = nhwc_tile<V>(g);
    if (!t.live) return;
    float A[V], B[V], C[V], M[V];
#pragma unroll
    for (int k = 0; k < V; k++) {
        const float* q = coef + 6 * (t.c0 + k);
        A[k] = q[0];
        B[k] = -q[1] * q[5] * q[3];
        C[k] = -q[1] * q[2];
        M[k] = q[4];
    }
    Vec<T, V> gv[BN_ROWS], xv[BN_ROWS], yv[BN_ROWS];
    nhwc_lane(
        t,
        [&](int u, u64 row) {
            u64 e = row * g.c + t.c0;
            gv[u] = *(const Vec<T, V>*)(gr + e);
            xv[u] = *(const Vec<T, V>*)(x + e);
            if (g.relu) yv[u] = *(const Vec<T, V>*)(y + e);
        },
        [&](int u, u64 row) {
            u64 e = row * g.c + t.c0;
            Vec<T, V> o, rr;
#pragma unroll
            for (int k = 0; k < V; k++) {
                float gg = g.relu && !(vto(yv[u], k) > 0.f) ? 0.f : vto(gv[u], k);
                o.v[k] = Num<T>::from(A[k] * gg + B[k] * (vto(xv[u], k) - M[k]) + C[k]);
                rr.v[k] = Num<T>::from(gg);
            }
            *(Vec<T, V>*)(dx + e) = o;
            if (g.has_res) *(Vec<T, V>*)(dres + e) = rr;
        });
}

template <typename T>
__device__ void bn_bwd_dx_nchw(BnGeo g, const T* gr, const T* x, const T* y, const float* coef,
                               T* dx, T* dres) {
    per_channel_map(g.n * g.c, g.c, g.sp, gr, dx, [&](float gv, unsigned ch, u64 at) {
        float gg = g.relu && !(Num<T>::to(y[at]) > 0.f) ? 0.f : gv;
        if (g.has_res) dres[at] = Num<T>::from(gg);
        return bn_dx(coef + 6 * ch, gg, Num<T>::to(x[at]));
    });
}

// V = 16-byte packs when the channel count allows, else single values.
#define BN_FUSED(NAME, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(BN_RED_THREADS)                                   \
        bn_stats_nhwc_##NAME(BnGeo g, const T* x, float* part, float* shift) {                    \
        if (g.c % Pack<T>::N == 0) bn_stats_nhwc<T, Pack<T>::N>(g, x, part, shift);                \
        else bn_stats_nhwc<T, 1>(g, x, part, shift);                                               \
    }                                                                                              \
    extern "C" __global__ void bn_stats_nchw_##NAME(BnGeo g, const T* x, float* part, float* shift) { \
        bn_stats_nchw<T>(g, x, part, shift);                                                       \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(BN_RED_THREADS)                                   \
        bn_apply_nhwc_##NAME(BnGeo g, const T* x, const T* r,                                      \
                                                    const float* coef, T* y) {                     \
        if (g.c % Pack<T>::N == 0) bn_apply_nhwc<T, Pack<T>::N>(g, x, r, coef, y);                 \
        else bn_apply_nhwc<T, 1>(g, x, r, coef, y);                                                \
    }                                                                                              \
    extern "C" __global__ void bn_apply_nchw_##NAME(BnGeo g, const T* x, const T* r,               \
                                                    const float* coef, T* y) {                     \
        bn_apply_nchw<T>(g, x, r, coef, y);                                                        \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(BN_RED_THREADS)                                   \
        bn_bwd_reduce_nhwc_##NAME(BnGeo g, const T* gr, const T* x, const T* y,                    \
                                  const float* mean, float* part) {                                \
        if (g.c % Pack<T>::N == 0) bn_bwd_reduce_nhwc<T, Pack<T>::N>(g, gr, x, y, mean, part);     \
        else bn_bwd_reduce_nhwc<T, 1>(g, gr, x, y, mean, part);                                    \
    }                                                                                              \
    extern "C" __global__ void bn_bwd_reduce_nchw_##NAME(BnGeo g, const T* gr, const T* x,         \
                                                         const T* y, const float* mean, float* part) { \
        bn_bwd_reduce_nchw<T>(g, gr, x, y, mean, part);                                            \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(BN_RED_THREADS)                                   \
        bn_bwd_dx_nhwc_##NAME(BnGeo g, const T* gr, const T* x, const T* y,                        \
                                                     const float* coef, T* dx, T* dres) {          \
        if (g.c % Pack<T>::N == 0) bn_bwd_dx_nhwc<T, Pack<T>::N>(g, gr, x, y, coef, dx, dres);     \
        else bn_bwd_dx_nhwc<T, 1>(g, gr, x, y, coef, dx, dres);                                    \
    }                                                                                              \
    extern "C" __global__ void bn_bwd_dx_nchw_##NAME(BnGeo g, const T* gr, const T* x, const T* y, \
                                                     const float* coef, T* dx, T* dres) {          \
        bn_bwd_dx_nchw<T>(g, gr, x, y, coef, dx, dres);                                            \
    }
BN_FUSED(f16, f16)
BN_FUSED(bf16, bf16)
BN_FUSED(f32, float)

// ---- SyncBatchNorm's pieces ----------------------------------------------------------------------
//
// A batch norm whose statistics are every process's: the fused kernels above do the passes over
// the data, these small ones turn their partials into what crosses between processes and back:
//   forward:  bn_stats → bn_sync_stats (this batch's [mean, Σ(x − mean)², count], in double)
//             → all-gather → bn_sync_gather (the union's mean, invstd, running statistics, count)
//             → bn_sync_coef → bn_apply;
//   backward: bn_bwd_reduce → bn_sync_bwd_sums ([Σg'·x̂, Σg'], the weight's and bias's gradients)
//             → all-reduce → bn_sync_bwd_coef (with the total count) → bn_bwd_dx.

// out = [mean (c), Σ(x − mean)² (c), m] from bn_stats's partials of d = x − K:
// mean = K + Σd/m, Σ(x − mean)² = Σd² − (Σd)²/m. One block per channel.
extern "C" __global__ void bn_sync_stats(BnGeo g, const float* part, const float* shift,
                                         double* out) {
    __shared__ double sh[32];
    double m = (double)(g.n * g.sp);
    if (blockIdx.x == 0 && threadIdx.x == 0) out[2 * g.c] = m;
    for (u64 ch = blockIdx.x; ch < g.c; ch += gridDim.x) {
        double a, b;
        channel_sums(part, ch, g.S, a, b, sh);
        if (threadIdx.x != 0) continue;
        double ss = b - a * a / m;
        out[ch] = (double)shift[ch] + a / m;
        out[g.c + ch] = ss > 0 ? ss : 0;
    }
}

// `ranks` rows of bn_sync_stats (rank order) combined per channel in rank order, Chan et al.'s
// pairwise update (n, mean, M2) ⊕ (n_r, mean_r, M2_r): mean and invstd (biased variance) for
// the forward and the backward, the running statistics (unbiased), the total count. One thread
// per channel; every process gets the same bits from the same rows.
extern "C" __global__ void bn_sync_gather(u64 ranks, u64 c, const double* rows, double eps,
                                          double momentum, float* rm, float* rv, float* mean,
                                          float* invstd, double* count) {
    u64 ch = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    u64 w = 2 * c + 1;
    if (ch == 0) {
        double t = 0;
        for (u64 r = 0; r < ranks; r++) t += rows[r * w + 2 * c] > 0 ? rows[r * w + 2 * c] : 0;
        count[0] = t;
    }
    if (ch >= c) return;
    double n = 0, mu = 0, m2 = 0;
    for (u64 r = 0; r < ranks; r++) {
        const double* row = rows + r * w;
        double nr = row[2 * c];
        if (!(nr > 0)) continue;
        double t = n + nr, d = row[ch] - mu;
        mu += d * nr / t;
        m2 += row[c + ch] + d * d * n * nr / t;
        n = t;
    }
    double var = m2 / n;
    double unbiased = n > 1 ? var * n / (n - 1) : var;
    rm[ch] = (float)((1.0 - momentum) * (double)rm[ch] + momentum * mu);
    rv[ch] = (float)((1.0 - momentum) * (double)rv[ch] + momentum * unbiased);
    mean[ch] = (float)mu;
    invstd[ch] = (float)(1.0 / sqrt(var + eps));
}

// bn_apply's coefficients from given statistics: scale = w·invstd, shift = b − mean·scale.
extern "C" __global__ void bn_sync_coef(u64 c, const float* w, const float* b, const float* mean,
                                        const float* invstd, float* coef) {
    u64 ch = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (ch >= c) return;
    double sc = (double)w[ch] * (double)invstd[ch];
    coef[2 * ch] = (float)sc;
    coef[2 * ch + 1] = (float)((double)b[ch] - (double)mean[ch] * sc);
}

// out = [Σg'·x̂ (c), Σg' (c)] from bn_bwd_reduce's partials (Σg', Σg'·(x − mean)). One block
// per channel.
extern "C" __global__ void bn_sync_bwd_sums(u64 c, u64 S, const float* part, const float* invstd,
                                            float* out) {
    __shared__ float sh[32];
    for (u64 ch = blockIdx.x; ch < c; ch += gridDim.x) {
        float sg, sgx;
        channel_sums(part, ch, S, sg, sgx, sh);
        if (threadIdx.x != 0) continue;
        out[ch] = sgx * invstd[ch];
        out[c + ch] = sg;
    }
}

// bn_bwd_dx's coefficients [w·invstd, w·invstd/N, Σg', Σg'·x̂, mean, invstd] from the sums
// over every process (bn_sync_bwd_sums's layout) and their count N.
extern "C" __global__ void bn_sync_bwd_coef(u64 c, const float* sums, const double* count,
                                            const float* w, const float* mean,
                                            const float* invstd, float* coef) {
    u64 ch = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (ch >= c) return;
    float is = invstd[ch];
    float* k = coef + 6 * ch;
    k[0] = w[ch] * is;
    k[1] = w[ch] * is / (float)count[0];
    k[2] = sums[c + ch];
    k[3] = sums[ch];
    k[4] = mean[ch];
    k[5] = is;
}
