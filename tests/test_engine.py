"""The engine on the CPU: greedy tokens equal to each request run alone without paging.

The tiny configuration in float64 (the NumPy model, attention from nbinfer.reference), requests
arriving mid-run, prompts longer than a step's token budget (chunked prefill), a pool too small
for every request at once (preemption and recompute); and a control that breaks the paged
attention on purpose, to show the comparison can fail.
"""

from __future__ import annotations

import numpy as np
import pytest

from nbinfer.engine import (
    CONFIGS,
    Engine,
    ModelConfig,
    NumpyLlama,
    NumpyRunner,
    PagePool,
    Request,
    config_from_hf,
    generate_alone,
    init_weights,
    named_config,
    pages_for_budget,
    rope_frequencies,
)

CFG = CONFIGS["tiny"]


@pytest.fixture(scope="module")
def model():
    return NumpyLlama(CFG, init_weights(CFG, seed=3))


def _requests(rng, n, arrivals=True):
    lens = rng.integers(1, 40, size=n)
    return [Request(list(rng.integers(0, CFG.vocab_size, size=int(k))), int(rng.integers(1, 9)),
                    arrival=int(rng.integers(0, 6)) if arrivals else 0) for k in lens]


def _alone(model, requests):
    return [generate_alone(model, r.prompt, r.max_new_tokens) for r in requests]


@pytest.mark.parametrize("page_size, budget", [(4, 16), (1, 7), (16, 256)])
def test_tokens_equal_each_request_alone(model, rng, page_size, budget):
    requests = _requests(rng, 6)
    engine = Engine(NumpyRunner(model, 128, page_size), 128, page_size,
                    max_step_tokens=budget)
    reports = []
    out = engine.run(requests, on_step=reports.append)
    assert out == _alone(model, requests)
    assert engine.preemptions == 0 and engine.pool.num_free == 128  # every page came back
    assert all(r.num_tokens <= budget for r in reports)
    if max(len(r.prompt) for r in requests) > budget:
        # a prompt longer than the budget is prefilled over several steps: some step schedules
        # a chunk that does not reach the end of its sequence (no token sampled for it)
        assert any(rid not in dict(r.sampled) for r in reports for rid, _ in r.scheduled)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_small_pool_preempts_the_youngest_and_recomputes(model, rng, overlap):
    requests = [Request(list(rng.integers(0, CFG.vocab_size, size=12)), 10) for _ in range(5)]
    # 5 requests of up to 22 tokens = 6 pages each at page size 4; 12 pages hold two of them
    engine = Engine(NumpyRunner(model, 12, 4), 12, 4, max_step_tokens=64, overlap=overlap)
    preempted = []
    out = engine.run(requests, on_step=lambda r: preempted.extend(r.preempted))
    assert engine.preemptions > 0 and preempted
    assert out == _alone(model, requests)
    assert engine.pool.num_free == 12


def _shared_prefix_requests(rng, n, prefix_len=24):
    prefix = list(rng.integers(0, CFG.vocab_size, size=prefix_len))
    return [Request(prefix + list(rng.integers(0, CFG.vocab_size, size=int(rng.integers(1, 9)))),
                    int(rng.integers(2, 8)), arrival=2 * i) for i in range(n)]


def test_prefix_cache_reuses_pages_and_changes_no_token(model, rng):
    requests = _shared_prefix_requests(rng, 6)
    want = _alone(model, requests)
    runs = {}
    for cache in (False, True):
        engine = Engine(NumpyRunner(model, 128, 4), 128, 4, max_step_tokens=32,
                        prefix_cache=cache)
        reports = []
        runs[cache] = (engine.run(requests, on_step=reports.append), engine.prefix_hit_rate,
                       sum(r.num_tokens for r in reports))
        held = engine.tree.num_pages if cache else 0
        assert engine.pool.num_free + held == 128  # pages are the tree's or free
        assert np.all(engine.pool.refs[engine.pool.refs > 0] == 1)  # nobody else holds one
    assert runs[False][0] == runs[True][0] == want
    assert runs[False][1] == 0 and runs[True][1] > 0.5  # 5 of 6 requests reuse 24 tokens
    assert runs[True][2] < runs[False][2]  # the cached prefix is not computed again


