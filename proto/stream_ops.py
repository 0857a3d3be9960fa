"""CUDA stream memory operations over the driver library (ctypes; no CUDA Python package needed),
used by both sides on the order words (order_words.py).

`StreamOps` registers a host mapping with CUDA and queues waits and writes on a stream. Call it
after torch has made the device's primary context current on the calling thread (any torch
CUDA call on that device, or `torch.cuda.device(...)`). Stream handles are `stream.cuda_stream`.
Written with no GPU in CI: the tests with a GPU are tests/gpu.
"""
from __future__ import annotations

import ctypes
import threading

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int64)(*addr - value) >= 0
WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory barrier before the write
REGISTER_PORTABLE_DEVICEMAP = 0x01 | 0x02

_lib = None
_lib_lock = threading.Lock()


def _driver():
    global _lib
    with _lib_lock:
        if _lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            for name in ("cuStreamWaitValue64_v2", "cuStreamWriteValue64_v2"):
                fn = getattr(lib, name)
                fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
                fn.restype = ctypes.c_int
            lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
            lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                         ctypes.c_void_p, ctypes.c_uint]
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            for name in ("cuMemHostRegister_v2", "cuMemHostUnregister",
                         "cuMemHostGetDevicePointer_v2", "cuGetErrorString"):
                getattr(lib, name).restype = ctypes.c_int
            _lib = lib
        return _lib


class StreamOpsError(RuntimeError):
    pass


def _check(lib, err: int, what: str) -> None:
    if err != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(err, ctypes.byref(text))
        raise StreamOpsError(f"{what} failed: CUDA error {err} "
                             f"({(text.value or b'?').decode(errors='replace')})")


class StreamOps:
    """One registered host mapping (page-aligned) and the stream operations on its words."""

    def __init__(self, host_addr: int, nbytes: int):
        self._lib = _driver()
        self.host_addr, self.nbytes = host_addr, nbytes
        _check(self._lib, self._lib.cuMemHostRegister_v2(ctypes.c_void_p(host_addr), nbytes,
                                                         REGISTER_PORTABLE_DEVICEMAP),
               "cuMemHostRegister of the order words")
        try:
            out = ctypes.c_uint64()
            _check(self._lib, self._lib.cuMemHostGetDevicePointer_v2(
                ctypes.byref(out), ctypes.c_void_p(host_addr), 0), "cuMemHostGetDevicePointer")
        except BaseException:
            self._lib.cuMemHostUnregister(ctypes.c_void_p(host_addr))
            raise
        self.dev_addr = out.value
        self.registered = True

    def wait_geq(self, stream_handle: int, word: int, value: int) -> None:
        """Queue on the stream: wait until word `word` >= value (the GEQ rule)."""
        _check(self._lib, self._lib.cuStreamWaitValue64_v2(
            ctypes.c_void_p(stream_handle), self.dev_addr + 8 * word, value, WAIT_GEQ),
            "cuStreamWaitValue64")

    def write(self, stream_handle: int, word: int, value: int) -> None:
        """Queue on the stream: write value into word `word` once the work before it is done."""
        _check(self._lib, self._lib.cuStreamWriteValue64_v2(
            ctypes.c_void_p(stream_handle), self.dev_addr + 8 * word, value, WRITE_DEFAULT),
            "cuStreamWriteValue64")

    def unregister(self) -> None:
        if self.registered:
            self.registered = False
            self._lib.cuMemHostUnregister(ctypes.c_void_p(self.host_addr))
