"""The cost model's efficiencies, fitted to published training measurements
(measurements.csv), and the model's error on them.

A measurement is a training run: micro-batch b, accumulation k, on `gpus` cards. The
model predicts its throughput from the planner's line per device (hetcomm.plan.cost):

    sequences/s = gpus · k·b / (k·(a + c·b) + update),

where c's matmul time F/(e·peak) + s·F/fp32_peak (s on tensor cores only) holds the
unknowns: e, the share of peak, one per math (fp32, tf32, tensor16; 16-bit storage
with fp32 math shares fp32's) at each level of hetcomm.plan.cost.efficiency_keys —
the compute capability with the tensor-to-fp32 peak ratio, the compute capability,
the architecture, all pooled; the first that has rows is used — and s, one SIMT
share for all. For
each s on a grid, each e is the 1-D least-squares fit of log(predicted / measured)
over the rows it covers; the s with the least total error is kept.

Leave-one-source-out judges it: the rows of each source (one campaign: the same code
and software) are predicted from a fit to the other sources only. Absolute error is
predicted / measured - 1; relative error compares, within one source and workload,
the ratio of two GPU kinds' throughputs with the predicted ratio — what decides a
split. Multi-GPU rows are left out of both (the all-reduce is not what is fitted); their
weak scaling against the same source's single-GPU run judges the all-reduce model.

    python -m hetcomm.plan.fit            # refit efficiency.csv from measurements.csv
"""

import csv
import importlib.resources
import io
import itertools
import math
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hetcomm.plan.catalog import Catalog, load_catalog
from hetcomm.plan.cost import (CONTEXT_BYTES, SIMT_SHARE_KEY, STATE_BYTES_PER_PARAMETER, STORAGE, all_reduce_cost,
                               device_cost, efficiency_keys, exposed_communication, lookup_efficiency, matmul_seconds,
                               micro_batch_cap, peak_flops, per_tensor_optimizer_seconds)
from hetcomm.plan.model_shape import PRESETS, ModelShape
from hetcomm.plan.planner import BACKWARD_SHARE

# The search range for a share of peak, and the golden-section steps that narrow it to
# well under 0.1% of its value; the SIMT shares tried.
EFFICIENCY_RANGE = (0.02, 1.0)
SEARCH_STEPS = 40
SIMT_SHARE_GRID = tuple(i / 100 for i in range(31))


@dataclass(frozen=True)
class Measurement:
    source: str
    gpu: str
    gpus: int
    link: str           # between the gpus (links.csv); empty for one
    model: str          # bert-base / bert-large
    task: str           # qa / mlm
    seq: int
    micro_batch: int
    accumulation: int
    precision: str
    attention: str
    optimizer: str      # fused, or per-tensor (a Python loop over the parameters)
    throughput: float   # sequences per second, all gpus together
    software: str
    citation: str

    @property
    def shape(self) -> ModelShape:
        return PRESETS[self.model if self.task == "mlm" else f"{self.model}-{self.task}"]

    @property
    def activations(self) -> str | None:
        """How the run's fp16 kept its activations: "o2" for apex's amp O2."""
        return "o2" if self.precision == "fp16" and "apex amp" in self.software else None

    @property
    def run(self) -> tuple:
        """What a multi-GPU row shares with its single-GPU twin."""
        return (self.source, self.gpu, self.model, self.task, self.seq, self.micro_batch, self.accumulation,
                self.precision, self.attention, self.optimizer, self.software)

    @property
    def workload(self) -> tuple:
        """What two rows of one source must share for their ratio to compare GPUs."""
        return self.source, self.model, self.task, self.seq

    @property
    def build(self) -> str:
        """The software build, as the software column names it up to its first ';'. A
        source's rows need not share one: lambda-2021 ran its A40, A4000, A5000 and A100
        80GB in a later container build than its other cards, lambda-2022 split its cards
        between two."""
        return self.software.split(";")[0].strip()


