"""Tests never reach a model or dataset hub: everything loads from the files shipped with the project."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from unit_peers import make_peer  # noqa: E402,F401  (the fixture, shared by the unit test modules)
