#!/usr/bin/env python3
"""The lab: LXC system containers with systemd that stand in for Proxmox GPU containers.

    labctl.py up   [--lab NAME] --nodes N [--fixtures h200-x1,h200-x2] --inventory-dir DIR [--replay-measured]
    labctl.py down [--lab NAME]
    labctl.py list

A lab's name (by default "lab-" and a short hash of this clone's path, so two clones on one machine
each have their own containers, bridge, subnet and keys) prefixes everything it makes; `down`
removes that lab's things only.

--replay-measured: the stand-in vLLM on every node serves each speculative method at the figures
of record (a trained pair's measured acceptance, the measured step cost at Qwen3.6-27B's shapes),
combined by ddtree/trained/decision.py --replay at every `up`, and the inventory tunes the chain
against every DDTree budget those figures measured (what `make lab` shows).

Each node is a real Debian 12 system container (systemd as PID 1, sshd, key-only SSH for a
non-root `admin` with sudo) in its own network namespace on a bridge the lab makes. It is laid
out like a GPU node before the swap: NVIDIA device nodes passed in by the container config the
way a Proxmox host does, a fake nvidia-smi replaying real captured output, the target model
directory, and a running stand-in SGLang service. Everything the lab makes is recorded in a
state file so `down` removes exactly that, and an interrupted `up` is repaired by the next one.

Standard library only, run as root.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "nvidia-smi"
FAKES = REPO / "tests" / "fakes"
STATE_ROOT = Path(os.environ.get("LAB_STATE_ROOT", "/var/lib/dflash-lab"))
CACHE = Path(os.environ.get("LAB_CACHE", "/var/cache/dflash-lab"))
LXC_PATH = Path("/var/lib/lxc")
MIRROR = os.environ.get("LAB_MIRROR", "http://deb.debian.org/debian")
SUITE = "bookworm"
PACKAGES = [
    "systemd",
    "systemd-sysv",
    "dbus",
    "python3",
    "python3-venv",
    "openssh-server",
    "sudo",
    "iproute2",
    "psmisc",
    "procps",
    "rsync",
    "ca-certificates",
    "curl",
]
# 10.213.<n>.0/24, one /24 per lab: private, and used only by the lab's own namespaces.
SUBNET_BASE = ipaddress.IPv4Network("10.213.0.0/16")
NVIDIA_MAJOR = 195
UVM_MAJOR = 238
ADMIN = "admin"
TARGET_DIR = "/opt/models/Qwen3.6-27B"
SGLANG_PORT = 30000


class LabError(Exception):
    """Something the operator must fix; the message says what and how."""


# ---------------------------------------------------------------- helpers


def run(*cmd: str, check: bool = True, capture: bool = False, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, text=True, capture_output=capture, **kw)
    if check and res.returncode != 0:
        detail = (res.stderr or res.stdout or "").strip() if capture else ""
        raise LabError(f"command failed ({res.returncode}): {' '.join(cmd)}" + (f"\n{detail}" if detail else ""))
    return res


def say(msg: str) -> None:
    print(f"lab: {msg}", flush=True)


def default_lab_name() -> str:
    """This clone's lab: 'lab-' and six hex digits of the clone's path."""
    return "lab-" + hashlib.sha1(str(REPO).encode()).hexdigest()[:6]


# The results of record the lab replays (see --replay-measured): read at every `up`, never copied.
MEASURED_ACCEPTANCE = REPO / "ddtree" / "results" / "trained_hybrid_rebuilt_h100.json"
MEASURED_NODE_FILE = "etc/lab-fakes/measured-figures.json"
# The swap's acceptance floor while the lab replays the trained pair: its drafter is a small one
# trained in minutes, whose chain accepts far fewer tokens than Qwen3.6-27B-DFlash (the production
# floor, 2.0); a broken drafter (the low_acceptance knob, about 1.06) still fails it.
REPLAY_ACCEPTANCE_FLOOR = 1.2
# The largest batch the figures measured: the lab's vLLM admits no more requests at once (and so a
# DDTree budget's tree state always fits the fake H200s beside the weights).
REPLAY_MAX_NUM_SEQS = 8


def bridge_name(lab: str) -> str:
    # Interface names are limited to 15 characters; the hash keeps labs apart.
    return "dflbr" + hashlib.sha1(lab.encode()).hexdigest()[:8]


@dataclass
class Node:
    name: str
    address: str
    fixture: str
    complete: bool = False


@dataclass
class Lab:
    name: str
    subnet: str
    bridge: str
    nodes: list[Node] = field(default_factory=list)

    @property
    def dir(self) -> Path:
        return STATE_ROOT / "labs" / self.name

    @property
    def key(self) -> Path:
        return self.dir / "id_ed25519"

    @property
    def drafter(self) -> Path:
        return self.dir / "dflash-q36-27b.safetensors"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def gateway(self) -> str:
        return str(next(ipaddress.IPv4Network(self.subnet).hosts()))

    def address_of(self, index: int) -> str:
        return str(ipaddress.IPv4Network(self.subnet).network_address + 10 + index)

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(self.dir / "state.json")

    @classmethod
    def load(cls, name: str) -> Lab | None:
        path = STATE_ROOT / "labs" / name / "state.json"
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        raw["nodes"] = [Node(**n) for n in raw["nodes"]]
        return cls(**raw)


def all_labs() -> list[Lab]:
    root = STATE_ROOT / "labs"
    return [lab for p in sorted(root.glob("*/state.json")) if (lab := Lab.load(p.parent.name))]


# ---------------------------------------------------------------- preconditions


def require_root_and_tools() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab makes containers and bridges, which needs root: run it as root (sudo make lab)")
    missing = [t for t in ("lxc-start", "lxc-attach", "debootstrap", "ip", "ssh", "ssh-keygen") if not shutil.which(t)]
    if missing:
        raise LabError(f"missing tools: {', '.join(missing)}; run tests/lab/host-deps.sh (make host-deps) first")


def validate_name(name: str) -> None:
    if not name or len(name) > 20 or not all(c.isalnum() or c == "-" for c in name) or not name[0].isalpha():
        raise LabError(f"lab name {name!r} must start with a letter and use letters, digits and '-' (at most 20)")


def host_networks() -> list[ipaddress.IPv4Network]:
    out = run("ip", "-4", "-j", "addr", "show", capture=True).stdout
    nets = []
    for link in json.loads(out or "[]"):
        for a in link.get("addr_info", []):
            nets.append(ipaddress.IPv4Interface(f"{a['local']}/{a['prefixlen']}").network)
    return nets


def pick_subnet(lab: str) -> str:
    taken = {n.subnet for n in all_labs() if n.name != lab}
    busy = host_networks()
    for sub in SUBNET_BASE.subnets(new_prefix=24):
        if sub.network_address == SUBNET_BASE.network_address:
            continue
        if str(sub) in taken or any(sub.overlaps(b) for b in busy):
            continue
        return str(sub)
    raise LabError(f"no free /24 left in {SUBNET_BASE} for the lab; remove old labs with 'labctl.py down'")


# ---------------------------------------------------------------- rootfs cache


def base_rootfs() -> Path:
    """The Debian rootfs every node is copied from, built once by debootstrap and cached."""
    tag = hashlib.sha1(" ".join([SUITE, *PACKAGES]).encode()).hexdigest()[:10]
    final = CACHE / f"rootfs-{SUITE}-{tag}"
    if (final / ".complete").exists():
        return final
    CACHE.mkdir(parents=True, exist_ok=True)
    work = CACHE / f".build-{tag}"
    shutil.rmtree(work, ignore_errors=True)  # a half-built rootfs from an interrupted run
    say(f"building the node rootfs with debootstrap (about a minute, cached in {final})")
    run("debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(work), MIRROR, capture=True)
    # Per-node identity is made at node creation: no shared host keys or machine id.
    for key in (work / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    (work / "etc/machine-id").write_text("")
    (work / "var/lib/dbus/machine-id").unlink(missing_ok=True)
    # Units that have nothing to do in a container and only make boot 'degraded'.
    for unit in ("systemd-remount-fs.service", "sys-kernel-config.mount", "sys-kernel-debug.mount"):
        (work / "etc/systemd/system" / unit).unlink(missing_ok=True)
        (work / "etc/systemd/system" / unit).symlink_to("/dev/null")
    (work / "etc/ssh/sshd_config.d/lab.conf").write_text(
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin no\nUseDNS no\n"
    )
    (work / ".complete").write_text("")
    shutil.rmtree(final, ignore_errors=True)
    work.rename(final)
    return final


# ---------------------------------------------------------------- network


def ensure_bridge(lab: Lab) -> None:
    if run("ip", "link", "show", lab.bridge, check=False, capture=True).returncode != 0:
        run("ip", "link", "add", lab.bridge, "type", "bridge")
    prefix = ipaddress.IPv4Network(lab.subnet).prefixlen
    have = run("ip", "-4", "-o", "addr", "show", "dev", lab.bridge, capture=True).stdout
    if f" {lab.gateway}/{prefix} " not in have:
        run("ip", "addr", "add", f"{lab.gateway}/{prefix}", "dev", lab.bridge)
    run("ip", "link", "set", lab.bridge, "up")


# ---------------------------------------------------------------- nodes


def fixture_gpu_count(fixture: str) -> int:
    csv = FIXTURES / fixture / "query-gpu-noheader.csv"
    if not csv.exists():
        have = ", ".join(sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()))
        raise LabError(f"unknown nvidia-smi fixture {fixture!r}; available: {have}")
    return sum(1 for line in csv.read_text().splitlines() if line.strip())


def device_nodes(lab: Lab, node: Node) -> list[tuple[str, int, int]]:
    gpus = fixture_gpu_count(node.fixture)
    devs = [(f"nvidia{i}", NVIDIA_MAJOR, i) for i in range(gpus)]
    devs += [("nvidiactl", NVIDIA_MAJOR, 255), ("nvidia-uvm", UVM_MAJOR, 0), ("nvidia-uvm-tools", UVM_MAJOR, 1)]
    return devs


def make_host_devices(lab: Lab, node: Node) -> Path:
    """Real character device nodes with NVIDIA's majors, as /dev/nvidia* are on a Proxmox host."""
    ddir = lab.dir / "dev" / node.name
    ddir.mkdir(parents=True, exist_ok=True)
    for name, major, minor in device_nodes(lab, node):
        path = ddir / name
        if not path.exists():
            os.mknod(path, 0o20666, os.makedev(major, minor))
            path.chmod(0o666)  # mknod honours the umask; the real nodes are world read-write
    return ddir


