/* The daemon's key table in shared memory: one writer (the daemon), many readers (clients).
 *
 * Layout (key_table.py says it in words): a 128-byte header, then `nslots` slots of 32 bytes,
 * nslots a power of two. A slot is {u64 seq, u64 k0, u64 k1, u32 bits, u32 zero}: the 16-byte
 * key as two little-endian words and which tiers hold it (bit 0 the host tier, bits 1.. local
 * storage tiers); bits == 0 is an empty slot. Open addressing with linear probing from a home
 * slot chosen by a seeded mix of the key; a deleted key's run is closed by moving later keys
 * back (no tombstones, so the table never fills with them).
 *
 * Each slot is a seqlock: the writer makes seq odd, writes the key and bits, makes seq even
 * again; a reader takes a slot's words only when seq was the same even value before and after
 * reading them, so it never pairs one key with another key's bits. A reader may miss a key
 * that the writer is moving back at that moment (a false miss, costing one recomputation);
 * it never reports a key the table did not hold while the reader read it.
 *
 * Writers: every writer call runs with the GIL held, so the daemon's threads write one at a
 * time. lookup() releases the GIL only for batches of at least GIL_FREE_KEYS keys: a 64-key
 * probe takes about a microsecond, less than handing the GIL over and taking it back, which
 * behind a busy Python thread can wait a whole switch interval (5 ms).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() do { } while (0)
#endif
#include <poll.h>
#include <sched.h>
#include <time.h>

#define MAGIC 0x315459454b43564bULL /* b"KVCKEYT1" read as a little-endian u64 */
#define HEADER_BYTES 128
#define SLOT_BYTES 32
#define GIL_FREE_KEYS 1024
#define SPINS 4096 /* a slot the writer holds for longer than this: the reader gives up */

/* header offsets */
#define H_MAGIC 0
#define H_VERSION 8
#define H_SLOT_BYTES 12
#define H_NSLOTS 16
#define H_EPOCH 24
#define H_SEED 32
#define H_COUNT 40
#define H_MAX_COUNT 48
#define H_FLAGS 56
#define LAYOUT_VERSION 1

typedef struct {
    uint64_t seq;
    uint64_t k0;
    uint64_t k1;
    uint32_t bits;
    uint32_t zero;
} slot_t;

#define LOAD(p, o) __atomic_load_n((p), (o))
#define STORE(p, v, o) __atomic_store_n((p), (v), (o))

static inline uint64_t *hword(char *base, size_t off) { return (uint64_t *)(base + off); }
static inline slot_t *slot_at(char *base, uint64_t i) {
    return (slot_t *)(base + HEADER_BYTES + i * SLOT_BYTES);
}

static inline uint64_t home(uint64_t k0, uint64_t k1, uint64_t seed, uint64_t mask) {
    uint64_t h = (k0 ^ seed) * 0x9e3779b97f4a7c15ULL;
    h ^= k1 + (h >> 29);
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    return h & mask;
}

typedef struct {
    Py_buffer view;
    char *base;
    uint64_t nslots, mask, seed;
} table_t;

