"""Fuzzing the SageMaker routes of a real multi-model server (``SAGEMAKER_MULTI_MODEL=true``,
on-demand): ``/ping``, ``/invocations`` with hostile TargetModel headers, content types whose
``json-header-size`` lies and hostile v2 bodies, ``/models`` registrations with hostile names
and urls, listings with hostile query strings, and ``/models/{name}`` and its ``invoke``.
Every example must be answered without a 5xx (but the deliberate ones of ``support.fuzz``),
the server must stay up, and the canary (``simple`` through ``/invocations``) must still be
answered right. Knobs: tests/support/fuzz.py."""

from __future__ import annotations

import base64
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import example, given
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
    example_request,
    hostile_names,
    http_bodies,
    http_encode,
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
    encoding=st.one_of(st.none(), st.sampled_from(["gzip", "deflate", "br", "identity", ""])),
)
def test_random_requests_on_every_route(
    server: QuiverServer, watch: Watch, route: tuple[str, str], method: str | None, model: str, body: bytes,
    content_type: str, target: str | None, encoding: str | None,
) -> None:
    verb = method or route[0]
    if verb == "DELETE" and model in PROTECTED:
        return
    path = route[1].replace("{m}", model)
    headers = {"Content-Type": content_type} if content_type else {}
    if target is not None:
        headers[TARGET] = target
    if encoding is not None:
        headers["Content-Encoding"] = encoding
        if encoding == "gzip" and body[:1] == b"{":
            body = gzip.compress(body)
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


def sagemaker_framing(draw: st.DrawFn, encoded: HttpBody, *, lie: bool) -> dict[str, str]:
    """The headers of a body: the binary length in the content type (SageMaker's way) or in
    Inference-Header-Content-Length (tritonclient's); ``lie`` lets the content type lie."""
    headers = dict(encoded.headers)
    json_length = headers.pop("Inference-Header-Content-Length", None)
    if json_length is not None and draw(st.booleans()):
        headers["Inference-Header-Content-Length"] = json_length
    elif json_length is not None or (lie and draw(st.integers(0, 3)) == 0):
        digits = (json_length or "").lstrip("-")
        truth = int(json_length) if json_length and digits.isascii() and digits.isdigit() else None
        truthful = f"{BINARY_JSON};json-header-size={truth}"
        headers["Content-Type"] = draw(sagemaker_content_types(truth)) if lie else truthful
        if truth is None or headers["Content-Type"] != truthful:
            encoded.req.mutations.append("content-type")
    return headers


@st.composite
def invocations(draw: st.DrawFn) -> tuple[str, dict[str, str], HttpBody, str]:
    """(path, headers, body, model): a hostile v2 body for a model (see ``http_bodies``),
    framed the SageMaker way or tritonclient's, sent to ``/invocations`` with the model as
    TargetModel or to ``/models/{model}/invoke``."""
    encoded = draw(http_bodies(CATALOG))
    model = encoded.req.model
    headers = sagemaker_framing(draw, encoded, lie=True)
    if draw(st.booleans()):
        headers[TARGET] = model
        return "/invocations", headers, encoded, model
    return f"/models/{quote(model, safe='')}/invoke", headers, encoded, model


@st.composite
def named_invocations(draw: st.DrawFn) -> tuple[str, dict[str, str], HttpBody, str]:
    """(path, headers, body, model): a valid body for a model, sent under a hostile
    TargetModel or ``/models/{name}/invoke`` name (which an on-demand server looks up on
    disk and in its caches)."""
    encoded = draw(http_bodies(CATALOG, mutations=(0, 0)))
    model = encoded.req.model
    headers = sagemaker_framing(draw, encoded, lie=False)
    if draw(st.booleans()):
        target = draw(target_models())
        if target != model:
            encoded.req.mutations.append("target")
        headers[TARGET] = target
        return "/invocations", headers, encoded, model
    name = draw(path_segments(MODEL_NAMES))
    if name != model:
        encoded.req.mutations.append("name")
    return f"/models/{name}/invoke", headers, encoded, model


def invoke(server: QuiverServer, watch: Watch, call: tuple[str, dict[str, str], HttpBody, str]) -> None:
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


@fuzz(200)
@given(call=invocations())
def test_invocations(server: QuiverServer, watch: Watch, call: tuple[str, dict[str, str], HttpBody, str]) -> None:
    invoke(server, watch, call)


