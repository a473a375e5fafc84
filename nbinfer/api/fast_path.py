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
    descriptive error.
    """

    def __init__(self, step, launch, layout, device, *, rows=None, indices=None):
        """``step``: the StepPlan being built; ``rows``: query rows (default the batch size,
        decode); ``indices``: the page indices run() must find in the cache."""
        import torch

        if device.index is None:  # "cuda" and "cuda:0" must compare equal below
            device = torch.device("cuda", torch.cuda.current_device())
        self.torch, self.launch, self.device = torch, launch, device
        B, Hq, Hkv, D, PS = (step.batch_size, step.num_qo_heads, step.num_kv_heads,
                             step.head_dim, step.page_size)
        tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
        self.q_dtype, self.kv_dtype = tdt[step.q_dtype], tdt[step.kv_dtype]
        rows = B if rows is None else rows
        self.q_shape, self.lse_shape = (rows, Hq, D), (rows, Hq)
        tail = (PS, Hkv, D) if layout == "NHD" else (Hkv, PS, D)
        self.combined_tail, self.tuple_tail = (2, *tail), tail
        indices = step.kv_indices if indices is None else indices
        self.min_pages = int(indices.max()) + 1 if indices.size else 0
        self.v_off = PS * Hkv * D
        self.scratch_lse = torch.empty(self.lse_shape, dtype=torch.float32, device=device)
        token, head = (Hkv * D, D) if layout == "NHD" else (D, PS * D)
        page = PS * Hkv * D
        # Element strides of a contiguous combined cache / (k, v) pair, and of a contiguous q.
        self.strides = {True: (2 * page, token, head, Hq * D, D),
                        False: (page, token, head, Hq * D, D)}
        try:
            self.stream = torch._C._cuda_getCurrentRawStream  # one C call
        except AttributeError:  # pragma: no cover - older torch
            self.stream = lambda idx: torch.cuda.current_stream(idx).cuda_stream

    def _ok(self, x, dtype):
        return (type(x) is self.torch.Tensor and x.dtype == dtype and x.device == self.device
                and x.is_contiguous())

    def __call__(self, q, cache, out, lse, want_lse):
        if not (self._ok(q, self.q_dtype) and q.shape == self.q_shape):
            return None
        if type(cache) is tuple:
            if len(cache) != 2:
                return None
            k, v = cache
            if not (self._ok(k, self.kv_dtype) and self._ok(v, self.kv_dtype)
                    and k.shape[1:] == self.tuple_tail and v.shape == k.shape):
                return None
            kp, vp, combined = k.data_ptr(), v.data_ptr(), False
        else:
            k = cache
            if not (self._ok(k, self.kv_dtype) and k.shape[1:] == self.combined_tail):
                return None
            kp, combined = k.data_ptr(), True
            vp = kp + self.v_off * k.element_size()
        if k.shape[0] < self.min_pages or kp % 16 or vp % 16:
            return None
        if out is None:
            out = self.torch.empty(self.q_shape, dtype=self.q_dtype, device=self.device)
        elif not (self._ok(out, self.q_dtype) and out.shape == self.q_shape):
            return None
        if lse is None:
            if not want_lse:
                # The kernels always write an LSE; nobody reads this one, so it is reused.
                lse = self.scratch_lse
            else:
                lse = self.torch.empty(self.lse_shape, dtype=self.torch.float32,
                                       device=self.device)
        elif not (self._ok(lse, self.torch.float32) and lse.shape == self.lse_shape):
            return None
        L = self.launch
        dec = L.launch
        n = k.numel()
        dec.set_pointer(ARG["q"], q.data_ptr(), q.numel())
        dec.set_pointer(ARG["k"], kp, n)
        dec.set_pointer(ARG["v"], vp, n)
        L.set_strides(*self.strides[combined])
        dec.set_pointer(ARG["o"], out.data_ptr(), out.numel())
        dec.set_pointer(ARG["lse"], lse.data_ptr(), lse.numel())
        L(self.stream(self.device.index or 0))
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
