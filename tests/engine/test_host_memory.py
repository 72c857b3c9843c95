import subprocess
import sys

SCRIPT = """
import resource, sys, torch
from conveyor.engine.execution.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
def step():
    x = torch.empty(48 << 18)  # 48 MiB of float32, above glibc's largest default mmap threshold
    x.fill_(1.0)
for _ in range(10):  # with the thresholds raised the heap settles within a few buffers (7 here)
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> tuple[bool, int]:
    env = {"PATH": "/usr/bin:/bin"}  # no MALLOC_* knobs from the caller's environment
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, check=True)
    applied, count = out.stdout.split()
    return applied == "True", int(count)


def test_freed_activations_are_reused_instead_of_faulted_in_again() -> None:
    """Without keep_freed_memory every 48 MiB buffer is a fresh mapping (12288 page faults each); with it, once
    the heap has settled, freed pages are reused."""
    applied, kept = faults("keep")
    _, default = faults("default")
    assert applied
    assert default >= 10 * 12288 * 0.9, default
    assert kept <= 12288, kept


DROP_SCRIPT = """
import gc
from conveyor.engine import LLM, SamplingParams
def rss_mib():
    return next(int(line.split()[1]) >> 10 for line in open("/proc/self/status") if line.startswith("VmRSS"))
after = []
for _ in range(4):
    llm = LLM("demo:tiny", dtype="float32", kv_cache_memory=256 << 20)
    llm.generate([{"prompt_token_ids": list(range(5, 60))}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    del llm
    gc.collect()
    after.append(rss_mib())
print(*after)
"""


def test_a_dropped_engine_gives_its_memory_back() -> None:
    """Engines made and dropped in one process (tests, notebooks) must not pile up: neither the 256 MiB KV cache
    (kept by malloc below its mmap threshold) nor the start-up objects frozen out of the collector's reach."""
    out = subprocess.run([sys.executable, "-c", DROP_SCRIPT], capture_output=True, text=True, check=True)
    after = [int(x) for x in out.stdout.split()]
    assert after[-1] - after[0] < 64, after
