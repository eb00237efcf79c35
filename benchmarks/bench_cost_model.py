"""The planner's cost model against published training measurements
(hetcomm/plan/measurements.csv, max_batch.csv, batch_bounds.csv, forward_memory.csv):
leave-one-source-out error, absolute and relative (ratios between GPU kinds within one
source and workload), the TF32 and fp16-on-Pascal rows, the largest micro-batches
(published maxima, and published runs that bound them), the memory a published forward
kept, multi-GPU weak scaling, and the full fit's residuals.

Targets (issue 18): relative within 15% on average, at most 30%; absolute within 20%
on average; TF32 and fp16-on-Pascal rows within 30%; maximum batch sizes within 25%.

    python benchmarks/bench_cost_model.py                     # table on stdout, ~10 s
    python benchmarks/bench_cost_model.py --out benchmarks/results   # cost_model_cpu.{md,json}
    python benchmarks/bench_cost_model.py --activation-traffic 5.3   # what-if: another memory-bound count
"""

import argparse
from unittest import mock

from result_files import add_out_arguments, write_results

import hetcomm.plan.cost
from hetcomm.plan.catalog import load_catalog
from hetcomm.plan.cost import all_reduce_cost, math_of
from hetcomm.plan.fit import (fit_efficiencies, leave_one_source_out, load_batch_bounds, load_forward_memory,
                              load_max_batches, load_measurements, predict, predicted_cap, predicted_cap_of_run,
                              relative_errors, summary, weak_scaling)

WORST_PAIRS = 8
# The rows no documented cause explains (docs/planner.md, "What remains off"): lambda-2021's A40 in
# TF32 runs at 0.67-0.78 of the same-chip A6000 while its fp16 rows, and the A4000 and A5000 in
# the same container build, fit. Reported once without them; counted everywhere else.
UNEXPLAINED = ("lambda-2021", "a40", "tf32")


def _kind(row) -> tuple[str, str, str]:
    return row.source, row.gpu, row.precision


def percent(value: float) -> str:
    return f"{100 * value:.1f}%"


