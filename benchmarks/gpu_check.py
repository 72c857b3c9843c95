"""The one prepared GPU check (a CUDA machine, no network): the Triton kernels against the reference
and their timings (benchmarks/triton_kernels.py --quick), then the engine end to end on CUDA — greedy tokens
in float32 equal to the CPU run on demo:small (and on SmolLM2 when its checkpoint is in the model
cache), and bfloat16 tok/s on the seed workload. `python -m benchmarks.gpu_check`; exits 1 on any
mismatch, within ~8 minutes on one GPU.

`python -m benchmarks.gpu_check --aot` needs no GPU: it compiles every Triton kernel the engine launches
(kernels/triton_kernels.py) for sm_80 and sm_90 with the constexprs and launch options the launchers
(kernels/triton_ops.py) pick, and fails on register spills, shared memory over the target's limit, or a
16-bit tl.dot without tensor-core MMA in the SASS. Results are cached under ~/.cache/conveyor/triton-aot/."""

import argparse
import contextlib
import hashlib
import io
import itertools
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch


def greedy(model: str, device: str, dtype: str, prompts: list[dict], max_tokens: int) -> list[list[int]]:
    from conveyor.engine import LLM, SamplingParams

    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=32, max_num_batched_tokens=2048)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def tok_per_s(model: str, dtype: str, n: int) -> float:
    from benchmarks.throughput import workload
    from conveyor.engine import LLM, SamplingParams

    llm = LLM(model, device="cuda", dtype=dtype, max_num_seqs=32, max_num_batched_tokens=2048)
    prompts, params = workload(n, 0, llm.engine.vocab_size)
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2, use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------------
# AOT mode: compile for real GPU targets on a machine without a GPU or driver.

# Largest dynamic shared memory one thread block may use on each compute capability, in bytes.
AOT_SMEM_LIMIT: dict[int, int] = {80: 163 * 1024, 90: 227 * 1024}
AOT_CACHE_DIR = Path.home() / ".cache" / "conveyor" / "triton-aot"
AOT_SCHEMA = 1  # bump when AotResult's fields or their meaning change: old cache entries are then ignored
AOT_DTYPES = ("float16", "bfloat16", "float32")
AOT_HEAD_DIMS = (64, 128, 256)
AOT_PADDED_HEAD_DIMS = (96,)  # prefill only: narrower than its BLOCK_D, which its tile rules key on
AOT_GROUPS = (1, 2, 3, 4, 8)
AOT_BLOCK_SIZES = (16, 32)
AOT_KV_HEADS = (1, 3, 8, 32)  # store_kv's NUM_KV_HEADS / BLOCK_H
AOT_DECODE_SPLITS = ((1, 1), (64, 3))  # per decode mode, the num_splits of its two cases; 1 is no split-K
AOT_QUERY_LENS = (8, 32, 64, 512)  # prefill max_query_len: one per BLOCK_M the launcher picks
AOT_SEQ_LEN = 4096  # context length of every decode/prefill case; 64 and 3 splits of it stay 64 and 3
TENSOR_CORE_OPS = ("HMMA", "HGMMA")


@dataclass(frozen=True)
class AotCase:
    """One call of a kernels.triton_ops entry point as the engine makes it. The launcher runs on CPU
    tensors that only supply dtypes, shapes and strides; its kernel launches are captured, not run."""

    op: str  # "store_kv", "decode" or "prefill"
    dtype: str  # the model dtype: queries, keys, values and both caches
    head_dim: int
    group: int = 1  # query heads per KV head
    block_size: int = 16
    num_kv_heads: int = 2
    num_splits: int = 1  # decode: 1 launches without split-K
    max_query_len: int = 1  # prefill

    def label(self) -> str:
        extra = {
            "store_kv": f"kvh{self.num_kv_heads}",
            "decode": f"splits{self.num_splits}",
            "prefill": f"q{self.max_query_len}",
        }[self.op]
        return f"{self.op} {self.dtype} d{self.head_dim} g{self.group} bs{self.block_size} {extra}"


def group_block_pairs() -> list[tuple[int, int]]:
    """Every (GQA group, block size) pair, neighbours differing in block size: any run of ten covers all."""
    return [
        (AOT_GROUPS[i % len(AOT_GROUPS)], AOT_BLOCK_SIZES[i % len(AOT_BLOCK_SIZES)])
        for i in range(len(AOT_GROUPS) * len(AOT_BLOCK_SIZES))
    ]