@pytest.mark.parametrize("overlap", [False, True])
def test_requests_arriving_together_wait_for_a_shared_prefix_in_flight(model, rng, overlap):
    # All at step 0 with a 40-token common prefix (10 pages of 4): the first request computes
    # it; the others wait until its pages are in the cache (one step later with overlap) and
    # then reuse all of them. Without the wait the first step computed the prefix once per
    # request it admitted. Decode steps hand no pages to the cache (only prompt chunks and
    # finished sequences do), and the tokens are those of each request alone.
    requests = _shared_prefix_requests(rng, 6, prefix_len=40)
    for r in requests:
        r.arrival = 0
    engine = Engine(NumpyRunner(model, 128, 4), 128, 4, max_step_tokens=256,
                    prefix_cache=True, overlap=overlap)
    held, reports = [], []

    def watch(report):
        reports.append(report)
        held.append((report, engine.tree.num_pages))

    assert engine.run(requests, on_step=watch) == _alone(model, requests)
    prompt = sum(len(r.prompt) for r in requests)
    assert engine.prefix_hit_rate == 5 * 40 / prompt  # the 5 others reuse all 10 pages
    first = reports[0].scheduled if reports[0].scheduled else reports[1].scheduled
    assert len(first) == 1  # the first prefill step computes one request's prompt
    for report, pages in held if not overlap else ():  # (with overlap a step completes after
        # the next one launched: a sequence that ends there is cached a step early)
        if report.scheduled and all(n == 1 for _, n in report.scheduled) and \
                not report.finished:
            assert pages == held[held.index((report, pages)) - 1][1]  # decode caches nothing
    engine_off = Engine(NumpyRunner(model, 128, 4), 128, 4, max_step_tokens=256)
    assert engine_off.run(requests) == _alone(model, requests)


def test_decode_runs_as_a_cascade_when_requests_share_pages(model, rng):
    requests = _shared_prefix_requests(rng, 5, prefix_len=32)
    for r in requests:
        r.max_new_tokens = 8
    results, sizes = {}, []
    for cascade in ("auto", "off"):
        engine = Engine(NumpyRunner(model, 128, 4), 128, 4, prefix_cache=True, cascade=cascade)
        reports = []
        results[cascade] = engine.run(requests, on_step=reports.append)
        sizes += [len(r.scheduled) for r in reports if r.attention == "cascade"]
        kinds = {r.attention for r in reports}
        if cascade == "off":
            assert kinds <= {"paged", ""} and engine.cascade_steps == 0
        else:  # later requests share the 32-token prefix's pages: decode steps cascade
            assert "cascade" in kinds and engine.cascade_steps > 0
            assert all(all(n == 1 for _, n in r.scheduled) for r in reports
                       if r.attention == "cascade")
    assert results["auto"] == results["off"] == _alone(model, requests)

    # A step the runner replays from a CUDA graph stays paged (TorchRunner with cuda_graphs:
    # batches up to its largest bucket); the schedule itself does not change.
    for largest_replayed, cascades in ((max(sizes), 0), (min(sizes) - 1, len(sizes))):
        class Replaying(NumpyRunner):
            def replays_decode(self, batch, largest=largest_replayed):
                return batch <= largest

        engine = Engine(Replaying(model, 128, 4), 128, 4, prefix_cache=True)
        assert engine.run(requests) == results["auto"]
        assert engine.cascade_steps == cascades

        # a runner that replays cascade steps too (TorchRunner's cascade_graphs) cascades
        # them again, unless a step's levels outgrow its graph's tables
        class ReplayingCascades(Replaying):
            def replays_cascade(self, batch, levels=None, largest=largest_replayed, cap=None):
                return batch <= largest and (levels is None or cap is None or all(
                    int(p[-1]) <= cap for p in levels.paged_kv_indptr_arr))

        engine = Engine(ReplayingCascades(model, 128, 4), 128, 4, prefix_cache=True)
        assert engine.run(requests) == results["auto"]
        assert engine.cascade_steps == len(sizes)
        ReplayingCascades.replays_cascade.__defaults__ = (None, largest_replayed, 0)
        engine = Engine(ReplayingCascades(model, 128, 4), 128, 4, prefix_cache=True)
        assert engine.run(requests) == results["auto"]
        assert engine.cascade_steps == cascades
    with pytest.raises(ValueError, match="cascade"):
        Engine(NumpyRunner(model, 4, 4), 4, 4, cascade="on")


