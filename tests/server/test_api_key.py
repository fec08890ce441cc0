"""The API-key middleware in process: non-ASCII keys and header bytes give 200 / 401, never 500."""

from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvfleet.server.app import _APIKeyMiddleware


def _client(key: str) -> TestClient:
    app = FastAPI()

    @app.get("/v1/ping")
    def ping() -> dict:
        return {"ok": True}

    app.add_middleware(_APIKeyMiddleware, api_key=key)
    return TestClient(app)


def test_non_ascii_key_accepts_the_right_key_and_rejects_others():
    c = _client("sékret")
    assert c.get("/v1/ping", headers={"Authorization": "Bearer sékret".encode()}).status_code == 200
    r = c.get("/v1/ping", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert c.get("/v1/ping").status_code == 401


def test_non_ascii_header_against_ascii_key_is_401():
    c = _client("secret")
    assert c.get("/v1/ping", headers={"Authorization": "Bearer s\xc3\xa9kret".encode("latin-1")}).status_code == 401
    assert c.get("/v1/ping", headers={"Authorization": "Bearer secret"}).status_code == 200
