"""merge_state / merge_state_in_place / merge_states kernels vs the float64 reference.

Simulator at tiny shapes (fp16/fp32 through the public functions, bf16 through the kernels with
int16 bits, since NumPy has no bfloat16), the H200 with torch tensors at realistic shapes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import SIMULATOR, TOLERANCE, rel_err

from nbinfer import reference
from nbinfer.api.launch import defer_frees
from nbinfer.api.state import merge_state, merge_state_in_place, merge_states
from nbinfer.kernels.state import (
    StateSpec,
    build_merge_pair,
    build_merge_stack,
    state_launch_config,
)

DTYPES = [np.float16, np.float32]
BASES = [2.0, math.e]


def _state(rng, shape, dtype, empty_rows=()):
    """Random outputs and LSEs (spread over several units); listed rows are empty (-inf)."""
    v = rng.standard_normal(shape).astype(dtype)
    s = (3 * rng.standard_normal(shape[:-1])).astype(np.float32)
    s[list(empty_rows)] = -np.inf
    return v, s


def _check(v, s, ref_v, ref_s, dtype):
    assert rel_err(v, ref_v) <= TOLERANCE[dtype], f"v error {rel_err(v, ref_v):.2e}"
    finite = np.isfinite(ref_s)
    assert np.array_equal(np.isfinite(s), finite)
    assert rel_err(s[finite], ref_s[finite]) <= TOLERANCE["float32"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lse_base", BASES)
@pytest.mark.parametrize("dim", [8, 6])  # 16-byte vectors per thread; 2 elements at D = 6
def test_merge_state(rng, dtype, lse_base, dim):
    v_a, s_a = _state(rng, (3, 2, dim), dtype, empty_rows=[0])
    v_b, s_b = _state(rng, (3, 2, dim), dtype, empty_rows=[0, 1])  # row 0: both empty
    v, s = merge_state(v_a, s_a, v_b, s_b, lse_base=lse_base)
    ref_v, ref_s = reference.merge_state(v_a, s_a, v_b, s_b, lse_base=lse_base)
    assert v.dtype == dtype and s.dtype == np.float32 and v.shape == (3, 2, dim)
    _check(v, s, ref_v, ref_s, np.dtype(dtype).name)
    assert np.all(v[0] == 0) and np.all(s[0] == -np.inf)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_mask", [False, True])
def test_merge_state_in_place(rng, dtype, use_mask):
    v, s = _state(rng, (4, 2, 8), dtype)
    v_other, s_other = _state(rng, (4, 2, 8), dtype, empty_rows=[3])
    mask = np.array([True, False, True, True]) if use_mask else None
    want_v, want_s = v.astype(np.float64), s.astype(np.float64)
    reference.merge_state_in_place(want_v, want_s, v_other, s_other, mask)
    v0, s0, other0 = v.copy(), s.copy(), v_other.copy()
    assert merge_state_in_place(v, s, v_other, s_other, mask) is None
    _check(v, s, want_v, want_s, np.dtype(dtype).name)
    assert np.array_equal(v_other, other0)  # the other state is read only
    if use_mask:  # unmasked rows keep their bits
        assert np.array_equal(v[1], v0[1]) and np.array_equal(s[1], s0[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lse_base", BASES)
@pytest.mark.parametrize("num_states", [3, 0])
def test_merge_states(rng, dtype, lse_base, num_states):
    v, s = _state(rng, (2, num_states, 2, 12), dtype)  # D = 12: 4 fp16 / 4 fp32 per thread
    if num_states:
        s[1, :, 0] = -np.inf  # one (row, head) with every state empty
    out, lse = merge_states(v, s, lse_base=lse_base)
    ref_v, ref_s = reference.merge_states(v, s, lse_base=lse_base)
    assert out.shape == (2, 2, 12) and out.dtype == dtype
    _check(out, lse, ref_v, ref_s, np.dtype(dtype).name)


def test_merge_states_equals_pairwise_merges(rng):
    # The operator is associative: merging three states at once == merging them two at a time.
    v, s = _state(rng, (3, 3, 2, 8), np.float32)
    out, lse = merge_states(v, s)
    v01, s01 = merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    v012, s012 = merge_state(v01, s01, np.ascontiguousarray(v[:, 2]), np.ascontiguousarray(s[:, 2]))
    assert rel_err(out, v012) <= TOLERANCE["float32"]
    assert rel_err(lse, s012) <= TOLERANCE["float32"]


def test_reference_backend_is_the_reference(rng):
    v_a, s_a = _state(rng, (2, 2, 4), np.float32)
    v_b, s_b = _state(rng, (2, 2, 4), np.float32)
    v, s = merge_state(v_a, s_a, v_b, s_b, backend="reference")
    ref_v, ref_s = reference.merge_state(v_a, s_a, v_b, s_b)
    assert v.dtype == np.float64 and np.array_equal(v, ref_v) and np.array_equal(s, ref_s)


# --- bf16: the kernels on int16 bit patterns ------------------------------------------------
def _to_bf16_bits(x):
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16).view(np.int16)


def _from_bf16_bits(bits):
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("lse_base", BASES)
def test_bf16_kernels(rng, lse_base):
    rows, heads, dim = 2, 2, 8
    spec = StateSpec("bfloat16", dim, lse_base, sim=SIMULATOR)
    total = rows * heads * dim
    grid, block = state_launch_config(spec, rows, heads)
    bits_a, bits_b = (_to_bf16_bits(rng.standard_normal((rows, heads, dim))) for _ in range(2))
    s_a, s_b = ((3 * rng.standard_normal((rows, heads))).astype(np.float32) for _ in range(2))
    out, lse = np.empty(total, np.int16), np.empty(rows * heads, np.float32)
    build_merge_pair(spec)[grid, block](bits_a.ravel(), s_a.ravel(), bits_b.ravel(), s_b.ravel(),
                                        out, lse, np.zeros(0, np.uint8), np.int32(heads))
    ref_v, ref_s = reference.merge_state(_from_bf16_bits(bits_a), s_a, _from_bf16_bits(bits_b),
                                         s_b, lse_base=lse_base)
    _check(_from_bf16_bits(out).reshape(ref_v.shape), lse.reshape(ref_s.shape), ref_v, ref_s,
           "bfloat16")

    stack = np.stack([bits_a, bits_b], axis=1)  # [rows, 2, heads, dim]
    s_stack = np.stack([s_a, s_b], axis=1)
    build_merge_stack(spec)[grid, block](stack.ravel(), s_stack.ravel(), out, lse, np.int32(2),
                                         np.int32(heads))
    _check(_from_bf16_bits(out).reshape(ref_v.shape), lse.reshape(ref_s.shape), ref_v, ref_s,
           "bfloat16")


def test_blocks_hold_whole_heads_and_in_place_merges_odd_head_dims(rng):
    # The in-place kernel's barrier orders a head's LSE reads before its write only when the
    # head's threads share a block: 10 threads per head (fp32, D 40) must not straddle blocks.
    for dtype, dim, heads in (("float32", 40, 16), ("float16", 80, 3), ("float16", 128, 32)):
        spec = StateSpec(dtype, dim, math.e, sim=SIMULATOR, in_place=True)
        per_head = dim // spec.vec
        (_, chunks), (block,) = state_launch_config(spec, 5, heads)
        assert block % per_head == 0 and block <= 128 and chunks * block >= heads * per_head
    v, s = _state(rng, (3, 5, 40), np.float32, empty_rows=(1,))
    v_o, s_o = _state(rng, (3, 5, 40), np.float32)
    want_v, want_s = v.astype(np.float64), s.astype(np.float64)
    reference.merge_state_in_place(want_v, want_s, v_o, s_o)
    merge_state_in_place(v, s, v_o, s_o)
    _check(v, s, want_v, want_s, "float32")
    with pytest.raises(ValueError, match="head_dim must be at most 4096"):
        StateSpec("float32", 4100, 2.0, in_place=True)


# --- errors ---------------------------------------------------------------------------------
def test_errors(rng):
    v, s = _state(rng, (3, 2, 4), np.float16)
    with pytest.raises(TypeError, match="s_a must be float32"):
        merge_state(v, s.astype(np.float64), v, s)
    with pytest.raises(ValueError, match=r"s_b.shape must be v_b.shape\[:-1\]"):
        merge_state(v, s, v, s[:2])
    with pytest.raises(TypeError, match="v_b must have v_a's dtype float16"):
        merge_state(v, s, v.astype(np.float32), s)
    with pytest.raises(TypeError, match="v_a must have dtype float16"):
        merge_state(v.astype(np.float64), s, v, s)
    with pytest.raises(ValueError, match="v_b.shape must equal"):
        merge_state(v, s, v[:2], s[:2])
    with pytest.raises(ValueError, match="lse_base must be 2"):
        merge_state(v, s, v, s, lse_base=10)
    with pytest.raises(ValueError, match="backend must be one of"):
        merge_state(v, s, v, s, backend="gpu")
    with pytest.raises(ValueError, match="mask.shape"):
        merge_state_in_place(v, s, v, s, np.ones(2, bool))
    with pytest.raises(TypeError, match="mask must be a bool array"):
        merge_state_in_place(v, s, v, s, np.ones(3, np.int32))
    with pytest.raises(ValueError, match="v must be contiguous"):
        merge_state_in_place(v[:, :, ::2], s, v[:, :, ::2], s)
    frozen = v.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="v must be writeable"):
        merge_state_in_place(frozen, s, v, s)
    with pytest.raises(ValueError, match="v must have 4 dimensions"):
        merge_states(v, s)


# --- the H200 -------------------------------------------------------------------------------
def _torch_state(torch, shape, dtype, gen):
    v = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    s = 3 * torch.randn(shape[:-1], generator=gen, device="cuda")
    return v, s


def _host(t):
    return t.float().cpu().numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_torch_merges(rng, dtype):
    torch = pytest.importorskip("torch")
    gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 31)))
    tdt = getattr(torch, dtype)
    seq, heads, dim = 1024, 32, 128
    v_a, s_a = _torch_state(torch, (seq, heads, dim), tdt, gen)
    v_b, s_b = _torch_state(torch, (seq, heads, dim), tdt, gen)
    v, s = merge_state(v_a, s_a, v_b, s_b, lse_base=2)  # FlashInfer's base
    assert v.is_cuda and v.dtype == tdt and s.dtype == torch.float32
    ref_v, ref_s = reference.merge_state(_host(v_a), _host(s_a), _host(v_b), _host(s_b), lse_base=2)
    _check(_host(v), _host(s), ref_v, ref_s, dtype)

    mask = torch.rand(seq, generator=gen, device="cuda") < 0.5
    want_v, want_s = _host(v_a).astype(np.float64), _host(s_a).astype(np.float64)
    reference.merge_state_in_place(want_v, want_s, _host(v_b), _host(s_b), mask.cpu().numpy(),
                                   lse_base=2)
    merge_state_in_place(v_a, s_a, v_b, s_b, mask, lse_base=2)
    _check(_host(v_a), _host(s_a), want_v, want_s, dtype)

    vs, ss = _torch_state(torch, (seq, 8, heads, dim), tdt, gen)
    out, lse = merge_states(vs, ss, lse_base=math.e)
    ref_v, ref_s = reference.merge_states(_host(vs), _host(ss), lse_base=math.e)
    _check(_host(out), _host(lse), ref_v, ref_s, dtype)

    with pytest.raises(ValueError, match="v must be contiguous"):
        merge_state_in_place(v_a[:, :, ::2], s_a, v_b[:, :, ::2], s_b)
    with pytest.raises(TypeError, match="arrays must all be of one kind"):
        merge_state(v_a, s_a.cpu().numpy(), v_b, s_b)


@pytest.mark.gpu
def test_gpu_numpy_round_trip(rng):
    v_a, s_a = _state(rng, (64, 8, 128), np.float16)
    v_b, s_b = _state(rng, (64, 8, 128), np.float16)
    v, s = merge_state(v_a, s_a, v_b, s_b, backend="cuda")
    _check(v, s, *reference.merge_state(v_a, s_a, v_b, s_b), "float16")
    want = reference.merge_state(v_a, s_a, v_b, s_b)
    merge_state_in_place(v_a, s_a, v_b, s_b, backend="cuda")
    _check(v_a, s_a, *want, "float16")


@pytest.mark.gpu
def test_gpu_merges_on_a_side_stream_replay_in_a_cuda_graph(rng):
    # Each merge launches on the caller's current stream and allocates nothing of its own, so
    # all three can be captured (they once allocated with Numba and launched on its default
    # stream: capture failed with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED). Real aliasing in place
    # (the GPU does not copy arguments as the simulator does), at an odd head_dim too.
    torch = pytest.importorskip("torch")
    gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 31)))
    for dtype, (seq, heads, dim) in ((torch.float16, (96, 32, 128)), (torch.bfloat16, (40, 3, 80))):
        v, s = _torch_state(torch, (seq, heads, dim), dtype, gen)
        v_o, s_o = _torch_state(torch, (seq, heads, dim), dtype, gen)
        vs, ss = _torch_state(torch, (seq, 3, heads, dim), dtype, gen)
        mask = torch.rand(seq, generator=gen, device="cuda") < 0.5
        start = (v.clone(), s.clone())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compile and bind before capture
            merge_state_in_place(v, s, v_o, s_o, mask)
            merge_state(v_o, s_o, v_o, s_o)
            merge_states(vs, ss)
        torch.cuda.current_stream().wait_stream(stream)
        v.copy_(start[0])
        s.copy_(start[1])
        graph = torch.cuda.CUDAGraph()
        with defer_frees(), torch.cuda.graph(graph):
            merge_state_in_place(v, s, v_o, s_o, mask)
            pair = merge_state(v_o, s_o, vs[:, 0].contiguous(), ss[:, 0].contiguous())
            stack = merge_states(vs, ss)
        for _ in range(2):  # fresh inputs in the captured buffers, then replay
            v_o.copy_(torch.randn(v_o.shape, generator=gen, device="cuda").to(dtype))
            vs.copy_(torch.randn(vs.shape, generator=gen, device="cuda").to(dtype))
            v.copy_(start[0])
            s.copy_(start[1])
            graph.replay()
            torch.cuda.synchronize()
            want_v, want_s = _host(start[0]).astype(np.float64), _host(start[1]).astype(np.float64)
            reference.merge_state_in_place(want_v, want_s, _host(v_o), _host(s_o),
                                           mask.cpu().numpy())
            name = str(dtype).removeprefix("torch.")
            _check(_host(v), _host(s), want_v, want_s, name)
            _check(_host(pair[0]), _host(pair[1]),
                   *reference.merge_state(_host(v_o), _host(s_o), _host(vs[:, 0]),
                                          _host(ss[:, 0])), name)
            _check(_host(stack[0]), _host(stack[1]), *reference.merge_states(_host(vs), _host(ss)),
                   name)
