"""The Hugging Face Hub seen from a machine that may be offline. Left alone, a hub id that is not in the cache
costs half a minute of `huggingface_hub`'s retries before its error; here one TCP connection to the Hub's
endpoint, given a few seconds, says whether to try at all (asked once per process), and a model or dataset
already in the Hugging Face cache is found there without the network."""
from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlparse

PROBE_S = 3.0  # how long the Hub's endpoint is given to accept a connection
_answers: dict[str, str | None] = {}  # endpoint -> the probe's result, once asked


def offline_set() -> bool:
    """Whether HF_HUB_OFFLINE asks for no network."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _probe(host: str, port: int, found: list) -> None:
    try:
        socket.create_connection((host, port), timeout=PROBE_S).close()
        found.append(None)
    except OSError as error:
        found.append(error.strerror or type(error).__name__)


def unreachable() -> str | None:
    """Why the Hub cannot be used now, or None when its endpoint (`HF_ENDPOINT`, default huggingface.co) accepts
    a connection within PROBE_S seconds (the lookup runs in a thread: a resolver that hangs costs PROBE_S too)."""
    if offline_set():
        return "HF_HUB_OFFLINE=1 is set"
    url = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    if url not in _answers:
        endpoint = urlparse(url)
        host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
        found: list = []
        probe = threading.Thread(target=_probe, args=(host, port, found), daemon=True)
        probe.start()
        probe.join(PROBE_S + 0.5)
        error = found[0] if found else f"no answer within {PROBE_S:g} s"
        _answers[url] = None if error is None else f"the Hub cannot be reached ({host}: {error})"
    return _answers[url]


def cached(repo_id: str, repo_type: str = "model") -> str | None:
    """The folder of `repo_id`'s copy in the Hugging Face cache (HF_HOME), or None; never the network."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, repo_type=repo_type, local_files_only=True)
    except Exception:  # noqa: BLE001 -- not cached, or an id the hub library refuses: either way, none here
        return None
