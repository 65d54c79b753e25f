// Fused Lion step (lion-pytorch Lion semantics), one pass.
// Twin: flatopt/lion.py `update` -- the same operations in the same order, each rounded to T
// (compiled with --fmad=false), hence bit-identical results.
//   p <- p * decay                                   (when weight decay != 0)
//   c = m * beta1 + g * (1 - beta1)
//   p <- p + sign(c) * neg_lr                        (sign(+-0) = +0, sign(NaN) = NaN, as numpy.sign)
//   m <- m * beta2 + g * (1 - beta2)
template <typename T>
__global__ void lion_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                          const long long n, const T decay, const T beta1,
                          const T one_minus_beta1, const T beta2, const T one_minus_beta2,
                          const T neg_lr, const int decayed) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T gi = g[i];
    T pi = p[i];
    if (decayed) pi = pi * decay;
    const T mi = m[i];
    const T c = mi * beta1 + gi * one_minus_beta1;
    const T sg = c > T(0) ? T(1) : (c < T(0) ? T(-1) : (isnan(c) ? c : T(0)));
    pi = pi + sg * neg_lr;
    m[i] = mi * beta2 + gi * one_minus_beta2;
    p[i] = pi;
  }
}