def container_config(lab: Lab, node: Node, index: int) -> str:
    ddir = lab.dir / "dev" / node.name
    mac = "02:" + ":".join(hashlib.sha1(node.name.encode()).hexdigest()[i : i + 2] for i in range(0, 10, 2))
    prefix = ipaddress.IPv4Network(lab.subnet).prefixlen
    lines = [
        f"# dflash lab node {node.name} (lab {lab.name}); made by tests/lab/labctl.py",
        "lxc.include = /usr/share/lxc/config/common.conf",
        "lxc.arch = amd64",
        f"lxc.uts.name = {node.name}",
        f"lxc.rootfs.path = dir:{LXC_PATH / node.name / 'rootfs'}",
        "lxc.apparmor.profile = unconfined",
        "lxc.net.0.type = veth",
        f"lxc.net.0.link = {lab.bridge}",
        "lxc.net.0.flags = up",
        "lxc.net.0.name = eth0",
        f"lxc.net.0.hwaddr = {mac}",
        f"lxc.net.0.ipv4.address = {node.address}/{prefix}",
        f"lxc.net.0.ipv4.gateway = {lab.gateway}",
        "# GPU passthrough, written the way a Proxmox host's container config does it",
        f"lxc.cgroup2.devices.allow = c {NVIDIA_MAJOR}:* rwm",
        f"lxc.cgroup2.devices.allow = c {UVM_MAJOR}:* rwm",
    ]
    lines += [
        f"lxc.mount.entry = {ddir / name} dev/{name} none bind,create=file 0 0"
        for name, _, _ in device_nodes(lab, node)
    ]
    return "\n".join(lines) + "\n"


