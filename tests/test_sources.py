"""Document sources on Grain (run/sources.py, run/packing.py, run/loader.py): real JSONL, Parquet,
ArrayRecord, text and token files written here; packing invariants; mixture proportions; exact
resume (also on another number of processes or workers); per-process shares; bad input."""
import collections
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

# The `data` extra (grain, pyarrow, array_record): `make test` installs it, its absence is a failure.
import pyarrow as pa
import pyarrow.parquet as pq
from array_record.python.array_record_module import ArrayRecordWriter

from axonn_jax.run import data as data_lib
from axonn_jax.run import loader, packing, sources

from conftest import parse_python

REPO = pathlib.Path(__file__).resolve().parents[1]
SEQ = 16  # rows of 17 tokens
LOREM = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do".split()


def text(tag: str, i: int) -> str:
    """Document i of source `tag`: unique (its first word), 5 to 54 characters."""
    return f"{tag}{i:03d} " + " ".join(LOREM[:(i * 7) % 8])


def write_jsonl(path, records, blank_at=None):
    lines = [json.dumps(r) for r in records]
    if blank_at is not None:
        lines.insert(blank_at, "")
    path.write_text("\n".join(lines) + "\n")


def write_array_record(path, records):
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for r in records:
        writer.write(json.dumps(r).encode())
    writer.close()


def ids_doc(i: int) -> list[int]:
    """Pre-tokenized document i: ids unique over all documents (1000·(i+1) + t), 1 to 45 long
    (several longer than a row of 17)."""
    return [1000 * (i + 1) + t for t in range(1 + (i * 13) % 45)]


@pytest.fixture(scope="module", autouse=True)
def index_cache(tmp_path_factory):
    """Indexes go to a temporary cache, not the user's."""
    old = os.environ.get("AXONN_JAX_CACHE")
    os.environ["AXONN_JAX_CACHE"] = str(tmp_path_factory.mktemp("index-cache"))
    yield
    if old is None:
        del os.environ["AXONN_JAX_CACHE"]
    else:
        os.environ["AXONN_JAX_CACHE"] = old


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    write_jsonl(d / "a.jsonl", [{"text": text("a", i), "n": i} for i in range(80)], blank_at=5)
    pq.write_table(pa.table({"text": [text("b", i) for i in range(40)]}), d / "b.parquet",
                   row_group_size=7)
    write_array_record(d / "c.array_record", [{"body": text("c", i)} for i in range(30)])
    write_jsonl(d / "a2.jsonl", [{"text": text("x", i)} for i in range(5)])
    write_jsonl(d / "ids.jsonl", [{"ids": ids_doc(i)} for i in range(60)])
    (d / "texts").mkdir()
    for i in range(3):
        (d / "texts" / f"{i}.txt").write_text(text("t", i))
    ids = [t for i in range(5) for t in [*range(10 * i + 1, 10 * i + 4), 0]] + [7, 8]
    np.save(d / "tok.npy", np.asarray(ids, np.int32))
    return d


def segments(batch):
    """Each row's segments as (row, start, length), in order."""
    out = []
    for r, seg in enumerate(batch["segment_ids"]):
        full = np.append(seg, 0)
        for s in range(1, seg.max() + 1):
            idx = np.flatnonzero(full == s)
            out.append((r, idx[0], len(idx)))
    return out


def first_words(batches):
    """The tags of the documents whose first token starts a segment of the batches (e.g.
    'a017'; not the pieces of a split document after its first)."""
    words = []
    for b in batches:
        for r, start, n in segments(b):
            word = data_lib.decode(b["inputs"][r, start:start + n]).split(" ")[0]
            if word[:1] in "abct" and word[1:].isdigit():
                words.append(word)
    return words


def config(*specs, **kw):
    return loader.DataConfig.from_dict({"sources": list(specs), **kw})


def take(batches, n):
    return [next(batches) for _ in range(n)]


def same(xs, ys):
    return len(xs) == len(ys) and all(
        set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(xs, ys))


# ----------------------------------------------------------------------------- sources

