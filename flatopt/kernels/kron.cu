// KronPsgd's elementwise glue between the GEMMs, triangular solves and reductions of a step (launched by
// flatopt/kron/fused.py).  Twin: flatopt/kron/__init__.py `update` with flatopt/kron/numerics.py (the `_ws`
// functions) and kron/layout.py `gaussian_probe`: every kernel performs the twin's operations on one element, in the
// twin's order, each rounded to its dtype (compiled with --fmad=false), so the fused step has the twin's bits given
// the same GEMM, solve and reduction results (the fused path makes the twin's calls for those).  Every kernel is
// elementwise (grid-stride; a flag written by several threads is written with the same value), so its results do
// not depend on the launch configuration.
//
// P (the template type) is the preconditioner's dtype; T, the parameter's, is float or double by `t_double` (the
// parameter-side kernels kron_momentum and kron_final see both).  NumPy's maximum / minimum propagate NaN.
//
//   kron_momentum   m <- m * b1 + g * (1 - b1);  h = (P)(m / (1 - b1^t));  fit = (P)g (fit_is_g);  ab = |fit|
//   kron_probe      v = the probe (generate: gaussian_probe's splitmix64 + Box-Muller), then (perturb)
//                   fit <- fit + (sqrt_eps * mean) * v,  mean = mean(ab) (0-d, device)
//   kron_ds         d = (t1 - t2) * eta (triu: 0 below the diagonal);  s = t1 + t2 (in place of t1);  ab = |s|;
//                   resets the factor's non-finite flag
//   kron_slb_m      the spectral lower bound's M = S / safe and M * M,  safe = amax > 0 ? amax : 1
//   kron_slb_y      y <- y / (amax > 0 ? sqrt(sum(y * y)) : 1)
//   kron_dense_div  d <- d / max(lb, floor),  lb = amax > 0 ? sqrt(sum(z * z)) * amax : amax
//   kron_dense_new  new <- q - new (new = D.Q on entry); flag = 1 where new is not finite
//   kron_diag_new   new = q - d * (q / max(amax, floor)); flag = 1 where new is not finite
//   kron_commit     q <- new unless the factor's flag is set (q[j], j in [0, split) factor 0, else factor 1)
//   kron_final      u' = u * min(1, clip / (sqrt(mean(u * u)) + tiny)) (use_clip);  s = (T)u' (+ p * wd);
//                   p <- p + s * neg_lr

__device__ __forceinline__ float kf_log(float x) { return logf(x); }
__device__ __forceinline__ double kf_log(double x) { return log(x); }
__device__ __forceinline__ float kf_cos(float x) { return cosf(x); }
__device__ __forceinline__ double kf_cos(double x) { return cos(x); }
__device__ __forceinline__ float kf_sin(float x) { return sinf(x); }
__device__ __forceinline__ double kf_sin(double x) { return sin(x); }
__device__ __forceinline__ float kf_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double kf_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float kf_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double kf_abs(double x) { return fabs(x); }

template <typename P>
__device__ __forceinline__ P kf_max(const P a, const P b) {
  return (isnan(a) || a >= b) ? a : b;
}

template <typename T, typename P>
__device__ __forceinline__ void kron_momentum_elem(T* m, const T* g, P* h, P* fit, P* ab, const long long i,
                                                   const double b1, const double one_minus_b1, const double bc,
                                                   const int fit_is_g, const int want_abs) {
  const T gi = g[i];
  T mi = m[i] * (T)b1;
  mi = mi + gi * (T)one_minus_b1;
  m[i] = mi;
  const P hi = (P)(mi / (T)bc);
  h[i] = hi;
  P f = hi;
  if (fit_is_g) {
    f = (P)gi;
    fit[i] = f;
  }
  if (want_abs) ab[i] = kf_abs(f);
}

template <typename P>
__global__ void kron_momentum(void* m, const void* g, P* h, P* fit, P* ab, const long long n, const double b1,
                              const double one_minus_b1, const double bc, const int t_double, const int fit_is_g,
                              const int want_abs) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (t_double) {
      kron_momentum_elem((double*)m, (const double*)g, h, fit, ab, i, b1, one_minus_b1, bc, fit_is_g, want_abs);
    } else {
      kron_momentum_elem((float*)m, (const float*)g, h, fit, ab, i, b1, one_minus_b1, bc, fit_is_g, want_abs);
    }
  }
}

