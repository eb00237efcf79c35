"""The planner: cluster strings, the cost model worked by hand, plans that hold together
(split, accumulation, memory, precision, step), cards that slow the cluster down,
models that fit nowhere, calibration from a run's log, the rebalancer simulation, the
command line and its bad input."""

import dataclasses
import json
import math

import pytest

from hetcomm.balance import solve_split
from hetcomm.plan import load_run_profile, make_plan, parse_cluster, parse_model, simulate, spec_members
from hetcomm.plan.cli import main
from hetcomm.plan.cost import all_reduce_cost, device_cost, fitted_efficiencies
from hetcomm.simulated import Slowdown

GIB = 2**30


def plan_for(catalog, cluster, model="gpt2-124m", seq=1024, global_batch=512, net="10gbe", intra="pcie3", **kwargs):
    shape = parse_model(model)
    options = {k: kwargs.pop(k) for k in ("precision", "efficiency") if k in kwargs}
    options["memory_fraction"] = kwargs.setdefault("memory_fraction", 0.9)
    members = spec_members(parse_cluster(cluster, catalog), shape, seq, wire=kwargs.get("wire", "fp16"), **options)
    return make_plan(members, shape, seq, global_batch, in_node=catalog.link(intra), between_nodes=catalog.link(net),
                     **kwargs)


# --- the cluster string -----------------------------------------------------------------

def test_cluster_machines_and_counts(catalog):
    cluster = parse_cluster("2x1080ti+1xv100, 4xT4", catalog)
    assert [d.device.name for d in cluster] == ["1080ti", "1080ti", "v100", "t4", "t4", "t4", "t4"]
    assert [d.node for d in cluster] == [0, 0, 0, 1, 1, 1, 1]
    assert [d.node for d in parse_cluster("2x1080ti,1xv100,4xt4", catalog)] == [0, 0, 1, 2, 2, 2, 2]


@pytest.mark.parametrize("text, message", [
    ("", "--cluster is empty"),
    ("t4,,v100", "machine 2 is empty"),
    ("0xt4", "has a count of 0"),
    ("2xt5", "unknown GPU 't5'; nearest known: t4"),
    ("4x1080tii", "nearest known: 1080ti"),
])
def test_bad_cluster_strings(catalog, text, message):
    with pytest.raises(ValueError, match=message):
        parse_cluster(text, catalog)


# --- the cost model, worked by hand from its documented constants -------------------

def test_device_cost_by_hand(catalog):
    device = catalog.device("1080ti")     # 11.34 TFLOPS fp32, 11 GB, 484 GB/s, sm_61: fp32
    shape = parse_model("gpt2-124m")
    cost = device_cost(device, shape, 1024, "fp32", wire_bytes=2, memory_fraction=0.9)
    params, h, vocab, layers = shape.parameters(1024), 768, 50257, 12
    activation = 1024 * (layers * 68 * h + 8 * h + 12 * vocab)
    state = params * (16 + 2) + 0.5 * GIB
    assert cost.activation_bytes == activation and cost.state_bytes == state
    assert cost.cap == math.floor((11 * GIB * 0.9 - state) / activation)
    flops = 1024 * (6 * (params - 1024 * h) + 12 * layers * h * 1024)
    efficiency = fitted_efficiencies()[("sm_61", "fp32")]   # fitted to published runs (efficiency.csv)
    per_sample = flops / (11.34e12 * efficiency) + 3 * activation / (484e9 * 0.7)
    assert cost.per_sample == pytest.approx(per_sample, rel=1e-12)
    assert cost.fixed == pytest.approx((40 * 12 + 30) * 12e-6 + params * 12 / (484e9 * 0.7), rel=1e-12)
    assert cost.update_seconds == pytest.approx(params * 48 / (484e9 * 0.7), rel=1e-12)


