// fused_optim.cu: fused SGD / Adam(W) / LAMB / NovoGrad updates over tensor lists. FP32 math and
// state; gradients of any float type, multiplied by *mult (1/loss_scale · clip) on load; the
// parameter (FP32 master or the model's own) rounded once on store, plus an optional copy (the
// half model weights) written in the same pass. Every kernel returns at once when *found != 0:
// a skipped step is an exact no-op. Step counters steps[slot] are read, never written, here
// (step_increment runs after the update). Hyperparameters are a block of floats in device memory
// (flags 0/1), never launch arguments, so a captured CUDA graph follows set_lr / set_config. Their
// structs (SgdHyper, AdamHyper, LambHyper, NovoGradHyper) are not written here: the registry
// prepends the definitions it generates from the Rust blocks of src/backend/fused_optim.rs.
// Optional lists are known by their pointer: SGD's momentum buffer (p[2]), Adam's amsgrad
// maximum (p[4]), the half copy (p[5]).

template <typename G, typename P, typename C>
__device__ void sgd(const TEnt* tens, const CEnt* chunks, const float* found, const float* mult,
                    const float* steps, const SgdHyper* qp) {
    if (found && *found != 0.0f) return;
    const float s = mult ? *mult : 1.0f;
    const SgdHyper q = *qp;
    MT_LOOP(tens, chunks) {
        const bool mom = te.p[2] != 0;
        const bool first = steps[te.slot] == 0.0f;
        float g[4], w[4], m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        ld4<G>(te.p[0], i, end, vec, g);
        ld4<P>(te.p[1], i, end, vec, w);
        if (mom && !first) ld4<float>(te.p[2], i, end, vec, m);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float gv = g[k] * s;
            if (q.weight_decay != 0.0f && q.wd_after_momentum == 0.0f) gv += q.weight_decay * w[k];
            if (mom) {
                m[k] = first ? gv : q.momentum * m[k] + (1.0f - q.dampening) * gv;
                gv = q.nesterov != 0.0f ? gv + q.momentum * m[k] : m[k];
            }
            if (q.weight_decay != 0.0f && q.wd_after_momentum != 0.0f) gv += q.weight_decay * w[k];
            w[k] = w[k] - q.lr * gv;
        }
        if (mom) st4<float>(te.p[2], i, end, vec, m);
        st4<P>(te.p[1], i, end, vec, w);
        if (te.p[5]) st4<C>(te.p[5], i, end, vec, w);
    }
}

template <typename G, typename P, typename C>
__device__ void adam(const TEnt* tens, const CEnt* chunks, const float* found, const float* mult,
                     const float* steps, const AdamHyper* qp) {
    if (found && *found != 0.0f) return;
    const float s = mult ? *mult : 1.0f;
    const AdamHyper q = *qp;
    const TEnt& t0 = tens[chunks[blockIdx.x].t];
    const float step = steps[t0.slot] + 1.0f;
    const float bc1 = bias_corr(q.bias_correction, q.beta1, step);
    const float bc2_sqrt = sqrtf(bias_corr(q.bias_correction, q.beta2, step));
    const float step_size = q.lr / bc1;
    MT_LOOP(tens, chunks) {
        const bool amsgrad = te.p[4] != 0;
        float g[4], w[4], m[4], v[4], vm[4];
        ld4<G>(te.p[0], i, end, vec, g);
        ld4<P>(te.p[1], i, end, vec, w);
        ld4<float>(te.p[2], i, end, vec, m);
        ld4<float>(te.p[3], i, end, vec, v);
        if (amsgrad) ld4<float>(te.p[4], i, end, vec, vm);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float gv = g[k] * s;
            float wv = w[k];
            if (q.adamw == 0.0f && q.weight_decay != 0.0f) gv += q.weight_decay * wv;
            m[k] = q.beta1 * m[k] + (1.0f - q.beta1) * gv;
            v[k] = q.beta2 * v[k] + (1.0f - q.beta2) * gv * gv;
            float vd = v[k];
            if (amsgrad) {
                vm[k] = fmaxf(vm[k], v[k]);
                vd = vm[k];
            }
            if (q.adamw != 0.0f && q.weight_decay != 0.0f) wv -= q.lr * q.weight_decay * wv;
            float denom = sqrtf(vd) / bc2_sqrt + q.eps;
            w[k] = wv - step_size * (m[k] / denom);
        }
        st4<float>(te.p[2], i, end, vec, m);
        st4<float>(te.p[3], i, end, vec, v);
        if (amsgrad) st4<float>(te.p[4], i, end, vec, vm);
        st4<P>(te.p[1], i, end, vec, w);
        if (te.p[5]) st4<C>(te.p[5], i, end, vec, w);
    }
}

