"""The parent side of `python -m benchmarks.gpu_check --aot`: resolves every case's launches, compiles the
distinct ones in spawned workers (benchmarks/aot_compile.py) or takes them from the cache, and prints the
table, a summary per target and every problem."""

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.aot_cases import AOT_CACHE_DIR, AOT_SCHEMA, AOT_SMEM_LIMIT, AotLaunch, AotReport, AotResult, aot_cases
from benchmarks.aot_compile import compile_launch, environ, resolve_launches


def _cache_path(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"{key}.json"


def _load_cached(cache_dir: Path, key: str) -> AotResult | None:
    try:
        data = json.loads(_cache_path(cache_dir, key).read_text())
    except (OSError, ValueError):
        return None
    if data.pop("schema", None) != AOT_SCHEMA:
        return None
    return replace(AotResult(**data), cached=True)


def _store_cached(cache_dir: Path, key: str, result: AotResult) -> None:
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{key}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"schema": AOT_SCHEMA, **asdict(result)}))
    os.replace(tmp, _cache_path(cache_dir, key))


def _unique_launches(launches: list[AotLaunch]) -> dict[str, tuple[AotLaunch, list[str]]]:
    """Launches that compile the same thing, merged: key -> (first such launch, every case label)."""
    unique: dict[str, tuple[AotLaunch, list[str]]] = {}
    for launch in launches:
        unique.setdefault(launch.key, (launch, []))[1].append(launch.case.label())
    return unique


def _compile_order(launch: AotLaunch) -> tuple:
    """Longest compiles first so the pool ends together: prefill, then bigger tiles, fp32 last of each."""
    rank = {"prefill": 0, "decode": 1}.get(launch.case.op, 2)
    return (rank, -launch.case.head_dim, -launch.case.max_query_len, launch.case.label(), launch.arch)


def run_aot_check(
    archs: tuple[int, ...] = tuple(AOT_SMEM_LIMIT),
    jobs: int = 2,
    cache_dir: Path | None = AOT_CACHE_DIR,
    only: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> AotReport:
    """Compiles every kernel the engine launches (aot_cases()) for each target; cache_dir None disables the
    cache. Compiles run in `jobs` spawned processes with TRITON_INTERPRET unset, so this is safe to call
    from a process where the interpreter is on (the test suite on CPU)."""
    start = time.perf_counter()
    cases = [c for c in aot_cases() if only is None or only in c.label()]
    ctx = multiprocessing.get_context("spawn")
    with environ(TRITON_INTERPRET=None), ProcessPoolExecutor(max(1, jobs), mp_context=ctx) as pool:
        launches, unlaunched = pool.submit(resolve_launches, cases, archs).result()
        unique = _unique_launches(launches)
        results: dict[str, AotResult] = {}
        pending: dict[str, Future] = {}
        for key, (launch, labels) in sorted(unique.items(), key=lambda kv: _compile_order(kv[1][0])):
            cached = _load_cached(cache_dir, key) if cache_dir is not None else None
            if cached is not None:
                results[key] = cached
            else:
                pending[key] = pool.submit(compile_launch, launch)
        for done, (key, future) in enumerate(pending.items(), 1):
            result = future.result()
            if cache_dir is not None and not result.error:
                _store_cached(cache_dir, key, result)
            results[key] = result
            if progress is not None and (done % 20 == 0 or done == len(pending)):
                progress(f"compiled {done}/{len(pending)} ({len(unique) - len(pending)} cached)")
    for key, result in results.items():
        result.cases = unique[key][1]
    first_seen = {key: i for i, key in enumerate(unique)}
    ordered = sorted(results.items(), key=lambda kv: (kv[1].kernel, kv[1].arch, first_seen[kv[0]]))
    return AotReport([r for _, r in ordered], unlaunched if only is None else [], time.perf_counter() - start)


def _format_table(results: list[AotResult]) -> str:
    header = (
        "kernel",
        "target",
        "dtype",
        "config",
        "warps/stages",
        "regs",
        "spills",
        "smem",
        "mma",
        "seconds",
        "cached",
        "status",
    )
    rows = [header]
    for r in results:
        mma = "+".join(r.mma) if r.mma else ("no" if r.dot_types else "-")
        if r.dot_types and not r.mma_expected:
            mma += f" ({'/'.join(r.dot_types)} ieee)"
        status = "; ".join(r.problems()) or "ok"
        rows.append(
            (
                r.kernel,
                f"sm_{r.arch}",
                r.dtype,
                r.config,
                f"{r.num_warps}/{r.num_stages}",
                str(r.regs),
                str(r.spill_bytes),
                str(r.smem),
                mma,
                f"{r.seconds:.1f}",
                "yes" if r.cached else "no",
                status,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _summary(report: AotReport) -> str:
    lines = []
    for arch in sorted({r.arch for r in report.results}):
        mine = [r for r in report.results if r.arch == arch and not r.error]
        failed = sum(bool(r.problems()) for r in report.results if r.arch == arch)
        if mine:
            lines.append(
                f"sm_{arch}: {len(mine)} kernels compiled, regs {min(r.regs for r in mine)}-"
                f"{max(r.regs for r in mine)}, smem {min(r.smem for r in mine)}-{max(r.smem for r in mine)} "
                f"bytes (limit {AOT_SMEM_LIMIT[arch]}), {failed} failing"
            )
    cached = sum(r.cached for r in report.results)
    lines.append(f"{len(report.results)} compiles ({cached} from cache) in {report.seconds:.0f} s")
    return "\n".join(lines)


def aot_main(args: argparse.Namespace) -> int:
    report = run_aot_check(
        jobs=args.jobs,
        cache_dir=None if args.no_cache else args.cache_dir,
        only=args.only,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(_format_table(report.results))
    print(_summary(report))
    problems = report.problems()
    for problem in problems:
        print("FAIL", problem)
    print("AOT check", "FAILED" if problems or not report.results else "passed")
    return 1 if problems or not report.results else 0
