// Fused Lamb step.  Twin: flatopt/lamb.py `update` (with flatopt/core/blocks.py `sq_sum`), bit-identical: every
// operation is the twin's, in the twin's order, rounded to T (compiled with --fmad=false), and the two sums of
// squares add in the twin's blocked order (core/blocks.py documents it).  Three launches on the current stream,
// no host synchronisation, no atomics:
//   lamb_moments (sq_blocks(n) blocks of SQ_THREADS): m, v; u = (m / bc1) / (sqrt(v / bc2) + eps) + p * wd;
//                the block partials of sum p^2 and sum u^2 -> parts[c], parts[nb + c]
//   lamb_ratio   (1 block): folds both; scal[0] = r * (-lr), r = phi / psi where phi > 0 and psi > 0, else 1
//   lamb_apply   (elementwise): recomputes u from the new m, v and the unchanged p (the same bits as pass 1);
//                p <- p + u * scal[0]
// The multi-tensor kernels (core/multi_tensor.py, `Norms`) make the same three passes for a whole group of tensors
// in three launches: lamb_partials_multi (one block per (tensor, c) segment), lamb_ratio_multi (one block per
// tensor), lamb_apply_multi (one block per chunk); each pass calls the per-tensor pass's device function with the
// tensor's own nb, so every partial, fold and element has the per-tensor kernel's bits.
// Every kernel must be launched with blockDim.x == SQ_THREADS.
#include "multi_tensor.cuh"
#include "sq_sum.cuh"

template <typename T>
__device__ __forceinline__ T lamb_u(const T mi, const T vi, const T pi, const T bc1, const T bc2, const T eps,
                                    const T wd, const int has_wd) {
  const T den = sqrt(vi / bc2) + eps;
  T u = (mi / bc1) / den;
  if (has_wd) u = u + pi * wd;
  return u;
}

// Block c of the nb blocks of pass 1 over one tensor: m, v; the partials of sum p^2, sum u^2 -> *part_p, *part_u.
template <typename T>
__device__ void lamb_moments_block(const T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                                   T* __restrict__ v, const long long n, const long long nb, const long long c,
                                   const T one_minus_beta1, const T beta2, const T one_minus_beta2, const T bc1,
                                   const T bc2, const T eps, const T wd, const int has_wd, T* sh,
                                   T* __restrict__ part_p, T* __restrict__ part_u) {
  const long long stride = nb * SQ_THREADS;
  T sp = 0, su = 0;
  for (long long i = sq_column(nb, c); i < n; i += stride) {
    const T gi = g[i];
    const T pi = p[i];
    T mi = m[i];
    mi = mi + (gi - mi) * one_minus_beta1;
    T vi = v[i];
    vi = vi * beta2 + (gi * one_minus_beta2) * gi;
    m[i] = mi;
    v[i] = vi;
    const T u = lamb_u(mi, vi, pi, bc1, bc2, eps, wd, has_wd);
    sp += pi * pi;
    su += u * u;
  }
  sp = sq_block(sp, sh);
  su = sq_block(su, sh);
  if (threadIdx.x == 0) {
    *part_p = sp;
    *part_u = su;
  }
}

// One block: folds the nb partials of both sums; *scal = r * neg_lr.
template <typename T>
__device__ void lamb_ratio_block(const T* __restrict__ parts_p, const T* __restrict__ parts_u, const long long nb,
                                 const T neg_lr, T* sh, T* __restrict__ scal) {
  const T ssp = sq_fold(parts_p, nb, sh);
  const T ssu = sq_fold(parts_u, nb, sh);
  if (threadIdx.x == 0) {
    const T phi = sqrt(ssp);
    const T psi = sqrt(ssu);
    const T r = (phi > (T)0 && psi > (T)0) ? phi / psi : (T)1;
    *scal = r * neg_lr;
  }
}

template <typename T>
__device__ __forceinline__ void lamb_apply_elem(T* __restrict__ p, const T* __restrict__ m, const T* __restrict__ v,
                                                const long long i, const T bc1, const T bc2, const T eps,
                                                const T wd, const int has_wd, const T step) {
  const T pi = p[i];
  const T u = lamb_u(m[i], v[i], pi, bc1, bc2, eps, wd, has_wd);
  p[i] = pi + u * step;
}

