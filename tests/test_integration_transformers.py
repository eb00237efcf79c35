"""BalancedTrainer (hetcomm.integrations.transformers) on 4 Gloo ranks: a split of 1/3/5/7
of 16 trains the weights one process's stock Trainer trains on the union batches (SGD,
so that the comparison is of gradients, not of Adam's normalisation of rounding), for a
loss that divides by num_items_in_batch and one that ignores it (with and without
average_tokens_across_devices), with gradient accumulation; every sample is drawn once
an epoch; a checkpoint resumes bit for bit across an epoch, and its state file changed,
truncated, of the old format, of another step or of another run is refused naming it; a
throttled rank gets fewer samples; settings it cannot honour and arguments of a wrong
type or value are refused by name at construction."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from balancing_state_formats import as_format_1
from distributed import run_ranks, values
from tolerances import REORDERINGS, farthest, order_bound

import work_clock

pytest.importorskip("transformers", minversion="5.0", reason="BalancedTrainer needs pip install 'hetcomm[hf]'")
pytest.importorskip("accelerate", reason="BalancedTrainer needs pip install 'hetcomm[hf]'")

SAMPLES, SEQ, VOCAB = 64, 8, 32
SPLIT = [1, 3, 5, 7]


class Tokens(torch.utils.data.Dataset):
    """Token windows whose labels mask a different number of leading positions, so that
    weighting by samples and by tokens differ; records the indices it serves."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.items = []
        for _ in range(SAMPLES):
            ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
            labels = ids.clone()
            labels[: int(torch.randint(0, SEQ - 1, (), generator=g))] = -100
            self.items.append({"input_ids": ids, "labels": labels})
        self.served = []

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        self.served.append(int(i))
        return self.items[i]


class IgnoresNumItems(torch.nn.Module):
    """Takes **kwargs (so Trainer passes num_items_in_batch) but its loss is the micro-batch's
    mean over its own tokens."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, labels, **kwargs):
        return self.inner(input_ids=input_ids, labels=labels)


class NoLossKwargs(IgnoresNumItems):
    def forward(self, input_ids, labels):
        return self.inner(input_ids=input_ids, labels=labels)


MODELS = {"uses": lambda m: m, "ignores": IgnoresNumItems, "plain": NoLossKwargs}


def shifted_tokens(batch):
    """The items of the wrapped causal LM's mean: its labels past the first position
    (Trainer knows to shift only for the models it recognises)."""
    return int(batch["labels"][:, 1:].ne(-100).sum())


def build(kind):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0,
                        embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)
    return MODELS[kind](GPT2LMHeadModel(config))


def arguments(out, per_device, steps, **extra):
    from transformers import TrainingArguments
    settings = dict(output_dir=out, per_device_train_batch_size=per_device, max_steps=steps, learning_rate=0.5,
                    optim="sgd", use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                    disable_tqdm=True, seed=0, max_grad_norm=1.0)
    return TrainingArguments(**{**settings, **extra})


def as_torchrun(rank, world):
    """The environment torchrun gives a rank, for accelerate (the group exists already)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29500"), OMP_NUM_THREADS="1")


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def balanced_runs(rank, world, out, runs):
    """Each (kind, settings) run on this rank: its final weights, whether it found the
    loss to divide by num_items_in_batch, and the samples it drew. Kind "stock" is a
    stock Trainer drawing the same shares (hetcomm's batches) that averages its ranks'
    mean losses equally, as DDP does."""
    as_torchrun(rank, world)
    from hetcomm.integrations.transformers import BalancedTrainer
    found = []
    for kind, settings in runs:
        if kind == "stock":
            found.append((stock_split_run(out, **settings), None, []))
            continue
        settings = dict(settings)
        trainer_args = {k: settings.pop(k) for k in ("balance", "split", "wire_dtype") if k in settings}
        data = Tokens()
        count = None if kind == "uses" else shifted_tokens
        trainer = BalancedTrainer(model=build(kind), args=arguments(f"{out}/{kind}", **settings), train_dataset=data,
                                  wire_dtype=trainer_args.pop("wire_dtype", torch.float32), count_items=count,
                                  **trainer_args)
        trainer.train()
        found.append((weights(trainer.model), trainer.loss_uses_num_items, data.served))
    return found


