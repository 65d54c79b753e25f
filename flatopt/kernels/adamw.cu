// Fused AdamW step (torch.optim.AdamW semantics), one pass over the buffers.
// Twin: flatopt/adamw.py `update` -- the same operations in the same order, each rounded to T
// (compiled with --fmad=false so no multiply-add is contracted), hence bit-identical results.
//   p <- p * decay                         decay = 1 - lr * weight_decay
//   m <- m + (g - m) * (1 - beta1)         (torch's lerp for weight < 0.5)
//   v <- v * beta2 + (g * (1 - beta2)) * g (torch's addcmul)
//   vmax <- max(vmax, v) when amsgrad (NaN propagates as in numpy.maximum)
//   p <- p + (m / (sqrt(v or vmax) / bc2_sqrt + eps)) * neg_step_size
// Both kernels below apply this one element function, so the multi-tensor kernel is the per-tensor kernel's bits.

#include "adam_core.cuh"

template <typename T>
__device__ __forceinline__ void adamw_elem(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                                           T* __restrict__ v, T* __restrict__ vmax, const long long i,
                                           const T decay, const T one_minus_beta1, const T beta2,
                                           const T one_minus_beta2, const T bc2_sqrt, const T eps,
                                           const T neg_step_size, const int amsgrad) {
  adam_elem(p[i] * decay, g[i], p, m, v, vmax, i, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps,
            neg_step_size, amsgrad);
}

template <typename T>
__global__ void adamw_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                           T* __restrict__ v, T* __restrict__ vmax, const long long n,
                           const T decay, const T one_minus_beta1, const T beta2,
                           const T one_minus_beta2, const T bc2_sqrt, const T eps,
                           const T neg_step_size, const int amsgrad) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    adamw_elem(p, g, m, v, vmax, i, decay, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps,
               neg_step_size, amsgrad);
  }
}

// Multi-tensor AdamW (core/multi_tensor.py: the table layout and the launch).  Block b updates elements
// [lo, min(lo + chunk, n)) of tensor ti, (ti, lo) = blocks[2b], blocks[2b + 1]; row ti of `tensors` holds the
// addresses of p, g, m, v, vmax and n; scales[ti] is the tensor's lr_scale.  Every tensor of a launch has the
// same step count (bc1 = 1 - beta1^t, bc2_sqrt = sqrt(1 - beta2^t), computed on the host as the twin does); the
// per-tensor scalars are derived in double exactly as flatopt/adamw.py `_scalars` derives them (lr = base_lr *
// lr_scale, decay = 1 - lr * weight_decay, neg_step_size = -(lr / bc1)), then rounded to T.
template <typename T>
__global__ void adamw_multi(const long long* __restrict__ tensors, const long long* __restrict__ blocks,
                            const double* __restrict__ scales, const long long chunk, const double base_lr,
                            const double weight_decay, const double bc1, const T one_minus_beta1,
                            const T beta2, const T one_minus_beta2, const T bc2_sqrt, const T eps,
                            const int amsgrad) {
  const long long ti = blocks[2 * (long long)blockIdx.x];
  const long long lo = blocks[2 * (long long)blockIdx.x + 1];
  const long long* row = tensors + 6 * ti;
  T* p = (T*)row[0];
  const T* g = (const T*)row[1];
  T* m = (T*)row[2];
  T* v = (T*)row[3];
  T* vmax = (T*)row[4];
  const long long hi = lo + chunk < row[5] ? lo + chunk : row[5];
  const double lr = base_lr * scales[ti];
  const T decay = (T)(1.0 - lr * weight_decay);
  const T neg_step_size = (T)(-(lr / bc1));
  for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    adamw_elem(p, g, m, v, vmax, i, decay, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps,
               neg_step_size, amsgrad);
  }
}
