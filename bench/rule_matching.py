"""Matching time of the rule engine (onnxfuse/graph/rules.py) against the matchers it replaced
and against onnxscript's rewriter, on the zoo and (optionally) GPT-2 small.

Three measurements per model, each the best of --repeats runs:

- conv forms: conv-bias-act's activation matching (conv_bias_act._activation) at every Conv
  output. With --tree DIR the same function of another checkout (an older commit, unpacked
  with `git archive REV | tar -x -C DIR`) is timed beside this one: hand-written matchers
  before, rules after.
- cleanup passes: remove-identity and remove-dropout over the whole graph (a scan that finds
  nothing on most models), this checkout and --tree's.
- graph scan: the four gated activation forms (SiLU, two hard-swish forms, x * HardSigmoid(x))
  tried at every node by this engine, and by onnxscript's rewriter (the same four patterns,
  commuted operands on, a condition that rejects every match so nothing is rewritten), plus the
  conversion to onnxscript's IR that its rewriter needs first (onnxfuse's passes work on the
  onnx-graphsurgeon graph the pipeline builds anyway).

    python -m bench.rule_matching [--tree DIR] [--gpt2 gpt2_small.onnx] [--out FILE.md]
"""
from __future__ import annotations

import importlib
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import click

from bench import harness


def _import_tree(tree: str):
    """(conv_bias_act, remove_identity) of the checkout at `tree`, imported under its own names."""
    saved = {k: v for k, v in sys.modules.items() if k == "onnxfuse" or k.startswith("onnxfuse.")}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, tree)
    try:
        pkg = importlib.import_module("onnxfuse")
        passes = types.ModuleType("onnxfuse.passes")
        passes.__path__ = [str(Path(tree) / "passes")]
        sys.modules["onnxfuse.passes"] = passes
        pkg.passes = passes
        mods = (importlib.import_module("onnxfuse.passes.conv_bias_act"),
                importlib.import_module("onnxfuse.passes.remove_identity"),
                importlib.import_module("onnxfuse.pipeline"))
    finally:
        sys.path.remove(tree)
        for k in [k for k in sys.modules if k == "onnxfuse" or k.startswith("onnxfuse.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    return mods


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _onnxscript_rules():
    from onnxscript.rewriter import pattern

    def silu(op, x):
        return x * op.Sigmoid(x)

    def hard_sigmoid_gate(op, x):
        return x * op.HardSigmoid(x)

    def hard_swish_div_after(op, x):
        return x * op.Clip(x + 3.0, 0.0, 6.0) / 6.0

    def hard_swish_div_gate(op, x):
        return x * (op.Clip(x + 3.0, 0.0, 6.0) / 6.0)

    def replacement(op, x):
        return op.Identity(x)

    def never(context, x, **_):
        return False

    return pattern.RewriteRuleSet(
        [pattern.RewriteRule(p, replacement, never) for p in (silu, hard_sigmoid_gate, hard_swish_div_after,
                                                             hard_swish_div_gate)],
        commute=True,
    )


def _our_rules():
    from onnxfuse.graph.rules import Rule, Var, op

    x = Var("x")
    return [Rule("silu", x * op.Sigmoid(x)), Rule("hardswish", x * op.HardSigmoid(x)),
            Rule("hardswish", x * op.Clip(x + 3.0, 0.0, 6.0) / 6.0),
            Rule("hardswish", x * (op.Clip(x + 3.0, 0.0, 6.0) / 6.0))]


def measure(label, model, repeats, before):
    import onnx_graphsurgeon as gs
    import onnx_ir

    from onnxfuse.graph import rules
    from onnxfuse.passes import conv_bias_act, remove_identity
    from onnxfuse.pipeline import Context

    row = {"model": label, "nodes": len(model.graph.node)}
    versions = [("after", conv_bias_act, remove_identity, Context)]
    if before is not None:
        versions.append(("before", before[0], before[1], before[2].Context))
    for name, cba, ri, ctx_type in versions:
        graph = gs.import_onnx(model)
        convs = [n.outputs[0] for n in graph.nodes if n.op == "Conv"]
        row[f"conv_{name}"] = _best(lambda: [cba._activation(graph, y) for y in convs], repeats)
        ctx = ctx_type()
        row[f"cleanup_{name}"] = _best(lambda: (ri.remove_identity(graph, ctx), ri.remove_dropout(graph, ctx)), repeats)
    row["convs"] = len(convs)
    graph = gs.import_onnx(model)
    ours = _our_rules()
    outs = {t.name for t in graph.outputs}
    row["scan_ours"] = _best(lambda: [rules.first_match(ours, graph, n, outs) for n in graph.nodes], repeats)
    rule_set = _onnxscript_rules()
    row["ir_convert"] = _best(lambda: onnx_ir.from_proto(model), repeats)
    ir_model = onnx_ir.from_proto(model)
    row["scan_onnxscript"] = _best(lambda: rule_set.apply_to_model(ir_model), repeats)
    return row


@harness.script(__doc__)
@click.option("--tree", help="another checkout whose matchers to time beside this one's")
@click.option("--gpt2", help="GPT-2 small model file (python -m bench.gpt2_small --out FILE)")
@click.option("--repeats", type=int, default=5, show_default=True, help="runs per measurement (the best counts)")
@click.option("--out", type=click.Path(path_type=Path), default=harness.RESULTS / "rule_matching.md", show_default=True)
def cli(args: SimpleNamespace, stamp: harness.RunStamp) -> int:
    import onnx

    from onnxfuse import zoo
    from onnxfuse.normalize import normalize

    before = _import_tree(args.tree) if args.tree else None
    models = [(m.uri, normalize(zoo.resolve_input(m.uri)).model) for m in zoo.list_models()]
    if args.gpt2:
        models.append(("gpt2_small", onnx.load(args.gpt2)))
    rows = []
    for label, m in models:
        harness.log(label)
        rows.append(measure(label, m, args.repeats, before))

    def ms(r, key):
        return f"{r[key] * 1e3:.2f}" if key in r else "-"

    head = ["model", "nodes", "Convs", "conv forms before", "conv forms after", "cleanup before", "cleanup after",
            "scan, this engine", "scan, onnxscript", "onnxscript IR conversion"]
    table = [[r["model"], r["nodes"], r["convs"], ms(r, "conv_before"), ms(r, "conv_after"), ms(r, "cleanup_before"),
              ms(r, "cleanup_after"), ms(r, "scan_ours"), ms(r, "scan_onnxscript"), ms(r, "ir_convert")] for r in rows]
    lines = [*stamp.header("Rule matching time", "onnx", "onnx_graphsurgeon", "onnxscript", "onnx_ir"),
             f"Best of {args.repeats} runs per measurement, in ms. Before: the checkout at --tree.", "",
             *harness.markdown_table(head, table)]
    harness.write_report(args.out, "\n".join(lines) + "\n")
    return 0


main = harness.main_of(cli)

if __name__ == "__main__":
    sys.exit(main())
