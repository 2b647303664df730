"""The `onnxfuse` command line: optimize, profile, passes, zoo, info, fuzz.

Every failure is one line on stderr, `onnxfuse: error: ...`, and a documented exit status;
a traceback only with --debug or ONNXFUSE_DEBUG=1.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from .display import (StageProgress, explain_text, input_text, optimize_text, passes_table, print_info, print_op_table,
                      print_wrapped, profile_text, terminal_text, zoo_table)
from .errors import InputError
from . import supervise
from .outfiles import OutputError, Terminated, remove_temporaries_on_signals

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
EXIT_HANGUP = 129

EXIT_CODES_HELP = """\b
Exit status:
  0  success
  1  verification failed: the optimized model does not match the original
     (or does not run); OUT is left untouched
  2  bad input, usage or environment: unreadable or invalid model, unknown
     pass, bad option, OUT or --report not writable, --target cuda
     without nvcc (these three checked before any work), a failed write
     (disk full, I/O error), out of memory; OUT is left untouched
  3  internal error or broken installation (e.g. the custom-op library does
     not load or is truncated); rerun with --debug (or ONNXFUSE_DEBUG=1)
     for a traceback
  129, 130, 143  hung up (SIGHUP), interrupted (SIGINT) or terminated
     (SIGTERM); temporary files are removed and OUT is left untouched
  137  killed (SIGKILL, e.g. by the out-of-memory killer); temporary files
     are removed and OUT is left untouched
"""

FUZZ_EXIT_HELP = """\b
Exit status:
  0  every case passed (differences excused position by position included)
  1  a case failed
  2  bad option
"""


LISTING_EXIT_HELP = """\b
Exit status:
  0  success
  2  bad option
  3  broken installation (onnxruntime or the custom-op library)
"""


def _debug_from_env() -> bool:
    return os.environ.get("ONNXFUSE_DEBUG", "") not in ("", "0")


_debug = _debug_from_env()


def _set_debug(ctx, param, value):
    global _debug
    if value:
        _debug = True
    return value


debug_option = click.option(
    "--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
    help="Show tracebacks and onnxruntime warnings.",
)


def _fail(code: int, message: str) -> None:
    click.echo(terminal_text(f"onnxfuse: {message}"), err=True)
    sys.exit(code)


class OnnxfuseGroup(click.Group):
    """A click group whose errors are one line and whose exit statuses are ours."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        global _debug
        if args is None and supervise.wanted():  # the command itself (not a test's runner)
            supervise.run_supervised()
        _debug = _debug_from_env()
        remove_temporaries_on_signals()
        try:
            rv = super().main(args, prog_name or "onnxfuse", complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help() if e.ctx else "")
            sys.exit(EXIT_OK)
        except click.UsageError as e:
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
            _fail(EXIT_BAD_INPUT, f"error: {e.format_message()}{hint}")
        except click.ClickException as e:
            _fail(EXIT_BAD_INPUT, f"error: {e.format_message()}")
        except click.Abort:
            _fail(EXIT_INTERRUPTED, "interrupted")
        except Terminated as e:
            if e.signum == EXIT_HANGUP - 128:
                _fail(EXIT_HANGUP, "hung up")
            _fail(EXIT_TERMINATED, "terminated")
        except (InputError, OutputError) as e:
            if _debug:
                import traceback

                traceback.print_exc()
            _fail(EXIT_BAD_INPUT, f"error: {e}")
        except MismatchExit as e:
            _fail(EXIT_MISMATCH, str(e))
        except InstallationError as e:
            _fail(EXIT_INTERNAL, f"error: {e}")
        except KeyboardInterrupt:
            _fail(EXIT_INTERRUPTED, "interrupted")
        except MemoryError:
            limit = supervise.memory_limit()
            _fail(EXIT_BAD_INPUT, "error: out of memory" + (f" (this process may use {supervise.limit_text(limit)} of"
                                                           " address space: ulimit -v); raise the limit, or"
                                                           if limit else ";") + " run it on a machine with more memory")
        except Exception as e:
            from .errors import CompileError
            from .runtime import LibraryError

            if _debug:
                import traceback

                traceback.print_exc()
            if isinstance(e, LibraryError):
                _fail(EXIT_INTERNAL, f"error: {e}")
            if isinstance(e, CompileError):  # onnxfuse.cuda.compile: nvcc missing or failing
                _fail(EXIT_INTERNAL, f"error: CUDA compilation failed: {str(e).strip().splitlines()[0]}")
            text = str(e).strip().splitlines()[0] if str(e).strip() else ""
            _fail(EXIT_INTERNAL, f"internal error: {type(e).__name__}{': ' + text if text else ''}"
                                 " (rerun with --debug for the traceback)")
        sys.exit(rv if isinstance(rv, int) else EXIT_OK)


