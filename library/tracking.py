"""Where step scalars go: accelerate's trackers (tensorboard, wandb) and a JSON-lines file.

Flag names and behaviour follow kohya-ss sd-scripts (``--logging_dir``, ``--log_with``,
``--log_prefix``, ``--log_tracker_name``, ``--log_tracker_config``, ``--log_config``,
``--wandb_run_name``, ``--wandb_api_key``); ``--log_jsonl`` is ours.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import time
from typing import Any, Mapping, Optional

import numpy as np
import toml

from library import atomic_files
from library.errors import UserError, first_line

DEFAULT_TRACKER_NAME = "network_train"
# Never sent to a tracker by --log_config: secrets. Paths are left out too (see logged_config).
_SECRETS = frozenset({"wandb_api_key", "huggingface_token"})
# wandb modes that never contact a server, so need no API key
_WANDB_KEYLESS_MODES = frozenset({"offline", "dryrun", "disabled"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The logging options shared by every trainer."""
    add = parser.add_argument
    add("--console_log_level", type=str, default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="level of the library log messages on the console (default INFO)")
    add("--console_log_file", type=str, default=None, help="also write the log messages to this file")
    add("--console_log_simple", action="store_true", help="log messages without time and source")
    add("--logging_dir", type=str, default=None, help="folder for tracker logs (tensorboard)")
    add("--log_with", type=str, default=None, choices=["tensorboard", "wandb", "all"],
        help="trackers to log to (default tensorboard when --logging_dir is given)")
    add("--log_prefix", type=str, default=None, help="prefix of the tracker log folder name")
    add("--log_tracker_name", type=str, default=None, help=f"tracker project name (default {DEFAULT_TRACKER_NAME})")
    add("--log_tracker_config", type=str, default=None,
        help="TOML file of tracker init options, by tracker name (e.g. [wandb] entity = ...); "
             "replaces the --wandb_run_name setting as in kohya")
    add("--log_config", action="store_true",
        help="send the run's options to the trackers (secrets and paths left out)")
    add("--wandb_run_name", type=str, default=None, help="wandb run name (set WANDB_MODE=offline to log offline)")
    add("--wandb_api_key", type=str, default=None,
        help="log in to wandb with this key before training (never written to configs or trackers)")
    add("--log_jsonl", type=str, default=None,
        help="also write every step's scalars as JSON lines to this file (for scripts and GUIs)")


def setup_console_log(args: argparse.Namespace) -> None:
    """kohya's console log options: level, an optional file, plain or detailed format. Without
    any of them Python's default stays (warnings and errors on stderr)."""
    if not (args.console_log_level or args.console_log_file or args.console_log_simple):
        return
    detailed = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if args.console_log_file:
        handlers.append(logging.FileHandler(args.console_log_file, encoding="utf-8"))
    logging.basicConfig(level=args.console_log_level or "INFO", handlers=handlers, force=True,
                        format="%(levelname)s %(message)s" if args.console_log_simple else detailed)


def tracker_names(args: argparse.Namespace) -> Optional[list[str]]:
    """accelerate tracker names for ``--log_with``; a tracker whose package is missing is a UserError."""
    if args.log_with == "all":
        names = ["tensorboard", "wandb"]
    elif args.log_with:
        names = [args.log_with]
    else:
        return ["tensorboard"] if args.logging_dir else None
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise UserError(f"--log_with {args.log_with}: wandb is not installed (pip install wandb; WANDB_MODE=offline "
                        f"logs without network), or use --log_with tensorboard")
    if "tensorboard" in names and not args.logging_dir:
        raise UserError(f"--log_with {args.log_with} needs --logging_dir DIR for the tensorboard event files")
    return names


def tracker_dir(args: argparse.Namespace) -> Optional[str]:
    """The run's tracker folder: ``<logging_dir>/<log_prefix><YYYYmmddHHMMSS>`` (kohya's layout)."""
    if not args.logging_dir:
        return None
    return os.path.join(args.logging_dir, (args.log_prefix or "") + time.strftime("%Y%m%d%H%M%S"))


def validate_arguments(args: argparse.Namespace) -> None:
    """Refuse a missing tracker package, an unreadable ``--log_tracker_config`` or wandb without
    credentials before anything loads."""
    if "wandb" in (tracker_names(args) or []):
        check_wandb_credentials(args)
    tracker_init_kwargs(args)