def write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def chroot(rootfs: Path, *cmd: str) -> None:
    run("chroot", str(rootfs), *cmd, capture=True)


def lab_vllm_release() -> str:
    """The vLLM release the lab deploys: shared_settings_vllm_version, the lab inventory's over the role default."""
    import yaml  # the lab venv has it (ansible-core's dependency)

    found = ""
    for path in [
        REPO / "roles/shared_settings/defaults/main.yml",
        *sorted((REPO / "inventory/lab/group_vars/all").glob("*.yml")),
    ]:
        found = str((yaml.safe_load(path.read_text()) or {}).get("shared_settings_vllm_version", found))
    return found


def copy_engine_rules(fakes: Path, release: str | None = None, home: Path | None = None) -> None:
    """Put the DDTree base's descriptor and its reader beside the stand-in, which reads its vLLM rules there.

    ``fakes/ddtree_base.py`` (module_utils/ddtree_base.py) and ``fakes/ddtree/vllm-<release>/base.json``
    for the release the lab deploys (lab_vllm_release) when it has a base, so a second base in the engine
    changes nothing here; else every base (the stand-in plays the sole one, or refuses naming them). The
    stand-in reserves draft slots by the descriptor's scheduler rule, not one of its own.
    """
    reader = REPO / "module_utils" / "ddtree_base.py"
    spec = importlib.util.spec_from_file_location("labctl_ddtree_base", reader)
    base = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = base  # its dataclasses look their module up there
    spec.loader.exec_module(base)
    shutil.copy2(reader, fakes / "ddtree_base.py")
    home = REPO / "ddtree" if home is None else home
    every = base.releases(home)
    deployed = base.release_of(release if release is not None else lab_vllm_release())
    for one in [deployed] if deployed in every else every:
        dest = base.descriptor_path(fakes / "ddtree", one)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(base.descriptor_path(home, one), dest)


