/* The layout-invariant fingerprint's partial sum, compiled (see unickpt/format/hashing.py and
 * docs/format.md, "Hashes", for the definition; hashing.py holds a numpy version that gives the
 * same numbers and is used when this module is not built).
 *
 *   S = sum over the elements (r, c) of a block of  a_r * b_c * w[r, c]   (mod 2^64)
 *   a_r = mix64(r) | 1,  b_c = mix64(c ^ 0xD1B54A32D192ED03) | 1
 *
 * r is the element's global row (all dims but the last, flattened in C order), c its global
 * column (last dim) and w the element's raw bits as an unsigned integer of the item size.
 *
 * Per element the work is one 64-bit product mod 2^64. With w at most 32 bits wide it splits into
 * two 32x32->64 products, w * lo32(b) + (w * hi32(b) << 32), which AVX2 does four at a time
 * (vpmuludq); the two sums are kept apart and joined once per row. An x86-64 CPU without AVX2 and
 * other architectures run the same arithmetic as plain C loops.
 *
 * partial(buffer, itemsize, global_lead, offsets_lead, shape_lead, col_offset, cols, start[, workspace])
 *   buffer holds the block's elements [start, start + len/itemsize) in C order. The block is
 *   shape_lead x cols, placed at offsets_lead / col_offset in a tensor whose leading dims are
 *   global_lead. Ranges may begin and end mid-row, so callers can feed a block in chunks (and
 *   hash each chunk while it is in cache); a workspace of table_bytes(cols) bytes keeps the
 *   column weights between those calls. The GIL is released while summing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define UNICKPT_X86 1
#endif

#define COL_KEY 0xD1B54A32D192ED03ULL
#define MAX_DIMS 64
#define MAX_TABLE_COLS (1u << 20) /* wider rows are summed in blocks of this many columns */
#define ROWS_PER_GROUP 256        /* rows summed per pass over a table block */
#define TABLE_MAGIC 0x756E69636B707431ULL

static inline uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Column weights for columns [first, first + n): lo/hi 32-bit halves, and for AVX2 the same
 * halves laid out per group of 8 columns as four 4-lane vectors (lo of even cols, lo of odd, hi of
 * even, hi of odd), each in the low half of a 64-bit lane, which is what vpmuludq reads.
 * The table lives in caller memory (a workspace kept across the chunks of one block, so the
 * weights of a row are computed once per block, not once per chunk) or in a per-call buffer. */
typedef struct {
    uint64_t magic, first, n, cap;
} table_head_t;

typedef struct {
    table_head_t *head;
    uint64_t *vec; /* 2 * cap entries, 32-byte aligned */
    uint32_t *lo, *hi;
} table_t;

/* 32 bytes of alignment slack, the 32-byte head, then vec, lo and hi. */
static size_t table_bytes(uint64_t cap) { return 64 + (size_t)cap * 24; }

static uint64_t table_cap(size_t bytes) { return bytes < 64 + 8 * 24 ? 0 : ((bytes - 64) / 24) & ~(uint64_t)7; }

/* Lay a table of ``cap`` columns over ``mem`` (table_bytes(cap) bytes). */
static void table_at(table_t *t, char *mem, uint64_t cap, int fresh) {
    char *base = (char *)(((uintptr_t)mem + 31) & ~(uintptr_t)31);
    t->head = (table_head_t *)base;
    t->vec = (uint64_t *)(base + 32);
    t->lo = (uint32_t *)(t->vec + 2 * cap);
    t->hi = t->lo + cap;
    if (fresh || t->head->magic != TABLE_MAGIC || t->head->cap != cap) {
        t->head->magic = TABLE_MAGIC;
        t->head->cap = cap;
        t->head->first = 0;
        t->head->n = 0;
    }
}

static void build_table(table_t *t, uint64_t first, uint64_t n) {
    if (t->head->n == n && t->head->first == first) return;
    for (uint64_t j = 0; j < n; j++) {
        uint64_t b = mix64((first + j) ^ COL_KEY) | 1ULL;
        t->lo[j] = (uint32_t)b;
        t->hi[j] = (uint32_t)(b >> 32);
    }
    for (uint64_t g = 0; g + 8 <= n; g += 8) {
        uint64_t *v = t->vec + 2 * g;
        for (int k = 0; k < 4; k++) {
            v[k] = t->lo[g + 2 * k];
            v[4 + k] = t->lo[g + 2 * k + 1];
            v[8 + k] = t->hi[g + 2 * k];
            v[12 + k] = t->hi[g + 2 * k + 1];
        }
    }
    t->head->first = first;
    t->head->n = n;
}

