"""Training state you can kill -9: atomic state folders, a tracker file, rotation, verified resume.

A state folder holds everything the next step depends on (LoRA, optimizer, LR schedule,
loss scaler, gradient guard, EMA of the weights, RNGs, data position) plus ``manifest.json``: the format
version, the arguments that must not change on resume, and a SHA-256 of every file.
It is written under a temporary name and renamed when complete (``library.atomic_files``:
fsynced, so a power loss too leaves it whole or absent); only then is the tracker file
(``<output_name>-state.json`` in ``--output_dir``) replaced, atomically, and only then are
old states removed; a full disk leaves no partial state behind. So at any instant the newest
complete state is intact and findable; ``--resume auto`` verifies it and falls back to the
newest intact one (``find_resume_state``, before any model is loaded, also refuses a state
written with other protected arguments). A state whose LoRA or optimizer holds NaN/Inf (a
diverged run) is never written: it replaces, rotates away and hides no good state.
"""
from __future__ import annotations

import argparse
import copy
import io
import json
import math
import os
import random
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from library import atomic_files, healthy_point, kohya_state, optimizers
from library.config_file import key_value_items
from library.checkpoint_files import file_sha256
from library.datasets.config import parse_resolution_wh
from library.ema import EmaConfig
from library.errors import UserError, first_line
from library.lora_files import epoch_stem, epoch_to_remove, save_refusal, step_stem, step_to_remove

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE_SUFFIX = "-state"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--save_state", action="store_true",
                        help="write a training state folder at every save point and when training ends (for --resume)")
    parser.add_argument("--save_state_on_train_end", action="store_true",
                        help="write a training state folder <output_name>-state when training ends (also done "
                             "by --save_state, as in kohya)")
    parser.add_argument("--save_last_n_steps_state", type=int, default=None,
                        help="keep only step states of the last N steps, by --save_last_n_steps' rule (removed "
                             "after the new state is complete; default: --save_last_n_steps, else keep all)")
    parser.add_argument("--save_last_n_epochs_state", type=int, default=None,
                        help="keep only the last N epoch states, by --save_last_n_epochs' rule (removed after "
                             "the new state is complete; default: --save_last_n_epochs, else keep all)")
    parser.add_argument("--resume", type=str, default=None,
                        help="state folder to resume from, or 'auto': the newest intact state of this "
                             "--output_dir/--output_name (start fresh when there is none)")
    parser.add_argument("--initial_step", type=int, default=None,
                        help="start counting at this optimizer step (without a state: the weights, optimizer and "
                             "LR schedule start fresh); training runs until --max_train_steps")
    parser.add_argument("--initial_epoch", type=int, default=None,
                        help="start at the beginning of this epoch (1 = the first); --initial_step wins")
    parser.add_argument("--skip_until_initial_step", action="store_true",
                        help="with --initial_step, also skip the batches of the steps before it in its epoch "
                             "(default: the data starts at the beginning of that epoch)")


def validate_arguments(args: argparse.Namespace) -> None:
    for flag in ("initial_step", "initial_epoch"):
        value = getattr(args, flag)
        if value is not None and value < (0 if flag == "initial_step" else 1):
            raise UserError(f"--{flag} {value} must be at least {0 if flag == 'initial_step' else 1}")
    if args.initial_step is not None and args.max_train_epochs is None and args.initial_step >= args.max_train_steps:
        raise UserError(f"--initial_step {args.initial_step} must be below --max_train_steps {args.max_train_steps}")


