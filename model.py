"""One readable Llama over a packed token stream.

There is no batch dimension anywhere: a batch is T tokens of many sequences laid end to end (a sequence is a
document, or a piece of one: data/loader.py cuts documents longer than max_seq_len), with `cu_seqlens` marking where
each sequence starts and ends and `positions` giving each token's position inside its own sequence. Attention is
causal inside a sequence and blind across sequences, so packing changes nothing about what a sequence sees: running
it alone or packed with others gives the same loss (tests/test_model.py).

    max_seq_len   the cap: no sequence is longer (LlamaConfig; the RoPE tables cover it)
    cu_seqlens    (n_seqs + 1,) int32: sequence s is tokens[cu_seqlens[s]:cu_seqlens[s + 1]]
    max_seqlen    the longest sequence of this batch, a host int (the attention kernels size their grids with it)
    positions     (T,) int32: each token's position inside its sequence, 0 at its first token

Every hot op comes from `kernels` (Triton on CUDA, plain torch on the CPU). Module names follow Hugging Face's
LlamaForCausalLM (q_proj, gate_proj, input_layernorm, ...), so a converted HF state dict loads by name; two config
switches make the same model Qwen2 (q/k/v biases: q_proj.bias ...) or Qwen3 (per-head q/k norms: self_attn.q_norm).
"""
import math
from dataclasses import asdict, dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import kernels
from kernels.common import ACTIVATIONS, FP8_ALIGN, mm_fp32


@dataclass
class LlamaConfig:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: Optional[int] = None  # None: dim // n_heads
    ffn_dim: int = 768
    vocab_size: int = 512
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Optional[dict] = None  # llama3: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    tie_embeddings: bool = False
    activation: str = "silu"  # "silu" -> SwiGLU, "gelu_tanh" -> GeGLU
    max_seq_len: int = 2048  # longest document the RoPE cache covers
    # Two switches for the Llama family beyond Llama-3 (off: Llama, SmolLM2). HF names: convert.py.
    qkv_bias: bool = False  # Qwen2: q_proj, k_proj, v_proj add a bias (o_proj none)
    qk_norm: bool = False  # Qwen3: RMSNorm of every query and key head vector (weight (head_dim,)) before RoPE

    def __post_init__(self):
        self._check_types()
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}: expected one of {ACTIVATIONS}")

    def _check_types(self):
        """Each field of its type, sizes positive, before anything is sized by them (a config.json from anywhere:
        a string dim or a billion-token max_seq_len is a ValueError here, not a crash or a huge RoPE table)."""
        def positive(name, value, number=False, limit=1 << 21):
            is_kind = isinstance(value, (int, float) if number else int) and not isinstance(value, bool)
            if not is_kind or not 0 < value <= limit:  # (NaN fails the comparison)
                raise ValueError(f"{name}={value!r}: expected a positive {'number' if number else 'int'} <= {limit:g}")
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            positive(name, getattr(self, name))
        if self.head_dim is not None:
            positive("head_dim", self.head_dim)
        positive("norm_eps", self.norm_eps, number=True, limit=1.0)
        positive("rope_theta", self.rope_theta, number=True, limit=1e12)
        for name in ("tie_embeddings", "qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected true or false")
        scaling = self.rope_scaling
        if scaling is not None and not (isinstance(scaling, dict) and all(
                isinstance(scaling.get(key), (int, float)) and not isinstance(scaling.get(key), bool)
                and scaling[key] > 0 for key in LLAMA3_ROPE_KEYS)):
            raise ValueError(f"rope_scaling={scaling!r}: expected positive numbers {', '.join(LLAMA3_ROPE_KEYS)}")

    def to_dict(self):
        return asdict(self)


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_LLAMA3_ROPE_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

