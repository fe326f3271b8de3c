"""Which API a request belongs to and which model it is for, from its method, path and headers.

The model is the key of Ray Serve's model multiplexing: requests for one model go to the
replicas that hold it. Requests that name no model (health, server metadata, the repository
index, ``/ping``, the ``/models`` listing) go to any replica.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote

V2 = "v2"
SAGEMAKER = "sagemaker"
#: The SageMaker header that picks the model of an ``/invocations`` request.
TARGET_MODEL_HEADER = "x-amzn-sagemaker-target-model"


@dataclass(frozen=True, slots=True)
class Route:
    api: str  # V2 or SAGEMAKER: which of Quiver's ASGI applications answers
    model: str  # the model the request is for; "" when it names none
    infer: bool = False  # an inference: the model is loaded for it where it lands


def route(method: str, path: str, headers: Mapping[str, str]) -> Route:
    """The API and model of a request. ``headers`` has lower-case names."""
    parts = [unquote(p) for p in path.split("/") if p]
    if parts[:1] == ["v2"]:
        # /v2/models/NAME[/versions/V]/..., /v2/repository/models/NAME/(load|unload)
        if parts[1:] == ["models", "stats"]:
            return Route(V2, "")  # every model's statistics (of the replica that answers)
        if len(parts) >= 3 and parts[1] == "models":
            return Route(V2, parts[2], parts[-1] == "infer")
        if len(parts) >= 4 and parts[1:3] == ["repository", "models"]:
            return Route(V2, parts[3])
        return Route(V2, "")
    if parts == ["invocations"]:
        return Route(SAGEMAKER, headers.get(TARGET_MODEL_HEADER, ""), True)
    if parts[:1] == ["models"]:
        # /models/NAME, /models/NAME/invoke; POST /models carries its name in the body
        return Route(SAGEMAKER, parts[1] if len(parts) >= 2 else "", parts[2:] == ["invoke"])
    if parts == ["ping"]:
        return Route(SAGEMAKER, "")
    return Route(V2, "")  # unknown paths: the v2 application answers 404 as the server does
