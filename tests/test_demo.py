"""The quick-start demo runs, checks itself against float64, and rejects bad counts."""

import pytest

from hetcomm import demo


@pytest.mark.parametrize("wire", ["float16", "bfloat16", "float32"])
def test_demo_reduces_to_the_weighted_mean(wire, capsys):
    assert demo.main(["--layers", "1", "--d-model", "32", "--wire", wire, "--samples", "2", "9", "1"]) == 0
    out = capsys.readouterr().out
    assert "3 simulated ranks in one process" in out and "result: OK" in out


def test_demo_rejects_empty_batch():
    with pytest.raises(SystemExit):
        demo.main(["--samples", "0", "0"])
