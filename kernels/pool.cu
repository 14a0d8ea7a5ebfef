// pool.cu: max / average / adaptive-average 2-D pooling over NCHW or NHWC, forward and
// backward. Backward passes are gathers (each input cell sums the windows that contain it):
// deterministic, no atomics, every element written. Threads walk the buffers in memory order
// (channels innermost in NHWC), so loads and stores coalesce in both formats. Max pooling's
// argmax is the flat h·w index in the plane (an i64 per output), except on the channel-pack path
// (max_fwd_vec), which keeps a byte per output.

struct PoolP {
    i64 n, c, h, w, kh, kw, sh, sw, ph, pw, oh, ow, count_include_pad, nhwc;
};

// A cell of a [n, c, rows, cols] tensor, from its position k in memory order: the plane (n·c +
// c in NCHW; n in NHWC, with the channel apart) and the row and column. The index arithmetic is
// in I: 32-bit when every position fits (`fits32`), since 64-bit division costs several times
// as many instructions and each cell takes a few.
struct Cell {
    i64 plane, ch, r, col;
};
template <typename I>
__device__ __forceinline__ Cell cell_of(const PoolP& p, u64 k64, i64 rows, i64 cols) {
    Cell q;
    I k = (I)k64, C = (I)p.c, R = (I)rows, W = (I)cols;
    if (p.nhwc) {
        I rest = k / C;
        q.ch = (i64)(k - rest * C);
        I rc = rest / W;
        q.col = (i64)(rest - rc * W);
        I pl = rc / R;
        q.r = (i64)(rc - pl * R);
        q.plane = (i64)pl;
    } else {
        q.ch = 0;
        I rc = k / W;
        q.col = (i64)(k - rc * W);
        I pl = rc / R;
        q.r = (i64)(rc - pl * R);
        q.plane = (i64)pl;
    }
    return q;
}
// The memory position of (plane, ch, r, col) in a tensor of rows × cols planes.
template <typename I>
__device__ __forceinline__ u64 at_of(const PoolP& p, i64 plane, i64 ch, i64 r, i64 col, i64 rows,
                                     i64 cols) {
    return p.nhwc ? (u64)((((I)plane * (I)rows + (I)r) * (I)cols + (I)col) * (I)p.c + (I)ch)
                  : (u64)(((I)plane * (I)rows + (I)r) * (I)cols + (I)col);
}
// Whether every position of input and output fits 32-bit index arithmetic.
__device__ __forceinline__ bool fits32(const PoolP& p) {
    u64 big = (u64)(p.h * p.w > p.oh * p.ow ? p.h * p.w : p.oh * p.ow);
    // ... and the adaptive windows' bounds, i·in with i up to out.
    u64 bounds = (u64)((p.h + 1) * p.oh > (p.w + 1) * p.ow ? (p.h + 1) * p.oh : (p.w + 1) * p.ow);
    return (u64)(p.n * p.c) * big < (1ull << 31) && bounds < (1ull << 31);
}

template <typename T, typename I> __device__ void max_fwd(PoolP p, const T* x, T* y, i64* arg) {
    typedef typename Num<T>::acc A;
    u64 total = (u64)(p.n * p.c * p.oh * p.ow);
    for (u64 k = global_tid(); k < total; k += global_stride()) {
        Cell o = cell_of<I>(p, k, p.oh, p.ow);
        i64 oh = o.r, ow = o.col;
        A best = -inf_of<A>();
        i64 bi = -1;
        for (i64 i = 0; i < p.kh; i++) {
            i64 ih = oh * p.sh - p.ph + i;
            if (ih < 0 || ih >= p.h) continue;
            for (i64 j = 0; j < p.kw; j++) {
                i64 iw = ow * p.sw - p.pw + j;
                if (iw < 0 || iw >= p.w) continue;
                A v = Num<T>::to(x[at_of<I>(p, o.plane, o.ch, ih, iw, p.h, p.w)]);
                if (bi < 0 || v > best || (is_nan(v) && !is_nan(best))) { best = v; bi = ih * p.w + iw; }
            }
        }
        y[k] = Num<T>::from(best);
        arg[k] = bi < 0 ? 0 : bi;
    }
}

