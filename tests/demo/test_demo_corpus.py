"""The demo corpus: the standard library's sources, split by file, batches per node."""

from __future__ import annotations

import numpy as np

from gradientmail.demo.corpus import batches, heldout_windows, load_corpus, stdlib_sources


def test_sources_are_sorted_python_files() -> None:
    files = stdlib_sources()
    assert [p.name for p in files] == sorted(p.name for p in files)
    assert all(p.suffix == ".py" for p in files)
    assert any(p.name == "os.py" for p in files)


def test_corpus_is_deterministic_and_a_few_megabytes() -> None:
    first, second = load_corpus(), load_corpus()
    assert np.array_equal(first.train, second.train)
    assert np.array_equal(first.heldout, second.heldout)
    assert 1_000_000 < first.train.size + first.heldout.size < 20_000_000
    # Every tenth file is held out: roughly a tenth of the bytes.
    assert 0.03 < first.heldout.size / (first.train.size + first.heldout.size) < 0.3


def test_split_is_by_whole_file(tmp_path: object) -> None:
    files = stdlib_sources()[:12]
    corpus = load_corpus(files)
    held = b"".join(files[i].read_bytes() for i in (0, 10))
    train = b"".join(p.read_bytes() for i, p in enumerate(files) if i not in (0, 10))
    assert corpus.heldout.tobytes() == held
    assert corpus.train.tobytes() == train
    assert corpus.files == tuple(p.name for p in files)


def test_batches_have_the_asked_shape_and_come_from_the_tokens() -> None:
    tokens = np.arange(1000, dtype=np.int64).astype(np.uint8)
    batch = next(batches(tokens, batch=5, context=16, seed=0, node=0))
    assert batch.shape == (5, 17) and batch.dtype == np.uint8
    # Windows are contiguous runs of the corpus.
    assert np.all((batch[:, 1:].astype(int) - batch[:, :-1].astype(int)) % 256 == 1)


def test_each_node_draws_its_own_reproducible_stream() -> None:
    corpus = load_corpus()

    def draw(seed: int, node: int) -> np.ndarray:
        stream = batches(corpus.train, batch=4, context=32, seed=seed, node=node)
        return np.stack([next(stream) for _ in range(3)])

    assert np.array_equal(draw(0, 1), draw(0, 1))
    assert not np.array_equal(draw(0, 0), draw(0, 1))
    assert not np.array_equal(draw(0, 0), draw(1, 0))


def test_heldout_windows_are_fixed_and_spread() -> None:
    corpus = load_corpus()
    first = heldout_windows(corpus.heldout, count=16, context=64)
    assert first.shape == (16, 65)
    assert np.array_equal(first, heldout_windows(corpus.heldout, count=16, context=64))
    assert len({w.tobytes() for w in first}) == 16
