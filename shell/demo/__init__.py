"""The demo behind ``gradientmail demo`` and the convergence benchmark.

A byte-level GPT (``model`` in torch, ``model_mlx`` in MLX, with the same parameter names) trained
on the Python standard library's sources (``corpus``) by one process per node (``worker``),
started and watched by ``launcher``; ``plot`` draws the curves. Needs torch or MLX, numpy and
matplotlib (the ``demo`` extra).
"""
