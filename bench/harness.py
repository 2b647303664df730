"""What every benchmark script shares: the interleaved timer, the run stamp and the report writer.

- `interleave` times several variants (sessions, bound runs, any callable) in rounds, so that
  drift on a shared host hits every variant alike; `Samples` holds the per-round figures and
  gives medians, per-round ratios and a bootstrap interval of the median ratio.
- `RunStamp` records, when a run starts, what a report needs to be read later: the command, the
  date, the commit, the machine (with its load) and the versions of what ran.
- `write_report` writes a report (creating its folder) and prints it; `table_head` gives a
  markdown table's head and rule.
- `script` and `main_of` make a script's click command (click is the CLI's library, used by every
  script of the project) and its `main(argv=None) -> int`.
- `float_model` builds the small float32 models benchmarks time; `optimized_ab_table` and
  `optimized_ab_command` time cases run by onnxruntime alone against the model onnxfuse writes.

Scripts run from the repository root as modules: `python -m bench.NAME`.
"""
from __future__ import annotations

import datetime
import functools
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

import click
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# ------------------------------------------------------------------------------------- timing

ORDERS = ("mirror", "rotate", "cycle")


@dataclass
class Samples:
    """Per-round times of each variant: entry i of wall[name] (and cpu[name], the calling
    thread's CPU time, when asked for) is the seconds per run of that variant in round i."""

    rounds: int
    runs: dict[str, int]  # back-to-back runs in one sample, per variant
    samples_per_round: int
    wall: dict[str, np.ndarray]
    cpu: dict[str, np.ndarray] = field(default_factory=dict)

    def times(self, name: str, clock: str = "wall") -> np.ndarray:
        return (self.cpu if clock == "cpu" else self.wall)[name]

    def median_ms(self, name: str, clock: str = "wall") -> float:
        return float(np.median(self.times(name, clock))) * 1e3

    def min_ms(self, name: str, clock: str = "wall") -> float:
        return float(np.min(self.times(name, clock))) * 1e3

    def max_ms(self, name: str, clock: str = "wall") -> float:
        return float(np.max(self.times(name, clock))) * 1e3

    def quantile_ms(self, name: str, q: float, clock: str = "wall") -> float:
        return float(np.quantile(self.times(name, clock), q)) * 1e3

    def total_runs(self, name: str) -> int:
        return self.rounds * self.samples_per_round * self.runs[name]

    def ratios(self, base: str, other: str, clock: str = "wall") -> np.ndarray:
        """Per round: other's time / base's time (a paired figure load changes between rounds
        do not move)."""
        return self.times(other, clock) / self.times(base, clock)

    def ratio(self, base: str, other: str, clock: str = "wall") -> float:
        return float(np.median(self.ratios(base, other, clock)))

    def interval(self, base: str, other: str, clock: str = "wall") -> dict:
        """Median per-round ratio other / base with its 95% bootstrap interval, and both medians."""
        ratios = self.ratios(base, other, clock)
        low, high = bootstrap_median_interval(ratios)
        return {"ms_a": self.median_ms(base, clock), "ms_b": self.median_ms(other, clock),
                "ratio": float(np.median(ratios)), "low": low, "high": high}


