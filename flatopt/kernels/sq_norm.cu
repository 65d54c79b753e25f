// Sum of squares of a buffer in double (distributed.global_norm's local sum; twin: core/norms.py `sumsq64`), in the
// blocked order of core/sqsum.py `sq_sum` (documented there; sq_sum.cuh): the terms are double(x)^2, so the result
// is the twin's, bit for bit, on any device and thread count.  Two launches per buffer on the current stream, no
// host synchronisation, no atomics:
//   sq64_partials (sq_blocks(n) blocks): the block partials -> parts[c]
//   sq64_fold     (1 block): the partials folded (nb == 1: parts[0]); total[0] = (first ? 0 : total[0]) + the sum
// T is the buffer's type (float or double).  Every kernel must be launched with blockDim.x == SQ_THREADS.
#include "sq_sum.cuh"

template <typename T>
__global__ void sq64_partials(const T* __restrict__ x, long long n, long long nb, double* __restrict__ parts) {
  __shared__ double sh[SQ_THREADS];
  const long long stride = nb * SQ_THREADS;
  double s = 0;
  for (long long i = sq_column(nb); i < n; i += stride) {
    const double v = (double)x[i];
    s += v * v;
  }
  s = sq_block(s, sh);
  if (threadIdx.x == 0) parts[blockIdx.x] = s;
}

template <typename T>
__global__ void sq64_fold(const double* __restrict__ parts, long long nb, int first, double* __restrict__ total) {
  __shared__ double sh[SQ_THREADS];
  const double s = nb == 1 ? parts[0] : sq_fold(parts, nb, sh);
  if (threadIdx.x == 0) total[0] = (first ? 0.0 : total[0]) + s;
}
