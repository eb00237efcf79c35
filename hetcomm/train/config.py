"""The trainer's settings: one dataclass, filled from the command line and checked
before any process starts, so that bad input is one clear message and nothing runs."""

import argparse
import math
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hetcomm.amp import PRECISIONS
from hetcomm.balance.rebalancer import THRESHOLD
from hetcomm.train.data import VOCAB_SCAN_MAX_TOKENS, load_windows
from hetcomm.per_rank import parse_per_rank
from hetcomm.simulated import parse_slowdown, parse_speeds

DEFAULT_CPU_SPEEDS = (1.0, 1.0, 0.5, 0.25)   # relative; scaled to fit the machine's cores
WIRES = ("float16", "float32", "bfloat16")
WEIGHTS = ("compute", "fp32")
SHARD_MODES = ("state", "full")
ARCHS = ("gpt", "llama")
OFFLOADS = ("optimizer",)
BALANCE = ("dynamic", "static", "equal")


@dataclass
class TrainConfig:
    # the job
    steps: int = 150
    global_batch: int = 48        # training windows per optimizer step, over all ranks
    block_size: int = 128
    # the model: hetcomm.train.model's GPT, or hetcomm.train.llama's Llama-style decoder
    arch: str = "gpt"
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 192
    n_kv_head: int | None = None      # llama: key/value heads (grouped-query attention); None: n_head
    intermediate: int | None = None   # llama: the SwiGLU MLP's width; None: 8/3 n_embd rounded up to 64
    dropout: float = 0.0
    # optimisation: AdamW, linear warm-up then cosine decay to min_lr
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    wire: str = "float16"
    precision: str = "auto"       # auto: by device generation (hetcomm.amp); or fp32 / fp16 / bf16 everywhere
    weights: str = "compute"      # compute: 16-bit weights + fp32 masters when computing in 16-bit; fp32: autocast
    loss_scale: float = 2.0**12   # initial dynamic loss scale (fp16 wire or fp16 compute)
    # balancing
    balance: str = "dynamic"      # dynamic: rebalance while training; static: one profile; equal: no balancing
    equal_steps: int = 4          # the first steps run the equal split: baseline and first profile
    rebalance_threshold: float = THRESHOLD
    handoff: bool = True          # dynamic: a straggler hands samples to the others within the step
    overlap: bool = True          # send the gradients' buckets during the last backward
    split: str | None = None      # a fixed split, e.g. "3,5": no balancing at all
    memory_caps: str | None = None
    # sharding
    # "state" (or True): the optimizer state only on each range's owner, ranges sized by memory;
    # "full": the weights too, each layer gathered while it computes, the gradients streamed
    shard: bool | str = False
    state_memory: str | None = None   # bytes per rank left for that state; default: probed on GPUs, host's on CPUs
    offload: str | None = None    # "optimizer": the sharded optimizer state in host memory, stepped there
    # activation checkpointing per block: "off", "on", or per rank ("on,on,off,off", as the planner prints)
    checkpointing: str = "off"
    # the cluster
    nproc: int | None = None
    device: str = "auto"          # auto: cuda if available, else cpu
    speeds: str | None = None
    slowdown: list[str] = field(default_factory=list)
    # data and files
    data: str | None = None
    vocab_size: int | None = None   # None: 256 for byte data, a .bin file's largest token + 1 (hetcomm.train.data)
    out: str = "runs/latest"
    resume: str | None = None     # a checkpoint; without one, the newest valid one in --out is resumed
    fresh: bool = False           # start over in --out, removing its checkpoints
    data_changed: bool = False    # resume although --data's content differs from the checkpoint's
    data_fingerprint: dict | None = None   # not an option: --data's, set by the launcher (train.data_fingerprint)
    checkpoint_every: int = 0
    keep: int = 3                 # checkpoints kept in --out
    timeout: float = 600.0        # seconds a collective may wait for a rank before the run stops
    seed: int = 0
    progress: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hetcomm train",
        description="Train a GPT (or a Llama-style model: --arch llama) data-parallel across devices of "
                    "different speeds, each rank getting the share "
                    "of the global batch it can finish in the same time. Without arguments on a machine without "
                    "GPUs: a simulated cluster of 4 CPU workers with speeds 1, 1, 0.5 and 0.25.",
        epilog="Under torchrun (env://) it joins the job it is given: torchrun --nproc-per-node 4 -m hetcomm train")
    d = TrainConfig()
    job = p.add_argument_group("job")
    job.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    job.add_argument("--global-batch", type=int, default=d.global_batch,
                     help="windows per optimizer step over all ranks (default %(default)s)")
    job.add_argument("--block-size", type=int, default=d.block_size, help="tokens per window (default %(default)s)")
    model = p.add_argument_group("model")
    model.add_argument("--arch", choices=ARCHS, default=d.arch,
                       help="gpt: nanoGPT's (LayerNorm, GELU MLP, learned positions, biases); llama: a Llama-style "
                            "decoder (RMSNorm, SwiGLU MLP, grouped-query attention, rotary positions, no biases; "
                            "the computation of transformers' LlamaForCausalLM) (default %(default)s)")
    model.add_argument("--n-layer", type=int, default=d.n_layer)
    model.add_argument("--n-head", type=int, default=d.n_head)
    model.add_argument("--n-embd", type=int, default=d.n_embd)
    model.add_argument("--n-kv-head", type=int,
                       help="with --arch llama: key/value heads, a divisor of --n-head (default: --n-head)")
    model.add_argument("--intermediate", type=int,
                       help="with --arch llama: the SwiGLU MLP's width (default: 8/3 --n-embd rounded up to a "
                            "multiple of 64)")
    model.add_argument("--dropout", type=float, default=d.dropout,
                       help="gpt: on attention, residual and MLP outputs; llama: on the attention probabilities")
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--lr", type=float, default=d.lr)
    opt.add_argument("--min-lr", type=float, default=d.min_lr)
    opt.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    opt.add_argument("--weight-decay", type=float, default=d.weight_decay)
    opt.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max global grad norm (0: off)")
    opt.add_argument("--wire", choices=WIRES, default=d.wire, help="gradient all-reduce dtype (default %(default)s)")
    opt.add_argument("--loss-scale", type=float, default=d.loss_scale, help="initial dynamic loss scale")
    opt.add_argument("--precision", choices=("auto", *PRECISIONS), default=d.precision,
                     help="compute precision: auto picks per device (fp32 on CPUs, fp16 before sm_80, "
                          "bf16 on sm_80+), or one for every rank (default %(default)s)")
    opt.add_argument("--weights", choices=WEIGHTS, default=d.weights,
                     help="when computing in 16-bit: compute = the model's weights in 16-bit with fp32 master "
                          "copies for the optimizer, refreshed by one fused cast per step; fp32 = fp32 weights "
                          "under autocast (default %(default)s)")
    bal = p.add_argument_group("balancing")
    bal.add_argument("--balance", choices=BALANCE, default=d.balance,
                     help="dynamic: profile, then rebalance while training; static: one split from the first "
                          "profile (FastSpeed-style); equal: every rank the same share")
    bal.add_argument("--equal-steps", type=int, default=d.equal_steps,
                     help="steps run with the equal split first: the baseline and the first profile; 0: start "
                          "from timing each rank on a part of the first step instead (default %(default)s)")
    bal.add_argument("--rebalance-threshold", type=float, default=d.rebalance_threshold,
                     help="adopt a new split only if it predicts this much less step time (default %(default)s)")
    bal.add_argument("--no-handoff", dest="handoff", action="store_false",
                     help="with --balance dynamic: do not let a rank that falls far behind within a step (a "
                          "card that starts throttling) hand its remaining windows to the others in that step")
    bal.add_argument("--no-overlap", dest="overlap", action="store_false",
                     help="send the gradients only after the step's last backward, not bucket by bucket during it")
    bal.add_argument("--split", help="a fixed split of the global batch, one count per rank (e.g. 12,12,6,2); "
                                     "overrides --balance")
    bal.add_argument("--memory-caps", help="largest micro-batch per rank, e.g. 16,16,8,4 (more becomes gradient "
                                           "accumulation); default: found on GPUs by running the real step at "
                                           "growing sizes, none on CPUs")
    shard = p.add_argument_group("sharding (models larger than the smallest card)")
    shard.add_argument("--shard", nargs="?", const="state", default=False, choices=SHARD_MODES,
                       help="state (the default of a bare --shard): keep the optimizer state (fp32 masters, AdamW's "
                            "moments) only on the rank that owns each range of the weights, ranges sized by each "
                            "rank's memory, every rank keeping the weights and gradients (16-bit when computing in "
                            "16-bit); full: the weights too, each transformer block gathered for its forward and "
                            "backward, the gradients reduced onto their owners block by block (on GPUs give "
                            "--state-memory and --memory-caps: hetcomm plan --shard full prints them)")
    shard.add_argument("--state-memory",
                       help="with --shard: bytes each rank has left for its range of the state, e.g. 9G,9G,9G,28G "
                            "(suffixes K, M, G); default: measured on GPUs after one window's forward and backward, "
                            "the host's available memory shared equally on CPUs")
    shard.add_argument("--offload", choices=OFFLOADS, default=d.offload,
                       help="with --shard: optimizer = keep each rank's range of the optimizer state (fp32 masters, "
                            "AdamW's moments) in host memory (pinned), stepped there by the CPU AdamW kernel from "
                            "its reduced gradient range copied down, the new weights copied up (18 bytes an element "
                            "of host memory, 16 for fp32 weights). With --shard full, --state-memory is still the "
                            "device's room (the range's weights and gradient sum); with --shard state it is each "
                            "rank's share of its host's memory for the state, and the ranges are equal without it")
    shard.add_argument("--checkpointing", default=d.checkpointing,
                       help="activation checkpointing per transformer block: each keeps only its input and "
                            "recomputes its forward in its backward (about a third more compute for the blocks); "
                            "off (default), on, or one on/off per rank, e.g. on,on,on,off: the cards whose memory "
                            "needs it, as hetcomm plan --shard full --checkpointing auto decides and prints")
    cluster = p.add_argument_group("cluster")
    cluster.add_argument("--nproc", type=int, help="local worker processes (default: the GPUs, or 4 CPU workers)")
    cluster.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device)
    cluster.add_argument("--speeds", help="simulated speed factor per rank, e.g. 1,1,0.5,0.25 (the CPU default: those "
                                              "ratios, scaled down to keep at most 75%% of the cores busy)")
    cluster.add_argument("--slowdown", action="append", default=[], metavar="RANK:STEP:FACTOR",
                         help="simulate a card that slows down: rank RANK runs FACTOR times as fast from STEP on")
    files = p.add_argument_group("data and files")
    files.add_argument("--data", help="a text file (byte tokens) or a uint16 .bin of tokens; default: Python's "
                                      "standard-library sources")
    files.add_argument("--vocab-size", type=int,
                       help="the model's vocabulary, e.g. 50257 for GPT-2's tokenizer (nanoGPT's prepared .bin "
                            "files); default: 256 for a text file, the largest token id + 1 of a .bin file of up to "
                            f"{VOCAB_SCAN_MAX_TOKENS // 2**20} Mi tokens (a larger one needs --vocab-size)")
    files.add_argument("--out", default=d.out, help="run directory: log, checkpoints, plots (default %(default)s)")
    files.add_argument("--resume", help="checkpoint to continue from (default: the newest valid checkpoint of "
                                        "the same run in --out, when the run there is unfinished: a restarted job "
                                        "goes on where it stopped)")
    files.add_argument("--fresh", action="store_true", help="start over in --out: remove its checkpoints first")
    files.add_argument("--data-changed", action="store_true",
                       help="resume although --data's content is not what the checkpoint was trained on (it was "
                            "regenerated or edited on purpose); without it such a resume is refused")
    files.add_argument("--keep", type=int, default=d.keep, help="checkpoints kept in --out (default %(default)s)")
    files.add_argument("--timeout", type=float, default=d.timeout,
                       help="seconds to wait for a stalled or lost rank in any collective before stopping every "
                            "rank with that message (default %(default)s)")
    files.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints "
                                                                                          "(0: only at the end)")
    files.add_argument("--seed", type=int, default=d.seed)
    files.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    files.add_argument("--debug", action="store_true",
                       help="when a rank fails, print its traceback too, not only the one-line error")
    return p


