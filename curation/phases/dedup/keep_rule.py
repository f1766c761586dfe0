"""The keep rule of dedup, plain numpy in and out: connected components over the pairs of every signal
(scipy.sparse.csgraph), one item kept per component, and for every dropped item the kept item of its component and
the signal that linked it. The components step runs it on whole components; the single-process reference on a pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class PairLike(Protocol):
    @property
    def i(self) -> np.ndarray: ...
    @property
    def j(self) -> np.ndarray: ...


@dataclass(frozen=True)
class DedupResult:
    """Per item: its component, whether it is kept, and for dropped items who they duplicate and why."""

    component: np.ndarray  # int64 label; items without any pair are singleton components
    keep: np.ndarray  # bool
    duplicate_of: np.ndarray  # int64: the kept item of the component, -1 for kept items
    linked_by: np.ndarray  # int8: index into ``signals`` of the edge that links it, -1 for kept items
    signals: tuple[str, ...]

    @property
    def n_dropped(self) -> int:
        return int((~self.keep).sum())

    def linked_by_name(self) -> list[str | None]:
        """``linked_by`` as signal names (None for kept items), e.g. for the ledger's reason column."""
        names = np.asarray([*self.signals, None], dtype=object)
        return names[self.linked_by].tolist()  # -1 picks the trailing None


def _canonical_edges(n: int, pairs: Mapping[str, PairLike]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted edge keys (lo * n + hi) and the signal of each; a pair in several signals gets the first one."""
    keys, codes = [], []
    for signal, p in enumerate(pairs.values()):
        i, j = np.asarray(p.i, np.int64), np.asarray(p.j, np.int64)
        if i.size and (min(i.min(), j.min()) < 0 or max(i.max(), j.max()) >= n):
            raise ValueError(f"pair indices of signal {list(pairs)[signal]!r} out of range [0, {n})")
        not_loop = i != j
        i, j = i[not_loop], j[not_loop]
        keys.append(np.minimum(i, j) * n + np.maximum(i, j))
        codes.append(np.full(i.size, signal, np.int8))
    key = np.concatenate(keys) if keys else np.empty(0, np.int64)
    code = np.concatenate(codes) if codes else np.empty(0, np.int8)
    order = np.lexsort((code, key))
    key, code = key[order], code[order]
    first = np.concatenate([[True], key[1:] != key[:-1]]) if key.size else np.empty(0, bool)
    return key[first], code[first]


def _keep_order(
    n: int,
    component: np.ndarray,
    keep: KeepAttributes,
    keys: np.ndarray | None,
) -> np.ndarray:
    """Items sorted by component, then best first by ``KeepAttributes``' order, then smaller key."""
    released = np.zeros(n, bool) if keep.released is None else np.asarray(keep.released, bool)
    res = np.zeros(n, np.int64)
    if keep.width is not None and keep.height is not None:
        res = np.asarray(keep.width, np.int64) * np.asarray(keep.height, np.int64)
    # an item without a quality or a score never beats one with it (NaN: unknown)
    q = np.full(n, np.nan) if keep.quality is None else np.asarray(keep.quality, dtype=np.float64)
    q = np.where(np.isnan(q), -np.inf, q)
    s = np.zeros(n) if keep.score is None else np.asarray(keep.score, dtype=np.float64)
    s = np.where(np.isnan(s), -np.inf, s)
    key_rank = np.arange(n) if keys is None else np.argsort(np.argsort(np.asarray(keys), kind="stable"))
    return np.lexsort((key_rank, -s, -q, -res, ~released, component))


@dataclass(frozen=True)
class KeepAttributes:
    """What the keep rule ranks the copies of one image by, in this order (each array per item, or None: all equal):

    1. ``released``: an image of the published release curated against, kept over any new copy;
    2. resolution, ``width * height``: a copy's pixels are what training can use; a resized copy lost some;
    3. ``quality``, the encoding quality (``common.encoding.encoding_quality``: a JPEG's IJG quality, 100 for a
       lossless encoding, NaN unknown): between copies of one size, the one re-saved at quality 40 loses;
    4. ``score``, the keep score (``dedup.keep_score`` in the settings; NaN: none), the models' judgement of the content.
    """

    released: np.ndarray | None = None
    width: np.ndarray | None = None
    height: np.ndarray | None = None
    quality: np.ndarray | None = None
    score: np.ndarray | None = None


def resolve_duplicates(
    n: int,
    pairs: Mapping[str, PairLike],
    attributes: KeepAttributes | None = None,
    *,
    keys: np.ndarray | None = None,
) -> DedupResult:
    """Group the ``n`` items by the pairs of every signal and keep one item per group.

    ``pairs`` maps a signal name ("phash", "embedding") to its pairs, in priority order: when both signals link
    the same two items the edge counts as the first signal's. The kept item of a component is the first by
    ``attributes`` (released, then resolution, encoding quality, score; see ``KeepAttributes``), then the smallest
    ``keys`` value (the item index when ``keys`` is None), so the choice is deterministic.

    ``linked_by`` of a dropped item is the signal of the first edge on its path to the kept item: a breadth-first
    search from the kept items gives every dropped item a shortest path to its kept item, and the edge from the
    item to its parent on that path is reported. A ``duplicate_of`` therefore may be reached through other
    dropped items (A~B by pHash, B~C by embedding: C is "embedding", duplicate_of A).
    """
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import breadth_first_order, connected_components

    signals = tuple(pairs)
    if n == 0:
        empty = np.empty(0, np.int64)
        return DedupResult(empty, np.empty(0, bool), empty.copy(), np.empty(0, np.int8), signals)
    edge_key, edge_code = _canonical_edges(n, pairs)
    lo, hi = edge_key // n, edge_key % n
    graph = csr_matrix((np.ones(lo.size, np.int8), (lo, hi)), shape=(n, n))
    _, component = connected_components(graph, directed=False)
    component = component.astype(np.int64)

    order = _keep_order(n, component, attributes or KeepAttributes(), keys)
    first = np.concatenate([[True], component[order][1:] != component[order][:-1]])
    kept_of = np.empty(component.max() + 1, np.int64)
    kept_of[component[order][first]] = order[first]
    keep = np.zeros(n, bool)
    keep[order[first]] = True

    duplicate_of = np.where(keep, -1, kept_of[component])
    linked_by = np.full(n, -1, np.int8)
    dropped = np.flatnonzero(~keep)
    if dropped.size:
        # BFS from a virtual root joined to every kept item: each dropped item's predecessor is the next item
        # on a shortest path towards its own component's kept item.
        roots = np.unique(duplicate_of[dropped])
        rows = np.concatenate([lo, np.full(roots.size, n)])
        cols = np.concatenate([hi, roots])
        tree = csr_matrix((np.ones(rows.size, np.int8), (rows, cols)), shape=(n + 1, n + 1))
        _, pred = breadth_first_order(tree, n, directed=False, return_predecessors=True)
        parent = pred[dropped].astype(np.int64)
        query = np.minimum(dropped, parent) * n + np.maximum(dropped, parent)
        linked_by[dropped] = edge_code[np.searchsorted(edge_key, query)]
    return DedupResult(component, keep, duplicate_of.astype(np.int64), linked_by, signals)
