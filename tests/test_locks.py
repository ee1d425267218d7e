"""Both locks install with pip's default configuration, and they pin the same versions.

requirements.lock is the CPU install (what CI tests), requirements-gpu.lock the CUDA one (tools/lock.sh writes
both). A user's pip looks only at PyPI: every pin must exist there for Linux x86_64 and Python 3.11, except the
CPU build of torch, which comes from the PyTorch CPU index named by torch-cpu.lock (CI cannot reach that index,
so that pin is checked to name it). pip runs here with its default configuration (PIP_CONFIG_FILE=/dev/null,
no PIP_* variables) and `--ignore-installed`, so neither this machine's wheel folder nor the venv answers for
PyPI.

Time: a dry run of the whole GPU lock through pip's resolver took 3 min 28 s here (2026-11-26, 2 loaded cores),
one metadata fetch after another. So each pin is fetched alone (`--no-deps`), in parallel processes, and the
dependencies are checked offline against the fetched metadata: every requirement of every pinned package, with
its markers for Linux x86_64 and Python 3.11 and the extras asked for, is met by a pin of the same lock. This
index has no PEP 658 metadata files, and pip before 24 downloads whole wheels in a dry run (526 MB for torch),
so the check uses pip 26.3 with range requests (`fast-deps`), fetched once into the tests' cache.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
CPU_LOCK, GPU_LOCK, TORCH_CPU = REPO / "requirements.lock", REPO / "requirements-gpu.lock", REPO / "torch-cpu.lock"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
_PIP = "26.3"  # the first pip tried here whose dry run reads wheel metadata by range requests without downloading
_PROCESSES = 8  # metadata fetches are network round trips: 8 pips at once finish the ~180 pins in about a minute
# Packages the two locks may pin differently, and why.
_DIFFER = {
    "torch": "the CPU build (2.13.0+cpu) and PyPI's CUDA build (2.13.0): the same release",
    "triton": "PyPI's torch 2.13.0 requires triton==3.7.1 exactly; the CPU build requires none, so the CPU lock "
    "keeps the 3.9.0 the kernels are tested with on the CPU",
}
# The locks' platform: what pip-compile resolved for (Linux x86_64, CPython 3.11).
_MARKERS = default_environment() | {
    "python_version": "3.11",
    "python_full_version": "3.11.7",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


def _pins(lock: Path) -> dict[str, str]:
    found = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$", lock.read_text(), re.MULTILINE)
    return {canonicalize_name(name): str(Version(version)) for name, version in found}


def _default_pip_env() -> dict[str, str]:
    """pip's default configuration: no config file, no PIP_* variable (find-links, index, constraint)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@pytest.fixture(scope="module")
def pip() -> list[str]:
    """pip `_PIP`, run from its wheel (fetched from PyPI once per machine, cached outside the checkout)."""
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slimtune-tests" / f"pip-{_PIP}"
    wheel = folder / f"pip-{_PIP}-py3-none-any.whl"
    if not wheel.is_file():
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(folder), f"pip=={_PIP}"],
            capture_output=True,
            text=True,
            env=_default_pip_env(),
        )
        assert done.returncode == 0, f"could not fetch pip {_PIP} from PyPI:\n{done.stderr[-2000:]}"
    return [sys.executable, str(wheel / "pip")]


@pytest.fixture(scope="module")
def pypi_metadata(pip: list[str], tmp_path_factory) -> dict[tuple[str, str], dict]:
    """(name, version) -> core metadata from PyPI, for every pin of both locks but the CPU build of torch."""
    pins = _pins(CPU_LOCK).items() | _pins(GPU_LOCK).items()
    wanted = sorted(f"{name}=={version}" for name, version in pins if "+" not in version)
    tmp = tmp_path_factory.mktemp("pypi")
    runs = []
    for i in range(_PROCESSES):
        chunk = wanted[i::_PROCESSES]
        command = [*pip, "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet"]
        command += ["--use-feature=fast-deps", "--report", str(tmp / f"{i}.json"), *chunk]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_default_pip_env())
        runs.append((command, process))
    found = {}
    for i, (command, process) in enumerate(runs):
        out = process.communicate()[0].decode(errors="replace")
        assert process.returncode == 0, f"pip found no PyPI distribution for a pin:\n$ {shlex.join(command)}\n{out}"
        for item in json.loads((tmp / f"{i}.json").read_text())["install"]:
            meta = item["metadata"]
            found[canonicalize_name(meta["name"]), str(Version(meta["version"]))] = meta
    return found


def test_the_cpu_torch_pin_comes_from_the_index_the_readme_installs_it_from():
    lines = [line.split("#")[0].strip() for line in TORCH_CPU.read_text().splitlines()]
    lines = [line for line in lines if line]
    torch = _pins(CPU_LOCK)["torch"]
    assert lines == [f"--index-url {TORCH_CPU_INDEX}", f"torch=={torch}"], lines
    assert torch.endswith("+cpu"), torch
    # The README installs it first, without dependencies (the lock pins them), then the lock, in both commands.
    block = re.search(r"^```sh\n(.*?)^```", (REPO / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    commands = block.group(1).splitlines()[:2]
    for command in commands:
        step1 = command.find("pip install -q --no-deps -r torch-cpu.lock")
        assert 0 <= step1 < command.find("-r requirements.lock"), command


def test_the_locks_agree_on_every_package_they_share():
    cpu, gpu = _pins(CPU_LOCK), _pins(GPU_LOCK)
    differ = {name: (cpu[name], gpu[name]) for name in cpu.keys() & gpu.keys() if cpu[name] != gpu[name]}
    assert differ.keys() <= _DIFFER.keys(), {k: v for k, v in differ.items() if k not in _DIFFER}
    assert Version(cpu["torch"]).public == Version(gpu["torch"]).public, (cpu["torch"], gpu["torch"])
    assert Version(gpu["torch"]).local is None, "the GPU lock must pin PyPI's torch (the CUDA build), not a local one"
    assert cpu.keys() <= gpu.keys(), f"only in the CPU lock: {sorted(cpu.keys() - gpu.keys())}"
    assert all(name.startswith(("nvidia-", "cuda-")) for name in gpu.keys() - cpu.keys()), gpu.keys() - cpu.keys()


def _unmet(lock: Path, metadata: dict[tuple[str, str], dict]) -> list[str]:
    """Every requirement of slimtune (with the extras the locks install) and of every pinned package that no pin
    of `lock` meets. A package pinned without PyPI metadata (the CPU build of torch) is not followed."""
    pins = _pins(lock)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    requested = {"slimtune": ["", "llama-cpp", "ray", "test"]}
    requires = {"slimtune": project["dependencies"] + extras["llama-cpp"] + extras["ray"] + extras["test"]}
    for (name, version), meta in metadata.items():
        if pins.get(name) == version:
            requires[name] = meta.get("requires_dist") or []
    unmet, queue, seen = [], ["slimtune"], set()
    while queue:
        name = queue.pop()
        for extra in requested.get(name, [""]):
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            for text in requires.get(name, []):
                req = Requirement(text)
                if req.marker is not None and not req.marker.evaluate(_MARKERS | {"extra": extra}):
                    continue
                dep = canonicalize_name(req.name)
                pinned = pins.get(dep)
                if pinned is None or not req.specifier.contains(pinned, prereleases=True):
                    unmet.append(f"{name}[{extra}] requires {text}; {lock.name} pins {dep}=={pinned}")
                    continue
                requested.setdefault(dep, [""])
                requested[dep] += [e for e in sorted(req.extras) if e not in requested[dep]]
                queue.append(dep)
    return unmet


@pytest.mark.parametrize("lock", [CPU_LOCK, GPU_LOCK], ids=lambda lock: lock.name)
def test_every_pin_resolves_from_pypi_and_the_lock_is_complete(lock, pypi_metadata):
    pins = _pins(lock)
    missing = sorted(f"{n}=={v}" for n, v in pins.items() if "+" not in v and (n, v) not in pypi_metadata)
    assert missing == [], f"not on PyPI for Linux x86_64, Python 3.11: {missing}"
    assert _unmet(lock, pypi_metadata) == []
