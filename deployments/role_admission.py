"""Admission per role in a disaggregated app (deployments/disaggregation.py). Each role's replicas push their stats to
an admission actor of their own (the prefill and the decode deployment each host one, with the same machinery as a
colocated app's), and the router keeps an AdmissionClient per role.

A request that can be handed off needs room on both roles: on a decode replica its whole predicted KV (the handed-off
prompt and first token, plus its likely output), on a prefill replica the prompt and first token within the
queue-time bound. Decode is decided first (waiting for room as any admission does, holding nothing), then prefill
(which reserves), then decode again on the same view without waiting, which reserves on the decode replica the
request will be routed to; should that refuse (the room went while prefill was decided), the prefill reservation is
withdrawn before anything else runs. Either refusal leaves nothing held on the other role. A decode reservation goes
as a colocated one does, when the decode replica's stats count the request (or after settle_max_s); one whose request
finished or failed on its prefill replica, and so never gets there, is withdrawn (AdmissionClient.release). A handoff
retried after its decode replica refused or lost it reserves again, on a replica not tried yet (`redecide`); where
admission sees no room, the retry goes without a reservation and the decode replica's own import check decides.
"""

from dataclasses import dataclass, replace
from typing import Sequence

from conveyor.cluster.admission_actor import AdmissionClient
from conveyor.cluster.admission_controller import Decision
from conveyor.cluster.routing import RoutingHint
from conveyor.cluster.stats import num_blocks


@dataclass(frozen=True)
class Ask:
    """What one role's admission decides on (AdmissionClient.decide's arguments)."""

    blocks: int
    largest_blocks: int | None = None
    keys: Sequence[bytes] = ()
    num_seqs: int = 1
    output_tokens: int = 0
    lora: str | None = None

    def args(self) -> tuple:
        return self.blocks, self.largest_blocks, self.keys, self.num_seqs, self.output_tokens, self.lora


def handoff_ask(prompt_tokens: int, block_size: int, max_tokens: int, lora: str | None) -> Ask:
    """The decode role's ask for a request to be handed off: the prompt and first token it receives, and its likely
    output."""
    return Ask(num_blocks(prompt_tokens + 1, block_size), output_tokens=max_tokens, lora=lora)


@dataclass(frozen=True)
class RoleDecision:
    """The prefill role's decision and the decode role's (None: not asked, the request runs whole on prefill)."""

    prefill: Decision | None
    decode: Decision | None = None

    @property
    def refusal(self) -> Decision | None:
        return next((d for d in (self.decode, self.prefill) if d is not None and not d.admit), None)


async def decide_roles(
    prefill: AdmissionClient, decode: AdmissionClient | None, p: Ask, d: Ask | None, queue_time: bool = True
) -> RoleDecision:
    """Both roles' decisions for a request to be handed off (`d`: its decode ask), on a refusal with nothing
    reserved on either; the prefill role's alone for one that runs whole there (`d` None) or without decode
    admission (`decode` None). `queue_time=False`: the door judged the prefill role's queue time already."""
    if decode is None or d is None:
        return RoleDecision(await prefill.decide(*p.args(), queue_time=queue_time))
    verdict = await decode.decide(*d.args(), hold=False)
    if not verdict.admit:
        return RoleDecision(None, verdict)
    chosen = await prefill.decide(*p.args(), queue_time=queue_time)
    if not chosen.admit or verdict.reason == "fail_open":
        return RoleDecision(chosen, verdict if chosen.admit else None)
    held = decode.decide_now(*d.args())
    if not held.admit:
        prefill.release(chosen)
    return RoleDecision(chosen, held)


def redecide(decode: AdmissionClient | None, d: Ask, tried: Sequence[str]) -> Decision | None:
    """A retried handoff's decode decision, reserving on a replica not in `tried`, or None where admission is off or
    sees no room there."""
    if decode is None:
        return None
    verdict = decode.decide_now(*d.args(), exclude=tried)
    return verdict if verdict.admit else None


def decode_hint(
    decode: AdmissionClient | None,
    d: Decision | None,
    num_prompt_blocks: int,
    exclude: Sequence[str],
    lora: str | None = None,
) -> RoutingHint:
    """The decode routing's hint: admission's ranking (its first replica holds the reservation), its KV demands and
    the request's adapter by name (without admission, replicas holding it rank first)."""
    hint = RoutingHint(num_prompt_blocks=num_prompt_blocks, exclude=tuple(exclude), lora=lora)
    if decode is None or d is None or not d.replicas:
        return hint
    return replace(hint, replicas=tuple(d.replicas), kv_demand=decode.controller.kv_demands(decode.clock()))
