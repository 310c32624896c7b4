"""The pure DiLoCo algorithm against hand-written references (no network)."""

from __future__ import annotations

import copy

import pytest
import torch

from p2p_diloco.diloco import (
    OuterHyperparams,
    Overlap,
    consensus_probe,
    consensus_probe_indices,
    merge_local_progress,
    outer_step,
    probe_drift,
    pseudo_gradient,
    radial_merge,
    radial_parts,
    step_in_place,
    weighted_average,
)

SHAPES = [(4, 3), (3,), (2, 2, 2)]


def _tensors(seed: int, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=dtype) for shape in SHAPES]


def _assert_lists_close(actual: list[torch.Tensor], expected: list[torch.Tensor], atol: float) -> None:
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected):
        torch.testing.assert_close(a, b, atol=atol, rtol=0.0)


@pytest.mark.parametrize(
    "lr, momentum, nesterov",
    [(0.7, 0.9, True), (0.7, 0.9, False), (0.3, 0.5, True), (0.3, 0.5, False), (1.0, 0.0, False)],
)
def test_outer_step_matches_torch_sgd_over_several_steps(lr: float, momentum: float, nesterov: bool) -> None:
    hyper = OuterHyperparams(lr=lr, momentum=momentum, nesterov=nesterov)
    reference = [torch.nn.Parameter(tensor.clone()) for tensor in _tensors(0)]
    sgd = torch.optim.SGD(reference, lr=lr, momentum=momentum, nesterov=nesterov)
    phi = _tensors(0)
    m = [torch.zeros_like(tensor) for tensor in phi]
    for step in range(5):
        delta = _tensors(100 + step)
        for parameter, grad in zip(reference, delta):
            parameter.grad = grad.clone()
        sgd.step()
        phi, m = outer_step(phi, m, delta, hyper)
        _assert_lists_close(phi, [parameter.detach() for parameter in reference], atol=1e-13)
        if momentum:
            _assert_lists_close(m, [sgd.state[parameter]["momentum_buffer"] for parameter in reference], atol=1e-13)


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_at_momentum_zero_needs_no_momentum(nesterov: bool) -> None:
    """μ = 0: no momentum in, none out, and φ' as with a zero momentum; at μ > 0 a missing momentum is an error."""
    phi, delta = _tensors(1), _tensors(3)
    hyper = OuterHyperparams(lr=0.7, momentum=0.0, nesterov=nesterov)
    new_phi, new_m = outer_step(phi, [], delta, hyper)
    assert new_m == []
    _assert_lists_close(new_phi, outer_step(phi, [torch.zeros_like(t) for t in phi], delta, hyper)[0], atol=0.0)
    with pytest.raises(ValueError, match="differ in length"):
        outer_step(phi, [], delta, OuterHyperparams(lr=0.7, momentum=0.9, nesterov=nesterov))


@pytest.mark.parametrize("lr", [1.0, 0.7])
def test_the_in_place_step_equals_the_outer_step_bit_for_bit(lr: float) -> None:
    """A round's payload at μ = 0 is stepped in the pseudo-gradient's memory: the same bits as outer_step's."""
    phi, delta = _tensors(1), _tensors(3)
    expected, _ = outer_step(phi, [], delta, OuterHyperparams(lr=lr, momentum=0.0, nesterov=False))
    stepped = step_in_place(phi, delta, lr)
    assert all(a is b for a, b in zip(stepped, delta))
    assert all(torch.equal(a, b) for a, b in zip(stepped, expected))


def test_outer_step_does_not_modify_inputs() -> None:
    phi, m, delta = _tensors(1), _tensors(2), _tensors(3)
    copies = [[t.clone() for t in tensors] for tensors in (phi, m, delta)]
    outer_step(phi, m, delta, OuterHyperparams(lr=0.7, momentum=0.9, nesterov=True))
    for original, copied in zip((phi, m, delta), copies):
        _assert_lists_close(original, copied, atol=0.0)


