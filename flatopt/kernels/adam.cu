// Fused Adam step (torch.optim.Adam semantics: L2 weight decay folded into the gradient), one pass.
// Twin: flatopt/adam.py `update` -- the same operations in the same order, each rounded to T
// (compiled with --fmad=false so no multiply-add is contracted), hence bit-identical results.
//   g' <- g + p * wd                       (when wd != 0)
//   m <- m + (g' - m) * (1 - beta1)        (torch's lerp for weight < 0.5)
//   v <- v * beta2 + (g' * (1 - beta2)) * g'
//   vmax <- max(vmax, v) when amsgrad (NaN propagates as in numpy.maximum)
//   p <- p + (m / (sqrt(v or vmax) / bc2_sqrt + eps)) * neg_step_size
#include "adam_core.cuh"

template <typename T>
__global__ void adam_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                          T* __restrict__ v, T* __restrict__ vmax, const long long n,
                          const T wd, const T one_minus_beta1, const T beta2,
                          const T one_minus_beta2, const T bc2_sqrt, const T eps,
                          const T neg_step_size, const int amsgrad) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T pi = p[i];
    T gi = g[i];
    if (wd != T(0)) gi = gi + pi * wd;
    adam_elem(pi, gi, p, m, v, vmax, i, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size,
              amsgrad);
  }
}
