// Kernels for the emulator's own test (tests/test_cuda_emu.py): each either computes something whose result is
// known, or commits one error the emulator must report.  Not part of flatopt.

// out[blockIdx.x] = sum of x over the block, by warp shuffles then shared memory (blockDim.x a multiple of 32).
template <typename T>
__global__ void st_shfl_sum(const T* x, T* out, long long n) {
  __shared__ T sh[32];
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  T v = i < n ? x[i] : (T)0;
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x >> 5) ? sh[lane] : (T)0;
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) out[blockIdx.x] = v;
  }
}

// out[i] = the value of lane (lane ^ 1) via __shfl_sync with width 2 / __shfl_up_sync by 1 (mode 0 / 1).
template <typename T>
__global__ void st_shfl_modes(const T* x, T* out, int mode) {
  const T v = x[threadIdx.x];
  out[threadIdx.x] = mode == 0 ? __shfl_sync(0xffffffffu, v, (threadIdx.x & 1) ^ 1, 2)
                               : __shfl_up_sync(0xffffffffu, v, 1);
}

// A full-mask shuffle in a partial warp (blockDim.x not a multiple of 32): names lanes that do not exist.
template <typename T>
__global__ void st_shfl_partial(const T* x, T* out) {
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, x[threadIdx.x], 1);
}

// Threads at two different barriers.
template <typename T>
__global__ void st_divergent(T* out) {
  if (threadIdx.x & 1) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = (T)1;
}

// Half of the block returns before a barrier.
template <typename T>
__global__ void st_exit_before_barrier(T* out) {
  if (threadIdx.x >= 16) return;
  __syncthreads();
  out[threadIdx.x] = (T)1;
}

// Reads shared memory that no thread wrote (poisoned: NaN).
template <typename T>
__global__ void st_uninit_shared(T* out) {
  __shared__ T sh[64];
  if (threadIdx.x < 32) sh[threadIdx.x] = (T)threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = sh[threadIdx.x];
}

// A race: every thread reads its neighbour's slot, which the neighbour writes, with no barrier in between.
template <typename T>
__global__ void st_race(T* out) {
  __shared__ T sh[256];
  sh[threadIdx.x] = (T)threadIdx.x;
  out[threadIdx.x] = sh[(threadIdx.x + 1) % blockDim.x];
}

// out[i + wshift] = x[i + rshift] for i < n: out-of-bounds for a shift != 0.
template <typename T>
__global__ void st_shifted_copy(const T* x, T* out, long long n, long long rshift, long long wshift) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)blockDim.x * gridDim.x)
    out[i + wshift] = x[i + rshift];
}

// out[i] = a * i + b for every parameter kind CuPy packs.
template <typename T>
__global__ void st_params(T* out, const T a, const long long n, const int b, const float c) {
  for (long long i = threadIdx.x; i < n; i += blockDim.x) out[i] = a * (T)i + (T)b + (T)c;
}

// out[4k .. 4k+3] = x[4k + shift .. 4k + shift + 3] by 16-byte vector loads (float4; the generated kernels' access):
// misaligned for a shift that is not a multiple of 4.
template <typename T>
__global__ void st_vector_copy(const float* x, float* out, long long n, long long shift) {
  for (long long i = 4 * ((long long)blockIdx.x * blockDim.x + threadIdx.x); i + 4 <= n; i += 4 * (long long)blockDim.x * gridDim.x)
    *(float4*)__builtin_assume_aligned(out + i, 16) = *(const float4*)__builtin_assume_aligned(x + i + shift, 16);
}
