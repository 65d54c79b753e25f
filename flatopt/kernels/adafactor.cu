// Fused Adafactor step, segmented over every tensor of a step (one launch per pass for the whole group).
// Twin: flatopt/adafactor/numerics.py with flatopt/adafactor/factored_passes.py (fused statistics); the host side,
// the tables and the launch order: flatopt/adafactor/gpu.py.  Passes, all on the current stream, no host sync:
//   af_stats_multi   : per factored row, sum_j g^2 -> the row EMA R, 1/R (one warp a row); per chunk of AF_CHUNK
//                      elements, the partial sum of theta^2 (parameter scaling) and, unfactored, the V EMA and the
//                      partial sum of U^2
//   af_cols_multi    : per tile of AF_TILE_ROWS rows x AF_THREADS columns, per column, the partial sums of g^2 and
//                      of W = g^2 * (1/R) over the tile's rows (in row order)
//   af_colfold_multi : per column (one warp), the tile partials folded -> the column EMA C, rsqrt(C) and
//                      rsqrt(C)^2 * W
//   af_factors_multi : per matrix, r-bar = mean(R), the row factors rsqrt(R / r-bar), r-bar * sum_j rsqrt(C)^2 W
//   af_scalars_multi : per tensor, sum U^2 and sum theta^2 folded -> scal = {alpha / max(1, RMS(U) / d), decay}
//   af_apply_multi   : per chunk, U~ = (g * (cfac * scal[0])) * rfac or (g / sqrt(V)) * scal[0], the first moment,
//                      p <- p * decay - delta
//
// Tables (int64, built once per plan): one row of AF_NCOL fields per tensor (addresses of its buffers and of its
// workspace, its shape), and per pass one entry per block naming the tensor and the block's part of it.
//
// What is bit-identical to the twin, and what is not (compiled with --fmad=false; every operation rounded to T):
// * Every elementwise operation is the twin's, in the twin's order: the EMAs R <- R*beta + ((sum/c + eps1)*(1-beta)),
//   1/R, C likewise (sum/r), rfac = 1/sqrt(R/r-bar), cfac = 1/sqrt(C), V <- V*beta + ((g^2 + eps1)*(1-beta)),
//   U = (g*(cfac*s))*rfac (s the step scale, folded into the column factor as the twin does) or (g/sqrt(V))*s, the
//   first moment m <- m*beta1 + U*(1-beta1), p <- p*(1 - alpha*wd) - delta (1 - rho*wd in double when alpha is the
//   host's rho, as the twin's Python float); the learning rate (base * lr_scale) * factor in double, as the host;
//   and the sums of U^2 are the twin's fused ones: sum U^2 = sum_b r-bar_b * sum_j (cfac_bj^2 * W_bj).
//   So with the same sums the kernel gives the twin's bits.
// * The sums are not: row sums (32 lanes strided, then a shuffle tree), column sums and W (in row order within a
//   tile of AF_TILE_ROWS rows, then the tiles' partials 32 lanes strided and a shuffle tree), r-bar and the per-matrix
//   sum of U^2 (AF_THREADS threads strided and a shared-memory tree), sum theta^2 and the unfactored sum of U^2
//   (per chunk of AF_CHUNK elements: threads strided, a tree; the chunks' partials likewise) add in another order than
//   NumPy's pairwise/einsum loops and CuPy's CUB reductions: a few ulps of each sum, which reach p and m through the
//   factors, alpha and the clip factor (tests/test_gpu.py holds the kernel to its twin within
//   4*steps*eps(T)*max(1, max|p|)).
// Every reduction is deterministic and *per tensor*: how a tensor is cut (rows, tiles, chunks, matrices) and the order
// in which its partials are added depend on its shape only, never on the other tensors of the batch, the grid or the
// block order; no atomics.  So step_batch gives each tensor the bits of a step of it alone.
// Every kernel must be launched with blockDim.x == AF_THREADS.
#define AF_THREADS 256
#define AF_WARPS (AF_THREADS / 32)
#define AF_CHUNK 4096     // elements per block of the chunked passes (partials of theta^2 and U^2; the update)
#define AF_TILE_ROWS 32   // rows per tile of the column sums

