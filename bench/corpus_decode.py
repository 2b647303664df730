"""The corpus's decode steps against the peers at a real past length.

The corpus benchmark (bench.corpus: same tools, same kernel counts and interleaved latency) for
the decode-step models of the corpus (models/corpus/build.py: NAME_decode_{ts,dynamo}, one new
token after a past of P cached positions), timed at `--past` (default 128) and `--batch`
instead of the zoo's default dims: every tool's output is checked against the original's there,
and onnxfuse verifies at those dims. The report adds kernels per decoder
layer (kernels over the model's layers: the whole step, shared mask and position arithmetic
included).

    python -m bench.corpus_decode                       # bench/results/corpus_decode.md
    python -m bench.corpus_decode --past 32 --budget 1
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import click

from bench import corpus, harness

DEFAULT_OUT = harness.RESULTS / "corpus_decode.md"


def layers(zm) -> int:
    return sum(1 for i in zm.inputs if i.name.startswith("past_key_"))


def per_layer_table(rows: list[dict], zms: dict) -> list[str]:
    lines = ["## Kernels per decoder layer", "",
             "Kernels per inference over the model's decoder layers (the shared mask and position "
             "arithmetic included).", "",
             *harness.table_head([("model", "l"), ("layers", "r"), *((t, "r") for t in corpus.TOOLS)])]
    for row in rows:
        n = layers(zms[row["name"]])
        cells = [f"{row['tools'][t]['kernels'] / n:.1f}" if row["tools"][t].get("kernels") else "failed"
                 for t in corpus.TOOLS]
        lines.append(f"| {row['name']} | {n} | " + " | ".join(cells) + " |")
    return lines + [""]


@harness.script(__doc__)
@click.option("--models", callback=harness.csv(), default=None, help="decode models (default: every NAME_decode_*)")
@click.option("--past", type=int, default=128, show_default=True, help="past length the steps are timed at")
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--budget", type=float, default=3.0, show_default=True,
              help="seconds of timed rounds per model and thread count")
@click.option("--threads", default="1", callback=harness.csv(int), show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=DEFAULT_OUT, show_default=True)
def cli(args, stamp: harness.RunStamp) -> int:
    from onnxfuse import zoo

    decode = [m for m in zoo.list_models() if m.source == "corpus" and "_decode_" in m.name]
    if args.models:
        unknown = sorted(set(args.models) - {m.name for m in decode})
        if unknown:
            raise click.BadParameter(f"not decode models: {', '.join(unknown)}", param_hint="--models")
        decode = [m for m in decode if m.name in args.models]
    dims = {"batch": args.batch, "past": args.past, "total": args.past + 1}
    t0 = time.perf_counter()
    rows, zms = [], {}
    for zm in decode:
        harness.log(f"{zm.name} at {dims} ...")
        timed = dataclasses.replace(zm, dims=dims)
        zms[zm.name] = zm
        rows.append(corpus.bench_model(timed, args.threads, args.budget))
    text = corpus.render(rows, stamp, args.threads, args.budget, time.perf_counter() - t0)
    text = text.replace("at their default dims", f"at batch {args.batch}, past {args.past} (one new token; "
                        "onnxfuse optimized and verified there)")
    text += "\n" + "\n".join(per_layer_table(rows, zms))
    harness.write_report(args.out, text)
    if args.out is not None:
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            {"command": stamp.command, "dims": dims, "machine": harness.machine(), "models": rows}, indent=1) + "\n")
    return 0


main = harness.main_of(cli)

if __name__ == "__main__":
    main()
