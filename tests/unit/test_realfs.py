"""The real filesystems the write-failure tests use do what those tests rely on (and are unmounted)."""

from __future__ import annotations

import errno
import os

import pytest
import realfs


def test_a_filled_tmpfs_refuses_one_more_byte(tmpfs_dir):
    assert os.path.ismount(tmpfs_dir)
    realfs.fill(tmpfs_dir)
    assert realfs.free_bytes(tmpfs_dir) == 0
    with pytest.raises(OSError) as caught:
        (tmpfs_dir / "one").write_bytes(b"x")
    assert caught.value.errno == errno.ENOSPC


def test_a_filled_ext4_refuses_one_more_byte_and_immutable_refuses_a_rename(ext4_dir):
    victim = ext4_dir / "victim"
    victim.write_text("old\n")
    (ext4_dir / "new").write_text("new\n")
    with realfs.immutable(victim):
        assert realfs.lsattr_immutable(victim)
        with pytest.raises(PermissionError):
            os.replace(ext4_dir / "new", victim)
    assert not realfs.lsattr_immutable(victim)
    realfs.fill(ext4_dir)
    with pytest.raises(OSError) as caught, open(ext4_dir / "one", "wb") as fh:
        fh.write(b"x")
        fh.flush()
        os.fsync(fh.fileno())
    assert caught.value.errno == errno.ENOSPC


def test_a_read_only_remount_answers_erofs_and_is_writable_again_after(ext4_dir):
    (ext4_dir / "f").write_text("old\n")
    with realfs.read_only(ext4_dir), pytest.raises(OSError) as caught:
        (ext4_dir / "new").write_text("x")
    assert caught.value.errno == errno.EROFS
    (ext4_dir / "new").write_text("x")


def test_fuse2fs_refuses_rename_exchange_with_einval(fuse_dir):
    from ansible.module_utils.model_stage import exchange_paths

    (fuse_dir / "a").mkdir()
    (fuse_dir / "b").mkdir()
    with pytest.raises(OSError) as caught:
        exchange_paths(str(fuse_dir / "a"), str(fuse_dir / "b"))
    assert caught.value.errno == errno.EINVAL
    os.rename(fuse_dir / "a", fuse_dir / "c")  # a plain rename works there
    assert sorted(os.listdir(fuse_dir)) == ["b", "c", "lost+found"]


def test_the_mounts_are_gone_after_the_fixtures(tmp_path):
    # The fixtures above mounted under their own tmp_path; none of pytest's base directory is still a mount.
    base = tmp_path.parent.parent
    with open("/proc/self/mountinfo") as fh:
        mounted = [line.split()[4] for line in fh]
    assert [m for m in mounted if m.startswith(str(base))] == []