/* sum over j < n of w[j] * b[j0 + j] (mod 2^64), b from table entries. */
#define SCALAR_ROW(T)                                                                   \
    static uint64_t row_scalar_##T(const T *w, const table_t *t, size_t j0, size_t n) { \
        const uint32_t *lo = t->lo + j0, *hi = t->hi + j0;                              \
        uint64_t l = 0, h = 0;                                                          \
        for (size_t j = 0; j < n; j++) {                                                \
            l += (uint64_t)w[j] * lo[j];                                                \
            h += (uint64_t)w[j] * hi[j];                                                \
        }                                                                               \
        return l + (h << 32);                                                           \
    }
SCALAR_ROW(uint8_t)
SCALAR_ROW(uint16_t)
SCALAR_ROW(uint32_t)

static uint64_t row_scalar_uint64_t(const uint64_t *w, const table_t *t, size_t j0, size_t n) {
    const uint32_t *lo = t->lo + j0, *hi = t->hi + j0;
    uint64_t l = 0, m = 0;
    for (size_t j = 0; j < n; j++) {
        uint64_t wl = (uint32_t)w[j], wh = w[j] >> 32;
        l += wl * lo[j];
        m += wl * hi[j] + wh * lo[j];
    }
    return l + (m << 32);
}

#ifdef UNICKPT_X86
/* LOAD8 widens 8 consecutive words to 8 x u32 in one 256-bit register. Columns before the first
 * 8-aligned table entry and after the last full group go through the scalar halves. */
#define AVX2_ROW(T, LOAD8)                                                                            \
    __attribute__((target("avx2"))) static uint64_t row_avx2_##T(const T *w, const table_t *t,        \
                                                                  size_t j0, size_t n) {              \
        const uint32_t *lo = t->lo + j0, *hi = t->hi + j0;                                            \
        uint64_t l = 0, h = 0;                                                                        \
        size_t j = 0;                                                                                 \
        for (; j < n && ((j0 + j) & 7); j++) {                                                        \
            l += (uint64_t)w[j] * lo[j];                                                              \
            h += (uint64_t)w[j] * hi[j];                                                              \
        }                                                                                             \
        __m256i l0 = _mm256_setzero_si256(), l1 = l0, h0 = l0, h1 = l0;                                \
        const uint64_t *v = t->vec + 2 * (j0 + j);                                                    \
        for (; j + 8 <= n; j += 8, v += 16) {                                                         \
            __m256i we = LOAD8(w + j);                                                                \
            __m256i wo = _mm256_srli_epi64(we, 32);                                                   \
            l0 = _mm256_add_epi64(l0, _mm256_mul_epu32(we, _mm256_load_si256((const __m256i *)v)));   \
            l1 = _mm256_add_epi64(l1, _mm256_mul_epu32(wo, _mm256_load_si256((const __m256i *)(v + 4)))); \
            h0 = _mm256_add_epi64(h0, _mm256_mul_epu32(we, _mm256_load_si256((const __m256i *)(v + 8)))); \
            h1 = _mm256_add_epi64(h1, _mm256_mul_epu32(wo, _mm256_load_si256((const __m256i *)(v + 12)))); \
        }                                                                                             \
        uint64_t ls[4], hs[4];                                                                        \
        _mm256_storeu_si256((__m256i *)ls, _mm256_add_epi64(l0, l1));                                 \
        _mm256_storeu_si256((__m256i *)hs, _mm256_add_epi64(h0, h1));                                 \
        l += ls[0] + ls[1] + ls[2] + ls[3];                                                           \
        h += hs[0] + hs[1] + hs[2] + hs[3];                                                           \
        for (; j < n; j++) {                                                                          \
            l += (uint64_t)w[j] * lo[j];                                                              \
            h += (uint64_t)w[j] * hi[j];                                                              \
        }                                                                                             \
        return l + (h << 32);                                                                         \
    }
#define LOAD8_U32(p) _mm256_loadu_si256((const __m256i *)(p))
#define LOAD8_U16(p) _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD8_U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
AVX2_ROW(uint32_t, LOAD8_U32)
AVX2_ROW(uint16_t, LOAD8_U16)
AVX2_ROW(uint8_t, LOAD8_U8)
#endif

static int have_avx2 = 0;

