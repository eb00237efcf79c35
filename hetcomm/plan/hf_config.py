"""`hetcomm plan --model PATH`: a Hugging Face config.json read into the planner's model
shape, checked field by field before any planning.

Families: llama, mistral and qwen2 (hetcomm.plan.llama_shape: RMSNorm, SwiGLU,
grouped-query attention, rotary positions); gpt2 (planned as hetcomm.train's GPT of that
shape, with GPT-2's n_positions-row position table: parameters exact for
GPT2LMHeadModel, activations those of hetcomm's model — transformers' GPT-2 keeps more,
its dropout masks and the tanh GELU's intermediates); bert (planned as pre-training,
BertForPreTraining, in the one shape hetcomm.plan.model_shape models: MLP 4·hidden, 512
positions, 2 token types). Defaults are transformers' own for a field a config leaves
out, except the sizes, which must be there.
"""

import json
from pathlib import Path

from hetcomm.plan.llama_shape import FAMILIES, LlamaShape
from hetcomm.plan.model_shape import BERT_POSITIONS, BERT_TOKEN_TYPES, ModelShape, parse_model

MODEL_TYPES = (*FAMILIES, "gpt2", "bert")
# transformers' defaults for what a config may leave out
MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}
GPT2_POSITIONS = 1024


def is_config_path(text: str) -> bool:
    """A --model that names a file: ends in .json, or is a directory (holding config.json)."""
    return text.strip().lower().endswith(".json") or Path(text).is_dir()


def resolve_model(text: str) -> ModelShape | LlamaShape:
    """--model: a config.json (or its directory), else a preset or layers=...,heads=...,dim=..."""
    return read_hf_config(text) if is_config_path(text) else parse_model(text)


class _Fields:
    """A config's fields, each read with an error naming the file, the field and what
    was expected."""

    def __init__(self, path: Path, config: dict):
        self.path, self.config = path, config

    def error(self, field: str, expected: str) -> ValueError:
        value = self.config.get(field, "missing")
        shown = value if value == "missing" else repr(value)
        return ValueError(f"--model {self.path}: {field} = {shown}; expected {expected}")

    def positive(self, field: str, default: int | None = None) -> int:
        value = self.config.get(field)
        if value is None and default is not None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.error(field, "a positive integer")
        return value

    def flag(self, field: str, default: bool) -> bool:
        value = self.config.get(field, default)
        if not isinstance(value, bool):
            raise self.error(field, "true or false")
        return value

    def positive_number(self, field: str) -> None:
        value = self.config.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise self.error(field, "a positive number")


def _config_file(text: str) -> Path:
    path = Path(text.strip())
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {path}: no such file; expected a Hugging Face config.json or a directory "
                         f"holding one")
    return path


def read_hf_config(text: str) -> ModelShape | LlamaShape:
    path = _config_file(text)
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--model {path}: not JSON ({error}); expected a Hugging Face config.json") from None
    if not isinstance(config, dict):
        raise ValueError(f"--model {path}: a JSON {type(config).__name__}; expected an object of config fields")
    fields = _Fields(path, config)
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise fields.error("model_type", f"one of {', '.join(MODEL_TYPES)}")
    name = path.parent.name if path.name == "config.json" else path.stem
    if model_type == "gpt2":
        return _gpt2(name, fields)
    if model_type == "bert":
        return _bert(name, fields)
    return _llama(name, model_type, fields)


def _llama(name: str, family: str, fields: _Fields) -> LlamaShape:
    hidden = fields.positive("hidden_size")
    heads = fields.positive("num_attention_heads")
    kv_heads = fields.positive("num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise fields.error("num_key_value_heads", f"a divisor of num_attention_heads = {heads}")
    if fields.config.get("head_dim") is None:
        if hidden % heads:
            raise fields.error("hidden_size", f"a multiple of num_attention_heads = {heads} (or a head_dim field)")
        head_dim = hidden // heads
    else:
        head_dim = fields.positive("head_dim")
    if fields.config.get("hidden_act", "silu") != "silu":
        raise fields.error("hidden_act", "silu (the SwiGLU MLP modelled)")
    fields.positive_number("rms_norm_eps")
    llama = family == "llama"
    return LlamaShape(
        name=name, n_layer=fields.positive("num_hidden_layers"), n_head=heads, n_kv_head=kv_heads, n_embd=hidden,
        head_dim=head_dim, intermediate=fields.positive("intermediate_size"),
        vocab_size=fields.positive("vocab_size"), tied=fields.flag("tie_word_embeddings", False), family=family,
        # Qwen2 always has biases on q, k and v; Llama's attention_bias puts them on o too.
        qkv_bias=family == "qwen2" or (llama and fields.flag("attention_bias", False)),
        o_bias=llama and fields.flag("attention_bias", False),
        mlp_bias=llama and fields.flag("mlp_bias", False),
        max_positions=fields.positive("max_position_embeddings", default=MAX_POSITIONS[family]))


def _gpt2(name: str, fields: _Fields) -> ModelShape:
    width = fields.positive("n_embd")
    if fields.config.get("n_inner") not in (None, 4 * width):
        raise fields.error("n_inner", f"null or 4·n_embd = {4 * width} (the GPT MLP modelled)")
    if not fields.flag("tie_word_embeddings", True):
        raise fields.error("tie_word_embeddings", "true (GPT-2's head is its token embedding)")
    heads = fields.positive("n_head")
    if width % heads:
        raise fields.error("n_embd", f"a multiple of n_head = {heads}")
    return ModelShape(name, fields.positive("n_layer"), heads, width, fields.positive("vocab_size"),
                      positions=fields.positive("n_positions", default=GPT2_POSITIONS))


def _bert(name: str, fields: _Fields) -> ModelShape:
    hidden = fields.positive("hidden_size")
    heads = fields.positive("num_attention_heads")
    if hidden % heads:
        raise fields.error("hidden_size", f"a multiple of num_attention_heads = {heads}")
    if fields.positive("intermediate_size", default=3072) != 4 * hidden:
        raise fields.error("intermediate_size", f"4·hidden_size = {4 * hidden} (the BERT shape modelled)")
    if fields.positive("max_position_embeddings", default=BERT_POSITIONS) != BERT_POSITIONS:
        raise fields.error("max_position_embeddings", f"{BERT_POSITIONS} (the BERT shape modelled)")
    if fields.positive("type_vocab_size", default=BERT_TOKEN_TYPES) != BERT_TOKEN_TYPES:
        raise fields.error("type_vocab_size", f"{BERT_TOKEN_TYPES} (the BERT shape modelled)")
    return ModelShape(name, fields.positive("num_hidden_layers"), heads, hidden, fields.positive("vocab_size"),
                      "bert", "mlm")
