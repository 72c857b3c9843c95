"""A hypothesis state machine over scheduler + block manager + prefix cache (no model): arrivals with shared
prefixes, salts and priorities, engine steps, aborts and forced preemptions (recompute and swap) in any
order. After every rule engine/core/invariants.py checks the pool, the tables, the swap slots and a real
PersistentBatch kept as the model runner keeps it; at the end every request finishes and the pool is whole."""

from dataclasses import replace

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conveyor.engine.config import EngineConfig
from conveyor.engine.core.block_manager import BlockManager
from conveyor.engine.core.invariants import check_invariants
from conveyor.engine.core.scheduler import make_scheduler
from conveyor.engine.core.sequence import Sequence, SequenceStatus
from conveyor.engine.execution.persistent_batch import PersistentBatch
from conveyor.engine.resolved_config import resolve
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.step import ModelRunnerOutput, SchedulerOutput

EOS = 2
BASE = resolve(EngineConfig(model="demo:tiny", attention_backend="torch"))
MAX_MODEL_LEN = 512
PREFIXES = [[(13 * j + 7 * g) % 90 + 10 for j in range(48)] for g in range(3)]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(6, 32),
        block_size=st.sampled_from([2, 4, 8]),
        budget=st.integers(1, 64),
        max_seqs=st.integers(1, 6),
        policy=st.sampled_from(["continuous", "continuous", "static"]),
        caching=st.booleans(),
        mode=st.sampled_from(["recompute", "swap"]),
        swap_blocks=st.integers(0, 24),
        threshold=st.sampled_from([0, 0, 3]),
        partials=st.sampled_from([0, 1]),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        budget: int,
        max_seqs: int,
        policy: str,
        caching: bool,
        mode: str,
        swap_blocks: int,
        threshold: int,
        partials: int,
    ) -> None:
        cfg = replace(
            BASE,
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            block_size=block_size,
            scheduling_policy=policy,
            enable_prefix_caching=caching,
            preemption_mode=mode,
            long_prefill_token_threshold=threshold,
            max_num_partial_prefills=partials,
            max_model_len=MAX_MODEL_LEN,
            check_invariants=True,
        )
        self.kv = BlockManager(num_blocks, block_size, caching, swap_blocks if mode == "swap" else 0)
        self.sched = make_scheduler(cfg, self.kv, {EOS})
        self.batch = PersistentBatch(-(-MAX_MODEL_LEN // block_size), 100, rows=2)
        self.sched.runner_batch = self.batch
        self.seqs: list[Sequence] = []
        self.steps = self.forced = 0

    @rule(
        group=st.integers(0, 1),
        shared=st.integers(0, 48),
        tail=st.integers(0, 12),
        max_tokens=st.integers(1, 40),
        priority=st.integers(0, 2),
        salt=st.sampled_from([None, None, None, "tenant-b"]),
    )
    def arrive(self, group: int, shared: int, tail: int, max_tokens: int, priority: int, salt: str | None) -> None:
        prompt = PREFIXES[group][:shared] + [50 + (len(self.seqs) * 7 + j) % 40 for j in range(tail)]
        if not prompt:
            prompt = [11]
        max_tokens = min(max_tokens, self.kv.num_blocks * self.kv.block_size - len(prompt))
        if max_tokens < 1:
            return
        seq = Sequence(
            f"r{len(self.seqs)}",
            prompt,
            SamplingParams(max_tokens=max_tokens, ignore_eos=False),
            priority=priority,
            cache_salt=salt,
            arrival_time=float(len(self.seqs)),
        )
        self.seqs.append(seq)
        self.sched.add(seq)

    @rule(eos_bits=st.one_of(st.just(0), st.integers(0, 2**8 - 1)))
    def step(self, eos_bits: int) -> None:
        so = self.sched.schedule()
        cfg = self.sched.config
        assert so.num_tokens <= cfg.max_num_batched_tokens
        assert len(so.chunks) <= cfg.max_num_seqs
        self.run(so)
        sampled = [c.req_id for c in so.chunks if c.sample]
        tokens = [EOS if eos_bits >> (i % 8) & 1 else 11 + (self.steps + i) % 13 for i in range(len(sampled))]
        self.sched.update(so, ModelRunnerOutput(sampled, tokens, [None] * len(sampled)), float(self.steps))
        self.steps += 1

    def run(self, so: SchedulerOutput) -> None:
        """What the model runner does with a SchedulerOutput's bookkeeping, on the real PersistentBatch."""
        for rid in so.finished_req_ids:
            self.batch.remove(rid)
        for r in so.new_requests:
            self.batch.add(r.req_id, r.params)
        for c in so.chunks:
            seq = self.sched.requests[c.req_id]
            assert c.token_ids == seq.token_ids[c.start : c.start + len(c.token_ids)] and c.token_ids
            if c.new_block_ids or c.reset_blocks:
                self.batch.set_blocks(c.req_id, c.new_block_ids, append=not c.reset_blocks)
            row = self.batch.rows[c.req_id]
            assert self.batch.block_table[row, : self.batch.num_blocks[row]].tolist() == self.kv.block_ids(seq)
            assert self.batch.num_blocks[row] * self.kv.block_size >= c.start + len(c.token_ids)

    def unfinished(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @precondition(lambda self: any(not s.is_finished for s in self.seqs))
    @rule(pick=st.integers(0, 1 << 16))
    def abort(self, pick: int) -> None:
        live = self.unfinished()
        self.sched.finish(live[pick % len(live)], "abort")

    @precondition(lambda self: bool(self.sched.running))
    @rule(pick=st.integers(0, 1 << 16), mode=st.sampled_from(["recompute", "swap"]))
    def preempt(self, pick: int, mode: str) -> None:
        """A preemption between steps, in either mode whatever the config says (swap falls back to recompute
        when the slots run out); the swap-out pairs are lost to the runner, which keeps no KV data here."""
        victim = self.sched.running[pick % len(self.sched.running)]
        cfg, held = self.sched.config, self.sched.pads(victim)
        configured, cfg.preemption_mode = cfg.preemption_mode, mode
        try:
            self.sched._preempt(victim, SchedulerOutput())
        finally:
            cfg.preemption_mode = configured
        assert victim not in self.sched.running
        assert held or victim.status in (SequenceStatus.WAITING, SequenceStatus.SWAPPED)
        self.forced += 1

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "sched"):
            check_invariants(self.sched, self.batch)
            assert self.kv.num_free_blocks + sum(1 for b in self.kv.pool.blocks if b.ref_count) == self.kv.num_blocks

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        for _ in range(4000):
            if not self.sched.has_unfinished:
                break
            self.step(0)
        else:
            raise AssertionError("requests still unfinished after 4000 steps: deadlock")
        for s in self.seqs:
            assert s.is_finished and s.finish_reason in ("stop", "length", "abort")
            assert s.num_output_tokens <= s.params.max_tokens
        assert self.kv.num_free_blocks == self.kv.num_blocks and not self.kv.tables and not self.kv.swapped
        assert sorted(self.kv.free_swap) == list(range(self.kv.num_swap_blocks))
        assert not self.sched.running and not self.sched.waiting and not self.sched.swapped
        event(f"preempted: {'yes' if self.sched.num_preemptions else 'no'}, forced: {'yes' if self.forced else 'no'}")
        event(f"prefix-cache hits: {'yes' if self.kv.hits else 'no'}, swap slots: {self.kv.num_swap_blocks > 0}")


SchedulerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSchedulerMachine = SchedulerMachine.TestCase