def initial_progress(args: argparse.Namespace, steps_per_epoch: int, fresh: "Progress") -> "Progress":
    """``fresh`` moved to where ``--initial_step``/``--initial_epoch`` (or a kohya-ss state given to ``--resume``,
    as kohya does) start a run without a state of this trainer (a resumed run continues at its state's step).

    The global step and epoch start there, so step-keyed saves, logs and the end at
    ``--max_train_steps`` line up with a longer run; the data of each epoch is the same as in
    that run (keyed by seed and epoch). ``steps_per_epoch``: optimizer steps in one epoch.
    """
    if args.initial_step is not None:
        step = args.initial_step
    elif args.initial_epoch is not None:
        step = (args.initial_epoch - 1) * steps_per_epoch
    elif (kohya_step := kohya_state.resume_step(args.resume)) is not None:
        step = kohya_step
    else:
        return fresh
    if step >= args.max_train_steps:
        raise UserError(f"the initial step {step} (--initial_step/--initial_epoch, or --resume's kohya state) must "
                        f"be below --max_train_steps {args.max_train_steps}")
    step_in_epoch = step % steps_per_epoch if args.skip_until_initial_step else 0
    return replace(fresh, global_step=step, epoch=1 + step // steps_per_epoch,
                   batches_done=step_in_epoch * args.gradient_accumulation_steps)


def kept_states(args: argparse.Namespace) -> tuple[Optional[int], Optional[int]]:
    """(steps, epochs) the state rotation keeps: ``--save_last_n_steps_state`` /
    ``--save_last_n_epochs_state``, each falling back to the LoRA files' value as in kohya."""
    return (args.save_last_n_steps_state or args.save_last_n_steps,
            args.save_last_n_epochs_state or args.save_last_n_epochs)


def optimizer_non_finite(optimizer_state: dict[str, Any]) -> Optional[str]:
    """The first optimizer state tensor holding NaN/Inf (e.g. an overflowed Adam second moment,
    which would zero or poison every later update), as "exp_avg_sq of parameter 3"; None when finite.
    Only the per-parameter state: hyperparameters may be legitimately infinite (Prodigy's growth_rate)."""
    for index, values in optimizer_state.get("state", {}).items():
        for name, value in values.items():
            if torch.is_tensor(value) and value.is_floating_point() and not torch.isfinite(value).all():
                return f"{name} of parameter {index}"
    return None


def step_state_name(output_name: str, step: int) -> str:
    return step_stem(output_name, step) + STATE_SUFFIX


def epoch_state_name(output_name: str, epoch: int) -> str:
    return epoch_stem(output_name, epoch) + STATE_SUFFIX


def final_state_name(output_name: str) -> str:
    return f"{output_name}{STATE_SUFFIX}"


@dataclass
class Progress:
    """Where the run is: the next micro-batch to train is batch ``batches_done`` of ``epoch``."""

    global_step: int = 0
    epoch: int = 1
    batches_done: int = 0
    seed: int = 0
    training_started_at: float = 0.0
    session_id: int = 0
    non_finite_losses: int = 0
    loss_history: list[float] = field(default_factory=list)
    # the global step the current epoch's first batch trains after (token warm-up); None: not yet known
    epoch_first_step: Optional[int] = None

    def record_loss(self, loss: float, window: int) -> float:
        """Add a step's loss; returns the moving average over the last ``window`` finite losses
        (kohya's ``avr_loss``; NaN before any). Non-finite losses are counted, never averaged."""
        if math.isfinite(loss):
            self.loss_history = (self.loss_history + [loss])[-window:]
        else:
            self.non_finite_losses += 1
        return float(np.mean(self.loss_history)) if self.loss_history else math.nan

    def start_next_epoch(self) -> None:
        """The epoch is done: the next batch is the first of the next epoch."""
        self.epoch += 1
        self.batches_done = 0
        self.epoch_first_step = None

    def batches_since(self, position: tuple[int, int], batches_per_epoch: int) -> int:
        """Batches trained from ``position`` (epoch, batches done) to here, ``batches_per_epoch`` to an epoch."""
        epoch, batches_done = position
        return (self.epoch - epoch) * batches_per_epoch + self.batches_done - batches_done


