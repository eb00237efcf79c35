"""A plan and a simulation as text for people and as plain dicts for JSON."""

from itertools import groupby

from hetcomm.plan.calibrate import RunProfile
from hetcomm.plan.cost import BANDWIDTH_EFFICIENCY
from hetcomm.plan.full_shard import (HOST_BANDWIDTH_GBS, HOST_UPDATE_BYTES, RECOMPUTE_SHARE, chunks_loss,
                                     device_update_bytes_per_element, host_bytes_per_element, pcie_gbs)
from hetcomm.plan.model_shape import BERT_POSITIONS
from hetcomm.plan.planner import Member, Plan
from hetcomm.plan.shard import UPDATE_BYTES_PER_ELEMENT
from hetcomm.plan.simulate import Simulation
from hetcomm.train.chunked_loss import loss_chunk_tokens

GIB = 2**30


def _member_rows(plan: Plan) -> list[dict]:
    rows = []
    for rank, member in enumerate(plan.members):
        micro = plan.split.micro_batches[rank]
        rows.append({"rank": rank, "device": member.name, "label": member.label, "machine": member.node,
                     "precision": member.cost.precision, "source": member.source,
                     "samples": plan.split.sizes[rank], "micro_batch": max(micro) if micro else 0,
                     "accumulation_steps": len(micro), "max_micro_batch": member.cost.cap,
                     "memory_gib": member.cost.memory_use(max(micro) if micro else 0) / GIB,
                     "memory_available_gib": member.cost.memory_bytes / GIB if member.cost.memory_bytes else None,
                     "compute_s": plan.split.rank_times[rank],
                     "fixed_s": member.cost.fixed, "per_sample_s": member.cost.per_sample,
                     "efficiency": member.cost.efficiency})
    return rows


def plan_dict(plan: Plan) -> dict:
    return {
        "model": {"name": plan.model.name, "parameters": plan.model.parameters(plan.seq), "layers": plan.model.n_layer,
                  "heads": plan.model.n_head, "dim": plan.model.n_embd, "vocab": plan.model.vocab_size},
        "seq": plan.seq, "global_batch": plan.global_batch, "attention": plan.members[0].cost.attention,
        "gelu": plan.members[0].cost.gelu, "wire": plan.wire, "overlap": plan.overlap,
        "link": {"name": plan.link.name, "bandwidth_gbs": plan.link.bandwidth_gbs, "latency_us": plan.link.latency_us},
        "devices": _member_rows(plan),
        "left_out": [{"device": x.member.name, "label": x.member.label, "machine": x.member.node, "reason": x.reason}
                     for x in plan.left_out],
        "step_s": plan.step_s, "compute_s": plan.compute_s, "all_reduce_s": plan.all_reduce.seconds,
        "all_reduce_algorithm": plan.all_reduce.algorithm,
        "exposed_comm_s": plan.exposed_comm_s, "update_s": plan.update_s,
        "wire_bytes_per_rank": plan.all_reduce.wire_bytes, "tokens_per_s": plan.tokens_per_s,
        "equal_split_step_s": plan.equal_step_s, "speedup_over_equal": plan.speedup_over_equal,
        "comm_share": plan.comm_share, "parallel_fraction": plan.parallel_fraction,
        "single_device": plan.single_device, "single_device_s": plan.single_device_s,
        "slow_cards": [{"device": s.name, "label": s.label, "removed": s.removed, "step_s": s.step_s,
                        "faster": s.faster} for s in plan.slow_cards],
        "shard": None if plan.shard is None else _shard_dict(plan),
        "full_shard": None if plan.full is None else _full_dict(plan),
    }


