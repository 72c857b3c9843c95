"""`conveyor` command line: make-model, fetch, generate, bench (serve, throughput, timeline, cluster)."""

import argparse
import importlib.util
import sys
from pathlib import Path

from conveyor.engine.checkpoints.demo import add_make_model_args, run_make_model


def _generate(args: argparse.Namespace) -> int:
    from conveyor.engine import LLM, SamplingParams

    llm = LLM(args.model, revision=args.revision, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    for out in llm.generate(args.prompt, params, use_tqdm=False):
        print(out.outputs[0].text)
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from conveyor.engine.checkpoints.model_source import resolve_model

    print(resolve_model(args.model, args.revision))
    return 0


def _bench(argv: list[str]) -> int:
    """The benchmarks live in the repository beside the package (not in the wheel): a checkout runs them. Only
    the `benchmarks` package is loaded from there; the repository root stays off sys.path (its folders would
    shadow installed packages of the same names, such as Hugging Face's `kernels`)."""
    init = Path(__file__).resolve().parents[1] / "benchmarks" / "__init__.py"
    if "benchmarks" not in sys.modules:
        if not init.is_file():
            print("conveyor bench: the benchmarks come with a checkout of the repository, not with the wheel")
            return 2
        spec = importlib.util.spec_from_file_location("benchmarks", init, submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["benchmarks"] = module
        spec.loader.exec_module(module)
    from benchmarks.cli import main as bench_main

    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="conveyor", description="Conveyor LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-model", help="write a deterministic random-weight demo checkpoint")
    add_make_model_args(make)
    make.set_defaults(func=run_make_model)
    fetch = sub.add_parser("fetch", help="download / convert a model into the local cache, print its path")
    fetch.add_argument("model")
    fetch.add_argument("--revision", default=None)
    fetch.set_defaults(func=_fetch)
    gen = sub.add_parser("generate", help="complete prompts offline")
    gen.add_argument("--model", default="demo:tiny")
    gen.add_argument("--prompt", action="append", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--revision", default=None)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--tensor-parallel-size", type=int, default=1)
    gen.set_defaults(func=_generate)
    sub.add_parser("bench", help="benchmarks: serve (any OpenAI-compatible URL), throughput, timeline")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Runs a parsed subcommand; a ValueError (bad input, named) is printed and exits 2."""
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
