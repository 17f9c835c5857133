#!/usr/bin/python
"""Ansible module (node side of the safetensors_stage action): plan, verify and commit staged weights."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: safetensors_stage
short_description: Stage safetensors weights into an HF-layout directory, verified and atomically
description:
  - Puts drafter (or any) weights into I(dest) as C(model.safetensors), or as shards plus
    C(model.safetensors.index.json) (written when the source has shards but no index).
  - Checks free space first, transfers each file to a temporary name inside I(dest) with rsync over
    the host's SSH settings (C(--partial --append-verify), so an interrupted transfer resumes), verifies
    size, SHA-256 and the safetensors header, then renames into place and sets owner, group and mode.
  - When more than one file changes (a shard set), the complete new set is built in a staging
    directory beside I(dest) (unchanged and unrelated files hard-linked) and swapped with I(dest) in
    one C(renameat2(RENAME_EXCHANGE)), so I(dest) never holds a mix of old and new files.
  - A sidecar C(dest/.model_stage.json) records each file's size, mtime and SHA-256; a re-run that
    finds both sides unchanged transfers and hashes nothing.
  - The controller side is an action plugin of the same name; this module runs on the node.
version_added: "1.0.0"
author: model_stage maintainers
extends_documentation_fragment:
  - attributes
options:
  src:
    description:
      - A C(.safetensors) file (any name; staged as C(model.safetensors)) or a directory of shards
        (with or without C(model.safetensors.index.json)). On the controller unless I(remote_src).
    type: path
    required: true
  remote_src:
    description: I(src) is a path on the node (copied locally there, not resumable).
    type: bool
    default: false
  dest:
    description: The HF-layout directory the engine loads (created if missing).
    type: path
    required: true
  sha256:
    description:
      - Expected SHA-256 digest (a string, single-file source) or a mapping of source file name to
        digest. Without it every file is checked against the digest of its source.
    type: raw
  owner:
    description:
      - Owner of the staged files; must exist on the node. I(dest) itself is owned by root (with
        I(group)), so that no service account can create entries in it.
    type: str
    required: true
  group:
    description: Group of the staged files and of I(dest); must exist on the node.
    type: str
    required: true
  mode:
    description: Mode of the staged files.
    type: str
    default: "0640"
  dir_mode:
    description:
      - Mode of I(dest) when this module creates it or fixes it; no write bit for the group or others.
    type: str
    default: "0750"
  space_margin:
    description: Bytes that must stay free on I(dest)'s filesystem beyond what the transfer writes.
    type: int
    default: 1073741824
  rsync_opts:
    description: Extra rsync options for the transfer (for example C(--bwlimit=200m)).
    type: list
    elements: str
    default: []
  step:
    description: Set by the action plugin (plan, follow, copy or commit); leave unset in tasks.
    type: str
    choices: [plan, follow, copy, commit]
  files:
    description: Set by the action plugin.
    type: list
    elements: dict
attributes:
  check_mode:
    support: full
    details: Reports the files that would be copied, written or removed; changes nothing.
  diff_mode:
    support: full
    details: The diff names the files in I(dest) before and after.
notes:
  - Needs rsync on the controller and the node for a controller-side source; sudo for C(become).
  - Only the Python standard library on the node.
"""

EXAMPLES = r"""
- name: Stage the drafter as model.safetensors
  safetensors_stage:
    src: /srv/weights/dflash-q36-27b.safetensors
    dest: /opt/models/Qwen3.6-27B-DFlash
    sha256: 0c5a1e9d2f3b4a5c6d7e8f90112233445566778899aabbccddeeff0011223344
    owner: vllm
    group: vllm
  become: true

- name: Report what would be copied
  safetensors_stage:
    src: /srv/weights/drafter-shards/
    dest: /opt/models/drafter
    owner: vllm
    group: vllm
  check_mode: true
  diff: true
"""

