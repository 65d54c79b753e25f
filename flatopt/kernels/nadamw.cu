// Fused NAdamW step (torch.optim.NAdam with momentum_decay=inf, decoupled_weight_decay=True), one pass.
// Twin: flatopt/nadamw.py `update` -- the same operations in the same order, each rounded to T
// (compiled with --fmad=false), hence bit-identical results.
//   p <- p * decay                          (when weight decay != 0)
//   m <- m + (g - m) * (1 - beta1);  v <- v * beta2 + (g * (1 - beta2)) * g
//   d = sqrt(v / bc2) + eps
//   p <- p + (g / d) * c_g;  p <- p + (m / d) * c_m
// Both kernels below apply this one element function, so the multi-tensor kernel is the per-tensor kernel's bits.
#include "multi_tensor.cuh"

template <typename T>
__device__ __forceinline__ void nadamw_elem(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                                            T* __restrict__ v, const long long i, const T decay,
                                            const T one_minus_beta1, const T beta2, const T one_minus_beta2,
                                            const T bc2, const T eps, const T c_g, const T c_m, const int decayed) {
  const T gi = g[i];
  T pi = p[i];
  if (decayed) pi = pi * decay;
  T mi = m[i];
  mi = mi + (gi - mi) * one_minus_beta1;
  T vi = v[i];
  vi = vi * beta2 + (gi * one_minus_beta2) * gi;
  const T d = sqrt(vi / bc2) + eps;
  pi = pi + (gi / d) * c_g;
  pi = pi + (mi / d) * c_m;
  m[i] = mi;
  v[i] = vi;
  p[i] = pi;
}

template <typename T>
__global__ void nadamw_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                            T* __restrict__ v, const long long n, const T decay,
                            const T one_minus_beta1, const T beta2, const T one_minus_beta2,
                            const T bc2, const T eps, const T c_g, const T c_m, const int decayed) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    nadamw_elem(p, g, m, v, i, decay, one_minus_beta1, beta2, one_minus_beta2, bc2, eps, c_g, c_m, decayed);
  }
}

// Multi-tensor NAdamW (multi_tensor.cuh): rows (p, g, m, v, n); one step count per launch.  With lr = base_lr *
// lr_scale, in double as flatopt/nadamw.py `_scalars` (omb1_d = 1 - beta1, bc1 = 1 - beta1^t, bc1_next =
// 1 - beta1^(t+1) from the host): decay = 1 - lr * weight_decay, c_g = -lr * omb1_d / bc1,
// c_m = -lr * beta1 / bc1_next, each then rounded to T.
template <typename T>
__global__ void nadamw_multi(const long long* __restrict__ tensors, const long long* __restrict__ blocks,
                             const double* __restrict__ scales, const long long chunk, const double base_lr,
                             const double weight_decay, const double beta1_d, const double omb1_d,
                             const double bc1, const double bc1_next, const T one_minus_beta1, const T beta2,
                             const T one_minus_beta2, const T bc2, const T eps, const int decayed) {
  const MtChunk c = mt_chunk(tensors, blocks, 5, chunk);
  const double lr = base_lr * scales[c.ti];
  const T decay = (T)(1.0 - lr * weight_decay);
  const T c_g = (T)(-lr * omb1_d / bc1);
  const T c_m = (T)(-lr * beta1_d / bc1_next);
  T* p = mt_ptr<T>(c, 0);
  const T* g = mt_ptr<const T>(c, 1);
  T* m = mt_ptr<T>(c, 2);
  T* v = mt_ptr<T>(c, 3);
  for (long long i = c.lo + threadIdx.x; i < c.hi; i += blockDim.x) {
    nadamw_elem(p, g, m, v, i, decay, one_minus_beta1, beta2, one_minus_beta2, bc2, eps, c_g, c_m, decayed);
  }
}
