"""networks/extract_lora_from_models.py against kohya's own tool on a full-size pair: time, peak RSS, accuracy.

    python benchmarks/bench_extract_lora.py --kohya_dir SD_SCRIPTS --kohya_python PYTHON \
        [--kind sdxl|sd15] [--work_dir /tmp/bench_extract_lora] [--dim 8] [--sample K] \
        [--kohya_rss_limit_gib 14] [--skip_kohya] [--keep]

Builds into ``--work_dir`` (kept with ``--keep``, else deleted at the end): a full-size base single file
with random weights (fp16, original layout; ``bench_full_sdxl.build_model_file``) and a "tuned" one, the
base plus, on every weight matrix, a random rank-8 change (0.2x the weight's init scale) and noise
(0.02x), stored in fp16. Then runs both tools the way the kohya_ss GUI calls kohya's (``--load_precision
fp16 --save_precision fp16 --clamp_quantile 0.99 --min_diff 0.01 --device cpu``, SDXL with
``--load_original_model_to cpu --load_tuned_model_to cpu``; our tool gets the same flags), each under
a watch on its memory (wall seconds, peak RSS of the process; a run whose RSS passes ``--kohya_rss_limit_gib``
is stopped and reported as above it, so a shared machine survives kohya's SDXL load). kohya's needs
``PYTHONPATH`` with its tree and a torchvision stand-in when there is none (``--kohya_pythonpath``).

``--sample K``: a full run is hours of SVDs on a CPU; with K > 1 both tools run unchanged except that
the module list each builds is cut, in process, to the modules whose name's CRC32 is divisible by K
(the same modules for both; kohya still loads both models whole, ours reads only those modules). Both
tools' full module lists (names, wrapped weight shapes) are written before the cut and compared.

The two LoRA files are compared: key set, shapes, metadata keys; and for each module the relative error
``||D - LoRA delta|| / ||D||`` of the true weight change ``D`` (the two files' difference, float64).
Last line: ``time_ratio=<ours/kohya> rss_ratio=<ours/kohya> ...`` (targets <= 1.0 and <= 0.5).
Full-size runs need most of a 24 GiB machine and, on a CPU, hours of SVDs: run them one at a time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

TUNED_SEED = 77
CHANGE_RANK = 8
KINDS = {"sdxl": "sdxl", "sd15": "sd1"}


def perturbation(seed: int):
    """``perturb(key, weight)`` for ``build_model_file``: weight + rank-8 change + noise on every matrix."""
    generator = torch.Generator().manual_seed(seed)

    def perturb(key: str, weight: torch.Tensor) -> torch.Tensor:
        if weight.dim() < 2:
            return weight
        matrix = weight.reshape(weight.shape[0], -1)
        scale = float(matrix.std()) or 1.0
        left = torch.randn(matrix.shape[0], CHANGE_RANK, generator=generator)
        right = torch.randn(CHANGE_RANK, matrix.shape[1], generator=generator)
        change = (left @ right) * (0.2 * scale / math.sqrt(CHANGE_RANK))
        change += torch.randn(matrix.shape, generator=generator) * (0.02 * scale)
        return (matrix + change).reshape(weight.shape)

    return perturb


# Run a tool's script in process with its module list cut to a sample (see --sample); the full list
# (name, wrapped weight shape) is written to MODULES first. {tool}: "kohya" or "ours".
SAMPLED_RUN = r"""
import json, runpy, sys, zlib
script, tool, sample, modules_file, argv = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:]
keep = lambda name: zlib.crc32(name.encode()) % sample == 0
def dump(pairs):
    with open(modules_file, "w") as file:
        json.dump(sorted([name, list(shape)] for name, shape in pairs), file)
if tool == "kohya":
    sys.path[:0] = [script.rsplit("/", 1)[0], script.rsplit("/", 2)[0]]  # networks/, then kohya's library
    import lora
    create_network, dumped = lora.create_network, []
    def sampled(*args, **kwargs):
        network = create_network(*args, **kwargs)
        if not dumped:
            dump((m.lora_name, m.org_module.weight.shape) for m in network.text_encoder_loras + network.unet_loras)
            dumped.append(1)
        network.text_encoder_loras = [m for m in network.text_encoder_loras if keep(m.lora_name)]
        network.unet_loras = [m for m in network.unet_loras if keep(m.lora_name)]
        return network
    lora.create_network = sampled
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")
else:
    sys.path.insert(0, script.rsplit("/", 2)[0])
    from library.errors import exit_on_user_error
    from networks import extract_lora_from_models as extract
    extract_targets = extract.extract_targets
    def sampled(*args, **kwargs):
        text, unet = extract_targets(*args, **kwargs)
        dump((t.lora_name, t.shape) for t in text + unet)
        return [t for t in text if keep(t.lora_name)], [t for t in unet if keep(t.lora_name)]
    extract.extract_targets = sampled
    exit_on_user_error(lambda: extract.main(argv))
