"""Fuzzing the SageMaker routes of a real multi-model server (``SAGEMAKER_MULTI_MODEL=true``,
on-demand): ``/ping``, ``/invocations`` with hostile TargetModel headers, content types whose
``json-header-size`` lies and hostile v2 bodies, ``/models`` registrations with hostile names
and urls, listings with hostile query strings, and ``/models/{name}`` and its ``invoke``.
Every example must be answered without a 5xx (but the deliberate ones of ``support.fuzz``),
the server must stay up, and the canary (``simple`` through ``/invocations``) must still be
answered right. Knobs: tests/support/fuzz.py."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from support.archives import single_archive
from support.fuzz import (
    CATALOG,
    MODEL_NAMES,
    PROTECTED,
    Reply,
    Watch,
    build_repository,
    compare_outputs,
    fuzz,
    http_call,
    http_canary,
    http_outputs,
    start_server,
)
from support.hostile import (
    BINARY_JSON,
    HttpBody,
    dumps,
    hostile_names,
    http_bodies,
    json_values,
    model_names,
    path_segments,
    query_strings,
)
from support.server import QuiverServer

TARGET = "X-Amzn-SageMaker-Target-Model"
ARCHIVE = "add_two.tar.gz"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz_sagemaker")
    repo = build_repository(root / "models", full=False)
    (repo / ARCHIVE).write_bytes(single_archive(2.0, name="add_two"))
    (root / "empty").mkdir()
    (root / "file.txt").write_text("not a model")
    return repo


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[QuiverServer]:
    env = {
        "SAGEMAKER_MULTI_MODEL": "true",
        # S3 urls go to an endpoint where nothing listens: refused at once, no network used
        "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9",
        "AWS_ACCESS_KEY_ID": "fuzz",
        "AWS_SECRET_ACCESS_KEY": "fuzz",
        "AWS_REGION": "us-east-1",
    }
    running = start_server(
        repo, f"--model-cache-dir={repo.parent / 'cache'}", "--s3-retries=1", "--s3-timeout=2", sagemaker=True, env=env
    )
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def watch(server: QuiverServer) -> Iterator[Watch]:
    watch = Watch(server, http_canary(server.sagemaker_port, "/invocations", {TARGET: "simple"}))
    yield watch
    watch.assert_clean()


def header_safe(text: str) -> str:
    """A header value http.client will send (no line breaks)."""
    return text.replace("\r", "").replace("\n", "")


def target_models() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from([*MODEL_NAMES, ARCHIVE, "add_two"]),
        hostile_names(),
        st.text(max_size=30),
    ).map(header_safe)


ROUTES = [
    ("GET", "/ping"), ("HEAD", "/ping"), ("POST", "/invocations"), ("GET", "/models"), ("POST", "/models"),
    ("GET", "/models/{m}"), ("DELETE", "/models/{m}"), ("POST", "/models/{m}/invoke"), ("GET", "/models/"),
    ("GET", "/"), ("POST", "/invocations/"), ("GET", "/models/{m}/invoke/x"),
]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


@fuzz(150)
@given(
    route=st.sampled_from(ROUTES),
    method=st.one_of(st.none(), st.sampled_from(METHODS)),
    model=path_segments(MODEL_NAMES, exclude=PROTECTED),
    body=st.one_of(st.binary(max_size=300), json_values().map(dumps)),
    content_type=st.sampled_from(["application/json", "", "text/csv", BINARY_JSON + ";json-header-size=3", "application/x-npy"]),
    target=st.one_of(st.none(), target_models()),
)
def test_random_requests_on_every_route(
    server: QuiverServer, watch: Watch, route: tuple[str, str], method: str | None, model: str, body: bytes,
    content_type: str, target: str | None,
) -> None:
    verb = method or route[0]
    if verb == "DELETE" and model in PROTECTED:
        return
    path = route[1].replace("{m}", model)
    headers = {"Content-Type": content_type} if content_type else {}
    if target is not None:
        headers[TARGET] = target
    with watch.case(f"{verb} {path} {headers}", body) as case:
        reply = http_call(server.sagemaker_port, verb, path, body, headers)
        if verb == "HEAD" and reply.status >= 500:
            reply = http_call(server.sagemaker_port, "GET", path, body, headers)
        case.http(reply)


# -- inference: /invocations and /models/{name}/invoke ---------------------------------------


def sagemaker_content_types(json_length: int | None) -> st.SearchStrategy[str]:
    """The binary+json content type with a json-header-size that tells the truth or lies."""
    size = st.one_of(
        st.just(str(json_length if json_length is not None else 0)),
        st.integers(-3, 3).map(lambda d: str((json_length or 0) + d)),
        st.sampled_from(["", "-1", "abc", "1e3", "99999999999999999999", " 5", "0x10", "\u0661", "5;json-header-size=6"]),
    )
    return st.one_of(
        size.map(lambda n: f"{BINARY_JSON};json-header-size={n}"),
        size.map(lambda n: f"{BINARY_JSON.upper()}; JSON-HEADER-SIZE = {n}"),
        st.sampled_from([BINARY_JSON, BINARY_JSON + ";", BINARY_JSON + ";json-header-size", "application/json;" + BINARY_JSON, "text/plain; " + BINARY_JSON]),
    )


@st.composite
def invocations(draw: st.DrawFn) -> tuple[str, dict[str, str], HttpBody, str]:
    """(path, headers, body, model): a v2 body (valid or mutated) for a model, sent the
    SageMaker way (binary length in the content type) or tritonclient's (its header)."""
    encoded = draw(http_bodies(CATALOG))
    model = encoded.req.model
    headers = dict(encoded.headers)
    json_length = headers.pop("Inference-Header-Content-Length", None)
    if json_length is not None and draw(st.booleans()):
        headers["Inference-Header-Content-Length"] = json_length  # tritonclient's way
    elif json_length is not None or draw(st.integers(0, 3)) == 0:
        truth = int(json_length) if json_length is not None and json_length.lstrip("-").isdigit() else None
        headers["Content-Type"] = draw(sagemaker_content_types(truth))
        if truth is None or headers["Content-Type"] != f"{BINARY_JSON};json-header-size={truth}":
            encoded.req.mutations.append("content-type")
    if draw(st.booleans()):
        target = draw(st.one_of(st.just(model), target_models()))
        if target != model:
            encoded.req.mutations.append("target")
        headers[TARGET] = target
        path = "/invocations"
    else:
        name = draw(st.one_of(st.just(model), path_segments(MODEL_NAMES)))
        if name != model:
            encoded.req.mutations.append("name")
        path = f"/models/{quote(name, safe='') if name == model else name}/invoke"
    return path, headers, encoded, model


