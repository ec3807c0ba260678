"""The tests' own output stays inside pytest's capture: a passing run prints only pytest's lines."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Ways around the capture: switching it off, or writing to the terminal's own descriptors.
AROUND = re.compile(r"\b(capsys|capfd)\.disabled\(\)|sys\.__(stdout|stderr)__|/dev/tty")


def test_no_test_writes_around_the_capture():
    offenders = [f"{path.relative_to(TESTS)}:{n}: {line.strip()}"
                 for path in sorted(TESTS.rglob("*.py")) if path != Path(__file__).resolve()
                 for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if AROUND.search(line)]
    assert offenders == [], "\n".join(offenders)
