"""The two protocols between a framework and the shell: ``Adapter`` and ``Backend``.

Bytes are the contract: ``TensorBytes`` written by one framework's backend decode to the same
numbers in every other, so one run may mix torch and MLX nodes.

``Tensors`` are a backend's own arrays by parameter name (torch tensors, MLX arrays); the shell
never looks inside them and only hands them back to the backend that made them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

from gradientmail.core.tensors import Quantized, Schema, TensorBytes, TensorView

__all__ = ["Adapter", "Backend", "Tensors"]

Tensors: TypeAlias = dict[str, Any]


@runtime_checkable
class Adapter(Protocol):
    """A model's canonical trainable parameters, read and written as bytes."""

    @property
    def schema(self) -> Schema:
        """The trainable parameters: names as the framework names them, F32/F16/BF16."""
        ...

    def read(self, names: Sequence[str]) -> dict[str, TensorBytes]:
        """Contiguous host copies of the named parameters."""
        ...

    def write(self, tensors: Mapping[str, TensorBytes]) -> None:
        """Overwrite the named parameters in place; optimizers keep their references."""
        ...


@runtime_checkable
class Backend(Protocol):
    """The tensor work of a node, on its framework's device.

    Every method that takes ``Tensors`` takes those this backend produced. Arithmetic on
    deltas, averages and outer steps is in F32 whatever the parameters' dtype.
    """

    name: str

    def adapter(self, model: object) -> Adapter:
        """The adapter for ``model``; ``TypeError`` naming the type when it is not this
        backend's framework."""
        ...

    def capture(
        self, adapter: Adapter, names: Sequence[str], *, into: Tensors | None = None
    ) -> Tensors:
        """Device-side copies of the named live parameters, in their own dtype. Called on the
        training thread; must not wait for the copy to finish (``ready`` does). ``into``:
        what ``reserve`` returned for these names; a copy goes into its tensor of the same
        name where shape, dtype and device match (that tensor is then the capture's), else
        into new memory."""
        ...

    def reserve(self, adapter: Adapter, names: Sequence[str]) -> Tensors:
        """Memory for a later ``capture(adapter, names, into=...)``, its pages already
        touched, so that the copy on the training thread does not pay for fresh memory (page
        faults: about 4x the copy itself on a CPU). Safe on any thread while the model
        trains: it reads the parameters' shapes, never their values. May leave names out
        (all of them where a capture needs no such help: MLX's immutable arrays, CUDA's
        caching allocator)."""
        ...

    def ready(self, tensors: Tensors) -> None:
        """Block until the copies ``capture`` started are complete (CUDA events); no-op else."""
        ...

    def load(self, tensors: Mapping[str, TensorBytes]) -> Tensors:
        """Framework tensors of ``tensors``, keeping their dtype (F32, F16 or BF16)."""
        ...

    def dump(self, tensors: Tensors) -> dict[str, TensorBytes]:
        """Bytes of ``tensors``, keeping their dtype."""
        ...

    def lend(self, tensors: Tensors) -> dict[str, TensorView]:
        """``dump``'s bytes without the copy where the memory allows (host tensors): views that
        stay valid while no one writes ``tensors``. A device tensor is copied to the host."""
        ...

    def delta(
        self,
        base: Tensors,
        local: Tensors,
        residual: Tensors | None = None,
        *,
        owned: bool = False,
    ) -> Tensors:
        """``base - local`` in F32, plus the error-feedback ``residual`` when given.
        ``owned``: the caller gives ``local`` up, and an F32 ``local`` may hold the result
        (torch writes it there: no new memory), so ``local`` must not be read afterwards."""
        ...

    def encode(
        self, delta: Tensors, quantization: Quantized | None, *, owned: bool = False
    ) -> tuple[dict[str, TensorBytes], Tensors]:
        """The payload of an F32 ``delta``, quantized when asked (``quantized_specs`` layout),
        and the residual ``delta - decode(payload)`` for error feedback (zeros when exact).
        ``owned``: the caller gives ``delta`` up, and a quantized residual may be written
        into its memory (torch does: no second F32 copy of the fragment), so ``delta`` must not
        be read afterwards. Raises ``NonFinite`` naming the tensors that hold NaN or Inf,
        before any tensor is written."""
        ...

    def lend_plain(self, delta: Tensors) -> dict[str, TensorView]:
        """``encode(delta, None)``'s payload without the copy: ``lend``'s views of the F32
        ``delta``, valid while no one writes it (a snapshot is written before its delta is
        summed). Raises ``NonFinite`` naming the tensors that hold NaN or Inf."""
        ...

    def decode(self, payload: Mapping[str, TensorBytes], schema: Schema) -> Tensors:
        """F32 deltas for every parameter of ``schema`` from a payload in any of the layouts
        (plain F32/F16/BF16, F8_E4M3 or F4 with scales). Raises ``SchemaMismatch`` naming the
        entries that are missing or of the wrong shape, ``NonFinite`` for NaN or Inf."""
        ...

    def average(self, weighted: Sequence[tuple[float, Tensors]]) -> Tensors:
        """``sum(w_i * t_i) / sum(w_i)`` in F32; weights are positive."""
        ...

    def weighted_sum(self, weighted: Sequence[tuple[float, Tensors]]) -> Tensors:
        """``sum(w_i * t_i)`` in F32 (the outer gradient; the caller normalizes the weights)."""
        ...

    def norm(self, tensors: Tensors) -> float:
        """The L2 norm of all of ``tensors`` taken together (a delta's size, for the closer's
        outlier rule): each tensor's norm in F32, scaled by its largest magnitude so that no
        finite delta overflows, combined in F64. ``inf`` or ``nan`` when a tensor holds them;
        0.0 for no tensors."""
        ...

    def outer_step(
        self,
        master: Tensors,
        momentum: Tensors | None,
        gradient: Tensors,
        *,
        lr: float,
        beta: float,
        nesterov: bool = True,
        reuse: bool = False,
    ) -> tuple[Tensors, Tensors]:
        """One SGD step with (Nesterov) momentum, all F32, as torch.optim.SGD computes it:
        ``m = beta * m + g`` (``m = g`` when ``momentum`` is None); ``u = g + beta * m`` if
        Nesterov else ``m``; returns ``(master - lr * u, m)``. With ``reuse`` the backend may
        compute into ``momentum`` and ``gradient`` (F32 tensors no one else holds): the new
        momentum into the momentum, the update and then the new master into the gradient,
        which saves three temporaries the size of the fragment; ``master`` is never written."""
        ...

    def cast(self, tensors: Tensors, schema: Schema) -> Tensors:
        """``tensors`` rounded (to nearest even) to the dtypes ``schema`` gives them."""
        ...

    def merge(
        self,
        adapter: Adapter,
        commit: Tensors,
        *,
        since: Tensors | None,
        alpha: float | None,
    ) -> None:
        """Fold a commit's parameters into the live model, on the training thread, in place.

        With ``alpha`` set: ``live = alpha * live + (1 - alpha) * commit`` (Streaming DiLoCo's
        mixing). Otherwise with ``since`` (the local parameters the progress is measured from):
        ``live = commit + (live - since)``, which keeps the steps trained since then. With
        neither: ``live = commit``. Arithmetic in F32, rounded to the parameters' dtype.
        """
        ...

    def difference(self, commit: Tensors, since: Tensors, *, owned: bool = False) -> Tensors:
        """``commit - since`` in F32: what a merge since ``since`` adds to the live
        parameters (``shift``), computed on any thread, ahead of the merge. ``owned``: the
        caller gives ``since`` up, and an F32 ``since`` may hold the result (torch writes it
        there: no new memory), so ``since`` must not be read afterwards."""
        ...

    def shift(self, adapter: Adapter, difference: Tensors) -> None:
        """``live = live + difference`` in place, on the training thread: arithmetic in F32,
        rounded to the parameters' dtype. ``shift(adapter, difference(commit, s))`` is
        ``merge(adapter, commit, since=s, alpha=None)`` in one pass over the live parameters
        instead of two, up to one rounding (``commit - s`` is rounded before it is added)."""
        ...
