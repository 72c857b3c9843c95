"""One ISA build of the C++ CPU kernels (kernels/cpu_ops.py's ISAS), for the kernel tests."""

from types import ModuleType

import pytest

from conveyor.kernels import cpu_ops
from conveyor.kernels.cpu_ops import load as load_kernels  # the real one: conftest.py patches cpu_ops.load


def isa_module(isa: str) -> ModuleType:
    """The kernels built for `isa`; skips (naming the missing CPU flags) where this CPU cannot run them and
    fails where they do not build."""
    missing = cpu_ops.missing_cpu_flags(isa)
    if missing:
        pytest.skip(f"the CPU lacks {', '.join(missing)} for {isa}")
    lib = load_kernels(isa)
    assert lib is not None, f"the {isa} kernels did not build (see the log)"
    assert lib.isa == isa
    return lib
