"""The demo GPT: torch and MLX share names, shapes, initial weights and numbers."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from gradientmail.demo import model as torch_gpt
from gradientmail.demo.config import GPTConfig, initial_parameters, learning_rate, parameter_shapes
from gradientmail.demo.corpus import batches, heldout_windows, load_corpus

SMALL = GPTConfig(context=32, layers=2, dim=32, heads=2)


def windows(count: int = 4, context: int = SMALL.context) -> np.ndarray:
    stream = batches(load_corpus().train, batch=count, context=context, seed=3, node=0)
    return next(stream)


def test_config_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="heads"):
        GPTConfig(dim=30, heads=4)
    with pytest.raises(ValueError, match="layers"):
        GPTConfig(layers=0)


def test_default_size_is_under_two_million_parameters() -> None:
    count = sum(math.prod(s) for s in parameter_shapes(GPTConfig()).values())
    assert 300_000 < count < 2_000_000


def test_initial_parameters_depend_only_on_the_seed() -> None:
    a, b, c = (initial_parameters(SMALL, s) for s in (0, 0, 1))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["embed.weight"], c["embed.weight"])
    assert not a["layers.0.ln1.bias"].any() and (a["layers.0.ln1.weight"] == 1).all()


def test_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    rates = [learning_rate(s, peak=1.0, warmup=10, total=100) for s in range(101)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(x >= y for x, y in itertools.pairwise(rates[10:]))
    assert rates[100] == pytest.approx(0.1)


def test_torch_names_and_shapes_match_the_config() -> None:
    model = torch_gpt.build(SMALL)
    names = {k: tuple(v.shape) for k, v in model.named_parameters()}
    assert names == parameter_shapes(SMALL)
    assert "layers.0.attn.qkv.weight" in names and "head.weight" not in names  # tied output


def test_torch_forward_and_backward() -> None:
    model = torch_gpt.build(SMALL)
    batch = windows()
    logits = model(torch.from_numpy(batch[:, :-1].astype(np.int64)))
    assert logits.shape == (4, SMALL.context, 256)
    loss = torch_gpt.loss_of(model, batch)
    # Small initial weights: close to a uniform guess over 256 bytes.
    assert abs(float(loss.detach()) - math.log(256)) < 0.5
    loss.backward()  # type: ignore[no-untyped-call]
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert float(model.embed.weight.grad.abs().sum()) > 0  # type: ignore[union-attr]


def test_torch_is_causal() -> None:
    model = torch_gpt.build(SMALL)
    batch = torch.from_numpy(windows()[:, :-1].astype(np.int64))
    changed = batch.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    with torch.no_grad():
        a, b = model(batch), model(changed)
    assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6)
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_short_training_lowers_heldout_loss() -> None:
    torch.manual_seed(0)
    trainer = torch_gpt.TorchTrainer(SMALL, seed=0, lr=3e-3, warmup=5, total_steps=60)
    held = heldout_windows(load_corpus().heldout, count=32, context=SMALL.context)
    before = trainer.heldout(held)
    stream = batches(load_corpus().train, batch=16, context=SMALL.context, seed=0, node=0)
    losses = [trainer.train_step(next(stream)) for _ in range(60)]
    after = trainer.heldout(held)
    assert after < before - 1.0, (before, after)
    assert np.mean(losses[-10:]) < np.mean(losses[:10])


mlx = pytest.importorskip("mlx.core", reason="MLX is not installed")


@pytest.mark.mlx
class TestMLX:
    def test_names_and_shapes_match_torch(self) -> None:
        from gradientmail.demo import model_mlx

        ours = {k: v.shape for k, v in model_mlx.parameters_of(model_mlx.build(SMALL)).items()}
        theirs = {k: v.shape for k, v in torch_gpt.parameters_of(torch_gpt.build(SMALL)).items()}
        assert ours == theirs == parameter_shapes(SMALL)

    def test_same_initial_weights_as_torch(self) -> None:
        from gradientmail.demo import model_mlx

        ours = model_mlx.parameters_of(model_mlx.build(SMALL, seed=5))
        theirs = torch_gpt.parameters_of(torch_gpt.build(SMALL, seed=5))
        assert all(np.array_equal(ours[k], theirs[k]) for k in theirs)

    def test_forward_and_backward(self) -> None:
        from gradientmail.demo import model_mlx

        nn = model_mlx.nn  # typed as Any there: mlx.nn's re-exports are invisible to mypy
        model = model_mlx.build(SMALL)
        batch = mlx.array(windows().astype(np.int32))
        assert model(batch[:, :-1]).shape == (4, SMALL.context, 256)
        loss, grads = nn.value_and_grad(model, model_mlx.loss_of)(model, batch)
        assert abs(loss.item() - math.log(256)) < 0.5
        flat = dict(model_mlx.tree_flatten(grads))
        assert set(flat) == set(parameter_shapes(SMALL))
        assert all(bool(mlx.isfinite(g).all()) for g in flat.values())

    def test_same_logits_as_torch_for_trained_weights(self) -> None:
        from gradientmail.demo import model_mlx

        trainer = torch_gpt.TorchTrainer(SMALL, seed=0, lr=3e-3, warmup=1, total_steps=5)
        stream = batches(load_corpus().train, batch=8, context=SMALL.context, seed=1, node=0)
        for _ in range(5):
            trainer.train_step(next(stream))
        # Through bytes, as the mailbox carries them between frameworks.
        blobs = {k: v.tobytes() for k, v in torch_gpt.parameters_of(trainer.model).items()}
        shapes = parameter_shapes(SMALL)
        mine = model_mlx.build(SMALL, seed=9)
        model_mlx.load(
            mine, {k: np.frombuffer(b, np.float32).reshape(shapes[k]) for k, b in blobs.items()}
        )
        batch = windows()
        with torch.no_grad():
            expected = trainer.model(torch.from_numpy(batch[:, :-1].astype(np.int64))).numpy()
        got = np.array(mine(mlx.array(batch[:, :-1].astype(np.int32))))
        np.testing.assert_allclose(got, expected, atol=2e-4, rtol=1e-4)

    def test_training_steps_match_torch(self) -> None:
        from gradientmail.demo import model_mlx

        ours = model_mlx.MLXTrainer(SMALL, seed=0, lr=3e-3, warmup=2, total_steps=4)
        theirs = torch_gpt.TorchTrainer(SMALL, seed=0, lr=3e-3, warmup=2, total_steps=4)
        stream = batches(load_corpus().train, batch=4, context=SMALL.context, seed=2, node=0)
        for _ in range(4):
            batch = next(stream)
            assert ours.train_step(batch) == pytest.approx(theirs.train_step(batch), abs=1e-4)
