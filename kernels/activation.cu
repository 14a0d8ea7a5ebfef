// activation.cu: GELU (exact and tanh) and SiLU with their derivatives, elementwise over dense
// spans, in f32 (f64 for f64) and rounded once on store. The op codes match
// backend::activation::Activation.

__device__ __forceinline__ float m_erf(float v) { return erff(v); }
__device__ __forceinline__ double m_erf(double v) { return erf(v); }
__device__ __forceinline__ float m_tanh(float v) { return tanhf(v); }
__device__ __forceinline__ double m_tanh(double v) { return tanh(v); }

// 1/√2, 1/√(2π), √(2/π), and GELU-tanh's cubic coefficient.
#define RSQRT2 0.70710678118654752440
#define RSQRT_2PI 0.39894228040143267794
#define SQRT_2_PI 0.79788456080286535588
#define GELU_C 0.044715

template <typename A> __device__ __forceinline__ A sigmoid(A v) { return (A)1 / ((A)1 + m_exp(-v)); }

template <typename A> __device__ __forceinline__ A act_value(int op, A x) {
    switch (op) {
    case 0: return (A)0.5 * x * ((A)1 + m_erf(x * (A)RSQRT2));
    case 1: return (A)0.5 * x * ((A)1 + m_tanh((A)SQRT_2_PI * (x + (A)GELU_C * x * x * x)));
    default: return x * sigmoid(x);
    }
}

template <typename A> __device__ __forceinline__ A act_slope(int op, A x) {
    switch (op) {
    case 0: {
        A pdf = (A)RSQRT_2PI * m_exp((A)-0.5 * x * x);
        return (A)0.5 * ((A)1 + m_erf(x * (A)RSQRT2)) + x * pdf;
    }
    case 1: {
        A t = m_tanh((A)SQRT_2_PI * (x + (A)GELU_C * x * x * x));
        return (A)0.5 * ((A)1 + t) + (A)0.5 * x * ((A)1 - t * t) * (A)SQRT_2_PI * ((A)1 + (A)3 * (A)GELU_C * x * x);
    }
    default: {
        A s = sigmoid(x);
        return s * ((A)1 + x * ((A)1 - s));
    }
    }
}

// A switch per launch, not per element: one loop per op.
#define ACTIVATION(N, T)                                                                           \
    extern "C" __global__ void activation_##N(u64 n, int op, const T* x, T* y) {                   \
        typedef Num<T>::acc A;                                                                     \
        switch (op) {                                                                              \
        case 0: map_contig(n, x, y, [](A v) { return act_value<A>(0, v); }); break;                \
        case 1: map_contig(n, x, y, [](A v) { return act_value<A>(1, v); }); break;                \
        default: map_contig(n, x, y, [](A v) { return act_value<A>(2, v); }); break;               \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void activation_backward_##N(u64 n, int op, const T* g, const T* x,      \
                                                       T* dx) {                                    \
        typedef Num<T>::acc A;                                                                     \
        switch (op) {                                                                              \
        case 0: map2_contig(n, g, x, dx, [](A a, A b) { return a * act_slope<A>(0, b); }); break;  \
        case 1: map2_contig(n, g, x, dx, [](A a, A b) { return a * act_slope<A>(1, b); }); break;  \
        default: map2_contig(n, g, x, dx, [](A a, A b) { return a * act_slope<A>(2, b); }); break; \
        }                                                                                          \
    }
ACTIVATION(f16, f16)
ACTIVATION(bf16, bf16)
ACTIVATION(f32, float)
ACTIVATION(f64, double)
