// Fused state kernels of Adafactor8Bit (a8_al_ema, a8_m_ema): dequantize -> float32 EMA -> write the exact value ->
// block reduction -> requantize, one CUDA block per quantization block, in one launch per state; below them the
// fused steps (a8f_*, see their section).  Twin: flatopt/adafactor8bit/state.py
// (``ema``) with flatopt/adafactor8bit/quant.py; the arithmetic is float32 in the twin's order (compiled with --fmad=false), the
// AL log2 is evaluated in double and rounded to float like the twin, reductions are min / max (exact, so the tree
// order cannot change them) through warp shuffles and shared memory: deterministic, no atomics.
// T is the type of the new sample x (float or double): x is rounded to float at its load, before it is squared,
// offset or interpolated; the twin rounds at the same point (state.ema_range), so a double x gives the same bits.
//
// Non-finite values (one documented behaviour, the twin's as well): the block reductions propagate NaN (as
// numpy.maximum / max), so a NaN in a block makes its statistics NaN:
//   AL8 / AL16: scale = min_log = NaN, code 0 for an exact zero, code 1 for every other value (the whole block,
//               zeros apart, decodes as NaN); +inf is an ordinary value (max_log is clamped at 126).
//   uf8 / uf4 / d8 / d4: a block whose absmax is not finite (a NaN or an infinity in it) stores that absmax and
//               is encoded as zeros (the code of 0 everywhere: 128, 8, 127, 7, as a fresh state), so that the whole
//               block decodes as NaN (0 * inf, 0 * NaN).

#include "a8_codec.cuh"

// AL8 (bits 8: uint8 codes) / AL16 (bits 16: uint16 codes) state of n values in blocks of `block`: v = lerp(decode(q), x', w) with
// x' = (square ? x*x : x) + add, or v = x'*w at the first step; out[i] = v (exact), then requantize the block.
// blockDim.x must be a multiple of 32 (at most 1024).
template <typename T>
__global__ void a8_al_ema(void* codes, int bits, float* scale, float* min_log, const T* x, float* out, long long n,
                          int block, float w, int square, float add, float floor_, int first) {
    __shared__ float sh[64];
    unsigned char* q8 = bits == 8 ? (unsigned char*)codes : nullptr;
    unsigned short* q16 = bits == 8 ? nullptr : (unsigned short*)codes;
    const int levels = bits == 8 ? 254 : 65534;
    const long long base = (long long)blockIdx.x * block;
    const float L = (float)levels, sc_old = scale[blockIdx.x], ml_old = min_log[blockIdx.x];
    float lo = A8_INF, hi = -A8_INF;
    for (int i = threadIdx.x; i < block; i += blockDim.x) {
        const long long idx = base + i;
        float v = 0.0f;
        if (idx < n) {
            float xv = (float)x[idx];
            if (square) xv = xv * xv;
            xv = xv + add;
            if (first) {
                v = xv * w;
            } else {
                v = a8_lerp(a8_al_value(a8_al_code_at(codes, bits, idx), sc_old, ml_old, L), xv, w);
            }
            out[idx] = v;
        }
        const float lg = a8_log2(v);
        hi = a8_max(hi, lg);
        if (v != 0.0f) lo = a8_min(lo, lg);
    }
    a8_block_minmax(lo, hi, sh);
    float mn, sc;
    a8_al_stats(lo, hi, floor_, mn, sc);
    for (int i = threadIdx.x; i < block; i += blockDim.x) {
        const long long idx = base + i;
        const unsigned int c = a8_al_code(idx < n ? out[idx] : 0.0f, mn, sc, L);
        if (q8) q8[idx] = (unsigned char)c; else q16[idx] = (unsigned short)c;
    }
    if (threadIdx.x == 0) { scale[blockIdx.x] = sc; min_log[blockIdx.x] = mn; }
}

// Signed first moment in blocks of `mblock` (fmt 0 uf8, 1 uf4, 2 d8, 3 d4; 4-bit codes packed two per byte, even
// index in the high nibble): m = lerp(decode(q), x, w); out[i] = m (exact); absmax reduction; requantize.
template <typename T>
__global__ void a8_m_ema(unsigned char* q, float* absmax, const T* x, float* out, long long n, int mblock, int fmt,
                         float w, const float* qmap, int qmap_size) {
    __shared__ float sh[64];
    __shared__ float mp[256];
    a8_map_to_shared(mp, qmap, qmap_size);
    const long long base = (long long)blockIdx.x * mblock;
    const float am_old = absmax[blockIdx.x];
    float lo = 0.0f, hi = 0.0f;
    for (int i = threadIdx.x; i < mblock; i += blockDim.x) {
        const long long idx = base + i;
        float v = 0.0f;
        if (idx < n) {
            v = a8_lerp(a8_m_old(q, idx, fmt, am_old, mp), (float)x[idx], w);
            out[idx] = v;
        }
        hi = a8_max(hi, fabsf(v));
    }
    __syncthreads();  // every thread has read its old codes before any is overwritten
    a8_m_encode(q, absmax, out, base, n, mblock, fmt, lo, hi, mp, qmap_size, sh);
}

// ================================================================================================================
// Fused steps (non-APOLLO paths).  Host side and launch order: flatopt/adafactor8bit/fused.py; twin:
// flatopt/adafactor8bit/{paths,flat,state,quant,common}.py with flatopt/adafactor/factored_passes.py.  T is the
// parameter's dtype; every elementwise operation is the twin's, in the twin's order and precision (a float32 state
// combined with a T value is computed in T where NumPy's promotion does so; see a8_lerp_t).  The sums are
// deterministic (fixed per-thread strides, a shared-memory tree, partials folded in a fixed order; the grid is a
// function of the sizes only; no atomics) but not in the twin's order: see fused.py for what that changes.
// Kernels that reduce must be launched with blockDim.x == A8F_THREADS (== SQ_THREADS: sums by sq_block, sq_sum.cuh).
#define A8F_THREADS 256
#define A8F_ROWS 64      // rows per column partial (a8f_col_parts)
#define A8F_CHUNK 4096   // elements per partial of the elementwise step (a8f_flat_u)