def test_all_reduce_ring_and_tree(catalog):
    link = catalog.link("10Gbit/s@30us")            # 1.25 GB/s
    small = all_reduce_cost(4, 10_000_000, 2, link)
    assert small.algorithm == "ring" and small.buckets == 2
    assert small.seconds == pytest.approx(2 * 3 / 4 * 2e7 / 1.25e9 + 2 * 2 * 3 * 30e-6)
    assert small.wire_bytes == pytest.approx(2 * 3 / 4 * 2e7)
    # Thousands of ranks: the ring's 2(N-1) latencies per bucket lose to the tree's 2·log2(N).
    large = all_reduce_cost(10_000, 10_000_000, 2, link)
    assert large.algorithm == "tree"
    assert large.seconds == pytest.approx(2 * 2e7 / 1.25e9 + 2 * 2 * 14 * 30e-6)
    assert all_reduce_cost(1, 10_000_000, 2, link).seconds == 0


# --- plans ----------------------------------------------------------------------------

def test_plan_holds_together(catalog):
    plan = plan_for(catalog, "2x1080ti,1xv100,4xt4,1xa100")
    split = plan.split
    assert sum(split.sizes) == 512 and len(split.sizes) == 8
    assert [m.cost.precision for m in plan.members] == ["fp16"] * 7 + ["bf16"]   # hetcomm.amp's policy
    for member, size, micro in zip(plan.members, split.sizes, split.micro_batches):
        assert len(micro) == math.ceil(size / member.cost.cap) and max(micro) <= member.cost.cap
        assert member.cost.memory_use(max(micro)) <= member.cost.memory_bytes
    # The split is the balancer's own.
    profiles = [(m.cost.fixed, m.cost.per_sample) for m in plan.members]
    assert split == solve_split(512, profiles, [m.cost.cap for m in plan.members])
    assert plan.step_s == pytest.approx(plan.compute_s + plan.exposed_comm_s + plan.update_s)
    assert plan.link.name == "10gbe" and plan.exposed_comm_s == plan.all_reduce.seconds
    # An equal split, by hand: 64 each, accumulating over the caps.
    equal = max(math.ceil(64 / m.cost.cap) * m.cost.fixed + m.cost.per_sample * 64 for m in plan.members)
    assert plan.equal_step_s == pytest.approx(equal + plan.all_reduce.seconds + plan.update_s)
    assert plan.speedup_over_equal > 1.5
    assert plan.tokens_per_s == pytest.approx(512 * 1024 / plan.step_s)
    assert 0 < plan.comm_share < 1 and 0 < plan.parallel_fraction <= 1


def test_links_and_overlap(catalog):
    one_machine = plan_for(catalog, "2xt4+1xv100")
    assert one_machine.link.name == "pcie3"
    three = plan_for(catalog, "2xt4,1xv100", intra="nvlink2")
    assert three.link.name == "10gbe"
    overlapped = plan_for(catalog, "2xt4,1xv100", overlap=True)
    plain = plan_for(catalog, "2xt4,1xv100")
    backward = 2 / 3 * plain.compute_s
    assert overlapped.exposed_comm_s == pytest.approx(max(plain.all_reduce.seconds / plain.all_reduce.buckets,
                                                          plain.all_reduce.seconds - backward))
    assert overlapped.step_s < plain.step_s


def test_a_card_that_slows_the_cluster_down_is_named(catalog):
    plan = plan_for(catalog, "4xa100,1x1060", global_batch=64)
    # The 1060 first: its one sample takes longer than an A100's share, and the ring
    # crosses the network to reach it. (Once it sets the pace, one A100 fewer also saves
    # a little all-reduce time: named too, with the smaller gain.)
    assert plan.slow_cards[0].name == "1060" and plan.slow_cards[0].removed == 1
    assert plan.slow_cards[0].faster > 0.2
    slow = plan.slow_cards[0]
    assert slow.step_s < plan.step_s and slow.faster == pytest.approx(1 - slow.step_s / plan.step_s)
    assert plan_for(catalog, "4xv100", global_batch=64).slow_cards == ()


