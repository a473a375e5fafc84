"""Brute-force attention oracle for the reference-engine tests, written independently of it.

Everything here loops over one query, one head, one key at a time and evaluates a variant by
calling its hook functions directly in plain Python (not through ``nbinfer.variants.host``), and
follows page tables token by token, so a shared mistake between this file and
``nbinfer.reference`` is unlikely. It is slow by design: keep shapes tiny.

Plain Python evaluation note: under NumPy 2's promotion rules (NEP 50) a hook that multiplies a
captured ``np.float32`` constant by a Python float (what ``math.tanh``/``math.exp`` return) yields
a float32, while the same hook compiled by Numba computes in float64. Soft-cap, sigmoid and
attention-sink hooks are affected, so tests of those variants compare with float32 tolerance.
"""

from __future__ import annotations

import math

import numpy as np

from nbinfer.variants import compose, from_flashinfer_args

# Variants whose hooks round to float32 when run as plain Python (see the module docstring).
FLOAT32_HOOK_PREFIXES = ("soft_cap", "sigmoid", "attention_sink")


def hooks_round_to_float32(variant) -> bool:
    """True when plain-Python evaluation of ``variant`` loses float64 precision."""
    return variant is not None and any(p in variant.name for p in FLOAT32_HOOK_PREFIXES)


def flag_variant(num_qo_heads, variant=None, *, causal=False, window_left=-1,
                 logits_soft_cap=None, pos_encoding_mode="NONE", rope_scale=None,
                 rope_theta=None):
    """The variant a FlashInfer call with these flags means, plus an optional extra variant."""
    base = from_flashinfer_args(causal=causal, window_left=window_left,
                                logits_soft_cap=logits_soft_cap,
                                pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale,
                                rope_theta=rope_theta, num_qo_heads=num_qo_heads)
    return base if variant is None else compose(base, variant)


