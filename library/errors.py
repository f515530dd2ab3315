"""The one exception type for mistakes a user can fix, and how entry scripts report it."""
from __future__ import annotations

import argparse
import errno
import signal
import sys
from typing import Callable, NoReturn

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""The errors a full disk (or quota) gives."""


class UserError(Exception):
    """A bad flag, file or dataset. Entry scripts print it as one line and exit with code 2.

    The message must name the flag or file and say what would be valid.
    """


class DiskFull(Exception):
    """No space left for a file the run writes (``library.atomic_files``). Entry scripts print it as
    one line naming the file and the bytes it needed, and exit with code 1: not a mistake in the
    options, and every file already on disk was kept."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (or its type name), for one-line reports."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def exit_on_user_error(main: Callable[[], object]) -> None:
    """Run ``main``; turn a ``UserError`` into one line on stderr and exit code 2, a full disk
    (``DiskFull``, or any write failing with ENOSPC/EDQUOT) into one line and exit code 1, and
    Ctrl-C (a ``KeyboardInterrupt``, e.g. while a model is being read) into one line and exit code 130.

    The trainer handles Ctrl-C itself once training runs (``library.interrupts``); before that,
    and in the tools, nothing has been written yet or every write is atomic, so stopping at
    once loses nothing and a traceback would only hide that.
    """
    try:
        main()
    except UserError as error:
        _fail(str(error))
    except DiskFull as error:
        _fail(str(_first_disk_full(error)), exit_code=1)
    except OSError as error:
        if error.errno not in NO_SPACE_ERRNOS:
            raise
        _fail(f"{error.filename or 'a file'}: no space left on the disk ({error.strerror})", exit_code=1)
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C)", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)


def _first_disk_full(error: DiskFull) -> DiskFull:
    """The first of the disk-full errors ``error`` was raised after (a log flushed on the way out
    meets the full disk again): the write the disk first had no room for."""
    first, context = error, error.__context__
    while context is not None:
        if isinstance(context, DiskFull):
            first = context
        context = context.__context__
    return first


def _fail(message: str, exit_code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(exit_code)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as a ``UserError`` (one line, exit code 2)
    instead of printing the whole usage text."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see --help)")
