"""A real reference-engine server on 127.0.0.1, started and stopped by specgate's lifecycle code."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
from conftest import counting_prompt

from specgate.sweep.managed_server import ManagedServer, ServerFailed, free_port

pytestmark = pytest.mark.slow


def serve_cmd(target, draft=None, port=0, extra=()):
    cmd = [sys.executable, "-m", "specgate.cli", "serve", "--target", str(target), "--port", str(port), "--max-len", "512",
           "--max-running", "8", *extra]  # fmt: skip
    return cmd + (["--draft", str(draft), "--disable-at", "4"] if draft else [])


def post(url, body, stream=False):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read().decode()
            return r.status, raw if stream else json.loads(raw)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def get(url):
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.status, r.read().decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory, counting_target, tiny_drafter):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    with ManagedServer(serve_cmd(counting_target, tiny_drafter, port), port, log, ready_timeout=120) as s:
        yield s


def test_openai_completions_non_stream_and_stream(server):
    status, body = post(f"{server.url}/v1/completions", {"prompt": "alpha beta", "max_tokens": 12, "ignore_eos": True})
    assert status == 200 and body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 12 and body["choices"][0]["finish_reason"] == "length"
    status, raw = post(f"{server.url}/v1/completions", {"prompt": "alpha beta", "max_tokens": 12, "ignore_eos": True,
                                                        "stream": True, "stream_options": {"include_usage": True}}, stream=True)  # fmt: skip
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 12 and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_completions(server):
    status, body = post(f"{server.url}/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "ignore_eos": True})  # fmt: skip
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 8
    status, raw = post(f"{server.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                                                             "max_tokens": 8, "ignore_eos": True, "stream": True}, stream=True)  # fmt: skip
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == body["choices"][0]["message"]["content"]


def test_native_generate_and_info(server):
    status, body = post(f"{server.url}/generate", {"input_ids": counting_prompt(300), "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}})
    assert status == 200 and body["meta_info"]["completion_tokens"] == 10 and len(body["output_ids"]) == 10
    assert body["meta_info"]["spec_verify_ct"] > 0 and body["meta_info"]["spec_accept_length"] > 1
    assert get(f"{server.url}/health") == (200, "ok")
    assert get(f"{server.url}/health_generate")[0] == 200
    models = json.loads(get(f"{server.url}/v1/models")[1])
    assert models["data"][0]["id"]
    info = json.loads(get(f"{server.url}/server_info")[1])
    assert info["internal_states"][0]["avg_spec_accept_length"] > 1
    assert {"steps_on", "steps_off", "switches"} <= set(info["gate"]) and info["version"]


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {"prompt": "x", "temperature": 0.7}, "temperature > 0 is not supported"),
    ("/v1/completions", {"prompt": 5}, "'prompt' must be"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "'max_tokens' must be an integer >= 1"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "'messages[0]'"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "ten"}}, "'max_new_tokens'"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, "exceeds the context limit"),
    # a streamed request is checked before its stream starts
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000, "stream": True},
     "exceeds the context limit"),
])  # fmt: skip
def test_malformed_requests_get_400_with_a_message(server, path, body, message):
    status, reply = post(f"{server.url}{path}", body)
    assert status == 400 and message in reply["error"]["message"]


def test_invalid_json_gets_400(server):
    req = urllib.request.Request(f"{server.url}/v1/completions", data=b"{nope", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400


def test_shutdown_fails_in_flight_requests_instead_of_hanging(tmp_path, counting_target):
    port = free_port()
    s = ManagedServer(serve_cmd(counting_target, port=port, extra=["--max-len", "4096"]), port, tmp_path / "log", ready_timeout=120)
    s.start()
    try:
        req = urllib.request.Request(f"{s.url}/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": "a", "max_tokens": 4000, "ignore_eos": True, "stream": True}).encode())  # fmt: skip
        resp = urllib.request.urlopen(req, timeout=60)
        assert resp.readline().startswith(b"data: ")  # generation is under way
        t0 = time.time()
        os.killpg(s.proc.pid, signal.SIGTERM)
        rest = resp.read().decode()
        assert time.time() - t0 < 30
        assert "server shutting down" in rest and "[DONE]" in rest
    finally:
        s.stop()


def test_startup_failure_raises_with_the_log_tail(tmp_path):
    port = free_port()
    with pytest.raises(ServerFailed, match="exited with code"):
        ManagedServer(serve_cmd(tmp_path / "no-such-model", port=port), port, tmp_path / "log", ready_timeout=60).start()


PARENT = textwrap.dedent("""
    import sys, time
    from specgate.sweep.managed_server import ManagedServer
    cmd, port, log = sys.argv[1].split("\\x1f"), int(sys.argv[2]), sys.argv[3]
    with ManagedServer(cmd, port, log, ready_timeout=120) as s:
        print(s.proc.pid, flush=True)
        time.sleep(600)
""")


def _alive(pgid) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_no_orphans_after_the_parent_is_killed(tmp_path, counting_target, sig):
    port = free_port()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "\x1f".join(serve_cmd(counting_target, port=port)), str(port),
                               str(tmp_path / "log")], stdout=subprocess.PIPE, text=True)  # fmt: skip
    server_pid = int(parent.stdout.readline())
    assert _alive(server_pid)
    parent.send_signal(sig)
    parent.wait(60)
    deadline = time.time() + 30
    while time.time() < deadline and _alive(server_pid):
        time.sleep(0.2)
    assert not _alive(server_pid), f"server group {server_pid} outlived its parent ({sig.name})"
