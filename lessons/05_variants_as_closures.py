# %% [markdown]
# # Lesson 05: attention variants as closures
#
# FlashInfer generates a CUDA kernel per attention variant: a template with holes (query/key
# transform, logits transform, mask, output transform, softmax on or off) filled with the
# variant's code, compiled just in time (walkthrough section VII). nbinfer does the same with
# Python closures: a variant is a handful of plain scalar Python functions, the kernel factory
# captures them, and Numba compiles the captured functions *into* the kernel, together with
# every number they close over.
#
# **You will learn**
#
# 1. how to write a variant yourself, here logits soft-capping (Gemma 2) and sigmoid attention
#    (FlashSigmoid, no softmax), as plain Python functions wrapped in a
#    `nbinfer.variants.Variant`;
# 2. that the very same functions run in three places: as plain Python, in the float64
#    reference engine, and inside the decode kernel (here in the CUDA simulator), and that
#    kernel and reference agree;
# 3. that the numbers a hook captures (the cap, the sigmoid's scale and bias) become literal
#    constants in the compiled GPU code, and that the kernels of two caps differ in exactly
#    those constants;
# 4. how variants are identified (by code *and* captured values) and how the kernel factory
#    caches compiled kernels by that identity;
# 5. masks, rotary embeddings and `compose`: each mask drawn as the (query, key) pattern it
#    keeps, RoPE as a query/key transform whose logits depend only on the distance (and why
#    its angle is computed in float64 but its sine and cosine in the data's precision), and
#    `compose` chaining transforms and AND-ing masks.
#
# The first cell picks Numba's CUDA simulator, so the lesson runs anywhere, GPU or not.

# %%
from nbinfer.lessons_tool import start_lesson

ROOT = start_lesson()  # Numba's CUDA simulator, chosen before Numba loads; the repository root

import hashlib
import inspect
import json
import math
import os
import re
import subprocess
import sys

import numpy as np

from nbinfer import BatchDecodeWithPagedKVCacheWrapper, PageTable, Variant, reference
from nbinfer.kernels.cache import stable
from nbinfer.kernels.decode import DecodeSpec, build_decode_kernel
from nbinfer.lessons_tool import repo_root
from nbinfer.variants import HOOK_KINDS, sigmoid_attention, soft_cap
from nbinfer.variants.host import transform_logits
from nbinfer.variants.spec import HOOK_ARITY
from nbinfer.viz import save_figure, show, subplots

SEED = int(os.environ.get("NBINFER_SEED", 5))  # fixed: the same data every run
rng = np.random.default_rng(SEED)
print("seed", SEED)

# %% [markdown]
# ## 1. A variant is a few scalar functions
#
# A `Variant` holds tuples of *hooks*, one tuple per kind, each hook a plain function of
# scalars with a fixed signature (`nbinfer/variants/spec.py` documents the contracts). The
# kernel calls a logits transform once per (query head, key) with the scaled logit
# `s = sm_scale * q.k` and the positions, and uses what it returns instead of `s`.

# %%
for kind in HOOK_KINDS:
    print(f"{kind:17s} takes {HOOK_ARITY[kind]} scalar arguments")
print("the built-in soft cap's hook:", inspect.signature(soft_cap(30.0).logits_transform[0]))
assert HOOK_KINDS == ("query_transform", "key_transform", "logits_transform", "logits_mask",
                      "output_transform")

# %% [markdown]
# Two variants, written from scratch. Each is a *factory*: it validates nothing here (the
# built-ins in `nbinfer/variants/builtins.py` do), turns its parameters into `float32`
# constants (a Python float is float64 and would silently promote GPU arithmetic), defines the
# hook as a closure over them, and returns a `Variant`.
#
# * **Logits soft-capping**: `s -> cap * tanh(s / cap)` bounds every logit to `[-cap, cap]`
#   and is close to the identity for `|s| << cap`. The division becomes a multiplication by
#   a captured reciprocal.
# * **Sigmoid attention**: no softmax at all; each key gets the weight
#   `sigmoid(scale * s + bias)` on its own and the output is `sum_j w_j v_j`. The spec says so
#   with `use_softmax=False`; kernel factories read that flag when they build a kernel and
#   leave the softmax bookkeeping out.

