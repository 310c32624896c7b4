"""Every threshold by which a unit judges another peer, named once, with the attack it bounds and the measurement or
test that set it (:data:`THRESHOLDS`; the incidents behind them: results/security/README.md), and the one test of a
believable change (:func:`within`) that the averaging side (network/reducer.py) and the round side (rounds/kinds.py)
both apply. Pure Python: the torch-only rounds import it."""

from __future__ import annotations

from dataclasses import dataclass

# ---- inside the all-reduce: each unit reduces its slice with the bounded mean (robust.py)
CLIP_FACTOR = 2.0  # the clipping radius, in lower-median deviations from the coordinate-wise median
DROP_FACTOR = 2.0  # a part deviating more than this many radii is dropped
RADIUS_FLOOR = 1e-6  # the clipping radius is at least this fraction of the median's norm
WEIGHT_CAP = 2.0  # a claimed weight is capped at this many times the lower median weight
# ---- judging members (network/reducer.py, network/gated.py)
OFFENCE_RELATIVE = 10.0  # an offence: a part deviating, or an average returned, beyond this many times the reference
AGREEMENT_FLOOR = 0.0  # an offence: a member whose steps' mean cosine with this unit's steps is below this ...
DIRECTION_ROUNDS = 3  # ... over its last OFFENCE_WINDOW judged rounds, once at least this many were judged
DIRECTED_STEP_SHARE = 0.1  # a step is judged by direction only at this fraction of the median step's norm or more
MAX_OFFENCES = 3  # offences in a member's last OFFENCE_WINDOW rounds with an averager that get it refused
OFFENCE_WINDOW = 6
# ---- after a round (rounds/kinds.py)
MAX_STEP_RATIO = 30.0  # a round's average moves φ at most this many times the unit's own outer step
# ---- claims and states (network/members.py, network/state_sync.py)
MAX_ROUND_LEAD = 4  # a claimed outer round is believed at most this many rounds ahead
CORROBORATION_TOLERANCE = 0.05  # two downloaded states agree when their φ are this close, relative to ‖φ‖
MOMENTUM_NORM_RATIO = 4.0  # ... and their outer momenta's norms within this factor of each other
STATE_LOSS_RATIO = 1.5  # a downloaded state is refused when its held-out loss is over this × the live units' median
# (none reporting: this unit's own starting weights' loss)


@dataclass(frozen=True)
class Threshold:
    """One threshold: its name and value, the attack it bounds, and what set it."""

    name: str
    value: float
    attack: str
    set_by: str


