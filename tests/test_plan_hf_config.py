"""`hetcomm plan --model config.json`: Hugging Face configs read into the planner's
shapes. Parameters against the transformers model built from the same config (and,
without transformers, against the tensors listed by hand); activation bytes against
autograd's saved tensors of tiny Llama, Qwen2 and Mistral models; FLOPs against
PyTorch's FlopCounterMode; bad configs refused by file and field."""

import json
from pathlib import Path

import pytest
import torch

from hetcomm.plan.cli import main
from hetcomm.plan.hf_config import read_hf_config, resolve_model
from hetcomm.plan.llama_shape import LlamaShape
from hetcomm.plan.model_shape import ModelShape

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
NAMES = ["llama-3.2-1b", "llama-3.2-3b", "qwen2.5-1.5b", "smollm2-1.7b", "mistral-7b-v0.3", "gpt2",
         "bert-base-uncased"]


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def tensors_by_hand(c: dict) -> list[tuple[int, ...]]:
    """The parameter tensors of the transformers model of config `c`, listed module by module."""
    kind = c["model_type"]
    if kind == "gpt2":
        h, inner = c["n_embd"], 4 * c["n_embd"]
        layer = [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,), (h, inner), (inner,), (inner, h), (h,)]
        return [(c["vocab_size"], h), (c["n_positions"], h)] + layer * c["n_layer"] + [(h,), (h,)]
    if kind == "bert":
        h, inner, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        linear = [(h, h), (h,)]
        layer = linear * 4 + [(h,), (h,), (inner, h), (inner,), (h, inner), (h,), (h,), (h,)]
        embeddings = [(v, h), (c["max_position_embeddings"], h), (c["type_vocab_size"], h), (h,), (h,)]
        pooler, mlm, nsp = linear, linear + [(h,), (h,), (v,)], [(2, h), (2,)]
        return embeddings + layer * c["num_hidden_layers"] + pooler + mlm + nsp
    h, heads = c["hidden_size"], c["num_attention_heads"]
    d = c.get("head_dim") or h // heads
    q, kv, inner = heads * d, c["num_key_value_heads"] * d, c["intermediate_size"]
    layer = [(q, h), (kv, h), (kv, h), (h, q), (inner, h), (inner, h), (h, inner), (h,), (h,)]
    if kind == "qwen2":
        layer += [(q,), (kv,), (kv,)]
    head = [] if c["tie_word_embeddings"] else [(c["vocab_size"], h)]
    return [(c["vocab_size"], h)] + layer * c["num_hidden_layers"] + [(h,)] + head


@pytest.mark.parametrize("name", NAMES)
def test_parameters_match_the_tensors_listed_by_hand(name):
    shapes = tensors_by_hand(config(name))
    shape = read_hf_config(str(CONFIGS / f"{name}.json"))
    assert shape.parameters(512) == sum(torch.Size(s).numel() for s in shapes)
    assert shape.parameter_tensors() == len(shapes)


@pytest.mark.parametrize("name", NAMES)
def test_parameters_match_the_transformers_model(name):
    transformers = pytest.importorskip("transformers")
    c = config(name)
    hf_config = transformers.AutoConfig.for_model(**c)
    with torch.device("meta"):
        # bert plans pre-training: the MLM and next-sentence heads over the encoder with its pooler
        model = transformers.BertForPreTraining(hf_config) if c["model_type"] == "bert" \
            else transformers.AutoModelForCausalLM.from_config(hf_config)
    parameters = list(model.parameters())   # a tied head is the embedding's tensor, listed once
    shape = read_hf_config(str(CONFIGS / f"{name}.json"))
    assert shape.parameters(512) == sum(p.numel() for p in parameters)
    assert shape.parameter_tensors() == len(parameters)


def test_the_published_sizes():
    sizes = {name: read_hf_config(str(CONFIGS / f"{name}.json")).parameters(1024) for name in NAMES}
    assert sizes["llama-3.2-1b"] == pytest.approx(1.24e9, rel=0.01)
    assert sizes["llama-3.2-3b"] == pytest.approx(3.21e9, rel=0.01)
    assert sizes["qwen2.5-1.5b"] == pytest.approx(1.54e9, rel=0.01)
    assert sizes["smollm2-1.7b"] == pytest.approx(1.71e9, rel=0.01)
    assert sizes["mistral-7b-v0.3"] == pytest.approx(7.25e9, rel=0.01)
    assert sizes["gpt2"] == 124_439_808


