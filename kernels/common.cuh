// common.cuh: prepended by the kernel registry to every kernels/*.cu source.
// No toolkit headers: NVRTC has no built-in cuda_fp16.h / cuda_bf16.h, so the half types are
// our own 16-bit storage structs with conversions in inline PTX.
typedef unsigned long long u64;
typedef long long i64;

struct __align__(2) f16 { unsigned short x; };
struct __align__(2) bf16 { unsigned short x; };

// Arithmetic type of each storage type: f32 for the half types and f32, f64 for f64.
template <typename T> struct Num;
template <> struct Num<float> {
    typedef float acc;
    static __device__ __forceinline__ float to(float v) { return v; }
    static __device__ __forceinline__ float from(float v) { return v; }
    static __device__ __forceinline__ float from_d(double v) { return (float)v; }
};
template <> struct Num<double> {
    typedef double acc;
    static __device__ __forceinline__ double to(double v) { return v; }
    static __device__ __forceinline__ double from(double v) { return v; }
    static __device__ __forceinline__ double from_d(double v) { return v; }
};
template <> struct Num<f16> {
    typedef float acc;
    static __device__ __forceinline__ float to(f16 h) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.x));
        return f;
    }
    static __device__ __forceinline__ f16 from(float v) {
        f16 h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(v));
        return h;
    }
    static __device__ __forceinline__ f16 from_d(double v) {
        f16 h;
        asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h.x) : "d"(v));
        return h;
    }
};
template <> struct Num<bf16> {
    typedef float acc;
    static __device__ __forceinline__ float to(bf16 h) { return __uint_as_float(((unsigned)h.x) << 16); }
    static __device__ __forceinline__ bf16 from(float v) {
        bf16 h;
#if __CUDA_ARCH__ >= 800
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.x) : "f"(v));
#else
        unsigned u = __float_as_uint(v);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            h.x = (unsigned short)((u >> 16) | 0x40u);
        } else {
            u += 0x7fffu + ((u >> 16) & 1u);
            h.x = (unsigned short)(u >> 16);
        }
#endif
        return h;
    }
    static __device__ __forceinline__ bf16 from_d(double v) { return from((float)v); }
};
template <> struct Num<i64> {
    typedef double acc;
    static __device__ __forceinline__ double to(i64 v) { return (double)v; }
    static __device__ __forceinline__ i64 from(double v) { return (i64)v; }
    static __device__ __forceinline__ i64 from_d(double v) {
        // As Rust's `as`: NaN → 0, saturating.
        if (v != v) return 0;
        if (v >= 9.2233720368547758e18) return 0x7fffffffffffffffLL;
        if (v <= -9.2233720368547758e18) return (i64)0x8000000000000000ULL;
        return (i64)v;
    }
};

// 16-byte packs for vectorised access of contiguous data.
template <typename T> struct Pack {
    // An enumerator, not a static data member: a member's symbol was emitted once per type
    // in an order that changed between compiles, and the kernel cache expects the same image.
    enum { N = 16 / sizeof(T) };
    struct __align__(16) type { T v[16 / sizeof(T)]; };
};

// Stores 8 values of a 2-byte type (f16, bf16) as one 16-byte access; `dst` must be 16-byte
// aligned, in global memory. A pack built one value at a time and stored as a struct was split
// by NVVM into 16-bit or 32-bit pieces (up to 7 stores for 16 bytes, even through a union), so
// the pairs go into 32-bit words and one st.global.v4.
template <typename T> __device__ __forceinline__ void store_pack8(T* dst, const T (&v)[8]) {
    static_assert(sizeof(T) == 2, "store_pack8 packs 2-byte values");
    unsigned w[4];
#pragma unroll
    for (int k = 0; k < 4; k++) asm("mov.b32 %0, {%1, %2};" : "=r"(w[k]) : "h"(v[2 * k].x), "h"(v[2 * k + 1].x));
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
                 : "memory");
}

__device__ __forceinline__ u64 global_tid() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ u64 global_stride() { return (u64)gridDim.x * blockDim.x; }

