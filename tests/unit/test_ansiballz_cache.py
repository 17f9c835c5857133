"""plugins/callback/ansiballz_cache.py: payloads persist across runs, never across a change to their sources."""

import os
from pathlib import Path

from ansiballz_cache import cache_key, link_cache, source_dirs


def sources(tmp_path: Path) -> tuple[Path, Path, Path]:
    library, utils, roles = tmp_path / "library", tmp_path / "module_utils", tmp_path / "roles"
    for d in (library, utils, roles / "r1" / "library", roles / "r2" / "tasks"):
        d.mkdir(parents=True)
    (library / "m.py").write_text("import ansible.module_utils.u\n")
    (utils / "u.py").write_text("X = 1\n")
    (roles / "r1" / "library" / "rm.py").write_text("pass\n")
    return library, utils, roles


def test_source_dirs_are_the_configured_ones_and_roles_module_dirs_that_exist(tmp_path: Path) -> None:
    library, utils, roles = sources(tmp_path)
    dirs = source_dirs([str(library), str(tmp_path / "absent")], [str(utils)], [str(roles)])
    assert dirs == [library, utils, roles / "r1" / "library"]


def test_the_key_changes_with_any_source_its_path_or_the_salt(tmp_path: Path) -> None:
    library, utils, roles = sources(tmp_path)
    dirs = source_dirs([str(library)], [str(utils)], [str(roles)])
    first = cache_key(dirs, ["2.19.14"])
    assert cache_key(dirs, ["2.19.14"]) == first
    assert cache_key(dirs, ["2.19.15"]) != first
    (utils / "u.py").write_text("X = 2\n")
    changed = cache_key(dirs, ["2.19.14"])
    assert changed != first
    (roles / "r1" / "library" / "rm.py").rename(roles / "r1" / "library" / "rm2.py")
    assert cache_key(dirs, ["2.19.14"]) != changed


def test_compiled_files_do_not_change_the_key(tmp_path: Path) -> None:
    library, utils, roles = sources(tmp_path)
    dirs = source_dirs([str(library)], [str(utils)], [str(roles)])
    first = cache_key(dirs, [])
    (utils / "__pycache__").mkdir()
    (utils / "__pycache__" / "u.cpython-311.pyc").write_bytes(b"\0")
    assert cache_key(dirs, []) == first


def test_the_run_cache_links_to_a_private_persistent_one(tmp_path: Path) -> None:
    run = tmp_path / "ansible-local-1abc"
    run.mkdir()
    store = link_cache(run, "k1")
    assert store == tmp_path / "ansiballz-k1"
    assert (run / "ansiballz_cache").resolve() == store
    assert store.stat().st_mode & 0o777 == 0o700
    (run / "ansiballz_cache" / "payload").write_text("built once")
    run2 = tmp_path / "ansible-local-2abc"
    run2.mkdir()
    assert link_cache(run2, "k1") == store
    assert (run2 / "ansiballz_cache" / "payload").read_text() == "built once"


def test_a_run_with_its_own_cache_keeps_it(tmp_path: Path) -> None:
    run = tmp_path / "ansible-local-1abc"
    (run / "ansiballz_cache").mkdir(parents=True)
    assert link_cache(run, "k1") is None
    assert not (tmp_path / "ansiballz-k1").exists()


def test_a_store_others_can_write_is_not_used(tmp_path: Path) -> None:
    run = tmp_path / "ansible-local-1abc"
    run.mkdir()
    (tmp_path / "ansiballz-k1").mkdir()
    os.chmod(tmp_path / "ansiballz-k1", 0o777)
    assert link_cache(run, "k1") is None
    assert not os.path.lexists(run / "ansiballz_cache")


def test_only_the_newest_stores_are_kept(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"ansiballz-old{i}").mkdir(mode=0o700)
        os.utime(tmp_path / f"ansiballz-old{i}", (1000 + i, 1000 + i))
    run = tmp_path / "ansible-local-1abc"
    run.mkdir()
    link_cache(run, "new", keep=3)
    assert sorted(p.name for p in tmp_path.glob("ansiballz-*")) == ["ansiballz-new", "ansiballz-old3", "ansiballz-old4"]
