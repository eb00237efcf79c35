"""BalancedTrainer on a GPU, with Trainer's fp16 (autocast + GradScaler) and bf16: two ranks share
the one GPU over Gloo (NCCL refuses two ranks on one device) with an uneven split of 3/5
of 8, the gradients through hetcomm's hook and its CUDA pack/unpack kernels. The weights
after the steps are compared with one process's stock Trainer on the union batches:
with the fp32 wire they must agree to fp16-autocast rounding; with the fp16 wire the
wire carries the loss-scaled gradient (as DDP's fp16_compress_hook does), so GradScaler
may skip a step the reference takes (each skip halves the loss scale): the difference
and the final loss scales are reported.

    python benchmarks/gpu_integrations.py --out results-folder

Writes integrations_gpu.md (and prints it); exit status 1 if a check fails."""

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from distributed import run_ranks, values  # noqa: E402

STEPS = 5
SPLIT = [3, 5]


# (Trainer's precision, the wire, how far from the reference the weights may end): with a
# 32-bit wire the rounding of the 16-bit forward on both sides; a 16-bit wire is reported.
CASES = (("fp16", "float32", 2e-3), ("fp16", "float16", None), ("bf16", "float16", None))


def gpu_arguments(out, per_device, precision, **extra):
    from test_integration_transformers import arguments
    return arguments(out, per_device, STEPS, use_cpu=False, **{precision: True}, **extra)


def loss_scale(trainer) -> float:
    scaler = trainer.accelerator.scaler
    return scaler.get_scale() if scaler is not None else float("nan")


def balanced(rank, world, out, precision, wire):
    from test_integration_transformers import Tokens, as_torchrun, build, weights

    from hetcomm.integrations.transformers import BalancedTrainer
    as_torchrun(rank, world)
    os.environ["LOCAL_RANK"] = "0"   # both ranks on the one GPU
    arguments = gpu_arguments(f"{out}/{precision}-{wire}", 4, precision, ddp_backend="gloo")
    trainer = BalancedTrainer(model=build("uses"), args=arguments, train_dataset=Tokens(), split=SPLIT,
                              wire_dtype=getattr(torch, wire))
    trainer.train()
    return [w.cpu() for w in weights(trainer.model)], loss_scale(trainer)


def reference(rank, world, out):
    torch.distributed.destroy_process_group()
    from test_integration_transformers import build, in_hetcomm_order, weights
    trained = {}
    for precision in ("fp16", "bf16"):
        trainer = in_hetcomm_order(build("uses"), gpu_arguments(f"{out}/reference-{precision}", 8, precision))
        trainer.train()
        trained[precision] = [w.cpu() for w in weights(trainer.model)], loss_scale(trainer)
    return trained


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    scratch = out / "integrations-scratch"
    references = values(run_ranks(1, reference, str(scratch), tmp_path=scratch))[0]
    rows, failed = [], False
    for precision, wire, within in CASES:
        one, scale = references[precision]
        ranks = values(run_ranks(2, balanced, str(scratch), precision, wire, tmp_path=scratch))
        trained, final_scale = ranks[0]
        apart = max((a - b).abs().max().item() for a, b in zip(trained, one))
        moved = max((a - b).abs().max().item() for a, b in zip(trained, build_initial()))
        same = max((a - b).abs().max().item() for a, b in zip(ranks[0][0], ranks[1][0]))
        ok = same == 0 and (within is None or apart < within) and moved > 1e-2
        failed |= not ok
        rows.append({"precision": precision, "wire": wire, "from_reference": apart, "moved": moved,
                     "ranks_apart": same, "loss_scale": final_scale, "reference_loss_scale": scale, "ok": ok})
    name = torch.cuda.get_device_name(0)
    lines = [f"# BalancedTrainer on {name} (Trainer's fp16 with its GradScaler, and bf16)", "",
             f"{datetime.date.today()}, torch {torch.__version__}; 2 ranks on one GPU over Gloo, split {SPLIT} of 8, "
             f"{STEPS} SGD steps (lr 0.5) of the tiny GPT-2 of tests/test_integration_transformers.py, against one "
             f"process's stock Trainer on the union batches. Not a legacy GPU: it checks the CUDA path, not speed.", "",
             "| precision | wire | max abs(w - reference) | max abs(w - w0) | ranks apart | loss scale (ours / "
             "reference) | ok |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['precision']} | {r['wire']} | {r['from_reference']:.3g} | {r['moved']:.3g} | "
                     f"{r['ranks_apart']:.3g} | {r['loss_scale']:.0f} / {r['reference_loss_scale']:.0f} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    text = "\n".join(lines) + "\n"
    (out / "integrations_gpu.md").write_text(text)
    (out / "integrations_gpu.json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 1 if failed else 0


def build_initial():
    from test_integration_transformers import build
    return [p.detach().clone() for p in build("uses").parameters()]


if __name__ == "__main__":
    sys.exit(main())