SGLANG_UNIT = f"""[Unit]
Description=SGLang serving Qwen3.6-27B with MTP (lab stand-in: tests/fakes/inference_server.py)
After=network-online.target

[Service]
User=sglang
Group=sglang
ExecStart=/usr/bin/python3 /opt/lab-fakes/inference_server.py sglang --model-path {TARGET_DIR} \\
  --served-model-name Qwen3.6-27B --host 0.0.0.0 --port {SGLANG_PORT} --tp-size {{tp}} \\
  --speculative-algo NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 \\
  --speculative-num-draft-tokens 4 --mem-fraction-static 0.88
Restart=on-failure
RestartSec=2

[Install]
WantedBy=multi-user.target
"""


def lay_out_node(lab: Lab, node: Node, rootfs: Path) -> None:
    """Make the copied rootfs look like a GPU node that serves the target with SGLang."""
    write(rootfs / "etc/hostname", node.name + "\n")
    write(rootfs / "etc/hosts", f"127.0.0.1 localhost\n{node.address} {node.name}\n")
    write(
        rootfs / "etc/machine-id",
        hashlib.md5(f"{lab.name}/{node.name}/{time.time()}".encode()).hexdigest() + "\n",
        0o444,
    )
    run("ssh-keygen", "-q", "-A", "-f", str(rootfs), capture=True)
    # The operator's account: key only, passwordless sudo.
    chroot(rootfs, "useradd", "--create-home", "--shell", "/bin/bash", "--groups", "sudo", ADMIN)
    write(rootfs / f"etc/sudoers.d/{ADMIN}", f"{ADMIN} ALL=(ALL) NOPASSWD: ALL\n", 0o440)
    pub = Path(str(lab.key) + ".pub").read_text()
    write(rootfs / f"home/{ADMIN}/.ssh/authorized_keys", pub, 0o600)
    chroot(rootfs, "chown", "-R", f"{ADMIN}:{ADMIN}", f"/home/{ADMIN}/.ssh")
    # The test doubles and the captured data they replay.
    fakes = rootfs / "opt/lab-fakes"
    fakes.mkdir(parents=True, exist_ok=True)
    shutil.copy2(FAKES / "inference_server.py", fakes / "inference_server.py")
    vllm = fakes / "vllm"  # the stand-in plays vLLM when called by this name: `vllm serve MODEL ...`
    if not vllm.is_symlink():
        vllm.symlink_to("inference_server.py")
    copy_engine_rules(fakes)
    if (FAKES / "nvidia_smi.py").exists():
        shutil.copy2(FAKES / "nvidia_smi.py", rootfs / "usr/bin/nvidia-smi")
        (rootfs / "usr/bin/nvidia-smi").chmod(0o755)
    shutil.copytree(FIXTURES, rootfs / "usr/share/lab-fakes/nvidia-smi", dirs_exist_ok=True)
    write(rootfs / "etc/lab-fakes/gpu.json", json.dumps({"fixture": node.fixture, "fault": None}) + "\n")
    driver = (FIXTURES / node.fixture / "driver.txt").read_text().splitlines()
    write(
        rootfs / "var/lib/lab-fakes/proc-driver-nvidia-version",
        "\n".join(line for line in driver if line.startswith(("NVRM", "GCC"))) + "\n",
    )
    write(rootfs / "etc/tmpfiles.d/lab-fakes.conf", "d /run/lab-fakes/gpu-holders 1777 root root -\n")
    # The target model and the engine that serves it before the swap.
    run(sys.executable, str(FAKES / "target_model.py"), str(rootfs / TARGET_DIR.lstrip("/")))
    chroot(
        rootfs,
        "useradd",
        "--system",
        "--home-dir",
        "/var/lib/sglang",
        "--create-home",
        "--shell",
        "/usr/sbin/nologin",
        "sglang",
    )
    write(rootfs / "etc/systemd/system/sglang-qwen.service", SGLANG_UNIT.format(tp=fixture_gpu_count(node.fixture)))
    wants = rootfs / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / "sglang-qwen.service"
    if not link.is_symlink():
        link.symlink_to("/etc/systemd/system/sglang-qwen.service")