# Shapes of released models (weights come from HF via convert.py).
PRESETS = {
    "llama3_8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                      rope_theta=500000.0, max_seq_len=8192),
    "llama3_1_8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                        rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_SCALING, max_seq_len=131072),
    "llama3_2_1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192, vocab_size=128256,
                        rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE_SCALING, factor=32.0),
                        tie_embeddings=True, max_seq_len=131072),
    "llama3_2_3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, head_dim=128, ffn_dim=8192, vocab_size=128256,
                        rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE_SCALING, factor=32.0),
                        tie_embeddings=True, max_seq_len=131072),
    # SmolLM2 (HuggingFaceTB): Llama architecture, GQA, tied embeddings, a 49,152-token byte-level BPE
    "smollm2_135m": dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536, vocab_size=49152,
                         rope_theta=100000.0, tie_embeddings=True, max_seq_len=8192),
    "smollm2_360m": dict(dim=960, n_layers=32, n_heads=15, n_kv_heads=5, ffn_dim=2560, vocab_size=49152,
                         rope_theta=100000.0, tie_embeddings=True, max_seq_len=8192),
    "smollm2_1_7b": dict(dim=2048, n_layers=24, n_heads=32, n_kv_heads=32, ffn_dim=8192, vocab_size=49152,
                         rope_theta=130000.0, tie_embeddings=True, max_seq_len=8192),
    # Qwen2.5 (q/k/v biases) and Qwen3 (q/k norms, head_dim 128 whatever dim / n_heads is); vocab padded to 151,936
    "qwen2_5_0_5b": dict(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, vocab_size=151936,
                         norm_eps=1e-6, rope_theta=1000000.0, tie_embeddings=True, max_seq_len=32768, qkv_bias=True),
    "qwen3_0_6b": dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
                       vocab_size=151936, norm_eps=1e-6, rope_theta=1000000.0, tie_embeddings=True, max_seq_len=40960,
                       qk_norm=True),
    "qwen3_8b": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=12288, vocab_size=151936,
                     norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, qk_norm=True),
}