def aot_cases() -> list[AotCase]:
    """The covering set. Every dtype x head_dim is compiled with every tile-shape choice the launchers
    make (decode with and without split-K, each prefill BLOCK_M, store_kv's BLOCK_H). GQA group and block
    size change only constants in the source (masks, shifts), so decode and prefill each draw them from a
    rotation through all (group, block size) pairs instead of their product; ptxas's register allocation
    still reacts to them, so each dtype meets every pair in both ops."""
    decode_pairs, prefill_pairs = itertools.cycle(group_block_pairs()), itertools.cycle(group_block_pairs())
    cases = []
    for dtype in AOT_DTYPES:
        for head_dim in AOT_HEAD_DIMS:
            for i, kv_heads in enumerate(AOT_KV_HEADS):
                block_size = AOT_BLOCK_SIZES[i % len(AOT_BLOCK_SIZES)]
                cases.append(AotCase("store_kv", dtype, head_dim, 1, block_size, num_kv_heads=kv_heads))
            for splits in AOT_DECODE_SPLITS:
                for num_splits in splits:
                    group, block_size = next(decode_pairs)
                    cases.append(AotCase("decode", dtype, head_dim, group, block_size, num_splits=num_splits))
        for head_dim in AOT_HEAD_DIMS + AOT_PADDED_HEAD_DIMS:
            for query_len in AOT_QUERY_LENS:
                group, block_size = next(prefill_pairs)
                cases.append(AotCase("prefill", dtype, head_dim, group, block_size, max_query_len=query_len))
    return cases


@dataclass
class AotResult:
    """One compiled kernel for one target. spill_bytes is ptxas's spill stores plus spill loads; smem is
    the dynamic shared memory Triton allocates; dot_types are the operand element types of the kernel's
    tt.dot ops; mma the tensor-core opcodes found in its SASS."""

    kernel: str
    arch: int
    dtype: str
    config: str
    num_warps: int
    num_stages: int
    cases: list[str] = field(default_factory=list)
    regs: int = 0
    spill_bytes: int = 0
    smem: int = 0
    dot_types: list[str] = field(default_factory=list)
    mma: list[str] = field(default_factory=list)
    seconds: float = 0.0
    cached: bool = False
    error: str = ""

    @property
    def mma_expected(self) -> bool:
        """16-bit dots must run on tensor cores; fp32 dots are input_precision="ieee", which rules them out."""
        return any(t in ("f16", "bf16") for t in self.dot_types)

    def problems(self) -> list[str]:
        if self.error:
            return [f"compile failed: {self.error}"]
        found = []
        if self.spill_bytes:
            found.append(f"{self.spill_bytes} bytes of register spills")
        if self.smem > AOT_SMEM_LIMIT[self.arch]:
            found.append(f"{self.smem} bytes of shared memory > {AOT_SMEM_LIMIT[self.arch]}")
        if self.mma_expected and not self.mma:
            found.append(f"tl.dot on {'/'.join(self.dot_types)} without tensor-core MMA in the SASS")
        return found


@dataclass
class AotLaunch:
    """A captured launch resolved for one target: what identifies its compile, without compiling."""

    case: AotCase
    arch: int
    kernel: str
    key: str
    config: str
    num_warps: int
    num_stages: int


@dataclass
class AotReport:
    results: list[AotResult]
    unlaunched: list[str]  # kernels in kernels/triton_kernels.py that no case launches
    seconds: float

    def problems(self) -> list[str]:
        found = [f"{name}: no AOT case launches this kernel" for name in self.unlaunched]
        for r in self.results:
            found += [f"{r.kernel} sm_{r.arch} {r.dtype} {r.config}: {p}" for p in r.problems()]
        return found


# --- worker side: runs in processes started without TRITON_INTERPRET, so triton.jit builds JITFunctions.


def _triton_ops() -> ModuleType:
    import triton

    assert not triton.knobs.runtime.interpret, "AOT compiles need TRITON_INTERPRET unset when kernels are imported"
    from conveyor.kernels import triton_ops

    return triton_ops


def _jit_functions() -> dict[str, Any]:
    """The JIT functions the launchers of _triton_ops() (call it first) can launch or inline."""
    from triton.runtime.jit import JITFunction

    from conveyor.kernels import triton_kernels

    return {name: obj for name, obj in vars(triton_kernels).items() if isinstance(obj, JITFunction)}


def _device_functions(functions: dict[str, Any]) -> set[str]:
    """JIT functions called from another one's body: inlined there, never launched on their own."""
    return {
        name
        for name in functions
        if any(other != name and re.search(rf"\b{name}\(", fn.src) for other, fn in functions.items())
    }


