"""The demo tests share a small machine with other work: one torch thread avoids thrashing."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
