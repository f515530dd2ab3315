"""Several trainings in one torchrun launch (for the two-process tests).

A launch costs its processes' start: torchrun's and each rank's imports (torch, diffusers, transformers), several
times what a tiny training itself takes. Tests that need several two-process trainings launch this file once
(``launch_in_sequence``); each of its processes runs the trainings in the order given, each as
``conftest.run_trainer`` runs one in the test's process (the entry script's ``main(argv)``), with its own stdout
and stderr files per rank. A run that must die (a kill test) and the entry script's own start are tested by
launching the script itself.

Between two trainings each process:
  * resets accelerate's state: every training builds its own ``Accelerator``, as in a fresh process;
  * reseeds Python's, numpy's and torch's random generators from the OS's entropy, as a fresh process starts
    them: a training without ``--seed`` must agree on a seed across the ranks, and would agree by accident after
    an earlier training had seeded both ranks alike;
  * keeps the default process group: the trainer's ``end_training`` would destroy it, and a second
    ``init_process_group`` on torchrun's store would find the first one's rendezvous keys (same group name)
    and could connect to the first group's addresses.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def log_stem(log_dir: Path, name: str, rank: int) -> Path:
    return log_dir / f"{name}.rank{rank}"


def launch_in_sequence(runs: dict[str, tuple[str, list[str]]], log_dir: Path, env: dict[str, str],
                       processes: int = 2, master_port: int = 29500) -> dict[str, subprocess.CompletedProcess]:
    """Run ``runs`` (name -> (entry module, argv)), in order, in one launch of ``processes`` processes.

    Returns name -> a CompletedProcess whose stdout (stderr) is the ranks' stdout (stderr) of that training, rank
    by rank, and whose returncode is 0 when every rank finished it, else 1 (the launch stops at the first
    training that fails on any rank: its stderr holds the traceback; later ones did not run and say so)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    plan = log_dir / "plan.json"
    plan.write_text(json.dumps({"log_dir": str(log_dir),
                                "runs": [{"name": name, "script": script, "argv": argv}
                                         for name, (script, argv) in runs.items()]}))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
               "--master_port", str(master_port), str(Path(__file__).resolve()), str(plan)]
    launch = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    results = {}
    for name in runs:
        stems = [log_stem(log_dir, name, rank) for rank in range(processes)]
        finished = all(Path(f"{stem}.done").exists() for stem in stems)
        stdout = "".join(Path(f"{stem}.out").read_text() for stem in stems if Path(f"{stem}.out").exists())
        stderr = "".join(Path(f"{stem}.err").read_text() for stem in stems if Path(f"{stem}.err").exists())
        if not finished:
            stderr += (f"\n[{name} did not finish in the launch (exit code {launch.returncode}); the launch's own "
                       f"output:]\n{(launch.stdout + launch.stderr)[-3000:]}")
        results[name] = subprocess.CompletedProcess(command, 0 if finished else 1, stdout, stderr)
    return results


def run_plan(plan_file: str) -> None:
    """This process's part of a launch: every training of the plan in order (see the module's docstring)."""
    import random

    import numpy as np
    import torch
    from accelerate.state import AcceleratorState, GradientState, PartialState

    sys.path.insert(0, str(REPO))  # the entry scripts (this file's folder is sys.path[0])
    plan = json.loads(Path(plan_file).read_text())
    rank = int(os.environ["RANK"])
    PartialState.destroy_process_group = lambda self, group=None: None  # kept for the next training
    for run in plan["runs"]:
        stem = log_stem(Path(plan["log_dir"]), run["name"], rank)
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(f"{stem}.out", "wb") as out, open(f"{stem}.err", "wb") as err:
            os.dup2(out.fileno(), 1)  # the file descriptors: the trainer's direct writes and its children's too
            os.dup2(err.fileno(), 2)
            code = 0
            try:
                AcceleratorState._reset_state(reset_partial_state=True)
                GradientState._reset_state()
                random.seed()
                np.random.seed()
                torch.seed()
                importlib.import_module(run["script"]).main(argv=run["argv"])
            except SystemExit as exited:
                code = exited.code if isinstance(exited.code, int) else int(exited.code is not None)
                if code:
                    print(f"{run['name']}: exit code {code}", file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
        if code:  # the other rank may wait in a collective: stop the launch (torchrun ends the other processes)
            os._exit(code)
        Path(f"{stem}.done").touch()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_plan(sys.argv[1])
