"""Shared test configuration: the one tolerance table, fresh random data, the gpu marker."""

from __future__ import annotations

import os

import numpy as np
import pytest

# Relative error ||out - ref|| / ||ref|| allowed against the float64 reference, keyed by the
# storage dtype of the inputs. float32 arithmetic lands far below 1e-4; fp16/bf16 inputs are
# rounded before both engines see them, so their error is the float32 accumulation plus the
# rounding of the output to the storage dtype.
TOLERANCE = {
    "float64": 1e-10,
    "float32": 2e-5,
    "float16": 2e-3,
    "bfloat16": 1e-2,
}

# Absolute error allowed in a natural-log LSE, by the dtype of the inputs. The tensor-core
# kernels sum the P they round to the MMA's operand type (so that the output is normalised by
# the weights that met V): each p's relative error is at most that type's unit roundoff
# (2^-11 for fp16, 2^-8 for bf16), so the sum's is too, and log(l (1 + e)) moves by at most
# about e. float32 inputs keep P in float32.
LSE_TOLERANCE = {
    "float64": 1e-10,
    "float32": 2e-4,
    "float16": 6e-4,
    "bfloat16": 5e-3,
}

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

if SIMULATOR and os.environ.get("NBINFER_SIM_POLL") != "1":
    # the simulator's block scheduler without its busy poll (tests/sim_barrier.py says why);
    # NBINFER_SIM_POLL=1 keeps Numba's own, for an A/B
    import sim_barrier

    sim_barrier.install()


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are zero); NaN never passes."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise AssertionError(f"shape mismatch: {out.shape} vs {ref.shape}")
    if not np.all(np.isfinite(out)):
        return float("inf")
    denom = np.linalg.norm(ref)
    num = np.linalg.norm(out - ref)
    return float(num / denom) if denom > 0 else float(num)


def assert_close(out, ref, dtype="float64", what=""):
    """Assert relative error within the tolerance of ``dtype``."""
    err = rel_err(out, ref)
    tol = TOLERANCE[str(np.dtype(dtype)) if dtype != "bfloat16" else dtype]
    assert err <= tol, f"{what} relative error {err:.3e} > {tol:.1e} ({dtype})"


@pytest.fixture
def rng(request):
    """A fresh generator per test: seeded from the clock unless NBINFER_SEED is set (printed on failure)."""
    seed = int(os.environ.get("NBINFER_SEED", np.random.SeedSequence().entropy % (2**32)))
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None:
        for key, value in item.user_properties:
            if key == "seed":
                item.add_report_section("call", "seed", f"NBINFER_SEED={value} reproduces this run")


def _has_gpu() -> bool:
    if SIMULATOR:
        return False
    try:
        from numba import cuda

        return cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (simulator or no GPU here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
