"""One command-line style: every command (fuzz included) is a click command whose help has a
usage line, a summary, options that each say what they do, and its exit statuses; the top-level
help lists each command once. `--target cuda` on a machine without nvcc is an environment
problem told before any work (exit 2)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SENTINEL, stderr_lines

COMMANDS = ["optimize", "profile", "passes", "zoo", "info", "fuzz"]


@pytest.fixture
def cli():
    """The CLI in-process under its installed name (the shared fixture's runner calls it main)."""
    from click.testing import CliRunner

    from onnxfuse.cli import main

    return lambda *args: CliRunner().invoke(main, [str(a) for a in args], prog_name="onnxfuse",
                                            catch_exceptions=False)


def test_top_level_help_lists_each_command_once(cli):
    text = cli("--help").stdout
    assert text.startswith("Usage: onnxfuse [OPTIONS] COMMAND [ARGS]...")
    for name in COMMANDS:
        assert len(re.findall(rf"^  {name} ", text, re.M)) == 1, (name, text)
        # no second, hand-written list of commands
        assert not re.findall(rf"^\s*onnxfuse {name}\b", text, re.M), (name, text)
    assert "Exit status:" in text


def _options(text: str) -> list[tuple[str, str]]:
    """The Options section as (option, its help text), continuation lines joined."""
    section = text.split("\nOptions:\n", 1)[1].split("\n\n", 1)[0]
    items: list[tuple[str, str]] = []
    for line in section.splitlines():
        m = re.match(r"^  (-\S.*?)(?:\s{2,}(.*))?$", line)
        if m:
            items.append((m.group(1), m.group(2) or ""))
        else:
            name, help_text = items[-1]
            items[-1] = (name, f"{help_text} {line.strip()}".strip())
    return items


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_help_has_the_same_parts(cli, name):
    result = cli(name, "--help")
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    assert text.startswith(f"Usage: onnxfuse {name} [OPTIONS]"), text[:80]
    summary = text.split("\n\n", 2)[1].strip()
    assert summary and summary[0].isupper() and summary.endswith("."), summary
    options = _options(text)
    names = [o for o, _ in options]
    assert any(o.startswith("--debug") for o in names) and any("--help" in o for o in names), names
    undocumented = [o for o, h in options if not h]
    assert not undocumented, f"onnxfuse {name}: options without help: {undocumented}"
    assert re.search(r"^  Exit status:\n    0  ", text, re.M), text
    assert "  2  bad" in text


def test_fuzz_options_are_parsed_by_click_with_one_line_errors(cli):
    result = cli("fuzz", "--cases", "many")
    assert result.exit_code == 2
    lines = stderr_lines(result)
    assert len(lines) == 1 and lines[0].startswith("onnxfuse: error: ") and "--cases" in lines[0], lines
    result = cli("fuzz", "--no-such-option")
    assert result.exit_code == 2 and len(stderr_lines(result)) == 1


def test_python_m_onnxfuse_fuzz_is_the_same_command():
    done = subprocess.run([sys.executable, "-m", "onnxfuse.fuzz", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Usage: onnxfuse fuzz [OPTIONS]" in done.stdout and "--idempotence / --no-idempotence" in done.stdout


def test_target_cuda_without_nvcc_is_exit_2_before_any_work(chain_path, tmp_path):
    """No nvcc on PATH nor under $CUDA_HOME: one line, exit 2, in well under 3 s from the
    shell (the model is not even read: a missing IN is not what is reported), OUT untouched."""
    out = tmp_path / "out.onnx"
    out.write_bytes(SENTINEL)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin",
           "CUDA_HOME": str(tmp_path / "no-cuda"), "CUDA_PATH": str(tmp_path / "no-cuda")}
    if any((Path(d) / "nvcc").exists() for d in env["PATH"].split(os.pathsep)):
        pytest.skip("nvcc is in /usr/bin or /bin here: cannot hide it")
    for model in (chain_path, tmp_path / "missing.onnx"):
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", str(model), str(out), "--target", "cuda"],
                              capture_output=True, text=True, timeout=60, env=env)
        seconds = time.perf_counter() - t0
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2, done.stderr
        assert len(lines) == 1 and "nvcc not found" in lines[0] and "--target cuda" in lines[0], lines
        assert seconds < 3.0, seconds
        assert out.read_bytes() == SENTINEL
    # Without cuda-compile in --passes nothing needs the compiler.
    done = subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", str(chain_path), str(out), "--target", "cuda",
                           "--passes", "pointwise", "--no-verify"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