// sq_block
#include "sq_sum.cuh"

template <typename T>
__device__ __forceinline__ T a8f_maxT(T a, T b) { return (isnan(a) || a >= b) ? a : b; }

// Old value i of a non-negative slot: decoded from its AL codes (quant) or the float32 state itself.
__device__ __forceinline__ float a8f_old(const void* codes, int bits, const float* scale, const float* min_log,
                                         int block, const float* vals, int quant, long long i) {
    if (!quant) return vals[i];
    const long long b = i / block;
    return a8_al_value(a8_al_code_at(codes, bits, i), scale[b], min_log[b], bits == 8 ? 254.0f : 65534.0f);
}

// Element i of a (B, r, c) tensor: its row i / c and its column factor's index (row / r) * c + i % c.  small (the
// tensor has at most A8F_SMALL elements; uniform over a launch): in 32-bit unsigned arithmetic, every operand and
// result then below 2^32 (a 64-bit division is a long software sequence per element).
#define A8F_SMALL 0xFFFFFFFFLL
__device__ __forceinline__ void a8f_rc(long long i, long long r, long long c, int small, long long& row,
                                       long long& k) {
    if (small) {
        const unsigned int ui = (unsigned int)i, uc = (unsigned int)c, urow = ui / uc;
        row = (long long)urow;
        k = (long long)((urow / (unsigned int)r) * uc + (ui - urow * uc));
    } else {
        row = i / c;
        k = (row / r) * c + (i - row * c);
    }
}

// Row statistics of an (nrows = B*r, c) matrix and the EMA of the row slot, one block per row:
//   mode 0 (x: T, the gradient):  s = sum_j x^2;  s = s/c + add (in T);  R = lerp_T(R_old, s, w)   (state.lerp_)
//                                  inv[row] = T(1/R) (float divide) — the fused statistics' 1/R
//   mode 1 (x: float, U - m):      s = sum_j T(x^2);  s = s/c + add (in T);  R = lerp(R_old, float(s), w)
// out[row] = R (the exact new value: the float32 state itself, or scratch to be requantized by a8f_al_encode).
// need_p: prow[row] = sum_j p^2 (the partials of sum theta^2).
template <typename T>
__device__ void a8f_row(long long row, const void* x, int mode, long long c, const void* codes, int bits,
                        const float* scale, const float* min_log, int block, float* out, int quant, float w, int lo,
                        float add, T* inv, const T* p, T* prow, int need_p, T* sh) {
    {
        const long long base = row * c;
        T s = 0, sp = 0;
        for (long long j = threadIdx.x; j < c; j += A8F_THREADS) {
            if (mode == 0) {
                const T v = ((const T*)x)[base + j];
                s += v * v;
            } else {
                const float v = ((const float*)x)[base + j];
                s += (T)(v * v);
            }
            if (need_p) { const T pv = p[base + j]; sp += pv * pv; }
        }
        s = sq_block(s, sh);
        if (need_p) sp = sq_block(sp, sh);
        if (threadIdx.x == 0) {
            const float old = a8f_old(codes, bits, scale, min_log, block, out, quant, row);
            float R;
            if (mode == 0) {
                s = s / (T)(float)c;
                s = s + (T)add;
                R = a8_lerp_t<T>(old, s, w, lo);
                inv[row] = (T)(1.0f / R);
            } else {
                s = s / (T)c;
                s = s + (T)add;
                R = a8_lerp_t<float>(old, (float)s, w, lo);
            }
            out[row] = R;
            if (need_p) prow[row] = sp;
        }
    }
}

template <typename T>
__global__ void a8f_rows(const void* x, int mode, long long nrows, long long c, const void* codes, int bits,
                         const float* scale, const float* min_log, int block, float* out, int quant, float w, int lo,
                         float add, T* inv, const T* p, T* prow, int need_p) {
    __shared__ T sh[A8F_THREADS];
    for (long long row = blockIdx.x; row < nrows; row += gridDim.x)
        a8f_row<T>(row, x, mode, c, codes, bits, scale, min_log, block, out, quant, w, lo, add, inv, p, prow, need_p,
                   sh);
}

// CAME with Fira: the rows' shares of sum U^2 of its step U = (m * cf_j) * rf_i (FactoredPasses.sums): one block per
// row, urow[row] = (sum_j (T(m) * cf_j)^2) * rf_row^2.
template <typename T>
__global__ void a8f_usq_rows(const float* m, const T* rf, const T* cf, long long nrows, long long r, long long c,
                             T* urow) {
    __shared__ T sh[A8F_THREADS];
    for (long long row = blockIdx.x; row < nrows; row += gridDim.x) {
        const T* cfb = cf + (row / r) * c;
        T s = 0;
        for (long long j = threadIdx.x; j < c; j += A8F_THREADS) {
            const T v = (T)m[row * c + j] * cfb[j];
            s += v * v;
        }
        s = sq_block(s, sh);
        if (threadIdx.x == 0) urow[row] = s * (rf[row] * rf[row]);
    }
}

