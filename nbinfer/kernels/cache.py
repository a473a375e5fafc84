"""The persistent kernel cache: compiled kernels kept on disk between processes.

Compiling one kernel spec costs 8-17 s on the H200 host (Numba typing and lowering, NVVM to PTX,
then ``ptxas`` through the linker); loading the finished cubin costs milliseconds. So every
kernel nbinfer compiles for a GPU is written to disk, and a later process that asks for the same
kernel loads it instead of compiling it.

**Where.** ``$NBINFER_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/nbinfer``, else
``~/.cache/nbinfer``; entries go in its ``kernels/`` folder. ``NBINFER_CACHE=0`` turns the
cache off (every process compiles, nothing is written).

**The key** is a SHA-256 over everything the compiled code depends on:

- the kernel's name and the full spec (every dataclass field; a variant by its *source*: the
  code of each hook, the values it closes over and the globals it reads, so an edited or
  re-parametrised hook is a different kernel);
- the signature and compile options (fast-math flags, register limit);
- the source it is built from (a digest of the kernel module and every module of the kernel
  package it imports, :func:`source_files`), nbinfer's version, the Python, numba,
  numba-cuda, cuda-bindings and cuda-core versions;
- the device's compute capability.

A variant whose hooks capture something with no stable content (an object known only by its
address) cannot be keyed: its kernels compile as before and are not written.

**An entry** is one file: a magic line, a JSON header (the key, what it was built from, the
kernel's entry name, the stored payload's length and SHA-256), then the cubin, zlib-compressed
(``"encoding": "zlib"``; cubins shrink ~4x, so a folder of a few hundred kernels stays small
enough to carry to another machine; an entry without the field holds the cubin as it is). It
is loaded only if every check passes; a truncated, corrupt or mismatched entry is deleted and
rebuilt. Writes go to a temporary file in the same folder and are renamed into place (atomic),
and a process compiles under an exclusive lock on the key, so two processes asking for the same
new kernel at once compile it once: the second waits and then loads the first one's entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import sys
import types
import warnings
import zlib
from pathlib import Path

import numpy as np

from ..variants.spec import Variant, _function_key, _Identity

MAGIC = b"NBINFER-KERNEL 1\n"
_PACKAGES = ("numba", "numba-cuda", "cuda-bindings", "cuda-core")


class Unkeyable(TypeError):
    """A value with no stable content-based key (known only by identity)."""


def cache_dir() -> Path | None:
    """The cache folder, or ``None`` when the cache is turned off (``NBINFER_CACHE=0``)."""
    if os.environ.get("NBINFER_CACHE", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    root = os.environ.get("NBINFER_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                ".cache")
        root = os.path.join(base, "nbinfer")
    return Path(root) / "kernels"


# --------------------------------------------------------------------------------------------
# Stable content keys
# --------------------------------------------------------------------------------------------

def stable(value) -> str:
    """A text that identifies ``value`` by content, equal in every process that builds an equal
    value (not by ``id`` or ``hash``, which change between processes). Raises :class:`Unkeyable`
    for values that have no such text."""
    return _stable(value, 0)


def _stable(v, depth: int) -> str:
    if depth > 64:
        raise Unkeyable("value nests too deeply to key")
    d = depth + 1
    if v is None or isinstance(v, (bool, int, str)):
        return f"{type(v).__name__}:{v!r}"
    if isinstance(v, float):
        return f"float:{v.hex()}"
    if isinstance(v, complex):
        return f"complex:{v.real.hex()},{v.imag.hex()}"
    if isinstance(v, bytes):
        return f"bytes:{hashlib.sha256(v).hexdigest()}"
    if isinstance(v, np.ndarray):
        return (f"ndarray:{v.dtype.str}:{v.shape}:"
                f"{hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()}")
    if isinstance(v, np.generic):
        return f"np.{type(v).__name__}:{_stable(v.item(), d)}"
    if isinstance(v, (tuple, list)):
        return f"{type(v).__name__}(" + ",".join(_stable(x, d) for x in v) + ")"
    if isinstance(v, (frozenset, set)):
        return f"{type(v).__name__}(" + ",".join(sorted(_stable(x, d) for x in v)) + ")"
    if isinstance(v, dict):
        return "dict(" + ",".join(sorted(f"{_stable(k, d)}={_stable(x, d)}"
                                         for k, x in v.items())) + ")"
    if isinstance(v, types.CodeType):
        # The parts of a code object that decide what it computes (not its file or line).
        return ("code(" + ",".join((
            v.co_name, hashlib.sha256(v.co_code).hexdigest(), _stable(v.co_consts, d),
            _stable(v.co_names, d), _stable(v.co_varnames, d), _stable(v.co_freevars, d),
            _stable(v.co_cellvars, d), str(v.co_argcount), str(v.co_kwonlyargcount),
            str(v.co_flags))) + ")")
    if isinstance(v, types.ModuleType):
        return f"module:{v.__name__}"
    if isinstance(v, types.BuiltinFunctionType):
        return f"builtin:{getattr(v, '__module__', None)}.{v.__qualname__}"
    if isinstance(v, type):
        return f"type:{v.__module__}.{v.__qualname__}"
    if isinstance(v, Variant):  # name, parameters, use_softmax and each hook's content key
        return f"Variant({_stable(v._key, d)})"
    if isinstance(v, types.FunctionType):  # code, captured values, globals read
        return f"function({_stable(_function_key(v), d)})"
    if dataclasses.is_dataclass(v):
        return (f"{type(v).__module__}.{type(v).__qualname__}("
                + ",".join(f"{f.name}={_stable(getattr(v, f.name), d)}"
                           for f in dataclasses.fields(v)) + ")")
    if isinstance(v, _Identity):
        raise Unkeyable(f"a hook captures {type(v.value).__name__}, which has no content key")
    text = repr(v)
    if " at 0x" in text or "object at" in text:
        raise Unkeyable(f"{type(v).__name__} has no content key (repr {text[:60]!r})")
    return f"{type(v).__module__}.{type(v).__qualname__}:{text}"


@functools.cache
def source_files(module: str) -> tuple[str, ...]:
    """The kernel package's files that ``module`` (e.g. ``"nbinfer.kernels.decode"``) is built
    from: itself and, transitively, every sibling it imports at module level. Host-side modules
    (this cache, the launcher) are not among them, so editing those keeps compiled kernels."""
    here = Path(__file__).parent
    todo, seen = [module.rsplit(".", 1)[-1]], set()
    while todo:
        name = todo.pop()
        if name in seen or not (here / f"{name}.py").exists():
            continue
        seen.add(name)
        todo.extend(sibling_imports((here / f"{name}.py").read_text()))
    return tuple(sorted(f"{n}.py" for n in seen))


# A statement at column 0 (module level) importing from this package (one dot): its module's
# first name, or, for ``from . import a, b``, the names in parentheses or up to the line's end.
_SIBLING_IMPORT = re.compile(r"^from \.(?!\.)(\w*)[\w.]* import[ \t]+(\([^)]*\)|[^\n]*)", re.M)


def sibling_imports(source: str) -> list[str]:
    """The modules of the kernel package that ``source`` imports at module level (relative
    imports of one dot), in order: what ``ast`` finds among the module's top-level statements,
    read from the lines instead (a cache hit computes every kernel's key, and parsing the
    files took ~25 ms per kernel module; ``tests/test_kernel_cache.py`` checks the two agree on
    every file of the package)."""
    out = []
    for module, names in _SIBLING_IMPORT.findall(source):
        if module:
            out.append(module)
            continue
        names = re.sub(r"#[^\n]*", "", names).strip().strip("()")
        out.extend(part.split()[0] for part in names.split(",") if part.strip())
    return out


@functools.cache
def _source_digest(module: str) -> str:
    """SHA-256 of :func:`source_files`: an edited kernel source is a different kernel."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in source_files(module):
        h.update(name.encode())
        h.update((here / name).read_bytes())
    return h.hexdigest()


