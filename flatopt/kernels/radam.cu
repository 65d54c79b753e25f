// Fused RAdam step (torch.optim.RAdam semantics), one pass.
// Twin: flatopt/radam.py `update` -- the same operations in the same order, each rounded to T
// (compiled with --fmad=false), hence bit-identical results.  `rect` and `factor` are host scalars of t.
//   mode 1 (L2):        g' <- g + p * wd
//   mode 2 (decoupled): p <- p * decay
//   m <- m + (g' - m) * (1 - beta1);  v <- v * beta2 + (g' * (1 - beta2)) * g'
//   rect:  p <- p + (m / (sqrt(v) + eps)) * factor;   otherwise  p <- p + m * factor
template <typename T>
__global__ void radam_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                           T* __restrict__ v, const long long n, const T wd, const T decay,
                           const T one_minus_beta1, const T beta2, const T one_minus_beta2,
                           const T eps, const T factor, const int mode, const int rect) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
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
}
