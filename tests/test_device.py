"""Device resolution asks CUDA for expandable segments, and leaves a user's allocator settings alone."""

from __future__ import annotations

import pytest

from slimtune.core.device import ALLOCATOR_SETTINGS, resolve_device

_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@pytest.fixture
def no_allocator_settings(monkeypatch):
    for var in _VARS:
        monkeypatch.delenv(var, raising=False)


def test_resolving_a_gpu_capable_device_asks_for_expandable_segments(no_allocator_settings, monkeypatch):
    import os

    resolve_device("auto")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ALLOCATOR_SETTINGS == "expandable_segments:True"


@pytest.mark.parametrize("var", _VARS)
def test_a_users_allocator_settings_win(no_allocator_settings, monkeypatch, var):
    import os

    monkeypatch.setenv(var, "max_split_size_mb:128")
    resolve_device("auto")
    assert os.environ[var] == "max_split_size_mb:128"
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128") == "max_split_size_mb:128"


def test_a_cpu_run_leaves_the_environment_alone(no_allocator_settings):
    import os

    assert str(resolve_device("cpu")) == "cpu"
    assert not any(var in os.environ for var in _VARS)
