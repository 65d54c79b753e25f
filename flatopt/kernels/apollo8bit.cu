// The fused APOLLO step of Adafactor8Bit (twin: flatopt/adafactor8bit/apollo.py, apollo_lowrank.py, apollo_proj.py,
// fira.py; the Python side of this file: flatopt/adafactor8bit/apollo_fused.py).  Around the two CuPy GEMMs of a step
// (G_low = G·Pᵀ or Pᵀ·G; the same matmul as the twin's) the step is five kernels:
//
//   ap_draw     P from its seed: the counter-based draw of apollo_proj.draw (integer ops, one table gather, one
//               multiply and one add: the twin's bits);
//   ap_grad     G read once: the sanitised float32 G (the GEMM's input: non-finite entries read as 0, negated for
//               maximize) and the partial sums of G² and θ²;
//   ap_lowrank  U_low = m/(√v + ε) from the exact low-rank moments (the 8-bit slots updated before by
//               adafactor8bit.cu's a8_al_ema / a8_m_ema; float32 slots updated here, in place, with the twin's lerp),
//               or U_low as given (CAME, apollo_factorize: the twin's direction), and the partial sums of U_low² and
//               G_low²;
//   ap_scalars  one block: Σθ² → α, the scaling factors s (per channel or for the tensor), the norm of the scaled
//               update, the Fira limiter (its state updated in place), the step coefficient and the decay → cs;
//   ap_apply    θ ← θ·decay + G·cs.
//
// Every elementwise operation is the twin's, in its order, in float32 (compiled with --fmad=false; θ in T).
// The sums are not the twin's: the twin reduces with NumPy's / CUB's order (einsum, dot, sum), these kernels in one
// fixed order (below), in double, rounded to float32 where the twin's sum is a float32.  So s, the norm, α and the
// step coefficient may differ from the twin by the rounding of a float32 sum (the low-rank moments and their codes
// do not depend on them and are the twin's bits).  Sums of at most two terms cannot differ (a + b is exact in double,
// then rounded once).
//
// Reductions (deterministic, no atomics; independent of the grid size, which the shape alone fixes):
//   ROW layout (the channels are rows: G's and G_low's rows on the "right", or the whole tensor): block b handles
//     row i = b / nch, columns [c·span, (c + 1)·span) with c = b % nch, nch = ceil(cols / span); thread t sums the
//     columns t, t + AP_THREADS, ... of the chunk in order, then the block's tree (ap_block_sum) gives partial b.
//   COL layout (the channels are columns: the "left" with channel scaling): block b handles the AP_THREADS columns
//     of chunk b % ncc and the rows of tile b / ncc (span rows); thread t sums its column over the tile's rows in
//     order: partial tile·cols + j.
//   span: the Python side's apollo_fused.CHUNK (ROW) or TILE (COL), a constant (an argument so that tests can make
//   small shapes cross several chunks and tiles).
//   A channel's sum is its partials in order (ap_channel); a whole-tensor sum is every partial, strided over the
//   threads of one block and folded by ap_block_sum.
// The kernels with partials are launched with AP_THREADS threads, ap_scalars with AP_SCALAR_THREADS (the Python
// side: apollo_fused.THREADS, SCALAR_THREADS); ap_draw and ap_apply with any (grid-stride loops, no sums).
// ap_scalars declares __launch_bounds__(AP_SCALAR_THREADS): ptxas then keeps it within 64 registers, so that a block of
// 1024 threads always fits an SM's 64K registers.  (A kernel launched with at most 256 threads needs none: 255
// registers, the most ptxas gives a thread, times 256 fit; declaring 256 makes ptxas spill in af_stats_multi<float>,
// which tests/test_kernels_compile.py would report.)

#include "a8_codec.cuh"

#define AP_THREADS 256
#define AP_SCALAR_THREADS 1024
#define AP_PHI 0x9E3779B97F4A7C15ull

// Sum over the block in a fixed order (warp shuffle tree, then warp 0 over the warp sums); every thread gets it.
// blockDim.x a multiple of 32 (the order depends on it: each kernel has its constant); sh: 33 doubles of shared
// memory.
__device__ __forceinline__ double ap_block_sum(double v, double* sh) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? sh[lane] : 0.0;
        for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
        if (lane == 0) sh[32] = v;
    }
    __syncthreads();
    v = sh[32];
    __syncthreads();
    return v;
}

