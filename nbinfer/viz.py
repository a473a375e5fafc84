"""Pictures of nbinfer's objects: block-sparse matrices, page tables, attention states.

Every ``plot_*`` function draws onto ``ax`` when one is given (and returns ``ax.figure``), or
onto a new :class:`matplotlib.figure.Figure` otherwise, and returns that figure. Nothing here
calls ``pyplot.show`` or touches pyplot's global figure list, so the module works the same under
the Agg backend (scripts, CI) and inside a notebook (where :func:`show` embeds the image).

Sections
--------
- output: :func:`figures_dir`, :func:`save_figure`, :func:`show`, :func:`subplots`
- formats: :func:`plot_bsr`, :func:`plot_page_table`
- attention states: :func:`plot_chunk_weights`, :func:`plot_states_merge`
- performance: :func:`plot_roofline`
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from matplotlib.colors import ListedColormap, to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

__all__ = [
    "figures_dir",
    "plot_bsr",
    "plot_chunk_weights",
    "plot_page_table",
    "plot_roofline",
    "plot_states_merge",
    "request_colors",
    "save_figure",
    "show",
    "subplots",
]

FIGURES_ENV = "NBINFER_FIGURES_DIR"
EMPTY_COLOR = "#ffffff"
GRID_COLOR = "#9a9a9a"
BLOCK_GRID_COLOR = "#303030"


# ----------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------
def figures_dir() -> Path:
    """The directory figures are saved to.

    Returns
    -------
    pathlib.Path
        ``$NBINFER_FIGURES_DIR`` when that variable is set, else the repository's ``figures/``
        directory (the sibling of the ``nbinfer`` package). Created if missing.
    """
    env = os.environ.get(FIGURES_ENV)
    path = Path(env) if env else Path(__file__).resolve().parent.parent / "figures"
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_figure(fig: Figure, name: str, *, dpi: int = 120) -> Path:
    """Write ``fig`` as ``figures_dir() / name`` and return the path.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
        The figure to save.
    name : str
        File name such as ``"01_merge.png"``; the suffix picks the format.
    dpi : int, optional
        Resolution of raster formats.

    Returns
    -------
    pathlib.Path
        Where the file was written.
    """
    if Path(name).name != name:
        raise ValueError(f"name must be a bare file name, got {name!r}")
    path = figures_dir() / name
    # Fixed metadata keeps the PNG bytes identical between runs (no timestamps, no versions).
    fig.savefig(path, dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    return path


def show(fig: Figure) -> None:
    """Embed ``fig`` as a PNG in the running Jupyter notebook; do nothing in a plain script.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
        The figure to display.
    """
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython is always there with the lessons extra
        return
    shell = get_ipython()
    if shell is None or not hasattr(shell, "kernel"):
        return
    import io

    from IPython.display import Image, display

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    display(Image(data=buf.getvalue(), format="png"))


def subplots(nrows: int = 1, ncols: int = 1, *, figsize=None, squeeze: bool = True, **kwargs):
    """A new pyplot-free figure with a grid of axes (``Figure.subplots`` with a layout engine).

    Parameters
    ----------
    nrows, ncols : int
        Grid of axes.
    figsize : (float, float), optional
        Inches; defaults to 4.8 x 3.6 per axes.
    squeeze : bool
        As in :meth:`matplotlib.figure.Figure.subplots`.
    **kwargs
        Passed to :meth:`matplotlib.figure.Figure.subplots` (``sharex``, ``gridspec_kw`` ...).

    Returns
    -------
    (Figure, Axes or array of Axes)
    """
    if figsize is None:
        figsize = (4.8 * ncols, 3.6 * nrows)
    fig = Figure(figsize=figsize, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=squeeze, **kwargs)
    return fig, axes


def _fig_ax(ax, figsize):
    if ax is None:
        fig, ax = subplots(figsize=figsize)
        return fig, ax
    return ax.figure, ax


def request_colors(n: int) -> list:
    """``n`` distinguishable colours (tab10, then tab20), one per request."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


# ----------------------------------------------------------------------------------------------
# formats
# ----------------------------------------------------------------------------------------------
def _lighten(color, amount: float = 0.75):
    r, g, b, _ = to_rgba(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount, 1.0)


