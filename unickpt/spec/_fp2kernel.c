/* Fingerprint v2, compiled (docs/format.md section 5.2 defines it; unickpt/spec/_fp2.py holds a
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
 * The bl tables are constants (G entries per prime, built once at import). The sums run in
 * 64-bit lanes, one pass over the data: limbs zero-extended to 64 bits are multiplied by the
 * packed weights bl_1 | bl_2 << 32 and added (vpmuludq + vpaddq, or one AVX512-IFMA
 * vpmadd52luq), 8 limbs a vector with AVX-512, 4 with AVX2, NEON umlal on AArch64, else plain C;
 * the x86 loops are chosen at import from what the CPU supports (setup.py needs no -m flags:
 * each loop carries its own target attribute). Products are below 2^48 and a group has at most 1024 of them, so 64-bit
 * lanes never wrap; each group is reduced mod p_k once and multiplied by bh_k(h). Every loop
 * gives the same sums, hence the same numbers.
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
/* The AVX-512 loops want a compiler that knows IFMA and the reduce intrinsics (GCC 8, clang 8). */
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 8) || (!defined(__clang__) && __GNUC__ >= 8))
#define UNICKPT_X86_512 1
#endif
#endif

/* AArch64: NEON is part of the base architecture, so its loops are always compiled and used. */
#if defined(__aarch64__) && defined(__ARM_NEON) && defined(__BYTE_ORDER__) && \
    __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#include <arm_neon.h>
#define UNICKPT_NEON 1
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
/* Both primes' position weights of limb l in one 64-bit word, bl_1(l) | bl_2(l) << 32, for the
 * SIMD loops: vpmuludq multiplies the low 32 bits of each 64-bit lane, so limbs zero-extended to
 * 64-bit lanes times these words give the prime-1 products, and times the words shifted right
 * by 32 the prime-2 products. 8 KiB: the table stays in L1 beside the streamed data. */
static uint64_t PW[G] __attribute__((aligned(64)));

static void build_tables(void) {
    for (uint32_t l = 0; l < G; l++) {
        uint64_t z = mix64((uint64_t)l ^ SEED_L);
        BL1[l] = (uint32_t)(1 + (uint32_t)z % (P1 - 1));
        BL2[l] = (uint32_t)(1 + (uint32_t)(z >> 32) % (P2 - 1));
        PW[l] = (uint64_t)BL1[l] | ((uint64_t)BL2[l] << 32);
    }
}

static inline void weights_h(uint64_t h, uint64_t *w1, uint64_t *w2) {
    uint64_t z = mix64(h ^ SEED_H);
    *w1 = 1 + (uint32_t)z % (P1 - 1);
    *w2 = 1 + (uint32_t)(z >> 32) % (P2 - 1);
}

/* A span: n limbs at p with group positions [l0, l0 + n) inside one group (l0 + n <= G); adds
 * the unreduced sums of v * bl_k to s1 / s2. Every product is below 2^48 and a span has at most
 * 1024 of them, so 64-bit sums (and every 64-bit lane of the SIMD accumulators) never wrap. */
typedef void (*span_fn)(const uint8_t *p, uint32_t l0, uint32_t n, uint64_t *s1, uint64_t *s2);

static void span_scalar_u8(const uint8_t *p, uint32_t l0, uint32_t n, uint64_t *s1, uint64_t *s2) {
    uint64_t a = 0, b = 0;
    for (uint32_t k = 0; k < n; k++) {
        uint64_t v = p[k];
        a += v * BL1[l0 + k];
        b += v * BL2[l0 + k];
    }
    *s1 += a;
    *s2 += b;
}

static void span_scalar_u16(const uint8_t *p, uint32_t l0, uint32_t n, uint64_t *s1, uint64_t *s2) {
    uint64_t a = 0, b = 0;
    for (uint32_t k = 0; k < n; k++) {
        uint64_t v = (uint64_t)p[2 * k] | ((uint64_t)p[2 * k + 1] << 8); /* little-endian on any host */
        a += v * BL1[l0 + k];
        b += v * BL2[l0 + k];
    }
    *s1 += a;
    *s2 += b;
}

