// dropout.cu: dropout by the mask rule of backend/dropout.rs. The generator state (seed, offset:
// two u64) is device memory, read by the kernels and advanced by one, so a captured graph draws
// a new mask on every replay. Value i of a draw is word e mod 4 of the Philox 4x32-10 block
// [lo(e/4), hi(e/4), TAG, 0] under key [lo(seed), hi(seed)], e = offset + i; it is kept when the
// word is >= thr. Each thread draws whole blocks: four values per Philox evaluation.

#define DROPOUT_TAG 0x64726f70u

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
    const unsigned M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
    for (int r = 0; r < 10; r++) {
        unsigned hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
        unsigned hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
        k.x += W0;
        k.y += W1;
    }
    return c;
}

// y[i] = keep(i) ? x[i]·scale : 0 for the draw at state = (seed, offset). The backward is the
// same map of the output's gradient with the forward's saved state.
template <typename T>
__device__ void dropout_apply(u64 n, u64 thr, double scale, const u64* state, const T* x, T* y) {
    typedef typename Num<T>::acc A;
    const u64 seed = state[0], offset = state[1];
    const uint2 key = make_uint2((unsigned)seed, (unsigned)(seed >> 32));
    const A s = (A)scale;
    const u64 first = offset / 4, last = (offset + n + 3) / 4;
    for (u64 b = first + global_tid(); b < last; b += global_stride()) {
        uint4 w = philox4x32_10(make_uint4((unsigned)b, (unsigned)(b >> 32), DROPOUT_TAG, 0u), key);
        unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u64 e = b * 4 + j;
            if (e < offset || e - offset >= n) continue;
            u64 i = e - offset;
            y[i] = (u64)ws[j] >= thr ? Num<T>::from(Num<T>::to(x[i]) * s) : Num<T>::from((A)0);
        }
    }
}

#define DROPOUT(N, T)                                                                              \
    extern "C" __global__ void dropout_##N(u64 n, u64 thr, double scale, const u64* state,         \
                                           const T* x, T* y) {                                     \
        dropout_apply<T>(n, thr, scale, state, x, y);                                              \
    }
DROPOUT(f16, f16)
DROPOUT(bf16, bf16)
DROPOUT(f32, float)
DROPOUT(f64, double)

// saved = state (what the backward and a recomputation replay), then state.offset += n.
extern "C" __global__ void dropout_advance(u64 n, u64* state, u64* saved) {
    if (global_tid() == 0) {
        if (saved) {
            saved[0] = state[0];
            saved[1] = state[1];
        }
        state[1] += n;
    }
}
