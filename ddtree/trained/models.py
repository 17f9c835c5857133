"""The trained pairs' architectures, and the DFlash drafter as plain PyTorch.

Two targets of about 14M parameters over the corpus's 4,096-token vocabulary (padded to 4,160):

- ``hybrid``: Qwen3.5/3.6's architecture, saved as ``Qwen3_5ForConditionalGeneration`` with the real
  config layout: ``text_config`` with Qwen3.6's layer pattern (three Gated DeltaNet layers, then one
  gated full-attention layer; twice), M-RoPE (``mrope_section``, interleaved, partial rotary),
  untied embeddings, and a minimal vision tower that vLLM skips with ``language_model_only``.
- ``attention``: a pure-attention Qwen3 of the same width and depth.

Each target's DFlash drafter (``Drafter``) has Qwen3.6-27B-DFlash's layout at this width: causal
sliding-window layers and one full non-causal layer, ``fc`` over the target layers that
drafter_config's rule names, ``hidden_norm``, ``norm``, the real tensor names, and no embedding or
LM head (the target's are used, frozen). Its forward is what vLLM 0.20.1 with the DDTree change set
computes: the context K/V come from ``hidden_norm(fc(target states))`` through each layer's k/v
projections (no input norm), the block ``[anchor, mask x 15]`` sits at positions ``anchor ..
anchor + 15`` after the context, a full layer sees the whole context and the whole block, a sliding
layer is causal over a window of ``window`` positions (FlashAttention's ``(window - 1, 0)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.trained.corpus import EOS, MASK_TOKEN_ID, VOCAB_SIZE

HIDDEN = 384
LAYERS = 8
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 64
INTERMEDIATE = 1024
MAX_POSITIONS = 4096
HYBRID_LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
BLOCK = 16  # DFlash block: the anchor and 15 mask tokens; the chain drafts 15 tokens
DRAFT_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"]
WINDOW = 256  # shorter than most proof prompts (16 to 1500 tokens)
RMS_EPS = 1e-6
OUT_OF_VOCAB = 10_000  # vision token ids: never in a text prompt


def hybrid_text_config(**sizes) -> dict:
    """Qwen3.6's text_config layout at the trained pair's sizes.

    ``sizes`` replace some of its values (the GPU proof's random pair is narrower, with a 64-token
    vocabulary); the layer pattern, linear-attention heads and M-RoPE stay Qwen3.6's.
    """
    layers = sizes.get("num_hidden_layers", LAYERS)
    config = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
        layer_types=HYBRID_LAYER_TYPES * (layers // 4),
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=RMS_EPS,
        hidden_act="silu",
        attention_bias=False,
        # 64 x 0.25 = 16 rotary dims = 8 frequencies, split 3/3/2 over (time, height, width) as
        # Qwen3.6 splits its 32 as 11/11/10. Text positions move the three together.
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [3, 3, 2],
        },
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    unknown = sorted(set(sizes) - set(config))
    if unknown:
        raise ValueError(f"not in the hybrid's text_config: {unknown}")
    return {**config, **sizes}


def hybrid_causal_lm():
    """The hybrid's language model alone (what is trained)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**hybrid_text_config()))


def hybrid_checkpoint_config(text: dict | None = None, out_of_vocab: int = OUT_OF_VOCAB):
    """Qwen3_5ForConditionalGeneration's config: ``text`` (default: text_config as trained), a minimal
    vision tower whose token ids start at ``out_of_vocab`` (past the vocabulary: never in a prompt)."""
    from transformers import Qwen3_5Config

    text = hybrid_text_config() if text is None else text
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=text["hidden_size"],
        num_position_embeddings=16,
    )
    cfg = Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=out_of_vocab,
        video_token_id=out_of_vocab + 1,
        vision_start_token_id=out_of_vocab + 2,
        vision_end_token_id=out_of_vocab + 3,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    return cfg


def attention_causal_lm():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=RMS_EPS,
        hidden_act="silu",
        rope_theta=1_000_000,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        attention_bias=False,
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    return Qwen3ForCausalLM(cfg)


def causal_lm(kind: str):
    if kind == "hybrid":
        return hybrid_causal_lm()
    if kind == "attention":
        return attention_causal_lm()
    raise ValueError(f"unknown target kind {kind!r}: hybrid or attention")