// Partials (see the header) of two sums over a rows×cols matrix: term(idx, a, b) adds element idx's terms to a and b;
// pa / pb receive them (either may be null).  mode 0: ROW layout, 1: COL layout.
template <class F>
__device__ __forceinline__ void ap_partials(int mode, long long rows, long long cols, long long span, double* pa,
                                            double* pb, double* sh, F term) {
    double a = 0.0, b = 0.0;
    if (mode == 0) {
        const long long nch = (cols + span - 1) / span;
        const long long i = blockIdx.x / nch, c = blockIdx.x % nch;
        const long long j1 = min(cols, (c + 1) * span);
        for (long long j = c * span + threadIdx.x; j < j1; j += AP_THREADS) term(i * cols + j, a, b);
        a = ap_block_sum(a, sh);
        b = ap_block_sum(b, sh);
        if (threadIdx.x == 0) {
            if (pa) pa[blockIdx.x] = a;
            if (pb) pb[blockIdx.x] = b;
        }
        return;
    }
    const long long ncc = (cols + AP_THREADS - 1) / AP_THREADS;
    const long long tile = blockIdx.x / ncc, j = (blockIdx.x % ncc) * AP_THREADS + threadIdx.x;
    if (j >= cols) return;
    const long long i1 = min(rows, (tile + 1) * span);
    for (long long i = tile * span; i < i1; ++i) term(i * cols + j, a, b);
    if (pa) pa[tile * cols + j] = a;
    if (pb) pb[tile * cols + j] = b;
}

// Channel k's sum of its partials, in order (ROW: nch of them; COL: one per tile).
__device__ __forceinline__ double ap_channel(const double* part, int mode, long long rows, long long cols,
                                             long long span, long long k) {
    double s = 0.0;
    if (mode == 0) {
        const long long nch = (cols + span - 1) / span;
        for (long long c = 0; c < nch; ++c) s += part[k * nch + c];
    } else {
        const long long nt = (rows + span - 1) / span;
        for (long long c = 0; c < nt; ++c) s += part[c * cols + k];
    }
    return s;
}

__device__ __forceinline__ long long ap_nparts(int mode, long long rows, long long cols, long long span) {
    return mode == 0 ? rows * ((cols + span - 1) / span) : ((rows + span - 1) / span) * cols;
}

// Σ of every partial (strided over the block's threads, then the tree); every thread gets it.
__device__ __forceinline__ double ap_total(const double* part, long long nparts, double* sh) {
    double s = 0.0;
    for (long long k = threadIdx.x; k < nparts; k += blockDim.x) s += part[k];
    return ap_block_sum(s, sh);
}

// P (flat, n elements) of the default draw: element i is 32-bit word i of mix64(mix64(seed) + (k + 1)·φ), k = i / 2
// (base = mix64(seed) + φ, computed on the host), through the table of (T_k, D_k) float32 pairs: T + f·D
// (apollo_proj.draw).  T is unused (the output is float32).
template <typename T>
__global__ void ap_draw(float* out, const unsigned long long* tab, long long n, unsigned long long base) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        unsigned long long z = (unsigned long long)(i >> 1) * AP_PHI + base;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z = z ^ (z >> 31);
        const unsigned int w = (i & 1) ? (unsigned int)(z >> 32) : (unsigned int)z;  // little-endian words
        const unsigned long long e = tab[w >> 16];
        const float t0 = __int_as_float((int)(unsigned int)e), d = __int_as_float((int)(unsigned int)(e >> 32));
        const float fd = (float)(w & 0xFFFFu) * d;
        out[i] = t0 + fd;
    }
}

// The sanitised float32 G into g32 (the twin's grad32: negated for maximize, rounded to float32, non-finite → 0)
// and the partials of Σ g32² (part_g) and Σ θ² (part_p, products in T as the twin's dot); either may be null.
template <typename T>
__global__ void ap_grad(const T* g, float* g32, const T* p, double* part_g, double* part_p, long long rows,
                        long long cols, int mode, long long span, int maximize) {
    __shared__ double sh[33];
    ap_partials(mode, rows, cols, span, part_g, part_p, sh, [&](long long idx, double& a, double& b) {
        float x = (float)(maximize ? -g[idx] : g[idx]);
        if (!isfinite(x)) x = 0.0f;
        g32[idx] = x;
        if (part_g) {
            const float q = x * x;
            a += (double)q;
        }
        if (part_p) {
            const T v = p[idx];
            const T q = v * v;
            b += (double)q;
        }
    });
}

