"""The DDTree engine: tree verification for DFlash speculative decoding, as a change set to vLLM.

A DFlash drafter proposes a block of tokens in one pass; DDTree builds a tree of the likeliest
continuations from the drafter's per-position distributions and the target verifies the whole tree
in one step (ancestor-only attention, branch-local recurrent state on Gated DeltaNet hybrids, depth
positions for M-RoPE). The engine ships as a change set per vLLM release (a "base", such as
``vllm-0.20.1/``: its manifest, diffs, added files and ``base.json`` descriptor) plus the modules
every base shares (``common/``). The ddtree_patch role applies a base's change set to an installed
vLLM by its manifest digest; this package holds the change set and everything that proves it: CPU
tests (``tests/``), GPU proofs (``gpu/``, ``trained/``), benchmarks (``bench/``) and their results
(``results/``). See README.md beside this file.
"""

from pathlib import Path

# The change-set root the ddtree_patch role and vllm_patch read: vllm-<release>/ and common/ below it.
HOME = Path(__file__).resolve().parent
REPO = HOME.parent
