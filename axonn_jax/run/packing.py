"""Packing whole documents into language-model rows, with segment ids and positions.

A row holds `seq_len + 1` tokens: documents one after another, each ending with its
end-of-document (EOS) token, then padding. Every document of a row is one *segment* (ids 1, 2, ...
in the row; 0 is padding) and its positions restart at 0. The batch of rows `(n, seq_len + 1)`
is `{'inputs': rows[:, :-1], 'targets': rows[:, 1:], 'segment_ids', 'positions'}` (the last two
of the inputs), every leaf `(n, seq_len)` int32, where a target is the next token *of the same
document*: the target of a document's EOS (the next document's first token) and of padding is
`IGNORE` (-1). The target of a document's last token is its EOS. The first token of a document is
never a target (nothing precedes it). A loss that weights `one_hot(targets)` gives `IGNORE`
targets no loss and no gradient.

Documents are packed greedily in order: a document that does not fit in what is left of a row
starts the next one (the rest is padding). A document longer than a row is refused (ValueError
naming it), or, with `split_long`, cut into pieces that fill rows: a piece fills what is left of
the current row (when at least 2 tokens are left) and each next piece starts one token before the
previous one ended, so that every token of the document but its first is a target exactly once.
Each piece is its own segment (positions restart at 0).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

IGNORE = -1
"""The target of a position whose next token belongs to another document, or of padding."""


def pack_row(doc_at: Callable, position: tuple[int, int], row_len: int, split_long: bool):
    """One row of packed documents and the position after it.

    Args:
      doc_at: `doc_at(j)`: the j-th document of the stream (`sources.Tokens`: ids ending with
        EOS, `where`), None past its end.
      position: `(j, offset)`: the next document and how many of its tokens earlier rows took
        (a split document).
      row_len: tokens per row (`seq_len + 1`).
      split_long: cut documents longer than a row into pieces (else refuse them).

    Returns:
      `((tokens, segment_ids, positions), next position)`, each array `(row_len,)` int32
      (padding: token 0, segment 0, position 0).

    Raises:
      ValueError: a document longer than a row, without `split_long`.
    """
    tokens, segments, positions = (np.zeros(row_len, np.int32) for _ in range(3))
    j, offset = position
    used = segment = 0
    while used < row_len and (doc := doc_at(j)) is not None:
        ids, space = doc.ids, row_len - used
        if len(ids) > row_len and not split_long:
            raise ValueError(f"{doc.where}: a document of {len(ids)} tokens (with its end-of-document "
                             f"token) is longer than a row of seq_len + 1 = {row_len}; set "
                             "long_documents: split, or a longer seq_len")
        if len(ids) - offset <= space:
            take, after = len(ids) - offset, (j + 1, 0)
        elif len(ids) > row_len and space >= 2:
            take, after = space, (j, offset + space - 1)
        else:
            break  # a whole document waits for the next row
        if take:  # (an empty document takes nothing)
            segment += 1
            tokens[used:used + take] = ids[offset:offset + take]
            segments[used:used + take] = segment
            positions[used:used + take] = np.arange(take)
        used += take
        j, offset = after
    return (tokens, segments, positions), (j, offset)


def lm_batch(tokens: np.ndarray, segments: np.ndarray, positions: np.ndarray) -> dict:
    """The language-model batch of packed rows.

    Args:
      tokens: the rows' tokens, `(n, seq_len + 1)` int32.
      segments: their segment ids, `(n, seq_len + 1)` (0: padding).
      positions: their positions in their segments, `(n, seq_len + 1)`.

    Returns:
      `{'inputs', 'targets', 'segment_ids', 'positions'}`, each `(n, seq_len)` int32, targets
      `IGNORE` where the next token is another segment's or padding.
    """
    same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0)
    return {"inputs": tokens[:, :-1], "targets": np.where(same, tokens[:, 1:], IGNORE).astype(np.int32),
            "segment_ids": segments[:, :-1], "positions": positions[:, :-1]}
