"""The report of `python -m bench.compare`: the variants it compares and the goals it checks,
the summary tables (also the README's benchmark section), the per-model tables, the optimize-time
section, the markdown report and its chart, all rendered from the results data alone (so that
`--render-only` rewrites them from bench/results/compare.json)."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

VARIANTS = ("ort", "onnxsim", "onnxslim", "onnxoptimizer", "onnxfuse")
PEERS = ("onnxsim", "onnxslim", "onnxoptimizer")
DESCRIPTIONS = {
    "ort": "the original model; onnxruntime's own graph optimizations (ORT_ENABLE_ALL) only",
    "onnxsim": "onnxsim.simplify(model) with its defaults",
    "onnxslim": "onnxslim.slim(model) with its defaults",
    "onnxoptimizer": "onnxoptimizer.optimize(model): its default passes",
    "onnxfuse": "onnxfuse.api.optimize(model): default pipeline, outputs verified (as `onnxfuse optimize` does)",
}
# Goals for `optimize` on a 2-core machine.
GOAL_LARGEST_ZOO_S = 2.0
GOAL_GPT2_SMALL_S = 10.0
GPT2_DIMS = {"batch": 2, "seq": 32}


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _ratio(a, b) -> float | None:
    return None if a in (None, 0) or b is None else b / a


def kernel_ratio(model: dict, variant: str, provider: str = "cpu") -> float | None:
    return _ratio(model["variants"]["ort"]["kernels"].get(provider), model["variants"].get(variant, {}).get("kernels", {}).get(provider))


def latency_ratio(model: dict, variant: str, key: str, stat: str = "ratio") -> float | None:
    """The paired latency ratio to onnxruntime alone (stat "ratio"), or the ratio of a statistic."""
    base = model["variants"]["ort"]["latency"].get(key)
    mine = model["variants"].get(variant, {}).get("latency", {}).get(key)
    if stat == "ratio":
        return mine.get("ratio") if mine else None
    return _ratio(base and base[stat], mine and mine[stat])


def _geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def variants_of(results: dict) -> list[str]:
    seen = [v for v in VARIANTS if any(v in m["variants"] for m in results["models"])]
    return seen


def _variant_rows(results: dict, variants: list[str], cell) -> list[str]:
    """One table row per model: '' for a variant not run, 'failed' for one that failed, else
    cell(model, variant, its info)."""
    rows = []
    for m in results["models"]:
        cells = []
        for v in variants:
            info = m["variants"].get(v)
            cells.append("" if info is None else "failed" if info["status"] != "ok" else cell(m, v, info))
        rows.append(f"| {m['model']} | " + " | ".join(cells) + " |")
    return rows


def summary_tables(results: dict) -> str:
    """The two summary tables (also the README's benchmark section)."""
    variants = variants_of(results)
    keys = [s["key"] for s in results["settings"] if s["provider"] == "cpu"]

    def kernels(m, v, info):
        k = info["kernels"].get("cpu")
        return f"{k}" if v == "ort" else f"{k} ({kernel_ratio(m, v):.2f})"

    def latency(m, v, info):
        if v == "ort":
            return " / ".join(_ms(info["latency"][k]["median_ms"]) + " ms" for k in keys if k in info["latency"])
        return " / ".join(_cell(latency_ratio(m, v, k)) for k in keys)

    lines = ["Kernels per inference (CPU provider; in brackets: ratio to onnxruntime alone; lower is better):", "",
             "| model | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants),
             *_variant_rows(results, variants, kernels)]
    lines.append("| geometric mean of ratios | " + " | ".join(
        _cell(_geomean(kernel_ratio(m, v) for m in results["models"])) for v in variants) + " |")
    lines += ["", "Latency, ratio to onnxruntime alone (" + " / ".join(
        s["label"] for s in results["settings"] if s["provider"] == "cpu") + "): median over the timed rounds of the"
        " variant's sample / onnxruntime alone's sample of the same round; lower is better. Column ort: its median"
        " latency.", "",
        "| model | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants),
        *_variant_rows(results, variants, latency)]
    lines.append("| geometric mean of ratios | " + " | ".join(
        "" if v == "ort" else " / ".join(_cell(_geomean(latency_ratio(m, v, k) for m in results["models"])) for k in keys)
        for v in variants) + " |")
    return "\n".join(lines)


def _cell(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}"


def model_table(m: dict, settings: list[dict]) -> str:
    variants = [v for v in VARIANTS if v in m["variants"]]
    head = ["variant", "nodes", "kernels (ratio)"]
    for s in settings:
        head += [f"{s['label']}: ms min / median / max (runs)", "ratio: paired / of mins"]
    head.append("optimize s")
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    providers = sorted({s["provider"] for s in settings})
    for v in variants:
        info = m["variants"][v]
        if info["status"] != "ok":
            lines.append(f"| {v} | failed: {info['error']} |" + " |" * (len(head) - 2))
            continue
        kernels = " / ".join(
            f"{info['kernels'][p]}" + ("" if v == "ort" else f" ({_cell(kernel_ratio(m, v, p))})")
            for p in providers if p in info["kernels"])
        row = [v, "-" if info["nodes"] is None else str(info["nodes"]), kernels]
        for s in settings:
            lat = info["latency"].get(s["key"])
            if lat is None:
                row += ["-", "-"]
                continue
            row.append(f"{_ms(lat['min_ms'])} / {_ms(lat['median_ms'])} / {_ms(lat['max_ms'])} ({lat['runs']})")
            row.append("1" if v == "ort" else
                       f"{_cell(latency_ratio(m, v, s['key']))} / {_cell(latency_ratio(m, v, s['key'], 'min_ms'))}")
        row.append("-" if info["optimize_s"] is None else f"{info['optimize_s']:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def optimize_time_section(results: dict) -> str:
    entries = results.get("optimize_time") or []
    lines = ["## Time of `optimize`", "",
             "`onnxfuse.api.optimize` with the CLI's defaults (default CPU pipeline, outputs verified, kernels"
             " counted), each run in a fresh process, imports and file reading excluded. Goals on this 2-core"
             f" machine: under {GOAL_LARGEST_ZOO_S:g} s for the largest zoo model (most nodes), under"
             f" {GOAL_GPT2_SMALL_S:g} s for a GPT-2-small-sized model (bench/gpt2_small.py: gpt_stack's graph with"
             " 12 blocks, d_model 768, 12 heads, vocabulary 50257, 1024 positions, per-block weights; the LM head"
             " is stored transposed beside the embedding, hence more parameters than GPT-2 small's 124M;"
             f" dims {', '.join(f'{k}={v}' for k, v in GPT2_DIMS.items())}).", ""]
    if not entries:
        return "\n".join(lines + ["Not measured in this run (--no-optimize-time).", ""])
    meta = results.get("optimize_meta") or {}
    if meta:
        lines += [f"Measured {meta['date']}, commit {meta['commit']}, with `{meta['command']}`; load average at the"
                  f" start {', '.join(map(str, meta['load_average_start']))}, at the end"
                  f" {', '.join(map(str, meta.get('load_average_end', [])))}.", ""]
    lines += ["| model | nodes | parameters | goal | min s | runs s | load | passes | verify | goal met |",
              "|---|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for e in entries:
        params = "-" if not e.get("parameters") else f"{e['parameters'] / 1e6:.1f}M"
        if e.get("error"):
            lines.append(f"| {e['model']} | {e['nodes']} | {params} | {e['goal_s']:g} s | failed: {e['error']} | | | | | |")
            continue
        st = e.get("stages") or {}
        lines.append(
            f"| {e['model']} | {e['nodes']} | {params} | {e['goal_s']:g} s | {e['min_s']:.2f} |"
            f" {', '.join(f'{s:.2f}' for s in e['seconds'])} | {st.get('load', 0):.2f} | {st.get('passes', 0):.2f} |"
            f" {st.get('verify', 0):.2f} | {'yes' if e['met'] else '**no**'} |")
    for e in entries:
        if e.get("error") or e["met"]:
            continue
        lines += ["", f"### Where the time goes: {e['model']}", ""]
        st = e.get("stages") or {}
        lines.append(f"{e['min_s']:.2f} s against a goal of {e['goal_s']:g} s. Stages of the fastest run: load and check {st.get('load', 0):.2f} s, passes"
                     f" {st.get('passes', 0):.2f} s, verification and kernel counts {st.get('verify', 0):.2f} s.")
        lines += ["", "Passes, slowest first (the fastest run):", "", "| pass | matches | seconds |", "|---|---:|---:|"]
        for p in e["passes"]:
            if p["seconds"] >= 0.01:
                lines.append(f"| {p['pass']} | {p['matches']} | {p['seconds']:.2f} |")
        hot = e.get("hot_functions") or {}
        for key, title in (("ours_by_cumulative_time", "onnxfuse's functions by cumulative time"),
                           ("by_own_time", "Functions with the most own time")):
            if not hot.get(key):
                continue
            lines += ["", f"{title} (one run under cProfile, {e['profiled_s']:.2f} s with the profiler's overhead):",
                      "", "| function | calls | own s | cumulative s |", "|---|---:|---:|---:|"]
            for f in hot[key]:
                lines.append(f"| `{f['function']}` | {f['calls']} | {f['own_s']:.2f} | {f['cumulative_s']:.2f} |")
    return "\n".join(lines + [""])


def render_markdown(results: dict, chart_name: str | None) -> str:
    meta = results["meta"]
    settings = results["settings"]
    out = [
        "# onnxfuse beside onnxruntime's optimizer and the ONNX simplifiers",
        "",
        "Generated by `python -m bench.compare` (do not edit by hand; `python -m bench.compare --render-only` rewrites it"
        " from `bench/results/compare.json`).",
        "",
        f"- Command: `{meta['command']}`",
        f"- Date: {meta['date']}; commit {meta['commit']}"
        + (f" (plus uncommitted changes to {meta['modified_tracked_files']} tracked files of the shared checkout)"
           if meta.get("modified_tracked_files") else ""),
        f"- Machine: {meta['machine']}",
        f"- Python {meta['python']}; " + ", ".join(meta["versions"]),
        f"- Load average (1, 5, 15 min) at the start {', '.join(map(str, meta['load_average_start']))},"
        f" at the end {', '.join(map(str, meta.get('load_average_end', [])))}: the machine is shared, so latencies are"
        " noisy; the min is the least disturbed figure, ratios are of medians of interleaved runs.",
        f"- Latency: {meta['warmup']} warm-up inferences per variant, then up to {meta['runs']} rotating rounds"
        f" (at least {meta['min_runs']}, stopping after {meta['budget_s']:g} s per model and setting); a sample is the"
        f" mean of back-to-back inferences lasting about {meta['sample_ms']:g} ms. Seeded random inputs (seed"
        f" {meta['seed']}), the zoo's default sizes of symbolic dimensions.",
        "- Kernels per inference: onnxruntime's profiler, one inference, CPU provider, 1 thread, ORT_ENABLE_ALL.",
        f"- CUDA provider: {meta['cuda']}",
        "",
        "Variants (each then run by onnxruntime, ORT_ENABLE_ALL):",
        "",
    ]
    out += [f"- `{v}`: {DESCRIPTIONS[v]}" for v in variants_of(results)]
    out += ["", "Every variant's outputs were compared with the original's (onnxfuse's tolerances); a variant"
            " that failed or changed the outputs is listed as failed with the reason.", ""]
    if chart_name:
        out += [f"![kernels per inference and latency ratio per model]({chart_name})", ""]
    out += ["## Summary", "", summary_tables(results), ""]
    out += ["## Per model", "",
            "Optimize time: wall time of the tool's Python call, in a fresh process (onnxfuse's includes its"
            " verification run of both models in onnxruntime; its passes alone are in the last column's note)."]
    for m in results["models"]:
        dims = ", ".join(f"{k}={v}" for k, v in m["dims"].items()) or "static shapes"
        out += ["", f"### {m['model']}", "", f"{m['nodes']} nodes; {dims}.", "", model_table(m, settings)]
        fuse = m["variants"].get("onnxfuse", {})
        if fuse.get("status") == "ok" and fuse.get("stages"):
            st = fuse["stages"]
            out += ["", f"onnxfuse optimize: load {st['load']:.2f} s, passes {st['passes']:.2f} s,"
                        f" verify {st['verify']:.2f} s."]
    if "onnxoptimizer" in variants_of(results):
        out += ["", "## Notes", "",
                "- onnxoptimizer (" + next((v for v in meta["versions"] if v.startswith("onnxoptimizer")), "?") + ")"
                " raises the light zoo models from IR 3 to IR 4 but keeps their initializers listed as graph inputs;"
                " from IR 4 on such initializers are overridable inputs, which onnxruntime does not constant-fold:"
                " it then runs every ConstantOfShape that makes the weights at each inference and cannot fold"
                " BatchNormalization into Conv (resnet50: 415 kernels, one per node, instead of 59). On the"
                " generated models (IR 8, initializers not listed as inputs) it matches onnxruntime alone."]
    failures = [(m["model"], v, i["error"]) for m in results["models"] for v, i in m["variants"].items()
                if i["status"] != "ok"]
    out += ["", "## Failures", ""]
    out += [f"- {model}, {v}: {err}" for model, v, err in failures] or ["None."]
    out += ["", optimize_time_section(results)]
    return "\n".join(out).rstrip() + "\n"


def render_chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m["model"] for m in results["models"]]
    variants = variants_of(results)
    keys = [s for s in results["settings"] if s["provider"] == "cpu"]
    panels = 1 + len(keys)
    fig, axes = plt.subplots(panels, 1, figsize=(max(8, 1.0 * len(models) + 3), 3.2 * panels), squeeze=False)
    width = 0.8 / len(variants)
    colors = {"ort": "#7f7f7f", "onnxsim": "#1f77b4", "onnxslim": "#2ca02c", "onnxoptimizer": "#ff7f0e",
              "onnxfuse": "#d62728"}

    def bars(ax, values_of, title, ylabel, log=False, unit_line=False):
        for i, v in enumerate(variants):
            xs, ys, failed = [], [], []
            for j, m in enumerate(results["models"]):
                info = m["variants"].get(v)
                x = j + (i - (len(variants) - 1) / 2) * width
                if info is None:
                    continue
                if info["status"] != "ok":
                    failed.append(x)
                    continue
                y = values_of(m, v)
                if y is not None:
                    xs.append(x)
                    ys.append(y)
            ax.bar(xs, ys, width, label=v, color=colors.get(v))
            if failed:
                ax.plot(failed, [0] * len(failed) if not log else [1] * len(failed), "x", color=colors.get(v),
                        markersize=7, label=f"{v} failed")
        if log:
            ax.set_yscale("log")
        if unit_line:
            ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models, rotation=30, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)

    bars(axes[0][0], lambda m, v: m["variants"][v]["kernels"].get("cpu"),
         "Kernels per inference (onnxruntime CPU provider, ORT_ENABLE_ALL)", "kernels", log=True)
    for ax, s in zip(axes[1:], keys):
        bars(ax[0], lambda m, v, k=s["key"]: latency_ratio(m, v, k),
             f"Latency / onnxruntime alone, {s['label']}: median of per-round paired ratios (lower is better)", "ratio", unit_line=True)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 6), fontsize=8, frameon=False)
    meta = results["meta"]
    fig.text(0.01, 0.005, f"{meta['date']}, commit {meta['commit']}; {meta['machine'].split(';')[0]}", fontsize=7,
             color="#555555")
    fig.tight_layout(rect=(0, 0.02, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), dpi=110)
    plt.close(fig)


def write_outputs(results: dict, out: Path, json_path: Path, chart: Path | None) -> None:
    from onnxfuse.modelsave import write_text_atomic

    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(json_path, json.dumps(results, indent=1) + "\n")
    chart_ref = None
    if chart:
        render_chart(results, chart)
        chart_ref = os.path.relpath(chart, out.parent)
    write_text_atomic(out, render_markdown(results, chart_ref))