/* Row sum for n words at p (any item size) against table entries [j0, j0 + n). */
static uint64_t row_sum(const char *p, int isz, const table_t *t, size_t j0, size_t n) {
#ifdef UNICKPT_X86
    if (have_avx2) {
        switch (isz) {
            case 1: return row_avx2_uint8_t((const uint8_t *)p, t, j0, n);
            case 2: return row_avx2_uint16_t((const uint16_t *)p, t, j0, n);
            case 4: return row_avx2_uint32_t((const uint32_t *)p, t, j0, n);
            default: break;
        }
    }
#endif
    switch (isz) {
        case 1: return row_scalar_uint8_t((const uint8_t *)p, t, j0, n);
        case 2: return row_scalar_uint16_t((const uint16_t *)p, t, j0, n);
        case 4: return row_scalar_uint32_t((const uint32_t *)p, t, j0, n);
        default: return row_scalar_uint64_t((const uint64_t *)p, t, j0, n);
    }
}

/* Sum over the block's columns [c, c + m) of one row, data at p: the row's partial without a_r.
 * With a table as wide as the block it is built once and kept; else block by block. */
static uint64_t segment(const char *p, int isz, table_t *t, uint64_t col_off, uint64_t cols, uint64_t c,
                        uint64_t m) {
    if (t->head->cap >= cols) {
        build_table(t, col_off, cols);
        return row_sum(p, isz, t, (size_t)c, (size_t)m);
    }
    uint64_t s = 0;
    for (uint64_t done = 0; done < m; done += t->head->cap) {
        uint64_t n = m - done < t->head->cap ? m - done : t->head->cap;
        build_table(t, col_off + c + done, n);
        s += row_sum(p + done * (uint64_t)isz, isz, t, 0, (size_t)n);
    }
    return s;
}

typedef struct {
    int nd;
    uint64_t off[MAX_DIMS], shape[MAX_DIMS], gstride[MAX_DIMS], idx[MAX_DIMS];
} rows_t;

static uint64_t global_row(const rows_t *r) {
    uint64_t g = 0;
    for (int d = 0; d < r->nd; d++) g += (r->off[d] + r->idx[d]) * r->gstride[d];
    return g;
}

static void next_row(rows_t *r) {
    for (int d = r->nd - 1; d >= 0; d--) {
        if (++r->idx[d] < r->shape[d]) return;
        r->idx[d] = 0;
    }
}

