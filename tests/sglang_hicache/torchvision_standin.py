"""The one stand-in of the SGLang tests, for the import only (sglang_pools.py installs it first): `sglang.srt.mem_cache.pool_host` reaches SGLang's model
configs at import time, and some of those import torchvision (for multimodal preprocessing that
these tests never run). PyPI's torchvision does not load beside the CPU torch the project pins,
so where SGLang is installed and torchvision is not, `import torchvision` gets an empty module
whose attributes are inert placeholders. Nothing of SGLang's host pools, storage interface or
backend factory touches it; with a real torchvision installed the stand-in is not used.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _Inert:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __getattr__(self, name):
        return _Inert()

    def __mro_entries__(self, bases):
        return (object,)


class _StandIn(types.ModuleType):
    __version__ = "0.0.0"  # transformers then takes its PIL image processors, not torchvision's

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandIn(spec.name)

    def exec_module(self, module):
        module.__path__ = []
        module.__file__ = "<kvcached tests: torchvision stand-in>"


def install() -> None:
    if importlib.util.find_spec("torchvision") is None and not any(
            isinstance(f, _TorchvisionStandIn) for f in sys.meta_path):
        sys.meta_path.append(_TorchvisionStandIn())
