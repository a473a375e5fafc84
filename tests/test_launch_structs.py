"""The driver's launch structures as nbinfer lays them out in ctypes (no GPU needed).

``cuLaunchKernelEx`` reads a ``CUlaunchConfig`` and, for a programmatic dependent launch (the
merge of split rows with ``PREFILL_PDL``), one ``CUlaunchAttribute``; a field at the wrong
offset would launch with garbage, so the offsets are pinned to cuda.h's.
"""

from __future__ import annotations

import ctypes

from nbinfer.kernels.launch import PROGRAMMATIC_STREAM_SERIALIZATION, launch_structs


def test_launch_config_and_attribute_follow_cuda_h():
    config, attribute = launch_structs()
    # seven unsigned ints, 4 bytes of padding, the stream and attribute pointers, the count
    assert [getattr(config, f).offset for f in ("grid_x", "shared_bytes", "stream", "attrs",
                                                "num_attrs")] == [0, 24, 32, 40, 48]
    assert ctypes.sizeof(config) == 56
    # the 4-byte id, 4 bytes of padding, a 64-byte value union
    assert (attribute.id.offset, attribute.value.offset, ctypes.sizeof(attribute)) == (0, 8, 72)
    assert PROGRAMMATIC_STREAM_SERIALIZATION == 6


def test_bind_launch_sets_the_attribute_only_for_a_dependent_launch():
    # _Driver.bind_launch without a driver: its cuLaunchKernelEx replaced by a stand-in
    import nbinfer.kernels.launch as launch

    drv = object.__new__(launch._Driver)
    drv.ctypes, drv.launch_ex = ctypes, object()
    drv._config, drv._attribute = launch_structs()
    for dependent in (False, True):
        fn, args, keep = drv.bind_launch(0x1234, (7, 1, 1), (256, 1, 1), 0x55, 0x66, 98304,
                                         dependent)
        cfg, attr = keep
        assert fn is drv.launch_ex and args == (ctypes.addressof(cfg), 0x1234, 0x66, None)
        assert (cfg.grid_x, cfg.block_x, cfg.shared_bytes, cfg.stream) == (7, 256, 98304, 0x55)
        if not dependent:
            assert attr is None and not cfg.attrs and cfg.num_attrs == 0
            continue
        assert cfg.attrs == ctypes.addressof(attr) and cfg.num_attrs == 1
        assert attr.id == PROGRAMMATIC_STREAM_SERIALIZATION and attr.value[0] == 1
