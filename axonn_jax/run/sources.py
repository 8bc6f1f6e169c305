"""Documents from files: random access to the documents of JSONL, Parquet, ArrayRecord, text and
token files, and their tokenization (`DocumentTokenizer`).

A *reader* is a Grain random-access data source (`len(reader)`, `reader[i] -> Document`): nothing
is read or parsed until a document is asked for, so each process reads only the documents it
packs. Finding documents needs an index for two formats, built by one pass over the bytes (no
parsing, no tokenizing) and cached in the user's cache directory: the line starts of a JSONL file
and the end-of-document positions of a token file. Parquet files are read a row group at a time
(the last few are cached per process); ArrayRecord files through Grain's `ArrayRecordDataSource`.

| format | files | a document is |
|---|---|---|
| jsonl | `*.jsonl`, `*.ndjson` | one line: a JSON object, its `text_field` (a string) or `ids_field` (token ids) |
| parquet | `*.parquet` | one row: its `text_field` / `ids_field` column |
| array_record | `*.array_record*`, `*.arrayrecord` | one record: a JSON object, as in JSONL |
| text | `.txt .py .md ...` (see `data.TEXT_SUFFIXES`) | one whole file |
| tokens | `*.npy`, `*.uint16.bin`, `*.uint32.bin` | the ids up to each end-of-document id |

Errors name the file and the line / row / record: a malformed line, a field that does not exist, a
value of the wrong type (ValueError); a path that does not exist (FileNotFoundError).
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import glob
import hashlib
import json
import os
import pathlib
from typing import Any, NamedTuple

import numpy as np

from . import data as token_data

SOURCE_KEYS = ("path", "weight", "text_field", "ids_field")
"""The keys of one source of a mixture (`data.sources`: `run.loader`, `run.options`)."""


def source_fields(spec) -> dict:
    """The fields of one data source given as a mapping, checked.

    Args:
      spec: `{path, weight, text_field | ids_field}` (YAML's form).

    Returns:
      `spec` itself.

    Raises:
      ValueError: (one line) `spec` is not a mapping with a string `path`, or has a key not in
        `SOURCE_KEYS`.
    """
    if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
        raise ValueError(f"a data source is PATH[:WEIGHT] or {{path, weight, text_field | "
                         f"ids_field}}, got {spec!r}")
    unknown = sorted(set(spec) - set(SOURCE_KEYS))
    if unknown:
        raise ValueError(f"data source {spec['path']!r}: unknown key {unknown[0]!r} "
                         f"(known: {', '.join(SOURCE_KEYS)})")
    return spec


LONG_DOCUMENTS = ("split", "refuse")
"""What a document longer than a sequence gets: split over sequences, or refused."""

FORMATS = ("jsonl", "parquet", "array_record", "text", "tokens")
DEFAULT_TEXT_FIELD = "text"
BYTE_EOS = 0
"""End-of-document id without a tokenizer: byte 0 (NUL), which text does not contain."""
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
"""Tokens taken as end-of-document, in this order, when the tokenizer files name none."""
SCAN_CHUNK = 1 << 26
"""Bytes (or ids) scanned at a time when an index is built."""
PARQUET_GROUPS_CACHED = 4


class Document(NamedTuple):
    """A document as its file holds it: its text or ids, and where it is.

    Attributes:
      where: `file:line`, `file row N`, ... for error messages.
      text: the text (str), or None.
      ids: the token ids (1-D integers), or None.
    """

    where: str
    text: str | None = None
    ids: np.ndarray | None = None


class Tokens(NamedTuple):
    """A tokenized document and where it comes from.

    Attributes:
      ids: int32 ids ending with the end-of-document id (empty for an empty document).
      where: where the document comes from.
    """

    ids: np.ndarray
    where: str


@dataclasses.dataclass(frozen=True)
class Field:
    """Which field of a record holds the document: `text` (a string) or `ids` (token ids)."""

    text: str | None = None
    ids: str | None = None

    @property
    def name(self) -> str:
        """The field's name: `ids`, else `text`, else `DEFAULT_TEXT_FIELD`."""
        return self.ids if self.ids is not None else self.text or DEFAULT_TEXT_FIELD

    def document(self, value: Any, where: str) -> Document:
        """The document of a field's value.

        Args:
          value: a string, or a list / array of ids (None: no ids).
          where: where the value is, for errors.

        Returns:
          The `Document`.

        Raises:
          ValueError: a text field that is not a string, or an ids field that is not 1-D ids.
        """
        if self.ids is None:
            if not isinstance(value, str):
                raise ValueError(f"{where}: field {self.name!r} is {type(value).__name__}, not a "
                                 "string (name the field of token ids with ids_field)")
            return Document(where, text=value)
        ids = np.asarray(value if value is not None else [])
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"{where}: field {self.name!r} is not a list of token ids")
        return Document(where, ids=ids)

    def from_json(self, raw: bytes, where: str) -> Document:
        """The document of a JSON object's bytes.

        Args:
          raw: the bytes of one JSON object (blank: an empty document).
          where: where they are, for errors.

        Returns:
          The `Document` of the object's field.

        Raises:
          ValueError: malformed JSON, not an object, or no such field.
        """
        if not raw.strip():
            return Document(where, text="") if self.ids is None else Document(where, ids=np.zeros(0))
        try:
            record = json.loads(raw)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{where}: malformed JSON ({getattr(e, 'msg', e)})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: a JSON object expected, found {type(record).__name__}")
        if self.name not in record:
            fields = ", ".join(map(repr, list(record)[:8])) or "none"
            raise ValueError(f"{where}: no field {self.name!r} (its fields: {fields})")
        return self.document(record[self.name], where)