def _transform_vector(fns, x, pos, head):
    """Apply query/key hooks one element at a time to a single vector ``x`` [D]."""
    dim = x.shape[0]
    for fn in fns:
        x = np.array([float(fn(np.float64(x[d]), np.float64(x[(d + dim // 2) % dim]), d, dim,
                               int(pos), int(head))) for d in range(dim)])
    return x


def dense_attention(q, k, v, *, sm_scale=None, variant=None, q_pos=None, kv_pos=None,
                    visible=None):
    """Raw attention state (no output transform), natural-log LSE, by explicit loops.

    q [Lq, Hq, D], k/v [Lkv, Hkv, D] (NHD); ``visible`` optional bool [Lq, Lkv].
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    lq, hq, dim = q.shape
    lkv, hkv, _ = k.shape
    group = hq // hkv
    scale = 1.0 / math.sqrt(dim) if sm_scale is None else sm_scale
    q_pos = list(range(lkv - lq, lkv)) if q_pos is None else [int(p) for p in q_pos]
    kv_pos = list(range(lkv)) if kv_pos is None else [int(p) for p in kv_pos]
    qt = list(variant.query_transform) if variant is not None else []
    kt = list(variant.key_transform) if variant is not None else []
    lt = list(variant.logits_transform) if variant is not None else []
    lm = list(variant.logits_mask) if variant is not None else []
    softmax = variant is None or variant.use_softmax

    keys = {(j, g): _transform_vector(kt, k[j, g], kv_pos[j], g)
            for j in range(lkv) for g in range(hkv)}
    o = np.zeros((lq, hq, v.shape[2]))
    lse = np.zeros((lq, hq)) if not softmax else np.full((lq, hq), -np.inf)
    for h in range(hq):
        g = h // group
        for i in range(lq):
            qi = _transform_vector(qt, q[i, h], q_pos[i], h)
            logits, values = [], []
            for j in range(lkv):
                if visible is not None and not visible[i, j]:
                    continue
                if not all(fn(q_pos[i], kv_pos[j], h) for fn in lm):
                    continue
                s = np.float64(scale * float(np.dot(qi, keys[(j, g)])))
                for fn in lt:
                    s = np.float64(fn(s, q_pos[i], kv_pos[j], h))
                logits.append(float(s))
                values.append(v[j, g])
            if not logits:
                continue
            if not softmax:
                o[i, h] = sum(w * val for w, val in zip(logits, values, strict=True))
                continue
            top = max(logits)
            weights = [math.exp(s - top) for s in logits]
            total = sum(weights)
            o[i, h] = sum(w * val for w, val in zip(weights, values, strict=True)) / total
            lse[i, h] = top + math.log(total)
    return o, lse


def dense_output(o, lse, variant):
    """Apply the output hooks element by element to a final state o [..., H, D], lse [..., H]."""
    if variant is None or not variant.output_transform:
        return o
    out = np.array(o, dtype=np.float64)
    for idx in np.ndindex(*out.shape):
        h = idx[-2]
        x = np.float64(out[idx])
        for fn in variant.output_transform:
            x = np.float64(fn(x, np.float64(lse[idx[:-1]]), h))
        out[idx] = x
    return out


# -- paged KV cache, followed token by token ------------------------------------------------------

def cache_token(paged_kv_cache, kv_layout, page, slot):
    """Key and value vectors [Hkv, D] stored at (page, slot), read straight from the layout."""
    if isinstance(paged_kv_cache, tuple):
        kc, vc = paged_kv_cache
        if kv_layout == "NHD":
            return kc[page, slot], vc[page, slot]
        return kc[page, :, slot], vc[page, :, slot]
    if kv_layout == "NHD":
        return paged_kv_cache[page, 0, slot], paged_kv_cache[page, 1, slot]
    return paged_kv_cache[page, 0, :, slot], paged_kv_cache[page, 1, :, slot]


def request_kv(paged_kv_cache, kv_layout, kv_indptr, kv_indices, kv_last_page_len, page_size, b):
    """Dense K, V [kv_len, Hkv, D] (float64) of request ``b``, one token at a time."""
    pages = list(kv_indices[kv_indptr[b]:kv_indptr[b + 1]])
    kv_len = 0 if not pages else (len(pages) - 1) * page_size + int(kv_last_page_len[b])
    ks, vs = [], []
    for t in range(kv_len):
        kt, vt = cache_token(paged_kv_cache, kv_layout, int(pages[t // page_size]),
                             t % page_size)
        ks.append(np.asarray(kt, dtype=np.float64))
        vs.append(np.asarray(vt, dtype=np.float64))
    if not ks:
        kc, _ = paged_kv_cache if isinstance(paged_kv_cache, tuple) else (paged_kv_cache, None)
        shape = (0, kc.shape[-2] if kv_layout == "NHD" else kc.shape[-3], kc.shape[-1])
        return np.zeros(shape), np.zeros(shape)
    return np.stack(ks), np.stack(vs)


def random_paged_cache(rng, kv_lens, page_size, num_kv_heads, head_dim, *, kv_layout="NHD",
                       as_tuple=False, spare_pages=2, dtype=np.float64):
    """A random paged cache holding requests of ``kv_lens`` on randomly permuted pages.

    Every slot (used or not) holds random data, so reading a wrong slot shows up. Returns
    ``(paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len)``; a request of length 0 gets no
    pages and ``last_page_len`` 0.
    """
    pages_per = [-(-n // page_size) for n in kv_lens]
    total = sum(pages_per) + spare_pages
    perm = rng.permutation(total).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(pages_per)]).astype(np.int32)
    indices = perm[:indptr[-1]]
    last = np.array([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages_per,
                                                                            strict=True)],
                    dtype=np.int32)
    page_shape = ((page_size, num_kv_heads) if kv_layout == "NHD"
                  else (num_kv_heads, page_size)) + (head_dim,)
    if as_tuple:
        cache = tuple(rng.standard_normal((total,) + page_shape).astype(dtype) for _ in range(2))
    else:
        cache = rng.standard_normal((total, 2) + page_shape).astype(dtype)
    return cache, indptr, indices, last
