"""The one-launch cascade's schedule: KV chunk size x a per-item cost in LPT (diagnostic).

    python bench/cascade_sweep.py [--tiles 64m] [--splits 0,512,1024] [--overheads -,0,128,256]
        [--pdl 0,1] [--rounds 1] [--out $OUT/cascade_sweep.json]

The shared-prefix case of bench/prefill.py (64 requests x (8192 shared + 256 own) tokens, Hq 32,
Hkv 8, D 128, fp16, pages of 16). LPT weighs an item as ``alpha * rows + beta * kv tokens``, a
byte count; on the tensor-core tile an own-level item (4 live rows of 64, 256 keys) costs a
fixed start and end (Q load, pipeline fill, partial write) on top of its 4 KV tiles, which the
byte count misses, so the 512 own items pile onto the CTAs the 192 prefix chunks leave free.
The planner's ``item_overhead`` (KV tokens of cost per item; '-' is the wrapper's default of four
KV tiles, 0 the byte model) and the chunk size (0: the adaptive split) are swept; each point is
checked against plain decode and timed as CUDA-graph replay and as one call. The modelled
per-CTA load (KV tiles + 3 tiles of start and end per item) is printed beside it. ``--pdl``
sweeps ``PREFILL_PDL`` (the merge of split rows as a programmatic dependent launch), and
``--rounds`` repeats the whole sweep (an A/B alternated within one process).

(Session 10's calls 3-5 ran an earlier version whose overhead column was *added* to the
wrapper's default, 4 KV tiles: its 0 was the default; call 2 predates that default, so its 0 was
the byte model. Its modelled tiles assumed 64-key tiles for every config.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from decode import median_ms  # noqa: E402
from prefill import api_overrides, graph_ms, shared_prefix_case, tile_config  # noqa: E402


def modelled_tiles(sched, kv_tile: int, per_item: float = 3.0) -> tuple[float, float]:
    """(max, mean) over CTAs of KV tiles + ``per_item`` tiles per item (a CTA with no items
    counts 0)."""
    w = np.asarray(sched.work)
    tiles = -(-(w[:, 5] - w[:, 4]) // kv_tile) + per_item
    load = np.bincount(sched.item_cta(), weights=tiles, minlength=sched.num_ctas)
    return float(load.max(initial=0.0)), float(load.mean())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", default="64m")
    ap.add_argument("--splits", default="0,512,1024")
    ap.add_argument("--overheads", default="-,128,256,512",
                    help="per-item cost in KV tokens; '-' is the wrapper's default")
    ap.add_argument("--pdl", default="0", help="PREFILL_PDL values to sweep (0,1)")
    ap.add_argument("--rounds", type=int, default=1, help="times the whole sweep runs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    case = shared_prefix_case()
    casc, plain, q, cache = case["casc"], case["plain"], case["q"], case["cache"]
    plain_graph = graph_ms(lambda: plain.run(q, cache))
    plain_call = median_ms(lambda: plain.run(q, cache))
    ref = plain.run(q, cache).float()
    rows = []
    print(f"plain decode: graph {plain_graph * 1e3:.1f} us, one call {plain_call * 1e3:.1f} us")
    print(f"{'tiles':>6} {'split':>6} {'ovh':>5} {'pdl':>3} {'items':>6} {'model max/mean':>15} "
          f"{'graph us':>9} {'call us':>8} {'x graph':>8} {'x call':>7} {'err':>8}")
    points = [(token, int(split), None if o == "-" else int(o), bool(int(pdl)))
              for token in args.tiles.split(",") for split in args.splits.split(",")
              for o in args.overheads.split(",") for pdl in args.pdl.split(",")]
    for rnd in range(args.rounds):
        for token, split, ovh, pdl in points:
            # None: the wrapper's default item cost (four KV tiles)
            with tile_config(token), api_overrides(MMA_ITEM_OVERHEAD=ovh,
                                                   PREFILL_PDL=pdl):
                casc.plan(*case["levels"], *case["heads"], q_data_type="float16",
                          fixed_split_size=split or None)
            sched = casc.fused_wrapper.schedule
            kv_tile = casc.fused_wrapper.step_plan.spec.kv_tile
            mx, mean = modelled_tiles(sched, kv_tile)
            err = float((casc.run(q, cache).float() - ref).abs().max())
            g = graph_ms(lambda: casc.run(q, cache))
            c = median_ms(lambda: casc.run(q, cache))
            used = sched.item_overhead  # what the plan took
            row = dict(tiles=token, split=split, overhead=used, pdl=pdl, round=rnd,
                       items=int(sched.num_work),
                       model_max_tiles=mx, model_mean_tiles=mean, graph_ms=g, call_ms=c,
                       x_graph=plain_graph / g, x_call=plain_call / c, max_abs_diff=err)
            rows.append(row)
            print(f"{token:>6} {split:>6} {used:>5} {pdl:>3d} {row['items']:>6} "
                  f"{mx:7.1f}/{mean:<7.1f} "
                  f"{g * 1e3:9.1f} {c * 1e3:8.1f} {row['x_graph']:8.2f} {row['x_call']:7.2f} "
                  f"{err:8.1e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(plain_graph_ms=plain_graph, plain_call_ms=plain_call, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