static uint64_t fingerprint_range(const char *p, int isz, rows_t *rows, uint64_t col_off, uint64_t cols,
                                  uint64_t start, uint64_t count, table_t *t) {
    uint64_t total = 0;
    uint64_t q = start / cols, c = start % cols;
    for (int d = rows->nd - 1; d >= 0; d--) {
        rows->idx[d] = q % rows->shape[d];
        q /= rows->shape[d];
    }
    if (c != 0 && count > 0) { /* head: the rest of a row begun before this range */
        uint64_t m = cols - c < count ? cols - c : count;
        total += (mix64(global_row(rows)) | 1ULL) * segment(p, isz, t, col_off, cols, c, m);
        p += m * (uint64_t)isz;
        count -= m;
        if (c + m == cols) next_row(rows);
    }
    uint64_t a[ROWS_PER_GROUP], s[ROWS_PER_GROUP];
    while (count >= cols) { /* full rows, a group at a time, one table block at a time */
        uint64_t g = count / cols < ROWS_PER_GROUP ? count / cols : ROWS_PER_GROUP;
        for (uint64_t k = 0; k < g; k++) {
            a[k] = mix64(global_row(rows)) | 1ULL;
            s[k] = 0;
            next_row(rows);
        }
        uint64_t step = t->head->cap >= cols ? cols : t->head->cap;
        for (uint64_t cb = 0; cb < cols; cb += step) {
            uint64_t n = cols - cb < step ? cols - cb : step;
            build_table(t, col_off + cb, n);
            for (uint64_t k = 0; k < g; k++)
                s[k] += row_sum(p + (k * cols + cb) * (uint64_t)isz, isz, t, 0, (size_t)n);
        }
        for (uint64_t k = 0; k < g; k++) total += a[k] * s[k];
        p += g * cols * (uint64_t)isz;
        count -= g * cols;
    }
    if (count > 0) /* tail: the start of a row that ends after this range */
        total += (mix64(global_row(rows)) | 1ULL) * segment(p, isz, t, col_off, cols, 0, count);
    return total;
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
    Py_buffer buf, ws;
    int isz;
    PyObject *glead, *olead, *slead, *workspace = Py_None;
    unsigned long long col_off, cols, start;
    if (!PyArg_ParseTuple(args, "y*iOOOKKK|O:partial", &buf, &isz, &glead, &olead, &slead, &col_off, &cols,
                          &start, &workspace))
        return NULL;
    ws.obj = NULL;
    rows_t rows;
    uint64_t gl[MAX_DIMS];
    int ng = 0, no = 0, ns = 0;
    PyObject *result = NULL;
    void *owned = NULL;
    if (read_dims(glead, gl, &ng, "global_lead") || read_dims(olead, rows.off, &no, "offsets_lead") ||
        read_dims(slead, rows.shape, &ns, "shape_lead"))
        goto done;
    if (ng != no || ng != ns) {
        PyErr_SetString(PyExc_ValueError, "global_lead, offsets_lead and shape_lead differ in length");
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
    rows.nd = ng;
    uint64_t nrows = 1, stride = 1;
    for (int d = ng - 1; d >= 0; d--) {
        if (rows.off[d] + rows.shape[d] > gl[d]) {
            PyErr_Format(PyExc_ValueError, "block exceeds the tensor on dim %d", d);
            goto done;
        }
        rows.gstride[d] = stride;
        stride *= gl[d];
        nrows *= rows.shape[d];
        rows.idx[d] = 0;
    }
    uint64_t count = (uint64_t)(buf.len / isz);
    if (count == 0) {
        result = PyLong_FromUnsignedLongLong(0);
        goto done;
    }
    if (cols == 0 || nrows == 0 || start > nrows * cols || count > nrows * cols - start) {
        PyErr_SetString(PyExc_ValueError, "element range lies outside the block");
        goto done;
    }
    table_t t;
    if (workspace != Py_None) {
        if (PyObject_GetBuffer(workspace, &ws, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
        uint64_t cap = table_cap((size_t)ws.len);
        if (cap == 0) {
            PyErr_SetString(PyExc_ValueError, "workspace is too small (see table_bytes)");
            goto done;
        }
        table_at(&t, (char *)ws.buf, cap, 0);
    } else {
        uint64_t cap = cols < MAX_TABLE_COLS ? (cols + 7) & ~(uint64_t)7 : MAX_TABLE_COLS;
        owned = PyMem_RawMalloc(table_bytes(cap));
        if (!owned) {
            PyErr_NoMemory();
            goto done;
        }
        table_at(&t, (char *)owned, cap, 1);
    }
    uint64_t total;
    Py_BEGIN_ALLOW_THREADS
    total = fingerprint_range((const char *)buf.buf, isz, &rows, col_off, cols, start, count, &t);
    Py_END_ALLOW_THREADS
    result = PyLong_FromUnsignedLongLong(total);
done:
    if (owned) PyMem_RawFree(owned);
    if (ws.obj) PyBuffer_Release(&ws);
    PyBuffer_Release(&buf);
    return result;
}

static PyObject *py_table_bytes(PyObject *self, PyObject *args) {
    unsigned long long cols;
    if (!PyArg_ParseTuple(args, "K:table_bytes", &cols)) return NULL;
    uint64_t cap = cols < MAX_TABLE_COLS ? (cols + 7) & ~(uint64_t)7 : MAX_TABLE_COLS;
    return PyLong_FromSize_t(table_bytes(cap < 8 ? 8 : cap));
}

static PyObject *py_simd(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(have_avx2 ? "avx2" : "scalar");
}

static PyMethodDef methods[] = {
    {"partial", py_partial, METH_VARARGS,
     "partial(buffer, itemsize, global_lead, offsets_lead, shape_lead, col_offset, cols, start, "
     "workspace=None) -> int"},
    {"table_bytes", py_table_bytes, METH_VARARGS,
     "table_bytes(cols) -> int: size of a workspace (a bytearray) that keeps a block's column weights "
     "across the partial() calls of its chunks; one workspace per block, never shared between threads."},
    {"simd", py_simd, METH_NOARGS, "Which row kernel runs on this CPU: 'avx2' or 'scalar'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fpkernel",
                                    "Compiled partial sums of the layout-invariant fingerprint.", -1, methods};

PyMODINIT_FUNC PyInit__fpkernel(void) {
#ifdef UNICKPT_X86
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    /* UNICKPT_FP_SCALAR=1 forces the plain-C row kernel (tests compare the two; same numbers). */
    if (getenv("UNICKPT_FP_SCALAR")) have_avx2 = 0;
    return PyModule_Create(&module);
}
