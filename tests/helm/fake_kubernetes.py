"""A Kubernetes API server in a thread, as much of one as smg's pod discovery
uses: it answers pod lists (label selectors applied) and holds pod watches
open, in one namespace only, and refuses anything else 403 as the gateway's
namespaced Role would (get, list, watch on pods). Every request is recorded.

    with FakeKubernetes("kv", [pod]) as api:
        env["KUBECONFIG"] = str(api.write_kubeconfig(tmp_path))
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit


def ready_pod(name: str, namespace: str, labels: dict[str, str], ip: str) -> dict[str, Any]:
    """A running, ready pod as the API server shows it."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                         "resourceVersion": "1", "labels": labels},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True"}]}}


class FakeKubernetes:
    def __init__(self, namespace: str, pods: list[dict[str, Any]]) -> None:
        self.namespace = namespace
        self.pods = pods
        self.requests: list[tuple[str, str]] = []  # (method, path with query)
        self.listed: set[str] = set()  # names of the pods lists returned
        self._closing = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeKubernetes:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()  # ends the watches
        self._server.shutdown()
        self._server.server_close()

    def write_kubeconfig(self, directory: Path) -> Path:
        path = directory / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "not-a-real-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                      "namespace": self.namespace}}]}))
        return path

    def selected(self, selector: str) -> list[dict[str, Any]]:
        wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
        found = [p for p in self.pods if wanted.items() <= p["metadata"]["labels"].items()]
        self.listed |= {p["metadata"]["name"] for p in found}
        return found

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                api.requests.append(("GET", self.path))
                url = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                if url.path != f"/api/v1/namespaces/{api.namespace}/pods":
                    self._send(403, {"kind": "Status", "status": "Failure", "code": 403,
                                     "reason": "Forbidden", "message": f"{url.path}: forbidden"})
                elif query.get("watch") == "true":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    api._closing.wait(float(query.get("timeoutSeconds", "60")))
                else:
                    self._send(200, {"apiVersion": "v1", "kind": "PodList",
                                     "metadata": {"resourceVersion": "1"},
                                     "items": api.selected(query.get("labelSelector", ""))})

            def do_POST(self) -> None:
                api.requests.append(("POST", self.path))
                self._send(403, {"kind": "Status", "code": 403, "reason": "Forbidden"})

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler
