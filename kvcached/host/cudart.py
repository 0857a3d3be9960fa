"""The few CUDA runtime calls the host pool needs that torch does not bind: registration with
rollback, the device address of registered memory, and clearing a sticky error.

The calls go to the libcudart that torch has already loaded into this process (found in
/proc/self/maps), so they act on the same runtime and context as torch's own calls; ctypes,
no extra dependency. Ran on an H100 (README "CUDA path"): one registration of the whole pool;
registration in parts has run only against the fake runtime of tests/test_cudart.py.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Protocol

log = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 0x01
CUDA_HOST_REGISTER_MAPPED = 0x02


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
        for name in ("cudaHostRegister", "cudaHostUnregister", "cudaHostGetDevicePointer",
                     "cudaGetLastError"):
            getattr(lib, name).restype = ctypes.c_int

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
