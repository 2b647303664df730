"""What the command line prints: the optimize summary, the profile table, the info table, the
zoo's inputs, and the progress spinner. Text only; the commands themselves are in cli.py."""
from __future__ import annotations

import unicodedata

import click

# Characters never printed as they are: controls (escape sequences, newlines, carriage returns),
# format characters (bidirectional overrides, zero-width joiners), line and paragraph
# separators, and surrogates (undecodable bytes).
_UNSAFE_CATEGORIES = {"Cc", "Cf", "Zl", "Zp", "Cs"}
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[ch]
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def terminal_text(text) -> str:
    """`text` as it is safe to show on a terminal: every control character, escape sequence,
    line break, bidirectional override and other invisible format character is shown escaped
    (ESC as \\x1b, a newline as \\n), so a name taken from a model can neither drive the
    terminal nor start a line of its own. Every human-readable line onnxfuse prints goes
    through it; JSON output has its own escaping."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(_escape(ch) if unicodedata.category(ch) in _UNSAFE_CATEGORIES else ch for ch in text)


def terminal_lines(lines) -> str:
    """Lines joined by newlines, each made safe with terminal_text (a line break inside one is
    shown escaped)."""
    return "\n".join(terminal_text(line) for line in lines)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def dims_text(dims: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in dims.items()) or "all static"


def dims_chosen_text(chosen: dict | None) -> str | None:
    """How the symbolic dims not set by --dim got their values, and the settings verified at;
    None when the caller set them all."""
    if not chosen or all(h == "given" for h in chosen["how"].values()):
        return None
    first = chosen["settings"][0]
    parts = [f"{k}={first[k]}" + ("" if h in ("given", "chosen") else f" ({h})") for k, h in chosen["how"].items()]
    text = f"{', '.join(parts)} (where not set by --dim: chosen to exercise the model)"
    if len(chosen["settings"]) > 1:
        text += "; also verified at " + "; ".join(dims_text(d) for d in chosen["settings"][1:])
    return text


class StageProgress:
    """A spinner on stderr naming the stage under way (loading, a pass, verifying, saving),
    shown only on a terminal and only once a stage has run for PROGRESS_DELAY_S: short runs,
    pipes, logs and --json print nothing extra. Erased when the run ends."""

    PROGRESS_DELAY_S = 1.0

    def __init__(self, enabled: bool = True) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal
        self.text = ""
        self.status = None
        self.timer = None

    def __enter__(self) -> "StageProgress":
        if self.enabled:
            import threading

            self.timer = threading.Timer(self.PROGRESS_DELAY_S, self._show)
            self.timer.daemon = True
            self.timer.start()
        return self

    def _show(self) -> None:
        self.status = self.console.status(self.text or "working")
        self.status.start()

    def stage(self, text: str) -> None:
        self.text = terminal_text(text)
        if self.status is not None:
            self.status.update(text)

    def __exit__(self, *exc) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer.join()
        if self.status is not None:
            self.status.stop()


def print_rich(renderable) -> None:
    """Print a rich table on stdout, through click like every other line. Off a terminal (pipes,
    logs, tests) it is laid out wide enough that no line of ours wraps, and without colour;
    trailing padding is dropped."""
    import shutil

    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, color_system=None, width=max(160, shutil.get_terminal_size().columns))
    with console.capture() as captured:
        console.print(renderable)
    click.echo("\n".join(line.rstrip() for line in captured.get().splitlines()))


def terminal_width() -> int:
    """Columns to lay a wrapping table out in: the terminal's, $COLUMNS, else 100 (pipes, logs)."""
    import shutil

    return max(40, shutil.get_terminal_size((100, 24)).columns)


def print_wrapped(table) -> None:
    """Print a rich table that wraps its long cells to fit the terminal (`passes`, `zoo`);
    without colour off a terminal, trailing padding dropped."""
    from rich.console import Console

    console = Console(highlight=False, width=terminal_width(), color_system=None if not _stdout_is_tty() else "auto")
    with console.capture() as captured:
        console.print(table)
    click.echo("\n".join(line.rstrip() for line in captured.get().splitlines()))


def _stdout_is_tty() -> bool:
    import sys

    return sys.stdout.isatty()


def _plain(text: str):
    """A table cell shown as it is, made safe with terminal_text: rich would read `[batch=2]`
    in it as markup."""
    from rich.text import Text

    return Text(terminal_text(text))