def test_cascade_rule_weighs_the_saved_bytes_against_the_cascades_fixed_cost(model, rng):
    """A runner that states its KV bytes per token is judged by the cost model: the cascade
    runs when the shared reads it saves, per layer at CASCADE_BANDWIDTH, outlast its fixed
    cost; "always" cascades every step that shares a page; the tokens never change."""
    requests = _shared_prefix_requests(rng, 5, prefix_len=32)
    for r in requests:
        r.max_new_tokens = 8

    def run(cascade, kv_bytes=None, layers=4):
        runner = NumpyRunner(model, 128, 4)
        if kv_bytes is not None:
            runner.kv_bytes_per_token, runner.num_layers = kv_bytes, layers
        engine = Engine(runner, 128, 4, prefix_cache=True, cascade=cascade)
        return engine.run(requests), engine

    want, always = run("always")
    assert always.cascade_steps > 0 and want == _alone(model, requests)
    # the fixed cost of 4 layers without overlap: 15.4 us + 0.27 ms / 4 = 82.9 us a layer; at
    # 5.8 TB/s that is 481 MB of saved reads. A few saved tokens pay for it only at absurd bytes
    # per token.
    fixed = Engine.CASCADE_LAYER_S + Engine.CASCADE_STEP_HOST_S / 4
    for kv_bytes, cascades in ((2048, 0), (1 << 40, always.cascade_steps)):
        got, engine = run("auto", kv_bytes)
        assert got == want and engine.cascade_steps == cascades
    # the boundary: saved tokens x bytes / bandwidth against the fixed cost, to the token
    engine = run("auto", 1)[1]
    at = fixed * Engine.CASCADE_BANDWIDTH
    assert engine.cascade_pays(int(np.ceil(at)), 10 ** 12)
    assert not engine.cascade_pays(int(np.floor(at)) - 1, 10 ** 12)
    assert not engine.cascade_pays(0, 100)
    # with overlap the host's share is hidden: the GPU's fixed cost alone
    engine.overlap = True
    at = Engine.CASCADE_LAYER_S * Engine.CASCADE_BANDWIDTH
    assert engine.cascade_pays(int(np.ceil(at)), 10 ** 12)
    assert not engine.cascade_pays(int(np.floor(at)) - 1, 10 ** 12)
    # a runner without byte counts keeps the share rule, whatever the step's size
    plain = Engine(NumpyRunner(model, 128, 4), 128, 4)
    assert plain.cascade_pays(25, 100) and not plain.cascade_pays(24, 100)
    assert run("auto")[1].cascade_steps == always.cascade_steps  # all share >= 25 % here


def test_cascade_levels_hold_each_sequences_pages(model, rng):
    # Two shared prefixes and requests of their own: a decode step's levels (groups of
    # sequences over their common full pages, then each sequence's other pages) must give
    # every row exactly the pages and last-page length of its plain page table, step after
    # step as the grouping is reused and rebuilt; tokens as each request alone.
    # Prefixes long against the own tokens (1-8) so that sharing saves >= 25 % of a decode
    # step's reads whatever the draw (prefixes of 20 and 13 fell short for 7 of 200 seeds).
    requests = []
    for n, prefix_len in ((3, 32), (2, 20), (2, 0)):
        requests += _shared_prefix_requests(rng, n, prefix_len=prefix_len)
    for r in requests:
        r.arrival, r.max_new_tokens = 0, 10
    checked = []

    class Checking(NumpyRunner):
        def forward(self, tokens, positions, qo_indptr, kv_indptr, kv_indices, last,
                    levels=None, rows=None):
            if levels is not None:
                (qo0, _), (ptr0, ptr1) = levels.qo_indptr_arr, levels.paged_kv_indptr_arr
                (idx0, idx1), (last0, last1) = (levels.paged_kv_indices_arr,
                                                levels.paged_kv_last_page_len_arr)
                for b in range(len(qo_indptr) - 1):
                    s = int(np.searchsorted(qo0, b, side="right")) - 1
                    pages = np.concatenate([idx0[ptr0[s]:ptr0[s + 1]], idx1[ptr1[b]:ptr1[b + 1]]])
                    np.testing.assert_array_equal(pages, kv_indices[kv_indptr[b]:kv_indptr[b + 1]])
                    assert ptr1[b + 1] > ptr1[b] and last1[b] == last[b]  # (own: the last page)
                    assert last0[s] == (4 if ptr0[s + 1] > ptr0[s] else 0)
                checked.append(len(qo0) - 1)
            return super().forward(tokens, positions, qo_indptr, kv_indptr, kv_indices, last,
                                   levels=levels, rows=rows)

    engine = Engine(Checking(model, 128, 4), 128, 4, prefix_cache=True, max_step_tokens=16)
    assert engine.run(requests) == _alone(model, requests)
    assert engine.cascade_steps == len(checked) > 0 and max(checked) >= 3  # groups and singles