#ifdef UNICKPT_X86
/* The x86 loops read limbs with plain loads: x86 is little-endian, as the format's limbs are. */
static inline uint32_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

#ifdef UNICKPT_X86_512
/* AVX-512: 8 limbs per vector; 32 per step (four independent pairs of accumulators), then 8 at
 * a time, then one masked step (masked-out lanes load nothing and add zero). MAC1 / MAC2 add the
 * products with prime 1's / prime 2's weights of the packed words w to an accumulator:
 * vpmuludq + vpaddq, or with AVX512-IFMA one vpmadd52luq (the low 52 bits of the product of the
 * low 52 bits: exact, as limbs are below 2^16 and weights below 2^32, once w is cleaned to the
 * one weight). Same sums either way. */
#define AVX512_SPAN(NAME, TARGET, LB, ZX, ZXM, MAC1, MAC2)                                                \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *p, uint32_t l0, uint32_t n,          \
                                                     uint64_t *s1, uint64_t *s2) {                       \
        const uint64_t *w = PW + l0;                                                                     \
        const __m512i lo = _mm512_set1_epi64(0xFFFFFFFFLL);                                              \
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0,        \
                b3 = a0;                                                                                 \
        (void)lo;                                                                                        \
        uint32_t k = 0;                                                                                  \
        for (; k + 32 <= n; k += 32) {                                                                   \
            const uint8_t *q = p + (size_t)k * LB;                                                       \
            __m512i d0 = ZX(q), d1 = ZX(q + 8 * LB), d2 = ZX(q + 16 * LB), d3 = ZX(q + 24 * LB);         \
            __m512i w0 = _mm512_loadu_si512(w + k), w1 = _mm512_loadu_si512(w + k + 8);                  \
            __m512i w2 = _mm512_loadu_si512(w + k + 16), w3 = _mm512_loadu_si512(w + k + 24);            \
            a0 = MAC1(a0, d0, w0);                                                                       \
            b0 = MAC2(b0, d0, w0);                                                                       \
            a1 = MAC1(a1, d1, w1);                                                                       \
            b1 = MAC2(b1, d1, w1);                                                                       \
            a2 = MAC1(a2, d2, w2);                                                                       \
            b2 = MAC2(b2, d2, w2);                                                                       \
            a3 = MAC1(a3, d3, w3);                                                                       \
            b3 = MAC2(b3, d3, w3);                                                                       \
        }                                                                                                \
        for (; k < n; k += 8) {                                                                          \
            uint32_t r = n - k;                                                                          \
            __mmask8 m = r >= 8 ? (__mmask8)0xFF : (__mmask8)((1u << r) - 1);                            \
            __m512i d = ZXM(m, p + (size_t)k * LB), wk = _mm512_maskz_loadu_epi64(m, w + k);             \
            a0 = MAC1(a0, d, wk);                                                                        \
            b0 = MAC2(b0, d, wk);                                                                        \
        }                                                                                                \
        a0 = _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3));                       \
        b0 = _mm512_add_epi64(_mm512_add_epi64(b0, b1), _mm512_add_epi64(b2, b3));                       \
        *s1 += (uint64_t)_mm512_reduce_add_epi64(a0);                                                    \
        *s2 += (uint64_t)_mm512_reduce_add_epi64(b0);                                                    \
    }
