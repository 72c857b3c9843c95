"""The C++ CPU kernels' threads: every torch thread runs them, one bound per core, and a second engine in the
process binds to distinct CPUs."""

from pathlib import Path

import pytest


def test_kernels_run_on_every_torch_thread_and_bind_one_per_core(tmp_path: Path) -> None:
    """Built without -fopenmp, at::parallel_for ran each kernel on one thread and bind_threads pinned
    only the caller (to the last cpu). In a subprocess (outside the repository, whose source folders would
    shadow installed packages of the same name): binding moves this process's threads."""
    import os
    import subprocess
    import sys

    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two cpus")
    code = (
        f"import os, torch; torch.set_num_threads(2); from conveyor.kernels import cpu_ops; "
        f"print(cpu_ops.bind_threads({cpus}), sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert out.strip().splitlines()[-1] == f"{cpus} [{cpus[0]}]"


def test_a_second_engine_in_the_process_binds_threads_to_distinct_cpus(tmp_path: Path) -> None:
    """cpus were read from the calling thread's affinity, which the first engine had pinned to one cpu:
    the second engine then pinned both torch threads there (demo:tiny ran 25x slower)."""
    import os
    import subprocess
    import sys

    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two cpus")
    code = (
        "import os, torch; torch.set_num_threads(2); from conveyor.engine import LLM\n"
        "for _ in range(2):\n"
        "    LLM('demo:tiny', dtype='float32', cpu_threads_bind='auto')\n"
        "    pinned = [os.sched_getaffinity(int(t)) for t in os.listdir('/proc/self/task')]\n"
        "    print(sorted(set().union(*(a for a in pinned if len(a) == 1))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert out.strip().splitlines()[-2:] == [str(cpus)] * 2
