"""Operating a run from outside it: ``status`` reads its state, ``collect`` removes what no
node needs any more (the ``gradientmail status`` and ``gradientmail gc`` commands)."""

from gradientmail.ops._admin import collect, status

__all__ = ["collect", "status"]
