"""The planner's model of full sharding (`hetcomm plan --shard full [--offload optimizer]
[--checkpointing auto|on|off] [--host-memory GIB]`): ZeRO-3 style, on the flat parameter
space and its owner ranges, with activation checkpointing decided per card and the
optimizer state optionally kept in the host's memory. The runtime follows this model.

Memory, per card (rank), on the device; w the weights' itemsize (2 for 16-bit weights,
4 for fp32 weights, which are their own masters):
- persistent, its own range r of the flat parameter space only: the range's weights (w),
  an fp32 gradient accumulator of the range (4) and, unless offloaded, the optimizer
  state: an fp32 master (4, none for fp32 weights) and AdamW's two fp32 moments (8).
  18 bytes an element for 16-bit weights (6 offloaded); 16 for fp32 weights (8 offloaded);
- transient, as hetcomm.shard.weights and hetcomm.shard.streamed hold them: the root
  (every parameter outside the blocks: the embeddings, with BERT's token types and norm,
  a tied or untied head, the final norm), gathered for the model's whole forward and
  backward, and at most two blocks gathered beside it (the one computing and the next,
  prefetched): (root + 2 x the largest block) x w; and gradients as many, in the weights'
  dtype (the root's, which the backward accumulates until its end, a block's being
  computed and one on the wire): (root + 2 x the largest block) x w;
- the activations of its micro-batch: without checkpointing as the unsharded planner
  counts them (hetcomm.plan.model_shape, llama_shape); with checkpointing each block
  keeps only its input, the fp32 residual stream (seq x hidden x 4 bytes a sample, in
  every precision: autocast leaves the residual adds in fp32), and the backward holds one
  block's full activations besides (its recompute), beside what is kept outside the
  blocks (the head's input, the log-softmax and, at the peak, the loss's gradients). For
  the models hetcomm train builds (GPT, Llama) checkpointing covers the loss too
  (hetcomm.train.chunked_loss): nothing vocabulary-wide is kept per sample, and the
  backward holds one chunk's (loss_chunk_tokens of the vocabulary) logits, log-softmax
  and gradients, once per micro-batch; a BERT model's loss stays whole;
- the CUDA context (0.5 GiB, hetcomm.plan.cost.CONTEXT_BYTES).

Checkpointing costs one more forward of the blocks (and of a chunked loss's head): 1/3 of
their forward+backward time (their share of the FLOPs of the sample's per-sample time),
and the blocks' forward's kernel launches again. `--checkpointing on`/`off` force it on every card; `auto` (the
default) turns it on for a card whose samples (as the balancer's solver splits the global
batch by speed) do not fit one micro-batch without it, or for one that cannot hold one
sample without it, and leaves it off elsewhere; the solver then splits again under the
caps that follow.

Ranges: as for `--shard` (hetcomm.plan.shard), in three steps:
1. each card's room is its usable memory less the context, the transient part and one
   sample's activations (checkpointed, unless `off`); a card whose room cannot hold
   MIN_RANGE elements is left out, and the plan fails when the rooms together cannot hold
   every element's persistent bytes;
2. the persistent part takes the same share f of every card's room; each card's
   micro-batch cap is what its activations (checkpointed or not) may grow into in the
   rest, and the solver splits the global batch by speed under those caps;
3. each card's range r_i is proportional to its memory left beside its planned
   micro-batch's activations and the transient part, floored to ALIGN elements, with
   sum r_i = the elements.

Offload (`--offload optimizer`): a rank's masters and moments live in pinned host memory
with an fp32 copy of its reduced gradient range and the new 16-bit weights' staging: 18 bytes
an element (16 with fp32 weights: hetcomm.shard.layout.host_bytes_per_element), summed
over a machine's cards and checked against its RAM (`--host-memory`,
GiB, one figure for every machine or one per machine, default 64). Each step each card
copies its range's fp32 gradient down (4 bytes an element) and the new weights up (w) at
its PCIe bandwidth, and the host's CPU AdamW (hetcomm's adamw_ CPU kernel) steps all of
the machine's ranges at the host's memory bandwidth (28 bytes an element at
HOST_BANDWIDTH_GBS). The PCIe figures are per-generation defaults, by the card's
architecture (PCIE_GBS): gen3 x16 about 12 GB/s effective for Pascal, Volta and Turing;
gen4 x16 about 24 GB/s for Ampere and Ada (the L4); gen5 about 48 GB/s for Hopper; each
card on its own x16 link. The copy down is waited for; the host's update and the copy up
overlap the next forward (ShardedAdamW's overlap on GPUs: each layer unit's part is
stepped and copied up just before the unit's next gather): the step waits for the first
unit's share of them (the root: the embeddings) and for what the rest exceeds one
micro-step's forward (a third of its compute) by, on the slowest card's machine
(offload_update_seconds).

A step: every micro-step gathers each unit's weights twice (forward, and again for the
backward) and reduce-scatters its gradients onto the owners (into their fp32
accumulators): per rank (N-1)/N x elements x w for each all-gather and (N-1)/N x elements x
the wire's bytes for the reduce-scatter, 1.5x a ring all-reduce at a 16-bit wire, every
unit paying N-1 latencies per collective. The collectives couple the ranks micro-step by
micro-step, so a rank with fewer micro-steps than the others still joins the rest: the
compute is lock-step, the sum over micro-steps of the slowest rank's micro-step in each.
The planner assumes the gathers overlap with compute except the first unit's, and the
reduce-scatter overlaps the backward except the last unit's (the embeddings, in both
cases), unless the collectives take longer than the compute: exposed = max(micro-steps x
(the first unit's gather + the last unit's reduce-scatter), collectives - compute). Then
each owner's update: the fused AdamW over its range on the device (fp32 gradient read, 4;
master and moments read and written, 24; 16-bit weight written, 2: 30 bytes an element at
the card's bandwidth x 0.7; 28 for fp32 weights), or offloaded as above. The step pays
the slowest:

    step = lock-step compute (with recompute) + exposed gathers/reduces + slowest update.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hetcomm.plan.catalog import Device, Link
from hetcomm.plan.cost import (CONTEXT_BYTES, KERNELS_PER_LAYER, SECONDS_PER_KERNEL, STORAGE,
                               AllReduceCost)
from hetcomm.plan.model_shape import BERT_POSITIONS, BERT_TOKEN_TYPES
from hetcomm.plan.shard import DTYPES, MIN_RANGE, weight_dtype
from hetcomm.shard.layout import host_bytes_per_element as runtime_host_bytes
from hetcomm.train.chunked_loss import loss_chunk_tokens

GIB = 2**30
ALIGN = 16                     # range boundaries, as hetcomm.shard.layout's
CHECKPOINTING = ("auto", "on", "off")
OFFLOADS = ("optimizer",)
HOST_MEMORY_GIB = 64.0         # default RAM per machine
HOST_BANDWIDTH_GBS = 20.0      # the CPU AdamW's effective memory bandwidth (a default)
HOST_UPDATE_BYTES = 28         # fp32 gradient read, master and moments read and written
RESIDUAL_BYTES = 4             # the block input a checkpoint keeps: the fp32 residual stream
RECOMPUTE_SHARE = 1 / 3        # one more forward of the blocks: 1/3 of their forward+backward
# PCIe x16, effective GB/s, per architecture's generation.
PCIE_GBS = {"Pascal": 12.0, "Volta": 12.0, "Turing": 12.0, "Ampere": 24.0, "Ada": 24.0, "Hopper": 48.0}
PCIE_DEFAULT_GBS = 12.0


def persistent_bytes_per_element(weights: str, offload: bool) -> int:
    """Weights of the range, its fp32 gradient accumulator and, unless offloaded, the state."""
    w = DTYPES[weights].itemsize
    state = 8 if weights == "fp32" else 12
    return w + 4 + (0 if offload else state)


def host_bytes_per_element(weights: str) -> int:
    """Offloaded, the runtime's own rule (hetcomm.shard.layout): the fp32 params AdamW
    steps, two moments, fp32 gradient staging, and 16-bit weights' staging on their way up."""
    return runtime_host_bytes(DTYPES[weights])


