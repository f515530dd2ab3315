"""Files and folders written so that a crash, ``kill -9`` or a power loss leaves the old version or
the new one, never a mix, and a full disk costs one line.

Every file the project writes in place of an earlier one goes through here. The data goes to a
temporary name beside the target (``.<name>.tmp<pid>``, see :func:`temporary_path`), is flushed
and fsynced, renamed over the target, and then the folder is fsynced, so the rename itself is on
disk when the call returns (a rename alone may still be lost at a power cut). On any error the
temporary is removed and the target is untouched. No space left (ENOSPC, or EDQUOT for a quota)
raises :class:`DiskFull` naming the path and the bytes the write needed.

Appends (the logs' rows) go through :func:`append_to_file` (fsynced) or :func:`append_to_open_file`;
a full disk is reported the same way.

Test hook: :func:`simulate_full_disk` makes every write of this module fail with ENOSPC once a
byte budget is spent, part-way through the write that exhausts it, as a full disk does
(``--debug_disk_full_after_bytes``, ``library.fault_injection``).
"""
from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

from library.errors import NO_SPACE_ERRNOS, DiskFull

TEMPORARY_MARK = ".tmp"
# Bytes the simulated disk still takes (None: the real disk decides).
_simulated_space_left: Optional[int] = None


def simulate_full_disk(after_bytes: Optional[int]) -> None:
    """Make the disk look full to this module once ``after_bytes`` more bytes were written (None: off)."""
    global _simulated_space_left
    _simulated_space_left = after_bytes