def passes_table(passes) -> "object":
    """`onnxfuse passes`: name, targets, default or opt-in, what the pass does (wrapped)."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("pass", no_wrap=True)
    table.add_column("targets", no_wrap=True)
    table.add_column("runs", no_wrap=True)
    table.add_column("what it does", overflow="fold")
    for p in passes:
        table.add_row(*map(_plain, (p.name, ",".join(p.targets), "default" if p.default else "opt-in", p.summary)))
    return table


def zoo_table(entries: list[dict]) -> "object":
    """`onnxfuse zoo`: name, description and inputs of each bundled model (wrapped)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("model (zoo:NAME)", no_wrap=True)
    table.add_column("description", overflow="fold", ratio=3)
    table.add_column("inputs", overflow="fold", ratio=2)
    for e in entries:
        inputs = Text("\n".join(terminal_text(i) for i in e["inputs"]))  # one input a line
        table.add_row(_plain(e["name"]), _plain(e["description"]), inputs)
    return table


def print_op_table(s: dict) -> None:
    """Nodes by op type before and after, and the model size, as a table (onnxsim's and
    onnxslim's summary): op types whose count changed first, by how many nodes went."""
    from rich import box
    from rich.table import Table

    before, after = s.get("op_types_before") or {}, s.get("op_types_after") or {}
    ops = list(before) + [k for k in after if k not in before]
    ops.sort(key=lambda k: (before.get(k, 0) == after.get(k, 0), -(before.get(k, 0) - after.get(k, 0)),
                            -before.get(k, 0), k))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("op type")
    table.add_column("original", justify="right")
    table.add_column("optimized", justify="right")
    for k in ops:
        b, a = before.get(k, 0), after.get(k, 0)
        table.add_row(_plain(k), str(b), str(a), style=None if a == b else "bold")
    table.add_section()
    table.add_row("model size", human_bytes(s.get("bytes_before")), human_bytes(s.get("bytes_after")))
    print_rich(table)


def regions_text(v: dict) -> str:
    """The summary's verification line in region-level mode."""
    regions = v.get("regions", [])
    skipped = [r for r in regions if r["skipped"]]
    fused = sum(1 for r in regions if not r["skipped"] and r.get("kind") == "fused")
    other = sum(1 for r in regions if not r["skipped"] and r.get("kind") == "rewrite")
    line = (f"  verified   region by region ({v.get('mode_reason')}): {fused} fused node(s) and {other} other"
            f" rewrite(s) match the subgraphs they replaced on random inputs of their shapes (seed {v['seed']}):"
            f" max abs error {v['max_abs']:.3g}, max rel error {v['max_rel']:.3g}")
    if skipped:
        line += f"; {len(skipped)} not checked (first: '{skipped[0]['node']}': {skipped[0]['skipped']})"
    return line


def optimize_text(s: dict) -> str:
    lines = [f"{s['input']} -> {s['output']} (target {s['target']}{', ' + s['arch'] if s.get('arch') else ''})"]
    lines.append(f"  nodes      {s['nodes_before']} -> {s['nodes_after']}")
    # named as in the op table (and in the model): domain.op_type
    fused = ", ".join(f"onnxfuse.{k} x{v}" for k, v in s["fused_ops"].items()) or "none"
    lines.append(f"  fused ops  {fused}")
    if s.get("softmax_left"):
        lines.append(f"  attention  {s['softmax_left']} Softmax left unfused (`--explain fuse-attention` says why)")
    if s["kernels_before"] is not None:
        after = s["kernels_after"] if s["kernels_after"] is not None else "n/a"
        lib = ""
        if s["fused_ops"]:
            lib = "; onnxfuse library loaded" if s.get("library_loaded") else "; onnxfuse library not loaded"
        lines.append(f"  kernels    {s['kernels_before']} -> {after} per inference"
                     f" (onnxruntime CPU, ORT_ENABLE_ALL{lib})")
    if s.get("kernel_note"):
        lines.append(f"  note       {s['kernel_note']}")
    chosen = dims_chosen_text(s.get("dims_chosen"))
    if chosen:
        lines.append(f"  dims       {chosen}")
    v = s.get("verification")
    if v is None:
        lines.append("  verified   no (--no-verify)")
    elif v.get("mode") == "regions":
        lines.append(regions_text(v))
    else:
        outputs = len(v["runs"][0]["outputs"]) if v["runs"] else 0
        extra = ""
        if any(r["run"].startswith("fallback") for r in v["runs"]):
            extra = "; fallback functions match too"
        dependence = v.get("input_dependence")
        # "verified" only where the comparison could have failed: not over outputs that are the
        # same whatever the input with nothing before them compared, and not for --target cuda
        # checked on the CPU provider, where the CUDA kernels written into the model never ran.
        cuda_unrun = s.get("target") == "cuda" and v.get("provider", "cpu") != "cuda" and bool(s["fused_ops"])
        informative = not (dependence and not dependence["compared"]) and not cuda_unrun
        label = "verified" if informative else "checked "
        if cuda_unrun:
            extra += ("; on the CPU provider only (no usable GPU here): the CUDA kernels compiled into the model"
                      " did not run and are not verified")
        if dependence:
            constant = ", ".join(f"'{n}'" for n in dependence["constant_outputs"])
            lines.append(f"  {label}   {outputs} output(s) of the whole model match on random inputs (seed {v['seed']},"
                         f" dims {dims_text(v['dims'])}){extra}")
            if dependence["compared"]:
                stand_in = dependence["runs"][0]["outputs"][0]
                lines.append(f"  note       output(s) {constant} are the same whatever the input, so matching them"
                             f" shows little; compared instead the last values that depend on the inputs,"
                             f" '{stand_in['name']}': max abs error {v['max_abs']:.3g}"
                             f" ({v.get('norm_rel', 0.0):.2g} of its largest value), max rel error"
                             f" {v['max_rel']:.3g}")
            else:
                lines.append(f"  note       output(s) {constant} are the same whatever the input, so matching them"
                             f" shows little: {dependence['note']}; not verified")
        else:
            lines.append(f"  {label}   {outputs} output(s) of the whole model match on random inputs (seed {v['seed']}, dims"
                         f" {dims_text(v['dims'])}): max abs error {v['max_abs']:.3g}"
                         f" ({v.get('norm_rel', 0.0):.2g} of its output's largest value),"
                         f" max rel error {v['max_rel']:.3g}{extra}")
    for note in s.get("notes", []):
        lines.append(f"  note       {note}")
    sec = s["seconds"]
    lines.append(f"  time       {sec['total']:.2f} s (load {sec['load']:.2f}, passes {sec['passes']:.2f},"
                 f" verify {sec['verify']:.2f}, save {sec.get('save', 0):.2f})")
    return terminal_lines(lines)