def device_update_bytes_per_element(weights: str) -> int:
    """The fused AdamW over a range with an fp32 gradient accumulator."""
    return 4 + 8 + 16 if weights == "fp32" else 4 + 24 + 2


def offload_update_seconds(down: float, up: float, host: float, first_share: float, forward: float) -> float:
    """What an offloaded update adds to the step: the copy down, then the first unit's
    share of the host's update and of the copy up, then what the rest of them leaves
    over once the forward they overlap (`forward` seconds) is done."""
    later = host + up
    return down + first_share * later + max(0.0, (1 - first_share) * later - forward)


def pcie_gbs(device: Device | None) -> float:
    return PCIE_GBS.get(device.architecture, PCIE_DEFAULT_GBS) if device else PCIE_DEFAULT_GBS


def layer_units(model, seq: int) -> tuple[int, ...]:
    """Elements of each layer unit in forward order (adding up to the parameters):
    the embeddings, one per block (the final norm with the last), an untied head."""
    parameters = model.parameters(seq)
    h = model.n_embd
    if model.kind == "llama":
        block = model.layer_parameters()
        embeddings = model.vocab_size * h
        head = 0 if model.tied else model.vocab_size * h
        final = h
    elif model.kind == "bert":
        block = 12 * h * h + 13 * h
        embeddings = (model.vocab_size + BERT_POSITIONS + BERT_TOKEN_TYPES) * h + 2 * h
        head = parameters - embeddings - model.n_layer * block
        final = 0
    else:
        block = 12 * h * h + 13 * h
        head = 0
        final = 2 * h
        embeddings = parameters - model.n_layer * block - final
    units = (embeddings, *([block] * (model.n_layer - 1)), block + final) + ((head,) if head else ())
    assert sum(units) == parameters, (units, parameters)
    return units


