"""While the host prepares a step, its copies to the GPU come from pinned memory (docs/ddtree_patch.md,
"Preparing a step without waiting for the GPU").

A copy from pageable host memory makes the host wait until every kernel queued before it has run, so
under async scheduling the GPU idles while the host prepares the next step. vLLM 0.20.1 makes such
copies on every speculative step: the M-RoPE positions (a strided view of their pinned buffer, which
torch first copies into pageable memory), their drift (a numpy-indexed gather), the verification's
index arrays (numpy) and the Gated DeltaNet metadata's row mask (and a CPU mask indexing GPU tensors).
The change set's versions are taken from the real wheel as it leaves them and run beside the release's
own code on the same inputs: the values must be the release's exactly, and every copy's source pinned
(or, without CUDA here, contiguous and handed to ``pin_memory``).
"""

from __future__ import annotations

import ast
import dataclasses
import sys
import types
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import torch

from ddtree.tests import release_files

RUNNER = "vllm/v1/worker/gpu_model_runner.py"
GDN = "vllm/v1/attention/backends/gdn_attn.py"


@pytest.fixture(scope="module")
def sources() -> dict[str, dict[str, str]]:
    return {
        "pristine": {p: b.decode() for p, b in release_files.pristine([RUNNER, GDN]).items()},
        "patched": {p: b.decode() for p, b in release_files.patched([RUNNER, GDN]).items()},
    }


def _runner_method(sources, which: str, name: str, **namespace):
    return release_files.method(sources[which][RUNNER], "GPUModelRunner", name, {"torch": torch, "np": np} | namespace)


class _Row:
    """One row of a stand-in GPU buffer: records what each copy into it was given."""

    def __init__(self, target: torch.Tensor, log: list):
        self.target, self.log = target, log

    def copy_(self, src: torch.Tensor, non_blocking: bool = False):
        self.log.append((src.is_contiguous(), non_blocking))
        self.target.copy_(src)


class _Rows:
    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.log = tensor, []

    def __getitem__(self, key):
        return _Row(self.tensor[key], self.log)


def test_m_rope_positions_go_row_by_row_from_contiguous_pinned_rows(sources):
    rows_to_gpu = _runner_method(sources, "patched", "_ddtree_rows_to_gpu", CpuGpuBuffer=object)
    cpu = torch.arange(3 * 11, dtype=torch.int64).reshape(3, 11)  # (3, max_num_tokens + 1), as vLLM makes it
    gpu = _Rows(torch.zeros(3, 11, dtype=torch.int64))
    rows_to_gpu(None, SimpleNamespace(cpu=cpu, gpu=gpu), 7)
    assert torch.equal(gpu.tensor[:, :7], cpu[:, :7]) and not gpu.tensor[:, 7:].any()
    assert gpu.log == [(True, True)] * 3  # three copies, each from a contiguous (pinned) row, none blocking
    assert not cpu[:, :7].is_contiguous()  # the release's one copy: torch stages this view in pageable memory


def test_the_position_drift_is_the_releases_from_the_host_values_already_on_the_gpu(sources):
    drift_of = _runner_method(sources, "patched", "_ddtree_position_drift")
    host = torch.tensor([5, 9, 20, 3], dtype=torch.int32)  # num_computed_tokens_cpu_tensor: optimistic
    corrected = torch.tensor([4, 9, 17, 3, 0, 0], dtype=torch.int32)  # the GPU's, after the correction
    req_indices = np.array([0, 0, 1, 2, 2, 2, 3])
    runner = SimpleNamespace(num_computed_tokens=corrected)
    # the release: num_computed_tokens[req_indices_gpu] - host[req_indices] (a pageable, numpy-indexed gather)
    release = corrected[torch.from_numpy(req_indices)].to(torch.int64) - host[req_indices].to(torch.int64)
    drift = drift_of(runner, 4, torch.from_numpy(req_indices), host.clone())
    assert drift.dtype == torch.int64 and drift.tolist() == release.tolist() == [-1, -1, 0, -3, -3, -3, 0]
    # copied from the host unchanged: nothing drifted, nothing to add
    assert drift_of(runner, 4, torch.from_numpy(req_indices), None) is None


class _PinningTorch:
    """torch as ``_ddtree_host_to_gpu`` uses it, where ``empty_like(..., pin_memory=True)`` (which needs
    CUDA) gives a plain tensor and records it: the pinned snapshots a step's copies read."""

    def __init__(self):
        self.pinned: list[torch.Tensor] = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty_like(self, like, pin_memory=False):
        out = torch.empty_like(like)
        if pin_memory:
            self.pinned.append(out)
        return out


