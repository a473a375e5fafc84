"""The persistent kernel cache (nbinfer.kernels.cache): keys, entries, corruption, concurrency.

The store and the keys are plain Python; they are tested here on the CPU. Loading a cubin and
the one-second second process are gpu tests (tests/test_gpu_cache.py).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from nbinfer import variants
from nbinfer.kernels import cache
from nbinfer.kernels.cache import KernelStore, Unkeyable, kernel_key, stable
from nbinfer.kernels.decode import DecodeSpec

ROOT = Path(__file__).resolve().parents[1]
SIG = "void(float16[::1], int32)"


def _spec(variant=None, **kw):
    return DecodeSpec(128, 4, 16, "float16", "float16", "NHD", variant or variants.standard(),
                      **kw)


def _key(spec, cc=(9, 0), **options):
    return kernel_key("decode", spec, SIG, options, cc)


def test_key_is_content_based_and_moves_with_every_input():
    key, meta = _key(_spec(variants.soft_cap(30.0)))
    assert _key(_spec(variants.soft_cap(30.0)))[0] == key  # a fresh, equal variant
    others = {
        "parameter": _key(_spec(variants.soft_cap(50.0)))[0],
        "variant": _key(_spec(variants.causal()))[0],
        "spec field": _key(_spec(variants.soft_cap(30.0), sparse=False))[0],
        "device": _key(_spec(variants.soft_cap(30.0)), cc=(8, 0))[0],
        "options": _key(_spec(variants.soft_cap(30.0)), max_registers=128)[0],
        "kind": kernel_key("prefill", _spec(variants.soft_cap(30.0)), SIG, {}, (9, 0))[0],
    }
    assert key not in others.values() and len(set(others.values())) == len(others)
    assert set(meta) == {"kind", "module", "spec", "signature", "options", "source", "versions",
                         "cc"}
    assert {"nbinfer", "numba", "numba-cuda", "python"} <= set(meta["versions"])


def test_key_follows_a_hooks_source_and_captured_values():
    def make(t):
        def hook(s, q_pos, kv_pos, qo_head):
            return s / t
        return variants.Variant("scaled", logits_transform=hook)

    def make_other(t):
        def hook(s, q_pos, kv_pos, qo_head):
            return s * t
        return variants.Variant("scaled", logits_transform=hook)

    a = _key(_spec(make(np.float32(2.0))))[0]
    assert a == _key(_spec(make(np.float32(2.0))))[0]
    assert a != _key(_spec(make(np.float32(3.0))))[0]  # captured value
    assert a != _key(_spec(make_other(np.float32(2.0))))[0]  # code


def test_key_is_equal_in_another_process():
    code = textwrap.dedent(f"""
        from nbinfer import variants
        from nbinfer.kernels.cache import kernel_key
        from nbinfer.kernels.decode import DecodeSpec
        spec = DecodeSpec(128, 4, 16, "float16", "float16", "NHD", variants.soft_cap(30.0))
        print(kernel_key("decode", spec, {SIG!r}, {{}}, (9, 0))[0])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT, env=dict(os.environ, PYTHONHASHSEED="123"))
    assert out.stdout.strip() == _key(_spec(variants.soft_cap(30.0)))[0]


def test_a_version_change_is_a_different_key(monkeypatch):
    key = _key(_spec())[0]
    real = cache.versions()
    monkeypatch.setattr(cache, "versions", lambda: dict(real, **{"numba-cuda": "0.0.1"}))
    assert _key(_spec())[0] != key


def test_values_without_content_cannot_be_keyed():
    class Opaque:
        pass

    with pytest.raises(Unkeyable):
        stable(Opaque())
    thing = Opaque()

    def hook(s, q_pos, kv_pos, qo_head):
        return s if thing else s

    with pytest.raises(Unkeyable):
        _key(_spec(variants.Variant("opaque", logits_transform=hook)))
    assert stable(-0.0) != stable(0.0) and stable(1) != stable(1.0) != stable(True)


def _store(tmp_path):
    return KernelStore(tmp_path / "kernels")


def _entry(store, payload=b"\x7fELF cubin bytes" * 100):
    key, meta = _key(_spec())
    store.save(key, meta, "_Z6kernel", payload, {"cc": [9, 0]})
    return key, meta, payload


