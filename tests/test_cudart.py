"""The host pool's CUDA registration logic (kvcached.cudart) against a fake runtime: pure logic,
the calls themselves run only on a GPU (tests/gpu)."""
import pytest

from kvcached import cudart


class FakeRuntime:
    """Registers what it is asked to unless the size is over `ceiling`; like the real runtime,
    a failure leaves a sticky error until get_last_error() reads it."""

    def __init__(self, ceiling):
        self.ceiling = ceiling
        self.registered = {}
        self.sticky = 0

    def host_register(self, ptr, nbytes, flags):
        if nbytes > self.ceiling:
            self.sticky = 1
            return 1
        self.registered[ptr] = (nbytes, flags)
        return 0

    def host_unregister(self, ptr):
        return 0 if self.registered.pop(ptr, None) else 1

    def host_get_device_pointer(self, ptr):
        assert ptr in self.registered
        return ptr + (1 << 40)  # a device address that is not the host address

    def get_last_error(self):
        err, self.sticky = self.sticky, 0
        return err

    def error_string(self, err):
        return f"cudaErrorInvalidValue ({err})"


def test_the_pool_is_registered_in_one_call():
    rt = FakeRuntime(ceiling=1 << 40)
    cudart.register_all(rt, 4096, 3 << 30, cudart.CUDA_HOST_REGISTER_PORTABLE | cudart.CUDA_HOST_REGISTER_MAPPED)
    assert rt.registered == {4096: (3 << 30, 3)}  # one registration: no copy can span two


def test_a_failed_registration_leaves_nothing_registered_and_no_sticky_error():
    rt = FakeRuntime(ceiling=1 << 30)
    with pytest.raises(RuntimeError, match=r"2\.0 GiB host pool failed: cudaErrorInvalidValue .*--host-cache-gb"):
        cudart.register_all(rt, 4096, 2 << 30, 3)
    assert rt.registered == {} and rt.sticky == 0


def test_zero_copy_takes_the_device_address_the_runtime_gives():
    rt = FakeRuntime(ceiling=1 << 40)
    cudart.register_all(rt, 4096, 1 << 20, 3)
    assert cudart.device_address(rt, 4096) == 4096 + (1 << 40)


def test_without_a_loaded_cuda_runtime_the_binding_says_so():
    if cudart._loaded_cudart_path() is not None:
        pytest.skip("this process has a CUDA runtime loaded")
    with pytest.raises(RuntimeError, match="libcudart is not loaded"):
        cudart.LibCudart()
