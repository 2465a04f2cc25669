import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402


def pytest_terminal_summary(terminalreporter):
    if harness.NOTES:
        terminalreporter.section("plait measurements")
        for line in harness.NOTES:
            terminalreporter.write_line(line)