def _full_dict(plan: Plan) -> dict:
    full = plan.full
    return {"weight_dtype": full.weight_dtype, "offload": "optimizer" if full.offload else None,
            "checkpointing": full.checkpointing, "persistent_bytes_per_element": full.persistent_bytes_per_element,
            "units": len(full.units), "largest_unit_elements": full.largest_unit, "micro_steps": full.micro_steps,
            "all_gather_s": full.all_gather.seconds, "reduce_scatter_s": full.reduce_scatter.seconds,
            "all_gather_bytes_per_rank": full.all_gather.wire_bytes,
            "reduce_scatter_bytes_per_rank": full.reduce_scatter.wire_bytes,
            "collectives_s": full.collectives_s, "exposed_comm_s": plan.exposed_comm_s,
            "update_s": plan.update_s, "update_rank": full.slowest_update,
            "host": [{"machine": h.machine, "cards": h.cards, "used_bytes": h.used_bytes,
                      "limit_bytes": h.limit_bytes, "update_s": h.update_seconds} for h in full.host],
            "cards": [{"rank": rank, "device": m.name, "machine": m.node, "micro_batch": c.micro_batch,
                       "checkpointing": c.checkpointing, "elements": c.elements, "share": c.elements / full.elements,
                       "weights_bytes": c.weights_bytes, "gradient_bytes": c.gradient_bytes,
                       "state_bytes": c.state_bytes, "gathered_bytes": c.gathered_bytes,
                       "unit_gradient_bytes": c.unit_gradient_bytes, "context_bytes": c.context_bytes,
                       "activation_bytes": c.activation_bytes, "activation_bytes_per_sample": c.activation_per_sample,
                       "held_bytes": c.held_bytes, "usable_bytes": c.usable_bytes, "free_bytes": c.free_bytes,
                       "host_bytes": c.host_bytes, "pcie_s": c.pcie_seconds, "update_s": c.update_seconds,
                       "host_update_s": c.host_seconds}
                      for rank, (m, c) in enumerate(zip(plan.members, full.cards))]}


def _shard_dict(plan: Plan) -> dict:
    shard = plan.shard
    return {"weight_dtype": shard.weight_dtype, "state_bytes_per_element": shard.state_bytes_per_element,
            "state_bytes": shard.state_bytes_per_element * shard.elements, "bucket_elements": shard.bucket_elements,
            "reduce_scatter_s": shard.reduce_scatter.seconds, "all_gather_s": shard.all_gather.seconds,
            "reduce_scatter_bytes_per_rank": shard.reduce_scatter.wire_bytes,
            "all_gather_bytes_per_rank": shard.all_gather.wire_bytes,
            "update_s": plan.update_s, "update_rank": shard.slowest_update,
            "state_memory": shard.state_memory_arg,
            "cards": [{"rank": rank, "device": m.name, "micro_batch": c.micro_batch, "weights_bytes": c.weights_bytes,
                       "gradient_bytes": c.gradient_bytes, "wire_buffer_bytes": c.wire_bytes,
                       "context_bytes": c.context_bytes, "masters_moments_bytes": c.state_bytes,
                       "scratch_bytes": c.scratch_bytes, "activation_bytes": c.activation_bytes,
                       "held_bytes": c.held_bytes, "usable_bytes": m.cost.memory_bytes,
                       "left_for_state_bytes": c.left_for_state, "free_bytes": c.free_bytes,
                       "elements": c.elements, "share": c.elements / shard.elements, "update_s": c.update_seconds}
                      for rank, (m, c) in enumerate(zip(plan.members, shard.cards))]}