"""


def watched(command: list[str], env: dict[str, str], log: Path, rss_limit_gib: float) -> tuple[float, float, bool]:
    """Run ``command``: (wall seconds, peak RSS GiB, stopped at the RSS limit); its output goes to ``log``."""
    start = time.perf_counter()
    with open(log, "w") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        stopped, seen_kib = False, 0
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid == process.pid:
                process.returncode = os.waitstatus_to_exitcode(status)
                break
            try:
                with open(f"/proc/{process.pid}/status") as proc_status:
                    rss_kib = next(int(line.split()[1]) for line in proc_status if line.startswith("VmRSS:"))
            except (OSError, StopIteration):
                rss_kib = 0
            seen_kib = max(seen_kib, rss_kib)
            if rss_kib > rss_limit_gib * 2**20 and not stopped:
                process.kill()
                stopped = True
            time.sleep(0.2)
    wall = time.perf_counter() - start
    if process.returncode != 0 and not stopped:
        raise SystemExit(f"{command[1]} failed (exit {process.returncode}); see {log}")
    return wall, max(usage.ru_maxrss, seen_kib) / 2**20, stopped


def relative_errors(lora_path: Path, org: Path, tuned: Path, kind: str) -> dict[str, float]:
    """Per module of ``lora_path``: ||D - up @ down * alpha / rank|| / ||D||, D = tuned - org (float64)."""
    from library.model_weights import ModelWeights
    from networks import extract_lora_from_models as extract
    from networks.lora import lora_delta, lora_modules, read_lora_file

    modules = lora_modules(read_lora_file(str(lora_path)))
    unet, text_encoders = extract.architecture(argparse.Namespace(model_org=str(org), model_config_dir=None), kind)
    text_targets, unet_targets = extract.extract_targets(unet, text_encoders, kind, with_convs=False)
    errors = {}
    with ModelWeights(org, "org", kind, (unet, text_encoders)) as base, \
            ModelWeights(tuned, "tuned", kind, (unet, text_encoders)) as changed:
        reader = extract.DeltaReader(base, changed, None, torch.device("cpu"))
        for target in [*text_targets, *unet_targets]:
            if target.lora_name in modules:
                true_delta = reader.delta(target)
                approximation = lora_delta(modules[target.lora_name], torch.float64).reshape(true_delta.shape)
                errors[target.lora_name] = float((true_delta - approximation).norm() / true_delta.norm())
    return errors


def compare(ours: Path, kohya: Path) -> list[str]:
    """Differences in key set, shapes and metadata keys (empty: none)."""
    from safetensors import safe_open

    problems = []
    with safe_open(str(ours), "pt") as mine, safe_open(str(kohya), "pt") as theirs:
        if set(mine.keys()) != set(theirs.keys()):
            only = sorted(set(mine.keys()) ^ set(theirs.keys()))
            problems.append(f"key sets differ in {len(only)} keys, e.g. {only[:3]}")
        for key in set(mine.keys()) & set(theirs.keys()):
            if mine.get_slice(key).get_shape() != theirs.get_slice(key).get_shape():
                problems.append(f"{key}: shape {mine.get_slice(key).get_shape()} vs {theirs.get_slice(key).get_shape()}")
        metadata_ours, metadata_kohya = set(mine.metadata() or {}), set(theirs.metadata() or {})
        if metadata_ours != metadata_kohya:
            problems.append(f"metadata keys: only ours {sorted(metadata_ours - metadata_kohya)}, "
                            f"only kohya's {sorted(metadata_kohya - metadata_ours)}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=sorted(KINDS), default="sdxl")
    parser.add_argument("--work_dir", default="/tmp/bench_extract_lora")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--kohya_dir", required=True, help="a checkout of kohya's sd-scripts")
    parser.add_argument("--kohya_python", required=True, help="a Python with kohya's requirements")
    parser.add_argument("--kohya_pythonpath", default="", help="extra PYTHONPATH entries for kohya (e.g. stubs)")
    parser.add_argument("--sample", type=int, default=1, help="extract only the modules whose name's CRC32 is "
                        "divisible by this (both tools; see the docstring). Default: 1, all")
    parser.add_argument("--kohya_rss_limit_gib", type=float, default=14.0,
                        help="stop kohya's tool when its RSS passes this (a shared 24 GiB machine). Default: 14")
    parser.add_argument("--skip_kohya", action="store_true", help="reuse kohya's result of an earlier run")
    parser.add_argument("--keep", action="store_true", help="keep the model files")
    args = parser.parse_args()

    from bench_full_sdxl import build_model_file

    kind = KINDS[args.kind]
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    org, tuned = work / f"{args.kind}_org.safetensors", work / f"{args.kind}_tuned.safetensors"
    if not org.exists():
        build_model_file(org, kind=kind)
    if not tuned.exists():
        build_model_file(tuned, kind=kind, perturb=perturbation(TUNED_SEED))
    flags = ["--model_org", str(org), "--model_tuned", str(tuned), "--dim", str(args.dim), "--load_precision", "fp16",
             "--save_precision", "fp16", "--clamp_quantile", "0.99", "--min_diff", "0.01", "--device", "cpu"]
    if kind == "sdxl":
        flags += ["--sdxl", "--load_original_model_to", "cpu", "--load_tuned_model_to", "cpu"]
    env = dict(os.environ)
    results = {}
    ours_file, kohya_file = work / "ours.safetensors", work / "kohya.safetensors"
    ours_script = str(REPO / "networks" / "extract_lora_from_models.py")
    results["ours"] = watched([sys.executable, "-c", SAMPLED_RUN, ours_script, "ours", str(args.sample),
                               str(work / "ours_modules.json"), *flags, "--save_to", str(ours_file)],
                              env, work / "ours.log", 1e9)
    print(f"ours: {results['ours'][0]:.0f} s, peak RSS {results['ours'][1]:.2f} GiB", flush=True)
    kohya_result = work / "kohya_result.json"
    if args.skip_kohya and kohya_result.exists():
        results["kohya"] = tuple(json.loads(kohya_result.read_text()))
    else:
        kohya_env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [args.kohya_pythonpath, args.kohya_dir])))
        kohya_script = str(Path(args.kohya_dir).resolve() / "networks" / "extract_lora_from_models.py")
        results["kohya"] = watched([args.kohya_python, "-c", SAMPLED_RUN, kohya_script, "kohya", str(args.sample),
                                    str(work / "kohya_modules.json"), *flags, "--save_to", str(kohya_file)],
                                   kohya_env, work / "kohya.log", args.kohya_rss_limit_gib)
        kohya_result.write_text(json.dumps(results["kohya"]))
    wall, rss, stopped = results["kohya"]
    if stopped:
        print(f"kohya: stopped at {rss:.2f} GiB RSS after {wall:.0f} s (over --kohya_rss_limit_gib "
              f"{args.kohya_rss_limit_gib})", flush=True)
        print(f"time_ratio=n/a rss_ratio<{results['ours'][1] / rss:.3f} (kohya > {args.kohya_rss_limit_gib} GiB)")
        return
    print(f"kohya: {wall:.0f} s, peak RSS {rss:.2f} GiB", flush=True)
    ours_modules = json.loads((work / "ours_modules.json").read_text())
    kohya_modules = json.loads((work / "kohya_modules.json").read_text())
    print(f"full module lists: {len(ours_modules)} ours, {len(kohya_modules)} kohya's, "
          f"{'the same names and shapes' if ours_modules == kohya_modules else 'DIFFERENT'}", flush=True)
    problems = compare(ours_file, kohya_file)
    print("\n".join(problems) if problems else "same keys, shapes and metadata keys", flush=True)
    errors = {name: relative_errors(path, org, tuned, kind) for name, path in (("ours", ours_file), ("kohya", kohya_file))}
    common = sorted(set(errors["ours"]) & set(errors["kohya"]))
    worse = [name for name in common if errors["ours"][name] > errors["kohya"][name] + 1e-6]
    for name in ("ours", "kohya"):
        values = [errors[name][module] for module in common]
        print(f"{name}: relative error mean {sum(values) / len(values):.6f}, max {max(values):.6f}", flush=True)
    largest_excess = max(errors["ours"][m] - errors["kohya"][m] for m in common)
    if not args.keep:
        shutil.rmtree(work)
    print(f"time_ratio={results['ours'][0] / results['kohya'][0]:.3f} "
          f"rss_ratio={results['ours'][1] / results['kohya'][1]:.3f} modules={len(common)} "
          f"worse_than_kohya={len(worse)} largest_excess={largest_excess:.2e}")


if __name__ == "__main__":
    main()