// Column partials over A8F_ROWS rows at a time (one thread per column; block (tile, part, b) of a 1-D grid):
//   cparts[part][b*c + j] = sum over the part's rows of S_ij, S = x^2 (mode 0, x: T) or T(x^2) (mode 1, x: float);
//   fused: wparts[...] = sum of S'_ij * inv_i, S' = S, or T(m^2) when m (the exact first moment, float) is given.
template <typename T>
__device__ void a8f_col_part(long long blk, const void* x, int mode, const float* m, int use_m, const T* inv,
                             int fused, long long B, long long r, long long c, T* cparts, T* wparts) {
    const long long tiles = (c + blockDim.x - 1) / blockDim.x, parts = (r + A8F_ROWS - 1) / A8F_ROWS;
    {
        const long long tile = blk % tiles, part = (blk / tiles) % parts, b = blk / (tiles * parts);
        const long long j = tile * blockDim.x + threadIdx.x;
        if (j >= c) return;
        const long long i1 = min(r, (part + 1) * A8F_ROWS);
        T cs = 0, ws = 0;
        for (long long i = part * A8F_ROWS; i < i1; ++i) {
            const long long idx = (b * r + i) * c + j;
            T sq;
            if (mode == 0) { const T v = ((const T*)x)[idx]; sq = v * v; }
            else { const float v = ((const float*)x)[idx]; sq = (T)(v * v); }
            cs += sq;
            if (fused) {
                const T sw = use_m ? (T)(m[idx] * m[idx]) : sq;
                ws += sw * inv[b * r + i];
            }
        }
        cparts[part * B * c + b * c + j] = cs;
        if (fused) wparts[part * B * c + b * c + j] = ws;
    }
}

// (no barrier: a thread past the last column leaves)
template <typename T>
__global__ void a8f_col_parts(const void* x, int mode, const float* m, int use_m, const T* inv, int fused, long long B,
                              long long r, long long c, T* cparts, T* wparts) {
    const long long total = ((c + blockDim.x - 1) / blockDim.x) * ((r + A8F_ROWS - 1) / A8F_ROWS) * B;
    for (long long blk = blockIdx.x; blk < total; blk += gridDim.x)
        a8f_col_part<T>(blk, x, mode, m, use_m, inv, fused, B, r, c, cparts, wparts);
}

// Columns: fold the partials in part order, s = s/r + add (in T), C = lerp(C_old, float(s), w) (state.ema rounds
// its sample to float first); out[k] = C (exact); fused: wsum[k] = the folded W partials.
template <typename T>
__device__ __forceinline__ void a8f_col_one(long long k, const T* cparts, const T* wparts, int fused, long long parts,
                                            long long bc, long long r, const void* codes, int bits,
                                            const float* scale, const float* min_log, int block, float* out,
                                            int quant, float w, int lo, float add, T* wsum) {
    {
        T s = 0, ws = 0;
        for (long long y = 0; y < parts; ++y) {
            s += cparts[y * bc + k];
            if (fused) ws += wparts[y * bc + k];
        }
        s = s / (T)r;
        s = s + (T)add;
        out[k] = a8_lerp_t<float>(a8f_old(codes, bits, scale, min_log, block, out, quant, k), (float)s, w, lo);
        if (fused) wsum[k] = ws;
    }
}

template <typename T>
__global__ void a8f_col_fin(const T* cparts, const T* wparts, int fused, long long parts, long long bc, long long r,
                            const void* codes, int bits, const float* scale, const float* min_log, int block,
                            float* out, int quant, float w, int lo, float add, T* wsum) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < bc; k += stride)
        a8f_col_one<T>(k, cparts, wparts, fused, parts, bc, r, codes, bits, scale, min_log, block, out, quant, w, lo,
                       add, wsum);
}

// Requantize up to two AL slots of exact values (one block per codec block; blocks [0, nb1) slot 1, then slot 2).
// The codes of the padding past n are 0, as a fresh state's.
__device__ void a8f_encode_block(void* q, float* scale, float* min_log, const float* v, long long n, long long blk,
                                 int bits, int block, float floor_, float* sh) {
    const long long base = blk * block;
    const float L = bits == 8 ? 254.0f : 65534.0f;
    float lo = A8_INF, hi = -A8_INF;
    for (int i = threadIdx.x; i < block; i += blockDim.x) {
        const float val = base + i < n ? v[base + i] : 0.0f;
        const float lg = a8_log2(val);
        hi = a8_max(hi, lg);
        if (val != 0.0f) lo = a8_min(lo, lg);
    }
    a8_block_minmax(lo, hi, sh);
    float mn, sc;
    a8_al_stats(lo, hi, floor_, mn, sc);
    for (int i = threadIdx.x; i < block; i += blockDim.x) {
        const long long idx = base + i;
        const unsigned int code = a8_al_code(idx < n ? v[idx] : 0.0f, mn, sc, L);
        if (bits == 8) ((unsigned char*)q)[idx] = (unsigned char)code;
        else ((unsigned short*)q)[idx] = (unsigned short)code;
    }
    if (threadIdx.x == 0) { scale[blk] = sc; min_log[blk] = mn; }
}

template <typename T>
__global__ void a8f_al_encode(void* q1, float* sc1, float* ml1, const float* v1, long long n1, long long nb1,
                              void* q2, float* sc2, float* ml2, const float* v2, long long n2, int bits, int block,
                              float floor_) {
    __shared__ float sh[64];
    const bool first = blockIdx.x < nb1;
    if (first) a8f_encode_block(q1, sc1, ml1, v1, n1, blockIdx.x, bits, block, floor_, sh);
    else a8f_encode_block(q2, sc2, ml2, v2, n2, blockIdx.x - nb1, bits, block, floor_, sh);
}

// The factors, one block per matrix b (FactoredPasses.factors): rbar = max(sum_i R_bi / r, floor) (in T),
// rf = 1/sqrt(R/rbar), cf = 1/sqrt(float sqrt(C)) (in T); use_w: ub[b] = (sum_j cf^2 * W) * rbar, the matrix's
// share of sum U^2 (FactoredPasses.fused_ssq).
template <typename T>
__device__ void a8f_factor(long long b, const float* R, const float* C, const T* wsum, int use_w, long long r,
                           long long c, float rfloor, T* rf, T* cf, T* ub, T* sh) {
    const int tid = threadIdx.x;
    {
        T acc = 0;
        for (long long i = tid; i < r; i += A8F_THREADS) acc += (T)R[b * r + i];
        T rbar = sq_block(acc, sh);  // valid in thread 0: broadcast
        if (tid == 0) sh[0] = a8f_maxT(rbar / (T)r, (T)rfloor);
        __syncthreads();
        rbar = sh[0];
        __syncthreads();
        for (long long i = tid; i < r; i += A8F_THREADS) rf[b * r + i] = (T)1.0 / sqrt((T)R[b * r + i] / rbar);
        T pu = 0;
        for (long long j = tid; j < c; j += A8F_THREADS) {
            const T f = (T)1.0 / (T)sqrtf(C[b * c + j]);
            cf[b * c + j] = f;
            if (use_w) pu += (f * f) * wsum[b * c + j];
        }
        if (use_w) {
            pu = sq_block(pu, sh);
            if (tid == 0) ub[b] = pu * rbar;
        }
    }
}

