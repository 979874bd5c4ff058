/* Fingerprint v2, compiled (docs/format.md section 5.2 defines it; unickpt/format/_fp2.py holds a
 * numpy version that gives the same numbers and is used when this module is not built).
 *
 * A tensor's bytes are read as a flat sequence of limbs: 16-bit little-endian words for item
 * sizes 2, 4 and 8 (so limb i is simply the i-th u16 of the C-order tensor), bytes for 1-byte
 * dtypes. Limb i = h * G + l (G = 1024) has the weight bh_k(h) * bl_k(l) mod p_k for the two
 * primes p_1 = 2^32 - 5 and p_2 = 2^32 - 17, with
 *
 *   z = mix64(l ^ SEED_L): bl_1 = 1 + lo32(z) mod (p_1 - 1),  bl_2 = 1 + hi32(z) mod (p_2 - 1)
 *   z = mix64(h ^ SEED_H): bh_1, bh_2 likewise
 *
 * and H_k = sum_i bh_k(i / G) * bl_k(i % G) * v_i mod p_k. A block's share is the same sum over
 * its own limbs, so the shares of any partition add up (mod p_k) to the tensor's H_k.
 *
 * The bl table is a constant (G entries per prime, built once at import) laid out per run of 16
 * limbs as AVX2 wants it: one 32-byte load of data is 16 limbs; the even limbs of each 32-bit
 * half (mask) and the odd ones (shift by 16) sit in the low 32 bits of a 64-bit lane for two of
 * the four lane positions, a 64-bit shift brings the other two down, and vpmuludq multiplies
 * them by both primes' weights. Products are below 2^48 and a group has at most 1024 of them, so
 * 64-bit lanes never wrap; each group is reduced mod p_k once and multiplied by bh_k(h).
 *
 * partial(buffer, itemsize, global_shape, offsets, shape, start) -> (H_1, H_2)
 *   buffer holds elements [start, start + len/itemsize) of the C-order block ``shape`` placed at
 *   ``offsets`` in a tensor of shape ``global_shape``; ranges may begin and end anywhere, so a
 *   block can be fed in chunks. The GIL is released while summing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define UNICKPT_X86 1
#endif

#define P1 4294967291ULL /* 2^32 - 5 */
#define P2 4294967279ULL /* 2^32 - 17 */
#define GBITS 10
#define G (1u << GBITS)
#define SEED_L 0x6A09E667F3BCC909ULL
#define SEED_H 0xBB67AE8584CAA73BULL
#define MAX_DIMS 64

static inline uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static uint32_t BL1[G], BL2[G];
/* Per 16-limb run j: 8 vectors of 4 u64 (weights in the low 32 bits): limbs 4q (prime 1, prime 2),
 * 4q+1, 4q+2, 4q+3 for lanes q = 0..3. */
static uint64_t TAB[G * 2] __attribute__((aligned(32)));

static void build_tables(void) {
    for (uint32_t l = 0; l < G; l++) {
        uint64_t z = mix64((uint64_t)l ^ SEED_L);
        BL1[l] = (uint32_t)(1 + (uint32_t)z % (P1 - 1));
        BL2[l] = (uint32_t)(1 + (uint32_t)(z >> 32) % (P2 - 1));
    }
    for (uint32_t j = 0; j < G / 16; j++) {
        uint64_t *t = TAB + 32 * j;
        for (int pos = 0; pos < 4; pos++)
            for (int q = 0; q < 4; q++) {
                uint32_t l = 16 * j + 4 * q + pos;
                t[8 * pos + q] = BL1[l];
                t[8 * pos + 4 + q] = BL2[l];
            }
    }
}

static inline void weights_h(uint64_t h, uint64_t *w1, uint64_t *w2) {
    uint64_t z = mix64(h ^ SEED_H);
    *w1 = 1 + (uint32_t)z % (P1 - 1);
    *w2 = 1 + (uint32_t)(z >> 32) % (P2 - 1);
}