def test_the_public_api_runner_plans_once_per_step_for_every_layer(rng):
    # The NumPy model over nbinfer's wrappers (reference backend), as the GPU runner drives
    # them: per step one plan (decode, causal prefill or cascade) and one append plan, per
    # layer one append run and one attention run.
    from nbinfer.engine.runners import ApiRunner

    model32 = NumpyLlama(CFG, init_weights(CFG, seed=3), dtype=np.float32)
    requests = _shared_prefix_requests(rng, 5, prefix_len=32)
    runner = ApiRunner(model32, 128, 4)
    engine = Engine(runner, 128, 4, max_step_tokens=16, prefix_cache=True)
    reports = []
    assert engine.run(requests, on_step=reports.append) == _alone(model32, requests)
    worked = sum(1 for r in reports if r.scheduled)
    assert runner.attention.plans == worked and engine.cascade_steps > 0
    assert runner.attention.runs == worked * CFG.num_layers
    assert runner.attention.append.__class__.__name__ == "PagedKVAppendWrapper"
    with pytest.raises(TypeError, match="float32"):
        ApiRunner(NumpyLlama(CFG, init_weights(CFG, seed=3)), 8, 4)


def test_api_runner_takes_host_backends_only():
    from nbinfer.engine import ApiRunner

    model = NumpyLlama(CFG, init_weights(CFG, seed=0), dtype=np.float32)
    with pytest.raises(ValueError, match="TorchRunner"):
        ApiRunner(model, 8, 4, backend="cuda")


def test_prefix_cache_evicts_before_it_preempts(model, rng):
    requests = _shared_prefix_requests(rng, 8, prefix_len=16)
    requests += [Request(list(rng.integers(0, CFG.vocab_size, size=20)), 6, arrival=3 + i)
                 for i in range(4)]
    engine = Engine(NumpyRunner(model, 16, 4), 16, 4, max_step_tokens=24, prefix_cache=True)
    assert engine.run(requests) == _alone(model, requests)
    assert engine.prefix_hit_rate > 0 and engine.evicted_pages > 0 and engine.preemptions > 0
    assert engine.pool.num_free + engine.tree.num_pages == 16


def test_the_comparison_fails_when_paged_attention_is_wrong(model, rng):
    class AliasedPage(NumpyRunner):  # every request's first page aliases the batch's last one
        def forward(self, tokens, positions, qo, kv_indptr, kv_indices, last, levels=None,
                    rows=None):
            # (one request's page alone left a tiny model's greedy tokens unchanged for some
            # draws: a request stuck repeating one token)
            wrong = kv_indices.copy()
            if wrong.size > 1:
                wrong[kv_indptr[:-1][np.diff(kv_indptr) > 0]] = wrong[-1]
            return super().forward(tokens, positions, qo, kv_indptr, wrong, last, rows=rows)

    requests = [Request(list(rng.integers(0, CFG.vocab_size, size=20)), 6) for _ in range(3)]
    engine = Engine(AliasedPage(model, 64, 4), 64, 4)
    assert engine.run(requests) != _alone(model, requests)