# ----------------------------------------------------------------------------- indexes

def cache_dir() -> pathlib.Path:
    """Where indexes are cached.

    Returns:
      `$AXONN_JAX_CACHE`, else `$XDG_CACHE_HOME/axonn_jax` (default `~/.cache/axonn_jax`).
    """
    root = os.environ.get("AXONN_JAX_CACHE")
    if root:
        return pathlib.Path(root)
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "axonn_jax"


def _scan(array: np.ndarray, value: int) -> np.ndarray:
    """Positions (int64) of `value` in a 1-D (memory-mapped) array, a chunk in memory at a time."""
    found = [np.flatnonzero(np.asarray(array[s:s + SCAN_CHUNK]) == value) + s
             for s in range(0, array.size, SCAN_CHUNK)]
    return np.concatenate(found).astype(np.int64) if found else np.zeros(0, np.int64)


def cached_index(path: pathlib.Path, kind: str, build) -> np.ndarray:
    """`build()`, cached as a `.npy` file under `cache_dir()`.

    The cache file is named by the file's resolved path, size and modification time and `kind`
    (a changed file builds again); a damaged one is built again.

    Args:
      path: the data file the index is of.
      kind: what the index is (e.g. `newlines`, `eos0`).
      build: makes the index, an int64 array.

    Returns:
      The index, memory-mapped when read back; where the cache cannot be written, the array
      kept in memory.
    """
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{kind}".encode())
    cache = cache_dir() / "index" / f"{path.name}.{key.hexdigest()[:20]}.npy"
    if cache.is_file():
        try:
            return np.load(cache, mmap_mode="r")
        except (OSError, ValueError):
            pass  # damaged (a crash while writing elsewhere): build again
    index = build()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")  # processes may race
        with open(partial, "wb") as out:
            np.save(out, index)
        os.replace(partial, cache)
    except OSError:
        return index
    return np.load(cache, mmap_mode="r")


# ----------------------------------------------------------------------------- readers

class _Lazy:
    """A reader whose open handles are made on first use in each process (readers are pickled
    into Grain's worker processes: `_handles` names what is not pickled)."""

    _handles: tuple[str, ...] = ()

    def __getstate__(self):
        return {k: (None if k in self._handles else v) for k, v in self.__dict__.items()}


