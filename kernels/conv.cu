// conv.cu: our own convolution kernels, for the shapes cuDNN serves worst. Each is a candidate
// of the plan choice (src/backend/cuda/conv_direct.rs), timed beside cuDNN's engines and run
// only where it is the fastest.
//
// Weight gradient of a channels_last filter (groups 1):
//   dw[k][r][s][c] = Σ over pixels (n, oh, ow) of dy[n][oh][ow][k] · x[n][ih][iw][c],
//   ih = oh·sh − ph + r·dh,  iw = ow·sw − pw + s·dw  (terms outside the input are 0).
// A filter with few weights against a long sum (a 1-channel stem: 144 weights, 100352 pixels
// at batch 128) is a matrix product with a tiny output and a huge reduction; cuDNN's tiled
// kernels leave most of the GPU idle on it. Here:
//   stage 1, a block per range of pixels: a thread holds WG_KT output channels of one
//     (r, s, c) and walks its share of the pixels, reading x once per pixel for all of them;
//     when the block has more threads than (channel tile, r, s, c) slots, `groups` copies of
//     the slots each take a contiguous piece of the range, added up through shared memory in
//     group order; the block writes its row of partial sums;
//   stage 2, a block per weight: the rows in a fixed order (a strided share per thread, then
//     the block's tree), rounded once to the weight's dtype.
// The order of every sum depends only on the shapes: the result repeats bit for bit. Indices
// are 32-bit: the launcher admits only operands under 2^31 elements.

#define WG_KT 16
// Threads per block of stage 1 at most (the launcher's WGRAD_THREADS).
#define WG_THREADS 256

struct WgradP {
    int n, c, h, w, k, r, s, oh, ow, sh, sw, ph, pw, dh, dw;
    // Channel tiles (ceil(k / WG_KT)), slots (tiles · r · s · c), copies of the slots per block.
    int tiles, slots, groups;
    int pixels_per_block;
};

