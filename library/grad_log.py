"""The CSV gradient log (``--grad_norm_log``): buffered rows, durable flushes, resume truncation.

File ``gradient_logs+<output_name>.txt`` in ``--grad_norm_log_dir`` (default
``--output_dir``), header ``Epoch,Step,Gradient Norm,Threshold,Loss,ThreshOff``
then ``,Scale`` with a GradScaler and ``,CosineSim`` with ``--grad_cosine_log``;
one row per optimizer step (see ``docs/grad_guard_spec.md``). Readers (``tools/``) use
:func:`is_fork_layout` to also read logs of the original ``--skip_grad_norm`` fork, which wrote
a row per micro-batch (:func:`fork_replay_config` replays its decisions).

Typical use by a trainer::

    grad_log = GradientLog.from_args(args, with_scale=scaler is not None)
    if grad_log:
        grad_log.start(resume_step=resumed_global_step)   # None for a fresh run
        uninstall = install_flush_handlers(grad_log.flush)
    ...  grad_log.append(...) once per optimizer step
    ...  grad_log.flush() at every state save, at the end and on exceptions
"""
from __future__ import annotations

import argparse
import atexit
import csv
import dataclasses
import io
import logging
import math
import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from library import atomic_files
from library.errors import DiskFull, UserError

logger = logging.getLogger(__name__)

LOG_FILE_PREFIX = "gradient_logs+"
EVENTS_FILE_PREFIX = "healing_log+"
EVENT_COLUMNS = ("Step", "Event", "Detail")
DEFAULT_OUTPUT_NAME = "last"
FLUSH_EVERY_ROWS = 100
BASE_COLUMNS = ("Epoch", "Step", "Gradient Norm", "Threshold", "Loss", "ThreshOff")


def format_number(value: float) -> str:
    """Shortest round-trip text of a float; NaN/Inf as ``nan``/``inf``/``-inf``."""
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


def log_columns(with_scale: bool, with_cosine: bool) -> list[str]:
    """The header columns for a log with/without the Scale and CosineSim columns."""
    return [*BASE_COLUMNS, *(["Scale"] if with_scale else []), *(["CosineSim"] if with_cosine else [])]


def parse_cell(text: str | None) -> float:
    """A log cell as a float (``nan``/``inf`` understood); NaN when empty, absent or not a number."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def is_fork_layout(steps: Iterable[float], epochs: Iterable[float] | None = None) -> bool:
    """Whether a log's ``Step``/``Epoch`` columns are in the original ``--skip_grad_norm`` fork's layout.

    Ours: ``Step`` is the 1-based global optimizer step, strictly increasing down the file
    (a resume drops the rows after its step first), and ``Epoch`` is 1-based. The fork wrote
    the 0-based batch index within the epoch as ``Step`` (restarting at 0 every epoch) and a
    0-based ``Epoch``. So a Step not above the row before (the first row: not above 0) or an
    Epoch of 0 means the fork's layout. Readers then take the rows in file order, row i being
    global step i (1-based): the order in which the fork's guard saw them. A fork log that
    covers part of one epoch after a resume cannot be told apart and is read by its Steps.
    """
    previous = 0.0
    for step in steps:
        if not step > previous:
            return True
        previous = step
    return epochs is not None and any(epoch == 0 for epoch in epochs)


def add_fork_arguments(parser: argparse.ArgumentParser) -> None:
    """The two facts about a fork's run that its log does not hold (for the tools reading logs)."""
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1, metavar="N",
                        help="for a log of the original --skip_grad_norm fork: its run's --gradient_accumulation_steps "
                             "(the fork wrote one row per micro-batch and counted a step every N rows). Default: 1")
    parser.add_argument("--initial_step", type=int, default=0, metavar="STEP",
                        help="for a log of the original fork: the global step its run counted from (its "
                             "--initial_step when run with --skip_until_initial_step, as in kohya's code; else 0). "
                             "Default: 0")


def check_fork_arguments(args: argparse.Namespace) -> None:
    """UserError for the values of :func:`add_fork_arguments` no run can have."""
    if args.gradient_accumulation_steps < 1:
        raise UserError(f"--gradient_accumulation_steps {args.gradient_accumulation_steps} must be at least 1")
    if args.initial_step < 0:
        raise UserError(f"--initial_step {args.initial_step} must be at least 0")


