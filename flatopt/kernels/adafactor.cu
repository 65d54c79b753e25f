// Fused Adafactor step.  Twin: flatopt/adafactor/numerics.py (the same elementwise operations in the same order,
// each rounded to T; compiled with --fmad=false).  Launch order, all on the current stream, no host sync:
//   factored   : af_row_sumsq, af_col_sumsq -> af_ema (rows), af_ema (cols) -> af_factors
//   unfactored : af_v_update
//   both       : af_sumsq_partials (theta, when scaling) and af_u_partials -> af_scalars -> af_apply
// Every reduction is deterministic: a fixed grid (chosen from the sizes only), fixed per-thread strides and a
// shared-memory tree; no atomics, so the same inputs give the same bits.  The data-dependent scalars (sum of
// theta^2, alpha, sum of U^2, the clip factor) never leave the device: af_scalars writes
// scal[0] = alpha / max(1, RMS(U) / d) and scal[1] = 1 - alpha * weight_decay, which af_apply reads.
// Every kernel must be launched with blockDim.x == AF_THREADS.
#define AF_THREADS 256

template <typename T>
__device__ __forceinline__ T af_max(const T a, const T b) {
  return (isnan(a) || a >= b) ? a : b;  // NaN propagates, as numpy.maximum
}

// Sum of v over the block (every thread gets it); sh has AF_THREADS entries.
template <typename T>
__device__ T af_block_sum(T v, T* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = AF_THREADS / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  const T out = sh[0];
  __syncthreads();
  return out;
}

// out[row] = sum_j x[row, j]^2 for rows rows of length c; one block per row.
template <typename T>
__global__ void af_row_sumsq(const T* __restrict__ x, const long long rows, const long long c,
                             T* __restrict__ out) {
  __shared__ T sh[AF_THREADS];
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * c;
    T s = 0;
    for (long long j = threadIdx.x; j < c; j += AF_THREADS) {
      const T v = xr[j];
      s += v * v;
    }
    s = af_block_sum(s, sh);
    if (threadIdx.x == 0) out[row] = s;
  }
}

// out[b, j] = sum_i x[b, i, j]^2; one thread per (b, j), rows in order (coalesced over j).
template <typename T>
__global__ void af_col_sumsq(const T* __restrict__ x, const long long nb, const long long r, const long long c,
                             T* __restrict__ out) {
  const long long total = nb * c;
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += stride) {
    const long long b = k / c;
    const T* xb = x + b * r * c + (k - b * c);
    T s = 0;
    for (long long i = 0; i < r; ++i) {
      const T v = xb[i * c];
      s += v * v;
    }
    out[k] = s;
  }
}

// state <- state * beta + (sums / count + eps1) * (1 - beta)
template <typename T>
__global__ void af_ema(T* __restrict__ state, const T* __restrict__ sums, const long long n, const T count,
                       const T eps1, const T beta, const T one_minus_beta) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    T s = sums[i] / count;
    s = s + eps1;
    s = s * one_minus_beta;
    state[i] = state[i] * beta + s;
  }
}

// Per batch index b (one block each): rbar = mean(R[b, :]); rfac = 1 / sqrt(R / rbar); cfac = 1 / sqrt(C).
template <typename T>
__global__ void af_factors(const T* __restrict__ R, const T* __restrict__ C, const long long nb, const long long r,
                           const long long c, T* __restrict__ rfac, T* __restrict__ cfac) {
  __shared__ T sh[AF_THREADS];
  for (long long b = blockIdx.x; b < nb; b += gridDim.x) {
    T s = 0;
    for (long long i = threadIdx.x; i < r; i += AF_THREADS) s += R[b * r + i];
    const T rbar = af_block_sum(s, sh) / (T)r;
    for (long long i = threadIdx.x; i < r; i += AF_THREADS) rfac[b * r + i] = (T)1 / sqrt(R[b * r + i] / rbar);
    for (long long j = threadIdx.x; j < c; j += AF_THREADS) cfac[b * c + j] = (T)1 / sqrt(C[b * c + j]);
  }
}

// v <- v * beta + (g^2 + eps1) * (1 - beta)
template <typename T>
__global__ void af_v_update(const T* __restrict__ g, T* __restrict__ v, const long long n, const T eps1,
                            const T beta, const T one_minus_beta) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T gi = g[i];
    T s = gi * gi;
    s = s + eps1;
    s = s * one_minus_beta;
    v[i] = v[i] * beta + s;
  }
}

