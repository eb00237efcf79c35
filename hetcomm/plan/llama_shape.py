"""What a Llama-architecture decoder costs per sample — Llama, Mistral and Qwen2 as
Hugging Face transformers builds them (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM): pre-norm blocks with RMSNorm, grouped-query attention with rotary
positions (no position table), a SwiGLU MLP, and a head tied to the token embedding or not.

Sizes: h the width, L the layers, V the vocabulary, I the MLP's width, d a head's width,
n query heads and k key/value heads (k divides n), q = n·d and c = k·d the widths of
the query and of the keys (and values).

Parameters, exactly as the transformers model has them:
- per layer: q_proj h·q, k_proj and v_proj h·c each, o_proj q·h; gate_proj and up_proj
  h·I each, down_proj I·h; two RMSNorms, h each (a weight, no bias); biases where the
  family has them: Qwen2's on q, k and v (q + 2c), Llama's attention_bias on all four
  (q + 2c + h), Llama's mlp_bias (2I + h);
- outside: the token embedding V·h, the final RMSNorm h, and the head V·h unless tied
  (a tied head is the embedding's tensor: counted once, as model.parameters() does).

FLOPs of forward + backward per token: 6 per parameter that multiplies — every one
but an untied embedding table's (a tied table is also the head's weight) — plus
attention's score and value products, 12·L·q·seq (the PaLM paper's count, with q the
query width: under GQA each query head still scores every key).

Activation bytes per token, what autograd keeps for backward, derived from the code
and checked against autograd's saved tensors of tiny transformers models
(tests/test_plan_hf_config.py). The residual stream is fp32 in both precisions
(autocast leaves the embedding and the adds in fp32). Per layer:
- each RMSNorm (it computes in fp32): its input (4h, kept by the square), the
  normalised input before the weight (4h, kept by the weight's product) and the
  reciprocal RMS (4 bytes);
- in fp32, each norm's output once (4h), which its linear layers share; under autocast
  every linear layer casts it to 16-bit on its own and keeps the copy: 3 × 2h before
  q/k/v, 2 × 2h before gate/up;
- attention (SDPA, the fused kernels that never store the seq×seq scores, given GQA
  natively — enable_gqa, which transformers passes when there is no padding mask):
  the rotated query (the rotary product keeps only cos and sin, which do not need
  gradients) and key, the value, the output (also o_proj's input) and the fp32
  logsumexp per query head: (2q + 2c) elements and 4n bytes. Under autocast the rotated
  q and k come out in fp32 (cos and sin are fp32) and SDPA keeps its 16-bit casts;
- the SwiGLU MLP: gate_proj's output (kept by SiLU), SiLU's output and up_proj's output
  (kept by their product) and the product (down_proj's input): 4 tensors of I.
So per layer 24h + 8q + 8c + 16I + 4n + 8 bytes in fp32, and 26h + 4q + 4c + 8I + 4n
+ 8 under autocast. Outside the layers: the final norm (8h + 4), the head's input (4h
in fp32, its 2h copy under autocast), the token ids and labels (8 + 8 bytes, int64),
and the fp32 log-softmax (4 bytes per vocabulary entry: transformers' loss casts the
logits to fp32 first). cos and sin are kept once per micro-batch, not per sample
(2d floats per token), and are left out.

The peak in backward adds the fp32 gradients of the log-softmax and of the logits (8
bytes per vocabulary entry, as for GPT), and — an estimate of how the model is driven
rather than of what autograd keeps — the logits the model returns, in the head's dtype,
alive through backward when the caller holds the output (as the Trainer does). Not
modelled: eager attention (seq×seq scores) and a padding mask (then transformers
repeats K and V to the query's width before SDPA: 2(q − c) elements more per layer); a
sliding window (Mistral v0.1's 4096) is costed as full attention, an upper bound. Native
GQA runs in PyTorch's flash kernel only (sm_80 and later, 16-bit): on older cards and in
fp32 SDPA falls back to its math kernel, which stores the scores — a GQA model there
needs K and V repeated before SDPA to stay near this count (docs/planner.md).
"""

from dataclasses import dataclass

from hetcomm.plan.model_shape import LOG_SOFTMAX_BYTES, LOSS_GRADIENT_BYTES

