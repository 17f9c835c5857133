#!/usr/bin/python3
"""Stand-in for NVIDIA's nvidia-smi: replays real captured H200 outputs, for lab nodes without a GPU.

Installed as /usr/bin/nvidia-smi on lab nodes. What it answers comes from:

- the node state /etc/lab-fakes/gpu.json: {"fixture": "h200-x1", "fault": null}; optional
  "nvml_library_version" (the userspace version reported by the "driver-mismatch" fault);
- the fixture directory /usr/share/lab-fakes/nvidia-smi/<fixture>/ (tests/fixtures/nvidia-smi/
  in the repository): query-gpu.csv (header with units), query-apps.csv, nvidia-smi.txt,
  nvidia-smi-q.txt (optional), driver.txt, topo.txt (optional);
- holders: JSON files in /run/lab-fakes/gpu-holders/ written by the stand-in engines while they run,
  {"pid": 123, "gpus": [0], "mib": 2426, "name": "sglang"} ("mib" per GPU; no "gpus" means all).
  Files whose pid is no longer alive are ignored. A holder adds its memory to memory.used, takes it
  from memory.free, and shows up in --query-compute-apps and the process table under the process's
  argv[0], as real nvidia-smi shows it (the file's "name" only if /proc/PID/cmdline is unreadable).

Faults ("fault" in gpu.json), with the texts and exit codes real nvidia-smi 580.159.04 prints:

- "no-devices": /dev/nvidiactl present, no /dev/nvidiaN (captured): "No devices were found", exit 6;
  -L prints "No devices found." and exits 0.
- "driver-not-loaded": no /dev/nvidiactl (captured): "NVIDIA-SMI has failed because it couldn't
  communicate with the NVIDIA driver. ...", exit 9.
- "access-blocked": device nodes not usable as devices (captured): "Failed to initialize NVML: GPU
  access blocked by the operating system", exit 17.
- "driver-mismatch" (hand-written from the real error text; exit code = NVML_ERROR_LIB_RM_VERSION_
  MISMATCH): "Failed to initialize NVML: Driver/library version mismatch" plus "NVML library
  version: X", exit 18.
- "nvml-fail" (hand-written from the real error text seen in LXC containers whose cgroup denies the
  device): "Failed to initialize NVML: Unknown Error", exit 255.

Paths can be moved with the environment (used by unit tests): LAB_FAKES_GPU_STATE,
LAB_FAKES_NVIDIA_SMI_FIXTURES, LAB_FAKES_GPU_HOLDERS.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

STATE = Path(os.environ.get("LAB_FAKES_GPU_STATE", "/etc/lab-fakes/gpu.json"))
FIXTURES = Path(os.environ.get("LAB_FAKES_NVIDIA_SMI_FIXTURES", "/usr/share/lab-fakes/nvidia-smi"))
HOLDERS = Path(os.environ.get("LAB_FAKES_GPU_HOLDERS", "/run/lab-fakes/gpu-holders"))

NVML_DRIVER_NOT_LOADED = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n\n"
)
FAULTS: dict[str, tuple[str, int]] = {
    "no-devices": ("No devices were found\n", 6),
    "driver-not-loaded": (NVML_DRIVER_NOT_LOADED, 9),
    "access-blocked": ("Failed to initialize NVML: GPU access blocked by the operating system\n", 17),
    "driver-mismatch": ("Failed to initialize NVML: Driver/library version mismatch\n", 18),
    "nvml-fail": ("Failed to initialize NVML: Unknown Error\n", 255),
}
DEFAULT_MISMATCH_LIBRARY = "580.126"

# Field aliases real nvidia-smi accepts for --query-gpu, mapped to the captured column names.
GPU_ALIASES = {
    "gpu_name": "name",
    "gpu_uuid": "uuid",
    "gpu_bus_id": "pci.bus_id",
}
APP_FIELDS = {
    "pid": "",
    "process_name": "",
    "name": "",
    "used_gpu_memory": "MiB",
    "used_memory": "MiB",
    "gpu_uuid": "",
    "gpu_bus_id": "",
    "gpu_name": "",
}


class Exit(Exception):
    """Ends the run with text on stdout (where nvidia-smi prints its errors) and an exit code."""

    def __init__(self, text: str, code: int) -> None:
        super().__init__(text)
        self.text = text
        self.code = code


def unrecognised(option: str) -> Exit:
    return Exit(f"ERROR: Option {option} is not recognized. Please run 'nvidia-smi -h'.\n\n", 255)


def load_state() -> dict:
    try:
        state = json.loads(STATE.read_text())
    except (OSError, ValueError) as exc:
        raise Exit(f"lab fake nvidia-smi: cannot read node state {STATE}: {exc}\n", 1) from exc
    if not isinstance(state, dict) or not isinstance(state.get("fixture"), str):
        raise Exit(f'lab fake nvidia-smi: {STATE} must hold {{"fixture": NAME, "fault": null}}\n', 1)
    fault = state.get("fault")
    if fault is not None and fault not in FAULTS:
        raise Exit(f"lab fake nvidia-smi: unknown fault {fault!r} in {STATE}; one of {sorted(FAULTS)}\n", 1)
    return state


class Fixture:
    """The captured outputs of one machine, with live holders applied."""

    def __init__(self, directory: Path) -> None:
        if not (directory / "query-gpu.csv").is_file():
            raise Exit(f"lab fake nvidia-smi: no captured query-gpu.csv in {directory}\n", 1)
        self.dir = directory
        lines = (directory / "query-gpu.csv").read_text().splitlines()
        self.columns: list[str] = []
        self.units: dict[str, str] = {}
        for head in lines[0].split(", "):
            m = re.fullmatch(r"(\S+)(?: \[(.+)\])?", head.strip())
            name = m.group(1) if m else head.strip()
            self.columns.append(name)
            self.units[name] = m.group(2) or "" if m else ""
        self.gpus: list[dict[str, str]] = []
        for line in lines[1:]:
            if not line.strip():
                continue
            raw = [cell.strip() for cell in line.split(", ")]
            row = {}
            for name, cell in zip(self.columns, raw, strict=False):
                unit = self.units[name]
                row[name] = cell[: -len(unit) - 1] if unit and cell.endswith(" " + unit) else cell
            self.gpus.append(row)
        self.holders = live_holders(len(self.gpus))
        for holder in self.holders:
            for index in holder["gpus"]:
                gpu = self.gpus[index]
                if "memory.used" in gpu:
                    gpu["memory.used"] = str(int(gpu["memory.used"]) + holder["mib"])
                if "memory.free" in gpu:
                    gpu["memory.free"] = str(max(0, int(gpu["memory.free"]) - holder["mib"]))

    def text(self, name: str) -> str | None:
        path = self.dir / name
        return path.read_text() if path.is_file() else None

    def field(self, name: str) -> str:
        if name == "count":
            return "count"
        column = GPU_ALIASES.get(name, name)
        if column not in self.columns:
            raise Exit(f'Field "{name}" is not a valid field to query.\n\n', 2)
        return column


def pid_alive(pid: int) -> bool:
    return pid > 0 and Path(f"/proc/{pid}").exists()


def live_holders(gpu_count: int) -> list[dict]:
    holders = []
    if not HOLDERS.is_dir():
        return holders
    for path in sorted(HOLDERS.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            pid = int(data["pid"])
            mib = int(data["mib"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not pid_alive(pid):
            continue
        gpus = data.get("gpus")
        indices = list(range(gpu_count)) if gpus is None else [int(i) for i in gpus]
        indices = [i for i in indices if 0 <= i < gpu_count]
        holders.append({"pid": pid, "mib": mib, "gpus": indices, "name": process_name(pid, data)})
    return holders


def process_name(pid: int, data: dict) -> str:
    """What real nvidia-smi shows as the process name: the process's argv[0] (e.g. /usr/bin/python3).

    The holder file's "name" is used only when the process's command line cannot be read.
    """
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        argv0 = ""
    return argv0 or str(data.get("name", "python3"))


def parse_format(spec: str | None) -> tuple[bool, bool]:
    """Return (header, units) for --format=csv[,noheader][,nounits]."""
    if spec is None:
        return True, True
    parts = [p.strip() for p in spec.split(",")]
    if parts[0] != "csv" or any(p not in ("noheader", "nounits") for p in parts[1:]):
        raise Exit("Format modifier is not recognized.\n", 2)
    return "noheader" not in parts, "nounits" not in parts


def csv_lines(fields: list[str], units: dict[str, str], rows: list[dict[str, str]], fmt: str | None) -> str:
    header, with_units = parse_format(fmt)
    out = []
    if header:
        out.append(", ".join(f"{f} [{units[f]}]" if units.get(f) else f for f in fields))
    for row in rows:
        cells = []
        for f in fields:
            value = row[f]
            if with_units and units.get(f) and not value.startswith("["):
                value = f"{value} {units[f]}"
            cells.append(value)
        out.append(", ".join(cells))
    return "".join(line + "\n" for line in out)


def select(fixture: Fixture, ids: str | None) -> list[dict[str, str]]:
    if ids is None:
        return fixture.gpus
    chosen = []
    for item in ids.split(","):
        item = item.strip()
        match = [g for g in fixture.gpus if item in (g.get("index"), g.get("uuid"), g.get("pci.bus_id"))]
        if not match:
            raise Exit("No devices were found\n", 6)
        chosen.extend(match)
    return chosen


def query_gpu(fixture: Fixture, spec: str, fmt: str | None, ids: str | None) -> str:
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    names = [fixture.field(w) for w in wanted]
    rows = []
    for gpu in select(fixture, ids):
        row = dict(gpu)
        row["count"] = str(len(fixture.gpus))
        rows.append(row)
    return csv_lines(names, fixture.units, rows, fmt)


def query_apps(fixture: Fixture, spec: str, fmt: str | None) -> str:
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    for w in wanted:
        if w not in APP_FIELDS:
            raise Exit(f'Field "{w}" is not a valid field to query.\n\n', 2)
    rows = []
    for holder in fixture.holders:
        for index in holder["gpus"]:
            gpu = fixture.gpus[index]
            value = {
                "pid": str(holder["pid"]),
                "process_name": holder["name"],
                "name": holder["name"],
                "used_gpu_memory": str(holder["mib"]),
                "used_memory": str(holder["mib"]),
                "gpu_uuid": gpu.get("uuid", ""),
                "gpu_bus_id": gpu.get("pci.bus_id", ""),
                "gpu_name": gpu.get("name", ""),
            }
            rows.append(value)
    return csv_lines(wanted, APP_FIELDS, rows, fmt)


def list_gpus(fixture: Fixture) -> str:
    return "".join(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})\n" for g in fixture.gpus)


def version(fixture: Fixture) -> str:
    text = fixture.text("driver.txt") or ""
    lines = [line for line in text.splitlines() if re.match(r"(NVIDIA-SMI|NVML|DRIVER|CUDA) [Vv]ersion\s+:", line)]
    return "".join(line + "\n" for line in lines)


def process_row(gpu: int, pid: int, name: str, mib: int) -> str:
    return f"|{gpu:>5}   N/A  N/A{pid:>16}{'C':>7}   {name:<36}{str(mib) + 'MiB':>10} |\n"


def table(fixture: Fixture) -> str:
    text = fixture.text("nvidia-smi.txt")
    if text is None:
        raise Exit(f"lab fake nvidia-smi: no captured nvidia-smi.txt in {fixture.dir}\n", 1)
    lines = text.splitlines(keepends=True)
    out = []
    gpu_row = None
    in_processes = False
    for line in lines:
        m = re.match(r"\|\s+(\d+)\s+\S", line)
        if m and not in_processes:
            gpu_row = int(m.group(1))
        mem = re.search(r"\|(\s*\d+MiB / \d+MiB )\|", line)
        if mem and gpu_row is not None and gpu_row < len(fixture.gpus):
            gpu = fixture.gpus[gpu_row]
            cell = f"{gpu['memory.used']}MiB / {gpu['memory.total']}MiB".rjust(len(mem.group(1)) - 1) + " "
            line = line[: mem.start(1)] + cell + line[mem.end(1) :]
        if line.startswith("| Processes:"):
            in_processes = True
        if in_processes and "No running processes found" in line and fixture.holders:
            for holder in fixture.holders:
                for index in holder["gpus"]:
                    out.append(process_row(index, holder["pid"], holder["name"], holder["mib"]))
            continue
        out.append(line)
    return "".join(out)


def detailed(fixture: Fixture) -> str:
    text = fixture.text("nvidia-smi-q.txt")
    if text is None:
        return synthesised_detail(fixture)
    out = []
    section = ""
    gpu_index = -1
    for line in text.splitlines(keepends=True):
        if re.match(r"GPU [0-9A-Fa-f]{8}:", line):
            gpu_index += 1
        stripped = line.strip()
        if line.startswith("    ") and not line.startswith("     "):
            section = stripped.split(":")[0].strip()
        if section == "FB Memory Usage" and 0 <= gpu_index < len(fixture.gpus):
            gpu = fixture.gpus[gpu_index]
            for key, field in (("Used", "memory.used"), ("Free", "memory.free")):
                if re.match(rf"\s+{key}\s+:", line):
                    line = re.sub(r": \d+ MiB", f": {gpu[field]} MiB", line)
        if section == "Processes" and stripped.endswith(": None") and 0 <= gpu_index < len(fixture.gpus):
            mine = [h for h in fixture.holders if gpu_index in h["gpus"]]
            if mine:
                out.append(f"    {'Processes':<51}\n")
                for holder in mine:
                    for key, value in (
                        ("GPU instance ID", "N/A"),
                        ("Compute instance ID", "N/A"),
                        ("Process ID", str(holder["pid"])),
                        ("Type", "C"),
                        ("Name", holder["name"]),
                        ("Used GPU Memory", f"{holder['mib']} MiB"),
                    ):
                        out.append(f"        {key:<47}: {value}\n")
                continue
        out.append(line)
    return "".join(out)


def synthesised_detail(fixture: Fixture) -> str:
    """-q for a fixture captured without it: the real layout, limited to the captured fields."""
    driver = fixture.gpus[0].get("driver_version", "N/A") if fixture.gpus else "N/A"
    cuda = "N/A"
    for line in version(fixture).splitlines():
        if line.startswith("CUDA Version"):
            cuda = line.split(":", 1)[1].strip()
    out = ["\n", "==============NVSMI LOG==============\n", "\n"]
    out.append(f"{'Driver Version':<55}: {driver}\n")
    out.append(f"{'CUDA Version':<55}: {cuda}\n\n")
    out.append(f"{'Attached GPUs':<55}: {len(fixture.gpus)}\n")
    for gpu in fixture.gpus:
        reserved = int(gpu["memory.total"]) - int(gpu["memory.used"]) - int(gpu["memory.free"])
        out.append(f"GPU {gpu['pci.bus_id']}\n")
        out.append(f"    {'Product Name':<51}: {gpu['name']}\n")
        out.append(f"    {'GPU UUID':<51}: {gpu['uuid']}\n")
        out.append(f"    {'Minor Number':<51}: {gpu['index']}\n")
        out.append(f"    PCI\n        {'Bus Id':<47}: {gpu['pci.bus_id']}\n")
        out.append(f"    FB Memory Usage\n        {'Total':<47}: {gpu['memory.total']} MiB\n")
        out.append(f"        {'Reserved':<47}: {reserved} MiB\n")
        out.append(f"        {'Used':<47}: {gpu['memory.used']} MiB\n")
        out.append(f"        {'Free':<47}: {gpu['memory.free']} MiB\n")
        mine = [h for h in fixture.holders if int(gpu["index"]) in h["gpus"]]
        if not mine:
            out.append(f"    {'Processes':<51}: None\n")
        else:
            out.append("    Processes\n")
            for holder in mine:
                out.append(f"        {'Process ID':<47}: {holder['pid']}\n")
                out.append(f"        {'Type':<47}: C\n")
                out.append(f"        {'Name':<47}: {holder['name']}\n")
                out.append(f"        {'Used GPU Memory':<47}: {holder['mib']} MiB\n")
    return "".join(out) + "\n"


def parse_args(argv: list[str]) -> dict[str, str | bool | None]:
    opts: dict[str, str | bool | None] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg.partition("=")
        if key in ("--query-gpu", "--query-compute-apps", "--format", "--id", "-i"):
            if not eq:
                if i + 1 >= len(argv):
                    raise unrecognised(arg)
                i += 1
                value = argv[i]
            opts["id" if key in ("-i", "--id") else key.lstrip("-")] = value
        elif arg in ("-L", "--list-gpus"):
            opts["list"] = True
        elif arg in ("-q", "--query"):
            opts["detail"] = True
        elif arg == "--version":
            opts["version"] = True
        elif arg == "topo" and i + 1 < len(argv) and argv[i + 1] in ("-m", "--matrix"):
            opts["topo"] = True
            i += 1
        else:
            raise unrecognised(arg)
        i += 1
    if "format" in opts and not ("query-gpu" in opts or "query-compute-apps" in opts):
        raise unrecognised(f"--format={opts['format']}")
    if "id" in opts and opts.get("list"):
        raise Exit("ERROR: Option -i is not valid for this command. Please run 'nvidia-smi -h' for help.\n\n", 2)
    return opts


def run(argv: list[str]) -> tuple[str, int]:
    opts = parse_args(argv)
    state = load_state()
    fixture = Fixture(FIXTURES / state["fixture"])
    if opts.get("version"):
        if state.get("fault") == "driver-mismatch":
            library = str(state.get("nvml_library_version") or DEFAULT_MISMATCH_LIBRARY)
            text, code = FAULTS["driver-mismatch"]
            return text + f"NVML library version: {library}\n", code
        return version(fixture), 0
    fault = state.get("fault")
    if fault is not None:
        text, code = FAULTS[fault]
        if fault == "no-devices" and opts.get("list"):
            return "No devices found.\n", 0
        if fault == "driver-mismatch":
            library = str(state.get("nvml_library_version") or DEFAULT_MISMATCH_LIBRARY)
            text += f"NVML library version: {library}\n"
        return text, code
    ids = opts.get("id")
    ids = ids if isinstance(ids, str) else None
    if "query-gpu" in opts:
        return query_gpu(fixture, str(opts["query-gpu"]), opts.get("format"), ids), 0  # type: ignore[arg-type]
    if "query-compute-apps" in opts:
        return query_apps(fixture, str(opts["query-compute-apps"]), opts.get("format")), 0  # type: ignore[arg-type]
    if opts.get("list"):
        return list_gpus(fixture), 0
    if opts.get("detail"):
        return detailed(fixture), 0
    if opts.get("topo"):
        topo = fixture.text("topo.txt")
        if topo is None:
            raise Exit(f"lab fake nvidia-smi: no captured topo.txt in {fixture.dir}\n", 1)
        return topo, 0
    return table(fixture), 0


def main() -> int:
    try:
        text, code = run(sys.argv[1:])
    except Exit as exc:
        text, code = exc.text, exc.code
    sys.stdout.write(text)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
