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

// A block of a multi-tensor norm pass (core/multi_tensor.py `Norms`, for the per-tensor sums of squares of
// kernels/sq_sum.cuh): launch block b computes block c of the nb blocks of tensor ti's first pass (the very partial
// the per-tensor kernel's block c computes) and writes its partial of sum k to parts[k * nparts + off + c].
// (ti, c) = segs[2b], segs[2b + 1]; (off, nb) = spans[2ti], spans[2ti + 1]; the fold pass runs block ti over
// parts[k * nparts + off ... + nb).
struct MtSegment {
  const long long* row;  // the tensor's addresses (mt_ptr), then its size
  long long n, c, nb, off;
};

__device__ __forceinline__ MtSegment mt_segment(const long long* __restrict__ tensors,
                                                const long long* __restrict__ segs,
                                                const long long* __restrict__ spans, const int ncol) {
  MtSegment s;
  const long long ti = segs[2 * (long long)blockIdx.x];
  s.c = segs[2 * (long long)blockIdx.x + 1];
  s.row = tensors + ncol * ti;
  s.n = s.row[ncol - 1];
  s.off = spans[2 * ti];
  s.nb = spans[2 * ti + 1];
  return s;
}

// Entry k of a row (MtChunk or MtSegment) as a T* (the addresses of p, g and the state arrays).
template <typename T, typename Row>
__device__ __forceinline__ T* mt_ptr(const Row& r, const int k) {
  return (T*)r.row[k];
}
