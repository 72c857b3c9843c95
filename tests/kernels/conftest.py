"""`lib`: each ISA build of the C++ CPU kernels in turn, also behind cpu_ops' wrappers; an ISA this CPU cannot
run is skipped naming the CPU flags it lacks."""

from types import ModuleType

import pytest

from conveyor.kernels import cpu_ops
from tests.kernels.cpu_isa import isa_module


@pytest.fixture(params=cpu_ops.ISAS)
def lib(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """One ISA's kernels, also behind cpu_ops' wrappers (cpu_ops.paged_attention, store_kv_cache...)."""
    module = isa_module(request.param)
    monkeypatch.setattr(cpu_ops, "load", lambda isa=None: module)
    return module