def fork_switch_row(nan_inf_until_step: int, epochs: Sequence[float], accumulation_steps: int,
                    initial_step: int) -> int | None:
    """The row (1-based) of a fork log after which the fork's run switched its NaN/Inf options for
    ``--nan_inf_until_step``; None when not within the log (``epochs``: its Epoch column).

    The fork decided, and logged, every micro-batch; it counted its global step from ``initial_step``
    at the end of each accumulation window (accelerate's rule: every ``accumulation_steps`` rows of an
    epoch, and at the epoch's last row) and switched after the window that brought the count to
    ``nan_inf_until_step`` or beyond."""
    count, position = initial_step, 0
    for row, epoch in enumerate(epochs, 1):
        position += 1
        last_of_epoch = row == len(epochs) or epochs[row] != epoch
        if position % accumulation_steps == 0 or last_of_epoch:
            count += 1
            if count >= nan_inf_until_step:
                return row
        if last_of_epoch:
            position = 0
    return None


def fork_replay_config(config: Any, epochs: Sequence[float], accumulation_steps: int, initial_step: int) -> Any:
    """A ``grad_guard.GuardConfig`` replaying a fork log's rows as steps 1..N with the fork's decisions:
    its ``nan_inf_until_step`` becomes the row of :func:`fork_switch_row` (past the last row: none)."""
    until = config.nan_inf_until_step
    if until is None:
        return config
    row = fork_switch_row(until, epochs, accumulation_steps, initial_step)
    return dataclasses.replace(config, nan_inf_until_step=row if row is not None else len(epochs) + 1)


def fork_layout_note(path: str | os.PathLike[str], rows: int, accumulation_steps: int = 1,
                     initial_step: int = 0) -> str:
    """The one line a reader prints when :func:`is_fork_layout` holds for the log at ``path``."""
    layout = f"{path}: Step restarts every epoch or Epoch starts at 0 (the original --skip_grad_norm fork's layout)"
    if accumulation_steps == 1 and initial_step == 0:
        return (f"{layout}: rows taken in file order as global steps 1..{rows}; the fork wrote a row per "
                f"micro-batch: give its run's --gradient_accumulation_steps and --initial_step when not 1 and 0, "
                f"they decide where --nan_inf_until_step switches")
    return (f"{layout}: rows 1..{rows} taken in file order, {accumulation_steps} per optimizer step counted from "
            f"step {initial_step} (--gradient_accumulation_steps {accumulation_steps} --initial_step {initial_step}), "
            f"which decides where --nan_inf_until_step switches")