// Fields of a tensor's table row (flatopt/adafactor/gpu.py writes them in this order).
#define AF_P 0       // theta
#define AF_G 1       // the gradient
#define AF_M 2       // the first moment (unused without beta1)
#define AF_SA 3      // R (factored) or V
#define AF_SB 4      // C (factored; unused otherwise)
#define AF_N 5       // elements
#define AF_B 6       // matrices (the leading dims' product; factored)
#define AF_R 7       // rows of a matrix
#define AF_C 8       // columns of a matrix
#define AF_FACT 9    // 1: factored
#define AF_ROWS 10   // workspace, B*r: 1/R (af_stats_multi), then the row factors (af_factors_multi)
#define AF_CFAC 11   // workspace, B*c: the column factors
#define AF_CW 12     // workspace, B*c: cfac^2 * W
#define AF_CPART 13  // workspace, 2*B*c*nrt: tile partials of the column sums ([column][tile]), then of W
#define AF_NRT 14    // tiles per matrix column: ceil(r / AF_TILE_ROWS)
#define AF_PART 15   // workspace, 2*nch: chunk partials of theta^2, then of U^2 (unfactored)
#define AF_NCH 16    // chunks: ceil(n / AF_CHUNK)
#define AF_USUM 17   // workspace, B: r-bar_b * sum_j cfac^2 W of each matrix
#define AF_SCAL 18   // workspace, 2: the step scale and the decay factor
#define AF_NCOL 19

// af_stats_multi's block kinds
#define AF_KIND_ROWS 0
#define AF_KIND_CHUNK 1

template <typename T>
__device__ __forceinline__ T af_max(const T a, const T b) {
  return (isnan(a) || a >= b) ? a : b;  // NaN propagates, as numpy.maximum
}

// Sum of v over the block (every thread gets it); sh has AF_THREADS entries.
template <typename T>
__device__ T af_block_sum(T v, T* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = AF_THREADS / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  const T out = sh[0];
  __syncthreads();
  return out;
}

// Sum of v over the warp (valid in lane 0): a fixed shuffle tree.
template <typename T>
__device__ __forceinline__ T af_warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

// state <- state * beta + (sum / count + eps1) * (1 - beta) (the twin's EMA of a row or column mean); returns it.
template <typename T>
__device__ __forceinline__ T af_ema(T* __restrict__ state, const T sum, const T count, const T eps1, const T beta,
                                    const T one_minus_beta) {
  T s = sum / count;
  s = s + eps1;
  s = s * one_minus_beta;
  const T st = *state * beta + s;
  *state = st;
  return st;
}