def container_state(name: str) -> str:
    res = run("lxc-info", "-n", name, "-s", "-H", check=False, capture=True)
    return res.stdout.strip() if res.returncode == 0 else "ABSENT"


def destroy_container(name: str) -> None:
    if container_state(name) == "RUNNING":
        run("lxc-stop", "-n", name, "-k", check=False, capture=True)
    if (LXC_PATH / name).exists():
        shutil.rmtree(LXC_PATH / name)


def create_node(lab: Lab, node: Node, index: int, base: Path) -> None:
    cdir = LXC_PATH / node.name
    if cdir.exists():
        config = cdir / "config"
        if config.exists() and f"# dflash lab node {node.name} (lab {lab.name})" not in config.read_text():
            raise LabError(
                f"a container named {node.name} already exists and was not made by this lab; "
                f"remove it (lxc-destroy -n {node.name}) or choose another lab name (LAB=...)"
            )
        say(f"{node.name}: found a half-made container from an interrupted run; rebuilding it")
        destroy_container(node.name)
    say(f"{node.name}: creating ({node.address}, fixture {node.fixture})")
    cdir.mkdir(parents=True)
    run("cp", "-a", "--reflink=auto", str(base), str(cdir / "rootfs"))
    (cdir / "rootfs/.complete").unlink(missing_ok=True)
    make_host_devices(lab, node)
    lay_out_node(lab, node, cdir / "rootfs")
    write(cdir / "config", container_config(lab, node, index))


def ssh_cmd(lab: Lab, node: Node, *cmd: str) -> list[str]:
    return [
        "ssh",
        "-i",
        str(lab.key),
        "-o",
        f"UserKnownHostsFile={lab.known_hosts}",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=5",
        f"{ADMIN}@{node.address}",
        *cmd,
    ]