def untrained_parts(args: argparse.Namespace) -> list[str]:
    """The LoRA parts whose learning rate is 0 (``--unet_lr``/``--text_encoder_lr``, else ``--learning_rate``):
    kohya leaves them untrained."""
    unet_lr, rates = optimizers.part_learning_rates(args)
    parts = ["unet"] if unet_lr == 0 else []
    if len(rates) == 1:  # one value for every text encoder
        return parts + (["text_encoders"] if rates[0] == 0 else [])
    return parts + [f"text_encoder{index + 1}" for index, lr in enumerate(rates) if lr == 0]


def protected_arguments(args: argparse.Namespace, num_processes: int) -> dict[str, Any]:
    """What a resumed run must share with the run that wrote the state."""
    model = args.pretrained_model_name_or_path
    model_size = os.path.getsize(model) if os.path.isfile(model) else None
    return {
        "model": os.path.basename(str(model).rstrip("/\\")),
        "model_size": model_size,
        "network_module": args.network_module,
        "base_weights": [os.path.basename(path) for path in args.base_weights or []],
        "base_weights_multiplier": list(args.base_weights_multiplier or []),
        "network_dim": args.network_dim,
        "network_alpha": args.network_alpha,
        "network_args": sorted(key_value_items(args.network_args)),
        "network_train_unet_only": bool(args.network_train_unet_only),
        "network_train_text_encoder_only": bool(args.network_train_text_encoder_only),
        # parts with learning rate 0 have no optimizer group: the optimizer state's layout depends on them
        "untrained_parts": untrained_parts(args),
        "mixed_precision": args.mixed_precision,
        "full_fp16": bool(args.full_fp16),
        "full_bf16": bool(args.full_bf16),
        "train_batch_size": args.train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "resolution": args.resolution,
        "seed": args.seed,
        "optimizer_type": args.optimizer_type,
        # the parameters' split into groups stepped alone: the optimizer state's layout (full fine-tuners only)
        "fused_optimizer_groups": None if getattr(args, "fused_backward_pass", False)
        else getattr(args, "fused_optimizer_groups", None) or None,
        "world_size": num_processes,
        # what shapes the EMA of the weights (None without one, as in states written before it existed)
        "ema": EmaConfig.from_args(args).averaging(),
    }


def comparable(key: str, value: Any) -> Any:
    """A protected argument as resume compares it: one setting spelled two ways is one value (``--resolution
    64`` is ``64,64``; optimizer names are case-insensitive, as ``--optimizer_type`` reads them)."""
    if key == "resolution" and value is not None:
        try:
            return list(parse_resolution_wh(value, "--resolution"))
        except UserError:
            return value
    if key == "optimizer_type" and isinstance(value, str):
        return value.lower()
    return value


def find_resume_state(args: argparse.Namespace, num_processes: int, sdxl: bool = False) -> Optional[Path]:
    """The state folder ``--resume`` names (a folder, or "auto": the newest intact one), verified and
    checked against this run's protected arguments; None to start fresh (no ``--resume``, or "auto"
    found no state). Reads manifests and checksums only, so a changed setting or a damaged state
    costs seconds, not a model load; call once the seed is known (it is a protected argument). ``sdxl``: the
    trainer's model family (a kohya state of the other one is refused)."""
    if not args.resume:
        return None
    store = StateStore(args.output_dir, args.output_name, protected_arguments(args, num_processes))
    path = store.resolve(args.resume)
    if path is not None and kohya_state.is_kohya_state(path):
        kohya_state.check_before_loading(path, args, sdxl)  # what its files tell; the rest as it loads
    elif path is not None:
        store.check_arguments(path)
    return path


# -- RNGs ---------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- files ----------------------------------------------------------------------------------
def _torch_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@dataclass
class TrainingState:
    """Everything read back from a state folder."""

    path: Path
    progress: Progress
    lora: dict[str, torch.Tensor]
    components: dict[str, Any]  # name -> state_dict (optimizer, lr_scheduler, loss_scaler, grad_guard, ...)
    rng: dict[str, Any]