// The output cells whose windows cover input cell (ih, iw): rows oh0..=oh1, columns ow0..=ow1.
// Output rows whose window covers ih: oh·sh − ph ≤ ih < oh·sh − ph + kh.
__device__ __forceinline__ void covering(PoolP p, i64 ih, i64 iw, i64& oh0, i64& oh1, i64& ow0,
                                         i64& ow1) {
    oh0 = ih + p.ph - p.kh + 1;
    oh0 = oh0 <= 0 ? 0 : (oh0 + p.sh - 1) / p.sh;
    oh1 = (ih + p.ph) / p.sh;
    if (oh1 >= p.oh) oh1 = p.oh - 1;
    ow0 = iw + p.pw - p.kw + 1;
    ow0 = ow0 <= 0 ? 0 : (ow0 + p.sw - 1) / p.sw;
    ow1 = (iw + p.pw) / p.sw;
    if (ow1 >= p.ow) ow1 = p.ow - 1;
}

template <typename T, typename I> __device__ void max_bwd(PoolP p, const T* g, const i64* arg, T* dx) {
    typedef typename Num<T>::acc A;
    u64 total = (u64)(p.n * p.c * p.h * p.w);
    for (u64 k = global_tid(); k < total; k += global_stride()) {
        Cell q = cell_of<I>(p, k, p.h, p.w);
        i64 ih = q.r, iw = q.col;
        i64 oh0, oh1, ow0, ow1;
        covering(p, ih, iw, oh0, oh1, ow0, ow1);
        A s = 0;
        i64 me = ih * p.w + iw;
        for (i64 oh = oh0; oh <= oh1; oh++)
            for (i64 ow = ow0; ow <= ow1; ow++) {
                u64 o = at_of<I>(p, q.plane, q.ch, oh, ow, p.oh, p.ow);
                if (arg[o] == me) s += Num<T>::to(g[o]);
            }
        dx[k] = Num<T>::from(s);
    }
}

// PyTorch's divisor: the window clipped to the padded input (count_include_pad) or to the input.
__device__ __forceinline__ i64 avg_div(PoolP p, i64 oh, i64 ow) {
    i64 hs = oh * p.sh - p.ph, ws = ow * p.sw - p.pw;
    i64 he = hs + p.kh, we = ws + p.kw;
    if (he > p.h + p.ph) he = p.h + p.ph;
    if (we > p.w + p.pw) we = p.w + p.pw;
    i64 pool = (he - hs) * (we - ws);
    if (p.count_include_pad) return pool;
    if (hs < 0) hs = 0;
    if (ws < 0) ws = 0;
    if (he > p.h) he = p.h;
    if (we > p.w) we = p.w;
    return (he - hs) * (we - ws);
}

template <typename T, typename I> __device__ void avg_fwd(PoolP p, const T* x, T* y) {
    typedef typename Num<T>::acc A;
    u64 total = (u64)(p.n * p.c * p.oh * p.ow);
    for (u64 k = global_tid(); k < total; k += global_stride()) {
        Cell o = cell_of<I>(p, k, p.oh, p.ow);
        i64 oh = o.r, ow = o.col;
        A s = 0;
        for (i64 i = 0; i < p.kh; i++) {
            i64 ih = oh * p.sh - p.ph + i;
            if (ih < 0 || ih >= p.h) continue;
            for (i64 j = 0; j < p.kw; j++) {
                i64 iw = ow * p.sw - p.pw + j;
                if (iw < 0 || iw >= p.w) continue;
                s += Num<T>::to(x[at_of<I>(p, o.plane, o.ch, ih, iw, p.h, p.w)]);
            }
        }
        i64 d = avg_div(p, oh, ow);
        y[k] = Num<T>::from(d > 0 ? s / (A)d : (A)0);
    }
}

