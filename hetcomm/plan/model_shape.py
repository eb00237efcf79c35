"""What a GPT-style model costs per sample: parameters, floating-point operations and
activation memory, for the model hetcomm.train builds (pre-norm blocks, tied
embeddings, a GELU MLP of width 4h, scaled-dot-product attention).

The counts are per sample of `seq` tokens:
- parameters: V·h (tied token embedding and head) + seq·h (positions)
  + L·(12h² + 13h) + 2h (final norm);
- FLOPs of forward + backward: 6 per parameter that multiplies (every parameter but
  the position table) per token, plus attention's score and value products,
  12·L·h·seq per token (the PaLM paper's count);
- activation bytes, per token: what autograd keeps for backward — per layer 38h under
  autocast (fp32 residual stream and norm inputs, 16-bit copies of matmul inputs, q/k/v
  and the attention output, the 4h-wide MLP activations) or 68h in fp32, attention
  kernels that never store the seq×seq score matrix being assumed (PyTorch's SDPA
  picks one on every GPU from sm_50); for the head, the fp32 log-softmax (4 bytes per
  vocabulary entry) and its inputs (6h or 8h) — plus, at the peak in backward, the
  fp32 gradients of the log-softmax and of the logits (8 bytes per vocabulary entry).
  tests/test_plan_model.py checks the kept part against autograd's saved tensors.
"""

import re
from dataclasses import dataclass

LAYER_ACTIVATION_BYTES = {"fp32": 68, "fp16": 38, "bf16": 38}   # × h per token per layer
HEAD_INPUT_BYTES = {"fp32": 8, "fp16": 6, "bf16": 6}             # × h per token
LOG_SOFTMAX_BYTES, LOSS_GRADIENT_BYTES = 4, 8                    # × vocabulary per token


@dataclass(frozen=True)
class ModelShape:
    name: str
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int

    def __post_init__(self):
        for field_name in ("n_layer", "n_head", "n_embd", "vocab_size"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {field_name} = {value!r}; expected a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(f"model {self.name!r}: dim = {self.n_embd} is not a multiple of heads = {self.n_head}")

    def parameters(self, seq: int) -> int:
        h = self.n_embd
        return self.vocab_size * h + seq * h + self.n_layer * (12 * h * h + 13 * h) + 2 * h

    def flops_per_sample(self, seq: int) -> float:
        multiplying = self.parameters(seq) - seq * self.n_embd
        per_token = 6 * multiplying + 12 * self.n_layer * self.n_embd * seq
        return float(per_token * seq)

    def saved_bytes_per_sample(self, seq: int, precision: str) -> float:
        """What autograd keeps from forward for backward."""
        h = self.n_embd
        per_token = (self.n_layer * LAYER_ACTIVATION_BYTES[precision] * h + HEAD_INPUT_BYTES[precision] * h
                     + LOG_SOFTMAX_BYTES * self.vocab_size)
        return float(per_token * seq)

    def activation_bytes_per_sample(self, seq: int, precision: str) -> float:
        """The peak: what is kept, plus the loss's gradients at the start of backward."""
        return self.saved_bytes_per_sample(seq, precision) + float(LOSS_GRADIENT_BYTES * self.vocab_size * seq)

    def describe(self, seq: int) -> str:
        return (f"{self.name}: {self.parameters(seq) / 1e6:.1f}M parameters, {self.n_layer} layers, "
                f"{self.n_head} heads, width {self.n_embd}, vocabulary {self.vocab_size}")


# GPT-2's sizes (vocabulary 50257), and the model `hetcomm train` builds by default (bytes).
PRESETS = {shape.name: shape for shape in (
    ModelShape("gpt2-124m", 12, 12, 768, 50257),
    ModelShape("gpt2-355m", 24, 16, 1024, 50257),
    ModelShape("gpt2-774m", 36, 20, 1280, 50257),
    ModelShape("gpt2-1.5b", 48, 25, 1600, 50257),
    ModelShape("hetcomm-default", 2, 4, 192, 256),
)}

_CUSTOM_KEYS = {"layers": "n_layer", "heads": "n_head", "dim": "n_embd", "vocab": "vocab_size"}


def parse_model(text: str) -> ModelShape:
    """A preset name, or "layers=12,heads=12,dim=768[,vocab=50257]"."""
    key = text.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    if "=" not in key:
        raise ValueError(f"--model {text!r}: unknown model; expected one of {', '.join(PRESETS)}, or "
                         f"layers=L,heads=H,dim=D[,vocab=V]")
    fields = {"vocab_size": 50257}
    for part in key.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in _CUSTOM_KEYS or not re.fullmatch(r"\s*\d+\s*", value):
            raise ValueError(f"--model {text!r}: {part.strip()!r} is not one of layers=, heads=, dim=, vocab= "
                             f"with a positive integer")
        fields[_CUSTOM_KEYS[name]] = int(value)
    missing = [k for k, v in _CUSTOM_KEYS.items() if v not in fields]
    if missing:
        raise ValueError(f"--model {text!r}: missing {', '.join(k + '=' for k in missing)}")
    return ModelShape(name=key, **fields)
