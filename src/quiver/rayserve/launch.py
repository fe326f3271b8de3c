"""``quiver serve --ray``: attach to a Ray cluster (or start a local one), deploy Quiver as a Ray
Serve application, serve until SIGINT/SIGTERM, then shut the application down (Ray drains each
replica's in-flight requests first)."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from typing import Any

from quiver.settings import RaySettings, Settings

logger = logging.getLogger("quiver.ray")

APP_NAME = "quiver"
#: Ray Serve's own per-request access log costs CPU on every request: off, warnings only.
QUIET_LOGS = {"enable_access_log": False, "log_level": "WARNING"}


class ClusterUnreachable(Exception):
    pass


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail fast, naming the address, when nothing listens at a HOST:PORT cluster address
    (``ray.init`` would otherwise retry for a minute)."""
    target = address.removeprefix("ray://")
    if address in ("", "auto") or ":" not in target:
        return
    host, _, port = target.rpartition(":")
    if not port.isdigit():
        raise ClusterUnreachable(f"'{address}' is not a Ray cluster address (HOST:PORT)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ClusterUnreachable(f"cannot reach the Ray cluster at {address}: {reason}") from None


def _replica_range(settings: RaySettings) -> tuple[int, int]:
    low = settings.min_replicas if settings.min_replicas is not None else 1
    high = settings.max_replicas if settings.max_replicas is not None else max(low, 1)
    return low, high


def deployment_options(settings: RaySettings) -> dict[str, Any]:
    """Ray Serve options of the QuiverReplica deployment."""
    from ray.serve.config import RequestRouterConfig

    options: dict[str, Any] = {
        "max_ongoing_requests": settings.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": settings.replica_cpus},
        "graceful_shutdown_timeout_s": settings.graceful_shutdown_timeout,
        "graceful_shutdown_wait_loop_s": 0.5,
        "logging_config": QUIET_LOGS,
        "request_router_config": RequestRouterConfig(
            request_routing_stats_period_s=settings.routing_stats_period  # type: ignore[arg-type]
        ),
    }
    if settings.autoscaling:
        low, high = _replica_range(settings)
        options["autoscaling_config"] = {
            "min_replicas": low,
            "max_replicas": high,
            "initial_replicas": max(low, 1),
            "target_ongoing_requests": settings.target_ongoing_requests,
            "upscale_delay_s": 3.0,
            "downscale_delay_s": 30.0,
        }
    else:
        options["num_replicas"] = settings.replicas
    return options


def build_application(settings: Settings) -> Any:
    from ray import serve

    from quiver.rayserve.deployments import QuiverIngress, QuiverReplica

    assert settings.ray is not None
    ray_settings = settings.ray
    replica = serve.deployment(name="QuiverReplica", **deployment_options(ray_settings))(QuiverReplica)
    ingress = serve.deployment(
        name="QuiverIngress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        logging_config=QUIET_LOGS,
        max_ongoing_requests=max(256, ray_settings.max_ongoing_requests * 8),
    )(QuiverIngress)
    return ingress.bind(replica.bind(settings), settings.http_max_input_size, ray_settings.request_retries)


def _http_port(address: str, port: int) -> int:
    if port:
        return port
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def run(options: Settings) -> int:
    """Deploy and serve until a signal; returns the exit code."""
    assert options.ray is not None
    settings = options.ray
    try:
        import ray
        from ray import serve
    except ImportError:
        logger.error("--ray needs Ray Serve: pip install 'quiver[ray]'")
        return 2
    try:
        check_reachable(settings.address)
    except ClusterUnreachable as exc:
        logger.error("%s", exc)
        return 1
    where = settings.address or "a new local Ray cluster"
    try:
        init: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
        if settings.address:
            init["address"] = settings.address
            host = settings.address.removeprefix("ray://").rpartition(":")[0]
            if host in ("127.0.0.1", "localhost"):
                init["_node_ip_address"] = "127.0.0.1"  # a cluster on loopback: join it there
        else:
            init["_node_ip_address"] = "127.0.0.1"  # a local cluster talks over loopback only
            if settings.num_cpus is not None:
                init["num_cpus"] = settings.num_cpus
        ray.init(**init)
    except Exception as exc:
        logger.error("cannot connect to the Ray cluster at %s: %s", where, exc)
        return 1
    stop = threading.Event()  # after ray.init, which installs a SIGTERM handler of its own
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        port = _http_port(options.http_address, options.http_port)
        serve.start(
            http_options={
                "host": options.http_address,
                "port": port,
                "request_timeout_s": settings.request_timeout,
            },
            logging_config=QUIET_LOGS,
        )
        serve.run(build_application(options), name=APP_NAME, route_prefix="/", blocking=False)
        logger.info(
            "Ray Serve application '%s' running on %s: %s",
            APP_NAME,
            where,
            "{}-{} replicas (autoscaling)".format(*_replica_range(settings))
            if settings.autoscaling
            else f"{settings.replicas} replica(s)",
        )
        logger.info("started HTTP service at %s:%d", options.http_address, port)
        while not stop.wait(0.5):
            pass
        logger.info("stopping: Ray Serve drains the replicas' in-flight requests")
        return 0
    except Exception as exc:
        logger.error("deploying Quiver on Ray Serve failed: %s", exc)
        return 1
    finally:
        try:
            # Deleting the application first lets the replicas finish what they hold while the
            # proxy still carries the answers back; shutdown alone stops the proxy at once.
            with contextlib.suppress(Exception):
                serve.delete(APP_NAME, _blocking=True)
            if not settings.address:
                serve.shutdown()  # type: ignore[no-untyped-call]  # ours; a shared cluster's Serve stays
        finally:
            ray.shutdown()
        logger.info("stopped")
