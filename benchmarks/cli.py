"""`conveyor bench serve | throughput | timeline | cluster` (imported only when `conveyor bench` runs)."""

import argparse

from conveyor.cli import run


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="conveyor bench", description="Conveyor benchmarks")
    sub = parser.add_subparsers(dest="bench", required=True)
    from benchmarks import multinode, serve_bench, throughput_bench, timeline

    for name, module in (
        ("serve", serve_bench),
        ("throughput", throughput_bench),
        ("timeline", timeline),
        ("cluster", multinode),
    ):
        p = sub.add_parser(
            name,
            help=module.__doc__.splitlines()[0].split(": ", 1)[-1],
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_args(p)
        p.set_defaults(func=module.main)
    return run(parser.parse_args(argv))
