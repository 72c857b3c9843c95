"""Building and loading the C++ CPU kernels: the best ISA the CPU runs or the one named, one module per ISA and
source digest, the auto attention backend, and a build lock that survives a killed builder."""

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conveyor.kernels import cpu_ops


def test_load_takes_the_best_isa_the_cpu_runs_or_the_one_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_ops, "_is_x86", lambda: True)
    monkeypatch.setattr(cpu_ops, "_cpu_flags", lambda: {"sse2", "avx", "avx2", "fma", "f16c"})  # AMD EPYC Zen 2
    assert cpu_ops.supported_isas() == ["avx2", "generic"]
    assert cpu_ops.missing_cpu_flags("avx512bf16") == ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"]
    with caplog.at_level(logging.WARNING, logger="conveyor"):
        assert cpu_ops._load.__wrapped__("avx512") is None  # unmemoized: the decision, not a cached module
        assert cpu_ops._load.__wrapped__("sse9") is None
    assert "lacks avx512f, avx512bw, avx512vl, avx512dq for ISA avx512" in caplog.text
    assert "unknown ISA 'sse9'" in caplog.text
    monkeypatch.setattr(cpu_ops, "_is_x86", lambda: False)  # aarch64: the portable build only
    assert cpu_ops.supported_isas() == ["generic"] and cpu_ops.missing_cpu_flags("avx2") == ["x86"]
    monkeypatch.undo()
    best = cpu_ops.supported_isas()[0]
    monkeypatch.delenv("CONVEYOR_CPU_ISA", raising=False)
    assert cpu_ops.isa() == best and cpu_ops.load() is cpu_ops.load(best)
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "generic")
    assert cpu_ops.isa() == "generic" and cpu_ops.load() is cpu_ops.load("generic")
    monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "0")
    assert cpu_ops.load() is None and cpu_ops.isa() is None


def test_each_isa_is_its_own_module_named_by_isa_and_digest() -> None:
    names = {isa: cpu_ops.module_name(isa) for isa in cpu_ops.ISAS}
    assert len(set(names.values())) == len(names)
    assert all(name.startswith(f"conveyor_cpu_ops_{isa}_") for isa, name in names.items())
    assert "-DCONVEYOR_ISA_AVX2" in cpu_ops.cflags("avx2") and "-mavx512bf16" not in cpu_ops.cflags("avx512")
    assert all({"-fopenmp", "-ffp-contract=off"} <= set(cpu_ops.cflags(isa)) for isa in cpu_ops.ISAS)


def test_auto_backend_on_cpu_is_the_cpp_kernels_except_float16() -> None:
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.resolved_config import resolve

    assert EngineConfig(model="demo:tiny", dtype="float32").attention_backend == "auto"
    assert resolve(EngineConfig(model="demo:tiny", dtype="float32")).attention_backend == "cpu"
    assert resolve(EngineConfig(model="demo:tiny", dtype="bfloat16")).attention_backend == "cpu"
    assert resolve(EngineConfig(model="demo:tiny", dtype="float16")).attention_backend == "torch"


def test_a_running_build_is_waited_for_and_a_killed_ones_lock_removed(tmp_path, monkeypatch) -> None:
    """A build killed midway leaves torch's lock file, on which torch would wait for ever: the next build
    waits while the builder lives and removes that file once it is gone."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    name = "conveyor_lock_test"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_BUILD_LOCK, name], env={**os.environ}, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "building"
        lock = Path(_get_build_directory(name, False)) / "lock"
        assert lock.exists()
        entered = threading.Event()

        def build() -> None:
            with cpu_ops.build_lock(name):
                entered.set()

        waiter = threading.Thread(target=build)
        waiter.start()
        assert not entered.wait(1.0), "a live build is waited for"
        holder.kill()
        holder.wait()
        assert entered.wait(10.0), "the killed build's lock is released with its process"
        waiter.join()
        assert not lock.exists()
    finally:
        holder.kill()


HOLD_BUILD_LOCK = """
import sys, time
from pathlib import Path
from torch.utils.cpp_extension import _get_build_directory
from conveyor.kernels import cpu_ops
with cpu_ops.build_lock(sys.argv[1]):
    (Path(_get_build_directory(sys.argv[1], False)) / "lock").touch()  # what torch's FileBaton does
    print("building", flush=True)
    time.sleep(60)
"""
