"""The plan of a cluster: which device takes how many samples of the global batch, in
how many micro-steps, at what precision and memory use, and what the step costs.

The split is the balancer's (hetcomm.balance.solve_split, the exact min-max split with
memory caps, excess becoming accumulation micro-steps): the planner and the trainer
share that solver and its step-time model t_i(b) = ceil(b / m_i)·a_i + c_i·b. The
planner adds what the trainer measures instead: a_i, c_i and m_i from specifications
(hetcomm.plan.cost) or from a calibrating profile, and the all-reduce and the update
that follow the slowest rank's compute:

    step = max_i t_i(b_i) + exposed all-reduce + update.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from hetcomm.balance import Split, equal_split, optimal_rank_times, predict_rank_times, solve_split
from hetcomm.plan.catalog import Device, Link
from hetcomm.plan.cluster import ClusterDevice
from hetcomm.plan.cost import (BANDWIDTH_EFFICIENCY, CONTEXT_BYTES, AllReduceCost, DeviceCost, all_reduce_cost,
                               device_cost, exposed_communication)
from hetcomm.plan.model_shape import ModelShape
from hetcomm.plan.precision import CHOICES as PRECISION_CHOICES, PrecisionChoice
from hetcomm.plan.shard import (DTYPES, UPDATE_BYTES_PER_ELEMENT, ShardPlan, StateDoesNotFit, bucket_elements,
                                shard_collectives, shard_ranges, shard_room, state_bytes_per_element)

WIRE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
BACKWARD_SHARE = 2 / 3   # backward does two of the three matmuls per weight
# A removal must make the step at least this much faster to name a card as slowing the
# cluster down: below it the difference is within what the model can tell.
SLOW_CARD_GAIN = 0.01
JITTER_DRAWS = 4096


@dataclass(frozen=True)
class Member:
    """One device as the planner sees it."""

    name: str          # the catalog's name, or what the profile called it
    label: str
    node: int          # machine index; the ring crosses the network between machines
    cost: DeviceCost
    source: str        # "specification", "specification, calibrated efficiency" or "measured"
    jitter: float = 0.0   # relative spread of its step times (measured; 0 when planned from specifications)
    device: Device | None = None   # the catalog entry it was costed from, if any


@dataclass(frozen=True)
class LeftOut:
    member: Member
    reason: str


@dataclass(frozen=True)
class SlowCard:
    """Cards of one kind whose removal makes the step faster."""

    name: str
    label: str
    removed: int       # how many of them were taken out
    step_s: float      # the step without them
    faster: float      # 1 - step_s / the plan's step


@dataclass(frozen=True)
class Plan:
    model: ModelShape
    seq: int
    global_batch: int
    wire: str
    overlap: bool
    link: Link                    # the slowest link the ring crosses
    members: tuple[Member, ...]   # the devices that train, in rank order
    left_out: tuple[LeftOut, ...]
    split: Split
    compute_s: float              # the slowest rank's compute: expected over the ranks' jitter, if any
    all_reduce: AllReduceCost
    exposed_comm_s: float
    update_s: float
    step_s: float
    equal_step_s: float           # the same cluster with an equal split (accumulating over caps)
    single_device: str            # the fastest member, the Amdahl baseline
    single_device_s: float        # its time for the whole global batch alone
    slow_cards: tuple[SlowCard, ...] = field(default=())
    shard: ShardPlan | None = None   # the optimizer state sharded by memory (--shard)

    @property
    def tokens_per_s(self) -> float:
        return self.global_batch * self.seq / self.step_s

    @property
    def speedup_over_equal(self) -> float:
        return self.equal_step_s / self.step_s

    @property
    def comm_share(self) -> float:
        return self.exposed_comm_s / self.step_s

    @property
    def parallel_fraction(self) -> float | None:
        """Amdahl's p from this plan's speed-up S over the fastest device alone and the
        cluster's size in units of that device, n = sum of throughputs / its throughput:
        S = 1 / ((1 - p) + p / n). None for a cluster of one device's worth."""
        fastest = max(1 / m.cost.per_sample for m in self.members)
        n = sum(1 / m.cost.per_sample for m in self.members) / fastest
        if n <= 1 + 1e-9:
            return None
        speedup = self.single_device_s / self.step_s
        return min(1.0, (1 - 1 / speedup) / (1 - 1 / n))


