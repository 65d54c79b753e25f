// Fused Mars step.  Twin: flatopt/mars.py `update` (with flatopt/core/blocks.py `sq_sum`), bit-identical: every
// operation is the twin's, in the twin's order, rounded to T (compiled with --fmad=false), and the sum of squares
// of the corrected gradient adds in the twin's blocked order (core/blocks.py documents it).  On the current stream,
// no host synchronisation, no atomics; with clip_c three launches, else one:
//   mars_c_partials (sq_blocks(n) blocks of SQ_THREADS): c = g + (g - g_prev) * coef; the block partials of sum c^2
//   mars_clip       (1 block): folds them; scal[0] = max(sqrt(sum c^2), 1) (NaN propagates, as numpy.maximum)
//   mars_step       (elementwise): c again (the same bits), c / scal[0] when clipping; m, v; p * decay; the Adam
//                   step; g_prev <- g
// Every kernel must be launched with blockDim.x == SQ_THREADS.
#include "sq_sum.cuh"

template <typename T>
__device__ __forceinline__ T mars_c(const T gi, const T gpi, const T coef) {
  return gi + (gi - gpi) * coef;
}

template <typename T>
__global__ void mars_c_partials(const T* __restrict__ g, const T* __restrict__ g_prev, const long long n,
                                const T coef, T* __restrict__ parts) {
  __shared__ T sh[SQ_THREADS];
  const long long nb = gridDim.x;
  const long long stride = nb * SQ_THREADS;
  T s = 0;
  for (long long i = sq_column(nb); i < n; i += stride) {
    const T c = mars_c(g[i], g_prev[i], coef);
    s += c * c;
  }
  s = sq_block(s, sh);
  if (threadIdx.x == 0) parts[blockIdx.x] = s;
}

template <typename T>
__global__ void mars_clip(const T* __restrict__ parts, const long long nb, T* __restrict__ scal) {
  __shared__ T sh[SQ_THREADS];
  const T ss = sq_fold(parts, nb, sh);
  if (threadIdx.x == 0) {
    const T d = sqrt(ss);
    scal[0] = (isnan(d) || d >= (T)1) ? d : (T)1;
  }
}

template <typename T>
__global__ void mars_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ g_prev, T* __restrict__ m,
                          T* __restrict__ v, const long long n, const T coef, const T one_minus_beta1,
                          const T beta2, const T one_minus_beta2, const T decay, const T bc2_sqrt, const T eps,
                          const T neg_step_size, const int has_wd, const int clip, const T* __restrict__ scal) {
  const T d = clip ? scal[0] : (T)1;
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T gi = g[i];
    T c = mars_c(gi, g_prev[i], coef);
    if (clip) c = c / d;
    T mi = m[i];
    mi = mi + (c - mi) * one_minus_beta1;
    T vi = v[i];
    vi = vi * beta2 + (c * one_minus_beta2) * c;
    T pi = p[i];
    if (has_wd) pi = pi * decay;
    const T den = sqrt(vi) / bc2_sqrt + eps;
    pi = pi + (mi / den) * neg_step_size;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    g_prev[i] = gi;
  }
}