/* Map the buffer and check the header; -1 with an exception set when it is not a table. */
static int table_open(PyObject *obj, table_t *t, int writable) {
    if (PyObject_GetBuffer(obj, &t->view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    t->base = (char *)t->view.buf;
    if (t->view.len < HEADER_BYTES) goto bad;
    if (LOAD(hword(t->base, H_MAGIC), __ATOMIC_ACQUIRE) != MAGIC) goto bad;
    if (*(uint32_t *)(t->base + H_VERSION) != LAYOUT_VERSION) goto bad;
    if (*(uint32_t *)(t->base + H_SLOT_BYTES) != SLOT_BYTES) goto bad;
    t->nslots = *hword(t->base, H_NSLOTS);
    if (t->nslots == 0 || (t->nslots & (t->nslots - 1)) ||
        (uint64_t)t->view.len < HEADER_BYTES + t->nslots * SLOT_BYTES)
        goto bad;
    t->mask = t->nslots - 1;
    t->seed = *hword(t->base, H_SEED);
    return 0;
bad:
    PyBuffer_Release(&t->view);
    PyErr_SetString(PyExc_ValueError, "not a kvcached key table (magic, version or size)");
    return -1;
}

static int key_words(PyObject *key, uint64_t *k0, uint64_t *k1) {
    char *p;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(key, &p, &n) < 0) return -1;
    if (n != 16) {
        PyErr_SetString(PyExc_ValueError, "a key is 16 bytes");
        return -1;
    }
    memcpy(k0, p, 8);
    memcpy(k1, p + 8, 8);
    return 0;
}

/* ---- the writer (GIL held) ------------------------------------------------------------ */

static void slot_write(slot_t *s, uint64_t k0, uint64_t k1, uint32_t bits) {
    uint64_t seq = LOAD(&s->seq, __ATOMIC_RELAXED);
    STORE(&s->seq, seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    STORE(&s->k0, k0, __ATOMIC_RELAXED);
    STORE(&s->k1, k1, __ATOMIC_RELAXED);
    STORE(&s->bits, bits, __ATOMIC_RELAXED);
    STORE(&s->seq, seq + 2, __ATOMIC_RELEASE);
}

/* The slot holding the key, or the empty slot where its probe ends (*found says which). */
static uint64_t find(table_t *t, uint64_t k0, uint64_t k1, int *found) {
    uint64_t i = home(k0, k1, t->seed, t->mask);
    for (uint64_t step = 0; step < t->nslots; step++, i = (i + 1) & t->mask) {
        slot_t *s = slot_at(t->base, i);
        if (s->bits == 0) {
            *found = 0;
            return i;
        }
        if (s->k0 == k0 && s->k1 == k1) {
            *found = 1;
            return i;
        }
    }
    *found = 0;
    return UINT64_MAX; /* no empty slot: cannot happen below max_count < nslots */
}

/* Empty slot i and close the probe run behind it (Knuth's algorithm R). */
static void remove_at(table_t *t, uint64_t i) {
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        slot_t *sj = slot_at(t->base, j);
        if (sj->bits == 0) break;
        uint64_t h = home(sj->k0, sj->k1, t->seed, t->mask);
        int stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
        if (stays) continue;
        slot_write(slot_at(t->base, i), sj->k0, sj->k1, sj->bits);
        i = j;
    }
    slot_write(slot_at(t->base, i), 0, 0, 0);
    uint64_t *count = hword(t->base, H_COUNT);
    STORE(count, LOAD(count, __ATOMIC_RELAXED) - 1, __ATOMIC_RELAXED);
}

/* init(buf, nslots, epoch, seed, max_count): an empty table; the magic goes last. */
static PyObject *kt_init(PyObject *self, PyObject *args) {
    PyObject *obj;
    unsigned long long nslots, epoch, seed, max_count;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "OKKKK", &obj, &nslots, &epoch, &seed, &max_count)) return NULL;
    if (nslots == 0 || (nslots & (nslots - 1)) || max_count >= nslots) {
        PyErr_SetString(PyExc_ValueError, "nslots: a power of two above max_count");
        return NULL;
    }
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE) < 0) return NULL;
    if ((uint64_t)view.len < HEADER_BYTES + nslots * SLOT_BYTES) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "buffer too small for nslots");
        return NULL;
    }
    char *base = (char *)view.buf;
    memset(base, 0, HEADER_BYTES + nslots * SLOT_BYTES);
    *(uint32_t *)(base + H_VERSION) = LAYOUT_VERSION;
    *(uint32_t *)(base + H_SLOT_BYTES) = SLOT_BYTES;
    *hword(base, H_NSLOTS) = nslots;
    *hword(base, H_EPOCH) = epoch;
    *hword(base, H_SEED) = seed;
    *hword(base, H_MAX_COUNT) = max_count;
    STORE(hword(base, H_MAGIC), (uint64_t)MAGIC, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* One key's update (see update): its bits now, or -1 when refused. */
static long update_one(table_t *t, uint64_t k0, uint64_t k1, uint32_t set_bits, uint32_t clear_bits,
                       uint64_t limit) {
    int found;
    uint64_t i = find(t, k0, k1, &found);
    if (found) {
        slot_t *s = slot_at(t->base, i);
        uint32_t bits = (s->bits | set_bits) & ~clear_bits;
        if (bits == 0)
            remove_at(t, i);
        else if (bits != s->bits)
            slot_write(s, k0, k1, bits);
        return bits;
    }
    uint32_t bits = set_bits & ~clear_bits;
    uint64_t *count = hword(t->base, H_COUNT);
    if (bits == 0) return 0;
    if (i == UINT64_MAX || *count >= *hword(t->base, H_MAX_COUNT) || *count >= limit) return -1;
    slot_write(slot_at(t->base, i), k0, k1, bits);
    STORE(count, *count + 1, __ATOMIC_RELAXED);
    return bits;
}

/* update(buf, key, set_bits, clear_bits[, limit]) -> the key's bits now, or -1 when it is not
 * held and the table holds max_count keys, or `limit` if lower (nothing added). A key whose bits
 * become 0 leaves the table. */
static PyObject *kt_update(PyObject *self, PyObject *args) {
    PyObject *obj, *key;
    unsigned int set_bits, clear_bits;
    unsigned long long limit = UINT64_MAX;
    uint64_t k0, k1;
    table_t t;
    if (!PyArg_ParseTuple(args, "OSII|K", &obj, &key, &set_bits, &clear_bits, &limit)) return NULL;
    if (key_words(key, &k0, &k1) < 0) return NULL;
    if (table_open(obj, &t, 1) < 0) return NULL;
    long result = update_one(&t, k0, k1, set_bits, clear_bits, limit);
    PyBuffer_Release(&t.view);
    return PyLong_FromLong(result);
}

/* update_many(buf, keys, mask, set_bits, clear_bits[, limit]) -> how many were refused: update
 * for each 16-byte key of `keys` (concatenated) XOR the 16-byte `mask`, in one call (a storage
 * tier's whole index is published at once). */
static PyObject *kt_update_many(PyObject *self, PyObject *args) {
    PyObject *obj;
    const char *keys, *mask;
    Py_ssize_t nkeys, nmask;
    unsigned int set_bits, clear_bits;
    unsigned long long limit = UINT64_MAX;
    table_t t;
    if (!PyArg_ParseTuple(args, "Oy#y#II|K", &obj, &keys, &nkeys, &mask, &nmask, &set_bits,
                          &clear_bits, &limit))
        return NULL;
    if (nkeys % 16 || nmask != 16) {
        PyErr_SetString(PyExc_ValueError, "keys: 16 bytes each; mask: 16 bytes");
        return NULL;
    }
    if (table_open(obj, &t, 1) < 0) return NULL;
    uint64_t m0, m1, k0, k1;
    memcpy(&m0, mask, 8);
    memcpy(&m1, mask + 8, 8);
    long refused = 0;
    for (Py_ssize_t off = 0; off < nkeys; off += 16) {
        memcpy(&k0, keys + off, 8);
        memcpy(&k1, keys + off + 8, 8);
        refused += update_one(&t, k0 ^ m0, k1 ^ m1, set_bits, clear_bits, limit) < 0;
    }
    PyBuffer_Release(&t.view);
    return PyLong_FromLong(refused);
}

/* clear_bits(buf, mask) -> how many keys left the table (their last bits were in mask). */
static PyObject *kt_clear_bits(PyObject *self, PyObject *args) {
    PyObject *obj;
    unsigned int mask;
    table_t t;
    if (!PyArg_ParseTuple(args, "OI", &obj, &mask)) return NULL;
    if (table_open(obj, &t, 1) < 0) return NULL;
    long removed = 0;
    /* A removal moves later keys back into slot i: look at slot i again before going on. A
     * key moved into a slot already passed was looked at before it moved. */
    for (uint64_t i = 0; i < t.nslots;) {
        slot_t *s = slot_at(t.base, i);
        if (s->bits & mask) {
            uint32_t bits = s->bits & ~mask;
            if (bits == 0) {
                remove_at(&t, i);
                removed++;
                continue;
            }
            slot_write(s, s->k0, s->k1, bits);
        }
        i++;
    }
    PyBuffer_Release(&t.view);
    return PyLong_FromLong(removed);
}

/* set_flags(buf, set, clear) -> the flags now. */
static PyObject *kt_set_flags(PyObject *self, PyObject *args) {
    PyObject *obj;
    unsigned long long set, clear;
    table_t t;
    if (!PyArg_ParseTuple(args, "OKK", &obj, &set, &clear)) return NULL;
    if (table_open(obj, &t, 1) < 0) return NULL;
    uint64_t *flags = hword(t.base, H_FLAGS);
    uint64_t now = (LOAD(flags, __ATOMIC_RELAXED) | set) & ~clear;
    STORE(flags, now, __ATOMIC_RELEASE);
    PyBuffer_Release(&t.view);
    return PyLong_FromUnsignedLongLong(now);
}

/* ---- the reader ------------------------------------------------------------------------ */

/* The bits the table holds for a key (0: not held), or -1 when a slot stayed locked. */
static int64_t probe(table_t *t, uint64_t k0, uint64_t k1) {
    uint64_t i = home(k0, k1, t->seed, t->mask);
    for (uint64_t step = 0; step < t->nslots; step++, i = (i + 1) & t->mask) {
        slot_t *s = slot_at(t->base, i);
        uint64_t a, b;
        uint32_t bits;
        for (int spin = 0;; spin++) {
            uint64_t s1 = LOAD(&s->seq, __ATOMIC_ACQUIRE);
            if (!(s1 & 1)) {
                a = LOAD(&s->k0, __ATOMIC_RELAXED);
                b = LOAD(&s->k1, __ATOMIC_RELAXED);
                bits = LOAD(&s->bits, __ATOMIC_RELAXED);
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                if (LOAD(&s->seq, __ATOMIC_RELAXED) == s1) break;
            }
            if (spin >= SPINS) return -1;
            if (spin & 63) CPU_RELAX(); else sched_yield();
        }
        if (bits == 0) return 0;
        if (a == k0 && b == k1) return bits;
    }
    return 0;
}

/* Probe n keys (16 bytes each at kp): *host the leading keys with the host bit, *storage the
 * keys right after those with a storage bit. Returns the header's flags read after the probe,
 * and sets *failed when the table is another daemon's (epoch) or a slot stayed locked. Releases
 * the GIL for batches of GIL_FREE_KEYS keys or more. */
static uint64_t count_prefix(table_t *t, const char *kp, Py_ssize_t n, uint64_t epoch,
                             Py_ssize_t *host, Py_ssize_t *storage, int *failed) {
    *host = *storage = 0;
    *failed = *hword(t->base, H_EPOCH) != epoch;
    PyThreadState *ts = NULL;
    if (n >= GIL_FREE_KEYS) ts = PyEval_SaveThread();
    for (Py_ssize_t k = 0; k < n && !*failed; k++) {
        uint64_t k0, k1;
        memcpy(&k0, kp + 16 * k, 8);
        memcpy(&k1, kp + 16 * k + 8, 8);
        int64_t bits = probe(t, k0, k1);
        if (bits < 0) *failed = 1;
        else if (*host == k && (bits & 1)) (*host)++;
        else if (bits & ~(int64_t)1) (*storage)++;
        else break;
    }
    uint64_t flags = LOAD(hword(t->base, H_FLAGS), __ATOMIC_ACQUIRE);
    if (ts != NULL) PyEval_RestoreThread(ts);
    return flags;
}

/* lookup(buf, keys, epoch) -> (host, storage, flags): `keys` is 16-byte keys back to back.
 * host: the leading keys the host tier holds; storage: the keys right after those that a local
 * storage tier holds; flags: the header's flags read after the probe. (-1, 0, flags) when the
 * table is another daemon's (epoch) or a slot stayed locked: ask the daemon. */
static PyObject *kt_lookup(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_buffer keys;
    unsigned long long epoch;
    table_t t;
    if (!PyArg_ParseTuple(args, "Oy*K", &obj, &keys, &epoch)) return NULL;
    if (keys.len % 16) {
        PyBuffer_Release(&keys);
        PyErr_SetString(PyExc_ValueError, "keys: 16-byte keys back to back");
        return NULL;
    }
    if (table_open(obj, &t, 0) < 0) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    Py_ssize_t host, storage;
    int failed;
    uint64_t flags = count_prefix(&t, (const char *)keys.buf, keys.len / 16, epoch, &host, &storage, &failed);
    PyBuffer_Release(&t.view);
    PyBuffer_Release(&keys);
    if (failed) return Py_BuildValue("nnK", (Py_ssize_t)-1, (Py_ssize_t)0, flags);
    return Py_BuildValue("nnK", host, storage, flags);
}

/* bits(buf, key) -> the bits the table holds for one key (0: none), -1 when its slot stayed
 * locked (tests check a reader never pairs a key with another key's bits). */
static PyObject *kt_bits(PyObject *self, PyObject *args) {
    PyObject *obj, *key;
    uint64_t k0, k1;
    table_t t;
    if (!PyArg_ParseTuple(args, "OS", &obj, &key)) return NULL;
    if (key_words(key, &k0, &k1) < 0) return NULL;
    if (table_open(obj, &t, 0) < 0) return NULL;
    int64_t bits = probe(&t, k0, k1);
    PyBuffer_Release(&t.view);
    return PyLong_FromLongLong(bits);
}

/* bits_of(buf, keys) -> bytes: each key's bits as an int32 (0: absent, -1: its slot stayed
 * locked), keys 16 bytes each back to back: which tiers hold each key, in one call. */
static PyObject *kt_bits_of(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_buffer keys;
    table_t t;
    if (!PyArg_ParseTuple(args, "Oy*", &obj, &keys)) return NULL;
    if (keys.len % 16) {
        PyBuffer_Release(&keys);
        PyErr_SetString(PyExc_ValueError, "keys: 16-byte keys back to back");
        return NULL;
    }
    if (table_open(obj, &t, 0) < 0) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    Py_ssize_t n = keys.len / 16;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out != NULL) {
        int32_t *dst = (int32_t *)PyBytes_AS_STRING(out);
        const char *kp = (const char *)keys.buf;
        for (Py_ssize_t k = 0; k < n; k++) {
            uint64_t k0, k1;
            memcpy(&k0, kp + 16 * k, 8);
            memcpy(&k1, kp + 16 * k + 8, 8);
            dst[k] = (int32_t)probe(&t, k0, k1);
        }
    }
    PyBuffer_Release(&t.view);
    PyBuffer_Release(&keys);
    return out;
}