def plot_bsr(bsr, ax=None, title=None, *, elements: bool = False, row_labels=None,
             col_labels=None, annotate: bool = True, color="C0", row_bounds=None,
             row_bounds_labels=None, xlabel=None, ylabel=None, figsize=None, keep=None):
    """Draw the occupancy of a block-sparse matrix with its block grid.

    Parameters
    ----------
    bsr : nbinfer.formats.BSR
        The matrix; only ``indptr``, ``indices``, ``block_shape``, ``shape`` and the valid
        column counts (``block_col_lens``) are used.
    ax : matplotlib.axes.Axes, optional
        Axes to draw on; a new figure is made when omitted.
    title : str, optional
        Axes title. Defaults to a one-line summary (shape, block shape, stored blocks).
    elements : bool
        False: one cell per block (``BSR.to_dense``), stored blocks filled. True: one cell per
        element (``BSR.to_dense_mask``); valid elements solid, the unused tail of a stored
        block (a partly filled last page) pale, thick lines on block boundaries.
    row_labels, col_labels : sequence of str, optional
        One label per block row / block column (default: the indices).
    annotate : bool
        Write each stored block's number of valid columns inside it (block view only), as
        ``"n"`` for full blocks and ``"n/Bc"`` for partial ones.
    color : color
        Fill of stored blocks.
    row_bounds : array of int, optional
        Element-row offsets (e.g. ``qo_indptr``) at which to draw separators between groups of
        rows, such as the query tokens of different requests.
    row_bounds_labels : sequence of str, optional
        One label per group of ``row_bounds``, written at the right edge.
    xlabel, ylabel : str, optional
        Axis labels (defaults describe KV columns and query rows; ``""`` for none).
    figsize : (float, float), optional
        Size of a new figure.
    keep : bool array [rows, cols], optional
        Element view only: the pairs a mask keeps (e.g. causal). Valid elements it drops are
        drawn pale, like the unused tail of a block: loaded with the block, never used.

    Returns
    -------
    matplotlib.figure.Figure
    """
    br, bc = (int(s) for s in bsr.block_shape)
    m, n = (int(s) for s in bsr.shape)
    nbr, nbc = bsr.num_block_rows, bsr.num_block_cols
    lens = np.asarray(bsr.block_col_lens())
    if elements:
        rows, cols = m, n
        stored = np.zeros((m, n), dtype=bool)
        for i in range(nbr):
            for k in range(bsr.indptr[i], bsr.indptr[i + 1]):
                c0 = int(bsr.indices[k]) * bc
                stored[i * br:(i + 1) * br, c0:c0 + bc] = True
        grid = stored.astype(np.int8) + np.asarray(bsr.to_dense_mask(), dtype=np.int8)
        if keep is not None:
            keep = np.asarray(keep, dtype=bool)
            if keep.shape != (m, n):
                raise ValueError(f"keep must have the matrix's shape {(m, n)}, got {keep.shape}")
            grid = np.where((grid == 2) & ~keep, 1, grid).astype(np.int8)
        step_r, step_c = br, bc
    else:
        if keep is not None:
            raise ValueError("keep applies to the element view (elements=True)")
        rows, cols = nbr, nbc
        grid = 2 * np.asarray(bsr.to_dense(), dtype=np.int8)
        step_r = step_c = 1
    if figsize is None:
        figsize = (min(1.0 + 0.45 * cols, 14.0) + 1.0, min(1.0 + 0.45 * rows, 10.0) + 0.6)
        if elements:
            figsize = (min(1.0 + 0.22 * cols, 14.0) + 1.0, min(1.0 + 0.22 * rows, 10.0) + 0.8)
    fig, ax = _fig_ax(ax, figsize)
    cmap = ListedColormap([EMPTY_COLOR, _lighten(color), to_rgba(color)])
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=2, interpolation="nearest", aspect="equal",
              extent=(0, cols, rows, 0))

    # Element grid (thin) when it is readable, block grid (thick) always.
    if elements and max(rows, cols) <= 96:
        ax.vlines(np.arange(cols + 1), 0, rows, colors=GRID_COLOR, linewidth=0.3)
        ax.hlines(np.arange(rows + 1), 0, cols, colors=GRID_COLOR, linewidth=0.3)
    xb = np.minimum(np.arange(nbc + 1) * step_c, cols)
    yb = np.minimum(np.arange(nbr + 1) * step_r, rows)
    ax.vlines(xb, 0, rows, colors=BLOCK_GRID_COLOR, linewidth=0.9 if elements else 0.6)
    ax.hlines(yb, 0, cols, colors=BLOCK_GRID_COLOR, linewidth=0.9 if elements else 0.6)

    if annotate and not elements:
        for i in range(nbr):
            for k in range(bsr.indptr[i], bsr.indptr[i + 1]):
                j = int(bsr.indices[k])
                full = min(bc, n - j * bc)
                text = f"{lens[k]}" if lens[k] == full else f"{lens[k]}/{full}"
                ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", color="white",
                        fontsize=8 if len(text) < 4 else 7, fontweight="bold")

    if row_bounds is not None:
        bounds = np.asarray(row_bounds)
        scale = 1 if elements else 1 / br
        for y in bounds[1:-1]:
            ax.axhline(y * scale, color="crimson", linewidth=2.0)
        if row_bounds_labels is not None:
            for g, label in enumerate(row_bounds_labels):
                mid = 0.5 * (bounds[g] + bounds[g + 1]) * scale
                ax.text(cols + 0.3, mid, label, ha="left", va="center", color="crimson",
                        fontsize=9, clip_on=False)

    xc = (xb[:-1] + xb[1:]) / 2
    yc = (yb[:-1] + yb[1:]) / 2
    ax.set_xticks(xc, labels=list(col_labels) if col_labels is not None else range(nbc),
                  fontsize=8)
    ax.set_yticks(yc, labels=list(row_labels) if row_labels is not None else range(nbr),
                  fontsize=8)
    ax.tick_params(length=0)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.xaxis.set_ticks_position("top")
    ax.xaxis.set_label_position("top")
    unit = "element" if elements else "block"
    ax.set_xlabel(f"KV {unit} column (Bc = {bc})" if xlabel is None else xlabel)
    ax.set_ylabel(f"query {unit} row (Br = {br})" if ylabel is None else ylabel)
    if title is None:
        title = (f"BSR {m}x{n}, blocks ({br}, {bc}), "
                 f"{bsr.nnz_blocks} of {nbr * nbc} blocks stored")
    ax.set_title(title, fontsize=10, pad=8)
    handles = [Patch(facecolor=to_rgba(color), edgecolor="k", linewidth=0.5,
                     label=("read (kept)" if keep is not None else "valid") if elements
                     else "stored block"),
               Patch(facecolor=EMPTY_COLOR, edgecolor="k", linewidth=0.5,
                     label="absent (never loaded)")]
    if elements and np.any(grid == 1):
        handles.insert(1, Patch(facecolor=_lighten(color), edgecolor="k", linewidth=0.5,
                                label="loaded, not used (masked, or past the last token)"
                                if keep is not None else "unused tail of a stored block"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, -0.02), ncol=len(handles),
              fontsize=8, frameon=False)
    return fig


