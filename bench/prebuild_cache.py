"""Fill a GPU machine's kernel cache on a machine without a GPU.

A device session that starts with a cold cache spends most of its time compiling (8-17 s per
kernel spec on the H200 host, a few hundred specs over the gpu tests and benchmarks). The cubin
needs no GPU: Numba lowers, NVVM writes PTX and nvJitLink links it for sm_90 on any machine
with the CUDA toolkit (:func:`nbinfer.kernels.offline.images_only`). An entry is keyed by the
Python, numba, numba-cuda, cuda-bindings and cuda-core versions (a hook's key holds its
bytecode), so the builder must run under the device image's versions: ``bench/prebuild_env.sh``
makes that interpreter, ``--versions-from`` checks it against entries the device wrote.

Which kernels: every entry of ``--from`` (a cache folder the device filled before; its entries
name their spec, built again here against today's sources, with today's defaults for fields
added since), plus ``--lean-rungs``: each lean warpgroup spec also with ``prefetch``,
``lazy_rescale`` and both (bench/session_wgmma_lean.sh's forms), ``--engine``: the decode
kernels of the engine's model configs (the decode wrapper's own rule picks each spec), and
``--plans``: what no device call has compiled yet (:func:`plan_specs`, :func:`suite_specs`,
:func:`lean_counterparts`: each spec from the api's own rule asked as the GPU backend). A spec
whose variant is not one of nbinfer's built-ins (composed by ``from_flashinfer_args`` or the
factories) is skipped.

The cache folder is not in git, and a fresh checkout starts without one: the manifest
``bench/cache_specs.json.gz`` (every spec a device call compiled, gzipped JSON, added to with
``--write-manifest``) stands in for it as ``--from``, so the whole cache can be rebuilt here.

    bash bench/prebuild_env.sh  # once: /tmp/py312 with the device's versions
    PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD /tmp/py312/bin/python \\
        bench/prebuild_cache.py --from .nbinfer-cache --to .nbinfer-cache --lean-rungs --engine \\
        --plans
    # a fresh checkout: the manifest instead of the folder
    ... bench/prebuild_cache.py --from bench/cache_specs.json.gz --to .nbinfer-cache --plans
    # after a device call brought entries back: record their specs
    ... bench/prebuild_cache.py --from .nbinfer-cache --write-manifest bench/cache_specs.json.gz

Checked against the H200's entries (2026-12-04): a merge kernel built here has the key of the device's
entry and the same SASS (only Numba's per-process name suffix differs); the device's cubins
carry ptxas 13.0.88, the version of nvJitLink this environment installs.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import gzip
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nbinfer.kernels import cache  # noqa: E402

# --------------------------------------------------------------------------------------------
# Reading cache.stable() texts back
# --------------------------------------------------------------------------------------------


class Raw(str):
    """A part of a stable text this parser keeps as text (a hook's code, a variant)."""


def _parse(text: str, i: int = 0):
    """``(value, end)`` of the stable text starting at ``text[i]``."""
    for prefix, conv in (("int:", int), ("float:", float.fromhex)):
        if text.startswith(prefix, i):
            j = i + len(prefix)
            k = j
            while k < len(text) and text[k] not in ",)=":
                k += 1
            return conv(text[j:k]), k
    if text.startswith("bool:", i):
        v = text.startswith("True", i + 5)
        return v, i + 5 + (4 if v else 5)
    if text.startswith("NoneType:None", i):
        return None, i + 13
    if text.startswith("str:", i):  # the string's repr
        quote, j = text[i + 4], i + 5
        while text[j] != quote:
            j += 2 if text[j] == "\\" else 1
        return ast.literal_eval(text[i + 4:j + 1]), j + 1
    for opener, kind in (("tuple(", tuple), ("list(", list)):
        if text.startswith(opener, i):
            j, items = i + len(opener), []
            while text[j] != ")":
                v, j = _parse(text, j)
                items.append(v)
                if text[j] == ",":
                    j += 1
            return kind(items), j + 1
    # anything else with parentheses (code(...), Variant(...), set(...), a dataclass): as text
    j, depth, quote = i, 0, None
    while j < len(text):
        c = text[j]
        if quote:
            if c == "\\":
                j += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "(":
            depth += 1
        elif c == ")":
            if depth == 0:
                break
            depth -= 1
            if depth == 0:
                j += 1
                break
        elif c == "," and depth == 0:
            break
        j += 1
    return Raw(text[i:j]), j


def spec_fields(text: str) -> tuple[str, dict]:
    """``("module.Class", {field: value})`` of a spec's stable text (a variant stays Raw)."""
    head, rest = text.split("(", 1)
    fields, j = {}, 0
    body = rest[:-1]
    while j < len(body):
        eq = body.index("=", j)
        name = body[j:eq]
        value, j = _parse(body, eq + 1)
        fields[name] = value
        if j < len(body) and body[j] == ",":
            j += 1
    return head, fields


def variant_name_params(raw: str) -> tuple[str, dict]:
    """The name and parameters of a variant's stable text."""
    (name, params, *_), _ = _parse(raw[len("Variant("):-1])
    return name, {k: v for k, v in params}


def rebuild_variant(raw: str):
    """The built-in variant whose stable text is ``raw``, or None."""
    from nbinfer import variants as V
    from nbinfer.variants import builtins as B

    name, p = variant_name_params(raw)
    parts = name.split("+")
    tries = []
    if name in ("standard", "causal"):
        tries.append(getattr(B, name)())
    args = dict(causal="causal" in parts)
    for part in parts:
        if part.startswith("sliding_window_"):
            args["window_left"] = p["window_left"]
        elif part.startswith("soft_cap_"):
            args["logits_soft_cap"] = p["cap"]
        elif part.startswith("alibi_"):
            args.update(pos_encoding_mode="ALIBI", num_qo_heads=p["num_heads"])
        elif part.startswith("rope_llama"):
            args.update(pos_encoding_mode="ROPE_LLAMA", rope_scale=p["rope_scale"],
                        rope_theta=p["rope_theta"])
    try:
        tries.append(B.from_flashinfer_args(**args))
    except (TypeError, ValueError):
        pass
    factories = []
    for part in parts:
        if part == "causal":
            factories.append(B.causal())
        elif part.startswith("attention_sink_"):
            factories.append(B.attention_sink(list(p["sinks"])))
        elif part.startswith("sigmoid_"):
            factories.append(B.sigmoid_attention(p["scale"], p["bias"]))
        elif part.startswith("sliding_window_"):
            factories.append(B.sliding_window(p["window_left"]))
        elif part.startswith("soft_cap_"):
            factories.append(B.soft_cap(p["cap"]))
    if factories:
        tries.append(factories[0] if len(factories) == 1 else V.compose(*factories))
    for v in tries:
        if cache.stable(v) == raw:
            return v
    return None


# --------------------------------------------------------------------------------------------
# Specs and their builders
# --------------------------------------------------------------------------------------------

def _classes():
    from nbinfer.kernels.append import AppendSpec
    from nbinfer.kernels.decode import DecodeSpec
    from nbinfer.kernels.layers import NormSpec, RopeSpec, SiluMulSpec
    from nbinfer.kernels.prefill import PrefillSpec
    from nbinfer.kernels.prefill_mma import MmaPrefillSpec
    from nbinfer.kernels.state import StateSpec

    return {f"{c.__module__}.{c.__qualname__}": c
            for c in (AppendSpec, DecodeSpec, PrefillSpec, MmaPrefillSpec, StateSpec, NormSpec,
                      RopeSpec, SiluMulSpec)}


def _builder(kind: str):
    from nbinfer.kernels import (
        append,
        decode,
        layers,
        prefill,
        prefill_mma,
        split_merge,
        state,
        value_scan,
    )

    return {"decode": decode.build_decode_kernel, "prefill": prefill.build_prefill_kernel,
            "prefill_mma": prefill_mma.build_prefill_mma_kernel,
            "prefill_wgmma": prefill_mma.build_prefill_mma_kernel,
            "split_merge": split_merge.build_split_merge_kernel,
            "value_scan": value_scan.build_value_scan_kernel,
            "append": append.build_append_kernel, "merge_pair": state.build_merge_pair,
            "merge_stack": state.build_merge_stack, "rmsnorm": layers.build_layer_kernel,
            "silu_and_mul": layers.build_layer_kernel, "rope": layers.build_layer_kernel}[kind]


def rebuild_spec(text: str):
    """The spec object of an entry's stable spec text with today's class (fields added since
    take their defaults), or ``(None, why)``."""
    head, fields = spec_fields(text)
    cls = _classes().get(head)
    if cls is None:
        return None, f"unknown spec class {head}"
    names = {f.name for f in dataclasses.fields(cls)}
    gone = sorted(set(fields) - names)
    if gone:
        return None, f"fields no longer in {cls.__name__}: {gone}"
    if isinstance(fields.get("variant"), Raw):
        v = rebuild_variant(fields["variant"])
        if v is None:
            return None, f"variant not a built-in: {variant_name_params(fields['variant'])[0]}"
        fields["variant"] = v
    try:
        return cls(**fields), None
    except (TypeError, ValueError) as exc:
        return None, f"{cls.__name__}: {exc}"


def source_specs(source: Path) -> list[tuple[str, str]]:
    """``[(kind, spec text)]`` named by ``source``: a cache folder's entries (its ``kernels/``
    subfolder if it has one), or a manifest file (:func:`write_manifest`), sorted."""
    if source.is_file():
        with gzip.open(source, "rt") as f:
            return sorted((str(k), str(t)) for k, t in json.load(f))
    folder = source / "kernels" if (source / "kernels").is_dir() else source
    out = []
    for path in sorted(folder.glob("*.nbk")):
        header = cache.read_header(path.read_bytes())
        if header is not None:
            out.append((header["meta"]["kind"], header["meta"]["spec"]))
    return sorted(out)


def write_manifest(path: Path, specs) -> int:
    """Write the ``(kind, spec text)`` pairs ``specs``, with those already in ``path``, as the
    manifest ``path`` (gzipped JSON, sorted, each pair once: the same set gives the same bytes);
    returns how many pairs it holds. A fresh checkout has no kernel cache, but the manifest in
    git names every spec the device compiled, so ``--from`` the manifest rebuilds them all
    offline."""
    pairs = set(map(tuple, specs))
    if path.is_file():
        pairs |= set(source_specs(path))
    text = json.dumps(sorted(pairs), indent=0)
    with open(path, "wb") as f:  # no file name or timestamp in the gzip header
        with gzip.GzipFile(filename="", fileobj=f, mode="wb", mtime=0) as z:
            z.write(text.encode())
    return len(pairs)


def jobs_from(specs, lean_rungs: bool, extra=()) -> tuple[list, collections.Counter]:
    """``[(kind, spec text, changes)]`` to build from ``specs`` (``(kind, spec text)`` pairs,
    :func:`source_specs`) and the ``extra`` ``(kind, spec)`` pairs, each kernel once (specs
    travel to the worker processes as text: a variant's hooks do not pickle), and why specs
    were skipped."""
    out, skipped, seen = [], collections.Counter(), set()

    def add(kind, spec, text, change):
        k = (kind, cache.stable(dataclasses.replace(spec, **change)))
        if k not in seen:
            seen.add(k)
            out.append((kind, text, change))

    for kind, text in specs:
        spec, why = rebuild_spec(text)
        if spec is None:
            skipped[why] += 1
            continue
        changes = [{}]
        if lean_rungs and kind == "prefill_wgmma":
            changes += [dict(prefetch=True), dict(lazy_rescale=True),
                        dict(prefetch=True, lazy_rescale=True), dict(qk_ahead=True),
                        dict(prefetch=True, qk_ahead=True)]
        for change in changes:
            add(kind, spec, text, change)
    for kind, spec in extra:
        add(kind, spec, cache.stable(spec), {})
    return out, skipped


# The engine's decode steps (nbinfer.engine's named configs: tiny, Llama-3.2-1B, Qwen2.5-0.5B,
# all head_dim 64) in the dtypes its tests and bench/engine.py run, pages of 16.
ENGINE_DECODE = [(hq, hkv, 64, 16, dtype) for hq, hkv in ((4, 2), (32, 8), (14, 2))
                 for dtype in ("float32", "float16", "bfloat16")]


# plan() keywords that shape the variant (the rest, like sm_scale or fixed_split_size, do not
# reach a kernel's spec)
_VARIANT_FLAGS = ("pos_encoding_mode", "window_left", "logits_soft_cap", "rope_scale",
                  "rope_theta")


def _with_knobs(module, knobs: dict, ask):
    """``ask()`` with the api module's knobs (``DECODE_MMA=True``, ``LEAN_PREFETCH=True``,
    ...) set for the call."""
    saved = {k: getattr(module, k) for k in knobs}
    try:
        for k, v in knobs.items():
            setattr(module, k, v)
        return ask()
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def decode_spec(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, layout="NHD", *,
                kv_dtype=None, knobs=None, **flags):
    """The spec a GPU decode wrapper's plan() compiles for these arguments (its own rule,
    :meth:`BatchDecodeWithPagedKVCacheWrapper._validate_statics`, asked as the GPU backend);
    ``flags``: plan()'s variant keywords and ``variant``."""
    from types import SimpleNamespace

    from nbinfer.api import decode as D

    gpu = SimpleNamespace(_backend="cuda", _kv_layout=layout)
    f = {k: flags.get(k) for k in _VARIANT_FLAGS}
    return _with_knobs(D, knobs or {}, lambda: D.BatchDecodeWithPagedKVCacheWrapper
                       ._validate_statics(gpu, num_qo_heads, num_kv_heads, head_dim, page_size,
                                          f["pos_encoding_mode"] or "NONE",
                                          -1 if f["window_left"] is None else f["window_left"],
                                          f["logits_soft_cap"], None, f["rope_scale"],
                                          f["rope_theta"], dtype, kv_dtype, None,
                                          flags.get("variant")).spec)


def prefill_spec(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, *, causal,
                 rows_per_request, layout="NHD", sparse=True, all_split=False, variant=None,
                 custom_mask=False, block_positions=False, knobs=None, **flags):
    """The spec a GPU prefill wrapper's plan() compiles (its rule,
    :meth:`~nbinfer.api.prefill.PrefillWrapperBase._spec`, asked as the GPU backend on an
    sm_90 device) for requests of ``rows_per_request`` query rows on average; ``sparse``: paged
    (True) or ragged KV; ``all_split``: the one-launch cascade; ``variant`` a whole variant or
    ``flags`` plan()'s variant keywords; ``knobs``: the api module's knobs while it decides."""
    from types import SimpleNamespace

    from nbinfer.api import prefill as P
    from nbinfer.api.decode import attention_variant

    if variant is None:
        variant = attention_variant(num_qo_heads, flags.get("variant"), causal=causal,
                                    **{k: flags[k] for k in _VARIANT_FLAGS if k in flags})
    step = SimpleNamespace(head_dim=head_dim, page_size=page_size, kv_dtype=dtype,
                           q_dtype=dtype, variant=variant, custom_mask=custom_mask,
                           q_pos0=0 if block_positions else None,
                           num_qo_rows=int(rows_per_request), batch_size=1)
    gpu = SimpleNamespace(_backend="cuda", _kv_layout=layout, _sparse=sparse,
                          _all_split=all_split)
    return _with_knobs(P, knobs or {}, lambda: P.PrefillWrapperBase._spec(
        gpu, step, num_qo_heads // num_kv_heads)[0])


def append_spec(head_dim, page_size, dtype, combined=True):
    """The append kernel's spec for whole rows of ``head_dim`` elements (rows 8-byte
    aligned, as torch allocates them: the widest copy unit)."""
    from nbinfer.kernels.append import AppendSpec, choose_word_bytes

    row = head_dim * {"float32": 4}.get(dtype, 2)
    word = choose_word_bytes(row, [0])
    return AppendSpec(word, row // word, page_size, combined)


def plan_specs() -> list:
    """``(kind, spec)`` of the plans the next device session makes that no earlier device
    call compiled: the engine's prefill, cascade and append steps (its three model configs,
    head_dim 64, pages of 16, each dtype; a prefill step of whole prompts and one that mixes
    a chunk with decoding rows), bench/prefill.py's level-by-level cascade (64 x (8192 + 256),
    Hq 32, Hkv 8, D 128: a prefix level of 64 queries x G 4 rows, with and without the per-item
    overlap), and the torch model's layer kernels (:mod:`nbinfer.kernels.layers`). Prefill specs
    are built with their companions (``prefill_plan``)."""
    out = []
    for hq, hkv in ((4, 2), (32, 8), (14, 2)):
        for dtype in ("float32", "float16", "bfloat16"):
            for rows in (1024, 8):  # whole prompts (the lean kernel on sm_90), a mixed step
                out.append(("prefill_plan", prefill_spec(hq, hkv, 64, 16, dtype, causal=True,
                                                         rows_per_request=rows)))
            if dtype != "float32":  # the one-launch cascade (tensor cores only)
                out.append(("prefill_plan", prefill_spec(hq, hkv, 64, 16, dtype, causal=False,
                                                         rows_per_request=1, all_split=True)))
    for dtype in ("float32", "float16", "bfloat16"):
        out.append(("append", append_spec(64, 16, dtype)))
    for prefetch in (None, True):
        out.append(("prefill_plan", prefill_spec(32, 8, 128, 16, "float16", causal=False,
                                                 rows_per_request=64,
                                                 knobs=dict(LEAN_PREFETCH=prefetch))))
    from nbinfer.kernels.layers import RopeSpec, SiluMulSpec, norm_spec

    # the torch model's layer kernels (float32 norm weights; tests/test_gpu_layers.py also
    # normalises with weights of the activations' dtype; rows of the tiny model, Qwen2.5-0.5B
    # and Llama-3.2-1B / the layer tests) and RoPE over head_dim 64
    for dtype in ("float32", "float16", "bfloat16"):
        for hidden in (128, 896, 2048):
            out += [("rmsnorm", norm_spec(dtype, "float32", False, False, hidden)),
                    ("rmsnorm", norm_spec(dtype, "float32", True, False, hidden)),
                    ("rmsnorm", norm_spec(dtype, dtype, False, False, hidden))]
        out += [("silu_and_mul", SiluMulSpec(dtype)),
                ("rope", RopeSpec(dtype, 64, 64, True, "int64", False))]
    # the fast / careful comparison's int32 positions, memcheck's partial rotary
    out += [("rope", RopeSpec("bfloat16", 64, 64, True, "int32", False)),
            ("rope", RopeSpec("bfloat16", 64, 48, True, "int32", False))]
    return out


def suite_matrices(name: str, *matrices: str) -> dict:
    """The named module-level case lists of ``tests/<name>.py``, evaluated without importing
    the test module (it needs torch and a GPU): each assignment's expression, with ``np`` and
    ``V`` (nbinfer.variants) in scope."""
    import numpy as np

    from nbinfer import variants

    path = Path(__file__).resolve().parents[1] / "tests" / f"{name}.py"
    scope = {"np": np, "V": variants}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and getattr(node.targets[0], "id", None) in matrices:
            scope[node.targets[0].id] = eval(compile(ast.Expression(node.value), str(path),
                                                     "eval"), scope)
    return {m: scope[m] for m in matrices}


def suite_specs() -> list:
    """``(kind, spec)`` of the gpu tests' case lists under today's rules (decode's matrices
    with and without ``DECODE_MMA``, the tensor-core decode, FP8 decode, the paged prefill's
    cases): the tests themselves need a GPU, their specs do not."""
    out = []
    m = suite_matrices("test_gpu_decode", "MATRIX", "MMA_MATRIX", "TENSOR_CORE_MATRIX")
    for _, _, hq, hkv, d, ps, dtype, layout, kw in m["MATRIX"]:
        out.append(("decode", decode_spec(hq, hkv, d, ps, dtype, layout, **kw)))
    for _, _, hq, hkv, d, ps, dtype, layout, fmt, kw in m["MMA_MATRIX"]:
        out.append(("decode", decode_spec(hq, hkv, d, ps, dtype, layout, kv_dtype=fmt,
                                          knobs=dict(DECODE_MMA=True), **kw)))
    for _, _, hq, hkv, d, ps, dtype, layout, kw in m["TENSOR_CORE_MATRIX"]:
        out.append(("prefill_plan", prefill_spec(hq, hkv, d, ps, dtype, causal=False,
                                                 rows_per_request=1, layout=layout, **kw)))
    for _, _, hq, hkv, d, ps, dtype, layout, fmt, kw in \
            suite_matrices("test_gpu_fp8", "MATRIX")["MATRIX"]:
        out.append(("decode", decode_spec(hq, hkv, d, ps, dtype, layout, kv_dtype=fmt, **kw)))
    for qo, _, hq, hkv, d, ps, dtype, layout, kw in \
            suite_matrices("test_gpu_prefill", "PAGED_CASES")["PAGED_CASES"]:
        kw = dict(kw)
        out.append(("prefill_plan", prefill_spec(
            hq, hkv, d, ps, dtype, causal=kw.pop("causal", False),
            rows_per_request=sum(qo) / len(qo) * (hq // hkv), layout=layout, **kw)))
    return out


def lean_counterparts(specs) -> list:
    """``(kind, spec)``: for every tensor-core prefill spec of ``specs`` (``(kind, spec
    text)`` pairs) on ``mma.sync`` with the default tiles, the spec the rule now gives the same
    problem on an sm_90 GPU when its requests fill the tile (the lean kernel, where it computes
    the problem): the gpu tests' 16-bit prefill plans ran before the rule existed."""
    from nbinfer.kernels.prefill_mma import MmaPrefillSpec

    out = []
    for kind, text in specs:
        if kind != "prefill_mma":
            continue
        spec, _ = rebuild_spec(text)
        if not isinstance(spec, MmaPrefillSpec) or spec.wgmma or spec.kv_split \
                or spec.value_guard or spec.sim:
            continue
        lean = prefill_spec(spec.group_size, 1, spec.head_dim, spec.page_size, spec.q_dtype,
                            causal=False, rows_per_request=10**6, layout=spec.kv_layout,
                            sparse=spec.sparse, variant=spec.variant,
                            custom_mask=spec.custom_mask,
                            block_positions=spec.block_positions)
        if getattr(lean, "lean", False):
            out.append(("prefill_plan", lean))
    return out


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------

def _init(root: str):
    os.environ["NBINFER_CACHE_DIR"] = root
    from nbinfer.kernels.offline import assume_device

    assume_device((9, 0))


def _build(job):
    kind, text, change = job
    from nbinfer.kernels.offline import images_only

    t0 = time.perf_counter()
    try:
        spec = dataclasses.replace(rebuild_spec(text)[0], **change)
        with images_only((9, 0)):
            if kind == "prefill_plan":  # the kernel and its companions, as plan() builds them
                from nbinfer.api.prefill import _compiled

                kernel, _, (before, after) = _compiled(spec)
                cached = all(k.from_cache for k in (kernel, *before, *after))
            else:
                cached = _builder(kind)(spec).from_cache
    except Exception as exc:  # noqa: BLE001 - reported per spec, the others go on
        return kind, None, f"{type(exc).__name__}: {str(exc)[:200]}", time.perf_counter() - t0
    return kind, cached, None, time.perf_counter() - t0


def check_versions(folder: Path) -> None:
    """Refuse to build when this interpreter's versions differ from the device's entries'."""
    mine = cache.versions()
    for path in sorted(folder.glob("*.nbk")):
        header = cache.read_header(path.read_bytes())
        if header is not None:
            theirs = header["meta"]["versions"]
            if theirs != mine:
                sys.exit(f"versions differ from the device's ({path.name}): {theirs} here "
                         f"{mine}; run under bench/prebuild_env.sh's interpreter")
            return


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="source", required=True,
                    help="cache folder whose entries name the specs to build, or a manifest "
                         "(bench/cache_specs.json.gz)")
    ap.add_argument("--to", default=None, help="cache folder to fill (NBINFER_CACHE_DIR)")
    ap.add_argument("--write-manifest", default=None, metavar="PATH",
                    help="instead of building: add the specs --from names to the manifest PATH")
    ap.add_argument("--versions-from", default=None,
                    help="a cache folder the device wrote: its versions must be this one's")
    ap.add_argument("--lean-rungs", action="store_true",
                    help="each lean spec also with prefetch / lazy_rescale / both / qk_ahead / "
                         "prefetch + qk_ahead")
    ap.add_argument("--engine", action="store_true",
                    help="also the decode kernels of the engine's configs (ENGINE_DECODE)")
    ap.add_argument("--plans", action="store_true",
                    help="also the plans no device call compiled yet (plan_specs), the gpu tests' "
                         "case lists (suite_specs) and the lean counterparts of the folder's "
                         "mma.sync prefill entries")
    ap.add_argument("--kinds", default=None, help="comma-separated kernel kinds (default all)")
    ap.add_argument("--dry-run", action="store_true", help="list the jobs, build nothing")
    ap.add_argument("-j", type=int, default=2, help="processes")
    args = ap.parse_args(argv)
    specs = source_specs(Path(args.source))
    if args.write_manifest:
        n = write_manifest(Path(args.write_manifest), specs)
        print(f"{args.write_manifest}: {n} specs")
        return 0
    if args.to is None:
        ap.error("--to is required unless --write-manifest is given")
    if args.versions_from:
        vf = Path(args.versions_from)
        check_versions(vf / "kernels" if (vf / "kernels").is_dir() else vf)
    _init(args.to)
    extra = [("decode", decode_spec(*case)) for case in ENGINE_DECODE] if args.engine else []
    if args.plans:
        extra += plan_specs() + suite_specs() + lean_counterparts(specs)
    jobs, skipped = jobs_from(specs, args.lean_rungs, extra)
    if args.kinds:
        wanted = set(args.kinds.split(","))
        jobs = [j for j in jobs if j[0] in wanted]
    for why, n in skipped.most_common():
        print(f"skipped {n:4d}: {why}")
    print(f"{len(jobs)} kernels to build ({collections.Counter(j[0] for j in jobs)})")
    if args.dry_run:
        return 0
    t0 = time.perf_counter()
    done = collections.Counter()
    with multiprocessing.get_context("spawn").Pool(args.j, _init, (args.to,)) as pool:
        for i, (kind, cached, err, sec) in enumerate(pool.imap_unordered(_build, jobs), 1):
            state = "error" if err else ("cached" if cached else "built")
            done[state] += 1
            if err or i % 10 == 0 or i == len(jobs):
                print(f"[{i}/{len(jobs)}] {kind:<14} {state:<6} {sec:6.1f} s "
                      f"{err or ''}", flush=True)
    print(f"done in {time.perf_counter() - t0:.0f} s: {dict(done)}")
    return 1 if done["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
