"""The run directory (issue 21, sections 1 and 5): checked like ssh-agent's,
owned by one tree through a lock, and sockets removed only when nobody serves them."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from poolserve.service.contract.rundir import (
    LOCK_FILE,
    MAX_UNIX_PATH,
    RunDirLock,
    SocketInUse,
    check_socket_paths,
    claim_socket,
    ensure_private_dir,
    file_id,
    lock_holders,
    pool_socket_path,
    remove_own,
)
from poolserve.service.contract.settings import ConfigError

OTHER_UID = 65534  # nobody


def refused(run_dir: Path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        ensure_private_dir(run_dir)
    assert info.value.field_name == "run_dir"
    assert str(run_dir) in str(info.value)
    return info.value


# -- ensure_private_dir ---------------------------------------------------------


def test_a_missing_run_dir_is_created_0700(tmp_path: Path) -> None:
    run_dir = tmp_path / "a" / "run"
    ensure_private_dir(run_dir)
    info = os.lstat(run_dir)
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
    ensure_private_dir(run_dir)  # and accepted as it is the next time


def test_a_run_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.write_text("not a folder")
    assert "not a directory" in refused(run_dir).problem


def test_a_run_dir_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    error = refused(tmp_path / "file" / "run")
    assert "cannot create" in error.problem


def test_a_symlinked_run_dir_is_refused_and_its_target_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir(mode=0o755)
    target.chmod(0o755)
    (tmp_path / "run").symlink_to(target)
    assert "symbolic link" in refused(tmp_path / "run").problem
    assert stat.S_IMODE(target.stat().st_mode) == 0o755  # never chmod-ed through the link


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o701, 0o777])
def test_a_run_dir_others_can_enter_is_refused_not_chmod_ed(tmp_path: Path, mode: int) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(mode)
    assert f"{mode:04o}" in refused(run_dir).problem
    assert stat.S_IMODE(run_dir.stat().st_mode) == mode


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory someone else's")
def test_a_run_dir_of_another_user_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    run_dir.chmod(0o755)
    os.chown(run_dir, OTHER_UID, OTHER_UID)
    assert "owned by another user" in refused(run_dir).problem
    info = run_dir.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (OTHER_UID, 0o755)


# -- socket paths -------------------------------------------------------------------


def test_a_run_dir_too_long_for_a_unix_socket_is_a_config_error(tmp_path: Path) -> None:
    gid = "g" * 20  # pool-<gid>.sock is then the longest socket name
    room = MAX_UNIX_PATH - len(os.fsencode(tmp_path)) - len(f"//pool-{gid}.sock")
    fits = tmp_path / ("d" * room)
    check_socket_paths(fits, [gid])
    assert len(os.fsencode(pool_socket_path(fits, gid))) == MAX_UNIX_PATH
    too_long = tmp_path / ("d" * (room + 1))
    with pytest.raises(ConfigError) as info:
        check_socket_paths(too_long, [gid])
    assert (info.value.source, info.value.field_name) == (str(too_long), "run_dir")
    assert f"longer than the {MAX_UNIX_PATH}" in info.value.problem


# -- the lock ------------------------------------------------------------------------


def test_one_tree_holds_a_run_dir_and_a_second_is_told_its_pid(tmp_path: Path) -> None:
    ensure_private_dir(tmp_path / "run")
    with RunDirLock.take(tmp_path / "run") as lock:
        assert (tmp_path / "run" / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        assert lock_holders(lock.path, lock.fd) == [os.getpid()]
        with pytest.raises(ConfigError) as info:
            RunDirLock.take(tmp_path / "run")
        assert f"pid {os.getpid()}" in info.value.problem
        assert info.value.field_name == "run_dir"
        # A pool or router started alone cannot join a tree it is not a child of.
        with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):
            RunDirLock.share(tmp_path / "run")
    RunDirLock.take(tmp_path / "run").release()  # free again once released


def test_processes_started_alone_share_a_run_dir_and_keep_a_tree_out(tmp_path: Path) -> None:
    ensure_private_dir(tmp_path / "run")
    first = RunDirLock.share(tmp_path / "run")
    second = RunDirLock.share(tmp_path / "run")
    assert first is not None and second is not None
    with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):
        RunDirLock.take(tmp_path / "run")
    first.release()
    second.release()


def test_a_child_of_the_lock_holder_joins_without_a_lock_of_its_own(tmp_path: Path) -> None:
    ensure_private_dir(tmp_path / "run")
    code = (
        "import sys\nfrom pathlib import Path\n"
        "from poolserve.service.contract.rundir import RunDirLock\n"
        "print(RunDirLock.share(Path(sys.argv[1])))\n"
    )
    with RunDirLock.take(tmp_path / "run"):
        done = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "run")],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    assert done.stdout.strip() == "None"


def test_the_lock_descriptor_is_not_inherited(tmp_path: Path) -> None:
    ensure_private_dir(tmp_path / "run")
    with RunDirLock.take(tmp_path / "run") as lock:
        assert not os.get_inheritable(lock.fd)
        assert os.fstat(lock.fd).st_ino == os.stat(lock.path).st_ino
        fds = subprocess.run(
            [sys.executable, "-c", "import os; print(' '.join(os.listdir('/proc/self/fd')))"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            close_fds=False,  # even then: close-on-exec
        )
        assert str(lock.fd) not in fds.stdout.split()


# -- claiming a socket ---------------------------------------------------------------


def test_a_stale_socket_is_removed_and_a_live_one_refused(tmp_path: Path) -> None:
    path = tmp_path / "pool-x.sock"
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(path))
        live.listen()
        with pytest.raises(SocketInUse, match="live process"):
            claim_socket(path)
        assert path.exists()
    # closed: the path is left, and nobody answers on it any more
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    claim_socket(path)
    assert not path.exists()


def test_what_is_not_a_socket_is_never_removed(tmp_path: Path) -> None:
    path = tmp_path / "pool-x.sock"
    path.write_text("someone's file")
    with pytest.raises(SocketInUse, match="not a socket"):
        claim_socket(path)
    assert path.read_text() == "someone's file"


def test_only_the_file_we_created_is_removed(tmp_path: Path) -> None:
    path = tmp_path / "router.addr"
    path.write_text("ours")
    ours = file_id(path)
    path.unlink()
    path.write_text("someone else's, at the same path")
    if file_id(path) == ours:  # the inode came back: make it differ
        other = tmp_path / "other"
        other.write_text("someone else's, at the same path")
        other.replace(path)
    remove_own(path, ours)
    assert path.exists()
    remove_own(path, file_id(path))
    assert not path.exists()
