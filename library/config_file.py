"""kohya's ``--config_file`` (options from a TOML file) and ``--output_config`` (options to a TOML file).

Reading follows kohya's ``read_config_from_file``: sections are only for grouping and are
flattened, a key is an option's dest (``learning_rate``, not ``--learning-rate``) and the
command line wins over the file. Unlike kohya, a value from the file goes through the same
``type``/``choices`` checks as on the command line, and the quirks of files written by the
kohya_ss GUI are accepted (see ``read_config_file``).

Writing follows kohya's ``--output_config``: ``--config_file`` names the file to write
(``.toml`` is appended when missing), an existing file is never overwritten, and the script
exits after writing. The file holds every option the user set, so reading it back gives the
same values *and* the same set of explicitly set options.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Container, Iterable, Sequence

try:  # Python >= 3.11
    import tomllib as _toml_reader
except ImportError:  # pragma: no cover - Python 3.10 uses the ``toml`` package from requirements.txt
    import toml as _toml_reader  # type: ignore[no-redef]

from library import atomic_files
from library.errors import UserError

logger = logging.getLogger(__name__)

CONFIG_SUFFIX = ".toml"
# Never written by --output_config: the config options themselves and secrets (kohya drops wandb_api_key).
_NOT_WRITTEN = frozenset({"config_file", "output_config", "wandb_api_key", "huggingface_token"})
# Keys of a file that name config options: they are ignored, not reported as unknown.
_IGNORED_KEYS = frozenset({"config_file", "output_config"})
# kohya_ss GUI writes max_token_length = 75 for "the default"; kohya's choices are None, 150, 225.
_GUI_DEFAULT_TOKEN_LENGTH = 75
_ACCUMULATING_ACTIONS = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``--config_file`` and ``--output_config``."""
    parser.add_argument(
        "--config_file",
        type=str,
        default=None,
        help="TOML file with options (keys are option names without '--'; sections are ignored; "
        "'.toml' is appended when the name has no such suffix and does not exist as given). "
        "Options on the command line win over the file. Default: none.",
    )
    parser.add_argument(
        "--output_config",
        action="store_true",
        help="write the options given on the command line to the TOML file named by --config_file "
        "(never overwrites an existing file) and exit without training. Default: off.",
    )


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> tuple[argparse.Namespace, set[str]]:
    """Parse ``argv`` (default ``sys.argv[1:]``), merged with ``--config_file`` when given.

    Returns the namespace and the set of dests the user set explicitly, on the command line
    or in the file (a file value meaning "not set", such as ``""``, does not count). Command-line
    errors exit through argparse as usual; file errors raise ``UserError``.

    With ``--output_config`` the options are written to the ``--config_file`` path instead
    (see ``write_config``) and ``SystemExit(0)`` is raised.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    explicit = dests_given_on_command_line(parser, argv)
    config_file = getattr(args, "config_file", None)

    if getattr(args, "output_config", False):
        if not config_file:
            raise UserError("--output_config needs --config_file PATH naming the TOML file to write")
        path = Path(config_file if config_file.endswith(CONFIG_SUFFIX) else config_file + CONFIG_SUFFIX)
        if path.exists():
            raise UserError(f"--output_config: {path} already exists; name a new file with --config_file")
        write_config(args, parser, path, explicit)
        print(f"wrote the options to {path}; run with --config_file {path} to use them", flush=True)
        raise SystemExit(0)

    if config_file:
        for dest, value in read_config_file(parser, resolve_config_path(config_file)).items():
            if dest not in explicit:
                setattr(args, dest, value)
            explicit.add(dest)
    return args, explicit


def boolean_word(text: str) -> bool | None:
    """A kohya-style boolean value of ``key=value`` options: true/false, 1/0, yes/no in any case
    (the GUI writes Python's ``True``/``False``); None for anything else."""
    return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.strip().lower())