template <typename T>
__global__ void a8f_factors(const float* R, const float* C, const T* wsum, int use_w, long long B, long long r,
                            long long c, float rfloor, T* rf, T* cf, T* ub) {
    __shared__ T sh[A8F_THREADS];
    for (long long b = blockIdx.x; b < B; b += gridDim.x) a8f_factor<T>(b, R, C, wsum, use_w, r, c, rfloor, rf, cf, ub, sh);
}

// The Fira limiter (adafactor8bit/fira.py ``factor``): the factor for the update norm nrm; updates prev in place.
__device__ __forceinline__ float a8_fira(float* prev, float nrm, float one_m) {
    const float norm = isfinite(nrm) ? nrm : 0.0f, p = prev[0];
    const bool reset = p < 1e-6f;
    const float lim = a8_max(norm / (p + 1e-8f), one_m) / one_m;
    const float f = reset ? 1.0f : 1.0f / lim;
    prev[0] = reset ? norm : norm * f;
    return f;
}

// The step's scalars (one block): scal[0] = the step scale s, scal[1] = the decay factor, scal[2] = alpha,
// scal[3] = CAME's clip divisor.  sum U^2 from the nu partials (use_u 1: ub, T, a8f_factors; 2: uparts, float,
// a8f_flat_u); alpha = rho (or max(RMS(theta), eps2)*rho from the T partials pparts, np_ of them), then * or / mult
// (mult_kind 1 / 2);  mode 0: s = alpha / max(1, |U| / (sqrt(n) d)) when clip;  mode 1 (CAME): scal[3] =
// max(RMS(U)/d, 1) when clip, s = alpha.  Mode 0 with fira / lag (lag_norm) / negate (maximize) as
// Scalars.step_scale: the Fira factor, the previous step's norm, -s.
template <typename T>
__device__ void a8f_scalars_body(int mode, const T* ub, const float* uparts, int use_u, long long nu,
                                 const T* pparts, long long np_, float rho, int scale_p, float eps2, int mult_kind,
                                 float mult, float sqrt_n, float sqrt_nd, float d, int clip, int has_decay, float wd,
                                 int swd, float* prev_norm, int lag, float* fira_prev, float* lag_fira, int fira,
                                 float one_m, int negate, float* scal, T* sh, float* shf) {
    const int tid = threadIdx.x;
    T ssq_u = 0;
    if (use_u == 1) {
        T a = 0;
        for (long long k = tid; k < nu; k += A8F_THREADS) a += ub[k];
        ssq_u = sq_block(a, sh);
    } else if (use_u == 2) {
        float a = 0.0f;
        for (long long k = tid; k < nu; k += A8F_THREADS) a += uparts[k];
        ssq_u = (T)sq_block(a, shf);
    }
    float alpha = rho;
    if (scale_p) {
        T a = 0;
        for (long long k = tid; k < np_; k += A8F_THREADS) a += pparts[k];
        const T ssq_p = sq_block(a, sh);
        alpha = a8_max(sqrtf((float)ssq_p) / sqrt_n, eps2) * rho;
    }
    if (mult_kind == 1) alpha = alpha * mult;
    else if (mult_kind == 2) alpha = alpha / mult;
    if (tid != 0) return;
    float s = alpha, cl = 1.0f;
    if (mode == 0 && (clip || fira)) {  // Scalars.step_scale
        float nrm = sqrtf((float)ssq_u);
        const bool bad = !isfinite(nrm);
        if (fira && bad) nrm = 0.0f;
        float f = 1.0f;
        if (lag) {  // the previous step's norm and Fira factor; this step's are kept for the next
            const float used = prev_norm[0];
            prev_norm[0] = bad ? 0.0f : nrm;
            if (fira) { f = lag_fira[0]; lag_fira[0] = a8_fira(fira_prev, nrm, one_m); }
            nrm = used;
        } else if (fira) {
            f = a8_fira(fira_prev, nrm, one_m);
        }
        if (fira) s = alpha * f;
        if (clip) s = s / a8_max(nrm / sqrt_nd, 1.0f);
        if (fira && bad) s = 0.0f;
    } else if (mode == 1 && clip) {
        cl = a8_max((sqrtf((float)ssq_u) / sqrt_n) / d, 1.0f);
    }
    if (negate) s = -s;
    {
        scal[0] = s;
        scal[1] = has_decay ? 1.0f - (swd ? alpha : rho) * wd : 1.0f;
        scal[2] = alpha;
        scal[3] = cl;
    }
}

template <typename T>
__global__ void a8f_scalars(int mode, const T* ub, const float* uparts, int use_u, long long nu, const T* pparts,
                            long long np_, float rho, int scale_p, float eps2, int mult_kind, float mult, float sqrt_n,
                            float sqrt_nd, float d, int clip, int has_decay, float wd, int swd, float* prev_norm,
                            int lag, float* fira_prev, float* lag_fira, int fira, float one_m, int negate,
                            float* scal) {
    __shared__ T sh[A8F_THREADS];
    __shared__ float shf[A8F_THREADS];
    a8f_scalars_body<T>(mode, ub, uparts, use_u, nu, pparts, np_, rho, scale_p, eps2, mult_kind, mult, sqrt_n, sqrt_nd,
                        d, clip, has_decay, wd, swd, prev_norm, lag, fira_prev, lag_fira, fira, one_m, negate, scal,
                        sh, shf);
}