def ring_link(nodes: set[int], in_node: Link, between_nodes: Link) -> Link:
    """The link that paces a ring: the slower of the two once it crosses machines."""
    if len(nodes) <= 1:
        return in_node
    return min((in_node, between_nodes), key=lambda link: (link.bandwidth_gbs, -link.latency_us))


def spec_members(cluster: Sequence[ClusterDevice], model: ModelShape, seq: int, *,
                 precision: "str | PrecisionChoice" = "auto", wire: str = "fp16", memory_fraction: float = 0.9,
                 efficiency: dict[str, float] | None = None, attention: str = "fused",
                 gelu: str = "fused") -> list[Member]:
    """Members costed from the device database; `precision` is one for all ("auto":
    each card by hetcomm.amp's policy) or a PrecisionChoice per kind of card;
    `efficiency` maps device names to a calibrated share of peak (others get the
    fitted one)."""
    if isinstance(precision, str):
        if precision not in PRECISION_CHOICES:
            raise ValueError(f"--precision {precision!r}: expected one of {', '.join(PRECISION_CHOICES)}")
        precision = PrecisionChoice(precision)
    efficiency = efficiency or {}
    costs: dict[str, DeviceCost] = {}   # one per kind of card: a 10,000-card cluster has a handful
    members = []
    for entry in cluster:
        device = entry.device
        if device.name not in costs:
            costs[device.name] = device_cost(device, model, seq, precision.for_device(device),
                                             wire_bytes=WIRE_BYTES[wire], memory_fraction=memory_fraction,
                                             efficiency=efficiency.get(device.name), attention=attention,
                                             gelu=gelu)
        source = "specification" + (", calibrated efficiency" if device.name in efficiency else "")
        members.append(Member(device.name, device.label, entry.node, costs[device.name], source, device=device))
    return members


def _why_left_out(cost: DeviceCost) -> str:
    gib = 2**30
    if cost.state_bytes >= cost.memory_bytes:
        return (f"weights, gradients and optimizer state take {cost.state_bytes / gib:.1f} GiB of the "
                f"{cost.memory_bytes / gib:.1f} GiB usable")
    return (f"one sample needs {cost.activation_bytes / gib:.2f} GiB of activations; "
            f"{(cost.memory_bytes - cost.state_bytes) / gib:.2f} GiB are left beside the state")


def _trains(member: Member) -> bool:
    """Whether the device holds at least one sample (no cap known: a CPU's)."""
    return member.cost.cap is None or member.cost.cap >= 1