// Blocks: (tensor, kind, first).  AF_KIND_ROWS: rows first .. first + AF_WARPS - 1 of the tensor's B*r rows, a warp
// each: R <- EMA of the row's mean of g^2, rows workspace <- 1/R.  AF_KIND_CHUNK: elements [first, first + AF_CHUNK):
// with need_rms the chunk's sum of theta^2 (part[k]); unfactored, V <- V*beta + (g^2 + eps1)*(1-beta) and the
// chunk's sum of (g/sqrt(V))^2 (part[nch + k]).
template <typename T>
__global__ void af_stats_multi(const long long* __restrict__ tensors, const long long* __restrict__ blocks,
                               const T eps1, const T beta, const T one_minus_beta, const int need_rms) {
  __shared__ T sh[AF_THREADS];
  const long long* e = blocks + 3 * (long long)blockIdx.x;
  const long long* row = tensors + AF_NCOL * e[0];
  const T* g = (const T*)row[AF_G];
  if (e[1] == AF_KIND_ROWS) {  // no block barrier in this branch: a warp without a row leaves
    const long long c = row[AF_C];
    const long long i = e[2] + threadIdx.x / 32;
    if (i >= row[AF_B] * row[AF_R]) return;
    const int lane = threadIdx.x % 32;
    const T* gr = g + i * c;
    T s = 0;
    for (long long j = lane; j < c; j += 32) {
      const T v = gr[j];
      s += v * v;
    }
    s = af_warp_sum(s);
    if (lane == 0) {
      const T st = af_ema((T*)row[AF_SA] + i, s, (T)c, eps1, beta, one_minus_beta);
      ((T*)row[AF_ROWS])[i] = (T)1 / st;
    }
    return;
  }
  const long long n = row[AF_N], nch = row[AF_NCH];
  const long long lo = e[2];
  const long long hi = lo + AF_CHUNK < n ? lo + AF_CHUNK : n;
  const long long k = lo / AF_CHUNK;
  const T* p = (const T*)row[AF_P];
  T* v = (T*)row[AF_SA];
  const int unfactored = !row[AF_FACT];  // uniform over the block, as need_rms
  T sp = 0, su = 0;
  for (long long i = lo + threadIdx.x; i < hi; i += AF_THREADS) {
    if (need_rms) {
      const T x = p[i];
      sp += x * x;
    }
    if (unfactored) {
      const T gi = g[i];
      T s = gi * gi;
      s = s + eps1;
      s = s * one_minus_beta;
      const T vi = v[i] * beta + s;
      v[i] = vi;
      const T u = gi / sqrt(vi);
      su += u * u;
    }
  }
  T* part = (T*)row[AF_PART];
  if (need_rms) {
    sp = af_block_sum(sp, sh);
    if (threadIdx.x == 0) part[k] = sp;
  }
  if (unfactored) {
    su = af_block_sum(su, sh);
    if (threadIdx.x == 0) part[nch + k] = su;
  }
}

// Blocks: (tensor, matrix b, row tile, column tile).  Column j of the tile (one thread): the sums over the tile's
// rows, in row order, of g^2 and of W = g^2 * (1/R_i) (after af_stats_multi), into the tile partials.
template <typename T>
__global__ void af_cols_multi(const long long* __restrict__ tensors, const long long* __restrict__ blocks) {
  const long long* e = blocks + 4 * (long long)blockIdx.x;
  const long long* row = tensors + AF_NCOL * e[0];
  const long long b = e[1], rt = e[2];
  const long long r = row[AF_R], c = row[AF_C], nrt = row[AF_NRT];
  const long long j = e[3] * AF_THREADS + threadIdx.x;
  if (j >= c) return;  // no barrier in this kernel
  const long long i0 = rt * AF_TILE_ROWS;
  const long long i1 = i0 + AF_TILE_ROWS < r ? i0 + AF_TILE_ROWS : r;
  const T* x = (const T*)row[AF_G] + b * r * c + j;
  const T* inv = (const T*)row[AF_ROWS] + b * r;
  T s = 0, sw = 0;
  for (long long i = i0; i < i1; ++i) {
    const T v = x[i * c];
    const T sq = v * v;
    s += sq;
    sw += sq * inv[i];
  }
  T* part = (T*)row[AF_CPART];
  const long long k = (b * c + j) * nrt + rt;
  part[k] = s;
  part[row[AF_B] * c * nrt + k] = sw;
}