def test_entry_round_trip(tmp_path):
    store = _store(tmp_path)
    key, meta, payload = _entry(store)
    header, data = store.load(key, meta)
    assert data == payload and header["name"] == "_Z6kernel" and header["cc"] == [9, 0]
    assert [p.name for p in store.root.iterdir()] == [f"{key}.nbk"]  # no temporary left


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "empty", "stale"])
def test_a_damaged_or_stale_entry_is_never_loaded_and_is_rebuilt(tmp_path, damage):
    store = _store(tmp_path)
    key, meta, payload = _entry(store)
    path = store.path(key)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-7]
    elif damage == "flip":
        data[-3] ^= 0x40
    elif damage == "header":
        data[len(cache.MAGIC) + 12] ^= 0x01
    elif damage == "empty":
        data = b""
    elif damage == "stale":  # an entry built from other inputs, sitting under this key
        other_key, other_meta = _key(_spec(variants.causal()))
        store.save(other_key, other_meta, "_Z6kernel", payload)
        data = store.path(other_key).read_bytes()
    path.write_bytes(bytes(data))
    assert store.load(key, meta) is None
    assert not path.exists()  # the bad entry is gone
    built = []
    header, out, fresh = store.get_or_build(
        key, meta, lambda: built.append(1) or ("_Z6kernel", payload, {}))
    assert fresh and built == [1] and out == payload
    assert store.load(key, meta)[1] == payload


def test_entries_hold_the_cubin_compressed_and_older_raw_entries_still_load(tmp_path):
    store = _store(tmp_path)
    key, meta, payload = _entry(store)
    data = store.path(key).read_bytes()
    header = cache.read_header(data)
    assert header["encoding"] == "zlib" and len(data) - header["_offset"] < len(payload) // 4
    # an entry written before compression (no "encoding"): the cubin as it is
    raw = dict(cache._header(key, meta, "_Z6kernel", payload, None))
    blob = json.dumps(raw, sort_keys=True).encode()
    store.path(key).write_bytes(cache.MAGIC + len(blob).to_bytes(8, "little") + blob + payload)
    assert store.load(key, meta)[1] == payload


@pytest.mark.parametrize("encoding", ["zlib", "lz4"])
def test_an_entry_that_does_not_decode_is_deleted(tmp_path, encoding):
    store = _store(tmp_path)
    key, meta = _key(_spec())
    stored = b"not zlib at all" * 10  # checksums match the stored bytes; decoding fails
    header = cache._header(key, meta, "_Z6kernel", stored, {"encoding": encoding})
    blob = json.dumps(header, sort_keys=True).encode()
    store.path(key).parent.mkdir(parents=True, exist_ok=True)
    store.path(key).write_bytes(cache.MAGIC + len(blob).to_bytes(8, "little") + blob + stored)
    assert store.load(key, meta) is None and not store.path(key).exists()