def test_every_format_reads_its_documents(corpus):
    eos = 0
    jsonl = sources.open_source(str(corpus / "a.jsonl"), sources.Field(), eos)
    assert len(jsonl) == 81  # 80 lines and a blank one (an empty document)
    assert jsonl[0] == (f"{corpus}/a.jsonl:1", text("a", 0), None)
    assert jsonl[5].text == "" and jsonl[6].text == text("a", 5) and jsonl[80].where.endswith(":81")
    parquet = sources.open_source(str(corpus / "b.parquet"), sources.Field(), eos)
    assert len(parquet) == 40 and [parquet[i].text for i in (0, 6, 7, 39)] == \
        [text("b", i) for i in (0, 6, 7, 39)]  # across row groups of 7
    records = sources.open_source(str(corpus / "c.array_record"), sources.Field(text="body"), eos)
    assert len(records) == 30 and records[29].text == text("c", 29)
    ids = sources.open_source(str(corpus / "ids.jsonl"), sources.Field(ids="ids"), eos)
    assert ids[3].ids.tolist() == ids_doc(3)
    texts = sources.open_source(str(corpus / "texts"), sources.Field(), eos)
    assert [texts[i].text for i in range(3)] == [text("t", i) for i in range(3)]
    tokens = sources.open_source(str(corpus / "tok.npy"), sources.Field(), eos)
    assert len(tokens) == 6 and tokens[1].ids.tolist() == [11, 12, 13] and \
        tokens[5].ids.tolist() == [7, 8]  # the last document has no end-of-document id
    both = sources.open_source(str(corpus / "a*.jsonl"), sources.Field(), eos)  # a glob: 2 files
    assert len(both) == 86 and both[81] == (f"{corpus}/a2.jsonl:1", text("x", 0), None)
    # Readers pickle without their handles (Grain's workers open their own).
    import pickle
    assert pickle.loads(pickle.dumps(parquet))[8].text == text("b", 8)
    assert pickle.loads(pickle.dumps(records))[2].text == text("c", 2)


def test_tokenizer_json_and_end_of_document(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "</s>", *sorted({w for i in range(80) for w in text("a", i).split()})]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    eos = sources.resolve_eos(tmp_path / "tokenizer.json", None, 256)
    assert eos == 1
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[UNK]"}))
    assert sources.resolve_eos(tmp_path / "tokenizer.json", None, 256) == 0
    assert sources.resolve_eos(None, None, 256) == sources.BYTE_EOS
    assert sources.resolve_eos(tmp_path / "tokenizer.json", 7, 256) == 7
    doc = sources.Document("x", text=text("a", 12))
    out = sources.DocumentTokenizer(tmp_path / "tokenizer.json", 1, 256)(doc)
    assert out.ids.tolist() == [words.index(w) for w in text("a", 12).split()] + [1]
    assert sources.DocumentTokenizer(None, 0, 256)(doc).ids.tolist() == \
        [*data_lib.encode(text("a", 12)).tolist(), 0]
    # Batches tokenize with it: the rows hold the word ids.
    (tmp_path / "tokenizer_config.json").unlink()
    batches = loader.make_batches(config(str(corpus / "a.jsonl"), prefetch=0), SEQ, 2,
                                  tmp_path / "tokenizer.json", 0, 1, vocab_size=len(words))
    b = next(batches)
    assert b["inputs"].max() < len(words) and (b["inputs"] == 1).any()  # EOS ids in the rows
    # No end-of-document token: one line naming the fix.
    words.remove("</s>")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="names no end-of-document token.*eos_id"):
        sources.resolve_eos(tmp_path / "tokenizer.json", None, 256)


# ----------------------------------------------------------------------------- packing

def one_pass(reader, streams, split_long, tokenize):
    """All rows of one epoch of every stream (the loader's own stream functions), per stream."""
    part = loader.split_documents(reader, 0.0, "train", "ids")
    shuffled = loader.shuffle_sources([part], seed=3, epochs=1)
    out = []
    for r in range(streams):
        doc_at = loader._Stream(loader.stream_documents(shuffled, [1.0], tokenize, r, streams))
        rows, position = [], (0, 0)
        while position[0] < len(doc_at.docs):
            row, position = packing.pack_row(doc_at, position, SEQ + 1, split_long)
            rows.append(row)
        out.append(packing.lm_batch(*map(np.stack, zip(*rows))))
    return out