def key_value_items(items: Iterable[str] | None) -> list[str]:
    """The ``key=value`` pairs of kohya-style options (``--network_args``, ``--optimizer_args``,
    ``--lr_scheduler_args``): an item may hold several pairs separated by spaces, as the kohya_ss GUI
    passes them ("conv_dim=4 conv_alpha=1"); a space not followed by ``name=`` stays in the value."""
    return [pair for item in items or () for pair in re.split(r"\s+(?=[A-Za-z_]\w*=)", item.strip()) if pair]


def resolve_config_path(name: str | os.PathLike[str]) -> Path:
    """The file ``--config_file name`` reads: ``name`` itself if it ends in ``.toml`` or exists, else ``name.toml``."""
    path = Path(name)
    if str(name).endswith(CONFIG_SUFFIX) or path.exists():
        return path
    return Path(str(name) + CONFIG_SUFFIX)


def dests_given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """Dests of the optional arguments present in ``argv``, even when given their default value.

    Parses ``argv`` once more into a namespace pre-filled with a marker, so argparse fills in
    no defaults and only the options present overwrite the marker.
    """
    unset = object()
    actions = _optional_actions(parser)
    accumulating = {action.dest for action in actions if isinstance(action, _ACCUMULATING_ACTIONS)}
    # Accumulating actions (append, count) add to the current value, so they start from None.
    marker = {action.dest: (None if action.dest in accumulating else unset) for action in actions}
    probe = argparse.Namespace(**marker)
    parser.parse_args(list(argv), namespace=probe)
    return {dest for dest, start in marker.items() if getattr(probe, dest) is not start}


def read_config_file(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """The options a TOML file sets, by dest, converted and checked as on the command line.

    - Top-level tables are flattened (their names are ignored). An option set in two tables (kohya:
      the later wins, silently) or in a table inside a table (``[a.b]``, which kohya drops silently)
      is refused.
    - ``""`` and ``[]`` mean "not set". ``false`` for a ``store_true`` flag means not set;
      ``true``/``false`` set a ``BooleanOptionalAction``; ``0``/``1`` are read as booleans for
      flags (kohya_ss GUI writes ``persistent_data_loader_workers = 1``).
    - A list sets an option taking several values; a single value is a one-item list.
    - ``max_token_length = 75`` means the default when 75 is not among the option's choices.
    - Keys no option defines are listed, with their tables (``model.epoch``), in one warning
      line and otherwise ignored.

    Raises ``UserError`` naming the file (and the key) for a missing or unreadable file,
    invalid TOML, or a value the option would reject on the command line.
    """
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows Notepad) is no TOML
    except FileNotFoundError:
        raise UserError(f"--config_file {path}: no such file; give the path of a TOML file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--config_file {path}: cannot read it as UTF-8 text: {error}") from None
    try:
        document = _toml_reader.loads(text)
    except ValueError as error:  # both TOML readers raise ValueError subclasses
        raise UserError(f"--config_file {path}: not valid TOML: {_one_line(error)}") from None

    actions_by_dest: dict[str, list[argparse.Action]] = {}
    for action in _optional_actions(parser):
        actions_by_dest.setdefault(action.dest, []).append(action)

    values: dict[str, Any] = {}
    unknown: list[str] = []
    first_seen: dict[str, str] = {}  # option -> where it was first set
    for where, key, raw in _flatten(document, actions_by_dest):
        if key in _IGNORED_KEYS:
            continue
        if key not in actions_by_dest:
            unknown.append(where)
            continue
        if key in first_seen:  # kohya lets the later table win silently: which one was meant is unknowable
            raise UserError(f"--config_file {path}: {key} is set twice, as {first_seen[key]} and as {where}; "
                            f"keep one of them")
        first_seen[key] = where
        if where.count(".") > 1 and not isinstance(raw, dict):  # [a.b] key: kohya drops it silently
            section, _, _ = where.rpartition(".")
            raise UserError(f"--config_file {path}: {where}: a table inside a table ([{section}]) is not read; "
                            f"move {key} into [{section.partition('.')[0]}] or to the top of the file")
        is_set, value = _value_from_file(parser, actions_by_dest[key], key, raw, path)
        if is_set:
            values[key] = value
    if unknown:
        logger.warning(
            "--config_file %s: ignoring %d key(s) that no option of this script defines: %s",
            path, len(unknown), ", ".join(unknown),
        )
    return values


