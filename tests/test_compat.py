"""Pins that keep hivemind 1.1.12 working (numpy < 2.4 for its 8-bit codecs, which fail silently on 2.4), and version
ranges that say what the code needs."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy
import pytest
import torch
from hivemind.compression import Float16Compression, Quantile8BitQuantization, Uniform8BitQuantization
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _requirement(name: str) -> Requirement:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return next(Requirement(line) for line in dependencies if Requirement(line).name == name)


def test_numpy_is_pinned_below_2_4_and_installed_accordingly() -> None:
    numpy_requirement = _requirement("numpy")
    assert not numpy_requirement.specifier.contains("2.4.0")
    assert numpy_requirement.specifier.contains(numpy.__version__)


def test_torch_range_admits_newer_releases_and_needs_fsdp2() -> None:
    torch_requirement = _requirement("torch")
    for release in ("2.6.0", "2.13.0", "2.14.1", "3.0.0"):  # a GPU box's newer torch is kept, not replaced
        assert torch_requirement.specifier.contains(release), release
    assert not torch_requirement.specifier.contains("2.5.1"), "--shard-model imports torch.distributed.fsdp.fully_shard"
    assert Version(torch.__version__.split("+")[0]) in torch_requirement.specifier


def test_transformers_floor_has_from_pretrained_dtype() -> None:
    assert not _requirement("transformers").specifier.contains("4.55.4"), "model.py passes dtype= (4.56 and later)"


@pytest.mark.parametrize(
    "codec, tolerance",
    [(Float16Compression(), 1e-3), (Uniform8BitQuantization(), 0.05), (Quantile8BitQuantization(), 0.05)],
    ids=["fp16", "uniform8bit", "quantile8bit"],
)
def test_hivemind_codecs_round_trip(codec, tolerance: float) -> None:
    tensor = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    restored = deserialize_torch_tensor(serialize_torch_tensor(tensor, codec.compression_type))
    assert restored.shape == tensor.shape
    relative_error = float((restored - tensor).norm() / tensor.norm())
    assert relative_error < tolerance, relative_error
