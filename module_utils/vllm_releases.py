"""What each vLLM release can do for a DFlash / DDTree deployment, and the rules built on it.

This module is the single place that knows vLLM releases. ``RELEASES`` is the knowledge base:
one row per range of releases, each read off the real release wheels (see docs/vllm_install.md
for which wheels were read and how). ``evaluate`` combines a row with the deployment (target,
drafter, requested method, this project's ddtree_patch change set) and returns refusals and
warnings, each one sentence with the reason and the fix. ``detect_features`` reads the same
facts back out of a release's source text, so the table can be checked against any wheel or
installed tree.

Standard library only: it runs on the controller and on managed nodes.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass, field

# How a release treats a drafter whose config mixes sliding-window and full-attention layers.
SLIDING_NONE = "none"  # no DFlash at all
SLIDING_SILENT_FULL = "silent_full"  # runs every layer as full, non-causal attention; no error
SLIDING_REFUSES = "refuses"  # raises NotImplementedError while building the drafter
SLIDING_V2_RUNNER = "v2_runner"  # works; vLLM switches to the V2 model runner for such drafters

METHOD_DFLASH = "dflash"
METHOD_DDTREE = "ddtree"
METHODS = (METHOD_DFLASH, METHOD_DDTREE)

# What this project's ddtree_patch change set can fix in a release.
FIX_AUX_LAYER_OFFSET = "aux_layer_offset"
FIX_SLIDING_DRAFTER = "sliding_drafter"
FIX_DDTREE = "ddtree"
FIX_HYBRID_TREE = "hybrid_tree"  # branch-local Gated DeltaNet state, so trees run on hybrids
FIX_PROMPT_AS_DECODE = "prompt_as_decode"  # a prompt shaped like a verification step is no decode step
PATCH_FIXES = (FIX_AUX_LAYER_OFFSET, FIX_SLIDING_DRAFTER, FIX_DDTREE, FIX_HYBRID_TREE, FIX_PROMPT_AS_DECODE)

# Which releases ddtree_patch has a change set for, and what each fixes, are the DDTree engine's
# base descriptors (ddtree/vllm-<release>/base.json "fixes"), not this table: the caller passes them
# (Request.patch_releases and patch_fixes; vllm_install reads them on the controller).

LEVEL_REFUSE = "refuse"
LEVEL_WARN = "warn"
# A known problem this deployment already handles (the change set fixes it, or the roles always do
# what avoids it): reported with the findings, never printed as a warning.
LEVEL_NOTE = "note"

_VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(\+[A-Za-z0-9.]+)?$")

Version = tuple[int, int, int]


@dataclass(frozen=True)
class KnownBug:
    """An upstream problem that matters for this deployment."""

    key: str
    summary: str
    refs: tuple[str, ...]


@dataclass(frozen=True)
class Release:
    """One row of the knowledge base: releases ``since`` <= v < ``before``."""

    since: str
    before: str
    torch: str | None
    dflash: bool
    aux_offset_fixed: bool | None  # None where there is no DFlash
    sliding: str
    tree_attention: bool
    bugs: tuple[str, ...] = ()
    # Releases whose wheels were read to establish this row; empty means taken from notes only.
    verified: tuple[str, ...] = ()
    notes: str = ""

    def as_dict(self) -> dict[str, object]:
        return {
            "since": self.since,
            "before": self.before,
            "torch": self.torch,
            "dflash": self.dflash,
            "aux_offset_fixed": self.aux_offset_fixed,
            "sliding": self.sliding,
            "tree_attention": self.tree_attention,
            "bugs": list(self.bugs),
            "verified": list(self.verified),
            "notes": self.notes,
        }


BUGS: dict[str, KnownBug] = {
    bug.key: bug
    for bug in (
        KnownBug(
            "aux_layer_offset",
            "DFlash feeds the drafter the target's hidden states one layer too early "
            "(target_layer_ids read as 'after k layers'): lower acceptance, no error",
            ("vllm-project/vllm#40727 (fix, in 0.22.0)",),
        ),
        KnownBug(
            "sliding_silent_full",
            "drafter layers marked sliding_attention run as full non-causal attention: collapsed acceptance, no error",
            ("vllm-project/vllm#40898",),
        ),
        KnownBug(
            "sliding_refused",
            "a drafter with mixed sliding/full layers raises NotImplementedError at start",
            ("vllm-project/vllm#40898",),
        ),
        KnownBug(
            "tree_attention_removed",
            "tree attention (TREE_ATTN) was removed",
            ("vllm-project/vllm#42121",),
        ),
        KnownBug(
            "gdn_prefix_caching",
            "prefix caching with speculative decoding corrupts output on GDN hybrid targets (still open in 0.28)",
            ("vllm-project/vllm#47194",),
        ),
        KnownBug(
            "fa3_aot_cuda_graphs",
            "FA3 ahead-of-time scheduling under CUDA graphs collapses DFlash acceptance to 1.0 "
            "(fixed in 0.30.0; first affected release not verified)",
            (),
        ),
        KnownBug(
            "concurrency_collapse",
            "one report of output collapse at concurrency 4-8 with DFlash and 15 speculative tokens",
            (),
        ),
        KnownBug(
            "prompt_as_decode",
            "the V1 model runner calls a batch a uniform decode from its shape alone, so a prompt (or prompt "
            "chunk) of exactly num_speculative_tokens + 1 tokens replays the FULL CUDA graph captured for "
            "verification, where a Gated DeltaNet hybrid target loses that request's recurrent state: garbage "
            "output, no error (seen on 0.20.1 on an H100, reported upstream on 0.25.1, 0.27.2rc1 and 0.29.0; "
            "the same runner and GDN builder code read in every wheel from 0.20.0 to 0.33.0)",
            (
                "vllm-project/vllm#49918 (open)",
                "vllm-project/vllm#53059 (fix, open)",
                "vllm-project/vllm#47123 (fix, open)",
            ),
        ),
        KnownBug(
            "gdn_spec_8_tokens",
            "the fused GDN speculative kernel covers at most 8 query tokens (num_speculative_tokens <= 7)",
            (),
        ),
    )
}

_DFLASH_BUGS_BEFORE_030 = ("gdn_prefix_caching", "prompt_as_decode", "fa3_aot_cuda_graphs")

RELEASES: tuple[Release, ...] = (
    Release(
        since="0.19.0",
        before="0.20.0",
        torch="2.10.0",
        dflash=False,
        aux_offset_fixed=None,
        sliding=SLIDING_NONE,
        tree_attention=True,
        verified=("0.19.1",),
        notes="tree attention serves EAGLE only",
    ),
    Release(
        since="0.20.0",
        before="0.21.0",
        torch="2.11.0",
        dflash=True,
        aux_offset_fixed=False,
        sliding=SLIDING_SILENT_FULL,
        tree_attention=True,
        bugs=("aux_layer_offset", "sliding_silent_full", *_DFLASH_BUGS_BEFORE_030),
        verified=("0.20.0", "0.20.1"),
        notes="static speculative_token_tree shared by the batch; wheels built for CUDA 13",
    ),
    Release(
        since="0.21.0",
        before="0.22.0",
        torch="2.11.0",
        dflash=True,
        aux_offset_fixed=False,
        sliding=SLIDING_SILENT_FULL,
        tree_attention=False,
        bugs=(
            "aux_layer_offset",
            "sliding_silent_full",
            "tree_attention_removed",
            "concurrency_collapse",
            *_DFLASH_BUGS_BEFORE_030,
        ),
        verified=("0.21.0",),
    ),
    Release(
        since="0.22.0",
        before="0.25.0",
        torch="2.11.0",
        dflash=True,
        aux_offset_fixed=True,
        sliding=SLIDING_SILENT_FULL,
        tree_attention=False,
        bugs=("sliding_silent_full", *_DFLASH_BUGS_BEFORE_030),
        verified=("0.22.0", "0.23.0", "0.24.0"),
    ),
    Release(
        since="0.25.0",
        before="0.26.0",
        torch="2.11.0",
        dflash=True,
        aux_offset_fixed=True,
        sliding=SLIDING_REFUSES,
        tree_attention=False,
        bugs=("sliding_refused", *_DFLASH_BUGS_BEFORE_030),
        verified=("0.25.0",),
    ),
    Release(
        since="0.26.0",
        before="0.27.0",
        torch="2.11.0",
        dflash=True,
        aux_offset_fixed=True,
        sliding=SLIDING_V2_RUNNER,
        tree_attention=False,
        bugs=_DFLASH_BUGS_BEFORE_030,
        verified=("0.26.0",),
    ),
    Release(
        since="0.27.0",
        before="0.28.0",
        torch="2.13.0",
        dflash=True,
        aux_offset_fixed=True,
        sliding=SLIDING_V2_RUNNER,
        tree_attention=False,
        bugs=_DFLASH_BUGS_BEFORE_030,
        verified=("0.27.0",),
        notes="first release pinned to torch 2.13.0",
    ),
    Release(
        since="0.28.0",
        before="0.30.0",
        torch="2.13.0",
        dflash=True,
        aux_offset_fixed=True,
        sliding=SLIDING_V2_RUNNER,
        tree_attention=False,
        bugs=("gdn_spec_8_tokens", *_DFLASH_BUGS_BEFORE_030),
        verified=("0.28.0", "0.29.0"),
    ),
    Release(
        since="0.30.0",
        before="0.33.0",
        torch="2.13.0",
        dflash=True,
        aux_offset_fixed=True,
        sliding=SLIDING_V2_RUNNER,
        tree_attention=False,
        bugs=("gdn_spec_8_tokens", "gdn_prefix_caching", "prompt_as_decode"),
        verified=("0.30.0", "0.31.0", "0.32.0"),
    ),
    Release(
        since="0.33.0",
        before="0.34.0",
        torch="2.14.0",
        dflash=True,
        aux_offset_fixed=True,
        sliding=SLIDING_V2_RUNNER,
        tree_attention=False,
        bugs=("gdn_spec_8_tokens", "gdn_prefix_caching", "prompt_as_decode"),
        verified=("0.33.0",),
    ),
)


def parse_version(text: str) -> Version:
    """``"0.20.1"`` (optionally with a local label such as ``+cu130``) -> ``(0, 20, 1)``.

    Pre-releases, dev and post releases are not releases this knowledge base describes.
    """
    match = _VERSION_RE.match(text.strip())
    if match is None:
        raise ValueError(
            f"vLLM version {text!r} is not a plain release number such as 0.20.1; "
            "pin an exact vLLM release (no pre-, dev- or post-release)"
        )
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def find_release(version: str) -> Release | None:
    """The knowledge-base row covering ``version``, or None when no row does."""
    wanted = parse_version(version)
    for row in RELEASES:
        if parse_version(row.since) <= wanted < parse_version(row.before):
            return row
    return None


@dataclass(frozen=True)
class Request:
    """What the deployment asks of one vLLM release."""

    version: str
    method: str
    hybrid_target: bool
    sliding_drafter: bool
    # Fixes this project's ddtree_patch change set will apply to this release (empty: none), from its
    # base descriptor.
    patch_fixes: frozenset[str] = field(default_factory=frozenset)
    # The releases ddtree_patch has a change set for (the engine's bases), offered in refusals.
    patch_releases: tuple[str, ...] = ()
    num_speculative_tokens: int | None = None
    allow_unknown: bool = False


@dataclass(frozen=True)
class Finding:
    level: str
    code: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"level": self.level, "code": self.code, "message": self.message}


def patched(req: Request) -> str:
    """The releases ddtree_patch has a change set for, as a choice to offer: "0.20.1 with ddtree_patch"
    ('' when it has none)."""
    return f"{' or '.join(req.patch_releases)} with ddtree_patch" if req.patch_releases else ""


def _choices(*options: str) -> str:
    """Options in order, the empty ones left out: "a, or b", "a, b, or c"."""
    kept = [o for o in options if o]
    return kept[0] if len(kept) == 1 else ", ".join(kept[:-1]) + ", or " + kept[-1]


def _refuse(code: str, message: str) -> Finding:
    return Finding(LEVEL_REFUSE, code, message)


def _warn(code: str, message: str) -> Finding:
    return Finding(LEVEL_WARN, code, message)


def _note(code: str, message: str) -> Finding:
    return Finding(LEVEL_NOTE, code, message)


def _prompt_as_decode(req: Request) -> Finding:
    """A hybrid target on a release whose runner takes a step-shaped prompt for a verification step."""
    if FIX_PROMPT_AS_DECODE in req.patch_fixes:
        return _note(
            "prompt-as-decode-patched",
            f"vLLM {req.version} replays a prompt exactly as long as one verification step through the FULL "
            "CUDA graph captured for verification, which loses a Gated DeltaNet hybrid target's recurrent "
            "state for that request (vllm-project/vllm#49918); ddtree_patch fixes it here, so ddtree_patch "
            "must run before the service starts",
        )
    if req.method == METHOD_DDTREE:
        length = "the DDTree budget + 1 tokens"
    elif req.num_speculative_tokens is not None:
        length = f"{req.num_speculative_tokens + 1} tokens (num_speculative_tokens + 1)"
    else:
        length = "num_speculative_tokens + 1 tokens"
    pick = f"pick {patched(req)}, which fixes it, or " if req.patch_releases else ""
    return _warn(
        "prompt-as-decode",
        f"vLLM {req.version} takes a prompt (or prompt chunk) of exactly {length} for a verification step "
        "and replays it through the FULL CUDA graph captured for verification, where this hybrid target's "
        "Gated DeltaNet layers lose that request's recurrent state: its output is garbage, without an error "
        f"(vllm-project/vllm#49918, no fix released); {pick}serve without full CUDA graphs "
        '(service_swap_extra_args: ["--compilation-config.cudagraph_mode", "PIECEWISE"])',
    )


def evaluate(req: Request) -> list[Finding]:
    """Refusals and warnings for ``req``, most fundamental first. Pure."""
    if req.method not in METHODS:
        return [
            _refuse(
                "unknown-method",
                f"speculative method {req.method!r} is not one this project deploys; use one of {', '.join(METHODS)}",
            )
        ]
    try:
        parse_version(req.version)
    except ValueError as exc:
        return [_refuse("bad-version", str(exc))]
    row = find_release(req.version)
    if row is None:
        known = f"{RELEASES[0].since} to before {RELEASES[-1].before}"
        if not req.allow_unknown:
            return [
                _refuse(
                    "unknown-release",
                    f"vLLM {req.version} is not in this project's release knowledge base (it knows "
                    f"{known}), so nothing is known about its DFlash support; pick a known release "
                    f"({', '.join(o for o in (patched(req) and patched(req) + ' for DDTree', '0.30.0 or later for the DFlash chain') if o)}) "
                    "or read that release's wheel and add a row to module_utils/vllm_releases.py",
                )
            ]
        return [
            _warn(
                "unknown-release",
                f"vLLM {req.version} is not in this project's release knowledge base (it knows "
                f"{known}); installing it because unknown releases are allowed, with no "
                "checks of its DFlash support",
            )
        ]

    findings: list[Finding] = []
    fixes = req.patch_fixes
    vtext = req.version

    if not row.dflash:
        findings.append(
            _refuse(
                "no-dflash",
                f"vLLM {vtext} has no DFlash (it arrived in 0.20.0), so neither the DFlash chain "
                f"nor DDTree can run; pick {_choices(patched(req), '0.30.0 or later for the chain')}",
            )
        )
        return findings

    if req.method == METHOD_DDTREE and FIX_DDTREE not in fixes:
        covered = " or ".join(req.patch_releases) or "no release"
        if vtext.split("+", 1)[0] in req.patch_releases:
            why = f"DDTree is in no vLLM release and ddtree_patch, which adds it to {vtext}, is switched off"
            fix = "enable ddtree_patch, or ask for method dflash"
        elif row.tree_attention:
            why = (
                f"DDTree is in no vLLM release and this project's ddtree_patch has a change set "
                f"for {covered} only, not for {vtext}"
            )
            fix = _choices(
                patched(req) and f"pick {' or '.join(req.patch_releases)} (with ddtree_patch)", "ask for method dflash"
            )
        else:
            why = (
                f"DDTree is in no vLLM release, {vtext} has no tree attention to build it on "
                "(removed in 0.21.0, vllm-project/vllm#42121), and this project's ddtree_patch "
                f"covers {covered} only"
            )
            fix = _choices(
                patched(req) and f"pick {' or '.join(req.patch_releases)} (with ddtree_patch)", "ask for method dflash"
            )
        findings.append(_refuse("ddtree-unavailable", f"{why}; {fix}"))

    if row.aux_offset_fixed is False:
        if FIX_AUX_LAYER_OFFSET in fixes:
            findings.append(
                _note(
                    "aux-layer-offset-patched",
                    f"vLLM {vtext} feeds the DFlash drafter one target layer too early "
                    "(fixed upstream in 0.22.0, vllm-project/vllm#40727); ddtree_patch fixes it "
                    "here, so ddtree_patch must run before the service starts",
                )
            )
        else:
            findings.append(
                _refuse(
                    "aux-layer-offset",
                    f"vLLM {vtext} feeds the DFlash drafter one target layer too early, which "
                    "silently lowers acceptance (fixed upstream in 0.22.0, vllm-project/vllm#40727); "
                    f"pick {_choices('0.22.0 or later', patched(req) and patched(req) + ', which fixes it')}",
                )
            )

    if req.sliding_drafter:
        if row.sliding == SLIDING_SILENT_FULL:
            if FIX_SLIDING_DRAFTER in fixes:
                findings.append(
                    _note(
                        "sliding-drafter-patched",
                        f"vLLM {vtext} runs sliding-window drafter layers as full non-causal "
                        "attention; ddtree_patch makes them causal and windowed here, so "
                        "ddtree_patch must run before the service starts",
                    )
                )
            else:
                findings.append(
                    _refuse(
                        "sliding-drafter-silent-full",
                        f"vLLM {vtext} silently runs this drafter's sliding-window layers as full "
                        "non-causal attention, which collapses acceptance without an error "
                        "(vllm-project/vllm#40898); pick "
                        + _choices(
                            patched(req) and patched(req) + " (which runs them causal over their window)",
                            "0.26.0 or later (DFlash chain only)",
                            "a drafter whose layers are all full attention",
                        ),
                    )
                )
        elif row.sliding == SLIDING_REFUSES:
            findings.append(
                _refuse(
                    "sliding-drafter-refused",
                    f"vLLM {vtext} refuses drafters with mixed sliding/full layers at start "
                    "(NotImplementedError, vllm-project/vllm#40898), after the target has loaded; "
                    f"pick {_choices('0.26.0 or later', patched(req))}",
                )
            )
        elif row.sliding == SLIDING_V2_RUNNER:
            findings.append(
                _warn(
                    "sliding-drafter-v2-runner",
                    f"vLLM {vtext} runs drafters with mixed sliding/full layers on the V2 model "
                    "runner only and selects it itself; do not set VLLM_USE_V2_MODEL_RUNNER=0, "
                    "or it refuses to start",
                )
            )

    if (
        req.hybrid_target
        and "gdn_spec_8_tokens" in row.bugs
        and req.num_speculative_tokens is not None
        and req.num_speculative_tokens > 7
    ):
        findings.append(
            _refuse(
                "gdn-spec-tokens",
                f"vLLM {vtext}'s fused GDN speculative kernel covers at most 8 query tokens, so a "
                f"hybrid target allows num_speculative_tokens <= 7, not {req.num_speculative_tokens}; "
                "lower num_speculative_tokens to 7 or less",
            )
        )

    if req.method == METHOD_DDTREE and req.hybrid_target and FIX_HYBRID_TREE not in fixes:
        findings.append(
            _warn(
                "ddtree-hybrid-target",
                "the target has recurrent (GDN) layers: a tree needs branch-local recurrent state, "
                "which no engine has, so ddtree_patch runs the DFlash chain on this target and says "
                "so at start; ask for method dflash to make that explicit",
            )
        )

    if req.hybrid_target and "gdn_prefix_caching" in row.bugs:
        findings.append(
            _note(
                "gdn-prefix-caching",
                f"on vLLM {vtext}, prefix caching with speculative decoding corrupts output on GDN "
                "hybrid targets (vllm-project/vllm#47194); the service must run with "
                "--no-enable-prefix-caching, which service_swap renders on hybrid targets "
                "(service_swap_prefix_caching: auto)",
            )
        )

    if req.hybrid_target and "prompt_as_decode" in row.bugs:
        findings.append(_prompt_as_decode(req))

    if "fa3_aot_cuda_graphs" in row.bugs:
        findings.append(
            _note(
                "fa3-aot-cuda-graphs",
                f"vLLM releases before 0.30.0, reportedly including {vtext}, can collapse DFlash "
                "acceptance to 1.0 under CUDA graphs with FA3 ahead-of-time scheduling; service_swap's "
                "acceptance-length gate (its floor is always above 1.0) catches that and restores "
                "SGLang, or pick 0.30.0 or later",
            )
        )

    if "concurrency_collapse" in row.bugs:
        findings.append(
            _warn(
                "concurrency-collapse",
                f"vLLM {vtext} has one report of output collapse at concurrency 4-8 with DFlash and "
                "15 speculative tokens; pick 0.22.0 or later",
            )
        )

    return findings


def refusals(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == LEVEL_REFUSE]


def warnings(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == LEVEL_WARN]


def notes(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == LEVEL_NOTE]


# ---------------------------------------------------------------------------------------------
# Reading a release's facts back out of its files (a wheel or an installed tree).

# Files and symbols each method needs, relative to the directory that holds the ``vllm`` package.
DFLASH_REQUIREMENTS: tuple[tuple[str, str], ...] = (
    ("vllm/v1/spec_decode/dflash.py", "class DFlashProposer"),
    ("vllm/model_executor/models/qwen3_dflash.py", "class DFlashQwen3ForCausalLM"),
    ("vllm/model_executor/models/registry.py", '"DFlashDraftModel"'),
)
TREE_REQUIREMENTS: tuple[tuple[str, str], ...] = (
    ("vllm/v1/attention/backends/tree_attn.py", "class TreeAttentionBackend"),
)

# Modules and names imported where a GPU (and torch) is present.
DFLASH_IMPORTS: tuple[tuple[str, str], ...] = (
    ("vllm.v1.spec_decode.dflash", "DFlashProposer"),
    ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM"),
)
TREE_IMPORTS: tuple[tuple[str, str], ...] = (("vllm.v1.attention.backends.tree_attn", "TreeAttentionBackend"),)


def requirements_for(method: str) -> tuple[tuple[str, str], ...]:
    """The (file, symbol) pairs ``method`` needs in an unpatched release.

    DDTree needs tree attention in the release itself: this project's patch builds on it.
    """
    if method == METHOD_DDTREE:
        return DFLASH_REQUIREMENTS + TREE_REQUIREMENTS
    return DFLASH_REQUIREMENTS


def imports_for(method: str) -> tuple[tuple[str, str], ...]:
    if method == METHOD_DDTREE:
        return DFLASH_IMPORTS + TREE_IMPORTS
    return DFLASH_IMPORTS


# 0.22.0's fix (vllm-project/vllm#40727): ``i + 1 for i in (dflash_config.get("target_layer_ids") ...``
_AUX_FIX_RE = re.compile(r"i\s*\+\s*1\s+for\s+i\s+in\s+\(?\s*dflash_config\.get\(\s*[\"']target_layer_ids[\"']")
_TORCH_PIN_RE = re.compile(r"^Requires-Dist:\s*torch\s*==\s*([0-9][0-9A-Za-z.+]*)\s*(;.*)?$", re.M)
_VERSION_LINE_RE = re.compile(r"^Version:\s*(\S+)\s*$", re.M)


@dataclass(frozen=True)
class Detected:
    """Facts read from a release's files; ``None`` where the files do not say."""

    version: str | None
    torch: str | None
    dflash: bool
    aux_offset_fixed: bool | None
    sliding: str
    tree_attention: bool

    def as_dict(self) -> dict[str, object]:
        return {
            "version": self.version,
            "torch": self.torch,
            "dflash": self.dflash,
            "aux_offset_fixed": self.aux_offset_fixed,
            "sliding": self.sliding,
            "tree_attention": self.tree_attention,
        }


