"""`conveyor bench serve`: load any OpenAI-compatible server and report what its clients see.

Arrivals are Poisson at `--request-rate` (inf: all at once), or a closed loop of `--concurrency` clients,
or both (Poisson, at most C in flight); for `--num-requests` requests or `--duration` seconds. Streaming
requests (default) give TTFT (send to first content chunk), ITL (gaps between content chunks: a chunk that
carries several tokens counts once, as in vLLM's benchmark_serving), TPOT ((e2e - TTFT) / (tokens - 1)) and
e2e; output tokens are the server's `usage.completion_tokens`. Goodput counts requests meeting every SLO
(`--slo ttft=0.5,itl=0.05`; keys ttft, itl (the request's mean gap), tpot, e2e; seconds)."""

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from benchmarks.http_client import complete, session
from benchmarks.lengths import Lengths, text_prompts, token_prompts
from benchmarks.percentiles import summary as percentiles

SLO_KEYS = ("ttft", "itl", "tpot", "e2e")


@dataclass
class RequestResult:
    start_s: float
    prompt_len: int
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    chunk_times_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def meets(self, slo: dict[str, float]) -> bool:
        got = {
            "ttft": self.ttft_s,
            "e2e": self.e2e_s,
            "tpot": self.tpot_s,
            "itl": float(np.mean(self.itl_s)) if self.itl_s else 0.0,
        }
        return self.ok and all(got[k] is not None and got[k] <= v for k, v in slo.items())


def parse_slo(spec: str | None) -> dict[str, float]:
    slo: dict[str, float] = {}
    for part in filter(None, (spec or "").split(",")):
        key, _, value = part.partition("=")
        if key not in SLO_KEYS:
            raise ValueError(f"--slo: unknown key {key!r} (known: {', '.join(SLO_KEYS)})")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {part!r}: the value must be seconds") from None
    return slo


class Client:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.chat = args.endpoint == "chat"
        self.url = args.base_url.rstrip("/") + ("/v1/chat/completions" if self.chat else "/v1/completions")
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def body(self, prompt: list[int] | str, max_tokens: int) -> dict[str, Any]:
        a = self.args
        b: dict[str, Any] = {
            "model": a.model,
            "max_tokens": max_tokens,
            "temperature": a.temperature,
            "stream": not a.no_stream,
        }
        if self.chat:
            b["messages"] = [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        if not a.no_ignore_eos:
            b.update(ignore_eos=True, min_tokens=max_tokens)
        if not a.no_stream:
            b["stream_options"] = {"include_usage": True}
        return b

    async def send(self, http: aiohttp.ClientSession, body: dict[str, Any], r: RequestResult, t0: float) -> None:
        c = await complete(http, self.url, body, self.headers)
        r.start_s = c.sent - t0
        r.e2e_s = c.done - c.sent
        r.ttft_s = c.ttft_s
        r.itl_s = c.gaps_s
        r.chunk_times_s = [t - t0 for t in c.chunks] if body["stream"] else [r.start_s + r.e2e_s]
        r.output_tokens = c.tokens
        r.ok = c.ok and r.ttft_s is not None
        r.error = c.error or ("" if r.ok else "no content in the stream")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompt_spec, output_spec = (
        Lengths.parse(args.prompt_len, "--prompt-len"),
        Lengths.parse(args.output_len, "--output-len"),
    )
    if output_spec.kind == "shared-prefix":
        raise ValueError("--output-len: shared-prefix applies to prompts only")
    n = args.num_requests or 100_000
    pool = min(n, 4096)
    prompts = (
        text_prompts(prompt_spec, pool, rng)
        if args.prompt_format == "text" or args.endpoint == "chat"
        else token_prompts(prompt_spec, pool, args.vocab_size, rng)
    )
    outputs = [output_spec.sample(rng) for _ in range(pool)]
    client, results, tasks = Client(args), [], []
    limit = asyncio.Semaphore(args.concurrency) if args.concurrency else None
    bar = tqdm(total=args.num_requests or None, desc="bench serve", unit="req", disable=args.quiet)

    async def one(i: int, t0: float) -> None:
        p = prompts[i % pool]
        r = RequestResult(0.0, len(p) if isinstance(p, list) else len(p.split()))
        results.append(r)
        try:
            await client.send(http, client.body(p, outputs[i % pool]), r, t0)
        finally:
            if limit is not None:
                limit.release()
            bar.update(1)

    async with session(args.concurrency or 1000, args.timeout, connect_s=30) as http:
        t0 = time.perf_counter()
        for i in range(n):
            if args.duration and time.perf_counter() - t0 >= args.duration:
                break
            if limit is not None:
                await limit.acquire()
            tasks.append(asyncio.create_task(one(i, t0)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
            else:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    bar.close()
    return summarize(args, results, elapsed, parse_slo(args.slo))


def summarize(
    args: argparse.Namespace, results: list[RequestResult], elapsed: float, slo: dict[str, float]
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if r.meets(slo)] if slo else ok
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (out_tokens + sum(r.prompt_len for r in ok)) / elapsed,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_len for r in ok),
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]),
        "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "slo": slo,
        "goodput": len(good) / elapsed,
        "good_fraction": len(good) / len(results) if results else 0.0,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
    config.update(request_rate=str(config["request_rate"]), out=str(args.out), plot=str(args.plot))
    return {"config": config, "summary": summary, "requests": [asdict(r) for r in results]}


