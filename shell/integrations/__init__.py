"""What puts a training framework's own loop on a run: callbacks for ``transformers`` (the
Hugging Face ``Trainer``) and ``lightning`` (PyTorch Lightning), and ``torchrun``'s
``GroupSession`` (a ``torch.distributed`` group of DDP ranks as one node). Each module imports
its framework when it is imported, so ``import gradientmail`` never does; install the
``transformers`` or ``lightning`` extra for the one you use.
"""