class MismatchExit(Exception):
    """Verification failed: exit status 1."""


class InstallationError(Exception):
    """Part of the installation is missing or broken: exit status 3, one line."""


# --------------------------------------------------------------------------- option parsing


def _parse_dims(ctx, param, values) -> dict[str, int]:
    dims: dict[str, int] = {}
    for item in values:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise click.BadParameter(f"'{item}': expected NAME=VALUE, e.g. batch=4", ctx, param)
        try:
            number = int(value)
        except ValueError:
            raise click.BadParameter(f"'{item}': {value!r} is not an integer", ctx, param) from None
        if number < 1:
            raise click.BadParameter(f"'{item}': a dimension must be at least 1", ctx, param)
        dims[name] = number
    return dims


def _parse_passes(ctx, param, value):
    if value is None:
        return None
    names = [n.strip() for n in value.split(",")]
    if not all(names):
        raise click.BadParameter(f"'{value}': expected comma-separated pass names (see 'onnxfuse passes')", ctx, param)
    return names


dim_option = click.option(
    "--dim", "dims", multiple=True, callback=_parse_dims, metavar="NAME=VALUE",
    help="Value of a symbolic input dimension (repeatable). optimize verifies unset ones at values chosen to"
         " exercise the model (the summary names them); profile runs them at 1.",
)
threads_option = click.option("--threads", type=click.IntRange(min=1), default=None,
                              help="onnxruntime intra-op threads (default: onnxruntime's choice).")
seed_option = click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


# --------------------------------------------------------------------------- commands


@click.group(cls=OnnxfuseGroup, epilog=EXIT_CODES_HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="onnxfuse", prog_name="onnxfuse")
@debug_option
def main():
    """Fuse launch-bound op chains of ONNX models into single kernels.

    Every command takes --help and --debug. A model argument may be a file or zoo:NAME (see
    'onnxfuse zoo'); 'python -m onnxfuse' is the same program.
    """
    from .environment import RuntimeInstallError, check_onnxruntime, quiet_libraries

    # `info` reports a broken onnxruntime installation instead of stopping at it.
    if click.get_current_context().invoked_subcommand != "info":
        try:
            check_onnxruntime()
        except RuntimeInstallError as e:
            raise InstallationError(str(e)) from None
    # onnxruntime and graphsurgeon log warnings to the terminal; the CLI's contract is one line
    # per error, so they are silenced unless --debug. optimize does it itself, after the checks
    # it makes before any work (importing onnxruntime to silence it takes a while).
    if not _debug and click.get_current_context().invoked_subcommand != "optimize":
        quiet_libraries()


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("source", metavar="IN")
@click.argument("dest", metavar="OUT")
@click.option("--passes", "pass_names", callback=_parse_passes, metavar="A,B,...",
              help="Run only these passes (default: the default pipeline of the target).")
