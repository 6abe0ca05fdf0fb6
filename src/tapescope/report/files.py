"""Writing the reports' files: checked before the work starts, written atomically.

A path that cannot be written (a missing folder, a folder given as a file, no permission) is
refused before the profile is computed, so a long trace is never lost to a typo. Each file is
written to a temporary file in the same folder and renamed over the target, so an interrupted
write (Ctrl-C, a full disk) leaves the old file or none, never a truncated one.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager

from ..errors import TapescopeError

__all__ = ["check_writable", "atomic_path", "write_text", "write_json"]


def check_writable(path, flag: str = "output") -> None:
    """Raise a TapescopeError that says why `path` cannot be written, if it cannot."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise TapescopeError(f"{flag} {path}: is a folder; give a file name")
    if not os.path.isdir(folder):
        raise TapescopeError(f"{flag} {path}: the folder {folder} does not exist")
    try:  # the only honest test: create a file there (permissions, read-only mounts, quotas)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".tapescope-", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise TapescopeError(f"{flag} {path}: cannot write in {folder} ({e.strerror})") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise TapescopeError(f"{flag} {path}: the file exists and is not writable")


@contextmanager
def atomic_path(path):
    """Yields a temporary path next to `path`; on success it replaces `path`, else it is removed."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                               prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_text(path, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


def write_json(path, data) -> None:
    """JSON with an indent of 1; values json cannot write (dtypes, devices) as their text."""
    write_text(path, json.dumps(data, indent=1, default=str))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
