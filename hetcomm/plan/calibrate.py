"""A profile of a real run, for the planner: each rank's measured line t = a + c·b
(the balancer's fit, over the micro-batch sizes the run gave it), its update time,
and the measured all-reduce, read from a `hetcomm train` run directory.

The planner then predicts from measurements instead of specifications: the run's own
cluster directly, or, for a --cluster of catalogued cards, the share of peak FLOP/s
that the run's GPUs reached (their calibrated efficiency)."""

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from hetcomm.amp import precision_for_capability
from hetcomm.balance import fit_step_time
from hetcomm.plan.catalog import Catalog, Link
from hetcomm.plan.cost import STATE_BYTES_PER_PARAMETER, DeviceCost, measured_efficiency
from hetcomm.plan.model_shape import ModelShape
from hetcomm.plan.planner import WIRE_BYTES, Member
from hetcomm.train.runlog import read_steps

TRAINER_WIRES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
# What the profile reads from each step's record ("samples" too, where the run logged it).
PROFILED = ("step", "micro_batch", "compute_s", "update_s", "wait_s")


@dataclass(frozen=True)
class RankProfile:
    device: str                          # as torch names it ("cpu" for CPU workers)
    capability: tuple[int, int] | None
    precision: str                       # what the rank computed in, as its run recorded it
    host: str
    speed: float                         # the simulated speed factor (1 on real hardware)
    fixed: float
    per_sample: float
    method: str                          # "line": a + c·b fitted; "throughput": one size seen, a = 0
    jitter: float                        # spread of log(measured / fitted time): the step-to-step noise
    update_s: float
    cap: int | None


@dataclass(frozen=True)
class RunProfile:
    path: Path
    model: ModelShape
    seq: int
    global_batch: int
    wire: str
    simulated: bool
    ranks: tuple[RankProfile, ...]
    comm_s: float     # the all-reduce as the last rank to arrive sees it (it waits for nobody)
    steps: int        # steps the profile was taken from

    @property
    def link(self) -> Link:
        """The link that the measured all-reduce implies for this run's ring."""
        world = len(self.ranks)
        if world < 2:
            raise ValueError(f"--profile {self.path}: a run of one rank measures no all-reduce, so there is no cluster "
                             f"to plan from it alone; add --cluster to plan cards calibrated by it")
        sent = 2 * (world - 1) / world * self.model.parameters(self.seq) * WIRE_BYTES[self.wire]
        return Link(name="measured", label=f"the link measured by the all-reduce of {self.path.name}", aliases=(),
                    scope="custom", bandwidth_gbs=sent / self.comm_s / 1e9, latency_us=0.0, source=str(self.path))

    def members(self) -> list[Member]:
        """The run's ranks as planner members, costed by their measurements."""
        hosts = list(dict.fromkeys(r.host for r in self.ranks))
        parameters = self.model.parameters(self.seq)
        members = []
        for i, rank in enumerate(self.ranks):
            precision = rank.precision
            cost = DeviceCost(precision=precision, fixed=rank.fixed, per_sample=rank.per_sample, cap=rank.cap,
                              state_bytes=parameters * (STATE_BYTES_PER_PARAMETER[precision] + WIRE_BYTES[self.wire]),
                              activation_bytes=self.model.activation_bytes_per_sample(self.seq, precision),
                              memory_bytes=None, update_seconds=rank.update_s, efficiency=None)
            label = rank.device + (f" (simulated speed {rank.speed:g})" if self.simulated else "")
            members.append(Member(f"rank{i}", label, hosts.index(rank.host), cost, "measured", rank.jitter))
        return members

    def efficiencies(self, catalog: Catalog) -> dict[str, float]:
        """Per catalogued kind of GPU in the run, the median share of peak FLOP/s its
        ranks reached (CPU ranks and unknown cards contribute nothing)."""
        found: dict[str, list[float]] = {}
        for rank in self.ranks:
            if rank.capability is None or rank.speed != 1:
                continue
            try:
                device = catalog.device(rank.device)
            except ValueError:
                continue
            found.setdefault(device.name, []).append(
                measured_efficiency(device, self.model, self.seq, rank.precision, rank.per_sample))
        return {name: statistics.median(values) for name, values in found.items()}


