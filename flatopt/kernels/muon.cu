// Muon's elementwise glue between the GEMMs of a step (flatopt/muon/fused.py launches them).
// Twin: flatopt/muon/__init__.py `update` / `newton_schulz` -- every kernel performs the twin's operations on one
// element, in the twin's order, each rounded to T (compiled with --fmad=false), hence the twin's bits given the same
// GEMM outputs and the same sum of squares (the fused path computes that sum with the twin's own CuPy reduction).
// Every kernel is elementwise (grid-stride), so its results do not depend on the launch configuration.
//
//   muon_momentum   buf, the direction x and y = x * x                     (the momentum rule, then NS's first op)
//   muon_normalize  x <- x / denom, denom = max(sqrt(s), eps) ("clamp") or sqrt(s) + eps, s = sum(y) (0-d, device)
//   muon_ns_b       B <- (A.A) * c + A * b                                  (after the A.A GEMM; A is not written)
//   muon_ns_combine y <- (B.X) + x * a                                      (after the B.X GEMM; x is not written)
//   muon_ns_final   the last combine, then p <- p * decay (use_wd), p <- p + ((B.X) + x * a) * neg_step

template <typename T>
__global__ void muon_momentum(T* __restrict__ buf, const T* __restrict__ g, T* __restrict__ x, T* __restrict__ y,
                              const long long n, const T mu, const T one_minus_mu, const int ema,
                              const int nesterov) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T gi = g[i];
    T b = buf[i] * mu;
    T d;
    if (ema) {
      const T gs = gi * one_minus_mu;  // (1 - mu) * G
      b = b + gs;
      d = nesterov ? gs + b * mu : b;  // (1 - mu) * G + mu * B
    } else {
      b = b + gi;
      d = nesterov ? b * mu + gi : b;  // G + mu * B
    }
    buf[i] = b;
    x[i] = d;
    y[i] = d * d;
  }
}

template <typename T>
__global__ void muon_normalize(T* __restrict__ x, const T* __restrict__ sumsq, const long long n, const T eps,
                               const int clamp) {
  const T norm = sqrt(sumsq[0]);
  // NumPy's maximum: NaN propagates (fmax would drop it)
  const T denom = clamp ? ((norm != norm || norm >= eps) ? norm : eps) : norm + eps;
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    x[i] = x[i] / denom;
  }
}

template <typename T>
__global__ void muon_ns_b(T* __restrict__ bm, const T* __restrict__ am, const long long n, const T b, const T c) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T cb = bm[i] * c;
    const T ba = am[i] * b;
    bm[i] = cb + ba;
  }
}

template <typename T>
__global__ void muon_ns_combine(T* __restrict__ y, const T* __restrict__ x, const long long n, const T a) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T ax = x[i] * a;
    y[i] = y[i] + ax;
  }
}

template <typename T>
__global__ void muon_ns_final(T* __restrict__ p, const T* __restrict__ y, const T* __restrict__ x,
                              const long long n, const T a, const T decay, const T neg_step, const int use_wd) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T ax = x[i] * a;
    T o = y[i] + ax;
    o = o * neg_step;
    T pi = p[i];
    if (use_wd) pi = pi * decay;
    p[i] = pi + o;
  }
}