class _PublishedBatch:
    """What a published run's model and precision mean to the planner (for the rows of
    max_batch.csv, batch_bounds.csv and forward_memory.csv)."""

    model: str
    task: str
    precision: str
    software: str

    @property
    def shape(self) -> ModelShape:
        return _preset(self.model, self.task)

    @property
    def activations(self) -> str | None:
        return "o2" if self.precision == "fp16" and "apex amp" in self.software else None

    @property
    def bucket_bytes_per_parameter(self) -> int:
        """torch DDP's buckets: a second copy of every gradient, in the gradients' dtype,
        which DDP all-reduces from (its gradient_as_bucket_view, off by default, would
        make the gradients views of them instead). Other software: none counted."""
        if "torch DDP" not in self.software:
            return 0
        return 2 if self.activations == "o2" else 4


@dataclass(frozen=True)
class MaxBatch(_PublishedBatch):
    source: str
    gpu: str
    model: str
    task: str
    seq: int
    precision: str
    attention: str
    max_batch: int
    software: str
    citation: str


@dataclass(frozen=True)
class BatchBound(_PublishedBatch):
    """Published runs that bound the largest micro-batch from both sides: `ran`, the
    largest micro-batch the source ran, and `failed`, the smallest it reports running
    out of memory (0: none reported). The maximum lies in [ran, failed - 1]."""

    source: str
    gpu: str
    model: str
    task: str           # qa, mlm, or cls (sequence classification: a small head, as qa's)
    seq: int
    precision: str
    attention: str
    ran: int
    failed: int
    software: str
    citation: str

    def error(self, cap: int) -> float:
        return outside_bounds(cap, self.ran, self.failed)


def outside_bounds(cap: int, ran: int, failed: int) -> float:
    """How far `cap` lies outside [ran, failed - 1] (failed 0: no upper bound), relative
    to the bound it crosses: 0 inside, positive above, negative below."""
    if failed and cap >= failed:
        return cap / (failed - 1) - 1
    return min(0.0, cap / ran - 1)


@dataclass(frozen=True)
class ForwardMemory(_PublishedBatch):
    """A published measurement of the memory a card held after one training forward
    (the graph kept, before backward): the weights and what autograd keeps, at the
    largest micro-batch whose forward fitted (`ran`), with the smallest that ran out of
    memory (`failed`) on a card of `memory_gib`. It checks the activation count apart
    from the optimizer's state, on a GPU."""

    source: str
    memory_gib: float   # the card's total capacity, as its out-of-memory messages report it
    model: str
    task: str
    seq: int
    precision: str
    attention: str
    gelu: str           # hetcomm.plan.model_shape.GELUS
    weights_mib: float  # held before the forward
    ran: int
    after_forward_mib: float
    failed: int
    software: str
    citation: str

    def published_bytes_per_sample(self) -> float:
        return (self.after_forward_mib - self.weights_mib) * 2**20 / self.ran

    def predicted_bytes_per_sample(self) -> float:
        return self.shape.saved_bytes_per_sample(self.seq, self.precision, self.attention, self.gelu)

    def predicted_cap(self) -> int:
        """The largest forward the model says fits: the card less the CUDA context and
        the fp32 weights, over the kept bytes per sample."""
        weights = self.shape.parameters(self.seq) * 4
        return micro_batch_cap(self.memory_gib * 2**30, weights + CONTEXT_BYTES, self.predicted_bytes_per_sample())


def _preset(model: str, task: str) -> ModelShape:
    """The BERT preset of a task: pre-training's MLM + NSP heads, or SQuAD's span
    head, whose memory and FLOPs a sequence classifier's head (the [CLS] token's
    pooler and a few logits) matches to well under 1%."""
    return PRESETS[model if task == "mlm" else f"{model}-{'qa' if task == 'cls' else task}"]


def _rows(filename: str, text: str | None = None) -> list[dict[str, str]]:
    if text is None:
        text = (importlib.resources.files("hetcomm") / "plan" / filename).read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return list(csv.DictReader(lines))


def load_measurements(text: str | None = None) -> list[Measurement]:
    """measurements.csv (or `text` in its format)."""
    integers = ("gpus", "seq", "micro_batch", "accumulation")
    return [Measurement(**{k: int(v) if k in integers else float(v) if k == "throughput" else v
                           for k, v in row.items()}) for row in _rows("measurements.csv", text)]


