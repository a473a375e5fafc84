"""Pictures of a plan: CTA queues as a Gantt chart, and the reduction map as a matrix.

Like :mod:`nbinfer.viz`, each function draws onto ``ax`` when given (returning ``ax.figure``) or
onto a new pyplot-free figure, and returns the figure. matplotlib is imported only when a picture
is drawn, so planning never pays for it.
"""

from __future__ import annotations

import numpy as np

from .schedule import Plan

__all__ = ["plot_gantt", "plot_reduction_map"]


def _fig_ax(ax, figsize):
    if ax is not None:
        return ax.figure, ax
    from ..viz import subplots

    return subplots(figsize=figsize)


def plot_gantt(plan: Plan, ax=None, *, title=None, figsize=None):
    """Draw every CTA's queue as a row of bars whose widths are the item costs.

    Bars are coloured by request; items that write partial states are drawn lighter with a dark
    edge. The dashed line is the lower bound ``max(total / num_ctas, largest item)`` no
    schedule can beat, the solid one the longest queue (the step's makespan in cost units).

    Parameters
    ----------
    plan : Plan
    ax : matplotlib Axes, optional
    title : str, optional
    figsize : (float, float), optional
        Used only when ``ax`` is None; defaults to a height that grows with the CTA count.

    Returns
    -------
    matplotlib.figure.Figure
    """
    from matplotlib.colors import to_rgba

    from ..viz import request_colors

    n = plan.num_ctas
    if figsize is None:
        figsize = (7.0, min(2.0 + 0.25 * n, 10.0))
    fig, ax = _fig_ax(ax, figsize)
    costs = plan.item_costs()
    order = plan.cta_work
    # Start of each item = its CTA's load before it: a running sum restarted at every queue.
    ends = np.cumsum(costs[order])
    queue_start = np.concatenate(([0.0], ends))[plan.cta_indptr[:-1]]
    owner = np.repeat(np.arange(n), np.diff(plan.cta_indptr))
    left = ends - costs[order] - queue_start[owner]
    palette = request_colors(max(plan.batch_size, 1))
    partial = plan.work[order, 6] >= 0
    colors = []
    for req, is_partial in zip(plan.work[order, 0].tolist(), partial.tolist(), strict=True):
        r, g, b, _ = to_rgba(palette[req % len(palette)])
        colors.append((r + (1 - r) * 0.5, g + (1 - g) * 0.5, b + (1 - b) * 0.5, 1.0)
                      if is_partial else (r, g, b, 1.0))
    thin = n > 64  # hundreds of CTAs: edges would paint the bars black
    ax.barh(owner, costs[order], left=left, height=0.8, color=colors,
            edgecolor=["#303030" if p else "none" for p in partial.tolist()],
            linewidth=0 if thin else 0.6)
    if plan.num_work:
        loads = plan.cta_loads()
        ax.axvline(plan.lower_bound(), color="#303030", linestyle="--", linewidth=1,
                   label=f"lower bound {plan.lower_bound():.4g}")
        ax.axvline(loads.max(), color="#c03030", linewidth=1, label=f"longest queue {loads.max():.4g}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.set_ylim(n - 0.5, -0.5)  # CTA 0 on top, like a timeline
    ax.set_xlabel(f"cost ({plan.alpha:g} l_q + {plan.beta:g} l_kv)")
    ax.set_ylabel("CTA")
    ax.set_title(title if title is not None else
                 f"LPT schedule: {plan.num_work} items on {n} CTAs (lighter = partial)")
    return fig


def plot_reduction_map(plan: Plan, ax=None, *, title=None, figsize=None):
    """Draw which partial rows merge into which output row, and in which order.

    One matrix row per merged output row, one column per partial row; a filled cell is a
    partial that row merges, coloured by its position in the merge list (its KV chunk, since
    lists are in increasing ``kv_start``). Rows written directly do not appear.

    Parameters
    ----------
    plan : Plan
    ax : matplotlib Axes, optional
    title : str, optional
    figsize : (float, float), optional

    Returns
    -------
    matplotlib.figure.Figure
    """
    m, p = plan.num_merge_rows, plan.num_partials
    fig, ax = _fig_ax(ax, figsize or (min(3.0 + 0.3 * p, 10.0), min(2.5 + 0.3 * m, 8.0)))
    direct = plan.num_qo_rows - m
    if m == 0:
        ax.text(0.5, 0.5, f"no split rows:\nall {plan.num_qo_rows} output rows written directly",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    else:
        grid = np.full((m, p), np.nan)
        lengths = np.diff(plan.merge_indptr)
        row = np.repeat(np.arange(m), lengths)
        position = np.arange(plan.num_merge_nnz) - np.repeat(plan.merge_indptr[:-1], lengths)
        grid[row, plan.merge_indices] = position
        # Positions are integers: one colour per position (a discrete map, a tick per colour),
        # and the number written in its cell when the matrix is small enough to read.
        import matplotlib as mpl

        n = max(int(lengths.max()), 1)
        cmap = mpl.colormaps["viridis"].resampled(n)
        norm = mpl.colors.BoundaryNorm(np.arange(n + 1) - 0.5, n)
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto",
                          interpolation="nearest")
        bar = fig.colorbar(image, ax=ax, label="merge position (KV order)",
                           ticks=np.arange(0, n, max(1, n // 8)))
        bar.ax.tick_params(length=0)
        if m * p <= 400:
            for r, c in zip(row, plan.merge_indices.tolist(), strict=True):
                v = int(grid[r, c])
                ax.text(c, r, str(v), ha="center", va="center", fontsize=8,
                        color="white" if v < n / 2 else "black")
        if m <= 32:
            ax.set_yticks(np.arange(m), [str(r) for r in plan.merge_rows.tolist()])
        if p <= 32:
            ax.set_xticks(np.arange(p))
        ax.set_xlabel("partial row")
        ax.set_ylabel("output row")
    ax.set_title(title if title is not None else
                 f"reduction map: {m} merged rows, {direct} written directly")
    return fig
