"""A small Llama-style decoder, the architecture most users fine-tune and train: pre-norm
blocks with RMSNorm, grouped-query attention (fewer key/value heads than query heads)
with rotary position embeddings, a SwiGLU MLP, no biases, and a head tied to the token
embedding or not. The same interface as hetcomm.train.model.GPT (forward(tokens,
targets, reduction) -> (logits, loss), `checkpointing`, the blocks in `self.blocks`),
and the same computation as Hugging Face's LlamaForCausalLM of the equivalent
LlamaConfig: `hf_name` maps a parameter's name to that model's, and
tests/test_llama.py checks the two agree within rounding.

The rotary angles are computed in the model's forward (no buffer: a buffer would follow
the model to 16-bit) and passed to each block, whose forward uses only its own
parameters, as full sharding needs (hetcomm.shard.units).
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hetcomm.train.chunked_loss import head_and_loss

INTERMEDIATE_MULTIPLE = 64


def default_intermediate(n_embd: int) -> int:
    """Llama's MLP width for a model of width n_embd: two thirds of GPT's 4·n_embd (the
    SwiGLU MLP has three matrices where GPT's has two: the same parameters), rounded up
    to a multiple of 64 (Meta's code rounds to `multiple_of`, 256 and more for its large
    models; 64 keeps a small model small)."""
    return INTERMEDIATE_MULTIPLE * math.ceil(8 * n_embd / 3 / INTERMEDIATE_MULTIPLE)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    block_size: int = 128          # the longest sequence (rotary positions have no table)
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int | None = None   # None: n_head (plain multi-head attention)
    n_embd: int = 128
    intermediate: int | None = None   # None: default_intermediate(n_embd)
    head_dim: int | None = None    # None: n_embd // n_head
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dropout: float = 0.0           # on the attention probabilities (transformers' attention_dropout)

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be at least 1; got {getattr(self, name)}")
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.intermediate is None:
            object.__setattr__(self, "intermediate", default_intermediate(self.n_embd))
        if self.head_dim is None:
            if self.n_embd % self.n_head:
                raise ValueError(f"LlamaConfig.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head}) "
                                 f"(or give head_dim)")
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        for name in ("n_kv_head", "intermediate", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be at least 1; got {getattr(self, name)}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig.n_head ({self.n_head}) must be a multiple of n_kv_head "
                             f"({self.n_kv_head}): each key/value head serves a group of query heads")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim ({self.head_dim}) must be even: rotary embeddings rotate "
                             f"pairs of channels")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError("LlamaConfig.rope_theta and rms_norm_eps must be positive")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LlamaConfig.dropout must be in [0, 1); got {self.dropout}")

    def to_dict(self) -> dict:
        return asdict(self)

    def shape(self, name: str = "llama"):
        """The planner's LlamaShape of this model (hetcomm.plan.llama_shape)."""
        from hetcomm.plan.llama_shape import LlamaShape

        return LlamaShape(name, n_layer=self.n_layer, n_head=self.n_head, n_kv_head=self.n_kv_head,
                          n_embd=self.n_embd, head_dim=self.head_dim, intermediate=self.intermediate,
                          vocab_size=self.vocab_size, tied=self.tie_embeddings, max_positions=self.block_size)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight, computed in fp32 whatever the input's dtype."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_angles(head_dim: int, time: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (time, head_dim) of the rotary embedding, fp32: channel pair (i,
    i + head_dim/2) of position t turns by t · theta^(-2i/head_dim)."""
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim)
    angles = torch.outer(torch.arange(time, device=device, dtype=torch.float32), inverse)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """Each channel pair (x1, x2), the two halves of the head, turned: (x1 cos - x2 sin,
    x2 cos + x1 sin)."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


def native_gqa(q: torch.Tensor) -> bool:
    """Whether SDPA is given the fewer key/value heads as they are (enable_gqa): only in
    16-bit on sm_80 and later, where its flash kernel runs them natively. Elsewhere
    (CPUs, older cards, fp32) SDPA would fall back to its math kernel, which stores the
    seq×seq scores: there the keys and values are repeated to the query's heads first."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.q = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.k = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.v = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.o = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)
        self.dropout = config.dropout

    def forward(self, x, cos, sin):
        batch, time, _ = x.shape
        q = self.q(x).view(batch, time, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, time, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, time, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        options = {}
        if self.n_kv_head != self.n_head:
            if native_gqa(q):
                options["enable_gqa"] = True
            else:   # query head h reads key/value head h // group
                group = self.n_head // self.n_kv_head
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0, **options)
        return self.o(y.transpose(1, 2).reshape(batch, time, self.n_head * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(config.n_embd, config.intermediate, bias=False)
        self.up = nn.Linear(config.n_embd, config.intermediate, bias=False)
        self.down = nn.Linear(config.intermediate, config.n_embd, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.wte.weight
        self.checkpointing = False   # per block and over the loss's chunks, as GPT's
        self.loss_chunk_tokens = None
        # transformers' initialisation (initializer_range 0.02; the norms' weights one)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens, targets=None, reduction: str = "mean"):
        """Logits, and the cross-entropy against `targets` when given (as GPT's)."""
        time = tokens.shape[1]
        if time > self.config.block_size:
            raise ValueError(f"sequence of {time} tokens is longer than block_size={self.config.block_size}")
        x = self.wte(tokens)
        cos, sin = rotary_angles(self.config.head_dim, time, self.config.rope_theta, tokens.device)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return head_and_loss(self.norm(x), self.head, targets, reduction, self.checkpointing, self.loss_chunk_tokens)


# --- Hugging Face transformers' LlamaForCausalLM -----------------------------------------

_HF_BLOCK_NAMES = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
                   "attn.q.weight": "self_attn.q_proj.weight", "attn.k.weight": "self_attn.k_proj.weight",
                   "attn.v.weight": "self_attn.v_proj.weight", "attn.o.weight": "self_attn.o_proj.weight",
                   "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
                   "mlp.down.weight": "mlp.down_proj.weight"}
_HF_NAMES = {"wte.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}


def hf_name(name: str) -> str:
    """The name in LlamaForCausalLM's state dict of this model's parameter `name`."""
    if name in _HF_NAMES:
        return _HF_NAMES[name]
    prefix, layer, rest = name.split(".", 2)
    if prefix != "blocks" or rest not in _HF_BLOCK_NAMES:
        raise KeyError(f"{name}: no such parameter of hetcomm.train.llama.Llama")
    return f"model.layers.{layer}.{_HF_BLOCK_NAMES[rest]}"


def hf_config_kwargs(config: LlamaConfig) -> dict:
    """transformers.LlamaConfig's arguments for the same model."""
    return dict(model_type="llama", vocab_size=config.vocab_size, hidden_size=config.n_embd,
                intermediate_size=config.intermediate, num_hidden_layers=config.n_layer,
                num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head, head_dim=config.head_dim,
                max_position_embeddings=config.block_size, rms_norm_eps=config.rms_norm_eps,
                rope_theta=config.rope_theta, tie_word_embeddings=config.tie_embeddings,
                attention_dropout=config.dropout, attention_bias=False, mlp_bias=False, hidden_act="silu")


def load_hf_state_dict(model: Llama, state: dict) -> None:
    """Copies a LlamaForCausalLM state dict's weights into `model` (shapes checked)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            source = state[hf_name(name)]
            if source.shape != p.shape:
                raise ValueError(f"{name}: {tuple(p.shape)} here, {tuple(source.shape)} as {hf_name(name)}")
            p.copy_(source)