template <typename T>
__global__ void lamb_moments(const T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                             T* __restrict__ v, const long long n, const T one_minus_beta1, const T beta2,
                             const T one_minus_beta2, const T bc1, const T bc2, const T eps, const T wd,
                             const int has_wd, T* __restrict__ parts) {
  __shared__ T sh[SQ_THREADS];
  const long long nb = gridDim.x;
  lamb_moments_block(p, g, m, v, n, nb, (long long)blockIdx.x, one_minus_beta1, beta2, one_minus_beta2, bc1, bc2,
                     eps, wd, has_wd, sh, parts + blockIdx.x, parts + nb + blockIdx.x);
}

template <typename T>
__global__ void lamb_ratio(const T* __restrict__ parts, const long long nb, const T neg_lr, T* __restrict__ scal) {
  __shared__ T sh[SQ_THREADS];
  lamb_ratio_block(parts, parts + nb, nb, neg_lr, sh, scal);
}

template <typename T>
__global__ void lamb_apply(T* __restrict__ p, const T* __restrict__ m, const T* __restrict__ v, const long long n,
                           const T bc1, const T bc2, const T eps, const T wd, const int has_wd,
                           const T* __restrict__ scal) {
  const T step = scal[0];
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    lamb_apply_elem(p, m, v, i, bc1, bc2, eps, wd, has_wd, step);
  }
}

// Multi-tensor Lamb (multi_tensor.cuh): rows (p, g, m, v, n); one step count per launch.  Sum 0 is sum p^2, sum 1
// sum u^2; scal[ti] = r * neg_lr of tensor ti, neg_lr = -(base_lr * lr_scale) in double rounded to T, as
// flatopt/lamb.py's `dt(-lr)`.
template <typename T>
__global__ void lamb_partials_multi(const long long* __restrict__ tensors, const long long* __restrict__ segs,
                                    const long long* __restrict__ spans, const long long nparts,
                                    T* __restrict__ parts, const T one_minus_beta1, const T beta2,
                                    const T one_minus_beta2, const T bc1, const T bc2, const T eps, const T wd,
                                    const int has_wd) {
  __shared__ T sh[SQ_THREADS];
  const MtSegment s = mt_segment(tensors, segs, spans, 5);
  lamb_moments_block(mt_ptr<const T>(s, 0), mt_ptr<const T>(s, 1), mt_ptr<T>(s, 2), mt_ptr<T>(s, 3), s.n, s.nb,
                     s.c, one_minus_beta1, beta2, one_minus_beta2, bc1, bc2, eps, wd, has_wd, sh,
                     parts + s.off + s.c, parts + nparts + s.off + s.c);
}

template <typename T>
__global__ void lamb_ratio_multi(const long long* __restrict__ spans, const double* __restrict__ scales,
                                 const long long nparts, const double base_lr, const T* __restrict__ parts,
                                 T* __restrict__ scal) {
  __shared__ T sh[SQ_THREADS];
  const long long ti = blockIdx.x, off = spans[2 * ti], nb = spans[2 * ti + 1];
  lamb_ratio_block(parts + off, parts + nparts + off, nb, (T)(-(base_lr * scales[ti])), sh, scal + ti);
}

template <typename T>
__global__ void lamb_apply_multi(const long long* __restrict__ tensors, const long long* __restrict__ blocks,
                                 const double* __restrict__ scales, const long long chunk, const double base_lr,
                                 const T bc1, const T bc2, const T eps, const T wd, const int has_wd,
                                 const T* __restrict__ scal) {
  const MtChunk c = mt_chunk(tensors, blocks, 5, chunk);
  const T step = scal[c.ti];
  T* p = mt_ptr<T>(c, 0);
  const T* m = mt_ptr<const T>(c, 2);
  const T* v = mt_ptr<const T>(c, 3);
  for (long long i = c.lo + threadIdx.x; i < c.hi; i += blockDim.x) {
    lamb_apply_elem(p, m, v, i, bc1, bc2, eps, wd, has_wd, step);
  }
}