def bootstrap_median_interval(ratios: np.ndarray, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of `ratios`."""
    ratios = np.asarray(ratios, float)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(ratios), size=(reps, len(ratios)))
    medians = np.median(ratios[picks], axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def session_run(session, feeds) -> Callable[[], object]:
    """One inference of an onnxruntime session on fixed feeds, as a variant for `interleave`."""
    return lambda: session.run(None, feeds)


def interleave(variants: dict[str, Callable[[], object]], *, order: str = "mirror", min_rounds: int = 1,
               max_rounds: int = 1 << 30, budget_s: float = 0.0, warmup: int = 3, sample_ms: float = 0.0,
               runs: int | None = None, same_runs: bool = True, cpu_clock: bool = False) -> Samples:
    """Time `variants` (name -> one run) interleaved.

    Each variant first runs `warmup` times on its own (at least once, timed: the fastest of
    these runs sizes its samples). A sample is `runs` back-to-back runs of one variant, or, when
    `runs` is None, enough to last about `sample_ms` (at least one): the same count for every
    variant, sized on the slowest, when `same_runs`, else each variant's own. Rounds:
      mirror  A B C C B A (a round's figure is the mean of its two samples)
      rotate  A B C, then B C A, then C A B, ...
      cycle   A B C every round
    at least `min_rounds`, then until `max_rounds` or until `budget_s` seconds have passed,
    whichever comes first. With `cpu_clock` the calling thread's CPU time is taken beside wall
    time: onnxruntime runs every kernel of a one-thread session on the calling thread, and other
    processes on a shared machine do not inflate that clock by preempting it."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, not {order!r}")
    names = list(variants)
    per_run = {}
    for name in names:
        times = []
        for _ in range(max(1, warmup)):
            t0 = time.perf_counter()
            variants[name]()
            times.append(time.perf_counter() - t0)
        per_run[name] = max(min(times), 1e-7)
    if runs is not None:
        count = {name: max(1, runs) for name in names}
    else:
        count = {name: max(1, math.ceil(sample_ms / 1e3 / per_run[name])) for name in names}
        if same_runs:
            count = dict.fromkeys(names, min(count.values()))
    min_rounds = max(1, min(min_rounds, max_rounds))
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}

    def sample(name: str) -> None:
        run, k = variants[name], count[name]
        c0 = time.thread_time_ns() if cpu_clock else 0
        w0 = time.perf_counter_ns()
        for _ in range(k):
            run()
        w1 = time.perf_counter_ns()
        if cpu_clock:
            cpu[name].append((time.thread_time_ns() - c0) / k / 1e9)
        wall[name].append((w1 - w0) / k / 1e9)

    start = time.perf_counter()
    rounds = 0
    while rounds < max_rounds:
        if order == "mirror":
            sequence = names + names[::-1]
        elif order == "rotate":
            shift = rounds % len(names)
            sequence = names[shift:] + names[:shift]
        else:
            sequence = names
        for name in sequence:
            sample(name)
        rounds += 1
        if rounds >= min_rounds and time.perf_counter() - start >= budget_s:
            break
    per_round = 2 if order == "mirror" else 1

    def by_round(values: list[float]) -> np.ndarray:
        return np.asarray(values, float).reshape(rounds, per_round).mean(axis=1)

    return Samples(rounds=rounds, runs=count, samples_per_round=per_round,
                   wall={n: by_round(v) for n, v in wall.items()},
                   cpu={n: by_round(v) for n, v in cpu.items()} if cpu_clock else {})


# ------------------------------------------------------------------------------------- run stamp


def git(*argv: str) -> str:
    """Output of a git command in the repository, or "" when git cannot answer."""
    try:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit_text() -> str:
    """The short commit, marked when tracked files carry uncommitted changes."""
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """Architecture, CPU model and logical CPUs."""
    return f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} logical CPUs"


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine_and_system() -> str:
    """Architecture, CPU model, cores, memory; the operating system."""
    return (f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} cores, {memory_gib()} GiB;"
            f" {platform.platform()}")


def dist_version(dist: str) -> str:
    """"NAME VERSION" of an installed distribution (onnxruntime: whichever of onnxruntime-gpu and
    onnxruntime is installed), or "NAME not installed"."""
    from importlib import metadata

    for name in ("onnxruntime-gpu", "onnxruntime") if dist == "onnxruntime" else (dist,):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return f"{dist} not installed"


def versions(*modules: str) -> str:
    """Versions of onnxruntime, onnx, numpy and Python, then of `modules` (those installed)."""
    from importlib import metadata

    import onnx
    import onnxruntime

    parts = [f"onnxruntime {onnxruntime.__version__}", f"onnx {onnx.__version__}", f"numpy {np.__version__}",
             f"Python {platform.python_version()}"]
    for module in modules:
        try:
            parts.append(f"{module} {metadata.version(module)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{module} not installed")
    return ", ".join(parts)


def command_line(script: str, argv: list[str]) -> str:
    """How the run was started, as it can be typed again: `python -m bench.NAME ARGS`; script is
    the module's file, name or dotted name."""
    name = Path(script).stem if script.endswith(".py") else script.rsplit(".", 1)[-1]
    return " ".join([f"python -m bench.{name}", *argv])


