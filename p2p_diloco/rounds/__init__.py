"""A learning unit's outer rounds, torch only (a test checks that importing any of it imports neither hivemind nor
transformers). A new kind of round or schedule is a new small file here, not more methods on the engine.

* plan.py: the round plan derived once from ``[outer]``, and the key schema (where units meet and share state);
* averager.py: the seam to the network, the ``Averager`` protocol and the ``RoundOutcome`` it returns;
* state.py: the outer state (φ, m, every fragment's round bookkeeping, the link to θ) and its one ``shift``;
* kinds.py: a fragment round, and the correction rounds (consensus, mix, settle) by what they carry;
* clock.py, schedule.py: when rounds are due (own steps, or boundaries of shared time);
* engine.py: the engine that asks the schedule and the kinds, with one store of the rounds in flight;
* results.py: what the engine returns;
* departure.py: the exit protocol, in order, against a census of the run.
"""
