// The 8-bit codecs' device functions, shared by the Adafactor8Bit kernels (adafactor8bit.cu and the fused steps):
// NaN-propagating min / max, torch.lerp, block-wide min/max reduction, the AL log2, and the signed first-moment
// formats (uf8 / uf4 linear, d8 / d4 by nearest entry of a quantization map).  Twin: flatopt/adafactor8bit/quant.py.

#define A8_TINY 1e-38f   // the original's clamp before log2 (a float32 subnormal)
#define A8_INF __int_as_float(0x7f800000)

// min / max that propagate NaN (numpy.minimum / numpy.maximum); fminf / fmaxf would drop it.
__device__ __forceinline__ float a8_min(float a, float b) { return (isnan(a) || a <= b) ? a : b; }
__device__ __forceinline__ float a8_max(float a, float b) { return (isnan(a) || a >= b) ? a : b; }

__device__ __forceinline__ float a8_lerp(float a, float b, float w) {
    // torch.lerp: a + w*(b - a) for |w| < 0.5, else b - (b - a)*(1 - w)
    float d = b - a;
    return fabsf(w) < 0.5f ? a + w * d : b - d * (1.0f - w);
}

// Block-wide min and max, NaN propagating (every thread gets the result).  Shared scratch: 2 * 32 floats.
__device__ __forceinline__ void a8_block_minmax(float& lo, float& hi, float* sh) {
    for (int off = 16; off > 0; off >>= 1) {
        lo = a8_min(lo, __shfl_down_sync(0xffffffffu, lo, off));
        hi = a8_max(hi, __shfl_down_sync(0xffffffffu, hi, off));
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    if (lane == 0) { sh[warp] = lo; sh[32 + warp] = hi; }
    __syncthreads();
    if (warp == 0) {
        lo = lane < nwarps ? sh[lane] : A8_INF;
        hi = lane < nwarps ? sh[32 + lane] : -A8_INF;
        for (int off = 16; off > 0; off >>= 1) {
            lo = a8_min(lo, __shfl_down_sync(0xffffffffu, lo, off));
            hi = a8_max(hi, __shfl_down_sync(0xffffffffu, hi, off));
        }
        if (lane == 0) { sh[0] = lo; sh[32] = hi; }
    }
    __syncthreads();
    lo = sh[0];
    hi = sh[32];
    __syncthreads();
}

__device__ __forceinline__ float a8_log2(float v) { return (float)log2((double)a8_max(v, A8_TINY)); }

__device__ __forceinline__ int a8_nearest(float x, const float* mp, int size) {
    int lo = 0, hi = size;  // first index with mp[i] >= x (searchsorted, side "left")
    while (lo < hi) { int mid = (lo + hi) >> 1; if (mp[mid] < x) lo = mid + 1; else hi = mid; }
    int i = min(lo, size - 1);
    const int prev = max(i - 1, 0);
    if (fabsf(x - mp[prev]) < fabsf(x - mp[i])) i = prev;
    const float sx = (x > 0.0f) - (x < 0.0f), sm = (mp[i] > 0.0f) - (mp[i] < 0.0f);
    if (sx != sm && sx != 0.0f) {
        if (sx > 0.0f && i < size - 1) i += 1;
        else if (sx < 0.0f && i > 0) i -= 1;
    }
    return i;
}

__device__ __forceinline__ int a8_m_code(float y, int fmt, const float* mp, int size) {
    if (fmt <= 1) {  // uf8 / uf4
        const float half = fmt == 0 ? 128.0f : 8.0f;
        float c = rintf(y * half);
        c = fminf(fmaxf(c, -half), half - 1.0f);
        return (int)(c + half);
    }
    return a8_nearest(y, mp, size);
}

__device__ __forceinline__ float a8_m_value(int code, int fmt, float am, const float* mp) {
    if (fmt <= 1) {
        const float half = fmt == 0 ? 128.0f : 8.0f;
        return ((float)code - half) * (am / half);
    }
    return mp[code] * am;
}