def temporary_path(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place: a hidden name in the same folder."""
    return path.with_name(f".{path.name}{TEMPORARY_MARK}{os.getpid()}")


def is_temporary(name: str, target_prefix: str = "") -> bool:
    """Whether ``name`` is a temporary of :func:`temporary_path` for a target whose name starts with
    ``target_prefix`` (left behind only by a process killed mid-write)."""
    return name.startswith(f".{target_prefix}") and TEMPORARY_MARK in name


def fsync_folder(folder: Path) -> None:
    """Make a folder's entries (a rename, a new file) durable. Windows cannot open a folder for
    fsync; NTFS journals renames itself."""
    if os.name == "nt":
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_file(path: str | os.PathLike, data: bytes | str) -> None:
    """Replace ``path`` by ``data`` (text is written as UTF-8, newlines as given) atomically and durably;
    creates the folder. ``DiskFull`` when the disk has no room: ``path`` is then as it was."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(path)
    with no_space_is_disk_full(path, len(payload)), _removed_on_error(temporary):
        with open(temporary, "wb", buffering=0) as file:
            _write_durably(file, payload)
        os.replace(temporary, path)
        fsync_folder(path.parent)


def rename_file(path: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rename ``path`` to ``target`` (replacing it) atomically and durably (the folder is synced)."""
    os.replace(path, target)
    fsync_folder(Path(target).parent)


@contextlib.contextmanager
def writing_file(path: str | os.PathLike, needed_bytes: int) -> Iterator[Path]:
    """For writers that take a file name (e.g. safetensors' ``save_file`` of a large checkpoint): yields
    the temporary to write; when the block ends it is fsynced and renamed over ``path`` (removed on an
    error). ``needed_bytes`` is what the message says the file needs when the disk is full."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(path)
    with no_space_is_disk_full(path, needed_bytes), _removed_on_error(temporary):
        yield temporary
        _count_and_sync(temporary)
        os.replace(temporary, path)
        fsync_folder(path.parent)


def write_folder(path: str | os.PathLike, files: Mapping[str, bytes | Callable[[Path], None]],
                 before_rename: Optional[Callable[[Path], None]] = None,
                 linked: Optional[Mapping[str, Path]] = None, needed_bytes: Optional[int] = None) -> None:
    """Replace the folder ``path`` by one holding ``files`` (name -> bytes, or a writer called with the
    file's path in the temporary folder, for contents too large to hold in memory twice: a full model's
    state), written in order, atomically and durably (see :func:`writing_folder`). ``linked`` (name -> an
    existing file): files that join the folder as hard links (:func:`link_or_copy`), after the others.
    ``before_rename(temporary)`` runs when the temporary folder is complete (kill tests die there).
    ``DiskFull`` (no temporary left, an existing folder kept) when the disk has no room; ``needed_bytes``
    is what its message says the folder needs (default: the bytes given).
    """
    if needed_bytes is None:
        needed_bytes = sum(len(data) for data in files.values() if not callable(data))
    with _writing_folder(path, needed_bytes, files_synced=True) as temporary:
        for name, data in files.items():
            if callable(data):
                data(temporary / name)
                _count_and_sync(temporary / name)
                continue
            with open(temporary / name, "wb", buffering=0) as file:
                _write_durably(file, data)
        for name, source in (linked or {}).items():
            link_or_copy(source, temporary / name)
        if before_rename is not None:
            before_rename(temporary)


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` becomes a hard link of ``source`` (no bytes written: both names share the file, which
    lives as long as one of them); where the filesystem has no hard links, a durable copy."""
    try:
        os.link(source, target)
    except OSError as error:
        if error.errno in NO_SPACE_ERRNOS:
            raise
        with no_space_is_disk_full(target, source.stat().st_size):
            shutil.copyfile(source, target)
            size = target.stat().st_size
            if _spend(size) < size:  # the simulated disk
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
            with open(target, "rb+") as file:
                os.fsync(file.fileno())


def link_file(source: Path, target: Path) -> None:
    """Replace ``target`` by a hard link (or copy) of ``source``, atomically and durably; creates the folder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(target)
    with _removed_on_error(temporary):
        temporary.unlink(missing_ok=True)
        link_or_copy(source, temporary)
        os.replace(temporary, target)
        fsync_folder(target.parent)


@contextlib.contextmanager
def writing_folder(path: str | os.PathLike, needed_bytes: int) -> Iterator[Path]:
    """For writers that fill a folder themselves (a diffusers model folder): yields an empty temporary
    folder beside ``path``; when the block ends every file in it (subfolders too) and every folder is
    fsynced, and it replaces ``path`` atomically: an existing folder of that name is moved aside first and
    removed once the new one is in place. On an error the temporary is removed and ``path`` is untouched.
    ``needed_bytes`` is what the message says the folder needs when the disk is full (``DiskFull``).
    """
    with _writing_folder(path, needed_bytes, files_synced=False) as temporary:
        yield temporary


@contextlib.contextmanager
def _writing_folder(path: str | os.PathLike, needed_bytes: int, files_synced: bool) -> Iterator[Path]:
    """:func:`writing_folder`; ``files_synced``: the block wrote its files through this module (counted
    against the simulated disk and fsynced already), so only the folders are left to sync."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(path)
    with no_space_is_disk_full(path, needed_bytes), _removed_on_error(temporary):
        if temporary.exists():
            shutil.rmtree(temporary)
        temporary.mkdir()
        yield temporary
        _sync_tree(temporary, files=not files_synced)
        if path.exists():  # e.g. the same save point written again after a resume
            stale = path.with_name(f".{path.name}.old{os.getpid()}")
            os.replace(path, stale)
            try:
                os.replace(temporary, path)
            except OSError:
                os.replace(stale, path)
                raise
            shutil.rmtree(stale)
        else:
            os.replace(temporary, path)
        fsync_folder(path.parent)


def _sync_tree(folder: Path, files: bool) -> None:
    """fsync every folder under ``folder``, deepest first; with ``files``, every file before (each counted
    against the simulated disk first)."""
    folders = []
    for root, _, names in os.walk(folder):
        folders.append(Path(root))
        for name in names if files else ():
            _count_and_sync(Path(root) / name)
    for each in reversed(folders):
        fsync_folder(each)


def _count_and_sync(file_path: Path) -> None:
    """fsync a file that another writer filled, after counting it against the simulated disk (a real
    disk without room failed in that writer already)."""
    size = file_path.stat().st_size
    if _spend(size) < size:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file_path))
    with open(file_path, "rb+") as file:
        os.fsync(file.fileno())


def append_to_file(path: str | os.PathLike, data: bytes | str) -> None:
    """Append ``data`` to ``path`` (created with its folder when missing), fsynced.
    ``DiskFull`` when the disk has no room (part of ``data`` may then be on disk, as after a crash)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab", buffering=0) as file:
        append_to_open_file(file, data)
        os.fsync(file.fileno())


def append_to_open_file(file: io.RawIOBase, data: bytes | str) -> None:
    """Append ``data`` to ``file``, opened unbuffered for appending (``open(path, "ab", buffering=0)``:
    no buffer is left that a later close would fail to write); not fsynced. ``DiskFull`` naming
    ``file.name`` when the disk has no room."""
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    with no_space_is_disk_full(file.name, len(payload)):
        _write_all(file, payload)


def _write_durably(file: io.RawIOBase, data: bytes) -> None:
    _write_all(file, data)
    os.fsync(file.fileno())


def _write_all(file: io.RawIOBase, data: bytes) -> None:
    """Write all of ``data`` to an unbuffered file (a raw write may take only part of it); what the
    (simulated) disk has no room for fails with ENOSPC after the part that fits, as a real disk does."""
    allowed = _spend(len(data))
    view = memoryview(data)[:allowed]
    while view:
        view = view[file.write(view):]
    if allowed < len(data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file.name)


def _spend(size: int) -> int:
    """Bytes of a ``size``-byte write the (simulated) disk takes; the caller writes those, then fails."""
    global _simulated_space_left
    if _simulated_space_left is None:
        return size
    allowed = min(size, _simulated_space_left)
    _simulated_space_left -= allowed
    return allowed


def _free_bytes(folder: Path) -> Optional[int]:
    if _simulated_space_left is not None:
        return _simulated_space_left
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


@contextlib.contextmanager
def no_space_is_disk_full(path: str | os.PathLike, needed_bytes: int) -> Iterator[None]:
    """Turn a full-disk ``OSError`` of the block (writing ``path``) into ``DiskFull``; also for writes
    that stay outside this module (an open log file's lines)."""
    path = Path(path)
    try:
        yield
    except OSError as error:
        if error.errno not in NO_SPACE_ERRNOS:
            raise
        free = _free_bytes(path.parent)
        left = f", {free:,} free" if free is not None else ""
        raise DiskFull(f"{path}: no space left on the disk; writing it needs {needed_bytes:,} bytes{left}. "
                       f"Free some space or write to another disk; files already there are kept") from None


@contextlib.contextmanager
def _removed_on_error(temporary: Path) -> Iterator[None]:
    try:
        yield
    except BaseException:
        if temporary.is_dir():
            shutil.rmtree(temporary, ignore_errors=True)
        else:
            temporary.unlink(missing_ok=True)
        raise
