"""Where a daemon's configuration comes from: defaults < TOML file < KVCACHED_* environment
variables < command-line flags. Every key is a DaemonConfig field; unknown keys and values of
the wrong type are rejected with a message that names them and where they came from.

    # kvcached.toml
    instance = "gpu0"
    device = "cuda:0"
    host_cache_gb = 64
    storage = ["disk:///var/cache/kvcached?capacity_gb=500"]

Environment: KVCACHED_HOST_CACHE_GB=64, KVCACHED_STORAGE="disk:///a,redis://r:6379/0" (lists
are comma-separated; a Sentinel URI keeps its own commas), KVCACHED_STORAGE_WRITER=false. A
KVCACHED_* variable that names no key, and is none of those the scripts and tests read
(NON_CONFIG_ENV), is warned about at start.
"""
from __future__ import annotations

import dataclasses
import os
import re
import typing
from typing import Any, Mapping

from .config import DaemonConfig
from .errors import StartupError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ENV_PREFIX = "KVCACHED_"
# read by the scripts and tests, not by the daemon's configuration
NON_CONFIG_ENV = ("KVCACHED_INSTANCE", "KVCACHED_DISK", "KVCACHED_VENV", "KVCACHED_VLLM_VENV",
                  "KVCACHED_VLLM_VERSION", "KVCACHED_SOAK_OPS", "KVCACHED_SOAK_SEED", "KVCACHED_LOG_DIR",
                  "KVCACHED_HANG_S")
_HINTS = typing.get_type_hints(DaemonConfig)
_TYPES = {f.name: _HINTS[f.name] for f in dataclasses.fields(DaemonConfig)}
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _coerce(key: str, value: Any, source: str) -> Any:
    hint = _HINTS[key]
    where = f"{source}: {key}"
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise StartupError(f"{where} = {value!r}: expected true or false")
    if hint is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise StartupError(f"{where} = {value!r}: expected an integer")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise StartupError(f"{where} = {value!r}: expected an integer") from None
    if hint is float:
        if isinstance(value, bool):
            raise StartupError(f"{where} = {value!r}: expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise StartupError(f"{where} = {value!r}: expected a number") from None
    if hint is str:
        if not isinstance(value, str):
            raise StartupError(f"{where} = {value!r}: expected a string")
        return value
    if hint == list[str]:
        if isinstance(value, str):
            return split_list(value)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise StartupError(f"{where} = {value!r}: expected a list of strings")
    raise AssertionError(f"no coercion for {key}: {hint}")


def split_list(value: str) -> list[str]:
    """A comma-separated list of an environment variable. A URI may hold commas (a Sentinel
    tier's hosts, `redis+sentinel://h1:26379,h2:26379/0?service=m`): a piece with no scheme
    after one with one goes on that URI."""
    out: list[str] = []
    for piece in (v.strip() for v in value.split(",")):
        if out and piece and "://" in out[-1] and not _SCHEME.match(piece):
            out[-1] += "," + piece
        elif piece:
            out.append(piece)
    return out


def from_file(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise StartupError(f"--config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise StartupError(f"--config {path}: not valid TOML ({exc})") from None
    except UnicodeDecodeError:
        raise StartupError(f"--config {path}: not a text file (TOML is UTF-8)") from None
    unknown = sorted(set(data) - set(_TYPES))
    if unknown:
        raise StartupError(f"--config {path}: unknown key(s) {', '.join(unknown)}; "
                           f"known: {', '.join(sorted(_TYPES))}")
    return {k: _coerce(k, v, path) for k, v in data.items()}


def known_env_names() -> set[str]:
    return {ENV_PREFIX + k.upper() for k in _TYPES} | set(NON_CONFIG_ENV)


def from_env(environ: Mapping[str, str]) -> dict:
    out = {}
    for name, value in environ.items():
        if name.startswith(ENV_PREFIX):
            key = name[len(ENV_PREFIX):].lower()
            if key in _TYPES:
                out[key] = _coerce(key, value, name)
    return out


def resolve(flags: Mapping[str, Any], config_file: str | None = None,
            environ: Mapping[str, str] | None = None) -> DaemonConfig:
    """Merge the sources (flags win) and validate the result."""
    merged: dict[str, Any] = {}
    if config_file:
        merged.update(from_file(config_file))
    merged.update(from_env(os.environ if environ is None else environ))
    merged.update({k: v for k, v in flags.items() if k in _TYPES})
    return DaemonConfig(**merged).validate()