def _spec_runner(sources, which: str, shim: _PinningTorch):
    arange = np.arange(64, dtype=np.int64)
    runner = SimpleNamespace(
        arange_np=arange,
        _arange_scratch=np.empty(64, dtype=np.int64),
        input_ids=SimpleNamespace(gpu=torch.arange(1000, 1300, dtype=torch.int32)),
        device=torch.device("cpu"),
        pin_memory=True,
    )
    runner._get_cumsum_and_arange = _runner_method(sources, which, "_get_cumsum_and_arange").__get__(runner)
    if which == "patched":
        runner._ddtree_host_to_gpu = _runner_method(sources, which, "_ddtree_host_to_gpu", torch=shim).__get__(runner)
    return runner


def test_a_host_array_goes_to_the_gpu_from_a_pinned_snapshot(sources):
    shim = _PinningTorch()
    to_gpu = _runner_method(sources, "patched", "_ddtree_host_to_gpu", torch=shim)
    live = np.array([5, 9, 20, 3], dtype=np.int32)  # e.g. num_computed_tokens_cpu, which the host rewrites
    runner = SimpleNamespace(pin_memory=True, device=torch.device("cpu"))
    on_gpu = to_gpu(runner, live)
    assert len(shim.pinned) == 1 and on_gpu.data_ptr() == shim.pinned[0].data_ptr()  # copied from the snapshot
    live[1] -= 4  # the deferred correction, after the copy was queued and before it ran
    assert on_gpu.tolist() == [5, 9, 20, 3] and on_gpu.dtype == torch.int32


def test_the_verifications_index_arrays_are_the_releases_through_pinned_memory(sources):
    shim = _PinningTorch()
    metadata = {"SpecDecodeMetadata": lambda **kw: kw}
    num_draft_tokens = np.array([3, 0, 2, 0, 1], dtype=np.int32)  # the release's own docstring example
    cu_num_scheduled = np.cumsum(np.array([4, 100, 3, 100, 2], dtype=np.int32))
    out = {}
    for which in ("pristine", "patched"):
        calc = _runner_method(sources, which, "_calc_spec_decode_metadata", **metadata)
        out[which] = calc(_spec_runner(sources, which, shim), num_draft_tokens, cu_num_scheduled)
    assert out["patched"]["logits_indices"].tolist() == [0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208]
    for key, value in out["pristine"].items():
        if isinstance(value, torch.Tensor):
            assert out["patched"][key].dtype == value.dtype and torch.equal(out["patched"][key], value), key
        else:
            assert out["patched"][key] == value, key
    assert len(shim.pinned) == 5  # every index array went through pinned memory


def test_prepare_inputs_makes_its_copies_through_the_helpers(sources):
    """The release's pageable copies are gone from the step's preparation, the helpers called instead."""
    source = sources["patched"][RUNNER]
    tree = ast.parse(source)
    body = next(
        ast.get_source_segment(source, f)
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef) and c.name == "GPUModelRunner"
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == "_prepare_inputs"
    )
    for call in (
        "self._ddtree_rows_to_gpu(self.mrope_positions, total_num_scheduled_tokens)",
        "self._ddtree_rows_to_gpu(self.xdrope_positions, total_num_scheduled_tokens)",
        "host_computed = self._ddtree_host_to_gpu(",
        "self._ddtree_position_drift(num_reqs, req_indices_gpu, host_computed)",
    ):
        assert call in body, call
    (update,) = [
        node
        for node in ast.walk(ast.parse(body))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "update_num_computed_tokens_for_batch_change"
    ]
    assert ast.unparse(update.args[-1]) == "host_computed"  # the snapshot, not the live array
    for release in (
        ".cpu[:, :total_num_scheduled_tokens]",
        "num_computed_tokens_cpu_tensor[req_indices]",
        "num_computed_tokens_cpu_tensor[:num_reqs].to(",  # a live copy the correction could outrun
    ):
        assert release not in body and release in sources["pristine"][RUNNER], release


class _Indexed(torch.Tensor):
    """A GPU tensor stand-in that records how it is indexed: a CPU bool mask on a GPU tensor copies
    its indices to the GPU from pageable memory (torch 2.11), which waits for every queued kernel."""

    masks: ClassVar[list] = []

    def __getitem__(self, key):
        first = key[0] if isinstance(key, tuple) else key
        if isinstance(first, torch.Tensor) and first.dtype == torch.bool:
            _Indexed.masks.append(first.tolist())
        return super().__getitem__(key).as_subclass(torch.Tensor)


