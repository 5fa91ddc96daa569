"""Command-line plumbing shared by the tools: one-line errors, checked numbers, an early write check.

A user error (a missing or unreadable file, a bad number, an output folder that cannot be written, a full disk)
ends a tool with one line on stderr, `<prog>: error: ...`, and exit status 1 (2 for bad arguments), never a
traceback; numbers are checked where they are parsed, never quietly replaced by a default.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr (exit 2), not the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def describe(error: BaseException) -> str:
    """One line for a user error; an OSError names its file(s) first."""
    if isinstance(error, OSError) and error.strerror:
        files = [str(f) for f in (error.filename, error.filename2) if f is not None]
        return f"{' -> '.join(files)}: {error.strerror}" if files else error.strerror
    return str(error)


def fail(prog: str, error: BaseException) -> int:
    """Print `error` as one line for `prog` and return the exit status 1."""
    print(f"{prog}: error: {describe(error)}", file=sys.stderr)
    return 1


def int_at_least(low: int):
    """An argparse type: an integer >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def check_writable(path: str | Path) -> None:
    """Fail now, not after hours of work, when the file `path` could not be created (its folder made if missing)."""
    folder = Path(path).absolute().parent
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{Path(path).name}.", suffix=".probe", dir=folder)
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror} (cannot create files there)", str(folder)) from None
    os.close(fd)
    os.unlink(probe)
