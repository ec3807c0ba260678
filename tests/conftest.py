import os
import sys
from pathlib import Path

# Multi-process tests import worker functions from tests/workers.py by module name.
sys.path.insert(0, str(Path(__file__).parent))

# A checkout that sits beside a shared/data folder of corpora uses it, as if LOCALCLIP_DATA
# pointed there (set before shared_data.py resolves the data root the way the CLI does).
_beside = Path(__file__).resolve().parents[2] / "shared" / "data"
if not os.environ.get("LOCALCLIP_DATA") and _beside.is_dir():
    os.environ["LOCALCLIP_DATA"] = str(_beside)
