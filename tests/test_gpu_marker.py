"""On a machine without CUDA, GPU tests skip with a message that says how to run them where there is one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def _tests_conftest(config: pytest.Config):
    """tests/conftest.py as pytest registered it: `import conftest` gets whichever conftest was imported first."""
    path = Path(__file__).with_name("conftest.py")
    [plugin] = [p for p in config.pluginmanager.get_plugins() if getattr(p, "__file__", None) == str(path)]
    return plugin


class _Item:
    """The two methods of a collected test item that the hook uses."""

    def __init__(self, *marks: str):
        self.marks = marks
        self.markers: list[pytest.MarkDecorator] = []

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return getattr(pytest.mark, name).mark if name in self.marks else None

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.markers.append(marker)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: gpu tests run here")
def test_gpu_tests_skip_saying_how_to_run_them(pytestconfig):
    gpu, cpu = _Item("gpu"), _Item("parametrize")
    _tests_conftest(pytestconfig).pytest_collection_modifyitems(None, [gpu, cpu])
    assert cpu.markers == []
    [marker] = gpu.markers
    assert marker.name == "skip" and "pytest -m gpu" in marker.kwargs["reason"], marker.kwargs


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_a_test_with_a_gpu_param_id_is_no_gpu_test(variant, request):
    assert request.node.get_closest_marker("gpu") is None  # it runs here (it was skipped as a GPU test)