def plot_page_table(page_table, ax=None, *, title=None, request_labels=None, figsize=None):
    """Draw a paged KV cache two ways: each request's logical pages, and the physical pool.

    Top panel: one row per request, its logical pages left to right, each page labelled with
    the physical page it maps to and split into ``page_size`` slots (filled slots coloured).
    Bottom panel: the physical page pool in address order, each page coloured by the request
    that owns it (white when free) and labelled ``"r<req>.<logical page>"``.

    Parameters
    ----------
    page_table : nbinfer.formats.PageTable
        Any object with ``indptr``, ``indices``, ``last_page_len``, ``page_size`` and
        ``num_pages`` in FlashInfer's meaning (``kv_indptr``, ``kv_indices``,
        ``kv_last_page_len``).
    ax : sequence of two Axes, optional
        ``(logical_ax, physical_ax)``; a new two-row figure is made when omitted.
    title : str, optional
        Figure title.
    request_labels : sequence of str, optional
        One label per request (default ``"request b"``).
    figsize : (float, float), optional
        Size of a new figure.

    Returns
    -------
    matplotlib.figure.Figure
    """
    indptr = np.asarray(page_table.indptr)
    indices = np.asarray(page_table.indices)
    last = np.asarray(page_table.last_page_len)
    ps = int(page_table.page_size)
    num_pages = int(page_table.num_pages)
    nreq = indptr.size - 1
    counts = np.diff(indptr)
    max_pages = int(counts.max()) if nreq else 0
    colors = request_colors(max(nreq, 1))
    labels = (list(request_labels) if request_labels is not None
              else [f"request {b}" for b in range(nreq)])
    if ax is None:
        if figsize is None:
            figsize = (max(6.0, 0.62 * max(num_pages, max_pages) + 2.2), 1.4 + 0.55 * nreq + 1.6)
        fig = Figure(figsize=figsize, layout="constrained")
        ax_log, ax_phys = fig.subplots(2, 1, gridspec_kw={"height_ratios": [max(nreq, 1), 1.6]})
    else:
        ax_log, ax_phys = ax
        fig = ax_log.figure

    def draw_page(a, x, y, owner, fill, text):
        w = 0.9
        a.add_patch(Rectangle((x, y), w, 0.8, facecolor="white", edgecolor="k", linewidth=0.8))
        for s in range(ps):
            filled = s < fill
            fc = colors[owner] if (filled and owner is not None) else "white"
            a.add_patch(Rectangle((x + w * s / ps, y), w / ps, 0.8, facecolor=fc,
                                  edgecolor=GRID_COLOR, linewidth=0.3,
                                  hatch=None if filled or owner is None else "///"))
        a.add_patch(Rectangle((x, y), w, 0.8, facecolor="none", edgecolor="k", linewidth=0.9))
        a.text(x + w / 2, y + 0.4, text, ha="center", va="center", fontsize=8,
               fontweight="bold", color="black",
               bbox={"boxstyle": "round,pad=0.12", "facecolor": "white", "alpha": 0.75,
                     "linewidth": 0})

    owner = np.full(num_pages, -1)
    logical = np.full(num_pages, -1)
    fill = np.zeros(num_pages, dtype=int)
    for b in range(nreq):
        pages = indices[indptr[b]:indptr[b + 1]]
        for lp, p in enumerate(pages):
            f = int(last[b]) if lp == len(pages) - 1 else ps
            y = nreq - 1 - b
            draw_page(ax_log, lp, y + 0.1, b, f, f"P{int(p)}")
            owner[p], logical[p], fill[p] = b, lp, f
        ntok = (counts[b] - 1) * ps + int(last[b]) if counts[b] else 0
        ax_log.text(max_pages + 0.15, nreq - 1 - b + 0.5, f"{ntok} tokens", va="center",
                    fontsize=8, color="dimgray")
    ax_log.set_xlim(-0.1, max_pages + 1.3)
    ax_log.set_ylim(0, max(nreq, 1))
    ax_log.set_yticks(np.arange(nreq) + 0.5, labels=labels[::-1], fontsize=9)
    ax_log.set_xticks(np.arange(max_pages) + 0.45, labels=[f"L{i}" for i in range(max_pages)],
                      fontsize=8)
    ax_log.tick_params(length=0)
    for side in ("top", "right", "bottom", "left"):
        ax_log.spines[side].set_visible(False)
    ax_log.set_xlabel("logical page (box text = physical page it maps to)", fontsize=9)
    ax_log.set_title("logical view: each request's page list (kv_indices)", fontsize=10)

    for p in range(num_pages):
        o = int(owner[p])
        if o >= 0:
            draw_page(ax_phys, p, 0.1, o, int(fill[p]), f"r{o}.L{int(logical[p])}")
        else:
            draw_page(ax_phys, p, 0.1, None, 0, "free")
    ax_phys.set_xlim(-0.1, num_pages)
    ax_phys.set_ylim(0, 1.0)
    ax_phys.set_yticks([])
    ax_phys.set_xticks(np.arange(num_pages) + 0.45, labels=[f"P{p}" for p in range(num_pages)],
                       fontsize=8)
    ax_phys.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        ax_phys.spines[side].set_visible(False)
    ax_phys.set_title(f"physical KV pool: {num_pages} pages of {ps} slots "
                      "(hatched = unused slot of a partial last page)", fontsize=10)
    handles = [Patch(facecolor=colors[b], label=labels[b]) for b in range(nreq)]
    handles.append(Patch(facecolor="white", edgecolor="k", hatch="///", label="empty slot"))
    ax_phys.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35),
                   ncol=min(len(handles), 6), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


