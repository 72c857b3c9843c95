"""The serving-path app arguments: engine core process, stream_interval, user code thread; the router's light
imports."""

import subprocess
import sys

import pytest

from conveyor.deployments.app import AppArgs, build_app


@pytest.mark.parametrize(
    "args, field",
    [
        ({"topology": "single"}, "topology"),
        ({"handle_transport": "grpc"}, "handle_transport"),
        ({"token_channel": False}, "token_channel"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"stream_interval_s": 0.01}, "stream_interval_s"),
    ],
)
def test_bad_serving_args_name_the_field(args: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        AppArgs(**args)


def test_the_app_is_a_router_bound_to_a_replica() -> None:
    default = build_app(AppArgs())
    replica = default._bound_deployment.init_args[0]
    assert default._bound_deployment.name == "Router" and replica._bound_deployment.name == "LLMReplica"
    assert replica._bound_deployment.init_kwargs["engine_core_process"] is True
    assert replica._bound_deployment.init_kwargs["stream_interval"] == 4
    assert replica._bound_deployment.init_kwargs["heartbeat_s"] == 0.0  # pushes every stats_push_s, idle or not
    quiet = (
        build_app(AppArgs(admission={"enabled": False}))._bound_deployment.init_args[0]._bound_deployment.init_kwargs
    )
    assert quiet["stats_push_s"] == quiet["heartbeat_s"] == 0.0
    quiet_idle = build_app(AppArgs(admission={"quiet_when_idle": True}))._bound_deployment.init_args[0]
    assert quiet_idle._bound_deployment.init_kwargs["heartbeat_s"] == 0.5 / 4  # idle: a quarter of staleness_s
    on_loop = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000"}
    assert default._bound_deployment.ray_actor_options["runtime_env"]["env_vars"] == on_loop
    assert replica._bound_deployment.ray_actor_options["runtime_env"]["env_vars"] == {"OMP_NUM_THREADS": "1", **on_loop}
    inproc = build_app(AppArgs(engine_core_process=False, stream_interval=2))
    kwargs = inproc._bound_deployment.init_args[0]._bound_deployment.init_kwargs
    assert kwargs["engine_core_process"] is False and kwargs["stream_interval"] == 2


def test_the_http_router_imports_no_torch() -> None:
    """The light edge: the router (and the request types, limits and tokenizer it uses) loads without torch."""
    code = (
        "import sys, conveyor.deployments.router; import conveyor.deployments.preprocessor as r; from conveyor.engine.checkpoints.model_source import resolve_model; "
        "t = r.PreTrainedTokenizerFast.from_pretrained(resolve_model('demo:tiny')); t('hi'); "
        "r.RequestLimits(8192, 64, 16, 4).check(t('hi').input_ids, r.SamplingParams(max_tokens=4)); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' "
        "or m.startswith(('conveyor.kernels', 'conveyor.engine.model', 'conveyor.engine.execution'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