def test_step_reports_show_decode_and_prefill_in_one_batch(model, rng):
    engine = Engine(NumpyRunner(model, 64, 4), 64, 4, max_step_tokens=10)
    reports = []
    engine.run([Request([1, 2, 3], 6), Request(list(range(30)), 2, arrival=2)],
               on_step=reports.append)
    mixed = [r for r in reports if len(r.scheduled) == 2]
    assert mixed  # request 0 decodes while request 1's prompt is prefilled in chunks
    assert any(dict(r.scheduled)[0] == 1 and dict(r.scheduled)[1] > 1 for r in mixed)


@pytest.mark.parametrize("pool, prefix_cache", [(128, False), (128, True), (14, False),
                                                 (16, True)])
def test_overlap_launches_before_the_last_tokens_arrive_and_changes_no_token(model, rng, pool,
                                                                            prefix_cache):
    # Each step launched while the previous one's tokens are still "on the device": its
    # decoding sequences enter the batch as placeholders that the runner fills from its last
    # sample. Arrivals, chunked prefill, the prefix cache and (small pools) evicted pages all
    # run under it (preemption: the test above); the tokens are the unpaged reference's.
    class Spy(NumpyRunner):
        placeholders = 0

        def forward(self, tokens, *args, **kw):
            self.placeholders += int(np.sum(np.asarray(tokens) < 0))
            return super().forward(tokens, *args, **kw)

    requests = _shared_prefix_requests(rng, 6, prefix_len=12) + _requests(rng, 4)
    want = _alone(model, requests)
    runner = Spy(model, pool, 4)
    engine = Engine(runner, pool, 4, max_step_tokens=20, prefix_cache=prefix_cache,
                    overlap=True)
    if prefix_cache:  # the prefix cache never sees a placeholder: tokens are filled first
        def no_placeholders(call):
            def checked(tokens, *args):
                assert min(tokens) >= 0, "a placeholder reached the prefix cache"
                return call(tokens, *args)
            return checked

        engine.tree.insert = no_placeholders(engine.tree.insert)
        engine.tree.match = no_placeholders(engine.tree.match)
    reports = []
    assert engine.run(requests, on_step=reports.append) == want
    assert runner.placeholders > 0  # decode tokens did come from the device side
    assert [r.step for r in reports] == list(range(engine.steps))  # each step reported once
    assert sum(len(r.sampled) for r in reports) == sum(len(w) for w in want)
    assert engine.pool.num_free + (engine.tree.num_pages if prefix_cache else 0) == pool
    # the same schedule as without overlap when nothing is cached and pages are plenty (with
    # overlap the prefix cache sees a step's pages, and the pool a finished sequence's, one
    # step later, so admissions may wait a step longer)
    if not prefix_cache and pool >= 100:
        plain = []
        Engine(NumpyRunner(model, pool, 4), pool, 4, max_step_tokens=20).run(
            requests, on_step=plain.append)
        assert [r.scheduled for r in plain] == [r.scheduled for r in reports]
        assert [r.sampled for r in plain] == [r.sampled for r in reports]


def test_overlap_through_the_public_api_runner(rng):
    from nbinfer.engine.runners import ApiRunner

    model32 = NumpyLlama(CFG, init_weights(CFG, seed=3), dtype=np.float32)
    requests = _shared_prefix_requests(rng, 5, prefix_len=32)
    engine = Engine(ApiRunner(model32, 128, 4), 128, 4, max_step_tokens=16, prefix_cache=True,
                    overlap=True)
    assert engine.run(requests) == _alone(model32, requests)
    assert engine.cascade_steps > 0


def test_an_idle_gap_between_arrivals_with_and_without_overlap(model, rng):
    # nothing runs between the first request's end and the second's arrival: the engine's
    # clock (its step count) must still advance, or run() would wait forever
    requests = [Request(list(rng.integers(0, CFG.vocab_size, size=5)), 2, arrival=0),
                Request(list(rng.integers(0, CFG.vocab_size, size=6)), 3, arrival=12)]
    for overlap in (False, True):
        engine = Engine(NumpyRunner(model, 64, 4), 64, 4, overlap=overlap)
        reports = []
        assert engine.run(requests, max_steps=40, on_step=reports.append) == \
            _alone(model, requests)
        first = min(r.step for r in reports if any(rid == 1 for rid, _ in r.scheduled))
        assert first == 12, overlap  # admitted at its arrival step
    with pytest.raises(RuntimeError, match="not done after"):  # arrivals past the limit
        Engine(NumpyRunner(model, 64, 4), 64, 4, overlap=True).run(requests, max_steps=8)


