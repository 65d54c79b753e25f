// Fused RAdam step (torch.optim.RAdam semantics), one pass.
// Twin: flatopt/radam.py `update` -- the same operations in the same order, each rounded to T
// (compiled with --fmad=false), hence bit-identical results.  `rect` and `factor` are host scalars of t.
//   mode 1 (L2):        g' <- g + p * wd
//   mode 2 (decoupled): p <- p * decay
//   m <- m + (g' - m) * (1 - beta1);  v <- v * beta2 + (g' * (1 - beta2)) * g'
//   rect:  p <- p + (m / (sqrt(v) + eps)) * factor;   otherwise  p <- p + m * factor
// Both kernels below apply this one element function, so the multi-tensor kernel is the per-tensor kernel's bits.
#include "multi_tensor.cuh"

template <typename T>
__device__ __forceinline__ void radam_elem(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                                           T* __restrict__ v, const long long i, const T wd, const T decay,
                                           const T one_minus_beta1, const T beta2, const T one_minus_beta2,
                                           const T eps, const T factor, const int mode, const int rect) {
  T pi = p[i];
  T gi = g[i];
  if (mode == 1) gi = gi + pi * wd;
  if (mode == 2) pi = pi * decay;
  T mi = m[i];
  mi = mi + (gi - mi) * one_minus_beta1;
  T vi = v[i];
  vi = vi * beta2 + (gi * one_minus_beta2) * gi;
  const T u = rect ? mi / (sqrt(vi) + eps) : mi;
  pi = pi + u * factor;
  m[i] = mi;
  v[i] = vi;
  p[i] = pi;
}

template <typename T>
__global__ void radam_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                           T* __restrict__ v, const long long n, const T wd, const T decay,
                           const T one_minus_beta1, const T beta2, const T one_minus_beta2,
                           const T eps, const T factor, const int mode, const int rect) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    radam_elem(p, g, m, v, i, wd, decay, one_minus_beta1, beta2, one_minus_beta2, eps, factor, mode, rect);
  }
}

// Multi-tensor RAdam (multi_tensor.cuh): rows (p, g, m, v, n); one step count per launch (rect, r, sqrt_bc2 =
// sqrt(1 - beta2^t) and bc1 = 1 - beta1^t in double from the host).  With lr = base_lr * lr_scale, in double as
// flatopt/radam.py `_scalars`: factor = -lr * r * sqrt_bc2 / bc1 when rect, else -lr / bc1; decay = 1 - lr *
// weight_decay (read in mode 2 only); each then rounded to T.
template <typename T>
__global__ void radam_multi(const long long* __restrict__ tensors, const long long* __restrict__ blocks,
                            const double* __restrict__ scales, const long long chunk, const double base_lr,
                            const double weight_decay, const double r, const double sqrt_bc2, const double bc1,
                            const T wd, const T one_minus_beta1, const T beta2, const T one_minus_beta2,
                            const T eps, const int mode, const int rect) {
  const MtChunk c = mt_chunk(tensors, blocks, 5, chunk);
  const double lr = base_lr * scales[c.ti];
  const T factor = (T)(rect ? -lr * r * sqrt_bc2 / bc1 : -lr / bc1);
  const T decay = (T)(1.0 - lr * weight_decay);
  T* p = mt_ptr<T>(c, 0);
  const T* g = mt_ptr<const T>(c, 1);
  T* m = mt_ptr<T>(c, 2);
  T* v = mt_ptr<T>(c, 3);
  for (long long i = c.lo + threadIdx.x; i < c.hi; i += blockDim.x) {
    radam_elem(p, g, m, v, i, wd, decay, one_minus_beta1, beta2, one_minus_beta2, eps, factor, mode, rect);
  }
}
