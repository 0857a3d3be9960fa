/* Included by _keytable.c (one compilation unit: its layout, table_open and count_prefix): a
 * client's whole lookup in one call (answer), and the table's flags and count. */
#define F_OPEN 1
#define F_HOST_COMPLETE 2
#define F_NO_STORAGE 4
#define F_STORAGE_COMPLETE 8
#define F_STORAGE_REMOTE 16
/* the status block (kvcached_proto.shm_layout): heartbeat u64 at 32, flags u32 at 40, bit 0 up */
#define S_HEARTBEAT 32
#define S_FLAGS 40
#define S_BYTES 48

static int daemon_alive(PyObject *status_obj, unsigned long long hang_ns, int pidfd) {
    Py_buffer sv;
    if (PyObject_GetBuffer(status_obj, &sv, PyBUF_SIMPLE) < 0) return -1;
    int alive = 0;
    if (sv.len >= S_BYTES) {
        const char *sb = (const char *)sv.buf;
        uint32_t flags = LOAD((const uint32_t *)(sb + S_FLAGS), __ATOMIC_ACQUIRE);
        uint64_t beat = LOAD((const uint64_t *)(sb + S_HEARTBEAT), __ATOMIC_ACQUIRE);
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t now = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
        alive = (flags & 1) && (now < beat || now - beat <= hang_ns);
        if (alive && pidfd >= 0) {
            struct pollfd p = {pidfd, POLLIN, 0};
            alive = poll(&p, 1, 0) == 0; /* readable: the daemon exited */
        }
    }
    PyBuffer_Release(&sv);
    return alive;
}

/* The keys as one bytes object of 16-byte keys: `keys` itself when it is bytes, else a list or
 * tuple of 16-byte bytes joined; NULL without an exception when an item is not (the caller's
 * message path reports it). */
static PyObject *packed_keys(PyObject *keys) {
    if (PyBytes_Check(keys)) {
        if (PyBytes_GET_SIZE(keys) % 16) return NULL;
        Py_INCREF(keys);
        return keys;
    }
    if (!PyList_Check(keys) && !PyTuple_Check(keys)) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 16);
    if (out == NULL) {
        PyErr_Clear();
        return NULL;
    }
    char *dst = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_Check(items[i]) || PyBytes_GET_SIZE(items[i]) != 16) {
            Py_DECREF(out);
            return NULL;
        }
        memcpy(dst + 16 * i, PyBytes_AS_STRING(items[i]), 16);
    }
    return out;
}

/* answer(table, keys, epoch, status, hang_ns, pidfd) -> (host, storage, packed) or None.
 *
 * A client's lookup in one call: None means "send the lookup op" - the daemon is not up, has not
 * beaten within hang_ns or has exited (pidfd readable; -1: no pidfd), the keys are no list of
 * 16-byte keys, the table is another daemon's or closed (flags say so to the caller through
 * `state`), a slot stayed locked, or the table cannot answer this question: a miss in a table
 * that could not take every host key, or a storage run it does not fully know (a tier not
 * answering now, or one it does not cover and the run stops short). `packed`: the keys as one
 * bytes object. */
static PyObject *kt_answer(PyObject *self, PyObject *args) {
    PyObject *obj, *keys_obj, *status_obj;
    unsigned long long epoch, hang_ns;
    int pidfd;
    if (!PyArg_ParseTuple(args, "OOKOKi", &obj, &keys_obj, &epoch, &status_obj, &hang_ns, &pidfd))
        return NULL;
    int alive = daemon_alive(status_obj, hang_ns, pidfd);
    if (alive < 0) return NULL;
    if (!alive) Py_RETURN_NONE;
    PyObject *packed = packed_keys(keys_obj);
    if (packed == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    table_t t;
    if (table_open(obj, &t, 0) < 0) {
        Py_DECREF(packed);
        return NULL;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(packed) / 16, host, storage;
    int failed;
    uint64_t flags = count_prefix(&t, PyBytes_AS_STRING(packed), n, epoch, &host, &storage, &failed);
    PyBuffer_Release(&t.view);
    if (!(flags & F_OPEN) || failed) goto ask;
    if (host < n) {
        if (!(flags & F_HOST_COMPLETE)) goto ask;
        if (flags & F_NO_STORAGE) storage = 0;
        else if (!(flags & F_STORAGE_COMPLETE) || (host + storage < n && (flags & F_STORAGE_REMOTE)))
            goto ask;
    }
    PyObject *r = Py_BuildValue("nnN", host, storage, packed);
    return r;
ask:
    Py_DECREF(packed);
    Py_RETURN_NONE;
}

/* open_flags(buf) -> the table's flags (0 when it is not a table). */
static PyObject *kt_flags(PyObject *self, PyObject *args) {
    PyObject *obj;
    table_t t;
    if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
    if (table_open(obj, &t, 0) < 0) {
        PyErr_Clear();
        return PyLong_FromLong(0);
    }
    uint64_t flags = LOAD(hword(t.base, H_FLAGS), __ATOMIC_ACQUIRE);
    PyBuffer_Release(&t.view);
    return PyLong_FromUnsignedLongLong(flags);
}

/* count(buf) -> (keys held, max_count, nslots) */
static PyObject *kt_count(PyObject *self, PyObject *args) {
    PyObject *obj;
    table_t t;
    if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
    if (table_open(obj, &t, 0) < 0) return NULL;
    PyObject *r = Py_BuildValue("KKK", (unsigned long long)LOAD(hword(t.base, H_COUNT), __ATOMIC_RELAXED),
                                (unsigned long long)*hword(t.base, H_MAX_COUNT),
                                (unsigned long long)t.nslots);
    PyBuffer_Release(&t.view);
    return r;
}
