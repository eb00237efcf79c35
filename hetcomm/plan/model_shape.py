"""What a transformer costs per sample: parameters, floating-point operations and
activation memory, for the GPT model hetcomm.train builds (pre-norm blocks, tied
embeddings, a GELU MLP of width 4h, scaled-dot-product attention) and for BERT
(post-norm blocks of the same size, token-type embeddings, learned positions for 512
tokens, and a task head: "mlm", pre-training's masked-LM head on MLM_FRACTION of the
tokens plus next-sentence prediction, or "qa", SQuAD's two-logit span head).

The counts are per sample of `seq` tokens:
- parameters: V·h (tied token embedding and head) + seq·h (positions; a Hugging Face
  GPT-2's table has n_positions rows whatever the sequence)
  + L·(12h² + 13h) + 2h (final norm);
- FLOPs of forward + backward: 6 per parameter that multiplies (every parameter but
  the position table) per token, plus attention's score and value products,
  12·L·h·seq per token (the PaLM paper's count);
- activation bytes, per token: what autograd keeps for backward — per layer, for the
  GPT model, 38h under autocast (fp32 residual stream and norm inputs, 16-bit copies of
  matmul inputs, q/k/v and the attention output, the 4h-wide MLP activations) or 68h in
  fp32; for BERT (post-norm, three dropouts per layer, each keeping a 1-byte mask) 42h
  under autocast or 66h in fp32 — attention kernels that never store the seq×seq score
  matrix being assumed (PyTorch's SDPA picks one on every GPU from sm_50); outside the
  layers, the embeddings' and head's inputs (GPT 6h or 8h, BERT 7h or 9h) and for a
  vocabulary-wide head the fp32 log-softmax (4 bytes per vocabulary entry) — plus, at the
  peak in backward, the fp32 gradients of the log-softmax and of the logits (8 bytes per
  vocabulary entry). tests/test_plan_model.py checks the GPT counts against autograd's
  saved tensors; tests/test_plan_memory.py the BERT ones against a transformers
  BertForQuestionAnswering (hetcomm.plan.saved_bytes; benchmarks/bench_bert_memory.py at
  full size: within 0.2%).
  With attention="eager" (code that computes softmax(QKᵀ)V as separate kernels, as all
  BERT-era code does, HetSeq's included), each layer also keeps the seq×seq scores per
  head: the softmax output, in fp32 (autocast runs softmax in fp32), the 16-bit copy the
  next matmul keeps under autocast, and with attention dropout (BERT) its 1-byte mask
  and, in fp32, its output: 9 bytes per score for BERT in fp32, 7 under autocast. Apex's
  amp O2 (precision "o2" here: BERT only), which casts the whole model to fp16, keeps 34h
  per layer, 5h outside and 5 bytes per score.
  With gelu="composite" (the MLP's GELU written out as x·0.5·(1 + erf(x/√2)), as BERT's
  code had it until transformers 2.x; torch's F.gelu is one kernel that keeps its input),
  each layer keeps three 4h-wide tensors there instead of one — the erf's input, x·0.5
  and 1 + erf — 32h bytes more per token in fp32, 16h in 16-bit (the ops run in the
  dtype of the linear layer's output).
"""

import re
from dataclasses import dataclass

# × h per token: per layer, and outside the layers (embeddings, head inputs), per model kind.
# "o2": BERT with the whole model cast to fp16, as apex's amp O2 runs it (softmax and
# LayerNorm in fp16 too), what every fp16 row of measurements.csv ran; measured like the rest.
LAYER_ACTIVATION_BYTES = {"gpt": {"fp32": 68, "fp16": 38, "bf16": 38},
                          "bert": {"fp32": 66, "fp16": 42, "bf16": 42, "o2": 34}}
HEAD_INPUT_BYTES = {"gpt": {"fp32": 8, "fp16": 6, "bf16": 6},
                    "bert": {"fp32": 9, "fp16": 7, "bf16": 7, "o2": 5}}
LOG_SOFTMAX_BYTES, LOSS_GRADIENT_BYTES = 4, 8                    # × vocabulary per token
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
ATTENTIONS = ("fused", "eager")
GELUS = ("fused", "composite")
COMPOSITE_GELU_EXTRA_TENSORS = 2   # 4h-wide tensors kept beyond F.gelu's one
KINDS, HEADS = ("gpt", "bert"), ("lm", "mlm", "qa")
# BERT pre-training masks 15% of the tokens, and its MLM head runs on those only (the
# vocabulary-wide logits of the other 85% are never formed).
MLM_FRACTION = 0.15
BERT_POSITIONS, BERT_TOKEN_TYPES = 512, 2