// Blocks: (tensor, first column).  Columns first .. first + AF_WARPS - 1 of the tensor's B*c columns, a warp each:
// the tile partials folded (lanes strided over the tiles, a shuffle tree), C <- EMA of the column's mean of g^2,
// cfac = 1/sqrt(C), cw = (cfac*cfac)*W.
template <typename T>
__global__ void af_colfold_multi(const long long* __restrict__ tensors, const long long* __restrict__ blocks,
                                 const T eps1, const T beta, const T one_minus_beta) {
  const long long* e = blocks + 2 * (long long)blockIdx.x;
  const long long* row = tensors + AF_NCOL * e[0];
  const long long nc = row[AF_B] * row[AF_C], nrt = row[AF_NRT];
  const long long k = e[1] + threadIdx.x / 32;
  if (k >= nc) return;  // no block barrier in this kernel: a warp without a column leaves
  const int lane = threadIdx.x % 32;
  const T* ps = (const T*)row[AF_CPART] + k * nrt;
  const T* pw = ps + nc * nrt;
  T s = 0, w = 0;
  for (long long q = lane; q < nrt; q += 32) {
    s += ps[q];
    w += pw[q];
  }
  s = af_warp_sum(s);
  w = af_warp_sum(w);
  if (lane == 0) {
    const T st = af_ema((T*)row[AF_SB] + k, s, (T)row[AF_R], eps1, beta, one_minus_beta);
    const T cf = (T)1 / sqrt(st);
    ((T*)row[AF_CFAC])[k] = cf;
    ((T*)row[AF_CW])[k] = (cf * cf) * w;
  }
}

// Blocks: (tensor, matrix b).  r-bar = mean(R[b, :]); rows workspace <- 1/sqrt(R / r-bar); usum[b] = (sum_j cw[b, j])
// * r-bar, this matrix's sum of U^2 (the twin's fused_ssq).
template <typename T>
__global__ void af_factors_multi(const long long* __restrict__ tensors, const long long* __restrict__ blocks) {
  __shared__ T sh[AF_THREADS];
  const long long* e = blocks + 2 * (long long)blockIdx.x;
  const long long* row = tensors + AF_NCOL * e[0];
  const long long b = e[1], r = row[AF_R], c = row[AF_C];
  const T* R = (const T*)row[AF_SA] + b * r;
  T* rfac = (T*)row[AF_ROWS] + b * r;
  const T* cw = (const T*)row[AF_CW] + b * c;
  T s = 0;
  for (long long i = threadIdx.x; i < r; i += AF_THREADS) s += R[i];
  const T rbar = af_block_sum(s, sh) / (T)r;
  for (long long i = threadIdx.x; i < r; i += AF_THREADS) rfac[i] = (T)1 / sqrt(R[i] / rbar);
  T u = 0;
  for (long long j = threadIdx.x; j < c; j += AF_THREADS) u += cw[j];
  u = af_block_sum(u, sh);
  if (threadIdx.x == 0) ((T*)row[AF_USUM])[b] = u * rbar;
}

// One block per tensor (blockIdx.x = its row).  sum U^2 (the matrices' usum, or the chunks' partials), with need_rms
// sum theta^2 (the chunks' partials); rho = (T)((base_lr * scales[ti]) * lr_factor) (the host's double arithmetic),
// alpha = rho * max(RMS(theta), eps2) or rho; scal[0] = alpha / max(RMS(U) / d, 1), scal[1] = 1 - alpha * wd (in
// double from rho without need_rms: the twin's alpha is then a Python float).
template <typename T>
__global__ void af_scalars_multi(const long long* __restrict__ tensors, const double* __restrict__ scales,
                                 const double base_lr, const double lr_factor, const T eps2, const T d,
                                 const double wd, const int need_rms) {
  __shared__ T sh[AF_THREADS];
  const long long* row = tensors + AF_NCOL * (long long)blockIdx.x;
  const long long n = row[AF_N], nch = row[AF_NCH];
  const T* part = (const T*)row[AF_PART];
  const T* up = row[AF_FACT] ? (const T*)row[AF_USUM] : part + nch;
  const long long nu = row[AF_FACT] ? row[AF_B] : nch;
  T s = 0;
  for (long long k = threadIdx.x; k < nu; k += AF_THREADS) s += up[k];
  const T ssq_u = af_block_sum(s, sh);
  const double rho_d = (base_lr * scales[blockIdx.x]) * lr_factor;
  const T rho = (T)rho_d;
  T alpha = rho;
  if (need_rms) {  // uniform over the block
    s = 0;
    for (long long k = threadIdx.x; k < nch; k += AF_THREADS) s += part[k];
    const T ssq_p = af_block_sum(s, sh);
    alpha = rho * af_max(sqrt(ssq_p / (T)n), eps2);
  }
  if (threadIdx.x == 0) {
    T* scal = (T*)row[AF_SCAL];
    scal[0] = alpha / af_max(sqrt(ssq_u / (T)n) / d, (T)1);
    scal[1] = need_rms ? (T)1 - alpha * (T)wd : (T)(1.0 - rho_d * wd);
  }
}

