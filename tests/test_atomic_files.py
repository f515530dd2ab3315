"""library/atomic_files.py: every file and folder the project replaces is written to a temporary name,
fsynced, renamed, and its folder fsynced; a failed write (a full disk) leaves the old version and no
temporary behind."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from library import atomic_files
from library.errors import DiskFull

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def small_disk():
    """The disk looks full after 100 more bytes (the trainers' --debug_disk_full_after_bytes)."""
    atomic_files.simulate_full_disk(100)
    yield
    atomic_files.simulate_full_disk(None)


def test_a_file_is_replaced_whole_and_a_full_disk_keeps_the_old_one(tmp_path, small_disk):
    target = tmp_path / "sub" / "log.txt"
    atomic_files.write_file(target, "first\n")
    assert target.read_text() == "first\n"
    with pytest.raises(DiskFull) as full:
        atomic_files.write_file(target, b"x" * 500)
    assert str(full.value).startswith(f"{target}: no space left on the disk; writing it needs 500 bytes, 0 free.")
    assert target.read_text() == "first\n"
    assert os.listdir(target.parent) == ["log.txt"]


def test_a_folder_is_replaced_whole_and_a_full_disk_keeps_the_old_one(tmp_path, small_disk):
    target = tmp_path / "run-state"
    atomic_files.write_folder(target, {"a.bin": b"1" * 10, "b.bin": b"2" * 10})
    atomic_files.write_folder(target, {"a.bin": b"3" * 10})  # written again: the new content only
    assert sorted(os.listdir(target)) == ["a.bin"] and (target / "a.bin").read_bytes() == b"3" * 10
    with pytest.raises(DiskFull) as full:
        atomic_files.write_folder(target, {"a.bin": b"4" * 60, "b.bin": b"5" * 60})
    assert "writing it needs 120 bytes" in str(full.value)
    assert sorted(os.listdir(tmp_path)) == ["run-state"] and (target / "a.bin").read_bytes() == b"3" * 10


def test_a_folder_file_may_come_from_a_writer_and_a_full_disk_there_keeps_the_old_folder(tmp_path, small_disk):
    """A writer fills its file itself (a full model's state streamed by torch.save): written in order after the
    files before it, counted against the disk like them."""
    target = tmp_path / "run-state"
    atomic_files.write_folder(target, {"a.bin": b"1" * 10, "sizes.txt": lambda path: path.write_text(
        str(sorted(entry.stat().st_size for entry in path.parent.iterdir())))})
    assert (target / "sizes.txt").read_text() == "[10]"  # a.bin was complete when the writer ran
    with pytest.raises(DiskFull) as full:
        atomic_files.write_folder(target, {"a.bin": b"2" * 10, "big.bin": lambda path: path.write_bytes(b"3" * 95)},
                                  needed_bytes=105)
    assert "writing it needs 105 bytes" in str(full.value)
    assert sorted(os.listdir(tmp_path)) == ["run-state"] and (target / "a.bin").read_bytes() == b"1" * 10


def test_a_file_written_by_name_fails_on_a_full_disk_and_keeps_the_old_one(tmp_path, small_disk):
    """Writers that take a file name (safetensors' save_file) go through ``writing_file``: the simulated
    disk fails them too, before the rename."""
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")
    with pytest.raises(DiskFull, match="model.bin: no space left on the disk; writing it needs 500 bytes"):
        with atomic_files.writing_file(target, 500) as temporary:
            temporary.write_bytes(b"n" * 500)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["model.bin"]


def test_appends_report_a_full_disk_the_same_way(tmp_path, small_disk):
    log = tmp_path / "rows.txt"
    atomic_files.append_to_file(log, "1\n")
    with pytest.raises(DiskFull, match="rows.txt: no space left on the disk; writing it needs 200 bytes"):
        atomic_files.append_to_file(log, "2" * 200)


def test_the_data_and_the_rename_are_fsynced_in_order(tmp_path, monkeypatch):
    """What a power loss needs: the file's data on disk before the rename, the folder's entry after it."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    def replace(source, target):
        events.append(("replace", str(target)))
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "lora.safetensors"
    atomic_files.write_file(target, b"data")
    assert events == [("fsync", str(atomic_files.temporary_path(target))), ("replace", str(target)),
                      ("fsync", str(tmp_path))]
    events.clear()
    folder = tmp_path / "state"
    atomic_files.write_folder(folder, {"x.pt": b"1"})
    temporary = atomic_files.temporary_path(folder)
    assert events == [("fsync", str(temporary / "x.pt")), ("fsync", str(temporary)), ("replace", str(folder)),
                      ("fsync", str(tmp_path))]


def test_no_module_renames_files_itself():
    """One helper for every atomic write: no other module renames, makes temporary files or names them."""
    pattern = re.compile(r"os\.replace\(|os\.rename\(|\.rename\(|shutil\.move\(|mkstemp|NamedTemporaryFile|\.tmp\b")
    sources = [path for folder in ("library", "networks", "tools", "finetune") for path in (REPO / folder).rglob("*.py")]
    sources += list(REPO.glob("*.py"))
    offenders = [f"{path.relative_to(REPO)}:{number}" for path in sources if path.name != "atomic_files.py"
                 for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                 if pattern.search(line)]
    assert offenders == []