RETURN = r"""
dest:
  description: The destination directory.
  returned: always
  type: str
  sample: /opt/models/Qwen3.6-27B-DFlash
actions:
  description: What was (or in check mode would be) done, one line per file.
  returned: always
  type: list
  elements: str
  sample: ["copy /srv/w/dflash.safetensors -> model.safetensors (3460012345 bytes; not in the destination)"]
files:
  description: The staged files with size, mtime and SHA-256 as recorded in the sidecar.
  returned: success, outside check mode
  type: dict
  sample: {"model.safetensors": {"size": 3460012345, "mtime": 1790000000, "sha256": "0c5a...", "source": "/srv/w/d.safetensors"}}
transferred:
  description: Names of the files transferred in this run.
  returned: success
  type: list
  elements: str
  sample: ["model.safetensors"]
bytes_transferred:
  description: Bytes written to the node by this run (resumed bytes excluded).
  returned: success
  type: int
  sample: 3460012345
swapped:
  description:
    - True when several files changed and the new set was swapped in as one directory
      (renameat2 RENAME_EXCHANGE with a staging directory beside I(dest)); false for one rename.
  returned: success, when something was committed
  type: bool
  sample: true
timings:
  description:
    - Seconds per phase of a controller-side staging. C(check) (source headers and the quick
      check), C(plan) and C(commit) are module calls; C(transfer) (rsync done), C(follow) (the
      node's digest done) and C(hashed) (rsync and the controller's digest both done) count from
      the end of the plan.
  returned: success, when a controller source was transferred
  type: dict
  sample: {"check": 0.21, "plan": 0.93, "transfer": 58.1, "follow": 58.3, "hashed": 58.3, "commit": 0.88}
"""

import contextlib
import fcntl
import grp
import hashlib
import os
import pwd
import stat
import time
from collections.abc import Iterator
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.model_stage import (
    DIR_UID,
    INDEX_NAME,
    MAX_RECORD_BYTES,
    SIDECAR_NAME,
    TEMP_PREFIX,
    TEMP_SUFFIX,
    DestFile,
    NewSet,
    SourceFile,
    StageError,
    build_index,
    check_exchange,
    check_index,
    check_space,
    describe,
    expected_digests,
    file_entries_problem,
    fsync_path,
    leftovers,
    parse_sidecar,
    plan_stage,
    record,
    remove_tree,
    render_index,
    render_sidecar,
    replace_set,
    source_layout,
)
from ansible.module_utils.safe_io import (
    UnsafeFileError,
    atomic_write,
    loads_json,
    locked_attribute,
    open_regular,
    read_regular,
    write_problem,
)
from ansible.module_utils.safetensors_header import SafetensorsError, read_file_header

ARGUMENT_SPEC: dict[str, Any] = {
    "src": {"type": "path", "required": True},
    "remote_src": {"type": "bool", "default": False},
    "dest": {"type": "path", "required": True},
    "sha256": {"type": "raw"},
    "owner": {"type": "str", "required": True},
    "group": {"type": "str", "required": True},
    "mode": {"type": "str", "default": "0640"},
    "dir_mode": {"type": "str", "default": "0750"},
    "space_margin": {"type": "int", "default": 1073741824},
    "rsync_opts": {"type": "list", "elements": "str", "default": []},
    "step": {"type": "str", "choices": ["plan", "follow", "copy", "commit"]},
    "files": {"type": "list", "elements": "dict"},
}


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)


def _mode(text: str, what: str) -> int:
    try:
        value = int(str(text), 8)
    except ValueError:
        raise StageError(f"{what} {text!r} is not an octal mode such as '0640'") from None
    if value < 0 or value > 0o7777:
        raise StageError(f"{what} {text!r} is not a file mode")
    if what == "dir_mode" and value & 0o022:
        # A directory the group (the service account) or anyone may write into lets them plant links.
        raise StageError(f"dir_mode {text!r} lets the group or others create entries in dest; use 0750 or 0755")
    return value


def _ids(owner: str, group: str) -> tuple[int, int]:
    try:
        uid = pwd.getpwnam(owner).pw_uid
    except KeyError:
        raise StageError(
            f"user {owner!r} does not exist on this node; let the role create it (shared_settings_service_user_create: true)"
            " or set shared_settings_service_user to an existing user"
        ) from None
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise StageError(
            f"group {group!r} does not exist on this node; create it or set shared_settings_service_group to an existing group"
        ) from None
    return uid, gid


def _existing_ancestor(path: str) -> str:
    p = path
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _scan_dest(dest: str) -> tuple[dict[str, DestFile], dict[str, int], str | None]:
    files, temps, sidecar, _ = _scan_dest_all(dest)
    return files, temps, sidecar


