"""Which storage a run directory is on (alpsck.store.storage.storage), and a run on Lustre where
``lfs`` cannot run (a container image without Lustre's client tools): saves go on, with one warning.

Alps' file systems cannot be mounted here: the paths are made under tmp_path with Alps' names
(``capstor/scratch/...``), ALPSCK_FS_KIND stands in for what statfs says there, and $HOME is set
per test. The lfs cases run a real Checkpointer on real tensors, with PATH set to a directory that
holds no ``lfs`` (or an ``lfs`` that cannot run)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.lfs import Lfs
from support.tmpfs import mounted_tmpfs

import alpsck
from alpsck import _core
from alpsck.errors import CheckpointError, DiskFullError
from alpsck.store import filesystem, lustre
from alpsck.store import storage as storage_unit
from alpsck.store.storage import Storage, storage

SCRATCH_ADVICE = "/capstor/scratch/cscs/$USER"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$HOME: tmp_path/users/me, as Alps' /users/$USER."""
    h = tmp_path / "users" / "me"
    h.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(h))
    return h


def _fs(monkeypatch: pytest.MonkeyPatch, fs: str) -> None:
    monkeypatch.setenv(filesystem.KIND_ENV, fs)


# ----------------------------------------------------------------------------- storage()


def test_capstor_scratch_is_the_place_for_checkpoints(tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fs(monkeypatch, "lustre")
    st = storage(tmp_path / "capstor" / "scratch" / "cscs" / "me" / "runs" / "x")  # not made yet
    assert st == Storage("capstor", "lustre", 30, None, False)
    assert st.describe() == "Capstor scratch (Lustre), purged after 30 days without access"


def test_iopsstor_warns_of_its_14_days_and_names_capstor(tmp_path: Path, home: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """$SCRATCH on Clariden is Iopsstor; reached through a link, the resolved path decides."""
    _fs(monkeypatch, "lustre")
    real = tmp_path / "iopsstor" / "scratch" / "cscs" / "me"
    real.mkdir(parents=True)
    (tmp_path / "scratch").symlink_to(real)
    st = storage(tmp_path / "scratch" / "run")
    assert (st.name, st.kind, st.purge_days, st.needs_opt_in) == ("iopsstor", "lustre", 14, False)
    assert st.warning is not None and "\n" not in st.warning
    assert "14 days without access" in st.warning and SCRATCH_ADVICE in st.warning and "30 days" in st.warning
    assert st.describe() == "Iopsstor scratch (Lustre), purged after 14 days without access"


def test_the_purge_windows_come_from_purge_days_alone(tmp_path: Path, home: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(storage_unit.PURGE_DAYS, "iopsstor", 21)
    monkeypatch.setitem(storage_unit.PURGE_DAYS, "capstor", 40)
    st = storage(tmp_path / "iopsstor" / "scratch" / "me")
    assert st.purge_days == storage_unit.purge_days(tmp_path / "iopsstor" / "scratch" / "me") == 21
    assert st.warning is not None and "after 21 days" in st.warning and "(purged after 40 days" in st.warning
    assert "purged after 21 days" in st.describe()


def test_a_capstor_project_store_is_not_scratch(tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fs(monkeypatch, "lustre")
    path = tmp_path / "capstor" / "store" / "cscs" / "proj" / "run"
    assert storage(path) == Storage("capstor", "lustre", None, None, False)
    assert storage_unit.purge_days(path) is None
    assert storage(path).describe() == "Capstor, not scratch (Lustre), not purged"


def test_ritom_is_named(tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fs(monkeypatch, "nfs")
    st = storage(tmp_path / "ritom" / "scratch" / "cscs" / "me" / "run")
    assert st == Storage("ritom", "nfs", None, None, False)
    assert st.describe() == "Ritom scratch (VAST over NFS)"


def test_home_on_nfs_needs_an_opt_in_and_names_its_quota(tmp_path: Path, home: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Alps' home: NFS, 50 GB and 500k inodes. $HOME given through a link still counts (resolved)."""
    _fs(monkeypatch, "nfs")
    (tmp_path / "home-link").symlink_to(home)
    for path in (home / "runs" / "x", tmp_path / "home-link" / "runs" / "x", Path("runs/x")):
        monkeypatch.chdir(home)
        st = storage(path)
        assert (st.name, st.kind, st.purge_days, st.needs_opt_in) == ("home", "nfs", None, True), path
        assert st.warning is not None and "50 GB" in st.warning and "500k inodes" in st.warning
        assert SCRATCH_ADVICE in st.warning and "\n" not in st.warning
    monkeypatch.setenv("HOME", str(tmp_path / "home-link"))
    assert storage(home / "runs").needs_opt_in
    assert storage(home / "runs").describe() == "home directory (NFS, a 50 GB and 500k inodes quota)"


def test_a_laptops_home_on_a_local_disk_is_fine(tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's quickstart, `runs/quickstart` from a clone in one's home on a laptop: no warning."""
    _fs(monkeypatch, "ext4")
    monkeypatch.chdir(home)
    assert storage("runs/quickstart") == Storage("home", "ext4", None, None, False)
    assert storage(home).describe() == "home directory (ext4)"


def test_a_sibling_of_home_is_not_home(tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fs(monkeypatch, "nfs")
    st = storage(tmp_path / "users" / "me2" / "run")  # starts with $HOME's text, but is not under it
    assert st.name != "home" and not st.needs_opt_in


@pytest.mark.parametrize(("path", "fs"), [("/tmp/alpsck-no-such-dir/run", "ext4"), ("/dev/shm/alpsck-no-such/run", "ext4"),
                                          ("/alpsck-no-such-dir/run", "tmpfs"), ("/alpsck-no-such-dir/run", "ramfs")])
def test_temporary_storage_warns_that_it_does_not_survive(home: Path, monkeypatch: pytest.MonkeyPatch, path: str,
                                                          fs: str) -> None:
    _fs(monkeypatch, fs)
    st = storage(path)
    assert (st.name, st.kind, st.purge_days, st.needs_opt_in) == ("tmp", fs, None, False)
    assert st.warning is not None and "does not survive the job or the node" in st.warning
    assert SCRATCH_ADVICE in st.warning
    assert st.describe() == f"temporary storage ({fs})"


@pytest.mark.parametrize(("fs", "name", "line"), [("xfs", "local", "local disk (xfs)"),
                                                  ("overlay", "local", "local disk (overlay)"),
                                                  ("gpfs", "gpfs", "GPFS file system"),
                                                  ("lustre", "lustre", "Lustre file system"),
                                                  ("nfs", "nfs", "NFS file system")])
def test_elsewhere_the_kind_names_it(home: Path, monkeypatch: pytest.MonkeyPatch, fs: str, name: str, line: str) -> None:
    _fs(monkeypatch, fs)
    st = storage("/alpsck-no-such-dir/run")  # neither Alps' names, nor home, nor /tmp
    assert st == Storage(name, fs, None, None, False)
    assert st.describe() == line


def test_a_path_not_made_yet_is_classified_by_its_nearest_parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(filesystem.KIND_ENV, raising=False)
    assert storage(tmp_path / "not" / "made").kind == filesystem.kind(tmp_path)
    if os.path.isdir("/dev/shm") and filesystem.kind("/dev/shm") == "tmpfs":
        assert storage("/dev/shm/alpsck-no-such/deeper").kind == "tmpfs"


# ----------------------------------------------------------------------------- no lfs on Lustre


@pytest.fixture
def no_lfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Lustre as statfs would say, PATH a directory without lfs, and this process not yet warned."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    _fs(monkeypatch, "lustre")
    monkeypatch.setattr(lustre, "_lfs_warned", False)
    return bin_dir


def _state(mib: float) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(int(mib * (1 << 20)) // 4, dtype=torch.float32)}


def _lfs_warnings(records: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in records if "lfs" in str(w.message)]


def _committed(run: Path) -> list[int]:
    return [i["step"] for i in _core.scan(str(run)) if i["status"] == "committed"]


def test_without_lfs_saves_go_on_with_one_warning(tmp_path: Path, no_lfs: Path) -> None:
    """Before: the first save raised CheckpointError (the quota pre-flight) and the layout step
    warned on its own. Now: the layout, the quota and the targets are skipped with one warning in
    all, however many checkpointers (each sets the layout and runs its own pre-flight)."""
    run = tmp_path / "run"
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with alpsck.Checkpointer(run, keep_last=2) as ck:
            assert ck.layout is not None and ck.layout.unavailable and not ck.layout.set_args
            assert str(ck.layout).startswith("lustre: no layout set (no `lfs` command is on PATH")
            ck.save(1, _state(1)).wait()
            ck.save(2, _state(1)).wait()
        with alpsck.Checkpointer(run, keep_last=2) as ck:  # a restart in the same process
            assert ck.restore(_state(1)) == 2
            ck.save(3, _state(1)).wait()
    said = _lfs_warnings(records)
    assert len(said) == 1, said
    assert said[0].startswith(f"{run} is on Lustre but no `lfs` command is on PATH"), said
    assert "quota" in said[0] and "layout" in said[0] and "saves go on" in said[0] and "\n" not in said[0]
    assert _committed(run) == [2, 3]


def test_without_lfs_a_layout_the_user_gave_is_a_warning_too(tmp_path: Path, no_lfs: Path) -> None:
    """lfs refusing a layout the user gave is their error (test_filesystem); lfs not there at all
    is the environment's: the checkpoints are as safe without the layout."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with alpsck.Checkpointer(tmp_path / "run", lustre_layout="-c 8 -S 4M", keep_last=2) as ck:
            assert ck.layout is not None and ck.layout.unavailable and not ck.layout.set_args
            ck.save(1, _state(1)).wait()
    assert len(_lfs_warnings(records)) == 1
    assert _committed(tmp_path / "run") == [1]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs (needs root, as CI has), mounted before no_lfs empties PATH."""
    with mounted_tmpfs(tmp_path / "small", "size=16m,nr_inodes=1000") as mnt:
        yield mnt


def test_without_lfs_statvfs_still_limits_the_save(small_fs: Path, no_lfs: Path) -> None:
    """4 checkpoints of 6 MiB do not fit a real 16 MiB file system, and the pre-flight says so from
    statvfs although lfs cannot run."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with alpsck.Checkpointer(small_fs / "run", keep_last=3, max_in_flight=1) as ck:
            with pytest.raises(DiskFullError, match=r"the file system's free space \(statvfs .*\) leaves"):
                ck.save(1, _state(6))
        with alpsck.Checkpointer(small_fs / "run1", keep_last=3, max_in_flight=1) as ck:
            ck.save(1, _state(1)).wait()  # 4 x 1 MiB fit
    assert len(_lfs_warnings(records)) == 1
    assert _committed(small_fs / "run1") == [1]


@pytest.mark.parametrize("script", ["#!/alpsck/no/such/interpreter\n",  # exec fails: OSError
                                    "#!/bin/sh\nexec /alpsck/no/such/lfs.real \"$@\"\n"])  # exit 127
def test_an_lfs_that_cannot_run_is_as_none(tmp_path: Path, no_lfs: Path, script: str) -> None:
    """A host's lfs mounted into a container without what it needs to run."""
    (no_lfs / "lfs").write_text(script)
    (no_lfs / "lfs").chmod(0o755)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with alpsck.Checkpointer(tmp_path / "run", keep_last=2) as ck:
            ck.save(1, _state(1)).wait()
    said = _lfs_warnings(records)
    assert len(said) == 1 and f"{no_lfs / 'lfs'}` cannot run" in said[0], said
    assert _committed(tmp_path / "run") == [1]


def test_an_lfs_that_runs_and_fails_still_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """lfs ran and said the quota cannot be read: that is about the file system, so the save fails
    naming it (as before), and nothing warns of a missing lfs."""
    stand_in = Lfs(tmp_path)
    real = stand_in.bin / "lfs.standin"
    (stand_in.bin / "lfs").rename(real)
    (stand_in.bin / "lfs").write_text("#!/bin/sh\nif [ \"$1\" = quota ]; then echo 'lfs quota: Permission denied' >&2; "
                                      f"exit 1; fi\nexec {real} \"$@\"\n")
    (stand_in.bin / "lfs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{stand_in.bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("LFS_STANDIN_STATE", str(stand_in.state_path))
    monkeypatch.setenv("LFS_STANDIN_LOG", str(stand_in.log))
    _fs(monkeypatch, "lustre")
    monkeypatch.setattr(lustre, "_lfs_warned", False)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with alpsck.Checkpointer(tmp_path / "run", keep_last=2) as ck:
            assert ck.layout is not None and ck.layout.set_args  # getstripe and setstripe worked
            with pytest.raises(CheckpointError, match=r"`lfs quota -q -u \d+ .*` failed \(exit 1\): lfs quota: "
                                                      "Permission denied") as e:
                ck.save(1, _state(1))
            assert not isinstance(e.value, DiskFullError)
    assert _lfs_warnings(records) == []