@pytest.mark.parametrize("overlap", [False, True])
def test_each_slow_card_s_step_is_the_plan_without_those_cards(catalog, overlap):
    # The analysis re-plans by a shorter path (no micro-batches, equal split or single
    # device): its step times must be make_plan's, jitter and overlap included.
    shape = parse_model("gpt2-124m")
    members = spec_members(parse_cluster("4xa100,2x1060+1xt4", catalog), shape, 1024, wire="fp16",
                           memory_fraction=0.9)
    members = [dataclasses.replace(m, jitter=0.05 * (i % 3)) for i, m in enumerate(members)]
    links = {"in_node": catalog.link("pcie3"), "between_nodes": catalog.link("10gbe")}
    plan = make_plan(members, shape, 1024, 64, overlap=overlap, **links)
    assert {slow.name for slow in plan.slow_cards} >= {"1060", "t4"}
    for slow in plan.slow_cards:
        kind = [i for i, m in enumerate(members) if m.name == slow.name]
        rest = [m for i, m in enumerate(members) if i not in kind[-slow.removed:]]
        assert slow.step_s == make_plan(rest, shape, 1024, 64, overlap=overlap, find_slow_cards=False,
                                        **links).step_s


def test_cards_without_room_are_left_out_with_the_reason(catalog):
    plan = plan_for(catalog, "1xa100,1x1060", model="gpt2-355m", global_batch=16)
    assert [m.name for m in plan.members] == ["a100"]
    assert [x.member.name for x in plan.left_out] == ["1060"]
    assert "weights, gradients and optimizer state take" in plan.left_out[0].reason


def test_a_model_that_fits_nowhere_says_what_would_fit(catalog):
    with pytest.raises(ValueError, match=r"gpt2-1.5b at --seq 1024 fits on none of the devices.*a card with at "
                                         r"least \d+ GiB"):
        plan_for(catalog, "2x1060", model="gpt2-1.5b")
    with pytest.raises(ValueError, match=r"Even a micro-batch of 1 does not fit.*accumulation cannot help; "
                                         r"--seq 4096 or shorter would make it fit"):
        plan_for(catalog, "1x1080ti", seq=8192, global_batch=8)


def test_bad_plans(catalog):
    with pytest.raises(ValueError, match="--global-batch 3 is smaller than the 4 devices"):
        plan_for(catalog, "4xt4", global_batch=3)
    with pytest.raises(ValueError, match="Tesla V100.*bf16"):
        plan_for(catalog, "1xv100", precision="bf16")
    with pytest.raises(ValueError, match="--precision 'fp8'"):
        plan_for(catalog, "1xv100", precision="fp8")


def test_ten_thousand_gpus_of_eight_kinds(catalog):
    kinds = ("1080ti", "titanxp", "p100", "v100", "t4", "2080ti", "3090", "a100")
    plan = plan_for(catalog, ",".join(f"1250x{k}" for k in kinds), global_batch=100_000, net="100gbe")
    assert len(plan.members) == 10_000 and sum(plan.split.sizes) == 100_000
    assert plan.all_reduce.algorithm == "tree"
    # Cards of one kind get the same share, to within one sample.
    for k in range(8):
        sizes = plan.split.sizes[1250 * k:1250 * (k + 1)]
        assert max(sizes) - min(sizes) <= 1


# --- calibration from a run's log ---------------------------------------------------------

