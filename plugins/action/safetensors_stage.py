"""Action plugin (controller side) of safetensors_stage: validate the source, rsync, verify, commit.

The node-side module plans (free space, what changed, stale temporary files) and commits
(SHA-256, header, atomic rename, owner and mode, sidecar). Between the two this plugin runs
rsync over the host's own SSH settings (address, port, user, key, common/extra args, become
through sudo) into a temporary name inside the destination, with ``--append-verify`` so an
interrupted transfer of the same source resumes where it stopped. The sources' SHA-256 digests
are computed on the controller while rsync runs and cached by (path, size, mtime, inode).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ansible.module_utils
from ansible import constants as C
from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

_HERE = Path(__file__).resolve().parent
for _p in [*(C.DEFAULT_MODULE_UTILS_PATH or []), str(_HERE.parent.parent / "module_utils")]:
    if os.path.isdir(_p) and _p not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(_p)

from ansible.module_utils.model_stage import (
    INDEX_NAME,
    MAX_RECORD_BYTES,
    SIDECAR_NAME,
    SWAP_PREFIX,
    TEMP_PREFIX,
    DestFile,
    SourceFile,
    StageError,
    expected_digests,
    parse_sidecar,
    plan_stage,
    source_layout,
)
from ansible.module_utils.safetensors_header import (
    SafetensorsError,
    inspect_shards,
    read_file_header,
)
from ansible.module_utils.terminal_text import terminal_text

MODULE = "safetensors_stage"
# A multi-GB transfer takes minutes: a line with rsync's own progress at most this often.
PROGRESS_S = 30
_PROGRESS = re.compile(r"^\s*([\d,.]+)\s+(\d+)%\s+(\S+/s)\s+(\d+:\d{2}:\d{2})")
display = Display()
_MARK = "--model-stage-sidecar--"
_CHUNK = 8 * 1024 * 1024
HASH_NICE = 10


def rsync_progress(line: str) -> tuple[int, int, str, str] | None:
    """Bytes so far, percent, rate and time left from one line of rsync's --info=progress2 (LC_ALL=C),
    such as '    130,285,568  43%   58.62MB/s    0:00:02'; None for any other line."""
    m = _PROGRESS.match(line)
    if not m:
        return None
    return int(re.sub(r"[,.]", "", m.group(1))), int(m.group(2)), m.group(3), m.group(4)


def progress_message(host: str, name: str, done: int, size: int, pct: int, rate: str, left: str) -> str:
    gib = 1024**3
    return f"{host}: staging {name}: {done / gib:.1f} of {size / gib:.1f} GiB ({pct}%), {rate}, {left} left"


def run_rsync(cmd: list[str], report: Any, every_s: float = PROGRESS_S) -> tuple[int, str]:
    """Run rsync with --info=progress2, calling report(bytes, percent, rate, left) at most every every_s
    seconds while it transfers; its exit status and stderr."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [*cmd[:1], "--info=progress2", *cmd[1:]],
            stdout=subprocess.PIPE,
            stderr=err,
            env=dict(os.environ, LC_ALL="C"),
        )
        assert proc.stdout is not None
        last, buf = time.monotonic(), b""
        while chunk := proc.stdout.read1(65536):
            buf += chunk
            *lines, buf = re.split(rb"[\r\n]", buf)
            progress = next(
                (p for p in map(rsync_progress, (ln.decode("ascii", "replace") for ln in reversed(lines))) if p), None
            )
            if progress and time.monotonic() - last >= every_s:
                last = time.monotonic()
                report(*progress)
        rc = proc.wait()
        err.seek(0)
        return rc, err.read().decode("utf-8", "replace")


