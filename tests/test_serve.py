"""`veloxquant serve`: mlx-lm's own server (mlx_lm.server) with the real model and its bundle,
on 127.0.0.1. OpenAI-style chat requests (two at once, so the server batches them), a follow-up
that reuses the prompt cache, and the resident KV bytes of what the server keeps."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def chat(url: str, messages: list[dict], max_tokens: int = 10) -> dict:
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0})
    req = urllib.request.Request(
        url + "/v1/chat/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(artifacts_root, eval_text, smollm2):
    art = artifacts_root / "artifacts" / "smollm2-135m"
    port = free_port()
    log = artifacts_root / f"serve-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "veloxquant.cli",
        "serve",
        str(art / "model"),
        "--method",
        "vecinfer",
        "--bundle",
        str(art / "bundle"),
        # The short conversation (37 tokens) stays in the fp16 window, as with the old 46-token
        # default: with the question itself coded, this 135M model answers it only from a
        # pipeline-sized calibration (8192 captured tokens: "Paris" at the default window),
        # not from the test capture's 1024 tokens (measured at every k-means budget). The
        # coded path is what the long conversation exercises.
        "--window",
        "46",
        "--host",  # mlx_lm.server's own flags from here on
        "127.0.0.1",
        "--port",
        str(port),
        "--max-tokens",
        "10",
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if get(url + "/health")["status"] == "ok":
                    break
            except OSError:
                pass
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        # a system prompt long enough that most of it is coded at 2 bits
        _, tok = smollm2
        system = "Read this, then answer briefly.\n" + tok.decode(tok.encode(eval_text)[:200])
        yield {"url": url, "log": log, "system": system}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_chat_requests_batched_and_answered(server):
    url = server["url"]
    convs = [
        [{"role": "system", "content": server["system"]}, {"role": "user", "content": QUESTION}],
        [{"role": "user", "content": QUESTION}],
    ]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda m: chat(url, m), convs))
    for a in answers:
        assert "Paris" in a["choices"][0]["message"]["content"], a
    server["first"] = (convs[0], answers[0]["choices"][0]["message"]["content"])
    log = server["log"].read_text()
    assert "with vecinfer caches (VecInferCache x30), batching on" in log
    assert "generation thread died" not in log


def test_follow_up_reuses_the_prompt_cache_and_kv_is_compressed(server):
    url = server["url"]
    messages, answer = server["first"]
    follow = [*messages, {"role": "assistant", "content": answer}]
    follow.append({"role": "user", "content": "And what is the capital of Italy?"})
    r = chat(url, follow)
    assert r["choices"][0]["message"]["content"].strip()
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 200, r["usage"]  # the system prompt and the first exchange came from cache

    stats = get(url + "/veloxquant/stats")
    last = stats["last_entry"]
    assert last["classes"] == "VecInferCache x30" and last["tokens"] > 230
    # 3-bit key and 2-bit value codes plus the fp16 window, sinks and codebooks, against
    # float32 K/V
    assert last["kv_bytes"] < 0.3 * last["uncompressed_kv_bytes"], last
    assert stats["prompt_cache"]["kv_bytes"] > 0
    assert "MB resident" in server["log"].read_text()


def test_refusals_happen_at_startup(artifacts_root):
    """--kv-bits (would swap our caches mid-stream) and --draft-model (rewinds caches) stop the
    server when it loads the model, before it listens."""
    import argparse

    import veloxquant  # noqa: F401
    from veloxquant import KVCacheConfig
    from veloxquant.serve import make_model_provider

    art = artifacts_root / "artifacts" / "smollm2-135m"
    args = argparse.Namespace(
        model=str(art / "model"),
        adapter_path=None,
        draft_model=None,
        trust_remote_code=False,
        chat_template="",
        use_default_chat_template=False,
        pipeline=False,
        kv_bits=4,
    )
    config = KVCacheConfig(method="vecinfer", artifact_dir=str(art / "bundle"))
    with pytest.raises(ValueError, match="kv_bits=4"):
        make_model_provider(args, config).load_default()
    args.kv_bits, args.draft_model = None, str(art / "model")
    with pytest.raises(ValueError, match="--draft-model"):
        make_model_provider(args, config).load_default()