def load_max_batches(text: str | None = None) -> list[MaxBatch]:
    return [MaxBatch(**{k: int(v) if k in ("seq", "max_batch") else v for k, v in row.items()})
            for row in _rows("max_batch.csv", text)]


def load_batch_bounds(text: str | None = None) -> list[BatchBound]:
    """batch_bounds.csv (or `text` in its format); an empty `failed` reads as 0."""
    return [BatchBound(**{k: int(v or 0) if k in ("seq", "ran", "failed") else v for k, v in row.items()})
            for row in _rows("batch_bounds.csv", text)]


def load_forward_memory(text: str | None = None) -> list[ForwardMemory]:
    """forward_memory.csv (or `text` in its format)."""
    integers, floats = ("seq", "ran", "failed"), ("memory_gib", "weights_mib", "after_forward_mib")
    return [ForwardMemory(**{k: int(v) if k in integers else float(v) if k in floats else v for k, v in row.items()})
            for row in _rows("forward_memory.csv", text)]


def predict(row: Measurement, catalog: Catalog, efficiencies: dict[tuple[str, str], float]) -> float:
    """The model's sequences per second for a single-GPU measurement (as run: no wire
    buffers, the whole memory)."""
    device = catalog.device(row.gpu)
    cost = device_cost(device, row.shape, row.seq, row.precision, wire_bytes=0, memory_fraction=1.0,
                       attention=row.attention, efficiencies=efficiencies, activations=row.activations)
    step = row.accumulation * (cost.fixed + cost.per_sample * row.micro_batch) + _update(row, device, cost)
    return row.gpus * row.accumulation * row.micro_batch / step


def _update(row: Measurement, device, cost) -> float:
    """The optimizer step as the row's code runs it: the planner's fused update, or a
    Python loop over the parameters."""
    if row.optimizer == "per-tensor":
        return per_tensor_optimizer_seconds(device, row.shape, row.seq)
    return cost.update_seconds


@dataclass(frozen=True)
class _Parts:
    """A row's prediction with the unknowns left open: per sample, flops_e / e +
    simt · s + rest; the step, accumulation·(fixed + b·per_sample) + update."""

    row: Measurement
    keys: tuple[tuple[str, str], ...]
    flops_e: float      # FLOPs / the math's peak
    simt: float         # FLOPs / the fp32 peak on tensor cores, else 0
    rest: float         # the memory-bound seconds per sample
    fixed: float
    update: float
    fp32_path: float = math.inf   # tf32: the matmuls on the fp32 units, at their fitted efficiency

    @classmethod
    def of(cls, row: Measurement, catalog: Catalog) -> "_Parts":
        device = catalog.device(row.gpu)
        unit = device_cost(device, row.shape, row.seq, row.precision, wire_bytes=0, memory_fraction=1.0,
                           attention=row.attention, efficiency=1.0, activations=row.activations)
        seconds = matmul_seconds(device, row.shape, row.seq, row.precision, 1.0)
        return cls(row, efficiency_keys(device, row.precision), seconds,
                   matmul_seconds(device, row.shape, row.seq, row.precision, 1.0, 1.0) - seconds,
                   unit.per_sample - seconds, unit.fixed, _update(row, device, unit))

    def log_error(self, efficiency: float, simt_share: float) -> float:
        per_sample = min(self.flops_e / efficiency + self.simt * simt_share, self.fp32_path) + self.rest
        k, b = self.row.accumulation, self.row.micro_batch
        predicted = k * b / (k * (self.fixed + b * per_sample) + self.update)
        return math.log(predicted / self.row.throughput)


def predicted_cap(row: MaxBatch | BatchBound, catalog: Catalog) -> int:
    """The largest micro-batch the model says fits on the whole card, with DDP's bucket
    copies where the run used DDP."""
    device = catalog.device(row.gpu)
    shape, storage = row.shape, STORAGE[row.precision]
    state = shape.parameters(row.seq) * (STATE_BYTES_PER_PARAMETER[storage] + row.bucket_bytes_per_parameter) \
        + CONTEXT_BYTES
    return micro_batch_cap(device.memory_gib * 2**30, state,
                           shape.activation_bytes_per_sample(row.seq, row.activations or storage, row.attention))


