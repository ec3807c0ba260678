"""Where the tests find the exact PTB and WikiText-2 corpora: ../shared/data or $LOCALCLIP_DATA."""

import os
from pathlib import Path

from localclip.data.corpora import CORPORA


def shared_data_root() -> Path | None:
    candidates = [Path(__file__).resolve().parents[2] / "shared" / "data"]
    if os.environ.get("LOCALCLIP_DATA"):
        candidates.append(Path(os.environ["LOCALCLIP_DATA"]))
    for root in candidates:
        if all((root / spec.folder / "train.txt").is_file() for spec in CORPORA.values()):
            return root
    return None
