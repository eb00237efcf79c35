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