template <typename T, typename I> __device__ void avg_bwd(PoolP p, const T* g, T* dx) {
    typedef typename Num<T>::acc A;
    u64 total = (u64)(p.n * p.c * p.h * p.w);
    for (u64 k = global_tid(); k < total; k += global_stride()) {
        Cell q = cell_of<I>(p, k, p.h, p.w);
        i64 ih = q.r, iw = q.col;
        i64 oh0, oh1, ow0, ow1;
        covering(p, ih, iw, oh0, oh1, ow0, ow1);
        A s = 0;
        for (i64 oh = oh0; oh <= oh1; oh++)
            for (i64 ow = ow0; ow <= ow1; ow++) {
                i64 d = avg_div(p, oh, ow);
                if (d > 0) s += Num<T>::to(g[at_of<I>(p, q.plane, q.ch, oh, ow, p.oh, p.ow)]) / (A)d;
            }
        dx[k] = Num<T>::from(s);
    }
}

// Adaptive: output cell i covers rows floor(i·h/oh) .. ceil((i+1)·h/oh). In I, as the cell
// arithmetic: a 64-bit division costs several 32-bit ones, and a global pool's backward does
// four per cell (on ResNet-18's, a million cells, 64-bit indices measured noticeably slower).
template <typename I> __device__ __forceinline__ I ad_start(I i, I in, I out) { return (i * in) / out; }
template <typename I> __device__ __forceinline__ I ad_end(I i, I in, I out) { return ((i + 1) * in + out - 1) / out; }

template <typename T, typename I> __device__ void adaptive_fwd(PoolP p, const T* x, T* y) {
    typedef typename Num<T>::acc A;
    u64 total = (u64)(p.n * p.c * p.oh * p.ow);
    const I H = (I)p.h, W = (I)p.w, OH = (I)p.oh, OW = (I)p.ow;
    // Steps between a window's rows and columns.
    const I row_step = p.nhwc ? W * (I)p.c : W, col_step = p.nhwc ? (I)p.c : (I)1;
    for (u64 k = global_tid(); k < total; k += global_stride()) {
        Cell o = cell_of<I>(p, k, p.oh, p.ow);
        I h0 = ad_start<I>((I)o.r, H, OH), h1 = ad_end<I>((I)o.r, H, OH);
        I w0 = ad_start<I>((I)o.col, W, OW), w1 = ad_end<I>((I)o.col, W, OW);
        const T* row = x + at_of<I>(p, o.plane, o.ch, (i64)h0, (i64)w0, p.h, p.w);
        A s = 0;
        for (I ih = h0; ih < h1; ih++, row += row_step) {
#pragma unroll 4
            for (I iw = 0; iw < w1 - w0; iw++) s += Num<T>::to(row[iw * col_step]);
        }
        I d = (h1 - h0) * (w1 - w0);
        y[k] = Num<T>::from(d > 0 ? s / (A)d : (A)0);
    }
}

template <typename T, typename I> __device__ void adaptive_bwd(PoolP p, const T* g, T* dx) {
    typedef typename Num<T>::acc A;
    u64 total = (u64)(p.n * p.c * p.h * p.w);
    const I H = (I)p.h, W = (I)p.w, OH = (I)p.oh, OW = (I)p.ow;
    for (u64 k = global_tid(); k < total; k += global_stride()) {
        Cell q = cell_of<I>(p, k, p.h, p.w);
        I ih = (I)q.r, iw = (I)q.col;
        A s = 0;
        for (I oh = 0; oh < OH; oh++) {
            I h0 = ad_start<I>(oh, H, OH), h1 = ad_end<I>(oh, H, OH);
            if (ih < h0 || ih >= h1) continue;
            for (I ow = 0; ow < OW; ow++) {
                I w0 = ad_start<I>(ow, W, OW), w1 = ad_end<I>(ow, W, OW);
                if (iw < w0 || iw >= w1) continue;
                s += Num<T>::to(g[at_of<I>(p, q.plane, q.ch, (i64)oh, (i64)ow, p.oh, p.ow)]) / (A)((h1 - h0) * (w1 - w0));
            }
        }
        dx[k] = Num<T>::from(s);
    }
}

