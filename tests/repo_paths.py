"""Where the repository's files are, for tests in any folder of ``tests/`` (they mirror ``liver/``, so a
test's own path says nothing about the repository's root)."""

from __future__ import annotations

from pathlib import Path
from typing import Final

REPO: Final = Path(__file__).resolve().parent.parent
EXAMPLES: Final = REPO / "examples"
TEST_DATA: Final = REPO / "tests" / "data"
