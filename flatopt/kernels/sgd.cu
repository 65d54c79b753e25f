// Fused SGD step (torch.optim.SGD semantics).
// Twin: flatopt/sgd.py `update` -- the same operations in the same order, each rounded to T
// (compiled with --fmad=false), hence bit-identical results.
//   d <- g + weight_decay * p                       (only when weight_decay != 0)
//   buf <- d on the first step, else buf * momentum + d * (1 - dampening)   (when momentum != 0)
//   d <- d + buf * momentum if nesterov, else buf   (when momentum != 0)
//   p <- p + d * (-lr)
// Both kernels below apply this one element function, so the multi-tensor kernel is the per-tensor kernel's bits.

template <typename T>
__device__ __forceinline__ void sgd_elem(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ buf,
                                         const long long i, const T neg_lr, const T weight_decay,
                                         const T momentum, const T one_minus_dampening, const int use_wd,
                                         const int use_momentum, const int first, const int nesterov,
                                         const int damp) {
  T pi = p[i];
  T d = g[i];
  if (use_wd) d = pi * weight_decay + d;
  if (use_momentum) {
    T b;
    if (first) {
      b = d;
    } else {
      b = buf[i] * momentum;
      b = b + (damp ? d * one_minus_dampening : d);
    }
    buf[i] = b;
    d = nesterov ? d + b * momentum : b;
  }
  p[i] = pi + d * neg_lr;
}

template <typename T>
__global__ void sgd_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ buf,
                         const long long n, const T neg_lr, const T weight_decay, const T momentum,
                         const T one_minus_dampening, const int use_wd, const int use_momentum,
                         const int first, const int nesterov, const int damp) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    sgd_elem(p, g, buf, i, neg_lr, weight_decay, momentum, one_minus_dampening, use_wd, use_momentum, first,
             nesterov, damp);
  }
}

// Multi-tensor SGD (core/multi_tensor.py: the table layout and the launch).  Block b updates elements
// [lo, min(lo + chunk, n)) of tensor ti, (ti, lo) = blocks[2b], blocks[2b + 1]; row ti of `tensors` holds the
// addresses of p, g, buf (p's when momentum == 0: never read) and n; scales[ti] is the tensor's lr_scale.  Every
// tensor of a launch has the same step count; neg_lr = -(base_lr * lr_scale) in double, rounded to T, as
// flatopt/sgd.py's `dt(-lr)` with lr = base_lr * lr_scale.
template <typename T>
__global__ void sgd_multi(const long long* __restrict__ tensors, const long long* __restrict__ blocks,
                          const double* __restrict__ scales, const long long chunk, const double base_lr,
                          const T weight_decay, const T momentum, const T one_minus_dampening,
                          const int use_wd, const int use_momentum, const int first, const int nesterov,
                          const int damp) {
  const long long ti = blocks[2 * (long long)blockIdx.x];
  const long long lo = blocks[2 * (long long)blockIdx.x + 1];
  const long long* row = tensors + 4 * ti;
  T* p = (T*)row[0];
  const T* g = (const T*)row[1];
  T* buf = (T*)row[2];
  const long long hi = lo + chunk < row[3] ? lo + chunk : row[3];
  const T neg_lr = (T)(-(base_lr * scales[ti]));
  for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    sgd_elem(p, g, buf, i, neg_lr, weight_decay, momentum, one_minus_dampening, use_wd, use_momentum, first,
             nesterov, damp);
  }
}
