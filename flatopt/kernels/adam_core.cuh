// The Adam moment update and step of one element, shared by adamw.cu and adam.cu (pasted in by the loader,
// core/kernels.py `source`; g++, the CPU emulator, resolves the #include itself).  pi: the parameter after any
// decoupled decay, gi: the gradient after any L2 term; the twins (flatopt/adamw.py, flatopt/adam.py) make the same
// operations in the same order:
//   m <- m + (g - m) * (1 - beta1)         (torch's lerp for weight < 0.5)
//   v <- v * beta2 + (g * (1 - beta2)) * g (torch's addcmul)
//   vmax <- max(vmax, v) when amsgrad (NaN propagates as in numpy.maximum)
//   p <- p + (m / (sqrt(v or vmax) / bc2_sqrt + eps)) * neg_step_size
#pragma once

template <typename T>
__device__ __forceinline__ void adam_elem(T pi, const T gi, T* __restrict__ p, T* __restrict__ m,
                                          T* __restrict__ v, T* __restrict__ vmax, const long long i,
                                          const T one_minus_beta1, const T beta2, const T one_minus_beta2,
                                          const T bc2_sqrt, const T eps, const T neg_step_size,
                                          const int amsgrad) {
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