def positions_from_cu_seqlens(cu_seqlens, total):
    """Position of every token inside its own sequence: t - start(seq(t)), as int32."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
    return (torch.arange(total, device=cu_seqlens.device, dtype=torch.int32) - starts).to(torch.int32)


class Packing(NamedTuple):
    """What every block needs besides its input: where the packed sequences lie (module docstring), and the RoPE
    tables (max_seq_len, head_dim / 2) that the positions index."""
    cu_seqlens: torch.Tensor
    max_seqlen: int
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class MasterLinears(torch.autograd.Function):
    """[x @ W_i^T + b_i] for Linears with fp32 master weights under autocast (train.py's default), in one Function:
    x and each W_i cast to bf16 once, products in bf16 as F.linear there, the same output bits. Backward, every sum
    in fp32 inside the GEMMs (kernels.common.mm_fp32), where autocast rounds each product to bf16, casts it back
    and adds in fp32 (a pass over memory per cast and per add):
        dx   = sum_i dy_i W_i = [dy_1 ... dy_n] [W_1; ...; W_n]       dW_i = dy_i^T x       db_i = sum_t dy_i
    dx is one product over the dy_i side by side (K = sum N_i) where copying them together moves fewer bytes than
    adding product after product into the fp32 dx (2 T sum N_i bf16 written and read, against 8 T K per add:
    q/k/v), else a chain of products, each added to the last in the GEMM's epilogue, last Linear first (gate/up).
    params: W_0, b_0, W_1, b_1, ... (b_i None: no bias)."""

    @staticmethod
    def forward(ctx, x, dtype, *params):
        x_mm = x.reshape(-1, x.shape[-1]).to(dtype)
        widths = [w.shape[0] for w in params[0::2]]
        w_all = torch.empty(sum(widths), x.shape[-1], dtype=dtype, device=x.device)  # [W_1; ...; W_n] in bf16
        weights = w_all.split(widths)
        for w_mm, w in zip(weights, params[0::2]):
            w_mm.copy_(w)  # the cast, written into its rows
        ys = [x_mm @ w.T if b is None else torch.addmm(b.to(dtype), x_mm, w.T)
              for w, b in zip(weights, params[1::2])]
        ctx.save_for_backward(x_mm, w_all)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return tuple(y.view(*x.shape[:-1], y.shape[-1]) for y in ys)

    @staticmethod
    def backward(ctx, *grads):
        x_mm, w_all = ctx.saved_tensors
        dys = [g.reshape(-1, g.shape[-1]) for g in grads]
        dx = None
        if ctx.needs_input_grad[0]:
            n, K, widths = len(dys), w_all.shape[1], [dy.shape[1] for dy in dys]
            if n == 1 or sum(widths) < 2 * (n - 1) * K:  # one product (the docstring's byte count)
                dy = dys[0] if n == 1 else torch.cat(dys, 1)
                dx = mm_fp32(dy, w_all) if ctx.x_dtype == torch.float32 else dy @ w_all  # (bf16 x: o_proj's)
            else:
                for dy, w in zip(reversed(dys), reversed(w_all.split(widths))):
                    dx = mm_fp32(dy, w, dx)
            dx = dx.to(ctx.x_dtype).view(ctx.x_shape)
        dparams = []
        for i, dy in enumerate(dys):
            need_w, need_b = ctx.needs_input_grad[2 + 2 * i], ctx.needs_input_grad[3 + 2 * i]
            dparams += [mm_fp32(dy.T, x_mm) if need_w else None,
                        dy.sum(0, dtype=torch.float32) if need_b else None]
        return dx, None, *dparams


def linears(x, projs, fp8):
    """[proj(x) for proj in projs]; with fp8 the same products in FP8 e4m3, x quantized once for all (kernels.
    fp8_linears: bf16 values), plus each proj's bias if any. In FP8 the projs themselves are not called: forward
    hooks on them would not run, so they are refused. fp32 weights under autocast run MasterLinears (hooked projs
    are called as modules there)."""
    hooked = any(proj._forward_hooks or proj._forward_pre_hooks for proj in projs)
    if not fp8:
        device = x.device.type
        if (not hooked and torch.is_autocast_enabled(device)
                and all(proj.weight.dtype == torch.float32 for proj in projs)):
            params = [t for proj in projs for t in (proj.weight, proj.bias)]
            return list(MasterLinears.apply(x, torch.get_autocast_dtype(device), *params))
        return [proj(x) for proj in projs]
    if hooked:
        raise RuntimeError("fp8: the block Linears run kernels.fp8_linears, not their modules: hooks would not run")
    ys = kernels.fp8_linears(x, [proj.weight for proj in projs])
    return [y if proj.bias is None else y + proj.bias.to(y.dtype) for y, proj in zip(ys, projs)]


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return kernels.rms_norm(x, self.weight, self.eps)

    def add(self, x, delta):
        """(h, y): the residual stream h = x + delta and its norm y = self(h), in one kernel (kernels.add_rms_norm).
        delta None (the first block's input, the embeddings): h is x."""
        if delta is None:
            return x, self(x)
        return kernels.add_rms_norm(x, delta, self.weight, self.eps)


class Attention(nn.Module):
    fp8 = False  # Llama.set_fp8: q/k/v/o in FP8

    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        if cfg.qkv_bias:  # a new model starts with no bias (Qwen2's init); converted weights replace them
            for proj in (self.q_proj, self.k_proj, self.v_proj):
                nn.init.zeros_(proj.bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # one weight per head dim, shared by all heads (HF Qwen3's q_norm / k_norm)
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def qkv(self, x, cos, sin, positions):
        """Project (+ bias), normalise each head (qk_norm), rotate: q (T, Hq, D), k and v (T, Hkv, D).

        With qk_norm, q = rope(rms_norm(q_proj(x) viewed (T, Hq, D)) * q_norm.weight), likewise k, as HF Qwen3: the
        RMSNorm kernel sees (T * H, D) rows. Its output is a fresh tensor that its backward does not save, so RoPE
        may rotate it in place (kernels/__init__.py's contract), as it otherwise rotates the projection's output.
        """
        T = x.shape[0]
        q, k, v = linears(x, (self.q_proj, self.k_proj, self.v_proj), self.fp8)
        q = q.view(T, self.n_heads, self.head_dim)
        k, v = k.view(T, self.n_kv_heads, self.head_dim), v.view(T, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = kernels.apply_rope(q, k, cos, sin, positions)
        return q, k, v

    def forward(self, x, packing, cache=None):
        """Attention over the packed sequences; with `cache` (generation: one sequence) over its KV cache instead."""
        q, k, v = self.qkv(x, packing.cos, packing.sin, packing.positions)
        if cache is None:
            out = kernels.varlen_attention(q, k, v, packing.cu_seqlens, packing.max_seqlen,
                                           1.0 / math.sqrt(self.head_dim))
        else:
            out = cached_attention(q, k, v, *cache)
        return linears(out.reshape(x.shape[0], -1), (self.o_proj,), self.fp8)[0]


def cached_attention(q, k, v, k_cache, v_cache, start_pos):
    """Causal attention of n new tokens of one sequence, at positions start_pos .. start_pos + n - 1, over all its
    tokens so far: k and v are written into the caches (max_len, Hkv, D) first, then query i sees keys 0 ..
    start_pos + i. Plain torch (sample.py's path): one sequence needs no packing."""
    end = start_pos + q.shape[0]
    k_cache[start_pos:end], v_cache[start_pos:end] = k, v
    group = q.shape[1] // k.shape[1]
    keys = k_cache[:end].repeat_interleave(group, dim=1).transpose(0, 1)  # (Hq, end, D)
    values = v_cache[:end].repeat_interleave(group, dim=1).transpose(0, 1)
    mask = torch.arange(end, device=q.device)[None, :] <= torch.arange(start_pos, end, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask).transpose(0, 1)


class MLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), act = silu (SwiGLU) or tanh-GELU (GeGLU).

    down_proj is a weight holder, never called: kernels.glu takes its weight and fuses the down projection (so that
    backward rebuilds act(g) * u instead of keeping it). Hooks on down_proj would never run: forward refuses them.
    """
    fp8 = False  # Llama.set_fp8: gate, up and down in FP8

    def __init__(self, cfg):
        super().__init__()
        self.activation = cfg.activation
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # FUSED into kernels.glu: never called

    def forward(self, x):
        if self.down_proj._forward_hooks or self.down_proj._forward_pre_hooks:
            raise RuntimeError("MLP.down_proj is fused into kernels.glu and never called: its hooks would not run")
        gate, up = linears(x, (self.gate_proj, self.up_proj), self.fp8)
        return kernels.glu(gate, up, self.activation, down=self.down_proj.weight, fp8=self.fp8)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, delta, packing, cache=None):
        """x = x + attn(norm1(x)); x = x + mlp(norm2(x)), with the residual stream passed as a sum not yet done:
        in (x, delta) and out (x, mlp's output), the stream being x + delta (delta None: x). Each add is fused into
        the norm that reads its result (RMSNorm.add): this block's two, the next block's or the final norm.
        cache: generation's (k_cache, v_cache, start_pos) of this block (Attention.forward)."""
        x, y = self.input_layernorm.add(x, delta)
        x, y = self.post_attention_layernorm.add(x, self.self_attn(y, packing, cache))
        return x, self.mlp(y)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Activation checkpointing, a training setting (train.py's checkpoint_layers): the first n blocks keep only
        # their input for backward and run their forward again to rebuild the rest: one more forward of n blocks,
        # about n/n_layers x 1/3 more compute, for all but one (T, dim) tensor of each block's activations. Their
        # input is the residual stream summed (not fused into their first norm: the pair (x, delta) would hold twice).
        self.checkpoint_layers = 0
        self.fp8 = False  # set_fp8: the lm_head's gradient products in FP8
        self.register_buffer("rope_cos", None, persistent=False)  # fp32 always: see _apply below
        self.register_buffer("rope_sin", None, persistent=False)
        self.build_rope_cache(self.embed_tokens.weight.device)  # where the weights are made (a torch.device context)
        self.apply(self._init_weights)
        for layer in self.layers:  # residual projections scaled by depth (GPT-2 / nanoGPT)
            for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                nn.init.normal_(w, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    def set_fp8(self, on=True):
        """Run the Linears of every block (q/k/v/o, gate/up, down) in FP8 e4m3 (kernels/fp8.py), or (False) as
        before. A training setting (train.py's fp8), not part of the model: checkpoints don't record it. The
        lm_head's logits stay a bf16 product in the fused cross-entropy; its two gradient products run in FP8 too
        (where vocab_size is a multiple of 16). _scaled_mm needs every weight dimension a multiple of 16."""
        cfg = self.cfg
        if on:
            dims = dict(dim=cfg.dim, ffn_dim=cfg.ffn_dim, q_dim=cfg.n_heads * cfg.head_dim,
                        kv_dim=cfg.n_kv_heads * cfg.head_dim)
            if odd := [f"{k}={v}" for k, v in dims.items() if v % FP8_ALIGN]:
                raise ValueError(f"fp8: {', '.join(odd)} not a multiple of {FP8_ALIGN}, as torch._scaled_mm needs")
        for layer in self.layers:
            layer.self_attn.fp8 = layer.mlp.fp8 = on
        self.fp8 = on

    def build_rope_cache(self, device=None):
        """cos/sin tables (max_seq_len, head_dim / 2), fp32, computed (not loaded: they are not in checkpoints).
        Always on the CPU, then moved: a GPU's cos and sin round differently, and a model built on the GPU would
        then not compute what the same model loaded from a checkpoint does (a resumed run would drift)."""
        cfg = self.cfg
        with torch.device("cpu"):
            cos, sin = kernels.rope_cache(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) must not round the RoPE tables: they stay fp32 and only follow the device.
        cos, sin = self.rope_cos, self.rope_sin
        super()._apply(fn, recurse)
        self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)
        return self

    def num_params(self, exclude_embedding=True):
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding and not self.cfg.tie_embeddings:
            n -= self.embed_tokens.weight.numel()
        return n

    def matmul_params(self):
        """Parameters that take part in a matrix product per token: every Linear, lm_head included."""
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))

    def estimate_flops(self, seqlens):
        """Training FLOPs (forward + backward) of one batch of sequences of these lengths:
        6 * P_matmul * T for the weights, plus 6 * n_layers * (n_heads * head_dim) * sum(len^2) for causal
        attention (QK^T and PV are 2 * 2 * len^2 * d each forward at full, half of it under the causal mask, x3)."""
        lengths = torch.as_tensor(seqlens, dtype=torch.float64)
        attn_dim = self.cfg.n_heads * self.cfg.head_dim
        return 6 * self.matmul_params() * lengths.sum().item() + 6 * self.cfg.n_layers * attn_dim * (lengths**2).sum().item()

    def hidden_states(self, tokens, cu_seqlens, max_seqlen=None, positions=None):
        """Final normalised hidden states (T, dim) of a packed stream. A data.loader.Batch carries max_seqlen and
        positions (made on the host: no device sync); without them they are derived here from cu_seqlens."""
        T = tokens.shape[0]
        if positions is None:
            positions = positions_from_cu_seqlens(cu_seqlens, T)
        if max_seqlen is None:  # a host sync
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        if max_seqlen > self.cfg.max_seq_len:
            raise ValueError(f"a sequence of {max_seqlen} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
        packing = Packing(cu_seqlens, max_seqlen, positions, self.rope_cos, self.rope_sin)
        x, delta = self.embed_tokens(tokens), None  # the residual stream is x + delta (Block.forward)
        for i, layer in enumerate(self.layers):
            if i < self.checkpoint_layers and torch.is_grad_enabled():
                if delta is not None:  # the sum made here, so the block keeps one tensor, not two, for backward
                    x, delta = x + delta, None
                x, delta = checkpoint(layer, x, delta, packing, use_reentrant=False)
            else:
                x, delta = layer(x, delta, packing)
        return self.norm.add(x, delta)[1]

    def forward(self, tokens, cu_seqlens, max_seqlen=None, positions=None, labels=None, reduction="mean"):
        """Without labels: logits (T, vocab). With labels (T,), -100 = ignore: the mean loss, or with
        reduction="sum" the pair (summed loss, number of counted tokens) so a caller can normalise by the token
        count of a whole optimizer step. The fused loss never materialises the (T, vocab) logits on CUDA."""
        h = self.hidden_states(tokens, cu_seqlens, max_seqlen, positions)
        if labels is None:
            return self.lm_head(h)
        loss_sum, n_valid = kernels.linear_cross_entropy(h, self.lm_head.weight, labels, fp8_grads=self.fp8)
        if reduction == "sum":
            return loss_sum, n_valid
        return loss_sum / n_valid.clamp_min(1)

    # ---- generation (sample.py): one sequence, a KV cache, plain torch attention ----

    @torch.no_grad()
    def decode(self, tokens, cache, start_pos):
        """Logits of the last of `tokens` (n,), a continuation of one sequence whose first `start_pos` tokens
        are already in `cache` (a list of [k, v] of shape (max_len, Hkv, D) per layer, see new_cache)."""
        n = tokens.shape[0]
        positions = torch.arange(start_pos, start_pos + n, device=tokens.device, dtype=torch.int32)
        packing = Packing(None, n, positions, self.rope_cos, self.rope_sin)
        x, delta = self.embed_tokens(tokens), None
        for layer, (k_cache, v_cache) in zip(self.layers, cache):
            x, delta = layer(x, delta, packing, (k_cache, v_cache, start_pos))
        return self.lm_head(self.norm.add(x[-1:], delta[-1:])[1])[0]

    def new_cache(self, max_len):
        shape = (max_len, self.cfg.n_kv_heads, self.cfg.head_dim)
        w = self.embed_tokens.weight
        return [[w.new_zeros(shape), w.new_zeros(shape)] for _ in self.layers]
