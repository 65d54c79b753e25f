/* flatopt's compiled CPU passes: one elementwise update per call, fused into a single pass over memory.
 *
 * Each function is the NumPy twin of its algorithm module (flatopt/<algo>.py ``update``) with the same operations in
 * the same order, each rounded to the parameter dtype: compiled with -ffp-contract=off and without -ffast-math, an
 * IEEE multiply, add, divide or square root gives the same bits as NumPy's ufunc, on any instruction set (the AVX2
 * clone and the baseline SSE2 one agree: tests/test_native.py builds each alone with -DFLATOPT_NO_CLONES), so the
 * twin's bits are kept.  The scalars arrive in double and are rounded to the dtype once, as NumPy rounds a Python
 * float against a float32 array.
 *
 * Built and loaded by flatopt/core/native.py.  ``dt``: 0 float32, 1 float64.  ``flags``: bit 0 weight decay on,
 * further bits per algorithm.  A function returns 0 when it ran, -1 for an unknown dtype.
 */
#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && !defined(FLATOPT_NO_CLONES)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* the dtype's square root and absolute value (C11 _Generic: sqrtf or sqrt, fabsf or fabs) */
#define SQRT(x) _Generic((x), float: sqrtf, double: sqrt)(x)
#define ABS(x) _Generic((x), float: fabsf, double: fabs)(x)

/* sign(c) as NumPy's sign: 1, -1, 0 (for ±0) or c itself (NaN) */
#define SIGN(T, c) ((c) != (c) ? (c) : (T)((c) > (T)0) - (T)((c) < (T)0))  /* branch-free: it vectorises */

/* The loop of the Adam family: load p, g, m, v;  PRE (a decay);  the moments of g (adam.py ``moments``:
 * m = m + (g - m)*omb1;  v = v*b2 + (g*omb2)*g);  STEP (sets p[i]);  store m, v. */
#define ADAM_LOOP(T, PRE, STEP)                                                                                     \
    for (int64_t i = 0; i < n; i++) {                                                                               \
        T pi = p[i], gi = g[i], mi = m[i], vi = v[i];                                                               \
        PRE;                                                                                                        \
        mi = mi + (gi - mi) * omb1;                                                                                 \
        vi = vi * b2 + (gi * omb2) * gi;                                                                            \
        STEP;                                                                                                       \
        m[i] = mi;                                                                                                  \
        v[i] = vi;                                                                                                  \
    }

/* AdamW (adamw.py): p = p*decay (WD);  the moments;  p = p + (m / (sqrt(v)/bc2_sqrt + eps))*neg_step.
 * Adam (adam.py): g' = g + p*wd (WD);  the moments of g';  the same step.  One entry, ``adam``: flag 2 is Adam's. */
#define ADAM_STEP p[i] = pi + (mi / (SQRT(vi) / bc2_sqrt + eps)) * neg_step
#define ADAMW_BODY(T, WD) ADAM_LOOP(T, if (WD) pi = pi * decay, ADAM_STEP)
#define ADAM_BODY(T, WD) ADAM_LOOP(T, if (WD) gi = gi + pi * wd, ADAM_STEP)

/* ----------------------------------------------------------------------------------------------- Lion (lion.py)
 * p = p*decay;  c = m*b1 + g*omb1;  p = p + sign(c)*neg_lr;  m = m*b2 + g*omb2 */
#define LION_BODY(T, WD)                                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                                               \
        T pi = p[i], gi = g[i], mi = m[i];                                                                          \
        if (WD) pi = pi * decay;                                                                                    \
        T c = mi * b1 + gi * omb1;                                                                                  \
        p[i] = pi + SIGN(T, c) * neg_lr;                                                                            \
        m[i] = mi * b2 + gi * omb2;                                                                                 \
    }

/* ----------------------------------------------------------------------------------------- QHAdamW (qhadamw.py)
 * p = p*decay;  the moments;  num = m*c_m + g*c_g (NU1);  den = sqrt(v*c_v + (g*c_gg)*g (NU2)) + eps;
 * p = p + (num/den)*neg_lr */