// theta <- theta*decay - (x * (cf_j * s)) * rf_i over the (B, r, c) tensor (FactoredPasses.apply); x: T (the
// gradient) or float (the exact first moment, xf32).
template <typename T>
__device__ __forceinline__ void a8f_apply_one(long long i, T* p, const void* x, int xf32, const T* rf, const T* cf,
                                              long long r, long long c, int small, T s, T dec, int has_decay,
                                              int zero_nf) {
    long long row, k;
    a8f_rc(i, r, c, small, row, k);
    const T xv = xf32 ? (T)((const float*)x)[i] : ((const T*)x)[i];
    T u = (xv * (cf[k] * s)) * rf[row];
    if (zero_nf && !isfinite(u)) u = 0;  // Fira: a non-finite entry of the update is dropped
    T pv = p[i];
    if (has_decay) pv = pv * dec;
    p[i] = pv - u;
}

template <typename T>
__global__ void a8f_apply(T* p, const void* x, int xf32, const T* rf, const T* cf, long long n, long long r,
                          long long c, const float* scal, int has_decay, int zero_nf) {
    const T s = (T)scal[0], dec = (T)scal[1];
    const int small = n <= A8F_SMALL;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        a8f_apply_one<T>(i, p, x, xf32, rf, cf, r, c, small, s, dec, has_decay, zero_nf);
}

// The first moment, one block per block of mblock values: u = float(g) (mode 0) or CAME's U = float(T(float(g *
// (cf_j / clip))) * rf_i) (mode 1, FactoredPasses.write); m = lerp(m_old, u, w); mout[i] = m (exact: the float32
// state itself, or scratch); quant: requantize the block (as a8_m_ema); mode 1: res[i] = u - m.  Mode 2 (the
// momentum-only rule, flat.flat_phases pass 2): u = res[i] / clip (res: the elementwise step's U), and with m2
// the block's sum of m^2 (float) into m2parts[block].
template <typename T>
__global__ void a8f_m_step(const T* g, int mode, const T* rf, const T* cf, long long r, long long c,
                           const float* scal, int clip, unsigned char* q, float* absmax, int quant, float* mout,
                           float* res, long long n, int mblock, int fmt, float w, int lo, const float* qmap,
                           int qmap_size, int neg, float* m2parts, int m2) {
    __shared__ float sh[64];
    __shared__ float shs[A8F_THREADS];
    __shared__ float mp[256];
    a8_map_to_shared(mp, qmap, qmap_size);
    const long long base = (long long)blockIdx.x * mblock;
    const float am_old = quant ? absmax[blockIdx.x] : 0.0f;
    const T cl = clip ? (T)scal[3] : (T)1;
    const int small = n <= A8F_SMALL;
    float lo_ = 0.0f, hi = 0.0f, sm = 0.0f;
    for (int i = threadIdx.x; i < mblock; i += blockDim.x) {
        const long long idx = base + i;
        float v = 0.0f;
        if (idx < n) {
            float u;
            if (mode == 0) {
                u = (float)g[idx];
                if (neg) u = -u;  // maximize: the negated gradient (rounded to float), as common.src_chunk
            } else if (mode == 2) {
                u = res[idx];
                if (clip) u = u / scal[3];
            } else {
                long long row, k;
                a8f_rc(idx, r, c, small, row, k);
                T f = cf[k];
                if (clip) f = f / cl;
                if (neg) f = -f;  // maximize: the column factor negated after the clip
                u = (float)((T)(float)(g[idx] * f) * rf[row]);
            }
            float old;
            if (quant) {
                old = a8_m_old(q, idx, fmt, am_old, mp);
            } else {
                old = mout[idx];
            }
            v = a8_lerp_t<float>(old, u, w, lo);
            mout[idx] = v;
            if (mode == 1) res[idx] = u - v;
            sm += v * v;
        }
        hi = a8_max(hi, fabsf(v));
    }
    if (m2) { sm = sq_block(sm, shs); if (threadIdx.x == 0) m2parts[blockIdx.x] = sm; }
    if (!quant) return;
    __syncthreads();  // every thread has read its old codes before any is overwritten
    a8_m_encode(q, absmax, mout, base, n, mblock, fmt, lo_, hi, mp, qmap_size, sh);
}

// The elementwise (unfactored) step's U, one block per A8F_CHUNK values (flat.flat_phases, pass 1): the second
// moment v (exact values from a8_al_ema, or the float32 state updated here: v*(1-b) + float(float(g*b)*g) [+ b*eps]),
// u = src/(sqrt(v) + eps) (adam: src*(1/(...)) with a first moment) or src*(1/sqrt(max(v, eps^2))), src the exact
// first moment m (float) or g; u[i] (float); partials: uparts = sum u^2 (float), pparts = sum p^2 (T).
// The elementwise step's source of U (flat.flat_phases): the gradient, negated and rounded to float for maximize
// (common.src_chunk; T's products and quotients of floats rounded to float are the float operations' results).
template <typename T>
__device__ __forceinline__ T a8f_flat_g(const T* g, long long idx, int neg) {
    return neg ? (T)(-(float)g[idx]) : g[idx];
}

// U of one element from its new second moment vv: adam: src/(sqrt(vv) + eps) (m*(1/(...)) with a first moment),
// else src*(1/sqrt(max(vv, eps^2))); src the exact first moment m (float) or the gradient gv.
template <typename T>
__device__ __forceinline__ float a8f_flat_uv(T gv, float vv, const float* m, int use_m, long long idx, int adam,
                                             float eps_d, float eps_sq) {
    float o;
    if (adam) {
        o = sqrtf(vv);
        o = o + eps_d;
        if (use_m) { o = 1.0f / o; o = m[idx] * o; }
        else o = (float)(gv / (T)o);
    } else {
        o = a8_max(vv, eps_sq);
        o = sqrtf(o);
        o = 1.0f / o;
        o = use_m ? m[idx] * o : (float)(gv * (T)o);
    }
    return o;
}

