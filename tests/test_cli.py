import subprocess
import sys

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