def metadata_version(metadata: str) -> str | None:
    match = _VERSION_LINE_RE.search(metadata)
    return match.group(1) if match else None


def metadata_torch_pin(metadata: str) -> str | None:
    match = _TORCH_PIN_RE.search(metadata)
    return match.group(1) if match else None


def has_symbol(read: Callable[[str], str | None], path: str, symbol: str) -> bool:
    text = read(path)
    return text is not None and symbol in text


def detect_features(read: Callable[[str], str | None], metadata: str | None) -> Detected:
    """Read the knowledge-base columns out of a release's files.

    ``read(relpath)`` returns a file's text (relative to the directory holding ``vllm/``) or
    None when the file does not exist; ``metadata`` is the dist-info METADATA text.
    """
    dflash = all(has_symbol(read, path, sym) for path, sym in DFLASH_REQUIREMENTS)
    tree = all(has_symbol(read, path, sym) for path, sym in TREE_REQUIREMENTS)
    aux: bool | None = None
    sliding = SLIDING_NONE
    if dflash:
        runner = read("vllm/v1/worker/gpu_model_runner.py") or ""
        aux = _AUX_FIX_RE.search(runner) is not None
        model = read("vllm/model_executor/models/qwen3_dflash.py") or ""
        config = read("vllm/config/vllm.py") or ""
        if "layer_types" not in model:
            sliding = SLIDING_SILENT_FULL
        elif "does not yet support mixed sliding/full" in model:
            sliding = SLIDING_REFUSES
        elif "_dflash_needs_multi_kv_group" in config:
            sliding = SLIDING_V2_RUNNER
        else:
            sliding = "unknown"
    return Detected(
        version=metadata_version(metadata) if metadata else None,
        torch=metadata_torch_pin(metadata) if metadata else None,
        dflash=dflash,
        aux_offset_fixed=aux,
        sliding=sliding,
        tree_attention=tree,
    )