def _group_key(item: tuple[Member, dict]):
    member, row = item
    return member.name, member.node, row["samples"], row["micro_batch"], row["accumulation_steps"]


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def plan_text(plan: Plan, profile: RunProfile | None, planning_seconds: float,
              largest: dict[str, dict[str, str | None]] | None = None) -> str:
    machines = len({m.node for m in plan.members})
    reduction = "all-reduce" if plan.shard is None else "reduce-scatter"
    collectives = "all-reduce" if plan.shard is None else "reduce-scatter and all-gather"
    overlap = (f", {reduction} overlapped with backward" if plan.overlap else f", {reduction} after backward")
    if plan.full is not None:
        collectives = "all-gathers and reduce-scatters"
        overlap = ", weights gathered and gradients reduce-scattered unit by unit, overlapped with compute"
    lines = [f"hetcomm plan: {plan.model.describe(plan.seq)}",
             f"  seq {plan.seq}, global batch {plan.global_batch} sequences, {plan.members[0].cost.attention} "
             f"attention, {'composite GELU, ' if plan.members[0].cost.gelu == 'composite' else ''}{plan.wire} wire"
             + overlap,
             f"  {len(plan.members)} devices on {machines} machine{'s' if machines > 1 else ''}; {collectives} "
             f"paced by "
             f"{plan.link.label} ({plan.link.bandwidth_gbs:.2f} GB/s, {plan.link.latency_us:g} us)"]
    if profile:
        calibrated = sorted({m.label for m in plan.members if m.source != "specification"})
        if not calibrated:
            lines.append(f"  NOTE: {profile.path} ran no GPU of these kinds; every figure is from specifications")
        else:
            what = "every device measured in" if plan.members[0].source == "measured" else \
                f"efficiency of {', '.join(calibrated)} calibrated by"
            lines.append(f"  {what} {profile.path} ({profile.steps} steps"
                         + (", a SIMULATED cluster" if profile.simulated else "") + ")")
    lines.append("")
    header = (f"  {'devices':<34} {'mach':>4} {'prec':>5} {'samples':>8} {'micro':>6} {'accum':>5} "
              f"{'memory GiB':>14} {'compute':>10} {'tok/s':>9}")
    lines.append(header)
    rows = list(zip(plan.members, _member_rows(plan)))
    for (_, node, samples, micro, accumulation), group in groupby(rows, key=_group_key):
        group = list(group)
        member, row = group[0]
        count = f"{len(group)}x " if len(group) > 1 else ""
        available = f"/{row['memory_available_gib']:.1f}" if row["memory_available_gib"] else ""
        tokens = samples * plan.seq / plan.step_s
        lines.append(f"  {(count + member.label)[:34]:<34} {node:>4} {member.cost.precision:>5} {samples:>8} "
                     f"{micro:>6} {accumulation:>5} {row['memory_gib']:>7.1f}{available:<7} "
                     f"{_seconds(row['compute_s']):>10} {tokens:>9,.0f}")
    lines.append("")
    all_reduce = plan.all_reduce
    if plan.shard is not None:
        lines += _shard_lines(plan)
    elif plan.full is not None:
        lines += _full_lines(plan)
    else:
        lines.append(f"  predicted step {_seconds(plan.step_s)} = compute {_seconds(plan.compute_s)} + all-reduce "
                     f"{_seconds(plan.exposed_comm_s)} (of a {_seconds(all_reduce.seconds)} {all_reduce.algorithm}, "
                     f"{all_reduce.wire_bytes / 2**20:.0f} MiB sent per rank) + update {_seconds(plan.update_s)}")
    lines.append(f"  {plan.tokens_per_s:,.0f} tokens/s; {plan.speedup_over_equal:.2f}x the speed of an equal split "
                 f"({_seconds(plan.equal_step_s)} per step)")
    fraction, speedup = plan.parallel_fraction, plan.single_device_s / plan.step_s
    if fraction is None:
        amdahl = "one device: no parallel fraction"
    elif speedup < 1:   # Amdahl's p would be negative: the cluster loses to one card
        amdahl = (f"SLOWER than one {plan.single_device} alone ({speedup:.2f}x its speed): the all-reduce costs more "
                  f"than the other cards add")
    else:
        amdahl = (f"Amdahl parallel fraction {fraction:.2f} (speed-up {speedup:.1f}x over one "
                  f"{plan.single_device} alone)")
    lines.append(f"  communication {plan.comm_share:.0%} of the step; {amdahl}")
    for slow in plan.slow_cards:
        which = f"one {slow.label}" if slow.removed == 1 else f"all {slow.removed} {slow.label}"
        lines.append(f"  SLOWS THE CLUSTER DOWN: without {which} the step takes {_seconds(slow.step_s)} "
                     f"({slow.faster:.1%} faster)")
    for item in plan.left_out:
        lines.append(f"  left out: {item.member.label} (machine {item.member.node}): {item.reason}")
    if largest:
        lines += largest_lines(largest, len(plan.members) + len(plan.left_out), plan.seq, plan.global_batch)
    measured_only = all(m.source == "measured" for m in plan.members)
    lines.append(f"  (planned in {planning_seconds:.3f} s" + ("" if measured_only else
                 "; figures from public peak specifications times an efficiency unless calibrated") + ")")
    return "\n".join(lines)


def _shard_lines(plan: Plan) -> list[str]:
    """Per card, what it holds with the optimizer state sharded, against what it has;
    then the step with its reduce-scatter, slowest update and all-gather."""
    shard = plan.shard
    per = shard.state_bytes_per_element
    masters = "fp32 moments" if shard.weight_dtype == "fp32" else "fp32 masters and moments"
    lines = [f"  optimizer state sharded by memory: P = {shard.elements:,} elements of {shard.weight_dtype} weights; "
             f"{masters}, {per} B an element ({per * shard.elements / GIB:.2f} GiB), on each range's owner",
             f"  {'GiB per card':<26} {'weights':>7} {'grads':>6} {'wire':>5} {'masters+moments':>15} "
             f"{'ctx+scratch':>11} {'activ (micro)':>13} {'held/usable':>12} {'left for state':>14} {'range':>6}"]
    for member, card in zip(plan.members, shard.cards):
        wire = f"{card.wire_bytes / GIB:5.2f}" if card.wire_bytes else "    -"
        activations = f"{card.activation_bytes / GIB:.2f} ({card.micro_batch})"
        held = f"{card.held_bytes / GIB:.1f}/{member.cost.memory_bytes / GIB:.1f}"
        lines.append(f"  {member.label[:26]:<26} {card.weights_bytes / GIB:>7.2f} {card.gradient_bytes / GIB:>6.2f} "
                     f"{wire} {card.state_bytes / GIB:>15.2f} {(card.context_bytes + card.scratch_bytes) / GIB:>11.2f} "
                     f"{activations:>13} {held:>12} {card.left_for_state / GIB:>14.2f} "
                     f"{card.elements / shard.elements:>6.1%}")
    lines += ["  the samples follow speed (above), the ranges what each card has left for state beside its "
              "micro-batch;",
              f"  the runtime makes these ranges from: hetcomm train --shard --state-memory {shard.state_memory_arg}",
              ""]
    rs, ag, slowest = shard.reduce_scatter, shard.all_gather, plan.members[shard.slowest_update]
    card = shard.cards[shard.slowest_update]
    rs_exposed = plan.exposed_comm_s - ag.seconds
    hidden = f" ({_seconds(rs_exposed)} of it exposed)" if plan.overlap else ""
    lines.append(f"  predicted step {_seconds(plan.step_s)} = compute {_seconds(plan.compute_s)} + reduce-scatter "
                 f"{_seconds(rs.seconds)}{hidden} + update {_seconds(plan.update_s)} + all-gather "
                 f"{_seconds(ag.seconds)}")
    bandwidth = f"{slowest.device.bandwidth_gbs:g} GB/s" if slowest.device else "its bandwidth"
    lines.append(f"    update: the slowest owner's, rank {shard.slowest_update} ({slowest.label}, "
                 f"{card.elements / shard.elements:.1%}): {UPDATE_BYTES_PER_ELEMENT} B an element at {bandwidth} x "
                 f"{BANDWIDTH_EFFICIENCY:g} (public spec x the memory-bound efficiency)")
    lines.append(f"    sent per rank: {rs.wire_bytes / 2**20:,.0f} + {ag.wire_bytes / 2**20:,.0f} MiB, one ring "
                 f"all-reduce's 2(N-1)/N x P x {plan.wire}, at the link's public rate")
    return lines