class GradientLog:
    """Appends one CSV row per optimizer step to ``path``.

    Invariants: rows are held in memory until ``flush_every`` are pending or
    :meth:`flush` is called; a flush writes them and fsyncs the file, so after it returns
    every appended row is on disk exactly once. Only :meth:`flush` and
    :meth:`truncate_after` write; :meth:`start` plans the file's first write.
    """

    def __init__(self, path: str | os.PathLike[str], *, with_scale: bool, with_cosine: bool,
                 flush_every: int = FLUSH_EVERY_ROWS) -> None:
        self.path = Path(path)
        self.with_scale = with_scale
        self.with_cosine = with_cosine
        self.columns = log_columns(with_scale, with_cosine)
        self.flush_every = flush_every
        self._pending: list[tuple[int, str]] = []  # (step, CSV line)
        self._flushing = False
        self._disk_full = False
        # Rows the file starts from, written at the first flush (see start); None: use the file as it is.
        self._kept_rows: list[list[str]] | None = None
        # The self-healing events of the same steps, in their own file beside this one (EventLog).
        self.events = EventLog(events_path(self.path))

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, with_scale: bool) -> GradientLog | None:
        """The log asked for by ``args`` (None without ``--grad_norm_log``).

        ``with_scale``: a GradScaler is in use. ``--grad_cosine_log`` without
        ``--grad_norm_log`` is warned about and ignored.
        """
        if not getattr(args, "grad_norm_log", False):
            if getattr(args, "grad_cosine_log", False):
                logger.warning("--grad_cosine_log needs --grad_norm_log; ignoring --grad_cosine_log")
            return None
        directory = getattr(args, "grad_norm_log_dir", None) or getattr(args, "output_dir", None)
        if not directory:
            raise UserError("--grad_norm_log needs --output_dir or --grad_norm_log_dir to know where to write")
        name = getattr(args, "output_name", None) or DEFAULT_OUTPUT_NAME
        return cls(Path(directory) / f"{LOG_FILE_PREFIX}{name}.txt", with_scale=with_scale,
                   with_cosine=bool(getattr(args, "grad_cosine_log", False)))

    @property
    def pending_rows(self) -> int:
        """Rows appended but not yet on disk."""
        return len(self._pending)

    def start(self, resume_step: int | None = None) -> None:
        """Plan the file: a fresh run (``resume_step`` None) starts a new file with the header
        (replacing an old one); a resumed run keeps the rows up to ``resume_step``. The file is
        checked now (UserError for a file that is not a gradient log) but written only at the
        first flush, so a run that fails before its first row leaves an old log as it was."""
        self._kept_rows = [] if resume_step is None else self._rows_up_to(resume_step)
        self.events.start(resume_step)

    def append(self, *, epoch: int, step: int, norm: float, threshold: float, loss: float, thresh_off: int,
               scale: float | None = None, cosine: float | None = None) -> None:
        """Buffer one row (Threshold empty when NaN); flush when ``flush_every`` rows are pending.
        ``scale``/``cosine`` are required exactly when the log has those columns."""
        if (scale is not None) != self.with_scale or (cosine is not None) != self.with_cosine:
            raise ValueError(f"{self.path.name} has columns {self.columns}; pass scale/cosine accordingly")
        threshold_text = "" if math.isnan(threshold) else format_number(threshold)
        values = [str(int(epoch)), str(int(step)), format_number(norm), threshold_text, format_number(loss),
                  str(int(thresh_off))]
        if scale is not None:
            values.append(format_number(scale))
        if cosine is not None:
            values.append(format_number(cosine))
        self._pending.append((int(step), ",".join(values) + "\n"))
        if len(self._pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Write the pending rows durably (fsynced). Safe to call any time, also re-entrantly from a
        signal handler (a nested call returns at once).

        The first flush of a run writes the whole file at once (header, the rows kept by
        :meth:`start`, the pending rows) under a temporary name and renames it over the old log, so
        an old log is replaced only by one holding this run's rows; later flushes append. A full disk
        raises ``DiskFull`` once; the log then stops writing (its rows could not be kept anyway, and a
        flush at exit must not print a second error). The events file follows the log's rows."""
        if self._flushing or self._disk_full:
            return
        if not self._pending:
            self.events.flush(log_started=self._kept_rows is None)
            return
        self._flushing = True
        try:
            count = len(self._pending)
            text = "".join(line for _, line in self._pending[:count])
            if self._kept_rows is not None:
                self._rewrite(self._kept_rows, text)
                self._kept_rows = None
            else:
                if not self.path.exists() or self.path.stat().st_size == 0:
                    text = ",".join(self.columns) + "\n" + text
                atomic_files.append_to_file(self.path, text)
            del self._pending[:count]
            self.events.flush(log_started=True)
        except DiskFull:
            self._disk_full = True
            raise
        finally:
            self._flushing = False

    def truncate_after(self, step: int) -> None:
        """Drop every row with Step > ``step`` (on disk and pending), so a resumed run logs each
        step once. Torn rows (a crash mid-write) are dropped too. Rows written with other
        columns are rewritten to this log's columns (missing ones empty)."""
        self._pending = [(row_step, line) for row_step, line in self._pending if row_step <= step]
        self._rewrite(self._rows_up_to(step))

    def _rows_up_to(self, step: int) -> list[list[str]]:
        """The file's rows with Step <= ``step`` in this log's columns (see ``truncate_after``)."""
        if not self.path.exists():
            return []
        with open(self.path, encoding="utf-8", newline="") as file:
            rows = list(csv.reader(file))
        if not rows:
            return []
        old_columns, kept = rows[0], []
        if "Step" not in old_columns:
            raise UserError(f"{self.path} is not a gradient log (no Step column); move it away or change "
                            f"--output_name/--grad_norm_log_dir")
        if old_columns != self.columns:
            logger.warning("%s: columns change from %s to %s; earlier rows are rewritten (missing values empty)",
                           self.path, ",".join(old_columns), ",".join(self.columns))
        step_index = old_columns.index("Step")
        for row in rows[1:]:
            if len(row) != len(old_columns):
                continue
            try:
                row_step = int(float(row[step_index]))
            except ValueError:
                continue
            if row_step <= step:
                by_name = dict(zip(old_columns, row))
                kept.append([by_name.get(column, "") for column in self.columns])
        return kept

    def _rewrite(self, rows: Iterable[list[str]], pending_text: str = "") -> None:
        """Atomically replace the file with the header, ``rows`` and ``pending_text`` (CSV lines)."""
        lines = [",".join(self.columns) + "\n", *(",".join(row) + "\n" for row in rows), pending_text]
        atomic_files.write_file(self.path, "".join(lines))


def events_path(log_path: str | os.PathLike[str]) -> Path:
    """The events file beside the gradient log at ``log_path`` (``gradient_logs+X.txt`` -> ``healing_log+X.txt``)."""
    path = Path(log_path)
    name = path.name[len(LOG_FILE_PREFIX):] if path.name.startswith(LOG_FILE_PREFIX) else path.name
    return path.with_name(EVENTS_FILE_PREFIX + name)


class EventLog:
    """The self-healing events of a run (``healing_log+<output_name>.txt`` beside the gradient log):
    CSV ``Step,Event,Detail``, one row per event (``healthy``: the state after Step is the healthy
    point; ``rewind``: back to the healthy point of the step in Detail; ``quarantine``: the image in
    Detail). The replay and plot tools read it. Written only when there are events, with the gradient
    log: its rows go to disk when the gradient log's do, and a fresh run's first gradient-log write
    replaces an old events file (a resumed run keeps the rows up to its step)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pending: list[str] = []
        self._kept_rows: list[list[str]] | None = None

    def start(self, resume_step: int | None) -> None:
        self._kept_rows = [] if resume_step is None else read_events(self.path, up_to=resume_step)

    def append(self, step: int, event: str, detail: str) -> None:
        self._pending.append(_csv_line([str(int(step)), event, detail]))

    def flush(self, log_started: bool) -> None:
        """Write what is pending, once the gradient log has started writing (``log_started``)."""
        if not log_started:
            return
        if self._kept_rows is not None:
            kept, self._kept_rows = self._kept_rows, None
            if kept or self._pending or self.path.exists():
                if not kept and not self._pending:
                    self.path.unlink()
                    return
                atomic_files.write_file(self.path, _csv_line(EVENT_COLUMNS) + "".join(_csv_line(row) for row in kept))
        if not self._pending:
            return
        text = "".join(self._pending)
        if not self.path.exists():
            text = _csv_line(EVENT_COLUMNS) + text
        atomic_files.append_to_file(self.path, text)
        self._pending.clear()


def read_events(path: str | os.PathLike[str], up_to: int | None = None) -> list[list[str]]:
    """The rows (Step, Event, Detail) of an events file, those with Step <= ``up_to`` when given; [] when
    there is none. Torn rows (a crash mid-write) are dropped."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", newline="") as file:
        rows = list(csv.reader(file))
    kept = []
    for row in rows[1:]:
        if len(row) != len(EVENT_COLUMNS) or not row[0].isdigit():
            continue
        if up_to is None or int(row[0]) <= up_to:
            kept.append(row)
    return kept