def predicted_cap_of_run(row: Measurement, catalog: Catalog) -> int:
    """predicted_cap for the card, model and precision a measurement ran."""
    return predicted_cap(MaxBatch(row.source, row.gpu, row.model, row.task, row.seq, row.precision, row.attention, 0,
                                  row.software, row.citation), catalog)


def _fit_one(parts: Sequence[_Parts], simt_share: float) -> tuple[float, float]:
    """The share of peak that minimises the squared log error of `parts`, and that
    error: golden-section search on its logarithm (the error is unimodal in it: the
    matmul time falls monotonically as it grows)."""
    def error(log_value: float) -> float:
        return sum(p.log_error(math.exp(log_value), simt_share) ** 2 for p in parts)

    low, high = (math.log(v) for v in EFFICIENCY_RANGE)
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(SEARCH_STEPS):
        a, b = high - ratio * (high - low), low + ratio * (high - low)
        if error(a) < error(b):
            high = b
        else:
            low = a
    best = (low + high) / 2
    return math.exp(best), error(best)


def fit_efficiencies(rows: Iterable[Measurement], catalog: Catalog) -> dict[tuple[str, str], float]:
    """(level, math) -> share of peak at every level some single-GPU row covers, and
    SIMT_SHARE_KEY -> the SIMT share."""
    parts = [_Parts.of(row, catalog) for row in rows if row.gpus == 1]
    # fp32 first: TF32's alternative path depends on it, and nothing of it on the SIMT share.
    fitted = _fit_levels([p for p in parts if p.keys[0][1] == "fp32"], 0.0)
    tensor = []
    for part in parts:
        if part.keys[0][1] == "tf32":
            device = catalog.device(part.row.gpu)
            fp32 = lookup_efficiency(efficiency_keys(device, "fp32"), fitted)
            fp32_seconds = part.flops_e * peak_flops(device, "tf32") / peak_flops(device, "fp32") / fp32
            part = replace(part, fp32_path=fp32_seconds)
        if part.keys[0][1] != "fp32":
            tensor.append(part)
    simt_share = min(SIMT_SHARE_GRID, key=lambda share: _fit_levels(tensor, share, most_specific_error=True))
    fitted |= _fit_levels(tensor, simt_share)
    fitted[SIMT_SHARE_KEY] = simt_share
    return fitted


def _fit_levels(parts: Sequence[_Parts], simt_share: float, most_specific_error: bool = False):
    """Every level's fit of `parts`; or, with most_specific_error, the total error of the
    most specific level, which decides each row's prediction."""
    groups: dict[tuple[str, str], list[_Parts]] = {}
    for part in parts:
        for key in part.keys:
            groups.setdefault(key, []).append(part)
    if most_specific_error:
        return sum(_fit_one(groups[key], simt_share)[1] for key in {part.keys[0] for part in parts})
    return {key: _fit_one(members, simt_share)[0] for key, members in groups.items()}


@dataclass(frozen=True)
class Prediction:
    row: Measurement
    predicted: float

    @property
    def error(self) -> float:
        return self.predicted / self.row.throughput - 1


def leave_one_source_out(rows: Sequence[Measurement], catalog: Catalog) -> list[Prediction]:
    """Every single-GPU row predicted from a fit to the other sources' rows."""
    predictions = []
    for source in dict.fromkeys(r.source for r in rows):
        fitted = fit_efficiencies([r for r in rows if r.source != source], catalog)
        predictions += [Prediction(r, predict(r, catalog, fitted)) for r in rows if r.source == source and r.gpus == 1]
    return predictions


@dataclass(frozen=True)
class PairError:
    first: Prediction
    second: Prediction

    @property
    def error(self) -> float:
        """The predicted throughput ratio of the two over the measured one, minus 1,
        taken the way round that makes it positive-or-small (|error| is symmetric)."""
        measured = self.first.row.throughput / self.second.row.throughput
        predicted = self.first.predicted / self.second.predicted
        ratio = predicted / measured
        return ratio - 1 if ratio >= 1 else 1 / ratio - 1