// u: where U goes (null: not kept; a8f_flat_apply_seg recomputes it from the new v, bit for bit).
template <typename T>
__device__ void a8f_flat_chunk(long long chunk, const T* g, float* v, int vquant, float b, float b1m, float beps,
                               const float* m, int use_m, int adam, float eps_d, float eps_sq, float* u, const T* p,
                               T* pparts, float* uparts, long long n, int need_u, int need_p, int neg, int sgd,
                               float b1c, T* sh, float* shf) {
    const long long base = chunk * A8F_CHUNK;
    T sp = 0;
    float su = 0.0f;
    for (int i = threadIdx.x; i < A8F_CHUNK; i += A8F_THREADS) {
        const long long idx = base + i;
        if (idx >= n) break;
        const T gv = a8f_flat_g(g, idx, neg);
        float o;
        if (sgd) {  // SGD mode: u = m / (1 - beta1), or g
            o = use_m ? m[idx] / b1c : (float)gv;
            u[idx] = o;
            su += o * o;
            if (need_p) { const T pv = p[idx]; sp += pv * pv; }
            continue;
        }
        float vv = v[idx];
        if (!vquant) {
            const float t = (float)((T)(float)(gv * (T)b) * gv);
            vv = vv * b1m;
            vv = vv + t;
            if (beps != 0.0f) vv = vv + beps;
            v[idx] = vv;
        }
        o = a8f_flat_uv<T>(gv, vv, m, use_m, idx, adam, eps_d, eps_sq);
        if (u) u[idx] = o;
        su += o * o;
        if (need_p) { const T pv = p[idx]; sp += pv * pv; }
    }
    if (need_u) { su = sq_block(su, shf); if (threadIdx.x == 0) uparts[chunk] = su; }
    if (need_p) { sp = sq_block(sp, sh); if (threadIdx.x == 0) pparts[chunk] = sp; }
}

template <typename T>
__global__ void a8f_flat_u(const T* g, float* v, int vquant, float b, float b1m, float beps, const float* m, int use_m,
                           int adam,
                           float eps_d, float eps_sq, float* u, const T* p, T* pparts, float* uparts, long long n,
                           int need_u, int need_p, int neg, int sgd, float b1c) {
    __shared__ T sh[A8F_THREADS];
    __shared__ float shf[A8F_THREADS];
    a8f_flat_chunk<T>(blockIdx.x, g, v, vquant, b, b1m, beps, m, use_m, adam, eps_d, eps_sq, u, p, pparts, uparts, n,
                      need_u, need_p, neg, sgd, b1c, sh, shf);
}

// theta <- theta*decay - u*s (flat.apply_tasks).
template <typename T>
__device__ __forceinline__ void a8f_flat_one(long long i, T* p, float u, float s, T dec, int has_decay, int zero_nf) {
    T pv = p[i];
    if (has_decay) pv = pv * dec;
    float ui = u * s;
    if (zero_nf && !isfinite(ui)) ui = 0.0f;
    p[i] = pv - (T)ui;
}

template <typename T>
__global__ void a8f_flat_apply(T* p, const float* u, long long n, const float* scal, int has_decay, int zero_nf) {
    const float s = scal[0];
    const T dec = (T)scal[1];
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        a8f_flat_one<T>(i, p, u[i], s, dec, has_decay, zero_nf);
}

// ================================================================================================================
// Segmented steps: the same passes over every tensor of a group (flatopt/adafactor8bit/segmented.py: the tensors of
// one configuration, dtype, step and learning rate on one device), one launch per pass whatever the number of
// tensors.  Each block runs one entry of its pass's block list (int64, built once per plan): the tensor's index and
// the part of it (a row, a column-partial block, a column chunk, a codec block, a matrix, an element chunk) that the
// per-tensor kernel above runs as one of its blocks, through the same device function: each tensor gets exactly the
// per-tensor kernels' bits (every reduction is cut and ordered by the tensor's own sizes).
// Tensor rows (A8S_NCOL int64 fields; segmented.py FIELDS): addresses of its arrays and of its scratch in the group's
// workspace, its sizes, two float32 bit patterns.  Unused addresses are 0.
#define A8S_P 0        // theta
#define A8S_G 1        // the gradient
#define A8S_N 2        // elements
#define A8S_B 3        // matrices (factored)
#define A8S_R 4        // rows of a matrix
#define A8S_C 5        // columns of a matrix
#define A8S_RQ 6       // the row slot: codes (or the float32 state), bits, scale, min_log, exact values, quantized
#define A8S_RBITS 7
#define A8S_RSC 8
#define A8S_RML 9
#define A8S_RX 10
#define A8S_RQUANT 11
#define A8S_CQ 12      // the column slot, likewise
#define A8S_CBITS 13
#define A8S_CSC 14
#define A8S_CML 15
#define A8S_CX 16
#define A8S_CQUANT 17
#define A8S_BLOCK 18   // the AL codec's block size
#define A8S_INV 19     // B*r (T): 1/R
#define A8S_PP 20      // (T) partials of sum theta^2: per row (factored), per chunk (elementwise)
#define A8S_NPP 21     // their number
#define A8S_RF 22      // B*r (T): the row factors
#define A8S_CF 23      // B*c (T): the column factors
#define A8S_CPARTS 24  // parts*B*c (T): column partials of sum x^2
#define A8S_WPARTS 25  // parts*B*c (T): column partials of W
#define A8S_WSUM 26    // B*c (T): W
#define A8S_UB 27      // (T) per matrix: its share of sum U^2
#define A8S_NU 28      // the partials of sum U^2: B (factored, UB) or the chunks (elementwise, UPARTS)
#define A8S_PARTS 29   // row parts of a column: ceil(r / A8F_ROWS)
#define A8S_SCAL 30    // 4 floats: the step's scalars (a8f_scalars)
#define A8S_PREV 31    // prev_update_norm (lag_norm), fira_prev, lag_fira_scale (SCAL when unused)
#define A8S_FPREV 32
#define A8S_LAGF 33
#define A8S_SQRTN 34   // float32 bits of sqrt(n)
#define A8S_SQRTND 35  // float32 bits of sqrt(n) * d
#define A8S_UPARTS 36  // elementwise: (float) partials of sum U^2 per chunk
#define A8S_V 37       // elementwise: the float32 second moment
#define A8S_RPB 38     // rows per entry of a8f_rows_seg, column blocks per entry of a8f_cols_seg, matrices per entry
#define A8S_CPB 39     // of a8f_factors_seg (several small units to a block: a short table for many tiny rows or
#define A8S_FPB 40     // matrices)
#define A8S_NCOL 41