// The WG_KT output-gradient values of one pixel's channel tile, as f32: two or four 16-byte
// loads when the tile is whole and aligned (the threads of a copy all read the same row, so
// the scalar loads were most of the kernel's instructions), else one element at a time.
template <typename T>
__device__ __forceinline__ void load_tile(const T* d, int kn, float v[WG_KT]) {
    const int per = 16 / (int)sizeof(T);  // elements per 16-byte load
    if (kn == WG_KT && ((size_t)d & 15) == 0) {
#pragma unroll
        for (int i = 0; i < WG_KT / per; i++) {
            uint4 raw = ((const uint4*)d)[i];
            const T* e = (const T*)&raw;
#pragma unroll
            for (int j = 0; j < per; j++) v[i * per + j] = Num<T>::to(e[j]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < WG_KT; j++) v[j] = j < kn ? Num<T>::to(d[j]) : 0.0f;
    }
}

template <typename T>
__device__ void wgrad_partial(WgradP p, const T* dy, const T* x, float* partials) {
    __shared__ float sh_acc[WG_THREADS * WG_KT];  // groups · slots · WG_KT ≤ this, when groups > 1
    const int rsc = p.r * p.s * p.c, weights = p.k * rsc;
    const int pixels = p.n * p.oh * p.ow;
    const int p0 = blockIdx.x * p.pixels_per_block;
    const int p1 = min(pixels, p0 + p.pixels_per_block);
    // With several copies of the slots, copy g takes the g-th contiguous piece of the range.
    const int g = p.groups > 1 ? (int)threadIdx.x / p.slots : 0;
    const int piece = (p1 - p0 + p.groups - 1) / p.groups;
    const int q0 = min(p1, p0 + g * piece), q1 = min(p1, q0 + piece);
    const int first = p.groups > 1 ? (int)threadIdx.x % p.slots : (int)threadIdx.x;
    const int step = p.groups > 1 ? p.slots : (int)blockDim.x;
    for (int slot = first; slot < p.slots && g < p.groups; slot += step) {
        const int tile = slot / rsc, at = slot - tile * rsc;
        const int r = at / (p.s * p.c), sc = at - r * (p.s * p.c);
        const int s = sc / p.c, c = sc - s * p.c;
        const int k0 = tile * WG_KT, kn = min(WG_KT, p.k - k0);
        const int roff = r * p.dh - p.ph, soff = s * p.dw - p.pw;
        float acc[WG_KT];
#pragma unroll
        for (int j = 0; j < WG_KT; j++) acc[j] = 0.0f;
        // The first pixel as (n, oh, ow), then stepped one pixel at a time.
        int ow = q0 % p.ow, oh = (q0 / p.ow) % p.oh, n = q0 / (p.ow * p.oh);
        for (int q = q0; q < q1; q++) {
            const int ih = oh * p.sh + roff, iw = ow * p.sw + soff;
            if (ih >= 0 && ih < p.h && iw >= 0 && iw < p.w) {
                const float xv = Num<T>::to(x[((n * p.h + ih) * p.w + iw) * p.c + c]);
                float d[WG_KT];
                load_tile<T>(dy + (size_t)q * p.k + k0, kn, d);
#pragma unroll
                for (int j = 0; j < WG_KT; j++) acc[j] += d[j] * xv;
            }
            if (++ow == p.ow) {
                ow = 0;
                if (++oh == p.oh) {
                    oh = 0;
                    n++;
                }
            }
        }
        if (p.groups > 1) {
#pragma unroll
            for (int j = 0; j < WG_KT; j++) sh_acc[(g * p.slots + slot) * WG_KT + j] = acc[j];
        } else {
            float* row = partials + (size_t)blockIdx.x * weights;
#pragma unroll
            for (int j = 0; j < WG_KT; j++)
                if (j < kn) row[(k0 + j) * rsc + at] = acc[j];
        }
    }
    if (p.groups > 1) {
        __syncthreads();
        float* row = partials + (size_t)blockIdx.x * weights;
        for (int e = threadIdx.x; e < p.slots * WG_KT; e += blockDim.x) {
            const int slot = e / WG_KT, j = e - slot * WG_KT;
            const int tile = slot / rsc, at = slot - tile * rsc, k = tile * WG_KT + j;
            if (k >= p.k) continue;
            float v = 0.0f;
            for (int gg = 0; gg < p.groups; gg++) v += sh_acc[(gg * p.slots + slot) * WG_KT + j];
            row[k * rsc + at] = v;
        }
    }
}

template <typename T>
__device__ void wgrad_reduce(const float* partials, int blocks, int weights, T* dw) {
    __shared__ float sh[32];
    for (int o = blockIdx.x; o < weights; o += gridDim.x) {
        float v = block_fold((u64)blocks, [](float a, float b) { return a + b; }, 0.0f,
                             [&](u64 b) { return partials[b * weights + o]; }, sh);
        if (threadIdx.x == 0) dw[o] = Num<T>::from(v);
    }
}

// ---- space-to-depth (src/backend/cuda/conv_space_to_depth.rs) ---------------------------------
//
// A convolution of stride (s0, s1) over few input channels, rewritten as a stride-1 one over
// s0·s1 times as many: S[n][y][x][(p·s1 + q)·c + ci] = x[n][s0·y + p − ph][s1·x + q − pw][ci]
// (0 outside x, and in the pad channels cs..cp), w'[k][a][b][(p·s1 + q)·c + ci] =
// w[k][s0·a + p][s1·b + q][ci] (0 past the kernel), so that
//   y[n][oy][ox][k] = Σ over a, b, cp of w'[k][a][b][cp] · S[n][oy + a][ox + b][cp],
// the same products as the strided convolution (plus zeros). In bf16 cuDNN's stride-1 kernels
// over 16 channels run ResNet's 7x7/2 stem over 3 in 0.64 ms against 1.77 (H200, batch 256;
// in f16 its stem kernels are faster still, and the timer keeps them). The gradients map back: dw from dw' (each weight has one place in w'), dx from dS (each
// input value has at most one place in S). channels_last operands; indices in 32 bits (the
// launcher admits only operands under 2^31 elements).
struct S2dP {
    int n, c, h, w;      // the input
    int s0, s1, ph, pw;  // stride and padding of the strided convolution
    int hs, ws, cs, cp;  // S: rows, columns, used channels (s0·s1·c), channels with the pad
    int k, kh, kw;       // the filter
    int kh2, kw2;        // the rewritten filter's size, ceil(kh / s0) x ceil(kw / s1)
};

// S from x: a thread per 8 channels of a pixel of S (cp is a multiple of 8), one 16-byte store
// for the half types. (A thread per pixel storing its 16 values one at a time took ~0.5 ms for
// ResNet-50's batch-256 stem, longer than half the convolution it feeds.)
template <typename T> __device__ void s2d_input(S2dP p, const T* __restrict__ x, T* __restrict__ out) {
    const unsigned chunks = (unsigned)p.cp / 8, items = (unsigned)p.n * p.hs * p.ws * chunks;
    for (unsigned i = global_tid(); i < items; i += global_stride()) {
        const unsigned q0 = (i % chunks) * 8, pix = i / chunks;
        const int xx = pix % p.ws, y = (pix / p.ws) % p.hs, n = pix / (p.ws * p.hs);
        // (pr, qc, ci) of channel q0, then stepped one channel at a time.
        int ci = q0 % p.c, pq = q0 / p.c, pr = pq / p.s1, qc = pq % p.s1;
        T v[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            v[e] = Num<T>::from(0.0f);
            const int iy = p.s0 * y + pr - p.ph, ix = p.s1 * xx + qc - p.pw;
            if ((int)q0 + e < p.cs && iy >= 0 && iy < p.h && ix >= 0 && ix < p.w)
                v[e] = x[(((size_t)n * p.h + iy) * p.w + ix) * p.c + ci];
            if (++ci == p.c) {
                ci = 0;
                if (++qc == p.s1) {
                    qc = 0;
                    pr++;
                }
            }
        }
        T* o = out + (size_t)pix * p.cp + q0;
        if constexpr (sizeof(T) == 2) {
            store_pack8(o, v);
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++) o[e] = v[e];
        }
    }
}

