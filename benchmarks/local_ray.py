"""The one-node Ray cluster a benchmark starts for itself: on 127.0.0.1, no dashboard, workers' logs kept out of the
driver's output, a 256 MiB object store, Ray's files under a temp dir of its own, Serve's HTTP proxy on `port`."""

import shutil
import tempfile


def ray_temp_dir(prefix: str) -> str:
    """A fresh directory for one cluster's files (sockets, logs; HAProxy's state beside them)."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def start_local_ray(num_cpus: float, port: int, temp_dir: str) -> str:
    """Starts Ray and Serve; the URL Serve's HTTP proxy answers on."""
    import ray
    from ray import serve

    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=temp_dir,
        _node_ip_address="127.0.0.1",
        object_store_memory=256 * 2**20,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def stop_local_ray(temp_dir: str) -> None:
    """Stops Serve and Ray and removes the cluster's directory."""
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