#define ZX512_U16(q) _mm512_cvtepu16_epi64(_mm_loadu_si128((const __m128i *)(q)))
#define ZX512_U8(q) _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(q)))
#define ZXM512_U16(m, q) _mm512_cvtepu16_epi64(_mm_maskz_loadu_epi16((__mmask8)(m), (q)))
#define ZXM512_U8(m, q) _mm512_cvtepu8_epi64(_mm_maskz_loadu_epi8((__mmask16)(m), (q)))
#define MUL1(acc, d, w) _mm512_add_epi64(acc, _mm512_mul_epu32(d, w))
#define MUL2(acc, d, w) _mm512_add_epi64(acc, _mm512_mul_epu32(d, _mm512_srli_epi64(w, 32)))
#define IFMA1(acc, d, w) _mm512_madd52lo_epu64(acc, d, _mm512_and_si512(w, lo))
#define IFMA2(acc, d, w) _mm512_madd52lo_epu64(acc, d, _mm512_srli_epi64(w, 32))
#define T512 "avx512f,avx512bw,avx512vl"
#define T512IFMA "avx512f,avx512bw,avx512vl,avx512ifma"
AVX512_SPAN(span_avx512_u16, T512, 2, ZX512_U16, ZXM512_U16, MUL1, MUL2)
AVX512_SPAN(span_avx512_u8, T512, 1, ZX512_U8, ZXM512_U8, MUL1, MUL2)
AVX512_SPAN(span_ifma_u16, T512IFMA, 2, ZX512_U16, ZXM512_U16, IFMA1, IFMA2)
AVX512_SPAN(span_ifma_u8, T512IFMA, 1, ZX512_U8, ZXM512_U8, IFMA1, IFMA2)
#endif

/* AVX2: the same with 4 limbs per vector, 16 per step; the last < 4 limbs in plain C. */
#define AVX2_SPAN(NAME, LB, ZX, TAIL)                                                                     \
    __attribute__((target("avx2"))) static void NAME(const uint8_t *p, uint32_t l0, uint32_t n,          \
                                                     uint64_t *s1, uint64_t *s2) {                       \
        const uint64_t *w = PW + l0;                                                                     \
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0,        \
                b3 = a0;                                                                                 \
        uint32_t k = 0;                                                                                  \
        for (; k + 16 <= n; k += 16) {                                                                   \
            const uint8_t *q = p + (size_t)k * LB;                                                       \
            __m256i d0 = ZX(q), d1 = ZX(q + 4 * LB), d2 = ZX(q + 8 * LB), d3 = ZX(q + 12 * LB);          \
            __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + k));                                   \
            __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + k + 4));                               \
            __m256i w2 = _mm256_loadu_si256((const __m256i *)(w + k + 8));                               \
            __m256i w3 = _mm256_loadu_si256((const __m256i *)(w + k + 12));                              \
            a0 = _mm256_add_epi64(a0, _mm256_mul_epu32(d0, w0));                                         \
            b0 = _mm256_add_epi64(b0, _mm256_mul_epu32(d0, _mm256_srli_epi64(w0, 32)));                  \
            a1 = _mm256_add_epi64(a1, _mm256_mul_epu32(d1, w1));                                         \
            b1 = _mm256_add_epi64(b1, _mm256_mul_epu32(d1, _mm256_srli_epi64(w1, 32)));                  \
            a2 = _mm256_add_epi64(a2, _mm256_mul_epu32(d2, w2));                                         \
            b2 = _mm256_add_epi64(b2, _mm256_mul_epu32(d2, _mm256_srli_epi64(w2, 32)));                  \
            a3 = _mm256_add_epi64(a3, _mm256_mul_epu32(d3, w3));                                         \
            b3 = _mm256_add_epi64(b3, _mm256_mul_epu32(d3, _mm256_srli_epi64(w3, 32)));                  \
        }                                                                                                \
        for (; k + 4 <= n; k += 4) {                                                                     \
            __m256i d = ZX(p + (size_t)k * LB), wk = _mm256_loadu_si256((const __m256i *)(w + k));       \
            a0 = _mm256_add_epi64(a0, _mm256_mul_epu32(d, wk));                                          \
            b0 = _mm256_add_epi64(b0, _mm256_mul_epu32(d, _mm256_srli_epi64(wk, 32)));                   \
        }                                                                                                \
        uint64_t u[4], v[4];                                                                             \
        a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));                       \
        b0 = _mm256_add_epi64(_mm256_add_epi64(b0, b1), _mm256_add_epi64(b2, b3));                       \
        _mm256_storeu_si256((__m256i *)u, a0);                                                           \
        _mm256_storeu_si256((__m256i *)v, b0);                                                           \
        *s1 += u[0] + u[1] + u[2] + u[3];                                                                \
        *s2 += v[0] + v[1] + v[2] + v[3];                                                                \
        TAIL(p + (size_t)k * LB, l0 + k, n - k, s1, s2);                                                 \
    }