def in_hetcomm_order(model, args, reorder=None):
    """A stock Trainer on one process drawing the samples in the order hetcomm deals
    them (the epoch's permutation, seed 0), each step's global batch in one micro-batch
    when per_device_train_batch_size is the global batch; with reorder, each step's 16
    samples in reorder(indices)."""
    from transformers import Trainer

    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()
    if reorder is not None:
        order = [i for step in range(0, SAMPLES, 16) for i in reorder(order[step:step + 16])]

    class InOrder(Trainer):
        def _get_train_sampler(self, dataset=None):
            return order

    return InOrder(model=model, args=args, train_dataset=Tokens())


def one_process(rank, world, out, steps):
    """The stock Trainer on one process on the union batches: for the model whose loss
    divides by num_items_in_batch (which Trainer counts), and for a mean loss; each with
    how far a run of it may land (tests/tolerances.py: order_bound of the same run on
    its batches in REORDERINGS), under "<kind> bound"."""
    torch.distributed.destroy_process_group()
    trained = {}
    for kind in ("uses", "plain"):
        runs = []
        for k, reorder in enumerate((None, *REORDERINGS)):
            trainer = in_hetcomm_order(build(kind), arguments(f"{out}/{kind}-{k}", 16, steps), reorder)
            trainer.train()
            runs.append(weights(trainer.model))
        trained[kind], trained[f"{kind} bound"] = runs[0], order_bound(runs[0], runs[1:])
    trained["ignores"], trained["ignores bound"] = trained["plain"], trained["plain bound"]
    return trained


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    return values(run_ranks(1, one_process, str(out), 4, tmp_path=out))[0]


def test_uneven_split_equals_one_process_trainer_in_both_loss_modes(tmp_path, reference):
    """Also: the check can fail (DDP's equal average of the ranks' mean losses ends
    elsewhere), and the 4 steps of 16 drew each of the 64 samples once."""
    runs = [(kind, {"per_device": 4, "steps": 4, "split": SPLIT, "average_tokens_across_devices": average})
            for kind in ("uses", "ignores") for average in (True, False)]
    runs.append(("plain", {"per_device": 2, "steps": 4, "split": [2, 2, 5, 7], "gradient_accumulation_steps": 2}))
    runs.append(("stock", {"per_device": 4, "steps": 4}))
    ranks = values(run_ranks(4, balanced_runs, str(tmp_path), runs, tmp_path=tmp_path))
    for r, (kind, _) in enumerate(runs[:-1]):
        trained = [rank[r][0] for rank in ranks]
        assert farthest(trained[0], trained[3]) == 0, "the ranks' weights differ"
        bound = reference[f"{kind} bound"]
        assert farthest(trained[0], reference[kind]) <= bound, (runs[r], farthest(trained[0], reference[kind]), bound)
    assert [ranks[0][r][1] for r in range(len(runs))] == [True, True, False, False, None, None]  # "plain": no probe
    assert farthest(ranks[0][-1][0], reference["plain"]) > 50 * reference["plain bound"]
    served = [rank[0][2] for rank in ranks]
    assert [len(s) for s in served] == [4 * b for b in SPLIT]
    assert sorted(i for s in served for i in s) == list(range(SAMPLES))


def stock_split_run(out, per_device, steps):
    from transformers import Trainer

    from hetcomm.integrations import BalancedBatches

    class SameBatches(Trainer):
        def get_train_dataloader(self):
            batches = BalancedBatches(SAMPLES, 16, split=SPLIT, seed=0)
            return torch.utils.data.DataLoader(self.train_dataset, batch_sampler=batches,
                                               collate_fn=self.data_collator)

    trainer = SameBatches(model=build("plain"), args=arguments(f"{out}/stock", per_device, steps),
                          train_dataset=Tokens())
    trainer.train()
    return weights(trainer.model)


def resume_runs(rank, world, out):
    """6 steps straight (saving at 3, past the first epoch's 4), then again from step 3's
    checkpoint, with a split chosen by timing (static) that the checkpoint carries."""
    as_torchrun(rank, world)
    from hetcomm.integrations.transformers import BalancedTrainer

    def trainer(folder):
        return BalancedTrainer(model=build("uses"), args=arguments(folder, 4, 6, save_strategy="steps", save_steps=3),
                               train_dataset=Tokens(), balance="static", wire_dtype=torch.float32)

    straight = trainer(f"{out}/straight")
    work_clock.install(0.004 if rank == 3 else 0.001).count_forwards(straight.model)
    straight.train()
    resumed = trainer(f"{out}/resumed")
    resumed.train(resume_from_checkpoint=f"{out}/straight/checkpoint-3")
    return weights(straight.model), weights(resumed.model), straight.batches.split, resumed.batches.split


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """resume_runs' results on 4 ranks, and the folder of its runs' checkpoints."""
    out = tmp_path_factory.mktemp("resume")
    return values(run_ranks(4, resume_runs, str(out), tmp_path=out)), out


