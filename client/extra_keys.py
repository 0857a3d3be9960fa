"""Engine extra-config keys that kvcached does not read: a typo ("namespce") would otherwise be
silently ignored, and its default taken (for `namespace`, no tenant salt: tenants would share)."""
from __future__ import annotations

import difflib
from typing import Iterable


def unknown_keys(extra: dict, known: Iterable[str], all_unknown: bool = True) -> list[str]:
    """One message per key of `extra` that is not in `known`, naming the closest known key.
    `all_unknown=False` (an extra-config the engine reads too): only keys close to a known one."""
    known = sorted(set(known))
    out = []
    for key in sorted(str(k) for k in extra if k not in known):
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
        if close or all_unknown:
            hint = f"; did you mean {close[0]!r}?" if close else f" (kvcached reads {', '.join(known)})"
            out.append(f"extra-config key {key!r} is not read by kvcached{hint}")
    return out
