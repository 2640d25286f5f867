"""The one exception type for problems in what the user gave us (data, checkpoint, device, server, command line).

`polyrl` prints a `UserError` as one line, `polyrl: error: <message>`, and exits non-zero; the message names the
file, line, key or URL at fault. Anything else that escapes is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem in the user's input, reported as one `polyrl: error:` line (no traceback)."""
