// flash_attention.cu: fused scaled-dot-product attention on tensor cores (the FlashAttention-2
// algorithm), f16 / bf16 operands with f32 accumulation, head dim 64 or 128, sm_80+.
//
// Forward: a block of 4 warps per (64-query block, batch, head); warp w owns query rows
// 16w..16w+15 of the block and keeps their Q fragments in registers. Key/value tiles of 64 rows
// go through shared memory with cp.async (K of the next tile loads while this tile's softmax and
// P·V run; V of the next while the next S = Q·Kᵀ runs). Softmax is online, in base 2 (the scale
// folded into log2 e), in registers. Causal: tiles wholly above the diagonal are never loaded;
// the tiles that cross it (and the tail past seq_k) are masked. Writes O normalised, as
// [B, Tq, H, D], and the log-sum-exp (natural log) per row, [B, H, Tq].
//
// Backward: flash_bwd_pre computes Dᵢ = Σ_d dOᵢ·Oᵢ (f32) and zeroes the f32 dQ accumulator; then
// a block of 4 warps per (64-key block, batch, head), warp w owning keys 16w..16w+15, loops over
// the query blocks that see those keys: recomputes Pᵀ from Q, K and the LSE, dV += Pᵀ·dO,
// dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ − D), dK += dSᵀ·Q; dSᵀ goes to shared memory, then every warp
// multiplies its share of dS·K and adds it to dQ with f32 atomics (vector reductions on sm_90);
// flash_dq_convert scales dQ and converts it to the input dtype. dK (scaled) and dV are written
// once, from registers. (Query blocks are 32 rows for D = 128, to stay within 48 KiB of static
// shared memory.)
//
// Tensor-core fragments of mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: lane l, with
// g = l / 4 and t = l % 4; a .b32 register holds two 16-bit values, the lower column (A, C) or
// lower k (B) in its low half.
//   A (16×16, row-major, 4 regs): a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1],
//                                 a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9]
//   B (16×8, k × n, 2 regs):      b0 = B[2t, 2t+1][g],  b1 = B[2t+8, 2t+9][g]
//   C (16×8 f32, 4 regs):         c0, c1 = C[g][2t, 2t+1],  c2, c3 = C[g+8][2t, 2t+1]
// Hence two C tiles side by side (columns 0-7 and 8-15) are, packed in pairs, the A fragment of
// the 16×16 tile they form: a0 = (c0, c1) of the first, a1 = (c2, c3) of the first, a2, a3 the
// same of the second. That is how P (and dS) feed the next product without leaving registers.
//
// ldmatrix.m8n8.x4 (16-bit): lanes 8i..8i+7 give the addresses of rows 0..7 of 8×8 matrix i
// (16 contiguous bytes each); register i of lane l receives matrix i's elements
// [l/4][2(l%4), 2(l%4)+1], or with .trans [2(l%4)][l/4] and [2(l%4)+1][l/4]. So, for a 16×16
// tile at (r0, c0) of a row-major shared array X:
//   A fragment of X:          matrix i at rows r0 + 8(i%2),  cols c0 + 8(i/2)   (non-trans)
//   B fragments of Xᵀ (B[k][n] = X[n][k]), n-tiles r0..r0+7 and r0+8..r0+15:
//                             matrix i at rows r0 + 8(i/2),  cols c0 + 8(i%2)   (non-trans)
//                             → regs (0, 1) are tile r0's (b0, b1), (2, 3) tile r0+8's
//   B fragments of X (B[k][n] = X[k][n]), n-tiles c0..c0+7 and c0+8..c0+15:
//                             matrix i at rows r0 + 8(i%2),  cols c0 + 8(i/2)   (.trans)
//   A fragment of Xᵀ (A[m][k] = X[k][m]):
//                             matrix i at rows r0 + 8(i/2),  cols c0 + 8(i%2)   (.trans)
//                             (here r0 indexes X's rows = A's k, c0 X's columns = A's m)
//
// Shared arrays have rows padded by 8 elements (16 bytes), so the 8 rows of one ldmatrix matrix
// fall in different banks, and every row start stays 16-byte aligned.

