/* Block copies between an engine's CPU KV and the host pool, in one C loop.
 *
 * copy(src, dst, sizes, nontemporal) -> bytes: `src`, `dst` and `sizes` are buffers of int64
 * (addresses and byte counts, one entry per block run, built by native.py from the registered
 * views); each entry is one memcpy. The loop runs with the GIL released, so the request thread,
 * the heartbeat and the other copy workers go on meanwhile.
 *
 * nontemporal: runs of at least NT_MIN bytes are written with streaming stores (x86-64 SSE2
 * `movntdq`, then one `sfence`): an offload fills host pool pages nobody reads soon, and
 * streaming stores skip reading each destination line into the cache first (glibc's memcpy
 * switches to them only for copies of hundreds of MiB). Loads use ordinary stores: the engine
 * reads those blocks next. Elsewhere than x86-64 every run is a memcpy.
 *
 * Faults: the addresses come from mappings the daemon made and checked (kv_mapping.py), and a
 * client's segment that shrinks under a copy faults into the SIGBUS guard (_sigbus.c), which
 * swaps in zero pages and lets the copy run on; native.py then fails the task.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#define HAVE_NT 1
#else
#define HAVE_NT 0
#endif

#define NT_MIN (32 * 1024)

#if HAVE_NT
static void copy_nt(char *dst, const char *src, size_t n) {
    /* head up to 16-byte alignment of dst, 64-byte lines streamed, tail */
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    while (n >= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + 0));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)(dst + 0), a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        dst += 64; src += 64; n -= 64;
    }
    memcpy(dst, src, n);
}
#endif

static int int64_buffer(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len % 8) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s: expected int64 values", what);
        return -1;
    }
    return 0;
}

static PyObject *copy(PyObject *self, PyObject *args) {
    PyObject *src_obj, *dst_obj, *size_obj;
    int nontemporal = 0;
    if (!PyArg_ParseTuple(args, "OOO|p", &src_obj, &dst_obj, &size_obj, &nontemporal))
        return NULL;
    Py_buffer src, dst, sizes;
    if (int64_buffer(src_obj, &src, "src") < 0)
        return NULL;
    if (int64_buffer(dst_obj, &dst, "dst") < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (int64_buffer(size_obj, &sizes, "sizes") < 0) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *result = NULL;
    if (src.len != dst.len || src.len != sizes.len) {
        PyErr_SetString(PyExc_ValueError, "src, dst and sizes must have one entry per run each");
        goto done;
    }
    Py_ssize_t n = src.len / 8;
    const int64_t *s = (const int64_t *)src.buf, *d = (const int64_t *)dst.buf,
                  *z = (const int64_t *)sizes.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (z[i] < 0 || (z[i] && (!s[i] || !d[i]))) {
            PyErr_Format(PyExc_ValueError, "run %zd: size %lld from %p to %p", i,
                         (long long)z[i], (void *)(uintptr_t)s[i], (void *)(uintptr_t)d[i]);
            goto done;
        }
    }
    long long total = 0;
    Py_BEGIN_ALLOW_THREADS
    int streamed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t len = (size_t)z[i];
#if HAVE_NT
        if (nontemporal && len >= NT_MIN) {
            copy_nt((char *)(uintptr_t)d[i], (const char *)(uintptr_t)s[i], len);
            streamed = 1;
        } else
#endif
            memcpy((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], len);
        total += (long long)len;
    }
#if HAVE_NT
    if (streamed)
        _mm_sfence();
#else
    (void)streamed;
#endif
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong(total);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&sizes);
    return result;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(src, dst, sizes, nontemporal=False) -> bytes: one memcpy per int64 entry, GIL released"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockcopy(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "NT_MIN", NT_MIN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (m != NULL && PyModule_AddIntConstant(m, "HAVE_NT", HAVE_NT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