// delta = U~ (with a first moment m <- m * beta1 + U~ * (1 - beta1), delta = m); p <- p * decay (when has_decay)
// - delta.
template <typename T>
__device__ __forceinline__ void af_update(T* __restrict__ p, T* __restrict__ m, const long long i, T u,
                                          const T beta1, const T one_minus_beta1, const int has_m,
                                          const int has_decay, const T decay) {
  T delta = u;
  if (has_m) {
    T mi = m[i] * beta1;
    u = u * one_minus_beta1;
    mi = mi + u;
    m[i] = mi;
    delta = mi;
  }
  T pi = p[i];
  if (has_decay) pi = pi * decay;
  p[i] = pi - delta;
}

// Blocks: (tensor, first element).  Elements [first, first + AF_CHUNK): U~ = (g * (cfac * scal[0])) * rfac
// (factored) or (g / sqrt(V)) * scal[0], then af_update with decay scal[1].  Factored, each thread carries its
// element's (matrix, row, column) from one element to its next (AF_THREADS further) instead of dividing per element.
template <typename T>
__global__ void af_apply_multi(const long long* __restrict__ tensors, const long long* __restrict__ blocks,
                               const T beta1, const T one_minus_beta1, const int has_m, const int has_decay) {
  const long long* e = blocks + 2 * (long long)blockIdx.x;
  const long long* row = tensors + AF_NCOL * e[0];
  const long long n = row[AF_N];
  const long long lo = e[1];
  const long long hi = lo + AF_CHUNK < n ? lo + AF_CHUNK : n;
  T* p = (T*)row[AF_P];
  const T* g = (const T*)row[AF_G];
  T* m = (T*)row[AF_M];
  const T* scal = (const T*)row[AF_SCAL];
  const T step = scal[0];
  const T decay = scal[1];
  const long long first = lo + threadIdx.x;
  if (!row[AF_FACT]) {
    const T* v = (const T*)row[AF_SA];
    for (long long i = first; i < hi; i += AF_THREADS)
      af_update(p, m, i, (g[i] / sqrt(v[i])) * step, beta1, one_minus_beta1, has_m, has_decay, decay);
    return;
  }
  if (first >= hi) return;
  const long long r = row[AF_R], c = row[AF_C];
  const T* rfac = (const T*)row[AF_ROWS];
  const T* cfac = (const T*)row[AF_CFAC];
  const long long dq = AF_THREADS / c, dr = AF_THREADS - dq * c;  // a step of AF_THREADS: dq rows and dr columns
  long long ri = first / c;  // row among the B*r rows
  long long j = first - ri * c;
  long long b = ri / r;
  long long ii = ri - b * r;  // row within matrix b
  for (long long i = first; i < hi; i += AF_THREADS) {
    af_update(p, m, i, (g[i] * (cfac[b * c + j] * step)) * rfac[ri], beta1, one_minus_beta1, has_m, has_decay,
              decay);
    j += dr;
    ri += dq;
    ii += dq;
    if (j >= c) {
      j -= c;
      ++ri;
      ++ii;
    }
    if (ii >= r) {  // into a later matrix (a division only where matrices are shorter than a step)
      b += ii / r;
      ii %= r;
    }
  }
}