def read_events_for_tool(path: str | os.PathLike[str], source: str) -> list[list[str]]:
    """:func:`read_events` for the offline tools: UserError naming ``source`` (the flag or file) for a file
    that is not UTF-8 CSV text, or a ``rewind`` row whose Detail is not the step it went back to."""
    try:
        rows = read_events(path)
    except (UnicodeDecodeError, csv.Error):
        raise UserError(f"{source}: not a text events file (UTF-8 CSV Step,Event,Detail, as the trainer writes "
                        f"healing_log+<name>.txt)") from None
    except OSError as error:
        raise UserError(f"{source}: cannot read it ({error.strerror or error})") from None
    for step, kind, detail in rows:
        if kind == "rewind" and not (detail.strip().isascii() and detail.strip().isdigit()):
            raise UserError(f"{source}: the rewind at step {step} has Detail {detail!r}; a rewind's Detail is "
                            f"the step it went back to (a whole number)")
    return rows


def _csv_line(values: Iterable[str]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(values)
    return buffer.getvalue()


def install_flush_handlers(flush: Callable[[], None],
                           signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM)) -> Callable[[], None]:
    """Call ``flush`` at interpreter exit and on each of ``signals``, then let the signal do what it
    did before (SIGINT: KeyboardInterrupt; SIGTERM: terminate by that signal). Signal handlers are
    only installed from the main thread. Returns a function that removes all of it."""
    previous: dict[int, object] = {}

    def handler(signum: int, frame: object) -> None:
        try:
            flush()
        except Exception:  # the signal must still take effect
            logger.exception("flushing on signal %d failed", signum)
        prior = previous.get(signum)
        if callable(prior):
            prior(signum, frame)
        elif prior != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    atexit.register(flush)
    if threading.current_thread() is threading.main_thread():
        for signum in signals:
            previous[signum] = signal.getsignal(signum)
            signal.signal(signum, handler)

    def uninstall() -> None:
        atexit.unregister(flush)
        for signum, prior in previous.items():
            if signal.getsignal(signum) is handler:
                signal.signal(signum, prior if prior is not None else signal.SIG_DFL)

    return uninstall
