"""Corpus, byte-level tokenizer and deterministic language-model batches.

Batches are a pure function of `(seed, step)`: a resumed run sees exactly the data it would have seen.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import sysconfig

import numpy as np

VOCAB_SIZE = 256
"""Byte-level vocabulary: one token per byte value."""

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".json", ".csv", ".c", ".h")


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of `text` as a uint8 token array.

    Args:
      text: any string.

    Returns:
      A uint8 array of shape `(bytes,)`, one token per byte.
    """
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens) -> str:
    """Tokens back to text; invalid UTF-8 sequences are replaced, never raised.

    Args:
      tokens: byte tokens (any integer array-like of values in [0, 256)).

    Returns:
      The decoded string.
    """
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def stdlib_sources() -> list[pathlib.Path]:
    """The `.py` files of the running interpreter's standard library, in sorted order.

    Returns:
      Their paths (site-packages excluded), sorted by their path relative to the library.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in root.rglob("*.py") if "site-packages" not in f.parts and f.is_file()]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def _read_text_files(files: list[pathlib.Path]) -> np.ndarray:
    chunks = [np.frombuffer(f.read_bytes(), dtype=np.uint8) for f in files]
    if not chunks:
        raise ValueError("no text files to read")
    return np.concatenate(chunks)


TOKEN_FILE_DTYPES = {".uint16.bin": np.uint16, ".uint32.bin": np.uint32}
"""Raw token files: ids of this dtype, native byte order, nothing else in the file."""

CHECK_CHUNK = 1 << 26
"""Token ids checked per read when a token file is scanned (64 Mi ids)."""


def _open_token_file(path: pathlib.Path) -> np.ndarray:
    """A `.npy` array or a raw `.uint16.bin` / `.uint32.bin` file of token ids, memory-mapped
    (read-only; batches read only their rows, so the file may be larger than memory)."""
    name = path.name.lower()
    if name.endswith(".npy"):
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as e:  # numpy raises several types for a damaged file
            raise ValueError(f"cannot read token array {str(path)!r}: {e}") from e
    dtype = next((np.dtype(d) for suffix, d in TOKEN_FILE_DTYPES.items() if name.endswith(suffix)),
                 None)
    if dtype is None:
        raise ValueError(f"{str(path)!r}: name a raw token file NAME.uint16.bin or NAME.uint32.bin "
                         "(the dtype of its ids)")
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise ValueError(f"{str(path)!r} holds {size} bytes, not a positive whole number of "
                         f"{dtype.name} ids")
    return np.memmap(path, dtype=dtype, mode="r")


def _token_file(path: pathlib.Path) -> np.ndarray:
    """The memory-mapped ids of a token file (see `_open_token_file`), checked to be 1-D integers."""
    tokens = _open_token_file(path)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"{str(path)!r} must hold a 1-D integer token array, got {tokens.dtype} {tokens.shape}"
        )
    return tokens


def _check_ids(tokens: np.ndarray, vocab_size: int, source: str) -> np.ndarray:
    """`tokens`, after one pass (a chunk in memory at a time) checking every id is in
    [0, vocab_size)."""
    for start in range(0, tokens.size, CHECK_CHUNK):
        chunk = np.asarray(tokens[start:start + CHECK_CHUNK])
        if chunk.min() < 0 or chunk.max() >= vocab_size:
            raise ValueError(
                f"{source} holds token ids outside [0, {vocab_size}) (the model's vocabulary) "
                f"from id {start} on: min {chunk.min()}, max {chunk.max()}")
    return tokens


def _text_files(path: pathlib.Path | None) -> list[pathlib.Path]:
    """The text files of a corpus path (None: the built-in corpus); the path must exist."""
    if path is None:
        return stdlib_sources()
    if not path.is_dir():
        return [path]
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"directory {str(path)!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    return files


def load_tokens(path: str | pathlib.Path | None = None, tokenizer: str | pathlib.Path | None = None,
                vocab_size: int = VOCAB_SIZE) -> np.ndarray:
    """All tokens of a corpus as a 1-D integer array.

    Args:
      path: None for the default corpus (the standard library's `.py` sources); a text file; a
        directory (its text files, recursively, in sorted order); or a token file of ids in
        [0, vocab_size): a `.npy` array or raw `NAME.uint16.bin` / `NAME.uint32.bin` ids, both
        memory-mapped (`np.memmap`), so they may be larger than memory.
      tokenizer: a Hugging Face `tokenizer.json` that tokenizes the text (see `tokenize`);
        without it every byte is a token.
      vocab_size: the model's vocabulary; every id must be in [0, vocab_size).

    Returns:
      The tokens, shape `(num_tokens,)`: uint8 bytes, int32 ids of a tokenizer, or the token
      file's (memory-mapped) ids.

    Raises:
      FileNotFoundError: `path` does not exist.
      ValueError: a token file is unreadable or not 1-D integers, a directory holds no text
        files, or an id is outside [0, vocab_size).
    """
    if path is not None:
        path = pathlib.Path(path)
        if not path.exists():
            raise FileNotFoundError(f"data path {str(path)!r} does not exist")
        if path.suffix in (".npy", ".bin"):
            return _check_ids(_token_file(path), vocab_size, repr(str(path)))
    if tokenizer is None:
        return _check_ids(_read_text_files(_text_files(path)), vocab_size, "the corpus")
    return _check_ids(tokenize(path, tokenizer), vocab_size,
                      f"the tokenization by {str(tokenizer)!r}")


def _cache_file(path: pathlib.Path | None, digest: str) -> pathlib.Path:
    """Where the token file of corpus `path` is cached: next to the data (the built-in corpus:
    in the user's cache directory)."""
    name = f".tokens-{digest}.npy"
    if path is None:
        root = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
        return root / "axonn_jax" / f"stdlib{name}"
    path = path.resolve()
    return path.with_name(path.name + name)


def tokenize(path: pathlib.Path | None, tokenizer: str | pathlib.Path) -> np.ndarray:
    """Token ids of a text corpus under a Hugging Face tokenizer file.

    The files are concatenated in order, no special tokens added. The ids are cached as a `.npy`
    token file next to the data (the built-in corpus: in the user's cache directory), named by a
    digest of the tokenizer and the files' names, sizes and modification times (a changed file
    or tokenizer tokenizes again).

    Args:
      path: a text file or a directory of them; None: the built-in corpus.
      tokenizer: the tokenizer file (`tokenizer.json`).

    Returns:
      The int32 ids, shape `(num_tokens,)`.

    Raises:
      ImportError: the `tokenizers` package is not installed.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError("tokenizing with a tokenizer.json needs tokenizers: pip install "
                          "'axonn_jax[hf]'") from e

    tokenizer = pathlib.Path(tokenizer)
    files = _text_files(path)
    digest = hashlib.sha256(tokenizer.read_bytes())
    for f in files:
        stat = f.stat()
        digest.update(f"{f.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    cache = _cache_file(path, digest.hexdigest()[:16])
    if cache.is_file():
        return np.load(cache)
    encoder = Tokenizer.from_file(str(tokenizer))
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    ids = [np.asarray(e.ids, np.int32) for e in encoder.encode_batch(texts, add_special_tokens=False)]
    tokens = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")  # several processes may race
    with open(partial, "wb") as out:
        np.save(out, tokens)
    os.replace(partial, cache)
    return tokens


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Train and validation token streams (validation is the last `val_fraction` of the corpus)."""

    train: np.ndarray
    val: np.ndarray

    @classmethod
    def load(cls, path=None, val_fraction: float = 0.05, min_tokens: int = 0, tokenizer=None,
             vocab_size: int = VOCAB_SIZE) -> "Corpus":
        """The corpus at `path` (see `load_tokens`), split into train and validation.

        Args:
          path: the corpus, as `load_tokens` takes it (None: the built-in corpus).
          val_fraction: the share of the tokens, at the end, that validation holds.
          min_tokens: the fewest tokens each of train and validation holds.
          tokenizer: a `tokenizer.json`, as `load_tokens` takes it.
          vocab_size: the model's vocabulary.

        Returns:
          The `Corpus`.

        Raises:
          ValueError: the corpus holds fewer than `2 * min_tokens` tokens (or as `load_tokens`).
        """
        tokens = load_tokens(path, tokenizer, vocab_size)
        n_val = max(int(len(tokens) * val_fraction), min_tokens)
        if len(tokens) - n_val < min_tokens:
            raise ValueError(
                f"corpus has {len(tokens)} tokens; need at least {2 * min_tokens} "
                f"(train and validation each hold one sequence of {min_tokens})"
            )
        return cls(train=tokens[:-n_val], val=tokens[-n_val:])


def batch_offsets(num_tokens: int, seed: int, step: int, batch_size: int, seq_len: int) -> np.ndarray:
    """Start offsets of the sequences of batch `step`: a pure function of its inputs.

    Args:
      num_tokens: the length of the token stream.
      seed: the run's seed.
      step: the batch's step.
      batch_size: sequences per batch.
      seq_len: tokens per sequence (each window reads `seq_len + 1`).

    Returns:
      Offsets of shape `(batch_size,)`, uniform in [0, num_tokens - seq_len - 1).

    Raises:
      ValueError: the stream is too short for one sequence.
    """
    high = num_tokens - seq_len - 1
    if high < 1:
        raise ValueError(f"corpus of {num_tokens} tokens is too short for sequences of {seq_len}")
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, high, size=batch_size)


def batch_rows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> np.ndarray:
    """The token windows that start at `offsets`: inputs are `[:, :-1]`, targets `[:, 1:]`.

    Args:
      tokens: the token stream, shape `(num_tokens,)`.
      offsets: start offsets, shape `(rows,)`.
      seq_len: tokens per sequence.

    Returns:
      int32 rows of shape `(rows, seq_len + 1)`.
    """
    idx = offsets[:, None] + np.arange(seq_len + 1)[None, :]
    return tokens[idx].astype(np.int32)


def lm_batch(tokens: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int) -> dict:
    """Language-model batch `step` of random windows of `tokens`; a pure function of its arguments.

    Args:
      tokens: the token stream, shape `(num_tokens,)`.
      seed: the run's seed.
      step: the batch's step.
      batch_size: sequences per batch.
      seq_len: tokens per sequence.

    Returns:
      `{'inputs', 'targets'}`, each int32 of shape `(batch_size, seq_len)` (the targets are the
      inputs shifted by one token).
    """
    rows = batch_rows(tokens, batch_offsets(len(tokens), seed, step, batch_size, seq_len), seq_len)
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


@dataclasses.dataclass(frozen=True)
class TokenBatches:
    """`batches(step)`: batch `step` of random windows of a token stream (see `lm_batch`)."""

    tokens: np.ndarray
    seed: int
    batch_size: int
    seq_len: int

    def __call__(self, step: int) -> dict:
        return lm_batch(self.tokens, self.seed, step, self.batch_size, self.seq_len)
