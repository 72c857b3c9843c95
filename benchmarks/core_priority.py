"""The engine core's CPU priority, A/B on one live app: deploys the default app once behind HAProxy (as
benchmarks/serving.py does), then alternates settings applied to the running core process (and, with `x`, to
the router and replica too) between runs of the same streamed load, so no redeploy or VM drift separates them.

Settings: `low` (SCHED_IDLE), `nN` (SCHED_OTHER at niceness N), `pN` (the same, the core pinned to the last
CPU), `pNx` (pinned, and the router and replica pinned to the other CPUs). Prints tok/s, the machine's idle
CPU share, ITL, CPU ms per token by role and the Serve TTFT overhead over the bare app, per run.

    python -m benchmarks.core_priority --settings low n0 n19 p0 --reps 3
"""

import argparse
import asyncio
import os

import psutil

from benchmarks import serving, serving_apps, serving_load


def newest(key: str) -> int:
    procs = [
        p for p in psutil.process_iter(["pid", "cmdline", "create_time"]) if key in " ".join(p.info["cmdline"] or [])
    ]
    return max(procs, key=lambda p: p.info["create_time"]).info["pid"]


def threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def apply(setting: str, core: int, front: list[int]) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    pinned, apart = setting.startswith("p"), setting.endswith("x")
    for tid in threads(core):
        if setting == "low":
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, int(setting.strip("npx")))
        os.sched_setaffinity(tid, {cpus[-1]} if pinned else set(cpus))
    for pid in front:
        for tid in threads(pid):
            os.sched_setaffinity(tid, set(cpus[:-1]) if apart else set(cpus))


def cpu_times() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=["low", "n0"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ttft-reps", type=int, default=30)
    args = p.parse_args()
    opts = serving.build_parser().parse_args(["--haproxy-only"])
    prompts = serving.workload(args.num_prompts, *opts.prompt_len, seed=0)
    ttft_prompts = serving.workload(args.ttft_reps + 2, *opts.prompt_len, seed=1)
    child = serving_apps.start_haproxy_child(opts)
    try:
        serving_apps.haproxy_deploy(child, "/")
        core = newest("conveyor.engine.process.core_process")
        front = [newest("ServeReplica:default:Router"), newest("ServeReplica:default:LLMReplica")]
        base = f"http://127.0.0.1:{opts.port + 1}"
        results: dict[str, list[float]] = {s: [] for s in args.settings}
        for rep in range(args.reps):
            for setting in args.settings:
                apply(setting, core, front)
                t0, roles0 = cpu_times(), serving_load.cpu_by_role()
                elapsed, tokens, _, gaps = asyncio.run(
                    serving_load.http_throughput(
                        f"{base}/", prompts, args.max_tokens, True, opts.model, args.concurrency
                    )
                )
                t1, roles1 = cpu_times(), serving_load.cpu_by_role()
                ttft = asyncio.run(
                    serving_load.http_ttfts(
                        {"app": f"{base}/", "bare Serve app": f"{base}/floor/"}, ttft_prompts, opts.model
                    )
                )
                d = [b - a for a, b in zip(t0, t1)]
                per_token = {k: 1000 * (v - roles0.get(k, 0.0)) / tokens for k, v in roles1.items()}
                results[setting].append(tokens / elapsed)
                idle = 100 * (d[3] + d[4]) / sum(d)
                print(
                    f"rep {rep} {setting:>5}: {tokens / elapsed:7.1f} tok/s  idle CPU {idle:4.1f}%  "
                    f"ITL p50 {serving.ms(gaps):.1f} p99 {serving.ms(gaps, 0.99):.1f} ms  CPU ms/token core "
                    f"{per_token.get('core', 0):.3f} router {per_token.get('router', 0):.3f} replica "
                    f"{per_token.get('replica', 0):.3f} all {sum(per_token.values()):.3f}  TTFT overhead "
                    f"{serving.ms(ttft['app']) - serving.ms(ttft['bare Serve app']):+.2f} ms",
                    flush=True,
                )
        for setting, runs in results.items():
            mean = sum(runs) / len(runs)
            print(f"{setting:>5}: " + " / ".join(f"{r:.1f}" for r in runs) + f" tok/s, mean {mean:.1f}")
    finally:
        child.stdin.close()
        child.wait(timeout=120)


if __name__ == "__main__":
    main()