def _scan_dest_all(dest: str) -> tuple[dict[str, DestFile], dict[str, int], str | None, list[str]]:
    """The regular files in dest, the temporary files, the sidecar's text and the odd entries.

    Odd entries are anything but a regular file under the temporary prefix (a symlink, a FIFO, a
    directory): something planted there; the plan removes them before a transfer writes that name.
    """
    files: dict[str, DestFile] = {}
    temps: dict[str, int] = {}
    odd: list[str] = []
    sidecar = None
    if not os.path.isdir(dest):
        return files, temps, sidecar, odd
    for entry in os.scandir(dest):
        if not entry.is_file(follow_symlinks=False):
            if entry.name.startswith(TEMP_PREFIX):
                odd.append(entry.name)
            continue
        st = entry.stat(follow_symlinks=False)
        if entry.name.startswith(TEMP_PREFIX) and entry.name.endswith(TEMP_SUFFIX):
            temps[entry.name] = st.st_size
        elif entry.name == SIDECAR_NAME:
            try:
                sidecar = read_regular(entry.path, MAX_RECORD_BYTES).decode("utf-8", "replace")
            except (FileNotFoundError, UnsafeFileError):
                sidecar = None  # no usable record: every file is verified again
        else:
            files[entry.name] = DestFile(
                st.st_size, int(st.st_mtime), st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), st.st_mtime_ns
            )
    return files, temps, sidecar, sorted(odd)


def _sources(params: dict[str, Any]) -> list[SourceFile]:
    """The file list the action plugin sent, or (remote_src) the node's own source."""
    if params["files"] is not None and not params["remote_src"]:
        return [
            SourceFile(
                name=f["name"],
                origin=f["origin"],
                size=int(f["size"]),
                mtime=int(f["mtime"]),
                sha256=f.get("sha256"),
                mtime_ns=int(f["mtime_ns"]) if f.get("mtime_ns") is not None else None,
            )
            for f in params["files"]
        ]
    src = params["src"]
    if not os.path.exists(src):
        raise StageError(f"{src}: the source does not exist on the node; check model_stage_src")
    is_dir = os.path.isdir(src)
    layout = source_layout(src, is_dir, os.listdir(src) if is_dir else [])
    names = [os.path.basename(path) for path, _ in layout]
    digests = expected_digests(params["sha256"], names, names[0] if len(layout) == 1 else None)
    out = []
    for path, name in layout:
        st = os.stat(path)
        if name != INDEX_NAME:
            _header(path)
        out.append(
            SourceFile(name, path, st.st_size, int(st.st_mtime), digests.get(os.path.basename(path)), st.st_mtime_ns)
        )
    return out


def _header(path: str) -> dict[str, int]:
    try:
        fh = read_file_header(path)
    except SafetensorsError as exc:
        raise StageError(str(exc)) from None
    return {name: t.nbytes for name, t in fh.tensors.items()}


def _check_writable(dest: str) -> str:
    where = _existing_ancestor(dest)
    if os.statvfs(where).f_flag & os.ST_RDONLY:
        raise StageError(
            f"{dest} is on a read-only filesystem ({where} is mounted read-only); remount it read-write or"
            " choose another shared_settings_drafter_dir"
        )
    return where


def listing_diff(files: dict[str, DestFile], the_plan: Any) -> tuple[str, str]:
    """The destination's files (name, size, mtime) before and after, one per line, for --diff."""
    before = {n: f"{n} {f.size} bytes mtime {f.mtime}" for n, f in files.items()}
    after = dict(before)
    for p in the_plan.transfers:
        after[p.source.name] = f"{p.source.name} {p.source.size} bytes mtime {p.source.mtime} from {p.source.origin}"
    if the_plan.index_stale:
        after[INDEX_NAME] = f"{INDEX_NAME} (written from the shards' headers)"
    for n in the_plan.stale_weights:
        after.pop(n, None)
    return "".join(f"{before[n]}\n" for n in sorted(before)), "".join(f"{after[n]}\n" for n in sorted(after))