#define QHADAMW_BODY(T, WD, NU1, NU2)                                                                               \
    ADAM_LOOP(T, if (WD) pi = pi * decay, {                                                                         \
        T num = mi * c_m;                                                                                           \
        if (NU1) num = num + gi * c_g;                                                                              \
        T den = vi * c_v;                                                                                           \
        if (NU2) den = den + (gi * c_gg) * gi;                                                                      \
        p[i] = pi + (num / (SQRT(den) + eps)) * neg_lr;                                                             \
    })

/* ------------------------------------------------------------------------------------------- NAdamW (nadamw.py)
 * p = p*decay;  the moments;  d = sqrt(v/bc2) + eps;  p = p + (g/d)*c_g;  p = p + (m/d)*c_m */
#define NADAMW_BODY(T, WD)                                                                                          \
    ADAM_LOOP(T, if (WD) pi = pi * decay, {                                                                         \
        T d = SQRT(vi / bc2) + eps;                                                                                 \
        p[i] = (pi + (gi / d) * c_g) + (mi / d) * c_m;                                                              \
    })

/* --------------------------------------------------------------------------------------------- RAdam (radam.py)
 * g' = g + p*wd (WD, coupled) or p = p*decay (WD, DEC);  the moments;
 * p = p + (m / (sqrt(v) + eps))*factor (RECT) or p = p + m*factor */
#define RADAM_BODY(T, WD, DEC, RECT)                                                                                \
    ADAM_LOOP(T, if (WD && DEC) pi = pi * decay; if (WD && !DEC) gi = gi + pi * wd,                                 \
              p[i] = pi + (RECT ? mi / (SQRT(vi) + eps) : mi) * factor)

/* ------------------------------------------------------------------------------------------- Sophia (sophia.py)
 * p = p*decay;  m = m*b1 + g*omb1;  ratio = min(|m| / (h*rho + eps), 1) (NaN propagates, as numpy.minimum);
 * p = p + (sign(m)*ratio)*neg_lr */
#define SOPHIA_BODY(T, WD)                                                                                          \
    for (int64_t i = 0; i < n; i++) {                                                                               \
        T pi = p[i], gi = g[i], mi = m[i];                                                                          \
        if (WD) pi = pi * decay;                                                                                    \
        mi = mi * b1 + gi * omb1;                                                                                   \
        T r = ABS(mi) / (h[i] * rho + eps);                                                                         \
        r = r < (T)1 ? r : (r != r ? r : (T)1);                                                                     \
        p[i] = pi + (SIGN(T, mi) * r) * neg_lr;                                                                     \
        m[i] = mi;                                                                                                  \
    }

/* ---------------------------------------------------------------------------------------------------- SGD (sgd.py)
 * d = p*wd + g (WD);  buf = d (FIRST) or buf = buf*mom + d*(1 - damp) (DAMP) or buf*mom + d;
 * d = d + buf*mom (NEST) or d = buf;  p = p + d*neg_lr.  MOM off: p = p + d*neg_lr (buf is not touched). */
#define SGD_BODY(T, WD, MOM, FIRST, DAMP, NEST)                                                                     \
    for (int64_t i = 0; i < n; i++) {                                                                               \
        T pi = p[i], d = g[i];                                                                                      \
        if (WD) d = pi * wd + d;                                                                                    \
        if (MOM) {                                                                                                  \
            T bi = FIRST ? d : (DAMP ? buf[i] * mom + d * omd : buf[i] * mom + d);                                  \
            buf[i] = bi;                                                                                            \
            d = NEST ? d + bi * mom : bi;                                                                           \
        }                                                                                                           \
        p[i] = pi + d * neg_lr;                                                                                     \
    }

/* SGD with momentum: the eight (FIRST, DAMP, NEST) combinations for one WD */
#define SGD_MOM_CASES(T, WD)                                                                                        \
    case WD | 2: { SGD_BODY(T, WD, 1, 0, 0, 0) } break;                                                             \
    case WD | 2 | 4: { SGD_BODY(T, WD, 1, 1, 0, 0) } break;                                                         \
    case WD | 2 | 8: { SGD_BODY(T, WD, 1, 0, 1, 0) } break;                                                         \
    case WD | 2 | 4 | 8: { SGD_BODY(T, WD, 1, 1, 1, 0) } break;                                                     \
    case WD | 2 | 16: { SGD_BODY(T, WD, 1, 0, 0, 1) } break;                                                        \
    case WD | 2 | 4 | 16: { SGD_BODY(T, WD, 1, 1, 0, 1) } break;                                                    \
    case WD | 2 | 8 | 16: { SGD_BODY(T, WD, 1, 0, 1, 1) } break;                                                    \
    case WD | 2 | 4 | 8 | 16: { SGD_BODY(T, WD, 1, 1, 1, 1) } break;

