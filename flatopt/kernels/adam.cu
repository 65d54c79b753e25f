// Fused Adam step (torch.optim.Adam semantics: L2 weight decay folded into the gradient), one pass.
// Twin: flatopt/adam.py `update` -- the same operations in the same order, each rounded to T
// (compiled with --fmad=false so no multiply-add is contracted), hence bit-identical results.
//   g' <- g + p * wd                       (when wd != 0)
//   m <- m + (g' - m) * (1 - beta1)        (torch's lerp for weight < 0.5)
//   v <- v * beta2 + (g' * (1 - beta2)) * g'
//   vmax <- max(vmax, v) when amsgrad (NaN propagates as in numpy.maximum)
//   p <- p + (m / (sqrt(v or vmax) / bc2_sqrt + eps)) * neg_step_size
// Both kernels below apply this one element function, so the multi-tensor kernel is the per-tensor kernel's bits.
#include "adam_core.cuh"
#include "multi_tensor.cuh"

template <typename T>
__device__ __forceinline__ void adam_l2_elem(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                                             T* __restrict__ v, T* __restrict__ vmax, const long long i,
                                             const T wd, const T one_minus_beta1, const T beta2,
                                             const T one_minus_beta2, const T bc2_sqrt, const T eps,
                                             const T neg_step_size, const int amsgrad) {
  const T pi = p[i];
  T gi = g[i];
  if (wd != T(0)) gi = gi + pi * wd;
  adam_elem(pi, gi, p, m, v, vmax, i, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size,
            amsgrad);
}

template <typename T>
__global__ void adam_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                          T* __restrict__ v, T* __restrict__ vmax, const long long n,
                          const T wd, const T one_minus_beta1, const T beta2,
                          const T one_minus_beta2, const T bc2_sqrt, const T eps,
                          const T neg_step_size, const int amsgrad) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    adam_l2_elem(p, g, m, v, vmax, i, wd, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size,
                 amsgrad);
  }
}

// Multi-tensor Adam (multi_tensor.cuh): rows (p, g, m, v, vmax, n); one step count per launch (bc1 = 1 - beta1^t
// in double, from the host); neg_step_size = -(lr / bc1) with lr = base_lr * lr_scale, in double as
// flatopt/adam.py `_scalars`, then rounded to T.
template <typename T>
__global__ void adam_multi(const long long* __restrict__ tensors, const long long* __restrict__ blocks,
                           const double* __restrict__ scales, const long long chunk, const double base_lr,
                           const double bc1, const T wd, const T one_minus_beta1, const T beta2,
                           const T one_minus_beta2, const T bc2_sqrt, const T eps, const int amsgrad) {
  const MtChunk c = mt_chunk(tensors, blocks, 6, chunk);
  const T neg_step_size = (T)(-((base_lr * scales[c.ti]) / bc1));
  T* p = mt_ptr<T>(c, 0);
  const T* g = mt_ptr<const T>(c, 1);
  T* m = mt_ptr<T>(c, 2);
  T* v = mt_ptr<T>(c, 3);
  T* vmax = mt_ptr<T>(c, 4);
  for (long long i = c.lo + threadIdx.x; i < c.hi; i += blockDim.x) {
    adam_l2_elem(p, g, m, v, vmax, i, wd, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size,
                 amsgrad);
  }
}
