"""The one exception type for mistakes a user can fix, and how entry scripts report it."""
from __future__ import annotations

import argparse
import signal
import sys
from typing import Callable, NoReturn


class UserError(Exception):
    """A bad flag, file or dataset. Entry scripts print it as one line and exit with code 2.

    The message must name the flag or file and say what would be valid.
    """


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (or its type name), for one-line reports."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def exit_on_user_error(main: Callable[[], object]) -> None:
    """Run ``main``; turn a ``UserError`` into one line on stderr and exit code 2, and Ctrl-C
    (a ``KeyboardInterrupt``, e.g. while a model is being read) into one line and exit code 130.

    The trainer handles Ctrl-C itself once training runs (``library.interrupts``); before that,
    and in the tools, nothing has been written yet or every write is atomic, so stopping at
    once loses nothing and a traceback would only hide that.
    """
    try:
        main()
    except UserError as error:
        _fail(str(error))
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C)", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)


def _fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as a ``UserError`` (one line, exit code 2)
    instead of printing the whole usage text."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see --help)")
