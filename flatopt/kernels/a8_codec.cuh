// The 8-bit codecs' device functions, shared by the Adafactor8Bit kernels (adafactor8bit.cu and the fused steps):
// NaN-propagating min / max, torch.lerp, block-wide min/max reduction, the AL log2, and the signed first-moment
// formats (uf8 / uf4 linear, d8 / d4 by nearest entry of a quantization map).  Twin: flatopt/adafactor8bit/quant.py.

// The original's clamp before log2, 1e-38f, as a double: a float32 subnormal, which a flush-to-zero float32 compare
// (CuPy's -ftz=true) would read as 0 (log2 = -inf, then a NaN scale for an all-zero block), but a normal double.  The
// clamp is a float64 max (the twin's too: quant._TINY), exactly the float32 max of the original on every input.
#define A8_TINY ((double)1e-38f)
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

__device__ __forceinline__ float a8_log2(float v) {
    const double d = (double)v;
    return (float)log2((isnan(d) || d >= A8_TINY) ? d : A8_TINY);
}

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

// torch.lerp(a, x, w) as the twin's ``state.lerp_`` computes it when x is of type T and the state a is float32:
// d = float(x - a) (in T), then a + w*d (float) when `lo` (|w| < 0.5, decided on the host), else
// float(x - T(d*(1 - w))).
// For T = float this is a8_lerp.
template <typename T>
__device__ __forceinline__ float a8_lerp_t(float a, T x, float w, int lo) {
    const float d = (float)(x - (T)a);
    return lo ? a + w * d : (float)(x - (T)(d * (1.0f - w)));
}

// AL decode of one code (0 -> 0) with its block's scale and min_log; levels L = 254 (AL8) or 65534 (AL16).
// 2^x is powf(2, x), the function CuPy's exp2 ufunc (the twin's) calls ("pow(in0_type(2), in0)"), not exp2f (another
// algorithm, ex2.approx).  CuPy compiles its ufuncs with -ftz=true and fmad on, which change powf's instruction
// stream: that the two agree on every code is measured on a device (benchmarks/gpu_check.py), not proven here.
__device__ __forceinline__ float a8_al_value(unsigned int code, float sc, float ml, float L) {
    return code == 0u ? 0.0f : powf(2.0f, (((float)code - 1.0f) * sc) / L + ml);
}

__device__ __forceinline__ unsigned int a8_al_code_at(const void* codes, int bits, long long idx) {
    return bits == 8 ? (unsigned int)((const unsigned char*)codes)[idx]
                     : (unsigned int)((const unsigned short*)codes)[idx];
}

// The AL statistics of one block from the block-wide min (over non-zero values) and max of the log2 values:
// min_log (floored, below max_log), scale; then the code of one value.
__device__ __forceinline__ void a8_al_stats(float lo, float hi, float floor_, float& mn, float& sc) {
    const float mx = a8_min(hi, 126.0f);
    mn = a8_max(lo, floor_);
    if (mn >= mx) mn = mx - 1.0f;
    sc = a8_max(mx - mn, 1e-12f);
}

__device__ __forceinline__ unsigned int a8_al_code(float v, float mn, float sc, float L) {
    float c = 0.0f;
    if (v != 0.0f) {
        c = rintf(((a8_log2(v) - mn) / sc) * L) + 1.0f;
        c = fminf(fmaxf(c, 1.0f), L + 1.0f);  // a NaN c (a NaN block) becomes 1: fmaxf drops the NaN
    }
    return (unsigned int)c;
}

// Requantize one block of mblock signed values (exact values vals[base ...], n in all) whose per-thread |max| is
// hi (lo: scratch for the block reduction): absmax = max(max |v|, 1e-12); codes (4-bit: two per byte, even index in
// the high nibble).  A block whose absmax is not finite is encoded as zeros.  The caller has read its old codes.
__device__ __forceinline__ void a8_m_encode(unsigned char* q, float* absmax, const float* vals, long long base,
                                            long long n, int mblock, int fmt, float lo, float hi, const float* mp,
                                            int qmap_size, float* sh) {
    a8_block_minmax(lo, hi, sh);
    const float am = a8_max(hi, 1e-12f);
    const bool finite = isfinite(am);
    if (fmt == 1 || fmt == 3) {
        for (int j = threadIdx.x; j < mblock / 2; j += blockDim.x) {
            const long long i0 = base + 2 * j;
            const float v0 = i0 < n ? vals[i0] : 0.0f, v1 = i0 + 1 < n ? vals[i0 + 1] : 0.0f;
            const int c0 = a8_m_code(finite ? v0 / am : 0.0f, fmt, mp, qmap_size);
            const int c1 = a8_m_code(finite ? v1 / am : 0.0f, fmt, mp, qmap_size);
            q[i0 >> 1] = (unsigned char)((c0 << 4) | c1);
        }
    } else {
        for (int i = threadIdx.x; i < mblock; i += blockDim.x) {
            const long long idx = base + i;
            const float v = idx < n ? vals[idx] : 0.0f;
            q[idx] = (unsigned char)a8_m_code(finite ? v / am : 0.0f, fmt, mp, qmap_size);
        }
    }
    if (threadIdx.x == 0) absmax[blockIdx.x] = am;
}

// The old value idx of a quantized signed state (block absmax am; 4-bit codes: even index in the high nibble).
__device__ __forceinline__ float a8_m_old(const unsigned char* q, long long idx, int fmt, float am, const float* mp) {
    int code;
    if (fmt == 1 || fmt == 3) {
        const unsigned int b = q[idx >> 1];
        code = (idx & 1) ? (int)(b & 0x0Fu) : (int)(b >> 4);
    }
    else code = q[idx];
    return a8_m_value(code, fmt, am, mp);
}

// The quantization map into shared memory (every thread of the block; synchronises).
__device__ __forceinline__ void a8_map_to_shared(float* mp, const float* qmap, int size) {
    for (int i = threadIdx.x; i < size; i += blockDim.x) mp[i] = qmap[i];
    __syncthreads();
}
