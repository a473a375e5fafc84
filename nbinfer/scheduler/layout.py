"""A plan packed into one int32 buffer with fixed offsets, for a fixed-size GPU workspace region.

A CUDA graph captures kernel arguments by value, so the kernels of a replayed step must find the
new plan at the same addresses as the captured one. :class:`PlanLayout` fixes a capacity (CTAs,
work items, merge rows, merge entries) and from it the offset of every section; each step packs
its plan into a pinned host buffer of ``layout.size`` words and copies it to the same device
region, and the graph replays unchanged. The counts live in the header, so kernels read how much
of each section is valid.

Buffer (int32 words; every section starts on a 4-word = 16-byte boundary for vector loads)::

    header         [HEADER_WORDS]            see HEADER_FIELDS
    work           [max_work * 7]            row-major work table
    cta_indptr     [num_ctas + 1]
    cta_work       [max_work]
    merge_rows     [max_merge_rows]
    merge_indptr   [max_merge_rows + 1]
    merge_indices  [max_merge_nnz]

Padding past the valid counts: ``work``, ``cta_work``, ``merge_rows`` and ``merge_indices`` hold
``-1``; ``merge_indptr`` repeats its last value, so a fixed-grid merge kernel sees the padded rows
as empty lists (and must skip ``merge_rows[i] < 0``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .._checks import check_heads, check_positive_int
from .schedule import WORK_FIELDS, Plan

__all__ = ["HEADER_FIELDS", "HEADER_WORDS", "PLAN_MAGIC", "STEP_FIELDS", "STEP_FIELDS_AT",
           "PlanLayout"]

PLAN_MAGIC = 0x4E425031  # "NBP1": rejects a buffer that holds no plan (or an older format)
HEADER_FIELDS = ("magic", "num_ctas", "max_work", "max_merge_rows", "max_merge_nnz",
                 "num_work", "num_merge_rows", "num_merge_nnz", "num_partials", "batch_size",
                 "num_qo_rows", "num_qo_heads", "num_kv_heads", "tile_q", "tile_rows",
                 "kv_chunk", "granule", "flags", "alpha_lo", "alpha_hi", "beta_lo", "beta_hi",
                 "item_overhead")
HEADER_WORDS = 24  # len(HEADER_FIELDS) rounded up to a multiple of 4
_H = {name: i for i, name in enumerate(HEADER_FIELDS)}
# The header fields each step's schedule sets, in this order (PlanLayout.header_template holds
# the rest); their word positions, read-only.
STEP_FIELDS = ("num_work", "num_merge_rows", "num_merge_nnz", "num_partials", "batch_size",
               "num_qo_rows", "tile_q", "tile_rows", "kv_chunk")
STEP_FIELDS_AT = np.array([_H[name] for name in STEP_FIELDS], dtype=np.int64)
STEP_FIELDS_AT.flags.writeable = False
_CAUSAL, _FIXED = 1, 2  # flag bits
_SECTIONS = ("work", "cta_indptr", "cta_work", "merge_rows", "merge_indptr", "merge_indices")


@functools.lru_cache(maxsize=16)
def _weight_words(alpha: float, beta: float) -> tuple[int, ...]:
    """alpha and beta as float64, each split into two int32 header words."""
    return tuple(np.array([alpha, beta], dtype=np.float64).view(np.int32).tolist())


def _align(n: int) -> int:
    return -(-n // 4) * 4


@dataclass(frozen=True)
class PlanLayout:
    """Capacity of a packed plan and the word offset of every section.

    Parameters
    ----------
    num_ctas : int
        CTAs of the grid (a plan must have exactly this many queues).
    max_work : int
        Work items the buffer can hold.
    max_merge_rows : int
        Split output rows (merge lists).
    max_merge_nnz : int
        Merge entries (= partial rows).
    """

    num_ctas: int
    max_work: int
    max_merge_rows: int
    max_merge_nnz: int

    def __post_init__(self):
        check_positive_int("num_ctas", self.num_ctas)
        for name in ("max_work", "max_merge_rows", "max_merge_nnz"):
            check_positive_int(name, getattr(self, name), minimum=0)

    @classmethod
    def for_plan(cls, plan: Plan) -> PlanLayout:
        """The smallest layout that holds ``plan``."""
        return cls(plan.num_ctas, plan.num_work, plan.num_merge_rows, plan.num_merge_nnz)

    @classmethod
    def bound(cls, num_ctas: int, max_qo_rows: int, num_qo_heads: int, num_kv_heads: int, *,
              max_kv_len: int | None = None, fixed_split_size: int | None = None,
              max_tile_q: int = 128) -> PlanLayout:
        """A layout that holds every plan of up to ``max_qo_rows`` query rows (whatever the batch).

        Adaptive chunks (``fixed_split_size=None``): tiles ``T <= max_qo_rows``, and since
        ``L_kv >= Hkv * sum(kv) / num_ctas`` a tile of ``kv`` tokens has ``<= 1 + kv / L_kv``
        chunks, so there are ``<= T + num_ctas / Hkv`` chunks, ``<= Hkv * T + num_ctas`` items
        and ``<= max_qo_rows + R * num_ctas / Hkv`` partial rows, ``R = max(1, max_tile_q // G)``
        rows per tile (128 is the largest tile :func:`plan` picks by itself). With
        ``fixed_split_size`` the count grows with the KV length, so ``max_kv_len`` is required:
        ``<= T * (1 + ceil(max_kv_len / fixed_split_size))`` chunks, each tile's rows split at
        most that often.

        Parameters
        ----------
        num_ctas, max_qo_rows, num_qo_heads, num_kv_heads : int
        max_kv_len : int, optional
            Longest KV of any request (needed with ``fixed_split_size``).
        fixed_split_size : int, optional
            As given to :func:`plan`.
        max_tile_q : int, optional
            Largest ``tile_q`` the plans may use (only a ``tile_q=`` override exceeds 128).

        Returns
        -------
        PlanLayout
        """
        num_ctas = check_positive_int("num_ctas", num_ctas)
        rows = check_positive_int("max_qo_rows", max_qo_rows, minimum=0)
        group = check_heads(num_qo_heads, num_kv_heads)
        hkv = int(num_kv_heads)
        if fixed_split_size is None:
            chunks = rows + num_ctas // hkv
            tile_rows = max(1, check_positive_int("max_tile_q", max_tile_q) // group)
            partials = rows + tile_rows * (num_ctas // hkv)
            return cls(num_ctas, hkv * chunks, rows, partials)
        if max_kv_len is None:
            raise ValueError("max_kv_len is required with fixed_split_size (chunks grow with KV)")
        per_row = 1 + -(-check_positive_int("max_kv_len", max_kv_len, minimum=0)
                        // check_positive_int("fixed_split_size", fixed_split_size))
        return cls(num_ctas, hkv * rows * per_row, rows, rows * per_row)

    # -- offsets -------------------------------------------------------------------------------
    def lengths(self) -> dict[str, int]:
        """Words of every section (before alignment)."""
        return {"header": HEADER_WORDS, "work": self.max_work * WORK_FIELDS,
                "cta_indptr": self.num_ctas + 1, "cta_work": self.max_work,
                "merge_rows": self.max_merge_rows, "merge_indptr": self.max_merge_rows + 1,
                "merge_indices": self.max_merge_nnz}

    def offsets(self) -> dict[str, int]:
        """Word offset of every section, and ``"end"`` (= :attr:`size`)."""
        return dict(self._offsets)

    @functools.cached_property
    def _offsets(self) -> dict[str, int]:
        out, pos = {}, 0
        for name, n in self.lengths().items():
            out[name] = pos
            pos += _align(n)
        out["end"] = pos
        return out

    @property
    def size(self) -> int:
        """Total int32 words of the buffer."""
        return self._offsets["end"]

    @property
    def nbytes(self) -> int:
        return 4 * self.size

    def fits(self, plan: Plan) -> bool:
        """Whether ``plan`` fits this capacity."""
        return (plan.num_ctas == self.num_ctas and plan.num_work <= self.max_work
                and plan.num_merge_rows <= self.max_merge_rows
                and plan.num_merge_nnz <= self.max_merge_nnz)

    # -- pack / unpack ------------------------------------------------------------------------
    def pack(self, plan: Plan, *, out: np.ndarray | None = None) -> np.ndarray:
        """Write ``plan`` into ``out`` (int32 [size], e.g. pinned memory) or a new buffer."""
        if plan.num_ctas != self.num_ctas:
            raise ValueError(f"plan has {plan.num_ctas} CTAs, the layout {self.num_ctas}")
        for have, cap in (("num_work", "max_work"), ("num_merge_rows", "max_merge_rows"),
                          ("num_merge_nnz", "max_merge_nnz")):
            if getattr(plan, have) > getattr(self, cap):
                raise ValueError(f"plan.{have} is {getattr(plan, have)}, more than the layout's "
                                 f"{cap} = {getattr(self, cap)}")
        if out is None:
            out = np.empty(self.size, dtype=np.int32)
        elif not isinstance(out, np.ndarray) or out.dtype != np.int32 or out.shape != (self.size,):
            raise ValueError(f"out must be an int32 ndarray of shape ({self.size},), got "
                             f"{getattr(out, 'dtype', type(out).__name__)} "
                             f"{getattr(out, 'shape', '')}")
        out.fill(-1)
        off = self.offsets()
        out[:HEADER_WORDS] = self.header(plan)
        for name in _SECTIONS:
            arr = getattr(plan, name).reshape(-1)
            out[off[name]:off[name] + arr.size] = arr
        mi = off["merge_indptr"]
        out[mi + plan.num_merge_rows + 1:mi + self.max_merge_rows + 1] = plan.merge_indptr[-1]
        return out

    def header(self, plan: Plan) -> np.ndarray:
        """The header words of ``plan`` packed with this layout (int32 [HEADER_WORDS])."""
        head = self.header_template(plan.num_qo_heads, plan.num_kv_heads, plan.granule,
                                    plan.causal, plan.fixed_split_size, plan.alpha,
                                    plan.beta, plan.item_overhead).copy()
        head[STEP_FIELDS_AT] = (plan.num_work, plan.num_merge_rows, plan.num_merge_nnz,
                                plan.num_partials, plan.batch_size, plan.num_qo_rows,
                                plan.tile_q, plan.tile_rows, plan.kv_chunk)
        return head

    @functools.lru_cache(maxsize=64)  # noqa: B019 - layouts are few, frozen and hashable
    def header_template(self, num_qo_heads: int, num_kv_heads: int, granule: int, causal: bool,
                        fixed_split_size: int | None, alpha: float, beta: float,
                        item_overhead: int = 0) -> np.ndarray:
        """The header words that do not change from step to step (read-only): every field but
        :data:`STEP_FIELDS`, whose words (at :data:`STEP_FIELDS_AT`) are zero."""
        flags = (_CAUSAL if causal else 0) | (_FIXED if fixed_split_size else 0)
        head = np.zeros(HEADER_WORDS, dtype=np.int32)
        static = dict(magic=PLAN_MAGIC, num_ctas=self.num_ctas, max_work=self.max_work,
                      max_merge_rows=self.max_merge_rows, max_merge_nnz=self.max_merge_nnz,
                      num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, granule=granule,
                      flags=flags, item_overhead=item_overhead)
        static.update(zip(HEADER_FIELDS[18:22], _weight_words(alpha, beta), strict=True))
        for name, value in static.items():
            head[_H[name]] = value
        head.flags.writeable = False
        return head

    def unpack(self, buf) -> Plan:
        """Read a plan back from a buffer written by :meth:`pack` with this layout."""
        buf = np.asarray(buf)
        if buf.dtype != np.int32 or buf.shape != (self.size,):
            raise ValueError(f"buf must be int32 of shape ({self.size},), got {buf.dtype} {buf.shape}")
        head = buf[:HEADER_WORDS]
        if head[_H["magic"]] != PLAN_MAGIC:
            raise ValueError("buf does not hold a packed plan (bad magic number)")
        capacity = tuple(int(head[_H[f]]) for f in ("num_ctas", "max_work", "max_merge_rows",
                                                     "max_merge_nnz"))
        if capacity != (self.num_ctas, self.max_work, self.max_merge_rows, self.max_merge_nnz):
            raise ValueError(f"buf was packed with capacity {capacity}, not this layout's")
        h = {name: int(head[_H[name]]) for name in HEADER_FIELDS[5:18]}
        off = self.offsets()
        counts = {"work": h["num_work"] * WORK_FIELDS, "cta_indptr": self.num_ctas + 1,
                  "cta_work": h["num_work"], "merge_rows": h["num_merge_rows"],
                  "merge_indptr": h["num_merge_rows"] + 1, "merge_indices": h["num_merge_nnz"]}
        arrays = {name: buf[off[name]:off[name] + counts[name]].copy() for name in _SECTIONS}
        arrays["work"] = arrays["work"].reshape(-1, WORK_FIELDS)
        alpha, beta = head[_H["alpha_lo"]:_H["beta_hi"] + 1].copy().view(np.float64).tolist()
        return Plan(**arrays, num_partials=h["num_partials"], batch_size=h["batch_size"],
                    num_qo_rows=h["num_qo_rows"], num_qo_heads=h["num_qo_heads"],
                    num_kv_heads=h["num_kv_heads"], tile_q=h["tile_q"], tile_rows=h["tile_rows"],
                    kv_chunk=h["kv_chunk"], granule=h["granule"],
                    causal=bool(h["flags"] & _CAUSAL),
                    fixed_split_size=h["kv_chunk"] if h["flags"] & _FIXED else None,
                    alpha=alpha, beta=beta, item_overhead=int(head[_H["item_overhead"]]))