// w' from w: a thread per element of w'.
template <typename T> __device__ void s2d_weight(S2dP p, const T* w, T* out) {
    const unsigned total = (unsigned)p.k * p.kh2 * p.kw2 * p.cp;
    for (unsigned i = global_tid(); i < total; i += global_stride()) {
        const int q0 = i % p.cp, b = (i / p.cp) % p.kw2, a = (i / (p.cp * p.kw2)) % p.kh2;
        const int k = i / (p.cp * p.kw2 * p.kh2);
        T v = Num<T>::from(0.0f);
        if (q0 < p.cs) {
            const int ci = q0 % p.c, pq = q0 / p.c, ky = p.s0 * a + pq / p.s1, kx = p.s1 * b + pq % p.s1;
            if (ky < p.kh && kx < p.kw) v = w[(((size_t)k * p.kh + ky) * p.kw + kx) * p.c + ci];
        }
        out[i] = v;
    }
}

// dw from dw': a thread per weight.
template <typename T> __device__ void s2d_weight_grad(S2dP p, const T* dw2, T* dw) {
    const unsigned total = (unsigned)p.k * p.kh * p.kw * p.c;
    for (unsigned i = global_tid(); i < total; i += global_stride()) {
        const int ci = i % p.c, kx = (i / p.c) % p.kw, ky = (i / (p.c * p.kw)) % p.kh;
        const int k = i / (p.c * p.kw * p.kh);
        const int q0 = ((ky % p.s0) * p.s1 + kx % p.s1) * p.c + ci;
        dw[i] = dw2[(((size_t)k * p.kh2 + ky / p.s0) * p.kw2 + kx / p.s1) * p.cp + q0];
    }
}

// dx from dS: a thread per input value (0 where no output reads it).
template <typename T> __device__ void s2d_input_grad(S2dP p, const T* ds, T* dx) {
    const unsigned total = (unsigned)p.n * p.h * p.w * p.c;
    for (unsigned i = global_tid(); i < total; i += global_stride()) {
        const int ci = i % p.c, ix = (i / p.c) % p.w, iy = (i / (p.c * p.w)) % p.h;
        const unsigned n = i / (p.c * p.w * p.h);
        const int y = (iy + p.ph) / p.s0, xx = (ix + p.pw) / p.s1;
        T v = Num<T>::from(0.0f);
        if (y < p.hs && xx < p.ws) {
            const int q0 = (((iy + p.ph) % p.s0) * p.s1 + (ix + p.pw) % p.s1) * p.c + ci;
            v = ds[(((size_t)n * p.hs + y) * p.ws + xx) * p.cp + q0];
        }
        dx[i] = v;
    }
}

#define CONV(N, T)                                                                                  \
    extern "C" __global__ void wgrad_partial_##N(WgradP p, const T* dy, const T* x,                \
                                                 float* partials) {                                 \
        wgrad_partial<T>(p, dy, x, partials);                                                       \
    }                                                                                               \
    extern "C" __global__ void wgrad_reduce_##N(const float* partials, int blocks, int weights,     \
                                                T* dw) {                                            \
        wgrad_reduce<T>(partials, blocks, weights, dw);                                             \
    }                                                                                               \
    extern "C" __global__ void s2d_input_##N(S2dP p, const T* x, T* out) { s2d_input<T>(p, x, out); } \
    extern "C" __global__ void s2d_weight_##N(S2dP p, const T* w, T* out) { s2d_weight<T>(p, w, out); } \
    extern "C" __global__ void s2d_weight_grad_##N(S2dP p, const T* dw2, T* dw) {                   \
        s2d_weight_grad<T>(p, dw2, dw);                                                             \
    }                                                                                               \
    extern "C" __global__ void s2d_input_grad_##N(S2dP p, const T* ds, T* dx) {                     \
        s2d_input_grad<T>(p, ds, dx);                                                               \
    }
CONV(f16, f16)
CONV(bf16, bf16)
CONV(f32, float)
