"""The engine core process's CPU priority against its front end (HTTP, routing, detokenising) on the same node.

"high": an ordinary process at niceness 0 (if allowed; else the niceness it inherited), above Ray's workers
(niceness 15, RAY_worker_niceness): the threads the core wakes with its outputs do not preempt it, and an idle
core picks them up. "low": SCHED_IDLE (Linux; else niceness 19): any waking front-end thread preempts it at once.
"auto": high while the node's engine cores (registered in `registry_dir()`, one file per core process holding
its thread count) leave at least one CPU to everything else, low where they fill every CPU; and low for
SHEDDING_S after a router on the node marked it shedding (`mark_shedding`: its replicas are queueing, and
refusing what comes in first is worth more than the core's share of a starved CPU). The evidence:
docs/decisions/03-core-process-priority.md, 18-door-first-under-a-burst.md."""

import logging
import os
import resource
import tempfile
import time
from pathlib import Path

log = logging.getLogger("conveyor")
REFRESH_S = 2.0
SHEDDING_S = 0.5
SHEDDING = "shedding"  # the mark's file in registry_dir(): its mtime is the last mark


def registry_dir() -> Path:
    """CONVEYOR_CORE_REGISTRY, or one directory per user in /dev/shm (the node's cores see each other)."""
    if os.environ.get("CONVEYOR_CORE_REGISTRY"):
        return Path(os.environ["CONVEYOR_CORE_REGISTRY"])
    root = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    return root / f"conveyor-cores-{os.getuid()}"


def mark_shedding(directory: Path | None = None) -> None:
    """A router on this node is shedding load: its node's `auto` engine cores yield for SHEDDING_S."""
    path = (directory or registry_dir()) / SHEDDING
    try:
        path.touch(mode=0o600)
    except FileNotFoundError:  # no engine core registered on this node yet
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CorePriority:
    """Registers this core process with its thread count; `refresh()` sets the priority of all its threads, and
    re-decides "auto" as cores come and go (call it every REFRESH_S or so); `follow_front()` (every step) lowers
    an "auto" core while the node is marked shedding."""

    def __init__(self, priority: str, threads: int, directory: Path | None = None) -> None:
        self.priority = priority
        self.dir = directory or registry_dir()
        self.file = self.dir / str(os.getpid())
        self.applied: str | None = None
        self.decided = "high"
        self.can_yield = _may_return_from_idle()
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.file.write_text(str(threads))

    def spare_cpus(self) -> int:
        """CPUs left to everything but the node's live engine cores (a dead core's file is removed)."""
        used = 0
        for f in self.dir.iterdir():
            try:
                pid, threads = int(f.name), int(f.read_text() or 0)
            except (ValueError, OSError):
                continue
            if _alive(pid):
                used += threads
            else:
                f.unlink(missing_ok=True)
        return self.cpus - used

    def decide(self) -> str:
        if self.priority != "auto":
            return self.priority
        return "high" if self.spare_cpus() >= 1 else "low"

    def refresh(self) -> str:
        self.decided = self.decide()
        return self.follow_front()

    def shedding(self) -> bool:
        try:
            return time.time() - (self.dir / SHEDDING).stat().st_mtime < SHEDDING_S
        except OSError:
            return False

    def follow_front(self) -> str:
        yielding = self.priority == "auto" and self.decided == "high" and self.can_yield and self.shedding()
        mode = "low" if yielding else self.decided
        if mode != self.applied:
            _apply(mode)
            self.applied = mode
        return mode

    def close(self) -> None:
        self.file.unlink(missing_ok=True)


def _may_return_from_idle() -> bool:
    """Whether this process could leave SCHED_IDLE again (Linux asks for CAP_SYS_NICE, or an RLIMIT_NICE that
    admits its niceness): a core that could not stays where `auto` put it."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    if os.geteuid() == 0:
        return True
    return 20 - os.getpriority(os.PRIO_PROCESS, 0) <= resource.getrlimit(resource.RLIMIT_NICE)[0]


def _apply(mode: str) -> None:
    """To every thread of this process (a policy or niceness set on one thread does not reach the others)."""
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    idle = mode == "low" and hasattr(os, "SCHED_IDLE")
    for tid in tids:
        try:
            if hasattr(os, "sched_setscheduler"):
                os.sched_setscheduler(tid, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))
            if not idle:
                _set_nice(tid, 0 if mode == "high" else 19)
        except ProcessLookupError:
            continue


def _set_nice(tid: int, nice: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except PermissionError:  # lowering niceness needs CAP_SYS_NICE: keep what the process inherited
        log.info("engine core: niceness %d not permitted, keeping %d", nice, os.getpriority(os.PRIO_PROCESS, tid))
