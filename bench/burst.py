"""Kept for the commands quoted in docs/: `bench/burst.py ARGS` is `bench/run.py w1 ARGS`.

.venv/bin/python bench/burst.py --jobs 2000 --schedulers 2 --relays 2 --workers 2
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import main  # noqa: E402

if __name__ == "__main__":
    main(["w1", *sys.argv[1:]])
