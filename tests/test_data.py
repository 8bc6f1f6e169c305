import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from axonn_jax import ParallelConfig
from axonn_jax.config import BATCH_AXES
from axonn_jax.run import data as data_lib


def test_tokenizer_round_trip():
    text = "def f(x):\n    return x  # ünïcödé"
    assert data_lib.decode(data_lib.encode(text)) == text
    assert data_lib.encode("A").tolist() == [65]


def test_default_corpus_is_stdlib_sources_sorted():
    files = data_lib.stdlib_sources()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    corpus = data_lib.Corpus.load()
    assert corpus.train[:200].tobytes() == files[0].read_bytes()[:200]
    assert len(corpus.val) > 0 and len(corpus.train) > 19 * len(corpus.val)


def test_batches_are_pure_functions_of_seed_and_step():
    tokens = np.arange(10_000) % 256
    a = data_lib.batch_offsets(len(tokens), 0, 5, 8, 32)
    assert np.array_equal(a, data_lib.batch_offsets(len(tokens), 0, 5, 8, 32))
    assert not np.array_equal(a, data_lib.batch_offsets(len(tokens), 0, 6, 8, 32))
    assert not np.array_equal(a, data_lib.batch_offsets(len(tokens), 1, 5, 8, 32))
    rows = data_lib.batch_rows(tokens, a, 32)
    assert rows.shape == (8, 33) and rows.dtype == np.int32
    assert np.array_equal(rows[:, 1:], (rows[:, :-1] + 1) % 256)


def test_batches_are_placed_over_data(devices):
    from axonn_jax.train import TrainOptions, build_trainer

    trainer = build_trainer(TrainOptions(batch_size=16, seq_len=20,
                                         parallel=ParallelConfig(data=8)), devices)
    tokens = np.random.default_rng(0).integers(0, 256, 5000)
    host = data_lib.lm_batch(tokens, 3, 7, 16, 20)
    expected = data_lib.batch_rows(tokens, data_lib.batch_offsets(5000, 3, 7, 16, 20), 20)
    assert np.array_equal(host["inputs"], expected[:, :-1])
    assert np.array_equal(host["targets"], expected[:, 1:])
    batch = trainer.place(host)
    for name, leaf in batch.items():
        assert leaf.shape == (16, 20) and leaf.sharding.spec == P(BATCH_AXES)
        assert {s.data.shape for s in leaf.addressable_shards} == {(2, 20)}
        assert np.array_equal(np.asarray(leaf), host[name])


def test_data_paths(tmp_path):
    (tmp_path / "a.txt").write_text("hello ")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("world")
    assert data_lib.decode(data_lib.load_tokens(tmp_path)) == "hello world"
    assert data_lib.decode(data_lib.load_tokens(tmp_path / "a.txt")) == "hello "
    np.save(tmp_path / "t.npy", np.array([104, 105], np.int32))
    assert data_lib.decode(data_lib.load_tokens(tmp_path / "t.npy")) == "hi"


def test_bad_data_gets_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data_lib.load_tokens(tmp_path / "missing.txt")
    (tmp_path / "corrupt.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(ValueError, match="cannot read token array"):
        data_lib.load_tokens(tmp_path / "corrupt.npy")
    np.save(tmp_path / "big.npy", np.array([1, 300]))
    with pytest.raises(ValueError, match=r"outside \[0, 256\)"):
        data_lib.load_tokens(tmp_path / "big.npy")
    np.save(tmp_path / "float.npy", np.zeros(4))
    with pytest.raises(ValueError, match="1-D integer"):
        data_lib.load_tokens(tmp_path / "float.npy")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no text files"):
        data_lib.load_tokens(tmp_path / "empty")
    (tmp_path / "short.txt").write_text("abc")
    with pytest.raises(ValueError, match="corpus has 3 tokens"):
        data_lib.Corpus.load(tmp_path / "short.txt", min_tokens=66)
