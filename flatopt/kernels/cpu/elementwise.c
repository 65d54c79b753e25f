/* flatopt's compiled CPU passes: one elementwise update per call, fused into a single pass over memory.
 *
 * Each function is the NumPy twin of its algorithm module (flatopt/<algo>.py ``update``) with the same operations in
 * the same order, each rounded to the parameter dtype: compiled with -ffp-contract=off and without -ffast-math, an
 * IEEE multiply, add, divide or square root gives the same bits as NumPy's ufunc, on any instruction set (the AVX2
 * clone and the baseline SSE2 one agree: tests/test_native.py builds each alone with -DFLATOPT_NO_CLONES), so the
 * twin's bits are kept.  The scalars arrive in double and are rounded to the dtype once, as NumPy rounds a Python
 * float against a float32 array.
 *
 * The passes of the algorithms defined once (core/elementwise: SGD, the Adam family, Lion, Sophia) are generated
 * into ../generated/elementwise.c and compiled into the same library; this file keeps the hand-written passes of
 * Lamb and Mars.  Built and loaded by flatopt/core/native.py.  ``dt``: 0 float32, 1 float64.  ``flags``: bit 0
 * weight decay on, further bits per algorithm.  A function returns 0 when it ran, -1 for an unknown dtype.
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

/* The loop of an Adam-like update (Mars): load p, g, m, v;  PRE (a decay);  the moments of g (adam.py ``moments``:
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

/* the AdamW step (Mars ends with it): p = p + (m / (sqrt(v)/bc2_sqrt + eps))*neg_step */
#define ADAM_STEP p[i] = pi + (mi / (SQRT(vi) / bc2_sqrt + eps)) * neg_step

/* --------------------------------------------------------------------------------------------- Mars (mars.py)
 * c = g + (g - g_prev)*coef, then c = c / den (CLIP: den = max(‖c‖, 1) from the first phase);  g_prev = g;
 * p = p*decay (WD);  the moments of c;  the AdamW step */
#define MARS_BODY(T, WD, CLIP)                                                                                      \
    ADAM_LOOP(T, T gpi = gp[i]; gp[i] = gi; gi = gi + (gi - gpi) * coef; if (CLIP) gi = gi / den;                   \
              if (WD) pi = pi * decay, ADAM_STEP)

/* The column sums of the norms (core/norms.py): ``rows`` contiguous rows of ``w`` terms; acc[j] gets each row's
 * square added in row order (FIRST: the first row's square replaces it), as norms.add_squares. */
#define ADD_SQ(acc, x, FIRST) acc[j] = ((FIRST) && r == 0) ? (x) * (x) : acc[j] + (x) * (x)

/* Mars's first phase: the column sums of c², c = g + (g - g_prev)*coef (not stored: the step makes it again) */
#define MARS_COLUMNS_BODY(T, FIRST)                                                                                 \
    for (int64_t r = 0; r < rows; r++) {                                                                            \
        const T *gr = g + r * w, *gpr = gp + r * w;                                                                 \
        for (int64_t j = 0; j < w; j++) {                                                                           \
            T ci = gr[j] + (gr[j] - gpr[j]) * coef;                                                                 \
            ADD_SQ(acc, ci, FIRST);                                                                                 \
        }                                                                                                           \
    }

/* ----------------------------------------------------------------------------------------------- Lamb (lamb.py)
 * Lamb's first phase: the moments;  u = (m/bc1) / (sqrt(v/bc2) + eps) + p*wd (WD);  the column sums of p² and u² */
#define LAMB_COLUMNS_BODY(T, WD, FIRST)                                                                             \
    for (int64_t r = 0; r < rows; r++) {                                                                            \
        T *pr = p + r * w, *mr = m + r * w, *vr = v + r * w, *ur = u + r * w;                                       \
        const T *gr = g + r * w;                                                                                    \
        for (int64_t j = 0; j < w; j++) {                                                                           \
            T pi = pr[j], gi = gr[j], mi = mr[j], vi = vr[j];                                                       \
            mi = mi + (gi - mi) * omb1;                                                                             \
            vi = vi * b2 + (gi * omb2) * gi;                                                                        \
            T ui = (mi / bc1) / (SQRT(vi / bc2) + eps);                                                             \
            if (WD) ui = ui + pi * wd;                                                                              \
            mr[j] = mi;                                                                                             \
            vr[j] = vi;                                                                                             \
            ur[j] = ui;                                                                                             \
            ADD_SQ(acc_p, pi, FIRST);                                                                               \
            ADD_SQ(acc_u, ui, FIRST);                                                                               \
        }                                                                                                           \
    }

/* Lamb's second phase: p = p + u*step (step = r·(−η)) */
#define LAMB_APPLY_BODY(T)                                                                                          \
    for (int64_t i = 0; i < n; i++) p[i] = p[i] + u[i] * step;