def save_target(kind: str, lm, out_dir: str) -> None:
    """The target in HF layout as vLLM loads it (bf16). The hybrid as Qwen3_5ForConditionalGeneration."""
    lm = lm.to(torch.bfloat16)
    if kind == "attention":
        lm.save_pretrained(out_dir, safe_serialization=True)
        return
    from transformers import Qwen3_5ForConditionalGeneration

    full = Qwen3_5ForConditionalGeneration(hybrid_checkpoint_config()).to(torch.bfloat16)
    state = {
        f"model.language_model.{k[len('model.') :]}": v for k, v in lm.state_dict().items() if k != "lm_head.weight"
    }
    state["lm_head.weight"] = lm.state_dict()["lm_head.weight"]
    missing, unexpected = full.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith("model.visual.") for k in missing):
        raise RuntimeError(f"the hybrid's weights do not map onto its checkpoint: {missing} {unexpected}")
    full.save_pretrained(out_dir, safe_serialization=True)


def load_target(kind: str, target_dir: str, dtype=torch.float32):
    """(language model, lm_head) of a saved target: ``lm(ids).last_hidden_state`` then ``head``."""
    if kind == "attention":
        from transformers import Qwen3ForCausalLM

        m = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=dtype)
        return m.model, m.lm_head, m
    from transformers import Qwen3_5ForConditionalGeneration

    m = Qwen3_5ForConditionalGeneration.from_pretrained(target_dir, dtype=dtype)
    return m.model.language_model, m.lm_head, m


def set_mask_embedding(embed: torch.Tensor, seed: int) -> None:
    """The mask token never appears in text, so training leaves its row as initialised (and weight
    decay would shrink it): give it a fixed random direction of a trained row's typical norm."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norms = embed[:MASK_TOKEN_ID].float().norm(dim=-1)
        v = torch.randn(embed.shape[1], generator=g).to(embed.device)
        embed[MASK_TOKEN_ID] = (v / v.norm() * norms.median()).to(embed.dtype)


# --------------------------------------------------------------------------- the drafter
@dataclass(frozen=True)
class DrafterShape:
    hidden: int = HIDDEN
    target_hidden: int = HIDDEN
    taps: int = 3
    layer_types: tuple[str, ...] = tuple(DRAFT_LAYER_TYPES)
    window: int = WINDOW
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    intermediate: int = INTERMEDIATE
    rope_theta: float = 10_000_000.0
    eps: float = RMS_EPS


class RMSNorm(nn.Module):
    """Qwen3's (and vLLM's) RMSNorm: x / rms(x) * weight, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding over the whole head (x: [..., tokens, heads, dim])."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    ang = positions.to(torch.float32)[..., None] * inv  # [..., tokens, dim/2]
    cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]
    x1, x2 = x[..., : dim // 2].float(), x[..., dim // 2 :].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DraftLayer(nn.Module):
    def __init__(self, s: DrafterShape, sliding: bool):
        super().__init__()
        self.s, self.sliding = s, sliding
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        attn = nn.Module()
        attn.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        attn.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        attn.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        attn.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        attn.q_norm = RMSNorm(s.head_dim, s.eps)
        attn.k_norm = RMSNorm(s.head_dim, s.eps)
        self.self_attn = attn
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        mlp.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        mlp.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)
        self.mlp = mlp

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of already-normed states x [..., T, hidden]."""
        s, a = self.s, self.self_attn
        k = a.k_norm(a.k_proj(x).unflatten(-1, (s.kv_heads, s.head_dim)))
        v = a.v_proj(x).unflatten(-1, (s.kv_heads, s.head_dim))
        return rope(k, positions, s.rope_theta), v

    def forward(self, x, q_pos, ctx_k, ctx_v, mask):
        """x [B, Q, hidden] block states; ctx_k/v [B, T, kv, hd]; mask [B or 1, Q, T + Q] (True: attend)."""
        s, a = self.s, self.self_attn
        h = self.input_layernorm(x)
        q = rope(a.q_norm(a.q_proj(h).unflatten(-1, (s.heads, s.head_dim))), q_pos, s.rope_theta)
        bk, bv = self.kv(h, q_pos)
        k = torch.cat([ctx_k, bk], dim=1).transpose(1, 2)
        v = torch.cat([ctx_v, bv], dim=1).transpose(1, 2)
        rep = s.heads // s.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None])
        x = x + a.o_proj(o.transpose(1, 2).flatten(-2))
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class Drafter(nn.Module):
    """The DFlash drafter; ``state_dict()`` keys are the published drafters' tensor names."""

    def __init__(self, s: DrafterShape):
        super().__init__()
        self.s = s
        self.fc = nn.Linear(s.taps * s.target_hidden, s.hidden, bias=False)
        self.hidden_norm = RMSNorm(s.hidden, s.eps)
        self.layers = nn.ModuleList(DraftLayer(s, t == "sliding_attention") for t in s.layer_types)
        self.norm = RMSNorm(s.hidden, s.eps)

    def forward(self, taps: torch.Tensor, anchors: torch.Tensor, block_embeds: torch.Tensor) -> torch.Tensor:
        """Final states of every block position.

        taps [B, T, taps x target_hidden]: the target's states at the tapped layers for positions 0..T-1;
        anchors [B, M]: each block's first position (its context is every position before it, so an
        anchor is at most T); block_embeds [B, M x BLOCK, hidden]: the embedded [anchor token, mask...].
        Returns [B, M x BLOCK, hidden] (the target's lm_head gives the logits).
        """
        B, T = taps.shape[:2]
        M = anchors.shape[1]
        dev = taps.device
        ctx = self.hidden_norm(self.fc(taps))
        ctx_pos = torch.arange(T, device=dev).expand(B, T)
        q_pos = (anchors[:, :, None] + torch.arange(BLOCK, device=dev)).reshape(B, M * BLOCK)
        masks = {sliding: block_mask(anchors, T, self.s.window if sliding else None) for sliding in (False, True)}
        x = block_embeds
        for layer in self.layers:
            ck, cv = layer.kv(ctx, ctx_pos)
            x = layer(x, q_pos, ck, cv, masks[layer.sliding])
        return self.norm(x)