@fuzz(250)
@given(call=invocations())
def test_invocations(server: QuiverServer, watch: Watch, call: tuple[str, dict[str, str], HttpBody, str]) -> None:
    path, headers, encoded, model = call
    req = encoded.req
    spec = next((m for m in CATALOG if m.name == model), None)
    body = encoded.body()

    def expect(reply: Reply) -> str | None:
        if req.mutations or spec is None or not spec.always_ok:
            return None
        if reply.status != 200:
            return f"a valid request was answered {reply.status}: {reply.error}"
        if reply.headers.get("content-type", "").startswith(BINARY_JSON):
            reply.headers["inference-header-content-length"] = reply.headers["content-type"].rsplit("=", 1)[1]
        try:
            return compare_outputs(req, http_outputs(reply))
        except (ValueError, KeyError, TypeError) as exc:
            return f"the answer does not parse: {exc!r}: {reply.body[:300]!r}"

    with watch.case(f"POST {path} {req.mutations} {headers}", body) as case:
        case.http(http_call(server.sagemaker_port, "POST", path, body, headers), expect=expect)


# -- the multi-model API: registrations, listings, deletions ---------------------------------


def urls(repo: Path) -> st.SearchStrategy[str]:
    local = [str(repo / name) for name in ("add_sub", "string_upper", "pipeline", "victim", "broken", ARCHIVE)]
    local += [str(repo), str(repo.parent / "empty"), str(repo.parent / "file.txt"), str(repo / "nonexistent")]
    hostile = [
        "", "/", "/etc", "/etc/passwd", "/proc/self/environ", "/dev/zero", "/dev/../proc/self", "/sys/kernel",
        "/proc", "file:///etc/passwd", "file://" + str(repo / "add_sub"), "file://", "s3://", "s3://bucket",
        "s3://bucket/", "s3://bucket/key.tar.gz", "s3://bucket/../x", "s3://b/" + "a" * 2000, "s3://bucket/a/../../x/",
        "http://127.0.0.1:1/x.tar.gz", "ftp://x", "\x00", str(repo) + "/\x00x", "a" * 5000, "/" + "a" * 300,
        "/" + "a/" * 3000, str(repo / ("a" * 300 + ".tar.gz")), "../../etc", "~", "$HOME", "\u6a21\u578b",
        str(repo / "add_sub") + "/../simple", str(repo / "add_sub") + "/", str(repo / ".." / "models" / "string_upper"),
    ]
    return st.one_of(st.sampled_from(local), st.sampled_from(hostile), st.text(max_size=20))