// U = (g * rfac[row]) * cfac[b, j] (factored) or g / sqrt(v) (unfactored).
template <typename T>
__device__ __forceinline__ T af_u(const T* __restrict__ g, const T* __restrict__ rfac, const T* __restrict__ cfac,
                                  const T* __restrict__ v, const long long i, const long long r, const long long c,
                                  const int factored) {
  if (factored) {
    const long long row = i / c;
    const long long j = i - row * c;
    const long long b = row / r;
    return (g[i] * rfac[row]) * cfac[b * c + j];
  }
  return g[i] / sqrt(v[i]);
}

// partials[blockIdx.x] = sum of x^2 over this block's grid-stride elements (grid fixed by the caller).
template <typename T>
__global__ void af_sumsq_partials(const T* __restrict__ x, const long long n, T* __restrict__ partials) {
  __shared__ T sh[AF_THREADS];
  T s = 0;
  const long long stride = (long long)AF_THREADS * gridDim.x;
  for (long long i = (long long)blockIdx.x * AF_THREADS + threadIdx.x; i < n; i += stride) {
    const T v = x[i];
    s += v * v;
  }
  s = af_block_sum(s, sh);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// partials[blockIdx.x] = sum of U^2 over this block's grid-stride elements.
template <typename T>
__global__ void af_u_partials(const T* __restrict__ g, const T* __restrict__ rfac, const T* __restrict__ cfac,
                              const T* __restrict__ v, const long long n, const long long r, const long long c,
                              const int factored, T* __restrict__ partials) {
  __shared__ T sh[AF_THREADS];
  T s = 0;
  const long long stride = (long long)AF_THREADS * gridDim.x;
  for (long long i = (long long)blockIdx.x * AF_THREADS + threadIdx.x; i < n; i += stride) {
    const T u = af_u(g, rfac, cfac, v, i, r, c, factored);
    s += u * u;
  }
  s = af_block_sum(s, sh);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// One block: reduce the partials in a fixed order and write scal[0] = alpha / max(RMS(U) / d, 1) and
// scal[1] = 1 - alpha * wd, alpha = rho * max(RMS(theta), eps2) when scale, else rho.
template <typename T>
__global__ void af_scalars(const T* __restrict__ p_partials, const int np, const T* __restrict__ u_partials,
                           const int nu, const long long n, const T rho, const T eps2, const T d, const T wd,
                           const int scale, T* __restrict__ scal) {
  __shared__ T sh[AF_THREADS];
  T s = 0;
  for (int k = threadIdx.x; k < nu; k += AF_THREADS) s += u_partials[k];
  const T ssq_u = af_block_sum(s, sh);
  T alpha = rho;
  if (scale) {  // uniform over the block
    s = 0;
    for (int k = threadIdx.x; k < np; k += AF_THREADS) s += p_partials[k];
    const T ssq_p = af_block_sum(s, sh);
    alpha = rho * af_max(sqrt(ssq_p / (T)n), eps2);
  }
  if (threadIdx.x == 0) {
    scal[0] = alpha / af_max(sqrt(ssq_u / (T)n) / d, (T)1);
    scal[1] = (T)1 - alpha * wd;
  }
}

// U~ = U * scal[0]; with a first moment m <- m * beta1 + U~ * (1 - beta1), delta = m; else delta = U~;
// p <- p * scal[1] (when has_decay) - delta.
template <typename T>
__global__ void af_apply(T* __restrict__ p, const T* __restrict__ g, const T* __restrict__ rfac,
                         const T* __restrict__ cfac, const T* __restrict__ v, T* __restrict__ m, const long long n,
                         const long long r, const long long c, const int factored, const T* __restrict__ scal,
                         const T beta1, const T one_minus_beta1, const int has_m, const int has_decay) {
  const T step = scal[0];
  const T decay = scal[1];
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    T u = af_u(g, rfac, cfac, v, i, r, c, factored) * step;
    T delta = u;
    if (has_m) {
      T mi = m[i] * beta1;
      u = u * one_minus_beta1;
      mi = mi + u;
      m[i] = mi;
      delta = mi;
    }
    T pi = p[i];
    if (has_decay) pi = pi * decay;
    p[i] = pi - delta;
  }
}
