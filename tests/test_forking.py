"""The fork hooks of forking.py: a forked child drops its copy of the registered private tensors and keeps the shared
ones; the parent's tensors are untouched; leaving the context stops the dropping."""

from __future__ import annotations

import ctypes.util
import multiprocessing
import multiprocessing.connection
import platform

import pytest
import torch

from p2p_diloco.unit.forking import dropped_in_forked_children

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or ctypes.util.find_library("c") is None,
    reason="the hooks act on glibc Linux only",
)
SIZE = 1 << 20  # 4 MiB of float32: many whole pages


def _child_sums(private: torch.Tensor, shared: torch.Tensor) -> tuple[float, float]:
    context = multiprocessing.get_context("fork")
    parent_end, child_end = context.Pipe()
    child = context.Process(target=_report_sums, args=(child_end, private, shared))
    child.start()
    sums = parent_end.recv()
    child.join(timeout=30)
    assert child.exitcode == 0
    return sums


def _report_sums(
    connection: multiprocessing.connection.Connection, private: torch.Tensor, shared: torch.Tensor
) -> None:
    # numpy, not torch: torch's thread pool is not usable in a forked child
    connection.send((float(private.numpy()[1024:-1024].sum()), float(shared.numpy().sum())))


def test_a_forked_child_drops_the_private_tensors_and_keeps_the_shared_ones() -> None:
    private = torch.ones(SIZE)
    shared = torch.ones(SIZE).share_memory_()
    with dropped_in_forked_children(lambda: [private, None, shared]):
        private_in_child, shared_in_child = _child_sums(private, shared)
    assert private_in_child == 0.0  # its pages were dropped: the child reads zeros
    assert shared_in_child == SIZE
    assert float(private.sum()) == SIZE  # the parent's memory is untouched


def test_after_the_context_a_child_keeps_its_copy() -> None:
    private = torch.ones(SIZE)
    with dropped_in_forked_children(lambda: [private]):
        pass
    private_in_child, _ = _child_sums(private, torch.ones(1).share_memory_())
    assert private_in_child == SIZE - 2048
