"""A real HTTP server on 127.0.0.1 whose every path can be told how to answer (serve, 404, 503
a few times, cut the transfer short), and counts the requests it got."""
from __future__ import annotations

import hashlib
import io
import tarfile
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Server:
    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.fail_first: dict[str, int] = {}   # path -> how many 503s before serving
        self.status: dict[str, int] = {}       # path -> fixed status (e.g. 404)
        self.truncate_first: dict[str, int] = {}
        self.hits: Counter = Counter()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                path = self.path
                server.hits[path] += 1
                if path in server.status:
                    self.send_error(server.status[path])
                    return
                if server.fail_first.get(path, 0) > 0:
                    server.fail_first[path] -= 1
                    self.send_error(503)
                    return
                body = server.files.get(path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if server.truncate_first.get(path, 0) > 0:
                    server.truncate_first[path] -= 1
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()




def make_tarball(top: str, files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