_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
_GDN_BUILDER = "vllm/v1/attention/backends/gdn_attn.py"
# _is_uniform_decode: ``max_num_scheduled_tokens == uniform_decode_query_len and num_tokens == ...``
_SHAPE_ONLY_RE = re.compile(r"max_num_scheduled_tokens\s*==\s*uniform_decode_query_len")
# The GDN builder fills the FULL graph's persistent state indices for pure spec-decode batches only.
_GDN_DECODE_ONLY_RE = re.compile(
    r"self\.use_full_cuda_graph\s+and\s+num_prefills\s*==\s*0\s+and\s+num_decodes\s*==\s*0"
)


def detect_prompt_as_decode(read: Callable[[str], str | None]) -> bool | None:
    """Whether a release's files show the ``prompt_as_decode`` bug; None where the V1 runner or the
    GDN metadata builder is absent.

    True when ``_is_uniform_decode`` decides on the batch's shape, ``execute_model``'s one dispatch
    decision passes no ``force_uniform_decode`` of its own (this project's change set and the upstream
    fix PRs pass one) and the GDN builder refreshes the FULL graph's state indices for decode batches
    only. ``read`` is as for ``detect_features``.
    """
    runner, builder = read(_RUNNER), read(_GDN_BUILDER)
    if runner is None or builder is None:
        return None
    shape_only = False
    overridden = True
    for node in ast.walk(ast.parse(runner)):
        if not isinstance(node, ast.FunctionDef):
            continue
        if node.name == "_is_uniform_decode":
            shape_only = _SHAPE_ONLY_RE.search(ast.unparse(node)) is not None
        elif node.name == "execute_model":
            keywords = [
                kw.arg
                for call in ast.walk(node)
                if isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "_determine_batch_execution_and_padding"
                for kw in call.keywords
            ]
            overridden = not keywords or "force_uniform_decode" in keywords
    return shape_only and not overridden and _GDN_DECODE_ONLY_RE.search(builder) is not None


def compare_with_row(detected: Detected, row: Release) -> list[str]:
    """Where the files disagree with the knowledge-base row; empty when they agree."""
    diffs: list[str] = []
    pairs: tuple[tuple[str, object, object], ...] = (
        ("torch", row.torch, detected.torch),
        ("dflash", row.dflash, detected.dflash),
        ("aux_offset_fixed", row.aux_offset_fixed, detected.aux_offset_fixed),
        ("sliding", row.sliding, detected.sliding),
        ("tree_attention", row.tree_attention, detected.tree_attention),
    )
    for name, expected, found in pairs:
        if expected != found:
            diffs.append(f"{name}: knowledge base says {expected!r}, files say {found!r}")
    return diffs
