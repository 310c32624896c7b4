"""Chaos experiments: seeded fault schedules applied to real processes, for our swarm and for baselines."""