def _full_lines(plan: Plan) -> list[str]:
    """Per card, what it holds fully sharded, its checkpointing and range; then the step."""
    full = plan.full
    w = 4 if full.weight_dtype == "fp32" else 2
    state = "" if full.offload else (" + fp32 moments" if full.weight_dtype == "fp32" else " + fp32 master and moments")
    where = " (the optimizer state offloaded to host memory)" if full.offload else ""
    lines = [f"  fully sharded by memory{where}: P = {full.elements:,} elements of {full.weight_dtype} weights in "
             f"{len(full.units)} layer units (largest {full.largest_unit / 1e6:.1f}M elements); each card holds its "
             f"range's weights ({w} B) + fp32 gradient accumulator (4 B){state}: "
             f"{full.persistent_bytes_per_element} B an element, the root's and two blocks' gathered weights and "
             f"gradients ({full.cards[0].transient_bytes / GIB:.2f} GiB) and its micro-batch's activations",
             f"  {'GiB per card':<26} {'ckpt':>4} {'micro':>5} {'weights':>7} {'grads':>6} {'state':>6} "
             f"{'units':>6} {'ctx':>4} {'activ':>6} {'held/usable':>12} {'range':>6}"]
    for member, card in zip(plan.members, full.cards):
        held = f"{card.held_bytes / GIB:.1f}/{card.usable_bytes / GIB:.1f}"
        lines.append(f"  {member.label[:26]:<26} {'on' if card.checkpointing else 'off':>4} {card.micro_batch:>5} "
                     f"{card.weights_bytes / GIB:>7.2f} {card.gradient_bytes / GIB:>6.2f} "
                     f"{card.state_bytes / GIB:>6.2f} "
                     f"{card.transient_bytes / GIB:>6.2f} {card.context_bytes / GIB:>4.1f} "
                     f"{card.activation_bytes / GIB:>6.2f} {held:>12} {card.elements / full.elements:>6.1%}")
    if any(card.checkpointing for card in full.cards):
        chunks = (f" and the loss is computed {loss_chunk_tokens(plan.model.vocab_size):,} tokens at a time"
                  if chunks_loss(plan.model) else "")
        lines.append(f"  checkpointing ({full.checkpointing}): each block keeps its fp32 input and recomputes its "
                     f"forward in the backward (+{RECOMPUTE_SHARE:.2f} of the blocks' time){chunks};"
                     + (" on where the card's samples do not fit one micro-batch without it"
                        if full.checkpointing == "auto" else ""))
    lines.append("")
    ag, rs = full.all_gather, full.reduce_scatter
    lines.append(f"  predicted step {_seconds(plan.step_s)} = compute {_seconds(plan.compute_s)} (lock-step over "
                 f"{full.micro_steps} micro-step{'s' if full.micro_steps > 1 else ''}) + gathers/reduces "
                 f"{_seconds(plan.exposed_comm_s)} exposed (of {_seconds(full.collectives_s)}) + update "
                 f"{_seconds(plan.update_s)}")
    lines.append(f"    each micro-step: 2 all-gathers of the weights ({_seconds(ag.seconds)}, "
                 f"{ag.wire_bytes / 2**20:,.0f} MiB sent per rank, each) + a reduce-scatter of the gradients "
                 f"({_seconds(rs.seconds)}, {rs.wire_bytes / 2**20:,.0f} MiB): 1.5x a ring all-reduce's bytes at a "
                 f"16-bit wire; hidden behind compute except the first unit's gather and the last unit's reduce "
                 f"({_seconds(full.first_unit_s)})")
    slowest, card = plan.members[full.slowest_update], full.cards[full.slowest_update]
    if full.offload:
        lines.append(f"    update: rank {full.slowest_update} ({slowest.label}, {card.elements / full.elements:.1%}): "
                     f"PCIe {_seconds(card.pcie_seconds)} (4 B an element down, {w} B up at "
                     f"{pcie_gbs(slowest.device):g} GB/s) + its machine's CPU AdamW "
                     f"{_seconds(card.host_seconds)} ({HOST_UPDATE_BYTES} B an element at "
                     f"{HOST_BANDWIDTH_GBS:g} GB/s); each unit's part stepped and copied up at its next gather, "
                     f"overlapping the forward: {_seconds(card.update_seconds)} of it in the step")
        for host in full.host:
            lines.append(f"    host memory, machine {host.machine}: {host.used_bytes / GIB:.1f} of "
                         f"{host.limit_bytes / GIB:g} GiB pinned ({host_bytes_per_element(full.weight_dtype)} B an "
                         f"element of its {host.cards} card{'s' if host.cards > 1 else ''}' ranges)")
    else:
        bandwidth = f"{slowest.device.bandwidth_gbs:g} GB/s" if slowest.device else "its bandwidth"
        lines.append(f"    update: the slowest owner's, rank {full.slowest_update} ({slowest.label}, "
                     f"{card.elements / full.elements:.1%}): {device_update_bytes_per_element(full.weight_dtype)} B "
                     f"an element at {bandwidth} x {BANDWIDTH_EFFICIENCY:g}")
    return lines