# %%
def make_soft_cap(cap):
    """Logits soft-capping, s -> cap * tanh(s / cap)."""
    c = np.float32(cap)
    inv = np.float32(1.0 / cap)

    def logits_transform(s, q_pos, kv_pos, qo_head):
        return c * math.tanh(s * inv)

    return Variant(f"my_soft_cap_{cap:g}", params=(("cap", float(cap)),),
                   logits_transform=logits_transform)


def make_sigmoid(scale, bias):
    """Sigmoid attention: weight sigmoid(scale * s + bias) per key, no softmax."""
    a, b, one = np.float32(scale), np.float32(bias), np.float32(1.0)

    def logits_transform(s, q_pos, kv_pos, qo_head):
        return one / (one + math.exp(-(s * a + b)))

    return Variant(f"my_sigmoid_{scale:g}_{bias:g}",
                   params=(("scale", float(scale)), ("bias", float(bias))),
                   logits_transform=logits_transform, use_softmax=False)


CAP, CAP2, SCALE, BIAS = 30.0, 50.0, 0.7, -0.3
cap30, cap50, sig = make_soft_cap(CAP), make_soft_cap(CAP2), make_sigmoid(SCALE, BIAS)
for var in (cap30, cap50, sig):
    print(var, "use_softmax =", var.use_softmax)

# The hooks are ordinary Python: call them.
hook = cap30.logits_transform[0]
for s in (1.0, 29.0, 500.0):
    print(f"soft cap 30: s = {s:5.1f} -> {hook(np.float32(s), 0, 0, 0):.4f}")
assert abs(hook(np.float32(1.0), 0, 0, 0) - 1.0) < 1e-3  # ~identity for small logits
assert abs(hook(np.float32(500.0), 0, 0, 0) - CAP) < 1e-3  # saturates at the cap ...
assert all(abs(hook(np.float32(x), 0, 0, 0)) <= CAP for x in (-1e4, -45.0, 45.0, 1e4))  # never above
assert abs(sig.logits_transform[0](np.float32(0.0), 0, 0, 0)
           - 1 / (1 + math.exp(-BIAS))) < 1e-6
assert cap30.use_softmax and not sig.use_softmax

# %% [markdown]
# ## 2. The same functions in the reference engine and in the kernel
#
# The reference engine compiles each hook with `numba.vectorize` into a float64 NumPy ufunc and
# applies it to whole arrays of logits. Our hand-written variants give the same attention as
# nbinfer's built-ins (`soft_cap`, `sigmoid_attention`), which are written the same way.

# %%
lens = [3, 30]
HQ, HKV, D, PS = 4, 2, 64, 4
pt = PageTable.from_kv_lens(lens, PS, num_pages=sum(-(-n // PS) for n in lens) + 2, rng=rng)
cache = rng.standard_normal((pt.num_pages, 2, PS, HKV, D)).astype(np.float32)
q = (20.0 * rng.standard_normal((len(lens), HQ, D))).astype(np.float32)  # logits of ~ +-20


def ref(variant):
    return reference.batch_decode_with_paged_kv_cache(q, cache, pt.indptr, pt.indices,
                                                      pt.last_page_len, variant=variant)


pairs = {"soft cap 30": (cap30, soft_cap(CAP)), "soft cap 50": (cap50, soft_cap(CAP2)),
         "sigmoid": (sig, sigmoid_attention(SCALE, BIAS))}
for name, (mine, builtin) in pairs.items():
    diff = np.abs(ref(mine) - ref(builtin)).max()
    print(f"reference, {name}: hand-written vs built-in max |diff| = {diff:.1e}")
    np.testing.assert_allclose(ref(mine), ref(builtin), rtol=1e-12, atol=1e-12)
capped_away = np.abs(ref(cap30) - ref(None)).max()
print(f"soft cap 30 vs no cap: max |diff| = {capped_away:.2f}")
assert capped_away > 1e-2  # with logits of this size the cap changes the answer

# %% [markdown]
# Now the kernel. `plan(..., variant=...)` builds a `DecodeSpec` that includes the variant and
# asks the cached factory for its kernel; with `backend="sim"` the simulator runs it on the
# CPU, calling our Python hooks as they are.

# %%
def run_kernel(variant):
    w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), "NHD", backend="sim")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, q_data_type="float32",
           variant=variant)
    return w.run(q, cache)


kernel_out, errors = {}, {}
for var in (cap30, cap50, sig):
    kernel_out[var.name] = run_kernel(var)
    want = ref(var)
    errors[var.name] = float(np.linalg.norm(kernel_out[var.name] - want) / np.linalg.norm(want))
    print(f"{var.name:20s} kernel (simulator) vs reference: "
          f"relative error {errors[var.name]:.1e}")
    assert errors[var.name] < 1e-4

