"""The `disaggregation` app argument: validated up front, each refusal naming the field."""

import pytest
from pydantic import ValidationError

from conveyor.deployments.app import AppArgs, build_app
from conveyor.deployments.disaggregation import DECODE_ADMISSION, can_hand_off
from conveyor.deployments.protocol import GenerateRequest, LoRAModule
from conveyor.engine import SamplingParams


@pytest.mark.parametrize(
    "disaggregation, extra, field",
    [
        ({"prefill_replicas": 0}, {}, "prefill_replicas"),
        ({"transfer": "carrier-pigeon"}, {}, "transfer"),
        ({"decode_engine": {"no_such_option": 1}}, {}, "disaggregation.decode_engine.no_such_option"),
        ({"decode_engine": {"block_size": 0}}, {}, "disaggregation.decode_engine.block_size"),
        ({"decode_engine": {"tensor_parallel_size": 0}}, {}, "disaggregation.decode_engine.tensor_parallel_size"),
        ({"decode_engine": {"block_size": 32}}, {}, "disaggregation.decode_engine.block_size: must equal"),
        ({"decode_engine": {"attention_backend": "torch"}}, {}, "disaggregation.decode_engine.attention_backend"),
        ({"whatever": 1}, {}, "whatever"),
        ({}, {"kv_autoscaling": {"min_replicas": 1, "max_replicas": 2}}, "decode_autoscaling"),
        (
            {"prefill_autoscaling": {"policy": {"target_kv_utilization": 0.5}}},
            {},
            "disaggregation.prefill_autoscaling.policy.target_kv_utilization",
        ),
        (
            {"prefill_autoscaling": {"policy": {"target_waiting_tokens": 0}}},
            {},
            "disaggregation.prefill_autoscaling.policy.target_waiting_tokens",
        ),
        (
            {"decode_autoscaling": {"policy": {"tolerance": 2}}},
            {},
            "disaggregation.decode_autoscaling.policy.tolerance",
        ),
        (
            {"decode_autoscaling": {"min_replicas": 3, "max_replicas": 2}},
            {},
            "disaggregation.decode_autoscaling.max_replicas",
        ),
        ({"decode_autoscaling": {"min_replicas": 0}}, {}, "min_replicas"),
    ],
)
def test_bad_disaggregation_is_refused_naming_the_field(disaggregation: dict, extra: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        AppArgs.model_validate({"disaggregation": disaggregation, **extra})


def test_good_disaggregation() -> None:
    args = AppArgs.model_validate(
        {"disaggregation": {"prefill_replicas": 2, "decode_replicas": 3, "decode_engine": {"max_num_seqs": 64}}}
    )
    assert args.disaggregation.decode_replicas == 3 and args.disaggregation.transfer == "object_store"
    scaled = AppArgs.model_validate(
        {
            "disaggregation": {
                "prefill_autoscaling": {"max_replicas": 3, "policy": {"target_waiting_tokens": 512}},
                "decode_autoscaling": {"max_replicas": 4, "policy": {"target_kv_utilization": 0.6}},
            }
        }
    ).disaggregation
    assert scaled.prefill_autoscaling.policy == {"target_waiting_tokens": 512}
    assert scaled.decode_autoscaling.max_replicas == 4


def test_only_single_sequence_requests_are_handed_off() -> None:
    """LoRA requests too: the handoff carries the adapter (tests/engine/test_kv_handoff_lora.py)."""
    assert can_hand_off(GenerateRequest(prompts=[[1, 2]]))
    assert can_hand_off(GenerateRequest(prompts=[[1]], lora=LoRAModule(name="a", path="/adapters/a")))
    assert not can_hand_off(GenerateRequest(prompts=[[1, 2]], n=2))
    assert not can_hand_off(GenerateRequest(prompts=[[1], [2]]))
    assert not can_hand_off(GenerateRequest(prompts=[[1]], sampling=SamplingParams(structured={"json": {}})))


def test_each_role_hosts_its_own_admission_actor() -> None:
    """The decode replicas push their stats like the prefill ones, to an admission actor of their deployment, placed
    like the prefill one and ranking as the decode routing does; with admission off, neither role has one."""
    app = build_app(AppArgs(disaggregation={}, admission_resources={"head": 0.01}))
    prefill = app._bound_deployment.init_args[0]._bound_deployment
    decode = app._bound_deployment.init_kwargs["decode"]._bound_deployment
    assert (prefill.name, decode.name) == ("LLMPrefill", "LLMDecode")
    assert decode.init_kwargs["stats_push_s"] == prefill.init_kwargs["stats_push_s"] > 0
    (p_actor,) = prefill._deployment_config.deployment_actors
    (d_actor,) = decode._deployment_config.deployment_actors
    assert p_actor.name == d_actor.name and d_actor.actor_options == p_actor.actor_options
    assert d_actor.actor_options["resources"] == {"head": 0.01}
    assert d_actor.init_kwargs["config"] == {**p_actor.init_kwargs["config"], **DECODE_ADMISSION}
    assert (
        p_actor.init_kwargs["config"]["affinity_weight"] == 1.0 and d_actor.init_kwargs["config"]["placement"] is False
    )
    off = build_app(AppArgs(disaggregation={}, admission={"enabled": False}))
    for role in (off._bound_deployment.init_args[0], off._bound_deployment.init_kwargs["decode"]):
        assert not role._bound_deployment._deployment_config.deployment_actors
        assert role._bound_deployment.init_kwargs["stats_push_s"] == 0.0


def test_each_role_reserves_its_own_tensor_parallel_workers() -> None:
    """A TP=2 prefill role and a TP=1 decode role: each replica's placement group holds its own engine's ranks."""
    args = AppArgs(engine={"tensor_parallel_size": 2}, disaggregation={"decode_engine": {"tensor_parallel_size": 1}})
    app = build_app(args)
    prefill = app._bound_deployment.init_args[0]._bound_deployment
    decode = app._bound_deployment.init_kwargs["decode"]._bound_deployment
    assert len(prefill._replica_config.placement_group_bundles) == 1 + 2  # the replica, then one bundle per rank
    assert len(decode._replica_config.placement_group_bundles) == 1
    assert decode.init_kwargs["engine_args"]["tensor_parallel_size"] == 1