def test_packing_keeps_documents_whole_and_every_token_once(corpus):
    """One epoch over 60 pre-tokenized documents (ids unique over all of them; 1 to 45 tokens,
    rows of 17) in 3 streams: every document's consecutive pairs are (input, target) pairs exactly
    once and there is no other pair; documents that fit a row are one whole segment; segments and
    positions are consistent; long documents are split."""
    reader = sources.open_source(str(corpus / "ids.jsonl"), sources.Field(ids="ids"), 0)
    tokenize = sources.DocumentTokenizer(None, 0, None)
    batches = one_pass(reader, 3, True, tokenize)
    docs = [tokenize(reader[i]).ids for i in range(len(reader))]
    expected = collections.Counter((int(a), int(b)) for d in docs for a, b in zip(d[:-1], d[1:]))
    pairs, whole = collections.Counter(), set()
    for b in batches:
        valid = b["targets"] != packing.IGNORE
        pairs.update(zip(b["inputs"][valid].tolist(), b["targets"][valid].tolist()))
        for r, start, n in segments(b):
            assert (b["positions"][r, start:start + n] == np.arange(n)).all()
            # Targets inside a segment are its next tokens; its last one's is IGNORE unless it
            # ends the row (then the row's extra token is the target).
            assert (b["targets"][r, start:start + n - 1] == b["inputs"][r, start + 1:start + n]).all()
            if start + n < SEQ:
                assert b["targets"][r, start + n - 1] == packing.IGNORE
            tail = b["targets"][r, -1]  # the row's last token, when it continues the segment
            whole.add((*b["inputs"][r, start:start + n],
                       *([tail] if start + n == SEQ and tail != packing.IGNORE else [])))
        # Segment ids count up from 1; padding (0) only at the end of a row.
        for seg in b["segment_ids"]:
            used = seg[seg > 0]
            assert (np.diff(used) >= 0).all() and used[0] == 1 and (seg[len(used):] == 0).all()
    assert pairs == expected
    short = [d for d in docs if len(d) <= SEQ + 1]  # each one whole segment, with its EOS
    assert all(tuple(d) in whole for d in short)
    assert sum(len(d) > SEQ + 1 for d in docs) >= 10  # the split path ran
    # Refused instead: the first long document stops the pass with one line naming it.
    with pytest.raises(ValueError, match=r"ids\.jsonl:\d+: a document of \d+ tokens .* longer "
                                         r"than a row of seq_len \+ 1 = 17"):
        one_pass(reader, 3, False, tokenize)


def test_ignored_targets_get_no_loss_and_no_gradient():
    """The models' loss (gpt.cross_entropy, a one-hot contraction) gives IGNORE targets zero loss
    and zero gradient: the loss of a packed batch is the sum over its real targets (divided by all
    positions)."""
    import jax
    import jax.numpy as jnp

    from axonn_jax.models.gpt import cross_entropy

    logits = jax.random.normal(jax.random.key(0), (2, 5, 11))
    targets = jnp.array([[3, 4, packing.IGNORE, 1, 2], [packing.IGNORE] * 4 + [7]])
    loss, grad = jax.value_and_grad(cross_entropy)(logits, targets)
    logp = jax.nn.log_softmax(logits)
    valid = np.asarray(targets) != packing.IGNORE
    picked = np.take_along_axis(np.asarray(logp), np.maximum(np.asarray(targets), 0)[..., None],
                                -1)[..., 0]
    np.testing.assert_allclose(loss, -(picked * valid).sum() / valid.size, rtol=1e-6)
    assert not np.asarray(grad)[~valid].any() and np.asarray(grad)[valid].any()


def test_epoch_shuffle_is_a_new_permutation_every_epoch():
    """Both ways of shuffling (a table for small sets, Grain's index_shuffle for large ones): every
    epoch is a permutation of the documents, epochs differ, the same seed gives the same order."""
    import grain

    for table_max in (loader.EpochShuffle.TABLE_MAX, 0):
        shuffled = loader.EpochShuffle(grain.MapDataset.range(50), seed=7, epochs=3)
        shuffled.TABLE_MAX = table_max
        order = [shuffled[i] for i in range(150)]
        epochs = [order[:50], order[50:100], order[100:]]
        assert all(sorted(e) == list(range(50)) for e in epochs)
        assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(50))
        again = loader.EpochShuffle(grain.MapDataset.range(50), seed=7, epochs=3)
        again.TABLE_MAX = table_max
        assert [again[i] for i in range(150)] == order


# ----------------------------------------------------------------------------- mixtures