# %% [markdown]
# ## 3. Identity: code *and* captured values
#
# `cap30` and `cap50` run the same Python code; only the numbers in the closure differ. A
# variant's identity (its hash, and so the kernel cache key) is its name, its parameters,
# `use_softmax`, and for every hook its code object, the values it closes over and the globals
# it reads. Two variants with even the same name and no parameters still differ when their
# captured constants differ; two calls of a factory with equal arguments give equal variants,
# although the closures are different Python objects.

# %%
f30, f50 = cap30.logits_transform[0], cap50.logits_transform[0]
f30_again = make_soft_cap(CAP).logits_transform[0]
print("same code object:", f30.__code__ is f50.__code__,
      "| captured:", [c.cell_contents for c in f30.__closure__],
      "vs", [c.cell_contents for c in f50.__closure__])
assert f30.__code__ is f50.__code__ and f30 is not f30_again

anon30 = Variant("capped", logits_transform=f30)
anon50 = Variant("capped", logits_transform=f50)
anon30_again = Variant("capped", logits_transform=f30_again)
# Python's hash() of a string changes from process to process; the content digest that nbinfer's
# disk cache keys kernels by (code, captured values, globals read) is the same in every one.
def digest(x):
    return hashlib.sha256(stable(x).encode()).hexdigest()[:16]


print(f"digest(capped with 30) = {digest(anon30)}, digest(capped with 50) = {digest(anon50)}")
assert digest(anon30) == digest(anon30_again) != digest(anon50)
assert anon30 != anon50 and hash(anon30) != hash(anon50)
assert anon30 == anon30_again and hash(anon30) == hash(anon30_again)
assert cap30 == make_soft_cap(CAP) and cap30 != cap50

# %% [markdown]
# The kernel factory `build_decode_kernel(spec)` is wrapped in `functools.cache`, keyed by the
# hashable `DecodeSpec` (head dim, group size, page size, dtypes, layout, variant, ...). Equal
# specs get the *same* kernel object back without compiling again (on a GPU every miss is a
# full compilation: section 4 times a few); a different captured constant is a different spec,
# hence a different kernel. The three calls below are all cache hits: `plan()` in section 2
# already built exactly these specs, from variants that are equal to, not identical with,
# the ones we pass now.

# %%
def spec_for(variant, sim=True):
    return DecodeSpec(head_dim=D, group_size=HQ // HKV, page_size=PS, kv_dtype="float32",
                      q_dtype="float32", kv_layout="NHD", variant=variant, sim=sim)


before = build_decode_kernel.cache_info()
k30 = build_decode_kernel(spec_for(cap30))
k30_again = build_decode_kernel(spec_for(make_soft_cap(CAP)))  # a fresh, equal variant
k50 = build_decode_kernel(spec_for(cap50))
after = build_decode_kernel.cache_info()
print(f"cache: {after.hits - before.hits} hits, {after.misses - before.misses} misses for 3 "
      f"calls; {after.currsize} kernels cached")
print(f"spec digests: cap 30 -> {digest(spec_for(cap30))}, cap 50 -> {digest(spec_for(cap50))}")
assert k30 is k30_again and k30 is not k50
assert spec_for(cap30) == spec_for(make_soft_cap(CAP)) and spec_for(cap30) != spec_for(cap50)
assert after.hits - before.hits == 3 and after.misses == before.misses

# %% [markdown]
# ## 4. The constants are in the compiled code
#
# Under the simulator nothing is compiled: the "kernel" is the Python function itself. To see
# what the GPU would run, we compile the same kernel for an H100/H200 (`sm_90`) in a separate
# Python process *without* the simulator. No GPU is needed for that:
#
# * **PTX** when the CUDA toolkit's NVVM library is installed: `numba.cuda.compile_ptx` lowers
#   the kernel to LLVM IR, and NVVM turns it into PTX, the GPU's virtual assembly. Numba asks
#   the machine two questions a GPU-less one cannot answer (which architectures NVRTC knows,
#   which device is current); `nbinfer.kernels.offline.assume_device` answers both. A float32
#   constant is written in PTX as `0f` and its 8 hex digits (`30.0` is `0f41F00000`).
# * **LLVM IR** otherwise: the module Numba generates before handing it to NVVM. It already
#   contains the kernel and, beside it, the hook as a function marked `alwaysinline` (NVVM
#   inlines it); LLVM writes a float constant as the 16 hex digits
#   of the equal double (`30.0` is `0x403E000000000000`).
#
# The worker below receives the source of our two factories (`inspect.getsource`), rebuilds the
# variants from it, and compiles the decode kernel of each, with the same `DecodeSpec` the
# simulator ran but `sim=False`. Set `NBINFER_NO_NVVM=1` to force the LLVM IR route.

