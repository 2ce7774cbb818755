"""Mooncake's HTTP metadata service, bound to the one address it is given.

Mooncake's clients publish their segment descriptors (and find each other's)
through a key-value service over HTTP: `GET`, `PUT` and `DELETE` of
`/metadata?key=K`. `mooncake_master --enable_http_metadata_server` serves it,
but on every interface whatever `--http_metadata_server_host` says, so
`MooncakeMaster` runs this one instead:

    python -m radixkv.storage.mooncake_metadata --host 127.0.0.1 --port P

It must be a process of its own: Mooncake's client setup holds the GIL while
it waits for this service's answers.
"""

from __future__ import annotations

import argparse
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict
from urllib.parse import parse_qs, urlsplit

PATH = "/metadata"


class _Handler(BaseHTTPRequestHandler):
    server: "MetadataServer"

    def _key(self) -> str:
        url = urlsplit(self.path)
        if url.path != PATH:
            return ""
        return parse_qs(url.query).get("key", [""])[0].strip()

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        key = self._key()
        if not key:
            return self._answer(400, b"metadata key is required")
        value = self.server.get(key)
        if value is None:
            return self._answer(404, b"metadata not found")
        self._answer(200, value)

    def do_PUT(self) -> None:  # noqa: N802
        key = self._key()
        length = int(self.headers.get("Content-Length") or 0)
        value = self.rfile.read(length) if length > 0 else b""
        if not key:
            return self._answer(400, b"metadata key is required")
        if not self.server.put(key, value):
            return self._answer(400, b"an rpc_meta key is written once")
        self._answer(200, b"metadata updated")

    def do_DELETE(self) -> None:  # noqa: N802
        key = self._key()
        if not key:
            return self._answer(400, b"metadata key is required")
        if not self.server.delete(key):
            return self._answer(404, b"metadata not found")
        self._answer(200, b"metadata deleted")

    def log_message(self, format: str, *args) -> None:  # noqa: A002
        pass  # one line per request would fill the master's log


class MetadataServer(ThreadingHTTPServer):
    """The key-value store behind the handler, on (host, port)."""

    daemon_threads = True
    request_queue_size = 128  # every client of a deployment may set up at once

    def __init__(self, host: str, port: int) -> None:
        super().__init__((host, port), _Handler)
        self._values: Dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get(self, key: str):
        with self._lock:
            return self._values.get(key)

    def put(self, key: str, value: bytes) -> bool:
        with self._lock:
            # A client's RPC address is published once: a second client may
            # not take over the name of a live one.
            if "rpc_meta" in key and key in self._values:
                return False
            self._values[key] = value
            return True

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._values.pop(key, None) is not None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args(argv)
    MetadataServer(a.host, a.port).serve_forever()


if __name__ == "__main__":
    main()