def report() -> tuple[str, dict]:
    catalog = load_catalog()
    rows = load_measurements()
    predictions = leave_one_source_out(rows, catalog)
    pairs = relative_errors(predictions)
    lines = ["## Leave-one-source-out (each source predicted from a fit to the others)", "",
             "| source | rows | absolute mean | absolute max | GPU pairs | relative mean | relative max |",
             "|---|---|---|---|---|---|---|"]
    record: dict = {"sources": {}}
    for source in [*dict.fromkeys(p.row.source for p in predictions), "all"]:
        mine = [p.error for p in predictions if source in ("all", p.row.source)]
        theirs = [e.error for e in pairs if source in ("all", e.first.row.source)]
        (absolute, absolute_max), (relative, relative_max) = summary(mine), summary(theirs)
        lines.append(f"| {source} | {len(mine)} | {percent(absolute)} | {percent(absolute_max)} | {len(theirs)} | "
                     f"{percent(relative)} | {percent(relative_max)} |")
        record["sources"][source] = {"rows": len(mine), "absolute_mean": absolute, "absolute_max": absolute_max,
                                     "pairs": len(theirs), "relative_mean": relative, "relative_max": relative_max}
    same = [e.error for e in relative_errors(predictions, same_build=True)]
    same_mean, same_max = summary(same)
    lines += ["", f"Pairs run in the same software build only (lambda-2021 ran its A40, A4000, A5000 and A100 "
              f"80GB in a later build than its other cards; lambda-2022 split its cards between two builds): "
              f"{len(same)} pairs, relative mean {percent(same_mean)}, max {percent(same_max)}. The table above "
              f"counts every pair."]
    record["same_build_pairs"] = {"pairs": len(same), "relative_mean": same_mean, "relative_max": same_max}
    rest = [e.error for e in pairs if UNEXPLAINED not in {_kind(e.first.row), _kind(e.second.row)}]
    rest_mean, rest_max = summary(rest)
    lines += ["", f"Without the pairs holding {' '.join(UNEXPLAINED)} (the unexplained outlier, docs/planner.md): "
              f"{len(rest)} pairs, relative mean {percent(rest_mean)}, max {percent(rest_max)}. Every figure "
              f"elsewhere keeps them."]
    record["pairs_without_unexplained"] = {"excluded": list(UNEXPLAINED), "pairs": len(rest),
                                           "relative_mean": rest_mean, "relative_max": rest_max}
    lines += ["", f"Worst {WORST_PAIRS} pairs (predicted ratio over measured):", ""]
    for pair in sorted(pairs, key=lambda e: -e.error)[:WORST_PAIRS]:
        a, b = pair.first.row, pair.second.row
        lines.append(f"- {percent(pair.error)}: {a.source} {a.model}-{a.task} {a.gpu} {a.precision} b{a.micro_batch} / "
                     f"{b.gpu} {b.precision} b{b.micro_batch}")

    def special(title: str, chosen) -> None:
        lines.extend(["", f"## {title} (leave-one-source-out)", "", "| source | GPU | model | micro-batch | measured | "
                      "predicted | error |", "|---|---|---|---|---|---|---|"])
        errors = []
        for p in chosen:
            r = p.row
            errors.append(p.error)
            lines.append(f"| {r.source} | {r.gpu} | {r.model}-{r.task} {r.seq} | {r.micro_batch} | {r.throughput:g} | "
                         f"{p.predicted:.1f} | {p.error:+.1%} |")
        mean, largest = summary(errors)
        lines.append(f"\nmean |error| {percent(mean)}, max {percent(largest)}")
        record[title] = {"mean": mean, "max": largest, "rows": len(errors)}

    special("TF32 rows", [p for p in predictions if p.row.precision == "tf32"])
    special("fp16 on Pascal (16-bit storage, fp32 math)",
            [p for p in predictions if math_of(catalog.device(p.row.gpu), p.row.precision) == "fp16-fp32math"])

    lines += ["", "## Largest micro-batch: published maxima", "", "| source | GPU | model | seq | published | "
              "predicted | error |", "|---|---|---|---|---|---|---|"]
    record["max_batch"] = []
    for row in load_max_batches():
        cap = predicted_cap(row, catalog)
        error = cap / row.max_batch - 1 if row.max_batch else None
        lines.append(f"| {row.source} | {row.gpu} | {row.model} | {row.seq} | {row.max_batch} | {cap} | "
                     f"{'-' if error is None else f'{error:+.0%}'} |")
        record["max_batch"].append({"model": row.model, "seq": row.seq, "published": row.max_batch, "predicted": cap})
    lines += ["", "## Largest micro-batch: published bounds (the largest micro-batch a source ran, the smallest it "
              "reports running out of memory; the error is the distance outside them)", "",
              "| source | GPU | model | seq | precision | software | ran | ran out of memory | predicted | error |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    record["batch_bounds"] = []
    for row in load_batch_bounds():
        cap = predicted_cap(row, catalog)
        lines.append(f"| {row.source} | {row.gpu} | {row.model}-{row.task} | {row.seq} | {row.precision} | "
                     f"{row.software} | {row.ran} | {row.failed or '-'} | {cap} | {row.error(cap):+.1%} |")
        record["batch_bounds"].append({"source": row.source, "gpu": row.gpu, "model": row.model, "seq": row.seq,
                                       "software": row.software, "ran": row.ran, "failed": row.failed,
                                       "predicted": cap})
    lines += ["", "## Memory held after one training forward, published (pytorch_transformers 1.x, 11.17 GiB card): "
              "kept bytes per sample and the largest forward that fits", "",
              "| source | model | seq | GELU | published MiB / sample | predicted | error | F.gelu's count | "
              "forward ran | ran out of memory | predicted largest |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    record["forward_memory"] = []
    for row in load_forward_memory():
        published, predicted = row.published_bytes_per_sample(), row.predicted_bytes_per_sample()
        fused = row.shape.saved_bytes_per_sample(row.seq, row.precision, row.attention, "fused")
        cap = row.predicted_cap()
        lines.append(f"| {row.source} | {row.model}-{row.task} | {row.seq} | {row.gelu} | {published / 2**20:.1f} | "
                     f"{predicted / 2**20:.1f} | {predicted / published - 1:+.1%} | {fused / published - 1:+.1%} | "
                     f"{row.ran} | {row.failed} | {cap} |")
        record["forward_memory"].append({"model": row.model, "seq": row.seq, "gelu": row.gelu,
                                         "published_bytes": published, "predicted_bytes": predicted,
                                         "fused_gelu_bytes": fused, "ran": row.ran, "failed": row.failed,
                                         "predicted_cap": cap})
    lines += ["", "## Largest micro-batch against the micro-batches lambda-2022 ran (each ran, so each is at most the "
              "maximum; NGC 22.x chose them to fill the card)", "",
              "| GPU | model | precision | ran | predicted maximum | predicted / ran |", "|---|---|---|---|---|---|"]
    ratios = []
    for r in rows:
        if r.source == "lambda-2022" and r.gpus == 1:
            cap = predicted_cap_of_run(r, catalog)
            ratios.append(cap / r.micro_batch)
            lines.append(f"| {r.gpu} | {r.model} | {r.precision} | {r.micro_batch} | {cap} | "
                         f"{cap / r.micro_batch:.2f} |")
    lines.append(f"\npredicted / ran: min {min(ratios):.2f}, mean {sum(ratios) / len(ratios):.2f}, "
                 f"max {max(ratios):.2f}")
    record["lambda_2022_cap_over_ran"] = {"min": min(ratios), "mean": sum(ratios) / len(ratios), "max": max(ratios)}

    fitted = fit_efficiencies(rows, catalog)
    lines += ["", "## Weak scaling: N GPUs' throughput over N times one GPU's, same source (the planner's ring "
              "all-reduce, overlapped with backward as DDP runs it)", "",
              "| source | system | GPUs | model | precision | micro-batch | measured | predicted | step lost, ms | "
              "all-reduce, ms | lost / all-reduce |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    record["weak_scaling"] = []
    for scaling in weak_scaling(rows, catalog, fitted):
        r = scaling.row
        # The time each step lost against the single-GPU run, and the planner's all-reduce of the gradients
        # (16-bit in fp16 runs) through the row's link, not overlapped at all.
        single_step = r.micro_batch * r.accumulation / scaling.single.throughput
        lost = single_step * (1 / scaling.measured - 1)
        wire = 2 if r.precision == "fp16" else 4
        reduce = all_reduce_cost(r.gpus, r.shape.parameters(r.seq), wire, catalog.link(r.link)).seconds
        lines.append(f"| {r.source} | {r.gpu}, {r.link} | {r.gpus} | {r.model}-{r.task} {r.seq} | {r.precision} | "
                     f"{r.micro_batch} | {scaling.measured:.2f} | {scaling.predicted:.2f} | {1e3 * lost:.0f} | "
                     f"{1e3 * reduce:.1f} | {lost / reduce:.1f} |")
        record["weak_scaling"].append({"source": r.source, "gpu": r.gpu, "gpus": r.gpus, "model": r.model,
                                       "precision": r.precision, "measured": scaling.measured,
                                       "predicted": scaling.predicted, "lost_s": lost, "all_reduce_s": reduce})
    lines += ["", "Not modelled: the lost time is not the link's. lambda-2020 loses 90-116 ms a step whatever the "
              "model (BERT-base's all-reduce is a third of BERT-large's), 13-26 times the all-reduce; NVIDIA's runs "
              "lose 1.9-3.7 times it, one 13 times. One overlap or bandwidth factor fitted to these would miss by "
              "2-10x row to row, so the planner keeps its overlapped all-reduce (predicted 1.00 on NVLink)."]
    lines += ["", "## Residuals of the fit to every source (efficiency.csv)", "",
              "| source | GPU | model | precision | micro-batch | measured | fitted | residual |",
              "|---|---|---|---|---|---|---|---|"]
    record["residuals"] = []
    for r in rows:
        if r.gpus == 1:
            value = predict(r, catalog, fitted)
            lines.append(f"| {r.source} | {r.gpu} | {r.model}-{r.task} {r.seq} | {r.precision} | {r.micro_batch} | "
                         f"{r.throughput:g} | {value:.1f} | {value / r.throughput - 1:+.1%} |")
            record["residuals"].append({"source": r.source, "gpu": r.gpu, "model": r.model, "task": r.task,
                                        "seq": r.seq, "precision": r.precision, "micro_batch": r.micro_batch,
                                        "measured": r.throughput, "fitted": value})
    return "\n".join(lines) + "\n", record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_arguments(parser)
    parser.add_argument("--activation-traffic", type=float, metavar="PASSES",
                        help="what-if: count the memory-bound work as PASSES passes over the activations kept for "
                             f"backward instead of the model's {hetcomm.plan.cost.ACTIVATION_TRAFFIC} (refitted, "
                             "judged the same way; the scores' chain is counted apart as before)")
    args = parser.parse_args()
    traffic = args.activation_traffic or hetcomm.plan.cost.ACTIVATION_TRAFFIC
    with mock.patch.object(hetcomm.plan.cost, "ACTIVATION_TRAFFIC", traffic):
        text, record = report()
    title = "# Cost model against published measurements"
    if args.activation_traffic:
        title += f", what-if: the memory-bound work at {traffic:g} passes over what is kept"
        record["activation_traffic"] = traffic
    print(text)
    if args.out:
        write_results(args.out, "cost_model", f"{title}\n\n{text}", record,
                      variant=f"traffic{traffic:g}" if args.activation_traffic else None)


if __name__ == "__main__":
    main()
