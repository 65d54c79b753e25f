// Fused Lamb step.  Twin: flatopt/lamb.py `update` (with flatopt/core/blocks.py `sq_sum`), bit-identical: every
// operation is the twin's, in the twin's order, rounded to T (compiled with --fmad=false), and the two sums of
// squares add in the twin's blocked order (core/blocks.py documents it).  Three launches on the current stream,
// no host synchronisation, no atomics:
//   lamb_moments (sq_blocks(n) blocks of SQ_THREADS): m, v; u = (m / bc1) / (sqrt(v / bc2) + eps) + p * wd;
//                the block partials of sum p^2 and sum u^2 -> parts[c], parts[nb + c]
//   lamb_ratio   (1 block): folds both; scal[0] = r * (-lr), r = phi / psi where phi > 0 and psi > 0, else 1
//   lamb_apply   (elementwise): recomputes u from the new m, v and the unchanged p (the same bits as pass 1);
//                p <- p + u * scal[0]
// Every kernel must be launched with blockDim.x == SQ_THREADS.
#include "sq_sum.cuh"

template <typename T>
__device__ __forceinline__ T lamb_u(const T mi, const T vi, const T pi, const T bc1, const T bc2, const T eps,
                                    const T wd, const int has_wd) {
  const T den = sqrt(vi / bc2) + eps;
  T u = (mi / bc1) / den;
  if (has_wd) u = u + pi * wd;
  return u;
}

template <typename T>
__global__ void lamb_moments(const T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                             T* __restrict__ v, const long long n, const T one_minus_beta1, const T beta2,
                             const T one_minus_beta2, const T bc1, const T bc2, const T eps, const T wd,
                             const int has_wd, T* __restrict__ parts) {
  __shared__ T sh[SQ_THREADS];
  const long long nb = gridDim.x;
  const long long stride = nb * SQ_THREADS;
  T sp = 0, su = 0;
  for (long long i = sq_column(nb); i < n; i += stride) {
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
    parts[blockIdx.x] = sp;
    parts[nb + blockIdx.x] = su;
  }
}

template <typename T>
__global__ void lamb_ratio(const T* __restrict__ parts, const long long nb, const T neg_lr, T* __restrict__ scal) {
  __shared__ T sh[SQ_THREADS];
  const T ssp = sq_fold(parts, nb, sh);
  const T ssu = sq_fold(parts + nb, nb, sh);
  if (threadIdx.x == 0) {
    const T phi = sqrt(ssp);
    const T psi = sqrt(ssu);
    const T r = (phi > (T)0 && psi > (T)0) ? phi / psi : (T)1;
    scal[0] = r * neg_lr;
  }
}

template <typename T>
__global__ void lamb_apply(T* __restrict__ p, const T* __restrict__ m, const T* __restrict__ v, const long long n,
                           const T bc1, const T bc2, const T eps, const T wd, const int has_wd,
                           const T* __restrict__ scal) {
  const T step = scal[0];
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T pi = p[i];
    const T u = lamb_u(m[i], v[i], pi, bc1, bc2, eps, wd, has_wd);
    p[i] = pi + u * step;
  }
}