def wait_ready(lab: Lab, node: Node, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        res = run(*ssh_cmd(lab, node, "systemctl", "is-system-running", "--wait"), check=False, capture=True)
        state = res.stdout.strip()
        if state in ("running", "degraded"):
            return
        last = (res.stderr or state).strip().splitlines()[-1:] or [""]
        time.sleep(1)
    raise LabError(
        f"{node.name} did not come up over SSH within {timeout:.0f}s (last: {last}); "
        f"see 'lxc-info -n {node.name}' and 'lxc-attach -n {node.name} -- journalctl -b'"
    )


def host_key_line(node: Node) -> str:
    pub = (LXC_PATH / node.name / "rootfs/etc/ssh/ssh_host_ed25519_key.pub").read_text().split()
    return f"{node.address} {pub[0]} {pub[1]}\n"


# ---------------------------------------------------------------- measured figures


def measured_figures(lab: Lab) -> dict:
    """The per-method figures the stand-in vLLM replays, built by ddtree/trained/decision.py now."""
    out = lab.dir / "measured-figures.json"
    run(
        sys.executable,
        "-m",
        "ddtree.trained.decision",
        str(MEASURED_ACCEPTANCE),
        "--replay",
        str(out),
        capture=True,
        cwd=REPO,
    )
    return json.loads(out.read_text())


def replay_candidates(figures: dict) -> list[dict]:
    """roles/tune's candidates: the chain, then every DDTree budget with a measured length."""
    budgets = []
    for method, cells in figures["methods"].items():
        measured = any(c.get("mean_acceptance_length") for kind in cells.values() for c in kind.values())
        if method.startswith("ddtree") and measured:
            budgets.append(int(method[len("ddtree") :]))
    return [{"method": "dflash"}] + [{"method": "ddtree", "budget": b} for b in sorted(budgets)]


def install_figures(lab: Lab, figures: dict) -> list[str]:
    """Write the figures onto every node; returns the nodes whose figures changed (to be tuned again)."""
    text = json.dumps(figures, indent=2, sort_keys=True) + "\n"
    changed = []
    for node in lab.nodes:
        path = LXC_PATH / node.name / "rootfs" / MEASURED_NODE_FILE
        if not path.exists() or path.read_text() != text:
            write(path, text)
            changed.append(node.name)
    return changed


# ---------------------------------------------------------------- inventory


def write_inventory(lab: Lab, inv_dir: Path, figures: dict | None = None, retune: list[str] | None = None) -> None:
    inv_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Made by tests/lab/labctl.py for lab {lab.name}; rewritten by every 'up'.",
        "---",
        "all:",
        "  children:",
        "    gpu_nodes:",
        "      hosts:",
    ]
    for n in lab.nodes:
        lines += [
            f"        {n.name}:",
            f"          ansible_host: {n.address}",
            f"          lab_fixture: {n.fixture}",
            f"          lab_container_config: {LXC_PATH / n.name / 'config'}",
            f"          gpu_check_gpu_count: {fixture_gpu_count(n.fixture)}",
            f"          service_swap_tensor_parallel_size: {fixture_gpu_count(n.fixture)}",
        ]
        if figures is not None:
            # Host variables: the group_vars/all of the Molecule scenarios' settings would win over group ones.
            lines += [
                f"          tune_candidates: {json.dumps(replay_candidates(figures))}",
                f"          service_swap_min_acceptance_length: {REPLAY_ACCEPTANCE_FLOOR}",
                # The figures were measured on batches of up to 8 requests, each this many tokens long.
                f"          service_swap_max_num_seqs: {REPLAY_MAX_NUM_SEQS}",
                f"          tune_max_tokens: {int(figures.get('max_tokens') or 128)}",
            ]
        if n.name in (retune or []):
            lines.append("          tune_force: true  # the measured figures changed since this node was tuned")
    lines += [
        "      vars:",
        f"        ansible_user: {ADMIN}",
        f"        ansible_ssh_private_key_file: {lab.key}",
        f"        ansible_ssh_common_args: -o UserKnownHostsFile={lab.known_hosts} -o StrictHostKeyChecking=yes",
        "        ansible_python_interpreter: /usr/bin/python3",
        f"        lab_name: {lab.name}",
        f"        lab_drafter_file: {lab.drafter}",
    ]
    if figures is not None:
        src = figures.get("source", {})
        lines += [
            f"        # The stand-in vLLM replays {src.get('acceptance')} x {', '.join(src.get('step_costs', []))}",
            "        # (ddtree/trained/decision.py --replay): each node tunes the chain against every budget",
            "        # measured there (tune_candidates), at the trained pair's acceptance floor.",
        ]
    tmp = inv_dir / ".hosts.yml.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(inv_dir / "hosts.yml")
    shared = REPO / "inventory" / "lab" / "group_vars"
    link = inv_dir / "group_vars"
    if inv_dir.resolve() != (REPO / "inventory" / "lab").resolve() and not link.exists():
        link.symlink_to(shared)


# ---------------------------------------------------------------- commands