def write_run(path, ranks, lines, caps=None, model=(2, 4, 64, 256, 32), global_batch=12):
    layers, heads, width, vocab, seq = model
    path.mkdir(parents=True)
    config = {"n_layer": layers, "n_head": heads, "n_embd": width, "block_size": seq, "global_batch": global_batch,
              "wire": "float16", "memory_caps": caps}
    (path / "run.json").write_text(json.dumps({"config": config, "vocab_size": vocab, "ranks": ranks,
                                               "simulated": True}))
    (path / "steps.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def synthetic_steps(lines_ab, splits, comm, updates):
    """Steps whose compute times lie exactly on each rank's line a + c·b; the last rank
    to finish waits for nobody (its reduce is the all-reduce and its update)."""
    records = []
    for step, sizes in enumerate(splits):
        compute = [a + c * b for (a, c), b in zip(lines_ab, sizes)]
        wait = [comm + u + max(compute) - t for t, u in zip(compute, updates)]
        records.append({"step": step, "micro_batch": list(sizes), "compute_s": compute, "wait_s": wait,
                        "update_s": list(updates), "step_s": max(compute) + comm + max(updates)})
    return records


CPU = {"device": "cpu", "capability": None, "host": "h1", "speed": 1.0}


def test_profile_recovers_each_ranks_line(tmp_path):
    lines_ab = [(0.01, 0.02), (0.02, 0.05), (0.0, 0.1)]
    splits = [(4, 4, 4), (6, 4, 2), (7, 3, 2), (8, 3, 1)]
    write_run(tmp_path / "run", [CPU] * 3, synthetic_steps(lines_ab, splits, comm=0.03, updates=(0.004,) * 3))
    profile = load_run_profile(tmp_path / "run")
    assert profile.steps == 3    # step 0 is warm-up
    for rank, (a, c) in zip(profile.ranks, lines_ab):
        assert rank.method == "line"
        assert (rank.fixed, rank.per_sample) == (pytest.approx(a, abs=1e-12), pytest.approx(c, rel=1e-9))
        assert rank.update_s == pytest.approx(0.004)
    assert profile.comm_s == pytest.approx(0.03)
    members = profile.members()
    plan = make_plan(members, profile.model, profile.seq, 12, in_node=profile.link, between_nodes=profile.link)
    # The measured link reproduces the measured all-reduce for the run's own ring.
    assert plan.all_reduce.seconds == pytest.approx(0.03)
    best = solve_split(12, lines_ab)
    assert plan.split.sizes == best.sizes
    assert plan.step_s == pytest.approx(best.step_time + 0.03 + 0.004)


@pytest.mark.parametrize("recorded", [{"precision": "fp32"}, {}])   # {}: a run from before ranks recorded it
def test_profile_keeps_the_precision_its_run_computed_in(tmp_path, catalog, recorded):
    shape = parse_model("layers=2,heads=4,dim=64,vocab=256")
    true = device_cost(catalog.device("1080ti"), shape, 32, "fp32", wire_bytes=2, memory_fraction=0.9, efficiency=0.4)
    gpu = {"device": "NVIDIA GeForce GTX 1080 Ti", "capability": [6, 1], "host": "h1", "speed": 1.0, **recorded}
    lines_ab = [(true.fixed, true.per_sample)] * 2
    write_run(tmp_path / "run", [gpu, gpu], synthetic_steps(lines_ab, [(6, 6), (5, 7), (7, 5)], 0.01, (0, 0)))
    profile = load_run_profile(tmp_path / "run")
    assert [m.cost.precision for m in profile.members()] == ["fp32", "fp32"]
    assert profile.efficiencies(catalog) == {"1080ti": pytest.approx(0.4)}


def test_profile_of_a_fixed_split_falls_back_to_throughput(tmp_path):
    write_run(tmp_path / "run", [CPU] * 2, synthetic_steps([(0.0, 0.02), (0.0, 0.05)], [(6, 6)] * 4, 0.01, (0, 0)))
    ranks = load_run_profile(tmp_path / "run").ranks
    assert [r.method for r in ranks] == ["throughput"] * 2
    assert [r.per_sample for r in ranks] == [pytest.approx(0.02), pytest.approx(0.05)]


def test_profile_calibrates_a_gpus_efficiency(tmp_path, catalog):
    shape = parse_model("layers=2,heads=4,dim=64,vocab=256")
    v100 = catalog.device("v100")
    true = device_cost(v100, shape, 32, "fp16", wire_bytes=2, memory_fraction=0.9, efficiency=0.3)
    gpu = {"device": "Tesla V100-SXM2-16GB", "capability": [7, 0], "host": "h1", "speed": 1.0}
    lines_ab = [(true.fixed, true.per_sample)] * 2
    write_run(tmp_path / "run", [gpu, gpu], synthetic_steps(lines_ab, [(6, 6), (5, 7), (7, 5)], 0.01, (0, 0)))
    profile = load_run_profile(tmp_path / "run")
    assert profile.efficiencies(catalog) == {"v100": pytest.approx(0.3)}
    members = spec_members(parse_cluster("2xv100", catalog), shape, 32, efficiency=profile.efficiencies(catalog))
    assert members[0].cost.per_sample == pytest.approx(true.per_sample)
    assert members[0].source == "specification, calibrated efficiency"


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / "run.json").unlink(), "no run.json there"),
    (lambda p: (p / "steps.jsonl").write_text("{not json\n"), "steps.jsonl, line 1: not JSON"),
    (lambda p: (p / "run.json").write_text(json.dumps({"config": {}})), "made by an older hetcomm"),
])
def test_bad_profiles(tmp_path, damage, message):
    write_run(tmp_path / "run", [CPU] * 2, synthetic_steps([(0, 0.02), (0, 0.05)], [(6, 6)] * 3, 0.01, (0, 0)))
    damage(tmp_path / "run")
    with pytest.raises(ValueError, match=message):
        load_run_profile(tmp_path / "run")


