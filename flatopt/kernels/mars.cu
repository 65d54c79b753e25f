// Fused Mars step.  Twin: flatopt/mars.py `update` (with flatopt/core/blocks.py `sq_sum`), bit-identical: every
// operation is the twin's, in the twin's order, rounded to T (compiled with --fmad=false), and the sum of squares
// of the corrected gradient adds in the twin's blocked order (core/blocks.py documents it).  On the current stream,
// no host synchronisation, no atomics; with clip_c three launches, else one:
//   mars_c_partials (sq_blocks(n) blocks of SQ_THREADS): c = g + (g - g_prev) * coef; the block partials of sum c^2
//   mars_clip       (1 block): folds them; scal[0] = max(sqrt(sum c^2), 1) (NaN propagates, as numpy.maximum)
//   mars_step       (elementwise): c again (the same bits), c / scal[0] when clipping; m, v; p * decay; the Adam
//                   step; g_prev <- g
// The multi-tensor kernels (core/multi_tensor.py, `Norms`) make the same passes for a whole group of tensors in as
// many launches: mars_partials_multi (one block per (tensor, c) segment), mars_clip_multi (one block per tensor),
// mars_multi (one block per chunk); each pass calls the per-tensor pass's device function with the tensor's own nb,
// so every partial, fold and element has the per-tensor kernel's bits.
// Every kernel must be launched with blockDim.x == SQ_THREADS.
#include "multi_tensor.cuh"
#include "sq_sum.cuh"

template <typename T>
__device__ __forceinline__ T mars_c(const T gi, const T gpi, const T coef) {
  return gi + (gi - gpi) * coef;
}

// Block c of the nb blocks of the first pass over one tensor: the partial of sum c^2 -> *part.
template <typename T>
__device__ void mars_c_block(const T* __restrict__ g, const T* __restrict__ g_prev, const long long n,
                             const long long nb, const long long c, const T coef, T* sh, T* __restrict__ part) {
  const long long stride = nb * SQ_THREADS;
  T s = 0;
  for (long long i = sq_column(nb, c); i < n; i += stride) {
    const T ci = mars_c(g[i], g_prev[i], coef);
    s += ci * ci;
  }
  s = sq_block(s, sh);
  if (threadIdx.x == 0) *part = s;
}

// One block: folds the nb partials; *scal = max(sqrt(sum c^2), 1).
template <typename T>
__device__ void mars_clip_block(const T* __restrict__ parts, const long long nb, T* sh, T* __restrict__ scal) {
  const T ss = sq_fold(parts, nb, sh);
  if (threadIdx.x == 0) {
    const T d = sqrt(ss);
    *scal = (isnan(d) || d >= (T)1) ? d : (T)1;
  }
}

template <typename T>
__device__ __forceinline__ void mars_elem(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ g_prev,
                                          T* __restrict__ m, T* __restrict__ v, const long long i, const T coef,
                                          const T one_minus_beta1, const T beta2, const T one_minus_beta2,
                                          const T decay, const T bc2_sqrt, const T eps, const T neg_step_size,
                                          const int has_wd, const int clip, const T d) {
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

template <typename T>
__global__ void mars_c_partials(const T* __restrict__ g, const T* __restrict__ g_prev, const long long n,
                                const T coef, T* __restrict__ parts) {
  __shared__ T sh[SQ_THREADS];
  mars_c_block(g, g_prev, n, (long long)gridDim.x, (long long)blockIdx.x, coef, sh, parts + blockIdx.x);
}

template <typename T>
__global__ void mars_clip(const T* __restrict__ parts, const long long nb, T* __restrict__ scal) {
  __shared__ T sh[SQ_THREADS];
  mars_clip_block(parts, nb, sh, scal);
}

template <typename T>
__global__ void mars_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ g_prev, T* __restrict__ m,
                          T* __restrict__ v, const long long n, const T coef, const T one_minus_beta1,
                          const T beta2, const T one_minus_beta2, const T decay, const T bc2_sqrt, const T eps,
                          const T neg_step_size, const int has_wd, const int clip, const T* __restrict__ scal) {
  const T d = clip ? scal[0] : (T)1;
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    mars_elem(p, g, g_prev, m, v, i, coef, one_minus_beta1, beta2, one_minus_beta2, decay, bc2_sqrt, eps,
              neg_step_size, has_wd, clip, d);
  }
}

// Multi-tensor Mars (multi_tensor.cuh): rows (p, g, g_prev, m, v, n); one step count per launch (bc1 = 1 - beta1^t
// in double from the host).  scal[ti] is tensor ti's clip divisor.  With lr = base_lr * lr_scale, in double as
// flatopt/mars.py `_scalars`: decay = 1 - lr * weight_decay, neg_step_size = -(lr / bc1), each then rounded to T.
template <typename T>
__global__ void mars_partials_multi(const long long* __restrict__ tensors, const long long* __restrict__ segs,
                                    const long long* __restrict__ spans, const long long nparts,
                                    T* __restrict__ parts, const T coef) {
  __shared__ T sh[SQ_THREADS];
  const MtSegment s = mt_segment(tensors, segs, spans, 6);
  mars_c_block(mt_ptr<const T>(s, 1), mt_ptr<const T>(s, 2), s.n, s.nb, s.c, coef, sh, parts + s.off + s.c);
}

template <typename T>
__global__ void mars_clip_multi(const long long* __restrict__ spans, const double* __restrict__ scales,
                                const long long nparts, const double base_lr, const T* __restrict__ parts,
                                T* __restrict__ scal) {
  __shared__ T sh[SQ_THREADS];
  const long long ti = blockIdx.x;
  mars_clip_block(parts + spans[2 * ti], spans[2 * ti + 1], sh, scal + ti);
}

template <typename T>
__global__ void mars_multi(const long long* __restrict__ tensors, const long long* __restrict__ blocks,
                           const double* __restrict__ scales, const long long chunk, const double base_lr,
                           const double weight_decay, const double bc1, const T coef, const T one_minus_beta1,
                           const T beta2, const T one_minus_beta2, const T bc2_sqrt, const T eps, const int has_wd,
                           const int clip, const T* __restrict__ scal) {
  const MtChunk c = mt_chunk(tensors, blocks, 6, chunk);
  const double lr = base_lr * scales[c.ti];
  const T decay = (T)(1.0 - lr * weight_decay);
  const T neg_step_size = (T)(-(lr / bc1));
  const T d = clip ? scal[c.ti] : (T)1;
  T* p = mt_ptr<T>(c, 0);
  const T* g = mt_ptr<const T>(c, 1);
  T* g_prev = mt_ptr<T>(c, 2);
  T* m = mt_ptr<T>(c, 3);
  T* v = mt_ptr<T>(c, 4);
  for (long long i = c.lo + threadIdx.x; i < c.hi; i += blockDim.x) {
    mars_elem(p, g, g_prev, m, v, i, coef, one_minus_beta1, beta2, one_minus_beta2, decay, bc2_sqrt, eps,
              neg_step_size, has_wd, clip, d);
  }
}