def test_two_processes_building_one_key_build_it_once(tmp_path):
    root = tmp_path / "kernels"
    log = tmp_path / "builds.log"
    code = textwrap.dedent(f"""
        import time, sys
        from nbinfer.kernels.cache import KernelStore
        store = KernelStore({str(root)!r})
        meta = {{"kind": "test"}}

        def build():
            with open({str(log)!r}, "a") as f:
                f.write("built\\n")
            time.sleep(1.0)  # both processes are inside get_or_build by now
            return "k", b"payload" * 1000, {{}}

        header, payload, fresh = store.get_or_build("k" * 64, meta, build)
        assert payload == b"payload" * 1000
        print("fresh" if fresh else "loaded")
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-400:] for o in outs]
    assert sorted(o[0].strip() for o in outs) == ["fresh", "loaded"]
    assert log.read_text().count("built") == 1


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NBINFER_CACHE_DIR", str(tmp_path / "c"))
    assert cache.cache_dir() == tmp_path / "c" / "kernels"
    monkeypatch.delenv("NBINFER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache.cache_dir() == tmp_path / "x" / "nbinfer" / "kernels"
    monkeypatch.setenv("NBINFER_CACHE", "0")
    assert cache.cache_dir() is None


def test_header_is_json_naming_what_the_kernel_was_built_from(tmp_path):
    store = _store(tmp_path)
    key, meta, _ = _entry(store)
    data = store.path(key).read_bytes()
    n = int.from_bytes(data[len(cache.MAGIC):len(cache.MAGIC) + 8], "little")
    header = json.loads(data[len(cache.MAGIC) + 8:len(cache.MAGIC) + 8 + n])
    assert header["meta"]["spec"].startswith("nbinfer.kernels.decode.DecodeSpec(")
    assert "soft_cap" not in header["meta"]["spec"] and "standard" in header["meta"]["spec"]


def test_a_kernel_is_keyed_by_the_sources_it_is_built_from():
    decode = cache.source_files("nbinfer.kernels.decode")
    mma = cache.source_files("nbinfer.kernels.prefill_mma")
    assert {"decode.py", "common.py", "primitives.py"} <= set(decode)
    assert {"prefill_mma.py", "mma.py", "prefill.py"} <= set(mma)
    assert "prefill_mma.py" not in decode and "decode.py" not in mma
    host_side = {"cache.py", "compiled.py", "launch.py"}
    assert not host_side & (set(decode) | set(mma))  # editing those keeps compiled kernels
    spec = _spec()
    assert kernel_key("decode", spec, SIG, {}, (9, 0), "nbinfer.kernels.decode")[0] != \
        kernel_key("decode", spec, SIG, {}, (9, 0), "nbinfer.kernels.prefill_mma")[0]


def _ast_sibling_imports(source):
    # the definition the line scan stands in for: one-dot imports among top-level statements
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out.extend([node.module.split(".")[0]] if node.module else
                       [alias.name for alias in node.names])
    return out


@pytest.mark.parametrize("path", sorted((Path(cache.__file__).parent).glob("*.py")),
                         ids=lambda p: p.name)
def test_the_source_keys_line_scan_finds_what_ast_finds(path):
    source = path.read_text()
    assert cache.sibling_imports(source) == _ast_sibling_imports(source)


def test_the_line_scan_reads_every_form_of_a_sibling_import():
    source = textwrap.dedent('''\
        """A docstring."""
        import numpy as np
        from .common import ARG, WORK_FIELDS
        from .sub.deeper import thing
        from . import warp, mma as tile_ops
        from . import (  # the tile ops
            loading,
            positions as pos,  # comment
        )
        from ..variants import Variant
        from .a import (x,
                        y)


        def later():
            from .compiled import gpu_kernel  # host code, not the kernel's source
        ''')
    assert cache.sibling_imports(source) == _ast_sibling_imports(source) == [
        "common", "sub", "warp", "mma", "loading", "positions", "a"]


def test_an_unwritable_cache_folder_costs_the_reuse_not_the_kernel(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    store = KernelStore(blocker / "kernels")  # cannot be created: its parent is a file
    key, meta = _key(_spec())
    built = []
    with pytest.warns(RuntimeWarning, match="not writable"):
        header, payload, fresh = store.get_or_build(
            key, meta, lambda: built.append(1) or ("_Z6kernel", b"cubin", {}))
    assert fresh and payload == b"cubin" and header["name"] == "_Z6kernel" and built == [1]


def test_only_an_unusable_image_counts_as_a_refused_cubin():
    from nbinfer.kernels.compiled import refused_image

    class DriverError(Exception):
        def __init__(self, code, msg=""):
            super().__init__(msg)
            self.code = code

    assert refused_image(DriverError(200))  # CUDA_ERROR_INVALID_IMAGE
    assert refused_image(DriverError(209))  # NO_BINARY_FOR_GPU
    assert refused_image(RuntimeError("CUDA_ERROR_UNSUPPORTED_PTX_VERSION: ..."))
    assert not refused_image(DriverError(2, "CUDA_ERROR_OUT_OF_MEMORY"))
    assert not refused_image(DriverError(700, "CUDA_ERROR_ILLEGAL_ADDRESS"))
    assert not refused_image(ValueError("something else"))


def test_a_refused_image_is_discarded_only_while_the_entry_still_holds_it(tmp_path):
    from nbinfer.kernels.compiled import KernelImage

    store = _store(tmp_path)
    key, meta, payload = _entry(store)
    stale = KernelImage("_Z6kernel", b"another cubin", True, key, {}, store, meta)
    stale.discard()  # another process replaced the entry meanwhile: kept
    assert store.load(key, meta)[1] == payload
    KernelImage("_Z6kernel", payload, True, key, {}, store, meta).discard()
    assert not store.path(key).exists()