# ----------------------------------------------------------------------------------------------
# attention states
# ----------------------------------------------------------------------------------------------
def plot_chunk_weights(scores, chunks, ax=None, *, title=None, chunk_labels=None, figsize=None):
    """Compare each key's softmax weight over all keys with its weight inside its own chunk.

    Parameters
    ----------
    scores : array of float, shape [n]
        Logits of one query against ``n`` keys.
    chunks : sequence of sequences of int
        A partition of ``range(n)`` into chunks.
    ax : matplotlib.axes.Axes, optional
        Axes to draw on; a new figure is made when omitted.
    title : str, optional
        Axes title.
    chunk_labels : sequence of str, optional
        One name per chunk (default ``"chunk 0"``, ...).
    figsize : (float, float), optional
        Size of a new figure.

    Returns
    -------
    matplotlib.figure.Figure
    """
    s = np.asarray(scores, dtype=np.float64)
    glob = np.exp(s - s.max())
    glob /= glob.sum()
    local = np.zeros_like(s)
    owner = np.zeros(s.size, dtype=int)
    for c, idx in enumerate(chunks):
        idx = np.asarray(idx)
        w = np.exp(s[idx] - s[idx].max())
        local[idx] = w / w.sum()
        owner[idx] = c
    fig, ax = _fig_ax(ax, figsize or (5.5, 3.6))
    colors = request_colors(len(chunks))
    x = np.arange(s.size)
    ax.bar(x - 0.2, glob, 0.4, color="0.35")
    ax.bar(x + 0.2, local, 0.4, color=[colors[o] for o in owner], alpha=0.85)
    for xi, (g, lo) in enumerate(zip(glob, local, strict=True)):
        ax.text(xi - 0.2, g + 0.01, f"{g:.2f}", ha="center", va="bottom", fontsize=7)
        ax.text(xi + 0.2, lo + 0.01, f"{lo:.2f}", ha="center", va="bottom", fontsize=7)
    names = chunk_labels or [f"chunk {c}" for c in range(len(chunks))]
    ax.set_xticks(x, labels=[f"k{i + 1}\n({names[o]})" for i, o in enumerate(owner)], fontsize=8)
    ax.set_ylabel("softmax weight")
    ax.set_ylim(0, 1.08)
    ax.set_title(title or "each chunk normalises over itself only", fontsize=10)
    handles = [Patch(facecolor="0.35", label="over all keys (correct)")]
    handles += [Patch(facecolor=colors[c], alpha=0.85, label=f"inside {names[c]} only")
                for c in range(len(chunks))]
    ax.legend(handles=handles, fontsize=8, loc="upper left", frameon=False)
    return fig


