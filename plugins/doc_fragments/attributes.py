"""The attributes every module in library/ declares (check_mode, diff_mode), described once.

As community.general's attributes fragment: a module extends ``attributes`` and gives each
attribute's ``support`` (and ``details`` where it has more to say); a module that only reads
extends ``attributes.read_only`` as well, which gives both.
"""


class ModuleDocFragment:
    DOCUMENTATION = r"""
options: {}
attributes:
  check_mode:
    description: Can run in check mode and return the changed status it predicts without modifying the target.
  diff_mode:
    description: Returns what has changed (or would change, in check mode) when in diff mode.
"""

    # A module that reads and reports, and changes nothing.
    READ_ONLY = r"""
options: {}
attributes:
  check_mode:
    support: full
    details: Read-only; runs the same in check mode.
  diff_mode:
    support: N/A
    details: Changes nothing, so there is nothing to diff.
"""