class JsonlFile(_Lazy):
    """The lines of a JSONL file as documents (`where`: `file:line`)."""

    _handles = ("_fd",)

    def __init__(self, path: pathlib.Path, field: Field):
        self.path, self.field, self._fd = path, field, None
        size = path.stat().st_size
        self.newlines = cached_index(path, "newlines", lambda: _scan(
            np.memmap(path, np.uint8, mode="r") if size else np.zeros(0, np.uint8), ord("\n")))
        last = int(self.newlines[-1]) if len(self.newlines) else -1
        self._size, self._count = size, len(self.newlines) + (size > last + 1)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: int) -> Document:
        start = int(self.newlines[i - 1]) + 1 if i else 0
        end = int(self.newlines[i]) if i < len(self.newlines) else self._size
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self.field.from_json(os.pread(self._fd, end - start, start), f"{self.path}:{i + 1}")


class ParquetFile(_Lazy):
    """The rows of a Parquet file as documents, read a row group (one column) at a time."""

    _handles = ("_file", "_groups")

    def __init__(self, path: pathlib.Path, field: Field):
        self.path, self.field = path, field
        self._file, self._groups = self._open(), None
        names = self._file.schema_arrow.names
        if field.name not in names:
            raise ValueError(f"{path}: no column {field.name!r} (its columns: "
                             f"{', '.join(map(repr, names[:8]))})")
        meta = self._file.metadata
        self.starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])

    def _open(self):
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(self.path)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
            raise ValueError(f"cannot read Parquet file {self.path}: {e}") from None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _group(self, g: int) -> list:
        if self._file is None:
            self._file = self._open()
        if self._groups is None:
            self._groups = collections.OrderedDict()
        if g not in self._groups:
            self._groups[g] = self._file.read_row_group(g, columns=[self.field.name]).column(0).to_pylist()
            if len(self._groups) > PARQUET_GROUPS_CACHED:
                self._groups.popitem(last=False)
        return self._groups[g]

    def __getitem__(self, i: int) -> Document:
        g = bisect.bisect_right(self.starts, i) - 1
        return self.field.document(self._group(g)[i - self.starts[g]], f"{self.path} row {i}")


class ArrayRecordFile(_Lazy):
    """The records of an ArrayRecord file (each a JSON object, as a JSONL line) as documents."""

    _handles = ("_source",)

    def __init__(self, path: pathlib.Path, field: Field):
        self.path, self.field, self._source = path, field, None
        self._count = len(self._open())

    def _open(self):
        import grain

        if self._source is None:
            try:
                self._source = grain.sources.ArrayRecordDataSource([str(self.path)])
            except Exception as e:  # RuntimeError from the C++ reader
                raise ValueError(f"cannot read ArrayRecord file {self.path}: {e}") from None
        return self._source

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: int) -> Document:
        return self.field.from_json(self._open()[i], f"{self.path} record {i}")


class TextFiles:
    """Whole text files as documents (UTF-8; invalid bytes replaced)."""

    def __init__(self, files: list[pathlib.Path]):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> Document:
        f = self.files[i]
        return Document(str(f), text=f.read_bytes().decode("utf-8", errors="replace"))


class TokenFile(_Lazy):
    """The documents of a token file: the ids between end-of-document ids.

    The file is one of `data.load_tokens`'s formats and holds the end-of-document ids; a last
    document without one gets it (`DocumentTokenizer` appends it to every document).
    """

    _handles = ("_tokens",)

    def __init__(self, path: pathlib.Path, eos_id: int):
        self.path, self._tokens = path, None
        tokens = self._ids()
        self.ends = cached_index(path, f"eos{eos_id}", lambda: _scan(tokens, eos_id))
        last = int(self.ends[-1]) if len(self.ends) else -1
        self._size, self._count = tokens.size, len(self.ends) + (tokens.size > last + 1)

    def _ids(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = token_data._token_file(self.path)
        return self._tokens

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: int) -> Document:
        start = int(self.ends[i - 1]) + 1 if i else 0
        end = int(self.ends[i]) if i < len(self.ends) else self._size
        return Document(f"{self.path} document {i} (ids {start}..{end})",
                        ids=np.asarray(self._ids()[start:end]))


