"""Tree attention masks for speculative decoding: a token tree verified in one prefill step.

A draft model proposes a tree of candidate tokens after a request's prefix (whose KV is in the
cache). The target model scores every tree token at once: tree token ``i`` sees the whole
prefix, its ancestors and itself, and nothing of the other branches. The tree is a parent array,
``parent[i] < i`` (topological order) and ``-1`` for a root hung directly after the prefix, so
a forest of several roots is allowed.

The mask of one tree is bool ``[n, prefix_len + n]``: the KV of the request is the prefix
followed by the ``n`` tree tokens in index order. For a batch, FlashInfer takes each request's
mask flattened row-major and concatenated (``custom_mask``), or each request's flat mask packed
separately in little bit order with byte offsets ``mask_indptr`` (``packed_custom_mask``).

Positions for rotary embeddings are ``prefix_len + depth`` (siblings share a position), not the
row index: rotate q and k with :func:`tree_positions` before attention, as a fused
``ROPE_LLAMA`` would place tree token ``i`` at ``prefix_len + i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import as_index_array, check_positive_int
from .masks import segment_packbits

__all__ = ["TreeMaskBatch", "batch_tree_masks", "plot_tree_mask", "tree_ancestors",
           "tree_depths", "tree_mask", "tree_positions"]


def _check_parent(parent, name: str = "parent") -> np.ndarray:
    par = as_index_array(name, parent).astype(np.int64)
    bad = (par < -1) | (par >= np.arange(par.size))
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}] must be -1 (a root) or an earlier token in [0, {i}), "
                         f"got {par[i]}")
    return par


def tree_ancestors(parent) -> np.ndarray:
    """Ancestor-or-self relation of a token tree.

    Parameters
    ----------
    parent : array of int, shape [n]
        ``parent[i]`` in ``[0, i)``, or ``-1`` for a root.

    Returns
    -------
    numpy.ndarray of bool, shape [n, n]
        ``[i, j]`` is True when ``j == i`` or ``j`` is an ancestor of ``i``.
    """
    par = _check_parent(parent)
    anc = np.eye(par.size, dtype=bool)
    for i in range(par.size):  # parents come first, so their rows are complete
        if par[i] >= 0:
            anc[i] |= anc[par[i]]
    return anc


def tree_depths(parent) -> np.ndarray:
    """Depth of every tree token (roots 0), int32 ``[n]``; ``parent`` as in :func:`tree_ancestors`."""
    par = _check_parent(parent)
    depth = np.zeros(par.size, dtype=np.int32)
    for i in range(par.size):
        depth[i] = depth[par[i]] + 1 if par[i] >= 0 else 0
    return depth


def tree_positions(parent, prefix_len: int = 0) -> np.ndarray:
    """Sequence positions of the tree tokens for RoPE: ``prefix_len + depth``, int32 ``[n]``.

    Parameters
    ----------
    parent : array of int, shape [n]
        As in :func:`tree_ancestors`.
    prefix_len : int
        Tokens before the tree (positions ``0 .. prefix_len - 1``), >= 0.
    """
    prefix_len = check_positive_int("prefix_len", prefix_len, minimum=0)
    return (tree_depths(parent) + prefix_len).astype(np.int32)


def tree_mask(parent, prefix_len: int = 0) -> np.ndarray:
    """Attention mask of one token tree after a prefix.

    Parameters
    ----------
    parent : array of int, shape [n]
        As in :func:`tree_ancestors`.
    prefix_len : int
        Prefix tokens every tree token sees, >= 0.

    Returns
    -------
    numpy.ndarray of bool, shape [n, prefix_len + n]
        Row ``i`` keeps the prefix columns, and column ``prefix_len + j`` for ``j`` an
        ancestor of ``i`` or ``i`` itself.
    """
    prefix_len = check_positive_int("prefix_len", prefix_len, minimum=0)
    anc = tree_ancestors(parent)
    return np.concatenate([np.ones((anc.shape[0], prefix_len), dtype=bool), anc], axis=1)


@dataclass(frozen=True, eq=False)
class TreeMaskBatch:
    """Masks of a batch of token trees in the layout of FlashInfer's batch prefill.

    Attributes
    ----------
    qo_indptr : int32 array, shape [B + 1]
        Tree tokens (query rows) of request ``b``: ``qo_indptr[b]:qo_indptr[b + 1]``.
    kv_lens : int32 array, shape [B]
        ``prefix_len + n`` per request: the KV the masks' columns index.
    custom_mask : bool array, shape [sum_b n_b * kv_len_b]
        Each request's ``[n_b, kv_len_b]`` mask flattened row-major, concatenated.
    packed_custom_mask : uint8 array, shape [sum_b ceil(n_b * kv_len_b / 8)]
        Each request's flat mask packed separately, little bit order.
    mask_indptr : int32 array, shape [B + 1]
        Byte offset of each request's packed mask.
    positions : int32 array, shape [qo_indptr[-1]]
        ``prefix_len + depth`` of every tree token (RoPE positions).
    """

    qo_indptr: np.ndarray
    kv_lens: np.ndarray
    custom_mask: np.ndarray
    packed_custom_mask: np.ndarray
    mask_indptr: np.ndarray
    positions: np.ndarray

    def mask(self, b: int) -> np.ndarray:
        """Request ``b``'s mask, bool ``[n_b, kv_len_b]`` (a view of ``custom_mask``)."""
        b = check_positive_int("b", b, minimum=0)
        if b >= self.kv_lens.size:
            raise ValueError(f"b must be < batch size {self.kv_lens.size}, got {b}")
        sizes = np.diff(self.qo_indptr).astype(np.int64) * self.kv_lens
        start = int(sizes[:b].sum())
        n = int(self.qo_indptr[b + 1] - self.qo_indptr[b])
        return self.custom_mask[start:start + int(sizes[b])].reshape(n, int(self.kv_lens[b]))