@fuzz(150)
@given(call=named_invocations())
# a TargetModel longer than a file name may be (an on-demand lookup)
@example(call=("/invocations", {"Content-Type": "application/json", TARGET: "a" * 256},
               http_encode(example_request("simple", [], mutations=["target"])), "simple"))
def test_invocation_targets(server: QuiverServer, watch: Watch, call: tuple[str, dict[str, str], HttpBody, str]) -> None:
    invoke(server, watch, call)


# -- the multi-model API: registrations, listings, deletions ---------------------------------


#: Where urls point: {repo} is the model repository, {root} the folder above it.
URLS_LOCAL = [
    "{repo}/add_sub", "{repo}/string_upper", "{repo}/pipeline", "{repo}/victim", "{repo}/broken", "{repo}/" + ARCHIVE,
    "{repo}", "{root}/empty", "{root}/file.txt", "{repo}/nonexistent", "file://{repo}/add_sub",
    "{repo}/add_sub/../simple", "{repo}/add_sub/", "{repo}/../models/string_upper", "{repo}/\x00x",
    "{repo}/" + "a" * 300 + ".tar.gz",
]
URLS_HOSTILE = [
    "", "/", "/etc", "/etc/passwd", "/proc/self/environ", "/dev/zero", "/dev/../proc/self", "/sys/kernel",
    "/proc", "file:///etc/passwd", "file://", "s3://", "s3://bucket", "s3://bucket/", "s3://bucket/key.tar.gz",
    "s3://bucket/../x", "s3://b/" + "a" * 2000, "s3://bucket/a/../../x/", "http://127.0.0.1:1/x.tar.gz", "ftp://x",
    "\x00", "a" * 5000, "/" + "a" * 300, "/" + "a/" * 3000, "../../etc", "~", "$HOME", "\u6a21\u578b",
]


def urls() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(URLS_LOCAL), st.sampled_from(URLS_HOSTILE), st.text(max_size=20))


def registration_names() -> st.SearchStrategy[str]:
    return st.one_of(
        model_names(MODEL_NAMES, exclude=PROTECTED),
        st.sampled_from(["a" * 255, "a" * 254 + ".tar.gz", "x" * 200, "hash-1", "hash-2", ARCHIVE, "add_two"]),
    )


@st.composite
def registrations(draw: st.DrawFn) -> tuple[str, Any]:
    """(model_name, body of POST /models): mostly {"model_name", "url"} with hostile values,
    sometimes any JSON."""
    name = draw(registration_names())
    body = draw(st.one_of(
        st.builds(lambda u: {"model_name": name, "url": u}, urls()),
        st.builds(lambda n, u: {"model_name": n, "url": u}, st.one_of(st.just(name), json_values(4)), st.one_of(urls(), json_values(4))),
        json_values(6),
    ))
    return name, body


def with_paths(value: Any, repo: Path) -> Any:
    if isinstance(value, dict):
        return {k: with_paths(v, repo) for k, v in value.items()}
    if isinstance(value, str) and "{r" in value:
        return value.replace("{repo}", str(repo)).replace("{root}", str(repo.parent))
    return value


@fuzz(120)
@given(
    registration=registrations(),
    target=st.one_of(st.none(), target_models()),
    then=st.lists(st.sampled_from(["get", "invoke", "delete", "list"]), max_size=3),
)
# a url longer than a file name may be
@example(registration=("x", {"model_name": "x", "url": "/" + "a" * 300}), target=None, then=[])
@example(registration=("y", {"model_name": "y", "url": "{repo}/" + "a" * 300 + ".tar.gz"}), target=None, then=[])
def test_registrations(server: QuiverServer, watch: Watch, repo: Path, registration: tuple[str, Any], target: str | None, then: list[str]) -> None:
    """POST /models with hostile names and urls (and bodies of every shape), then what a
    client does next with the name: GET it, invoke it, DELETE it, list the models."""
    name, body = registration
    headers = {"Content-Type": "application/json"}
    if target is not None:
        headers[TARGET] = target
    raw = dumps(with_paths(body, repo))
    with watch.case(f"POST /models {headers}", raw) as case:
        case.http(http_call(server.sagemaker_port, "POST", "/models", raw, headers))
    segment = quote(name, safe="")
    for step in then:
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
@example(query="max_results=%C2%B2", token=None)  # str.isdigit, but not int()
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