@click.option("--target", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Which kernels fused ops get.")
@click.option("--arch", default=None, metavar="SM", help="CUDA architecture for --target cuda, e.g. sm_90.")
@click.option("--tune", is_flag=True, default=False,
              help="--target cuda: choose each Conv layer's kernel tile by timing the candidates on this "
                   "machine's GPU (needs pycuda and a CUDA device; without one, the documented heuristic).")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Compare original and optimized outputs in onnxruntime before writing OUT.")
@click.option("--fallback-check/--no-fallback-check", default=True, show_default=True,
              help="Also verify the fallback functions (the optimized model without the onnxfuse library).")
@click.option("--verify-mode", type=click.Choice(["auto", "whole", "regions"]), default="auto", show_default=True,
              help="whole: run both models and compare their outputs; regions: check each fused node against the"
                   " subgraph it replaced, one at a time (for models too large to run whole); auto: whole unless"
                   " it would not fit in the memory available.")
@dim_option
@seed_option
@threads_option
@click.option("--report", "report_path", default=None, metavar="FILE.json",
              help="Write per-pass statistics and the summary to FILE.json.")
@click.option("--explain", "explain", multiple=True, metavar="PASS",
              help="Say why PASS left each candidate still in the model (e.g. each Softmax fuse-attention did "
                   "not fuse); repeatable.")
@json_option
@debug_option
def optimize(source, dest, pass_names, target, arch, tune, verify, fallback_check, verify_mode, dims, seed, threads,
             report_path, explain, as_json):
    """Optimize model IN (a path or zoo:NAME) and write OUT.

    OUT is written only when verification passes (or with --no-verify), and atomically:
    an existing OUT is never left half-written.
    """
    from .optimize_options import OptimizeOptions, OptionError

    settings = OptimizeOptions(
        passes=tuple(pass_names) if pass_names is not None else None, target=target, arch=arch, tune=tune,
        verify=verify, fallback_check=fallback_check, verify_mode=verify_mode, dims=dict(dims or {}), seed=seed,
        threads=threads, explain=tuple(explain))
    try:
        settings.check()
    except OptionError as e:
        raise click.BadParameter(str(e), param_hint=e.option) from None
    if explain:
        from .pipeline import all_passes

        known = {p.name for p in all_passes()}
        for name in explain:
            if name not in known:
                raise click.BadParameter(f"unknown pass '{name}' (`onnxfuse passes` lists them)", param_hint="--explain")
    if settings.compiles_cuda:
        _check_cuda_compiler()
    if not _debug:
        from .environment import quiet_libraries

        quiet_libraries()
    from . import api
    from .modelsave import check_writable, save_model, write_text_atomic
    from .verify import VerificationError

    check_writable(dest)
    if report_path:
        check_writable(report_path, "report")
    t0 = time.perf_counter()
    with StageProgress(enabled=not as_json) as progress:
        try:
            result = api.optimize(source, settings=settings, progress=progress.stage)
        except VerificationError as e:
            raise MismatchExit(f"{e}; {dest} not written") from None
        progress.stage(f"saving {dest}")
        t_save = time.perf_counter()
        summary = dict(result.summary)
        summary["output"] = dest
        summary["ir_version"] = _saved_ir(result.model)

        def finish_summary(paths: list[str]) -> None:
            # Runs when OUT's bytes are written and before it is renamed into place: a report
            # that cannot be written leaves OUT untouched.
            summary["files_written"] = paths
            summary["seconds"] = {**result.summary["seconds"], "save": round(time.perf_counter() - t_save, 4),
                                  "total": round(time.perf_counter() - t0, 4)}
            if report_path:
                write_text_atomic(report_path, json.dumps({**result.report(), "summary": summary}, indent=2) + "\n",
                                  "report")

        save_model(result.model, dest, before_commit=finish_summary)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        header, _, rest = optimize_text(summary).partition("\n")
        click.echo(header)
        print_op_table(summary)
        click.echo(rest)
        if explain:
            click.echo(explain_text(summary, list(explain)))


def _check_cuda_compiler() -> None:
    """--target cuda compiles every fused node's kernel with nvcc (pycuda calls nvcc too): a
    machine without it is an environment problem, told before the model is even read (exit 2)."""
    from .cuda.compile import CompileError, find_nvcc

    try:
        find_nvcc()
    except CompileError as e:
        raise InputError(str(e)) from None


def _saved_ir(model) -> int:
    from .modelsave import output_ir_version

    return output_ir_version(model)


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("model_a", metavar="MODEL")
@click.argument("model_b", metavar="[MODEL2]", required=False)
@click.option("--provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="onnxruntime execution provider (cuda: exit 2 when onnxruntime cannot use a GPU).")
@threads_option
@click.option("--runs", type=click.IntRange(min=0), default=100, show_default=True,
              help="Timed runs per model (0: no timing).")
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True, help="Untimed runs first.")
@click.option("--profile-runs", type=click.IntRange(min=1), default=6, show_default=True,
              help="Inferences under onnxruntime's profiler, for the counts and the kernel time by op type"
                   " (the first is left out of the time).")
@click.option("--ort-level", "level", type=click.Choice(["disable", "basic", "extended", "all"]), default="all",
              show_default=True, help="onnxruntime's own graph optimization level.")
@dim_option
@seed_option
@click.option("--top", type=click.IntRange(min=0), default=12, show_default=True,
              help="Op types listed in the breakdown.")
@json_option
@debug_option
def profile(model_a, model_b, provider, threads, runs, warmup, profile_runs, level, dims, seed, top, as_json):
    """Measure kernels per inference, bytes moved and latency of MODEL.

    Kernels are counted from onnxruntime's profiler (after its own optimizations at
    --ort-level), which also gives each op type's share of the kernel time (the profiler's
    per-kernel overhead makes small kernels read long); latency is the median of --runs runs
    without the profiler. With MODEL2 the two are shown side by side with ratios MODEL2/MODEL,
    timed interleaved. MODEL may be zoo:NAME. The onnxfuse library is loaded for models that
    hold fused ops.
    """
    from .normalize import normalize
    from .profile import profile_models, ratios
    from .inputs import check_dims, effective_dims
    from .zoo import resolve_input

    loaded = [normalize(resolve_input(m, weights_on_disk=True)) for m in [model_a, model_b] if m is not None]
    check_dims(dims, [m.model for m in loaded])
    defaults = {}
    for m in loaded:
        defaults.update(m.dims)
    merged = effective_dims([m.model for m in loaded], {**defaults, **dims})
    reports = _run_or_input_error(
        lambda: profile_models([(m.label, m.model) for m in loaded], provider, threads, level, merged, runs, warmup,
                               seed, profile_runs),
        loaded,
    )
    result = {
        "provider": provider,
        "threads": threads,
        "ort_level": level,
        "dims": merged,
        "seed": seed,
        "models": [r.as_dict() for r in reports],
    }
    if len(reports) == 2:
        result["ratios"] = ratios(reports[0], reports[1])
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(profile_text(reports, result, top))


def _run_or_input_error(fn, loaded):
    """onnxruntime failing to load or run a user's model is bad input (exit 2)."""
    from .environment import ort_error_text
    from .runtime import LibraryError

    try:
        return fn()
    except (InputError, LibraryError):
        raise
    except Exception as e:  # onnxruntime's own exception types
        if type(e).__module__.startswith("onnxruntime"):
            names = " / ".join(m.label for m in loaded)
            raise InputError(f"{names}: onnxruntime cannot run it: {ort_error_text(e)}") from None
        raise


def listing_command(name: str, *options):
    """A command that lists something: its own `options` (in help order), then --json and
    --debug, and the listing commands' exit codes."""

    def wrap(fn):
        for option in (debug_option, json_option, *reversed(options)):
            fn = option(fn)
        return main.command(name, epilog=LISTING_EXIT_HELP)(fn)

    return wrap


@listing_command("passes", click.option("--target", type=click.Choice(["cpu", "cuda"]), default=None,
                                        help="List only the passes of this target (default: all)."))
def list_passes(target, as_json):
    """List the passes in pipeline order.

    One row per pass: its name (for --passes), its targets, whether the default pipeline
    runs it or it is opt-in, and what it does.
    """
    from .pipeline import all_passes

    passes = [p for p in all_passes() if target is None or target in p.targets]
    if as_json:
        click.echo(json.dumps([{"name": p.name, "order": p.order, "targets": list(p.targets), "default": p.default,
                                "summary": p.summary} for p in passes], indent=2))
        return
    if not passes:
        click.echo("no passes installed")
        return
    print_wrapped(passes_table(passes))


@listing_command("zoo")
def list_zoo(as_json):
    """List the bundled models.

    One row per model: its name (use it as zoo:NAME wherever a model is read), what it is,
    and its inputs; symbolic dimensions are shown with their default values.
    """
    import onnx

    try:
        from . import zoo

        models = zoo.list_models()
    except ImportError:
        raise InstallationError("the model zoo is not available in this installation") from None
    except zoo.ZooError as e:
        raise InstallationError(str(e)) from None
    entries = []
    for m in models:
        inputs = []
        try:
            # the stored file: a corpus model's inputs are there without materializing its weights
            proto = onnx.load(str(m.file), load_external_data=False)
            inits = {t.name for t in proto.graph.initializer}
            for v in proto.graph.input:
                if v.name in inits:
                    continue
                inputs.append(input_text(v, m.dims or {}))
        except Exception as e:  # a broken bundled file is reported in the listing, not fatal
            inputs.append(f"(cannot read: {e})")
        entries.append({"name": m.name, "description": m.description, "inputs": inputs, "dims": dict(m.dims or {})})
    if as_json:
        click.echo(json.dumps(entries, indent=2))
        return
    print_wrapped(zoo_table(entries))


@listing_command("info")
def info(as_json):
    """Show versions, the onnxruntime in use and the custom-op library.

    Prints the library's path and what it was built with. The library path is the one to register with onnxruntime in an application
    (SessionOptions.register_custom_ops_library; Python: onnxfuse.get_library_path()).
    """
    import platform
    from importlib import metadata

    from .version import __version__
    from .environment import RuntimeInstallError, check_onnxruntime, library_info, onnxruntime_wheels
    from .fused import DOMAIN_VERSION
    from .runtime import LibraryError, library_path

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    report: dict = {
        "onnxfuse": __version__,
        "opset": DOMAIN_VERSION,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "onnx": version("onnx"),
        "onnx-graphsurgeon": version("onnx-graphsurgeon"),
        "numpy": version("numpy"),
    }
    runtime: dict = {"wheels": [f"{w.name} {w.version} ({w.location})" for w in onnxruntime_wheels()],
                     "problem": None, "version": None, "providers": []}
    try:
        check_onnxruntime()
        import onnxruntime as ort

        runtime["version"] = ort.__version__
        runtime["providers"] = list(ort.get_available_providers())
    except (RuntimeInstallError, ImportError) as e:
        runtime["problem"] = str(e)
    report["onnxruntime"] = runtime
    library: dict = {"path": None, "problem": None}
    try:
        library["path"] = library_path()
        library.update(library_info(library["path"]))
    except (LibraryError, OSError, AttributeError, ValueError) as e:
        library["problem"] = str(e)
    report["library"] = library
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    print_info(report)


@main.command("fuzz", epilog=FUZZ_EXIT_HELP)
@click.option("--cases", type=click.IntRange(min=0), default=1000, show_default=True, help="Number of cases.")
@click.option("--seed", type=int, default=0, show_default=True, help="First seed; case i uses seed + i.")
@click.option("--one", type=int, default=None, metavar="SEED",
              help="Run the case of this seed alone: print its model and the outcome (a traceback on error).")
@click.option("--save", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="DIR",
              help="Write each failing case's original model to DIR.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              metavar="FILE.json", help="Write the summary (counts, failures, seconds) to FILE.json.")
@click.option("--idempotence/--no-idempotence", default=True, show_default=True,
              help="Also optimize each optimized model again and require no change.")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Worker processes (each case runs on one thread).")
@debug_option
def fuzz_command(cases, seed, one, save, json_path, idempotence, jobs):
    """Check this installation on random graphs against its onnxruntime.

    Each case is a seeded random graph (half with special values at a few input positions),
    optimized and compared with the original in onnxruntime, with and without the onnxfuse
    library. A failing case is reproduced by its seed with --one SEED.
    """
    from .fuzz.run import run_fuzz

    sys.exit(run_fuzz(cases=cases, seed=seed, one=one, save=save, json_path=json_path, idempotence=idempotence,
                      jobs=jobs))


if __name__ == "__main__":
    main()