/* One specialised, vectorisable loop per (dtype, flag combination): the flags are compile-time constants inside. */
#define DEFINE(T)                                                                                                   \
    CLONES static void adam_##T(T *restrict p, const T *restrict g, T *restrict m, T *restrict v, int64_t n,        \
                                const double *sc, int flags) {                                                      \
        /* sc[0]: AdamW's decay, or Adam's wd (flag 2) */                                                           \
        const T decay = (T)sc[0], wd = (T)sc[0], omb1 = (T)sc[1], b2 = (T)sc[2], omb2 = (T)sc[3],                   \
                bc2_sqrt = (T)sc[4], eps = (T)sc[5], neg_step = (T)sc[6];                                           \
        switch (flags & 3) {                                                                                        \
        case 1: { ADAMW_BODY(T, 1) } break;                                                                         \
        case 3: { ADAM_BODY(T, 1) } break;                                                                          \
        default: { ADAMW_BODY(T, 0) } break; /* no decay: Adam and AdamW are the same loop */                       \
        }                                                                                                           \
    }                                                                                                               \
    CLONES static void lion_##T(T *restrict p, const T *restrict g, T *restrict m, int64_t n, const double *sc,     \
                                int flags) {                                                                        \
        const T decay = (T)sc[0], b1 = (T)sc[1], omb1 = (T)sc[2], b2 = (T)sc[3], omb2 = (T)sc[4],                   \
                neg_lr = (T)sc[5];                                                                                  \
        if (flags & 1) { LION_BODY(T, 1) } else { LION_BODY(T, 0) }                                                 \
    }                                                                                                               \
    CLONES static void qhadamw_##T(T *restrict p, const T *restrict g, T *restrict m, T *restrict v, int64_t n,     \
                                   const double *sc, int flags) {                                                   \
        const T decay = (T)sc[0], omb1 = (T)sc[1], b2 = (T)sc[2], omb2 = (T)sc[3], c_m = (T)sc[4],                  \
                c_g = (T)sc[5], c_v = (T)sc[6], c_gg = (T)sc[7], eps = (T)sc[8], neg_lr = (T)sc[9];                 \
        switch (flags & 7) {                                                                                        \
        case 0: { QHADAMW_BODY(T, 0, 0, 0) } break;                                                                 \
        case 1: { QHADAMW_BODY(T, 1, 0, 0) } break;                                                                 \
        case 2: { QHADAMW_BODY(T, 0, 1, 0) } break;                                                                 \
        case 3: { QHADAMW_BODY(T, 1, 1, 0) } break;                                                                 \
        case 4: { QHADAMW_BODY(T, 0, 0, 1) } break;                                                                 \
        case 5: { QHADAMW_BODY(T, 1, 0, 1) } break;                                                                 \
        case 6: { QHADAMW_BODY(T, 0, 1, 1) } break;                                                                 \
        default: { QHADAMW_BODY(T, 1, 1, 1) } break;                                                                \
        }                                                                                                           \
    }                                                                                                               \
    CLONES static void nadamw_##T(T *restrict p, const T *restrict g, T *restrict m, T *restrict v, int64_t n,      \
                                  const double *sc, int flags) {                                                    \
        const T decay = (T)sc[0], omb1 = (T)sc[1], b2 = (T)sc[2], omb2 = (T)sc[3], bc2 = (T)sc[4],                  \
                eps = (T)sc[5], c_g = (T)sc[6], c_m = (T)sc[7];                                                     \
        if (flags & 1) { NADAMW_BODY(T, 1) } else { NADAMW_BODY(T, 0) }                                             \
    }                                                                                                               \
    CLONES static void radam_##T(T *restrict p, const T *restrict g, T *restrict m, T *restrict v, int64_t n,       \
                                 const double *sc, int flags) {                                                     \
        const T wd = (T)sc[0], decay = (T)sc[1], omb1 = (T)sc[2], b2 = (T)sc[3], omb2 = (T)sc[4],                   \
                eps = (T)sc[5], factor = (T)sc[7];                                                                  \
        switch (flags & 7) {                                                                                        \
        case 1: { RADAM_BODY(T, 1, 0, 0) } break;                                                                   \
        case 3: { RADAM_BODY(T, 1, 1, 0) } break;                                                                   \
        case 5: { RADAM_BODY(T, 1, 0, 1) } break;                                                                   \
        case 7: { RADAM_BODY(T, 1, 1, 1) } break;                                                                   \
        case 4: case 6: { RADAM_BODY(T, 0, 0, 1) } break;                                                           \
        default: { RADAM_BODY(T, 0, 0, 0) } break;                                                                  \
        }                                                                                                           \
    }                                                                                                               \
    CLONES static void sophia_##T(T *restrict p, const T *restrict g, T *restrict m, const T *restrict h,           \
                                  int64_t n, const double *sc, int flags) {                                         \
        const T decay = (T)sc[0], b1 = (T)sc[1], omb1 = (T)sc[2], rho = (T)sc[3], eps = (T)sc[4],                   \
                neg_lr = (T)sc[5];                                                                                  \
        if (flags & 1) { SOPHIA_BODY(T, 1) } else { SOPHIA_BODY(T, 0) }                                             \
    }                                                                                                               \
    CLONES static void sgd_##T(T *restrict p, const T *restrict g, T *restrict buf, int64_t n, const double *sc,    \
                               int flags) {                                                                         \
        const T wd = (T)sc[0], mom = (T)sc[1], omd = (T)sc[2], neg_lr = (T)sc[3];                                   \
        /* bits: WD, MOM, FIRST, DAMP, NEST (the last three only with MOM) */                                       \
        switch (flags & 2 ? flags & 31 : flags & 1) {                                                               \
        case 0: { SGD_BODY(T, 0, 0, 0, 0, 0) } break;                                                               \
        case 1: { SGD_BODY(T, 1, 0, 0, 0, 0) } break;                                                               \
        SGD_MOM_CASES(T, 0) SGD_MOM_CASES(T, 1)                                                                     \
        default: break;                                                                                             \
        }                                                                                                           \
    }

