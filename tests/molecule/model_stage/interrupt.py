#!/usr/bin/env python3
"""Run a staging play and kill its rsync part way, as a dropped connection or a killed transfer would.

    interrupt.py DIR MIN_BYTES TIMEOUT -- COMMAND...

DIR is the destination directory as seen from this machine (a lab node's rootfs path). When a
``.model_stage-*.part`` file there reaches MIN_BYTES, the rsync sending it (the controller-side
process whose arguments name that file) gets SIGKILL. Ansible runs tasks in worker processes of
their own session, so killing the playbook itself would not stop the transfer. The play must then
fail by itself. Prints the size reached and the play's exit status; exits 0 when the play was
interrupted and failed, 1 otherwise.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time


def senders(temp_name: str) -> list[int]:
    """Pids of rsync processes (not the node's receiving side) whose arguments name the file."""
    pids = []
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(os.path.join(d, "cmdline"), "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if (
            argv
            and os.path.basename(argv[0]) == b"rsync"
            and b"--server" not in argv
            and any(temp_name.encode() in a for a in argv)
        ):
            pids.append(int(os.path.basename(d)))
    return pids


def main(argv: list[str]) -> int:
    sep = argv.index("--")
    where, min_bytes, timeout = argv[0], int(argv[1]), float(argv[2])
    proc = subprocess.Popen(argv[sep + 1 :], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    reached = 0
    while time.monotonic() < deadline and proc.poll() is None:
        parts = {p: os.path.getsize(p) for p in glob.glob(os.path.join(where, ".model_stage-*.part"))}
        big = [p for p, size in parts.items() if size >= min_bytes]
        pids = senders(os.path.basename(big[0])) if big else []
        if pids:
            reached = parts[big[0]]
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    try:
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    print(out[-4000:])
    print(f"interrupted at {reached} bytes; the play exited with {proc.returncode}")
    return 0 if reached and proc.returncode != 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