def transient_elements(units: Sequence[int], blocks: int) -> int:
    """The root (every unit but the `blocks` after the first, see layer_units) and the
    two largest blocks: what a rank holds gathered at most, and as many gradients."""
    inner = units[1:1 + blocks]
    return sum(units) - sum(inner) + sum(sorted(inner)[-2:])


def block_activation_bytes(model, seq: int, kept: str, attention: str, gelu: str) -> float:
    """One block's full activations per sample (what a checkpointed block recomputes)."""
    twice = replace(model, n_layer=2 * model.n_layer)
    return (twice.activation_bytes_per_sample(seq, kept, attention, gelu)
            - model.activation_bytes_per_sample(seq, kept, attention, gelu)) / model.n_layer


def chunks_loss(model) -> bool:
    """Whether checkpointing computes the model's loss chunk by chunk: hetcomm train's
    models (GPT, Llama) do; a BERT model is the user's own."""
    return model.kind in ("gpt", "llama")


def loss_bytes_per_token(model, seq: int, kept: str, attention: str, gelu: str) -> float:
    """The vocabulary-wide part of a token's activations at the peak: the log-softmax, the
    loss's gradients and what else the model counts per vocabulary entry."""
    twice = replace(model, vocab_size=2 * model.vocab_size)
    return (twice.activation_bytes_per_sample(seq, kept, attention, gelu)
            - model.activation_bytes_per_sample(seq, kept, attention, gelu)) / seq


def loss_chunk_bytes(model, seq: int, kept: str, attention: str, gelu: str) -> float:
    """What a chunked loss holds at its peak, once per micro-batch (0: a whole loss)."""
    if not chunks_loss(model):
        return 0.0
    return loss_bytes_per_token(model, seq, kept, attention, gelu) * loss_chunk_tokens(model.vocab_size)