def test_mixture_draws_documents_in_the_stated_proportions(corpus):
    """Weights 2:1:1 over JSONL, Parquet and ArrayRecord: Grain's mix is deterministic, so in
    each stream the count of each source after j documents is within 1 of j·w (no sampling
    error); over G = 8 streams within 8 documents of the whole count (stated bound)."""
    cfg = config({"path": str(corpus / "a.jsonl"), "weight": 2.0},
                 {"path": str(corpus / "b.parquet"), "weight": 1.0},
                 {"path": str(corpus / "c.array_record"), "weight": 1.0, "text_field": "body"},
                 val_fraction=0.0, prefetch=0)
    words = first_words(take(loader.make_batches(cfg, 64, 8, None, 0, 1), 12))
    counts = collections.Counter(w[0] for w in words)
    total = sum(counts.values())
    assert total > 150
    for tag, weight in (("a", 0.5), ("b", 0.25), ("c", 0.25)):
        assert abs(counts[tag] - weight * total) <= 8, (counts, total)
    # Weights 1:3 change the proportions accordingly.
    cfg = config({"path": str(corpus / "a.jsonl"), "weight": 1},
                 {"path": str(corpus / "b.parquet"), "weight": 3}, val_fraction=0.0, prefetch=0)
    counts = collections.Counter(w[0] for w in first_words(
        take(loader.make_batches(cfg, 64, 8, None, 0, 1), 8)))
    assert abs(counts["b"] - 0.75 * sum(counts.values())) <= 8, counts


# ----------------------------------------------------------------------------- resume and shares

MIXTURE = ({"path": "a.jsonl", "weight": 2}, {"path": "b.parquet"},
           {"path": "c.array_record", "text_field": "body"})


def mixture(corpus, **kw):
    return config(*[{**s, "path": str(corpus / s["path"])} for s in MIXTURE], **kw)


def test_resume_gives_the_batches_an_unbroken_run_reads(corpus):
    """Save after 3 batches (with a prefetch thread running ahead), restore into a fresh iterator
    from the JSON text: the next 3 batches are those of the unbroken run."""
    cfg = mixture(corpus, prefetch=3)
    unbroken = loader.make_batches(cfg, SEQ, 4, None, 0, 1)
    first = take(unbroken, 3)
    state = json.loads(json.dumps(unbroken.get_state()))
    rest = take(unbroken, 3)
    resumed = loader.make_batches(cfg, SEQ, 4, None, 0, 1)
    resumed.set_state(state)
    assert same(take(resumed, 3), rest)
    assert not same(first, rest)
    # Another seq_len (or seed, sources, global batch) is other data: refused in one line.
    with pytest.raises(loader.DataStateMismatch, match="saved for other data"):
        loader.make_batches(cfg, SEQ + 1, 4, None, 0, 1).set_state(state)
    with pytest.raises(loader.DataStateMismatch, match="saved for other data"):
        loader.make_batches(mixture(corpus, seed=1), SEQ, 4, None, 0, 1).set_state(state)
    # A damaged state (the checkpoint falls back to an older step): a ValueError, never a crash.
    damaged = {**state, "positions": {**state["positions"], "0": ["x", 1]}}
    for bad in (damaged, {"version": 1}, [], {**state, "version": 0}):
        with pytest.raises(loader.DataStateMismatch):
            resumed.set_state(bad)


def test_process_shares_are_disjoint_cover_the_batch_and_resume_on_other_counts(corpus):
    """2 processes hold rows [0, 4) and [4, 8) of the single process's batches and read half its
    documents each; their merged state restores on 4 processes (and on 1) exactly."""
    cfg = mixture(corpus, prefetch=0)
    single = loader.make_batches(cfg, SEQ, 8, None, 0, 1)
    whole = take(single, 3)
    read_single = single.stats()["data_documents"]
    whole += take(single, 3)
    halves = [loader.make_batches(cfg, SEQ, 8, None, i, 2) for i in range(2)]
    assert [h.rows for h in halves] == [range(0, 4), range(4, 8)]
    parts = [take(h, 3) for h in halves]
    for step in range(3):
        joined = {k: np.concatenate([parts[0][step][k], parts[1][step][k]]) for k in whole[0]}
        assert same([joined], [whole[step]])
    words = [set(first_words(p)) for p in parts]
    assert not words[0] & words[1]  # no document read twice within these batches
    reads = [h.stats()["data_documents"] for h in halves]
    assert reads[0] + reads[1] == pytest.approx(read_single, rel=1e-12) and min(reads) > 0
    state = loader.merge_states([h.get_state() for h in halves])
    quarters = [loader.make_batches(cfg, SEQ, 8, None, i, 4) for i in range(4)]
    for q in quarters:
        q.set_state(state)
    got = [take(q, 3) for q in quarters]
    for step in range(3):
        joined = {k: np.concatenate([g[step][k] for g in got]) for k in whole[0]}
        assert same([joined], [whole[3 + step]])
    one = loader.make_batches(cfg, SEQ, 8, None, 0, 1)
    one.set_state(state)
    assert same(take(one, 3), whole[3:])
    with pytest.raises(loader.DataStateMismatch, match="no position for row"):
        one.set_state(halves[0].get_state())  # one process's state alone
    with pytest.raises(ValueError, match="global batch of 8 rows does not split over 3 processes"):
        loader.make_batches(cfg, SEQ, 8, None, 0, 3)


