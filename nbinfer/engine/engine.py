"""Continuous batching over one paged KV pool: sequences, the step scheduler, greedy decoding.

Each :meth:`Engine.step`:

1. **schedules** up to ``max_step_tokens`` new tokens: every running sequence that is decoding
   gets its one token first (oldest first), then sequences still prefilling continue, then
   waiting requests start, in arrival order; a prompt longer than what is left of the budget is
   prefilled in chunks over several steps;
2. **allocates pages** for the scheduled tokens (a waiting request is admitted only when the
   pages of its first chunk are free, after evicting cached pages nobody runs on); when the pool
   runs dry as running sequences grow, the youngest running sequence is **preempted**: its pages
   are freed and it goes back to the front of the queue, to be recomputed (prompt and tokens
   generated so far) when pages are free again;
3. **runs the model** once on the whole batch (each layer appends the step's keys and values to
   their pages, then attends causally over each sequence's pages);
4. **samples** (greedy) the next token of every sequence whose scheduled tokens reached the end
   of what it has, and retires the sequences that are done, freeing their pages.

The runner (:mod:`.runners`) does the arithmetic; everything here is host bookkeeping, the same
for the NumPy and the torch model.

**Overlap** (``Engine(overlap=True)``). Steps 1-3 never need the *values* of the tokens the
last step sampled, only how many there are (a sequence's length, whether it is done: requests
end after ``max_new_tokens``). So with ``overlap`` a step is scheduled, allocated and launched
while the GPU still computes the one before it: a token not yet on the host enters the batch as
a placeholder (``-1 - j``: row ``j`` of the last step's sampled tokens), which the runner
replaces on the device; then the previous step is *completed* (its tokens copied to the host,
its placeholders filled in, its finished sequences' pages released, its full pages handed to
the prefix cache). The host's work of step ``n + 1`` then runs beside the GPU's of step ``n``
instead of after it. Tokens are the same as without overlap; the prefix cache sees a step's
pages one step later, and :meth:`Engine.step` returns the report of the step it completed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .._checks import check_positive_int
from ..formats.radix import CascadeLevels, RadixTree
from .pool import PagePool

__all__ = ["Engine", "Request", "StepReport"]


_EMPTY = np.zeros(0, dtype=np.int32)


def _concat(arrays: list) -> np.ndarray:
    return np.concatenate(arrays) if arrays else _EMPTY


def _indptr(counts) -> np.ndarray:
    """int32 ``[0, c0, c0 + c1, ...]`` of ``counts`` (the runners take int32 index arrays)."""
    out = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=out[1:])
    return out


@dataclass
class Request:
    """One generation request.

    Attributes
    ----------
    prompt : list of int
        Token ids (at least one).
    max_new_tokens : int
        Tokens to generate (>= 1).
    arrival : int
        Step at which the request arrives (for :meth:`Engine.run`).
    """

    prompt: list
    max_new_tokens: int
    arrival: int = 0

    def __post_init__(self):
        self.prompt = [int(t) for t in self.prompt]
        if not self.prompt:
            raise ValueError("prompt must hold at least one token")
        if min(self.prompt) < 0:
            raise ValueError(f"prompt token ids must be >= 0, got {min(self.prompt)}")
        check_positive_int("max_new_tokens", self.max_new_tokens)


@dataclass(eq=False)  # compared by identity: the step loops test membership often
class _Sequence:
    rid: int
    request: Request
    order: int  # admission order: the youngest (largest) is preempted first
    tokens: list = field(default_factory=list)  # the prompt, then each generated token
    pages: list = field(default_factory=list)
    computed: int = 0  # tokens whose K and V are in the pool
    cached: int = 0  # full pages handed to the prefix cache so far (Engine._complete says when)

    def __post_init__(self):
        self.tokens = list(self.request.prompt)
        self.prompt_ids = np.asarray(self.request.prompt)  # for the admission's prefix check
        self._page_array = (None, 0, _EMPTY)

    def page_array(self) -> np.ndarray:
        """``pages`` as int32 (read-only), rebuilt only when they changed: pages are appended
        in place or replaced by a new list, so the list and its length say when. A step's
        tables are slices of these: converting every sequence's list each step cost ~0.1 ms
        at 64 sequences of ~70 pages on a 2-core CPU."""
        held, n, arr = self._page_array
        if held is not self.pages or n != len(self.pages):
            arr = np.array(self.pages, dtype=np.int32)
            arr.flags.writeable = False
            self._page_array = (self.pages, len(self.pages), arr)
        return arr

    @property
    def output(self) -> list:
        return self.tokens[len(self.request.prompt):]

    @property
    def done(self) -> bool:
        return len(self.tokens) - len(self.request.prompt) >= self.request.max_new_tokens


@dataclass(frozen=True)
class StepReport:
    """What one step did: request ids and token counts per sequence (``prefill`` for chunks of
    more than one token, ``decode`` for single tokens), preemptions, pages in use."""

    step: int
    scheduled: tuple  # (request id, new tokens)
    sampled: tuple  # (request id, token)
    finished: tuple
    preempted: tuple
    pages_in_use: int
    attention: str = ""  # "paged" or "cascade" ("" when nothing ran)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass
class _Launched:
    """A step whose batch the runner has; completed once its sampled tokens are on the host."""

    step: int
    plan: list  # [(sequence, new tokens)]
    sampled: list  # [(sequence, index in its tokens)]: placeholder -1 - j for sampled row j
    handle: object  # the runner's sample() handle (None: nothing sampled)
    finished: list  # sequences done after this step (left the running set, pages held)
    preempted: list
    attention: str


class Engine:
    """Serve :class:`Request` objects with a model runner over one :class:`PagePool`.

    Parameters
    ----------
    runner : a model runner (:class:`~nbinfer.engine.runners.NumpyRunner`, ...) whose caches
        hold ``num_pages`` pages of ``page_size`` tokens
    num_pages, page_size : int
    max_step_tokens : int
        Token budget of a step (decode tokens and prefill chunks together).
    max_batch : int
        Sequences per step.
    prefix_cache : bool
        Keep full pages in a :class:`~nbinfer.formats.RadixTree` (a prompt's after each of its
        chunks; all a sequence computed when it ends or is preempted); a new request starts
        from the pages of its longest cached prefix (``prefix_hit_rate``), and
        cached pages nobody runs on are evicted, least recently used first, when the pool runs
        dry.
    cascade : {"auto", "always", "off"}
        ``"auto"``: a decode-only step whose sequences share pages runs as a cascade (each
        shared run of pages read once for all its sequences, then each sequence's own pages,
        the states merged) when the reads it saves pay for its fixed costs
        (:meth:`cascade_pays`, :attr:`CASCADE_RULE`) and, when a CUDA graph would replay the
        plain step, the runner replays the cascade step too; else paged. ``"always"``: every
        such step that shares any page, under the same graph condition (the rule's A/B).
    overlap : bool
        Launch each step before the previous one's tokens reach the host (module docstring);
        the runner must have ``sample`` and ``fetch``.
    """

    # The cascade's cost model, fitted on the H100 (sessions 25-26, bf16, D 64, Hkv 8, 64
    # sequences, 912-16384 shared tokens; bench/NOTES.md "Session 26"): plain decode over
    # shared pages streams every sequence's tokens through the L2; the one-launch cascade reads
    # the shared pages once. Per layer the cascade's GPU time is below plain decode's by
    # saved bytes / 5.8 TB/s - 15.4 us (within 5 us at every size). Without overlap its plan's
    # extra host time (0.27 ms a step: 0.83 against 0.56 ms) adds to the step; with overlap the
    # host runs under the previous step's GPU work.
    CASCADE_BANDWIDTH = 5.8e12  # bytes/s: the fit's rate of the reads sharing saves
    CASCADE_LAYER_S = 15.4e-6  # the fit's fixed cost of the cascade per layer
    CASCADE_STEP_HOST_S = 0.27e-3  # its extra host time per step (counted without overlap)
    CASCADE_MIN_SAVING = 0.25  # a runner that states no KV bytes: share of the step's reads
    # (the printed rule is written from the constants above, so the two cannot drift apart)
    CASCADE_RULE = (f"cascade when every sequence decodes one token and the KV reads sharing "
                    f"saves, per layer at {CASCADE_BANDWIDTH / 1e12:g} TB/s, outlast the "
                    f"cascade's fixed cost ({CASCADE_LAYER_S * 1e6:g} us a layer, plus "
                    f"{CASCADE_STEP_HOST_S * 1e3:g} ms of host time a step over the layers "
                    f"without overlap; a runner without KV byte counts: >= "
                    f"{CASCADE_MIN_SAVING * 100:g} % of the step's reads) and, when a CUDA graph "
                    f"replays the plain step, one replays the cascade step too; else paged "
                    f"attention")

    def __init__(self, runner, num_pages: int, page_size: int, *, max_step_tokens: int = 256,
                 max_batch: int = 64, prefix_cache: bool = False, cascade: str = "auto",
                 overlap: bool = False):
        check_positive_int("max_step_tokens", max_step_tokens)
        check_positive_int("max_batch", max_batch)
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {type(overlap).__name__}")
        if overlap and not (hasattr(runner, "sample") and hasattr(runner, "fetch")):
            raise ValueError(f"overlap=True needs a runner with sample() and fetch() (tokens "
                             f"left on the device), {type(runner).__name__} has none")
        self.overlap, self._launched = overlap, None
        self.runner, self.pool = runner, PagePool(num_pages, page_size)
        self.max_step_tokens, self.max_batch = max_step_tokens, max_batch
        self.waiting: list[_Sequence] = []
        self.running: list[_Sequence] = []
        self.finished: dict[int, list] = {}
        self.steps = self.preemptions = self.evicted_pages = 0
        self._next_rid = self._next_order = 0
        if cascade not in ("auto", "always", "off"):
            raise ValueError(f"cascade must be 'auto', 'always' or 'off', got {cascade!r}")
        self.cascade, self.cascade_steps = cascade, 0
        self._levels_key, self._levels_layout = None, None
        self.tree = RadixTree(page_size) if prefix_cache else None
        self.prompt_tokens = self.cached_tokens = 0  # over admissions (a recompute counts again)

    @property
    def prefix_hit_rate(self) -> float:
        """Share of admitted tokens whose KV came from the prefix cache."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request: Request) -> int:
        """Queue ``request``; returns its id. A request whose prompt and output can never fit
        the pool at once is refused."""
        vocab = getattr(getattr(getattr(self.runner, "model", None), "cfg", None), "vocab_size",
                        None)
        if vocab is not None and max(request.prompt) >= vocab:
            raise ValueError(f"prompt token ids must be < vocab_size {vocab}, got "
                             f"{max(request.prompt)}")
        need = -(-(len(request.prompt) + request.max_new_tokens) // self.pool.page_size)
        if need > self.pool.num_pages:
            raise ValueError(f"request needs {need} pages, the pool has {self.pool.num_pages}")
        rid = self._next_rid
        self._next_rid += 1
        self.waiting.append(_Sequence(rid, request, order=-1))
        return rid

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._launched)

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> StepReport | None:
        """Schedule, allocate, run and sample once (see the module docstring). Returns the
        step's report; with ``overlap``, the report of the step before it (``None`` when this
        call launched the first step of a run), whose ``pages_in_use`` then counts the pages
        after this step's allocation."""
        if not self.overlap:
            return self._complete(self._launch())
        # with nothing in flight a step is launched even when it is empty, as without overlap:
        # the step count is the clock that requests arrive by (Engine.run)
        launch = self.waiting or self.running or self._launched is None
        launched = self._launch() if launch else None
        done, self._launched = self._launched, launched
        return None if done is None else self._complete(done)

    def _launch(self) -> _Launched:
        """Steps 1-3 of the module docstring and the count half of step 4: every sequence that
        samples gets a placeholder token (filled in by :meth:`_complete`), and the sequences
        this step finishes leave the running set."""
        preempted = []
        plan = self._schedule()
        plan = self._allocate(plan, preempted)
        sampled, finished, attention, handle = [], [], "", None
        if plan:
            # a sequence whose scheduled tokens reach the end of what it has samples its next
            # token from its last row; only those rows go through the LM head
            levels = self._cascade_levels(plan)  # may reorder plan: first
            due = [seq.computed + n == len(seq.tokens) for seq, n in plan]
            rows = np.cumsum([n for _, n in plan])[np.array(due, dtype=bool)] - 1
            logits, attention = self._run(plan, rows, levels)
            handle = self._sample(logits)
            for (seq, n), sample in zip(plan, due, strict=True):
                seq.computed += n
                if sample:
                    seq.tokens.append(-1 - len(sampled))  # row j of the sampled tokens: -1 - j
                    sampled.append((seq, len(seq.tokens) - 1))
                    if seq.done:
                        finished.append(seq)
            for seq in finished:  # its pages stay until its tokens are in the prefix cache
                self.running.remove(seq)
        self.steps += 1
        return _Launched(self.steps - 1, plan, sampled, handle, finished, preempted, attention)

    def _sample(self, logits):
        sample = getattr(self.runner, "sample", None)
        return self.runner.argmax(logits) if sample is None else sample(logits)

    def _complete(self, launched: _Launched) -> StepReport:
        """The rest of step 4: the sampled tokens on the host, in place of the placeholders;
        full pages to the prefix cache; finished sequences' pages back to the pool."""
        tokens = []
        if launched.sampled:
            fetch = getattr(self.runner, "fetch", None)
            tokens = launched.handle if fetch is None else fetch(launched.handle)
        sampled = []
        for (seq, index), token in zip(launched.sampled, tokens, strict=True):
            seq.tokens[index] = token = int(token)
            sampled.append((seq.rid, token))
        for seq, n in launched.plan:
            # Full pages go to the prefix cache after a chunk of prompt (or recompute) and when
            # a sequence ends or is preempted, not as each decode step fills one: that walked
            # the tree for every running sequence every page_size steps (64 sequences of 1100
            # tokens: ~12 ms on a 2-core CPU, one step in 16; bench/NOTES.md, session 21).
            if n > 1 or seq.done:
                self._cache(seq)
        for seq in launched.finished:
            self.pool.release(seq.pages)
            seq.pages = []
            self.finished[seq.rid] = seq.output
        return StepReport(launched.step, tuple((s.rid, n) for s, n in launched.plan),
                          tuple(sampled), tuple(s.rid for s in launched.finished),
                          tuple(launched.preempted), self.pool.num_pages - self.pool.num_free,
                          launched.attention)

    def _schedule(self) -> list:
        """``[(sequence, new tokens)]`` within the step's token and batch budgets."""
        budget, plan = self.max_step_tokens, []
        # decoding sequences (one token to compute) first, then prefilling ones; oldest first
        pending = [s for s in self.running if len(s.tokens) > s.computed]
        for seq in sorted(pending, key=lambda s: (len(s.tokens) - s.computed > 1, s.order)):
            if budget == 0 or len(plan) == self.max_batch:
                return plan
            n = min(len(seq.tokens) - seq.computed, budget)
            plan.append((seq, n))
            budget -= n
        ps = self.pool.page_size
        # pages the running sequences' new tokens take: admissions must leave them free
        reserved = sum(max(0, -(-(s.computed + n) // ps) - len(s.pages)) for s, n in plan)
        computing = self._prompts_in_flight()
        i = 0
        while i < len(self.waiting) and budget and len(plan) < self.max_batch:
            seq = self.waiting[i]
            cached = self._cached_prefix(seq)
            if self._wait_for_prefix(seq, cached, computing):
                i += 1  # its prefix is being computed: admitted once the cache holds it
                continue
            n = min(len(seq.tokens) - cached, budget)
            need = -(-(cached + n) // ps) - cached // ps
            short = need - (self.pool.num_free - reserved)
            if short > 0 and self.tree is not None:
                short -= self._evict(short)
            if short > 0:  # admitting it now would only preempt it again: wait for pages
                break
            self.waiting.pop(i)
            self._admit(seq)
            if computing is not None and len(seq.tokens) > cached + ps:
                computing.setdefault(tuple(seq.tokens[:ps]), seq)
            plan.append((seq, n))
            budget -= n
            reserved += need
        return plan

    # A waiting request that shares at least this many tokens beyond what the cache holds with a
    # prompt being computed waits for that prompt's pages to reach the cache (SGLang's in-batch
    # prefix check uses 32 tokens too): 64 requests with a 90 % common prefix arriving at once
    # would otherwise compute the prefix once per request of the first prefill step.
    PREFIX_WAIT_TOKENS = 32

    def _prompts_in_flight(self) -> dict | None:
        """Running sequences whose prompt is not all in the prefix cache yet, by first page
        (None without a prefix cache, or when no request waits: a decode step's case)."""
        if self.tree is None or not self.waiting:
            return None
        ps = self.pool.page_size
        return {tuple(s.tokens[:ps]): s for s in self.running
                if s.cached < len(s.request.prompt) // ps}

    def _wait_for_prefix(self, seq: _Sequence, cached: int, computing: dict | None) -> bool:
        """Whether ``seq`` should wait for a prompt in flight that shares its first pages."""
        if not computing:
            return False
        ps = self.pool.page_size
        other = computing.get(tuple(seq.tokens[:ps]))
        if other is None or other is seq:
            return False
        n = min(seq.prompt_ids.size, other.prompt_ids.size) - 1  # (a last token is computed)
        differ = seq.prompt_ids[:n] != other.prompt_ids[:n]
        common = int(np.argmax(differ)) if differ.any() else n
        return (common // ps) * ps - cached >= self.PREFIX_WAIT_TOKENS

    def _cached_prefix(self, seq: _Sequence) -> int:
        """Tokens of ``seq`` the prefix cache holds (what :meth:`_admit` will reuse)."""
        if self.tree is None or len(seq.tokens) < 2:
            return 0
        return self.tree.match(seq.tokens[:-1])[0]

    def _admit(self, seq: _Sequence) -> None:
        """Move ``seq`` to the running set, starting from its longest cached prefix (at least
        its last token is computed, so its logits exist)."""
        if seq.order < 0:
            seq.order = self._next_order
            self._next_order += 1
        self.running.append(seq)
        self.prompt_tokens += len(seq.tokens)
        if self.tree is not None and len(seq.tokens) > 1:
            n, pages = self.tree.match(seq.tokens[:-1])
            if n:
                seq.pages = pages.tolist()
                self.pool.retain(seq.pages)
                seq.computed, seq.cached = n, n // self.pool.page_size
                self.cached_tokens += n

    def _cache(self, seq: _Sequence) -> None:
        """Hand ``seq``'s newly completed pages to the prefix cache (the tree takes a reference
        to each page it did not hold)."""
        ps = self.pool.page_size
        full = seq.computed // ps
        if self.tree is None or full <= seq.cached:
            return
        already = self.tree.insert(seq.tokens[:full * ps], seq.pages[:full]) // ps
        self.pool.retain(seq.pages[already:full])
        seq.cached = full

    def _allocate(self, plan: list, preempted: list) -> list:
        """Give every scheduled sequence the pages its new tokens need, oldest first; when the
        pool is short, preempt the youngest running sequence (recomputed later)."""
        ps = self.pool.page_size
        alive = set(self.running)  # (a list's membership test per sequence: O(batch^2))
        for seq, n in sorted(plan, key=lambda p: p[0].order):
            if seq not in alive:  # preempted for an older sequence already
                continue
            need = -(-(seq.computed + n) // ps) - len(seq.pages)
            while need > 0:
                pages = self.pool.alloc(need)
                if pages is not None:
                    seq.pages += pages
                    break
                # cached pages no sequence runs on go first
                if self.tree is not None and self._evict(need - self.pool.num_free):
                    continue
                victim = max(self.running, key=lambda s: s.order)
                self._preempt(victim)
                alive.discard(victim)
                preempted.append(victim.rid)
                if victim is seq:
                    break
        return [(s, n) for s, n in plan if s in alive]

    def _evict(self, n: int) -> int:
        """Free up to ``n`` cached pages no sequence runs on, least recently used first."""
        freed = self.tree.evict(n, lambda p: self.pool.refs[p] == 1)
        self.pool.release(freed)
        self.evicted_pages += len(freed)
        return len(freed)

    def _preempt(self, seq: _Sequence) -> None:
        self._cache(seq)  # what it computed stays matchable for its recompute
        self.running.remove(seq)
        self.pool.release(seq.pages)
        seq.pages, seq.computed, seq.cached = [], 0, 0
        self.waiting.insert(0, seq)
        self.preemptions += 1

    def _run(self, plan: list, rows: np.ndarray, levels):
        """The batch of ``plan`` as the runner takes it; the logits of ``rows`` (the step's
        token rows that sample) and the attention used (``levels``: the cascade's, or None)."""
        ps = self.pool.page_size
        # Per sequence only what Python must read (its position, tokens, pages); the rest as
        # array arithmetic: the per-sequence loop was ~80 us of a 64-sequence step on a 2-core
        # CPU, about three times that on the H200's host.
        start = np.array([seq.computed for seq, _ in plan], dtype=np.int64)
        count = np.array([n for _, n in plan], dtype=np.int64)
        qo = _indptr(count)
        length = start + count
        used = -(-length // ps)
        kv_indptr = _indptr(used)
        last = (length - (used - 1) * ps).astype(np.int32)
        if qo[-1] == len(plan):  # one token each (a decode step)
            # with overlap, a placeholder may stand for the last token
            tokens, positions = [seq.tokens[seq.computed] for seq, _ in plan], start
        else:
            tokens = []
            for seq, n in plan:
                tokens += seq.tokens[seq.computed:seq.computed + n]
            positions = np.repeat(start - qo[:-1], count) + np.arange(qo[-1])
        indices = _concat([seq.page_array()[:u]
                           for (seq, _), u in zip(plan, used.tolist(), strict=True)])
        logits = self.runner.forward(np.asarray(tokens), positions, qo, kv_indptr, indices,
                                     last, levels=levels, rows=rows)
        return logits, "paged" if levels is None else "cascade"

    def _cascade_levels(self, plan: list):
        """Two cascade levels of a decode-only step when :attr:`CASCADE_RULE` picks the
        cascade, else None; ``plan`` is reordered in place so that the sequences of each
        shared run of pages are adjacent (the levels' rows are then the batch's own order).

        Sequences share a page only through the prefix cache, so equal page ids mean equal
        tokens: level 0 holds, per group of sequences starting on the same page, the full
        pages they all hold (read once for the group), level 1 each sequence's other pages.
        The grouping depends only on the sequences and their page counts: it is reused until
        one of them gets a page (every ``page_size`` steps per sequence).
        """
        # a replayed paged step beats an eager cascade (CASCADE_RULE): under graphs the cascade
        # needs a runner that replays it too
        replays = getattr(self.runner, "replays_decode", lambda batch: False)(len(plan))
        cascade_replays = getattr(self.runner, "replays_cascade", lambda batch, levels=None: False)
        if self.cascade == "off" or len(plan) < 2 or any(n != 1 for _, n in plan) or \
                (replays and not cascade_replays(len(plan))):
            return None
        ps = self.pool.page_size
        computed = np.array([seq.computed for seq, _ in plan], dtype=np.int64)
        used = (computed + ps) // ps  # pages holding each sequence's KV with its new token
        used_list = used.tolist()
        # page counts and first pages: a preempted and readmitted sequence has new pages
        key = tuple((seq.rid, u, seq.pages[0]) for (seq, _), u in zip(plan, used_list,
                                                                       strict=True))
        if self._levels_key != key:
            self._levels_key, self._levels_layout = key, self._level_layout(
                self._share_groups(plan, used_list))
        saved, order, first, shared, qo0, ptr0, last0, own_shared = self._levels_layout
        if not self.cascade_pays(saved, int(computed.sum()) + len(plan)):
            return None
        plan[:] = [plan[i] for i in order]
        computed, used = computed[order], used[order]
        pages = [seq.page_array() for seq, _ in plan]
        ptr1 = _indptr(used - own_shared)  # each sequence's pages past its group's shared
        batch = len(plan)
        levels = CascadeLevels(
            [qo0, np.arange(batch + 1, dtype=np.int32)], [ptr0, ptr1],
            [_concat([pages[f][:n] for f, n in zip(first, shared, strict=True)]),
             _concat([p[k:u] for p, k, u in zip(pages, own_shared.tolist(), used.tolist(),
                                                strict=True)])],
            [last0, (computed + 1 - (used - 1) * ps).astype(np.int32)], np.arange(batch),
            np.arange(batch + 1, dtype=np.int32), np.arange(batch))
        if replays and not cascade_replays(batch, levels):  # (its tables outgrow the graph's)
            return None
        self.cascade_steps += 1
        return levels

    def cascade_pays(self, saved: int, tokens: int) -> bool:
        """Whether a decode step whose sharing saves ``saved`` of its ``tokens`` KV token reads
        (per layer) runs as a cascade under this engine's ``cascade`` mode
        (:attr:`CASCADE_RULE`). A runner with ``kv_bytes_per_token`` (K and V of one token in
        one layer) and ``num_layers`` is judged by the cost model; one without, by
        :attr:`CASCADE_MIN_SAVING`."""
        if self.cascade == "always" or saved <= 0:
            return saved > 0
        kv_bytes = getattr(self.runner, "kv_bytes_per_token", None)
        if kv_bytes is None:
            return saved >= self.CASCADE_MIN_SAVING * tokens
        fixed = self.CASCADE_LAYER_S
        if not self.overlap:
            fixed += self.CASCADE_STEP_HOST_S / self.runner.num_layers
        return saved * kv_bytes / self.CASCADE_BANDWIDTH >= fixed

    def _level_layout(self, groups: list) -> tuple:
        """What a grouping fixes of the levels (reused while it holds): the KV pages sharing
        saves, the batch order (groups adjacent), each group's first position and shared page
        count, level 0's query indptr, page indptr and last-page lengths, and each sequence's
        group's shared page count."""
        ps = self.pool.page_size
        sizes = [len(members) for members, _ in groups]
        shared = [n for _, n in groups]
        qo0, ptr0 = _indptr(sizes), _indptr(shared)
        saved = ps * sum((k - 1) * n for k, n in zip(sizes, shared, strict=True))
        last0 = np.where(np.array(shared) > 0, ps, 0).astype(np.int32)
        return (saved, [i for members, _ in groups for i in members], qo0[:-1].tolist(), shared,
                qo0, ptr0, last0, np.repeat(np.array(shared, dtype=np.int64), sizes))

    @staticmethod
    def _share_groups(plan: list, used: list) -> list:
        """``[(batch positions, shared full pages)]``: sequences grouped by their first page,
        each group with the number of leading pages all its members hold (never a member's
        last page, which it is still filling); sequences alone in their group share 0."""
        by_first: dict = {}
        for i, ((seq, _), u) in enumerate(zip(plan, used, strict=True)):
            by_first.setdefault(seq.pages[0] if u > 1 else -1 - i, []).append(i)
        groups = []
        for members in by_first.values():
            shared = 0
            if len(members) > 1:
                ref = plan[members[0]][0].pages
                shared = used[members[0]] - 1
                for i in members[1:]:
                    pages, k, limit = plan[i][0].pages, 0, min(shared, used[i] - 1)
                    while k < limit and pages[k] == ref[k]:
                        k += 1
                    shared = k
            if shared:
                groups.append((members, shared))
            else:
                groups += [([i], 0) for i in members]
        return groups

    # -- a whole run ---------------------------------------------------------------------------
    def run(self, requests, *, max_steps: int = 100000, on_step=None) -> list[list]:
        """Serve ``requests`` (each arriving at its ``arrival`` step) to completion; returns the
        generated tokens of each, in the order given. ``on_step(report)`` sees every step."""
        pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
        rids = {}
        while pending or self.has_work:
            while pending and requests[pending[0]].arrival <= self.steps:
                i = pending.pop(0)
                rids[i] = self.add_request(requests[i])
            if self.steps >= max_steps and (pending or self.waiting or self.running):
                # (with overlap, completing the last launched step is not a step)
                raise RuntimeError(f"not done after {max_steps} steps")
            report = self.step()
            if on_step is not None and report is not None:
                on_step(report)
        return [self.finished[rids[i]] for i in range(len(requests))]