def full_shard(config: TrainConfig) -> bool:
    """Whether --shard full: the weights sharded too."""
    return config.shard == "full"


def from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__})


def validate(config: TrainConfig, world_size: int) -> None:
    """Raises ValueError naming the option for every setting that cannot work."""
    _check_finite(config)
    positive = {"--steps": config.steps, "--global-batch": config.global_batch, "--block-size": config.block_size,
                "--lr": config.lr, "--loss-scale": config.loss_scale, "--keep": config.keep,
                "--timeout": config.timeout}
    for name, value in positive.items():
        if not value > 0:
            raise ValueError(f"{name} must be positive; got {value}")
    for name, value in {"--min-lr": config.min_lr, "--warmup-steps": config.warmup_steps,
                        "--weight-decay": config.weight_decay, "--grad-clip": config.grad_clip,
                        "--equal-steps": config.equal_steps, "--checkpoint-every": config.checkpoint_every}.items():
        if value < 0:
            raise ValueError(f"{name} must not be negative; got {value}")
    _check_model(config)
    if config.vocab_size is not None and (not isinstance(config.vocab_size, int) or config.vocab_size < 1):
        raise ValueError(f"--vocab-size must be a positive integer; got {config.vocab_size!r}")
    if config.global_batch < world_size:
        raise ValueError(f"--global-batch {config.global_batch} is smaller than the {world_size} ranks: every rank "
                         f"needs at least one window per step at the start; use --global-batch {world_size} or more")
    if config.speeds is not None:
        parse_speeds(config.speeds, world_size)
    for text in config.slowdown:
        parse_slowdown(text, world_size)
    if config.memory_caps is not None:
        parse_caps(config.memory_caps, world_size)
    if config.split is not None:
        parse_split(config.split, world_size, config.global_batch)
    if config.shard not in (False, True, *SHARD_MODES):
        raise ValueError(f"--shard {config.shard!r}: expected one of {', '.join(SHARD_MODES)}")
    if full_shard(config) and not config_device_is_cpu(config) \
            and (config.state_memory is None or config.memory_caps is None):
        raise ValueError("--shard full on GPUs needs --state-memory and --memory-caps (hetcomm plan --shard full "
                         "prints both): probing a card's room would hold the whole model, and every rank's "
                         "micro-batches must be known to align their layers' gathers")
    if config.offload is not None:
        if config.offload not in OFFLOADS:
            raise ValueError(f"--offload {config.offload!r}: expected one of {', '.join(OFFLOADS)}")
        if not config.shard:
            raise ValueError("--offload optimizer offloads the sharded optimizer state; add --shard (state or full) "
                             "or leave it out")
    parse_checkpointing(config.checkpointing, world_size)
    if config.state_memory is not None:
        if not config.shard:
            raise ValueError("--state-memory sizes the ranges of --shard; add --shard or leave it out")
        parse_state_memory(config.state_memory, world_size)
    if config.wire == "bfloat16" and config_device_is_cpu(config):
        raise ValueError("--wire bfloat16 needs NCCL (GPUs): the Gloo backend of CPU runs cannot all-reduce "
                         "bfloat16; use --wire float16 or float32")