static inline uint32_t limb_at(const uint8_t *p, int lb, uint64_t k) {
    if (lb == 1) return p[k];
    return (uint32_t)p[2 * k] | ((uint32_t)p[2 * k + 1] << 8);
}

/* Scalar: n limbs at p against bl[l0 .. l0 + n). */
static void span_scalar(const uint8_t *p, int lb, uint32_t l0, uint32_t n, uint64_t *s1, uint64_t *s2) {
    uint64_t a = 0, b = 0;
    for (uint32_t k = 0; k < n; k++) {
        uint64_t v = limb_at(p, lb, k);
        a += v * BL1[l0 + k];
        b += v * BL2[l0 + k];
    }
    *s1 += a;
    *s2 += b;
}

#ifdef UNICKPT_X86
#define AVX2_BODY(NAME, LOAD16, STEP)                                                                       \
    __attribute__((target("avx2"))) static void NAME(const uint8_t *p, const uint64_t *t, uint32_t runs, \
                                                     uint64_t *s1, uint64_t *s2) {                        \
        const __m256i m = _mm256_set1_epi64x(0x0000FFFF0000FFFFLL);                                       \
        __m256i x1 = _mm256_setzero_si256(), x2 = x1, y1 = x1, y2 = x1;                                    \
        for (uint32_t j = 0; j < runs; j++, p += STEP, t += 32) {                                          \
            __m256i x = LOAD16(p);                                                                         \
            __m256i e = _mm256_and_si256(x, m), o = _mm256_srli_epi32(x, 16);                              \
            __m256i e2 = _mm256_srli_epi64(e, 32), o2 = _mm256_srli_epi64(o, 32);                          \
            const __m256i *w = (const __m256i *)t;                                                         \
            x1 = _mm256_add_epi64(x1, _mm256_mul_epu32(e, _mm256_load_si256(w)));                          \
            x2 = _mm256_add_epi64(x2, _mm256_mul_epu32(e, _mm256_load_si256(w + 1)));                      \
            y1 = _mm256_add_epi64(y1, _mm256_mul_epu32(o, _mm256_load_si256(w + 2)));                      \
            y2 = _mm256_add_epi64(y2, _mm256_mul_epu32(o, _mm256_load_si256(w + 3)));                      \
            x1 = _mm256_add_epi64(x1, _mm256_mul_epu32(e2, _mm256_load_si256(w + 4)));                     \
            x2 = _mm256_add_epi64(x2, _mm256_mul_epu32(e2, _mm256_load_si256(w + 5)));                     \
            y1 = _mm256_add_epi64(y1, _mm256_mul_epu32(o2, _mm256_load_si256(w + 6)));                     \
            y2 = _mm256_add_epi64(y2, _mm256_mul_epu32(o2, _mm256_load_si256(w + 7)));                     \
        }                                                                                                  \
        uint64_t u[4], v[4];                                                                               \
        _mm256_storeu_si256((__m256i *)u, _mm256_add_epi64(x1, y1));                                       \
        _mm256_storeu_si256((__m256i *)v, _mm256_add_epi64(x2, y2));                                       \
        *s1 += u[0] + u[1] + u[2] + u[3];                                                                  \
        *s2 += v[0] + v[1] + v[2] + v[3];                                                                  \
    }
#define LOAD16_U16(p) _mm256_loadu_si256((const __m256i *)(p))
#define LOAD16_U8(p) _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p)))
AVX2_BODY(body_avx2_u16, LOAD16_U16, 32)
AVX2_BODY(body_avx2_u8, LOAD16_U8, 16)
#endif

static int have_avx2 = 0;