def largest_lines(largest: dict[str, dict[str, str | None]], cards: int, seq: int, global_batch: int) -> list[str]:
    """The largest preset of each family that trains with and without sharding."""
    lines = []
    for family, found in largest.items():
        def name(key: str) -> str:
            return found[key] or "none"
        at = f"seq {min(seq, BERT_POSITIONS)}" if family == "BERT" else f"seq {seq}"
        where = f"all {cards} cards" if cards > 1 else "its card"
        if "all_full" in found:
            def modes(scope: str) -> str:
                return (f"{name(scope)} unsharded, {name(scope + '_sharded')} state sharded, "
                        f"{name(scope + '_full')} fully sharded, {name(scope + '_offload')} with offload")
            some = f"; on some of them: {modes('any')}" if cards > 1 else ""
            lines.append(f"  largest {family} ({at}, batch {global_batch}) on {where}: {modes('all')}{some}")
            continue
        some = (f"; on some of them: {name('any')} unsharded, {name('any_sharded')} sharded" if cards > 1 else "")
        lines.append(f"  largest {family} ({at}, batch {global_batch}) on {where}: {name('all')} unsharded, "
                     f"{name('all_sharded')} sharded{some}")
    return lines


def _sizes_text(plan: Plan, sizes: tuple[int, ...]) -> str:
    if len(sizes) <= 16:
        return "/".join(map(str, sizes))
    parts = []
    for name, group in groupby(zip(plan.members, sizes), key=lambda item: item[0].name):
        values = [b for _, b in group]
        low, high = min(values), max(values)
        parts.append(f"{name} {low}" + (f"-{high}" if high != low else ""))
    return ", ".join(parts)


def simulation_dict(simulation: Simulation) -> dict:
    return {"steps": simulation.steps, "noise": simulation.noise,
            "slowdowns": [{"rank": s.rank, "step": s.step, "factor": s.factor} for s in simulation.slowdowns],
            "static_s": simulation.static_s, "rebalanced_s": simulation.rebalanced_s, "ideal_s": simulation.ideal_s,
            "rebalances": [{"step": r.step, "predicted_gain": r.predicted_gain, "sizes": list(r.sizes)}
                           for r in simulation.rebalances],
            "handoffs": list(simulation.handoffs),
            "final_sizes": list(simulation.final_sizes), "static_step_s": list(simulation.static_step_s),
            "rebalanced_step_s": list(simulation.rebalanced_step_s)}


def simulation_text(simulation: Simulation, plan: Plan) -> str:
    slowdowns = ", ".join(f"rank {s.rank} x{s.factor:g} from step {s.step}" for s in simulation.slowdowns) or "none"
    lines = [f"SIMULATED {simulation.steps} steps (noise {simulation.noise:.0%}, slowdowns: {slowdowns}):",
             f"  planned split kept:  {simulation.static_s:10.1f} s",
             f"  with rebalancing:    {simulation.rebalanced_s:10.1f} s "
             f"({simulation.rebalanced_s / simulation.static_s - 1:+.1%} against kept; a straggler handed "
             f"samples off within {len(simulation.handoffs)} step{'' if len(simulation.handoffs) == 1 else 's'})",
             f"  ideal (true speeds): {simulation.ideal_s:10.1f} s "
             f"(rebalancing is {simulation.rebalanced_s / simulation.ideal_s - 1:+.1%} over it)"]
    for event in simulation.rebalances[:20]:
        lines.append(f"  step {event.step:>5}: rebalanced (predicted gain {event.predicted_gain:.1%}) -> "
                     f"{_sizes_text(plan, event.sizes)}")
    if len(simulation.rebalances) > 20:
        lines.append(f"  ... {len(simulation.rebalances) - 20} more rebalances")
    lines.append(f"  final split: {_sizes_text(plan, simulation.final_sizes)}")
    return "\n".join(lines)