// NHWC with the channels a whole number of 16-byte packs (the host checks that, the buffers'
// alignment, that every position fits 32 bits and that a window has at most 255 cells): one
// thread per pack of channels at one output (forward) or input (backward) position, so the
// window's bounds and index arithmetic are worked out once per pack instead of once per channel,
// and the values move 16 bytes at a time. The argmax is kept as a byte per output, the winner's
// offset i·kw + j in its window (row i, column j from the window's padded corner), N bytes per
// pack: ResNet-50's stem pool read and wrote 8-byte flat indices, 8 times the bytes of the
// values themselves. Per channel, the comparisons and sums are those of max_fwd / max_bwd in
// the same order: the results are bit for bit theirs.
template <int N> struct OffsetPack;
template <> struct OffsetPack<8> { typedef unsigned long long type; };
template <> struct OffsetPack<4> { typedef unsigned type; };
template <> struct OffsetPack<2> { typedef unsigned short type; };

template <typename T> __device__ __forceinline__ void store_values(T* dst, const typename Pack<T>::type& v) {
    if constexpr (sizeof(T) == 2)
        store_pack8(dst, v.v);
    else
        *(typename Pack<T>::type*)dst = v;
}

template <typename T> __device__ void max_fwd_vec(PoolP p, const T* x, T* y, unsigned char* off) {
    typedef typename Num<T>::acc A;
    typedef typename Pack<T>::type P;
    const int N = Pack<T>::N;
    typedef typename OffsetPack<N>::type O;
    const unsigned CV = (unsigned)p.c / N, OH = (unsigned)p.oh, OW = (unsigned)p.ow;
    const int H = (int)p.h, W = (int)p.w, KH = (int)p.kh, KW = (int)p.kw;
    const unsigned total = (unsigned)(p.n * p.oh * p.ow) * CV;
    for (unsigned k = (unsigned)global_tid(); k < total; k += (unsigned)global_stride()) {
        unsigned cv = k % CV, rest = k / CV;
        unsigned ow = rest % OW;
        rest /= OW;
        unsigned oh = rest % OH, n = rest / OH;
        int h0 = (int)oh * (int)p.sh - (int)p.ph, w0 = (int)ow * (int)p.sw - (int)p.pw;
        A best[N];
        int bi[N];
#pragma unroll
        for (int l = 0; l < N; l++) { best[l] = -inf_of<A>(); bi[l] = -1; }
        for (int i = 0; i < KH; i++) {
            int ih = h0 + i;
            if (ih < 0 || ih >= H) continue;
            for (int j = 0; j < KW; j++) {
                int iw = w0 + j;
                if (iw < 0 || iw >= W) continue;
                P v = *(const P*)(x + (((unsigned)n * H + ih) * W + iw) * (unsigned)p.c + cv * N);
                int me = i * KW + j;
#pragma unroll
                for (int l = 0; l < N; l++) {
                    A a = Num<T>::to(v.v[l]);
                    if (bi[l] < 0 || a > best[l] || (is_nan(a) && !is_nan(best[l]))) { best[l] = a; bi[l] = me; }
                }
            }
        }
        P out;
        O o = 0;
#pragma unroll
        for (int l = 0; l < N; l++) {
            out.v[l] = Num<T>::from(best[l]);
            // A window with no cell inside the input (the host rules it out) would keep 255,
            // which no cell's offset equals.
            o |= (O)(bi[l] < 0 ? 255 : bi[l]) << (8 * l);
        }
        store_values<T>(y + (u64)k * N, out);
        *(O*)(off + (u64)k * N) = o;
    }
}

