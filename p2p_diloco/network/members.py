"""What a round's members told each other, read as a stranger's words.

Every member of a hivemind group sends a ``gather`` value (see ``OuterAverager.begin_round``): its outer round, token
weight, consensus probe, tag and clock period. Another member's gather is msgpack from a peer we do not trust, so
:func:`read_member` turns it into a :class:`MemberInfo` whose every field is valid, whatever was sent:

* a value of the wrong type, non-finite or out of range is replaced by "not stated" (round -1, weight 0, no probe,
  tag "", period 0) and noted in ``problems``: nothing a member sends can raise in the reader's process;
* a round more than :data:`MAX_ROUND_LEAD` ahead of the reader's own is not believed (the reader's counter would
  otherwise jump to it: ``max(rounds) + 1``); honest members of a group are at most a few rounds apart, since every
  unit advances one round per round it completes, alone or not, and a joiner takes the swarm's counters;
* a probe must have the reader's probe length (the same architecture and fragment) and finite values.

What this does not bound: the weight and the tensors a member contributes to the all-reduce itself (hivemind applies
them inside its averager process).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from p2p_diloco.trust import MAX_ROUND_LEAD

MAX_TAG_CHARS = 64


@dataclass(frozen=True)
class MemberInfo:
    """One member's validated gather (see the module docstring); ``problems`` says what was not believed."""

    outer_round: int = -1
    weight: float = 0.0
    probe: tuple[float, ...] = ()
    tag: str = ""
    period: float = 0.0
    problems: tuple[str, ...] = ()


def read_member(value: object, own_round: int, probe_length: int) -> MemberInfo:
    """The member's gather ``value`` as seen by a unit at outer round ``own_round`` whose probes have
    ``probe_length`` values. Never raises."""
    if not isinstance(value, dict):
        return MemberInfo(problems=(f"gather is a {type(value).__name__}, not a mapping",))
    problems: list[str] = []
    outer_round = _round(value.get("outer_round"), own_round, problems)
    weight = _non_negative(value.get("weight"), "weight", problems)
    probe = _probe(value.get("probe"), probe_length, problems)
    tag = value.get("tag", "")
    if not isinstance(tag, str) or len(tag) > MAX_TAG_CHARS:
        problems.append("tag is not a short string")
        tag = ""
    period = _non_negative(value.get("period"), "period", problems)
    return MemberInfo(outer_round, weight, probe, tag, period, tuple(problems))


def _round(value: object, own_round: int, problems: list[str]) -> int:
    if value is None:
        return -1
    number = _number(value)
    if number is None or not number.is_integer() or number < 0:
        problems.append(f"outer round {value!r} is not a round number")
        return -1
    if number > own_round + MAX_ROUND_LEAD:
        problems.append(f"outer round {value!r} is more than {MAX_ROUND_LEAD} ahead of ours ({own_round})")
        return -1
    return int(number)


def _non_negative(value: object, name: str, problems: list[str]) -> float:
    if value is None:
        return 0.0
    number = _number(value)
    if number is None or number < 0:
        problems.append(f"{name} {value!r} is not a finite number >= 0")
        return 0.0
    return number


def _probe(value: object, length: int, problems: list[str]) -> tuple[float, ...]:
    if value is None or value == []:
        return ()
    numbers = [_number(item) for item in value] if isinstance(value, list) and len(value) == length else []
    if not numbers or any(number is None for number in numbers):
        problems.append(f"probe is not {length} finite numbers")
        return ()
    return tuple(number for number in numbers if number is not None)


def _number(value: object) -> float | None:
    """``value`` as a float if it is an int within 64 bits or a finite float (not a bool), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return float(value) if abs(value) < 2**63 else None
    return value if isinstance(value, float) and math.isfinite(value) else None


def believed_rounds(claims: dict[str, int]) -> dict[str, int]:
    """The claims (peer → outer round, from records) not far ahead of the others: a round more than MAX_ROUND_LEAD
    above the lower median of all claims is not believed. One peer cannot move the lower median above every honest
    claim unless it holds half of the claims."""
    if not claims:
        return {}
    ceiling = statistics.median_low(claims.values()) + MAX_ROUND_LEAD
    return {peer: claimed for peer, claimed in claims.items() if claimed <= ceiling}
