"""The schemas a clone tests against: found where they lie, checked against their pinned digest, downloaded once
from their source when nowhere here, and a clone that can reach none of them told so, not skipped."""

from __future__ import annotations

import http.server
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from tests import schemas


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """No ../shared, no cache, no SCHEMAS_DIR: a user's clone."""
    monkeypatch.setattr(schemas, "SHARED", tmp_path / "shared")
    monkeypatch.setattr(schemas, "CACHE", tmp_path / "cache")
    monkeypatch.delenv("SCHEMAS_DIR", raising=False)
    return tmp_path


def serve(folder: Path):
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(folder))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_every_schema_found_here_is_its_pinned_version():
    for name in schemas.SCHEMAS:
        assert schemas.schema_file(name).exists()


def test_a_clone_without_them_downloads_each_once_and_checks_it(nowhere, monkeypatch):
    (nowhere / "web").mkdir()
    (nowhere / "web" / "project.json").write_text('{"title": "Pulumi Project",\n "type": "object"}')
    (nowhere / "web" / "other.json").write_text('{"type": "object"}')
    # the pinned digest is of the parsed JSON: a re-indented copy is the same schema
    pinned = schemas.Schema(
        "pulumi-schema/project.json", "", schemas.digest(b'{"type":"object","title":"Pulumi Project"}', ".json")
    )
    server = serve(nowhere / "web")
    try:
        url = f"http://127.0.0.1:{server.server_port}/"
        monkeypatch.setitem(schemas.SCHEMAS, "pulumi project", replace(pinned, url=url + "project.json"))
        got = schemas.schema_file("pulumi project")
        assert got == nowhere / "cache" / "pulumi-schema" / "project.json"
        assert got.read_bytes() == (nowhere / "web" / "project.json").read_bytes()
        server.shutdown()
        assert schemas.schema_file("pulumi project") == got  # the second time from the cache, the server gone
        got.unlink()
        server = serve(nowhere / "web")
        url = f"http://127.0.0.1:{server.server_port}/"
        monkeypatch.setitem(schemas.SCHEMAS, "pulumi project", replace(pinned, url=url + "other.json"))
        with pytest.raises(AssertionError, match="is not the pinned pulumi project"):
            schemas.schema_file("pulumi project")
    finally:
        server.shutdown()


def test_a_clone_that_reaches_none_is_told_where_to_put_them(nowhere, monkeypatch):
    pinned = schemas.SCHEMAS["rayclusters v1.4.2"]
    monkeypatch.setitem(schemas.SCHEMAS, "rayclusters v1.4.2", replace(pinned, url="http://127.0.0.1:9/gone.yaml"))
    with pytest.raises(AssertionError, match="set SCHEMAS_DIR to a folder laid out as ../shared"):
        schemas.schema_file("rayclusters v1.4.2")
    (nowhere / "mine" / "kuberay-crds" / "v1.4.2").mkdir(parents=True)
    (nowhere / "mine" / pinned.path).write_text("kind: CustomResourceDefinition\n")
    monkeypatch.setenv("SCHEMAS_DIR", str(nowhere / "mine"))
    with pytest.raises(AssertionError, match="its digest differs"):
        schemas.schema_file("rayclusters v1.4.2")
