"""Compression of the averaged tensors on the wire: which hivemind codec each name means and what it loses.

What is compressed. ``hivemind.DecentralizedAverager(compression=...)`` splits every averaged tensor into flat
parts of at most ``part_size_bytes`` after compression (2**19 by default: 131072 fp32, 262144 fp16 or 524288
int8 values) and each group member reduces a shard of the parts. A member compresses every part it sends to
another member; that reducer replies with ``average − decoded part`` compressed with the same codec, and the
sender adds the decoded reply to its own *uncompressed* part. Parts of a member's own shard are never
compressed. So the members' results differ from each other by their own codec errors, not only from the exact
mean: a compressed round leaves the group in disagreement (2 peers, 1M Gaussian floats: relative L2 distance
between their results 2.8e-2 with int8, 3.6e-4 with fp16, 5e-8 with fp32). Codec errors scale with the spread of
the values sent, so send pseudo-gradients, not parameters: int8 on outer-step proposals φ − lr·Δ made each peer's
error 29% of the norm of the averaged update (fp16: 0.4%).

Only hivemind's registered codecs can go on the wire: the receiver decodes a part by its
``runtime_pb2.CompressionType`` through hivemind's built-in table (hivemind/compression/serialization.py). That
enum holds NONE, FLOAT16, MEANSTD_16BIT, UNIFORM_8BIT, QUANTILE_8BIT and BLOCKWISE_8BIT (the last needs
bitsandbytes). There is no 4-bit type, and a new one would mean changing hivemind's protobuf on every peer, so
no 4-bit codec is offered.

Bounds, for a tensor sent as one flat part (``error_bound`` gives them per element; the tests check them):

* ``fp32`` (NoCompression): exact.
* ``fp16`` (ScaledFloat16Compression): |error| ≤ 2**-11·|x − m| + 2**-25·s (+ fp32 rounding), m and s being the
  part's mean and root-mean-square deviation. No overflow or underflow at any magnitude.
* ``int8`` (Uniform8BitQuantization): |error| ≤ 6·std/256 + 2**-12·|x| for elements within about ±2.95 std of
  the part's mean (the second term is fp32 rounding; it matters only when |mean| ≫ std); elements outside are
  clipped to the edge buckets and have no bound, and one outlier inflates the std, hence every element's step.
  On Gaussian data of at least 10**4 elements the relative L2 error is at most :data:`INT8_GAUSSIAN_REL_L2`
  (measured: about 0.016 at 10**5–10**6 elements, at most 0.0244 over 500 draws of 10**4; a few extreme values
  dominate smaller tensors).
"""

from __future__ import annotations

import math

import torch
from hivemind.compression import (
    CompressionBase,
    NoCompression,
    ScaledFloat16Compression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)

from p2p_diloco.config import CODECS, Codec

INT8_GAUSSIAN_REL_L2 = 0.03
"""Bound on ‖roundtrip(x) − x‖ / ‖x‖ for int8 and Gaussian x of ≥ 10**4 elements (measured, see module doc)."""

_INT8_BUCKETS = 256
_INT8_INTERIOR = 126  # |x − mean| ≤ 126·step keeps x out of the two edge buckets, which also hold clipped values
_INT8_ROUNDING = 2.0**-12  # hivemind's fp32 bucket means (sums of uncentered values) lose up to ~2**-14·|x|
_FP32_EPS = torch.finfo(torch.float32).eps


def hivemind_compression(codec: Codec) -> CompressionBase:
    """The hivemind codec for ``codec``, to pass as ``DecentralizedAverager(compression=...)``.

    * fp32 → ``NoCompression``.
    * fp16 → ``ScaledFloat16Compression``, not ``Float16Compression``: it sends (x − m) / s in float16 with the
      part's mean m and deviation s in float32 (8 bytes more per part), so the error is relative to the values'
      spread at any magnitude. Plain float16 flushes values below 2**-24 to zero and loses relative precision
      below 2**-14 (measured relative L2 error on N(0, σ²): 2.1e-4 at σ = 1e-2, 1.7e-2 at σ = 1e-6, 0.99 at
      σ = 1e-8; scaled: 2.1e-4 at every σ). Small pseudo-gradients and the reducers' replies (differences
      between members) live at such magnitudes.
    * int8 → ``Uniform8BitQuantization`` rather than ``Quantile8BitQuantization``: on 1M Gaussian floats its
      relative L2 error is 0.016 against 0.026 and it costs 2–5 ms of CPU to encode against 90–110 ms; Quantile is
      better only on heavy tails (Laplace: 0.063 against 0.087). It calls ``torch.quantize_per_tensor``, which
      torch 2.13 deprecates (a UserWarning per call).

    Raises ValueError for an unknown codec name.
    """
    if codec == "fp32":
        return NoCompression()
    if codec == "fp16":
        return ScaledFloat16Compression()
    if codec == "int8":
        return Uniform8BitQuantization()
    raise ValueError(f"unknown codec {codec!r}, expected one of {CODECS}")