def plan(module: AnsibleModule) -> dict[str, Any]:
    p = module.params
    dest = p["dest"]
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise StageError(f"{dest} exists and is not a directory; shared_settings_drafter_dir must be a directory")
    try:
        uid, gid = _ids(p["owner"], p["group"])
    except StageError:
        if not module.check_mode:
            raise
        # In --check the role's account task only pretends to create the owner: plan without it.
        module.warn(f"{p['owner']}:{p['group']} does not exist yet; a real run creates it before staging")
        uid, gid = -1, -1
    file_mode = _mode(p["mode"], "mode")
    dir_mode = _mode(p["dir_mode"], "dir_mode")
    sources = _sources(p)
    names = {s.name for s in sources}
    generated_index = len(sources) > 1 and INDEX_NAME not in names
    files, temps, side_text, odd = _scan_dest_all(dest)
    the_plan = plan_stage(sources, files, parse_sidecar(side_text), temps, generated_index)
    if the_plan.write_index and not the_plan.index_stale:
        # Unchanged shards: the index is stale only if someone edited it; headers are cheap to read.
        try:
            shards = {f.source.name: _header(os.path.join(dest, f.source.name)) for f in the_plan.files}
            text = read_regular(os.path.join(dest, INDEX_NAME), MAX_RECORD_BYTES).decode("utf-8", "replace")
            the_plan.index_stale = text != render_index(build_index(shards))
        except (OSError, StageError, UnsafeFileError):
            the_plan.index_stale = True
    where = _check_writable(dest)
    vfs = os.statvfs(where)
    free = vfs.f_bavail * vfs.f_frsize
    needed = the_plan.bytes_to_write()
    check_space(dest, needed, p["space_margin"], free)
    attrs = sorted(
        s.name
        for s in sources
        if s.name in files
        and (files[s.name].uid, files[s.name].gid, files[s.name].mode) != (uid, gid, file_mode)
        and not any(f.source.name == s.name and f.action == "transfer" for f in the_plan.files)
    )
    actions = describe(the_plan) + [f"set owner, group and mode of {n}" for n in attrs]
    dir_missing = not os.path.isdir(dest)
    if dir_missing:
        actions.insert(0, f"create {dest}")
        fix_dir = True
    else:
        st = os.stat(dest)
        fix_dir = (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) != (DIR_UID, gid, dir_mode)
        if fix_dir:
            actions.insert(0, f"set owner root, group {p['group']} and mode {oct(dir_mode)[2:]:0>4} of {dest}")
    left = leftovers(dest)
    actions += [f"remove {p} (left over from an interrupted replacement of the file set)" for p in left]
    actions += [f"remove {n} (not a regular file, where only this module's temporary files go)" for n in odd]
    changed = bool(actions)
    if not module.check_mode and the_plan.replaces_set and os.path.isdir(os.path.dirname(os.path.realpath(dest))):
        # Refuse before anything is changed or transferred where the set cannot be swapped in one step.
        check_exchange(dest)
    if not module.check_mode:
        for path in left:
            remove_tree(path)
        if dir_missing:
            os.makedirs(dest, mode=0o755, exist_ok=True)
        if fix_dir:
            os.chown(dest, DIR_UID, gid)
            os.chmod(dest, dir_mode)
            changed = True
        for t in the_plan.stale_temps:
            os.unlink(os.path.join(dest, t))
        for name in odd:
            _remove_odd(dest, name)
    before, after = listing_diff(files, the_plan)
    return {
        "changed": changed,
        "actions": actions,
        "transfers": [
            {
                "name": f.source.name,
                "origin": f.source.origin,
                "size": f.source.size,
                "mtime": f.source.mtime,
                **({"mtime_ns": f.source.mtime_ns} if f.source.mtime_ns is not None else {}),
                "sha256": f.source.sha256,
                "temp": os.path.join(dest, f.source.temp),
                "partial": f.partial,
            }
            for f in the_plan.transfers
        ],
        "keep": [f.source.name for f in the_plan.files if f.action == "keep"],
        "attrs": attrs,
        "stale_weights": the_plan.stale_weights,
        "write_index": generated_index,
        "index_stale": the_plan.index_stale,
        "bytes_needed": needed,
        "bytes_free": free,
        "diff": {
            "before_header": dest,
            "after_header": dest,
            "before": before,
            "after": after,
        },
    }


