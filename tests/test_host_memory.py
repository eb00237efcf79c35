"""keep_freed_memory: a CPU worker's training steps stop faulting their pages in afresh."""

import json
import platform
import subprocess
import sys

import pytest

from hetcomm.loop.host_memory import keep_freed_memory

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# A fresh process (a fresh heap) runs a few forward/backward steps of a small GPT, two
# passes each as the trainer's check and rest, and prints the page faults of every step.
STEPS = """
import json, resource, sys
import torch
from hetcomm.loop.host_memory import keep_freed_memory
from hetcomm.train.model import GPT, GPTConfig
if sys.argv[1] == "keep":
    assert keep_freed_memory()
torch.set_num_threads(1)
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128, dropout=0.0))
windows = torch.randint(0, 256, (16, 64))
faults = []
for step in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model.zero_grad(set_to_none=True)
    for part in (windows[:3], windows[3:]):
        _, loss = model(part, part, reduction="sum")
        loss.backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def step_faults(mode: str) -> list[int]:
    run = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


@glibc_only
def test_later_steps_reuse_the_first_step_s_pages():
    default, kept = step_faults("default"), step_faults("keep")
    # The first step faults its working set in either way; glibc's defaults then give
    # pages back and fault them in again on later steps, kept memory does not.
    assert sum(kept[1:]) < 0.25 * kept[0], kept
    assert sum(kept[1:]) < sum(default[1:]), (kept, default)


@glibc_only
def test_it_says_it_took_effect():
    assert keep_freed_memory() is True
