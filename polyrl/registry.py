"""Name -> class registries: a new model, reward or algorithm is a new file plus one `@register(...)`."""

from __future__ import annotations

from typing import Any


class Registry(dict):
    def __init__(self, group: str):
        super().__init__()
        self.group = group

    def register(self, name: str):
        def wrap(cls):
            self[name] = cls
            return cls

        return wrap

    def build(self, name: str, *args: Any, **kwargs: Any):
        if name not in self:
            raise ValueError(f"{self.group}.name={name!r} is not registered; allowed: {', '.join(sorted(self))}")
        return self[name](*args, **kwargs)
