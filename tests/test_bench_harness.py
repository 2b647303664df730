"""bench/harness.py: the interleaved timer's orders and figures, the run stamp and the command line
every bench script shares."""
from __future__ import annotations

import click
import numpy as np
import pytest

from bench import harness


def _recorder(log: list[str], name: str):
    return lambda: log.append(name)


def test_mirror_rounds_run_each_variant_twice_in_opposite_order():
    log: list[str] = []
    samples = harness.interleave({n: _recorder(log, n) for n in "abc"}, order="mirror", min_rounds=2, max_rounds=2,
                                 warmup=1, runs=1)
    assert log[:3] == ["a", "b", "c"]  # warm-up
    assert log[3:] == ["a", "b", "c", "c", "b", "a"] * 2
    assert samples.rounds == 2 and samples.samples_per_round == 2
    assert samples.total_runs("a") == 4 and samples.wall["a"].shape == (2,)


def test_cycle_rounds_keep_the_order_and_samples_hold_the_asked_runs():
    log: list[str] = []
    samples = harness.interleave({n: _recorder(log, n) for n in "ab"}, order="cycle", min_rounds=3, max_rounds=3,
                                 warmup=2, runs=3)
    assert log[4:] == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
    assert samples.runs == {"a": 3, "b": 3} and samples.total_runs("b") == 9


def test_samples_last_about_sample_ms_sized_on_the_slowest_variant_unless_each_its_own():
    import time

    fast, slow = (lambda: None), (lambda: time.sleep(0.002))
    same = harness.interleave({"fast": fast, "slow": slow}, min_rounds=1, max_rounds=1, sample_ms=4.0)
    assert same.runs["fast"] == same.runs["slow"] <= 2
    own = harness.interleave({"fast": fast, "slow": slow}, min_rounds=1, max_rounds=1, sample_ms=4.0, same_runs=False)
    assert own.runs["fast"] > 100 and own.runs["slow"] <= 2


def test_thread_cpu_time_is_taken_only_when_asked_and_ratios_pair_rounds():
    spin = lambda: sum(range(2000))  # noqa: E731
    samples = harness.interleave({"a": spin, "b": spin}, min_rounds=5, max_rounds=5, runs=2, cpu_clock=True)
    assert set(samples.cpu) == {"a", "b"} and samples.cpu["a"].shape == (5,)
    assert np.allclose(samples.ratios("a", "b"), samples.wall["b"] / samples.wall["a"])
    interval = samples.interval("a", "b", "cpu")
    assert interval["low"] <= interval["ratio"] <= interval["high"]
    assert harness.interleave({"a": spin}, min_rounds=1, max_rounds=1, runs=1).cpu == {}


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="order must be one of"):
        harness.interleave({"a": lambda: None}, order="random")


def test_run_stamp_names_the_command_as_it_can_be_typed_again():
    stamp = harness.RunStamp.now("bench.zoo_latency", ["--models", "char_rnn"])
    assert stamp.command == "python -m bench.zoo_latency --models char_rnn"
    assert harness.RunStamp.now("/somewhere/bench/gelu_forms.py", []).command == "python -m bench.gelu_forms"
    title, blank, command, line, end = stamp.header("Title")
    assert (title, blank, end) == ("# Title", "", "")
    assert command == "Command: `python -m bench.zoo_latency --models char_rnn`"
    assert line.startswith(f"Date: {stamp.started}. Commit: ") and "onnxruntime " in line and "Python " in line


def test_scripts_get_their_options_and_stamp_and_usage_errors_exit_2(capsys):
    seen = {}

    @harness.script("A script.\n\nMore text.", "demo")
    @click.option("--threads", default="1,2", callback=harness.csv(int))
    def cli(args, stamp) -> int:
        seen.update(threads=args.threads, command=stamp.command)
        return 3

    main = harness.main_of(cli, prog="python -m bench.demo")
    assert main(["--threads", "4,8"]) == 3
    assert seen == {"threads": [4, 8], "command": "python -m bench.demo --threads 4,8"}
    assert main(["--bogus"]) == 2
    assert "No such option" in capsys.readouterr().err
    assert main(["--threads", "x"]) == 2