// The instructions used (mma.sync with bf16, cp.async) need sm_80: for older GPUs the family
// compiles to no kernels, and the Rust side refuses before any launch.
#if __CUDA_ARCH__ >= 800

// Launch parameters (mirrored by `FlashParams` on the Rust side: every field
// 8 bytes but the two floats at the end, so the layouts agree). Strides in elements, for
// (batch, head, token); the head dimension is contiguous.
struct FlashParams {
    u64 q, k, v, o, lse;
    u64 dout, dq_acc, dq, dk, dv, dvec;
    i64 batch, heads, seq_q, seq_k, head_dim;
    i64 q_s[3], k_s[3], v_s[3], o_s[3], do_s[3];
    i64 causal;
    float scale, scale_log2;
};

#define FA_THREADS 128
#define FA_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global → shared, asynchronously; `valid` false writes 16 zero bytes instead (src-size
// 0: nothing is read, `src` only has to be some valid address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(const void* p, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p))
                 : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(const void* p, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p))
                 : "memory");
}

// p[0..4) += v0..v3 in global memory (16-byte aligned), one vector reduction (sm_90).
__device__ __forceinline__ void red_add_v4(float* p, float v0, float v1, float v2, float v3) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v0), "f"(v1), "f"(v2),
                 "f"(v3)
                 : "memory");
}