def _gdn_builder(full_graphs: bool, max_bs: int = 8, num_spec: int = 3):
    return SimpleNamespace(
        use_spec_decode=True,
        num_spec=num_spec,
        kv_cache_spec=None,
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="none")),
        use_full_cuda_graph=full_graphs,
        decode_cudagraph_max_bs=max_bs,
        spec_state_indices_tensor=torch.full((max_bs, num_spec + 1), -7, dtype=torch.int32),
        non_spec_state_indices_tensor=torch.full((max_bs,), -7, dtype=torch.int32),
        spec_sequence_masks=torch.zeros(max_bs, dtype=torch.bool),
        spec_token_indx=torch.full((max_bs * (num_spec + 1),), -7, dtype=torch.int32),
        non_spec_token_indx=torch.full((max_bs * (num_spec + 1),), -7, dtype=torch.int32),
        spec_query_start_loc=torch.full((max_bs + 1,), -7, dtype=torch.int32),
        non_spec_query_start_loc=torch.full((max_bs + 1,), -7, dtype=torch.int32),
        num_accepted_tokens=torch.full((max_bs,), -7, dtype=torch.int32),
    )


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is on a GPU (the builder pins only what goes to one)."""

    @property
    def is_cuda(self):
        return True


def _gdn_build(
    sources,
    which: str,
    builder,
    query_lens: list[int],
    drafts: list[int],
    accepted: list[int],
    on_gpu: bool = False,
    computed: list[int] | None = None,
):
    @dataclasses.dataclass
    class Metadata:  # GDNAttentionMetadata's fields, as the builder fills them
        num_prefills: int
        num_prefill_tokens: int
        num_decodes: int
        num_decode_tokens: int
        num_spec_decodes: int
        num_spec_decode_tokens: int
        num_actual_tokens: int
        has_initial_state: object = None
        chunk_indices: object = None
        chunk_offsets: object = None
        spec_query_start_loc: object = None
        non_spec_query_start_loc: object = None
        spec_state_indices_tensor: object = None
        non_spec_state_indices_tensor: object = None
        spec_sequence_masks: object = None
        spec_token_indx: object = None
        non_spec_token_indx: object = None
        num_accepted_tokens: object = None
        nums_dict: object = None
        batch_ptr: object = None
        token_chunk_offset_ptr: object = None

    namespace = {
        "torch": torch,
        "NULL_BLOCK_ID": 0,
        "GDNAttentionMetadata": Metadata,
        "mamba_get_block_table_tensor": lambda table, seq_lens, spec, mode: table,
        "is_pin_memory_available": lambda: True,
        # Causal-conv metadata from the host's query starts (vllm/v1/attention/backends/utils.py, outside
        # the change set): what the builder passes it is what is compared.
        "compute_causal_conv1d_metadata": lambda starts, device: ({"starts": starts.tolist()}, None, None),
    }
    if "_to_device_pinned" in sources[which][GDN]:
        namespace["_to_device_pinned"] = release_files.function(sources[which][GDN], "_to_device_pinned", namespace)
    build = release_files.method(sources[which][GDN], "GDNAttentionMetadataBuilder", "build", namespace)
    starts = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    rows = len(query_lens)
    common = SimpleNamespace(
        query_start_loc=starts.clone().as_subclass(_OnGpu) if on_gpu else starts.clone(),
        query_start_loc_cpu=starts.clone(),
        compute_num_computed_tokens=lambda: torch.tensor(computed or [40] * rows, dtype=torch.int32).as_subclass(
            _Indexed
        ),
        block_table_tensor=torch.arange(rows * 6, dtype=torch.int32).reshape(rows, 6).as_subclass(_Indexed),
        seq_lens=torch.full((rows,), 50, dtype=torch.int32),
        num_actual_tokens=int(starts[-1]),
    )
    return build(
        builder,
        0,
        common,
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32).as_subclass(_Indexed),
        num_decode_draft_tokens_cpu=torch.tensor(drafts, dtype=torch.int32),
    )


def _assert_same_metadata(release, changed) -> None:
    """Every field the changed builder fills equals the release's, in value and dtype."""
    for field in dataclasses.fields(release):
        a, b = getattr(release, field.name), getattr(changed, field.name)
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), field.name
        else:
            assert a == b, field.name


@pytest.fixture
def pinned(monkeypatch) -> list:
    """What each torch.Tensor.pin_memory call was given (no CUDA here: it returns a copy)."""
    given: list = []

    def pin_memory(self):
        given.append(self.tolist())
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return given