def profile_text(reports, result, top: int) -> str:
    two = len(reports) == 2
    rows: list[tuple[str, ...]] = []

    def row(name, values, ratio=None):
        cells = [name] + list(values)
        if two:
            cells.append("" if ratio is None else f"{ratio:.2f}x")
        rows.append(tuple(cells))

    rows.append(("model",) + tuple(r.label for r in reports) + (("MODEL2/MODEL",) if two else ()))
    row("onnxfuse library", ["loaded" if r.kernels.library_loaded else "not loaded" for r in reports])
    ratios = result.get("ratios", {})
    row("kernels / inference", [str(r.kernels.kernels_per_inference) for r in reports],
        ratios.get("kernels_per_inference"))
    row("activations read", [human_bytes(r.kernels.activation_bytes_read) for r in reports],
        ratios.get("activation_bytes_read"))
    row("parameters read", [human_bytes(r.kernels.parameter_bytes_read) for r in reports])
    row("written", [human_bytes(r.kernels.bytes_written) for r in reports], ratios.get("bytes_written"))
    if all(r.latency for r in reports):
        row("median latency", [f"{r.latency.median_ms:.4f} ms" for r in reports], ratios.get("median_ms"))
        row("p10 .. p90", [f"{r.latency.p10_ms:.4f} .. {r.latency.p90_ms:.4f}" for r in reports])
    row("kernel time (profiler)", [f"{r.kernels.kernel_time_us / 1e3:.4f} ms" for r in reports],
        ratios.get("kernel_time_us"))
    ops: list[str] = []
    for r in reports:
        ops += [k for k in r.kernels.by_op_type if k not in ops]
    # Most kernel time first: where an inference spends its time is what the breakdown is for.
    ops.sort(key=lambda k: (-max(r.kernels.time_us_by_op_type.get(k, 0.0) for r in reports),
                            -max(r.kernels.by_op_type.get(k, 0) for r in reports)))

    spread = any(r.kernels.share_range_by_op_type for r in reports)

    def cell(r, kinds) -> str:
        count = sum(r.kernels.by_op_type.get(k, 0) for k in kinds)
        share = sum(r.kernels.time_us_by_op_type.get(k, 0.0) for k in kinds) / (r.kernels.kernel_time_us or 1.0)
        if not count:
            return "0"
        ranges = [r.kernels.share_range_by_op_type.get(k) for k in kinds]
        if spread and len(kinds) == 1 and ranges[0]:
            low, high = ranges[0]
            return f"{count} ({100 * share:.0f}%, {100 * low:.0f}-{100 * high:.0f}%)"
        return f"{count} ({100 * share:.0f}%)"

    if top and ops:
        runs = max(r.kernels.timed_runs for r in reports)
        what = (f"share of kernel time, lowest-highest of {runs} runs" if spread else "share of kernel time")
        rows.append((f"kernels ({what}) by op type",) + ("",) * (len(reports) + (1 if two else 0)))
        fused = frozenset().union(*(r.fused_op_types for r in reports))
        for k in ops[:top]:
            row(f"  {'onnxfuse.' + k if k in fused else k}", [cell(r, [k]) for r in reports])
        if len(ops) > top:
            row(f"  ({len(ops) - top} more op types)", [cell(r, ops[top:]) for r in reports])
    rows = [tuple(terminal_text(c) for c in r) for r in rows]
    # a section line (text in the first cell only) does not widen the table
    table_rows = [r for r in rows if any(r[1:])]
    widths = [max(len(r[i]) for r in table_rows) for i in range(len(rows[0]))]
    header = (f"onnxruntime {result['provider'].upper()}, ORT level {result['ort_level']}, threads"
              f" {result['threads'] or 'default'}, dims {dims_text(result['dims'])}")
    lines = [header]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    return terminal_lines(lines + PROFILE_NOTES)