@contextlib.contextmanager
def _captured_launches(kernels: list[Any]) -> Iterator[list[tuple[Any, tuple, dict]]]:
    """While open, `kernel[grid](...)` records (kernel, args, kwargs) instead of compiling and launching."""
    launches: list[tuple[Any, tuple, dict]] = []

    def recorder(kernel: Any) -> Callable[..., None]:
        def run(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            launches.append((kernel, args, kwargs))

        return run

    for kernel in kernels:
        kernel.run = recorder(kernel)
    try:
        yield launches
    finally:
        for kernel in kernels:
            del kernel.run


def _call_launcher(ops: ModuleType, case: AotCase) -> None:
    """Calls the engine-facing function of `case.op` with tensors shaped as the engine passes them."""
    dtype = getattr(torch, case.dtype)
    heads = case.num_kv_heads * case.group
    k_cache = torch.zeros(4, case.block_size, case.num_kv_heads, case.head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    if case.op == "store_kv":
        key = torch.zeros(2, case.num_kv_heads, case.head_dim, dtype=dtype)
        ops.store_kv_cache(key, torch.zeros_like(key), k_cache, v_cache, torch.zeros(2, dtype=torch.int64))
        return
    # The engine's block-table view is as wide as its longest sequence: here not a multiple of 16.
    block_tables = torch.zeros(2, AOT_SEQ_LEN // case.block_size + 1, dtype=torch.int32)
    seq_lens = torch.full((2,), AOT_SEQ_LEN, dtype=torch.int32)
    if case.op == "decode":
        q = torch.zeros(2, heads, case.head_dim, dtype=dtype)
        ops.paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, 0.125, max_seq_len=AOT_SEQ_LEN, num_splits=case.num_splits
        )
    elif case.op == "prefill":
        n = case.max_query_len
        q = torch.zeros(2 * n, heads, case.head_dim, dtype=dtype)
        query_start_loc = torch.tensor([0, n, 2 * n], dtype=torch.int32)
        ops.paged_prefill_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, n, 0.125, max_seq_len=AOT_SEQ_LEN
        )
    else:
        raise ValueError(f"unknown AOT op {case.op!r}")


def _case_launches(ops: ModuleType, case: AotCase) -> list[tuple[Any, tuple, dict]]:
    with _captured_launches(list(_jit_functions().values())) as launches:
        _call_launcher(ops, case)
    return launches


def _specialize(kernel: Any, args: tuple, kwargs: dict, arch: int) -> tuple[Any, dict, dict, dict, Any]:
    """(target, signature, constexprs, attrs, options) exactly as JITFunction.run derives them for a launch."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return target, signature, constexprs, attrs, options


def _constexpr_names(kernel: Any, constexprs: dict) -> dict[str, str]:
    return {kernel.arg_names[path[0]]: str(value) for path, value in sorted(constexprs.items())}


def _launch_key(kernel: Any, arch: int, signature: dict, constexprs: dict, attrs: dict, options: Any) -> str:
    """Kernel source hash (its JIT dependencies included), full specialization, options and target."""
    import triton

    payload = [
        AOT_SCHEMA,
        triton.__version__,
        arch,
        kernel.cache_key,
        sorted(signature.items()),
        sorted(_constexpr_names(kernel, constexprs).items()),
        sorted((str(k), str(v)) for k, v in attrs.items()),
        sorted((k, str(v)) for k, v in vars(options).items()),
    ]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


CONFIG_ABBREV = {"GROUP": "G", "HEAD_DIM": "D", "BLOCK_SIZE": "bs", "NUM_KV_HEADS": "kvh", "DOT_DTYPE": "dot"}


def _config_text(kernel: Any, constexprs: dict) -> str:
    return " ".join(
        f"{CONFIG_ABBREV.get(name, name.replace('BLOCK_', 'B'))}={value}"
        for name, value in _constexpr_names(kernel, constexprs).items()
    )


def resolve_launches(cases: list[AotCase], archs: tuple[int, ...]) -> tuple[list[AotLaunch], list[str]]:
    """Worker: every case's launches for every target, and the launchable kernels no case launched."""
    ops = _triton_ops()
    functions = _jit_functions()
    launched, resolved = set(), []
    for case in cases:
        for kernel, args, kwargs in _case_launches(ops, case):
            launched.add(kernel.fn.__name__)
            for arch in archs:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # Triton's notice about its fp-fusion default
                    _, signature, constexprs, attrs, options = _specialize(kernel, args, kwargs, arch)
                resolved.append(
                    AotLaunch(
                        case,
                        arch,
                        kernel.fn.__name__,
                        _launch_key(kernel, arch, signature, constexprs, attrs, options),
                        _config_text(kernel, constexprs),
                        options.num_warps,
                        options.num_stages,
                    )
                )
    unlaunched = sorted(set(functions) - _device_functions(functions) - launched)
    return resolved, unlaunched


@contextlib.contextmanager
def _environ(**values: str | None) -> Iterator[None]:
    """Sets (str) or removes (None) environment variables while open; Triton's knobs read them live."""
    saved = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _ptxas_usage(log: str) -> tuple[int, int]:
    """(registers per thread, spill store + spill load bytes) from `ptxas -v`."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise RuntimeError(f"no ptxas -v usage in the compile log: {log[-500:]!r}")
    return int(regs.group(1)), int(spills.group(1)) + int(spills.group(2))


SASS_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", re.MULTILINE)


def _tensor_core_ops(cubin: bytes, workdir: str) -> list[str]:
    """Tensor-core opcodes (HMMA, HGMMA) in the cubin's SASS, from the cuobjdump Triton ships."""
    from triton import knobs

    path = Path(workdir) / "kernel.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run(
        [knobs.nvidia.cuobjdump.path, "-sass", str(path)], check=True, capture_output=True, text=True
    ).stdout
    return sorted(set(SASS_OPCODE.findall(sass)) & set(TENSOR_CORE_OPS))