// Phase 1: moments and the raw update u = (m/bc1)/(sqrt(v/bc2)+eps) + wd·p into p[4] (FP32).
template <typename G, typename P>
__device__ void lamb_update(const TEnt* tens, const CEnt* chunks, const float* found, const float* mult,
                            const float* steps, const float* gnorm, const LambHyper* qp) {
    if (found && *found != 0.0f) return;
    const float s = mult ? *mult : 1.0f;
    const LambHyper q = *qp;
    const float gn = *gnorm;
    const float clip = (q.max_grad_norm > 0.0f && gn > q.max_grad_norm) ? gn / q.max_grad_norm : 1.0f;
    const TEnt& t0 = tens[chunks[blockIdx.x].t];
    const float step = steps[t0.slot] + 1.0f;
    const float bc1 = bias_corr(q.bias_correction, q.beta1, step);
    const float bc2 = bias_corr(q.bias_correction, q.beta2, step);
    MT_LOOP(tens, chunks) {
        float g[4], w[4], m[4], v[4], u[4];
        ld4<G>(te.p[0], i, end, vec, g);
        ld4<P>(te.p[1], i, end, vec, w);
        ld4<float>(te.p[2], i, end, vec, m);
        ld4<float>(te.p[3], i, end, vec, v);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float gv = g[k] * s / clip;
            m[k] = q.beta1 * m[k] + q.beta3 * gv;
            v[k] = q.beta2 * v[k] + (1.0f - q.beta2) * gv * gv;
            u[k] = (m[k] / bc1) / (sqrtf(v[k] / bc2) + q.eps) + q.weight_decay * w[k];
        }
        st4<float>(te.p[2], i, end, vec, m);
        st4<float>(te.p[3], i, end, vec, v);
        st4<float>(te.p[4], i, end, vec, u);
    }
}

// Phase 2: p −= lr·ratio·u, ratio = ‖p‖/‖u‖ per tensor (1 when off or either is 0). The rows
// are phase 1's (one cached table): u is p[4].
template <typename P, typename C>
__device__ void lamb_apply(const TEnt* tens, const CEnt* chunks, const float* found, const float* pnorm,
                           const float* unorm, const LambHyper* qp) {
    if (found && *found != 0.0f) return;
    const LambHyper q = *qp;
    MT_LOOP(tens, chunks) {
        const float pn = pnorm[te.slot], un = unorm[te.slot];
        const float ratio = (q.use_ratio != 0.0f && pn != 0.0f && un != 0.0f) ? pn / un : 1.0f;
        float u[4], w[4];
        ld4<float>(te.p[4], i, end, vec, u);
        ld4<P>(te.p[1], i, end, vec, w);
#pragma unroll
        for (int k = 0; k < 4; k++) w[k] = w[k] - q.lr * ratio * u[k];
        st4<P>(te.p[1], i, end, vec, w);
        if (te.p[5]) st4<C>(te.p[5], i, end, vec, w);
    }
}

template <typename G, typename P, typename C>
__device__ void novograd(const TEnt* tens, const CEnt* chunks, const float* found, const float* mult,
                         const float* steps, const float* vs, const NovoGradHyper* qp) {
    if (found && *found != 0.0f) return;
    const float s = mult ? *mult : 1.0f;
    const NovoGradHyper q = *qp;
    MT_LOOP(tens, chunks) {
        const float step = steps[te.slot] + 1.0f;
        const float bc1 = bias_corr(q.bias_correction, q.beta1, step);
        const float bc2 = bias_corr(q.bias_correction, q.beta2, step);
        const float denom = sqrtf(vs[te.slot] / bc2) + q.eps;
        float g[4], w[4], m[4];
        ld4<G>(te.p[0], i, end, vec, g);
        ld4<P>(te.p[1], i, end, vec, w);
        ld4<float>(te.p[2], i, end, vec, m);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float gv = g[k] * s;
            if (q.reg_inside_moment != 0.0f) {
                m[k] = q.beta1 * m[k] + q.beta3 * (gv / denom + q.weight_decay * w[k]);
                w[k] = w[k] - q.lr * (m[k] / bc1);
            } else {
                m[k] = q.beta1 * m[k] + q.beta3 * gv;
                w[k] = w[k] - q.lr * ((m[k] / bc1) / denom + q.weight_decay * w[k]);
            }
        }
        st4<float>(te.p[2], i, end, vec, m);
        st4<P>(te.p[1], i, end, vec, w);
        if (te.p[5]) st4<C>(te.p[5], i, end, vec, w);
    }
}

