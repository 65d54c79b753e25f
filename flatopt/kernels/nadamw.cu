// Fused NAdamW step (torch.optim.NAdam with momentum_decay=inf, decoupled_weight_decay=True), one pass.
// Twin: flatopt/nadamw.py `update` -- the same operations in the same order, each rounded to T
// (compiled with --fmad=false), hence bit-identical results.
//   p <- p * decay                          (when weight decay != 0)
//   m <- m + (g - m) * (1 - beta1);  v <- v * beta2 + (g * (1 - beta2)) * g
//   d = sqrt(v / bc2) + eps
//   p <- p + (g / d) * c_g;  p <- p + (m / d) * c_m
template <typename T>
__global__ void nadamw_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                            T* __restrict__ v, const long long n, const T decay,
                            const T one_minus_beta1, const T beta2, const T one_minus_beta2,
                            const T bc2, const T eps, const T c_g, const T c_m, const int decayed) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T gi = g[i];
    T pi = p[i];
    if (decayed) pi = pi * decay;
    T mi = m[i];
    mi = mi + (gi - mi) * one_minus_beta1;
    T vi = v[i];
    vi = vi * beta2 + (gi * one_minus_beta2) * gi;
    const T d = sqrt(vi / bc2) + eps;
    pi = pi + (gi / d) * c_g;
    pi = pi + (mi / d) * c_m;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
  }
}
