"""One home for trust policy (p2p_diloco/trust.py): every threshold that judges a peer is named there once, in the
table with the attack it bounds and an existing measurement or test, nowhere else in the package, and in the security
page; the one test of a believable change."""

from __future__ import annotations

import re
from pathlib import Path

from p2p_diloco import trust

ROOT = Path(__file__).resolve().parents[1]
CONSTANTS = {name: value for name, value in vars(trust).items() if name.isupper() and isinstance(value, int | float)}


def test_every_threshold_is_in_the_table_once_with_its_value_an_attack_and_what_set_it() -> None:
    table = {threshold.name: threshold for threshold in trust.THRESHOLDS}
    assert len(table) == len(trust.THRESHOLDS) and table.keys() == CONSTANTS.keys()
    for name, threshold in table.items():
        assert threshold.value == CONSTANTS[name] and threshold.attack and threshold.set_by
        cited = re.findall(r"(?:tests|results)/[\w/.-]*\w", threshold.set_by)
        assert cited and all((ROOT / path).exists() for path in cited), f"{name} cites {cited}"


def test_no_other_module_of_the_package_sets_a_threshold_of_trust() -> None:
    assigned = re.compile(rf"^\s*({'|'.join(CONSTANTS)})\s*=", re.M)
    elsewhere = [path for path in (ROOT / "p2p_diloco").rglob("*.py")
                 if path.name != "trust.py" and assigned.search(path.read_text())]  # fmt: skip
    assert elsewhere == []


def test_the_security_page_names_every_threshold() -> None:
    page = (ROOT / "docs" / "security.md").read_text()
    assert [name for name in CONSTANTS if name not in page] == []


def test_a_change_is_believable_within_its_factor_and_anything_is_before_a_reference() -> None:
    assert trust.within(3.0, 1.0, 3.0) and not trust.within(3.1, 1.0, 3.0)
    assert trust.within(1e9, 0.0, 3.0), "no reference yet: nothing to compare with"
    assert not trust.within(float("inf"), 1.0, 3.0)
