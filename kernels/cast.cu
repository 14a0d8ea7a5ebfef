// cast.cu: dtype conversion and fill. Float → float rounds once to nearest even; float → i64 truncates.

template <typename S, typename D> struct Conv {
    static __device__ __forceinline__ D run(S v) { return Num<D>::from_d((double)Num<S>::to(v)); }
};
// Paths that round once from f32 (as the CPU's f32 → half conversions do).
template <> struct Conv<float, f16> { static __device__ __forceinline__ f16 run(float v) { return Num<f16>::from(v); } };
template <> struct Conv<float, bf16> { static __device__ __forceinline__ bf16 run(float v) { return Num<bf16>::from(v); } };
template <> struct Conv<f16, bf16> { static __device__ __forceinline__ bf16 run(f16 v) { return Num<bf16>::from(Num<f16>::to(v)); } };
template <> struct Conv<bf16, f16> { static __device__ __forceinline__ f16 run(bf16 v) { return Num<f16>::from(Num<bf16>::to(v)); } };
template <> struct Conv<f16, float> { static __device__ __forceinline__ float run(f16 v) { return Num<f16>::to(v); } };
template <> struct Conv<bf16, float> { static __device__ __forceinline__ float run(bf16 v) { return Num<bf16>::to(v); } };

template <typename T, int N> struct alignas(sizeof(T) * N) Arr { T v[N]; };

template <typename S, typename D>
__device__ void cast_impl(u64 n, const S* __restrict__ x, D* __restrict__ y) {
    // 8 elements per step through aligned aggregate loads/stores (vector instructions).
    const int N = 8;
    // Views at an offset may not be aligned for the aggregate access: then all scalar.
    bool ok = ((u64)x % sizeof(Arr<S, N>)) == 0 && ((u64)y % sizeof(Arr<D, N>)) == 0;
    u64 nv = ok ? n / N : 0;
    const Arr<S, N>* xv = (const Arr<S, N>*)x;
    Arr<D, N>* yv = (Arr<D, N>*)y;
    for (u64 i = global_tid(); i < nv; i += global_stride()) {
        Arr<S, N> a = xv[i];
        Arr<D, N> r;
#pragma unroll
        for (int k = 0; k < N; k++) r.v[k] = Conv<S, D>::run(a.v[k]);
        yv[i] = r;
    }
    for (u64 i = nv * N + global_tid(); i < n; i += global_stride()) y[i] = Conv<S, D>::run(x[i]);
}

#define CAST(SN, S, DN, D) \
    extern "C" __global__ void cast_##SN##_##DN(u64 n, const S* x, D* y) { cast_impl<S, D>(n, x, y); }
#define CAST_FROM(SN, S)      \
    CAST(SN, S, f16, f16)     \
    CAST(SN, S, bf16, bf16)   \
    CAST(SN, S, f32, float)   \
    CAST(SN, S, f64, double)  \
    CAST(SN, S, i64, i64)
CAST_FROM(f16, f16)
CAST_FROM(bf16, bf16)
CAST_FROM(f32, float)
CAST_FROM(f64, double)
CAST_FROM(i64, i64)

#define FILL(N, T) \
    extern "C" __global__ void fill_##N(u64 n, T* y, double v) { \
        T t = Num<T>::from_d(v); \
        for (u64 i = global_tid(); i < n; i += global_stride()) y[i] = t; \
    }
FILL(f16, f16)
FILL(bf16, bf16)
FILL(f32, float)
FILL(f64, double)
FILL(i64, i64)