TINY = {   # GQA with an explicit head width, Qwen2's q/k/v biases, an untied Mistral, plain MHA
    "llama-gqa": dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=1000,
                      tie_word_embeddings=True, max_position_embeddings=256),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=1, vocab_size=700, tie_word_embeddings=True,
                  max_position_embeddings=256),
    "mistral": dict(model_type="mistral", hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=2, vocab_size=500, tie_word_embeddings=False,
                    max_position_embeddings=256, sliding_window=None),
}


def tiny_shape(tmp_path, name: str, layers: int) -> LlamaShape:
    path = tmp_path / f"{name}-{layers}.json"
    path.write_text(json.dumps(dict(TINY[name], num_hidden_layers=layers)))
    return read_hf_config(str(path))


def tiny_model(name: str, layers: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(**dict(TINY[name], num_hidden_layers=layers),
                                                  attn_implementation="sdpa")
    return transformers.AutoModelForCausalLM.from_config(hf_config).train()


def saved_bytes(model, batch: int, seq: int, autocast: bool) -> int:
    """Bytes of the distinct storages autograd keeps in one training forward with the
    loss, leaving out the parameters and autocast's 16-bit copies of the weights."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    shapes |= {s[::-1] for s in shapes}   # a linear layer may keep the weight's copy transposed
    storages = {}

    def keep(tensor):
        weight_copy = tensor.dtype == torch.bfloat16 and tuple(tensor.shape) in shapes
        if tensor.untyped_storage().data_ptr() not in weights and not weight_copy:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(input_ids=tokens, labels=tokens)
    return sum(storages.values())


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kept_activations_match_autograds_saved_tensors(tmp_path, name, precision):
    seq, autocast = 40, precision != "fp32"
    per_sample = {}
    for layers in (1, 2):   # per sample: batch 2 less batch 1 (cos and sin are per micro-batch)
        model = tiny_model(name, layers)
        per_sample[layers] = saved_bytes(model, 2, seq, autocast) - saved_bytes(model, 1, seq, autocast)
    one, two = (tiny_shape(tmp_path, name, layers) for layers in (1, 2))
    assert two.saved_bytes_per_sample(seq, precision) - one.saved_bytes_per_sample(seq, precision) \
        == per_sample[2] - per_sample[1]
    # The labels are shifted by one: the loss keeps seq - 1 of them, 8 bytes each, plus a padded one.
    assert two.saved_bytes_per_sample(seq, precision) == pytest.approx(per_sample[2], abs=16)


@pytest.mark.parametrize("name", list(TINY))
def test_flops_match_the_counted_matmuls(tmp_path, name):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model, seq, batch = tiny_model(name, 2), 32, 2
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
    # The math backend runs attention as matmuls, which the counter sees; norms and
    # biases (6 FLOPs per parameter in the formula) are the rest of the difference.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(input_ids=tokens, labels=tokens).loss.backward()
    shape = tiny_shape(tmp_path, name, 2)
    assert shape.flops_per_sample(seq) == pytest.approx(counter.get_total_flops() / batch, rel=0.02)


def test_the_peak_adds_the_loss_gradients_and_the_returned_logits(tmp_path):
    shape = tiny_shape(tmp_path, "qwen2", 2)
    for precision, logits in (("fp32", 4), ("bf16", 2)):
        extra = shape.activation_bytes_per_sample(64, precision) - shape.saved_bytes_per_sample(64, precision)
        assert extra == (8 + logits) * 700 * 64


def write(tmp_path, content) -> str:
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


LLAMA = dict(TINY["llama-gqa"])


@pytest.mark.parametrize("content, message", [
    ("{not json", r"config.json: not JSON \(.*\); expected a Hugging Face config.json"),
    ("[1, 2]", "a JSON list; expected an object of config fields"),
    (dict(LLAMA, model_type="t5"), "model_type = 't5'; expected one of llama, mistral, qwen2, gpt2, bert"),
    ({k: v for k, v in LLAMA.items() if k != "model_type"}, "model_type = missing; expected one of"),
    ({k: v for k, v in LLAMA.items() if k != "vocab_size"}, "vocab_size = missing; expected a positive integer"),
    (dict(LLAMA, num_hidden_layers=0), "num_hidden_layers = 0; expected a positive integer"),
    (dict(LLAMA, intermediate_size=-5), "intermediate_size = -5; expected a positive integer"),
    (dict(LLAMA, hidden_size="64"), "hidden_size = '64'; expected a positive integer"),
    (dict(LLAMA, num_key_value_heads=3), "num_key_value_heads = 3; expected a divisor of num_attention_heads = 4"),
    ({k: v for k, v in dict(LLAMA, hidden_size=66).items() if k != "head_dim"},
     "hidden_size = 66; expected a multiple of num_attention_heads = 4"),
    (dict(LLAMA, tie_word_embeddings="yes"), "tie_word_embeddings = 'yes'; expected true or false"),
    (dict(LLAMA, rms_norm_eps=0), "rms_norm_eps = 0; expected a positive number"),
    (dict(LLAMA, hidden_act="gelu"), "hidden_act = 'gelu'; expected silu"),
    (dict(config("gpt2"), n_inner=1000), "n_inner = 1000; expected null or 4·n_embd = 3072"),
    (dict(config("gpt2"), n_head=7), "n_embd = 768; expected a multiple of n_head = 7"),
    (dict(config("bert-base-uncased"), max_position_embeddings=1024), "max_position_embeddings = 1024; expected 512"),
])
def test_bad_configs_name_the_file_and_the_field(tmp_path, content, message):
    path = write(tmp_path, content)
    with pytest.raises(ValueError, match=message) as error:
        read_hf_config(path)
    assert str(error.value).startswith(f"--model {path}: ")


def test_a_directory_holding_config_json_and_a_missing_file(tmp_path):
    write(tmp_path, LLAMA)
    assert resolve_model(str(tmp_path)) == read_hf_config(str(tmp_path / "config.json"))
    assert resolve_model("gpt2-124m").name == "gpt2-124m"
    with pytest.raises(ValueError, match="nowhere.json: no such file; expected a Hugging Face config.json"):
        resolve_model(str(tmp_path / "nowhere.json"))


def test_gpt2_keeps_its_position_table_whatever_the_sequence():
    shape = read_hf_config(str(CONFIGS / "gpt2.json"))
    assert isinstance(shape, ModelShape) and shape.positions == 1024
    assert shape.parameters(256) == shape.parameters(1024) == 124_439_808
    assert shape.max_seq == 1024


def plan(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


LLAMA_1B = str(CONFIGS / "llama-3.2-1b.json")


def test_llama_1b_on_1080tis_says_it_does_not_fit(capsys):
    code, _, err = plan(capsys, "--model", LLAMA_1B, "--cluster", "4x1080ti", "--global-batch", "64", "--seq", "2048")
    assert code == 2 and "llama-3.2-1b at --seq 2048 fits on none of the devices" in err
    assert "Traceback" not in err
    code, _, err = plan(capsys, "--model", LLAMA_1B, "--cluster", "4x1080ti", "--global-batch", "64", "--seq", "2048",
                        "--shard")
    assert code == 2 and "fits on none of the devices, even with the optimizer state sharded" in err


def test_llama_1b_plans_on_cards_it_fits(capsys):
    code, out, _ = plan(capsys, "--model", LLAMA_1B, "--cluster", "2xa100-80gb", "--global-batch", "64",
                        "--seq", "2048", "--json")
    record = json.loads(out)
    assert code == 0 and record["model"]["parameters"] == 1_235_814_400
    assert sum(device["samples"] for device in record["devices"]) == 64


def test_what_a_llama_model_cannot_be_planned_with(capsys):
    smollm = str(CONFIGS / "smollm2-1.7b.json")
    code, _, err = plan(capsys, "--model", smollm, "--cluster", "2xa100-80gb", "--seq", "16384")
    assert code == 2 and "--seq 16384: smollm2-1.7b has rotary positions up to max_position_embeddings = 8192" in err
    code, _, err = plan(capsys, "--model", smollm, "--cluster", "2xa100-80gb", "--seq", "512", "--attention", "eager")
    assert code == 2 and "only fused (SDPA) attention is modelled for llama models" in err