def plot_states_merge(outputs, lses, merged, ax=None, *, labels=None, exact=None, average=None,
                      title=None, figsize=None):
    """Bar chart of partial attention outputs, their merge, and (optionally) a naive average.

    Parameters
    ----------
    outputs : array of float, shape [n]
        Scalar output of each partial attention state (one value dimension).
    lses : array of float, shape [n]
        Log-sum-exp of each partial state; written under its bar, and its share of the merge,
        ``exp(LSE_i) / sum_j exp(LSE_j)``, written inside the bar.
    merged : float
        Output of the merged state.
    ax : matplotlib.axes.Axes, optional
        Axes to draw on; a new figure is made when omitted.
    labels : sequence of str, optional
        One name per partial state.
    exact : float, optional
        One-shot attention over all keys, drawn as a dashed line.
    average : float, optional
        Plain mean of the partial outputs, drawn as a red bar.
    title : str, optional
        Axes title.
    figsize : (float, float), optional
        Size of a new figure.

    Returns
    -------
    matplotlib.figure.Figure
    """
    outputs = np.asarray(outputs, dtype=np.float64).ravel()
    lses = np.asarray(lses, dtype=np.float64).ravel()
    n = outputs.size
    fig, ax = _fig_ax(ax, figsize or (5.5, 3.6))
    colors = request_colors(n)
    names = list(labels) if labels is not None else [f"state {i}" for i in range(n)]
    heights = list(outputs) + [float(merged)]
    bar_colors = colors[:n] + ["0.25"]
    ticks = [f"{nm}\nLSE {lse:.3f}" for nm, lse in zip(names, lses, strict=True)]
    ticks.append("merge ⊕\n(exact)")
    if average is not None:
        heights.append(float(average))
        bar_colors.append("crimson")
        ticks.append("plain mean\n(wrong)")
    x = np.arange(len(heights))
    bars = ax.bar(x, heights, 0.6, color=bar_colors)
    if average is not None:
        bars[-1].set_hatch("//")
        bars[-1].set_edgecolor("white")
    for xi, h in zip(x, heights, strict=True):
        ax.text(xi, h, f"{h:.2f}", ha="center", va="bottom", fontsize=9)
    # Each partial state's share of the merge: exp(LSE_i) / sum_j exp(LSE_j), computed safely.
    share = np.exp(lses - lses.max())
    share /= share.sum()
    for xi, (h, w) in enumerate(zip(outputs, share, strict=True)):
        ax.text(xi, h / 2, f"weight\nin ⊕\n{w:.2f}", ha="center", va="center", fontsize=8,
                color="white", fontweight="bold")
    if exact is not None:
        ax.axhline(float(exact), color="k", linestyle="--", linewidth=1.0,
                   label=f"attention over all keys = {float(exact):.2f}")
        ax.legend(fontsize=8, loc="upper left", frameon=False)
    ax.set_xticks(x, labels=ticks, fontsize=8)
    ax.set_ylabel("attention output")
    ax.set_ylim(0, max(heights + ([float(exact)] if exact is not None else [])) * 1.25)
    ax.set_title(title or "partial states, their merge and a naive average", fontsize=10)
    return fig