def print_summary(s: dict[str, Any]) -> None:
    print(f"completed {s['completed']}  failed {s['failed']}  in {s['duration_s']:.2f} s")
    print(
        f"requests/s {s['request_throughput']:.2f}  output tok/s {s['output_throughput']:.1f}  "
        f"total tok/s {s['total_token_throughput']:.1f}"
    )
    print(f"{'':8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}   (ms)")
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        row = s[key]
        print(
            f"{key[:-2].upper():8}"
            + "".join(
                f"{1000 * row[q]:>10.1f}" if row[q] is not None else f"{'-':>10}" for q in ("mean", "p50", "p90", "p99")
            )
        )
    if s["slo"]:
        print(f"goodput {s['goodput']:.2f} req/s ({100 * s['good_fraction']:.0f}% of requests met {s['slo']})")
    for e in s["errors"]:
        print(f"error: {e}")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (the /v1 paths are added)")
    p.add_argument("--model", default="demo:tiny")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=None, help="default 200 unless --duration is given")
    p.add_argument("--duration", type=float, default=None, help="seconds to keep sending")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--concurrency", type=int, default=None, help="at most this many in flight (closed loop)")
    p.add_argument(
        "--prompt-len",
        default="uniform:32,256",
        help="fixed:N | uniform:LO,HI | heavy-tail:LO,HI[,A] | shared-prefix:PREFIX,SUFFIX",
    )
    p.add_argument("--output-len", default="uniform:16,192", help="fixed:N | uniform:LO,HI | heavy-tail:LO,HI[,A]")
    p.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default="ids",
        help="token-id arrays (exact lengths) or words; chat always sends words",
    )
    p.add_argument("--vocab-size", type=int, default=256, help="random token ids are drawn below this")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos / min_tokens")
    p.add_argument("--slo", default=None, help="e.g. ttft=0.5,itl=0.05 (seconds)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-serve.json"))
    p.add_argument("--plot", type=Path, default=Path("bench-serve.png"))
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--disaggregated",
        default=None,
        metavar="P,D",
        help="deploy --model locally as P+D colocated replicas, then as P prefill + D decode replicas, and compare",
    )


def main(args: argparse.Namespace) -> int:
    if args.num_requests is None and args.duration is None:
        args.num_requests = 200
    for name in ("num_requests", "concurrency"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.request_rate <= 0:
        raise ValueError("--request-rate must be > 0")
    parse_slo(args.slo)
    if args.disaggregated:
        from benchmarks.disaggregated import main as compare  # deploys apps: Ray Serve and the engine

        return compare(args)
    result = asyncio.run(run(args))
    print_summary(result["summary"])
    args.out.write_text(json.dumps(result, indent=1))
    from benchmarks.charts import serve_chart

    serve_chart(result, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0 if result["summary"]["completed"] else 1