def verify_state(path: Path) -> tuple[bool, str]:
    """(intact, reason): every file listed in the manifest exists with its checksum."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return False, "no manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as error:
        return False, f"unreadable manifest ({error})"
    if manifest.get("format_version") != FORMAT_VERSION:
        return False, f"format version {manifest.get('format_version')} (this trainer reads {FORMAT_VERSION})"
    for name, checksum in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return False, f"missing {name}"
        if file_sha256(file) != checksum:
            return False, f"checksum mismatch in {name}"
    return True, "intact"


class StateStore:
    """Writes, rotates, finds and reads the state folders of one run (``output_dir``/``output_name``).

    ``save_dtype`` is the LoRA files' dtype (``--save_precision``): a state whose LoRA could not be
    saved in it is refused like the files. ``before_rename`` is a test hook called after the files
    of a state are written and before it becomes visible (kill tests use it to die mid-write).
    """

    def __init__(self, output_dir: str, output_name: str, protected: dict[str, Any],
                 save_dtype: Optional[torch.dtype] = None,
                 before_rename: Optional[Callable[[Path], None]] = None) -> None:
        self.output_dir = Path(output_dir)
        self.output_name = output_name
        self.protected = protected
        self.save_dtype = save_dtype
        self.tracker = self.output_dir / f"{output_name}{STATE_SUFFIX}.json"
        self._before_rename = before_rename

    # -- writing ------------------------------------------------------------------------
    def save(self, name: str, progress: Progress, lora: dict[str, torch.Tensor],
             components: dict[str, Any], linked: Optional[dict[str, tuple[Path, str]]] = None) -> Optional[Path]:
        """Write state folder ``name`` completely, then rename it into place and point the tracker at it.
        ``linked``: name -> (an existing file, its SHA-256) that joins the state as a hard link (the
        healthy point on disk, ``library.healthy_point``).

        Returns None, writing nothing and printing one line, when the LoRA or the optimizer state
        holds NaN/Inf (or the LoRA overflows ``save_dtype``): the tracker keeps naming the last good state.
        """
        refusal = save_refusal(lora, self.save_dtype)
        if refusal is None and "optimizer" in components:
            bad_value = optimizer_non_finite(components["optimizer"])
            refusal = f"the optimizer's {bad_value} holds NaN/Inf (the training diverged)" if bad_value else None
        if refusal is not None:
            newest = self._tracked_name()
            keeps = f"{newest} stays the newest state (--resume auto resumes it)" if newest else "no state is kept"
            print(f"\nnot saving state {name}: {refusal}; {keeps}", flush=True)
            return None
        linked = linked or {}
        trained = {key: value.detach().cpu().contiguous() for key, value in lora.items()}
        # the trained weights and the optimizer state are streamed to their files (a full model's state
        # does not fit in memory a second time as bytes)
        written = {
            "components.pt": lambda path: torch.save(components, path),
            "lora.safetensors": lambda path: save_file(trained, str(path)),
            "progress.json": json.dumps(asdict(progress)).encode("utf-8"),
            "rng.pt": _torch_bytes(rng_state()),
        }

        def write_manifest(path: Path) -> None:
            # the files above are in the temporary folder already: their checksums are read back from it
            checksums = {file_name: file_sha256(path.with_name(file_name)) for file_name in written}
            checksums.update({file_name: checksum for file_name, (_, checksum) in linked.items()})
            manifest = {"format_version": FORMAT_VERSION, "global_step": progress.global_step,
                        "arguments": self.protected, "files": checksums}
            path.write_text(json.dumps(manifest, indent=1))

        final = self.output_dir / name
        atomic_files.write_folder(final, {**written, MANIFEST: write_manifest}, before_rename=self._before_rename,
                                  linked={file_name: source for file_name, (source, _) in linked.items()},
                                  needed_bytes=healthy_point.tensor_bytes((trained, components)))
        atomic_files.write_file(self.tracker, json.dumps({"state": name, "global_step": progress.global_step}))
        return final

    def rotate(self, kind: str, current: int, every: int, keep: Optional[int]) -> None:
        """After the state of step (kind 'step') or epoch (kind 'epoch') ``current`` is complete,
        remove the one state kohya removes then (``lora_files.step_to_remove`` / ``epoch_to_remove``;
        saves every ``every`` steps/epochs, ``keep`` from ``kept_states``). Only that one: like
        kohya, states left by other settings are not swept."""
        if kind == "step":
            old = step_to_remove(current, every, keep)
            name = step_state_name(self.output_name, old) if old is not None else None
        else:
            old = epoch_to_remove(current, every, keep)
            name = epoch_state_name(self.output_name, old) if old is not None else None
        if name is not None and (self.output_dir / name).is_dir():
            shutil.rmtree(self.output_dir / name)
            print(f"removed old state {self.output_dir / name}", flush=True)

    def _tracked_name(self) -> Optional[str]:
        """The state folder the tracker names (None: no tracker, or unreadable)."""
        try:
            return json.loads(self.tracker.read_text())["state"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def remove_partial_writes(self) -> None:
        """Delete temporary folders left by a state write that was killed before its rename. Every
        process of a multi-process run looks at the same time: one that finds a folder already gone
        (removed by another) goes on."""
        if not self.output_dir.is_dir():
            return
        for path in self.output_dir.iterdir():
            if path.is_dir() and atomic_files.is_temporary(path.name, self.output_name):
                shutil.rmtree(path, ignore_errors=True)
                print(f"removed the partial state write {path}")

    # -- finding and reading ------------------------------------------------------------------
    def candidates(self) -> list[Path]:
        """This run's complete-looking state folders, newest (highest step) first."""
        if not self.output_dir.is_dir():
            return []
        found = []
        for path in self.output_dir.iterdir():
            if path.is_dir() and path.name.startswith(self.output_name) and path.name.endswith(STATE_SUFFIX):
                try:
                    step = json.loads((path / MANIFEST).read_text()).get("global_step", -1)
                except (OSError, ValueError):
                    step = -1
                found.append((step, path.name, path))
        return [path for _, _, path in sorted(found, reverse=True)]

    def resolve(self, resume: str) -> Optional[Path]:
        """The state folder to resume from (None: ``auto`` found nothing, start fresh)."""
        self.remove_partial_writes()
        if resume != "auto":
            path = Path(resume)
            if not path.is_dir():
                raise UserError(f"--resume {resume}: no such state folder")
            if kohya_state.is_kohya_state(path):
                return path
            intact, reason = verify_state(path)
            if not intact:
                raise UserError(f"--resume {resume}: the state is damaged ({reason}); use another state or --resume auto")
            return path
        tracked = None
        if self.tracker.is_file():
            try:
                tracked = self.output_dir / json.loads(self.tracker.read_text())["state"]
            except (OSError, ValueError, KeyError):
                print(f"--resume auto: tracker {self.tracker} is unreadable; looking for the newest intact state")
        if tracked is not None:
            intact, reason = verify_state(tracked)
            if intact:
                print(f"--resume auto: resuming from {tracked} (named by {self.tracker.name})")
                return tracked
            print(f"--resume auto: {tracked} named by the tracker is unusable ({reason}); trying older states")
        for path in self.candidates():
            intact, reason = verify_state(path)
            if intact:
                print(f"--resume auto: resuming from {path}, the newest intact state")
                return path
            print(f"--resume auto: skipping {path} ({reason})")
        print("--resume auto: no state found; starting from the beginning")
        return None

    def check_arguments(self, path: Path) -> None:
        """Refuse a state written with other protected arguments (its manifest lists them)."""
        manifest = json.loads((path / MANIFEST).read_text())
        saved = manifest.get("arguments", {})
        for key in sorted(set(saved) | set(self.protected)):
            if comparable(key, saved.get(key)) != comparable(key, self.protected.get(key)):
                raise UserError(
                    f"--resume {path}: the state was written with {key}={saved.get(key)!r}, this run has "
                    f"{key}={self.protected.get(key)!r}; resume with the same settings"
                )

    def load(self, path: Path) -> TrainingState:
        """Read a verified state; refuse one written with different protected arguments."""
        self.check_arguments(path)
        progress = Progress(**json.loads((path / "progress.json").read_text()))
        components = torch.load(path / "components.pt", map_location="cpu", weights_only=False)
        rng = torch.load(path / "rng.pt", map_location="cpu", weights_only=False)
        return TrainingState(path, progress, load_file(path / "lora.safetensors"), components, rng)


