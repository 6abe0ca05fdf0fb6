"""Keep the profiler's C++ log lines off the user's terminal.

torch.profiler's Kineto writes its own log lines straight to the process's stderr (file
descriptor 2, below Python): `USDT: ... profiler_start`, and on a machine without a GPU
`ERROR: ... gpuGetDeviceCount failed with code 35`. They say nothing about the user's model.
While a profiler runs, fd 2 goes to a temporary file; afterwards every line that is not such a
log line is written back to stderr, so genuine output (a warning of the model's) still shows.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from contextlib import contextmanager

__all__ = ["quiet_native_logs", "is_native_log_line"]

# Kineto's logger: LEVEL:YYYY-MM-DD HH:MM:SS pid:tid File.cpp:LINE] message
_NATIVE_LOG = re.compile(rb"^(USDT|ERROR|WARNING|INFO|VERBOSE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d "
                         rb"\d+:\d+ \S+\.(cpp|h|cc):\d+\] ")


def is_native_log_line(line: bytes) -> bool:
    return _NATIVE_LOG.match(line) is not None


@contextmanager
def quiet_native_logs():
    fd = 2  # where C++ writes, whatever object sys.stderr is now
    try:
        sys.stderr.flush()
        saved = os.dup(fd)
    except (AttributeError, ValueError, OSError):  # no file descriptor 2 in this process
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), fd)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            finally:
                os.dup2(saved, fd)
                os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().splitlines(keepends=True)
                    if not is_native_log_line(line)]
            if kept:
                os.write(fd, b"".join(kept))
