"""The worker side of `python -m benchmarks.gpu_check --aot`: runs in processes started without
TRITON_INTERPRET, so triton.jit builds JITFunctions. The launchers run on CPU tensors with their kernel
launches captured, each launch is specialised for a target as JITFunction.run would, then compiled and
measured (ptxas registers and spills, shared memory, tl.dot operand types, tensor-core opcodes in the SASS)."""

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from benchmarks.aot_cases import AOT_SCHEMA, AOT_SEQ_LEN, TENSOR_CORE_OPS, AotCase, AotLaunch, AotResult


def _triton_ops() -> ModuleType:
    import triton

    assert not triton.knobs.runtime.interpret, "AOT compiles need TRITON_INTERPRET unset when kernels are imported"
    from conveyor.kernels import triton_ops

    return triton_ops


def _jit_functions() -> dict[str, Any]:
    """The JIT functions the launchers of _triton_ops() (call it first) can launch or inline."""
    from triton.runtime.jit import JITFunction

    from conveyor.kernels import triton_kernels, triton_lora_kernels

    modules = (triton_kernels, triton_lora_kernels)
    return {name: obj for m in modules for name, obj in vars(m).items() if isinstance(obj, JITFunction)}


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
    if case.op == "lora":
        _call_lora_launchers(ops, case, dtype)
        return
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


def _call_lora_launchers(ops: ModuleType, case: AotCase, dtype: torch.dtype) -> None:
    """The q/k/v projection of 16 heads (4 KV heads) of head_dim: 4 slots, two segments of max_query_len rows."""
    hidden, kv = 16 * case.head_dim, 4 * case.head_dim
    n, slots = case.max_query_len, 4
    x = torch.zeros(3 * n, hidden, dtype=dtype)
    a = torch.zeros(slots, 3 * case.rank, hidden, dtype=dtype)
    b = torch.zeros(slots, 3 * case.rank, hidden + 2 * kv, dtype=dtype)
    y = torch.zeros(3 * n, hidden + 2 * kv, dtype=dtype)
    rows = torch.arange(2 * n, dtype=torch.int32)
    starts = torch.tensor([0, n, 2 * n], dtype=torch.int32)
    seg_slots = torch.tensor([0, 2], dtype=torch.int64)
    bounds = torch.tensor([0, hidden, hidden + kv, hidden + 2 * kv], dtype=torch.int32)
    t = ops.lora_shrink(x, a, rows, starts, seg_slots, n, case.rank)
    ops.lora_expand(t, b, y, rows, starts, seg_slots, n, bounds, hidden)


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
def environ(**values: str | None) -> Iterator[None]:
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
            environ(TRITON_CACHE_DIR=workdir, TRITON_ALWAYS_COMPILE="1", TRITON_DUMP_PTXAS_LOG="1"),
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