def copied(value: Any, device: torch.device | str = "cpu") -> Any:
    """A deep copy of a state (nested dicts, lists, tuples) with every tensor copied to ``device``, so
    that neither the copy nor what is later loaded from it shares memory with the live objects."""
    if torch.is_tensor(value):
        return value.detach().to(device, copy=True)
    if isinstance(value, dict):
        return type(value)((key, copied(item, device)) for key, item in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(copied(item, device) for item in value)
    return copy.deepcopy(value)


HEALTHY_POINT = "healthy_point"
"""Where a state folder's ``components.pt`` keeps the healthy point (see ``RunStates.capture``): the point
itself when it is in memory; ``{step, position, file, sha256}`` when it is on disk, ``file`` naming the
state's own hard link of it (``healthy_point.STATE_FILE``)."""


class RunStates:
    """Saving and resuming one run's state: the LoRA ``network`` and the stateful ``components``
    (name -> object with ``state_dict``/``load_state_dict``: optimizer, LR schedule, guard, ...),
    and a copy of them, the *healthy point*, that a diverging run rewinds to: in CPU memory, or on
    disk where ``place`` says it does not fit (``library.healthy_point``, ``--healthy_point_location``).

    The healthy point is saved with every state, so a resumed run rewinds exactly as the
    uninterrupted one. ``not_captured``: components the healthy point leaves out (the healing
    policy itself, whose rewind history must survive the rewind).
    """

    def __init__(self, store: StateStore, network: torch.nn.Module, components: dict[str, Any],
                 not_captured: tuple[str, ...] = (), place: Optional[healthy_point.HealthyPointPlace] = None) -> None:
        self.store = store
        self.network = network
        self.components = components
        self.not_captured = not_captured
        self.place = place or healthy_point.HealthyPointPlace()
        self.healthy_point: Optional[dict[str, Any]] = None

    def capture(self, step: int, position: tuple[int, int]) -> None:
        """Keep the network, the captured components and the RNGs as the state after ``step`` (in CPU
        memory, or written to this process's file); ``position``: (epoch, batches done) of the data then."""
        self.healthy_point = self.snapshot(step, position, self.place)

    def snapshot(self, step: int, position: tuple[int, int], place: healthy_point.HealthyPointPlace) -> dict[str, Any]:
        """The state now as a point ``restore`` takes: copies in CPU memory, or ``place``'s file."""
        network = self.network.training_state_dict()
        components = {name: component.state_dict() for name, component in self.components.items()
                      if name not in self.not_captured}
        size = healthy_point.tensor_bytes((network, components))
        if place.on_disk(size):
            return place.write(step, list(position), {"network": network, "components": components, "rng": rng_state()})
        place.kept_in_memory(size)
        return {
            "step": step,
            "position": list(position),
            "network": copied(network),
            "components": {name: copied(state) for name, state in components.items()},
            "rng": copied(rng_state()),
        }

    def restore(self, device: torch.device, point: Optional[dict[str, Any]] = None) -> int:
        """Put the healthy point (or ``point``) back into the live objects (copies: it can be restored
        again); its step."""
        point = point or self.healthy_point
        kept = healthy_point.read(point) if healthy_point.is_on_disk(point) else point
        self.network.load_training_state_dict({key: value.to(device) for key, value in kept["network"].items()})
        for name, state in kept["components"].items():
            self.components[name].load_state_dict(copied(state))
        set_rng_state(copied(kept["rng"]))
        return point["step"]

    def healthy_point_bytes(self) -> int:
        """Bytes the healthy point holds (its tensors in memory, or its file)."""
        if healthy_point.is_on_disk(self.healthy_point):
            return self.healthy_point["bytes"]
        return healthy_point.tensor_bytes(self.healthy_point or {})

    def close(self) -> None:
        """The run ended: this process's healthy point file goes (a state saved with it holds its own link)."""
        self.place.clear(remove_folder=True)

    def resume(self, path: Optional[Path], device: torch.device) -> Optional[Progress]:
        """Load the state folder ``path`` (from ``find_resume_state``) into the network, the components
        and the RNGs; returns its progress, or None to start fresh (``path`` None)."""
        self.place.clear()  # a file a killed run left behind is no healthy point of this one
        if path is None:
            return None
        if kohya_state.is_kohya_state(path):  # its step is the run's initial step (initial_progress)
            kohya_state.restore(path, self.network, self.components, device)
            return None
        state = self.store.load(path)
        self.network.load_training_state_dict({key: value.to(device) for key, value in state.lora.items()})
        self.healthy_point = self._resumed_point(state.components.get(HEALTHY_POINT), path)
        for name, component in self.components.items():
            if name not in state.components and getattr(component, "STATE_OPTIONAL", False):
                continue  # written before this component existed: it starts fresh
            try:
                component.load_state_dict(state.components[name])
            except (KeyError, ValueError, RuntimeError) as error:
                raise UserError(f"--resume {path}: its {name} does not fit this run ({first_line(error)}); "
                                f"resume with the settings that wrote it") from None
        set_rng_state(state.rng)
        print(f"resumed at step {state.progress.global_step} (epoch {state.progress.epoch})")
        return state.progress

    def _resumed_point(self, point: Optional[dict[str, Any]], path: Path) -> Optional[dict[str, Any]]:
        """The state's healthy point where this run keeps it: a state's file is linked as this process's
        file (read into memory with ``--healthy_point_location memory``); a point in memory is written to
        the file with ``--healthy_point_location disk``."""
        if point is None:
            return None
        if healthy_point.is_on_disk(point):
            point = {**point, "file": str(path / point["file"])}
            if self.place.location != "memory":
                return self.place.link(point)
            kept = healthy_point.read(point)
            return {"step": point["step"], "position": point["position"], "network": copied(kept["network"]),
                    "components": copied(kept["components"]), "rng": copied(kept["rng"])}
        if self.place.location == "disk":
            return self.place.write(point["step"], point["position"], {
                key: point[key] for key in ("network", "components", "rng")})
        return point

    def save(self, name: str, progress: Progress) -> bool:
        """Write state folder ``name`` (atomically, see ``StateStore.save``); False when refused. A healthy
        point on disk joins the state as a hard link of its file."""
        components = {key: component.state_dict() for key, component in self.components.items()}
        linked = {}
        if healthy_point.is_on_disk(self.healthy_point):
            point, digest = self.healthy_point, healthy_point.checksum(self.healthy_point)
            components[HEALTHY_POINT] = {"step": point["step"], "position": point["position"],
                                         "file": healthy_point.STATE_FILE, "sha256": digest}
            linked[healthy_point.STATE_FILE] = (Path(point["file"]), digest)
        elif self.healthy_point is not None:
            components[HEALTHY_POINT] = self.healthy_point
        return self.store.save(name, progress, self.network.training_state_dict(), components, linked) is not None