DEFINE(float)
DEFINE(double)

/* ------------------------------------------------------------------------------------------ the exported entries
 * (arrays..., n, scalars, flags): the arrays (p, g, the state) are contiguous, of n elements, of
 * dtype ``dt``. */
#define EXPORT(NAME, ARGS, CALL_F, CALL_D)                                                                          \
    __attribute__((visibility("default"))) int flatopt_##NAME ARGS {                                                \
        if (dt == 0) { CALL_F; return 0; }                                                                          \
        if (dt == 1) { CALL_D; return 0; }                                                                          \
        return -1;                                                                                                  \
    }

EXPORT(adam, (int dt, void *p, const void *g, void *m, void *v, int64_t n, const double *sc, int flags),
       adam_float(p, g, m, v, n, sc, flags), adam_double(p, g, m, v, n, sc, flags))
EXPORT(lion, (int dt, void *p, const void *g, void *m, int64_t n, const double *sc, int flags),
       lion_float(p, g, m, n, sc, flags), lion_double(p, g, m, n, sc, flags))
EXPORT(qhadamw, (int dt, void *p, const void *g, void *m, void *v, int64_t n, const double *sc, int flags),
       qhadamw_float(p, g, m, v, n, sc, flags), qhadamw_double(p, g, m, v, n, sc, flags))
EXPORT(nadamw, (int dt, void *p, const void *g, void *m, void *v, int64_t n, const double *sc, int flags),
       nadamw_float(p, g, m, v, n, sc, flags), nadamw_double(p, g, m, v, n, sc, flags))
EXPORT(radam, (int dt, void *p, const void *g, void *m, void *v, int64_t n, const double *sc, int flags),
       radam_float(p, g, m, v, n, sc, flags), radam_double(p, g, m, v, n, sc, flags))
EXPORT(sophia, (int dt, void *p, const void *g, void *m, void *h, int64_t n, const double *sc, int flags),
       sophia_float(p, g, m, h, n, sc, flags), sophia_double(p, g, m, h, n, sc, flags))
EXPORT(sgd, (int dt, void *p, const void *g, void *buf, int64_t n, const double *sc, int flags),
       sgd_float(p, g, buf, n, sc, flags), sgd_double(p, g, buf, n, sc, flags))