def checkpointed_activation_bytes(model, seq: int, kept: str, attention: str, gelu: str) -> float:
    """Per sample with every block checkpointed: each block's fp32 input, one block's
    full activations (the recompute in the backward) and what is kept outside the blocks
    (without the vocabulary-wide loss where it is chunked: loss_chunk_bytes)."""
    full = model.activation_bytes_per_sample(seq, kept, attention, gelu)
    block = block_activation_bytes(model, seq, kept, attention, gelu)
    loss = loss_bytes_per_token(model, seq, kept, attention, gelu) * seq if chunks_loss(model) else 0.0
    return full - loss - model.n_layer * block + model.n_layer * RESIDUAL_BYTES * seq * model.n_embd + block


def recomputed_flops_share(model, seq: int) -> float:
    """The share of a sample's FLOPs a recompute repeats a third of: the blocks', and the
    head's where the loss is chunked."""
    twice = replace(model, n_layer=2 * model.n_layer)
    blocks = twice.flops_per_sample(seq) - model.flops_per_sample(seq)
    head = 6 * model.vocab_size * model.n_embd * seq if chunks_loss(model) else 0
    return (blocks + head) / model.flops_per_sample(seq)


@dataclass(frozen=True)
class FullCard:
    """One card's part of a fully sharded plan (bytes, seconds)."""

    micro_batch: int              # the planned micro-batch
    checkpointing: bool
    elements: int                 # its range of the flat parameter space
    weights_bytes: int            # its range's weights
    gradient_bytes: int           # its range's fp32 gradient accumulator
    state_bytes: int              # masters and moments on the device (0 when offloaded)
    gathered_bytes: int           # the root and two blocks gathered
    unit_gradient_bytes: int      # as many gradients
    context_bytes: float
    activation_bytes: float       # of its planned micro-batch
    activation_per_sample: float  # checkpointed or not
    usable_bytes: float
    free_bytes: float             # usable less context, transient and activations: what its range is sized by
    host_bytes: int               # offloaded state and gradient staging, in its machine's RAM
    pcie_seconds: float           # offload: gradient range down, weights up
    update_seconds: float         # what its range's update adds to the step: on the device, or offloaded
    #                               (offload_update_seconds)
    host_seconds: float = 0.0     # offload: its machine's CPU update, hidden or not

    @property
    def persistent_bytes(self) -> int:
        return self.weights_bytes + self.gradient_bytes + self.state_bytes

    @property
    def transient_bytes(self) -> int:
        return self.gathered_bytes + self.unit_gradient_bytes

    @property
    def held_bytes(self) -> float:
        return self.context_bytes + self.persistent_bytes + self.transient_bytes + self.activation_bytes


@dataclass(frozen=True)
class HostMemory:
    machine: int
    cards: int
    used_bytes: int
    limit_bytes: float
    update_seconds: float         # the CPU AdamW over the machine's ranges


@dataclass(frozen=True)
class FullShardPlan:
    weight_dtype: str
    offload: bool
    checkpointing: str            # the mode asked for: auto, on or off
    persistent_bytes_per_element: int
    units: tuple[int, ...]
    cards: tuple[FullCard, ...]
    all_gather: AllReduceCost     # one all-gather of every weight (a micro-step has two)
    reduce_scatter: AllReduceCost  # one reduce-scatter of every gradient
    micro_steps: int              # lock-step rounds of collectives per optimizer step
    first_unit_s: float           # the first unit's gather + the last unit's reduce-scatter, not hidden
    collectives_s: float          # every round's two all-gathers and reduce-scatter
    slowest_update: int
    host: tuple[HostMemory, ...] = ()

    @property
    def elements(self) -> int:
        return sum(card.elements for card in self.cards)

    @property
    def largest_unit(self) -> int:
        return max(self.units)


