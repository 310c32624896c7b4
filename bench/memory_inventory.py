"""Every model-sized copy a learning unit holds, read from the code, in bytes per trained parameter (pure arithmetic).

``N`` trained parameters; θ, its gradients and AdamW's moments are in the weights' dtype (``weight_bytes``: 4 for the
default ``--dtype float32``); everything the round engine, the averagers and the state server hold is fp32 (4 bytes).
``s`` = min(1, max_in_flight / P) is the largest share of the weights in flight at once (P fragments, staggered).

Lifetimes: ``persistent`` (held from start-up, or from the first step or round, to the exit), ``in flight`` (while a
fragment round is in flight: about half of every period with the default matchmaking window), ``momentary`` (inside
one call, freed when it returns; glibc may keep the freed pages resident), ``exit`` (from the final rounds on), and
``not alone`` (paths a lone unit never takes: group all-reduces, state downloads, export with --save-dir).

hivemind's DHT and every averager run in processes forked from the unit's main process (lifecycle.py:
ensure_fork_start_method), one after the other. A child shares the main process's pages copy-on-write, so every page
the main process rewrites afterwards, and every freed heap page it reuses, would become the child's own (measured for
SmolLM2, P=1, fp32, before unit/forking.py: 33 B/param private in the three children). forking.py hands the freed pages
back to the system before each fork and drops the unit's tensors from each child right after it, so the children keep
no model-sized pages: what they hold is their own heap (measured: 2-8 B/param for all of them on SmolLM2, about 100
MiB each on the tiny model). The shared buffers are mapped by the main process and the child: counted once (a lone
unit's children never touch them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from p2p_diloco.rounds.plan import RoundPlan
from p2p_diloco.streaming import Payload

FP32 = 4
LIFETIMES = ("persistent", "in flight", "momentary", "exit", "not alone")


@dataclass(frozen=True)
class Copy:
    """One model-sized copy: ``bytes_per_param`` (per trained parameter) held in ``process`` for ``lifetime``,
    made at ``source`` (file:function); ``bare``: the bare training loop holds it too."""

    what: str
    process: str
    lifetime: str
    bytes_per_param: float
    source: str
    bare: bool = False


def forked_children(plan: RoundPlan) -> int:
    """hivemind processes forked while training: the DHT, one averager per fragment (two with consensus rounds) and
    the state server (the settle averager at exit comes on top)."""
    fragments = len(plan.fragments)
    return 1 + fragments * (2 if plan.consensus else 1) + 1


def in_flight_share(plan: RoundPlan) -> float:
    """``s``: the largest share of the trained parameters whose rounds are in flight at once."""
    return min(1.0, plan.max_in_flight / len(plan.fragments))


def inventory(plan: RoundPlan, weight_bytes: int = FP32) -> list[Copy]:
    """The copies a unit of ``plan`` holds (see the module docstring), the bare loop's first."""
    lossy = plan.step.payload is Payload.PSEUDO_GRADIENT
    s = in_flight_share(plan)
    children = forked_children(plan)
    m = 1 if plan.keeps_momentum else 0  # at outer momentum 0 no m exists anywhere (rounds/engine.py)
    own_momentum = 1 if plan.step.payload is Payload.PROPOSAL else 0
    return [
        Copy("θ (the model's parameters)", "main", "persistent", weight_bytes, "unit/model.py:load_model", bare=True),
        Copy("gradients of θ", "main", "momentary", weight_bytes,
             "unit/inner.py:InnerTrainer.train_step (backward; zero_grad(set_to_none) frees them)", bare=True),
        Copy("AdamW exp_avg and exp_avg_sq", "main", "persistent", 2 * weight_bytes,
             "unit/inner.py:InnerTrainer.__init__ (torch.optim.AdamW, allocated at the first step)", bare=True),
        Copy("φ (global parameters)", "main", "persistent", FP32, "rounds/state.py:OuterState.__init__ (copy of θ)"),
        Copy("m (outer momentum; none at momentum 0)", "main", "persistent", FP32 * m,
             "rounds/state.py:OuterState._kept_momentum (zeros_like φ)"),
        Copy(f"fragment-round averagers' buffers ({plan.step.payload.copies}× the fragments, P={len(plan.fragments)})",
             "shared memory: main + each averager", "persistent", FP32 * plan.step.payload.copies,
             "network/averaging.py:OuterAverager.__init__ (zeros_like of rounds/plan.py:RoundPlan.round_templates; "
             "hivemind DecentralizedAverager.__init__: share_memory_)"),
        Copy(f"fragment-round averagers' references (the payload of a unit that trained nothing, for judging members' "
             f"directions; {plan.step.payload.copies}× the fragments)", "shared memory: main + each averager",
             "persistent", FP32 * plan.step.payload.copies,
             "network/reducer.py:RoundReference ← network/averaging.py:OuterAverager.__init__ (directed)"),
        Copy("consensus averagers' buffers (φ_p flat per fragment)", "shared memory: main + each consensus averager",
             "persistent", FP32 if plan.consensus else 0.0,
             "peer.py:run_peer ← rounds/plan.py:RoundPlan.consensus_templates (lossy codecs only)"),
        Copy("state server's served copy (φ, and m)", "shared memory: main + the state server", "persistent",
             FP32 * (1 + m),
             "network/state_sync.py:StateServer.__init__ (buffers), StateServer.publish (copy_ into them)"),
        Copy("error-feedback residuals", "main", "persistent", FP32 if plan.step.error_feedback else 0.0,
             "streaming.py:ErrorFeedback.update ← streaming.py:FragmentRounds.mark_sent (lossy codecs)"),
        Copy(f"the main process's pages inherited at each fork: θ, AdamW state, φ, m, freed buffer templates "
             f"({children} children: DHT, averagers, state server)", "each forked child", "persistent", 0.0,
             "unit/forking.py:dropped_in_forked_children (malloc_trim before the fork, MADV_DONTNEED in the child) ← "
             "peer.py:unit_in_swarm"),
        Copy("θ_p at send", "main", "in flight", FP32 * s,
             "rounds/kinds.py:FragmentRound.begin (rounds/state.py:OuterState.read_local)"),
        Copy("own m'_p (the merge's m without sync_momentum)", "main", "in flight", FP32 * s * m * own_momentum,
             "streaming.py:FragmentRounds.payload, held by streaming.py:SentRound.momentum_proposal (the payload "
             "itself is only in the averager's buffer: an alone round reads it back, network/averaging.py:"
             "OuterAverager._buffers)"),
        Copy("payload: Δ_p" + (" stepped into φ'_p in place" if not (m or lossy) else ", φ'_p, m_p copy and m'_p"
                                if not lossy else ", the unused proposal" + (", m_p copy and m'_p" if m else "")),
             "main", "momentary", FP32 * s * (1 if not (m or lossy) else 2 + 2 * m),
             "streaming.py:FragmentRounds.payload (φ_p read in place; diloco.py:pseudo_gradient, step_in_place, "
             "outer_step)"),
        Copy("reference: φ_p itself at momentum 0 (views), else the outer step on a zero Δ_p" + (
             " (zeros, lossy)" if lossy else ""), "main", "momentary", FP32 * s * (1 if lossy else 3 * m),
             "streaming.py:FragmentRounds.reference"),
        Copy("decoded payload (lossy: what receivers decode, to update the residuals)", "main", "momentary",
             FP32 * s if plan.step.error_feedback else 0.0,
             "streaming.py:FragmentRounds.mark_sent (network/compression.py:roundtrip)"),
        Copy("merge: θ_p one piece at a time (the average read in the averager's buffers)" + (
             ", the outer step's φ_p, m_p" if lossy else ""),
             "main", "momentary", FP32 * s * (1 + m) if lossy else 0.0,
             "rounds/kinds.py:FragmentRound.end, rounds/state.py:OuterState.merge (diloco.py:merge_local_progress)"),
        Copy("eval: φ converted to θ's dtype (none in fp32: φ is swapped in)", "main", "momentary",
             0.0 if weight_bytes == FP32 else weight_bytes,
             "unit/inner.py:InnerTrainer.parameters_swapped ← unit/unit.py:LearningUnit._evaluate"),
        Copy("checkpoint: θ on the host in fp32 (none for a CPU fp32 θ; φ, m, AdamW state by reference; hashed in "
             "place; torch.save streams to the page cache)", "main", "momentary",
             0.0 if weight_bytes == FP32 else FP32,
             "unit/unit.py:LearningUnit.save (unit/inner.py:on_host), checkpoint.py:save_checkpoint, payload_digest"),
        Copy("settle averager's buffer (φ in its shapes), once the round averagers' buffers were freed",
             "shared memory: main + a new child", "exit", FP32,
             "peer.py:_settle_averager ← rounds/departure.py:Departure._start_settle_averager "
             "(network/averaging.py:OuterAverager.shutdown frees the others')"),
        Copy("settle payload: φ itself (views)", "main", "exit", 0.0, "rounds/kinds.py:Settle.payload"),
        Copy("the main process's pages inherited by the settle averager (forked at exit from the whole main "
             "process)", "the settle averager", "exit", 0.0,
             "unit/forking.py:dropped_in_forked_children ← peer.py:_settle_averager, "
             "rounds/departure.py:Departure.leave"),
        Copy("a correction round's end: mean − sent (consensus rounds; settle rounds at exit)", "main", "momentary",
             FP32 * s if plan.consensus else 0.0, "rounds/kinds.py:CorrectionRound.end"),
        Copy("all-reduce: one averaged tensor at a time and per-part buffers", "each averager", "not alone",
             0.0, "hivemind averaging/partition.py:TensorPartContainer.iterate_output_tensors (torch.cat per tensor)"),
        Copy("serving a joiner: a snapshot of φ (and m)", "the state server", "not alone", FP32 * (1 + m),
             "network/state_sync.py:_SnapshotAverager.get_current_state (clone)"),
        Copy("joining by download: φ (and m) through the pipe, then validated clones", "main", "not alone",
             2 * FP32 * (1 + m),
             "network/state_sync.py:_SnapshotAverager.fetch_state, StateServer._validated"),
        Copy("export with --save-dir: φ converted to θ's dtype (none in fp32; safetensors writes from the tensors)",
             "main", "not alone", 0.0 if weight_bytes == FP32 else weight_bytes,
             "unit/unit.py:LearningUnit.finish → unit/model.py:export_pretrained"),
    ]  # fmt: skip


def predicted(copies: list[Copy]) -> dict[str, float]:
    """Bytes per parameter the unit adds to the bare loop: ``persistent`` (unit-only persistent copies),
    ``in_flight`` (held while a round is in flight), ``momentary`` (the largest single momentary copy beyond the bare
    loop's), ``peak_low`` = persistent + in flight, ``peak_high`` = that + momentary."""
    own = [copy for copy in copies if not copy.bare]
    persistent = sum(copy.bytes_per_param for copy in own if copy.lifetime == "persistent")
    in_flight = sum(copy.bytes_per_param for copy in own if copy.lifetime == "in flight")
    momentary = max((copy.bytes_per_param for copy in own if copy.lifetime == "momentary"), default=0.0)
    return {"persistent": persistent, "in_flight": in_flight, "momentary": momentary,
            "peak_low": persistent + in_flight, "peak_high": persistent + in_flight + momentary}  # fmt: skip


def as_json(copies: list[Copy]) -> list[dict[str, Any]]:
    return [asdict(copy) for copy in copies]