#define ZX256_U16(q) _mm256_cvtepu16_epi64(_mm_loadl_epi64((const __m128i *)(q)))
#define ZX256_U8(q) _mm256_cvtepu8_epi64(_mm_cvtsi32_si128((int)load32(q)))
AVX2_SPAN(span_avx2_u16, 2, ZX256_U16, span_scalar_u16)
AVX2_SPAN(span_avx2_u8, 1, ZX256_U8, span_scalar_u8)
#endif

#ifdef UNICKPT_NEON
/* NEON: 8 limbs a step, widened to 32 bits and multiply-accumulated into 64-bit lanes (umlal /
 * umlal2) against each prime's weights; the last < 8 limbs in plain C. Loads are byte loads
 * (no alignment assumed); AArch64 Linux is little-endian, as the format's limbs are. */
#define NEON_SPAN(NAME, LOAD8, TAIL, LB)                                                                  \
    static void NAME(const uint8_t *p, uint32_t l0, uint32_t n, uint64_t *s1, uint64_t *s2) {            \
        const uint32_t *w1 = BL1 + l0, *w2 = BL2 + l0;                                                   \
        uint64x2_t a0 = vdupq_n_u64(0), a1 = a0, b0 = a0, b1 = a0;                                       \
        uint32_t k = 0;                                                                                  \
        for (; k + 8 <= n; k += 8) {                                                                     \
            uint16x8_t v = LOAD8(p + (size_t)k * LB);                                                    \
            uint32x4_t lo = vmovl_u16(vget_low_u16(v)), hi = vmovl_high_u16(v);                          \
            uint32x4_t x0 = vld1q_u32(w1 + k), x1 = vld1q_u32(w1 + k + 4);                               \
            uint32x4_t y0 = vld1q_u32(w2 + k), y1 = vld1q_u32(w2 + k + 4);                               \
            a0 = vmlal_u32(a0, vget_low_u32(lo), vget_low_u32(x0));                                      \
            a1 = vmlal_high_u32(a1, lo, x0);                                                             \
            a0 = vmlal_u32(a0, vget_low_u32(hi), vget_low_u32(x1));                                      \
            a1 = vmlal_high_u32(a1, hi, x1);                                                             \
            b0 = vmlal_u32(b0, vget_low_u32(lo), vget_low_u32(y0));                                      \
            b1 = vmlal_high_u32(b1, lo, y0);                                                             \
            b0 = vmlal_u32(b0, vget_low_u32(hi), vget_low_u32(y1));                                      \
            b1 = vmlal_high_u32(b1, hi, y1);                                                             \
        }                                                                                                \
        *s1 += vaddvq_u64(vaddq_u64(a0, a1));                                                            \
        *s2 += vaddvq_u64(vaddq_u64(b0, b1));                                                            \
        TAIL(p + (size_t)k * LB, l0 + k, n - k, s1, s2);                                                 \
    }
#define LOAD8_U16(q) vreinterpretq_u16_u8(vld1q_u8(q))
#define LOAD8_U8(q) vmovl_u8(vld1_u8(q))
NEON_SPAN(span_neon_u16, LOAD8_U16, span_scalar_u16, 2)
NEON_SPAN(span_neon_u8, LOAD8_U8, span_scalar_u8, 1)
#endif