/* a client's whole lookup (answer), and the table's flags and count */
#include "_keytable_answer.h"

static PyMethodDef methods[] = {
    {"init", kt_init, METH_VARARGS, "init(buf, nslots, epoch, seed, max_count): an empty table"},
    {"update", kt_update, METH_VARARGS,
     "update(buf, key, set_bits, clear_bits[, limit]) -> the key's bits, -1 when full (not added)"},
    {"update_many", kt_update_many, METH_VARARGS,
     "update_many(buf, keys, mask, set_bits, clear_bits[, limit]) -> keys refused"},
    {"clear_bits", kt_clear_bits, METH_VARARGS, "clear_bits(buf, mask) -> keys removed"},
    {"set_flags", kt_set_flags, METH_VARARGS, "set_flags(buf, set, clear) -> flags"},
    {"lookup", kt_lookup, METH_VARARGS,
     "lookup(buf, keys, epoch) -> (host, storage, flags); host -1: ask the daemon"},
    {"count", kt_count, METH_VARARGS, "count(buf) -> (keys, max_count, nslots)"},
    {"answer", kt_answer, METH_VARARGS,
     "answer(table, keys, epoch, status, hang_ns, pidfd) -> (host, storage, packed) or None"},
    {"flags", kt_flags, METH_VARARGS, "flags(buf) -> the table's flags, 0 when it is no table"},
    {"bits", kt_bits, METH_VARARGS, "bits(buf, key) -> the key's bits, 0 if absent, -1 if locked"},
    {"bits_of", kt_bits_of, METH_VARARGS, "bits_of(buf, keys) -> int32 bits per key, as bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_keytable", NULL, -1, methods};

PyMODINIT_FUNC PyInit__keytable(void) { return PyModule_Create(&module); }
