"""Time ``tools/plot_grad_log.py`` end to end on a large, busy gradient log.

Builds a deterministic (seeded) 100,000-row log in a temp dir: lognormal norms with
spikes, 1% NaN/Inf rows, and ThreshOff 1/2 set on scattered rows so that there are
about 16,000 separate ThreshOff runs (the worst case for shading), a Scale and a
CosineSim column. Then runs the tool's ``main`` (read, draw, write the PNG) and prints
``plot_s=<wall s> cpu_s=<process CPU s> rows=<n> threshoff_runs=<r> naninf_rows=<k>`` (CPU time
is the steadier figure on a shared machine). Before the shading became one path per kind
(one ``axvspan`` per run) this log took 23-35 s (21.5 s CPU); the target is <= 5 s.

    python benchmarks/bench_plot_grad_log.py [--rows 100000] [--repeats 1] [--keep PNG] [--profile N]

``--profile N`` also prints the N most expensive functions (cProfile, cumulative time).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from library.grad_log import format_number, log_columns  # noqa: E402
from tools import plot_grad_log  # noqa: E402

# Each row is off with this probability, independently, ThreshOff 1 or 2 alike: each kind
# starts a run at about rows * (p/2) * (1 - p/2) rows, i.e. ~16,000 runs for 100,000 rows.
THRESH_OFF_PROBABILITY = 0.175
NAN_INF_FRACTION = 0.01


def write_busy_log(path: Path, rows: int, seed: int = 0) -> tuple[int, int]:
    """Write the log; returns (ThreshOff runs, NaN/Inf rows)."""
    rng = np.random.default_rng(seed)
    steps = np.arange(1, rows + 1)
    norms = rng.lognormal(3.0, 0.3, size=rows)
    norms[rng.choice(rows, size=rows // 500, replace=False)] *= 40  # spikes
    naninf = rng.choice(rows, size=int(rows * NAN_INF_FRACTION), replace=False)
    norms[naninf[::2]] = np.nan
    norms[naninf[1::2]] = np.inf
    thresh_off = np.where(rng.random(rows) < THRESH_OFF_PROBABILITY, rng.integers(1, 3, size=rows), 0)
    threshold = np.where(thresh_off == 1, np.nan, 60.0 + rng.random(rows))
    losses = 0.1 + 0.05 * rng.random(rows)
    scale = np.empty(rows)  # as a GradScaler: halved at an overflow, doubled after 50 clean steps
    scale_now, clean = 65536.0, 0
    for row, finite in enumerate(np.isfinite(norms).tolist()):
        scale[row] = scale_now
        clean = clean + 1 if finite else 0
        if not finite or clean == 50:
            scale_now, clean = (scale_now * 2 if finite else scale_now / 2), 0
    cosine = rng.uniform(-1, 1, size=rows)
    with open(path, "w", encoding="utf-8", newline="") as file:
        file.write(",".join(log_columns(with_scale=True, with_cosine=True)) + "\n")
        for row in range(rows):
            threshold_text = "" if np.isnan(threshold[row]) else format_number(threshold[row])
            file.write(f"{1 + row // 5000},{steps[row]},{format_number(norms[row])},{threshold_text},"
                       f"{format_number(losses[row])},{thresh_off[row]},{format_number(scale[row])},"
                       f"{format_number(cosine[row])}\n")
    runs = sum(int(np.count_nonzero(np.diff(np.concatenate([[0], (thresh_off == value).astype(np.int8)])) == 1))
               for value in (1, 2))
    return runs, len(naninf)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows in the log. Default: 100000")
    parser.add_argument("--repeats", type=int, default=1, help="plot this many times, report the fastest. Default: 1")
    parser.add_argument("--keep", default=None, metavar="PNG", help="copy the image here")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print the N functions with the most cumulative time. Default: 0 (no profile)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        log_path = Path(directory) / "gradient_logs+bench.txt"
        runs, naninf_rows = write_busy_log(log_path, args.rows)
        out = Path(directory) / "bench.png"
        times_s, cpu_times_s = [], []
        for _ in range(args.repeats):
            started, cpu_started = time.perf_counter(), time.process_time()
            plot_grad_log.main([str(log_path), "--out", str(out)])
            times_s.append(time.perf_counter() - started)
            cpu_times_s.append(time.process_time() - cpu_started)
        if args.profile:
            profile = cProfile.Profile()
            profile.runcall(plot_grad_log.main, [str(log_path), "--out", str(out)])
            pstats.Stats(profile).sort_stats("cumulative").print_stats(args.profile)
        if args.keep:
            shutil.copyfile(out, args.keep)
    print(f"plot_s={min(times_s):.2f} cpu_s={min(cpu_times_s):.2f} rows={args.rows} threshoff_runs={runs} "
          f"naninf_rows={naninf_rows}")


if __name__ == "__main__":
    main()
