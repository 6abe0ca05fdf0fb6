"""Writing the reports' files: checked before the work starts, written atomically.

A path that cannot be written (a missing folder, a folder given as a file, no permission) is
refused before the profile is computed, so a long trace is never lost to a typo. Each file is
written to a temporary file in the same folder and renamed over the target, so an interrupted
write (Ctrl-C, a full disk) leaves the old file or none, never a truncated one.

A symbolic link is followed: the file it points to is the one replaced, the link stays. A path
that is no regular file - a FIFO, a device such as /dev/null or /dev/stdout - is written
through, never replaced (renaming over /dev/null as root would put a regular file there); a
socket cannot be written and is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from contextlib import contextmanager

from ..errors import TapescopeError

__all__ = ["check_writable", "atomic_path", "write_text", "write_json", "same_file_twice"]


def _special(path: str) -> int | None:
    """The mode of `path` (links followed) if it exists and is no regular file, else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else mode


def same_file_twice(paths: dict) -> tuple | None:
    """Two flags naming one file (links and relative paths resolved), as (flag, flag, path)."""
    seen: dict = {}
    for flag, path in paths.items():
        if not path:
            continue
        real = os.path.realpath(os.fspath(path))
        if real in seen and _special(real) is None:  # /dev/null twice is harmless
            return seen[real], flag, os.fspath(path)
        seen.setdefault(real, flag)
    return None


def check_writable(path, flag: str = "output") -> None:
    """Raise a TapescopeError that says why `path` cannot be written, if it cannot."""
    path = os.path.realpath(os.fspath(path))  # a link: the file it points to
    folder = os.path.dirname(path)
    mode = _special(path)
    if mode is not None:
        if stat.S_ISSOCK(mode):
            raise TapescopeError(f"{flag} {path}: is a socket; give a file, a FIFO or a device")
        if not os.access(path, os.W_OK):
            raise TapescopeError(f"{flag} {path}: not writable")
        return
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
    """Yields a temporary path; on success it replaces `path` (a regular file, or the one a link
    points to) or is copied into it (a FIFO, a device), else it is removed. A write that fails
    (a full disk, no permission) is a TapescopeError naming the file."""
    shown = os.fspath(path)
    path = os.path.realpath(shown)
    special = _special(path) is not None
    # a short name of our own: the user's may already be at the 255-byte limit
    folder = tempfile.gettempdir() if special else os.path.dirname(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tapescope-", suffix=".tmp")
        os.close(fd)
    except OSError as e:
        raise TapescopeError(f"cannot write {shown}: {e.strerror} in {folder}") from None
    try:
        yield tmp
        if special:
            with open(tmp, "rb") as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.unlink(tmp)
        else:
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise TapescopeError(f"cannot write {shown}: {exc.strerror or exc}") from None
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
