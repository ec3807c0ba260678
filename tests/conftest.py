import sys
from pathlib import Path

# Multi-process tests import worker functions from tests/workers.py by module name.
sys.path.insert(0, str(Path(__file__).parent))