def up(name: str, count: int, fixtures: list[str], inv_dir: Path, replay: bool = False) -> None:
    validate_name(name)
    if count < 1 or count > 32:
        raise LabError(f"--nodes must be between 1 and 32, not {count}")
    require_root_and_tools()
    for f in fixtures:
        fixture_gpu_count(f)
    lab = Lab.load(name)
    if lab is None:
        lab = Lab(name=name, subnet=pick_subnet(name), bridge=bridge_name(name))
        lab.save()
    lab.dir.mkdir(parents=True, exist_ok=True)
    if not lab.key.exists():
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"dflash-lab-{name}", "-f", str(lab.key))
    base = base_rootfs()
    ensure_bridge(lab)
    # The drafter the deployment stages, kept on the controller like an operator's download.
    if not lab.drafter.exists():
        run(sys.executable, str(FAKES / "drafter_model.py"), str(lab.drafter), capture=True)

    # Nodes beyond the requested count are removed; the rest are reused or (re)made.
    for extra in lab.nodes[count:]:
        say(f"{extra.name}: removing (lab now has {count} nodes)")
        destroy_container(extra.name)
        shutil.rmtree(lab.dir / "dev" / extra.name, ignore_errors=True)
    lab.nodes = lab.nodes[:count]
    for i in range(count):
        node_name = f"{name}-{i + 1}"
        fixture = fixtures[i % len(fixtures)]
        if i < len(lab.nodes):
            node = lab.nodes[i]
        else:
            node = Node(name=node_name, address=lab.address_of(i + 1), fixture=fixture)
            lab.nodes.append(node)
        foreign = (LXC_PATH / node.name).exists() and not node.complete
        if node.complete and not (LXC_PATH / node.name / "config").exists():
            node.complete = False
        if not node.complete or foreign:
            lab.save()  # recorded before it exists, so an interrupted create is cleaned up
            create_node(lab, node, i + 1, base)
            node.complete = True
            lab.save()
        if container_state(node.name) != "RUNNING":
            run("lxc-start", "-n", node.name, "-d", capture=True)
    lab.known_hosts.write_text("".join(host_key_line(n) for n in lab.nodes))
    figures, retune = None, []
    if replay:
        figures = measured_figures(lab)
        retune = install_figures(lab, figures)
    for node in lab.nodes:
        wait_ready(lab, node)
    write_inventory(lab, inv_dir, figures, retune)
    say(f"{count} node(s) up on {lab.bridge} ({lab.subnet}); inventory in {inv_dir / 'hosts.yml'}")


def down(name: str) -> None:
    validate_name(name)
    require_root_and_tools()
    lab = Lab.load(name)
    if lab is None:
        say(f"no lab named {name}; nothing to remove")
        return
    for node in lab.nodes:
        destroy_container(node.name)
    if run("ip", "link", "show", lab.bridge, check=False, capture=True).returncode == 0:
        run("ip", "link", "delete", lab.bridge)
    shutil.rmtree(lab.dir)
    hosts = REPO / "inventory" / "lab" / "hosts.yml"
    if hosts.exists() and f"for lab {name};" in hosts.read_text().splitlines()[0]:
        hosts.unlink()
    say(f"removed lab {name}: {len(lab.nodes)} container(s), bridge {lab.bridge}, keys")


def list_labs() -> None:
    for lab in all_labs():
        states = ", ".join(f"{n.name}={container_state(n.name)}" for n in lab.nodes)
        print(f"{lab.name}: {lab.subnet} on {lab.bridge}: {states}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="create or repair a lab and write its inventory")
    u.add_argument("--lab", default=default_lab_name(), help="default: this clone's, %(default)s")
    u.add_argument("--nodes", type=int, default=2)
    u.add_argument("--fixtures", default="h200-x1,h200-x2", help="nvidia-smi fixture per node, cycled")
    u.add_argument("--inventory-dir", type=Path, default=REPO / "inventory" / "lab")
    u.add_argument("--replay-measured", action="store_true", help="the stand-in vLLM replays the figures of record")
    d = sub.add_parser("down", help="remove every container, bridge and key of a lab")
    d.add_argument("--lab", default=default_lab_name(), help="default: this clone's, %(default)s")
    sub.add_parser("list", help="show the labs on this machine")
    a = p.parse_args(argv)
    try:
        if a.cmd == "up":
            up(a.lab, a.nodes, [f for f in a.fixtures.split(",") if f], a.inventory_dir, a.replay_measured)
        elif a.cmd == "down":
            down(a.lab)
        else:
            list_labs()
    except LabError as e:
        print(f"lab: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"lab: interrupted; run 'labctl.py {a.cmd} --lab {a.lab}' again: it repairs half-made nodes "
            f"(or 'labctl.py down --lab {a.lab}' removes everything)",
            file=sys.stderr,
        )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
