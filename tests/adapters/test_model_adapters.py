"""Adapters on small real transformers in torch and MLX, the choice of framework by model type,
and capture / merge on a live model."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest

from gradientmail.adapters import Adapter, adapter_for, backend_for, default_backend
from gradientmail.core.errors import SchemaMismatch
from gradientmail.core.tensors import ParameterSpec, Schema, TensorBytes

VOCAB, WIDTH, CONTEXT = 61, 16, 8


def torch_transformer() -> Any:
    torch = pytest.importorskip("torch")

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, WIDTH)
            self.position = torch.nn.Parameter(torch.zeros(CONTEXT, WIDTH), requires_grad=False)
            self.blocks = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True)
                for _ in range(2)
            )
            self.norm = torch.nn.LayerNorm(WIDTH)
            self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
            self.head.weight = self.embed.weight  # tied input and output embeddings
            self.register_buffer("mask", torch.triu(torch.ones(CONTEXT, CONTEXT), 1).bool())

        def forward(self, tokens: Any) -> Any:
            h = self.embed(tokens) + self.position[: tokens.shape[1]]
            for block in self.blocks:
                h = block(h, src_mask=self.mask[: tokens.shape[1], : tokens.shape[1]])
            return self.head(self.norm(h))

    torch.manual_seed(0)
    return TinyLM()


def mlx_transformer() -> Any:
    pytest.importorskip("mlx.core")
    import mlx.core as mx
    import mlx.nn as nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiHeadAttention(WIDTH, 2)
            self.norm = nn.RMSNorm(WIDTH)
            self.mlp = [nn.Linear(WIDTH, 32), nn.Linear(32, WIDTH)]

        def __call__(self, h: Any, mask: Any) -> Any:
            x = self.norm(h)
            h = h + self.attention(x, x, x, mask)
            return h + self.mlp[1](nn.gelu(self.mlp[0](h)))

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.position = mx.zeros((CONTEXT, WIDTH))
            self.layers = [Block() for _ in range(2)]
            self._mask = nn.MultiHeadAttention.create_additive_causal_mask(CONTEXT)  # a buffer

        def __call__(self, tokens: Any) -> Any:
            h = self.embed(tokens) + self.position[: tokens.shape[1]]
            for layer in self.layers:
                h = layer(h, self._mask[: tokens.shape[1], : tokens.shape[1]])
            return self.embed.as_linear(h)  # tied input and output embeddings

    mx.random.seed(0)
    model = TinyLM()
    model.freeze(keys=["position"], recurse=False)
    return model


def test_torch_adapter_holds_the_trainable_parameters_once() -> None:
    model = torch_transformer()
    adapter = adapter_for(model)
    expected = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert list(adapter.schema.names) == expected
    assert "embed.weight" in expected and "head.weight" not in expected  # tied: once
    assert "position" not in expected and "mask" not in expected  # frozen, buffer
    assert adapter.schema["blocks.1.linear1.weight"] == ParameterSpec(
        name="blocks.1.linear1.weight", dtype="F32", shape=(32, WIDTH)
    )


def test_mlx_adapter_holds_the_trainable_parameters_by_tree_path() -> None:
    model = mlx_transformer()
    adapter = adapter_for(model)
    names = set(adapter.schema.names)
    assert {
        "embed.weight",
        "layers.1.mlp.0.weight",
        "layers.0.attention.query_proj.weight",
    } <= names
    assert "position" not in names and not any("mask" in n for n in names)
    assert adapter.schema["layers.1.mlp.0.weight"].shape == (32, WIDTH)


@pytest.mark.parametrize("make", [torch_transformer, mlx_transformer], ids=["torch", "mlx"])
def test_read_and_write_round_trip_through_bytes(make: Any) -> None:
    model = make()
    adapter = adapter_for(model)
    names = list(adapter.schema.names)
    before = adapter.read(names)
    assert all(
        before[n].dtype == "F32" and before[n].shape == adapter.schema[n].shape for n in names
    )
    changed = {
        n: TensorBytes(
            dtype="F32", shape=v.shape, data=(np.frombuffer(v.data, np.float32) + 1).tobytes()
        )
        for n, v in before.items()
    }
    adapter.write(changed)
    assert adapter.read(names) == changed
    with pytest.raises(SchemaMismatch) as caught:
        adapter.write({"embed.weight": TensorBytes(dtype="F32", shape=(1,), data=bytes(4))})
    assert caught.value.names == ("embed.weight",)
    with pytest.raises(SchemaMismatch):
        adapter.read(["nothing.here"])


def test_torch_write_keeps_the_tensors_the_optimizer_holds() -> None:
    torch = pytest.importorskip("torch")
    model = torch_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    adapter = adapter_for(model)
    weight = model.embed.weight
    pointer = weight.data_ptr()
    value = adapter.read(["embed.weight"])["embed.weight"]
    adapter.write(
        {"embed.weight": TensorBytes(dtype="F32", shape=value.shape, data=bytes(len(value.data)))}
    )
    assert model.embed.weight is weight and weight.data_ptr() == pointer
    assert model.head.weight is weight and not weight.any()  # the tie holds
    model(torch.randint(0, VOCAB, (2, CONTEXT))).sum().backward()
    optimizer.step()
    assert weight.any()  # the optimizer updated the tensor that was written


def test_mlx_write_keeps_the_tree_and_trains_on() -> None:
    model = mlx_transformer()
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    adapter = adapter_for(model)
    value = adapter.read(["layers.1.mlp.0.weight"])["layers.1.mlp.0.weight"]
    adapter.write(
        {
            "layers.1.mlp.0.weight": TensorBytes(
                dtype="F32", shape=value.shape, data=bytes(len(value.data))
            )
        }
    )
    assert isinstance(model.layers, list) and isinstance(model.layers[1].mlp, list)
    assert not model.layers[1].mlp[0].weight.any().item()
    tokens = mx.random.randint(0, VOCAB, (2, CONTEXT))
    _, grads = nn.value_and_grad(model, lambda m: m(tokens).sum())(model)
    optim.SGD(learning_rate=0.1).update(model, grads)
    mx.eval(model.parameters())
    assert model.layers[1].mlp[0].weight.any().item()
    assert "position" not in dict(_flat(grads))  # frozen stays frozen


def _flat(tree: Any) -> Any:
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


def test_unsupported_dtypes_are_named() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(2, 2).double()
    with pytest.raises(TypeError, match=r"'weight' is torch\.float64"):
        adapter_for(model)
    model.weight.requires_grad_(False)
    model.bias.requires_grad_(False)
    assert adapter_for(model).schema.names == ()  # frozen parameters are not exchanged


def test_bf16_models_are_bf16_schemas(fw: Any) -> None:
    if fw.name == "torch":
        import torch

        model: Any = torch.nn.Linear(3, 5).to(torch.bfloat16)
    else:
        import mlx.core as mx
        import mlx.nn as nn

        model = nn.Linear(3, 5)
        model.set_dtype(mx.bfloat16)
    adapter = fw.backend.adapter(model)
    assert {p.dtype for p in adapter.schema.parameters} == {"BF16"}
    assert (
        adapter.read(["weight"])["weight"].data
        == fw.backend.dump(fw.backend.capture(adapter, ["weight"]))["weight"].data
    )


def test_adapter_for_rejects_other_objects_by_name() -> None:
    with pytest.raises(
        TypeError, match=r"dict; expected a torch\.nn\.Module, an mlx\.nn\.Module or an Adapter"
    ):
        adapter_for({"w": 1})
    with pytest.raises(TypeError, match="list"):
        backend_for([])


def test_backend_for_and_default_backend(fw: Any) -> None:
    model = torch_transformer() if fw.name == "torch" else mlx_transformer()
    assert backend_for(model).name == fw.name
    assert backend_for(adapter_for(model)).name == fw.name
    first = "torch" if importlib.util.find_spec("torch") else "mlx"
    assert default_backend().name == first  # torch first when both are installed
    other = mlx_transformer() if fw.name == "torch" else torch_transformer()
    with pytest.raises(TypeError, match="backend takes"):
        fw.backend.adapter(other)


class DictAdapter:
    """An adapter over plain bytes, as a user might write for a model of another framework."""

    def __init__(self, tensors: dict[str, TensorBytes]) -> None:
        self.tensors = dict(tensors)
        self.schema = Schema.of(
            ParameterSpec(name=n, dtype=t.dtype, shape=t.shape) for n, t in tensors.items()
        )

    def read(self, names: Any) -> dict[str, TensorBytes]:
        return {n: self.tensors[n] for n in names}

    def write(self, tensors: Any) -> None:
        self.tensors.update(tensors)


def live_adapter(fw: Any, kind: str, weight: np.ndarray[Any, Any]) -> Any:
    if kind == "bytes":
        return DictAdapter(fw.backend.dump({"w": fw.tensor(weight, "BF16")}))
    if fw.name == "torch":
        import torch

        class Holder(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = torch.nn.Parameter(torch.from_numpy(weight.copy()).to(torch.bfloat16))

        return fw.backend.adapter(Holder())
    import mlx.nn as nn

    class MLXHolder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = fw.tensor(weight, "BF16")

    return fw.backend.adapter(MLXHolder())


def live_values(fw: Any, adapter: Any) -> np.ndarray[Any, Any]:
    return fw.numpy(fw.backend.load(adapter.read(["w"]))["w"])


@pytest.mark.parametrize("kind", ["model", "bytes"])
def test_capture_is_a_copy_and_merge_folds_a_commit_in(fw: Any, kind: str) -> None:
    start = np.float32([1.0, 2.0, -3.0, 0.5])
    adapter = live_adapter(fw, kind, start)
    assert isinstance(adapter, Adapter)
    since = fw.backend.capture(adapter, ["w"])
    fw.backend.ready(since)
    fw.backend.merge(adapter, {"w": fw.tensor(start + 1)}, since=None, alpha=None)  # "training"
    assert live_values(fw, adapter).tolist() == (start + 1).tolist()
    assert fw.numpy(since["w"]).tolist() == start.tolist()  # the capture did not move

    commit = {"w": fw.tensor(np.float32([10.0, 20.0, 30.0, 40.0]))}
    fw.backend.merge(adapter, commit, since=since, alpha=None)
    assert live_values(fw, adapter).tolist() == [11.0, 21.0, 31.0, 41.0]  # progress kept
    fw.backend.merge(adapter, {"w": fw.tensor(np.zeros(4))}, since=since, alpha=0.5)
    assert live_values(fw, adapter).tolist() == [5.5, 10.5, 15.5, 20.5]  # alpha mixing
    fw.backend.merge(adapter, commit, since=None, alpha=None)
    assert live_values(fw, adapter).tolist() == [10.0, 20.0, 30.0, 40.0]
    assert adapter.read(["w"])["w"].dtype == "BF16"  # rounded to the parameter's dtype
    with pytest.raises(SchemaMismatch):
        fw.backend.merge(adapter, {"v": fw.tensor([1.0])}, since=None, alpha=None)
    with pytest.raises(ValueError, match="alpha"):
        fw.backend.merge(adapter, commit, since=None, alpha=2.0)


@pytest.mark.parametrize("kind", ["model", "bytes"])
def test_a_capture_into_reserved_memory_is_the_same_copy_in_that_memory(fw: Any, kind: str) -> None:
    start = np.float32([1.0, 2.0, -3.0, 0.5])
    adapter = live_adapter(fw, kind, start)
    made: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: made.update(fw.backend.reserve(adapter, ["w"])))
    worker.start()  # reserved on another thread, as a node does while the step before runs
    worker.join()
    # Only torch's host tensors pay for fresh memory: MLX and a bytes adapter reserve nothing.
    assert set(made) == ({"w"} if fw.name == "torch" and kind == "model" else set())
    captured = fw.backend.capture(adapter, ["w"], into=made)
    fw.backend.ready(captured)
    if made:
        assert captured["w"] is made["w"]
    assert fw.numpy(captured["w"]).tolist() == start.tolist()
    fw.backend.merge(adapter, {"w": fw.tensor(start + 1)}, since=None, alpha=None)
    assert fw.numpy(captured["w"]).tolist() == start.tolist()  # a copy: training moves on
    assert adapter.read(["w"])["w"].dtype == "BF16"
    if made:
        # Memory of another shape is not used: the capture takes new memory.
        wrong = {"w": made["w"].new_zeros((5,))}
        again = fw.backend.capture(adapter, ["w"], into=wrong)
        assert again["w"] is not wrong["w"] and tuple(again["w"].shape) == (4,)
        assert fw.numpy(again["w"]).tolist() == (start + 1).tolist()


def typed_adapter(fw: Any, kind: str, weight: np.ndarray[Any, Any], dtype: str) -> Any:
    """An adapter of one parameter ``w`` of ``dtype``: a model's, or bytes (``DictAdapter``)."""
    if kind == "bytes":
        return DictAdapter(fw.backend.dump({"w": fw.tensor(weight, dtype)}))
    if fw.name == "torch":
        import torch

        class Holder(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                w = torch.from_numpy(weight.copy())
                self.w = torch.nn.Parameter(w if dtype == "F32" else w.to(torch.bfloat16))

        return fw.backend.adapter(Holder())
    import mlx.nn as nn

    class MLXHolder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = fw.tensor(weight, dtype)

    return fw.backend.adapter(MLXHolder())


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
@pytest.mark.parametrize("kind", ["model", "bytes"])
def test_a_shift_by_the_difference_is_the_merge_since_a_capture(
    fw: Any, kind: str, dtype: str
) -> None:
    rng = np.random.default_rng(5)
    start = rng.standard_normal(257).astype(np.float32)
    trained = start + rng.standard_normal(257).astype(np.float32) * np.float32(1e-2)
    adapters = [typed_adapter(fw, kind, start, dtype) for _ in range(2)]
    captured = [fw.backend.capture(adapter, ["w"]) for adapter in adapters]
    for adapter in adapters:  # training moves on from the capture
        fw.backend.merge(adapter, {"w": fw.tensor(trained)}, since=None, alpha=None)
    live = live_values(fw, adapters[0])
    commit_values = start + rng.standard_normal(257).astype(np.float32) * np.float32(0.1)
    commit = {"w": fw.tensor(commit_values, dtype)}
    fw.backend.merge(adapters[0], commit, since=captured[0], alpha=None)

    since = fw.numpy(captured[1]["w"])
    difference = fw.backend.difference(commit, captured[1], owned=True)
    if fw.name == "torch" and kind == "model" and dtype == "F32":
        assert difference["w"] is captured[1]["w"]  # the spent capture's memory
    fw.backend.shift(adapters[1], difference)
    shifted = live_values(fw, adapters[1])
    assert adapters[1].read(["w"])["w"].dtype == dtype
    # live + (commit - since): each operation rounded to F32, the sum to the parameter's dtype.
    c = fw.numpy(commit["w"])
    assert np.array_equal(fw.numpy(difference["w"]), c - since)
    assert np.array_equal(shifted, fw.numpy(fw.tensor(live + (c - since), dtype)))
    # The merge it stands for, up to that one rounding.
    merged = live_values(fw, adapters[0])
    np.testing.assert_allclose(shifted, merged, rtol=2e-2 if dtype == "BF16" else 1e-6, atol=1e-6)
    with pytest.raises(SchemaMismatch):
        fw.backend.shift(adapters[1], {"v": difference["w"]})
    with pytest.raises(SchemaMismatch):
        fw.backend.difference(commit, {"v": captured[0]["w"]})


def test_tensors_cross_between_the_training_and_communication_threads(fw: Any) -> None:
    start = np.float32([1.0, 2.0, -3.0, 0.5])
    adapter = live_adapter(fw, "model", start)
    base = fw.backend.load(adapter.read(["w"]))
    fw.backend.merge(adapter, {"w": fw.tensor(start * 2)}, since=None, alpha=None)
    captured = fw.backend.capture(adapter, ["w"])  # training thread
    results: dict[str, Any] = {}

    def communicate() -> None:  # the learner's loop and the syncer, on their own thread
        fw.backend.ready(captured)
        delta = fw.backend.delta(base, captured)
        payload, _ = fw.backend.encode(delta, "F4")
        decoded = fw.backend.decode(payload, adapter.schema)
        gradient = fw.backend.weighted_sum([(1.0, decoded)])
        master, _ = fw.backend.outer_step(base, None, gradient, lr=1.0, beta=0.5)
        results["commit"] = fw.backend.cast(master, adapter.schema)

    worker = threading.Thread(target=communicate)
    worker.start()
    worker.join()
    fw.backend.merge(adapter, results["commit"], since=captured, alpha=None)  # training thread
    # master = base - (base - local) * (1 + 0.5): the Nesterov step, taken on the live model.
    assert live_values(fw, adapter).tolist() == (start * 2 + start * 0.5).tolist()


def test_torch_merge_writes_in_place() -> None:
    torch = pytest.importorskip("torch")
    from gradientmail.adapters import TorchBackend

    layer = torch.nn.Linear(4, 3)
    weight, pointer = layer.weight, layer.weight.data_ptr()
    backend = TorchBackend("cpu")
    adapter = backend.adapter(layer)
    backend.merge(adapter, {"weight": torch.ones(3, 4)}, since=None, alpha=0.25)
    assert layer.weight is weight and weight.data_ptr() == pointer
    assert weight.grad is None and weight.requires_grad


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_merge_keeps_the_progress_since_the_snapshot_bit_for_bit(dtype: str) -> None:
    # F32 parameters merge in place, without temporaries; others through F32 and one rounding.
    # Either way the live values are what the formula gives: commit + (live - since) in F32.
    torch = pytest.importorskip("torch")
    from gradientmail.adapters import TorchBackend

    generator = torch.Generator().manual_seed(5)
    layer = torch.nn.Linear(64, 32).to(getattr(torch, dtype))
    weight, pointer = layer.weight, layer.weight.data_ptr()
    since = torch.randn(32, 64, generator=generator) * 1e3
    commit = torch.randn(32, 64, generator=generator) * 1e-3
    live = layer.weight.detach().to(torch.float32).clone()
    expected = (commit + (live - since)).to(weight.dtype)
    backend = TorchBackend("cpu")
    adapter = backend.adapter(layer)
    backend.merge(
        adapter,
        {"weight": commit, "bias": layer.bias.detach().float()},
        since={"weight": since, "bias": layer.bias.detach().float()},
        alpha=None,
    )
    assert layer.weight is weight and weight.data_ptr() == pointer
    assert torch.equal(weight.detach(), expected)
    assert weight.grad is None and weight.requires_grad


def test_importing_the_package_imports_no_framework() -> None:
    code = (
        "import sys, gradientmail.adapters as a\n"
        "assert 'torch' not in sys.modules and 'mlx.core' not in sys.modules, sorted(sys.modules)\n"
        "assert a.Adapter and a.adapter_for\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("make", [torch_transformer, mlx_transformer], ids=["torch", "mlx"])
def test_row_blocks_read_capture_merge_and_write_only_their_rows(make: Any) -> None:
    # The tied embedding is the parameter a split run cuts into row blocks (core.fragments).
    model = make()
    adapter = adapter_for(model)
    backend = backend_for(model)
    assert getattr(adapter, "row_blocks", False)
    whole = np.frombuffer(adapter.read(["embed.weight"])["embed.weight"].data, np.float32)
    whole = whole.reshape(VOCAB, WIDTH).copy()
    names = ["embed.weight[0:20]", "embed.weight[20:61]"]
    read = adapter.read(names)
    assert read[names[1]].shape == (41, WIDTH)
    assert np.array_equal(np.frombuffer(read[names[1]].data, np.float32), whole[20:].ravel())

    captured = backend.capture(adapter, names[1:])
    backend.ready(captured)
    commit = {names[1]: backend.load({"c": _f32(np.full((41, WIDTH), 2.0))})["c"]}
    backend.merge(adapter, commit, since=None, alpha=None)
    after = np.frombuffer(adapter.read(["embed.weight"])["embed.weight"].data, np.float32)
    after = after.reshape(VOCAB, WIDTH)
    assert np.array_equal(after[:20], whole[:20]), "rows outside the block are untouched"
    assert (after[20:] == 2.0).all()
    captured_rows = backend.dump(captured)[names[1]]
    assert np.array_equal(np.frombuffer(captured_rows.data, np.float32), whole[20:].ravel())

    adapter.write({names[0]: _f32(np.full((20, WIDTH), -1.0))})
    after = np.frombuffer(adapter.read(["embed.weight"])["embed.weight"].data, np.float32)
    assert (after.reshape(VOCAB, WIDTH)[:20] == -1.0).all()
    assert (after.reshape(VOCAB, WIDTH)[20:] == 2.0).all()
    with pytest.raises(SchemaMismatch) as caught:
        adapter.read(["embed.weight[0:62]"])
    assert caught.value.names == ("embed.weight[0:62]",)
    with pytest.raises(SchemaMismatch):
        adapter.write({names[0]: _f32(np.zeros((21, WIDTH)))})


def _f32(values: np.ndarray[Any, Any]) -> TensorBytes:
    array = np.ascontiguousarray(values, np.float32)
    return TensorBytes(dtype="F32", shape=array.shape, data=array.tobytes())
