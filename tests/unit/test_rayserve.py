"""``quiver serve --ray`` parts that need no cluster: routing by model, deployment options."""

from __future__ import annotations

from pathlib import Path

import pytest

from quiver.rayserve.cache_slots import CacheSlot
from quiver.rayserve.launch import (
    ClusterUnreachable,
    RaySettings,
    check_reachable,
    deployment_options,
)
from quiver.rayserve.routing import SAGEMAKER, V2, Route, route


@pytest.mark.parametrize(
    ("method", "path", "headers", "expected"),
    [
        ("POST", "/v2/models/resnet/infer", {}, Route(V2, "resnet", True)),
        ("POST", "/v2/models/resnet/versions/3/infer", {}, Route(V2, "resnet", True)),
        ("GET", "/v2/models/resnet/ready", {}, Route(V2, "resnet")),
        ("GET", "/v2/models/my%20model/config", {}, Route(V2, "my model")),
        ("GET", "/v2/models/stats", {}, Route(V2, "")),
        ("GET", "/v2/models/resnet/stats", {}, Route(V2, "resnet")),
        ("POST", "/v2/repository/models/resnet/load", {}, Route(V2, "resnet")),
        ("POST", "/v2/repository/index", {}, Route(V2, "")),
        ("GET", "/v2/health/ready", {}, Route(V2, "")),
        ("GET", "/v2", {}, Route(V2, "")),
        ("POST", "/invocations", {"x-amzn-sagemaker-target-model": "resnet_v0.tar.gz"}, Route(SAGEMAKER, "resnet_v0.tar.gz", True)),
        ("POST", "/invocations", {}, Route(SAGEMAKER, "", True)),
        ("POST", "/models/bert/invoke", {}, Route(SAGEMAKER, "bert", True)),
        ("DELETE", "/models/bert", {}, Route(SAGEMAKER, "bert")),
        ("GET", "/models", {}, Route(SAGEMAKER, "")),
        ("POST", "/models", {}, Route(SAGEMAKER, "")),
        ("GET", "/ping", {}, Route(SAGEMAKER, "")),
        ("GET", "/nothing/here", {}, Route(V2, "")),
    ],
)
def test_route(method: str, path: str, headers: dict[str, str], expected: Route) -> None:
    assert route(method, path, headers) == expected


def test_fixed_replicas_without_autoscaling() -> None:
    options = deployment_options(RaySettings(replicas=3, max_ongoing_requests=7, replica_cpus=0.5))
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options
    assert options["max_ongoing_requests"] == 7
    assert options["ray_actor_options"] == {"num_cpus": 0.5}
    assert options["graceful_shutdown_timeout_s"] == 30.0


def test_autoscaling_flags_become_rays_autoscaling_config() -> None:
    options = deployment_options(RaySettings(min_replicas=1, max_replicas=4, target_ongoing_requests=3))
    assert "num_replicas" not in options
    config = options["autoscaling_config"]
    assert (config["min_replicas"], config["max_replicas"], config["initial_replicas"]) == (1, 4, 1)
    assert config["target_ongoing_requests"] == 3
    # Scale to zero is allowed; Ray starts one replica anyway.
    zero = deployment_options(RaySettings(min_replicas=0, max_replicas=2))["autoscaling_config"]
    assert (zero["min_replicas"], zero["initial_replicas"]) == (0, 1)


def test_an_address_that_is_not_host_and_port_is_named_in_the_error() -> None:
    with pytest.raises(ClusterUnreachable, match=r"'127\.0\.0\.1:http' is not a Ray cluster address"):
        check_reachable("127.0.0.1:http")
    check_reachable("auto")  # Ray finds it; nothing to check here


def test_replicas_on_one_node_take_their_own_cache_folders(tmp_path: Path) -> None:
    first, second = CacheSlot(tmp_path), CacheSlot(tmp_path)
    assert (first.folder, second.folder) == (tmp_path / "replica-0", tmp_path / "replica-1")
    first.release()  # as when its process ends
    third = CacheSlot(tmp_path)
    assert third.folder == tmp_path / "replica-0"  # a replacement finds the old cache there
    second.release()
    third.release()


class _FakeMultiplexing:
    """What the replica touches of Ray's per-replica multiplexing state."""

    def __init__(self) -> None:
        self.models: dict[str, object] = {}
        self._model_load_tasks: set[str] = set()
        self._push_multiplexed_replica_info = False


def test_quivers_residency_changes_reach_rays_multiplexed_set_at_once() -> None:
    from quiver.rayserve.deployments import QuiverReplica

    replica = object.__new__(QuiverReplica)
    state = _FakeMultiplexing()
    setattr(replica, "__serve_multiplex_wrapper", state)  # where @serve.multiplexed keeps it
    replica._residency_changed("resnet", True)
    assert list(state.models) == ["resnet"] and state._push_multiplexed_replica_info
    state._push_multiplexed_replica_info = False
    replica._residency_changed("resnet", True)  # no change, no push
    assert not state._push_multiplexed_replica_info
    replica._residency_changed("pipe.tar.gz::preprocess", True)  # archive members: never routed by
    assert list(state.models) == ["resnet"]
    replica._residency_changed("resnet", False)  # evicted
    assert state.models == {} and state._push_multiplexed_replica_info
