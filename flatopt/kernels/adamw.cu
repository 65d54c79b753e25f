// Fused AdamW step (torch.optim.AdamW semantics), one pass over the buffers.
// Twin: flatopt/adamw.py `update` -- the same operations in the same order, each rounded to T
// (compiled with --fmad=false so no multiply-add is contracted), hence bit-identical results.
//   p <- p * decay                         decay = 1 - lr * weight_decay
//   m <- m + (g - m) * (1 - beta1)         (torch's lerp for weight < 0.5)
//   v <- v * beta2 + (g * (1 - beta2)) * g (torch's addcmul)
//   vmax <- max(vmax, v) when amsgrad (NaN propagates as in numpy.maximum)
//   p <- p + (m / (sqrt(v or vmax) / bc2_sqrt + eps)) * neg_step_size
template <typename T>
__global__ void adamw_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                           T* __restrict__ v, T* __restrict__ vmax, const long long n,
                           const T decay, const T one_minus_beta1, const T beta2,
                           const T one_minus_beta2, const T bc2_sqrt, const T eps,
                           const T neg_step_size, const int amsgrad) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T gi = g[i];
    T pi = p[i] * decay;
    T mi = m[i];
    mi = mi + (gi - mi) * one_minus_beta1;
    T vi = v[i];
    vi = vi * beta2 + (gi * one_minus_beta2) * gi;
    T src = vi;
    if (amsgrad) {
      const T vm = vmax[i];
      src = (isnan(vm) || vm >= vi) ? vm : vi;
      vmax[i] = src;
    }
    const T den = sqrt(src) / bc2_sqrt + eps;
    pi = pi + (mi / den) * neg_step_size;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
  }
}
