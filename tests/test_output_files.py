"""report/files.py: the report files never replace what the path names when it is no regular
file, follow links, refuse one file for two outputs and turn a failed write into one line."""

import os
import stat
import threading

import pytest
from typer.testing import CliRunner

from tapescope.cli import app
from tapescope.errors import TapescopeError
from tapescope.report.files import write_text

from .conftest import TINY_GPT2

TINY = [TINY_GPT2, "--batch", "1", "--seq", "8", "-q"]


def test_a_fifo_is_written_through_not_replaced(tmp_path):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    write_text(fifo, "hello\n")
    reader.join(10)
    assert got == ["hello\n"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_device_is_written_through_not_replaced():
    before = os.stat("/dev/null")
    write_text("/dev/null", "x" * 100)
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino,
                                                                              before.st_rdev)


def test_a_link_is_followed_and_kept(tmp_path):
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    r = CliRunner().invoke(app, ["profile", *TINY, "--json", str(link)])
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text().startswith("{")


def test_one_file_for_two_outputs_is_refused(tmp_path):
    path = tmp_path / "both"
    r = CliRunner().invoke(app, ["profile", *TINY, "--json", str(path), "--graph",
                                 str(tmp_path / "." / "both")])
    assert r.exit_code == 1 and "--json and --graph both name" in r.output
    assert not path.exists()


def test_a_name_at_the_length_limit_is_written(tmp_path):
    name = tmp_path / ("n" * 250 + ".json")  # legal: 255 bytes; a temporary named after it is not
    write_text(name, "{}")
    assert name.read_text() == "{}"


def test_a_failed_write_is_one_line(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with pytest.raises(TapescopeError, match="cannot write /dev/full: No space left"):
        write_text("/dev/full", "x" * 100_000)