__device__ __forceinline__ float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The 16-bit type's tensor-core instruction and its pair packing.
template <typename T> struct Tc;
template <> struct Tc<f16> {
    // {lo, hi} → one register (cvt puts its first source in the upper half).
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        unsigned r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                               unsigned b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct Tc<bf16> {
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        unsigned r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                               unsigned b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// Two adjacent 16-bit values as one register (4-byte aligned: even offsets of 16-byte aligned
// rows).
template <typename T> __device__ __forceinline__ unsigned ld_pair(const T* p) {
    return *(const unsigned*)p;
}
template <typename T> __device__ __forceinline__ void st_pair(T* p, unsigned v) { *(unsigned*)p = v; }

// `ROWS` rows of `D` elements, rows from `first` on (a row of index >= `limit` is zero-filled),
// from global `src` (row stride `st`) into shared `dst` (row stride D + 8), 16 bytes per copy.
template <typename T, int ROWS, int D>
__device__ __forceinline__ void load_rows(T* dst, const T* src, i64 st, i64 first, i64 limit) {
    const int CPR = D / 8;
    static_assert(ROWS * CPR % FA_THREADS == 0, "whole copies per thread");
#pragma unroll
    for (int it = 0; it < ROWS * CPR / FA_THREADS; it++) {
        const int c = threadIdx.x + it * FA_THREADS;
        const int r = c / CPR, cc = c % CPR;
        const i64 row = first + r;
        const bool ok = row < limit;
        cp_async16(dst + r * (D + 8) + cc * 8, ok ? src + row * st + cc * 8 : src, ok);
    }
}

// ---------------------------------------------------------------------------------------------
// Forward.

template <typename T, int D>
__device__ __forceinline__ void flash_fwd(const FlashParams& p) {
    const int BM = 64, BN = 64, LD = D + 8;
    __shared__ __align__(16) T ks[BN * LD];
    __shared__ __align__(16) T vs[BN * LD];

    const i64 seq_q = p.seq_q, seq_k = p.seq_k, H = p.heads;
    const i64 nqb = (seq_q + BM - 1) / BM;
    // Query blocks of one (batch, head) last to first: under a causal mask the last do the most
    // work, and they start first.
    const i64 qb = nqb - 1 - (i64)blockIdx.x % nqb;
    const i64 bh = (i64)blockIdx.x / nqb, b = bh / H, h = bh % H;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const i64 m0 = qb * BM;
    const i64 row0 = m0 + warp * 16 + g, row1 = row0 + 8;  // this thread's two query rows

    const T* q = (const T*)p.q + b * p.q_s[0] + h * p.q_s[1];
    const T* k = (const T*)p.k + b * p.k_s[0] + h * p.k_s[1];
    const T* v = (const T*)p.v + b * p.v_s[0] + h * p.v_s[1];
    const i64 kst = p.k_s[2], vst = p.v_s[2];

    // Keys [0, n_end) can be visible to this block's rows.
    i64 n_end = seq_k;
    if (p.causal && m0 + BM < n_end) n_end = m0 + BM;
    const int ntiles = (int)((n_end + BN - 1) / BN);

    load_rows<T, BN, D>(ks, k, kst, 0, seq_k);
    cp_async_commit();
    load_rows<T, BN, D>(vs, v, vst, 0, seq_k);
    cp_async_commit();

    // The warp's 16 rows of Q as A fragments, straight from global memory (rows past seq_q: 0).
    unsigned qa[D / 16][4];
    {
        const T* q0 = q + row0 * p.q_s[2];
        const T* q1 = q + row1 * p.q_s[2];
        const bool ok0 = row0 < seq_q, ok1 = row1 < seq_q;
#pragma unroll
        for (int kc = 0; kc < D / 16; kc++) {
            const int c = kc * 16 + 2 * t;
            qa[kc][0] = ok0 ? ld_pair(q0 + c) : 0u;
            qa[kc][1] = ok1 ? ld_pair(q1 + c) : 0u;
            qa[kc][2] = ok0 ? ld_pair(q0 + c + 8) : 0u;
            qa[kc][3] = ok1 ? ld_pair(q1 + c + 8) : 0u;
        }
    }

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float mrow[2] = {FA_NEG_INF, FA_NEG_INF};  // running max of scale·log2e·s per row
    float lrow[2] = {0.f, 0.f};                // this thread's share of the running row sum
    const float sl2 = p.scale_log2;

    for (int j = 0; j < ntiles; j++) {
        const i64 n0 = (i64)j * BN;
        // Groups in flight: K(j), V(j) (and nothing later): wait for K(j).
        cp_async_wait<1>();
        __syncthreads();

        float s[BN / 8][4];
#pragma unroll
        for (int i = 0; i < BN / 8; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < D / 16; kc++) {
#pragma unroll
            for (int np = 0; np < BN / 16; np++) {
                // B fragments of Kᵀ: matrix i at key rows np·16 + 8(i/2), dim cols kc·16 + 8(i%2).
                unsigned bf[4];
                ldsm_x4(ks + (np * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kc * 16 + ((lane >> 3) & 1) * 8, bf);
                Tc<T>::mma(s[2 * np], qa[kc], bf[0], bf[1]);
                Tc<T>::mma(s[2 * np + 1], qa[kc], bf[2], bf[3]);
            }
        }
        // Every warp is done with K(j): load K(j+1) under this tile's softmax and P·V.
        __syncthreads();
        if (j + 1 < ntiles) load_rows<T, BN, D>(ks, k, kst, n0 + BN, seq_k);
        cp_async_commit();

        // Scaled to base 2, masked past seq_k and above the diagonal.
        const bool mask = n0 + BN > seq_k || (p.causal && n0 + BN - 1 > m0);
#pragma unroll
        for (int i = 0; i < BN / 8; i++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = s[i][e] * sl2;
                if (mask) {
                    const i64 key = n0 + i * 8 + 2 * t + (e & 1);
                    const i64 row = e < 2 ? row0 : row1;
                    if (key >= seq_k || (p.causal && key > row)) x = FA_NEG_INF;
                }
                s[i][e] = x;
            }
        }
        // Online softmax: the new row maxima (the 4 lanes of a quad share a row), the factor
        // that rescales what was summed so far, and P = 2^(x − max).
        float mx[2] = {FA_NEG_INF, FA_NEG_INF};
#pragma unroll
        for (int i = 0; i < BN / 8; i++) {
            mx[0] = fmaxf(mx[0], fmaxf(s[i][0], s[i][1]));
            mx[1] = fmaxf(mx[1], fmaxf(s[i][2], s[i][3]));
        }
        float alpha[2], mref[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float mnew = fmaxf(mrow[r], mx[r]);
            // A row with nothing visible yet keeps −inf as its max; 0 as the reference then
            // keeps (−inf) − (−inf) out.
            mref[r] = mnew == FA_NEG_INF ? 0.f : mnew;
            alpha[r] = fa_exp2(mrow[r] - mref[r]);
            mrow[r] = mnew;
        }
        float ls[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < BN / 8; i++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float pe = fa_exp2(s[i][e] - mref[e >> 1]);
                s[i][e] = pe;
                ls[e >> 1] += pe;
            }
        }
        lrow[0] = lrow[0] * alpha[0] + ls[0];
        lrow[1] = lrow[1] * alpha[1] + ls[1];
#pragma unroll
        for (int i = 0; i < D / 8; i++) {
            o[i][0] *= alpha[0];
            o[i][1] *= alpha[0];
            o[i][2] *= alpha[1];
            o[i][3] *= alpha[1];
        }

        // Groups in flight: V(j), K(j+1): wait for V(j).
        cp_async_wait<1>();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            const unsigned pa[4] = {Tc<T>::pack(s[2 * kk][0], s[2 * kk][1]),
                                    Tc<T>::pack(s[2 * kk][2], s[2 * kk][3]),
                                    Tc<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    Tc<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dp = 0; dp < D / 16; dp++) {
                // B fragments of V: matrix i at key rows kk·16 + 8(i%2), dim cols dp·16 + 8(i/2).
                unsigned bf[4];
                ldsm_x4_t(vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dp * 16 + (lane >> 4) * 8, bf);
                Tc<T>::mma(o[2 * dp], pa, bf[0], bf[1]);
                Tc<T>::mma(o[2 * dp + 1], pa, bf[2], bf[3]);
            }
        }
        // Every warp is done with V(j): load V(j+1) under the next S = Q·Kᵀ.
        __syncthreads();
        if (j + 1 < ntiles) load_rows<T, BN, D>(vs, v, vst, n0 + BN, seq_k);
        cp_async_commit();
    }

    // Normalise and write O as [B, Tq, H, D]; the LSE in natural log, [B, H, Tq].
    float inv[2], lsum[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float l = lrow[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        lsum[r] = l;
        inv[r] = l > 0.f ? 1.f / l : 0.f;
    }
    T* out = (T*)p.o;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const i64 row = r ? row1 : row0;
        if (row < seq_q) {
            T* orow = out + ((b * seq_q + row) * H + h) * D;
#pragma unroll
            for (int i = 0; i < D / 8; i++)
                st_pair(orow + i * 8 + 2 * t, Tc<T>::pack(o[i][2 * r] * inv[r], o[i][2 * r + 1] * inv[r]));
            if (t == 0) {
                const float lse = lsum[r] > 0.f ? (mrow[r] + log2f(lsum[r])) * 0.69314718055994531f : FA_NEG_INF;
                ((float*)p.lse)[(b * H + h) * seq_q + row] = lse;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Backward.

// Dᵢ = Σ_d dOᵢ·Oᵢ per (batch, query, head) row, and the row's dQ accumulator zeroed: D/8 lanes
// per row (8 or 16), each with 16 bytes of O and of dO.
struct __align__(16) FaF4 { float v[4]; };
template <typename T>
__device__ __forceinline__ void flash_bwd_pre(const FlashParams& p) {
    typedef typename Pack<T>::type P;
    const i64 H = p.heads, Tq = p.seq_q, D = p.head_dim;
    const int per_row = (int)(D / 8);
    const i64 rows = p.batch * Tq * H, rows_per_warp = 32 / per_row;
    const int lane = threadIdx.x & 31, sub = lane % per_row;
    const i64 nwarps = (i64)(global_stride() >> 5);
    for (i64 base = (i64)(global_tid() >> 5) * rows_per_warp; base < rows; base += nwarps * rows_per_warp) {
        const i64 r = base + lane / per_row;
        const i64 h = r % H, i = (r / H) % Tq, b = r / (H * Tq);
        float s = 0.f;
        if (r < rows) {
            const P a = ((const P*)((const T*)p.o + b * p.o_s[0] + h * p.o_s[1] + i * p.o_s[2]))[sub];
            const P d = ((const P*)((const T*)p.dout + b * p.do_s[0] + h * p.do_s[1] + i * p.do_s[2]))[sub];
#pragma unroll
            for (int k = 0; k < 8; k++) s += Num<T>::to(a.v[k]) * Num<T>::to(d.v[k]);
            FaF4* acc = (FaF4*)((float*)p.dq_acc + r * D) + 2 * sub;
            const FaF4 zero = {{0.f, 0.f, 0.f, 0.f}};
            acc[0] = zero;
            acc[1] = zero;
        }
        // The row's lanes are an aligned group of per_row: xor offsets below per_row stay in it.
        for (int o = per_row / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (r < rows && sub == 0) ((float*)p.dvec)[(b * H + h) * Tq + i] = s;
    }
}

// BM query rows per step: 64 for D = 64; 32 for D = 128, to stay within 48 KiB of static shared
// memory.
template <typename T, int D, int BM>
__device__ __forceinline__ void flash_bwd(const FlashParams& p) {
    const int BN = 64, LD = D + 8, LDS = BM + 8;
    // dQ = dS·K is shared out as RG row groups of 16 queries × DG column groups of 64 dims.
    const int RG = BM / 16, DG = D / 64;
    static_assert(RG * DG == FA_THREADS / 32, "one dQ share per warp");
    __shared__ __align__(16) T ks[BN * LD];
    __shared__ __align__(16) T qs[BM * LD];
    __shared__ __align__(16) T dos[BM * LD];
    __shared__ __align__(16) T dsts[BN * LDS];  // dSᵀ: [key][query]
    __shared__ float lse2_s[BM];                // LSE·log2 e
    __shared__ float dvec_s[BM];

    const i64 seq_q = p.seq_q, seq_k = p.seq_k, H = p.heads;
    const i64 nkb = (seq_k + BN - 1) / BN, nqb = (seq_q + BM - 1) / BM;
    // Key blocks of one (batch, head) first to last: under a causal mask the first do the most
    // work, and they start first.
    const i64 kb = (i64)blockIdx.x % nkb;
    const i64 bh = (i64)blockIdx.x / nkb, b = bh / H, h = bh % H;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const i64 n0 = kb * BN;
    const i64 key0 = n0 + warp * 16 + g, key1 = key0 + 8;  // this thread's two keys

    const T* q = (const T*)p.q + b * p.q_s[0] + h * p.q_s[1];
    const T* k = (const T*)p.k + b * p.k_s[0] + h * p.k_s[1];
    const T* v = (const T*)p.v + b * p.v_s[0] + h * p.v_s[1];
    const T* dout = (const T*)p.dout + b * p.do_s[0] + h * p.do_s[1];
    const float* lse = (const float*)p.lse + (b * H + h) * seq_q;
    const float* dvec = (const float*)p.dvec + (b * H + h) * seq_q;
    const i64 qst = p.q_s[2], dost = p.do_s[2];
    const float sl2 = p.scale_log2;

    // Query blocks that see some key of this block.
    const i64 first = p.causal ? n0 / BM : 0;

    load_rows<T, BN, D>(ks, k, p.k_s[2], n0, seq_k);
    auto stage = [&](i64 qblk) {
        const i64 m = qblk * BM;
        load_rows<T, BM, D>(qs, q, qst, m, seq_q);
        load_rows<T, BM, D>(dos, dout, dost, m, seq_q);
        for (int i = threadIdx.x; i < BM; i += FA_THREADS) {
            const bool ok = m + i < seq_q;
            lse2_s[i] = ok ? lse[m + i] * 1.4426950408889634f : 0.f;
            dvec_s[i] = ok ? dvec[m + i] : 0.f;
        }
    };
    if (first < nqb) stage(first);
    cp_async_commit();

    // The warp's 16 rows of V as A fragments, from global memory (keys past seq_k: 0).
    unsigned va[D / 16][4];
    {
        const T* v0 = v + key0 * p.v_s[2];
        const T* v1 = v + key1 * p.v_s[2];
        const bool ok0 = key0 < seq_k, ok1 = key1 < seq_k;
#pragma unroll
        for (int kc = 0; kc < D / 16; kc++) {
            const int c = kc * 16 + 2 * t;
            va[kc][0] = ok0 ? ld_pair(v0 + c) : 0u;
            va[kc][1] = ok1 ? ld_pair(v1 + c) : 0u;
            va[kc][2] = ok0 ? ld_pair(v0 + c + 8) : 0u;
            va[kc][3] = ok1 ? ld_pair(v1 + c + 8) : 0u;
        }
    }

    float dv[D / 8][4], dk[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++) {
        dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;
        dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.f;
    }

    for (i64 qblk = first; qblk < nqb; qblk++) {
        const i64 m0 = qblk * BM;
        // K (first pass), this block's Q and dO have landed; so have lse2_s and dvec_s.
        cp_async_wait<0>();
        __syncthreads();

        // Sᵀ = K_w·Qᵀ (16 keys × BM queries).
        float st[BM / 8][4];
#pragma unroll
        for (int i = 0; i < BM / 8; i++) st[i][0] = st[i][1] = st[i][2] = st[i][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < D / 16; kc++) {
            // A fragment of K: matrix i at key rows warp·16 + 8(i%2), dim cols kc·16 + 8(i/2).
            unsigned ka[4];
            ldsm_x4(ks + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + kc * 16 + (lane >> 4) * 8, ka);
#pragma unroll
            for (int np = 0; np < BM / 16; np++) {
                // B fragments of Qᵀ: matrix i at query rows np·16 + 8(i/2), dim cols kc·16 + 8(i%2).
                unsigned bf[4];
                ldsm_x4(qs + (np * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kc * 16 + ((lane >> 3) & 1) * 8, bf);
                Tc<T>::mma(st[2 * np], ka, bf[0], bf[1]);
                Tc<T>::mma(st[2 * np + 1], ka, bf[2], bf[3]);
            }
        }
        // Pᵀ = 2^(scale·log2e·s − LSE·log2e), 0 where masked.
#pragma unroll
        for (int i = 0; i < BM / 8; i++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int ql = i * 8 + 2 * t + (e & 1);
                const i64 query = m0 + ql, key = e < 2 ? key0 : key1;
                const bool masked = query >= seq_q || key >= seq_k || (p.causal && key > query);
                st[i][e] = masked ? 0.f : fa_exp2(st[i][e] * sl2 - lse2_s[ql]);
            }
        }

        // dPᵀ = V_w·dOᵀ (16 keys × BM queries).
        float dp[BM / 8][4];
#pragma unroll
        for (int i = 0; i < BM / 8; i++) dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < D / 16; kc++) {
#pragma unroll
            for (int np = 0; np < BM / 16; np++) {
                // B fragments of dOᵀ: as Qᵀ's above.
                unsigned bf[4];
                ldsm_x4(dos + (np * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kc * 16 + ((lane >> 3) & 1) * 8, bf);
                Tc<T>::mma(dp[2 * np], va[kc], bf[0], bf[1]);
                Tc<T>::mma(dp[2 * np + 1], va[kc], bf[2], bf[3]);
            }
        }

        // dV += Pᵀ·dO.
#pragma unroll
        for (int kk = 0; kk < BM / 16; kk++) {
            const unsigned pa[4] = {Tc<T>::pack(st[2 * kk][0], st[2 * kk][1]),
                                    Tc<T>::pack(st[2 * kk][2], st[2 * kk][3]),
                                    Tc<T>::pack(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                                    Tc<T>::pack(st[2 * kk + 1][2], st[2 * kk + 1][3])};
#pragma unroll
            for (int dd = 0; dd < D / 16; dd++) {
                // B fragments of dO: matrix i at query rows kk·16 + 8(i%2), dim cols dd·16 + 8(i/2).
                unsigned bf[4];
                ldsm_x4_t(dos + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dd * 16 + (lane >> 4) * 8, bf);
                Tc<T>::mma(dv[2 * dd], pa, bf[0], bf[1]);
                Tc<T>::mma(dv[2 * dd + 1], pa, bf[2], bf[3]);
            }
        }

        // dSᵀ = Pᵀ∘(dPᵀ − D), kept in dp.
#pragma unroll
        for (int i = 0; i < BM / 8; i++) {
#pragma unroll
            for (int e = 0; e < 4; e++) dp[i][e] = st[i][e] * (dp[i][e] - dvec_s[i * 8 + 2 * t + (e & 1)]);
        }

        // dK += dSᵀ·Q (scaled at the end); dSᵀ to shared memory for dQ.
#pragma unroll
        for (int kk = 0; kk < BM / 16; kk++) {
            const unsigned da[4] = {Tc<T>::pack(dp[2 * kk][0], dp[2 * kk][1]),
                                    Tc<T>::pack(dp[2 * kk][2], dp[2 * kk][3]),
                                    Tc<T>::pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                    Tc<T>::pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
            // Rows warp·16 + g (+8) = keys, columns kk·16 + 2t (+8) = queries.
            T* drow = dsts + (warp * 16 + g) * LDS + kk * 16 + 2 * t;
            st_pair(drow, da[0]);
            st_pair(drow + 8 * LDS, da[1]);
            st_pair(drow + 8, da[2]);
            st_pair(drow + 8 * LDS + 8, da[3]);
#pragma unroll
            for (int dd = 0; dd < D / 16; dd++) {
                // B fragments of Q: as dO's above.
                unsigned bf[4];
                ldsm_x4_t(qs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dd * 16 + (lane >> 4) * 8, bf);
                Tc<T>::mma(dk[2 * dd], da, bf[0], bf[1]);
                Tc<T>::mma(dk[2 * dd + 1], da, bf[2], bf[3]);
            }
        }
        // All of dSᵀ is written and Q, dO, lse2_s, dvec_s are read: stage the next query block
        // under the dQ product.
        __syncthreads();
        if (qblk + 1 < nqb) stage(qblk + 1);
        cp_async_commit();

        // dQ += dS·K for queries rg·16.., dims dg·64.. (scaled at conversion).
        const int rg = warp % RG, dg = warp / RG;
        float dq[8][4];
#pragma unroll
        for (int i = 0; i < 8; i++) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            // A fragment of dS from dSᵀ: matrix i at key rows kk·16 + 8(i/2), query cols
            // rg·16 + 8(i%2) (.trans).
            unsigned sa[4];
            ldsm_x4_t(dsts + (kk * 16 + (lane & 7) + (lane >> 4) * 8) * LDS + rg * 16 + ((lane >> 3) & 1) * 8, sa);
#pragma unroll
            for (int dd = 0; dd < 4; dd++) {
                // B fragments of K: matrix i at key rows kk·16 + 8(i%2), dim cols dg·64 + dd·16
                // + 8(i/2) (.trans).
                unsigned bf[4];
                ldsm_x4_t(ks + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dg * 64 + dd * 16 + (lane >> 4) * 8, bf);
                Tc<T>::mma(dq[2 * dd], sa, bf[0], bf[1]);
                Tc<T>::mma(dq[2 * dd + 1], sa, bf[2], bf[3]);
            }
        }
        float* acc = (float*)p.dq_acc;
#if __CUDA_ARCH__ >= 900
        // Lanes t and t^1 swap halves so that each holds 4 adjacent dims of one row: the even
        // lane row g, dims 2t..2t+3; the odd lane row g+8, dims 2t-2..2t+1. One vector
        // reduction each instead of four scalar atomics.
        {
            const bool odd = t & 1;
            const i64 query = m0 + rg * 16 + g + (odd ? 8 : 0);
            float* arow = acc + ((b * seq_q + query) * H + h) * D + dg * 64 + 2 * (t & ~1);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const float r0 = __shfl_xor_sync(0xffffffffu, odd ? dq[i][0] : dq[i][2], 1);
                const float r1 = __shfl_xor_sync(0xffffffffu, odd ? dq[i][1] : dq[i][3], 1);
                if (query < seq_q) {
                    if (odd) red_add_v4(arow + i * 8, r0, r1, dq[i][2], dq[i][3]);
                    else red_add_v4(arow + i * 8, dq[i][0], dq[i][1], r0, r1);
                }
            }
        }
#else
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const i64 query = m0 + rg * 16 + g + 8 * r;
            if (query < seq_q) {
                float* arow = acc + ((b * seq_q + query) * H + h) * D + dg * 64 + 2 * t;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    atomicAdd(arow + i * 8, dq[i][2 * r]);
                    atomicAdd(arow + i * 8 + 1, dq[i][2 * r + 1]);
                }
            }
        }
#endif
    }

    // dK·scale and dV as [B, Tk, H, D].
    const float scale = p.scale;
    T* dko = (T*)p.dk;
    T* dvo = (T*)p.dv;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const i64 key = r ? key1 : key0;
        if (key < seq_k) {
            const i64 base = ((b * seq_k + key) * H + h) * D;
#pragma unroll
            for (int i = 0; i < D / 8; i++) {
                const int c = i * 8 + 2 * t;
                st_pair(dko + base + c, Tc<T>::pack(dk[i][2 * r] * scale, dk[i][2 * r + 1] * scale));
                st_pair(dvo + base + c, Tc<T>::pack(dv[i][2 * r], dv[i][2 * r + 1]));
            }
        }
    }
}

// dQ = scale·(the f32 accumulator), in the input dtype; 8 values per step (D is a multiple of 8).
template <typename T>
__device__ __forceinline__ void flash_dq_convert(const FlashParams& p) {
    typedef typename Pack<T>::type P;
    const u64 n8 = (u64)(p.batch * p.seq_q * p.heads * p.head_dim) / 8;
    const FaF4* acc = (const FaF4*)p.dq_acc;
    P* dq = (P*)p.dq;
    for (u64 i = global_tid(); i < n8; i += global_stride()) {
        const FaF4 a = acc[2 * i], b = acc[2 * i + 1];
        P r;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            r.v[k] = Num<T>::from(a.v[k] * p.scale);
            r.v[4 + k] = Num<T>::from(b.v[k] * p.scale);
        }
        dq[i] = r;
    }
}

#define FLASH(N, T)                                                                                \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_fwd_##N##_d64(FlashParams p) { \
        flash_fwd<T, 64>(p);                                                                       \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_fwd_##N##_d128(FlashParams p) {\
        flash_fwd<T, 128>(p);                                                                      \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_bwd_##N##_d64(FlashParams p) { \
        flash_bwd<T, 64, 64>(p);                                                                   \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_bwd_##N##_d128(FlashParams p) {\
        flash_bwd<T, 128, 32>(p);                                                                  \
    }                                                                                              \
    extern "C" __global__ void flash_bwd_pre_##N(FlashParams p) { flash_bwd_pre<T>(p); }           \
    extern "C" __global__ void flash_dq_convert_##N(FlashParams p) { flash_dq_convert<T>(p); }
FLASH(f16, f16)
FLASH(bf16, bf16)

#endif  // __CUDA_ARCH__ >= 800
