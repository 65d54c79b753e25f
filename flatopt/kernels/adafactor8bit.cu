// Fused state kernels of Adafactor8Bit: dequantize -> float32 EMA -> write the exact value -> block reduction ->
// requantize, one CUDA block per quantization block, in one launch per state.  Twin: flatopt/adafactor8bit/state.py
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
                const unsigned int code = q8 ? (unsigned int)q8[idx] : (unsigned int)q16[idx];
                const float old = code == 0u ? 0.0f : exp2f((((float)code - 1.0f) * sc_old) / L + ml_old);
                v = a8_lerp(old, xv, w);
            }
            out[idx] = v;
        }
        const float lg = a8_log2(v);
        hi = a8_max(hi, lg);
        if (v != 0.0f) lo = a8_min(lo, lg);
    }
    a8_block_minmax(lo, hi, sh);
    const float mx = a8_min(hi, 126.0f);
    float mn = a8_max(lo, floor_);
    if (mn >= mx) mn = mx - 1.0f;
    const float sc = a8_max(mx - mn, 1e-12f);
    for (int i = threadIdx.x; i < block; i += blockDim.x) {
        const long long idx = base + i;
        const float v = idx < n ? out[idx] : 0.0f;
        float c = 0.0f;
        if (v != 0.0f) {
            c = rintf(((a8_log2(v) - mn) / sc) * L) + 1.0f;
            c = fminf(fmaxf(c, 1.0f), L + 1.0f);  // a NaN c (a NaN block) becomes 1: fmaxf drops the NaN
        }
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
    for (int i = threadIdx.x; i < qmap_size; i += blockDim.x) mp[i] = qmap[i];
    __syncthreads();
    const long long base = (long long)blockIdx.x * mblock;
    const bool four = (fmt == 1 || fmt == 3);
    const float am_old = absmax[blockIdx.x];
    float lo = 0.0f, hi = 0.0f;
    for (int i = threadIdx.x; i < mblock; i += blockDim.x) {
        const long long idx = base + i;
        float v = 0.0f;
        if (idx < n) {
            int code;
            if (four) { const unsigned int b = q[idx >> 1]; code = (i & 1) ? (int)(b & 0x0Fu) : (int)(b >> 4); }
            else code = q[idx];
            v = a8_lerp(a8_m_value(code, fmt, am_old, mp), (float)x[idx], w);
            out[idx] = v;
        }
        hi = a8_max(hi, fabsf(v));
    }
    __syncthreads();  // every thread has read its old codes before any is overwritten
    a8_block_minmax(lo, hi, sh);
    const float am = a8_max(hi, 1e-12f);
    const bool finite = isfinite(am);  // else the block is encoded as zeros (see the header)
    if (four) {
        for (int j = threadIdx.x; j < mblock / 2; j += blockDim.x) {
            const long long i0 = base + 2 * j;
            const float v0 = i0 < n ? out[i0] : 0.0f, v1 = i0 + 1 < n ? out[i0 + 1] : 0.0f;
            const int c0 = a8_m_code(finite ? v0 / am : 0.0f, fmt, mp, qmap_size);
            const int c1 = a8_m_code(finite ? v1 / am : 0.0f, fmt, mp, qmap_size);
            q[i0 >> 1] = (unsigned char)((c0 << 4) | c1);
        }
    } else {
        for (int i = threadIdx.x; i < mblock; i += blockDim.x) {
            const long long idx = base + i;
            const float v = idx < n ? out[idx] : 0.0f;
            q[idx] = (unsigned char)a8_m_code(finite ? v / am : 0.0f, fmt, mp, qmap_size);
        }
    }
    if (threadIdx.x == 0) absmax[blockIdx.x] = am;
}
