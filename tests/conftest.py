import os
import sys
from pathlib import Path

# Test modules import helpers.py and, for multi-process tests, the worker functions of workers.py
# by module name, from any sub-folder.
sys.path.insert(0, str(Path(__file__).parent))

# A checkout that sits beside a shared/data folder of corpora uses it, as if LOCALCLIP_DATA
# pointed there (set before helpers.py resolves the data root the way the CLI does).
_beside = Path(__file__).resolve().parents[2] / "shared" / "data"
if not os.environ.get("LOCALCLIP_DATA") and _beside.is_dir():
    os.environ["LOCALCLIP_DATA"] = str(_beside)
