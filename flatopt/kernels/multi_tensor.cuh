// The chunk table of a multi-tensor launch (flatopt/core/multi_tensor.py documents the layout and the launch),
// shared by the <name>_multi kernels of the catalogue's elementwise algorithms.  Block b of the launch updates
// elements [lo, hi) of tensor ti: (ti, lo) = blocks[2b], blocks[2b + 1], hi = min(lo + chunk, n); row ti of
// `tensors` has ncol entries: the tensor's addresses (p, g, then the state arrays), then n.
// Pasted in by the loader (core/kernels.py `source`); g++, the CPU emulator, resolves the #include itself.
#pragma once

struct MtChunk {
  const long long* row;  // the tensor's addresses (mt_ptr), then its size
  long long ti, lo, hi;
};

__device__ __forceinline__ MtChunk mt_chunk(const long long* __restrict__ tensors,
                                            const long long* __restrict__ blocks, const int ncol,
                                            const long long chunk) {
  MtChunk c;
  c.ti = blocks[2 * (long long)blockIdx.x];
  c.lo = blocks[2 * (long long)blockIdx.x + 1];
  c.row = tensors + ncol * c.ti;
  const long long n = c.row[ncol - 1];
  c.hi = c.lo + chunk < n ? c.lo + chunk : n;
  return c;
}

// Entry k of a row as a T* (the addresses of p, g and the state arrays).
template <typename T>
__device__ __forceinline__ T* mt_ptr(const MtChunk& c, const int k) {
  return (T*)c.row[k];
}
