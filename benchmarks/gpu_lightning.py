"""BalancedStrategy on a GPU with Lightning's "16-mixed" (autocast + GradScaler): two
ranks share the one GPU over Gloo, declared as two nodes of one device each (Lightning
puts a node's first rank on cuda:0), split 5/11 of 16, hetcomm's hook registered by the
strategy where Lightning would register its own CUDA hook. The weights after the steps
are compared with plain PyTorch on one process: the union batches' mean loss over all
their tokens, the same autocast and GradScaler.

    python benchmarks/gpu_lightning.py --out results-folder

Writes lightning_gpu.md (and prints it); exit status 1 if a check fails, 0 with a line
saying so when lightning is not installed."""

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from distributed import run_ranks, values  # noqa: E402

STEPS, SPLIT = 4, [5, 11]
CUDA = torch.device("cuda", 0)


def balanced(rank, world, wire):
    import lightning as L
    from test_integration_lightning import Served, loader, module

    from hetcomm.integrations.lightning import BalancedStrategy
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", NODE_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    model = module()
    trainer = L.Trainer(accelerator="gpu", devices=1, num_nodes=world, precision="16-mixed", max_steps=STEPS,
                        strategy=BalancedStrategy(split=SPLIT, wire_dtype=getattr(torch, wire),
                                                  process_group_backend="gloo"),
                        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader(Served(), 8))
    scale = trainer.strategy.precision_plugin.scaler.get_scale()
    return [p.detach().cpu() for p in model.parameters()], scale


def one_process():
    from test_integration_lightning import SAMPLES, mean_loss, network, samples
    net, data = network().to(CUDA), samples()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cuda")
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()
    for step in range(STEPS):
        batch = torch.utils.data.default_collate([data[i] for i in order[16 * step: 16 * step + 16]])
        batch = {k: v.to(CUDA) for k, v in batch.items()}
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = mean_loss(net, batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return [p.detach().cpu() for p in net.parameters()], scaler.get_scale()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    try:
        import lightning
    except ImportError:
        print("gpu_lightning: lightning is not installed; nothing checked")
        return 0
    reference, reference_scale = one_process()
    lines = [f"# BalancedStrategy on {torch.cuda.get_device_name(0)} (Lightning's 16-mixed)", "",
             f"{datetime.date.today()}, torch {torch.__version__}, lightning {lightning.__version__}; 2 ranks on one "
             f"GPU over Gloo, split {SPLIT} of 16, {STEPS} SGD steps (lr 0.5) of tests/test_integration_lightning.py's "
             f"token model, against plain PyTorch on one process (the union batches' token mean, autocast fp16, "
             f"GradScaler). Not a legacy GPU: it checks the CUDA path, not speed.", "",
             "| wire | max abs(w - reference) | ranks apart | loss scale (ours / reference) | ok |",
             "|---|---|---|---|---|"]
    failed = False
    for wire, within in (("float32", 2e-3), ("float16", None)):
        scratch = out / "lightning-scratch"
        ranks = values(run_ranks(2, balanced, wire, tmp_path=scratch))
        trained, scale = ranks[0]
        apart = max((a - b).abs().max().item() for a, b in zip(trained, reference))
        same = max((a - b).abs().max().item() for a, b in zip(ranks[0][0], ranks[1][0]))
        ok = same == 0 and (within is None or apart < within)
        failed |= not ok
        lines.append(f"| {wire} | {apart:.3g} | {same:.3g} | {scale:.0f} / {reference_scale:.0f} | "
                     f"{'yes' if ok else 'NO'} |")
    text = "\n".join(lines) + "\n"
    (out / "lightning_gpu.md").write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
