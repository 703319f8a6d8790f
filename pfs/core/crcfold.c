/* CRC32C (Castagnoli) of large buffers by carry-less multiplication (VPCLMULQDQ over
 * AVX-512 registers), for pfs.core.crcfast: the same value as crc32c.crc32c(data, value),
 * at about twice its speed where the CPU has these instructions (that package's
 * crc32 instruction does 8 bytes a cycle at best).
 *
 * The buffer is read 256 bytes at a time into 16 lanes of 128 bits; each lane is folded
 * forward by 2048 bits (x^2048 mod P, split over its two 64-bit halves: constants
 * x^(D+32) and x^(D-32) mod P, bit-reflected and shifted left by one), which keeps what
 * the lanes hold congruent, modulo P, to the bytes read so far. At the end the lanes
 * fold into one 128-bit value, whose CRC, followed by the bytes left over, is taken with
 * the crc32 instruction. Constants: tests/unit/test_crcfast.py derives them again.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define FAST_MIN 1024 /* below this, the plain crc32 instruction loop */
#define NOGIL_MIN (64 << 10)

#define TGT_SSE __attribute__((target("sse4.2")))
#define TGT_FOLD __attribute__((target("sse4.2,pclmul,avx512f,avx512vl,vpclmulqdq")))

TGT_SSE static uint32_t crc_bytes(uint32_t c, const unsigned char *p, size_t n) {
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c64 = _mm_crc32_u64(c64, v);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--) c = _mm_crc32_u8(c, *p++);
    return c;
}

TGT_FOLD static inline __m512i fold512(__m512i x, __m512i k) {
    return _mm512_xor_si512(_mm512_clmulepi64_epi128(x, k, 0x00),
                            _mm512_clmulepi64_epi128(x, k, 0x11));
}

TGT_FOLD static inline __m128i fold128(__m128i x, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

TGT_FOLD static inline __m512i load_copy(const unsigned char *p, unsigned char *d) {
    __m512i v = _mm512_loadu_si512((const void *)p);
    if (d) _mm512_storeu_si512((void *)d, v);
    return v;
}

/* the raw CRC state ``c`` (not inverted) over ``n`` >= 256 bytes; where ``d`` is not NULL
 * each vector read is also stored there (a copy in the same pass: the bytes are read
 * from memory once, and the CRC is of exactly what was copied) */
TGT_FOLD static inline __attribute__((always_inline)) uint32_t
fold_impl(uint32_t c, const unsigned char *p, size_t n, unsigned char *d) {
    const __m512i k2048 = _mm512_set_epi64(0xb9e02b86, 0xdcb17aa4, 0xb9e02b86, 0xdcb17aa4,
                                           0xb9e02b86, 0xdcb17aa4, 0xb9e02b86, 0xdcb17aa4);
    const __m512i k512 = _mm512_set_epi64(0x9e4addf8, 0x740eef02, 0x9e4addf8, 0x740eef02,
                                          0x9e4addf8, 0x740eef02, 0x9e4addf8, 0x740eef02);
    const __m128i k128 = _mm_set_epi64x(0x14cd00bd6, 0xf20c0dfe);
#define LOAD(off) load_copy(p + (off), d ? d + (off) : NULL)
    __m512i z0 = LOAD(0);
    __m512i z1 = LOAD(64);
    __m512i z2 = LOAD(128);
    __m512i z3 = LOAD(192);
    z0 = _mm512_xor_si512(z0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)c)));
    p += 256;
    d = d ? d + 256 : NULL;
    n -= 256;
    while (n >= 256) {
        z0 = _mm512_xor_si512(fold512(z0, k2048), LOAD(0));
        z1 = _mm512_xor_si512(fold512(z1, k2048), LOAD(64));
        z2 = _mm512_xor_si512(fold512(z2, k2048), LOAD(128));
        z3 = _mm512_xor_si512(fold512(z3, k2048), LOAD(192));
        p += 256;
        d = d ? d + 256 : NULL;
        n -= 256;
    }
    z1 = _mm512_xor_si512(z1, fold512(z0, k512));
    z2 = _mm512_xor_si512(z2, fold512(z1, k512));
    z3 = _mm512_xor_si512(z3, fold512(z2, k512));
    while (n >= 64) {
        z3 = _mm512_xor_si512(fold512(z3, k512), LOAD(0));
        p += 64;
        d = d ? d + 64 : NULL;
        n -= 64;
    }