def roundtrip(tensor: torch.Tensor, codec: Codec) -> torch.Tensor:
    """What a receiver decodes for ``tensor`` sent as one part: an fp32 CPU tensor of ``tensor``'s shape.

    Like the averager, the tensor is sent flat in fp32. Raises ValueError for an unknown codec; hivemind's int8
    codec raises (ValueError or IndexError) for an empty tensor.
    """
    flat = _flat_fp32(tensor)
    decoded = deserialize_torch_tensor(serialize_torch_tensor(flat, hivemind_compression(codec).compression_type))
    return decoded.reshape(tensor.shape)


def serialized_bytes(tensor: torch.Tensor, codec: Codec) -> int:
    """Bytes of ``tensor`` sent as one part: the size of hivemind's protobuf message, before transport framing."""
    return serialize_torch_tensor(_flat_fp32(tensor), hivemind_compression(codec).compression_type).ByteSize()


def error_bound(tensor: torch.Tensor, codec: Codec) -> torch.Tensor:
    """Per-element bound on |roundtrip(tensor, codec) − tensor|, fp32 of ``tensor``'s shape; ``inf`` where the
    codec guarantees nothing (int8 elements in or beyond the clipping buckets).

    The fp32 rounding allowances are analysed for fp16 and measured for int8 (hivemind averages fp32 sums of
    uncentered values per bucket, which costs up to ~2**-14·|x| when |mean| ≫ std). Raises ValueError for an
    unknown codec.
    """
    hivemind_compression(codec)  # validates the name
    flat = _flat_fp32(tensor)
    if codec == "fp32":
        bound = torch.zeros_like(flat)
    elif codec == "fp16":
        bound = _scaled_fp16_bound(flat)
    else:
        bound = _uniform_int8_bound(flat)
    return bound.reshape(tensor.shape)


def _scaled_fp16_bound(flat: torch.Tensor) -> torch.Tensor:
    """z = (x − m) / s is cast to float16: relative error 2**-11 when normal, absolute 2**-25 when subnormal;
    |z| ≤ √n never overflows. Decoding computes z·s + m in fp32 (a few 2**-24 rounding errors)."""
    if flat.numel() == 0:
        return flat.clone()
    mean = flat.mean()
    deviation = flat - mean
    spread = (deviation.norm() / math.sqrt(flat.numel())).clamp_min(_FP32_EPS)
    return (2.0**-11 + 2.0**-21) * deviation.abs() + 2.0**-25 * spread + 2.0**-22 * (flat.abs() + mean.abs())


def _uniform_int8_bound(flat: torch.Tensor) -> torch.Tensor:
    """hivemind centres by the mean, quantizes with step 6·std/256 (std unbiased) around bucket 128, clamps to
    buckets 0..255 and decodes each bucket to the mean of its members. An interior bucket spans one step, so its
    members decode within one step; the edge buckets also hold the clipped values and their mean can be anywhere.
    Equal values (one element included) share a bucket and decode to their fp32 mean."""
    if flat.numel() == 0:
        return flat.clone()
    deviation = flat - flat.mean()
    if flat.numel() < 2 or not bool(deviation.any()):
        return _INT8_ROUNDING * flat.abs()
    std = float(deviation.norm()) / math.sqrt(flat.numel() - 1)
    step = Uniform8BitQuantization.RANGE_IN_SIGMAS * std / _INT8_BUCKETS
    bound = step + _INT8_ROUNDING * (flat.abs() + step)
    return torch.where(deviation.abs() <= _INT8_INTERIOR * step, bound, torch.full_like(flat, math.inf))


def _flat_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
