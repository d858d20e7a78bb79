"""Callbacks that put a training framework's own loop on a run: ``transformers`` (the Hugging
Face ``Trainer``) and ``lightning`` (PyTorch Lightning). Each module imports its framework when
it is imported, so ``import gradientmail`` never does; install the ``transformers`` or
``lightning`` extra for the one you use.
"""
