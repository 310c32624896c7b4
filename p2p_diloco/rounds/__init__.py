"""A learning unit's outer rounds, torch only (a test checks that importing any of it imports neither hivemind nor
transformers): the plan derived from ``[outer]`` and where units meet (plan.py), the round clock (clock.py), the
seam to the network (averager.py), the engine that runs the rounds (engine.py) and what it returns (results.py)."""