def batch_tree_masks(parents, prefix_lens) -> TreeMaskBatch:
    """Build the masks, packed masks and positions of a batch of token trees.

    Parameters
    ----------
    parents : sequence of arrays of int
        Request ``b``'s parent array ``[n_b]`` (see :func:`tree_ancestors`); ``n_b`` may be 0.
    prefix_lens : array of int, shape [B]
        Prefix tokens of each request, >= 0.

    Returns
    -------
    TreeMaskBatch
    """
    if isinstance(parents, np.ndarray) or not hasattr(parents, "__len__"):
        raise TypeError(f"parents must be a list of parent arrays (one per request), "
                        f"got {type(parents).__name__}")
    prefix = as_index_array("prefix_lens", prefix_lens).astype(np.int64)
    if prefix.size != len(parents):
        raise ValueError(f"prefix_lens must have length {len(parents)} (len(parents)), "
                         f"got {prefix.size}")
    if prefix.size and prefix.min() < 0:
        raise ValueError(f"prefix_lens must be >= 0, got {int(prefix.min())}")
    pars = [_check_parent(p, f"parents[{b}]") for b, p in enumerate(parents)]
    masks = [tree_mask(p, int(n)) for p, n in zip(pars, prefix, strict=True)]
    n = np.array([p.size for p in pars], dtype=np.int64)
    flat = np.concatenate([np.zeros(0, bool)] + [m.ravel() for m in masks])
    sizes = np.concatenate([[0], np.cumsum([m.size for m in masks])])
    packed, mask_indptr = segment_packbits(flat, sizes, bitorder="little")
    positions = np.concatenate([np.zeros(0, np.int32)] +
                               [tree_positions(p, int(k)) for p, k in zip(pars, prefix, strict=True)])
    return TreeMaskBatch(qo_indptr=np.concatenate([[0], np.cumsum(n)]).astype(np.int32),
                         kv_lens=(prefix + n).astype(np.int32), custom_mask=flat,
                         packed_custom_mask=packed, mask_indptr=mask_indptr.astype(np.int32),
                         positions=positions.astype(np.int32))


def plot_tree_mask(parent, prefix_len: int = 0, ax=None):
    """Draw a tree's mask: prefix columns pale, ancestor columns solid, rows labelled by depth.

    Parameters
    ----------
    parent : array of int, shape [n]
    prefix_len : int
    ax : matplotlib.axes.Axes, optional
        Drawn on a new figure when omitted.

    Returns
    -------
    matplotlib.figure.Figure
    """
    mask = tree_mask(parent, prefix_len)
    par, depth = _check_parent(parent), tree_depths(parent)
    n, cols = mask.shape
    grid = mask.astype(float)
    grid[:, :prefix_len] *= 0.5
    if ax is None:
        from ..viz import subplots
        fig, ax = subplots(figsize=(1.5 + 0.3 * cols, 1.2 + 0.3 * n))
    else:
        fig = ax.figure
    ax.imshow(grid, cmap="Blues", vmin=0, vmax=1.2, aspect="equal", interpolation="nearest")
    if prefix_len:
        ax.axvline(prefix_len - 0.5, color="crimson", linewidth=1.5)
    ax.set_yticks(range(n), labels=[f"t{i} <- {'p' if par[i] < 0 else f't{par[i]}'} (d{depth[i]})"
                                    for i in range(n)], fontsize=7)
    ax.set_xticks(range(cols), labels=[f"p{j}" for j in range(prefix_len)] +
                  [f"t{j}" for j in range(n)], fontsize=7, rotation=90)
    ax.set_xlabel("KV: prefix | tree tokens")
    ax.set_title(f"tree mask: {n} tree tokens after a prefix of {prefix_len}", fontsize=10)
    return fig
