"""Which Ray node this process runs on: what replicas report with their stats and the admission actor and routers
name in /v1/cluster, so an operator sees where each piece of the app runs."""

import ray


def node_of_this_process() -> dict[str, str]:
    """{"node_id", "node_ip"} of the Ray node this process runs on; empty values outside Ray."""
    if not ray.is_initialized():
        return {"node_id": "", "node_ip": ""}
    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}
