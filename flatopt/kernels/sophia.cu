// Fused Sophia step (the official SophiaG with the batch factor folded into h), one pass.
// Twin: flatopt/sophia.py `update` -- the same operations in the same order, each rounded to T
// (compiled with --fmad=false), hence bit-identical results.
//   p <- p * decay                                       (when weight decay != 0)
//   m <- m * beta1 + g * (1 - beta1)
//   ratio = min(|m| / (h * rho + eps), 1)                (NaN propagates, as numpy.minimum)
//   p <- p + (sign(m) * ratio) * neg_lr                  (sign(+-0) = +0, sign(NaN) = NaN, as numpy.sign)
// Both kernels below apply this one element function, so the multi-tensor kernel is the per-tensor kernel's bits.
#include "multi_tensor.cuh"

template <typename T>
__device__ __forceinline__ void sophia_elem(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                                            const T* __restrict__ h, const long long i, const T decay,
                                            const T beta1, const T one_minus_beta1, const T rho, const T eps,
                                            const T neg_lr, const int decayed) {
  T pi = p[i];
  if (decayed) pi = pi * decay;
  const T mi = m[i] * beta1 + g[i] * one_minus_beta1;
  T r = fabs(mi) / (h[i] * rho + eps);
  r = (r > T(1)) ? T(1) : r;
  const T sg = mi > T(0) ? T(1) : (mi < T(0) ? T(-1) : (isnan(mi) ? mi : T(0)));
  pi = pi + (sg * r) * neg_lr;
  m[i] = mi;
  p[i] = pi;
}

template <typename T>
__global__ void sophia_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                            const T* __restrict__ h, const long long n, const T decay,
                            const T beta1, const T one_minus_beta1, const T rho, const T eps,
                            const T neg_lr, const int decayed) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    sophia_elem(p, g, m, h, i, decay, beta1, one_minus_beta1, rho, eps, neg_lr, decayed);
  }
}

// Multi-tensor Sophia (multi_tensor.cuh): rows (p, g, m, h, n); h is read where update_hessian left it (in place:
// its address in the table stays valid).  With lr = base_lr * lr_scale, in double as flatopt/sophia.py
// `_scalars`: decay = 1 - lr * weight_decay, neg_lr = -lr, each then rounded to T.
template <typename T>
__global__ void sophia_multi(const long long* __restrict__ tensors, const long long* __restrict__ blocks,
                             const double* __restrict__ scales, const long long chunk, const double base_lr,
                             const double weight_decay, const T beta1, const T one_minus_beta1, const T rho,
                             const T eps, const int decayed) {
  const MtChunk c = mt_chunk(tensors, blocks, 5, chunk);
  const double lr = base_lr * scales[c.ti];
  const T decay = (T)(1.0 - lr * weight_decay);
  const T neg_lr = (T)(-lr);
  T* p = mt_ptr<T>(c, 0);
  const T* g = mt_ptr<const T>(c, 1);
  T* m = mt_ptr<T>(c, 2);
  const T* h = mt_ptr<const T>(c, 3);
  for (long long i = c.lo + threadIdx.x; i < c.hi; i += blockDim.x) {
    sophia_elem(p, g, m, h, i, decay, beta1, one_minus_beta1, rho, eps, neg_lr, decayed);
  }
}
