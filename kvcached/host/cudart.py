"""The few CUDA runtime calls the daemon needs that torch does not bind: host registration with
rollback, the device address of registered memory, clearing a sticky error, and the copy-engine
strategy's copies (cudaMemcpyAsync, cudaMemcpyBatchAsync: kvcached/copy/dma.py).

The calls go to the libcudart that torch has already loaded into this process (found in
/proc/self/maps), so they act on the same runtime and context as torch's own calls; ctypes,
no extra dependency. Ran on an H100 (docs/cuda.md): one registration of the whole pool;
registration in parts has run only against the fake runtime of tests/test_cudart.py.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Protocol

log = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 0x01
CUDA_HOST_REGISTER_MAPPED = 0x02
CUDA_MEMCPY_DEFAULT = 4  # the direction from the pointers (unified addressing)
SRC_ACCESS_ORDER_STREAM = 0x1  # cudaMemcpySrcAccessOrderStream
PREFER_OVERLAP_WITH_COMPUTE = 0x1  # cudaMemcpyFlagPreferOverlapWithCompute
BATCH_SINCE = 12080  # cudaMemcpyBatchAsync: CUDA 12.8 (with a failIdx argument until 13.0)


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", MemLocation),
                ("dstLocHint", MemLocation), ("flags", ctypes.c_uint)]


class Runtime(Protocol):
    def host_register(self, ptr: int, nbytes: int, flags: int) -> int: ...
    def host_unregister(self, ptr: int) -> int: ...
    def host_get_device_pointer(self, ptr: int) -> int: ...
    def get_last_error(self) -> int: ...
    def error_string(self, err: int) -> str: ...


def _loaded_cudart_path() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if line.count(" ") >= 5 else ""
                if "/libcudart.so" in path:
                    return path
    except OSError:
        return None
    return None


class LibCudart:
    """ctypes over the process's libcudart (call after torch has initialised CUDA)."""

    def __init__(self, path: str | None = None):
        path = path or _loaded_cudart_path()
        if path is None:
            raise RuntimeError("libcudart is not loaded in this process (torch has not "
                               "initialised CUDA, or links the runtime statically)")
        self.path = path
        self._lib = lib = ctypes.CDLL(path)
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                                 ctypes.c_uint]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_int, ctypes.c_void_p]
        for name in ("cudaHostRegister", "cudaHostUnregister", "cudaHostGetDevicePointer",
                     "cudaGetLastError", "cudaMemcpyAsync", "cudaRuntimeGetVersion"):
            getattr(lib, name).restype = ctypes.c_int
        version = ctypes.c_int(0)
        lib.cudaRuntimeGetVersion(ctypes.byref(version))
        self.version = version.value
        self._batch = getattr(lib, "cudaMemcpyBatchAsync", None) if self.version >= BATCH_SINCE else None
        if self._batch is not None:
            self._batch.restype = ctypes.c_int
            self._attrs = MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, MemLocation(), MemLocation(),
                                           PREFER_OVERLAP_WITH_COMPUTE)

    def host_register(self, ptr: int, nbytes: int, flags: int) -> int:
        return self._lib.cudaHostRegister(ctypes.c_void_p(ptr), nbytes, flags)

    def host_unregister(self, ptr: int) -> int:
        return self._lib.cudaHostUnregister(ctypes.c_void_p(ptr))

    def host_get_device_pointer(self, ptr: int) -> int:
        out = ctypes.c_void_p()
        err = self._lib.cudaHostGetDevicePointer(ctypes.byref(out), ctypes.c_void_p(ptr), 0)
        if err:
            self.get_last_error()
            raise RuntimeError(f"cudaHostGetDevicePointer failed: {self.error_string(err)}")
        return out.value or 0

    def get_last_error(self) -> int:
        return self._lib.cudaGetLastError()

    def has_memcpy_batch(self) -> bool:
        return self._batch is not None

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        err = self._lib.cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src), nbytes,
                                        CUDA_MEMCPY_DEFAULT, ctypes.c_void_p(stream))
        if err:
            self._raise("cudaMemcpyAsync", err)

    def memcpy_batch_async(self, dsts, srcs, sizes, stream: int) -> None:
        """dsts, srcs, sizes: contiguous uint64 numpy arrays, read during the call."""
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
        attr_index = ctypes.c_size_t(0)
        args = [ptr(dsts), ptr(srcs), ptr(sizes), ctypes.c_size_t(len(sizes)),
                ctypes.byref(self._attrs), ctypes.byref(attr_index), ctypes.c_size_t(1)]
        fail = ctypes.c_size_t(0)
        if self.version < 13000:
            args.append(ctypes.byref(fail))
        err = self._batch(*args, ctypes.c_void_p(stream))
        if err:
            self._raise(f"cudaMemcpyBatchAsync of {len(sizes)} copies (failed at {fail.value})", err)

    def _raise(self, what: str, err: int) -> None:
        self.get_last_error()  # clear it: it would surface at an unrelated later call
        raise RuntimeError(f"{what}: {self.error_string(err)}")

    def error_string(self, err: int) -> str:
        return f"{(self._lib.cudaGetErrorString(err) or b'?').decode()} ({err})"


def register_all(rt: Runtime, ptr: int, nbytes: int, flags: int) -> None:
    """Register [ptr, ptr + nbytes) in one call, so that no copy can span two registrations.
    On failure nothing stays registered, the runtime's error is cleared (it would otherwise
    surface at an unrelated later call) and the message says what to change."""
    err = rt.host_register(ptr, nbytes, flags)
    if err == 0:
        return
    rt.get_last_error()  # clear the sticky error
    raise RuntimeError(
        f"cudaHostRegister of the {nbytes / 2**30:.1f} GiB host pool failed: "
        f"{rt.error_string(err)}; nothing is left registered. Lower --host-cache-gb, or raise "
        "the locked-memory limit (ulimit -l / the container's memlock)")


def register_parts(rt: Runtime, ptr: int, parts: list[tuple[int, int]], flags: int) -> str:
    """Register each (offset, size) part; on the first failure unregister the parts already
    registered, clear the error and return what failed ("" when every part is registered)."""
    done: list[int] = []
    for offset, size in parts:
        err = rt.host_register(ptr + offset, size, flags)
        if err:
            rt.get_last_error()
            for off in reversed(done):
                rt.host_unregister(ptr + off)
            rt.get_last_error()
            return f"part at {offset / 2**30:.1f} GiB of {size / 2**30:.1f} GiB: {rt.error_string(err)}"
        done.append(offset)
    return ""


def device_address(rt: Runtime, ptr: int) -> int:
    """The device address of registered host memory (equal to ptr only where the device can
    use host pointers for registered memory)."""
    return rt.host_get_device_pointer(ptr)
