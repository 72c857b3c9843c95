"""Imported at start-up by every process of the vLLM peer when ATEN_CPU_CAPABILITY holds torch to AVX2
(benchmarks/throughput.py puts this folder on the peer's PYTHONPATH then). vLLM picks its C++ kernel library
(vllm._C_AVX2 or the AVX-512 ones) and its attention ISA from torch.cpu's flags, which report the hardware
whatever ATEN_CPU_CAPABILITY says; here they report what an AVX2-only CPU would, so that vLLM runs as it would
on one, as Conveyor does under CONVEYOR_CPU_ISA=avx2."""

import os

if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2":
    import torch.cpu

    for name in dir(torch.cpu):
        if name.startswith(("_is_avx512", "_is_amx")):
            setattr(torch.cpu, name, lambda: False)
