// elementwise.cu: unary, affine, powf, binary (contiguous and broadcast), relu_backward.
// The op codes match the order of backend::UnaryOp / backend::BinaryOp.

template <typename A> __device__ __forceinline__ A unary_op(int op, A v) {
    switch (op) {
    case 0: return -v;
    case 1: return v > (A)0 ? v : (A)0;
    case 2: return m_exp(v);
    case 3: return m_log(v);
    case 4: return m_sqrt(v);
    case 5: return v * v;
    default: return m_abs(v);
    }
}

template <typename A> __device__ __forceinline__ A binary_op(int op, A a, A b) {
    switch (op) {
    case 0: return a + b;
    case 1: return a - b;
    case 2: return a * b;
    case 3: return a / b;
    case 4: return (is_nan(a) || is_nan(b)) ? nan_of<A>() : (a > b ? a : b);
    default: return (is_nan(a) || is_nan(b)) ? nan_of<A>() : (a < b ? a : b);
    }
}

// Each op is a switch on a launch-uniform code inside the element loop: one kernel per dtype.
#define ELEMENTWISE(N, T)                                                                          \
    extern "C" __global__ void unary_##N(u64 n, int op, const T* x, T* y) {                        \
        typedef Num<T>::acc A;                                                                     \
        switch (op) {                                                                              \
        case 0: map_contig(n, x, y, [](A v) { return -v; }); break;                                \
        case 1: map_contig(n, x, y, [](A v) { return v > (A)0 ? v : (A)0; }); break;               \
        case 5: map_contig(n, x, y, [](A v) { return v * v; }); break;                             \
        default: map_contig(n, x, y, [op](A v) { return unary_op<A>(op, v); }); break;             \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void affine_##N(u64 n, const T* x, T* y, double mul, double add) {       \
        typedef Num<T>::acc A;                                                                     \
        A m = (A)mul, a = (A)add;                                                                  \
        map_contig(n, x, y, [m, a](A v) { return v * m + a; });                                    \
    }                                                                                              \
    extern "C" __global__ void powf_##N(u64 n, const T* x, T* y, double e) {                       \
        typedef Num<T>::acc A;                                                                     \
        A ea = (A)e;                                                                               \
        map_contig(n, x, y, [ea](A v) { return m_pow(v, ea); });                                   \
    }                                                                                              \
    extern "C" __global__ void binary_##N(u64 n, int op, const T* a, const T* b, T* y) {           \
        typedef Num<T>::acc A;                                                                     \
        switch (op) {                                                                              \
        case 0: map2_contig(n, a, b, y, [](A p, A q) { return p + q; }); break;                    \
        case 1: map2_contig(n, a, b, y, [](A p, A q) { return p - q; }); break;                    \
        case 2: map2_contig(n, a, b, y, [](A p, A q) { return p * q; }); break;                    \
        default: map2_contig(n, a, b, y, [op](A p, A q) { return binary_op<A>(op, p, q); }); break; \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void binary_bcast_##N(u64 n, int op, const T* a, const T* b, T* y,       \
                                                Strided s) {                                       \
        typedef Num<T>::acc A;                                                                     \
        if (strided_fits32(n, s)) {                                                                \
            for (u64 i = global_tid(); i < n; i += global_stride()) {                              \
                unsigned oa, ob;                                                                   \
                strided_offsets32((unsigned)i, s, oa, ob);                                         \
                y[i] = Num<T>::from(binary_op<A>(op, Num<T>::to(a[oa]), Num<T>::to(b[ob])));       \
            }                                                                                      \
            return;                                                                                \
        }                                                                                          \
        for (u64 i = global_tid(); i < n; i += global_stride()) {                                  \
            u64 oa, ob;                                                                            \
            strided_offsets64(i, s, oa, ob);                                                       \
            y[i] = Num<T>::from(binary_op<A>(op, Num<T>::to(a[oa]), Num<T>::to(b[ob])));           \
        }                                                                                          \
    }                                                                                              \
    /* The same over packs (`Strided` in pack space, from the host's `packed`): one index split    \
       per 16 bytes of output; a view with stride 0 along the packed dim repeats its value. */     \
    extern "C" __global__ void binary_bcast_vec_##N(u64 packs, int op, const T* a, const T* b,     \
                                                    T* y, Strided s) {                             \
        typedef Num<T>::acc A;                                                                     \
        typedef Pack<T>::type P;                                                                   \
        const int V = sizeof(P) / sizeof(T);                                                        \
        const int r = (int)s.rank - 1;                                                             \
        const bool run_a = s.sa[r] != 0, run_b = s.sb[r] != 0;                                     \
        const bool fits = strided_fits32(packs * V, s);                                            \
        for (u64 i = global_tid(); i < packs; i += global_stride()) {                              \
            u64 oa, ob;                                                                            \
            strided_offsets(fits, i, s, oa, ob);                                                   \
            const P va = load_pack(a + oa, run_a), vb = load_pack(b + ob, run_b);                  \
            P vy;                                                                                  \
            for (int k = 0; k < V; k++)                                                            \
                vy.v[k] = Num<T>::from(binary_op<A>(op, Num<T>::to(va.v[k]), Num<T>::to(vb.v[k]))); \
            *(P*)(y + i * V) = vy;                                                                 \
        }                                                                                          \
    }                                                                                              \
    /* b a row broadcast over a's rows (a linear layer's bias): one index split, no per-dim loop */ \
    extern "C" __global__ void binary_rowvec_##N(u64 n, u64 cols, int op, const T* a, const T* b,  \
                                                 T* y) {                                           \
        typedef Num<T>::acc A;                                                                     \
        for (u64 i = global_tid(); i < n; i += global_stride())                                    \
            y[i] = Num<T>::from(binary_op<A>(op, Num<T>::to(a[i]), Num<T>::to(b[i % cols])));      \
    }                                                                                              \
    extern "C" __global__ void relu_backward_##N(u64 n, const T* g, const T* x, T* y) {            \
        typedef Num<T>::acc A;                                                                     \
        map2_contig(n, g, x, y, [](A gv, A xv) { return xv > (A)0 ? gv : (A)0; });                 \
    }

ELEMENTWISE(f16, f16)
ELEMENTWISE(bf16, bf16)
ELEMENTWISE(f32, float)
ELEMENTWISE(f64, double)