FAMILIES = ("llama", "mistral", "qwen2")
TOKEN_ID_BYTES = 8 + 8   # int64 input ids (kept by the embedding) and labels (by the loss)
RSQRT_BYTES = 4          # one fp32 per token and norm
PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class LlamaShape:
    name: str
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    head_dim: int
    intermediate: int
    vocab_size: int
    tied: bool
    family: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_positions: int | None = None
    kind = "llama"
    head = "lm"

    def __post_init__(self):
        for field_name in ("n_layer", "n_head", "n_kv_head", "n_embd", "head_dim", "intermediate", "vocab_size"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {field_name} = {value!r}; expected a positive integer")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"model {self.name!r}: {self.n_kv_head} key/value heads do not divide "
                             f"{self.n_head} query heads")
        if self.family not in FAMILIES:
            raise ValueError(f"model {self.name!r}: family {self.family!r}; expected one of {', '.join(FAMILIES)}")

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_head * self.head_dim

    @property
    def max_seq(self) -> int | None:
        return self.max_positions

    def layer_parameters(self) -> int:
        h, q, c, inner = self.n_embd, self.q_width, self.kv_width, self.intermediate
        weights = h * q + 2 * h * c + q * h + 3 * h * inner + 2 * h
        biases = ((q + 2 * c) if self.qkv_bias else 0) + (h if self.o_bias else 0) \
            + ((2 * inner + h) if self.mlp_bias else 0)
        return weights + biases

    def parameters(self, seq: int = 0) -> int:
        """`seq` is ignored (rotary positions have no table); kept for the planner's
        common signature."""
        head = 0 if self.tied else self.vocab_size * self.n_embd
        return self.vocab_size * self.n_embd + self.n_layer * self.layer_parameters() + self.n_embd + head

    def parameter_tensors(self) -> int:
        """Per layer 2 norms and 7 linear weights, plus their biases; the embedding, the
        final norm and an untied head."""
        biases = (3 if self.qkv_bias else 0) + (1 if self.o_bias else 0) + (3 if self.mlp_bias else 0)
        return self.n_layer * (9 + biases) + 2 + (0 if self.tied else 1)

    def flops_per_sample(self, seq: int) -> float:
        lookup_only = 0 if self.tied else self.vocab_size * self.n_embd
        multiplying = self.parameters() - lookup_only
        return float((6 * multiplying + 12 * self.n_layer * self.q_width * seq) * seq)

    def _check(self, precision: str, attention: str, gelu: str) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"{self.name}: precision {precision!r}; expected one of {', '.join(PRECISIONS)} "
                             f"(apex's O2 is modelled for BERT only)")
        if attention != "fused":
            raise ValueError(f"{self.name}: --attention {attention}: only fused (SDPA) attention is modelled for "
                             f"{self.family} models")
        if gelu != "fused":
            raise ValueError(f"{self.name}: --gelu {gelu}: a {self.family} model has a SwiGLU MLP, no GELU")

    def layer_saved_bytes_per_token(self, precision: str) -> int:
        h, q, c, inner, n = self.n_embd, self.q_width, self.kv_width, self.intermediate, self.n_head
        if precision == "fp32":
            return 24 * h + 8 * q + 8 * c + 16 * inner + 4 * n + 2 * RSQRT_BYTES
        return 26 * h + 4 * q + 4 * c + 8 * inner + 4 * n + 2 * RSQRT_BYTES

    def outside_saved_bytes_per_token(self, precision: str) -> int:
        head_input = 4 if precision == "fp32" else 2
        return (8 + head_input) * self.n_embd + RSQRT_BYTES + TOKEN_ID_BYTES + LOG_SOFTMAX_BYTES * self.vocab_size

    def score_bytes_per_token(self, seq: int, precision: str) -> float:
        raise ValueError(f"{self.name}: only fused (SDPA) attention is modelled for {self.family} models")

    def saved_bytes_per_sample(self, seq: int, precision: str, attention: str = "fused",
                               gelu: str = "fused") -> float:
        """What autograd keeps from forward for backward."""
        self._check(precision, attention, gelu)
        per_token = self.n_layer * self.layer_saved_bytes_per_token(precision) \
            + self.outside_saved_bytes_per_token(precision)
        return float(per_token * seq)

    def activation_bytes_per_sample(self, seq: int, precision: str, attention: str = "fused",
                                    gelu: str = "fused") -> float:
        """The peak: what is kept, the loss's gradients and the returned logits."""
        logits = 4 if precision == "fp32" else 2
        return (self.saved_bytes_per_sample(seq, precision, attention, gelu)
                + float((LOSS_GRADIENT_BYTES + logits) * self.vocab_size * seq))

    def describe(self, seq: int) -> str:
        head = "tied" if self.tied else "untied"
        return (f"{self.name}: {self.family}, {self.parameters() / 1e6:.1f}M parameters, {self.n_layer} layers, "
                f"{self.n_head} heads ({self.n_kv_head} key/value), width {self.n_embd}, MLP {self.intermediate}, "
                f"vocabulary {self.vocab_size} ({head} head)")


# Meta's Llama-3.2 1B and 3B (examples/configs/llama-3.2-*.json): the family whose largest
# member `hetcomm plan --shard full` names beside GPT-2's and BERT's.
LLAMA_PRESETS = {shape.name: shape for shape in (
    LlamaShape("llama-3.2-1b", n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, head_dim=64, intermediate=8192,
               vocab_size=128256, tied=True, max_positions=131072),
    LlamaShape("llama-3.2-3b", n_layer=28, n_head=24, n_kv_head=8, n_embd=3072, head_dim=128, intermediate=8192,
               vocab_size=128256, tied=True, max_positions=131072),
)}