# %%
WORKER = r'''
import json, math, os, sys
import numpy as np
from numba.cuda.cudadrv import nvvm

job = json.load(sys.stdin)
no_nvvm = bool(os.environ.get("NBINFER_NO_NVVM")) or not nvvm.is_available()
if no_nvvm:
    # LLVM IR only: lowering needs NVVM's data layout string, not the library itself.
    class _NoNVVM:
        data_layout = nvvm._datalayout
    nvvm.NVVM = _NoNVVM
    nvvm.add_ir_version = lambda module: None
# no GPU here: device functions see an sm_90 device, NVRTC is not asked for architectures
from nbinfer.kernels.offline import assume_device
assume_device((9, 0))
from numba import cuda
from numba.cuda.compiler import compile_cuda
from nbinfer import Variant
from nbinfer.kernels.decode import DecodeSpec, decode_kernel_source, decode_signature

namespace = {"math": math, "np": np, "Variant": Variant}
exec(job["source"], namespace)
out = {"route": "llvm" if no_nvvm else "ptx", "texts": {}, "ptx_error": None}
for name, factory, args in job["builds"]:
    spec = DecodeSpec(variant=namespace[factory](*args), **job["spec"])
    fn, sig = decode_kernel_source(spec), decode_signature(spec)
    if out["route"] == "ptx":
        try:
            text, _ = cuda.compile_ptx(fn, sig, cc=(9, 0), fastmath=True)
        except Exception as exc:  # NVVM present but unusable (no libdevice ...): fall back
            out["route"], out["ptx_error"] = "llvm", repr(exc)
    if out["route"] == "llvm":
        lib = compile_cuda(fn, sig.return_type, sig.args, fastmath=True, cc=(9, 0)).library
        text = lib.get_llvm_str()
    out["texts"][name] = text
json.dump(out, sys.stdout)
'''


def compile_offline(builds):
    """Compile the decode kernel of each (name, factory, args) for sm_90 in a fresh process."""
    spec = {k: v for k, v in vars(spec_for(cap30, sim=False)).items() if k != "variant"}
    job = {"source": inspect.getsource(make_soft_cap) + "\n" + inspect.getsource(make_sigmoid),
           "builds": builds, "spec": spec}
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(repo_root()) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", WORKER], input=json.dumps(job), env=env,
                          cwd=repo_root(), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"offline compile failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


compiled = compile_offline([("cap30", "make_soft_cap", [CAP]), ("cap50", "make_soft_cap", [CAP2]),
                            ("sigmoid", "make_sigmoid", [SCALE, BIAS])])
ROUTE, texts = compiled["route"], compiled["texts"]
print(f"route: {ROUTE} (compiled in a worker process without the simulator)")
if compiled["ptx_error"]:
    print("NVVM was found but PTX failed:", compiled["ptx_error"][:200])
for name, text in texts.items():
    print(f"  {name}: {len(text.splitlines())} lines of {'PTX' if ROUTE == 'ptx' else 'LLVM IR'}")
assert ROUTE in ("ptx", "llvm") and set(texts) == {"cap30", "cap50", "sigmoid"}

# %% [markdown]
# How a float32 constant is spelled in each kind of text, and the lines that mention the
# captured values. In PTX the soft cap's hook is two multiplications by immediates (`1/cap`,
# then `cap`, around the hardware `tanh.approx`), and the sigmoid's `s * scale + bias` is one
# fused multiply-add whose two other operands are both immediates.

# %%
def spellings(x):
    """How float32(x) is written in PTX and in LLVM IR (upper case; compare case-insensitively)."""
    x32 = np.float32(x)
    ptx = f"0F{int(np.array([x32]).view(np.uint32)[0]):08X}"
    llvm = f"0X{int(np.array([np.float64(x32)]).view(np.uint64)[0]):016X}"
    return {"ptx": ptx, "llvm": llvm}