def make_plan(members: Sequence[Member], model: ModelShape, seq: int, global_batch: int, *, in_node: Link,
              between_nodes: Link, wire: str = "fp16", overlap: bool = False, find_slow_cards: bool = True,
              memory_fraction: float = 0.9, shard: bool = False) -> Plan:
    """The plan for `members` (rank order). Devices that cannot hold one sample are
    left out (with the reason); ValueError when none can (saying what would make the
    model fit on the catalogued card with the most memory), or when the global batch is smaller than the number
    of devices (every device takes at least one sample, as in the trainer). With
    `shard`, the optimizer state is sharded by memory (hetcomm.plan.shard)."""
    if wire not in WIRE_BYTES:
        raise ValueError(f"--wire {wire!r}: expected one of {', '.join(WIRE_BYTES)}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"--global-batch {global_batch!r}: expected a positive integer")
    if shard:
        try:
            return _sharded_plan(members, model, seq, global_batch, in_node, between_nodes, wire, overlap)
        except StateDoesNotFit as error:
            raise ValueError(f"{error}. {shard_advice(members, model, seq, wire, memory_fraction, error.short)}") \
                from None
    training = [m for m in members if _trains(m)]
    left_out = tuple(LeftOut(m, _why_left_out(m.cost)) for m in members if m not in training) \
        if len(training) < len(members) else ()
    if not training:
        catalogued = [m for m in members if m.device is not None]
        advice = fit_advice(catalogued, model, seq, wire=wire, memory_fraction=memory_fraction) if catalogued else ""
        raise ValueError(f"{model.name} at --seq {seq} fits on none of the devices: "
                         f"{left_out[0].member.label}: {left_out[0].reason}." + (f" {advice}" if advice else ""))
    if global_batch < len(training):
        raise ValueError(f"--global-batch {global_batch} is smaller than the {len(training)} devices that can train: "
                         f"every device takes at least one sample per step; use --global-batch {len(training)} or "
                         f"more, or fewer devices")
    profiles, caps = [(m.cost.fixed, m.cost.per_sample) for m in training], [m.cost.cap for m in training]
    split = solve_split(global_batch, profiles, caps, "accumulate")
    step = _Step(training, model, seq, in_node, between_nodes, wire, overlap)
    compute = step.compute(split.rank_times)
    equal_compute = step.compute(predict_rank_times(equal_split(global_batch, len(training)), profiles, caps))
    fastest = min(training, key=lambda m: m.cost.per_sample)
    alone = predict_rank_times([global_batch], [(fastest.cost.fixed, fastest.cost.per_sample)], [fastest.cost.cap])[0]
    plan = Plan(model=model, seq=seq, global_batch=global_batch, wire=wire, overlap=overlap, link=step.link,
                members=tuple(training), left_out=left_out, split=split, compute_s=compute,
                all_reduce=step.all_reduce, exposed_comm_s=step.exposed(compute), update_s=step.update,
                step_s=step.seconds(compute), equal_step_s=step.seconds(equal_compute), single_device=fastest.label,
                single_device_s=alone + fastest.cost.update_seconds)
    if not find_slow_cards:
        return plan
    return Plan(**{**plan.__dict__, "slow_cards": _slow_cards(plan, members, in_node, between_nodes)})


class _Step:
    """What follows the slowest rank's compute in a step of `training`: the all-reduce
    over the ring's slowest link (the part backward does not hide) and the update."""

    def __init__(self, training: Sequence[Member], model: ModelShape, seq: int, in_node: Link, between_nodes: Link,
                 wire: str, overlap: bool):
        self.link = ring_link({m.node for m in training}, in_node, between_nodes)
        self.all_reduce = all_reduce_cost(len(training), model.parameters(seq), WIRE_BYTES[wire], self.link)
        self.update = max(m.cost.update_seconds for m in training)
        self.jitter, self.overlap = [m.jitter for m in training], overlap

    def compute(self, rank_times: Sequence[float]) -> float:
        return expected_slowest(rank_times, self.jitter)

    def exposed(self, compute: float) -> float:
        return exposed_communication(self.all_reduce, BACKWARD_SHARE * compute, self.overlap)

    def seconds(self, compute: float) -> float:
        return compute + self.exposed(compute) + self.update


class _ShardedStep(_Step):
    """The sharded step: the reduce-scatter (overlapped with backward as the all-reduce
    is, with overlap), the slowest owner's update (after the reduction's barrier: paid
    once, not added to each card's compute), the all-gather (after the update, never
    hidden)."""

    def __init__(self, training: Sequence[Member], cards, model: ModelShape, seq: int, in_node: Link,
                 between_nodes: Link, wire: str, overlap: bool, weights: str):
        super().__init__(training, model, seq, in_node, between_nodes, wire, overlap)
        self.reduce_scatter, self.all_gather = shard_collectives(len(training), model.parameters(seq), weights,
                                                                 WIRE_BYTES[wire], self.link)
        rs, ag = self.reduce_scatter, self.all_gather
        self.all_reduce = AllReduceCost(rs.seconds + ag.seconds, rs.wire_bytes + ag.wire_bytes, rs.buckets,
                                        "reduce-scatter + all-gather")
        self.update = max(card.update_seconds for card in cards)

    def exposed(self, compute: float) -> float:
        return (exposed_communication(self.reduce_scatter, BACKWARD_SHARE * compute, self.overlap)
                + self.all_gather.seconds)


def _sharded_plan(members: Sequence[Member], model: ModelShape, seq: int, global_batch: int, in_node: Link,
                  between_nodes: Link, wire: str, overlap: bool) -> Plan:
    """make_plan with the optimizer state sharded by memory (hetcomm.plan.shard): the
    room and caps, the split by speed under them, the ranges by what each card has
    left beside its planned micro-batch."""
    room = shard_room(members, model, seq, wire, WIRE_BYTES[wire])
    left_out = tuple(LeftOut(m, reason) for m, reason in room.left_out)
    if not room.members:
        raise ValueError(f"{model.name} at --seq {seq} fits on none of the devices, even with the optimizer state "
                         f"sharded: {left_out[0].member.label}: {left_out[0].reason}")
    training = room.members
    if global_batch < len(training):
        raise ValueError(f"--global-batch {global_batch} is smaller than the {len(training)} devices that can train: "
                         f"every device takes at least one sample per step; use --global-batch {len(training)} or "
                         f"more, or fewer devices")
    profiles = [(m.cost.fixed, m.cost.per_sample) for m in training]
    first = solve_split(global_batch, profiles, [m.cost.cap for m in training], "accumulate")
    planned = [max(micro) for micro in first.micro_batches]
    training, cards = shard_ranges(room, planned, model, seq)
    # The planned micro-batches are the caps now (the ranges leave room for them, not
    # more); the optimum under the first caps is still one under these.
    split = solve_split(global_batch, profiles, planned, "accumulate")
    step = _ShardedStep(training, cards, model, seq, in_node, between_nodes, wire, overlap, room.weights)
    compute = step.compute(split.rank_times)
    equal_compute = step.compute(predict_rank_times(equal_split(global_batch, len(training)), profiles, planned))
    fastest = min(training, key=lambda m: m.cost.per_sample)
    alone = predict_rank_times([global_batch], [(fastest.cost.fixed, fastest.cost.per_sample)], [fastest.cost.cap])[0]
    alone_update = model.parameters(seq) * UPDATE_BYTES_PER_ELEMENT / (fastest.device.bandwidth_gbs * 1e9
                                                                       * BANDWIDTH_EFFICIENCY)
    slowest = max(range(len(cards)), key=lambda rank: cards[rank].update_seconds)
    sharded = ShardPlan(room.weights, bucket_elements(room.weights),
                        state_bytes_per_element(DTYPES[room.weights]), cards, step.reduce_scatter, step.all_gather,
                        slowest)
    return Plan(model=model, seq=seq, global_batch=global_batch, wire=wire, overlap=overlap, link=step.link,
                members=tuple(training), left_out=left_out, split=split, compute_s=compute,
                all_reduce=step.all_reduce, exposed_comm_s=step.exposed(compute), update_s=step.update,
                step_s=step.seconds(compute), equal_step_s=step.seconds(equal_compute), single_device=fastest.label,
                single_device_s=alone + alone_update, shard=sharded)


def expected_slowest(times: Sequence[float], jitter: Sequence[float]) -> float:
    """E[max_i t_i·exp(σ_i·z_i)], z_i standard normal: a synchronous step waits for the
    unluckiest rank, and a balanced split makes every rank a candidate. Exact (the max)
    without jitter; otherwise a fixed-seed Monte Carlo estimate, the same every call."""
    if not any(jitter):
        return max(times)
    generator = torch.Generator().manual_seed(0)
    draws = torch.randn(JITTER_DRAWS, len(times), generator=generator, dtype=torch.float64)
    stretched = torch.tensor(times, dtype=torch.float64) * torch.exp(draws * torch.tensor(jitter, dtype=torch.float64))
    return stretched.max(dim=1).values.mean().item()


def _slow_cards(plan: Plan, members: Sequence[Member], in_node: Link, between_nodes: Link) -> tuple[SlowCard, ...]:
    """Re-plans without one card of each kind, and without all of that kind; a removal
    that makes the step at least SLOW_CARD_GAIN faster names the card (the last one of
    its kind in rank order). The largest gain comes first."""
    found = []
    for name in dict.fromkeys(m.name for m in plan.members):
        positions = [i for i, m in enumerate(members) if m.name == name]
        for removed in dict.fromkeys((1, len(positions))):
            drop = set(positions[-removed:])
            rest = [m for i, m in enumerate(members) if i not in drop]
            step_s = _step_seconds(rest, plan, in_node, between_nodes)
            if step_s is not None and step_s < plan.step_s * (1 - SLOW_CARD_GAIN):
                found.append(SlowCard(name, members[positions[0]].label, removed, step_s, 1 - step_s / plan.step_s))
    return tuple(sorted(found, key=lambda slow: -slow.faster))


def _step_seconds(members: Sequence[Member], plan: Plan, in_node: Link, between_nodes: Link) -> float | None:
    """make_plan(members, ...).step_s with `plan`'s settings, None where make_plan would
    refuse the members (none can train, or fewer samples than devices), computed without
    the micro-batches, the equal split and the single-device time a reported plan holds:
    about half the time of each of the slow-card analysis's re-plans."""
    training = [m for m in members if _trains(m)]
    if not training or plan.global_batch < len(training):
        return None
    times = optimal_rank_times(plan.global_batch, [(m.cost.fixed, m.cost.per_sample) for m in training],
                               [m.cost.cap for m in training], "accumulate")
    step = _Step(training, plan.model, plan.seq, in_node, between_nodes, plan.wire, plan.overlap)
    return step.seconds(step.compute(times))


def shard_advice(members: Sequence[Member], model: ModelShape, seq: int, wire: str, memory_fraction: float,
                 short: float) -> str:
    """What would make the sharded state fit: the longest shorter sequence (halving) at
    which it does, or that much more memory."""
    more = f"cards with {short / 2**30:.2f} GiB more usable memory between them"
    if not all(m.device for m in members):
        return f"It would fit on {more}."
    shorter = seq // 2
    while shorter >= 1:
        costed = [replace(m, cost=device_cost(m.device, model, shorter, m.cost.precision, wire_bytes=WIRE_BYTES[wire],
                                              memory_fraction=memory_fraction, attention=m.cost.attention,
                                              gelu=m.cost.gelu)) for m in members]
        try:
            if shard_room(costed, model, shorter, wire, WIRE_BYTES[wire]).members:
                return f"It would fit at --seq {shorter} (fewer activations beside the weights) or on {more}."
        except StateDoesNotFit:
            pass
        shorter //= 2
    return f"It would fit on {more} (a shorter --seq does not make room enough: the weights and gradients take it)."


def fit_advice(members: Sequence[Member], model: ModelShape, seq: int, *, wire: str, memory_fraction: float) -> str:
    """What would make the model fit on the card with the most memory: a larger card or
    a smaller model when its state alone does not fit; otherwise 16-bit activations, a
    shorter sequence (micro-batches are already 1, so accumulation cannot help)."""
    largest = max(members, key=lambda m: m.device.memory_gib)
    device, chosen = largest.device, largest.cost.precision

    def cost(seq_: int, precision_: str) -> DeviceCost:
        return device_cost(device, model, seq_, precision_, wire_bytes=WIRE_BYTES[wire],
                           memory_fraction=memory_fraction, attention=largest.cost.attention,
                           gelu=largest.cost.gelu)

    gib = 2**30
    here = cost(seq, chosen)
    if here.state_bytes >= here.memory_bytes:
        per_parameter = (here.state_bytes - CONTEXT_BYTES) / model.parameters(seq)
        needed = here.state_bytes / memory_fraction / gib
        largest_model = (here.memory_bytes - CONTEXT_BYTES) / per_parameter / 1e6
        return (f"Its state needs about {per_parameter:.0f} bytes per parameter (weights and gradients, "
                f"fp32 masters in 16-bit, AdamW moments, wire buffers): a card with at least {needed:.0f} GiB, "
                f"a larger --memory-fraction, or a model of at most about {largest_model:.0f}M parameters (before "
                f"activations) would fit on the {device.label}.")
    options = []
    if chosen in ("fp32", "tf32") and device.capability >= (6, 0):
        half = "bf16" if device.bf16_tflops else "fp16"
        if cost(seq, half).cap:
            options.append(f"--precision {half} (16-bit activations)")
    shorter = seq
    while shorter > 1 and not cost(shorter, chosen).cap:
        shorter //= 2
    if shorter < seq and cost(shorter, chosen).cap:
        options.append(f"--seq {shorter} or shorter")
    ask = " or ".join(options) if options else "a card with more memory"
    return (f"Even a micro-batch of 1 does not fit on the {device.label} ({here.memory_bytes / gib:.1f} GiB usable), "
            f"so gradient accumulation cannot help; {ask} would make it fit.")

