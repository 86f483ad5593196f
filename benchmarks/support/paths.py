"""Where the benchmarks write: the repository root and its results folder (models and images are cached there too).

The scenario runner (run.py) and the scenarios that also run alone (affinity.py) both need it, so it sits below them.
"""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