template <typename A> __device__ __forceinline__ bool is_nan(A v) { return v != v; }
template <typename A> __device__ __forceinline__ A nan_of();
template <> __device__ __forceinline__ float nan_of<float>() { return __int_as_float(0x7fffffff); }
template <> __device__ __forceinline__ double nan_of<double>() { return __longlong_as_double(0x7fffffffffffffffLL); }
template <typename A> __device__ __forceinline__ A inf_of();
template <> __device__ __forceinline__ float inf_of<float>() { return __int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double inf_of<double>() { return __longlong_as_double(0x7ff0000000000000LL); }

// Up to 8 dimensions of index space with two per-dimension stride vectors (in elements), passed by
// value: the two operands of a binary op, or the source and destination of a strided copy.
#define MAX_DIMS 8
struct Strided {
    i64 rank;
    i64 dims[MAX_DIMS];
    i64 sa[MAX_DIMS];
    i64 sb[MAX_DIMS];
};

// Whether every index of `n` and every offset of both views fit 32 bits (the same answer for
// every thread of a launch). Then the coordinates split with 32-bit divisions, several times
// cheaper on the GPU than 64-bit ones, which dominated a strided kernel's time.
__device__ __forceinline__ bool strided_fits32(u64 n, const Strided& s) {
    if (n > 0xffffffffull) return false;
    u64 ea = 0, eb = 0;
    for (int d = 0; d < (int)s.rank; d++) {
        ea += (u64)(s.dims[d] - 1) * (u64)s.sa[d];
        eb += (u64)(s.dims[d] - 1) * (u64)s.sb[d];
    }
    return ea <= 0xffffffffull && eb <= 0xffffffffull;
}

// The offsets of index i in the two views (32-bit: only where strided_fits32 holds).
__device__ __forceinline__ void strided_offsets32(unsigned i, const Strided& s, unsigned& oa, unsigned& ob) {
    unsigned rem = i;
    oa = 0;
    ob = 0;
    for (int d = (int)s.rank - 1; d >= 0; d--) {
        const unsigned dim = (unsigned)s.dims[d];
        const unsigned q = rem / dim;
        const unsigned c = rem - q * dim;
        rem = q;
        oa += c * (unsigned)s.sa[d];
        ob += c * (unsigned)s.sb[d];
    }
}

// The same in 64 bits, for the rest.
__device__ __forceinline__ void strided_offsets64(u64 i, const Strided& s, u64& oa, u64& ob) {
    u64 rem = i;
    oa = 0;
    ob = 0;
    for (int d = (int)s.rank - 1; d >= 0; d--) {
        const u64 c = rem % (u64)s.dims[d];
        rem /= (u64)s.dims[d];
        oa += c * s.sa[d];
        ob += c * s.sb[d];
    }
}

// The two offsets of index i in 32 bits where `fits` (strided_fits32 of the launch), else 64.
__device__ __forceinline__ void strided_offsets(bool fits, u64 i, const Strided& s, u64& oa, u64& ob) {
    if (fits) {
        unsigned a, b;
        strided_offsets32((unsigned)i, s, a, b);
        oa = a;
        ob = b;
    } else {
        strided_offsets64(i, s, oa, ob);
    }
}

// A pack of 16 bytes at p when the view steps through it (`run`), else its one value repeated
// (a broadcast view, stride 0 along the packed dim).
template <typename T>
__device__ __forceinline__ typename Pack<T>::type load_pack(const T* p, bool run) {
    typename Pack<T>::type v;
    if (run) {
        v = *(const typename Pack<T>::type*)p;
    } else {
        const T x = *p;
#pragma unroll
        for (int k = 0; k < Pack<T>::N; k++) v.v[k] = x;
    }
    return v;
}

// Whether every pointer is 16-byte aligned: views at an offset may not be, and then the packed
// loops would fault. The answer is the same for every thread of a launch.
__device__ __forceinline__ bool aligned16(const void* a, const void* b = 0, const void* c = 0) {
    return ((((u64)a) | ((u64)b) | ((u64)c)) & 15) == 0;
}

// Applies `f` to every element of a contiguous span: 16-byte packs, then a scalar tail (all
// scalar when a pointer is not 16-byte aligned).
template <typename T, typename F>
__device__ __forceinline__ void map_contig(u64 n, const T* __restrict__ x, T* __restrict__ y, F f) {
    typedef typename Pack<T>::type P;
    const int N = Pack<T>::N;
    u64 nv = aligned16(x, y) ? n / N : 0;
    const P* xv = (const P*)x;
    P* yv = (P*)y;
    for (u64 i = global_tid(); i < nv; i += global_stride()) {
        P a = xv[i], r;
#pragma unroll
        for (int k = 0; k < N; k++) r.v[k] = Num<T>::from(f(Num<T>::to(a.v[k])));
        yv[i] = r;
    }
    for (u64 i = nv * N + global_tid(); i < n; i += global_stride()) y[i] = Num<T>::from(f(Num<T>::to(x[i])));
}

template <typename T, typename F>
__device__ __forceinline__ void map2_contig(u64 n, const T* __restrict__ a, const T* __restrict__ b,
                                            T* __restrict__ y, F f) {
    typedef typename Pack<T>::type P;
    const int N = Pack<T>::N;
    u64 nv = aligned16(a, b, y) ? n / N : 0;
    const P* av = (const P*)a;
    const P* bv = (const P*)b;
    P* yv = (P*)y;
    for (u64 i = global_tid(); i < nv; i += global_stride()) {
        P p = av[i], q = bv[i], r;
#pragma unroll
        for (int k = 0; k < N; k++) r.v[k] = Num<T>::from(f(Num<T>::to(p.v[k]), Num<T>::to(q.v[k])));
        yv[i] = r;
    }
    for (u64 i = nv * N + global_tid(); i < n; i += global_stride())
        y[i] = Num<T>::from(f(Num<T>::to(a[i]), Num<T>::to(b[i])));
}

// Block-wide reduction helpers (blockDim.x a multiple of 32, at most 1024).
template <typename A, typename F>
__device__ __forceinline__ A warp_reduce(A v, F f) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = f(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
template <typename A, typename F>
__device__ A block_reduce(A v, F f, A identity, A* shared /* >= 32 */) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_reduce(v, f);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    if (warp == 0) {
        A w = lane < nw ? shared[lane] : identity;
        w = warp_reduce(w, f);
        if (lane == 0) shared[0] = w;
    }
    __syncthreads();
    A r = shared[0];
    __syncthreads();
    return r;
}

// A block's fold of `len` values, value j being load(j): each thread folds its strided share
// (j = threadIdx.x, + blockDim.x, ...) in order of j, four loads in flight, then the block's
// fixed-order tree. The order depends only on len and the block size, so results repeat bit
// for bit. What a block per row, lane or channel of partial sums is built on.
template <typename A, typename F, typename Load>
__device__ A block_fold(u64 len, F f, A identity, Load load, A* shared /* >= 32 */) {
    const u64 step = blockDim.x;
    A v = identity;
    u64 j = threadIdx.x;
    for (; j + 3 * step < len; j += 4 * step) {
        A a0 = load(j), a1 = load(j + step), a2 = load(j + 2 * step), a3 = load(j + 3 * step);
        v = f(v, a0);
        v = f(v, a1);
        v = f(v, a2);
        v = f(v, a3);
    }
    for (; j < len; j += step) v = f(v, load(j));
    return block_reduce(v, f, identity, shared);
}

// Math by arithmetic type (explicit f32 functions for float: no reliance on C++ overloads).
__device__ __forceinline__ float m_exp(float v) { return expf(v); }
__device__ __forceinline__ double m_exp(double v) { return exp(v); }
__device__ __forceinline__ float m_log(float v) { return logf(v); }
__device__ __forceinline__ double m_log(double v) { return log(v); }
__device__ __forceinline__ float m_sqrt(float v) { return sqrtf(v); }
__device__ __forceinline__ double m_sqrt(double v) { return sqrt(v); }
__device__ __forceinline__ float m_abs(float v) { return fabsf(v); }
__device__ __forceinline__ double m_abs(double v) { return fabs(v); }
__device__ __forceinline__ float m_pow(float v, float e) { return powf(v, e); }
__device__ __forceinline__ double m_pow(double v, double e) { return pow(v, e); }