/* The loops this CPU runs, chosen once at import: SPAN[0] for byte limbs, SPAN[1] for 16-bit. */
static span_fn SPAN[2] = {span_scalar_u8, span_scalar_u16};
static const char *simd_name = "scalar";

/* x mod p_k up to a small multiple: 2^32 = c (mod p_k) with c = 5 or 17, so folding the high
 * half onto the low one keeps the residue. Two folds take any x < 2^59 below 2^32 + c. */
static inline uint64_t fold(uint64_t x, uint64_t c) { return (x >> 32) * c + (x & 0xFFFFFFFFULL); }

/* Adds the weighted sum of n limbs at p, global limb indices [i0, i0 + n), to h1 / h2. */
static void limb_run(const uint8_t *p, int lb, uint64_t i0, uint64_t n, uint64_t *h1, uint64_t *h2) {
    const span_fn span = SPAN[lb - 1];
    uint64_t a1 = 0, a2 = 0; /* unreduced, each step adds < 2^38 */
    while (n > 0) {
        uint64_t h = i0 >> GBITS;
        uint32_t l = (uint32_t)(i0 & (G - 1));
        uint32_t m = n < (uint64_t)(G - l) ? (uint32_t)n : G - l;
        uint64_t s1 = 0, s2 = 0, w1, w2;
        span(p, l, m, &s1, &s2); /* each < 1024 * 2^48 = 2^58 */
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

static PyObject *py_simd(PyObject *self, PyObject *unused) { return PyUnicode_FromString(simd_name); }

static PyMethodDef methods[] = {
    {"partial", py_partial, METH_VARARGS,
     "partial(buffer, itemsize, global_shape, offsets, shape, start) -> (H1, H2): fingerprint v2 sums "
     "of elements [start, start + len(buffer) / itemsize) of a block, mod 2^32-5 and 2^32-17."},
    {"simd", py_simd, METH_NOARGS, "Which loops run on this CPU: 'avx512-ifma', 'avx512', 'avx2', 'neon' or 'scalar'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fp2kernel",
                                    "Compiled partial sums of fingerprint v2.", -1, methods};

/* The widest loops this CPU (and OS) runs, capped by UNICKPT_FP_SIMD=scalar|avx2|avx512 (or the older
 * UNICKPT_FP_SCALAR=1): tests compare them, every level gives the same numbers. On AArch64 the
 * NEON loops run unless capped to scalar. */
static void choose_loops(void) {
    const char *cap = getenv("UNICKPT_FP_SIMD");
    int level = 3; /* 0 scalar, 1 avx2, 2 avx512, 3 avx512-ifma */
    if (getenv("UNICKPT_FP_SCALAR") || (cap && strcmp(cap, "scalar") == 0)) level = 0;
    else if (cap && strcmp(cap, "avx2") == 0) level = 1;
    else if (cap && strcmp(cap, "avx512") == 0) level = 2;
#ifdef UNICKPT_X86
    __builtin_cpu_init();
#ifdef UNICKPT_X86_512
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl");
    if (level >= 3 && avx512 && __builtin_cpu_supports("avx512ifma")) {
        SPAN[0] = span_ifma_u8;
        SPAN[1] = span_ifma_u16;
        simd_name = "avx512-ifma";
        return;
    }
    if (level >= 2 && avx512) {
        SPAN[0] = span_avx512_u8;
        SPAN[1] = span_avx512_u16;
        simd_name = "avx512";
        return;
    }
#endif
    if (level >= 1 && __builtin_cpu_supports("avx2")) {
        SPAN[0] = span_avx2_u8;
        SPAN[1] = span_avx2_u16;
        simd_name = "avx2";
        return;
    }
#elif defined(UNICKPT_NEON)
    if (level >= 1) {
        SPAN[0] = span_neon_u8;
        SPAN[1] = span_neon_u16;
        simd_name = "neon";
    }
#else
    (void)level;
#endif
}

PyMODINIT_FUNC PyInit__fp2kernel(void) {
    choose_loops();
    build_tables();
    return PyModule_Create(&module);
}