def parse_host_memory(text: str | None, machines: int) -> tuple[float, ...]:
    """--host-memory: GiB, one figure for every machine or one per machine."""
    if text is None:
        return (HOST_MEMORY_GIB,) * machines
    parts = [part.strip() for part in str(text).split(",")]
    try:
        values = [float(part) for part in parts]
    except ValueError:
        raise ValueError(f"--host-memory {text!r}: expected GiB of RAM, one figure for every machine or one per "
                         f"machine, such as 64 or 64,128") from None
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"--host-memory {text!r}: expected positive GiB")
    if len(values) == 1:
        return tuple(values) * machines
    if len(values) != machines:
        raise ValueError(f"--host-memory {text!r}: {len(values)} figures for {machines} machines; give one for every "
                         f"machine or one per machine")
    return tuple(values)


def micro_steps(size: int, cap: int) -> tuple[int, ...]:
    """The solver's micro-steps of a rank's samples: ceil(b / m) of near-equal size, larger first."""
    if size == 0:
        return ()
    count = -(-size // cap)
    quotient, remainder = divmod(size, count)
    return (quotient + 1,) * remainder + (quotient,) * (count - remainder)


def lock_step_compute(members, micro_batches: Sequence[Sequence[int]]) -> tuple[float, int]:
    """Sum over micro-steps of the slowest rank's micro-step (a rank with none left waits
    in the collectives), and the number of micro-steps."""
    rounds = max(len(micro) for micro in micro_batches)
    total = 0.0
    for r in range(rounds):
        total += max((m.cost.fixed + m.cost.per_sample * sorted(micro, reverse=True)[r]
                      for m, micro in zip(members, micro_batches) if r < len(micro)), default=0.0)
    return total, rounds


def _collective(ranks: int, elements: int, item: int, units: int, link: Link, what: str) -> AllReduceCost:
    if ranks < 2:
        return AllReduceCost(0.0, 0.0, 0, "none")
    sent = (ranks - 1) / ranks * elements * item
    return AllReduceCost(sent / (link.bandwidth_gbs * 1e9) + units * (ranks - 1) * link.latency_us * 1e-6, sent,
                         units, what)


@dataclass(frozen=True)
class _Card:
    """A member's memory figures before the split."""

    member: object
    base: float          # usable less context and transient
    off: float           # activations per sample without checkpointing
    on: float            # with
    chunk: float         # with, once per micro-batch: a chunked loss's peak

    def activations(self, checkpointing: bool, micro_batch: int) -> float:
        return self.on * micro_batch + self.chunk if checkpointing else self.off * micro_batch


class FullShardDoesNotFit(ValueError):
    def __init__(self, message: str, short: float):
        super().__init__(message)
        self.short = short


def full_room(members, model, seq: int, checkpointing: str, offload: bool):
    """Steps 1 and 2: who takes part (with the reasons of those left out), the weights'
    dtype, each card's figures and its state budget (bytes kept for its range)."""
    missing = [m for m in members if not m.cost.memory_bytes]
    if missing:
        raise ValueError(f"--shard full needs each card's memory, and {missing[0].label} has none known (a CPU rank, "
                         f"or a run's measured ranks: plan them with --cluster and --profile to calibrate)")
    parameters = model.parameters(seq)
    units = layer_units(model, seq)
    candidates = list(members)
    while True:
        weights = weight_dtype(candidates)
        w = DTYPES[weights].itemsize
        per = persistent_bytes_per_element(weights, offload)
        transient = 2 * transient_elements(units, model.n_layer) * w
        cards = {}
        for m in candidates:
            kept = STORAGE[m.cost.precision]
            on = checkpointed_activation_bytes(model, seq, kept, m.cost.attention, m.cost.gelu)
            chunk = loss_chunk_bytes(model, seq, kept, m.cost.attention, m.cost.gelu)
            cards[id(m)] = _Card(m, m.cost.memory_bytes - CONTEXT_BYTES - transient, m.cost.activation_bytes, on,
                                 chunk)
        least = per * min(MIN_RANGE, parameters)

        def smallest(card):
            return card.off if checkpointing == "off" else min(card.activations(True, 1), card.off)

        fits = [m for m in candidates if cards[id(m)].base - smallest(cards[id(m)]) >= least]
        if not fits or len(fits) == len(candidates) or weight_dtype(fits) == weights:
            break
        candidates = fits
    left_out = []
    for m in members:
        if m in fits:
            continue
        card = cards.get(id(m))
        if card is None:   # left out before the last round's dtype
            left_out.append((m, "too little memory for its range of the fully sharded model"))
            continue
        activations = smallest(card)
        how = "one sample's activations" + ("" if checkpointing == "off" else ", checkpointed,")
        left_out.append((m, f"the CUDA context, the root's and two blocks' gathered weights and gradients "
                            f"({transient / GIB:.2f} GiB) and {how} ({activations / GIB:.2f} GiB) leave "
                            f"{max(0.0, card.base - activations) / GIB:.2f} GiB of its "
                            f"{m.cost.memory_bytes / GIB:.1f} GiB usable, less than the {least:,} bytes of "
                            f"{MIN_RANGE} elements"))
    figures = [cards[id(m)] for m in fits]
    rooms = [card.base - smallest(card) for card in figures]
    if fits and sum(rooms) < per * parameters:
        short = per * parameters - sum(rooms)
        n = f"{len(fits)} cards have" if len(fits) > 1 else "card has"
        held = "weights and fp32 gradient accumulator" if offload else "weights, fp32 gradient accumulator and " \
                                                                        "optimizer state"
        raise FullShardDoesNotFit(
            f"{model.name} at --seq {seq} does not fit even fully sharded (--shard full"
            f"{' --offload optimizer' if offload else ''}): its {parameters:,} elements need {per} bytes each of "
            f"{held}, {per * parameters / GIB:.2f} GiB, and the {n} {sum(rooms) / GIB:.2f} GiB left for them once "
            f"each holds the CUDA context, the root's and two blocks' gathered weights and gradients and one sample's "
            f"activations{'' if checkpointing == 'off' else ' (checkpointed)'} ({short / GIB:.2f} GiB short)", short)
    return fits, left_out, weights, units, figures, rooms


def full_caps(figures, rooms, parameters: int, per: int):
    """Step 2: each card's cap without and with checkpointing once the persistent part has
    its share of the card's room."""
    share = parameters * per / sum(rooms)
    caps = []
    for card, room in zip(figures, rooms):
        keep = max(per * min(MIN_RANGE, parameters), share * room)
        space = card.base - keep
        caps.append((max(0, math.floor(space / card.off)), max(0, math.floor((space - card.chunk) / card.on))))
    return caps


def checkpointed_member(member, model, seq: int, on: float):
    """The member's cost with every block checkpointed: a third more of the blocks' (and
    a chunked loss's head's) work per sample, the blocks' forward's launches again, the
    checkpointed activations."""
    cost = member.cost
    extra = RECOMPUTE_SHARE * recomputed_flops_share(model, seq)
    return replace(member, cost=replace(cost, per_sample=cost.per_sample * (1 + extra),
                                        fixed=cost.fixed + RECOMPUTE_SHARE * KERNELS_PER_LAYER * model.n_layer
                                        * SECONDS_PER_KERNEL, activation_bytes=on))


def full_ranges(frees: Sequence[float], parameters: int, per: int) -> list[int]:
    """Step 3: ranges proportional to each card's free bytes, floored to ALIGN, adding up
    to the elements, each within what its card holds."""
    capacity = [int(free // per) for free in frees]
    ideal = [parameters * c / sum(capacity) for c in capacity]
    sizes = [int(x) // ALIGN * ALIGN for x in ideal]
    left = parameters - sum(sizes)
    while left > 0:
        rank = max((r for r in range(len(sizes)) if sizes[r] < capacity[r]), key=lambda r: ideal[r] - sizes[r])
        more = min(left, ALIGN, capacity[rank] - sizes[rank])
        sizes[rank] += more
        left -= more
    return sizes