// U_low and the partials of Σ U_low² (part_u) and Σ G_low² (part_l) over the rows×cols G_low.  u_in: U_low as given
// (then v, m are unused); else v is the exact second moment (v_ema = 0) or the float32 slot, updated here
// (v_ema = 1: v ← lerp(v, x², wv), x²·wv at the first step), and the numerator is G_low (m_mode 0), the exact first
// moment (1) or the float32 slot updated here (2: m ← lerp(m, x, wm)); U_low = src/(√v + ε) (apollo_lowrank).
template <typename T>
__global__ void ap_lowrank(const float* glow, float* v, float* m, const float* u_in, double* part_u, double* part_l,
                           long long rows, long long cols, int mode, long long span, int v_ema, int m_mode,
                           int first, float wv, float wm, float eps) {
    __shared__ double sh[33];
    ap_partials(mode, rows, cols, span, part_u, part_l, sh, [&](long long idx, double& a, double& b) {
        const float x = glow[idx];
        float u;
        if (u_in) {
            u = u_in[idx];
        } else {
            float vv;
            if (v_ema) {
                const float x2 = x * x;
                vv = first ? x2 * wv : a8_lerp(v[idx], x2, wv);
                v[idx] = vv;
            } else {
                vv = v[idx];
            }
            float src = x;
            if (m_mode == 1) {
                src = m[idx];
            } else if (m_mode == 2) {
                src = a8_lerp(m[idx], x, wm);
                m[idx] = src;
            }
            float den = sqrtf(vv);
            den = den + eps;
            u = src / den;
        }
        const float uu = u * u, xx = x * x;
        a += (double)uu;
        b += (double)xx;
    });
}

// Flags of ap_scalars.
#define AP_SCALE_PARAM 1
#define AP_NEED_NORM 2
#define AP_FIRA 4
#define AP_FRONT 8
#define AP_DECAY 16
#define AP_SCALE_WD 32
#define AP_CLIP 64
#define AP_BIAS 128