def test_resume_from_a_trainer_checkpoint_goes_on_bit_for_bit(resumed):
    ranks, _ = resumed
    straight, resumed, split, split_after = ranks[0]
    assert farthest(straight, resumed) == 0
    # 16 by throughputs 4:4:4:1 (rank 3 at 4 ms a sample, the others at 1 ms)
    assert split == split_after == (5, 5, 5, 1), split


def spoilt_checkpoints(saved: Path, foreign: Path, into: Path) -> dict[str, Path]:
    """Copies of a one-process run's checkpoint-3, each with its hetcomm_state.json
    spoilt one way, and the 4-rank run's as it is (for one process, another run's)."""
    from hetcomm.integrations.transformers import STATE_FILE
    text = (saved / "checkpoint-3" / STATE_FILE).read_text()
    edited = text.replace('"epoch": 0', '"epoch": 1', 1)   # another epoch's permutation
    assert edited != text
    variants = {"edited": (saved, edited), "truncated": (saved, text[: len(text) // 2]),
                "format 1": (saved, json.dumps(as_format_1(json.loads(text)["batches"]))),
                "of another step": (saved, (saved / "checkpoint-6" / STATE_FILE).read_text()),
                "foreign": (foreign, (foreign / "checkpoint-3" / STATE_FILE).read_text())}
    folders = {}
    for name, (run, content) in variants.items():
        folders[name] = into / name.replace(" ", "-") / "checkpoint-3"
        shutil.copytree(run / "checkpoint-3", folders[name])
        (folders[name] / STATE_FILE).write_text(content)
    return folders


def resumes_refused(rank, world, out, foreign):
    """A one-process BalancedTrainer of the 4-rank run's global batch saves at steps 3 and
    6; each spoilt checkpoint resumed by the same: the folders, each one's error and the
    training steps run before it."""
    torch.distributed.destroy_process_group()
    from hetcomm.integrations.transformers import BalancedTrainer

    class Counting(BalancedTrainer):
        steps_run = 0

        def training_step(self, *args, **kwargs):
            self.steps_run += 1
            return super().training_step(*args, **kwargs)

    def trainer(folder, **extra):
        return Counting(model=build("uses"), args=arguments(folder, 16, 6, **extra), train_dataset=Tokens(),
                        balance="static", wire_dtype=torch.float32)

    trainer(f"{out}/saved", save_strategy="steps", save_steps=3).train()
    folders = spoilt_checkpoints(Path(out) / "saved", Path(foreign), Path(out))
    found = {}
    for name, folder in folders.items():
        resumed = trainer(f"{folder}-resumed")
        try:
            resumed.train(resume_from_checkpoint=str(folder))
            found[name] = (None, "resumed", resumed.steps_run)
        except Exception as error:  # the test inspects which error, and its message
            found[name] = (type(error), str(error), resumed.steps_run)
    return folders, found


def test_a_spoilt_or_foreign_state_file_is_refused_in_one_line_naming_it(resumed, tmp_path):
    from hetcomm.integrations.transformers import STATE_FILE
    folders, found = values(run_ranks(1, resumes_refused, str(tmp_path), str(resumed[1] / "straight"),
                                      tmp_path=tmp_path))[0]
    why = {"edited": "damaged or edited", "truncated": "not whole JSON, truncated or damaged", "format 1": "format 1",
           "of another step": "balancing state after step 6, the checkpoint's training state after step 3",
           "foreign": "world 4 there, 1 here"}
    assert set(found) == set(why)
    for name, (kind, message, steps_run) in found.items():
        assert kind is not None and issubclass(kind, ValueError), (name, kind, message)
        assert str(folders[name] / STATE_FILE) in message and why[name] in message, (name, message)
        assert "resume from another checkpoint, or start fresh" in message and "\n" not in message, message
        assert steps_run == 0, (name, steps_run)


def throttled(rank, world, out):
    as_torchrun(rank, world)
    from hetcomm.integrations.transformers import BalancedTrainer
    trainer = BalancedTrainer(model=build("uses"), args=arguments(out, 8, 8), train_dataset=Tokens(),
                              max_micro_batch=10)
    splits = []

    class Record:
        def __getattr__(self, name):
            return lambda *a, **k: None

        def on_step_end(self, *a, **k):
            splits.append(trainer.batches.sampler.sizes)

    trainer.add_callback(Record())
    work_clock.install(0.01 if rank == 1 else 0.001).count_forwards(trainer.model)
    trainer.train()
    return splits


def test_a_throttled_rank_gets_fewer_samples_within_the_others_caps(tmp_path):
    """Rank 1 at a tenth of the others' speed would get ~1 of 32 samples; the others hold
    at most 10 (max_micro_batch), so it keeps 2."""
    splits = values(run_ranks(4, throttled, str(tmp_path), tmp_path=tmp_path))[0]
    assert splits[0] == (8, 8, 8, 8)
    assert splits[-1] == (10, 2, 10, 10), splits
    assert all(max(split) <= 10 for split in splits), splits


TRAINER_ARGUMENTS = {
    "wire_dtype int8": ({"wire_dtype": torch.int8}, ValueError, "wire_dtype = torch.int8: expected torch.float16"),
    "wire_dtype str": ({"wire_dtype": "float16"}, TypeError, "wire_dtype = 'float16': expected a torch.dtype"),
    "balance type": ({"balance": 2}, TypeError, "balance = 2: expected a str"),
    "split type": ({"split": [4.0]}, TypeError, "split = [4.0]: expected a sequence of integers"),
    "max_micro_batch type": ({"max_micro_batch": "4"}, TypeError, "max_micro_batch = '4': expected a sequence"),
    # one process, 4 samples a step: micro-batches of at most 2 cannot hold them
    "max_micro_batch holds": ({"max_micro_batch": 2}, ValueError,
                              "max_micro_batch = 2 x 1 micro-batches holds at most 2 samples"),
    "count_items": ({"count_items": 3}, TypeError, "count_items = 3: expected None or a function"),
}


def arguments_refused(rank, world, out):
    """Each of TRAINER_ARGUMENTS given to a one-process BalancedTrainer: its error."""
    torch.distributed.destroy_process_group()
    from hetcomm.integrations.transformers import BalancedTrainer
    found = {}
    for name, (given, _, _) in TRAINER_ARGUMENTS.items():
        try:
            BalancedTrainer(model=build("uses"), args=arguments(out, 4, 1), train_dataset=Tokens(), **given)
            found[name] = (None, "accepted")
        except Exception as error:  # the test inspects which error, and its message
            found[name] = (type(error), str(error))
    return found


@pytest.fixture(scope="module")
def refused_arguments(tmp_path_factory):
    out = tmp_path_factory.mktemp("arguments")
    return values(run_ranks(1, arguments_refused, str(out), tmp_path=out))[0]


@pytest.mark.parametrize("name", TRAINER_ARGUMENTS)
def test_each_argument_is_checked_at_construction_by_name(name, refused_arguments):
    _, kind, expected = TRAINER_ARGUMENTS[name]
    found, message = refused_arguments[name]
    assert found is kind, (name, found, message)
    assert message.startswith("BalancedTrainer: ") and expected in message, message


def refusals(rank, world, out):
    as_torchrun(rank, world)
    from hetcomm.integrations.transformers import BalancedTrainer

    class OwnSampler(BalancedTrainer):
        def _get_train_sampler(self, dataset=None):
            return None

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(Tokens().items)

    cases = {"split_batches": (BalancedTrainer, {"accelerator_config": {"split_batches": True}}, Tokens()),
             "_get_train_sampler": (OwnSampler, {}, Tokens()),
             "IterableDataset": (BalancedTrainer, {}, Stream()),
             "train_sampling_strategy": (BalancedTrainer, {"train_sampling_strategy": "group_by_length"}, Tokens()),
             # 65 samples leave 1 for an epoch's last step of 2 ranks: no sample for one of them
             "dataloader_drop_last": (BalancedTrainer, {}, torch.utils.data.ConcatDataset([Tokens(), [{}]]))}
    messages = {}
    for name, (cls, extra, data) in cases.items():
        try:
            cls(model=build("uses"), args=arguments(out, 4, 1, **extra), train_dataset=data)
        except ValueError as error:
            messages[name] = str(error)
    try:   # Gloo cannot all-reduce bfloat16
        BalancedTrainer(model=build("uses"), args=arguments(out, 4, 1), train_dataset=Tokens(),
                        wire_dtype=torch.bfloat16)
    except ValueError as error:
        messages["bfloat16"] = str(error)
    return messages


def test_settings_it_cannot_honour_are_refused_by_name(tmp_path):
    messages = values(run_ranks(2, refusals, str(tmp_path), tmp_path=tmp_path))[0]
    assert set(messages) == {"split_batches", "_get_train_sampler", "IterableDataset", "train_sampling_strategy",
                             "dataloader_drop_last", "bfloat16"}
    for name, message in messages.items():
        assert name in message, message
