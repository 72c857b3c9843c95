"""A request's KV blocks across tensor-parallel ranks. Rank r holds KV heads [(r // replicas) h, + h) of every
block (h = heads per rank; `replicas` ranks share each head when tp > num_key_value_heads). A KVHandoff carries
one tensor of all heads, [2, layers, blocks, block_size, kv_heads, head_dim]: `gather` builds it from the ranks'
shares and `write_share` takes a rank's heads back out of it, so the prefill and the decode engine may run at any
tensor-parallel sizes.

Within a block, the memory is the attention backend's: [block_size, heads, head_dim] for torch and Triton, and
head-major for the C++ CPU backend (kernels/csrc/paged_attention.h: K [heads, head_dim, block_size], V [heads,
block_size, head_dim]). `kv_layout` names it; both ends of a handoff must share it."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from conveyor.engine.model.parallel import tp_rank
from conveyor.engine.step import NewRequestData

if TYPE_CHECKING:
    from conveyor.engine.execution.model_runner import ModelRunner

HEAD_MAJOR, TOKEN_MAJOR = "head_major", "token_major"


@dataclass(frozen=True)
class KVGeometry:
    """An engine's KV blocks as a handoff carries them: [2, layers, blocks, block_size, kv_heads, head_dim] of
    dtype, laid out within a block as `layout`."""

    layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str
    layout: str

    def shape(self, num_blocks: int) -> list[int]:
        return [2, self.layers, num_blocks, self.block_size, self.kv_heads, self.head_dim]


def kv_geometry(runner: "ModelRunner") -> KVGeometry:
    two, layers, _, bs, _, d = runner.kv_cache.shape
    layout = HEAD_MAJOR if runner.config.attention_backend == "cpu" else TOKEN_MAJOR
    dtype = str(runner.kv_cache.dtype).removeprefix("torch.")
    return KVGeometry(layers, bs, _total_heads(runner), d, dtype, layout)


def _by_head(t: torch.Tensor, layout: str) -> tuple[torch.Tensor, int]:
    """A view of blocks [2, layers, n, block_size, heads, head_dim] with the heads along one dim, and that dim."""
    if layout == HEAD_MAJOR:
        two, layers, n, bs, heads, d = t.shape
        return t.reshape(two, layers, n, heads, bs * d), 3
    return t, 4


def _total_heads(runner: "ModelRunner") -> int:
    hf = runner.config.hf_config
    return getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads


def _first_head(runner: "ModelRunner") -> int:
    replicas = max(1, runner.config.tensor_parallel_size // _total_heads(runner))
    return (tp_rank() // replicas) * runner.num_kv_heads


def read_share(runner: "ModelRunner", block_ids: list[int]) -> tuple[int, torch.Tensor]:
    """This rank's first KV head and its heads of the blocks, on the CPU."""
    return _first_head(runner), runner.kv_cache[:, :, block_ids].cpu()


def gather(shares: list[tuple[int, torch.Tensor]], layout: str) -> torch.Tensor:
    """All heads of the blocks from the ranks' shares (each head once, in order)."""
    firsts, parts = {}, []
    for first, t in shares:
        if first not in firsts:
            firsts[first] = t
    for first in sorted(firsts):
        parts.append(_by_head(firsts[first], layout)[0])
    t0 = shares[0][1]
    dim = _by_head(t0, layout)[1]
    whole = torch.cat(parts, dim=dim)
    heads = sum(t.shape[4] for t in firsts.values())
    return whole.reshape(*t0.shape[:4], heads, t0.shape[5])


def write_share(runner: "ModelRunner", block_ids: list[int], kv: torch.Tensor, layout: str) -> None:
    """Writes this rank's heads of `kv` (all heads) into the blocks."""
    first, h = _first_head(runner), runner.num_kv_heads
    view, dim = _by_head(kv, layout)
    mine = view.narrow(dim, first, h).reshape(*kv.shape[:4], h, kv.shape[5])
    ids = torch.tensor(block_ids, device=runner.device)
    runner.kv_cache[:, :, ids] = mine.to(runner.device)


def generator_state(runner: "ModelRunner", request_id: str) -> torch.Tensor | None:
    state = runner.requests.get(request_id)
    return state.generator.get_state() if state is not None and state.generator is not None else None


def adopt(
    runner: "ModelRunner",
    request: NewRequestData,
    block_ids: list[int],
    output_token_ids: list[int],
    generator: torch.Tensor | None,
    kv: torch.Tensor,
    layout: str,
) -> None:
    """A handed-off request joins this rank: its heads of the KV written, its state adopted."""
    write_share(runner, block_ids, kv, layout)
    runner.adopt_request(request, block_ids, output_token_ids, generator)