# What the figures of `onnxfuse profile` are (also in docs/cli.md).
PROFILE_NOTES = [
    "",
    "kernels: executed per inference after onnxruntime's own optimizations, from its profiler.",
    "activations read / written: sizes of each kernel's non-constant inputs / its outputs, summed over",
    "  the kernels as the profiler reports them: a fused op reading slices of one tensor through views",
    "  (an LSTM step's four gates) counts the whole tensor once per view, so fusing can raise 'read'.",
    "kernel time: the profiler's per-kernel durations (it adds a little to each kernel, so small",
    "  kernels read long): for the shares by op type, not latency. Latency: timed runs, profiler off.",
]


def print_info(r: dict) -> None:
    from rich import box
    from rich.table import Table

    yes_no = {True: "yes", False: "no", None: "n/a"}
    rt, lib = r["onnxruntime"], r["library"]
    table = Table(box=box.SIMPLE, show_header=False, pad_edge=False, show_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")

    def row(name: str, value: str) -> None:
        table.add_row(name, _plain(value))

    row("onnxfuse", f"{r['onnxfuse']} (op set {r['opset']})")
    row("python", f"{r['python']} on {r['platform']}")
    for name in ("onnx", "onnx-graphsurgeon", "numpy"):
        row(name, r[name] or "not installed")
    row("onnxruntime", rt["problem"] or f"{rt['version']}: {', '.join(rt['wheels']) or 'no wheel metadata'}")
    if rt["providers"]:
        row("providers", ", ".join(rt["providers"]))
    if lib["problem"]:
        row("library", lib["problem"])
    else:
        row("library", lib["path"])
        row("library build", f"onnxfuse {lib['version']}, op set {lib['opset']}, {lib['kernels']} kernels,"
                                       f" onnxruntime C API {lib['ort_api_version']}+, {lib['compiler']}")
        row("AVX2 + FMA", f"kernels built: {yes_no[lib['avx2_fma_kernels']]}; used on this CPU:"
                                    f" {yes_no[lib['avx2_fma_used']]}")
        driver = "found" if lib["cuda_driver_found"] else f"not found ({lib['cuda_driver_error']})"
        row("CUDA", f"kernels built: {yes_no[lib['cuda_kernels']]}; CUDA driver {driver}")
    print_rich(table)


def input_text(value, dims: dict) -> str:
    import onnx

    t = value.type.tensor_type
    try:
        elem = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
    except Exception:  # types numpy lacks (bfloat16, float8...)
        elem = onnx.TensorProto.DataType.Name(t.elem_type).lower()
    shape = []
    for d in t.shape.dim:
        if d.HasField("dim_value"):
            shape.append(str(d.dim_value))
        elif d.HasField("dim_param"):
            shape.append(f"{d.dim_param}={dims.get(d.dim_param, 1)}")
        else:
            shape.append("?")
    return f"{value.name} {elem}[{', '.join(shape)}]"


def explain_text(s: dict, pass_names: list[str]) -> str:
    """Why each named pass left the candidates still in the model (optimize --explain)."""
    lines = []
    for name in pass_names:
        reasons = s.get("unmatched", {}).get(name, {})
        if name not in s.get("passes_run", []):
            lines.append(f"{name}: not run")
            continue
        lines.append(f"{name}: {len(reasons)} candidate(s) left" + (":" if reasons else ""))
        for node, why in sorted(reasons.items()):
            lines.append(f"  {node}: {why[0]}" + "".join(f"; in a later round: {w}" for w in why[1:]))
    return terminal_lines(lines)