/* n limbs at p with group positions [l0, l0 + n) inside one group: the unreduced sums. */
static void group_sum(const uint8_t *p, int lb, uint32_t l0, uint32_t n, uint64_t *s1, uint64_t *s2) {
#ifdef UNICKPT_X86
    if (have_avx2 && n >= 32) {
        uint32_t head = (16 - (l0 & 15)) & 15;
        span_scalar(p, lb, l0, head, s1, s2);
        p += (size_t)head * lb;
        l0 += head;
        n -= head;
        uint32_t runs = n / 16;
        if (lb == 2)
            body_avx2_u16(p, TAB + 2 * l0, runs, s1, s2);
        else
            body_avx2_u8(p, TAB + 2 * l0, runs, s1, s2);
        p += (size_t)runs * 16 * lb;
        l0 += runs * 16;
        n -= runs * 16;
    }
#endif
    span_scalar(p, lb, l0, n, s1, s2);
}

/* x mod p_k up to a small multiple: 2^32 = c (mod p_k) with c = 5 or 17, so folding the high
 * half onto the low one keeps the residue. Two folds take any x < 2^59 below 2^32 + c. */
static inline uint64_t fold(uint64_t x, uint64_t c) { return (x >> 32) * c + (x & 0xFFFFFFFFULL); }

/* Adds the weighted sum of n limbs at p, global limb indices [i0, i0 + n), to h1 / h2. */
static void limb_run(const uint8_t *p, int lb, uint64_t i0, uint64_t n, uint64_t *h1, uint64_t *h2) {
    uint64_t a1 = 0, a2 = 0; /* unreduced, each step adds < 2^38 */
    while (n > 0) {
        uint64_t h = i0 >> GBITS;
        uint32_t l = (uint32_t)(i0 & (G - 1));
        uint32_t m = n < (uint64_t)(G - l) ? (uint32_t)n : G - l;
        uint64_t s1 = 0, s2 = 0, w1, w2;
        group_sum(p, lb, l, m, &s1, &s2); /* each < 1024 * 2^48 = 2^58 */
        weights_h(h, &w1, &w2);
        /* (< 2^32 + 17) * (< p_k) < 2^64; the fold of the product is < 2^38 */
        a1 += fold(fold(fold(s1, 5), 5) * w1, 5);
        a2 += fold(fold(fold(s2, 17), 17) * w2, 17);
        if ((a1 | a2) >> 62) {
            a1 %= P1;
            a2 %= P2;
        }
        p += (size_t)m * lb;
        i0 += m;
        n -= m;
    }
    *h1 = (*h1 + a1 % P1) % P1;
    *h2 = (*h2 + a2 % P2) % P2;
}

typedef struct {
    int k;            /* dims [0, k) are walked; each run is shape[k] x full trailing dims */
    uint64_t run;     /* elements per run */
    uint64_t off[MAX_DIMS], shape[MAX_DIMS], gstride[MAX_DIMS], idx[MAX_DIMS];
} walk_t;

static uint64_t run_start(const walk_t *w) {
    uint64_t g = w->off[w->k] * w->gstride[w->k];
    for (int d = 0; d < w->k; d++) g += (w->off[d] + w->idx[d]) * w->gstride[d];
    return g;
}

static void next_run(walk_t *w) {
    for (int d = w->k - 1; d >= 0; d--) {
        if (++w->idx[d] < w->shape[d]) return;
        w->idx[d] = 0;
    }
}

static void block_range(const uint8_t *p, int isz, walk_t *w, uint64_t start, uint64_t count, uint64_t *h1,
                        uint64_t *h2) {
    int lb = isz == 1 ? 1 : 2;
    uint64_t L = isz == 1 ? 1 : (uint64_t)isz / 2;
    uint64_t q = start / w->run, c = start % w->run;
    for (int d = w->k - 1; d >= 0; d--) {
        w->idx[d] = q % w->shape[d];
        q /= w->shape[d];
    }
    while (count > 0) {
        uint64_t m = w->run - c < count ? w->run - c : count;
        limb_run(p, lb, (run_start(w) + c) * L, m * L, h1, h2);
        p += m * (uint64_t)isz;
        count -= m;
        c = 0;
        next_run(w);
    }
}

static int read_dims(PyObject *seq, uint64_t *out, int *nd, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > MAX_DIMS) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s: more than %d dims", what, MAX_DIMS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        if (v < 0) {
            Py_DECREF(fast);
            PyErr_Format(PyExc_ValueError, "%s: negative size", what);
            return -1;
        }
        out[i] = (uint64_t)v;
    }
    *nd = (int)n;
    Py_DECREF(fast);
    return 0;
}

