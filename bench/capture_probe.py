"""Find what invalidates the engine's CUDA-graph captures (the intermittent CUresult 901).

Session 31 saw ``tests/test_engine_gpu.py``'s graph tests fail in 3 of 6 runs: the first
nbinfer launch inside ``torch.cuda.graph`` (RoPE, after the rmsnorm and the q/k/v GEMM) got
901, ``CUDA_ERROR_STREAM_CAPTURE_INVALIDATED``: something before it, which does not check its
error, had made a call a capture forbids. This script replays the tests' scenario (an eager
engine, then engines with decode graphs, cascade graphs and the overlap; a fused model whose
RoPE table grows) ``--rounds`` times in one process and watches every capture:

- a profile hook (``sys.setprofile``, on only while a capture runs) asks the capturing
  stream's status (``cudaStreamIsCapturing``) at every Python and C call and return, and
  records the first event at which the capture is no longer active, with its stack, and the
  last event at which it still was (what broke it ran between the two);
- a ``gc.callbacks`` hook asks it before and after every collection during a capture, so a
  finalizer run by the collector (a freed pinned buffer, an event, a Numba array) is named as
  the cause if the status flips across it.

Each round's outcome and every flip found go to ``--out`` (JSON) and the log. As a pytest
plugin it watches every capture of a test run instead (``CAPTURE_PROBE_OUT``: the JSON;
``CAPTURE_PROBE_SAVEALL=1``: what a collection inside a capture finds, kept alive and named by
type; ``CAPTURE_PROBE_MODE``: the capture error mode).

    python3 bench/capture_probe.py --rounds 6 --out $OUT/capture_probe.json
    PYTHONPATH=bench:$PYTHONPATH python3 -P -m pytest -p capture_probe tests/test_engine_gpu.py
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import time
import traceback


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--mode", default="global", choices=("global", "thread_local", "relaxed"),
                    help="torch.cuda.graph's capture_error_mode for every capture")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    # the scenario's requests and engines are the tests' own (tests/test_engine_gpu.py)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from test_engine_gpu import CFG as cfg
    from test_engine_gpu import _engine as engine
    from test_engine_gpu import _requests as requests

    from nbinfer.engine import init_weights
    from nbinfer.engine.torch_model import TorchLlama

    weights = init_weights(cfg, seed=5)
    rec = install_watch(args.mode)
    flips, gcs, state = rec["flips"], rec["gc"], rec["state"]

    rounds = []
    for r in range(args.rounds):
        t = time.perf_counter()
        outcome = {"round": r, "errors": []}
        model = TorchLlama(cfg, weights, device="cuda", dtype=torch.float32)
        reqs = requests(3, n=6, new=32)
        try:
            eager = engine(model, prefix_cache=True).run(reqs)
            runs = [dict(prefix_cache=True, cuda_graphs=True),
                    dict(prefix_cache=True, cuda_graphs=True, cascade_graphs=True),
                    dict(prefix_cache=True, cuda_graphs=True, overlap=True),
                    dict(num_pages=14, prefix_cache=True, cuda_graphs=True, overlap=True)]
            for kw in runs:
                pages = kw.pop("num_pages", 256)
                got = engine(model, pages, **kw).run(reqs)
                if got != eager:
                    outcome["errors"].append(f"tokens differ: {kw}")
            small = TorchLlama(cfg, weights, device="cuda", dtype=torch.float32, max_positions=8)
            want = engine(model, cuda_graphs=True).run(requests(4))
            if engine(small, cuda_graphs=True).run(requests(4)) != want:
                outcome["errors"].append("rope-growth tokens differ")
        except Exception as exc:  # noqa: BLE001 - a probe records and goes on
            outcome["errors"].append(f"{type(exc).__name__}: {exc}"[:400])
            try:
                torch.cuda.synchronize()
            except Exception as sync_exc:  # noqa: BLE001 - after a broken capture
                outcome["errors"].append(f"synchronize: {sync_exc}"[:200])
        outcome["captures_so_far"] = state["capture"]
        outcome["s"] = round(time.perf_counter() - t, 1)
        rounds.append(outcome)
        print(f"round {r}: {outcome['s']} s, captures {state['capture']}, "
              f"errors {outcome['errors'] or 'none'}", flush=True)
    report(rec)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"mode": args.mode, "rounds": rounds, "flips": flips, "gc": gcs}, fh,
                      indent=1)
    failed = sum(bool(o["errors"]) for o in rounds)
    print(f"rounds failed: {failed} of {len(rounds)}; captures invalidated: {len(flips)}")
    return 1 if failed else 0


def install_watch(mode: str = "global", saveall: bool = False) -> dict:
    """Replace ``torch.cuda.graph`` by a subclass that watches every capture (profile and
    collector hooks, module docstring) with ``capture_error_mode`` ``mode``; returns the
    records it fills: ``flips`` (the first event at which a capture was no longer active, with
    its stack, and the last event at which it still was: the fault lies between the two),
    ``gc`` (each collection during a capture and the status after it) and
    ``state`` (``capture``: captures so far). ``saveall``: what a collection during a capture
    finds is kept (``gc.DEBUG_SAVEALL``: never finalized there, so the capture survives) and
    its commonest types are recorded; the objects are let go after the capture."""
    import torch
    from cuda.bindings import runtime as rt

    flips, gcs = [], []
    state = {"capture": 0}

    def status(stream) -> int:
        err, st = rt.cudaStreamIsCapturing(stream)
        if int(err) != 0:  # (a failed query is not a flip)
            raise RuntimeError(f"cudaStreamIsCapturing: error {err}")
        return int(st)

    def where(frame, event, arg) -> str:
        # a C call's function, else the Python function the event is in
        name = getattr(arg, "__qualname__", None) if event.startswith("c_") else None
        return (f"{event} {name or frame.f_code.co_qualname} at "
                f"{frame.f_code.co_filename}:{frame.f_lineno}")

    active = int(rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive)
    torch.zeros(1, device="cuda")
    status(torch.cuda.current_stream().cuda_stream)  # the runtime's set-up, outside captures
    original = torch.cuda.graph

    class watched(original):  # noqa: N801 - stands in for torch.cuda.graph
        def __init__(self, *a, **kw):
            kw.setdefault("capture_error_mode", mode)
            super().__init__(*a, **kw)

        def __enter__(self):
            out = super().__enter__()
            stream = torch.cuda.current_stream().cuda_stream
            state["capture"] += 1
            seen = {"flipped": False, "last": None}

            def hook(frame, event, arg):
                if seen["flipped"]:
                    return
                st = status(stream)
                if st == active:
                    seen["last"] = (frame, event, arg)
                    return
                seen["flipped"] = True
                flips.append({"capture": state["capture"], "status": st,
                              "at": where(frame, event, arg),
                              "last_active": where(*seen["last"]) if seen["last"] else None,
                              "stack": traceback.format_stack(frame, limit=12)})

            def on_gc(phase, info):
                st = status(stream)
                rec = {"capture": state["capture"], "phase": phase,
                       "generation": info.get("generation"),
                       "collected": info.get("collected"), "status": st}
                if saveall and phase == "start":
                    seen["garbage"] = len(gc.garbage)
                if saveall and phase == "stop":  # what this collection added
                    found = collections.Counter(
                        f"{type(o).__module__}.{type(o).__qualname__}"
                        for o in gc.garbage[seen.get("garbage", 0):])
                    rec["types"] = found.most_common(15)
                    rec["cuda_types"] = sorted(n for n in found if "cuda" in n.lower()
                                               or "numba" in n.lower())
                gcs.append(rec)

            self._probe = (hook, on_gc, gc.get_debug(), sys.getprofile())
            if saveall:
                gc.set_debug(self._probe[2] | gc.DEBUG_SAVEALL)
            gc.callbacks.append(on_gc)
            sys.setprofile(hook)
            return out

        def __exit__(self, *exc):
            sys.setprofile(self._probe[3])
            gc.callbacks.remove(self._probe[1])
            try:
                return super().__exit__(*exc)
            finally:
                if saveall:
                    gc.set_debug(self._probe[2])
                    gc.garbage.clear()

    torch.cuda.graph = watched
    return {"flips": flips, "gc": gcs, "state": state}


def report(rec: dict) -> None:
    """Print :func:`install_watch`'s records: captures, collections during them, each
    invalidated capture with the call it followed and its stack, and (``saveall``) what the
    collections found."""
    during = [g for g in rec["gc"] if g["phase"] == "stop"]
    print(f"capture probe: {rec['state']['capture']} captures, {len(during)} collections during "
          f"them, {len(rec['flips'])} invalidated")
    for f in rec["flips"]:
        print(f"capture {f['capture']}: status {f['status']} at {f['at']}; last active at "
              f"{f['last_active']}")
        print("".join(f["stack"][-8:]))
    for g in during:
        if "types" in g:
            print(f"collection in capture {g['capture']} (generation {g['generation']}, "
                  f"{g['collected']} objects): CUDA-related types {g['cuda_types']}")


# pytest plugin (``PYTHONPATH=bench pytest -p capture_probe ...``): every capture of the run
# watched, the records written to $CAPTURE_PROBE_OUT (JSON) and summarised at the end.
_RECORDS = {}


def pytest_configure(config):
    import os

    import nbinfer

    print(f"capture probe: nbinfer from {nbinfer.__file__}")  # (which tree the tests import)
    _RECORDS.update(install_watch(os.environ.get("CAPTURE_PROBE_MODE", "global"),
                                  saveall=bool(os.environ.get("CAPTURE_PROBE_SAVEALL"))))


def pytest_sessionfinish(session, exitstatus):
    import os

    if not _RECORDS:
        return
    print()
    report(_RECORDS)
    out = os.environ.get("CAPTURE_PROBE_OUT")
    if out:
        with open(out, "w") as fh:
            json.dump({"flips": _RECORDS["flips"], "gc": _RECORDS["gc"]}, fh, indent=1,
                      default=str)


if __name__ == "__main__":
    sys.exit(main())
