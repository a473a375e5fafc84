"""bench/prebuild_cache.py: specs read back from cache entries, and an offline build.

The prebuilt cache is only useful if every spec comes back exactly (its stable text, and so
its key, equal to the entry's); these tests check that round trip for every kind of spec and
built-in variant the suite compiles, and that what cannot come back is skipped with a reason.
The offline build itself needs the CUDA toolkit's NVVM and nvJitLink (skipped without them).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest

from nbinfer import variants
from nbinfer.kernels import cache
from nbinfer.kernels.append import AppendSpec
from nbinfer.kernels.cache import KernelStore, kernel_key, stable
from nbinfer.kernels.decode import DecodeSpec
from nbinfer.kernels.layers import NormSpec, RopeSpec, SiluMulSpec
from nbinfer.kernels.prefill import PrefillSpec
from nbinfer.kernels.prefill_mma import MmaPrefillSpec
from nbinfer.kernels.state import StateSpec

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("prebuild_cache", ROOT / "bench" /
                                               "prebuild_cache.py")
prebuild = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prebuild)

B = variants


def _variants():
    return [B.standard(), B.causal(), B.soft_cap(30.0), B.sliding_window(100),
            B.from_flashinfer_args(causal=True, window_left=100),
            B.from_flashinfer_args(causal=True, logits_soft_cap=20.0, window_left=50),
            B.from_flashinfer_args(pos_encoding_mode="ALIBI", num_qo_heads=12, causal=True),
            B.from_flashinfer_args(pos_encoding_mode="ROPE_LLAMA", rope_theta=5e5),
            B.from_flashinfer_args(pos_encoding_mode="ROPE_LLAMA", causal=True),
            B.attention_sink([-1.0, -0.9, 0.25]), B.sigmoid_attention(0.5, -1.0)]


def _specs():
    out = [AppendSpec(8, 32, 16, True, False), StateSpec("float16", 64, 2.718281828459045, False)]
    for v in _variants():
        out.append(DecodeSpec(128, 4, 16, "float16", "float16", "NHD", v, sparse=True,
                              max_registers=128))
        out.append(PrefillSpec(64, 2, 1, "bfloat16", "bfloat16", "HND", v, custom_mask=True))
    lean = MmaPrefillSpec(128, 1, 1, "float16", "float16", "NHD", B.causal(), num_warps=8,
                          kv_tile=64, max_registers=128, defer_merge=True, wgmma=True,
                          lean=True)
    out += [lean, dataclasses.replace(lean, prefetch=True, lazy_rescale=True),
            lean.on_mma_sync(kv_tile=32, max_registers=None),
            NormSpec("bfloat16", "float32", True), SiluMulSpec("float16"),
            RopeSpec("float32", 128, 64, False, "int32", True)]
    return out


@pytest.mark.parametrize("spec", _specs(), ids=lambda s: f"{type(s).__name__}")
def test_a_spec_comes_back_from_its_stable_text(spec):
    text = stable(spec)
    rebuilt, why = prebuild.rebuild_spec(text)
    assert why is None and type(rebuilt) is type(spec)
    assert stable(rebuilt) == text and rebuilt == spec


def test_what_cannot_come_back_is_skipped_with_a_reason():
    scale = 3.0
    user = variants.Variant("user_scale", logits_transform=lambda s, q, k, h: s * scale)
    text = stable(DecodeSpec(64, 1, 16, "float16", "float16", "NHD", user))
    assert prebuild.rebuild_spec(text) == (None, "variant not a built-in: user_scale")
    gone = text[:-1] + ",retired_knob=bool:True)"
    spec, why = prebuild.rebuild_spec(gone)
    assert spec is None and "retired_knob" in why
    assert prebuild.rebuild_spec("nbinfer.kernels.gone.OldSpec(x=int:1)")[0] is None


def test_jobs_from_a_folder_add_the_lean_rungs_and_drop_repeats(tmp_path):
    store = KernelStore(tmp_path)
    lean = next(s for s in _specs() if getattr(s, "lean", False))
    decode = _specs()[2]
    for i, (kind, spec) in enumerate([("prefill_wgmma", lean), ("decode", decode),
                                      ("decode", decode)]):
        key, meta = kernel_key(kind, spec, f"sig{i}", {}, (9, 0))  # two entries, one spec
        store.save(key, meta, "_Z1k", b"cubin")
    jobs, skipped = prebuild.jobs_from(prebuild.source_specs(tmp_path), lean_rungs=True)
    assert not skipped
    kinds = sorted((k, tuple(sorted(c))) for k, _, c in jobs)
    assert kinds == [("decode", ()), ("prefill_wgmma", ()), ("prefill_wgmma", ("lazy_rescale",)),
                     ("prefill_wgmma", ("lazy_rescale", "prefetch")),
                     ("prefill_wgmma", ("prefetch",)), ("prefill_wgmma", ("prefetch", "qk_ahead")),
                     ("prefill_wgmma", ("qk_ahead",))]


def test_a_manifest_names_the_specs_its_folder_did(tmp_path):
    # A fresh checkout has no cache folder: the manifest in git stands in for it as --from.
    store = KernelStore(tmp_path / "cache")
    specs = _specs()
    for i, spec in enumerate(specs[:4]):
        key, meta = kernel_key("decode" if isinstance(spec, DecodeSpec) else "other", spec,
                               f"sig{i}", {}, (9, 0))
        store.save(key, meta, "_Z1k", b"cubin")
    folder = prebuild.source_specs(tmp_path / "cache")
    assert len(folder) == 4 and folder == sorted(folder)
    manifest = tmp_path / "specs.json.gz"
    assert prebuild.write_manifest(manifest, folder[:3]) == 3
    first = manifest.read_bytes()
    # adding to it keeps what it held; the same set gives the same bytes
    assert prebuild.write_manifest(manifest, folder[2:]) == 4
    assert prebuild.source_specs(manifest) == folder
    again = tmp_path / "again.json.gz"
    prebuild.write_manifest(again, folder[:3])
    assert again.read_bytes() == first
    assert prebuild.jobs_from(prebuild.source_specs(manifest), lean_rungs=False) == \
        prebuild.jobs_from(folder, lean_rungs=False)
    # the command line: --write-manifest needs no --to
    out = tmp_path / "cli.json.gz"
    assert prebuild.main(["--from", str(tmp_path / "cache"), "--write-manifest", str(out)]) == 0
    assert prebuild.source_specs(out) == folder


def _toolkit() -> bool:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if not (Path(home) / "nvvm").is_dir():
        return False
    try:
        from cuda.bindings import nvjitlink
        nvjitlink.version()
    except Exception:  # noqa: BLE001 - no nvJitLink library: cannot link offline
        return False
    return True


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1",
                    reason="the simulator replaces numba.cuda's compiler")
@pytest.mark.skipif(not _toolkit(),
                    reason="needs the CUDA toolkit's NVVM and nvJitLink")
def test_an_offline_build_stores_an_entry_the_gpu_would_look_up(tmp_path):
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import os, json
        os.environ["NBINFER_CACHE_DIR"] = {str(tmp_path)!r}
        from nbinfer.kernels.offline import assume_device, images_only
        assume_device((9, 0))
        from nbinfer.kernels.state import StateSpec, build_merge_pair
        with images_only((9, 0)):
            k = build_merge_pair(StateSpec("float16", 64, 2.718281828459045, False))
        print(json.dumps({{"key": k.key, "from_cache": k.from_cache, "n": len(k.image.cubin)}}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert not res["from_cache"] and res["n"] > 1000
    entries = list((tmp_path / "kernels").glob("*.nbk"))
    assert [p.stem for p in entries] == [res["key"]]
    header = cache.read_header(entries[0].read_bytes())
    assert header["meta"]["cc"] == [9, 0] and header["meta"]["kind"] == "merge_pair"


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
                    reason="compares with the simulator's wrapper")
def test_engine_decode_specs_are_the_decode_wrappers_own():
    # decode_spec() asks the wrapper's rule as the GPU backend; the simulator's wrapper, given
    # the same arguments, builds the same spec but for sim=True
    import numpy as np

    from nbinfer import BatchDecodeWithPagedKVCacheWrapper

    for hq, hkv, d, ps, dtype in prebuild.ENGINE_DECODE[:3]:
        w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), backend="sim")
        w.plan(np.array([0, 1], np.int32), np.array([0], np.int32), np.array([3], np.int32),
               hq, hkv, d, ps, q_data_type=dtype)
        (cfg,) = w._configs.values()
        assert dataclasses.replace(cfg.spec, sim=False) == prebuild.decode_spec(hq, hkv, d, ps,
                                                                                dtype)


def test_plan_specs_are_the_prefill_wrappers_own():
    # prefill_spec() asks the prefill rule as the GPU backend; a simulator plan of the same
    # problem builds the same spec but for sim=True on two warps (a mixed engine step: too few
    # rows for the lean kernel, so the device's kind never enters), and likewise the one-launch
    # cascade and the CUDA-core kernel of a float32 step
    import numpy as np

    from nbinfer import BatchPrefillWithPagedKVCacheWrapper, MultiLevelCascadeAttentionWrapper

    ws = np.zeros(1 << 22, np.uint8)
    ptr, idx, last = (np.array([0, 1, 2], np.int32), np.array([0, 1], np.int32),
                      np.array([5, 9], np.int32))
    for dtype in ("float16", "bfloat16", "float32"):
        w = BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="sim")
        w.plan(np.array([0, 3, 4], np.int32), ptr, idx, last, 4, 2, 64, 16, causal=True,
               q_data_type=dtype)
        gpu = prebuild.prefill_spec(4, 2, 64, 16, dtype, causal=True, rows_per_request=8)
        sim = dict(sim=True) if dtype == "float32" else dict(sim=True, num_warps=2)
        assert dataclasses.replace(gpu, **sim) == w._slot.get().spec, dtype
    c = MultiLevelCascadeAttentionWrapper(2, ws, "NHD", backend="sim")
    c.plan([np.array([0, 2], np.int32), np.array([0, 1, 2], np.int32)],
           [np.array([0, 1], np.int32), ptr], [np.array([2], np.int32), idx],
           [np.array([16], np.int32), last], 4, 2, 64, 16, q_data_type="float16")
    assert c.one_launch
    gpu = prebuild.prefill_spec(4, 2, 64, 16, "float16", causal=False, rows_per_request=1,
                                all_split=True)
    assert dataclasses.replace(gpu, sim=True, num_warps=2) == c.fused_wrapper.step_plan.spec


def test_plan_specs_ask_the_engines_shapes_and_the_level_cascades():
    jobs = prebuild.plan_specs()
    heads = {(s.head_dim, s.group_size) for k, s in jobs if k == "prefill_plan"}
    assert {(64, 2), (64, 4), (64, 7), (128, 4)} <= heads
    assert {s.row_words for k, s in jobs if k == "append"} == {16, 32}


def test_the_gpu_tests_case_lists_give_specs_that_come_back():
    # suite_specs() reads the gpu tests' case lists without importing them (they need torch);
    # every spec it derives must come back from its stable text (a worker rebuilds it so)
    jobs = prebuild.suite_specs()
    m = prebuild.suite_matrices("test_gpu_decode", "MATRIX", "MMA_MATRIX", "TENSOR_CORE_MATRIX")
    assert len(jobs) >= sum(map(len, m.values()))
    for kind, spec in jobs:
        back, why = prebuild.rebuild_spec(stable(spec))
        assert back is not None and stable(back) == stable(spec), (kind, why)
    assert any(getattr(s, "mma", False) for _, s in jobs)  # DECODE_MMA's rows
    assert {s.variant.name for _, s in jobs} >= {"soft_cap_30", "sliding_window_300", "causal"}


def test_decode_specs_with_variant_flags_are_the_wrappers_own():
    import numpy as np

    from nbinfer import BatchDecodeWithPagedKVCacheWrapper

    for layout, ps, kw in (("NHD", 16, dict(logits_soft_cap=30.0)),
                           ("HND", 5, dict(window_left=300)),
                           ("NHD", 1, dict(variant=variants.attention_sink([0.5] * 8)))):
        w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), layout,
                                               backend="sim")
        w.plan(np.array([0, 1], np.int32), np.array([0], np.int32), np.array([1], np.int32),
               8, 2, 64, ps, q_data_type="float16", **kw)
        (cfg,) = w._configs.values()
        assert dataclasses.replace(cfg.spec, sim=False) == prebuild.decode_spec(
            8, 2, 64, ps, "float16", layout, **kw), kw
