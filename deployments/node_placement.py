"""Where the app's pieces run on a multi-node Ray cluster, and their options.

- LLM replicas: one per node when `replica_node_resource` names a resource that each replica-capable node
  declares as 1 (`ray start --resources '{"conveyor_replica": 1}'`): the replica's placement group asks for
  all of it in its first bundle, so a second replica cannot fit on that node. A TP replica's workers share its
  STRICT_PACK group, so they stay on its node. (Serve's `max_replicas_per_node` cannot be combined with
  placement-group bundles, and Ray's implicit per-node resources cannot be put in a bundle.)
- The admission actor and a single router: on the head node (`HEAD_PIN`). The head holds the GCS and the Serve
  controller, so without GCS fault tolerance its loss ends the cluster anyway: pinning there adds no failure
  domain, a worker node's loss (or its removal by the autoscaler) never takes admission or the HTTP front
  with it, and the autoscaler can remove an idle worker node whole. Several routers are spread over nodes
  by Serve (its default), so one node's loss leaves the others serving.
"""

HEAD_RESOURCE = "node:__internal_head__"  # Ray puts 1 of it on the head node, on every cluster kind
HEAD_PIN = {HEAD_RESOURCE: 0.001}


def replica_bundles(
    head: dict[str, float], worker: dict[str, float], tensor_parallel_size: int, node_resource: str | None
) -> list[dict[str, float]]:
    """The STRICT_PACK bundles of one replica: its own (with all of `node_resource`, if given), then one per TP
    worker."""
    first = {**head, **({node_resource: 1.0} if node_resource else {})}
    return [first] + ([worker] * tensor_parallel_size if tensor_parallel_size > 1 else [])