def relative_errors(predictions: Sequence[Prediction], same_build: bool = False) -> list[PairError]:
    """Every pair of different GPU kinds within one source and workload, each at the
    precision it ran (a mixed cluster runs every card at its own); with same_build, only
    pairs run in the same software build (whose ratio holds no software factor)."""
    groups: dict[tuple, list[Prediction]] = {}
    for p in predictions:
        groups.setdefault((*p.row.workload, p.row.build if same_build else ""), []).append(p)
    return [PairError(a, b) for members in groups.values() for a, b in itertools.combinations(members, 2)
            if a.row.gpu != b.row.gpu]


@dataclass(frozen=True)
class Scaling:
    row: Measurement      # a multi-GPU run
    single: Measurement   # the same run on one GPU, in the same source
    predicted: float      # its throughput over gpus × the single GPU's, as the planner predicts it

    @property
    def measured(self) -> float:
        return self.row.throughput / (self.row.gpus * self.single.throughput)


def weak_scaling(rows: Sequence[Measurement], catalog: Catalog,
                 efficiencies: dict[tuple[str, str], float]) -> list[Scaling]:
    """Each multi-GPU row that has a single-GPU twin: the planner's step on one GPU,
    then the ring all-reduce of the gradients (16-bit in fp16 runs) through the row's
    link, overlapped with backward as DDP does."""
    found = []
    for row in rows:
        twin = [r for r in rows if r.gpus == 1 and r.run == row.run]
        if row.gpus == 1 or not twin:
            continue
        device = catalog.device(row.gpu)
        cost = device_cost(device, row.shape, row.seq, row.precision, wire_bytes=0, memory_fraction=1.0,
                           attention=row.attention, efficiencies=efficiencies, activations=row.activations)
        compute = row.accumulation * (cost.fixed + cost.per_sample * row.micro_batch)
        step = compute + _update(row, device, cost)
        wire = 2 if STORAGE[row.precision] != "fp32" else 4
        reduce = all_reduce_cost(row.gpus, row.shape.parameters(row.seq), wire, catalog.link(row.link))
        exposed = exposed_communication(reduce, BACKWARD_SHARE * compute, overlap=True)
        found.append(Scaling(row, twin[0], step / (step + exposed)))
    return found


def summary(values: Sequence[float]) -> tuple[float, float]:
    """Mean and maximum of |values|."""
    magnitudes = [abs(v) for v in values]
    return statistics.fmean(magnitudes), max(magnitudes)


def efficiency_table(fitted: dict[tuple[str, str], float], rows: Sequence[Measurement], catalog: Catalog) -> str:
    """efficiency.csv's text."""
    counts: dict[tuple[str, str], int] = {}
    for row in rows:
        if row.gpus == 1:
            for key in efficiency_keys(catalog.device(row.gpu), row.precision):
                counts[key] = counts.get(key, 0) + 1
    out = io.StringIO()
    out.write("# The cost model's fitted constants: hetcomm.plan.fit fits them to measurements.csv\n"
              "# (python -m hetcomm.plan.fit rewrites this file).\n"
              "# level: a compute capability with its 16-bit tensor peak over its fp32 peak (sm_XY/Rx), a compute\n"
              "# capability (sm_XY), an architecture, or * (pooled over all); the most specific level with a row is\n"
              "# used. math: fp32 (SIMT, and 16-bit storage with fp32 math on cards without tensor\n"
              "# cores), tf32, tensor16 (fp16/bf16 on tensor cores): value is the share of that math's peak FLOP/s\n"
              "# the matmuls reach; simt-share: the tensor-core matmuls' time that runs at the fp32 rate instead.\n"
              "# rows: the single-GPU measurements behind it.\n")
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(("level", "math", "value", "rows"))
    counts[SIMT_SHARE_KEY] = counts.get(("*", "tf32"), 0) + counts.get(("*", "tensor16"), 0)
    order = {"sm": 0, "*": 2}
    for key in sorted(fitted, key=lambda k: (order.get(k[0][:2] if k[0] != "*" else "*", 1), k)):
        writer.writerow((*key, f"{fitted[key]:.4f}", counts.get(key, 0)))
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    catalog = load_catalog()
    rows = load_measurements()
    fitted = fit_efficiencies(rows, catalog)
    path = Path(__file__).with_name("efficiency.csv")
    path.write_text(efficiency_table(fitted, rows, catalog), encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