def write_config(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    path: str | os.PathLike[str],
    explicit: Iterable[str] | None = None,
) -> Path:
    """Write ``args`` as a flat TOML file that ``--config_file`` reads back to the same values.

    Written: the options in ``explicit`` (pass the set from ``parse_args`` so that reading the
    file back marks the same options explicit) plus every option whose value differs from its
    default. Never written: ``None`` and ``""`` values (TOML has no null; both read back as
    "not set"), ``config_file``, ``output_config`` and secrets (``wandb_api_key``,
    ``huggingface_token``). Paths become strings, tuples lists. Values a TOML file cannot
    reproduce exactly are left out with a warning naming them. The file is replaced atomically
    (temporary file + rename); returns its path.
    """
    path = Path(path)
    explicit = set(explicit or ())
    lines = [f"# options written by --output_config; use them with --config_file {path.name}"]
    not_reproducible: list[str] = []
    actions_by_dest: dict[str, list[argparse.Action]] = {}
    for action in _optional_actions(parser):
        actions_by_dest.setdefault(action.dest, []).append(action)

    for dest, actions in actions_by_dest.items():
        if dest in _NOT_WRITTEN or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if dest not in explicit and _equals_default(parser, actions[0], value):
            continue
        if value is None or value == "":
            continue
        toml_value = _to_toml_value(value)
        try:
            is_set, read_back = _value_from_file(parser, actions, dest, toml_value, path)
        except UserError:
            is_set, read_back = False, None
        if not is_set or read_back != value:
            not_reproducible.append(dest)
            continue
        lines.append(f"{_toml_key(dest)} = {_format_toml(toml_value)}")
    if not_reproducible:
        logger.warning(
            "--output_config %s: left out option(s) whose value a TOML file cannot reproduce: %s",
            path, ", ".join(not_reproducible),
        )
    atomic_files.write_file(path, "\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# Reading: one TOML value -> the value argparse would have produced


def _value_from_file(
    parser: argparse.ArgumentParser, actions: list[argparse.Action], key: str, raw: Any, path: Path
) -> tuple[bool, Any]:
    """``(True, value)`` for a value that sets the option, ``(False, None)`` for "not set"."""

    flag = actions[0].option_strings[0]

    def fail(reason: str) -> UserError:
        return UserError(f"--config_file {path}: {key} = {_show(raw)}: {reason}")

    if (isinstance(raw, str) and raw == "") or (isinstance(raw, list) and not raw):
        return False, None
    if isinstance(raw, dict):
        raise fail(f"a table is not a value of {flag}")

    flag_actions = [action for action in actions if action.nargs == 0]
    value_actions = [action for action in actions if action.nargs != 0]

    if flag_actions and (isinstance(raw, bool) or (type(raw) is int and raw in (0, 1))):
        for action in flag_actions:
            if isinstance(action, argparse.BooleanOptionalAction):
                return True, bool(raw)
        for action in flag_actions:
            if isinstance(action, argparse._CountAction):
                return (True, int(raw)) if raw else (False, None)
        for action in flag_actions:
            if isinstance(action, argparse._StoreConstAction) and action.const is bool(raw):
                return True, action.const
        return False, None  # e.g. false for a store_true flag: same as leaving it out
    if flag_actions and not value_actions:
        if isinstance(flag_actions[0], argparse._CountAction) and type(raw) is int and raw >= 0:
            return (True, raw) if raw else (False, None)
        raise fail(f"{flag} is a flag: use true or false")

    action = value_actions[0]
    if (
        key == "max_token_length"
        and raw == _GUI_DEFAULT_TOKEN_LENGTH
        and action.choices is not None
        and _GUI_DEFAULT_TOKEN_LENGTH not in action.choices
    ):
        return False, None

    takes_list = action.nargs not in (None, argparse.OPTIONAL) or isinstance(action, argparse._AppendAction)
    if not takes_list:
        if isinstance(raw, list):
            raise fail(f"{flag} takes one value, not a list")
        return True, _convert_one(parser, action, raw, fail)
    items = raw if isinstance(raw, list) else [raw]
    if isinstance(action.nargs, int) and len(items) != action.nargs:
        raise fail(f"{flag} takes exactly {action.nargs} values")
    return True, [_convert_one(parser, action, item, fail) for item in items]


def _convert_one(parser: argparse.ArgumentParser, action: argparse.Action, item: Any, fail: Any) -> Any:
    """Run one TOML scalar through the action's ``type`` and ``choices`` like argparse does."""
    flag = action.option_strings[0]
    if isinstance(item, (list, dict)):
        raise fail(f"{flag} takes plain values, not nested lists or tables")
    if isinstance(item, bool):
        raise fail(f"{flag} takes a value, not true/false")
    convert = parser._registry_get("type", action.type, action.type) or str
    if isinstance(item, str):
        text = item
    elif isinstance(item, float) and convert is int and item.is_integer():
        text = str(int(item))  # GUIs write 16.0 for integer fields
    else:
        text = str(item)
    try:
        value = convert(text)
    except argparse.ArgumentTypeError as error:
        raise fail(_one_line(error)) from None
    except (TypeError, ValueError):
        raise fail(f"not a valid {getattr(convert, '__name__', repr(convert))} value for {flag}") from None
    if action.choices is not None and value not in action.choices:
        valid = ", ".join(repr(choice) for choice in action.choices if choice is not None)
        raise fail(f"{flag} must be one of {valid}")
    return value


def _flatten(table: dict[str, Any], options: Container[str], prefix: str = "") -> list[tuple[str, str, Any]]:
    """(key with its tables, key, value) of every value of ``table``, the keys of nested tables included,
    in file order. A section's name only groups its keys (kohya); a table inside a section that is
    named like an option stays one value (the option's reader refuses it)."""
    entries = []
    for key, value in table.items():
        if isinstance(value, dict) and not (prefix and key in options):
            entries.extend(_flatten(value, options, f"{prefix}{key}."))
        else:
            entries.append((f"{prefix}{key}", key, value))
    return entries


def _optional_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        action
        for action in parser._actions
        if action.option_strings
        and action.dest != argparse.SUPPRESS
        and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))
    ]