assert spellings(30.0) == {"ptx": "0F41F00000", "llvm": "0X403E000000000000"}


def lines_with(text, x):
    token = spellings(x)[ROUTE]
    return [line.strip() for line in text.splitlines() if token in line.upper()]


captured = {"cap30": {"cap": CAP, "1/cap": 1.0 / CAP}, "cap50": {"cap": CAP2, "1/cap": 1.0 / CAP2},
            "sigmoid": {"scale": SCALE, "bias": BIAS}}
for name, consts in captured.items():
    for what, x in consts.items():
        found = lines_with(texts[name], x)
        print(f"{name:8s} {what:6s} = float32({x:g}) spelled {spellings(x)[ROUTE]}: "
              f"{len(found)} line(s), e.g. {found[0][:90] if found else None}")
        assert found, f"{what} of {name} not found in the compiled code"
sig_line = [ln for ln in lines_with(texts["sigmoid"], SCALE) if spellings(BIAS)[ROUTE] in ln.upper()]
if ROUTE == "ptx":  # s * scale + bias: one FMA with both captured constants as immediates
    print("sigmoid FMA:", sig_line[0])
    assert sig_line and sig_line[0].startswith("fma.")
    # the soft cap: multiplications by the two immediates around a hardware tanh
    assert all(ln.startswith("mul.") for x in (CAP, 1.0 / CAP) for ln in lines_with(texts["cap30"], x))
    assert "tanh.approx.f32" in texts["cap30"]
assert not lines_with(texts["cap30"], CAP2) and not lines_with(texts["cap50"], CAP)

# %% [markdown]
# ### Two caps, two kernels that differ in exactly the constants
#
# Compare the compiled text of the cap-30 and the cap-50 kernel line by line, after renaming
# what Numba numbers per compilation (mangled function names and shared-memory symbols). Every
# line that differs contains a captured constant: the variant *is* those few immediates, the
# rest of the kernel is shared.

# %%
def normalised(text):
    text = re.sub(r"_Z\w+", "<name>", text)  # mangled names carry a per-compilation tag
    text = re.sub(r"_cudapy_smem_\d+", "<smem>", text)  # shared arrays, numbered per process
    text = re.sub(r"_v\d+_", "_v<n>_", text)  # LLVM IR: names of inlined functions' variables
    text = re.sub(r"\$\d+", "$<n>", text)  # LLVM IR: the module id
    text = re.sub(r"\bB\d+", "B<n>", text)  # LLVM IR: basic-block labels of inlined code
    # LLVM IR: one module per device function, listed in the order this process first compiled
    # them (NVVM inlines them into the kernel later): compare the modules sorted by name
    modules = [m.splitlines() for m in re.split(r"(?m)^(?=; ModuleID)", text)]
    return [line for m in sorted(modules, key=lambda m: (m[0] if m else "", len(m)))
            for line in m if line.strip()]


a_lines, b_lines = normalised(texts["cap30"]), normalised(texts["cap50"])
digests = {n: hashlib.sha256(t.encode()).hexdigest()[:16] for n, t in texts.items()}
print("sha256:", digests)
assert len(set(digests.values())) == 3
assert len(a_lines) == len(b_lines)
changed = [(x, y) for x, y in zip(a_lines, b_lines, strict=True) if x != y]
print(f"{len(changed)} of {len(a_lines)} lines differ:")
for x, y in changed[:6]:
    print("  cap 30:", x.strip()[:100], "\n  cap 50:", y.strip()[:100])
tokens30 = [spellings(x)[ROUTE] for x in captured["cap30"].values()]
tokens50 = [spellings(x)[ROUTE] for x in captured["cap50"].values()]
assert changed and len(changed) < 0.01 * len(a_lines)
for x, y in changed:
    assert any(t in x.upper() for t in tokens30) and any(t in y.upper() for t in tokens50), (x, y)

# %% [markdown]
# The picture: what the two hooks do to a logit, and the kernel against the reference for
# all three variants.

# %%
s_grid = np.linspace(-120, 120, 481)
fig, (ax_c, ax_s, ax_k) = subplots(1, 3, figsize=(14, 3.8))
ax_c.plot(s_grid, s_grid, color="0.6", ls="--", lw=1, label="no cap")
for var, color in ((cap30, "C0"), (cap50, "C1")):
    ax_c.plot(s_grid, transform_logits(var, s_grid, 0, 0, 0), color=color,
              label=f"{var.name}: cap {var.param('cap'):g}")
