// The blocked sum shared by the kernels with per-tensor sums (pasted into kernels/generated/ by core/elementwise): the order of
// flatopt/core/sqsum.py `sq_sum` (its twin), documented there.  Included textually by the loader
// (core/kernels.py `source`) for NVRTC; g++ (the CPU emulator) resolves the #include itself.
#pragma once
#define SQ_THREADS 256
#define SQ_LANES 16

// The block's partial of the per-thread sums acc (thread t = i * SQ_LANES + j): b[j] = sum over i in order, then
// b[0] + ... + b[SQ_LANES - 1] in order; valid in thread 0.  sh: SQ_THREADS entries.
template <typename T>
__device__ T sq_block(const T acc, T* sh) {
  sh[threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x < SQ_LANES) {
    T b = sh[threadIdx.x];
    for (int i = 1; i < SQ_LANES; ++i) b += sh[i * SQ_LANES + threadIdx.x];
    sh[threadIdx.x] = b;  // row 0 is read only by its own thread above
  }
  __syncthreads();
  T r = 0;
  if (threadIdx.x == 0) {
    r = sh[0];
    for (int j = 1; j < SQ_LANES; ++j) r += sh[j];
  }
  __syncthreads();
  return r;
}

// One block: the sum of the nb partials (thread t: parts[t], parts[t + SQ_THREADS], ... in order); valid in thread 0.
template <typename T>
__device__ T sq_fold(const T* __restrict__ parts, const long long nb, T* sh) {
  T acc = 0;
  for (long long k = threadIdx.x; k < nb; k += SQ_THREADS) acc += parts[k];
  return sq_block(acc, sh);
}

// The column of thread t = i * SQ_LANES + j of block c among nb blocks (core/sqsum.py): i * nb * L + c * L + j.
// (A multi-tensor pass, core/multi_tensor.py `Norms`, runs block c of a tensor as block b of its launch.)
__device__ __forceinline__ long long sq_column(const long long nb, const long long c) {
  const long long i = threadIdx.x / SQ_LANES, j = threadIdx.x % SQ_LANES;
  return (i * nb + c) * SQ_LANES + j;
}

__device__ __forceinline__ long long sq_column(const long long nb) { return sq_column(nb, blockIdx.x); }
