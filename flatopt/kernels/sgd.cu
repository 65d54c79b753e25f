// Fused SGD step (torch.optim.SGD semantics).
// Twin: flatopt/sgd.py `update` -- the same operations in the same order, each rounded to T
// (compiled with --fmad=false), hence bit-identical results.
//   d <- g + weight_decay * p                       (only when weight_decay != 0)
//   buf <- d on the first step, else buf * momentum + d * (1 - dampening)   (when momentum != 0)
//   d <- d + buf * momentum if nesterov, else buf   (when momentum != 0)
//   p <- p + d * (-lr)
template <typename T>
__global__ void sgd_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ buf,
                         const long long n, const T neg_lr, const T weight_decay, const T momentum,
                         const T one_minus_dampening, const int use_wd, const int use_momentum,
                         const int first, const int nesterov, const int damp) {
  const long long stride = (long long)blockDim.x * gridDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
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
}
