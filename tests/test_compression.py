"""Wire codecs against their stated bounds, and error feedback (no network)."""

from __future__ import annotations

from typing import get_args

import pytest
import torch
from hivemind.compression import NoCompression, ScaledFloat16Compression, Uniform8BitQuantization

from p2p_diloco.config import CODECS, Codec
from p2p_diloco.network.compression import (
    INT8_GAUSSIAN_REL_L2,
    error_bound,
    hivemind_compression,
    roundtrip,
    serialized_bytes,
)
from p2p_diloco.streaming import ErrorFeedback

SHAPES = [(), (1,), (2,), (7,), (1000,), (37, 29), (4, 5, 6), (100_000,)]
SEEDS = [0, 1, 2]


def _gaussian(shape: tuple[int, ...], seed: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std + mean


def _with_outlier(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    tensor = _gaussian(shape, seed)
    tensor.view(-1)[0] = 1000.0
    return tensor


def _rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def test_codec_names_map_to_registered_hivemind_codecs() -> None:
    assert CODECS == get_args(Codec)
    assert isinstance(hivemind_compression("fp32"), NoCompression)
    assert isinstance(hivemind_compression("fp16"), ScaledFloat16Compression)
    assert isinstance(hivemind_compression("int8"), Uniform8BitQuantization)


def test_unknown_codec_raises_value_error() -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        hivemind_compression("fp4")  # type: ignore[arg-type]
    for function in (roundtrip, serialized_bytes, error_bound):
        with pytest.raises(ValueError, match="unknown codec"):
            function(torch.ones(3), "bf16")  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("shape", SHAPES)
def test_roundtrip_keeps_shape_and_returns_fp32(codec: Codec, shape: tuple[int, ...]) -> None:
    decoded = roundtrip(_gaussian(shape, 0).double(), codec)
    assert decoded.shape == torch.Size(shape)
    assert decoded.dtype == torch.float32


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_roundtrip_is_bit_exact(shape: tuple[int, ...]) -> None:
    tensor = _gaussian(shape, 3) * 1e-30 + _gaussian(shape, 4) * 1e30 * (_gaussian(shape, 5) < 0)
    assert torch.equal(roundtrip(tensor, "fp32"), tensor)
    assert torch.equal(error_bound(tensor, "fp32"), torch.zeros(shape))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("std, mean", [(1.0, 0.0), (1e-8, 0.0), (1e-4, 3e-4), (1e4, 0.0), (0.01, 1.0)])
def test_fp16_within_its_elementwise_bound(seed: int, shape: tuple[int, ...], std: float, mean: float) -> None:
    tensor = _gaussian(shape, seed, std, mean)
    error = (roundtrip(tensor, "fp16") - tensor).abs()
    assert bool((error <= error_bound(tensor, "fp16")).all())


@pytest.mark.parametrize("std", [1e-8, 1e-2, 1e3])
def test_fp16_keeps_relative_precision_at_any_magnitude(std: float) -> None:
    """Plain float16 would flush N(0, 1e-16) to zero; the scaled codec keeps ~2**-12 relative error."""
    tensor = _gaussian((100_000,), 5, std)
    assert _rel_l2(roundtrip(tensor, "fp16"), tensor) < 3e-4


def test_fp16_outlier_is_still_bounded() -> None:
    tensor = _with_outlier((10_000,), 6)
    error = (roundtrip(tensor, "fp16") - tensor).abs()
    bound = error_bound(tensor, "fp16")
    assert bool(torch.isfinite(bound).all())
    assert bool((error <= bound).all())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("std, mean", [(1.0, 0.0), (1e-7, 0.0), (2e-3, 1e-3), (0.01, 1.0), (1.0, 1e4)])
def test_int8_within_its_bound_inside_the_clipping_range(
    seed: int, shape: tuple[int, ...], std: float, mean: float
) -> None:
    tensor = _gaussian(shape, seed, std, mean)
    error = (roundtrip(tensor, "int8") - tensor).abs()
    bound = error_bound(tensor, "int8")
    assert bool((error <= bound).all())
    inside = torch.isfinite(bound)
    assert float(inside.float().mean()) > (0.99 if tensor.numel() >= 1000 else 0.0)
    if tensor.numel() >= 1000:  # one step is 6/256 of a standard deviation
        assert float(bound[inside].max()) < 0.03 * std + 3e-4 * abs(mean)


@pytest.mark.parametrize("shape", [(), (1,), (5,)])
def test_int8_is_exact_for_equal_values(shape: tuple[int, ...]) -> None:
    tensor = torch.full(shape, 0.75)
    assert torch.equal(roundtrip(tensor, "int8"), tensor)


@pytest.mark.parametrize("shape", [(1000,), (37, 29), (100_000,)])
def test_int8_outlier_has_no_bound_and_coarsens_the_rest(shape: tuple[int, ...]) -> None:
    tensor = _with_outlier(shape, 7)
    error = (roundtrip(tensor, "int8") - tensor).abs()
    bound = error_bound(tensor, "int8")
    assert bound.view(-1)[0] == float("inf")
    assert bool((error <= bound).all())
    assert float(bound.view(-1)[1:].min()) > 0.05  # the outlier inflates the std, hence everyone's step


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("numel", [10_000, 100_000, 1_000_000])
def test_int8_relative_l2_error_on_gaussian_data(seed: int, numel: int) -> None:
    for std, mean in [(1.0, 0.0), (1e-6, 0.0), (3.0, 1.0)]:
        tensor = _gaussian((numel,), seed, std, mean)
        assert _rel_l2(roundtrip(tensor, "int8"), tensor) <= INT8_GAUSSIAN_REL_L2


def test_serialized_bytes_ratios() -> None:
    tensor = _gaussian((1_000_000,), 8)
    fp32, fp16, int8 = (serialized_bytes(tensor, codec) for codec in ("fp32", "fp16", "int8"))
    assert 4_000_000 <= fp32 < 4_000_100
    assert fp16 / fp32 == pytest.approx(0.5, abs=1e-4)
    lookup_table = 8 + 256 * 4  # table length + 256 fp32 bucket values
    assert 1_000_000 + lookup_table <= int8 < 1_000_000 + lookup_table + 100


def _ef_rounds(codec: Codec, rounds: int, use_feedback: bool) -> tuple[torch.Tensor, torch.Tensor, ErrorFeedback]:
    """Sum of true deltas and sum of transmitted values over ``rounds`` random rounds."""
    feedback = ErrorFeedback()
    true_sum, sent_sum = torch.zeros(10_000), torch.zeros(10_000)
    for index in range(rounds):
        delta = _gaussian((10_000,), 100 + index)
        compensated = feedback.compensate([delta]) if use_feedback else [delta]
        transmitted = [roundtrip(compensated[0], codec)]
        if use_feedback:
            feedback.update(compensated, transmitted)
        true_sum += delta
        sent_sum += transmitted[0]
    return true_sum, sent_sum, feedback


def test_error_feedback_keeps_the_accumulated_error_at_one_round() -> None:
    one_round_error = float((roundtrip(_gaussian((10_000,), 99), "int8") - _gaussian((10_000,), 99)).norm())
    true_sum, sent_sum, feedback = _ef_rounds("int8", 50, use_feedback=True)
    (residual,) = feedback.state_dict()["residuals"]
    torch.testing.assert_close(true_sum - sent_sum, residual, atol=1e-4, rtol=0.0)
    with_feedback = float((true_sum - sent_sum).norm())
    assert with_feedback <= 1.5 * one_round_error

    true_sum, sent_sum, _ = _ef_rounds("int8", 50, use_feedback=False)
    without_feedback = float((true_sum - sent_sum).norm())
    assert without_feedback > 3.0 * with_feedback


def test_error_feedback_compensates_in_fp32_and_does_not_alias_inputs() -> None:
    feedback = ErrorFeedback()
    delta = [torch.ones(3, dtype=torch.bfloat16)]
    first = feedback.compensate(delta)
    assert first[0].dtype == torch.float32
    first[0].add_(1.0)
    assert torch.equal(delta[0], torch.ones(3, dtype=torch.bfloat16))
    feedback.update([torch.full((3,), 1.5)], [torch.ones(3, dtype=torch.float16)])
    torch.testing.assert_close(feedback.compensate(delta)[0], torch.full((3,), 1.5))


def test_error_feedback_rejects_shape_mismatches() -> None:
    feedback = ErrorFeedback()
    with pytest.raises(ValueError):
        feedback.update([torch.zeros(3)], [torch.zeros(4)])
    with pytest.raises(ValueError):
        feedback.update([torch.zeros(3)], [torch.zeros(3), torch.zeros(3)])
    feedback.update([torch.ones(3)], [torch.zeros(3)])
    with pytest.raises(ValueError):
        feedback.compensate([torch.zeros(2, 2)])
    with pytest.raises(ValueError):
        feedback.compensate([torch.zeros(3), torch.zeros(3)])
    with pytest.raises(ValueError):
        feedback.update([torch.zeros(4)], [torch.zeros(4)])
    torch.testing.assert_close(feedback.compensate([torch.zeros(3)])[0], torch.ones(3))
    feedback.reset()
    assert feedback.compensate([torch.zeros(4)])[0].shape == (4,)


def test_error_feedback_state_dict_round_trip() -> None:
    feedback = ErrorFeedback()
    assert feedback.state_dict() == {"residuals": []}
    tensors = [_gaussian((5, 4), 9), _gaussian((3,), 10)]
    compensated = feedback.compensate(tensors)
    feedback.update(compensated, [roundtrip(tensor, "int8") for tensor in compensated])
    state = feedback.state_dict()

    restored = ErrorFeedback()
    restored.load_state_dict(state)
    for expected, actual in zip(feedback.compensate(tensors), restored.compensate(tensors)):
        assert torch.equal(expected, actual)
    state["residuals"][0].zero_()  # the saved state is a copy
    assert torch.equal(feedback.compensate(tensors)[0], restored.compensate(tensors)[0])

    empty = ErrorFeedback()
    empty.load_state_dict({"residuals": []})
    assert torch.equal(empty.compensate(tensors)[0], tensors[0])
    with pytest.raises(ValueError):
        empty.load_state_dict({"residuals": [1.0]})
    with pytest.raises(ValueError):
        empty.load_state_dict({})
