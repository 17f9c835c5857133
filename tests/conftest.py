"""Make the repo's module_utils and library importable in tests the way Ansible sees them.

Ansible resolves ``ansible.module_utils.<name>`` from the configured module_utils
directory; pytest has no such hook, so we extend the package path once here.
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # The DDTree Triton kernels' tests run in Triton's interpreter without a GPU. Triton reads this
    # when it is first imported (its own library functions are decorated then), and torch._dynamo
    # below imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# torch's dynamo wraps sys.intern when it is first imported and refuses the wrapper that Ansible's
# controller code installs over it; importing it before anything of Ansible keeps both working
# in one test process (the DDTree tree tests trace operators through it).
import torch._dynamo  # isort: skip
import ansible.module_utils  # isort: skip

REPO = Path(__file__).resolve().parent.parent
ansible.module_utils.__path__.append(str(REPO / "module_utils"))
sys.path.insert(0, str(REPO / "library"))
sys.path.insert(0, str(REPO / "plugins" / "filter"))
sys.path.insert(0, str(REPO / "plugins" / "callback"))
