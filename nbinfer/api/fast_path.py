"""The paged wrappers' fast run() for torch CUDA tensors (decode, paged prefill, cascade).

A careful run() validates each argument with descriptive errors and converts any array kind;
in Python that costs ~75 us per call, more than the GPU needs for a small decode step. When the
caller passes contiguous torch CUDA tensors that match the plan, all of those checks reduce to
comparisons against values plan() fixed, and the launch to patching a few pointers in a
prepared argument block.
"""

from __future__ import annotations

from ..kernels.common import ARG

__all__ = ["TorchFastPath", "run_fast"]


class TorchFastPath:
    """run() for contiguous torch CUDA tensors that match the plan exactly, in a few comparisons.

    Every check of the careful path is here as a comparison against a value plan() fixed
    (shapes, dtypes, device, contiguity, alignment, enough pages); on any mismatch the call
    returns None and run() takes the careful path, which handles strided views or raises the
    descriptive error. One object serves a launch for its lifetime: :meth:`update` moves it to
    a new plan's shapes.

    Per call it costs (H200 host, ``bench/launch_cost.py``): ~0.5 us of checks per tensor, five
    8-byte pointer writes into the argument block (~0.1 us each), ``torch.empty_like`` for the
    output when none is given (~2 us) and the launch itself (~7 us, the driver's).
    """

    def __init__(self, step, launch, layout, device, *, rows=None, indices=None):
        """``step``: the StepPlan being built; ``rows``: query rows (default the batch size,
        decode); ``indices``: the page indices run() must find in the cache."""
        import torch

        if device.index is None:  # "cuda" and "cuda:0" must compare equal below
            device = torch.device("cuda", torch.cuda.current_device())
        self.torch, self.Tensor, self.launch, self.device = torch, torch.Tensor, launch, device
        self._empty_like = torch.empty_like
        self.index = device.index
        tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
               "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
        self.q_dtype, self.kv_dtype = tdt[step.q_dtype], tdt[step.kv_dtype]
        Hq, Hkv, D, PS = step.num_qo_heads, step.num_kv_heads, step.head_dim, step.page_size
        tail = (PS, Hkv, D) if layout == "NHD" else (Hkv, PS, D)
        self.combined_tail, self.tuple_tail = (2, *tail), tail
        self._combined_shape = None  # the last combined cache's whole shape, tail checked
        self.v_off = PS * Hkv * D * self.torch.empty((), dtype=self.kv_dtype).element_size()
        token, head = (Hkv * D, D) if layout == "NHD" else (D, PS * D)
        page = PS * Hkv * D
        # Element strides of a contiguous combined cache / (k, v) pair, and of a contiguous q.
        self.strides = {True: (2 * page, token, head, Hq * D, D),
                        False: (page, token, head, Hq * D, D)}
        P = launch.launch
        self.prepared = P
        # the data cell of q, k, v, o, lse in the argument block
        self._data = tuple(P._slot[ARG[n]] + 4 for n in ("q", "k", "v", "o", "lse"))
        # Launch: the AttentionLaunch when kernels run around this one; else the driver call
        # itself on the prepared block (arguments packed once per stream).
        self._around = bool(launch._before or launch._after)
        self._stream_bound, self._bound = None, None
        from ..kernels.launch import _driver

        self._driver = _driver()
        self._lse_buf = self.scratch_lse = None
        try:
            self.stream = torch._C._cuda_getCurrentRawStream  # one C call
        except AttributeError:  # pragma: no cover - older torch
            self.stream = lambda idx: torch.cuda.current_stream(idx).cuda_stream
        launch.fast = self
        indices = step.kv_indices if indices is None else indices
        self.update(step.batch_size if rows is None else rows, Hq, D,
                    int(indices.max()) + 1 if indices.size else 0)

    def update(self, rows: int, num_qo_heads: int, head_dim: int, min_pages: int) -> None:
        """Follow a new plan of the same kernel: its query rows, and the pages the cache must
        hold (largest page id it reads + 1)."""
        self.q_shape, self.lse_shape = (rows, num_qo_heads, head_dim), (rows, num_qo_heads)
        self.min_pages = min_pages
        if self.scratch_lse is None or tuple(self.scratch_lse.shape) != self.lse_shape:
            n = rows * num_qo_heads
            if self._lse_buf is None or self._lse_buf.numel() < n:
                self._lse_buf = self.torch.empty(max(n, 64), dtype=self.torch.float32,
                                                 device=self.device)
            self.scratch_lse = self._lse_buf[:n].view(rows, num_qo_heads)
        self.dirty = True  # lengths and strides are written by the next call

    def _ok(self, x, dtype):
        return (type(x) is self.Tensor and x.dtype is dtype and x.is_contiguous()
                and x.get_device() == self.index)

    def _bind_all(self, q, k, combined, out, lse) -> bool:
        """The slow half of the first call after a plan (or after the careful path used the
        launch): page count, alignment, every length and the strides."""
        if k.shape[0] < self.min_pages:
            return False
        P, L = self.prepared, self.launch
        n = k.numel()
        P.set_pointer(ARG["q"], 0, q.numel())
        P.set_pointer(ARG["k"], 0, n)
        P.set_pointer(ARG["v"], 0, n)
        P.set_pointer(ARG["o"], 0, q.numel())
        P.set_pointer(ARG["lse"], 0, q.numel() // q.shape[-1])
        L.set_strides(*self.strides[combined])
        self._kv_key = (combined, k.shape)
        self.dirty = False
        return True

    def __call__(self, q, cache, out, lse, want_lse):
        if not (type(q) is self.Tensor and q.dtype is self.q_dtype and q.shape == self.q_shape
                and q.is_contiguous() and q.get_device() == self.index):
            return None
        if type(cache) is tuple:
            if len(cache) != 2:
                return None
            k, v = cache
            if not (self._ok(k, self.kv_dtype) and self._ok(v, self.kv_dtype)):
                return None
            shape = k.shape
            if not (shape[1:] == self.tuple_tail and v.shape == shape):
                return None
            kp, vp, combined = k.data_ptr(), v.data_ptr(), False
        else:
            k = cache
            # inlined _ok(); the shape's tail is compared only when the whole shape changes
            if not (type(k) is self.Tensor and k.dtype is self.kv_dtype and k.is_contiguous()
                    and k.get_device() == self.index):
                return None
            shape = k.shape
            if shape != self._combined_shape:
                if shape[1:] != self.combined_tail:
                    return None
                self._combined_shape = shape
            kp, combined = k.data_ptr(), True
            vp = kp + self.v_off
        if kp % 16 or vp % 16:
            return None
        if out is None:
            out = self._empty_like(q)  # q is contiguous: same shape, dtype and device
        elif not (type(out) is self.Tensor and out.dtype is self.q_dtype  # _ok(), inlined
                  and out.shape == self.q_shape and out.is_contiguous()
                  and out.get_device() == self.index):
            return None
        if lse is None:
            # The kernels always write an LSE; when nobody reads it, a scratch one is reused.
            lse = self.torch.empty(self.lse_shape, dtype=self.torch.float32,
                                   device=self.device) if want_lse else self.scratch_lse
        elif not (self._ok(lse, self.torch.float32) and lse.shape == self.lse_shape):
            return None
        if (self.dirty or self._kv_key != (combined, shape)) and \
                not self._bind_all(q, k, combined, out, lse):
            return None
        P = self.prepared
        c, (iq, ik, iv, io, il) = P._cells, self._data
        c[iq] = q.data_ptr()
        c[ik] = kp
        c[iv] = vp
        c[io] = out.data_ptr()
        c[il] = lse.data_ptr()
        stream = self.stream(self.index)
        if self._around:
            self.launch(stream)
            return out, lse
        if stream != self._stream_bound:
            self._bound = self._driver.bind_launch(P._func, P.grid, P.block, stream, P._params,
                                                   P.shared)
            self._stream_bound = stream
        fn, args, _ = self._bound
        err = fn(*args)
        if err:
            raise RuntimeError(f"kernel launch failed with CUresult {err}")
        return out, lse
def run_fast(step, q, cache, out, lse, return_lse):
    """run() through the plan's fast path, as run() returns it; None when the plan has none or
    the arguments need the careful path."""
    fast = step.fast
    if fast is None:
        return None
    res = fast(q, cache, out, lse, return_lse)
    if res is None:
        return None
    return res if return_lse else res[0]
