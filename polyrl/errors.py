"""The one exception type for problems in what the user gave us (data, checkpoint, device, server, command line).

`polyrl` prints a `UserError` as one line, `polyrl: error: <message>`, and exits non-zero; the message names the
file, line, key or URL at fault. Anything else that escapes is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem in the user's input, reported as one `polyrl: error:` line (no traceback)."""


def missing_extra(what: str, extra: str, packages: str) -> UserError:
    """The `polyrl: error:` line for an optional dependency that is not installed: what needs it, and the extra of
    pyproject.toml that installs it (the core install leaves it out; docs/install.md)."""
    return UserError(f"{what} needs polyrl's `{extra}` extra ({packages}), which is not installed: "
                     f"pip install 'polyrl[{extra}]' (from a clone: pip install -e '.[{extra}]')")