// One block of AP_SCALAR_THREADS threads: the step's scalars (apollo._update) into cs: per channel (chan = 1: the rows of G
// and of G_low, ROW layout; chan = 2: their columns, COL layout) cs[k] = coef·final_k and cs[K] = decay (K the
// number of channels), or for the tensor (chan = 0, ROW layouts) cs[0] = coef·final and cs[1] = decay.
//   α = ρ·max(√Σθ² / √n, eps2) (AP_SCALE_PARAM, else ρ);  s = √ΣU² / (√ΣG_low² + 1e-8) (·√apollo_scale: AP_FRONT);
//   norm = √Σ_k ΣG_k²·s_k² (channel) or √ΣG²·s (tensor);  Fira: f from norm and *fira_prev (fira.factor, which
//   updates it); final = s·f (·√apollo_scale unless AP_FRONT);  coef = −α / max(norm/dden, 1) (AP_CLIP; dden =
//   √n·d) · bias (AP_BIAS);  decay = 1 − (α or ρ)·wd (AP_DECAY).
// g_rows × g_cols: G's 2-D view; l_rows × l_cols: G_low's; span: their layouts' (the header).
template <typename T>
__global__ void __launch_bounds__(AP_SCALAR_THREADS) ap_scalars(const double* part_p, const double* part_g,
                           const double* part_u, const double* part_l, float* cs, float* fira_prev, long long g_rows,
                           long long g_cols, long long l_rows, long long l_cols, long long span, int chan, int flags,
                           float rho, float sqrt_n, float eps2, float sq, float one_m, float dden, float wd,
                           float bias) {
    __shared__ double sh[33];
    __shared__ float sc[2];
    const int lay = chan == 2 ? 1 : 0;
    const bool need_norm = flags & AP_NEED_NORM, front = flags & AP_FRONT, fira = flags & AP_FIRA;
    float alpha = rho;
    if (flags & AP_SCALE_PARAM) {
        const float ssq = (float)ap_total(part_p, ap_nparts(lay, g_rows, g_cols, span), sh);
        float rms = sqrtf(ssq);
        rms = rms / sqrt_n;
        alpha = a8_max(rms, eps2) * rho;
    }
    const long long nch = chan == 1 ? g_rows : g_cols;  // channels (chan 1 or 2)
    float s_t = 0.0f, nrm = 0.0f;
    if (chan == 0) {
        const long long nl = ap_nparts(0, l_rows, l_cols, span);
        const float un2 = (float)ap_total(part_u, nl, sh), ln2 = (float)ap_total(part_l, nl, sh);
        const float a = sqrtf(un2);
        float b = sqrtf(ln2);
        b = b + 1e-8f;
        s_t = a / b;
        if (front) s_t = s_t * sq;
        if (need_norm) {
            const float ng2 = (float)ap_total(part_g, ap_nparts(0, g_rows, g_cols, span), sh);
            nrm = sqrtf(ng2);
            nrm = nrm * s_t;
        }
    } else {
        double acc = 0.0;
        for (long long k = threadIdx.x; k < nch; k += blockDim.x) {
            const float un2 = (float)ap_channel(part_u, lay, l_rows, l_cols, span, k);
            const float ln2 = (float)ap_channel(part_l, lay, l_rows, l_cols, span, k);
            const float a = sqrtf(un2);
            float b = sqrtf(ln2);
            b = b + 1e-8f;
            float s = a / b;
            if (front) s = s * sq;
            cs[k] = s;
            if (need_norm) {
                const float ng2 = (float)ap_channel(part_g, lay, g_rows, g_cols, span, k);
                const float s2 = s * s;
                const float term = ng2 * s2;
                acc += (double)term;
            }
        }
        if (need_norm) nrm = sqrtf((float)ap_block_sum(acc, sh));
    }
    if (threadIdx.x == 0) {
        float f = 1.0f;
        if (fira) {  // fira.factor
            const float nm = isfinite(nrm) ? nrm : 0.0f;
            const float prev = fira_prev[0];
            const bool reset = prev < 1e-6f;
            const float ratio = nm / (prev + 1e-8f);
            const float lim = a8_max(ratio, one_m) / one_m;
            f = reset ? 1.0f : 1.0f / lim;
            fira_prev[0] = reset ? nm : nm * f;
        }
        float coef = -alpha;
        if (flags & AP_CLIP) coef = coef / a8_max(nrm / dden, 1.0f);
        float decay = 1.0f;
        if (flags & AP_DECAY) {
            const float cw = ((flags & AP_SCALE_WD) ? alpha : rho) * wd;
            decay = 1.0f - cw;
        }
        if (flags & AP_BIAS) coef = coef * bias;
        sc[0] = f;
        sc[1] = coef;
        cs[chan == 0 ? 1 : nch] = decay;
        if (chan == 0) {
            float fin = fira ? s_t * f : s_t;
            if (!front) fin = fin * sq;
            cs[0] = coef * fin;
        }
    }
    __syncthreads();
    if (chan != 0) {
        const float f = sc[0], coef = sc[1];
        for (long long k = threadIdx.x; k < nch; k += blockDim.x) {  // the entries this thread wrote above
            float fin = fira ? cs[k] * f : cs[k];
            if (!front) fin = fin * sq;
            cs[k] = coef * fin;
        }
    }
}

// θ ← θ·decay + G·cs (n elements of the rows × cols view): cs[0] for the tensor (chan 0), cs[row] (chan 1) or
// cs[column] (chan 2); decay = cs[K] (K = 1 for the tensor, the channels otherwise), used when has_decay.
template <typename T>
__global__ void ap_apply(T* p, const float* g32, const float* cs, long long n, long long cols, long long nk, int chan,
                         int has_decay) {
    const float decay = cs[nk];
    const long long stride = (long long)gridDim.x * blockDim.x;
    // element i's (row, col) = (i / cols, i % cols), carried from one element of the thread to its next (stride
    // further) instead of two 64-bit divisions per element
    const long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x, nc = cols > 0 ? cols : 1;
    const long long srow = stride / nc, scol = stride - srow * nc;
    long long row = i0 / nc, col = i0 - row * nc;
    for (long long i = i0; i < n; i += stride) {
        const float c = chan == 0 ? cs[0] : (chan == 1 ? cs[row] : cs[col]);
        const float u = g32[i] * c;
        T v = p[i];
        if (has_decay) v = v * (T)decay;
        v = v + (T)u;
        p[i] = v;
        row += srow;
        col += scol;
        if (col >= nc) { col -= nc; ++row; }
    }
}
