"""`onnxfuse fuzz` / `python -m onnxfuse.fuzz`: many cases, in parallel, with a summary."""
from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import onnx

from ..environment import quiet_libraries
from .cases import build_case
from .check import Outcome, run_case

def _checked(seed_and_idempotence) -> Outcome:
    seed, idempotence = seed_and_idempotence
    try:
        return run_case(seed, idempotence=idempotence)
    except Exception as e:  # a crash of the checker itself is a failure of the case too
        return Outcome(seed, "fail", f"seed {seed}: checker crashed: {type(e).__name__}: {str(e)[:200]}")


def failure_kind(message: str) -> str:
    """A failure message without its seed and value names: failures of one cause group together."""
    import re

    text = message.split(": ", 1)[-1]
    text = re.sub(r"'[^']*'|\b[vc]\d+\b|\d+(\.\d+)?(e[-+]?\d+)?", "#", text)
    return text[:90]


DESCRIPTION = ("Differential fuzzing: random valid graphs (half with special values at a few input positions),"
               " optimized and compared with the original in onnxruntime. Exit status 1 when a case fails.")


def run_fuzz(cases: int = 1000, seed: int = 0, one: int | None = None, save: Path | None = None,
             json_path: Path | None = None, idempotence: bool = True, jobs: int = 1) -> int:
    """Run `cases` seeded cases (or the case of seed `one` alone); the exit status."""
    args = SimpleNamespace(cases=cases, seed=seed, one=one, save=save, json=json_path,
                           no_idempotence=not idempotence, jobs=jobs)
    quiet_libraries("CRITICAL")
    if args.one is not None:
        case = build_case(args.one)
        print(onnx.printer.to_text(case.model))
        try:
            o = run_case(args.one, idempotence=not args.no_idempotence)
            print(o.message or o.status)
        except Exception:
            traceback.print_exc()
            return 1
        return 0
    t0 = time.time()
    failures, ties, unrunnable = [], [], []
    cf_cases = fused_cases = salted_cases = 0
    work = [(args.seed + i, not args.no_idempotence) for i in range(args.cases)]
    if args.jobs > 1:
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(args.jobs, initializer=quiet_libraries, initargs=("CRITICAL",))
        outcomes = pool.imap(_checked, work, chunksize=20)
    else:
        pool, outcomes = None, map(_checked, work)
    for i, o in enumerate(outcomes):
        seed = o.seed
        cf_cases += o.control_flow
        fused_cases += o.fused > 0
        salted_cases += o.salted
        if o.status == "tie":
            ties.append(o.message)
        if o.status == "unrunnable":
            unrunnable.append(o.message)
        if o.status == "fail":
            failures.append(o.message)
            print(o.message, flush=True)
            if args.save:
                args.save.mkdir(parents=True, exist_ok=True)
                onnx.save(build_case(seed).model, str(args.save / f"fuzz_{seed}.onnx"))
        if (i + 1) % 1000 == 0:
            print(f"{i + 1} cases, {len(failures)} failures, {len(ties)} tie-sensitive, {time.time() - t0:.0f} s",
                  flush=True)
    if pool is not None:
        pool.close()
    kinds: dict[str, int] = {}
    for m in failures:
        kinds[failure_kind(m)] = kinds.get(failure_kind(m), 0) + 1
    summary = {
        "cases": args.cases, "first_seed": args.seed, "failures": failures, "failure_kinds": kinds,
        "tie_sensitive": ties, "original_unrunnable_in_onnxruntime": unrunnable,
        "cases_with_control_flow": cf_cases, "cases_with_fused_nodes": fused_cases,
        "cases_with_special_values": salted_cases,
        "seconds": round(time.time() - t0, 1),
    }
    print(f"{args.cases} cases from seed {args.seed}: {len(failures)} failures, {len(ties)} tie-sensitive"
          f" (excused), {len(unrunnable)} valid originals onnxruntime cannot run, {fused_cases} with fused nodes,"
          f" {cf_cases} with control flow, {salted_cases} with special values, in {summary['seconds']} s")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if failures else 0

