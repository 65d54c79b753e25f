// Fused Lion step (lion-pytorch Lion semantics), one pass.
// Twin: flatopt/lion.py `update` -- the same operations in the same order, each rounded to T
// (compiled with --fmad=false), hence bit-identical results.
//   p <- p * decay                                   (when weight decay != 0)
//   c = m * beta1 + g * (1 - beta1)
//   p <- p + sign(c) * neg_lr                        (sign(+-0) = +0, sign(NaN) = NaN, as numpy.sign)
//   m <- m * beta2 + g * (1 - beta2)
// Both kernels below apply this one element function, so the multi-tensor kernel is the per-tensor kernel's bits.
#include "multi_tensor.cuh"

template <typename T>
__device__ __forceinline__ void lion_elem(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                                          const long long i, const T decay, const T beta1,
                                          const T one_minus_beta1, const T beta2, const T one_minus_beta2,
                                          const T neg_lr, const int decayed) {
  const T gi = g[i];
  T pi = p[i];
  if (decayed) pi = pi * decay;
  const T mi = m[i];
  const T c = mi * beta1 + gi * one_minus_beta1;
  const T sg = c > T(0) ? T(1) : (c < T(0) ? T(-1) : (isnan(c) ? c : T(0)));
  pi = pi + sg * neg_lr;
  m[i] = mi * beta2 + gi * one_minus_beta2;
  p[i] = pi;
}

template <typename T>
__global__ void lion_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                          const long long n, const T decay, const T beta1,
                          const T one_minus_beta1, const T beta2, const T one_minus_beta2,
                          const T neg_lr, const int decayed) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    lion_elem(p, g, m, i, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr, decayed);
  }
}

// Multi-tensor Lion (multi_tensor.cuh): rows (p, g, m, n).  With lr = base_lr * lr_scale, in double as
// flatopt/lion.py `_scalars`: decay = 1 - lr * weight_decay, neg_lr = -lr, each then rounded to T.
template <typename T>
__global__ void lion_multi(const long long* __restrict__ tensors, const long long* __restrict__ blocks,
                           const double* __restrict__ scales, const long long chunk, const double base_lr,
                           const double weight_decay, const T beta1, const T one_minus_beta1, const T beta2,
                           const T one_minus_beta2, const int decayed) {
  const MtChunk c = mt_chunk(tensors, blocks, 4, chunk);
  const double lr = base_lr * scales[c.ti];
  const T decay = (T)(1.0 - lr * weight_decay);
  const T neg_lr = (T)(-lr);
  T* p = mt_ptr<T>(c, 0);
  const T* g = mt_ptr<const T>(c, 1);
  T* m = mt_ptr<T>(c, 2);
  for (long long i = c.lo + threadIdx.x; i < c.hi; i += blockDim.x) {
    lion_elem(p, g, m, i, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr, decayed);
  }
}