def test_max_steps_counts_launched_steps_with_and_without_overlap(model, rng):
    requests = _requests(rng, 3, arrivals=False)
    plain = Engine(NumpyRunner(model, 64, 4), 64, 4)
    want = plain.run(requests)
    for overlap in (False, True):
        engine = Engine(NumpyRunner(model, 64, 4), 64, 4, overlap=overlap)
        assert engine.run(requests, max_steps=plain.steps) == want  # the last one completes
        with pytest.raises(RuntimeError, match="not done after"):
            Engine(NumpyRunner(model, 64, 4), 64, 4, overlap=overlap).run(
                requests, max_steps=plain.steps - 1)


def test_overlap_needs_a_runner_that_samples_on_its_side(model):
    class Plain:  # forward and argmax only
        def forward(self, *args, **kw):
            raise AssertionError("never called")

        @staticmethod
        def argmax(logits):
            return list(logits)

    with pytest.raises(ValueError, match="overlap=True needs a runner with sample"):
        Engine(Plain(), 8, 4, overlap=True)
    with pytest.raises(TypeError, match="overlap must be a bool"):
        Engine(NumpyRunner(model, 8, 4), 8, 4, overlap="yes")


def test_requests_are_validated(model):
    engine = Engine(NumpyRunner(model, 4, 4), 4, 4)
    with pytest.raises(ValueError, match="prompt"):
        Request([], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request([1], 0)
    with pytest.raises(ValueError, match="needs 5 pages"):
        engine.add_request(Request([1] * 15, 5))
    with pytest.raises(ValueError, match=">= 0"):
        Request([3, -1], 2)
    with pytest.raises(ValueError, match="vocab_size 256"):
        engine.add_request(Request([3, 256], 1))
    with pytest.raises(ValueError, match="max_step_tokens"):
        Engine(NumpyRunner(model, 4, 4), 4, 4, max_step_tokens=0)


def test_page_pool_counts_owners():
    pool = PagePool(4, 16)
    a = pool.alloc(3)
    assert a == [0, 1, 2] and pool.num_free == 1 and pool.alloc(2) is None
    pool.retain(a[:2])  # a second sequence shares the first two pages
    pool.release(a)
    assert pool.num_free == 2  # page 2 had one owner; pages 0 and 1 still have one
    pool.release(a[:2])
    assert pool.num_free == 4 and pool.occupancy == 0
    with pytest.raises(ValueError, match="free page"):
        pool.release([0])
    assert pages_for_budget(100 * 1024, CFG.kv_bytes_per_token(4), 16) == 100 * 1024 // (
        CFG.kv_bytes_per_token(4) * 16)
    with pytest.raises(ValueError, match="holds no page"):
        pages_for_budget(10, 1000, 16)


def test_configs_and_hf_config():
    llama = named_config("llama-3.2-1b")
    assert round(llama.num_parameters() / 1e9, 2) == 1.24  # Llama-3.2-1B has 1.24 B weights
    assert round(named_config("qwen2.5-0.5b").num_parameters() / 1e6) == 494
    hf = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
          "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
          "num_key_value_heads": 8, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": True,
          "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    got = config_from_hf(hf)
    assert (got.num_parameters(), got.head_dim, got.rope_scaling) == (
        llama.num_parameters(), 64, llama.rope_scaling)
    with pytest.raises(ValueError, match="config must be one of"):
        named_config("gpt2")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(10, 8, 8, 1, num_heads=3, num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match=r"rope_scaling lacks \['high_freq_factor'"):
        ModelConfig(10, 8, 8, 1, num_heads=2, num_kv_heads=2, head_dim=4, rope_scaling={
            "factor": 8.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192})


def test_llama3_rope_scaling_keeps_high_and_slows_low_frequencies():
    cfg = named_config("llama-3.2-1b")
    plain = rope_frequencies(ModelConfig(**{**cfg.__dict__, "rope_scaling": None}))
    scaled = rope_frequencies(cfg)
    wavelen = 2 * np.pi / plain
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    np.testing.assert_array_equal(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 32)
    mid = ~(high | low)
    assert np.all((scaled[mid] <= plain[mid]) & (scaled[mid] >= plain[mid] / 32))