def _option(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _check_finite(config: TrainConfig) -> None:
    """NaN passes every `value < 0` test and inf every `value > 0` one, and either makes
    the weights NaN or a setting silently off: refuse them first, by name."""
    for name, value in asdict(config).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{_option(name)} must be a finite number; got {value}")


def _check_model(config: TrainConfig) -> None:
    """The model's shape, checked here: the GPT built in every rank would refuse it
    only after the processes have started."""
    if config.arch not in ARCHS:
        raise ValueError(f"--arch {config.arch!r}: expected one of {', '.join(ARCHS)}")
    for name in ("n_layer", "n_head", "n_embd"):
        if getattr(config, name) < 1:
            raise ValueError(f"{_option(name)} must be at least 1; got {getattr(config, name)}")
    if config.n_embd % config.n_head:
        raise ValueError(f"--n-embd {config.n_embd} must be a multiple of --n-head {config.n_head}: each head "
                         f"gets n_embd / n_head channels")
    if config.arch != "llama":
        for name in ("n_kv_head", "intermediate"):
            if getattr(config, name) is not None:
                raise ValueError(f"{_option(name)} shapes a Llama-style model; add --arch llama or leave it out")
    else:
        for name in ("n_kv_head", "intermediate"):
            if getattr(config, name) is not None and getattr(config, name) < 1:
                raise ValueError(f"{_option(name)} must be at least 1; got {getattr(config, name)}")
        if config.n_kv_head is not None and config.n_head % config.n_kv_head:
            raise ValueError(f"--n-head {config.n_head} must be a multiple of --n-kv-head {config.n_kv_head}: "
                             f"each key/value head serves a group of query heads")
        if (config.n_embd // config.n_head) % 2:
            raise ValueError(f"--n-embd {config.n_embd} / --n-head {config.n_head} = {config.n_embd // config.n_head} "
                             f"channels a head: rotary positions need an even number (they turn pairs of channels)")
    if not 0 <= config.dropout < 1:
        raise ValueError(f"--dropout must be in [0, 1); got {config.dropout}")
    if config.rebalance_threshold < 0:
        raise ValueError(f"--rebalance-threshold must not be negative (0.01: a 1% faster predicted step); got "
                         f"{config.rebalance_threshold}")


def check_data(config: TrainConfig) -> None:
    """Opens --data as every rank will (a memory map: cheap) and checks that it holds
    a global batch of windows and no token id outside --vocab-size, so that bad data is
    one message before any process starts."""
    windows, description = load_windows(config.data, config.block_size, config.vocab_size)
    if len(windows) < config.global_batch:
        raise ValueError(f"--data ({description}) holds {len(windows)} windows of --block-size {config.block_size} "
                         f"tokens, fewer than --global-batch {config.global_batch}; use more data, a smaller "
                         f"--block-size or a smaller --global-batch")
    tokens = windows.tokens
    # Only data small enough to scan: a larger file is checked window by window as it trains.
    if config.vocab_size is not None and tokens.size <= VOCAB_SCAN_MAX_TOKENS:
        largest = int(tokens.max())
        if largest >= config.vocab_size:
            raise ValueError(f"--vocab-size {config.vocab_size} is too small for --data ({description}): it "
                             f"holds token id {largest}; use --vocab-size {largest + 1} or more")


def check_out(out: str) -> None:
    """--out must be a directory this process can create or write into: checked with
    os.access on the nearest existing directory, then by creating and removing a
    directory there, which nothing but trying tells (a read-only mount, /proc), so that
    nothing is left behind and no rank fails on it later."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--out {out}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {existing} is not writable")
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".hetcomm-out-check-"))
    except OSError as error:
        raise ValueError(f"--out {out}: nothing can be created in {existing} ({error.strerror})") from None


def config_device_is_cpu(config: TrainConfig) -> bool:
    import torch

    return config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())


def parse_caps(text: str, world_size: int) -> list[int]:
    caps = parse_per_rank("--memory-caps", text, world_size, int, "16,16,8,4")
    if any(c < 1 for c in caps):
        raise ValueError(f"--memory-caps {text!r}: a rank that cannot hold one window of --block-size tokens "
                         f"cannot train; every cap must be at least 1 (larger batches become accumulation)")
    return caps


def parse_split(text: str, world_size: int, global_batch: int) -> tuple[int, ...]:
    split = tuple(parse_per_rank("--split", text, world_size, int, "12,12,6,2"))
    if any(b < 0 for b in split) or sum(split) != global_batch:
        raise ValueError(f"--split {text!r}: expected {world_size} non-negative counts adding up to --global-batch "
                         f"{global_batch}")
    return split


BYTE_SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_checkpointing(text: str, world_size: int) -> list[bool]:
    """--checkpointing: off, on, or one on/off per rank -> whether each rank checkpoints."""
    if text in ("off", "on"):
        return [text == "on"] * world_size

    def on_off(word: str) -> bool:
        if word not in ("on", "off"):
            raise ValueError
        return word == "on"

    return parse_per_rank("--checkpointing", text, world_size, on_off, "on,on,off,off (or off, or on)")


def parse_state_memory(text: str, world_size: int) -> list[int]:
    """--state-memory: bytes per rank, each a number with an optional K, M, G or T suffix."""
    def to_bytes(part: str) -> int:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)i?B?\s*", part, re.IGNORECASE)
        if match is None:
            raise ValueError(part)
        return int(float(match.group(1)) * BYTE_SUFFIXES[match.group(2).upper()])

    return parse_per_rank("--state-memory", text, world_size, to_bytes, "9G,9G,9G,28G")