# --- the simulation -------------------------------------------------------------------------

def test_simulation_without_noise_or_slowdown_keeps_the_optimal_plan(catalog):
    plan = plan_for(catalog, "2x1080ti,1xv100,4xt4")
    result = simulate(plan, 30, noise=0.0)
    assert result.rebalances == () and result.handoffs == () and result.final_sizes == plan.split.sizes
    assert result.static_s == pytest.approx(30 * plan.step_s)
    assert result.rebalanced_s == pytest.approx(result.static_s) and result.ideal_s == pytest.approx(result.static_s)


def test_simulation_follows_a_slowdown(catalog):
    plan = plan_for(catalog, "2x1080ti,1xv100,4xt4")
    slowdown = (Slowdown(rank=2, step=40, factor=0.4),)
    result = simulate(plan, 100, noise=0.03, slowdowns=slowdown, seed=1)
    assert result.rebalances and all(r.step >= 40 for r in result.rebalances)
    assert result.final_sizes[2] < plan.split.sizes[2]      # the throttled V100 gets less
    assert result.ideal_s < result.rebalanced_s < 0.9 * result.static_s
    # The V100 at 0.4 of its speed is a straggler in step 40: it hands samples off within it.
    assert result.handoffs == (40,)
    assert result.rebalanced_step_s[40] < 0.8 * result.static_step_s[40]
    assert simulate(plan, 100, noise=0.03, slowdowns=slowdown, seed=1) == result   # seeded: reproducible
    with pytest.raises(ValueError, match="rank 9 does not exist; the plan has 7"):
        simulate(plan, 10, slowdowns=(Slowdown(9, 1, 0.5),))


# --- the command line --------------------------------------------------------------------

def run_cli(capsys, *args):
    code = main(list(args))
    return code, capsys.readouterr().out


def test_a_cluster_slower_than_its_fastest_card_says_so(capsys):
    """BERT-large's 1.3 GB of gradients over 1 Gbit/s Ethernet: the all-reduce outweighs
    what the other cards add. Amdahl's fraction would be negative there; the report says
    the cluster is slower instead."""
    code, out = run_cli(capsys, "--cluster", "2x1080ti,1xv100,4xt4", "--net", "1gbe", "--model", "bert-large-qa",
                        "--seq", "384", "--global-batch", "64")
    assert code == 0
    assert "SLOWER than one Tesla V100" in out and "Amdahl parallel fraction" not in out