@pytest.mark.parametrize("nesterov", [True, False])
def test_average_of_proposals_equals_outer_step_on_average_pseudo_gradient(nesterov: bool) -> None:
    hyper = OuterHyperparams(lr=0.7, momentum=0.9, nesterov=nesterov)
    phi, m = _tensors(10), _tensors(11)
    deltas = [_tensors(20 + unit) for unit in range(4)]
    weights = [1000.0, 250.0, 4096.0, 1.0]
    proposals = [outer_step(phi, m, delta, hyper) for delta in deltas]
    averaged_phi = weighted_average([proposal[0] for proposal in proposals], weights)
    averaged_m = weighted_average([proposal[1] for proposal in proposals], weights)
    expected_phi, expected_m = outer_step(phi, m, weighted_average(deltas, weights), hyper)
    _assert_lists_close(averaged_phi, expected_phi, atol=1e-12)
    _assert_lists_close(averaged_m, expected_m, atol=1e-12)


def _one_inner_sgd_step(model: torch.nn.Module, seed: int, lr: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    inputs = torch.randn(8, 5, generator=generator, dtype=dtype)
    targets = torch.randn(8, 2, generator=generator, dtype=dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()


def _diloco_vs_data_parallel(dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """H = 1, outer lr 1, momentum 0, one group of 3 equally weighted units: (DiLoCo φ_new, data-parallel φ_new)."""
    torch.manual_seed(0)
    initial = torch.nn.Linear(5, 2).to(dtype)
    phi = [parameter.detach().clone() for parameter in initial.parameters()]
    momentum = [torch.zeros_like(tensor) for tensor in phi]
    hyper = OuterHyperparams(lr=1.0, momentum=0.0, nesterov=False)
    units = [copy.deepcopy(initial) for _ in range(3)]
    for seed, unit in enumerate(units):
        _one_inner_sgd_step(unit, seed, lr=0.1)
    thetas = [[parameter.detach() for parameter in unit.parameters()] for unit in units]

    proposals = [outer_step(phi, momentum, pseudo_gradient(phi, theta), hyper)[0] for theta in thetas]
    diloco = weighted_average(proposals, [1.0, 1.0, 1.0])
    inner_updates = [[t - p for t, p in zip(theta, phi)] for theta in thetas]
    data_parallel = [p + sum(update[index] for update in inner_updates) / 3 for index, p in enumerate(phi)]
    return diloco, data_parallel


def test_h1_lr1_no_momentum_one_group_is_synchronous_data_parallel_fp64() -> None:
    diloco, data_parallel = _diloco_vs_data_parallel(torch.float64)
    _assert_lists_close(diloco, data_parallel, atol=1e-12)


def test_h1_lr1_no_momentum_one_group_is_synchronous_data_parallel_fp32() -> None:
    diloco, data_parallel = _diloco_vs_data_parallel(torch.float32)
    assert all(tensor.dtype == torch.float32 for tensor in diloco)
    for a, b in zip(diloco, data_parallel):
        torch.testing.assert_close(a, b)


def test_merge_without_overlap_is_the_new_global_params() -> None:
    new_global, theta = _tensors(30), _tensors(31)
    merged = merge_local_progress(new_global, theta, [t.clone() for t in theta])
    _assert_lists_close(merged, new_global, atol=0.0)


def test_merge_with_overlap_keeps_the_progress_made_meanwhile() -> None:
    new_global, sent = _tensors(40), _tensors(41)
    progress = _tensors(42)
    now = [s + p for s, p in zip(sent, progress)]
    merged = merge_local_progress(new_global, now, sent)
    _assert_lists_close(merged, [g + p for g, p in zip(new_global, progress)], atol=1e-12)


# One tensor of two coordinates, worked by hand: φ_old = (0, 0), the round's step u = φ_new − φ_old = (2, 0),
# θ_sent = (5, 5) and the steps made meanwhile d = θ_now − θ_sent = (−1, 3): opposing u by ⟨d, u⟩/‖u‖² = −0.5.
OLD, NEW, SENT, NOW = (
    [torch.tensor([0.0, 0.0])],
    [torch.tensor([2.0, 0.0])],
    [torch.tensor([5.0, 5.0])],
    [torch.tensor([4.0, 8.0])],
)


@pytest.mark.parametrize(
    ("overlap", "expected"),
    [
        (Overlap("keep"), [2.0 - 1.0, 0.0 + 3.0]),
        (Overlap("discount", 0.25), [2.0 - 0.25, 0.0 + 0.75]),
        (Overlap("align"), [2.0 + 0.0, 0.0 + 3.0]),  # d less (−0.5)·u = (−1, 3) + (1, 0)
        (Overlap("mix", 0.5), [0.5 * 4.0 + 0.5 * 2.0, 0.5 * 8.0 + 0.5 * 0.0]),
    ],
)
def test_each_overlap_rule_against_its_hand_computed_merge(overlap: Overlap, expected: list[float]) -> None:
    merged = merge_local_progress(NEW, NOW, SENT, overlap, OLD)
    torch.testing.assert_close(merged[0], torch.tensor(expected), rtol=0, atol=1e-6)


def test_align_keeps_steps_that_agree_with_the_round_and_every_rule_but_mix_is_synchronous_without_overlap() -> None:
    agreeing = [torch.tensor([7.0, 2.0])]  # d = (2, −3): ⟨d, u⟩ = 4 > 0, nothing removed
    assert merge_local_progress(NEW, agreeing, SENT, Overlap("align"), OLD)[0].tolist() == [4.0, -3.0]
    for rule in ("keep", "discount", "align"):
        assert merge_local_progress(NEW, SENT, SENT, Overlap(rule), OLD)[0].tolist() == NEW[0].tolist()
    with pytest.raises(ValueError):
        merge_local_progress(NEW, NOW, SENT, Overlap("align"))  # no φ_old to align against
    with pytest.raises(ValueError):
        Overlap("discount", 1.5)


def test_merge_keeps_local_dtype_and_device() -> None:
    new_global = _tensors(50, dtype=torch.float32)
    sent = [t.bfloat16() for t in _tensors(51, dtype=torch.float32)]
    now = [(t.float() + 0.5).bfloat16() for t in sent]
    merged = merge_local_progress(new_global, now, sent)
    assert [(t.dtype, t.device, t.shape) for t in merged] == [(t.dtype, t.device, t.shape) for t in now]
    expected = [(g + (n.float() - s.float())).bfloat16() for g, n, s in zip(new_global, now, sent)]
    _assert_lists_close(merged, expected, atol=0.0)


def test_pseudo_gradient_is_global_minus_local_in_global_dtype() -> None:
    phi = _tensors(60, dtype=torch.float32)
    theta = [t.bfloat16() for t in _tensors(61, dtype=torch.float32)]
    delta = pseudo_gradient(phi, theta)
    assert all(d.dtype == torch.float32 for d in delta)
    _assert_lists_close(delta, [p - t.float() for p, t in zip(phi, theta)], atol=0.0)


def test_pseudo_gradient_rejects_mismatched_lists() -> None:
    with pytest.raises(ValueError):
        pseudo_gradient(_tensors(0), _tensors(1)[:2])
    with pytest.raises(ValueError):
        pseudo_gradient(_tensors(0), [t.reshape(-1) for t in _tensors(1)])


@pytest.mark.parametrize(
    "proposals, weights",
    [
        ([], []),
        ([_tensors(0)], []),
        ([_tensors(0), _tensors(1)], [1.0]),
        ([_tensors(0), _tensors(1)], [0.0, 0.0]),
        ([_tensors(0), _tensors(1)], [2.0, -1.0]),
        ([_tensors(0), _tensors(1)[:2]], [1.0, 1.0]),
        ([_tensors(0), [t.reshape(-1) for t in _tensors(1)]], [1.0, 1.0]),
    ],
    ids=["empty", "no-weights", "too-few-weights", "zero-total", "negative", "length", "shape"],
)
def test_weighted_average_rejects_bad_input(proposals: list[list[torch.Tensor]], weights: list[float]) -> None:
    with pytest.raises(ValueError):
        weighted_average(proposals, weights)


def test_weighted_average_reference() -> None:
    a, b = _tensors(70), _tensors(71)
    averaged = weighted_average([a, b], [3.0, 1.0])
    _assert_lists_close(averaged, [0.75 * x + 0.25 * y for x, y in zip(a, b)], atol=1e-15)
    _assert_lists_close(weighted_average([a, b], [1.0, 0.0]), a, atol=0.0)


def test_consensus_probe_reads_fixed_coordinates() -> None:
    params = _tensors(90, dtype=torch.float32)
    indices = consensus_probe_indices(params, size=16)
    assert torch.equal(indices, consensus_probe_indices([t.clone() for t in params], size=16))
    flat = torch.cat([t.reshape(-1) for t in params])
    assert consensus_probe(params, indices) == flat[indices].tolist()
    assert len(consensus_probe_indices(params, size=10_000)) == flat.numel()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weighted_average_rejects_non_finite_weights(bad: float) -> None:
    with pytest.raises(ValueError):
        weighted_average([_tensors(0), _tensors(1)], [bad, 1.0])


def test_probe_drift_of_a_known_pair() -> None:
    assert probe_drift([[3.0, 4.0]]) == 0.0
    assert probe_drift([[3.0, 4.0], [3.0, 4.0]]) == 0.0
    assert probe_drift([[3.0, 4.0], [3.0, 5.0]]) == pytest.approx(1.0 / 34**0.5, rel=1e-12)


@pytest.mark.parametrize(
    "units",
    [2, 30],
)
def test_identical_probes_have_zero_drift(units: int) -> None:
    probe = (torch.randn(1024, generator=torch.Generator().manual_seed(0)) * 0.02 + 1.0).tolist()
    assert probe_drift([probe] * units) == 0.0


# ----------------------------------------------------------------------------- radial-directional averaging
def _rda(deltas: list[list[torch.Tensor]], weights: list[float], radial: list[bool]) -> list[torch.Tensor]:
    """The RDA merge of several members' Δ, as a group computes it: the weighted means of their parts."""
    parts = [radial_parts(delta, radial) for delta in deltas]
    directions = weighted_average([part[0] for part in parts], weights)
    (norms,) = weighted_average([[part[1]] for part in parts], weights)
    return radial_merge(directions, norms, radial)


def test_rda_equals_the_weighted_mean_when_every_pseudo_gradient_points_the_same_way() -> None:
    torch.manual_seed(0)
    direction = [torch.randn(5, 3), torch.randn(4), torch.randn(6, 2)]
    deltas = [[scale * tensor for tensor in direction] for scale in (0.5, 2.0, 3.0)]
    weights = [1.0, 3.0, 2.0]
    for merged, mean in zip(_rda(deltas, weights, [True, True, False]), weighted_average(deltas, weights)):
        torch.testing.assert_close(merged, mean)


def test_rda_keeps_the_mean_norm_where_the_mean_shrinks_and_leaves_mean_merged_tensors_alone() -> None:
    east, north = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    deltas = [[2 * east, 2 * east], [2 * north, 2 * north]]
    radial, plain = _rda(deltas, [1.0, 1.0], [True, False])
    torch.testing.assert_close(radial, torch.tensor([2.0, 2.0]) / 2**0.5)  # norm 2, the mean direction
    torch.testing.assert_close(plain, torch.tensor([1.0, 1.0]))  # the plain mean (norm √2)


def test_rda_of_zero_or_opposite_pseudo_gradients_is_zero_and_bad_flags_are_refused() -> None:
    zero, opposite = _rda([[torch.zeros(3)]], [1.0], [True]), _rda([[torch.ones(3)], [-torch.ones(3)]], [1.0, 1.0],
                                                                   [True])  # fmt: skip
    assert torch.equal(zero[0], torch.zeros(3)) and torch.equal(opposite[0], torch.zeros(3))
    with pytest.raises(ValueError, match="radial flags"):
        radial_parts([torch.ones(2)], [True, False])
