from __future__ import annotations

import sys
from pathlib import Path

# This directory's helpers (examples, hostile, tamper), and the shell tests' virtual_run,
# cluster and worker, which the security tests reuse.
sys.path.insert(0, str(Path(__file__).parents[1] / "shell"))
sys.path.insert(0, str(Path(__file__).parent))