THRESHOLDS = (
    Threshold(
        "CLIP_FACTOR",
        CLIP_FACTOR,
        "a member sending a scaled or noisy part: its deviation is clipped to the "
        "radius, so one member of three or more moves a slice by at most its capped weight share × radius",
        "tests/test_robust.py (reference mean, one of four); results/security: payload ×1000 −0.15%, noise "
        "+0.43%, sign flip ×3 +0.25% against honest-only runs spanning −2.6% to +1.9%",
    ),
    Threshold(
        "DROP_FACTOR",
        DROP_FACTOR,
        "a part far off (scaled, noise): dropped rather than clipped, 4 typical deviations from the median",
        "tests/test_robust.py; results/security (payload ×1000, noise)",
    ),
    Threshold(
        "RADIUS_FLOOR",
        RADIUS_FLOOR,
        "none: it keeps honest members that agree from being judged. When most parts are equal (units on one model "
        "averaging φ), the median deviation is 0 and a part off by fp32 rounding was dropped as infinitely far, "
        "and its sender counted as an offender, then refused",
        "results/scale clock-n8-g8 (grid layout): members refused at exit for parts 1.9e-9 of the median's norm "
        "away, an all-reduce left hanging 30 s; tests/test_robust.py",
    ),
    Threshold(
        "WEIGHT_CAP",
        WEIGHT_CAP,
        "a member claiming more tokens than it trained (weights are unverifiable)",
        "results/security: weight ×1000 −0.81%, its weight capped",
    ),
    Threshold(
        "OFFENCE_RELATIVE",
        OFFENCE_RELATIVE,
        "a member sending invalid or grossly off parts, or returning "
        "implausible averages as a reducer: an offence (a far part within it is none: counting those split the "
        "honest units)",
        "tests/test_averaging.py (offence rule over a whole slice: an honest member of more steps than the others in a "
        "swarm's first round is none; reducer replaced then refused); results/security: reducer ×1000 −1.09%",
    ),
    Threshold(
        "AGREEMENT_FLOOR",
        AGREEMENT_FLOOR,
        "a member sending its step flipped at honest length (inside every bound on size): its steps' mean cosine "
        "with this unit's over its last OFFENCE_WINDOW judged rounds falls below this, an offence every round after",
        "results/security/security.md (directions table); tests/test_averaging.py, tests/test_red_team.py (step-flip)",
    ),
    Threshold(
        "DIRECTION_ROUNDS",
        DIRECTION_ROUNDS,
        "one round's cosine is noise on small batches (honest rounds down to -0.08): a member is judged by direction "
        "only once this many of its rounds were",
        "tests/test_averaging.py (StepDirections); results/security/security.md (directions table)",
    ),
    Threshold(
        "DIRECTED_STEP_SHARE",
        DIRECTED_STEP_SHARE,
        "none: it keeps a unit that trained a few steps since its round (a final round at exit) from being judged by "
        "the direction of a step of noise (+0.00 once, before the rule)",
        "tests/test_averaging.py (a step a twentieth as long is not judged)",
    ),
    Threshold(
        "MAX_OFFENCES",
        MAX_OFFENCES,
        "a member that keeps offending: refused for the rest of the run by all of the unit's averagers",
        "tests/test_averaging.py (refused after MAX_OFFENCES in its window, only then)",
    ),
    Threshold(
        "OFFENCE_WINDOW",
        OFFENCE_WINDOW,
        "offences far apart never refuse a member; a pair with a member that "
        "offended in this window is left (a pair cannot bound it)",
        "tests/test_averaging.py (window, pair "
        "rule); tests/test_red_team.py noise variant (eval 6.8 → 18.6 in a pair before the rule)",
    ),
    Threshold(
        "MAX_STEP_RATIO",
        MAX_STEP_RATIO,
        "an average that would move φ far beyond the unit's own step (a "
        "member scaling its payload): rejected and carried",
        "results/quality/README.md (SmolLM2 restart and "
        "late join: a joiner's first round in warm-up moved φ 11.4×, honest rounds 0.8× at the median; ×1000 "
        "payloads 244× to 2,330×); tests/test_rounds.py (×1000 rejected, honest merged)",
    ),
    Threshold(
        "MAX_ROUND_LEAD",
        MAX_ROUND_LEAD,
        "a member or donor claiming a round far ahead, to make counters jump or joiners take its state",
        "tests/test_members.py, tests/test_state_sync.py; results/security: a round of 10^6 −0.33%, not believed",
    ),
    Threshold(
        "CORROBORATION_TOLERANCE",
        CORROBORATION_TOLERANCE,
        "a donor serving a poisoned state: a joiner takes a state only once a second donor's download agrees",
        "tests/test_state_sync.py (two donors outvote a fresher poisoned one); tests/test_red_team.py (joiner)",
    ),
    Threshold(
        "MOMENTUM_NORM_RATIO",
        MOMENTUM_NORM_RATIO,
        "a donor serving φ that agrees with a scaled outer momentum",
        "tests/test_state_sync.py (a scaled momentum is not corroborated)",
    ),
    Threshold(
        "STATE_LOSS_RATIO",
        STATE_LOSS_RATIO,
        "two identities serving the same forged state at a believable round (they corroborate each other), or one "
        "liar at a swarm's start: the joiner evaluates what it downloaded on its held-out batches and refuses a state "
        "whose loss is over this × the median eval loss the other live units' signed records report at its round or "
        "before (none reporting: this × its own starting weights' loss)",
        "issue 37: the joiner of such a pair evaluated 73.53 while the honest units reported 6.21 (11.8×); a lone "
        "liar's state 56.45 against starting weights' 8.348 (results/security/README.md); tests/test_unit_rounds.py",
    ),
)


def within(change: float, reference: float, factor: float) -> bool:
    """Whether ``change`` is at most ``factor`` × ``reference``, any change being believable while the reference is 0
    (nothing to compare with yet): how far a reducer's average moves what this unit sent (network/reducer.py) and how
    far a round's average moves φ against the unit's own step (rounds/kinds.py)."""
    return reference <= 0 or change <= factor * reference
