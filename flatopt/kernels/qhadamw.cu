// Fused QHAdamW step (qhoptim QHAdamW semantics, raw moments debiased by host scalars), one pass.
// Twin: flatopt/qhadamw.py `update` -- the same operations in the same order, each rounded to T
// (compiled with --fmad=false), hence bit-identical results.
//   p <- p * decay                                      (flags & 1)
//   m <- m + (g - m) * (1 - beta1);  v <- v * beta2 + (g * (1 - beta2)) * g
//   num = m * c_m [+ g * c_g]                           (flags & 2: nu1 != 1)
//   den = sqrt(v * c_v [+ (g * c_gg) * g]) + eps        (flags & 4: nu2 != 1)
//   p <- p + (num / den) * neg_lr
// Both kernels below apply this one element function, so the multi-tensor kernel is the per-tensor kernel's bits.
#include "multi_tensor.cuh"

template <typename T>
__device__ __forceinline__ void qhadamw_elem(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                                             T* __restrict__ v, const long long i, const T decay,
                                             const T one_minus_beta1, const T beta2, const T one_minus_beta2,
                                             const T c_m, const T c_g, const T c_v, const T c_gg, const T eps,
                                             const T neg_lr, const int flags) {
  const T gi = g[i];
  T pi = p[i];
  if (flags & 1) pi = pi * decay;
  T mi = m[i];
  mi = mi + (gi - mi) * one_minus_beta1;
  T vi = v[i];
  vi = vi * beta2 + (gi * one_minus_beta2) * gi;
  T num = mi * c_m;
  if (flags & 2) num = num + gi * c_g;
  T den = vi * c_v;
  if (flags & 4) den = den + (gi * c_gg) * gi;
  den = sqrt(den) + eps;
  pi = pi + (num / den) * neg_lr;
  m[i] = mi;
  v[i] = vi;
  p[i] = pi;
}

template <typename T>
__global__ void qhadamw_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                             T* __restrict__ v, const long long n, const T decay,
                             const T one_minus_beta1, const T beta2, const T one_minus_beta2,
                             const T c_m, const T c_g, const T c_v, const T c_gg, const T eps,
                             const T neg_lr, const int flags) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    qhadamw_elem(p, g, m, v, i, decay, one_minus_beta1, beta2, one_minus_beta2, c_m, c_g, c_v, c_gg, eps, neg_lr,
                 flags);
  }
}

// Multi-tensor QHAdamW (multi_tensor.cuh): rows (p, g, m, v, n); one step count per launch (c_m, c_v from the
// host).  With lr = base_lr * lr_scale, in double as flatopt/qhadamw.py `_scalars`: decay = 1 - lr *
// weight_decay, neg_lr = -lr, each then rounded to T.
template <typename T>
__global__ void qhadamw_multi(const long long* __restrict__ tensors, const long long* __restrict__ blocks,
                              const double* __restrict__ scales, const long long chunk, const double base_lr,
                              const double weight_decay, const T one_minus_beta1, const T beta2,
                              const T one_minus_beta2, const T c_m, const T c_g, const T c_v, const T c_gg,
                              const T eps, const int flags) {
  const MtChunk c = mt_chunk(tensors, blocks, 5, chunk);
  const double lr = base_lr * scales[c.ti];
  const T decay = (T)(1.0 - lr * weight_decay);
  const T neg_lr = (T)(-lr);
  T* p = mt_ptr<T>(c, 0);
  const T* g = mt_ptr<const T>(c, 1);
  T* m = mt_ptr<T>(c, 2);
  T* v = mt_ptr<T>(c, 3);
  for (long long i = c.lo + threadIdx.x; i < c.hi; i += blockDim.x) {
    qhadamw_elem(p, g, m, v, i, decay, one_minus_beta1, beta2, one_minus_beta2, c_m, c_g, c_v, c_gg, eps, neg_lr,
                 flags);
  }
}