def test_command_line_text_and_json(capsys):
    code, out = run_cli(capsys, "--cluster", "2x1080ti,1xv100,4xt4", "--net", "10gbe", "--model", "gpt2-124m",
                        "--global-batch", "512", "--seq", "1024")
    assert code == 0
    for text in ("gpt2-124m: 124.4M parameters", "7 devices on 3 machines", "2x GeForce GTX 1080 Ti", "fp16",
                 "predicted step", "the speed of an equal split", "Amdahl parallel fraction"):
        assert text in out
    code, out = run_cli(capsys, "--cluster", "4xa100,1x1060", "--global-batch", "64", "--json", "--simulate", "20",
                        "--slowdown", "0:10:0.5")
    record = json.loads(out)
    assert [d["samples"] for d in record["devices"]] and sum(d["samples"] for d in record["devices"]) == 64
    assert record["slow_cards"][0]["device"] == "1060"
    assert record["simulation"]["steps"] == 20 and len(record["simulation"]["static_step_s"]) == 20
    code, out = run_cli(capsys, "--list-devices")
    assert "1080ti" in out and "10gbe" in out


@pytest.mark.parametrize("args, message", [
    ([], "nothing to plan: give --cluster"),
    (["--cluster", "2xgtx1080tie"], "unknown GPU"),
    (["--cluster", "t4", "--net", "3gb/s"], "Gbit/s or GB/s"),
    (["--cluster", "t4", "--global-batch", "0"], "--global-batch 0: expected a positive integer"),
    (["--cluster", "t4", "--memory-fraction", "1.5"], "--memory-fraction 1.5"),
    (["--cluster", "t4", "--slowdown", "0:5:0.5"], "--slowdown only acts in a simulation"),
    (["--cluster", "t4", "--simulate", "5", "--slowdown", "0-5-0.5"], "expected RANK:STEP:FACTOR"),
    (["--cluster", "t4", "--model", "gpt9"], "unknown model"),
    (["--profile", "/nonexistent/run"], "no run.json there"),
])
def test_command_line_bad_input(capsys, args, message):
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("hetcomm plan: error:") and message in err and "Traceback" not in err


def test_step_jitter_pools_repeats_and_ignores_the_fit_across_sizes():
    from hetcomm.plan.calibrate import step_jitter

    # Size 4 repeats at 1.0·e^±0.1, size 8 at 3.0·e^±0.1: a poor line fit, the same noise.
    points = [(4, math.exp(0.1)), (4, math.exp(-0.1)), (8, 3 * math.exp(0.1)), (8, 3 * math.exp(-0.1))]
    assert step_jitter(points, 0.0, 0.3) == pytest.approx(math.sqrt(4 * 0.01 / 2))
    # No size seen twice: the residuals of the line.
    assert step_jitter([(2, 1.0), (4, 2.0)], 0.0, 0.5) == pytest.approx(0.0)


def test_expected_slowest_rank_under_jitter():
    from hetcomm.plan.planner import expected_slowest

    assert expected_slowest([1.0, 3.0, 2.0], [0.0, 0.0, 0.0]) == 3.0
    # One rank: E[t·exp(σz)] = t·exp(σ²/2), the lognormal mean.
    assert expected_slowest([2.0], [0.2]) == pytest.approx(2 * math.exp(0.02), rel=0.01)
    # Two equal ranks: E[max] = t·E[exp(σ·max(z1, z2))] > the single-rank mean.
    assert expected_slowest([2.0, 2.0], [0.2, 0.2]) > 2 * math.exp(0.02) * 1.05


def test_command_line_with_a_profile(tmp_path, capsys):
    lines_ab = [(0.01, 0.02), (0.02, 0.05)]
    write_run(tmp_path / "run", [CPU] * 2, synthetic_steps(lines_ab, [(6, 6), (8, 4), (7, 5)], 0.03, (0.004, 0.004)))
    code, out = run_cli(capsys, "--profile", str(tmp_path / "run"))
    assert code == 0 and "every device measured in" in out and "a SIMULATED cluster" in out
    code, out = run_cli(capsys, "--profile", str(tmp_path / "run"), "--cluster", "2xt4")
    assert "ran no GPU of these kinds; every figure is from specifications" in out
    with pytest.raises(SystemExit):
        main(["--profile", str(tmp_path / "run"), "--seq", "64"])
    assert "--model and --seq change what the run measured" in capsys.readouterr().err
