"""Plot how good a LoRA got, from a run's ``--log_jsonl`` file (and its ``--find_lr`` CSV).

    python tools/plot_lora_quality.py LOG.jsonl [--lr_find OUT-lr_find.csv] [--out PNG]

Panels (the first three share the step axis; each only when the log has its scalars):

* loss: ``loss/current`` (thin) and ``loss/average``, and ``--debiased_loss``'s ``loss/debiased``
  and ``loss/debiased_average`` on a second axis (1 = the base model's loss);
* validation: ``loss/validation/*_average`` with the best step marked (the lowest value, what
  ``<output_name>-best.safetensors`` holds) and ``effect/val_rel`` on a second axis;
* effect: ``effect/output_rel`` and ``effect/weight_rel_median``/``_max`` (log scale);
* the learning-rate finder: probe loss / base model's over the rate (log x), when ``--lr_find``.

See docs/know_your_lora.md. Drawing is headless (matplotlib's Agg backend).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import csv  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

from library import atomic_files  # noqa: E402
from library.errors import UserError, exit_on_user_error  # noqa: E402
from library.tool_paths import check_output_path  # noqa: E402


def read_series(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Every numeric scalar of a JSON-lines log: name -> [(step, value)] in file order."""
    series: dict[str, list[tuple[int, float]]] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise UserError(f"{path}: cannot be read ({error.strerror})") from None
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}: line {number} is not JSON (expected a --log_jsonl file)") from None
        for name, value in row.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(name, []).append((row["step"], float(value)))
    return series


def read_lr_find(path: Path) -> list[tuple[float, float]]:
    """(learning rate, probe loss / base) rows of a ``-lr_find.csv``."""
    try:
        with open(path, newline="") as file:
            return [(float(row["learning_rate"]), float(row["probe_rel"])) for row in csv.DictReader(file)]
    except (OSError, KeyError, ValueError) as error:
        raise UserError(f"--lr_find {path}: not a --find_lr CSV ({error})") from None


def draw(series: dict[str, list[tuple[int, float]]], lr_find: Optional[list[tuple[float, float]]], title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def has(*names: str) -> bool:
        return any(name in series for name in names)

    validation = [name for name in series if name.startswith("loss/validation/") and name.endswith("_average")]
    panels = [kind for kind, present in (("loss", has("loss/current")), ("validation", bool(validation)),
                                         ("effect", has("effect/output_rel", "effect/weight_rel_median")),
                                         ("lr_find", lr_find is not None)) if present]
    if not panels:
        raise UserError("the log has none of the scalars this tool draws (loss/current, loss/validation/*, effect/*)")
    figure, axes = plt.subplots(len(panels), 1, figsize=(10, 3 * len(panels)), squeeze=False)

    def line(axis, name: str, **style) -> None:
        if name in series:
            steps, values = zip(*series[name])
            axis.plot(steps, values, label=name, **style)

    for axis, kind in zip(axes[:, 0], panels):
        if kind == "loss":
            line(axis, "loss/current", linewidth=0.5, alpha=0.5)
            line(axis, "loss/average")
            if has("loss/debiased"):
                twin = axis.twinx()
                line(twin, "loss/debiased", linewidth=0.5, alpha=0.5, color="tab:red")
                line(twin, "loss/debiased_average", color="tab:red")
                twin.axhline(1.0, color="tab:red", linewidth=0.5, linestyle=":")
                twin.set_ylabel("loss / base model's")
                twin.legend(loc="upper right")
            axis.legend(loc="upper left")
        elif kind == "validation":
            for name in validation:
                line(axis, name, marker=".")
                step, value = min(series[name], key=lambda item: item[1])
                axis.plot([step], [value], marker="*", markersize=14, color="gold", linestyle="none",
                          label=f"best: step {step}")
            if has("effect/val_rel"):
                twin = axis.twinx()
                line(twin, "effect/val_rel", color="tab:purple", linestyle="--")
                twin.set_ylabel("validation / base model's")
                twin.legend(loc="upper right")
            axis.legend(loc="upper left")
        elif kind == "effect":
            for name in ("effect/output_rel", "effect/weight_rel_median", "effect/weight_rel_max"):
                line(axis, name, marker=".")
            axis.set_yscale("log")
            axis.legend(loc="upper left")
        else:
            rates, relative = zip(*lr_find)
            axis.semilogx(rates, relative, marker=".", label="--find_lr probe loss / base model's")
            axis.axhline(1.0, color="grey", linewidth=0.8)
            axis.set_xlabel("learning rate")
            axis.legend(loc="upper left")
        if kind != "lr_find":
            axis.set_xlabel("step")
    figure.suptitle(title)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    plt.close(figure)
    return buffer.getvalue()


def main(argv: Optional[Sequence[str]] = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="a --log_jsonl file")
    parser.add_argument("--lr_find", type=Path, default=None, help="a <output_name>-lr_find.csv to draw too")
    parser.add_argument("--out", type=Path, default=None, help="the PNG to write. Default: LOG with .png")
    args = parser.parse_args(argv)
    out = args.out or args.log.with_suffix(".png")
    check_output_path("--out", str(out), [("LOG", str(args.log)), ("--lr_find", args.lr_find and str(args.lr_find))],
                      suffixes=(".png",))
    image = draw(read_series(args.log), read_lr_find(args.lr_find) if args.lr_find else None, args.log.name)
    atomic_files.write_file(out, image)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    exit_on_user_error(main)
