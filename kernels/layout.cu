// layout.cu: data movement by element size (2, 4 or 8 bytes): the strided copy every view
// materialises through, and the 2-D block copy of cat.

typedef unsigned short e2;
typedef unsigned int e4;
typedef u64 e8;

// y[Σ_d coord_d(i) · sb[d]] = x[Σ_d coord_d(i) · sa[d]] for every index i of the space `dims`.
#define LAYOUT(N, T)                                                                               \
    extern "C" __global__ void strided_copy_##N(u64 n, const T* x, T* y, Strided s) {              \
        if (strided_fits32(n, s)) {                                                                \
            for (u64 i = global_tid(); i < n; i += global_stride()) {                              \
                unsigned src, dst;                                                                 \
                strided_offsets32((unsigned)i, s, src, dst);                                       \
                y[dst] = x[src];                                                                   \
            }                                                                                      \
            return;                                                                                \
        }                                                                                          \
        for (u64 i = global_tid(); i < n; i += global_stride()) {                                  \
            u64 src, dst;                                                                          \
            strided_offsets64(i, s, src, dst);                                                     \
            y[dst] = x[src];                                                                       \
        }                                                                                          \
    }                                                                                              \
    /* The same over 16-byte packs (`Strided` in pack space, from the host's `packed`): a source   \
       with stride 0 along the packed dim (a broadcast materialised) repeats its value. */         \
    extern "C" __global__ void strided_copy_vec_##N(u64 packs, const T* x, T* y, Strided s) {      \
        typedef Pack<T>::type P;                                                                   \
        const int V = sizeof(P) / sizeof(T);                                                        \
        const bool run = s.sa[(int)s.rank - 1] != 0;                                               \
        const bool fits = strided_fits32(packs * V, s);                                            \
        for (u64 i = global_tid(); i < packs; i += global_stride()) {                              \
            u64 src, dst;                                                                          \
            strided_offsets(fits, i, s, src, dst);                                                 \
            *(P*)(y + dst) = load_pack(x + src, run);                                              \
        }                                                                                          \
    }                                                                                              \
    /* rows × cols elements: dst[r·dpitch + dofs + c] = src[r·spitch + sofs + c] */                \
    extern "C" __global__ void copy2d_##N(u64 rows, u64 cols, const T* src, u64 spitch, u64 sofs,  \
                                          T* dst, u64 dpitch, u64 dofs) {                          \
        u64 n = rows * cols;                                                                       \
        for (u64 i = global_tid(); i < n; i += global_stride()) {                                  \
            u64 r = i / cols, c = i - r * cols;                                                    \
            dst[r * dpitch + dofs + c] = src[r * spitch + sofs + c];                               \
        }                                                                                          \
    }

LAYOUT(2, e2)
LAYOUT(4, e4)
LAYOUT(8, e8)