ax_c.set_ylim(-70, 70)
ax_c.set_xlabel("logit s = sm_scale q.k")
ax_c.set_ylabel("transformed logit")
ax_c.set_title("soft cap: cap * tanh(s / cap)", fontsize=10)
ax_c.legend(fontsize=8, frameon=False)
s_small = np.linspace(-12, 12, 241)
ax_s.plot(s_small, transform_logits(sig, s_small, 0, 0, 0), color="C2",
          label=f"sigmoid({SCALE:g} s {BIAS:+g})")
ax_s.axhline(1.0, color="0.6", lw=0.8, ls=":")
ax_s.set_xlabel("logit s")
ax_s.set_ylabel("weight of the key (no softmax)")
ax_s.set_title("sigmoid attention: each key weighted on its own", fontsize=10)
ax_s.legend(fontsize=8, frameon=False)
names = [v.name for v in (cap30, cap50, sig)]
ax_k.bar(range(3), [errors[n] for n in names], color=["C0", "C1", "C2"])
ax_k.axhline(1e-4, color="crimson", ls="--", lw=1, label="asserted bound 1e-4")
ax_k.set_yscale("log")
ax_k.set_ylim(1e-9, 1e-3)
ax_k.set_xticks(range(3), labels=names, fontsize=8)
ax_k.set_ylabel("||kernel - reference|| / ||reference||")
ax_k.set_title("the same hooks inside the decode kernel (simulator)", fontsize=10)
ax_k.legend(fontsize=8, frameon=False)
save_figure(fig, "05_variants.png")
show(fig)

# %% [markdown]
# ## 5. Masks, RoPE and `compose`
#
# A mask hook says, for a query position, a key position and a query head, whether the key is
# kept; the kernel skips the others (their weight is exactly 0). Each built-in mask is a line:
# `causal()` keeps `kv_pos <= q_pos`, `sliding_window(w)` keeps `kv_pos >= q_pos - w`.
# `compose(...)` chains the transforms of its variants left to right and ANDs their masks, so a
# sliding window over a causal model is `compose(causal(), sliding_window(w))`. A mask that is
# an *or* (keep the first tokens, the attention sinks of StreamingLLM, *or* the recent window)
# is one hook of its own. Below, each mask evaluated on a 12-query x 16-key grid (the queries
# are the last 12 positions, as in a prefill chunk after 4 cached tokens): the pictures are the
# hooks' own output, through the same host path the reference engine uses.

# %%
from nbinfer.variants import causal, compose, rope_llama, sliding_window  # noqa: E402
from nbinfer.variants.host import logits_keep  # noqa: E402


def sink_window(num_sinks: int, window: int) -> Variant:
    """Keep the first ``num_sinks`` keys and the last ``window + 1`` positions (an OR)."""
    n, w = int(num_sinks), int(window)

    def logits_mask(q_pos, kv_pos, qo_head):
        return kv_pos < n or kv_pos + w >= q_pos

    return Variant(f"sink_{n}_window_{w}", params=(("num_sinks", n), ("window", w)),
                   logits_mask=logits_mask)


QL, KL = 12, 16
q_pos = np.arange(KL - QL, KL)[:, None]
kv_pos = np.arange(KL)[None, :]
masks = {"causal()": causal(),
         "sliding_window(3)": sliding_window(3),
         "compose(causal(),\nsliding_window(3))": compose(causal(), sliding_window(3)),
         "compose(causal(),\nsink_window(2, 3))": compose(causal(), sink_window(2, 3))}
keep = {name: logits_keep(v, q_pos, kv_pos, 0) for name, v in masks.items()}
for name, k in keep.items():
    print(f"{name.replace(chr(10), ' '):38s} keeps {int(k.sum()):3d} of {k.size} (query, key) pairs")
assert np.array_equal(keep["causal()"], kv_pos <= q_pos)
assert np.array_equal(keep["sliding_window(3)"], kv_pos >= q_pos - 3)
assert np.array_equal(keep["compose(causal(),\nsliding_window(3))"],
                      keep["causal()"] & keep["sliding_window(3)"])  # compose ANDs masks
sinks = keep["compose(causal(),\nsink_window(2, 3))"]
assert sinks[:, :2].all() and np.array_equal(sinks[:, 2:], (keep["causal()"] & keep[
    "sliding_window(3)"])[:, 2:])

