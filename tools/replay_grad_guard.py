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

A run that rewound (``--rewind_on_divergence``) restored its guard to the healthy point's state:
the events file beside the log (``healing_log+<name>.txt``, or ``--events FILE``) says where, and
the replay restores the guard at the same rows, so its decisions stay the training's. With an
events file the output has a last column ``Event`` (rewind, quarantine) and the summary counts them.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import csv  # noqa: E402
import functools  # noqa: E402
import io  # noqa: E402
import math  # noqa: E402
from typing import Sequence  # noqa: E402

from library import atomic_files, grad_guard  # noqa: E402
from library.errors import UserError, exit_on_user_error  # noqa: E402
from library.tool_paths import check_output_path  # noqa: E402
from library.grad_log import (  # noqa: E402
    add_fork_arguments, check_fork_arguments, events_path, fork_layout_note, fork_replay_config, format_number,
    is_fork_layout, parse_cell, read_events_for_tool,
)

OUTPUT_COLUMNS = ("Step", "Gradient Norm", "Threshold", "ThreshOff", "Skipped")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="replay_grad_guard.py",
        description="Replay gradient-guard decisions over a gradient log with the given guard flags.")
    parser.add_argument("log", metavar="LOG.csv", help="a gradient log (gradient_logs+<name>.txt)")
    parser.add_argument("--out", required=True, metavar="OUT.csv",
                        help="where to write Step,Gradient Norm,Threshold,ThreshOff,Skipped")
    parser.add_argument("--events", metavar="EVENTS.csv", default=None,
                        help="the run's self-healing events (default: healing_log+<name>.txt beside LOG, if present)")
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


def read_run_events(log: Path, events: str | None) -> list[list[str]] | None:
    """The events file named by ``--events``, else the one beside the log; None when there is none."""
    path = Path(events) if events else events_path(log)
    if not path.is_file():
        if events:
            raise UserError(f"--events {events}: no such file")
        return None
    return read_events_for_tool(path, f"--events {events}" if events else str(path))


def write_replay(path: Path, results: Sequence[tuple[int, float, grad_guard.GuardDecision]],
                 events: Sequence[Sequence[str]] | None = None) -> None:
    """The replayed rows; with ``events`` a last column ``Event`` ("rewind to N", "quarantine FILE")."""
    shown = {}
    for step, kind, detail in events or ():
        if kind in ("rewind", "quarantine"):
            text = f"rewind to {detail}" if kind == "rewind" else f"quarantine {detail}"
            shown[int(step)] = f"{shown[int(step)]}; {text}" if int(step) in shown else text
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(OUTPUT_COLUMNS + (("Event",) if events is not None else ()))
    for step, norm, decision in results:
        threshold = "" if math.isnan(decision.threshold) else format_number(decision.threshold)
        row = [step, format_number(norm), threshold, decision.thresh_off, int(decision.skip)]
        writer.writerow(row + ([shown.get(step, "")] if events is not None else []))
    try:
        atomic_files.write_file(path, buffer.getvalue())
    except OSError as error:
        raise UserError(f"--out {path}: cannot write ({error.strerror or error})") from None


def summary(results: Sequence[tuple[int, float, grad_guard.GuardDecision]], config: grad_guard.GuardConfig,
            events: Sequence[Sequence[str]] | None = None) -> str:
    skipped = [step for step, _, decision in results if decision.skip]
    nan_threshold = sum(1 for *_, decision in results if decision.thresh_off == 1)
    free_phase = sum(1 for *_, decision in results if decision.thresh_off == 2)
    shown = ",".join(map(str, skipped[:10])) + (",..." if len(skipped) > 10 else "")
    line = (f"rows={len(results)} skipped={len(skipped)} threshold_nan_rows={nan_threshold} "
            f"free_phase_rows={free_phase} skipped_steps=[{shown}]")
    if events is not None:
        kinds = [kind for _, kind, _ in events]
        line += f" rewinds={kinds.count('rewind')} quarantined={kinds.count('quarantine')}"
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
    check_output_path("--out", args.out, [("LOG", args.log), ("--events", args.events or str(events_path(args.log)))],
                      suffixes=(".csv", ".txt"))
    rows, fork_epochs = read_norms(Path(args.log))
    announce = None
    if fork_epochs is not None:
        print(fork_layout_note(args.log, len(rows), args.gradient_accumulation_steps, args.initial_step))
        replayed = fork_replay_config(config, fork_epochs, args.gradient_accumulation_steps, args.initial_step)
        if replayed.nan_inf_until_step != config.nan_inf_until_step:  # the guard would name the row, not the step
            announce = functools.partial(print_fork_switch, config.nan_inf_until_step, replayed.nan_inf_until_step)
        config = replayed
    events = None if fork_epochs is not None else read_run_events(Path(args.log), args.events)
    results = grad_guard.replay_decisions(rows, config, events or (), announce or grad_guard.print_to_stderr)
    write_replay(Path(args.out), results, events)
    print(summary(results, config, events))


if __name__ == "__main__":
    exit_on_user_error(main)
