"""The planner's BERT activation counts against what a transformers BERT really keeps
for backward (hetcomm.plan.saved_bytes): tiny shapes, so it runs in seconds;
benchmarks/bench_bert_memory.py measures BERT-base and -large."""

import pytest

from hetcomm.plan.model_shape import ModelShape

pytest.importorskip("transformers")

from hetcomm.plan.saved_bytes import measure_bert  # noqa: E402

TINY = ModelShape("tiny-bert", 2, 2, 64, 1000, "bert", "qa")


@pytest.mark.parametrize("attention", ["eager", "fused"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "o2"])
@pytest.mark.parametrize("seq", [48, 96])
def test_bert_saved_bytes_match_the_model(seq, precision, attention):
    measured = measure_bert(TINY, seq, precision, attention)
    model_layer = (ModelShape("two", 2, 2, 64, 1000, "bert", "qa").saved_bytes_per_sample(seq, precision, attention)
                   - ModelShape("one", 1, 2, 64, 1000, "bert", "qa").saved_bytes_per_sample(seq, precision, attention))
    assert model_layer == pytest.approx(measured.layer, rel=0.03)
    assert TINY.saved_bytes_per_sample(seq, precision, attention) == pytest.approx(
        measured.total(TINY.n_layer), rel=0.03)


def test_eager_attention_adds_the_scores_per_layer():
    eager, fused = (measure_bert(TINY, 96, "fp32", a) for a in ("eager", "fused"))
    # 9 bytes per score in fp32: softmax output, dropout mask and dropout output.
    assert eager.layer - fused.layer == pytest.approx(9 * TINY.n_head * 96 * 96, rel=0.01)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "o2"])
def test_a_composite_gelu_keeps_two_more_mlp_tensors(precision):
    composite, fused = (measure_bert(TINY, 48, precision, "eager", gelu) for gelu in ("composite", "fused"))
    model = (TINY.saved_bytes_per_sample(48, precision, "eager", "composite")
             - TINY.saved_bytes_per_sample(48, precision, "eager", "fused")) / TINY.n_layer
    # Two 4h-wide tensors more per token: the erf's input, x·0.5 and 1 + erf kept, where F.gelu keeps x.
    element = 4 if precision == "fp32" else 2
    assert composite.layer - fused.layer == model == 2 * 4 * TINY.n_embd * 48 * element
    assert composite.outside == fused.outside