def step_jitter(points: list[tuple[int, float]], fixed: float, per_sample: float) -> float:
    """The step-to-step spread of a rank's compute time, as a standard deviation of
    log(time): pooled over the repeats at each size, so that how well the line fits
    across sizes does not count as noise; from the residuals of the line when no size
    was run twice."""
    by_size: dict[int, list[float]] = {}
    for size, seconds in points:
        by_size.setdefault(size, []).append(math.log(seconds))
    repeats = [logs for logs in by_size.values() if len(logs) > 1]
    if not repeats:
        return statistics.pstdev(math.log(t / (fixed + per_sample * b)) for b, t in points)
    squares = sum(sum((x - statistics.fmean(logs)) ** 2 for x in logs) for logs in repeats)
    return math.sqrt(squares / sum(len(logs) - 1 for logs in repeats))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--profile: cannot read {path}: {error}") from None


def load_run_profile(run_dir: str | Path, first_step: int = 1, last_step: int | None = None) -> RunProfile:
    """The profile of the run in `run_dir` from its steps first_step..last_step
    (inclusive; step 0 pays for warm-up and is skipped by default). ValueError naming
    the file when it is not a hetcomm run with the measurements needed."""
    path = Path(run_dir)
    if path.is_file():
        path = path.parent
    header_path, steps_path = path / "run.json", path / "steps.jsonl"
    for needed in (header_path, steps_path):
        if not needed.is_file():
            raise ValueError(f"--profile {run_dir}: no {needed.name} there; expected the directory of a "
                             f"`hetcomm train` run")
    header = _read_json(header_path)
    if "ranks" not in header or "vocab_size" not in header:
        raise ValueError(f"--profile {run_dir}: {header_path.name} has no per-rank devices; the run was made by an "
                         f"older hetcomm: run it again")
    config = header["config"]
    try:
        records = read_steps(path, required=PROFILED)
    except ValueError as error:
        raise ValueError(f"--profile {run_dir}: {error}") from None
    chosen = [r for r in records if r["step"] >= first_step and (last_step is None or r["step"] <= last_step)]
    if not chosen:
        raise ValueError(f"--profile {run_dir}: no steps between {first_step} and {last_step} in {steps_path.name}")
    world = len(header["ranks"])
    caps = header.get("memory_caps") or [None] * world   # what the run used: given or probed
    ranks = []
    for i, rank in enumerate(header["ranks"]):
        # Only steps the rank ran in one micro-step fit the one-micro-step line; the
        # samples it did ("samples": a handoff may have moved some off the split).
        done = [r.get("samples", r["micro_batch"])[i] for r in chosen]
        points = [(b, r["compute_s"][i]) for b, r in zip(done, chosen) if b > 0 and (caps[i] is None or b <= caps[i])]
        if not points:
            raise ValueError(f"--profile {run_dir}: rank {i} computed no single-micro-step batch in the chosen steps")
        try:
            fixed, per_sample = fit_step_time(points)
            method = "line"
        except ValueError:
            # One size only (a fixed split), or too noisy for a slope: its throughput.
            fixed, per_sample, method = 0.0, statistics.median(t / b for b, t in points), "throughput"
        jitter = step_jitter(points, fixed, per_sample)
        capability = tuple(rank["capability"]) if rank["capability"] else None
        # Runs record each rank's precision; older ones computed by the policy of their day
        # (fp32 on sm_61), which is what their absence means.
        precision = rank.get("precision") or ("fp32" if capability == (6, 1) else precision_for_capability(capability))
        ranks.append(RankProfile(device=rank["device"], capability=capability, precision=precision, host=rank["host"],
                                 speed=float(rank.get("speed", 1.0)), fixed=fixed, per_sample=per_sample,
                                 method=method, jitter=jitter, cap=caps[i],
                                 update_s=statistics.median(r["update_s"][i] for r in chosen)))
    comm = statistics.median(min(w - u for w, u in zip(r["wait_s"], r["update_s"])) for r in chosen)
    model = ModelShape(f"the model of {path.name}", config["n_layer"], config["n_head"], config["n_embd"],
                       header["vocab_size"])
    return RunProfile(path=path, model=model, seq=config["block_size"], global_batch=config["global_batch"],
                      wire=TRAINER_WIRES[config["wire"]], simulated=bool(header.get("simulated")),
                      ranks=tuple(ranks), comm_s=max(comm, math.ulp(1.0)), steps=len(chosen))