class Concat:
    """The documents of several readers, one after another."""

    def __init__(self, readers: list):
        self.readers = readers
        self.starts = np.cumsum([0] + [len(r) for r in readers])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> Document:
        k = bisect.bisect_right(self.starts, i) - 1
        return self.readers[k][i - int(self.starts[k])]


# ----------------------------------------------------------------------------- opening a source

def file_format(path: pathlib.Path) -> str | None:
    """The format of a file by its name.

    Args:
      path: a file.

    Returns:
      One of `FORMATS`, or None: not a data file.
    """
    name = path.name.lower()
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if ".array_record" in name or name.endswith(".arrayrecord"):
        return "array_record"
    if name.endswith(".npy") or any(name.endswith(s) for s in token_data.TOKEN_FILE_DTYPES):
        return "tokens"
    if path.suffix in token_data.TEXT_SUFFIXES:
        return "text"
    return None


def source_files(path: str) -> tuple[str, list[pathlib.Path]]:
    """The format and the files of a source path; all files of one source share one format.

    Args:
      path: a file, a directory (its data files, recursively, in sorted order) or a glob
        pattern.

    Returns:
      `(format, files)`.

    Raises:
      FileNotFoundError: the path does not exist or the glob matches no file.
      ValueError: a directory without data files, a file that is not a data file, or files of
        several formats.
    """
    if any(c in path for c in "*?["):
        files = sorted(pathlib.Path(p) for p in glob.glob(path, recursive=True))
        files = [f for f in files if f.is_file()]
        if not files:
            raise FileNotFoundError(f"data source {path!r} matches no file")
    elif pathlib.Path(path).is_dir():
        files = sorted(f for f in pathlib.Path(path).rglob("*") if f.is_file() and file_format(f))
        if not files:
            raise ValueError(f"data source {path!r}: the directory holds no data files")
    elif pathlib.Path(path).exists():
        files = [pathlib.Path(path)]
    else:
        raise FileNotFoundError(f"data source {path!r} does not exist")
    formats = {f: file_format(f) for f in files}
    unknown = [f for f, k in formats.items() if k is None]
    if unknown:
        raise ValueError(f"data source {path!r}: {str(unknown[0])!r} is not a data file "
                         "(.jsonl, .parquet, .array_record, a text file, .npy, .uint16.bin, .uint32.bin)")
    kinds = sorted(set(formats.values()))
    if len(kinds) > 1:
        raise ValueError(f"data source {path!r} mixes formats ({', '.join(kinds)}): give each its "
                         "own source")
    return kinds[0], files


def open_source(path: str, field: Field, eos_id: int):
    """A reader of all documents of a source path, checked.

    Every file opens and its first document has the field.

    Args:
      path: the source path (see `source_files`).
      field: the field of JSONL, Parquet and ArrayRecord records.
      eos_id: the end-of-document id that splits token files.

    Returns:
      A random-access reader (`len(reader)`, `reader[i] -> Document`).

    Raises:
      FileNotFoundError: as `source_files`.
      ValueError: a file does not open, a first document lacks the field, or the source holds
        no documents.
    """
    kind, files = source_files(path)
    if kind == "text":
        return TextFiles(files)
    if kind == "tokens":
        readers = [TokenFile(f, eos_id) for f in files]
    else:
        make = {"jsonl": JsonlFile, "parquet": ParquetFile, "array_record": ArrayRecordFile}[kind]
        readers = [make(f, field) for f in files]
    for reader in readers:
        if len(reader):
            reader[0]  # a wrong field or a file that is not JSON fails here, not hours later
    reader = readers[0] if len(readers) == 1 else Concat(readers)
    if not len(reader):
        raise ValueError(f"data source {path!r} holds no documents")
    return reader