static PyObject *py_partial(PyObject *self, PyObject *args) {
    Py_buffer buf;
    int isz;
    PyObject *gs, *os, *ss;
    unsigned long long start;
    if (!PyArg_ParseTuple(args, "y*iOOOK:partial", &buf, &isz, &gs, &os, &ss, &start)) return NULL;
    PyObject *result = NULL;
    walk_t w;
    uint64_t gl[MAX_DIMS];
    int ng = 0, no = 0, ns = 0;
    if (read_dims(gs, gl, &ng, "global_shape") || read_dims(os, w.off, &no, "offsets") ||
        read_dims(ss, w.shape, &ns, "shape"))
        goto done;
    if (ng != no || ng != ns) {
        PyErr_SetString(PyExc_ValueError, "global_shape, offsets and shape differ in length");
        goto done;
    }
    if (isz != 1 && isz != 2 && isz != 4 && isz != 8) {
        PyErr_Format(PyExc_ValueError, "itemsize must be 1, 2, 4 or 8, not %d", isz);
        goto done;
    }
    if (buf.len % isz != 0) {
        PyErr_Format(PyExc_ValueError, "buffer of %zd bytes is not a whole number of %d-byte words", buf.len, isz);
        goto done;
    }
    if (ng == 0) { /* a 0-dim tensor is one element */
        ng = 1;
        gl[0] = 1;
        w.off[0] = 0;
        w.shape[0] = 1;
    }
    uint64_t n = 1, stride = 1;
    for (int d = ng - 1; d >= 0; d--) {
        if (w.off[d] + w.shape[d] > gl[d] || w.off[d] + w.shape[d] < w.off[d]) {
            PyErr_Format(PyExc_ValueError, "block exceeds the tensor on dim %d", d);
            goto done;
        }
        w.gstride[d] = stride;
        stride *= gl[d];
        n *= w.shape[d];
        w.idx[d] = 0;
    }
    /* k: the last dim that is not whole, or 0; runs are shape[k] x the whole dims after it. */
    w.k = ng - 1;
    while (w.k > 0 && w.off[w.k] == 0 && w.shape[w.k] == gl[w.k]) w.k--;
    w.run = w.shape[w.k] * w.gstride[w.k];
    uint64_t count = (uint64_t)(buf.len / isz);
    uint64_t h1 = 0, h2 = 0;
    if (count > 0) {
        if (n == 0 || start > n || count > n - start) {
            PyErr_SetString(PyExc_ValueError, "element range lies outside the block");
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS
        block_range((const uint8_t *)buf.buf, isz, &w, start, count, &h1, &h2);
        Py_END_ALLOW_THREADS
    }
    result = Py_BuildValue("(KK)", (unsigned long long)h1, (unsigned long long)h2);
done:
    PyBuffer_Release(&buf);
    return result;
}

static PyObject *py_simd(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(have_avx2 ? "avx2" : "scalar");
}

static PyMethodDef methods[] = {
    {"partial", py_partial, METH_VARARGS,
     "partial(buffer, itemsize, global_shape, offsets, shape, start) -> (H1, H2): fingerprint v2 sums "
     "of elements [start, start + len(buffer) / itemsize) of a block, mod 2^32-5 and 2^32-17."},
    {"simd", py_simd, METH_NOARGS, "Which kernel runs on this CPU: 'avx2' or 'scalar'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fp2kernel",
                                    "Compiled partial sums of fingerprint v2.", -1, methods};

PyMODINIT_FUNC PyInit__fp2kernel(void) {
#ifdef UNICKPT_X86
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    /* UNICKPT_FP_SCALAR=1 forces the plain-C loops (tests compare the two; same numbers). */
    if (getenv("UNICKPT_FP_SCALAR")) have_avx2 = 0;
    build_tables();
    return PyModule_Create(&module);
}