@pytest.mark.parametrize("full_graphs", [True, False])
@pytest.mark.parametrize(
    "query_lens, drafts, accepted",
    [
        ([4, 4, 4, 0, 0], [3, 3, 3, -1, -1], [2, 1, 4, 1, 1]),  # every request verifies, padding last
        ([4], [3], [3]),  # batch 1
        ([0, 4, 4], [-1, 3, 3], [1, 2, 3]),  # a padded row first: not a prefix, the release's mask
    ],
)
def test_gated_deltanet_metadata_is_the_releases_without_indexing_gpu_tensors_by_a_cpu_mask(
    sources, full_graphs, query_lens, drafts, accepted
):
    got = {}
    for which in ("pristine", "patched"):
        _Indexed.masks = []
        meta = _gdn_build(sources, which, _gdn_builder(full_graphs), query_lens, drafts, accepted)
        got[which] = (meta, list(_Indexed.masks))
    (release, release_masks), (changed, changed_masks) = got["pristine"], got["patched"]
    _assert_same_metadata(release, changed)
    assert release_masks  # the release indexes the block table and the accepted counts with the CPU mask
    prefix = drafts[: sum(d >= 0 for d in drafts)] == [d for d in drafts if d >= 0]
    assert changed_masks == ([] if prefix else release_masks)


def test_the_gated_deltanet_row_mask_goes_to_the_gpu_from_pinned_memory(sources, pinned):
    for which, want in (("pristine", []), ("patched", [[True, True, False]])):
        pinned.clear()
        _gdn_build(sources, which, _gdn_builder(True), [4, 4, 0], [3, 3, -1], [2, 1, 1], on_gpu=True)
        assert pinned == want, which


@pytest.fixture
def fla_chunks(monkeypatch):
    """The FLA chunk helpers the builder imports for prefills: the wheel's own formulas (its package
    needs Triton's GPU driver to import)."""
    index = types.ModuleType("fla_index")

    def lens(cu):
        return cu[1:] - cu[:-1]

    def chunk_indices(cu, size):
        idx = torch.cat([torch.arange(n) for n in (-(-lens(cu) // size)).tolist()])
        return torch.stack([idx.eq(0).cumsum(0) - 1, idx], 1).to(cu)

    def chunk_offsets(cu, size):
        return torch.cat([cu.new_tensor([0]), -(-lens(cu) // size)]).cumsum(-1)

    index.prepare_chunk_indices, index.prepare_chunk_offsets = chunk_indices, chunk_offsets
    utils = types.ModuleType("fla_utils")
    utils.FLA_CHUNK_SIZE = 4
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.fla.ops.index", index)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.fla.ops.utils", utils)


@pytest.mark.parametrize(
    "query_lens, drafts, accepted, computed",
    [
        ([4, 7, 4, 0], [3, -1, 3, -1], [2, 1, 3, 1], [40, 0, 40, 0]),  # a prompt chunk among verifications
        ([1, 4, 4], [-1, 3, 3], [1, 2, 4], [40, 40, 40]),  # a plain decode, counted as a prefill
        ([9, 4, 6], [-1, 3, -1], [1, 3, 1], [0, 40, 16]),  # two prompts around one verification
        # verifications of different lengths (a request may draft fewer), a fresh prompt, a plain decode
        ([6, 4, 1, 2, 0], [-1, 3, -1, 1, -1], [1, 4, 1, 2, 1], [0, 40, 40, 40, 0]),
    ],
)
def test_a_step_of_prompts_beside_verifications_gathers_its_rows_from_one_pinned_copy(
    sources, fla_chunks, pinned, query_lens, drafts, accepted, computed
):
    got = {}
    for which in ("pristine", "patched"):
        _Indexed.masks, pinned[:] = [], []
        meta = _gdn_build(
            sources, which, _gdn_builder(True), query_lens, drafts, accepted, on_gpu=True, computed=computed
        )
        got[which] = (meta, list(_Indexed.masks), list(pinned))
    (release, release_masks, release_pins), (changed, changed_masks, changed_pins) = got["pristine"], got["patched"]
    assert release.num_prefills > 0 and release.num_spec_decodes > 0  # the mixed branch
    _assert_same_metadata(release, changed)
    # The release gathers the block table (twice), the accepted counts and the initial-state flags
    # with the CPU mask; the change set with row indices, from one pinned copy beside the mask's and
    # the chunk tables'.
    assert len(release_masks) == 4 and changed_masks == []
    assert release_pins == []
    spec = [i for i, d in enumerate(drafts) if d >= 0]
    assert changed_pins[0] == [d >= 0 for d in drafts]
    assert changed_pins[1] == spec + [i for i, d in enumerate(drafts) if d < 0]
    assert changed_pins[2:] == [changed.chunk_indices.tolist(), changed.chunk_offsets.tolist()]
