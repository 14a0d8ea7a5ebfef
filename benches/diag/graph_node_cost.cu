// What a CUDA-graph node costs on replay, by kind: a chain of N small kernels alone, with a
// stream-ordered allocation and free around each (graph memory nodes, what cuMemAllocAsync
// inside a capture records), and with a memset before each. Diagnostic for issue 16
// (`nvcc -O2 -arch=sm_90 graph_node_cost.cu -o graph_node_cost`; one JSON line per variant).
#include <cstdio>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

__global__ void touch(float* p, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = p[i] * 0.5f + 1.0f;
}

int main() {
  const int N = 300;
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int elems : {1024, 262144}) {
    float* fixed; CK(cudaMalloc(&fixed, sizeof(float) * elems * N));
    int blocks = (elems + 255) / 256;
    for (int variant = 0; variant < 4; ++variant) {
      cudaGraph_t g; cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      for (int k = 0; k < N; ++k) {
        float* p = fixed + (size_t)k * elems;
        if (variant == 1) CK(cudaMallocAsync((void**)&p, sizeof(float) * elems, s));
        if (variant == 2) CK(cudaMemsetAsync(p, 0, sizeof(float) * elems, s));
        if (variant == 3) { CK(cudaMallocAsync((void**)&p, sizeof(float) * elems, s)); CK(cudaMemsetAsync(p, 0, sizeof(float) * elems, s)); }
        touch<<<blocks, 256, 0, s>>>(p, elems);
        if (variant == 1 || variant == 3) CK(cudaFreeAsync(p, s));
      }
      CK(cudaStreamEndCapture(s, &g));
      size_t nodes = 0; CK(cudaGraphGetNodes(g, nullptr, &nodes));
      CK(cudaGraphInstantiate(&ge, g, 0));
      CK(cudaGraphUpload(ge, s));
      for (int w = 0; w < 20; ++w) CK(cudaGraphLaunch(ge, s));
      CK(cudaStreamSynchronize(s));
      cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
      const int R = 200;
      CK(cudaEventRecord(a, s));
      for (int r = 0; r < R; ++r) CK(cudaGraphLaunch(ge, s));
      CK(cudaEventRecord(b, s));
      CK(cudaEventSynchronize(b));
      float ms; cudaEventElapsedTime(&ms, a, b);
      const char* names[] = {"kernels", "kernels+alloc/free", "kernels+memset", "kernels+alloc+memset+free"};
      printf("{\"check\": \"graph-node-cost\", \"elems\": %d, \"variant\": \"%s\", \"nodes\": %zu, \"replay_us\": %.1f, \"us_per_kernel\": %.3f}\n",
             elems, names[variant], nodes, 1000.0 * ms / R, 1000.0 * ms / R / N);
      cudaEventDestroy(a); cudaEventDestroy(b);
      cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
    }
    cudaFree(fixed);
  }
  return 0;
}
