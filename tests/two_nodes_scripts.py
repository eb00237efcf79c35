"""Users' own training under torchrun, as tests/test_two_nodes.py runs it on one agent
and on two: a loop on hetcomm.loop.BalancedLoop (SGD on a tiny regression, each
sample's loss weighted by its items), then, where transformers is installed, a
BalancedTrainer (a one-layer GPT-2, SGD). Both split the global batch unevenly. Rank 0
saves the final weights (and the loop's losses) to <out>.loop.pt and <out>.trainer.pt,
for the argument <out>. One job for both: each torchrun job costs seconds of imports."""

import importlib.util
import sys

import torch
import torch.distributed as dist
from torch import nn

from hetcomm.loop import BalancedLoop

SAMPLES, FEATURES, GLOBAL_BATCH, STEPS = 48, 6, 8, 8
SEQ, VOCAB, PER_DEVICE, TRAINER_STEPS = 8, 32, 4, 3
SPLITS = {2: [3, 5], 4: [1, 2, 2, 3]}   # of the loop's global batch by world size


class Points(torch.utils.data.Dataset):
    """Sample i: a point, its target and i % 3 + 1 items (a per-sample loss weight)."""

    def __init__(self):
        generator = torch.Generator().manual_seed(5)
        self.x = torch.randn(SAMPLES, FEATURES, generator=generator)
        self.y = self.x @ torch.randn(FEATURES, 1, generator=generator) + 0.1

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "items": torch.tensor(i % 3 + 1.0)}


def balanced_loop(out: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
    loop = BalancedLoop(model, Points(), global_batch=GLOBAL_BATCH, split=SPLITS[dist.get_world_size()],
                        wire_dtype=torch.float32, precision="fp32")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in loop.steps(STEPS):
        for batch in step:
            per_sample = ((model(batch["x"]) - batch["y"]) ** 2).squeeze(1) * batch["items"]
            step.backward(per_sample.sum(), count=batch["items"].sum(), reduction="sum")
        result = step.reduce()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(result.loss)
    if dist.get_rank() == 0:
        torch.save({"weights": {k: v.clone() for k, v in model.state_dict().items()}, "losses": losses}, out)


class Tokens(torch.utils.data.Dataset):
    """Token windows whose labels mask a different number of leading positions."""

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.items = []
        for _ in range(GLOBAL_BATCH * 4):
            ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
            labels = ids.clone()
            labels[: int(torch.randint(0, SEQ - 1, (), generator=generator))] = -100
            self.items.append({"input_ids": ids, "labels": labels})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def balanced_trainer(out: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from hetcomm.integrations.transformers import BalancedTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                       resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=f"{out}.files", per_device_train_batch_size=PER_DEVICE,
                             max_steps=TRAINER_STEPS, learning_rate=0.5, optim="sgd", use_cpu=True, report_to=[],
                             save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=1.0)
    split = {2: [3, 5], 4: [1, 3, 5, 7]}[dist.get_world_size()]   # of PER_DEVICE x world
    trainer = BalancedTrainer(model=model, args=args, train_dataset=Tokens(), split=split, wire_dtype=torch.float32)
    trainer.train()
    if dist.get_rank() == 0:
        torch.save({k: v.clone() for k, v in trainer.model.state_dict().items()}, out)


if __name__ == "__main__":
    torch.set_num_threads(1)   # the ranks share the host's cores
    dist.init_process_group("gloo")   # torchrun's environment (env://)
    balanced_loop(f"{sys.argv[1]}.loop.pt")
    if importlib.util.find_spec("transformers") and importlib.util.find_spec("accelerate"):
        balanced_trainer(f"{sys.argv[1]}.trainer.pt")
    dist.barrier()
    dist.destroy_process_group()
