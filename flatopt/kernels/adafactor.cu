// Fused Adafactor step.  Twin: flatopt/adafactor/numerics.py with flatopt/adafactor/factored_passes.py (fused
// statistics).  Launch order, all on the current stream, no host sync:
//   factored   : af_row_sumsq -> af_ema (rows, writing 1/R) -> af_col_sumsq (column sums and W) -> af_ema (cols)
//                -> af_factors (r-bar, the factors and the per-matrix sums of U^2)
//   unfactored : af_v_update, af_u_partials
//   both       : af_sumsq_partials (theta, when scaling) -> af_scalars -> af_apply
//
// What is bit-identical to the twin, and what is not (compiled with --fmad=false; every operation rounded to T):
// * Every elementwise operation is the twin's, in the twin's order: the EMAs R <- R*beta + ((sum/c + eps1)*(1-beta)),
//   1/R, C likewise, rfac = 1/sqrt(R/r-bar), cfac = 1/sqrt(C), V <- V*beta + ((g^2 + eps1)*(1-beta)),
//   U = (g*(cfac*s))*rfac (factored; s the step scale, folded into the column factor as the twin does) or
//   (g/sqrt(V))*s, the first moment m <- m*beta1 + U*(1-beta1), p <- p*(1 - alpha*wd) - delta; and the sums of U^2
//   are the twin's fused ones: sum U^2 = sum_b r-bar_b * sum_j (cfac_bj^2 * W_bj), W_bj = sum_i g_bij^2 * (1/R_bi).
//   So with the same sums the kernel gives the twin's bits.
// * The sums are not: the row sums and r-bar (a 256-thread strided sum and a shared-memory tree), the column sums
//   and W (sequential over the rows), sum theta^2 and sum U^2 (per-thread strided partials, a tree, then the
//   partials in one block) add in another order than NumPy's pairwise/einsum loops and CuPy's CUB reductions.
//   Each differs by a few ulps of the sum, which reaches p and m through the factors, alpha and the clip factor:
//   tests/test_gpu.py holds the kernel to its twin within 4*steps*eps(T)*max(1, max|p|) (as CuPy to NumPy).
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

// out[b, j] = sum_i x[b, i, j]^2 and w[b, j] = sum_i x[b, i, j]^2 * inv[b, i] (inv = 1/R, the new row
// statistic); one thread per (b, j), rows in order (coalesced over j).
template <typename T>
__global__ void af_col_sumsq(const T* __restrict__ x, const T* __restrict__ inv, const long long nb,
                             const long long r, const long long c, T* __restrict__ out, T* __restrict__ w) {
  const long long total = nb * c;
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += stride) {
    const long long b = k / c;
    const T* xb = x + b * r * c + (k - b * c);
    const T* ib = inv + b * r;
    T s = 0, sw = 0;
    for (long long i = 0; i < r; ++i) {
      const T v = xb[i * c];
      const T sq = v * v;
      s += sq;
      sw += sq * ib[i];
    }
    out[k] = s;
    w[k] = sw;
  }
}

// state <- state * beta + (sums / count + eps1) * (1 - beta); with write_inv, sums <- 1 / state (the new one).
template <typename T>
__global__ void af_ema(T* __restrict__ state, T* __restrict__ sums, const long long n, const T count,
                       const T eps1, const T beta, const T one_minus_beta, const int write_inv) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    T s = sums[i] / count;
    s = s + eps1;
    s = s * one_minus_beta;
    const T st = state[i] * beta + s;
    state[i] = st;
    if (write_inv) sums[i] = (T)1 / st;
  }
}

// Per batch index b (one block each): rbar = mean(R[b, :]); rfac = 1 / sqrt(R / rbar); cfac = 1 / sqrt(C);
// usum[b] = (sum_j (cfac_j * cfac_j) * W[b, j]) * rbar, this matrix's sum of U^2 (the twin's fused_ssq).
template <typename T>
__global__ void af_factors(const T* __restrict__ R, const T* __restrict__ C, const T* __restrict__ W,
                           const long long nb, const long long r, const long long c, T* __restrict__ rfac,
                           T* __restrict__ cfac, T* __restrict__ usum) {
  __shared__ T sh[AF_THREADS];
  for (long long b = blockIdx.x; b < nb; b += gridDim.x) {
    T s = 0;
    for (long long i = threadIdx.x; i < r; i += AF_THREADS) s += R[b * r + i];
    const T rbar = af_block_sum(s, sh) / (T)r;
    for (long long i = threadIdx.x; i < r; i += AF_THREADS) rfac[b * r + i] = (T)1 / sqrt(R[b * r + i] / rbar);
    T u = 0;
    for (long long j = threadIdx.x; j < c; j += AF_THREADS) {
      const T cf = (T)1 / sqrt(C[b * c + j]);
      cfac[b * c + j] = cf;
      u += (cf * cf) * W[b * c + j];
    }
    u = af_block_sum(u, sh);
    if (threadIdx.x == 0) usum[b] = u * rbar;
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

// The scaled update U~ = (g * (cfac[b, j] * step)) * rfac[row] (factored: the twin folds the step scale into the
// column factor, then multiplies by the column factor and the row factor) or (g / sqrt(v)) * step (unfactored).
template <typename T>
__device__ __forceinline__ T af_u(const T* __restrict__ g, const T* __restrict__ rfac, const T* __restrict__ cfac,
                                  const T* __restrict__ v, const long long i, const long long r, const long long c,
                                  const int factored, const T step) {
  if (factored) {
    const long long row = i / c;
    const long long j = i - row * c;
    const long long b = row / r;
    return (g[i] * (cfac[b * c + j] * step)) * rfac[row];
  }
  return (g[i] / sqrt(v[i])) * step;
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

// partials[blockIdx.x] = sum of U^2 = (g / sqrt(v))^2 over this block's grid-stride elements (unfactored; the
// factored sum comes from af_factors).
template <typename T>
__global__ void af_u_partials(const T* __restrict__ g, const T* __restrict__ v, const long long n,
                              T* __restrict__ partials) {
  __shared__ T sh[AF_THREADS];
  T s = 0;
  const long long stride = (long long)AF_THREADS * gridDim.x;
  for (long long i = (long long)blockIdx.x * AF_THREADS + threadIdx.x; i < n; i += stride) {
    const T u = g[i] / sqrt(v[i]);
    s += u * u;
  }
  s = af_block_sum(s, sh);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// One block: reduce the partials in a fixed order and write scal[0] = alpha / max(RMS(U) / d, 1) and
// scal[1] = 1 - alpha * wd, alpha = rho * max(RMS(theta), eps2) when scale, else rho.
template <typename T>
__global__ void af_scalars(const T* __restrict__ p_partials, const int np, const T* __restrict__ u_partials,
                           const long long nu, const long long n, const T rho, const T eps2, const T d, const T wd,
                           const int scale, T* __restrict__ scal) {
  __shared__ T sh[AF_THREADS];
  T s = 0;
  for (long long k = threadIdx.x; k < nu; k += AF_THREADS) s += u_partials[k];
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

// U~ = af_u(..., scal[0]); with a first moment m <- m * beta1 + U~ * (1 - beta1), delta = m; else delta = U~;
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
    T u = af_u(g, rfac, cfac, v, i, r, c, factored, step);
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
