// Fused Sophia step (the official SophiaG with the batch factor folded into h), one pass.
// Twin: flatopt/sophia.py `update` -- the same operations in the same order, each rounded to T
// (compiled with --fmad=false), hence bit-identical results.
//   p <- p * decay                                       (when weight decay != 0)
//   m <- m * beta1 + g * (1 - beta1)
//   ratio = min(|m| / (h * rho + eps), 1)                (NaN propagates, as numpy.minimum)
//   p <- p + (sign(m) * ratio) * neg_lr                  (sign(+-0) = +0, sign(NaN) = NaN, as numpy.sign)
template <typename T>
__global__ void sophia_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                            const T* __restrict__ h, const long long n, const T decay,
                            const T beta1, const T one_minus_beta1, const T rho, const T eps,
                            const T neg_lr, const int decayed) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    T pi = p[i];
    if (decayed) pi = pi * decay;
    const T mi = m[i] * beta1 + g[i] * one_minus_beta1;
    T r = fabs(mi) / (h[i] * rho + eps);
    r = (r > T(1)) ? T(1) : r;
    const T sg = mi > T(0) ? T(1) : (mi < T(0) ? T(-1) : (isnan(mi) ? mi : T(0)));
    pi = pi + (sg * r) * neg_lr;
    m[i] = mi;
    p[i] = pi;
  }
}
