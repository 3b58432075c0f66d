"""The installed `gpuops` command is the native binary (issue 11, "The command line starts like a native
tool"): an ELF that loads neither torch nor Python, runs from any location with an empty environment, starts
in milliseconds, and prints what the Python API's front door (gpuops.cli.main) prints, byte for byte."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

COMMAND = Path(sys.executable).parent / "gpuops"
# What a C++17 program built by the system compiler may load: the C++ runtime, libc and the loader.
SYSTEM_LIBRARIES = {"linux-vdso.so.1", "libstdc++.so.6", "libm.so.6", "libgcc_s.so.1", "libc.so.6",
                    "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}


def loaded_objects(binary, **env):
    """The shared objects the dynamic loader maps for `binary`, as `ldd` lists them (the loader's own
    LD_TRACE_LOADED_OBJECTS mode, so no ldd is needed)."""
    result = subprocess.run([str(binary)], env={"LD_TRACE_LOADED_OBJECTS": "1", **env}, capture_output=True,
                            timeout=30)
    assert result.returncode == 0, result
    return result.stdout.decode()


def test_the_installed_command_is_an_elf_binary_that_loads_no_torch():
    assert COMMAND.read_bytes()[:4] == b"\x7fELF", "the installed gpuops is not the native binary"
    listing = loaded_objects(COMMAND)
    assert "not found" not in listing, listing
    names = {os.path.basename(line.split()[0]) for line in listing.splitlines() if line.strip()}
    assert names <= SYSTEM_LIBRARIES, names - SYSTEM_LIBRARIES
    # Library names and paths only: a load address such as (0x00007fc10...) holds "c10" in 1 run in 60.
    paths = " ".join(part for line in listing.splitlines() for part in line.split() if not part.startswith("(0x"))
    assert not re.search(r"torch|c10|python|cuda", paths, re.IGNORECASE), listing


def test_a_copy_runs_anywhere_with_an_empty_environment(tmp_path):
    """No RPATH into the build or the venv, no PATH, no PYTHONHOME: a copy elsewhere works alone."""
    copy = tmp_path / "elsewhere" / "gpuops"
    copy.parent.mkdir()
    shutil.copy2(COMMAND, copy)
    result = subprocess.run([str(copy), "estimate", "--model", "gpt2", "--json"], env={}, cwd=tmp_path,
                            capture_output=True, timeout=30)
    assert result.returncode == 0 and result.stderr == b"", result
    reference = subprocess.run([str(COMMAND), "estimate", "--model", "gpt2", "--json"], capture_output=True,
                               timeout=30)
    assert result.stdout == reference.stdout


def test_estimate_starts_in_well_under_a_second():
    """A smoke check, not a benchmark (docs/benchmarks.md has the figures): the console script this binary
    replaced took 2.5 s, most of it importing torch."""
    start = time.perf_counter()
    result = subprocess.run([str(COMMAND), "estimate"], capture_output=True, timeout=30)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result
    assert elapsed < 0.5, f"gpuops estimate took {elapsed:.3f} s"


def excludes_sorted(text):
    """CLI11 keeps an option's exclusions in a set ordered by pointer, so `estimate --help` may list them in
    either order, depending on the heap, not on the front door."""
    return re.sub(rb"Excludes: ([^\n]*)", lambda m: b"Excludes: " + b" ".join(sorted(m.group(1).split())), text)


@pytest.mark.parametrize("args", [
    ["estimate"], ["estimate", "--model", "gpt2", "--json"], ["gpus"], ["gpus", "--json"], ["presets"],
    ["--help"], ["estimate", "--help"], ["--version"], [], ["estimate", "--batch", "0x10"],
])
def test_the_binary_and_the_python_api_print_the_same(args, capfdbinary):
    from gpuops.cli import main

    native = subprocess.run([str(COMMAND), *args], capture_output=True, timeout=30)
    code = main(args)
    captured = capfdbinary.readouterr()
    assert (native.returncode, excludes_sorted(native.stdout), native.stderr) == \
        (code, excludes_sorted(captured.out), captured.err)


def test_python_dash_m_gpuops_is_the_command_line():
    result = subprocess.run([sys.executable, "-m", "gpuops", "gpus"], capture_output=True, timeout=120)
    native = subprocess.run([str(COMMAND), "gpus"], capture_output=True, timeout=30)
    assert result.returncode == 0 and result.stdout == native.stdout and result.stderr == b"", result