def check_wandb_credentials(args: argparse.Namespace) -> None:
    """``UserError`` when wandb would stop at ``wandb.init`` (after the models loaded) for want of an API key.

    A key is ``--wandb_api_key`` or whatever wandb's own lookup finds (``WANDB_API_KEY``, an
    identity token file, the netrc entry ``wandb login`` writes, wandb's settings file). The
    modes offline, dryrun and disabled (``WANDB_MODE``, wandb's settings file, or ``mode`` in
    ``--log_tracker_config``'s ``[wandb]`` table) need none. Reads environment and files only,
    never the network. Imports wandb: call only when it is requested.
    """
    try:  # wandb's own lookup (a private module): where a wandb lacks it, wandb.init reports a missing key
        from wandb.errors import AuthenticationError
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth
    except ImportError:
        return
    if args.wandb_api_key:
        problem = wbauth.check_api_key(args.wandb_api_key)
        if problem:
            raise UserError(f"--wandb_api_key: {problem}")
        return
    settings = wandb_setup.singleton().settings
    init_options = tracker_init_kwargs(args).get("wandb")
    mode = init_options.get("mode") if isinstance(init_options, dict) else None
    if (mode or settings.mode) in _WANDB_KEYLESS_MODES:
        return
    try:
        credentials = wbauth.authenticate_session(host=settings.base_url, source="--log_with", prompt=False,
                                                  update_session=False)
    except AuthenticationError as error:
        raise UserError(f"--log_with {args.log_with}: wandb credentials unusable ({first_line(error)}); run "
                        f"`wandb login`, pass --wandb_api_key KEY, or set WANDB_MODE=offline") from None
    if credentials is None:
        raise UserError(f"--log_with {args.log_with}: no wandb API key found; run `wandb login`, pass "
                        f"--wandb_api_key KEY, or set WANDB_MODE=offline to log offline")


def tracker_init_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Per-tracker init options: ``--log_tracker_config``'s file, else the wandb run name."""
    if args.log_tracker_config:
        try:
            with open(args.log_tracker_config, encoding="utf-8-sig") as file:
                return toml.load(file)
        except (OSError, UnicodeDecodeError, toml.TomlDecodeError) as error:
            raise UserError(f"--log_tracker_config {args.log_tracker_config}: cannot read it as TOML ({error})")
    return {"wandb": {"name": args.wandb_run_name}} if args.wandb_run_name else {}


def logged_config(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """The options ``--log_config`` sends to the trackers: plain values (lists and others as
    text), without secrets and without paths, which may name people or places (kohya drops
    a fixed list of path options; this drops every value that looks like a path)."""
    if not args.log_config:
        return None

    def is_path(value: Any) -> bool:
        if isinstance(value, (list, tuple)):
            return any(is_path(item) for item in value)
        return isinstance(value, str) and ("/" in value or "\\" in value or os.path.exists(value))

    config = {}
    for key, value in vars(args).items():
        if key in _SECRETS or is_path(value):
            continue
        config[key] = value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
    return config


def init_trackers(accelerator: Any, args: argparse.Namespace) -> None:
    """Start the trackers on the main process (after ``--wandb_api_key`` login when given)."""
    if not accelerator.is_main_process:
        return
    if args.wandb_api_key and "wandb" in (tracker_names(args) or []):
        import wandb

        wandb.login(key=args.wandb_api_key)
    try:
        accelerator.init_trackers(args.log_tracker_name or DEFAULT_TRACKER_NAME, config=logged_config(args),
                                  init_kwargs=tracker_init_kwargs(args))
    except TypeError as error:  # an init option the tracker does not take
        if not args.log_tracker_config:
            raise
        raise UserError(f"--log_tracker_config {args.log_tracker_config}: a tracker refused its options "
                        f"({first_line(error)})") from None


def log_sample_images(accelerator: Any, images: list[tuple[Any, str]], step: int) -> None:
    """Send sample images (PIL image, prompt) to the trackers as ``sample_<i>``: wandb with the
    prompt as caption (kohya's form), tensorboard as an image summary."""
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            import wandb

            tracker.log({f"sample_{index}": wandb.Image(image, caption=prompt)
                         for index, (image, prompt) in enumerate(images)}, step=step)
        elif tracker.name == "tensorboard":
            for index, (image, _) in enumerate(images):
                tracker.writer.add_image(f"sample_{index}", np.asarray(image), global_step=step, dataformats="HWC")
            tracker.writer.flush()


class JsonlLog:
    """Appends one JSON object per optimizer step (``{"step": N, ...scalars}``) to ``path``.

    Each line is written unbuffered, so a tailing GUI sees it at once. A resumed run
    first drops the lines of steps after the resumed step, so every step appears once.
    NaN/Inf are written as strings ("nan", "inf") to keep every line valid JSON. The file is
    replaced (or cut) only when the first line is written, atomically together with that
    line: a run that fails before its first step (a full disk included) leaves an old file
    as it was.
    """

    def __init__(self, path: str, resume_step: Optional[int] = None) -> None:
        self.path = path
        self._file = None
        kept = []
        if resume_step is not None and os.path.exists(path):
            with open(path, encoding="utf-8") as file:
                for line in file:
                    try:
                        if json.loads(line)["step"] <= resume_step:
                            kept.append(line if line.endswith("\n") else line + "\n")
                    except (ValueError, KeyError):
                        break  # a line cut by a crash ends the usable part
        self._kept = kept

    def append(self, step: int, scalars: Mapping[str, Any]) -> None:
        record = {"step": step}
        for key, value in scalars.items():
            record[key] = value if not isinstance(value, float) or math.isfinite(value) else str(value)
        line = json.dumps(record) + "\n"
        if self._file is None:  # the old file is replaced by one holding this run's first line
            atomic_files.write_file(self.path, "".join(self._kept) + line)
            self._file = open(self.path, "ab", buffering=0)
        else:
            atomic_files.append_to_open_file(self._file, line)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