def registration_names() -> st.SearchStrategy[str]:
    return st.one_of(
        model_names(MODEL_NAMES, exclude=PROTECTED),
        st.sampled_from(["a" * 255, "a" * 254 + ".tar.gz", "x" * 200, "hash-1", "hash-2", ARCHIVE, "add_two"]),
    )


@fuzz(120)
@given(data=st.data())
def test_registrations(server: QuiverServer, watch: Watch, repo: Path, data: st.DataObject) -> None:
    """POST /models with hostile names and urls (and bodies of every shape), then what a
    client does next with the name: GET it, invoke it, DELETE it, list the models."""
    name = data.draw(registration_names(), label="model_name")
    body = data.draw(
        st.one_of(
            st.builds(lambda n, u: {"model_name": n, "url": u}, st.just(name), urls(repo)),
            st.builds(lambda n, u: {"model_name": n, "url": u}, st.one_of(st.just(name), json_values(4)), st.one_of(urls(repo), json_values(4))),
            json_values(6),
        ),
        label="body",
    )
    headers = {"Content-Type": "application/json"}
    target = data.draw(st.one_of(st.none(), target_models()), label="target")
    if target is not None:
        headers[TARGET] = target
    raw = dumps(body)
    with watch.case(f"POST /models {headers}", raw) as case:
        case.http(http_call(server.sagemaker_port, "POST", "/models", raw, headers))
    segment = quote(name, safe="")
    for step in data.draw(st.lists(st.sampled_from(["get", "invoke", "delete", "list"]), max_size=3), label="then"):
        if step == "get":
            method, path, payload = "GET", f"/models/{segment}", None
        elif step == "invoke":
            method, path, payload = "POST", f"/models/{segment}/invoke", json.dumps({"inputs": []}).encode()
        elif step == "delete":
            if name in PROTECTED:
                continue
            method, path, payload = "DELETE", f"/models/{segment}", None
        else:
            method, path, payload = "GET", "/models", None
        with watch.case(f"{method} {path} (after registering {name!r})", payload) as case:
            case.http(http_call(server.sagemaker_port, method, path, payload))


@fuzz(80)
@given(query=query_strings(), token=st.one_of(st.none(), st.text(max_size=20), st.binary(max_size=20).map(lambda b: base64.urlsafe_b64encode(b).decode().rstrip("="))))
def test_model_listing(server: QuiverServer, watch: Watch, query: str, token: str | None) -> None:
    if token is not None:
        query += ("&" if query else "") + "next_page_token=" + quote(token, safe="")
    path = "/models" + ("?" + query if query else "")
    with watch.case(f"GET {path}") as case:
        case.http(http_call(server.sagemaker_port, "GET", path))


def test_server_exits_cleanly_after_fuzzing(server: QuiverServer) -> None:
    """Last in the module: the fuzzed server still stops on SIGTERM with exit code 0."""
    assert server.process is not None and server.process.poll() is None
    assert server.stop() == 0, "\n".join(server.lines[-50:])