def test_grain_workers_make_the_same_batches(corpus):
    """2 Grain worker processes (mp_prefetch, each a slice of the streams) give the in-process
    batches; a state saved with workers restores without them."""
    cfg = mixture(corpus, prefetch=0)
    reference = take(loader.make_batches(cfg, SEQ, 4, None, 0, 1), 4)
    workers = loader.make_batches(mixture(corpus, workers=2, prefetch=1), SEQ, 4, None, 0, 1)
    assert same(take(workers, 2), reference[:2])
    state = workers.get_state()
    workers.close()
    plain = loader.make_batches(cfg, SEQ, 4, None, 0, 1)
    plain.set_state(state)
    assert same(take(plain, 2), reference[2:])


def test_validation_split_is_held_out_and_fixed(corpus):
    reader = sources.open_source(str(corpus / "a.jsonl"), sources.Field(), 0)
    val = loader.split_documents(reader, 0.1, "val", "a")
    train = loader.split_documents(reader, 0.1, "train", "a")
    val_docs = {val[i].where for i in range(len(val))}
    train_docs = {train[i].where for i in range(len(train))}
    assert len(val_docs) == 9 and len(train_docs) == 72 and not val_docs & train_docs
    cfg = config(str(corpus / "a.jsonl"), val_fraction=0.1, prefetch=0)
    val_words = {text.split(" ")[0] for text in (val[i].text for i in range(len(val))) if text}
    batches = take(loader.make_batches(cfg, 64, 4, None, 0, 1, split="val"), 3)
    assert set(first_words(batches)) <= val_words
    # The held-out documents do not depend on the run's seed; the batches are the same each time.
    other = config(str(corpus / "a.jsonl"), val_fraction=0.1, prefetch=0, seed=5)
    assert set(first_words(take(loader.make_batches(other, 64, 4, None, 0, 1, split="val"), 3))) \
        <= val_words
    assert same(take(loader.make_batches(cfg, 64, 4, None, 0, 1, split="val"), 3), batches)
    train_words = first_words(take(loader.make_batches(cfg, 64, 4, None, 0, 1), 10))
    assert not set(train_words) & val_words


# ----------------------------------------------------------------------------- bad input