def test_checkpoint_folder_round_trip(model, tmp_path):
    import json

    from nbinfer.engine.checkpoint import load_checkpoint, read_safetensors, write_safetensors

    untied = ModelConfig(**{**CFG.__dict__, "tie_embeddings": False, "attention_bias": True})
    weights = init_weights(untied, seed=5)
    (tmp_path / "config.json").write_text(json.dumps(untied.to_hf()))
    names = sorted(weights)
    write_safetensors(tmp_path / "a.safetensors", {k: weights[k] for k in names[:5]})
    write_safetensors(tmp_path / "b.safetensors", {k: weights[k] for k in names[5:]})
    cfg, loaded = load_checkpoint(tmp_path)
    assert cfg == untied and sorted(loaded) == names
    assert all(np.array_equal(loaded[k], weights[k]) for k in names)
    prompt = [3, 1, 4, 1, 5, 9]
    assert generate_alone(NumpyLlama(cfg, loaded), prompt, 5) == \
        generate_alone(NumpyLlama(untied, weights), prompt, 5)
    # bf16 tensors are read as the top halves of float32
    bits = np.array([1.0, -2.5, 3.140625], dtype=np.float32).view(np.uint32) >> 16
    raw = bits.astype(np.uint16).tobytes()
    head = json.dumps({"x": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}}).encode()
    (tmp_path / "bf16.bin").write_bytes(len(head).to_bytes(8, "little") + head + raw)
    assert read_safetensors(tmp_path / "bf16.bin")["x"].tolist() == [1.0, -2.5, 3.140625]
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path / "missing")


def test_generate_command(capsys, tmp_path):
    from nbinfer.generate import main

    assert main(["--requests", "3", "--prompt-len", "10", "--output-len", "4", "--quiet",
                 "--shared-prefix", "0.5", "--arrival", "poisson", "--page-size", "2",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "check: 3/3 requests give the same greedy tokens" in out and "tokens/s" in out
    assert main(["--requests", "3", "--prompt-len", "9", "--output-len", "5", "--quiet",
                 "--device", "cpu", "--overlap", "on"]) == 0
    assert "check: 3/3 requests give the same greedy tokens" in capsys.readouterr().out
    for bad, name in ((["--requests", "0"], "--requests"), (["--shared-prefix", "1"],
                      "--shared-prefix"), (["--config", "gpt9"], "--config"),
                      (["--device", "cpu", "--cuda-graphs", "on"], "--cuda-graphs"),
                      (["--device", "cpu", "--dtype", "bfloat16"], "--dtype"),
                      (["--checkpoint", str(tmp_path)], "--checkpoint")):
        try:
            code = main(bad)
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and name in err[0], (bad, err)


def test_torch_model_matches_the_numpy_model(model):
    torch = pytest.importorskip("torch")
    from nbinfer.engine.torch_model import TorchLlama

    cfg = ModelConfig(**{**CFG.__dict__, "tie_embeddings": False, "attention_bias": True,
                         "rope_scaling": named_config("llama-3.2-1b").rope_scaling})
    weights = init_weights(cfg, seed=11)
    np_model, t_model = NumpyLlama(cfg, weights), TorchLlama(cfg, weights)
    g = cfg.group_size

    def sdpa(layer, q, k, v):  # one request, contiguous KV, causal: plain torch attention
        qh, kh, vh = (x.transpose(0, 1) for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(
            qh, kh.repeat_interleave(g, 0), vh.repeat_interleave(g, 0), is_causal=True)
        return o.transpose(0, 1)

    def reference_attend(layer, q, k, v):
        from nbinfer import reference

        return reference.single_prefill_with_kv_cache(q, k, v, causal=True)

    tokens = np.array([5, 17, 200, 3, 99, 42, 7, 255])
    pos = np.arange(tokens.size)
    want = np_model.forward(tokens, pos, reference_attend)
    got = t_model.forward(torch.as_tensor(tokens), torch.as_tensor(pos), sdpa).numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()  # float32 against float64
    assert np.array_equal(got.argmax(-1), want.argmax(-1))
    with pytest.raises(TypeError, match="dtype"):
        TorchLlama(cfg, weights, dtype=torch.int32)