// gaussian_probe (kron/layout.py): pair j of the m = (n + 1) / 2 pairs hashes z = (j + 1) * golden + base with
// splitmix64's finaliser; u1 from the top 24 bits, u2 from bits 8..31; element i < m is r * cos(theta) of pair i,
// element i >= m is r * sin(theta) of pair i - m.
template <typename P>
__global__ void kron_probe(P* v, P* fit, const P* mean, const long long n, const long long m,
                           const unsigned long long base, const int generate, const int perturb, const P sqrt_eps,
                           const P theta_scale) {
  const P c = perturb ? sqrt_eps * mean[0] : (P)0;
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    P vi;
    if (generate) {
      const long long j = i < m ? i : i - m;
      unsigned long long z = (unsigned long long)(j + 1) * 0x9E3779B97F4A7C15ull + base;
      z ^= z >> 30;
      z *= 0xBF58476D1CE4E5B9ull;
      z ^= z >> 27;
      z *= 0x94D049BB133111EBull;
      z ^= z >> 31;
      P r = (P)(z >> 40);
      r = r + (P)1.0;
      r = r * (P)5.9604644775390625e-08;  // 2^-24
      r = kf_log(r);
      r = r * (P)-2.0;
      r = kf_sqrt(r);
      P theta = (P)((z >> 8) & 0xFFFFFFull);
      theta = theta * theta_scale;
      vi = (i < m ? kf_cos(theta) : kf_sin(theta)) * r;
      v[i] = vi;
    } else {
      vi = v[i];
    }
    if (perturb) {
      const P cv = c * vi;
      fit[i] = fit[i] + cv;
    }
  }
}

template <typename P>
__global__ void kron_ds(P* t1, const P* t2, P* d, P* ab, const long long n, const long long cols, const P eta,
                        const int triu, int* flag) {
  if (blockIdx.x == 0 && threadIdx.x == 0) flag[0] = 0;
  const long long stride = (long long)blockDim.x * gridDim.x;
  // element i's (row, col) = (i / cols, i % cols), carried from one element of the thread to its next (stride
  // further) instead of two 64-bit divisions per element
  const long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x, nc = cols > 0 ? cols : 1;
  const long long srow = stride / nc, scol = stride - srow * nc;
  long long row = i0 / nc, col = i0 - row * nc;
  for (long long i = i0; i < n; i += stride) {
    const P a = t1[i];
    const P b = t2[i];
    const P dd = (a - b) * eta;
    const P s = a + b;
    d[i] = (triu && col < row) ? (P)0 : dd;
    t1[i] = s;
    ab[i] = kf_abs(s);
    row += srow;
    col += scol;
    if (col >= nc) { col -= nc; ++row; }
  }
}

template <typename P>
__global__ void kron_slb_m(const P* s, const P* amax, P* mm, P* sq, const long long n) {
  const P am = amax[0];
  const P safe = am > (P)0 ? am : (P)1;
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const P x = s[i] / safe;
    mm[i] = x;
    sq[i] = x * x;
  }
}

template <typename P>
__global__ void kron_slb_y(P* y, const P* amax, const P* ysum, const long long n) {
  const P den = amax[0] > (P)0 ? kf_sqrt(ysum[0]) : (P)1;
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    y[i] = y[i] / den;
  }
}

template <typename P>
__global__ void kron_dense_div(P* d, const P* amax, const P* zsum, const P floor, const long long n) {
  const P am = amax[0];
  const P lb = am > (P)0 ? kf_sqrt(zsum[0]) * am : am;
  const P den = kf_max(lb, floor);
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    d[i] = d[i] / den;
  }
}

template <typename P>
__global__ void kron_dense_new(const P* q, P* nw, const long long n, int* flag) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const P x = q[i] - nw[i];
    nw[i] = x;
    if (!isfinite(x)) flag[0] = 1;
  }
}

template <typename P>
__global__ void kron_diag_new(const P* q, const P* d, const P* amax, const P floor, P* nw, const long long n,
                              int* flag) {
  const P den = kf_max(amax[0], floor);
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const P qi = q[i];
    const P qs = qi / den;
    const P dd = d[i] * qs;
    const P x = qi - dd;
    nw[i] = x;
    if (!isfinite(x)) flag[0] = 1;
  }
}

template <typename P>
__global__ void kron_commit(P* q, const P* nw, const long long n, const long long split, const int* flags) {
  const int keep0 = flags[0], keep1 = flags[1];
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (!(i < split ? keep0 : keep1)) q[i] = nw[i];
  }
}

template <typename T, typename P>
__device__ __forceinline__ void kron_final_elem(const P* u, T* p, const long long i, const P f, const int use_clip,
                                                const double wd, const int use_wd, const double neg_lr) {
  P ui = u[i];
  if (use_clip) ui = ui * f;
  T s = (T)ui;
  const T pi = p[i];
  if (use_wd) s = s + pi * (T)wd;
  s = s * (T)neg_lr;
  p[i] = pi + s;
}

template <typename P>
__global__ void kron_final(const P* u, void* p, const P* msq, const long long n, const P clip, const P tiny,
                           const int use_clip, const double wd, const int use_wd, const double neg_lr,
                           const int t_double) {
  P f = (P)1;
  if (use_clip) {
    const P rms = kf_sqrt(msq[0]);
    f = clip / (rms + tiny);
    f = (isnan(f) || f <= (P)1) ? f : (P)1;  // numpy.minimum(1.0, f)
  }
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (t_double) {
      kron_final_elem(u, (double*)p, i, f, use_clip, wd, use_wd, neg_lr);
    } else {
      kron_final_elem(u, (float*)p, i, f, use_clip, wd, use_wd, neg_lr);
    }
  }
}