# ---------------------------------------------------------------------------------------------
# Writing


def _equals_default(parser: argparse.ArgumentParser, action: argparse.Action, value: Any) -> bool:
    default = parser.get_default(action.dest)
    if isinstance(default, str) and action.type is not None:
        try:  # argparse converts string defaults through ``type``
            default = parser._registry_get("type", action.type, action.type)(default)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            pass
    return value == default


def _to_toml_value(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [_to_toml_value(item) for item in value]
    return str(value)


def _format_toml(value: Any) -> str:
    """TOML text for a scalar or (nested) list. Own writer: ``toml.dumps`` mangles ``\\x`` in Windows paths."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_format_toml(item) for item in value) + "]"
    return _toml_string(str(value))


def _toml_string(text: str) -> str:
    escaped = []
    for char in text:
        if char == "\\":
            escaped.append("\\\\")
        elif char == '"':
            escaped.append('\\"')
        elif char == "\n":
            escaped.append("\\n")
        elif char == "\t":
            escaped.append("\\t")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\u{ord(char):04x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def _toml_key(key: str) -> str:
    if key and all(char.isascii() and (char.isalnum() or char in "_-") for char in key):
        return key
    return _toml_string(key)


def _show(raw: Any) -> str:
    return _format_toml(_to_toml_value(raw)) if not isinstance(raw, dict) else "{...}"


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