@functools.cache
def versions() -> dict:
    """The versions a compiled kernel depends on (besides nbinfer's own source)."""
    from importlib import metadata

    from .. import __version__

    out = {"nbinfer": __version__, "python": "{}.{}".format(*sys.version_info[:2])}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def kernel_key(kind: str, spec, signature, options: dict, cc,
               module: str = "nbinfer.kernels.common") -> tuple[str, dict]:
    """``(key, meta)`` of one kernel whose source is built in ``module``: ``meta`` is what the
    key hashes (kept in the entry's header and compared on load); ``key`` its SHA-256. Raises
    :class:`Unkeyable`."""
    meta = {
        "kind": kind,
        "module": module,
        "spec": stable(spec),
        "signature": str(signature),
        "options": stable(dict(options)),
        "source": _source_digest(module),
        "versions": versions(),
        "cc": list(cc),
    }
    text = json.dumps(meta, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest(), meta


# --------------------------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------------------------

class KernelStore:
    """Entries on disk, one file per key (see the module docstring for the format)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / f"{key}.nbk"

    def load(self, key: str, meta: dict) -> tuple[dict, bytes] | None:
        """``(header, payload)`` of a valid entry, else ``None`` (a bad entry is deleted)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:  # absent or unreadable: a miss
            return None
        header = _parse(data, key, meta)
        payload = None if header is None else _decode(header, data[header["_offset"]:])
        if payload is None:
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        return header, payload

    def save(self, key: str, meta: dict, name: str, payload: bytes,
             extra: dict | None = None) -> dict:
        """Write an entry atomically (a temporary file renamed over the final name); returns
        its header."""
        stored = zlib.compress(payload, 6)
        header = _header(key, meta, name, stored, dict(extra or {}, encoding="zlib"))
        blob = json.dumps(header, sort_keys=True).encode()
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{key}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC)
                f.write(len(blob).to_bytes(8, "little"))
                f.write(blob)
                f.write(stored)
            os.replace(tmp, self.path(key))
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return header

    @contextlib.contextmanager
    def lock(self, key: str):
        """Exclusive across processes for one key while it is compiled (a no-op where
        ``fcntl`` does not exist)."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            yield
            return
        with open(self.root / f".{key}.lock", "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def get_or_build(self, key: str, meta: dict, build):
        """``(header, payload, built)``: the stored entry, or ``build() -> (name, payload,
        extra)`` run under the key's lock and stored. A cache folder that cannot be created or
        written (a read-only home, a full disk) costs the reuse, never the kernel: the build's
        result is returned with a warning."""
        hit = self.load(key, meta)
        if hit is not None:
            return hit[0], hit[1], False
        built = None
        try:
            with self.lock(key):
                hit = self.load(key, meta)  # another process may have built it meanwhile
                if hit is not None:
                    return hit[0], hit[1], False
                built = build()
                self.save(key, meta, *built)
        except OSError as exc:
            warnings.warn(f"nbinfer kernel cache at {self.root} is not writable ({exc}); "
                          "compiling without it (set NBINFER_CACHE_DIR to a writable folder)",
                          RuntimeWarning, stacklevel=3)
            if built is None:
                built = build()
        return _header(key, meta, *built), built[1], True


def _decode(header: dict, stored: bytes) -> bytes | None:
    """The cubin of a checked entry's stored bytes (``None``: an encoding this version cannot
    read, or bytes that do not decompress)."""
    encoding = header.get("encoding")
    if encoding is None:
        return stored
    if encoding != "zlib":
        return None
    try:
        return zlib.decompress(stored)
    except zlib.error:
        return None


def _header(key: str, meta: dict, name: str, payload: bytes, extra: dict | None) -> dict:
    """An entry's header: what it was built from, its entry name, the payload's size and hash."""
    return dict(extra or {}, key=key, meta=meta, name=name, size=len(payload),
                sha256=hashlib.sha256(payload).hexdigest())


def read_header(data: bytes) -> dict | None:
    """The JSON header of an entry's bytes ``data``, with ``_offset`` (where the payload
    starts) added; ``None`` when ``data`` does not start with a readable header. Checks
    nothing else (:func:`_parse` does)."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        return None
    n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
    start = len(MAGIC) + 8
    try:
        header = json.loads(data[start:start + n])
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    header["_offset"] = start + n
    return header


def _parse(data: bytes, key: str, meta: dict) -> dict | None:
    """The header of a complete, intact entry for exactly ``(key, meta)``, else ``None``."""
    header = read_header(data)
    if header is None or header.get("key") != key or header.get("meta") != meta:
        return None
    payload = data[header["_offset"]:]
    if len(payload) != header.get("size") or \
            hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        return None
    return header


__all__ = ["KernelStore", "Unkeyable", "cache_dir", "kernel_key", "read_header", "sibling_imports",
           "source_files", "stable", "versions"]