template <typename T> __device__ void max_bwd_vec(PoolP p, const T* g, const unsigned char* off, T* dx) {
    typedef typename Num<T>::acc A;
    typedef typename Pack<T>::type P;
    const int N = Pack<T>::N;
    typedef typename OffsetPack<N>::type O;
    const unsigned CV = (unsigned)p.c / N, H = (unsigned)p.h, W = (unsigned)p.w;
    const int OH = (int)p.oh, OW = (int)p.ow, SH = (int)p.sh, SW = (int)p.sw, KW = (int)p.kw;
    const unsigned total = (unsigned)(p.n * p.h * p.w) * CV;
    for (unsigned k = (unsigned)global_tid(); k < total; k += (unsigned)global_stride()) {
        unsigned cv = k % CV, rest = k / CV;
        int iw = (int)(rest % W);
        rest /= W;
        int ih = (int)(rest % H);
        unsigned n = rest / H;
        // covering(), in 32 bits.
        int oh0 = ih + (int)p.ph - (int)p.kh + 1, ow0 = iw + (int)p.pw - (int)p.kw + 1;
        oh0 = oh0 <= 0 ? 0 : (oh0 + SH - 1) / SH;
        ow0 = ow0 <= 0 ? 0 : (ow0 + SW - 1) / SW;
        int oh1 = (ih + (int)p.ph) / SH, ow1 = (iw + (int)p.pw) / SW;
        if (oh1 >= OH) oh1 = OH - 1;
        if (ow1 >= OW) ow1 = OW - 1;
        A s[N];
#pragma unroll
        for (int l = 0; l < N; l++) s[l] = 0;
        for (int oh = oh0; oh <= oh1; oh++)
            for (int ow = ow0; ow <= ow1; ow++) {
                // This cell's offset in window (oh, ow).
                const unsigned me = (unsigned)((ih - (oh * SH - (int)p.ph)) * KW + (iw - (ow * SW - (int)p.pw)));
                unsigned o = (((unsigned)n * OH + oh) * OW + ow) * (unsigned)p.c + cv * N;
                O a = *(const O*)(off + o);
                P gv = *(const P*)(g + o);
#pragma unroll
                for (int l = 0; l < N; l++)
                    if (((unsigned)(a >> (8 * l)) & 255u) == me) s[l] += Num<T>::to(gv.v[l]);
            }
        P out;
#pragma unroll
        for (int l = 0; l < N; l++) out.v[l] = Num<T>::from(s[l]);
        store_values<T>(dx + (u64)k * N, out);
    }
}

// Each kernel picks 32- or 64-bit index arithmetic once per launch (a uniform branch).
#define BY_INDEX(F, T, ...) \
    if (fits32(p)) F<T, unsigned>(__VA_ARGS__); else F<T, u64>(__VA_ARGS__);
#define POOL(N, T)                                                                                 \
    extern "C" __global__ void max_pool_##N(PoolP p, const T* x, T* y, i64* arg) {                 \
        BY_INDEX(max_fwd, T, p, x, y, arg)                                                            \
    }                                                                                              \
    extern "C" __global__ void max_pool_backward_##N(PoolP p, const T* g, const i64* arg, T* dx) { \
        BY_INDEX(max_bwd, T, p, g, arg, dx)                                                           \
    }                                                                                              \
    extern "C" __global__ void max_pool_vec_##N(PoolP p, const T* x, T* y, unsigned char* off) {   \
        max_fwd_vec<T>(p, x, y, off);                                                              \
    }                                                                                              \
    extern "C" __global__ void max_pool_backward_vec_##N(PoolP p, const T* g, const unsigned char* off, T* dx) { \
        max_bwd_vec<T>(p, g, off, dx);                                                             \
    }                                                                                              \
    extern "C" __global__ void avg_pool_##N(PoolP p, const T* x, T* y) { BY_INDEX(avg_fwd, T, p, x, y) } \
    extern "C" __global__ void avg_pool_backward_##N(PoolP p, const T* g, T* dx) {                 \
        BY_INDEX(avg_bwd, T, p, g, dx)                                                                \
    }                                                                                              \
    extern "C" __global__ void adaptive_pool_##N(PoolP p, const T* x, T* y) {                      \
        BY_INDEX(adaptive_fwd, T, p, x, y)                                                            \
    }                                                                                              \
    extern "C" __global__ void adaptive_pool_backward_##N(PoolP p, const T* g, T* dx) {            \
        BY_INDEX(adaptive_bwd, T, p, g, dx)                                                           \
    }
POOL(f16, f16)
POOL(bf16, bf16)
POOL(f32, float)
POOL(f64, double)
