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

// Row statistics of an (nrows = B*r, c) matrix and the EMA of the row slot, one block per row:
//   mode 0 (x: T, the gradient):  s = sum_j x^2;  s = s/c + add (in T);  R = lerp_T(R_old, s, w)   (state.lerp_)
//                                  inv[row] = T(1/R) (float divide) — the fused statistics' 1/R
//   mode 1 (x: float, U - m):      s = sum_j T(x^2);  s = s/c + add (in T);  R = lerp(R_old, float(s), w)
// out[row] = R (the exact new value: the float32 state itself, or scratch to be requantized by a8f_al_encode).
// need_p: prow[row] = sum_j p^2 (the partials of sum theta^2).
template <typename T>
__global__ void a8f_rows(const void* x, int mode, long long nrows, long long c, const void* codes, int bits,
                         const float* scale, const float* min_log, int block, float* out, int quant, float w, int lo,
                         float add, T* inv, const T* p, T* prow, int need_p) {
    __shared__ T sh[A8F_THREADS];
    for (long long row = blockIdx.x; row < nrows; row += gridDim.x) {
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
__global__ void a8f_col_parts(const void* x, int mode, const float* m, int use_m, const T* inv, int fused, long long B,
                              long long r, long long c, T* cparts, T* wparts) {
    const long long tiles = (c + blockDim.x - 1) / blockDim.x, parts = (r + A8F_ROWS - 1) / A8F_ROWS;
    const long long total = tiles * parts * B;
    for (long long blk = blockIdx.x; blk < total; blk += gridDim.x) {
        const long long tile = blk % tiles, part = (blk / tiles) % parts, b = blk / (tiles * parts);
        const long long j = tile * blockDim.x + threadIdx.x;
        if (j >= c) continue;
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

// Columns: fold the partials in part order, s = s/r + add (in T), C = lerp(C_old, float(s), w) (state.ema rounds
// its sample to float first); out[k] = C (exact); fused: wsum[k] = the folded W partials.
template <typename T>
__global__ void a8f_col_fin(const T* cparts, const T* wparts, int fused, long long parts, long long bc, long long r,
                            const void* codes, int bits, const float* scale, const float* min_log, int block,
                            float* out, int quant, float w, int lo, float add, T* wsum) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < bc; k += stride) {
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

// Requantize up to two AL slots of exact values (one block per codec block; blocks [0, nb1) slot 1, then slot 2).
// The codes of the padding past n are 0, as a fresh state's.
template <typename T>
__global__ void a8f_al_encode(void* q1, float* sc1, float* ml1, const float* v1, long long n1, long long nb1,
                              void* q2, float* sc2, float* ml2, const float* v2, long long n2, int bits, int block,
                              float floor_) {
    __shared__ float sh[64];
    const bool first = blockIdx.x < nb1;
    void* q = first ? q1 : q2;
    float* scale = first ? sc1 : sc2;
    float* min_log = first ? ml1 : ml2;
    const float* v = first ? v1 : v2;
    const long long n = first ? n1 : n2, blk = first ? blockIdx.x : blockIdx.x - nb1;
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

// The factors, one block per matrix b (FactoredPasses.factors): rbar = max(sum_i R_bi / r, floor) (in T),
// rf = 1/sqrt(R/rbar), cf = 1/sqrt(float sqrt(C)) (in T); use_w: ub[b] = (sum_j cf^2 * W) * rbar, the matrix's
// share of sum U^2 (FactoredPasses.fused_ssq).
template <typename T>
__global__ void a8f_factors(const float* R, const float* C, const T* wsum, int use_w, long long B, long long r,
                            long long c, float rfloor, T* rf, T* cf, T* ub) {
    __shared__ T sh[A8F_THREADS];
    const int tid = threadIdx.x;
    for (long long b = blockIdx.x; b < B; b += gridDim.x) {
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
__global__ void a8f_scalars(int mode, const T* ub, const float* uparts, int use_u, long long nu, const T* pparts,
                            long long np_, float rho, int scale_p, float eps2, int mult_kind, float mult, float sqrt_n,
                            float sqrt_nd, float d, int clip, int has_decay, float wd, int swd, float* prev_norm,
                            int lag, float* fira_prev, float* lag_fira, int fira, float one_m, int negate,
                            float* scal) {
    __shared__ T sh[A8F_THREADS];
    __shared__ float shf[A8F_THREADS];
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

// theta <- theta*decay - (x * (cf_j * s)) * rf_i over the (B, r, c) tensor (FactoredPasses.apply); x: T (the
// gradient) or float (the exact first moment, xf32).
template <typename T>
__global__ void a8f_apply(T* p, const void* x, int xf32, const T* rf, const T* cf, long long n, long long r,
                          long long c, const float* scal, int has_decay, int zero_nf) {
    const T s = (T)scal[0], dec = (T)scal[1];
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long row = i / c, k = (row / r) * c + (i - row * c);
        const T xv = xf32 ? (T)((const float*)x)[i] : ((const T*)x)[i];
        T u = (xv * (cf[k] * s)) * rf[row];
        if (zero_nf && !isfinite(u)) u = 0;  // Fira: a non-finite entry of the update is dropped
        T pv = p[i];
        if (has_decay) pv = pv * dec;
        p[i] = pv - u;
    }
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
                const long long row = idx / c, k = (row / r) * c + (idx - row * c);
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
template <typename T>
__global__ void a8f_flat_u(const T* g, float* v, int vquant, float b, float b1m, float beps, const float* m, int use_m,
                           int adam,
                           float eps_d, float eps_sq, float* u, const T* p, T* pparts, float* uparts, long long n,
                           int need_u, int need_p, int neg, int sgd, float b1c) {
    __shared__ T sh[A8F_THREADS];
    __shared__ float shf[A8F_THREADS];
    const long long base = (long long)blockIdx.x * A8F_CHUNK;
    T sp = 0;
    float su = 0.0f;
    for (int i = threadIdx.x; i < A8F_CHUNK; i += A8F_THREADS) {
        const long long idx = base + i;
        if (idx >= n) break;
        // maximize: the negated gradient rounded to float (common.src_chunk); T's products and quotients of floats
        // rounded to float are the float operations' results
        const T gv = neg ? (T)(-(float)g[idx]) : g[idx];
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
        u[idx] = o;
        su += o * o;
        if (need_p) { const T pv = p[idx]; sp += pv * pv; }
    }
    if (need_u) { su = sq_block(su, shf); if (threadIdx.x == 0) uparts[blockIdx.x] = su; }
    if (need_p) { sp = sq_block(sp, sh); if (threadIdx.x == 0) pparts[blockIdx.x] = sp; }
}

// theta <- theta*decay - u*s (flat.apply_tasks).
template <typename T>
__global__ void a8f_flat_apply(T* p, const float* u, long long n, const float* scal, int has_decay, int zero_nf) {
    const float s = scal[0];
    const T dec = (T)scal[1];
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        T pv = p[i];
        if (has_decay) pv = pv * dec;
        float ui = u[i] * s;
        if (zero_nf && !isfinite(ui)) ui = 0.0f;
        p[i] = pv - (T)ui;
    }
}
