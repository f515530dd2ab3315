"""Replay the gradient guard's decisions over a gradient log with other guard flags.

    python tools/replay_grad_guard.py LOG.csv --out OUT.csv [guard flags]

Reads any ``gradient_logs+*.txt`` (only ``Step`` and ``Gradient Norm`` are used;
``nan``/``inf`` are understood; ``Epoch`` only to recognise a log of the original
``--skip_grad_norm`` fork, whose Step restarts every epoch: its rows are replayed in file
order, said in one line on stdout; the fork wrote a row per micro-batch, so give its run's
``--gradient_accumulation_steps`` and ``--initial_step``: they decide the row where
``--nan_inf_until_step`` switches), runs the trainers' own decision code
(``library.grad_guard``) with the given flags, and writes
``Step,Gradient Norm,Threshold,ThreshOff,Skipped`` (one row per input row,
Threshold empty when NaN) plus a one-line summary on stdout. Use it to tune
``--skip_grad_norm_max`` and friends offline.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import csv  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
from typing import Callable, Sequence  # noqa: E402

from library import atomic_files, grad_guard  # noqa: E402
from library.errors import UserError, exit_on_user_error  # noqa: E402
from library.grad_log import (  # noqa: E402
    add_fork_arguments, check_fork_arguments, fork_layout_note, fork_replay_config, format_number, is_fork_layout,
    parse_cell,
)

OUTPUT_COLUMNS = ("Step", "Gradient Norm", "Threshold", "ThreshOff", "Skipped")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="replay_grad_guard.py",
        description="Replay gradient-guard decisions over a gradient log with the given guard flags.")
    parser.add_argument("log", metavar="LOG.csv", help="a gradient log (gradient_logs+<name>.txt)")
    parser.add_argument("--out", required=True, metavar="OUT.csv",
                        help="where to write Step,Gradient Norm,Threshold,ThreshOff,Skipped")
    grad_guard.add_arguments(parser)
    add_fork_arguments(parser)
    return parser


def read_norms(path: Path) -> tuple[list[tuple[int, float]], list[float] | None]:
    """(Step, Gradient Norm) of every row of a gradient log, and, when the log is in the original fork's
    layout (see :func:`library.grad_log.is_fork_layout`; then Step is the 1-based row number), its Epoch
    column (else None). UserError naming the line when a Step or norm is unreadable."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as file:  # a spreadsheet may add a byte-order mark
            reader = csv.DictReader(file)
            missing = {"Step", "Gradient Norm"} - set(reader.fieldnames or [])
            if missing:
                raise UserError(f"{path}: not a gradient log, missing column(s) {', '.join(sorted(missing))}")
            rows, epochs = [], []
            for row in reader:
                epochs.append(parse_cell(row.get("Epoch")))  # unused otherwise: never an error
                try:
                    rows.append((int(float(row["Step"])), float(row["Gradient Norm"])))
                except (TypeError, ValueError):
                    raise UserError(f"{path}:{reader.line_num}: Step/Gradient Norm must be numbers "
                                    f"(nan/inf allowed), got {row.get('Step')!r}/{row.get('Gradient Norm')!r}"
                                    ) from None
    except OSError as error:
        raise UserError(f"{path}: cannot read the gradient log ({error.strerror or error})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text CSV gradient log") from None
    if not is_fork_layout((step for step, _ in rows), epochs):
        return rows, None
    return [(number, norm) for number, (_, norm) in enumerate(rows, 1)], epochs


def replay(rows: Sequence[tuple[int, float]], config: grad_guard.GuardConfig,
           announce: Callable[[str], None] | None = None) -> list[tuple[int, float, grad_guard.GuardDecision]]:
    """Run a fresh :class:`GradGuard` over ``rows``; (step, norm, decision) per row. ``announce`` gets the
    guard's line at the ``--nan_inf_until_step`` switch (default: printed on stderr)."""
    guard = grad_guard.GradGuard(config, announce=announce or (lambda line: print(line, file=sys.stderr)))
    return [(step, norm, guard.decide(step, norm)) for step, norm in rows]


def write_replay(path: Path, results: Sequence[tuple[int, float, grad_guard.GuardDecision]]) -> None:
    lines = [",".join(OUTPUT_COLUMNS) + "\n"]
    for step, norm, decision in results:
        threshold = "" if math.isnan(decision.threshold) else format_number(decision.threshold)
        lines.append(f"{step},{format_number(norm)},{threshold},{decision.thresh_off},{int(decision.skip)}\n")
    try:
        atomic_files.write_file(path, "".join(lines))
    except OSError as error:
        raise UserError(f"--out {path}: cannot write ({error.strerror or error})") from None


def summary(results: Sequence[tuple[int, float, grad_guard.GuardDecision]], config: grad_guard.GuardConfig) -> str:
    skipped = [step for step, _, decision in results if decision.skip]
    nan_threshold = sum(1 for *_, decision in results if decision.thresh_off == 1)
    free_phase = sum(1 for *_, decision in results if decision.thresh_off == 2)
    shown = ",".join(map(str, skipped[:10])) + (",..." if len(skipped) > 10 else "")
    line = (f"rows={len(results)} skipped={len(skipped)} threshold_nan_rows={nan_threshold} "
            f"free_phase_rows={free_phase} skipped_steps=[{shown}]")
    if not config.skip_grad_norm:
        line += " (no --skip_grad_norm: nothing is skipped, as in training)"
    return line


def print_fork_switch(nan_inf_until_step: int, row: int, guard_line: str) -> None:
    """The switch line for a fork log replayed by rows (the guard's own would name the row as the step)."""
    print(f"gradient guard: --nan_inf_until_step {nan_inf_until_step} reached after row {row} of the fork's log: "
          f"NaN/Inf norms are now kept out of the window and skipped immediately", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    grad_guard.apply_preset(args, grad_guard.explicit_dests(parser, argv))
    check_fork_arguments(args)
    config = grad_guard.GuardConfig.from_args(args)
    rows, fork_epochs = read_norms(Path(args.log))
    announce = None
    if fork_epochs is not None:
        print(fork_layout_note(args.log, len(rows), args.gradient_accumulation_steps, args.initial_step))
        replayed = fork_replay_config(config, fork_epochs, args.gradient_accumulation_steps, args.initial_step)
        if replayed.nan_inf_until_step != config.nan_inf_until_step:  # the guard would name the row, not the step
            announce = functools.partial(print_fork_switch, config.nan_inf_until_step, replayed.nan_inf_until_step)
        config = replayed
    results = replay(rows, config, announce)
    write_replay(Path(args.out), results)
    print(summary(results, config))


if __name__ == "__main__":
    exit_on_user_error(main)
