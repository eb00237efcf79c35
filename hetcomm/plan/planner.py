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
from hetcomm.plan.full_shard import (CHECKPOINTING, HOST_BANDWIDTH_GBS, HOST_MEMORY_GIB, HOST_UPDATE_BYTES, OFFLOADS,
                                     FullCard, FullShardDoesNotFit, FullShardPlan, HostMemory, _collective,
                                     checkpointed_member, device_update_bytes_per_element, full_caps, full_ranges,
                                     full_room, host_bytes_per_element, lock_step_compute, micro_steps,
                                     offload_update_seconds, pcie_gbs,
                                     transient_elements,
                                     persistent_bytes_per_element)
from hetcomm.plan.model_shape import ModelShape
from hetcomm.plan.precision import CHOICES as PRECISION_CHOICES, PrecisionChoice
from hetcomm.plan.shard import (DTYPES, UPDATE_BYTES_PER_ELEMENT, ShardPlan, StateDoesNotFit, bucket_elements,
                                shard_collectives, shard_ranges, shard_room, state_bytes_per_element)

GIB = 2**30
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
    full: FullShardPlan | None = None   # weights, gradients and state sharded by memory (--shard full)

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
              memory_fraction: float = 0.9, shard: bool | str = False, offload: str | None = None,
              checkpointing: str | None = None, host_memory: float | Sequence[float] = HOST_MEMORY_GIB) -> Plan:
    """The plan for `members` (rank order). Devices that cannot hold one sample are
    left out (with the reason); ValueError when none can (saying what would make the
    model fit on the catalogued card with the most memory), or when the global batch is smaller than the number
    of devices (every device takes at least one sample, as in the trainer). With
    `shard` True or "state", the optimizer state is sharded by memory (hetcomm.plan.shard);
    with "full", the weights, gradients and state (hetcomm.plan.full_shard), with
    `offload` "optimizer" the state in host memory (`host_memory` GiB per machine: one
    figure or one per machine), `checkpointing` "auto" (the default), "on" or "off"."""
    if wire not in WIRE_BYTES:
        raise ValueError(f"--wire {wire!r}: expected one of {', '.join(WIRE_BYTES)}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"--global-batch {global_batch!r}: expected a positive integer")
    if shard not in (False, True, None, "state", "full"):
        raise ValueError(f"--shard {shard!r}: expected state (the default) or full")
    if offload is not None and offload not in OFFLOADS:
        raise ValueError(f"--offload {offload!r}: expected {' or '.join(OFFLOADS)}")
    if checkpointing is not None and checkpointing not in CHECKPOINTING:
        raise ValueError(f"--checkpointing {checkpointing!r}: expected one of {', '.join(CHECKPOINTING)}")
    if shard != "full":
        if offload is not None:
            raise ValueError(f"--offload {offload} needs --shard full (the optimizer state offloaded to the host is "
                             f"modelled for full sharding only)")
        if checkpointing is not None:
            raise ValueError(f"--checkpointing {checkpointing} needs --shard full (activation checkpointing is "
                             f"planned for full sharding only)")
    if shard == "full":
        try:
            return _full_plan(members, model, seq, global_batch, in_node, between_nodes, wire,
                              checkpointing or "auto", offload is not None, host_memory)
        except FullShardDoesNotFit as error:
            advice = full_advice(members, model, seq, wire, memory_fraction, checkpointing or "auto",
                                 offload is not None)
            raise ValueError(f"{error}.{advice}") from None
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


def _full_plan(members: Sequence[Member], model: ModelShape, seq: int, global_batch: int, in_node: Link,
               between_nodes: Link, wire: str, checkpointing: str, offload: bool,
               host_memory: float | Sequence[float]) -> Plan:
    """make_plan with weights, gradients and optimizer state sharded by memory
    (hetcomm.plan.full_shard): the room and caps, checkpointing per card, the split by
    speed under the caps, the ranges by what each card has left beside its micro-batch."""
    fits, out, weights, units, figures, rooms = full_room(members, model, seq, checkpointing, offload)
    left_out = tuple(LeftOut(m, reason) for m, reason in out)
    if not fits:
        raise ValueError(f"{model.name} at --seq {seq} fits on none of the devices, even fully sharded: "
                         f"{left_out[0].member.label}: {left_out[0].reason}")
    if global_batch < len(fits):
        raise ValueError(f"--global-batch {global_batch} is smaller than the {len(fits)} devices that can train: "
                         f"every device takes at least one sample per step; use --global-batch {len(fits)} or "
                         f"more, or fewer devices")
    parameters = model.parameters(seq)
    per = persistent_bytes_per_element(weights, offload)
    caps = full_caps(figures, rooms, parameters, per)
    recomputing = [checkpointed_member(m, model, seq, card.on) for m, card in zip(fits, figures)]
    link = ring_link({m.node for m in fits}, in_node, between_nodes)
    ranks, w = len(fits), DTYPES[weights].itemsize
    gather = _collective(ranks, parameters, w, len(units), link, "all-gather")
    reduce = _collective(ranks, parameters, WIRE_BYTES[wire], len(units), link, "reduce-scatter")
    first = (_collective(ranks, units[0], w, 1, link, "").seconds
             + _collective(ranks, units[0], WIRE_BYTES[wire], 1, link, "").seconds)

    def exposed(compute_: float, rounds_: int) -> tuple[float, float]:
        collectives_ = rounds_ * (2 * gather.seconds + reduce.seconds)
        return collectives_, (max(rounds_ * first, collectives_ - compute_) if ranks > 1 else 0.0)

    best = None
    for rounds in range(1, global_batch // ranks + 1):
        found = _full_rounds(global_batch, rounds, fits, recomputing, caps, checkpointing)
        if found is None:
            continue
        seconds = found[2] + exposed(found[2], rounds)[1]
        if best is None or seconds < best[0] - 1e-12:
            best = (seconds, rounds, *found)
    if best is None:
        raise ValueError(f"--global-batch {global_batch}: too small to give each of the {ranks} cards a sample in "
                         f"every micro-step within their micro-batch caps {[max(c) for c in caps]}; use a larger one")
    _, rounds, chosen, split, compute = best
    planned = [max(micro) for micro in split.micro_batches]

    def frees_of(chosen_):
        return [card.base - card.activations(on, micro) for card, on, micro in zip(figures, chosen_, planned)]

    if checkpointing == "auto":
        # Off again wherever the planned micro-batch fits without it, the ranges still
        # holding every element (the caps of step 2 were conservative).
        for rank in range(ranks):
            trial = [on and i != rank for i, on in enumerate(chosen)]
            if chosen[rank] and sum(frees_of(trial)) >= per * parameters and min(frees_of(trial)) >= 0:
                chosen = trial
    training = [r if on else m for m, r, on in zip(fits, recomputing, chosen)]
    compute, _ = lock_step_compute(training, split.micro_batches)
    times = tuple(sum(m.cost.fixed + m.cost.per_sample * b for b in micro)
                  for m, micro in zip(training, split.micro_batches))
    split = replace(split, rank_times=times, step_time=max(times))
    frees = frees_of(chosen)
    sizes = full_ranges(frees, parameters, per)
    # The update of each range: on its card, or copied to and from the host and stepped there.
    host, host_seconds = [], {}
    if offload:
        limits = (host_memory,) if isinstance(host_memory, (int, float)) else tuple(host_memory)
        nodes = sorted({m.node for m in training})
        for node in nodes:
            on_node = [i for i, m in enumerate(training) if m.node == node]
            used = sum(sizes[i] for i in on_node) * host_bytes_per_element(weights)
            limit = (limits[0] if len(limits) == 1 else limits[node]) * GIB
            seconds = sum(sizes[i] for i in on_node) * HOST_UPDATE_BYTES / (HOST_BANDWIDTH_GBS * 1e9)
            host_seconds[node] = seconds
            host.append(HostMemory(node, len(on_node), used, limit, seconds))
            if used > limit:
                raise ValueError(f"--offload optimizer: machine {node}'s {len(on_node)} card"
                                 f"{'s' if len(on_node) > 1 else ''} keep {used / GIB:.1f} GiB of optimizer state "
                                 f"and gradient staging in pinned host memory ({host_bytes_per_element(weights)} B "
                                 f"an element of their ranges), more than its {limit / GIB:g} GiB (--host-memory)")
    cards, final = [], []
    forward = compute / rounds / 3   # one micro-step's forward, which an offloaded update overlaps
    # The root (all but the blocks; layer_units puts the final norm with the last block) is
    # gathered first, so its part of an offloaded update comes first.
    root_share = 1 - model.n_layer * min(units[1:1 + model.n_layer]) / parameters
    for m, figure, on, micro, free, size in zip(training, figures, chosen, planned, frees, sizes):
        if offload:
            down, up = (size * item / (pcie_gbs(m.device) * 1e9) for item in (4, w))
            pcie = down + up
            update = offload_update_seconds(down, up, host_seconds[m.node], root_share, forward)
        else:
            pcie = 0.0
            update = size * device_update_bytes_per_element(weights) / (m.device.bandwidth_gbs * 1e9
                                                                         * BANDWIDTH_EFFICIENCY)
        state = 0 if offload else size * (per - w - 4)
        held = transient_elements(units, model.n_layer) * w
        full = FullCard(micro, on, size, size * w, size * 4, state, held, held,
                        CONTEXT_BYTES, figure.activations(on, micro), m.cost.activation_bytes, m.cost.memory_bytes,
                        free, size * host_bytes_per_element(weights) if offload else 0, pcie, update,
                        host_seconds.get(m.node, 0.0))
        cards.append(full)
        # The chunked loss's peak is per micro-batch: with the state, not with the samples.
        final.append(replace(m, cost=replace(m.cost, cap=micro, update_seconds=update,
                                             state_bytes=full.held_bytes - m.cost.activation_bytes * micro)))
    collectives, exposed_s = exposed(compute, rounds)
    update_s = max(card.update_seconds for card in cards)
    slowest = max(range(ranks), key=lambda rank: cards[rank].update_seconds)
    equal = [micro_steps(size, cap) for size, cap in zip(equal_split(global_batch, ranks), planned)]
    equal_compute, equal_rounds = lock_step_compute(final, equal)
    fastest = min(final, key=lambda m: m.cost.per_sample)
    alone = predict_rank_times([global_batch], [(fastest.cost.fixed, fastest.cost.per_sample)], [fastest.cost.cap])[0]
    alone_update = parameters * device_update_bytes_per_element(weights) / (fastest.device.bandwidth_gbs * 1e9
                                                                            * BANDWIDTH_EFFICIENCY)
    plan_full = FullShardPlan(weights, offload, checkpointing, per, units, tuple(cards), gather, reduce, rounds,
                              first, collectives, slowest, tuple(host))
    all_reduce = AllReduceCost(collectives, rounds * (2 * gather.wire_bytes + reduce.wire_bytes),
                               rounds * 3 * len(units), "2 all-gathers + reduce-scatter a micro-step")
    return Plan(model=model, seq=seq, global_batch=global_batch, wire=wire, overlap=True, link=link,
                members=tuple(final), left_out=left_out, split=split, compute_s=compute, all_reduce=all_reduce,
                exposed_comm_s=exposed_s, update_s=update_s, step_s=compute + exposed_s + update_s,
                equal_step_s=equal_compute + exposed(equal_compute, equal_rounds)[1] + update_s,
                single_device=fastest.label, single_device_s=alone + alone_update, full=plan_full)


def _full_rounds(global_batch: int, rounds: int, plain: Sequence[Member], recomputing: Sequence[Member],
                 caps: Sequence[tuple[int, int]], checkpointing: str):
    """The global batch in `rounds` lock-step micro-steps (every rank runs each one: the
    weights are gathered from every rank), each split by speed under the caps by the
    balancer's solver, with checkpointing per card: (chosen, split, lock-step compute),
    or None when the caps cannot hold a round or a round has fewer samples than cards."""
    ranks = len(plain)
    base, extra = divmod(global_batch, rounds)
    if base < ranks:
        return None
    chosen = [checkpointing == "on" or (checkpointing == "auto" and off == 0) for off, _ in caps]
    while True:
        training = [r if on else m for m, r, on in zip(plain, recomputing, chosen)]
        profiles = [(m.cost.fixed, m.cost.per_sample) for m in training]
        if checkpointing != "auto":
            break
        # On where a card's share of a micro-step, split by speed, does not fit without it.
        wanted = solve_split(base + (extra > 0), profiles).sizes
        more = [on or (want > off and both > off) for on, want, (off, both) in zip(chosen, wanted, caps)]
        if more == chosen:
            break
        chosen = more
    limits = [both if on else off for on, (off, both) in zip(chosen, caps)]
    if sum(limits) < base + (extra > 0):
        return None
    solved = {size: solve_split(size, profiles, limits, "move") for size in {base, base + (extra > 0)}}
    sizes_by_round = [base + 1] * extra + [base] * (rounds - extra)
    micro = tuple(tuple(solved[size].sizes[rank] for size in sizes_by_round) for rank in range(ranks))
    times = tuple(sum(a + c * m for m in steps) for (a, c), steps in zip(profiles, micro))
    compute = sum(solved[size].step_time for size in sizes_by_round)
    split = Split(sizes=tuple(sum(steps) for steps in micro), micro_batches=micro, rank_times=times,
                  step_time=max(times), equal_step_time=0.0, policy="rounds")
    return chosen, split, compute


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


def full_advice(members: Sequence[Member], model: ModelShape, seq: int, wire: str, memory_fraction: float,
                checkpointing: str, offload: bool) -> str:
    """What would make a fully sharded model fit: the optimizer state offloaded, or the
    longest shorter sequence (halving) at which it fits."""
    if not all(m.device for m in members):
        return ""

    def fits(seq_: int, offload_: bool) -> bool:
        costed = [replace(m, cost=device_cost(m.device, model, seq_, m.cost.precision, wire_bytes=WIRE_BYTES[wire],
                                              memory_fraction=memory_fraction, attention=m.cost.attention,
                                              gelu=m.cost.gelu)) for m in members]
        try:
            return bool(full_room(costed, model, seq_, checkpointing, offload_)[0])
        except FullShardDoesNotFit:
            return False

    def longest_shorter(offload_: bool) -> int:
        shorter = seq // 2
        while shorter >= 1 and not fits(shorter, offload_):
            shorter //= 2
        return shorter

    ways = []
    if not offload and fits(seq, True):
        ways.append("with --offload optimizer (the masters and moments in host memory)")
    shorter = longest_shorter(offload)
    if shorter >= 1:
        ways.append(f"at --seq {shorter}" + (" with" if offload else " without") + " offload")
    elif not offload and not ways and longest_shorter(True) >= 1:
        ways.append(f"at --seq {longest_shorter(True)} with --offload optimizer")
    return (" It would fit " + " or ".join(ways) + ".") if ways else ""


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

