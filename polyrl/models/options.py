"""`model.options`: model-specific keys whose defaults are the model class's `options` (config validation checks the
names before anything loads, config/schema.py; each model reads the values with `read_options`)."""

from __future__ import annotations

from ..errors import UserError


def read_options(defaults: dict, given: dict) -> dict:
    """`model.options` over `defaults`, each value of its default's type (numbers, strings, booleans; a number or null
    where the default is null); a bad value is a UserError naming its key."""
    out = dict(defaults)
    for key, value in given.items():
        default = defaults[key]
        try:
            if isinstance(default, str | bool):
                if not isinstance(value, type(default)):
                    raise TypeError
                out[key] = value
            elif value is None and default is None:
                out[key] = None
            else:
                out[key] = float(value)
        except (TypeError, ValueError):
            raise UserError(f"model.options.{key}={value!r} is not valid (default: {default!r})") from None
    return out