#undef LOAD
    __m128i x = _mm512_extracti32x4_epi32(z3, 0);
    x = _mm_xor_si128(fold128(x, k128), _mm512_extracti32x4_epi32(z3, 1));
    x = _mm_xor_si128(fold128(x, k128), _mm512_extracti32x4_epi32(z3, 2));
    x = _mm_xor_si128(fold128(x, k128), _mm512_extracti32x4_epi32(z3, 3));
    uint64_t c64 = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    c64 = _mm_crc32_u64(c64, (uint64_t)_mm_extract_epi64(x, 1));
    if (d) {
        memcpy(d, p, n);
        p = d;
    }
    return crc_bytes((uint32_t)c64, p, n);
}

TGT_FOLD static uint32_t crc_fold(uint32_t c, const unsigned char *p, size_t n) {
    return fold_impl(c, p, n, NULL);
}

TGT_FOLD static uint32_t crc_fold_copy(uint32_t c, unsigned char *d, const unsigned char *p,
                                       size_t n) {
    return fold_impl(c, p, n, d);
}

static int have_fold;

static uint32_t crc32c_any(uint32_t value, const unsigned char *p, size_t n) {
    uint32_t c = ~value;
    c = (have_fold && n >= FAST_MIN) ? crc_fold(c, p, n) : crc_bytes(c, p, n);
    return ~c;
}

static uint32_t copy_any(uint32_t value, unsigned char *d, const unsigned char *p, size_t n) {
    uint32_t c = ~value;
    if (have_fold && n >= FAST_MIN) {
        c = crc_fold_copy(c, d, p, n);
    } else {
        memcpy(d, p, n);
        c = crc_bytes(c, d, n);
    }
    return ~c;
}

/* the optional last argument ``value`` of a call with ``want`` arguments before it:
 * 0 if absent; -1 (an exception set) if the count or the value is wrong */
static int crc_value(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                     const char *usage, unsigned long *value) {
    if (nargs < want || nargs > want + 1) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    *value = 0;
    if (nargs == want + 1) {
        *value = PyLong_AsUnsignedLongMask(args[want]);
        if (*value == (unsigned long)-1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static PyObject *py_crc32c(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    unsigned long value;
    if (crc_value(args, nargs, 1, "crc32c(data, value=0)", &value) < 0) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) return NULL;
    uint32_t r;
    if (b.len >= NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        r = crc32c_any((uint32_t)value, (const unsigned char *)b.buf, (size_t)b.len);
        Py_END_ALLOW_THREADS
    } else {
        r = crc32c_any((uint32_t)value, (const unsigned char *)b.buf, (size_t)b.len);
    }
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(r);
}

static PyObject *py_crc32c_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    unsigned long value;
    if (crc_value(args, nargs, 2, "crc32c_copy(dst, src, value=0)", &value) < 0) return NULL;
    Py_buffer d, b;
    if (PyObject_GetBuffer(args[0], &d, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &b, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    if (d.len < b.len) {
        PyBuffer_Release(&b);
        PyBuffer_Release(&d);
        PyErr_SetString(PyExc_ValueError, "crc32c_copy: dst is shorter than src");
        return NULL;
    }
    unsigned char *dp = (unsigned char *)d.buf;
    const unsigned char *sp = (const unsigned char *)b.buf;
    size_t n = (size_t)b.len;
    uint32_t r;
    if (n >= NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        r = copy_any((uint32_t)value, dp, sp, n);
        Py_END_ALLOW_THREADS
    } else {
        r = copy_any((uint32_t)value, dp, sp, n);
    }
    PyBuffer_Release(&b);
    PyBuffer_Release(&d);
    return PyLong_FromUnsignedLong(r);
}

static PyObject *py_folds(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(have_fold);
}

static PyMethodDef methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_FASTCALL,
     "crc32c(data, value=0): as crc32c.crc32c"},
    {"crc32c_copy", (PyCFunction)(void (*)(void))py_crc32c_copy, METH_FASTCALL,
     "crc32c_copy(dst, src, value=0): copy src to the start of dst; crc32c of src"},
    {"folds", py_folds, METH_NOARGS, "whether this CPU takes the folding path"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pfs_crcfold", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__pfs_crcfold(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("sse4.2")) {
        PyErr_SetString(PyExc_ImportError, "no SSE 4.2 crc32 instruction");
        return NULL;
    }
    have_fold = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul");
    return PyModule_Create(&module);
}
