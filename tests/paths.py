"""Where the repository and the test data are, for tests at any depth of tests/."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