def cached_sha256(path: str, cache_dir: str) -> str:
    """SHA-256 of a controller file, cached by (realpath, size, mtime_ns, inode) under a lock.

    Several hosts staging the same source at once hash it once; an unchanged source is never
    hashed again.
    """
    st = os.stat(path)
    real = os.path.realpath(path)
    key = hashlib.sha256(real.encode()).hexdigest()[:32]
    os.makedirs(cache_dir, mode=0o700, exist_ok=True)
    entry = os.path.join(cache_dir, key + ".json")
    stamp = {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
    with open(os.path.join(cache_dir, key + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(entry, encoding="utf-8") as fh:
                rec = json.load(fh)
            if {k: rec.get(k) for k in stamp} == stamp and isinstance(rec.get("sha256"), str):
                return rec["sha256"]
        except (OSError, ValueError):
            pass
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
        digest = h.hexdigest()
        if os.stat(path).st_mtime_ns == st.st_mtime_ns:
            tmp = entry + ".tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump({**stamp, "sha256": digest}, fh)
            os.replace(tmp, entry)
        return digest


def unchanged_on_node(listing: str, sources: list[dict[str, Any]], args: dict[str, Any]) -> dict[str, Any] | None:
    """The sidecar's records when a ``find -printf`` listing of dest shows nothing to do, else None.

    ``listing`` is ``find DEST -maxdepth 1 -printf '%P|%s|%T@|%u|%g|%m|%y\\n'``, the marker line and
    the sidecar's text. Anything unexpected answers None: the full plan on the node decides then.
    """
    # become through sudo runs the command on a tty: lines end in CR LF.
    text, sep, side = listing.replace("\r\n", "\n").partition(_MARK + "\n")
    if not sep or len(side) > MAX_RECORD_BYTES:
        return None
    entries: dict[str, tuple[int, int, str, str, int, str, int | None]] = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) != 7:
            return None
        name, size, mtime, user, group, mode, kind = parts
        stamp = mtime_ns_of(mtime)
        if stamp is None or not size.isascii() or not size.isdigit() or len(size) > 20:
            return None  # not what find prints: the full plan on the node decides
        try:
            # Seconds as the node's module reads them (int of the float), nanoseconds exactly.
            entries[name] = (int(size), int(float(mtime)), user, group, int(mode, 8), kind, stamp)
        except ValueError:
            return None
    want_mode, want_dir = int(str(args.get("mode") or "0640"), 8), int(str(args.get("dir_mode") or "0750"), 8)
    owner = (str(args["owner"]), str(args["group"]))
    top = entries.pop("", None)
    # dest itself is root's (the module's DIR_UID), with the files' group.
    if top is None or top[5] != "d" or top[2:4] != ("root", owner[1]) or top[4] != want_dir:
        return None
    if len(sources) > 1 and not any(f["name"] == INDEX_NAME for f in sources):
        return None  # a generated index: the node compares it with the shards' headers
    dest = {n: DestFile(e[0], e[1], 0, 0, e[4], e[6]) for n, e in entries.items() if e[5] == "f"}
    temps = {n: e[0] for n, e in entries.items() if n.startswith(TEMP_PREFIX)}
    records = parse_sidecar(side)
    srcs = [
        SourceFile(f["name"], f["origin"], f["size"], f["mtime"], f.get("sha256"), f.get("mtime_ns")) for f in sources
    ]
    plan = plan_stage(srcs, dest, records, temps, False)
    if plan.transfers or plan.stale_temps or plan.stale_weights:
        return None
    for f in sources:
        e = entries[f["name"]]
        if e[2:4] != owner or e[4] != want_mode:
            return None
    return {f["name"]: records[f["name"]] for f in sources}


def mtime_ns_of(text: str) -> int | None:
    """find's ``%T@`` (seconds since the epoch with up to ten fraction digits) as whole nanoseconds; None
    for anything else. Read as digits, not as a float: a float keeps only about 7 fraction digits."""
    whole, _, fraction = text.partition(".")
    if not (whole.isascii() and whole.isdigit() and len(whole) <= 12) or not (
        fraction == "" or (fraction.isascii() and fraction.isdigit())
    ):
        return None
    return int(whole) * 10**9 + int((fraction + "000000000")[:9])


def quick_check_command(dest: str) -> str:
    """The shell command whose output ``unchanged_on_node`` judges; it fails (so the module plans)
    when a staging directory left beside dest by an interrupted replacement is there."""
    dest = dest.rstrip("/") or "/"
    swap = f'"$(dirname -- "$r")/{SWAP_PREFIX}$(basename -- "$r")'
    side = shlex.quote(dest + "/" + SIDECAR_NAME)
    # The sidecar only as a regular file (a symlink to /dev/zero or a FIFO fails the check), bounded.
    return (
        f'r=$(readlink -f -- {shlex.quote(dest)}) && test ! -e {swap}" && test ! -e {swap}.probe"'
        f" && find {shlex.quote(dest)} -maxdepth 1 -printf '%P|%s|%T@|%u|%g|%m|%y\\n'"
        f" && echo {_MARK} && test -f {side} && test ! -L {side} && head -c {MAX_RECORD_BYTES + 1} -- {side}"
    )


def rsync_quote(arg: str) -> str:
    """Quote one word of rsync's -e command (rsync splits on spaces and honours quotes)."""
    if arg and all(c not in arg for c in " '\"\t"):
        return arg
    if "'" in arg:
        return '"' + arg + '"'
    return "'" + arg + "'"


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(
        ("src", "remote_src", "dest", "sha256", "owner", "group", "mode", "dir_mode", "space_margin", "rsync_opts")
    )

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        rsync_opts = args.pop("rsync_opts", None) or []
        if not isinstance(rsync_opts, list) or not all(isinstance(o, str) for o in rsync_opts):
            raise AnsibleActionFail("rsync_opts must be a list of strings")
        for key in ("src", "dest", "owner", "group"):
            if not args.get(key):
                raise AnsibleActionFail(f"{key} is required")
        if not os.path.isabs(str(args["dest"])):
            raise AnsibleActionFail(f"dest must be an absolute path on the node, not {args['dest']!r}")
        try:
            if args.get("remote_src"):
                return self._stage_remote(args, task_vars, result)
            return self._stage_from_controller(args, rsync_opts, task_vars, result)
        except StageError as exc:
            raise AnsibleActionFail(str(exc)) from None
        finally:
            self._remove_tmp_path(self._connection._shell.tmpdir)

    # ------------------------------------------------------------------ node calls

    def _node(self, args: dict[str, Any], task_vars: dict[str, Any], **extra: Any) -> dict[str, Any]:
        res = self._execute_module(module_name=MODULE, module_args={**args, **extra}, task_vars=task_vars)
        if res.get("failed"):
            raise AnsibleActionFail(res.get("msg", f"{MODULE} failed on the node"), result=res)
        return res

    @staticmethod
    def _finish(result: dict[str, Any], planned: dict[str, Any], done: dict[str, Any] | None) -> dict[str, Any]:
        result.update(
            changed=bool(planned.get("changed") or (done or {}).get("changed")),
            dest=planned["dest"],
            actions=planned.get("actions", []),
            transferred=(done or {}).get("transferred", []),
            bytes_transferred=sum(t["size"] - t["partial"] for t in planned["transfers"]) if done else 0,
            bytes_needed=planned.get("bytes_needed"),
            bytes_free=planned.get("bytes_free"),
        )
        if done:
            result["files"] = done.get("files", {})
            result["reread"] = done.get("reread", [])
            result["swapped"] = bool(done.get("swapped"))
        if result["changed"]:
            result["diff"] = planned["diff"]
        return result

    @staticmethod
    def _commit_files(planned: dict[str, Any], digests: dict[str, str]) -> list[dict[str, Any]]:
        files = []
        for t in planned["transfers"]:
            expected = t.get("sha256")
            files.append(
                {
                    **t,
                    "kind": "transfer",
                    "digest": expected or digests[t["name"]],
                    "digest_from": "inventory" if expected else "source",
                }
            )
        files += [{"name": n, "kind": "keep"} for n in planned["keep"]]
        files += [{"name": n, "kind": "remove"} for n in planned["stale_weights"]]
        if planned["write_index"]:
            files.append({"name": INDEX_NAME, "kind": "generate_index"})
        return files

    # ------------------------------------------------------------------ node-local source

    def _stage_remote(self, args: dict[str, Any], task_vars: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        planned = self._node(args, task_vars, step="plan")
        if self._task.check_mode or not (
            planned["transfers"] or planned["stale_weights"] or planned["attrs"] or planned["index_stale"]
        ):
            return self._finish(result, planned, None if self._task.check_mode else {"changed": False})
        copied = self._node(
            args, task_vars, step="copy", files=[{**t, "kind": "transfer"} for t in planned["transfers"]]
        )
        done = self._node(args, task_vars, step="commit", files=self._commit_files(planned, copied["digests"]))
        return self._finish(result, planned, done)

    # ------------------------------------------------------------------ controller source

    def _controller_sources(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        src = os.path.expanduser(str(args["src"]))
        if not os.path.exists(src):
            raise StageError(f"{src}: the source does not exist on the controller; check model_stage_src")
        is_dir = os.path.isdir(src)
        layout = source_layout(src, is_dir, os.listdir(src) if is_dir else [])
        try:
            if is_dir and any(name == INDEX_NAME for _, name in layout):
                inspect_shards(os.path.join(src, INDEX_NAME))
            else:
                for path, _ in layout:
                    read_file_header(path)
        except SafetensorsError as exc:
            raise StageError(f"the source is not a valid safetensors checkpoint: {exc}") from None
        names = [os.path.basename(p) for p, _ in layout]
        digests = expected_digests(args.get("sha256"), names, names[0] if len(layout) == 1 else None)
        out = []
        for path, name in layout:
            st = os.stat(path)
            out.append(
                {
                    "name": name,
                    "origin": path,
                    "size": st.st_size,
                    "mtime": int(st.st_mtime),
                    "mtime_ns": st.st_mtime_ns,
                    "sha256": digests.get(os.path.basename(path)),
                }
            )
        return out

    def _quick_check(self, args: dict[str, Any], files: list[dict[str, Any]]) -> dict[str, Any] | None:
        cmd = quick_check_command(str(args["dest"]))
        try:
            res = self._low_level_execute_command(cmd, sudoable=True)
        except Exception:  # any trouble: the module decides
            return None
        if res.get("rc") != 0:
            return None
        return unchanged_on_node(res.get("stdout", ""), files, args)

    def _ssh_target(self, task_vars: dict[str, Any]) -> tuple[list[str], str]:
        """rsync's -e/--rsync-path options and the host prefix of the remote path."""
        conn = self._connection
        transport = conn.transport
        become = self._play_context.become
        if transport.endswith("local"):
            if become and os.geteuid() != 0:
                raise StageError("staging to the controller itself with become needs the play to run as root")
            return [], ""
        if not transport.endswith("ssh"):
            raise StageError(
                f"safetensors_stage transfers with rsync over SSH; this host uses the {transport!r} connection."
                " Put the weights on the node first and use model_stage_remote_src: true"
            )
        ssh = [conn.get_option("ssh_executable") or "ssh"]
        for opt in ("ssh_args", "ssh_common_args", "ssh_extra_args"):
            val = conn.get_option(opt)
            if val:
                ssh += shlex.split(val)
        if conn.get_option("host_key_checking") is False:
            ssh += ["-o", "StrictHostKeyChecking=no"]
        port = conn.get_option("port")
        if port:
            ssh += ["-o", f"Port={port}"]
        key = conn.get_option("private_key_file")
        if key:
            ssh += ["-o", f"IdentityFile={os.path.expanduser(key)}"]
        ssh += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={conn.get_option('timeout')}"]
        ssh = [a for a in ssh if not a.startswith("ControlPath")]
        opts = ["-e", " ".join(rsync_quote(a) for a in ssh)]
        if become:
            method = self._play_context.become_method
            user = self._play_context.become_user or "root"
            if method != "sudo" or user != "root":
                raise StageError(
                    f"safetensors_stage escalates with 'sudo rsync'; become_method {method!r} to {user!r} is not"
                    " supported: use sudo to root, or connect as root"
                )
            opts += ["--rsync-path", "sudo -n rsync"]
        host = conn.get_option("host") or self._play_context.remote_addr
        if ":" in host:
            host = f"[{host}]"
        user = conn.get_option("remote_user")
        return opts, (f"{user}@{host}:" if user else f"{host}:")

    def _stage_from_controller(
        self, args: dict[str, Any], rsync_opts: list[str], task_vars: dict[str, Any], result: dict[str, Any]
    ) -> dict[str, Any]:
        t0 = time.monotonic()
        timings: dict[str, float] = {}

        def lap(name: str, since: float) -> float:
            now = time.monotonic()
            timings[name] = round(now - since, 3)
            return now

        files = self._controller_sources(args)
        kept = self._quick_check(args, files)
        if kept is not None:
            # Everything in place: one stat of dest over the connection, no module, no hashing.
            result.update(changed=False, dest=args["dest"], actions=[], transferred=[], bytes_transferred=0, files=kept)
            return result
        t = lap("check", t0)
        planned = self._node(args, task_vars, step="plan", files=files)
        t = lap("plan", t)
        if self._task.check_mode:
            return self._finish(result, planned, None)
        if not (planned["transfers"] or planned["stale_weights"] or planned["attrs"] or planned["index_stale"]):
            return self._finish(result, planned, {"changed": False})
        cache_var = task_vars.get("model_stage_controller_cache") or "~/.cache/model_stage"
        cache_dir = os.path.expanduser(str(self._templar.template(cache_var)))
        digests: dict[str, str] = {}
        errors: list[BaseException] = []

        def hash_sources() -> None:
            # The transfer is the critical path; the digest has until the transfer ends. On a busy
            # controller, let rsync and ssh have the CPU first (Linux: the nice value of this thread).
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HASH_NICE)
            try:
                for t in planned["transfers"]:
                    if not t.get("sha256"):
                        digests[t["name"]] = cached_sha256(t["origin"], cache_dir)
            except BaseException as exc:  # reported after rsync finishes
                errors.append(exc)

        hasher = threading.Thread(target=hash_sources, daemon=True)
        hasher.start()
        ssh_opts, prefix = self._ssh_target(task_vars)
        failures: list[str] = []
        host = task_vars.get("inventory_hostname", "?")

        def transfer() -> None:
            for t in planned["transfers"]:
                cmd = [
                    "rsync",
                    "--times",
                    "--partial",
                    "--append-verify",
                    "--chmod=F0600",
                    "--timeout=300",
                    *ssh_opts,
                    *rsync_opts,
                    t["origin"],
                    prefix + t["temp"],
                ]
                rc, stderr = run_rsync(
                    cmd,
                    lambda done, pct, rate, left, t=t: display.display(
                        progress_message(host, t["name"], done, t["size"], pct, rate, left)
                    ),
                )
                if rc != 0:
                    failures.append(
                        f"rsync of {t['origin']} to {t['temp']} failed (exit {rc}):"
                        f" {terminal_text(stderr.strip()[-1500:])}. The partial copy is kept; the next run resumes it."
                    )
                    return

        def timed_transfer() -> None:
            transfer()
            lap("transfer", t)

        mover = threading.Thread(target=timed_transfer, daemon=True)
        mover.start()
        # Meanwhile the node hashes what arrives, so the commit need not read the files again.
        try:
            follow = [{"name": t["name"], "temp": t["temp"], "size": t["size"]} for t in planned["transfers"]]
            prehashed = self._node(args, task_vars, step="follow", files=follow).get("prehashed", {})
        except AnsibleActionFail:
            prehashed = {}
        lap("follow", t)
        mover.join()
        if failures:
            raise StageError(failures[0])
        hasher.join()
        t = lap("hashed", t)
        if errors:
            raise StageError(f"cannot hash the source on the controller: {errors[0]}")
        files = self._commit_files(planned, digests)
        for f in files:
            if f["kind"] == "transfer":
                f["prehashed"] = prehashed.get(f["name"])
        done = self._node(args, task_vars, step="commit", files=files)
        lap("commit", t)
        result["timings"] = timings
        return self._finish(result, planned, done)
