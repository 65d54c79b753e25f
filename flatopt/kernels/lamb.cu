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
#define SQ_THREADS 256
#define SQ_LANES 16

// The block's partial of the per-thread sums acc (thread t = i * SQ_LANES + j): b[j] = sum over i in order, then
// b[0] + ... + b[SQ_LANES - 1] in order; valid in thread 0.  sh: SQ_THREADS entries.
template <typename T>
__device__ T sq_block(const T acc, T* sh) {
  sh[threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x < SQ_LANES) {
    T b = sh[threadIdx.x];
    for (int i = 1; i < SQ_LANES; ++i) b += sh[i * SQ_LANES + threadIdx.x];
    sh[threadIdx.x] = b;  // row 0 is read only by its own thread above
  }
  __syncthreads();
  T r = 0;
  if (threadIdx.x == 0) {
    r = sh[0];
    for (int j = 1; j < SQ_LANES; ++j) r += sh[j];
  }
  __syncthreads();
  return r;
}

// One block: the sum of the nb partials (thread t: parts[t], parts[t + SQ_THREADS], ... in order); valid in thread 0.
template <typename T>
__device__ T sq_fold(const T* __restrict__ parts, const long long nb, T* sh) {
  T acc = 0;
  for (long long k = threadIdx.x; k < nb; k += SQ_THREADS) acc += parts[k];
  return sq_block(acc, sh);
}

// The column of thread t = i * SQ_LANES + j of block c among nb blocks (core/blocks.py): i * nb * L + c * L + j.
__device__ __forceinline__ long long sq_column(const long long nb) {
  const long long i = threadIdx.x / SQ_LANES, j = threadIdx.x % SQ_LANES;
  return (i * nb + blockIdx.x) * SQ_LANES + j;
}

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