#define DEFINE(T)                                                                                                   \
    CLONES static void mars_##T(T *restrict p, const T *restrict g, T *restrict gp, T *restrict m,                  \
                                T *restrict v, int64_t n, const double *sc, int flags) {                            \
        const T coef = (T)sc[0], omb1 = (T)sc[1], b2 = (T)sc[2], omb2 = (T)sc[3], decay = (T)sc[4],                 \
                bc2_sqrt = (T)sc[5], eps = (T)sc[6], neg_step = (T)sc[7], den = (T)sc[8];                           \
        switch (flags & 3) {                                                                                        \
        case 0: { MARS_BODY(T, 0, 0) } break;                                                                       \
        case 1: { MARS_BODY(T, 1, 0) } break;                                                                       \
        case 2: { MARS_BODY(T, 0, 1) } break;                                                                       \
        default: { MARS_BODY(T, 1, 1) } break;                                                                      \
        }                                                                                                           \
    }                                                                                                               \
    CLONES static void mars_columns_##T(const T *restrict g, const T *restrict gp, T *restrict acc, int64_t rows,   \
                                        int64_t w, const double *sc, int flags) {                                   \
        const T coef = (T)sc[0];                                                                                    \
        if (flags & 1) { MARS_COLUMNS_BODY(T, 1) } else { MARS_COLUMNS_BODY(T, 0) }                                 \
    }                                                                                                               \
    CLONES static void lamb_apply_##T(T *restrict p, const T *restrict u, int64_t n, const double *sc,              \
                                      int flags) {                                                                  \
        (void)flags;                                                                                                \
        const T step = (T)sc[0];                                                                                    \
        LAMB_APPLY_BODY(T)                                                                                          \
    }                                                                                                               \
    CLONES static void lamb_columns_##T(T *restrict p, const T *restrict g, T *restrict m, T *restrict v,           \
                                        T *restrict u, T *restrict acc_p, T *restrict acc_u, int64_t rows,          \
                                        int64_t w, const double *sc, int flags) {                                   \
        const T omb1 = (T)sc[0], b2 = (T)sc[1], omb2 = (T)sc[2], bc1 = (T)sc[3], bc2 = (T)sc[4], eps = (T)sc[5],    \
                wd = (T)sc[6];                                                                                      \
        switch (flags & 3) { /* bits: FIRST, WD */                                                                  \
        case 0: { LAMB_COLUMNS_BODY(T, 0, 0) } break;                                                               \
        case 1: { LAMB_COLUMNS_BODY(T, 0, 1) } break;                                                               \
        case 2: { LAMB_COLUMNS_BODY(T, 1, 0) } break;                                                               \
        default: { LAMB_COLUMNS_BODY(T, 1, 1) } break;                                                              \
        }                                                                                                           \
    }

DEFINE(float)
DEFINE(double)

/* ------------------------------------------------------------------------------------------ the exported entries
 * (arrays..., n, scalars, flags): the arrays (p, g, the state; Lamb's apply: p, u) are contiguous, of n elements, of
 * dtype ``dt``. */
#define EXPORT(NAME, ARGS, CALL_F, CALL_D)                                                                          \
    __attribute__((visibility("default"))) int flatopt_##NAME ARGS {                                                \
        if (dt == 0) { CALL_F; return 0; }                                                                          \
        if (dt == 1) { CALL_D; return 0; }                                                                          \
        return -1;                                                                                                  \
    }

EXPORT(mars, (int dt, void *p, const void *g, void *gp, void *m, void *v, int64_t n, const double *sc, int flags),
       mars_float(p, g, gp, m, v, n, sc, flags), mars_double(p, g, gp, m, v, n, sc, flags))
EXPORT(lamb_apply, (int dt, void *p, const void *u, int64_t n, const double *sc, int flags),
       lamb_apply_float(p, u, n, sc, flags), lamb_apply_double(p, u, n, sc, flags))
/* the first phases of the norms: (arrays..., accumulators..., rows, w, scalars, flags) */
EXPORT(mars_columns, (int dt, const void *g, const void *gp, void *acc, int64_t rows, int64_t w, const double *sc,
                      int flags),
       mars_columns_float(g, gp, acc, rows, w, sc, flags), mars_columns_double(g, gp, acc, rows, w, sc, flags))
EXPORT(lamb_columns, (int dt, void *p, const void *g, void *m, void *v, void *u, void *acc_p, void *acc_u,
                      int64_t rows, int64_t w, const double *sc, int flags),
       lamb_columns_float(p, g, m, v, u, acc_p, acc_u, rows, w, sc, flags),
       lamb_columns_double(p, g, m, v, u, acc_p, acc_u, rows, w, sc, flags))
