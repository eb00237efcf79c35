"""What BERT-base and BERT-large (transformers' BertForQuestionAnswering, built from a
config: no download) keep for backward per sample, measured on the CPU with autograd's
saved-tensor hooks (hetcomm.plan.saved_bytes), against the planner's activation model
(hetcomm.plan.model_shape), eager and fused attention, fp32 and autocast.

    python benchmarks/bench_bert_memory.py                       # ~5 min on 2 cores
    python benchmarks/bench_bert_memory.py --out benchmarks/results   # bert_memory_cpu.{md,json}
"""

import argparse

import torch
from result_files import add_out_arguments, write_results

from hetcomm.plan.model_shape import PRESETS
from hetcomm.plan.saved_bytes import measure_bert

SEQS = (128, 384)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_arguments(parser)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lines = ["| model | seq | precision | attention | measured per layer / token / h | measured MB / sample | "
             "model MB / sample | model / measured |", "|---|---|---|---|---|---|---|---|"]
    record = []
    for name in ("bert-base-qa", "bert-large-qa"):
        shape = PRESETS[name]
        for seq in SEQS:
            for precision in ("fp32", "bf16", "o2"):
                for attention in ("eager", "fused"):
                    measured = measure_bert(shape, seq, precision, attention)
                    total = measured.total(shape.n_layer)
                    model = shape.saved_bytes_per_sample(seq, precision, attention)
                    row = {"model": name, "seq": seq, "precision": precision, "attention": attention,
                           "measured_layer_bytes": measured.layer, "measured_outside_bytes": measured.outside,
                           "measured_bytes": total, "model_bytes": model}
                    record.append(row)
                    lines.append(f"| {name} | {seq} | {precision} | {attention} | "
                                 f"{measured.layer / seq / shape.n_embd:.2f} | {total / 1e6:.1f} | {model / 1e6:.1f} | "
                                 f"{model / total:.3f} |")
                    print(lines[-1], flush=True)
    text = ("# BERT's saved-for-backward bytes: measured (transformers, CPU, hooks) against the planner's model\n\n"
            "Layers measured at 1 and 2 layers, batches 1 and 2, full width, heads and vocabulary; "
            "extrapolated linearly to 12 / 24 layers. bf16: CPU autocast, with the softmax in fp32 as CUDA "
            "autocast runs it (2-byte storage, as fp16); o2: the model cast to bf16, as apex amp O2 casts it to fp16. "
            "Dropout keeps CUDA's 1-byte mask.\n\n"
            + "\n".join(lines) + "\n")
    if args.out:
        write_results(args.out, "bert_memory", text, record)


if __name__ == "__main__":
    main()
