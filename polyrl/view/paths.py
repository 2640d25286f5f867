"""Which files `polyrl view` may serve: only regular files of a few kinds under the directories it was given.

A request names a file as `<root index>/<path under that root>`, percent-decoded once. It is refused when any part
of the path is empty, `.` or `..`, holds a backslash or a NUL, or when the file's real path (symbolic links
resolved) is not under the root's real path; so `..`, its encoded forms (`%2e%2e`, `..%2f`) and links that point out
of the root all fail, while a doubly encoded `%252e%252e` is only a strange name that does not exist.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote

# what a run directory holds that a page shows; checkpoints, optimizer states and the rest are never served
SERVED = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif",
          ".webp": "image/webp", ".mp4": "video/mp4", ".wav": "audio/wav", ".json": "application/json",
          ".jsonl": "text/plain; charset=utf-8", ".md": "text/plain; charset=utf-8",
          ".yaml": "text/plain; charset=utf-8", ".txt": "text/plain; charset=utf-8"}


class Refused(Exception):
    """A path outside what may be served (HTTP 403)."""


def resolve(roots: list[Path], ident: str, want_dir: bool = False) -> Path | None:
    """The real path of `ident` (`<root index>[/<relative path>]`, already percent-decoded) under its root: None
    when there is no such file (or directory, with `want_dir`), Refused when the path leaves the root."""
    k, _, rel = ident.partition("/")
    if not (k.isascii() and k.isdigit()) or int(k) >= len(roots):
        return None
    parts = rel.split("/") if rel else []
    if any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise Refused(ident)
    root = os.path.realpath(roots[int(k)])
    real = os.path.realpath(os.path.join(root, *parts))
    if real != root and os.path.commonpath([root, real]) != root:
        raise Refused(ident)
    ok = os.path.isdir(real) if want_dir else os.path.isfile(real)
    return Path(real) if ok else None


def served_file(roots: list[Path], url_path: str) -> tuple[Path, str] | None:
    """(file, content type) for `/files/<root index>/<path>`'s tail (still percent-encoded), or None (404) when
    there is no such file or it is not of a kind the page shows; Refused (403) when it leaves its root."""
    path = resolve(roots, unquote(url_path, errors="strict"))
    if path is None:
        return None
    kind = SERVED.get(path.suffix.lower())
    return (path, kind) if kind else None
