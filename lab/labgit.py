"""The commit a lab run measured: ``$TRITUNE_COMMIT`` when the driver set it (the device's copy of the tree
carries a stale ``.git``: its HEAD is not the commit that was sent), else ``git rev-parse HEAD`` here."""
import os
import subprocess
from pathlib import Path


def commit(short: bool = True) -> str:
    c = os.environ.get("TRITUNE_COMMIT", "").strip()
    if not c:
        try:
            c = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                               cwd=Path(__file__).parent).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            c = ""
    return c[:7] if short else c
