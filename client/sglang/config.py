"""What the SGLang backend reads from `--hicache-storage-backend-extra-config`, and the keys it
holds SGLang's pages under.

SGLang's own keys: `backend_name`, `module_path`, `class_name`, `interface_v1` (must be 1: the
zero-copy batch_get_v1/batch_set_v1 calls, the only ones that page the host pool in place) and
`allocator` (must be "shm": the host pool in memfds, which the daemon maps). kvcached's:

| key | default | meaning |
|---|---|---|
| instance | "default" | the daemon; `{rank}`, `{dp_rank}`, `{pp_rank}` are filled in (one daemon may serve every rank's pool) |
| instances | - | the daemons by tensor-parallel rank (instead of instance) |
| run_dir | the CLI's | the daemons' run dir |
| timeout_s | 5.0 | how long one call waits for the daemon |
| hang_s | $KVCACHED_HANG_S or 2 | heartbeat gap after which the daemon counts as hung |
| namespace | "" | a tenant salt: other salts share nothing |
| weights_version | the checkpoint's identity | a new one voids the cache (weight updates) |
| pool_instances | `{instance}-{pool}` | a hybrid model's side pools' daemons, by pool (`{"mamba": "m{rank}"}`); `{rank}` and the like are filled in |

SGLang's own weight version (`--weight-version`, changed by a weight update that names one:
`update_weights_from_disk/_tensor/_distributed` with `weight_version`) is part of the keys too,
read at every call: pages stored under one version are never matched under another.

A page's key is a 16-byte digest of the namespace - model, the pool's geometry (layout, page
size, layers, heads, dtype), tensor-parallel rank and size (not for MLA, whose KV is the same on
every rank), pipeline and context-parallel shard, what of SGLang's server args computes other KV
from the same checkpoint (`--dtype`, `--quantization`, `--revision`, `--json-model-override-args`,
`--load-format`, `--modelopt-quant`, `--quantization-param-path` and the like, where set) - and
SGLang's page hash (already chained over the prefix), so two SGLang servers of
one model, args and layout share pages through the daemon's tiers, and a restarted one finds its
prefixes.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

from ..extra_keys import unknown_keys
from ..hashing import make_namespace, path_identity, short_digest, weights_identity

log = logging.getLogger("kvcached.sglang")
EXTRA_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "allocator", "instance",
              "instances", "run_dir", "timeout_s", "hang_s", "namespace", "weights_version",
              "pool_instances")


class ConfigError(ValueError):
    """The extra-config asks for what the backend cannot do; the message names the key."""


def _rank_instance(extra: dict, cfg) -> str:
    if "instances" in extra:
        instances = [str(i) for i in extra["instances"]]
        if len(instances) != cfg.tp_size:
            raise ConfigError(f"extra-config 'instances' lists {len(instances)} daemons for "
                              f"tp_size {cfg.tp_size}: one per rank")
        return instances[cfg.tp_rank]
    return _ranked(str(extra.get("instance", "default")), cfg)  # one daemon may serve every rank's pool


def _ranked(instance: str, cfg) -> str:
    return (instance.replace("{rank}", str(cfg.tp_rank))
            .replace("{dp_rank}", str(getattr(cfg, "dp_rank", 0)))
            .replace("{pp_rank}", str(cfg.pp_rank)))


def _pool_instances(extra: dict, cfg) -> dict[str, str]:
    named = extra.get("pool_instances", {})
    if not isinstance(named, dict) or not all(isinstance(v, str) for v in named.values()):
        raise ConfigError("extra-config pool_instances maps a side pool's name to its daemon's "
                          "instance, e.g. {\"mamba\": \"sglang{rank}-mamba\"}")
    return {str(k): _ranked(v, cfg) for k, v in named.items()}


@dataclass
class Settings:
    instance: str
    run_dir: str | None
    timeout_s: float
    hang_s: float | None
    tenant: str
    weights_version: str
    pool_instances: dict  # a side pool's daemon by pool name, where the extra-config names one

    def pool_instance(self, name: str) -> str:
        """The daemon of a hybrid model's side pool `name` (a daemon takes one page geometry)."""
        return self.pool_instances.get(name, f"{self.instance}-{name}")

    @classmethod
    def of(cls, cfg) -> "Settings":
        """From SGLang's HiCacheStorageConfig; ConfigError names the key that is wrong."""
        extra = dict(cfg.extra_config or {})
        for message in unknown_keys(extra, EXTRA_KEYS, all_unknown=False):  # SGLang reads
            log.warning("[sglang] %s", message)  # this extra-config too: near misses only
        if not bool(extra.get("interface_v1", 0)):  # as SGLang reads it
            raise ConfigError("kvcached pages SGLang's host pool in place: add \"interface_v1\": 1 "
                              "to --hicache-storage-backend-extra-config")
        if extra.get("allocator") != "shm":
            raise ConfigError("kvcached maps SGLang's host pool: add \"allocator\": \"shm\" to "
                              "--hicache-storage-backend-extra-config")
        try:
            timeout = float(extra.get("timeout_s", 5.0))
            hang = float(extra["hang_s"]) if "hang_s" in extra else None
        except (TypeError, ValueError):
            raise ConfigError("extra-config timeout_s and hang_s are seconds (numbers)") from None
        if not timeout > 0:
            raise ConfigError("extra-config timeout_s must be > 0")
        model = cfg.model_name or ""
        weights = str(extra.get("weights_version", "")) or weights_identity(model)
        return cls(_rank_instance(extra, cfg), extra.get("run_dir"), timeout, hang,
                   str(extra.get("namespace", "")), weights, _pool_instances(extra, cfg))


