"""Action plugin for lxc_gpu_config: the module where the container's host is another machine, the
same check in the task's own worker where that host is the controller itself.

gpu_check delegates lxc_gpu_config to each node's container host (gpu_check_proxmox_host). Where
that is the controller (delegate_to: localhost, as in the lab, or a controller that is the Proxmox
host), running the module starts one Python interpreter on the controller per node, 0.1-0.2
CPU-seconds each (issue 25); the check is a few file reads, so it runs in-process instead, with the
module's own argument spec and code (module_utils/nvidia_gpu_probe.py) and the same result. With
become (root on the controller) or any other connection it runs the module as before.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ansible.module_utils
from ansible import constants as C
from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

_HERE = Path(__file__).resolve().parent
for _p in [*(C.DEFAULT_MODULE_UTILS_PATH or []), str(_HERE.parent.parent / "module_utils")]:
    if os.path.isdir(_p) and _p not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(_p)

from ansible.module_utils.nvidia_gpu_probe import (
    LXC_GPU_CONFIG_ARGS,
    ContainerConfigUnreadable,
    check_container_config_file,
)


def runs_in_process(transport: str, become: bool) -> bool:
    """Whether the check can run in the worker: on the controller itself, as the controller's user."""
    return transport == "local" and not become


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result = super().run(tmp, task_vars)
        if not runs_in_process(self._connection.transport, bool(self._play_context.become)):
            result.update(self._execute_module(module_name="lxc_gpu_config", task_vars=task_vars))
            return result
        _, args = self.validate_argument_spec(argument_spec=LXC_GPU_CONFIG_ARGS)
        if args["gpu_count"] is not None and args["gpu_count"] < 0:
            raise AnsibleActionFail(f"gpu_count must not be negative, got {args['gpu_count']}.")
        try:
            found = check_container_config_file(
                os.path.expanduser(args["config_path"]),
                args["gpu_count"],
                os.path.expanduser(args["proc_devices_path"]),
            )
        except ContainerConfigUnreadable as exc:
            raise AnsibleActionFail(str(exc)) from exc
        result.update(changed=False, **found)
        if found["warnings_found"]:
            result["warnings"] = list(found["warnings_found"])
        return result