__device__ __forceinline__ const long long* a8s_row(const long long* tab, long long ti) { return tab + A8S_NCOL * ti; }
template <typename P>
__device__ __forceinline__ P* a8s_ptr(const long long* row, int f) { return (P*)row[f]; }
__device__ __forceinline__ float a8s_f32(const long long* row, int f) { return __int_as_float((int)row[f]); }

// The units [first, min(first + per, total)) of an entry.
__device__ __forceinline__ long long a8s_end(long long first, long long per, long long total) {
    return first + per < total ? first + per : total;
}

// Entries (tensor, first row; RPB rows): a8f_rows in mode 0 (the gradient).
template <typename T>
__global__ void a8f_rows_seg(const long long* __restrict__ tab, const long long* __restrict__ ent, float w, int lo,
                             float add, int need_p) {
    __shared__ T sh[A8F_THREADS];
    const long long* e = ent + 2 * (long long)blockIdx.x;
    const long long* t = a8s_row(tab, e[0]);
    const long long end = a8s_end(e[1], t[A8S_RPB], t[A8S_B] * t[A8S_R]);
    for (long long row = e[1]; row < end; ++row)
        a8f_row<T>(row, a8s_ptr<const void>(t, A8S_G), 0, t[A8S_C], a8s_ptr<const void>(t, A8S_RQ),
                   (int)t[A8S_RBITS], a8s_ptr<const float>(t, A8S_RSC), a8s_ptr<const float>(t, A8S_RML),
                   (int)t[A8S_BLOCK], a8s_ptr<float>(t, A8S_RX), (int)t[A8S_RQUANT], w, lo, add,
                   a8s_ptr<T>(t, A8S_INV), a8s_ptr<const T>(t, A8S_P), a8s_ptr<T>(t, A8S_PP), need_p, sh);
}

// Entries (tensor, first block; CPB blocks): a8f_col_parts in mode 0, fused with W (launched with blockDim.x == 128,
// as it).
template <typename T>
__global__ void a8f_cols_seg(const long long* __restrict__ tab, const long long* __restrict__ ent) {
    const long long* e = ent + 2 * (long long)blockIdx.x;
    const long long* t = a8s_row(tab, e[0]);
    const long long r = t[A8S_R], c = t[A8S_C];
    const long long total = ((c + blockDim.x - 1) / blockDim.x) * ((r + A8F_ROWS - 1) / A8F_ROWS) * t[A8S_B];
    const long long end = a8s_end(e[1], t[A8S_CPB], total);
    for (long long blk = e[1]; blk < end; ++blk)
        a8f_col_part<T>(blk, a8s_ptr<const void>(t, A8S_G), 0, nullptr, 0, a8s_ptr<const T>(t, A8S_INV), 1, t[A8S_B],
                        r, c, a8s_ptr<T>(t, A8S_CPARTS), a8s_ptr<T>(t, A8S_WPARTS));
}

// Entries (tensor, chunk of blockDim.x columns): a8f_col_fin, fused.
template <typename T>
__global__ void a8f_colfin_seg(const long long* __restrict__ tab, const long long* __restrict__ ent, float w, int lo,
                               float add) {
    const long long* e = ent + 2 * (long long)blockIdx.x;
    const long long* t = a8s_row(tab, e[0]);
    const long long bc = t[A8S_B] * t[A8S_C], k = e[1] * blockDim.x + threadIdx.x;
    if (k >= bc) return;
    a8f_col_one<T>(k, a8s_ptr<const T>(t, A8S_CPARTS), a8s_ptr<const T>(t, A8S_WPARTS), 1, t[A8S_PARTS], bc, t[A8S_R],
                   a8s_ptr<const void>(t, A8S_CQ), (int)t[A8S_CBITS], a8s_ptr<const float>(t, A8S_CSC),
                   a8s_ptr<const float>(t, A8S_CML), (int)t[A8S_BLOCK], a8s_ptr<float>(t, A8S_CX),
                   (int)t[A8S_CQUANT], w, lo, add, a8s_ptr<T>(t, A8S_WSUM));
}

// Entries (tensor, slot (0 rows, 1 columns), codec block): a8f_al_encode of the quantized slots.
template <typename T>
__global__ void a8f_encode_seg(const long long* __restrict__ tab, const long long* __restrict__ ent, float floor_) {
    __shared__ float sh[64];
    const long long* e = ent + 3 * (long long)blockIdx.x;
    const long long* t = a8s_row(tab, e[0]);
    const int o = e[1] ? A8S_CQ - A8S_RQ : 0;
    const long long n = e[1] ? t[A8S_B] * t[A8S_C] : t[A8S_B] * t[A8S_R];
    a8f_encode_block(a8s_ptr<void>(t, A8S_RQ + o), a8s_ptr<float>(t, A8S_RSC + o), a8s_ptr<float>(t, A8S_RML + o),
                     a8s_ptr<const float>(t, A8S_RX + o), n, e[2], (int)t[A8S_RBITS + o], (int)t[A8S_BLOCK], floor_,
                     sh);
}