# ----------------------------------------------------------------------------------------------
# performance
# ----------------------------------------------------------------------------------------------
def plot_roofline(points, *, memory_ceilings, compute_ceilings, ax=None, ai_range=(0.25, 1024.0),
                  title=None, figsize=None):
    """Roofline chart: attainable FLOP/s against arithmetic intensity, with measured points.

    Each memory ceiling ``B`` (bytes/s) is the line ``FLOP/s = B * AI``, each compute ceiling
    ``P`` (FLOP/s) the horizontal line ``FLOP/s = P``; a kernel at intensity ``AI`` cannot run
    above ``min(B * AI, P)``. Both axes are logarithmic, in FLOP/byte and TFLOP/s.

    Parameters
    ----------
    points : sequence of dict
        One dict per measured point: ``ai`` (FLOP/byte), ``flops`` (FLOP/s), ``label`` (str;
        points sharing a label share one legend entry), optional ``color``, ``marker``,
        ``annotate`` (text written next to the point).
    memory_ceilings : sequence of (str, float)
        ``(label, bytes_per_second)``.
    compute_ceilings : sequence of (str, float)
        ``(label, flop_per_second)``.
    ax : matplotlib.axes.Axes, optional
        Axes to draw on; a new figure is made when omitted.
    ai_range : (float, float)
        Range of the x axis (FLOP/byte).
    title : str, optional
        Axes title.
    figsize : (float, float), optional
        Size of a new figure.

    Returns
    -------
    matplotlib.figure.Figure
        The measured points are drawn with one ``scatter`` per label, in the order the labels
        first appear, so ``ax.collections[i].get_offsets()`` gives them back in TFLOP/s.
    """
    fig, ax = _fig_ax(ax, figsize or (7.0, 4.6))
    lo, hi = (float(x) for x in ai_range)
    x = np.geomspace(lo, hi, 256)
    peak = max(p for _, p in compute_ceilings)
    styles = ["-", "--", ":", "-."]
    for i, (label, bw) in enumerate(memory_ceilings):
        y = np.minimum(bw * x, peak) / 1e12
        ax.plot(x, y, color="k", ls=styles[i % len(styles)], lw=1.2,
                label=f"{label}: {bw / 1e12:.2f} TB/s")
    for i, (label, p) in enumerate(compute_ceilings):
        ridge = p / max(bw for _, bw in memory_ceilings)
        xs = x[x >= ridge]
        ax.plot(xs, np.full(xs.size, p / 1e12), color=f"C{3 + i}", lw=1.2, ls=styles[i % 4],
                label=f"{label}: {p / 1e12:.0f} TFLOP/s (ridge {ridge:.0f} FLOP/B)")
        ax.axvline(ridge, color=f"C{3 + i}", lw=0.6, ls=":", alpha=0.6)
    labels = []
    for pt in points:
        if pt["label"] not in labels:
            labels.append(pt["label"])
    for i, label in enumerate(labels):
        group = [pt for pt in points if pt["label"] == label]
        ax.scatter([pt["ai"] for pt in group], [pt["flops"] / 1e12 for pt in group],
                   s=42, zorder=3, color=group[0].get("color", f"C{i}"),
                   marker=group[0].get("marker", "o"), label=label, edgecolors="k",
                   linewidths=0.5)
        for pt in group:
            if pt.get("annotate"):
                ax.annotate(pt["annotate"], (pt["ai"], pt["flops"] / 1e12), fontsize=7,
                            xytext=(6, 0), textcoords="offset points", va="center")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOP / byte of HBM traffic)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(True, which="major", lw=0.4, alpha=0.5)
    ax.legend(fontsize=7, loc="lower right", frameon=True, framealpha=0.9)
    ax.set_title(title or "roofline", fontsize=10)
    return fig