@dataclass
class RunStamp:
    """What a report records about its run, taken when the run starts."""

    command: str
    started: str
    load: tuple
    commit: str

    @classmethod
    def now(cls, script: str, argv: list[str] | None = None) -> "RunStamp":
        """script: the bench module's file or name; argv: its arguments (default: those `main_of`
        was given, else sys.argv[1:])."""
        argv = list(invoked_argv() if argv is None else argv)
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        return cls(command_line(script, argv), started, os.getloadavg(), commit_text())

    def line(self, *modules: str) -> str:
        """Date, commit, machine with its load at the start, and versions, on one line."""
        return (f"Date: {self.started}. Commit: {self.commit}. Machine: {machine()} (load average at the start "
                f"{self.load[0]:.2f} {self.load[1]:.2f} {self.load[2]:.2f}). {versions(*modules)}.")

    def header(self, title: str, *modules: str) -> list[str]:
        """A report's first lines: title, command, then the stamp line."""
        return [f"# {title}", "", f"Command: `{self.command}`", self.line(*modules), ""]


def write_report(path: str | Path | None, text: str, echo: bool = True) -> None:
    """Write a report to `path` (creating its folder; nothing written when None) and print it."""
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if echo:
        print(text)


def log(message: str) -> None:
    """Progress to stderr, so that stdout holds the report alone."""
    print(message, file=sys.stderr, flush=True)


def float_model(name: str, nodes, inputs: dict[str, list], outputs: dict[str, list], inits=(),
                domains: tuple[str, ...] = (), value_info=()):
    """A model of float32 inputs and outputs (name -> shape) at opset 17, IR 10, with the custom-op
    `domains` at version 1: what the benchmarks build their cases as."""
    from onnx import TensorProto, helper

    def declared(values: dict[str, list]) -> list:
        return [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in values.items()]

    graph = helper.make_graph(list(nodes), name, declared(inputs), declared(outputs), list(inits),
                              value_info=list(value_info))
    opsets = [helper.make_opsetid("", 17)] + [helper.make_opsetid(d, 1) for d in domains]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model


def table_head(columns: list[tuple[str, str]]) -> list[str]:
    """A markdown table's head and rule from (title, alignment) pairs: "l" left, "r" right."""
    return ["| " + " | ".join(title for title, _ in columns) + " |",
            "|" + "".join("---:|" if align == "r" else "---|" for _, align in columns)]


# ------------------------------------------------------------------------------------- command line


def script(doc: str, name: str | None = None) -> Callable[[Callable[..., int]], click.Command]:
    """click.command for a bench script: the help is the first paragraph of `doc`, and the
    function, decorated with its click options, is called as f(args, stamp): the options as
    attributes and the RunStamp taken when the run starts (naming the script `name`, by default
    the function's module). It returns the exit status, None for 0."""

    def decorate(f: Callable[..., int]) -> click.Command:
        @functools.wraps(f)
        def callback(**params) -> int:
            module = sys.modules[f.__module__]
            spec = getattr(module, "__spec__", None)
            script_name = name or (spec.name if spec is not None else f.__module__)
            return f(SimpleNamespace(**params), RunStamp.now(script_name))

        return click.command(help=doc.split("\n\n")[0])(callback)

    return decorate


def main_of(command: click.Command, prog: str | None = None) -> Callable[..., int]:
    """`main(argv=None) -> int` for a script's click command: the exit status instead of
    sys.exit, so that tests call a script as a function; usage errors print click's message and
    return 2."""

    def main(argv: list[str] | None = None) -> int:
        argv = list(sys.argv[1:] if argv is None else argv)
        try:
            status = command.main(args=argv, prog_name=prog or f"python -m {_module_name(command)}",
                                  standalone_mode=False,
                                  obj={"argv": argv})
        except click.ClickException as e:
            e.show()
            return e.exit_code
        except click.Abort:
            return 1
        return 0 if status is None else int(status)

    return main


def _module_name(command: click.Command) -> str:
    module = sys.modules[command.callback.__module__]
    spec = getattr(module, "__spec__", None)  # run with -m, __main__'s spec names the module
    return spec.name if spec is not None else command.callback.__module__


def invoked_argv() -> list[str]:
    """The arguments the running click command was given (by `main_of`), else sys.argv[1:]."""
    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        if isinstance(ctx.obj, dict) and "argv" in ctx.obj:
            return list(ctx.obj["argv"])
        ctx = ctx.parent
    return sys.argv[1:]


def csv(kind: type = str) -> Callable[[object, object, object], list]:
    """A click option callback that splits "a,b,c" into a list of `kind`."""

    def parse(_ctx, _param, value):
        if value is None or isinstance(value, list):
            return value
        try:
            return [kind(x.strip()) for x in str(value).split(",") if x.strip()]
        except ValueError as e:
            raise click.BadParameter(str(e)) from None

    return parse


# ------------------------------------------------------------------------------------- onnxruntime alone against onnxfuse


