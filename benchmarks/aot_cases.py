"""What `python -m benchmarks.gpu_check --aot` compiles and reports: the covering set of kernel launches
(every dtype x head_dim with every tile shape the launchers pick, GQA group and block size in rotation), the
targets and their limits, and the result of one compile."""

import itertools
from dataclasses import dataclass, field
from pathlib import Path

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
AOT_LORA_HEAD_DIMS = (64, 128)  # LoRA: the q/k/v projection of a model with 16 heads (4 KV heads) of this size
AOT_LORA_RANKS = (16, 64)  # max_lora_rank
AOT_LORA_SEGMENTS = (8, 32, 512)  # LoRA: the longest run of rows on one adapter, one per BLOCK_M the launcher picks
TENSOR_CORE_OPS = ("HMMA", "HGMMA")


@dataclass(frozen=True)
class AotCase:
    """One call of a kernels.triton_ops entry point as the engine makes it. The launcher runs on CPU
    tensors that only supply dtypes, shapes and strides; its kernel launches are captured, not run."""

    op: str  # "store_kv", "decode", "prefill" or "lora" (shrink and expand of one q/k/v projection)
    dtype: str  # the model dtype: queries, keys, values and both caches
    head_dim: int
    group: int = 1  # query heads per KV head
    block_size: int = 16
    num_kv_heads: int = 2
    num_splits: int = 1  # decode: 1 launches without split-K
    max_query_len: int = 1  # prefill; lora: the longest segment (rows on one adapter)
    rank: int = 0  # lora: max_lora_rank

    def label(self) -> str:
        extra = {
            "store_kv": f"kvh{self.num_kv_heads}",
            "decode": f"splits{self.num_splits}",
            "prefill": f"q{self.max_query_len}",
            "lora": f"r{self.rank} m{self.max_query_len}",
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
        for head_dim in AOT_LORA_HEAD_DIMS:
            for rank in AOT_LORA_RANKS:
                for segment in AOT_LORA_SEGMENTS:
                    cases.append(AotCase("lora", dtype, head_dim, 4, max_query_len=segment, rank=rank))
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
    unlaunched: list[str]  # kernels in kernels/triton_kernels.py and triton_lora_kernels.py that no case launches
    seconds: float

    def problems(self) -> list[str]:
        found = [f"{name}: no AOT case launches this kernel" for name in self.unlaunched]
        for r in self.results:
            found += [f"{r.kernel} sm_{r.arch} {r.dtype} {r.config}: {p}" for p in r.problems()]
        return found
