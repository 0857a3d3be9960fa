"""Earlier names of public attributes: they still work and warn (DeprecationWarning), so code
written against them goes on running while it moves to the new name."""
from __future__ import annotations

import warnings


class Renamed:
    """`old = Renamed("new")` in a class body: reading `obj.old` warns and gives `obj.new` (a
    bound method for a method, the value for a property or an attribute)."""

    def __init__(self, new: str):
        self.new = new
        self.old = self.owner = ""

    def __set_name__(self, owner, name: str) -> None:
        self.owner, self.old = owner.__name__, name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        warnings.warn(f"{self.owner}.{self.old} is {self.owner}.{self.new} now", DeprecationWarning,
                      stacklevel=2)
        return getattr(obj, self.new)