def kernel_names(counts: dict[str, int]) -> str:
    """{"Add": 2, "Relu": 1} -> "Add x2 + Relu"."""
    return " + ".join(f"{op}" + (f" x{n}" if n > 1 else "") for op, n in counts.items())


def optimized_ab_table(cases, threads_list: list[int], budget_s: float) -> tuple[str, str, list[str]]:
    """Each case (label: its first table cells, model, feeds) run by onnxruntime alone and as the
    default CPU pipeline writes it (onnxfuse library loaded): the kernels each runs, then per
    thread count the interleaved time (A B B A rounds; thread CPU time at one thread, wall time
    above) and ratio onnxfuse / onnxruntime with its 95% interval. Returns the table's head and
    rule after the label columns, and its rows."""
    from onnxfuse import api
    from onnxfuse.profile import count_kernels, open_session

    rows = []
    for label, m, feeds in cases:
        fused = api.optimize(m, count_kernels=False).model
        cells = [*label, kernel_names(count_kernels(m, threads=1)[1]), kernel_names(count_kernels(fused, threads=1)[1])]
        for threads in threads_list:
            a, _ = open_session(m, "cpu", threads, "all", with_library=False)
            b, _ = open_session(fused, "cpu", threads, "all", with_library=True)
            samples = interleave({"a": session_run(a, feeds), "b": session_run(b, feeds)}, order="mirror",
                                 min_rounds=15, max_rounds=400, budget_s=budget_s, warmup=5, sample_ms=2.0,
                                 cpu_clock=threads == 1)
            c = samples.interval("a", "b", "cpu" if threads == 1 else "wall")
            cells.append(f"{c['ms_a'] * 1e3:.1f} / {c['ms_b'] * 1e3:.1f} | {c['ratio']:.3f} [{c['low']:.3f}, {c['high']:.3f}]")
            log(f"{' '.join(label)} threads={threads}: {cells[-1]}")
        rows.append("| " + " | ".join(cells) + " |")
    head = " onnxruntime runs | onnxfuse runs |"
    rule = "---|---|"
    for th in threads_list:
        clock = "thread CPU" if th == 1 else "wall"
        head += f" {th} thread{'s' if th > 1 else ''}: us, ort / ours ({clock}) | ratio [95%] |"
        rule += "---|---|"
    return head, rule, rows


def row_cases(shapes: list[tuple[int, int]], variants: dict[str, object], build: Callable[[int, int, object], object],
              inputs: list[str]) -> Callable[[], Iterator]:
    """cases() for optimized_ab_command: for each (rows, d) of `shapes` and each variant (its
    table label -> value), the model build(rows, d, value) with seeded float32 normal feeds of
    shape [2, rows / 2, d] for the `inputs`, labelled "rows x d" and the variant's label."""

    def cases() -> Iterator:
        for rows, d in shapes:
            for label, value in variants.items():
                rng = np.random.default_rng(1)
                feeds = {name: rng.standard_normal((2, rows // 2, d)).astype(np.float32) for name in inputs}
                yield [f"{rows} x {d}", label], build(rows, d, value), feeds

    return cases


def optimized_ab_command(module: str, doc: str, title: str, description: str, labels: list[str],
                         cases) -> Callable[..., int]:
    """`main(argv=None)` of a bench script that times cases with optimized_ab_table (--budget,
    --threads, --out; default out bench/results/<script>.md): labels name the cases' first table
    columns, cases() yields them; the report (title, stamp, description and how it was timed,
    table) is written and printed. module: the script's name."""
    name = module

    @script(doc, name)
    @click.option("--budget", type=float, default=6.0, show_default=True, help="seconds of timed rounds per row")
    @click.option("--threads", default="1,2", callback=csv(int), show_default=True)
    @click.option("--out", type=click.Path(path_type=Path), default=RESULTS / f"{name}.md", show_default=True)
    def cli(args: SimpleNamespace, stamp: RunStamp) -> int:
        head, rule, rows = optimized_ab_table(cases(), args.threads, args.budget)
        text = "\n".join([
            *stamp.header(title),
            description + " Interleaved A B B A rounds; ratio = onnxfuse / onnxruntime, median of per-round ratios"
            " with a 95% bootstrap interval.",
            "",
            "| " + " | ".join(labels) + " |" + head, "|" + "---|" * len(labels) + rule, *rows, "",
        ])
        write_report(args.out, text)
        return 0

    return main_of(cli, prog=f"python -m bench.{name}")