def block_mask(anchors: torch.Tensor, T: int, window: int | None) -> torch.Tensor:
    """[B, M x BLOCK, T + M x BLOCK] True where a block token attends a key.

    Context key t: t < anchor (and, sliding, t > query position - window). Block keys: the query's own
    block only; all of it for a full layer, up to itself (causal, within the window) for a sliding one.
    """
    B, M = anchors.shape
    dev = anchors.device
    q_pos = (anchors[:, :, None] + torch.arange(BLOCK, device=dev)).reshape(B, M * BLOCK)
    t = torch.arange(T, device=dev)
    ctx = t[None, None, :] < anchors.repeat_interleave(BLOCK, dim=1)[:, :, None]
    blk_id = torch.arange(M, device=dev).repeat_interleave(BLOCK)
    same = blk_id[:, None] == blk_id[None, :]
    blk = same[None].expand(B, -1, -1)
    if window is not None:
        ctx = ctx & (t[None, None, :] > q_pos[:, :, None] - window)
        j = torch.arange(BLOCK, device=dev).repeat(M)
        blk = blk & (j[None, :, None] >= j[None, None, :]) & (window > j[None, :, None] - j[None, None, :])
    return torch.cat([ctx, blk], dim=2)


def drafter_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's tapped target layers, from the project's own drafter_config rule (one fact, one place)."""
    from ddtree.repo import module_util

    dflash_drafter = module_util("dflash_drafter")

    return dflash_drafter.target_layer_ids_rule(num_target_layers, num_draft_layers)


def tapped_states(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Layer id L is the OUTPUT of target layer L: HF's hidden_states[L + 1]."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def loss_weights(device) -> torch.Tensor:
    """Block positions 1..15 weighted exp(-(j - 1) / 7): the first drafts decide most acceptance."""
    j = torch.arange(1, BLOCK, device=device, dtype=torch.float32)
    return torch.exp(-(j - 1) / 7.0)


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


__all__ = ["BLOCK", "EOS", "MASK_TOKEN_ID", "VOCAB_SIZE"]
