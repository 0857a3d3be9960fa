/* SIGBUS guard for memory the daemon maps from a client (its CPU KV segments).
 *
 * A client can shrink (ftruncate) a POSIX shared-memory segment the daemon has mapped; the
 * daemon's next access past the new end raises SIGBUS, which would kill it and every engine's
 * cache with it. Python cannot handle a synchronous fault (its handler returns and the access
 * faults again), so the handler lives here.
 *
 * guard(address, length) registers a mapping. When an access inside a guarded mapping faults,
 * the handler replaces the whole mapping with private anonymous pages (MAP_FIXED), counts the
 * fault and returns: the access is retried and succeeds on zero pages. The copy that faulted
 * runs to its end on garbage, and its caller sees faults(slot) > 0 and fails the task instead
 * of keeping what was copied. A fault outside every guarded mapping is handed to the
 * disposition that was in place before install() (faulthandler, or the default: the process
 * dies as it would have).
 *
 * The handler only reads the table and calls mmap(2); the table's fields are atomics written
 * with the GIL held, so guard/unguard never race each other.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_GUARDS 4096

typedef struct {
    _Atomic uintptr_t start;
    _Atomic uintptr_t end; /* 0: the slot is free */
    _Atomic long faults;
} guard_t;

static guard_t guards[MAX_GUARDS];
static struct sigaction previous;
static int installed = 0;

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    (void)context;
    uintptr_t addr = (uintptr_t)info->si_addr;
    if (info->si_code > 0) { /* a real fault, not a kill(2) */
        for (int i = 0; i < MAX_GUARDS; i++) {
            uintptr_t end = atomic_load(&guards[i].end);
            uintptr_t start = atomic_load(&guards[i].start);
            if (end == 0 || addr < start || addr >= end)
                continue;
            void *p = mmap((void *)start, end - start, PROT_READ | PROT_WRITE,
                           MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p != MAP_FAILED) {
                atomic_fetch_add(&guards[i].faults, 1);
                return; /* the access is retried on the anonymous pages */
            }
            break;
        }
    }
    /* not ours: restore what was there before and let it act */
    sigaction(SIGBUS, &previous, NULL);
    if (info->si_code <= 0)
        raise(sig); /* a sent signal is not re-raised by returning */
}

static PyObject *sigbus_install(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    if (installed)
        Py_RETURN_FALSE;
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &previous) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    installed = 1;
    Py_RETURN_TRUE;
}

static PyObject *sigbus_guard(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long address, length;
    if (!PyArg_ParseTuple(args, "KK", &address, &length))
        return NULL;
    long page = sysconf(_SC_PAGESIZE);
    if (length == 0 || address % (unsigned long long)page != 0) {
        PyErr_SetString(PyExc_ValueError, "guard: expected a page-aligned address and a length > 0");
        return NULL;
    }
    uintptr_t end = (uintptr_t)(address + (length + page - 1) / page * page);
    for (int i = 0; i < MAX_GUARDS; i++) {
        if (atomic_load(&guards[i].end) != 0)
            continue;
        atomic_store(&guards[i].faults, 0);
        atomic_store(&guards[i].start, (uintptr_t)address);
        atomic_store(&guards[i].end, end); /* last: the slot is live from here */
        return PyLong_FromLong(i);
    }
    PyErr_SetString(PyExc_RuntimeError, "guard: every SIGBUS guard slot is in use");
    return NULL;
}

static int slot_arg(PyObject *args, int *slot)
{
    if (!PyArg_ParseTuple(args, "i", slot))
        return -1;
    if (*slot < 0 || *slot >= MAX_GUARDS) {
        PyErr_SetString(PyExc_ValueError, "no such guard slot");
        return -1;
    }
    return 0;
}

static PyObject *sigbus_faults(PyObject *self, PyObject *args)
{
    (void)self;
    int slot;
    if (slot_arg(args, &slot) < 0)
        return NULL;
    return PyLong_FromLong(atomic_load(&guards[slot].faults));
}

static PyObject *sigbus_unguard(PyObject *self, PyObject *args)
{
    (void)self;
    int slot;
    if (slot_arg(args, &slot) < 0)
        return NULL;
    atomic_store(&guards[slot].end, 0); /* first: the handler stops matching it */
    atomic_store(&guards[slot].start, 0);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"install", sigbus_install, METH_NOARGS,
     "Install the SIGBUS handler (once per process); True if this call installed it."},
    {"guard", sigbus_guard, METH_VARARGS,
     "guard(address, length) -> slot: faults inside the mapping are absorbed and counted."},
    {"faults", sigbus_faults, METH_VARARGS, "faults(slot) -> faults absorbed in that mapping."},
    {"unguard", sigbus_unguard, METH_VARARGS, "unguard(slot): stop guarding (before munmap)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sigbus",
    "SIGBUS guard for client memory mapped into the daemon (see _sigbus.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__sigbus(void) { return PyModule_Create(&module); }