def _remove_odd(dest: str, name: str) -> None:
    """Remove a non-regular entry under the temporary prefix without following it."""
    path = os.path.join(dest, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise StageError(
            f"{path} is a directory where only this module's temporary files go; remove it (it is not part of"
            " the model) and run again"
        )
    os.unlink(path)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino


def _create_temp(path: str) -> int:
    """A new, empty temporary file at ``path`` (whatever was there, not followed, removed first)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            raise StageError(f"{path} is a directory where a temporary file goes; remove it and run again")
        os.unlink(path)
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise StageError(
            f"{path} was created by someone else while this run was replacing it; check who writes into the"
            " destination and run again"
        ) from None


def copy_local(module: AnsibleModule) -> dict[str, Any]:
    """Copy node-local sources to their temporary names, hashing what is read (one pass).

    The source must stay unchanged during the copy (size, mtime and inode checked before and
    after); a changed source is refused and its temporary file removed.
    """
    digests = {}
    for f in module.params["files"] or []:
        if f.get("kind") != "transfer":
            continue
        h = hashlib.sha256()
        origin, temp = f["origin"], f["temp"]
        try:
            src_fd = os.open(origin, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise StageError(f"{origin}: cannot be read ({exc.strerror or exc}); check model_stage_src") from None
        with os.fdopen(src_fd, "rb") as src:
            before = os.fstat(src_fd)
            if not stat.S_ISREG(before.st_mode):
                raise StageError(f"{origin} is not a regular file; point model_stage_src at the weights themselves")
            os.set_blocking(src_fd, True)
            if (before.st_size, int(before.st_mtime)) != (int(f["size"]), int(f["mtime"])) or (
                f.get("mtime_ns") is not None and before.st_mtime_ns != int(f["mtime_ns"])
            ):
                raise StageError(f"{origin} changed since the plan; run the play again once it is complete")
            out_fd = _create_temp(temp)
            try:
                with os.fdopen(out_fd, "wb") as out:
                    while True:
                        chunk = src.read(8 * 1024 * 1024)
                        if not chunk:
                            break
                        h.update(chunk)
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                    # To the nanosecond where known: the next plan compares it so (issue 43).
                    if f.get("mtime_ns") is not None:
                        os.utime(out.fileno(), ns=(int(f["mtime_ns"]), int(f["mtime_ns"])))
                    else:
                        os.utime(out.fileno(), (f["mtime"], f["mtime"]))
                after = os.stat(origin)
                if _identity(os.fstat(src_fd)) != _identity(before) or _identity(after) != _identity(before):
                    raise StageError(
                        f"{origin} changed while it was copied (size, modification time or inode differ before and"
                        " after); nothing was committed: run the play again once the source is complete"
                    )
            except BaseException as exc:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)
                if isinstance(exc, OSError):
                    problem, remedy = write_problem(exc, temp)
                    raise StageError(
                        f"{f['name']}: copying {origin} to {temp} failed ({problem}); nothing was replaced and the"
                        f" partial copy was removed: {remedy}"
                    ) from None
                raise
        digests[f["name"]] = h.hexdigest()
    return {"changed": True, "digests": digests}


FOLLOW_STALL_SECONDS = 15.0
FOLLOW_NICE = 10


def _follow_one(path: str, size: int, stall: float) -> str | None:
    """SHA-256 of a file read while it is being written, once it holds ``size`` bytes.

    None when it stops growing for ``stall`` seconds (the transfer failed or paused): the commit
    then hashes the finished file instead.
    """
    h = hashlib.sha256()
    done = 0
    last = time.monotonic()
    fh = None
    try:
        while done < size:
            if fh is None:
                try:
                    # Only the regular file rsync writes: never through a link, never a FIFO (it would hang).
                    fh = os.fdopen(open_regular(path), "rb")  # kept open while the file grows
                except FileNotFoundError:
                    if time.monotonic() - last > stall:
                        return None
                    time.sleep(0.05)
                    continue
                except UnsafeFileError:
                    return None  # the commit refuses it, naming what is wrong
            chunk = fh.read(min(8 * 1024 * 1024, size - done))
            if chunk:
                h.update(chunk)
                done += len(chunk)
                last = time.monotonic()
            elif time.monotonic() - last > stall:
                return None
            else:
                time.sleep(0.02)
    finally:
        if fh is not None:
            fh.close()
    return h.hexdigest()


def follow(module: AnsibleModule) -> dict[str, Any]:
    """Hash the temporary files while rsync writes them, in transfer order (overlaps the two)."""
    prehashed = {}
    # rsync's receiver is the critical path; hashing keeps up with it on spare CPU.
    with contextlib.suppress(OSError):
        os.nice(FOLLOW_NICE)
    for f in module.params["files"] or []:
        prehashed[f["name"]] = _follow_one(f["temp"], int(f["size"]), float(f.get("stall", FOLLOW_STALL_SECONDS)))
    return {"changed": False, "prehashed": prehashed}


def _remove_temps(files: list[dict[str, Any]]) -> list[str]:
    """Remove the transferred temporary files; the ones that could not be (a read-only filesystem) are returned."""
    left = []
    for f in files:
        try:
            os.unlink(f["temp"])
        except FileNotFoundError:
            pass
        except OSError:
            left.append(f["temp"])
    return left


def _open_temp(f: dict[str, Any]) -> int:
    """A descriptor of the transferred temporary file, which must be a regular file of its own.

    Owner and mode are later set on this descriptor, never by path: a symlink or a hard link
    planted at the temporary name cannot make the commit change another file.
    """
    temp = f["temp"]
    try:
        fd = open_regular(temp, f"{f['name']}: the transferred file {temp}")
    except FileNotFoundError:
        raise StageError(f"{f['name']}: the transferred file {temp} is missing; run the play again") from None
    except UnsafeFileError as exc:
        raise StageError(f"{exc} (nothing was replaced)") from None
    if os.fstat(fd).st_nlink != 1:
        os.close(fd)
        raise StageError(
            f"{f['name']}: the transferred file {temp} has other hard links; something other than the transfer"
            " wrote it: remove it and run the play again (nothing was replaced)"
        )
    return fd


def _sha256_fd(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while True:
        chunk = os.read(fd, 8 * 1024 * 1024)
        if not chunk:
            return h.hexdigest()
        h.update(chunk)


def _verify(f: dict[str, Any], fd: int) -> str:
    """SHA-256 of a transferred temporary file (open as ``fd``), after checking its size and digest."""
    size = os.fstat(fd).st_size
    if size != f["size"]:
        raise StageError(
            f"{f['name']}: the transfer wrote {size} bytes but the source has {f['size']}: the copy is"
            " incomplete; run the play again"
        )
    # A digest taken while the file was written counts only if it is the right one; otherwise the
    # finished file is read again (rsync may have rewritten part of it after a failed check).
    got = f["digest"] if f.get("prehashed") == f["digest"] else _sha256_fd(fd)
    if got != f["digest"]:
        if f["digest_from"] == "inventory":
            raise StageError(
                f"{f['name']}: SHA-256 of {f['origin']} is {got} but the inventory expects {f['digest']}:"
                " the source is not the expected file; check model_stage_src and model_stage_sha256"
                " (nothing was replaced)"
            )
        raise StageError(
            f"{f['name']}: SHA-256 of the copy is {got} but the source's is {f['digest']}: the copy is"
            " corrupt; run the play again (nothing was replaced)"
        )
    return got


def _already_committed(dest: str, f: dict[str, Any], records: dict[str, dict[str, Any]]) -> bool:
    """The temporary file is gone because it is in place already, verified and recorded."""
    if os.path.exists(f["temp"]):
        return False
    rec = records.get(f["name"])
    try:
        st = os.stat(os.path.join(dest, f["name"]))
    except FileNotFoundError:
        return False
    return (
        rec is not None
        and rec.get("sha256") == f["digest"]
        and (st.st_size, int(st.st_mtime)) == (f["size"], f["mtime"])
        and (rec.get("size"), rec.get("mtime")) == (f["size"], f["mtime"])
    )


@contextlib.contextmanager
def _locked(dest: str) -> Iterator[None]:
    """One plan or commit at a time per destination (flock on the directory itself: no lock file)."""
    if not os.path.isdir(dest):
        yield
        return
    while True:
        fd = os.open(dest, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        st, now = os.fstat(fd), os.stat(dest)
        if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
            break
        os.close(fd)  # another run swapped a new directory in while this one waited: lock that one
    try:
        yield
    finally:
        os.close(fd)


def commit(module: AnsibleModule) -> dict[str, Any]:
    """Verify every transferred temporary file, then rename all into place and record them."""
    p = module.params
    dest = p["dest"]
    uid, gid = _ids(p["owner"], p["group"])
    file_mode = _mode(p["mode"], "mode")
    entries = p["files"] or []
    by_kind: dict[str, list[dict[str, Any]]] = {"transfer": [], "keep": [], "remove": [], "generate_index": []}
    for f in entries:
        by_kind[f["kind"]].append(f)
    transfers = by_kind["transfer"]
    sharded = len(transfers) + len(by_kind["keep"]) > 1
    records = parse_sidecar(_scan_dest(dest)[2])
    fds: dict[str, int] = {}
    try:
        return _commit(module, dest, uid, gid, file_mode, by_kind, transfers, sharded, records, fds)
    finally:
        for fd in fds.values():
            os.close(fd)


def _commit(
    module: AnsibleModule,
    dest: str,
    uid: int,
    gid: int,
    file_mode: int,
    by_kind: dict[str, list[dict[str, Any]]],
    transfers: list[dict[str, Any]],
    sharded: bool,
    records: dict[str, dict[str, Any]],
    fds: dict[str, int],
) -> dict[str, Any]:
    p = module.params
    shard_tensors: dict[str, dict[str, int]] = {}
    index_text: str | None = None
    new_records: dict[str, dict[str, Any]] = {}
    try:
        for f in transfers:
            if _already_committed(dest, f, records):
                # The same commit ran before (an SSH retry re-runs a module whose first run went on).
                shard_tensors[f["name"]] = {} if f["name"] == INDEX_NAME else _header(os.path.join(dest, f["name"]))
                new_records[f["name"]] = records[f["name"]]
                f["done"] = True
                continue
            fds[f["name"]] = _open_temp(f)
            digest = _verify(f, fds[f["name"]])
            source = SourceFile(
                f["name"],
                f["origin"],
                int(f["size"]),
                int(f["mtime"]),
                mtime_ns=int(f["mtime_ns"]) if f.get("mtime_ns") is not None else None,
            )
            new_records[f["name"]] = record(source, digest)
            if f["name"] == INDEX_NAME:
                index_text = _read_index(f["temp"])
            else:
                shard_tensors[f["name"]] = _header(f["temp"])
        if sharded:
            for f in by_kind["keep"]:
                path = os.path.join(dest, f["name"])
                if f["name"] == INDEX_NAME:
                    index_text = _read_index(path)
                else:
                    shard_tensors[f["name"]] = _header(path)
            if by_kind["generate_index"]:
                index_text = render_index(build_index(shard_tensors))
            elif index_text is None and any(f.get("done") and f["name"] == INDEX_NAME for f in transfers):
                pass
            elif index_text is not None:
                try:
                    index = loads_json(index_text, f"{INDEX_NAME} from the source")
                except UnsafeFileError as exc:
                    raise StageError(str(exc)) from None
                check_index(index, {k: set(v) for k, v in shard_tensors.items()}, INDEX_NAME)
    except (StageError, OSError) as exc:
        _remove_temps(transfers)
        if isinstance(exc, OSError):
            raise StageError(f"{dest}: {exc.strerror or exc}; nothing was replaced") from None
        raise

    changed = False
    transfers = [f for f in transfers if not f.get("done")]
    path = dest
    try:
        for f in transfers:
            path = f["temp"]
            os.fchown(fds[f["name"]], uid, gid)
            os.fchmod(fds[f["name"]], file_mode)
        for f in by_kind["keep"]:
            path = os.path.join(dest, f["name"])
            changed = _fix_attrs(path, uid, gid, file_mode) or changed
    except OSError as exc:
        # Before anything is replaced (a read-only remount shows first here, as fchown needs a write).
        left = _remove_temps(transfers)
        problem, remedy = write_problem(exc, path)
        removed = (
            " (the transferred files stay for the next run)" if left else " and the transferred files were removed"
        )
        raise StageError(
            f"{path}: setting its owner and mode failed ({problem}); nothing was replaced{removed}: {remedy}"
        ) from None
    write_index = False
    if by_kind["generate_index"] and index_text is not None:
        path = os.path.join(dest, INDEX_NAME)
        try:
            old = _read_index(path)
        except FileNotFoundError:
            old = None
        except StageError:
            old = ""  # not a regular file: replaced (a rename never writes through it)
        write_index = old != index_text
    removes = [f["name"] for f in by_kind["remove"] if os.path.lexists(os.path.join(dest, f["name"]))]
    _, _, side_text = _scan_dest(dest)
    keep_names = {f["name"] for f in by_kind["keep"]}
    merged = {n: r for n, r in records.items() if n in keep_names}
    merged.update(new_records)
    side = render_sidecar(merged)
    replaced = (
        [f["name"] for f in transfers] + removes + [INDEX_NAME] * write_index + [SIDECAR_NAME] * (side != side_text)
    )
    _refuse_locked(dest, replaced, transfers)
    if len(transfers) + len(removes) + int(write_index) > 1:
        # Several files change: build the new set beside dest and swap it in as one directory.
        writes = {SIDECAR_NAME: (side, 0o644)}
        if write_index and index_text is not None:
            writes[INDEX_NAME] = (index_text, file_mode)
        identity = {f["name"]: _dev_ino(fds[f["name"]]) for f in transfers}
        new = NewSet(
            place={f["name"]: f["temp"] for f in transfers}, write=writes, remove=set(removes), identity=identity
        )
        try:
            replace_set(dest, new, uid, gid, _mode(p["dir_mode"], "dir_mode"))
        except StageError:
            _remove_temps(transfers)
            raise
        except OSError as exc:
            _remove_temps(transfers)
            problem, remedy = write_problem(exc, exc.filename or os.path.join(dest, SIDECAR_NAME))
            raise StageError(
                f"{dest}: building the new set of files beside it failed ({problem}); nothing was replaced and the"
                f" transferred files were removed: {remedy}"
            ) from None
        reread = sorted(f["name"] for f in transfers if f.get("prehashed") != f["digest"])
        return {"changed": True, "files": merged, "transferred": sorted(new_records), "reread": reread, "swapped": True}
    # At most one file changes: one rename (or removal) is atomic by itself.
    for f in transfers:
        final = os.path.join(dest, f["name"])
        try:
            os.replace(f["temp"], final)
        except OSError as exc:
            _remove_temps(transfers)
            problem, remedy = write_problem(exc, final)
            raise StageError(f"{final}: cannot be replaced ({problem}); nothing was replaced: {remedy}") from None
        _check_placed(final, fds[f["name"]])
        changed = True
    try:
        if write_index and index_text is not None:
            _atomic_write(os.path.join(dest, INDEX_NAME), index_text, uid, gid, file_mode)
            changed = True
        for name in removes:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(dest, name))
                changed = True
        if side != side_text:
            _atomic_write(os.path.join(dest, SIDECAR_NAME), side, uid, gid, 0o644)
    except OSError as exc:
        placed = ", ".join(f["name"] for f in transfers) or "nothing"
        problem, remedy = write_problem(exc, exc.filename or os.path.join(dest, SIDECAR_NAME))
        raise StageError(
            f"{dest}: {placed} was put in place, verified, but finishing failed ({problem}); the next run checks"
            f" the files again: {remedy}"
        ) from None
    fsync_path(dest)
    reread = sorted(f["name"] for f in transfers if f.get("prehashed") != f["digest"])
    return {"changed": changed, "files": merged, "transferred": sorted(new_records), "reread": reread, "swapped": False}


def _refuse_locked(dest: str, names: list[str], transfers: list[dict[str, Any]]) -> None:
    """Refuse before anything changes when a file the commit replaces or removes is chattr +i or +a.

    The set swap exchanges directories, which such a file does not stop: it would be replaced
    anyway and the old set could not be removed. The operator marked it so it stays: say so.
    """
    for name in names:
        path = os.path.join(dest, name)
        attribute = locked_attribute(path)
        if attribute is not None:
            _remove_temps(transfers)
            flag = "i" if attribute == "immutable" else "a"
            raise StageError(
                f"{path} is {attribute} (chattr +{flag}); nothing was replaced and the transferred files were"
                f" removed: if it is meant to change, run chattr -{flag} {path} and run the play again"
            )


def _read_index(path: str) -> str:
    try:
        return read_regular(path, MAX_RECORD_BYTES).decode("utf-8", "replace")
    except UnsafeFileError as exc:
        raise StageError(str(exc)) from None


def _fix_attrs(path: str, uid: int, gid: int, mode: int) -> bool:
    """Set owner, group and mode of a file in dest through a descriptor (never through a link)."""
    try:
        fd = open_regular(path)
    except UnsafeFileError as exc:
        raise StageError(f"{exc} (nothing was replaced)") from None
    try:
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, mode):
            return False
        if st.st_nlink != 1:
            raise StageError(f"{path} has other hard links; its owner is not changed: remove the extra links")
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
        return True
    finally:
        os.close(fd)


def _dev_ino(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _check_placed(final: str, fd: int) -> None:
    """The entry renamed into place is the file verified (not one swapped in at the temporary name)."""
    st, want = os.lstat(final), os.fstat(fd)
    if (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino):
        os.unlink(final)
        raise StageError(
            f"{final}: the temporary file was replaced between its check and its rename; the entry was removed:"
            " check who writes into the destination and run the play again"
        )


def _atomic_write(path: str, text: str, uid: int, gid: int, mode: int) -> None:
    atomic_write(path, text, mode, (uid, gid), prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX)


def validate(params: dict[str, Any]) -> None:
    """Refuse, before anything is touched, settings no staging can work with."""
    for name in ("src", "dest"):
        value = params[name]
        if not value or not str(value).strip():
            raise StageError(f"{name} is empty; give the path of the {'weights' if name == 'src' else 'directory'}")
        if "\x00" in str(value):
            raise StageError(f"{name} holds a NUL character, which no path can hold; check model_stage_{name}")
    for name in ("owner", "group"):
        if "\x00" in params[name]:
            raise StageError(f"{name} {params[name]!r} holds a NUL character, which no {name} name can hold")
    problem = file_entries_problem(params["files"], params["dest"], params["step"] or "plan")
    if problem is not None:
        raise StageError(
            f"{problem}; files is what the safetensors_stage action sends its node steps: run the role or the"
            " action, not a step by hand"
        )
    if params["space_margin"] < 0:
        raise StageError(
            f"space_margin is {params['space_margin']}; it must be 0 or more bytes (a negative margin would turn the"
            " free-space check off)"
        )


def run(module: AnsibleModule) -> None:
    step = module.params["step"] or "plan"
    try:
        validate(module.params)
        with _locked(module.params["dest"]):
            if step == "plan":
                result = plan(module)
            elif step == "follow":
                result = follow(module)
            elif step == "copy":
                result = copy_local(module)
            else:
                result = commit(module)
    except (StageError, UnsafeFileError) as exc:
        module.fail_json(msg=str(exc))
    except OSError as exc:
        where = exc.filename2 or exc.filename or module.params["dest"]
        problem, remedy = write_problem(exc, str(where))
        module.fail_json(msg=f"{module.params['dest']}: {problem} ({where}); {remedy}")
    module.exit_json(dest=module.params["dest"], **result)


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
