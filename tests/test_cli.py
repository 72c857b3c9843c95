import subprocess
import sys
from pathlib import Path

from conveyor.engine import LLM, SamplingParams


def conveyor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conveyor.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_prints_the_greedy_completion() -> None:
    run = conveyor("generate", "--model", "demo:tiny", "--prompt", "def main():", "--max-tokens", "8")
    assert run.returncode == 0, run.stderr
    expected = LLM("demo:tiny").generate("def main():", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert run.stdout == expected[0].outputs[0].text + "\n"


def test_bad_arguments_exit_2_with_the_field_named() -> None:
    run = conveyor("generate", "--prompt", "x", "--temperature", "-1")
    assert run.returncode == 2 and "temperature" in run.stderr


def test_bench_runs_from_any_directory(tmp_path: Path) -> None:
    """The benchmarks come from the checkout, not the working directory, and the checkout's folders do not shadow
    installed packages (transformers imports Hugging Face's `kernels`, a name the repository also has)."""
    run = subprocess.run(
        [sys.executable, "-m", "conveyor.cli", "bench", "cluster", "--nodes", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert run.returncode == 2 and "--nodes must be >= 2" in run.stderr, run.stderr
