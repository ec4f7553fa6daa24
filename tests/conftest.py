import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; runs on the GPU machines (docs/gpu-tests.md)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