# %% [markdown]
# A composed variant gives the attention its parts give. The reference engine applies the
# variant's hooks; for the causal sliding window and soft cap it also takes FlashInfer's flags
# (`causal`, `window_left`, `logits_soft_cap`), implemented separately: the two must agree.

# %%
qv = rng.standard_normal((QL, 2, 16))
kvk, kvv = rng.standard_normal((KL, 2, 16)), rng.standard_normal((KL, 2, 16))
by_variant = reference.single_prefill_with_kv_cache(
    qv, kvk, kvv, variant=compose(causal(), sliding_window(3), soft_cap(5.0)))
by_flags = reference.single_prefill_with_kv_cache(qv, kvk, kvv, causal=True, window_left=3,
                                                  logits_soft_cap=5.0)
print(f"compose(causal, window 3, cap 5) against the flags: max |diff| "
      f"{np.abs(by_variant - by_flags).max():.1e}")
np.testing.assert_allclose(by_variant, by_flags, rtol=1e-12, atol=1e-12)

# %% [markdown]
# **RoPE is a transform of queries and keys.** `rope_llama()` rotates each pair of dimensions
# `(d, d + D/2)` of a vector at position `p` by the angle `p * theta^(-2d / D)`. Rotations
# compose: the logit of a query rotated by `p` and a key rotated by `k` depends on `p - k` only.
# So the same query and key give the same logit at positions (20, 15) as at (5, 0): the model
# sees distances, not places. The check rotates one query and one key with the variant's own
# hooks (the host path of the reference engine) at several pairs of positions.

# %%
from nbinfer.variants.host import transform_vectors  # noqa: E402

rope = rope_llama()
qvec, kvec = rng.standard_normal((1, 1, 64)), rng.standard_normal((1, 1, 64))


def rope_logit(pq, pk):
    qr = transform_vectors(rope, "query_transform", qvec, np.array([pq]), np.array([0]))
    kr = transform_vectors(rope, "key_transform", kvec, np.array([pk]), np.array([0]))
    return float((qr * kr).sum())


distances = np.arange(0, 40)
shifted = {base: [rope_logit(base + dist, base) for dist in distances] for base in (0, 100, 1000)}
for base, row in shifted.items():
    print(f"key at {base:4d}: logits at distances 0, 5, 10: "
          f"{row[0]:+.4f} {row[5]:+.4f} {row[10]:+.4f}")
np.testing.assert_allclose(shifted[100], shifted[0], rtol=1e-9, atol=1e-9)
np.testing.assert_allclose(shifted[1000], shifted[0], rtol=1e-9, atol=1e-9)
assert not np.allclose(shifted[0][1:], shifted[0][0])  # and it does depend on the distance

# %%
fig, axes = subplots(1, 5, figsize=(15.5, 3.6), gridspec_kw={"width_ratios": [1, 1, 1, 1, 1.5]})
for ax, (name, k) in zip(axes[:4], keep.items(), strict=True):
    ax.imshow(k, cmap="Blues", vmin=0, vmax=1.25, aspect="equal", interpolation="nearest",
              extent=(-0.5, KL - 0.5, KL - 0.5, KL - QL - 0.5))
    ax.set_title(f"{name}\nkeeps {int(k.sum())} pairs", fontsize=9)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_xticks(range(0, KL, 3))
    ax.set_yticks(range(KL - QL, KL, 2))
for base, row in shifted.items():
    axes[4].plot(distances, row, lw=1.2, ls=("-", "--", ":")[list(shifted).index(base)],
                 label=f"key at position {base}")
axes[4].set_xlabel("query position - key position")
axes[4].set_ylabel("q . k after RoPE")
axes[4].set_title("RoPE: the logit depends on the distance only", fontsize=9)
axes[4].legend(fontsize=8)
save_figure(fig, "05_masks_rope.png")
show(fig)

# %% [markdown]
# **RoPE needs float64 for its angle, and only for its angle.** The angle is
# `p * theta^(-2i/D)`: at position 100 000 and the fastest frequency (i = 0) that is 100 000
# radians, where neighbouring float32 numbers are 2^-7 = 0.008 apart, and the frequencies
# themselves carry float32's relative error of 6e-8, times 1e5: an angle computed in float32
# is off by thousandths of a radian, and the rotated key with it. So `rope_llama` forms the
# angle in float64 and reduces it to [-pi, pi) there; after that, float32 is enough. But in
# Numba a float64 value keeps everything it touches in float64 (float32 x float64 is float64),
# so the hook ends the float64 part explicitly: `as_type_of(angle, x)` is the angle in the
# type of the data `x`: unchanged in the float64 reference engine, float32 in a kernel, where
# the sine and cosine then run on the hardware's fast float32 units. (On the H200 this took the
# fused-RoPE decode from 0.43 to 0.95 TB/s of KV: `bench/NOTES.md`, issue 13.)
#
# The check compiles the RoPE hook for float32 data on the CPU (as a kernel sees it) and
# rotates one key at position 123 457 three ways: exactly (float64 NumPy), with the angle
# computed in float32, and with the hook.