def test_bad_input_gets_one_line_errors(corpus, tmp_path):
    def fails(error, match, **kw):
        with pytest.raises(error, match=match) as e:
            loader.make_batches(config(*kw.pop("specs"), prefetch=0, **kw), SEQ, 2, None, 0, 1,
                                vocab_size=256)
        assert "\n" not in str(e.value)

    fails(FileNotFoundError, "data source '.*missing.jsonl' does not exist",
          specs=[str(tmp_path / "missing.jsonl")])
    fails(ValueError, r"a\.jsonl:1: no field 'body' \(its fields: 'text', 'n'\)",
          specs=[{"path": str(corpus / "a.jsonl"), "text_field": "body"}])
    fails(ValueError, r"b\.parquet: no column 'body' \(its columns: 'text'\)",
          specs=[{"path": str(corpus / "b.parquet"), "text_field": "body"}])
    fails(ValueError, r"a\.jsonl:1: field 'n' is int, not a string",
          specs=[{"path": str(corpus / "a.jsonl"), "text_field": "n"}])
    fails(ValueError, r"ids\.jsonl:\d+: token ids outside \[0, 256\)",
          specs=[{"path": str(corpus / "ids.jsonl"), "ids_field": "ids"}])
    for weight in (0, -1.5, float("nan")):
        fails(ValueError, "weight must be a number > 0", specs=[{"path": "x.jsonl", "weight": weight}])
    fails(ValueError, "unknown key 'wieght'", specs=[{"path": "x.jsonl", "wieght": 2}])
    fails(ValueError, "long_documents must be one of split, refuse", specs=["x"],
          long_documents="truncate")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    fails(ValueError, "cannot read Parquet file .*bad.parquet", specs=[str(tmp_path / "bad.parquet")])
    (tmp_path / "bad.array_record").write_bytes(b"x" * 100)
    fails(ValueError, "cannot read ArrayRecord file .*bad.array_record",
          specs=[str(tmp_path / "bad.array_record")])
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "mixed" / "b.parquet").write_bytes(b"")
    fails(ValueError, "mixes formats", specs=[str(tmp_path / "mixed")])
    # A malformed line further in is found when it is read: `next` raises one line naming it, and
    # the iterator's state still holds the last good batch's position.
    lines = [json.dumps({"text": text("a", i)}) for i in range(20)]
    lines[7] = '{"text": "unterminated'
    (tmp_path / "broken.jsonl").write_text("\n".join(lines) + "\n")
    batches = loader.make_batches(config(str(tmp_path / "broken.jsonl"), val_fraction=0,
                                         prefetch=0), SEQ, 2, None, 0, 1)
    with pytest.raises(ValueError, match=r"broken\.jsonl:8: malformed JSON \(Unterminated string"):
        for _ in range(20):
            state = batches.get_state()
            next(batches)
    assert state["batches"] >= 1 and batches.get_state() == state


# ----------------------------------------------------------------------------- several processes

def test_launch_reads_per_host_and_assembles_global_batches(corpus, tmp_path):
    """`axonn-jax launch` with 2 processes of 2 devices (tests/data_hosts.py): each process reads
    its half of the rows (half the documents), the global arrays from
    `make_array_from_process_local_data` equal the single-process batches, and the gathered state
    (the same on both) restores exactly."""
    from test_distributed import cli, run

    from data_hosts import GLOBAL_BATCH, SEQ_LEN, STEPS

    spec = {"sources": [{**s, "path": str(corpus / s["path"])} for s in MIXTURE], "prefetch": 1}
    (tmp_path / "data.json").write_text(json.dumps(spec))
    run(cli("launch", "--nprocs", "2", "--devices-per-proc", "2", "--log-dir",
            str(tmp_path / "logs"), "--", str(REPO / "tests" / "data_hosts.py"),
            str(tmp_path / "data.json"), str(tmp_path)))
    procs = [json.loads((tmp_path / f"proc{i}.json").read_text()) for i in range(2)]
    assert [p["rows"] for p in procs] == [[0, 4], [4, 8]]
    assert procs[0]["state"] == procs[1]["state"]
    assert sorted(procs[0]["state"]["positions"], key=int) == [str(r) for r in range(8)]
    single = loader.make_batches(loader.DataConfig.from_dict(spec), SEQ_LEN, GLOBAL_BATCH, None, 0, 1)
    take(single, STEPS)
    assert single.get_state() == procs[0]["state"]
    reads = [p["documents"] for p in procs]
    assert sum(reads) == pytest.approx(single.stats()["data_documents"]) and min(reads) > 0


def test_core_package_does_not_need_grain():
    """Without the `data` extra the token-stream data still trains: only run/loader.py imports
    grain, pyarrow or array_record when it is imported (the readers import them inside the
    functions that need them), and no module imports run/loader.py when it is imported."""
    import ast

    extra = ("grain", "pyarrow", "array_record")
    found = {}
    for path in (REPO / "axonn_jax").rglob("*.py"):
        body = parse_python(path).body
        top = [n for stmt in body for n in ast.walk(stmt)
               if isinstance(n, (ast.Import, ast.ImportFrom))
               and not isinstance(stmt, (ast.FunctionDef, ast.ClassDef))]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names} | \
                {n.module or "" for n in top if isinstance(n, ast.ImportFrom)} | \
                {f"{n.module or ''}.{a.name}" for n in top if isinstance(n, ast.ImportFrom)
                 for a in n.names}
        found[path.relative_to(REPO).as_posix()] = names
    assert [p for p, names in found.items() if any(n.split(".")[0] in extra for n in names)] == \
        ["axonn_jax/run/loader.py"]
    assert not [p for p, names in found.items() if any(n.endswith("loader") for n in names)]