// Entries (tensor, first matrix; FPB matrices): a8f_factors.
template <typename T>
__global__ void a8f_factors_seg(const long long* __restrict__ tab, const long long* __restrict__ ent, int use_w,
                                float rfloor) {
    __shared__ T sh[A8F_THREADS];
    const long long* e = ent + 2 * (long long)blockIdx.x;
    const long long* t = a8s_row(tab, e[0]);
    const long long end = a8s_end(e[1], t[A8S_FPB], t[A8S_B]);
    for (long long b = e[1]; b < end; ++b)
        a8f_factor<T>(b, a8s_ptr<const float>(t, A8S_RX), a8s_ptr<const float>(t, A8S_CX),
                      a8s_ptr<const T>(t, A8S_WSUM), use_w, t[A8S_R], t[A8S_C], rfloor, a8s_ptr<T>(t, A8S_RF),
                      a8s_ptr<T>(t, A8S_CF), a8s_ptr<T>(t, A8S_UB), sh);
}

// One block per tensor (blockIdx.x = its row): a8f_scalars in mode 0; use_u 1: sum U^2 from UB (factored), 2: from
// UPARTS (elementwise).
template <typename T>
__global__ void a8f_scalars_seg(const long long* __restrict__ tab, int use_u, float rho, int scale_p, float eps2,
                                int mult_kind, float mult, float d, int clip, int has_decay, float wd, int swd,
                                int lag, int fira, float one_m, int negate) {
    __shared__ T sh[A8F_THREADS];
    __shared__ float shf[A8F_THREADS];
    const long long* t = a8s_row(tab, blockIdx.x);
    a8f_scalars_body<T>(0, a8s_ptr<const T>(t, A8S_UB), a8s_ptr<const float>(t, A8S_UPARTS), use_u, t[A8S_NU],
                        a8s_ptr<const T>(t, A8S_PP), t[A8S_NPP], rho, scale_p, eps2, mult_kind, mult,
                        a8s_f32(t, A8S_SQRTN), a8s_f32(t, A8S_SQRTND), d, clip, has_decay, wd, swd,
                        a8s_ptr<float>(t, A8S_PREV), lag, a8s_ptr<float>(t, A8S_FPREV), a8s_ptr<float>(t, A8S_LAGF),
                        fira, one_m, negate, a8s_ptr<float>(t, A8S_SCAL), sh, shf);
}

// Entries (tensor, first element): a8f_apply (x: the gradient) over elements [first, first + A8F_CHUNK).
template <typename T>
__global__ void a8f_apply_seg(const long long* __restrict__ tab, const long long* __restrict__ ent, int has_decay,
                              int zero_nf) {
    const long long* e = ent + 2 * (long long)blockIdx.x;
    const long long* t = a8s_row(tab, e[0]);
    const float* scal = a8s_ptr<const float>(t, A8S_SCAL);
    const T s = (T)scal[0], dec = (T)scal[1];
    const long long n = t[A8S_N], hi = e[1] + A8F_CHUNK < n ? e[1] + A8F_CHUNK : n;
    const int small = n <= A8F_SMALL;
    for (long long i = e[1] + threadIdx.x; i < hi; i += blockDim.x)
        a8f_apply_one<T>(i, a8s_ptr<T>(t, A8S_P), a8s_ptr<const void>(t, A8S_G), 0, a8s_ptr<const T>(t, A8S_RF),
                         a8s_ptr<const T>(t, A8S_CF), t[A8S_R], t[A8S_C], small, s, dec, has_decay, zero_nf);
}

// Entries (tensor, chunk): a8f_flat_u with the float32 second moment V and no first moment (U not kept).
template <typename T>
__global__ void a8f_flat_u_seg(const long long* __restrict__ tab, const long long* __restrict__ ent, float b,
                               float b1m, float beps, int adam, float eps_d, float eps_sq, int need_u, int need_p,
                               int neg) {
    __shared__ T sh[A8F_THREADS];
    __shared__ float shf[A8F_THREADS];
    const long long* e = ent + 2 * (long long)blockIdx.x;
    const long long* t = a8s_row(tab, e[0]);
    a8f_flat_chunk<T>(e[1], a8s_ptr<const T>(t, A8S_G), a8s_ptr<float>(t, A8S_V), 0, b, b1m, beps, nullptr, 0, adam,
                      eps_d, eps_sq, nullptr, a8s_ptr<const T>(t, A8S_P), a8s_ptr<T>(t, A8S_PP),
                      a8s_ptr<float>(t, A8S_UPARTS), t[A8S_N], need_u, need_p, neg, 0, 1.0f, sh, shf);
}

// Entries (tensor, first element): a8f_flat_apply over elements [first, first + A8F_CHUNK), U recomputed from the
// gradient and the new V (a8f_flat_uv, as a8f_flat_u_seg made it: the same bits, and no full-size U kept).
template <typename T>
__global__ void a8f_flat_apply_seg(const long long* __restrict__ tab, const long long* __restrict__ ent, int adam,
                                   float eps_d, float eps_sq, int neg, int has_decay, int zero_nf) {
    const long long* e = ent + 2 * (long long)blockIdx.x;
    const long long* t = a8s_row(tab, e[0]);
    const float* scal = a8s_ptr<const float>(t, A8S_SCAL);
    const float s = scal[0];
    const T dec = (T)scal[1];
    const long long n = t[A8S_N], hi = e[1] + A8F_CHUNK < n ? e[1] + A8F_CHUNK : n;
    const T* g = a8s_ptr<const T>(t, A8S_G);
    const float* v = a8s_ptr<const float>(t, A8S_V);
    for (long long i = e[1] + threadIdx.x; i < hi; i += blockDim.x) {
        const float u = a8f_flat_uv<T>(a8f_flat_g(g, i, neg), v[i], nullptr, 0, i, adam, eps_d, eps_sq);
        a8f_flat_one<T>(i, a8s_ptr<T>(t, A8S_P), u, s, dec, has_decay, zero_nf);
    }
}
