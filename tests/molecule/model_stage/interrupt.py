#!/usr/bin/env python3
"""Run a command and kill it (and everything it started) once a staging temp file has grown.

    interrupt.py DIR MIN_BYTES TIMEOUT -- COMMAND...

DIR is the destination directory as seen from this machine (a lab node's rootfs path). When a
``.model_stage-*.part`` file there reaches MIN_BYTES, the command's whole process group gets
SIGKILL, like an operator's Ctrl-C plus a lost connection. Prints the size reached and exits 0;
exits 1 if the command ended by itself or TIMEOUT seconds passed first.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    sep = argv.index("--")
    where, min_bytes, timeout = argv[0], int(argv[1]), float(argv[2])
    proc = subprocess.Popen(argv[sep + 1 :], start_new_session=True, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(f"the command finished (rc {proc.returncode}) before it could be interrupted")
            return 1
        sizes = [os.path.getsize(p) for p in glob.glob(os.path.join(where, ".model_stage-*.part"))]
        if sizes and max(sizes) >= min_bytes:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            print(f"interrupted at {max(sizes)} bytes")
            return 0
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    print(f"no temporary file reached {min_bytes} bytes within {timeout:.0f}s")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
