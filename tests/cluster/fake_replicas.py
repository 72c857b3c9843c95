"""Ray Serve's side of the KV-aware request router, for the cluster tests: a running replica as the router sees
it, and a router initialised as Serve does."""

from conveyor.cluster.routing import KVAwareRequestRouter


class FakeReplica:
    def __init__(self, rid: str, stats: dict):
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(rid, DeploymentID(name="llm", app_name="conveyor"))
        self.routing_stats = stats
        self.max_ongoing_requests = 64


def _router(**kwargs) -> KVAwareRequestRouter:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = KVAwareRequestRouter(
        deployment_id=DeploymentID(name="llm", app_name="conveyor"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(**kwargs)
    return router