# ----------------------------------------------------------------------------- tokenizing

def _tokenizer_eos(path: pathlib.Path, tokenizer) -> int | None:
    """The end-of-document id that a tokenizer's files name: `eos_token` of a
    `tokenizer_config.json` beside it, else the first of `EOS_NAMES` in its vocabulary."""
    config = path.with_name("tokenizer_config.json")
    names = list(EOS_NAMES)
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            names.insert(0, eos)
    return next((i for i in map(tokenizer.token_to_id, names) if i is not None), None)


def load_tokenizer(path: str | os.PathLike):
    """The Hugging Face tokenizer of a `tokenizer.json` (the `tokenizers` library).

    Args:
      path: the `tokenizer.json`.

    Returns:
      The `tokenizers.Tokenizer`.

    Raises:
      ImportError: `tokenizers` is not installed.
      ValueError: the file is missing or broken.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError("tokenizing with a tokenizer.json needs tokenizers: pip install "
                          "'axonn_jax[data]'") from e
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a missing or broken file
        raise ValueError(f"cannot read tokenizer {str(path)!r}: {e}") from None


def resolve_eos(tokenizer: str | os.PathLike | None, eos_id: int | None,
                vocab_size: int | None) -> int:
    """The end-of-document id, checked to be in [0, vocab_size).

    Args:
      tokenizer: a `tokenizer.json`, or None for byte-level tokens.
      eos_id: the id when given; else the tokenizer's (see `_tokenizer_eos`), else `BYTE_EOS`.
      vocab_size: the model's vocabulary (None: not checked above).

    Returns:
      The id.

    Raises:
      ValueError: the tokenizer names no end-of-document token, or the id is out of range.
    """
    if eos_id is None and tokenizer is not None:
        eos_id = _tokenizer_eos(pathlib.Path(tokenizer), load_tokenizer(tokenizer))
        if eos_id is None:
            raise ValueError(f"tokenizer {str(tokenizer)!r} names no end-of-document token "
                             f"({', '.join(EOS_NAMES)}); set the data config's eos_id")
    eos_id = BYTE_EOS if eos_id is None else int(eos_id)
    if eos_id < 0 or (vocab_size is not None and eos_id >= vocab_size):
        raise ValueError(f"eos_id {eos_id} is outside the model's vocabulary [0, {vocab_size})")
    return eos_id


class DocumentTokenizer:
    """`Document -> Tokens`: the tokenized text or the given ids, then the end-of-document id.

    The text is tokenized by a `tokenizer.json`, else one token per UTF-8 byte; every id is
    checked to be in [0, vocab_size). An empty document stays empty. Picklable: the tokenizer
    loads lazily in each process (Grain's workers tokenize).
    """

    def __init__(self, tokenizer: str | os.PathLike | None, eos_id: int, vocab_size: int | None):
        self.path = None if tokenizer is None else str(tokenizer)
        self.eos_id, self.vocab_size = eos_id, vocab_size
        self._tokenizer = None

    def __getstate__(self):
        return {**self.__dict__, "_tokenizer": None}

    def _encode(self, text: str) -> np.ndarray:
        if self.path is None:
            return token_data.encode(text)
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.path)
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def __call__(self, doc: Document) -> Tokens:
        ids = self._encode(doc.text) if doc.ids is None else doc.ids
        if ids.size == 0:
            return Tokens(np.zeros(0, np.int32), doc.where)
        if self.vocab_size is not None and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"{doc.where}: token ids outside [0, {self.vocab_size}) (the model's "
                             f"vocabulary): min {ids.min()}, max {ids.max()}")
        return Tokens(np.append(ids.astype(np.int32), np.int32(self.eos_id)), doc.where)