def _dot_operand_types(ttir: str) -> list[str]:
    return sorted(set(re.findall(r"tt\.dot [^:\n]*:\s*tensor<(?:\d+x)+(\w+)>", ttir)))


def compile_launch(launch: AotLaunch) -> AotResult:
    """Worker: compiles one resolved launch for its target and measures it."""
    import triton
    from triton.compiler import ASTSource

    ops = _triton_ops()
    case = launch.case
    result = AotResult(
        launch.kernel, launch.arch, case.dtype, launch.config, launch.num_warps, launch.num_stages, [case.label()]
    )
    try:
        kernel, args, kwargs = next(x for x in _case_launches(ops, case) if x[0].fn.__name__ == launch.kernel)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Triton's notice about its fp-fusion default
            target, signature, constexprs, attrs, options = _specialize(kernel, args, kwargs, launch.arch)
        if _launch_key(kernel, launch.arch, signature, constexprs, attrs, options) != launch.key:
            raise RuntimeError("the launch resolved differently than when it was planned")
        with (
            tempfile.TemporaryDirectory() as workdir,
            _environ(TRITON_CACHE_DIR=workdir, TRITON_ALWAYS_COMPILE="1", TRITON_DUMP_PTXAS_LOG="1"),
        ):
            log = io.StringIO()
            start = time.perf_counter()
            with contextlib.redirect_stdout(log):
                compiled = triton.compile(
                    ASTSource(kernel, signature, constexprs, attrs), target=target, options=vars(options)
                )
            result.regs, result.spill_bytes = _ptxas_usage(log.getvalue())
            result.mma = _tensor_core_ops(compiled.asm["cubin"], workdir)
            result.seconds = time.perf_counter() - start
        result.smem = compiled.metadata.shared
        result.dot_types = _dot_operand_types(compiled.asm["ttir"])
    except Exception as e:  # reported per kernel, the run goes on
        result.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return result


# --- parent side


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
    with _environ(TRITON_INTERPRET=None), ProcessPoolExecutor(max(1, jobs), mp_context=ctx) as pool:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="+", default=["demo:small", "demo:smollm2"])
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument(
        "--aot",
        action="store_true",
        help="no GPU needed: compile every Triton kernel for sm_80 and sm_90 and check the binaries",
    )
    ap.add_argument("--jobs", type=int, default=2, help="--aot: compile processes")
    ap.add_argument("--only", help="--aot: only cases whose label contains this, e.g. 'prefill float32'")
    ap.add_argument("--cache-dir", type=Path, default=AOT_CACHE_DIR, help="--aot: result cache")
    ap.add_argument("--no-cache", action="store_true", help="--aot: compile everything, read and write no cache")
    args = ap.parse_args()
    if args.aot:
        return aot_main(args)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here")
        return 1
    ok = True
    if not args.skip_kernels:
        ok &= subprocess.run([sys.executable, "-m", "benchmarks.triton_kernels", "--quick"]).returncode == 0
    from benchmarks.throughput import workload
    from conveyor.engine import LLM

    for model in args.models:
        try:
            probe = LLM(model, device="cpu", dtype="float32")
        except (ValueError, OSError, RuntimeError) as e:
            print(f"{model}: not available offline here ({e}); skipped")
            continue
        prompts, _ = workload(8, 1, probe.engine.vocab_size)
        del probe
        cpu = greedy(model, "cpu", "float32", prompts, 24)
        gpu = greedy(model, "cuda", "float32", prompts, 24)
        same = sum(a == b for a, b in zip(cpu, gpu))
        print(f"{model}: float32 greedy tokens CUDA == CPU for {same}/{len(cpu)} requests", flush=True)
        ok &= same == len(cpu)
        print(f"{model}: bfloat16 seed workload {tok_per_s(model, 'bfloat16', 64):.0f} tok/s on CUDA", flush=True)
    print("GPU check", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
