"""The type checker passes over the library, the laboratory, the entry scripts and the in-memory fakes (which must
satisfy the protocols the learning unit is typed against: Averager, StateService, ProgressRecords)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_passes_with_the_project_settings() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