@dataclass(frozen=True)
class ModelShape:
    name: str
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    kind: str = "gpt"   # "gpt" (hetcomm.train's model) or "bert"
    head: str = "lm"    # gpt: "lm"; bert: "mlm" or "qa"
    # gpt: rows of the position table when fixed (a Hugging Face GPT-2's n_positions);
    # None for hetcomm.train's GPT, whose table has one row per token of --seq.
    positions: int | None = None

    def __post_init__(self):
        for field_name in ("n_layer", "n_head", "n_embd", "vocab_size"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {field_name} = {value!r}; expected a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(f"model {self.name!r}: dim = {self.n_embd} is not a multiple of heads = {self.n_head}")
        if self.positions is not None and (self.kind != "gpt" or isinstance(self.positions, bool)
                                           or not isinstance(self.positions, int) or self.positions < 1):
            raise ValueError(f"model {self.name!r}: positions = {self.positions!r}; expected a positive integer, "
                             f"for a GPT model")
        if (self.kind, self.head) not in (("gpt", "lm"), ("bert", "mlm"), ("bert", "qa")):
            raise ValueError(f"model {self.name!r}: kind {self.kind!r} with head {self.head!r}; expected gpt with lm, "
                             f"or bert with mlm or qa")

    @property
    def max_seq(self) -> int | None:
        """The longest sequence the position table holds; None: no limit."""
        return BERT_POSITIONS if self.kind == "bert" else self.positions

    def _position_rows(self, seq: int) -> int:
        return seq if self.positions is None else self.positions

    def parameters(self, seq: int) -> int:
        h, layers = self.n_embd, self.n_layer * (12 * self.n_embd**2 + 13 * self.n_embd)
        if self.kind == "gpt":
            return self.vocab_size * h + self._position_rows(seq) * h + layers + 2 * h
        embeddings = (self.vocab_size + BERT_POSITIONS + BERT_TOKEN_TYPES) * h + 2 * h
        pooler = h * h + h
        head = (h * h + 3 * h + self.vocab_size + 2 * h + 2) if self.head == "mlm" else 2 * h + 2
        return embeddings + layers + pooler + head

    def parameter_tensors(self) -> int:
        """How many tensors the parameters are in (each costs a per-tensor optimizer its
        own kernels): per layer 12 (GPT: 2 norms, 4 linears, with biases) or 16 (BERT's
        separate query, key and value); embeddings, final norm and head besides."""
        if self.kind == "gpt":
            return 12 * self.n_layer + 4
        return 16 * self.n_layer + 5 + 2 + (7 if self.head == "mlm" else 2)

    def _head_tokens(self) -> float:
        """The share of tokens the vocabulary-wide output layer runs on."""
        return {"lm": 1.0, "mlm": MLM_FRACTION, "qa": 0.0}[self.head]

    def flops_per_sample(self, seq: int) -> float:
        """6 FLOPs per multiplying parameter per token (forward and backward), plus
        attention's score and value products."""
        h = self.n_embd
        if self.kind == "gpt":
            multiplying = self.parameters(seq) - self._position_rows(seq) * h
        else:
            multiplying = self.n_layer * (12 * h * h + 13 * h) + self._head_tokens() * (self.vocab_size + h) * h
        per_token = 6 * multiplying + 12 * self.n_layer * h * seq
        return float(per_token * seq)

    def score_bytes_per_token(self, seq: int, precision: str) -> float:
        """Per token and layer, what eager attention keeps of the seq×seq scores: the
        softmax output in fp32; under autocast the next matmul's 16-bit copy of it;
        with BERT's attention dropout its 1-byte mask and, in fp32, its output."""
        if precision == "o2":   # all in fp16: softmax output, dropout mask and output
            return float(self.n_head * seq * (2 + 1 + 2))
        per_score = 4.0
        if precision != "fp32":
            per_score += ELEMENT_BYTES[precision]
        if self.kind == "bert":
            per_score += 1 + (4 if precision == "fp32" else 0)
        return float(self.n_head * seq * per_score)

    def saved_bytes_per_sample(self, seq: int, precision: str, attention: str = "fused",
                               gelu: str = "fused") -> float:
        """What autograd keeps from forward for backward."""
        h = self.n_embd
        layer = LAYER_ACTIVATION_BYTES[self.kind][precision] * h
        if attention == "eager":
            layer += self.score_bytes_per_token(seq, precision)
        if gelu == "composite":
            layer += COMPOSITE_GELU_EXTRA_TENSORS * 4 * h * (4 if precision == "fp32" else 2)
        per_token = (self.n_layer * layer + HEAD_INPUT_BYTES[self.kind][precision] * h
                     + LOG_SOFTMAX_BYTES * self.vocab_size * self._head_tokens())
        return float(per_token * seq)

    def activation_bytes_per_sample(self, seq: int, precision: str, attention: str = "fused",
                                    gelu: str = "fused") -> float:
        """The peak: what is kept, plus the loss's gradients at the start of backward."""
        return (self.saved_bytes_per_sample(seq, precision, attention, gelu)
                + float(LOSS_GRADIENT_BYTES * self.vocab_size * self._head_tokens() * seq))

    def describe(self, seq: int) -> str:
        kind = f" {self.kind.upper()} with {self.head} head," if self.kind == "bert" else ""
        return (f"{self.name}:{kind} {self.parameters(seq) / 1e6:.1f}M parameters, {self.n_layer} layers, "
                f"{self.n_head} heads, width {self.n_embd}, vocabulary {self.vocab_size}")


# GPT-2's sizes (vocabulary 50257), the model `hetcomm train` builds by default (bytes), and
# BERT's (WordPiece vocabulary 30522): pre-training (-mlm) or SQuAD fine-tuning (-qa).
PRESETS = {shape.name: shape for shape in (
    ModelShape("gpt2-124m", 12, 12, 768, 50257),
    ModelShape("gpt2-355m", 24, 16, 1024, 50257),
    ModelShape("gpt2-774m", 36, 20, 1280, 50257),
    ModelShape("gpt2-1.5b", 48, 25, 1600, 50257),
    ModelShape("hetcomm-default", 2, 4, 192, 256),
    ModelShape("bert-base", 12, 12, 768, 30522, "bert", "mlm"),
    ModelShape("bert-base-qa", 12, 12, 768, 30522, "bert", "qa"),
    ModelShape("bert-large", 24, 16, 1024, 30522, "bert", "mlm"),
    ModelShape("bert-large-qa", 24, 16, 1024, 30522, "bert", "qa"),
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