# %%
import numba  # noqa: E402

from nbinfer.variants.precision import register  # noqa: E402

register("cpu")  # as_type_of for Numba's CPU target (nbinfer does this before compiling hooks)
f32, i32 = numba.float32, numba.int32
rotate_f32 = numba.njit((f32, f32, i32, i32, i32, i32))(rope.key_transform[0])
D_R, POS = 64, 123_457
key = rng.standard_normal(D_R).astype(np.float32)
half = np.arange(D_R) % (D_R // 2)
freq = 1e4 ** (-2.0 * half / D_R)  # rope_llama()'s defaults: scale 1, theta 1e4
partner = np.roll(key, -(D_R // 2)) * np.where(np.arange(D_R) < D_R // 2, -1.0, 1.0)


def rotated(angle):
    return key * np.cos(angle) + partner * np.sin(angle)


exact = rotated(POS * freq)
angle32 = np.float32(POS) * freq.astype(np.float32)  # the angle in float32
by_float32_angle = rotated(angle32.astype(np.float64))
by_hook = np.array([rotate_f32(key[d], key[(d + D_R // 2) % D_R], d, D_R, POS, 0)
                    for d in range(D_R)])
angle_err = np.abs(np.angle(np.exp(1j * (angle32 - POS * freq)))).max()  # radians, mod 2 pi
err32 = np.abs(by_float32_angle - exact).max() / np.abs(exact).max()
err_hook = np.abs(by_hook - exact).max() / np.abs(exact).max()
print(f"compiled for float32 data, the hook returns {rotate_f32.nopython_signatures[0].return_type}")
print(f"at position {POS}: the float32 angle is off by up to {angle_err:.1e} rad")
print(f"relative error of the rotated key: float32 angle {err32:.1e}, the hook {err_hook:.1e}")
assert rotate_f32.nopython_signatures[0].return_type == f32  # the kernel stays in float32
assert angle_err > 1e-3 and err_hook < 2e-6 and err32 > 100 * err_hook

# %% [markdown]
# ## Exercise: a variant of your own
#
# Write `my_distance_penalty(slope, window)`: a `Variant` whose logits are lowered by
# `slope * (q_pos - kv_pos)` (one slope for every head: ALiBi's idea in its simplest form) and
# whose mask drops keys more than `window` positions left of the query: two hooks, closed over
# their constants as `soft_cap` closes over its cap. The check runs your variant through the
# reference engine's causal prefill against the formula, and checks that equal arguments give
# equal variants (one compiled kernel) and different arguments different ones.
# (Solution: `tests/test_exercises.py`.)

# %%
from nbinfer import exercises


def my_distance_penalty(slope, window):
    """A Variant: logits - slope * (q_pos - kv_pos), keys with kv_pos < q_pos - window masked."""
    raise NotImplementedError  # replace with your code


print(exercises.attempt(exercises.check_distance_penalty, my_distance_penalty))

# %% [markdown]
# ## Summary
#
# * A variant is a few scalar Python functions plus `use_softmax`; a factory closes them over
#   float32 constants and returns a hashable `Variant`.
# * The same functions run as plain Python, vectorised in the float64 reference, and inside the
#   decode kernel; kernel and reference agree.
# * Compiled for the GPU, the hook is inlined into the kernel and its captured numbers are
#   immediates in the instructions: two caps give two kernels that differ only in those
#   constants: the variant's numbers need no kernel argument and no memory load.
# * Identity is code plus captured values, so the factory's `functools.cache` compiles each
#   distinct variant once and reuses it for equal ones.
# * Masks are hooks too (`compose` ANDs them; an OR is one hook of its own), and RoPE is a
#   query/key transform whose logits depend on distances only. Its angle needs float64; the
#   hook hands the reduced angle back in the data's precision (`as_type_of`), so a kernel
#   computes the rest in float32.