_get_serving = None


def sglang_weight_version() -> str | None:
    """SGLang's weight version now (its `--weight-version`, "default" unless set, changed by a
    weight update that names one), or None where this SGLang has none to read."""
    global _get_serving
    try:
        if _get_serving is None:
            from sglang.srt.runtime_context import get_serving
            _get_serving = get_serving
        return str(_get_serving().weight_version)
    except Exception:  # another SGLang, or its config not published (no server)
        return None


def sglang_model_factors() -> str:
    """What of SGLang's server args makes other KV from the same checkpoint: the compute dtype,
    weights quantized at load (`--quantization`, `--modelopt-quant`, a restored ModelOpt
    checkpoint, a FlashRL profile), weights loaded otherwise (`--load-format` other than auto:
    `dummy` weights are random), a hub revision, config overrides (as their digest) and fp8 KV
    scales from a file (`--quantization-param-path`), a speculative drafter (its algorithm and
    checkpoint: SGLang's HiCache may carry its layers in the target's pages), and the files of
    the local `--lora-paths` adapters (SGLang keys their pages by name and path alone, the same
    at every start: an adapter retrained where it was would be served the old one's pages).
    A file or directory counts by its path, size and modification time, read once per process.
    "" where each is SGLang's default, or where no server args are published (no server)."""
    try:
        from sglang.srt.runtime_context import get_context

        args = get_context().server_args
    except Exception:
        return ""
    out = ""
    for name, default in (("dtype", "auto"), ("quantization", None), ("revision", None),
                          ("load_format", "auto"), ("modelopt_quant", None)):
        value = getattr(args, name, default)
        if value not in (default, None, ""):
            out += f"|{name}:{value}"
    overrides = getattr(args, "json_model_override_args", "{}") or "{}"
    if overrides.strip() not in ("", "{}"):
        out += "|override:" + short_digest(overrides)
    for name in ("quantization_param_path", "modelopt_checkpoint_restore_path", "rl_quant_profile"):
        path = getattr(args, name, None)
        if path:
            out += f"|{name}:" + short_digest(f"{path}|{path_identity(str(path))}")
    out += _lora_factor(getattr(args, "lora_paths", None))
    draft = getattr(args, "speculative_draft_model_path", None)
    if getattr(args, "speculative_algorithm", None) and draft:  # its layers may ride in the pages
        revision = getattr(args, "speculative_draft_model_revision", None)
        out += "|draft:" + short_digest("\0".join((
            str(args.speculative_algorithm), str(draft),
            path_identity(str(draft)) or weights_identity(str(draft), revision),
            str(getattr(args, "speculative_draft_model_quantization", None)))))
    return out


def _lora_factor(lora_paths) -> str:
    """The files of the `--lora-paths` adapters that are local directories (as given: "name=path"
    or a path, a dict, or SGLang's parsed LoRARef). Adapters loaded at run time need none: SGLang
    gives each load an id of its own."""
    idents = []
    for item in lora_paths or ():
        if isinstance(item, str):
            name, _, path = item.partition("=") if "=" in item else (item, "", item)
        elif isinstance(item, dict):
            name, path = str(item.get("lora_name", "")), str(item.get("lora_path", ""))
        else:
            name, path = str(getattr(item, "lora_name", "")), str(getattr(item, "lora_path", ""))
        ident = path_identity(path) if path else ""
        if ident.startswith("files:"):
            idents.append(f"{name}\0{path}\0{ident}")
    return "|lora:" + short_digest("\n".join(sorted(idents))) if idents else ""


class PageKeys:
    """SGLang page hashes -> the daemon's 16-byte keys, under one namespace (with SGLang's
    weight version `version`; its launch default adds nothing, so keys stay as they were)."""

    def __init__(self, cfg, settings: Settings, kv_layout: str, version: str | None = None,
                 salt: str = "", replicated: bool | None = None):
        """`replicated`: the pool holds the same bytes on every tensor-parallel rank, so its
        keys name no rank (default: an MLA model's, as SGLang's MLA KV)."""
        mla = bool(cfg.is_mla_model) if replicated is None else replicated
        shard = (f"pp{cfg.pp_rank}/{cfg.pp_size}|cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}|"
                 f"dcp{getattr(cfg, 'dcp_rank', 0)}/{getattr(cfg, 'dcp_size', 1)}")
        self.version = version
        weights = settings.weights_version
        if version not in (None, "default"):
            weights += f"|sglang-weight-version:{version}"
        if salt:  # a storage flush that could not reach the daemon, a weight update that kept
            # the version (weight_updates.py)
            weights += f"|reset:{salt}"
        self.namespace = make_namespace(
            cfg.model_name or "", "", f"sglang-hicache|{kv_layout}|{shard}{sglang_model_factors()}",
            0 if mla else cfg.tp_rank, 1 if mla else cfg.tp_size,
            tenant=settings.tenant, weights_version=weights)
        self._base = hashlib.blake2b(self.namespace.encode() + b"\0", digest_size=16)

    def __call__(self, page_hashes) -> list[bytes]:
        out = []
        for h in page_hashes:
            d = self._base.copy()
            d.update(str(h).encode())
            out.append(d.digest())
        return out
