"""`verispec serve --ray-replicas N`: the same app (create_app) behind Ray Serve's HTTP proxy, one engine per replica.

Each replica is a Ray actor that loads its own ``LLM`` and builds its own app in its constructor (``serve.ingress``
with a builder function), so every route, error body, SSE stream and /metrics page is the one ``verispec serve``
gives. Serve runs the app's lifespan, which starts the replica's engine thread and stops it when the replica goes.

Sizing: each replica gets ``cpus / max_replicas`` of the cluster's CPUs (torch threads to match, unless --threads
says otherwise), so every replica autoscaling may start has its share. A replica takes as many requests at once as
its app queues (running + waiting); Ray's proxy holds the rest and routes each to the less busy of two replicas. With
``max_replicas``, Serve scales between ``replicas`` and ``max_replicas`` on ongoing requests, aiming at
``max_num_seqs / 2`` per replica.

Responses carry ``x-verispec-replica`` (the replica's id). /metrics is one replica's page: each replica has its own
Prometheus registry, and Ray routes each scrape to one of them (the header says which).

Ray comes from the ``ray`` extra; the rest of verispec never imports this module without it.
"""

from __future__ import annotations

import os
import signal
import time

import ray
from ray import serve

APP_NAME = "verispec"
REPLICA_HEADER = "x-verispec-replica"
OBJECT_STORE_BYTES = 256 << 20  # requests and responses are small; the weights load inside each replica
QUEUE_FACTOR = 5  # a replica's app holds max_num_seqs running + 4 x max_num_seqs waiting (create_app)


def init_ray(num_cpus: int | None = None, log_to_driver: bool = True) -> float:
    """Join the cluster at $RAY_ADDRESS, else start a local Ray of ``num_cpus`` (default: all) with no dashboard and
    a small object store; returns the CPUs the cluster has. ``log_to_driver``: replicas' logs on this stderr."""
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=log_to_driver)
        else:
            ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False,
                     object_store_memory=OBJECT_STORE_BYTES, log_to_driver=log_to_driver)
    return ray.cluster_resources().get("CPU", 1.0)


def deployment_options(replicas: int, max_replicas: int | None, max_num_seqs: int, cpus: float) -> dict:
    """``serve.deployment`` keywords: ``replicas`` fixed, or autoscaling up to ``max_replicas``; ``cpus`` in all."""
    if replicas < 1 or (max_replicas is not None and max_replicas <= replicas):
        raise ValueError(f"need replicas >= 1 and max_replicas > replicas, got {replicas}, {max_replicas}")
    most = max_replicas or replicas
    options = dict(ray_actor_options={"num_cpus": cpus / most}, max_ongoing_requests=QUEUE_FACTOR * max_num_seqs)
    if max_replicas is None:
        return {**options, "num_replicas": replicas}
    scaling = dict(min_replicas=replicas, initial_replicas=replicas, max_replicas=max_replicas,
                   target_ongoing_requests=max(1, max_num_seqs // 2))
    return {**options, "autoscaling_config": scaling}


def application(engine: dict, model_name: str, app_options: dict, *, replicas: int, max_replicas: int | None = None,
                cpus: float) -> serve.Application:
    """The Serve application: replicas that each run ``create_app(LLM(**engine), model_name, **app_options)``."""
    options = deployment_options(replicas, max_replicas, app_options.get("max_num_seqs", 16), cpus)
    threads = engine.get("threads") or max(1, int(options["ray_actor_options"]["num_cpus"]))
    engine = {**engine, "threads": threads}

    def build_app():  # runs in the replica, once
        from ..llm import LLM
        from .app import create_app

        app = create_app(LLM(**engine), model_name, **app_options)
        app.add_middleware(ReplicaHeader, replica=serve.get_replica_context().replica_tag)
        return app

    class Replica:
        def check_health(self) -> None:  # Serve replaces a replica whose engine thread died
            if not self.app.state.runner.alive:
                raise RuntimeError("the engine thread has stopped")

    deployment = serve.deployment(serve.ingress(build_app)(Replica), name="VerispecReplica", **options)
    return deployment.bind()


def deploy(app: serve.Application, host: str, port: int) -> str:
    """Start Serve's HTTP proxy on host:port and run ``app`` at /; returns once every replica is up."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}"


def run(engine: dict, model_name: str, app_options: dict, *, replicas: int, max_replicas: int | None, host: str,
        port: int) -> None:
    """`verispec serve --ray-replicas`: deploy, serve until Ctrl-C or SIGTERM, then stop Serve and Ray."""
    try:
        cpus = init_ray()
        signal.signal(signal.SIGTERM, _interrupt)  # after ray.init, which sets its own
        app = application(engine, model_name, app_options, replicas=replicas, max_replicas=max_replicas, cpus=cpus)
        url = deploy(app, host, port)
        scale = f"{replicas}..{max_replicas}" if max_replicas else str(replicas)
        print(f"verispec: {scale} replicas of {model_name} at {url} (Ctrl-C stops)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("verispec: stopping the replicas", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


class ReplicaHeader:
    """ASGI middleware: every HTTP response says which replica answered."""

    def __init__(self, app, replica: str):
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)