// v[slot] ← first ? n² : β2·v + (1−β2)·n², n = norms[slot]; one thread per table entry.
extern "C" __global__ void novograd_moment(const TEnt* tens, u64 nt, const float* found, const float* steps,
                                           float* vs, const float* norms, const NovoGradHyper* qp) {
    if (found && *found != 0.0f) return;
    const float beta2 = qp->beta2;
    for (u64 t = threadIdx.x; t < nt; t += blockDim.x) {
        const u64 sl = tens[t].slot;
        const float n2 = norms[sl] * norms[sl];
        vs[sl] = steps[sl] == 0.0f ? n2 : beta2 * vs[sl] + (1.0f - beta2) * n2;
    }
}

// steps[slot] += 1 for each table entry unless the step was skipped.
extern "C" __global__ void step_increment(const TEnt* tens, u64 nt, const float* found, float* steps) {
    if (found && *found != 0.0f) return;
    for (u64 t = threadIdx.x; t < nt; t += blockDim.x) steps[tens[t].slot] += 1.0f;
}

#define GPC(M, GN, G, PN, P) M(GN, G, PN, P, f32, float) M(GN, G, PN, P, f16, f16) M(GN, G, PN, P, bf16, bf16)
#define GP(M, GN, G) GPC(M, GN, G, f32, float) GPC(M, GN, G, f16, f16) GPC(M, GN, G, bf16, bf16)
#define ALL3(M) GP(M, f32, float) GP(M, f16, f16) GP(M, bf16, bf16)

#define SGD(GN, G, PN, P, CN, C) \
    extern "C" __global__ void sgd_##GN##_##PN##_##CN(const TEnt* t, const CEnt* c, const float* f, const float* m, const float* s, const SgdHyper* q) { sgd<G, P, C>(t, c, f, m, s, q); }
ALL3(SGD)
#define ADAM(GN, G, PN, P, CN, C) \
    extern "C" __global__ void adam_##GN##_##PN##_##CN(const TEnt* t, const CEnt* c, const float* f, const float* m, const float* s, const AdamHyper* q) { adam<G, P, C>(t, c, f, m, s, q); }
ALL3(ADAM)
#define NOVO(GN, G, PN, P, CN, C) \
    extern "C" __global__ void novograd_##GN##_##PN##_##CN(const TEnt* t, const CEnt* c, const float* f, const float* m, const float* s, const float* v, const NovoGradHyper* q) { novograd<G, P, C>(t, c, f, m, s, v, q); }
ALL3(NOVO)

#define LAMB_U(GN, G, PN, P) \
    extern "C" __global__ void lamb_update_##GN##_##PN(const TEnt* t, const CEnt* c, const float* f, const float* m, const float* s, const float* gn, const LambHyper* q) { lamb_update<G, P>(t, c, f, m, s, gn, q); }
#define LAMB_U_P(GN, G) LAMB_U(GN, G, f32, float) LAMB_U(GN, G, f16, f16) LAMB_U(GN, G, bf16, bf16)
LAMB_U_P(f32, float)
LAMB_U_P(f16, f16)
LAMB_U_P(bf16, bf16)

#define LAMB_A(PN, P, CN, C) \
    extern "C" __global__ void lamb_apply_##PN##_##CN(const TEnt* t, const CEnt* c, const float* f, const float* pn, const float* un, const LambHyper* q) { lamb_apply<P, C>(t, c, f, pn, un, q); }
#define LAMB_A_P(PN, P) LAMB_A(PN, P, f32, float) LAMB_A(PN, P, f16, f16) LAMB_A(PN, P, bf16, bf16)
LAMB_A_P(f32, float)
LAMB_A_P(f16, f16)
LAMB_A_P(bf16, bf16)
