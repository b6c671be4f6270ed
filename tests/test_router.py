"""The router in front of two vLLM servers (kvt/integrations/router.py).

By default the servers are fakes on loopback (standard-library HTTP servers in threads) that record what
they receive and answer as vLLM's OpenAI server with kvt's connector does: the rule, the two flows, the
verdict passed on, the fallbacks, the KV file's lifetime, chats, headers, /v1/models and streams (relayed,
cut, abandoned) run in seconds, without vLLM. The slow tests start the real stack on the toy pair (`python -m
kvt.integrations.router stack`, two vLLM servers in the vLLM Python of tests/test_vllm.py), once in bf16 and
once in float32 for four tests (toy_stack): tokens against kvt's own handoff under load, the official openai
client (completions and chat, whole and streamed), mapped KV never an exact prefix hit, and faults mid-stream
(the client gone, the source server killed).
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from http.server import ThreadingHTTPServer

import pytest

from kvt.config import KvtError
from kvt.integrations.router import CHAT, Handler, Router, free_port, make_server, stop, wait_healthy


class Fake:
    """A stand-in server on loopback: answer(path, body) -> (status, JSON), or (200, a list of events) for a
    stream (a float in it: a pause of that many seconds; "cut": the server dies there); .seen holds every
    (path, body), .gone whether a stream's reader went away before its end."""

    def __init__(self, answer):
        self.seen, self.gone = [], False
        fake = self

        class FakeHandler(Handler):                 # the router's JSON replies (Handler.reply), other answers
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.seen.append((self.path, body))
                status, out = answer(self.path, body)
                if isinstance(out, list):
                    return self.events(out)
                self.reply(status, out)

            def do_GET(self):
                fake.seen.append((self.path, None))
                self.reply(200, {"object": "list", "data": [{"id": fake.url[-5:], "object": "model"}]})

            def events(self, events):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    for e in events:
                        if e == "cut":
                            return                  # the connection closes without [DONE]
                        if isinstance(e, float):
                            time.sleep(e)
                            continue
                        self.wfile.write(f"data: {json.dumps(e) if isinstance(e, dict) else e}\n\n".encode())
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    fake.gone = True

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHandler)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def completions(self):
        return [body for path, body in self.seen if path == "/v1/completions"]


def source_answer(path, body):
    """The source server: /tokenize counts words; a kvt_save writes the file, as the connector does."""
    if path == "/tokenize":
        return 200, {"count": len(body["prompt"].split()), "max_model_len": 2048, "tokens": []}
    save = (body.get("kv_transfer_params") or {}).get("kvt_save")
    if save:
        open(save, "w").write("kv")
        return 200, {"choices": [{"text": " x"}], "kv_transfer_params": {"kvt": {"status": "saved", "path": save}}}
    if body.get("stream"):
        return 200, [{"choices": [{"text": " small"}]}, "[DONE]"]
    return 200, {"choices": [{"text": " small"}], "kv_transfer_params": None}


def target_answer(verdict, events=None):
    """The target server: records whether the KV file it is asked to load exists, answers with verdict, in
    kv_transfer_params and, as kvt's connector does, in the file named by "kvt_verdict"; renders a chat's
    messages as one id per word; streams `events` when asked for a stream."""
    def answer(path, body):
        if path == "/tokenize":
            ids = [len(w) for m in body["messages"] for w in m["content"].split()]
            return 200, {"tokens": ids, "count": len(ids), "max_model_len": 2048}
        params = body.get("kv_transfer_params") or {}
        load = params.get("kvt_load")
        body["file_there"] = bool(load) and os.path.exists(load)
        if params.get("kvt_verdict"):
            open(params["kvt_verdict"], "w").write(json.dumps(verdict))
        if body.get("stream"):
            return 200, events or [{"choices": [{"text": " large"}]}, "[DONE]"]
        return 200, {"choices": [{"text": " large"}], "kv_transfer_params": {"kvt": verdict} if load else None}
    return answer


APPLIED = {"status": "applied", "mapper": "m-1234", "slots": 4}


@pytest.fixture
def fakes(tmp_path):
    """(source, target, router URL, kv dir) with escalate_at=5, torn down after the test."""
    source, target = Fake(source_answer), Fake(target_answer(APPLIED))
    made = []

    def start(escalate_at=5, source_url=None, target_url=None):
        server = make_server(Router(source_url or source.url, target_url or target.url, str(tmp_path), escalate_at))
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        made.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield source, target, start, tmp_path
    for server in made + [source.server, target.server]:
        server.shutdown()
        server.server_close()


def ask(url, body, path="/v1/completions"):
    """(HTTP status, JSON answer) of a POST to the router."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def ask_with_headers(url, body, path="/v1/completions"):
    """(HTTP status, JSON answer, headers) of a POST to the router."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def events(url, body, path="/v1/completions"):
    """A streamed POST to the router: (headers, [(seconds since the request, event JSON or "[DONE]")])."""
    req = urllib.request.Request(url + path, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    t0, got = time.perf_counter(), []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: "):
                data = line[6:].strip().decode()
                got.append((time.perf_counter() - t0, data if data == "[DONE]" else json.loads(data)))
        return r.headers, got


def dead_url():
    return f"http://127.0.0.1:{free_port()}"   # nothing listens there: connection refused


def test_the_rule_flag_and_length(fakes):
    """Guards: the router-only "escalate" field (or the client's "model") forwarded to vLLM; a length threshold
    off by one (>= --escalate-at escalates) or ignored; a list of ids sent to /tokenize; --escalate-at 0
    escalating by length."""
    source, target, start, _ = fakes
    url = start(escalate_at=5)
    cases = [({"prompt": "a b c d", "escalate": False, "model": "m"}, "source"),   # 4 words < 5
             ({"prompt": "a b c d e"}, "target"),                                   # 5 words: escalates
             ({"prompt": "a b", "escalate": True}, "target"),
             ({"prompt": [1, 2, 3, 4]}, "source"),
             ({"prompt": [1, 2, 3, 4, 5]}, "target")]
    for body, where in cases:
        status, out = ask(url, {**body, "max_tokens": 3})
        assert status == 200 and out["choices"][0]["text"] == (" small" if where == "source" else " large"), (body, out)
        if where == "source":
            assert out["kvt"] == {"status": "source"}, out
    counted = [body["prompt"] for path, body in source.seen if path == "/tokenize"]
    assert counted == ["a b c d", "a b c d e"], counted        # the flag and a list of ids need no count
    for body in source.completions() + target.completions():
        assert "escalate" not in body and "model" not in body, body
    status, out = ask(start(escalate_at=0), {"prompt": "a b c d e f g h", "max_tokens": 3})
    assert out["kvt"] == {"status": "source"}, "--escalate-at 0: never by length"


@pytest.mark.parametrize("verdict", [APPLIED, {"status": "fallback_reprefill", "reason": "gate: unfit (KL)"},
                                     {"loaded": 4}], ids=["applied", "fallback", "older-format"])
def test_escalated_flow_and_verdict(fakes, verdict):
    """Guards: the source asked for the whole completion instead of max_tokens 1, or without kvt_save; the
    target given another path than the source saved to, or the prefill body instead of the client's; the
    connector's verdict changed or lost on the way back (it is passed on as it is, in either format); the
    KV file left on disk."""
    source, target, start, kv_dir = fakes
    target_fake = Fake(target_answer(verdict))
    url = start(target_url=target_fake.url)
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 8, "temperature": 0, "logprobs": 5, "escalate": True}
    status, out = ask(url, body)
    assert status == 200 and out["kvt"] == verdict and out["choices"][0]["text"] == " large", out
    (pre,), (final,) = source.completions(), target_fake.completions()
    save, load = pre["kv_transfer_params"]["kvt_save"], final["kv_transfer_params"]["kvt_load"]
    assert pre["max_tokens"] == 1 and pre["prompt"] == body["prompt"], pre
    assert save == load and re.fullmatch(re.escape(str(kv_dir)) + r"/[0-9a-f]{32}\.kv\.safetensors", save), (save, load)
    assert final["file_there"], "the target was asked before the source's file was there"
    assert {k: v for k, v in final.items() if k not in ("kv_transfer_params", "file_there")} == \
        {k: v for k, v in body.items() if k != "escalate"}, final
    assert not os.listdir(kv_dir), f"KV files left behind: {os.listdir(kv_dir)}"
    target_fake.server.shutdown()


def test_source_down_falls_back_to_the_targets_prefill(fakes):
    """Guards: a source that is down (refused) or answers with an error failing the request, or the target
    then asked to load a file that was never written; the fallback must say why, naming the source."""
    source, target, start, kv_dir = fakes
    broken = Fake(lambda path, body: (500, {"error": {"message": "engine dead\nsecond line", "code": 500}}))
    for source_url, why in ((dead_url(), "source server: .*refused"), (broken.url, r"source server: HTTP 500: engine dead$")):
        status, out = ask(start(source_url=source_url), {"prompt": "a b c d e f", "max_tokens": 4})
        assert status == 200 and out["choices"][0]["text"] == " large", out
        assert out["kvt"]["status"] == "fallback_reprefill" and re.search(why, out["kvt"]["reason"]), out["kvt"]
        assert "kv_transfer_params" not in target.completions()[-1], "the target was told to load a missing file"
    assert not os.listdir(kv_dir)
    broken.server.shutdown()


def test_a_server_down_is_a_502_naming_it(fakes):
    """Guards: the target (escalated) or the source (not escalated) down ending as a Python traceback, an
    empty answer or a 200; the client gets HTTP 502 and a JSON error naming the server, with a kvt status.
    And the KV file the source saved is deleted though the target failed."""
    source, target, start, kv_dir = fakes
    for url, body, who in ((start(target_url=dead_url()), {"prompt": "a", "escalate": True}, "target server"),
                           (start(source_url=dead_url()), {"prompt": [1]}, "source server")):
        status, out = ask(url, {**body, "max_tokens": 4})
        assert status == 502, (status, out)
        assert out["error"]["message"].startswith(who + ":") and out["kvt"]["status"] == "error", out
        assert "Traceback" not in json.dumps(out)
    assert len(source.completions()) == 1 and not os.listdir(kv_dir), "the saved KV file was left behind"


def test_headers_carry_the_kvt_status_and_models_lists_both(fakes):
    """Every answer to a request carries x-kvt-status (and x-kvt-mapper-id where applied) as its JSON "kvt"
    says; GET /v1/models lists the source's and the target's models. Guards headers left off a path (the
    source's answers, errors), a mapper id sent with a fallback, and /v1/models answering 404."""
    source, target, start, _ = fakes
    url = start(escalate_at=5)
    status, out, h = ask_with_headers(url, {"prompt": "a b"})
    assert status == 200 and h["x-kvt-status"] == "source" and "x-kvt-mapper-id" not in h, dict(h)
    status, out, h = ask_with_headers(url, {"prompt": "a b", "escalate": True})
    assert (h["x-kvt-status"], h["x-kvt-mapper-id"]) == ("applied", "m-1234"), dict(h)
    fallback = Fake(target_answer({"status": "fallback_reprefill", "reason": "gate", "mapper": "m-1234"}))
    status, out, h = ask_with_headers(start(target_url=fallback.url), {"prompt": "a b", "escalate": True})
    assert h["x-kvt-status"] == "fallback_reprefill" and "x-kvt-mapper-id" not in h, dict(h)
    status, out, h = ask_with_headers(start(target_url=dead_url()), {"prompt": "a", "escalate": True})
    assert status == 502 and h["x-kvt-status"] == "error", dict(h)
    status, out, h = ask_with_headers(url, {"prompt": ["a", "b"]})
    assert status == 400 and h["x-kvt-status"] == "unsupported", dict(h)
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        models = json.loads(r.read())["data"]
    assert [(m["id"], m["kvt_role"]) for m in models] == [(source.url[-5:], "source"), (target.url[-5:], "target")]
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        served = json.loads(r.read())["served"]
    assert served == {"source": 1, "applied": 1, "unsupported": 1}, served        # this router's answers
    fallback.server.shutdown()


def test_a_chat_is_rendered_once_by_the_target(fakes):
    """An escalated chat: the target's /tokenize renders the messages (with the chat fields), the source
    prefills exactly those ids (a completions body, max_tokens 1), the target gets the chat itself with the
    file to load, and the answer carries its verdict; a chat that does not escalate goes to the source's chat
    endpoint unrendered; a chat counted by --escalate-at is counted in the target's rendering; a /tokenize
    error (a model without a chat template) is passed on with its status. Guards the source saving KV for
    other ids than the target renders, and a chat sent to the source's completions endpoint as text."""
    source, target, start, kv_dir = fakes
    url = start(escalate_at=0)
    chat = {"messages": [{"role": "user", "content": "aa bbb c"}], "max_tokens": 4, "chat_template": "T",
            "add_generation_prompt": True}
    status, out = ask(url, {**chat, "escalate": True}, CHAT)
    assert status == 200 and out["kvt"] == APPLIED, out
    (render,) = [b for p, b in target.seen if p == "/tokenize"]
    assert render == {k: chat[k] for k in ("messages", "chat_template", "add_generation_prompt")}, render
    (pre,) = source.completions()
    assert pre["prompt"] == [2, 3, 1] and pre["max_tokens"] == 1 and "messages" not in pre, pre
    (final,) = [b for p, b in target.seen if p == CHAT]
    assert final["messages"] == chat["messages"] and final["file_there"], final
    assert final["kv_transfer_params"]["kvt_load"] == pre["kv_transfer_params"]["kvt_save"]
    assert not os.listdir(kv_dir), os.listdir(kv_dir)
    status, out = ask(url, chat, CHAT)
    assert out["kvt"] == {"status": "source"} and [p for p, _ in source.seen][-1] == CHAT, source.seen[-1]
    status, out = ask(start(escalate_at=3), chat, CHAT)                 # 3 rendered ids: escalates
    assert out["kvt"] == APPLIED, out
    no_template = Fake(lambda path, body: (400, {"error": {"message": "this model has no chat template", "code": 400}}))
    status, out = ask(start(target_url=no_template.url), {**chat, "escalate": True}, CHAT)
    assert status == 400 and out["error"]["message"] == "target server: HTTP 400: this model has no chat template", out
    no_template.server.shutdown()


def test_a_stream_is_relayed_as_it_arrives(fakes):
    """An escalated stream: the client's first event arrives when the target's does (not when the stream
    ends, 0.6 s later), carries the connector's verdict (from the file the target's connector wrote), as do
    the headers; every event and [DONE] are relayed, and the KV file and its verdict are removed after.
    Guards a router that buffers the whole stream, drops the verdict of a stream (vLLM streams no
    kv_transfer_params), or leaves files behind."""
    source, target, start, kv_dir = fakes
    streaming = Fake(target_answer(APPLIED, [{"choices": [{"text": " a"}]}, 0.3, {"choices": [{"text": " b"}]}, 0.3,
                                             {"choices": [{"text": " c"}]}, "[DONE]"]))
    h, got = events(start(target_url=streaming.url), {"prompt": "x y", "escalate": True})
    (t_first, first), *rest = got
    assert first["kvt"] == APPLIED and (h["x-kvt-status"], h["x-kvt-mapper-id"]) == ("applied", "m-1234"), (first, h)
    assert [e["choices"][0]["text"] for _, e in [got[0]] + rest[:-1]] == [" a", " b", " c"] and rest[-1][1] == "[DONE]"
    assert t_first < 0.3 and rest[-1][0] >= 0.6, f"first event at {t_first:.2f} s, the end at {rest[-1][0]:.2f} s"
    assert "stream" not in source.completions()[0], "the source's prefill must be one whole answer"
    assert not os.listdir(kv_dir), os.listdir(kv_dir)
    h, got = events(start(), {"prompt": "x y"})                               # the source's stream
    assert h["x-kvt-status"] == "source" and got[0][1]["kvt"] == {"status": "source"}, got
    streaming.server.shutdown()


def test_a_stream_cut_mid_way_ends_with_an_error_event(fakes):
    """A server that dies mid-stream (the connection closes before [DONE]): the client gets the events sent
    so far, then one error event naming the server, and the stream ends. A client that goes away mid-stream:
    the router closes the server's stream (vLLM aborts the request) and keeps serving. Guards a stream that
    ends as if complete, a client left waiting, and a router thread writing into a closed socket."""
    source, target, start, kv_dir = fakes
    dying = Fake(target_answer(APPLIED, [{"choices": [{"text": " a"}]}, "cut"]))
    h, got = events(start(target_url=dying.url), {"prompt": "x y", "escalate": True})
    assert [e["choices"][0]["text"] for _, e in got[:1]] == [" a"] and len(got) == 2, got
    assert got[1][1]["kvt"]["status"] == "error" and got[1][1]["error"]["message"].startswith("target server: "), got
    slow = Fake(target_answer(APPLIED, [{"choices": [{"text": " a"}]}] + [0.1, {"choices": [{"text": " b"}]}] * 30))
    url = start(target_url=slow.url)
    body = json.dumps({"prompt": "x y", "escalate": True, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b"data: {" not in got:                                     # the first event came
            got += client.recv(4096)
    # the client went away
    for _ in range(50):
        if slow.gone:
            break
        time.sleep(0.1)
    assert slow.gone, "the router kept reading the server's stream after its client went away"
    status, out = ask(url, {"prompt": "x y"})
    assert status == 200 and out["kvt"] == {"status": "source"}, out
    assert not os.listdir(kv_dir), os.listdir(kv_dir)
    dying.server.shutdown()
    slow.server.shutdown()


def test_what_the_router_does_not_take_is_a_400_with_a_kvt_status(fakes):
    """Guards: several prompts in one request (vLLM returns the verdict of the first only), a chat without
    messages, or an escalate flag that is not a boolean ("false" is truthy) forwarded as if understood, each
    refused in one line saying why; and a body that is not JSON ending as a traceback."""
    source, target, start, _ = fakes
    url = start()
    for body, why in (({"prompt": ["a", "b"]}, "first prompt only"), ({"prompt": [[1, 2]]}, "first prompt only"),
                      ({"prompt": "a", "escalate": "false"}, "escalate must be true or false"),
                      ({"messages": []}, "non-empty list of messages")):
        status, out = ask(url, body, CHAT if "messages" in body else "/v1/completions")
        assert status == 400 and out["kvt"]["status"] == "unsupported" and why in out["error"]["message"], (body, out)
    req = urllib.request.Request(url + "/v1/completions", b"{not json", {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and json.loads(e.value.read())["kvt"]["status"] == "error"
    assert not source.seen and not target.seen


def alive(pgid):
    """Whether any process of group pgid is still running (zombies left for init do not count)."""
    for stat in os.listdir("/proc"):
        try:
            fields = open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def test_a_server_that_fails_to_start_is_one_line_naming_its_cause_and_log(tmp_path):
    """Guards: the stack's error quoting the last line of a vLLM log (a resource_tracker warning at exit)
    instead of the exception that stopped it, or leaving out where the whole log is."""
    log = tmp_path / "target.log"
    log.write_text("(APIServer pid=1) WARNING [system_utils.py:255] This can cause fd limit errors like `OSError: [Errno 24]`\n"
                   "(Worker pid=2) ERROR [multiproc_executor.py:1063] kvt.config.KvtError: the target engine caches prefixes\n"
                   "RuntimeError: Engine core initialization failed. See root cause above.\n"
                   "  warnings.warn('resource_tracker: There appear to be %d '\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait()
    with pytest.raises(KvtError) as e:
        wait_healthy("target", proc, dead_url(), log, timeout=30)
    assert str(e.value) == (f"the target server exited with status 1 before it was healthy (kvt.config.KvtError: the "
                            f"target engine caches prefixes); its log: {log}"), str(e.value)


def test_stop_ends_the_whole_process_group():
    """Guards: stopping only each server's own process (p.terminate()), which leaves vLLM's engine core and
    workers (its children, in its process group) running as orphans."""
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60"], start_new_session=True)
    time.sleep(0.3)
    stop([proc])
    time.sleep(0.1)
    assert not alive(proc.pid), "a child of the server's process group is still running"


def test_the_router_imports_neither_vllm_nor_the_connector():
    """Guards: `from kvt.integrations.serving import connector_config` in the router, which would make it
    import vLLM (and so need the vLLM Python) only to route HTTP requests."""
    import ast

    import kvt.integrations.router as router
    tree = ast.parse(open(router.__file__).read())
    names = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {n for n in names if n.split(".")[0] == "vllm" or n.endswith("serving")}, names


# ---- the real stack: two vLLM servers and the router, on the toy pair (slow) --------------------------

def toy_mapper(tmp_path):
    """The mapper file of the documented command (run.py without tasks or bench, on the toy pair)."""
    from tests.conftest import ROOT
    r = subprocess.run([sys.executable, "run.py", "--tasks", "none", "--no-bench", "--out", str(tmp_path / "run")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    (mapper_file,) = (tmp_path / "run").glob("mapper-*.safetensors")
    return mapper_file


def start_stack(tmp_path, mapper_file, *args):
    """`python -m kvt.integrations.router stack` on the toy pair in the vLLM Python, each server on a core of its
    own: (the stack's process, {name: url}, {name: pid}) once it printed the router's line."""
    from tests.conftest import ROOT
    from tests.test_vllm import vllm_python
    err = open(tmp_path / "stack.err", "w")
    stack = subprocess.Popen([sys.executable, "-m", "kvt.integrations.router", "stack", "--source", "weights/toy-s",
                              "--target", "weights/toy-m", "--mapper", str(mapper_file),
                              "--vllm-python", vllm_python(tmp_path), "--kv-dir", str(tmp_path / "kv"),
                              "--port", str(free_port()), "--start-timeout", "240", "--source-cpus", "0",
                              "--target-cpus", str(os.cpu_count() - 1), *args],
                             cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=err,
                             text=True)
    urls, pids = {}, {}
    for line in stack.stdout:                       # "<name>  <url>  ... (pid N, log ...)", the router last
        name, urls[name] = line.split()[:2]
        pids.update({name: int(m.group(1)) for m in [re.search(r"\(pid (\d+)", line)] if m})
        if name == "router":
            break
    if "router" not in urls:
        stop_stack(stack, pids)
    assert "router" in urls, (tmp_path / "stack.err").read_text()[-3000:]
    return stack, urls, pids


def stop_stack(stack, pids):
    """SIGTERM to the stack; the names of the servers it left running (then killed)."""
    stack.send_signal(signal.SIGTERM)
    stack.wait(90)
    left = [name for name, pid in pids.items() if alive(pid)]
    for name in left:
        os.killpg(pids[name], signal.SIGKILL)
    return left


def through_router(url, ids, escalate, max_tokens):
    """A greedy completion through the router, with token ids and the first steps' top-5 logprobs."""
    return ask(url, {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": 5, "ignore_eos": True,
                     "return_token_ids": True, "return_tokens_as_token_ids": True, "escalate": escalate})


def first_logprobs(out):
    """{"token_id:123": logprob} of the first step -> {123: logprob}."""
    return {int(t.split(":")[1]): lp for t, lp in out["choices"][0]["logprobs"]["top_logprobs"][0].items()}


@pytest.mark.slow
def test_the_stack_in_bf16(tmp_path):
    """The documented stack with both servers in bf16 (vLLM's "amx" KV layout on a CPU with AMX tiles, "vec"
    without): an escalated request of 150 token ids through HTTP is applied, and its first-step logprobs and
    greedy tokens lie within bf16's own rounding of kvt's bf16 handoff (test_vllm.assert_like_kvt_bf16).
    Guards the bf16 path as deployed: the stack's --dtype reaching both servers, and their KV read and
    written in the layout vLLM's bf16 kernels use."""
    import kvt
    from kvt.harness import toy
    from kvt.harness.files import load_mapper
    from tests.conftest import ROOT
    from tests.test_vllm import NEW, assert_like_kvt_bf16

    mapper_file = toy_mapper(tmp_path)
    mapper, tok = load_mapper(mapper_file), kvt.load_tokenizer(ROOT / "weights" / "toy-m")
    p = tok.encode(" ".join(toy.corpus(40, seed=5)))[:150]
    stack, urls, pids = start_stack(tmp_path, mapper_file, "--dtype", "bfloat16")
    try:
        status, out = through_router(urls["router"], p, True, NEW)
    finally:
        left = stop_stack(stack, pids)
    assert not left, f"SIGTERM to the stack left these servers running: {left}"
    assert status == 200 and out["kvt"]["status"] == "applied" and out["kvt"]["slots"] == len(p) - 1, out["kvt"]
    assert_like_kvt_bf16(mapper, p, first_logprobs(out), out["choices"][0]["token_ids"], "through the router")


# a chat template for the toys, whose tokenizers have none (words of their vocabulary only)
TOY_CHAT = "{% for m in messages %}{{ m['content'] }} . {% endfor %}{% if add_generation_prompt %}so{% endif %}"


@pytest.fixture(scope="module")
def toy_stack(tmp_path_factory):
    """The documented stack (run.py's mapper, then `python -m kvt.integrations.router stack`) on the toy pair in
    the vLLM Python, with TOY_CHAT as both servers' chat template, and kvt's models of the same folders; the
    servers are stopped after the module's tests, and none may be left running."""
    import kvt
    from kvt.harness import toy
    from kvt.harness.files import load_mapper
    from tests.conftest import ROOT
    tmp = tmp_path_factory.mktemp("stack")
    mapper_file = toy_mapper(tmp)
    (tmp / "chat.jinja").write_text(TOY_CHAT)
    tok = kvt.load_tokenizer(ROOT / "weights" / "toy-m")
    stack, urls, pids = start_stack(tmp, mapper_file, "--chat-template", str(tmp / "chat.jinja"))
    try:
        yield dict(urls=urls, pids=pids, kv_dir=tmp / "kv", mapper=load_mapper(mapper_file), tok=tok,
                   ks=kvt.load_model(ROOT / "weights" / "toy-s"), kt=kvt.load_model(ROOT / "weights" / "toy-m"),
                   text=tok.encode(" ".join(toy.corpus(40, seed=5))))
    finally:
        left = stop_stack(stack, pids)
    assert not left, f"SIGTERM to the stack left these servers running: {left}"


@pytest.mark.slow
def test_the_stack_on_the_toy_pair(toy_stack):
    """Through the stack's router: an escalated request of 150 token ids is applied with T - 1 slots and its
    greedy tokens and first-step logprobs equal kvt's handoff + generate on the same mapper, a plain one the
    source's own; 8 clients x 25 mixed requests are all answered, no KV file left behind.
    Guards the router's HTTP bodies against the real server (kv_transfer_params in and out, the verdict's
    place) and the stack's command lines and connector configs."""
    import torch

    import kvt
    from kvt.handoff import handoff
    from tests.test_vllm import ATOL, NEW, own

    s = toy_stack
    ks, kt, mapper, text, kv_dir = s["ks"], s["kt"], s["mapper"], s["text"], s["kv_dir"]

    def request(ids, escalate, max_tokens=NEW):
        return through_router(s["urls"]["router"], ids, escalate, max_tokens)

    p = text[:150]
    ids = torch.tensor([p])
    status, out = request(p, True)
    assert status == 200 and out["kvt"]["status"] == "applied" and out["kvt"]["slots"] == len(p) - 1, out["kvt"]
    logits, cache = handoff(ks, kt, mapper, ids)
    want = logits[0, -1].log_softmax(-1)
    err_lp = max(abs(lp - want[t].item()) for t, lp in first_logprobs(out).items())
    assert err_lp <= ATOL, f"first-step logprobs differ from kvt's handoff by {err_lp:.2e}"
    assert out["choices"][0]["token_ids"] == kvt.generate(kt, logits[:, -1], cache, NEW)[0]

    status, out = request(p, False)
    own_lp, tokens = own(ks, ids)
    assert status == 200 and out["kvt"] == {"status": "source"}, out["kvt"]
    err_lp = max(abs(lp - own_lp[t].item()) for t, lp in first_logprobs(out).items())
    assert err_lp <= ATOL and out["choices"][0]["token_ids"] == tokens, f"the source's own: {err_lp:.2e}"

    answers = {}                                 # 8 clients x 25 requests, every other one escalated

    def client(c):
        for j in range(25):
            n = 20 + 23 * (25 * c + j) % 200
            answers[c, j] = (j + c) % 2 == 0, request(text[:n], (j + c) % 2 == 0, max_tokens=4)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(8)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    tally = Counter(out["kvt"]["status"] for _, (_, out) in answers.values())
    print(f"\nload: {len(answers)} of 200 requests answered in {time.perf_counter() - t0:.1f} s, by status: "
          f"{dict(tally)}")
    assert len(answers) == 200, f"{200 - len(answers)} requests unanswered"
    for (c, j), (escalated, (status, out)) in answers.items():
        assert status == 200, (c, j, out)
        if not escalated:
            assert out["kvt"] == {"status": "source"}, (c, j, out["kvt"])
        else:
            assert out["kvt"]["status"] == "applied" or \
                out["kvt"]["status"] == "fallback_reprefill" and out["kvt"]["reason"], (c, j, out["kvt"])
    assert not list(kv_dir.glob("*.kv.safetensors*")), "KV files left behind"


def openai_extra(escalate):
    """The body fields the openai client has no argument for: the router's flag and vLLM's greedy-run fields."""
    return {"escalate": escalate, "ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True}


@pytest.mark.slow
def test_the_openai_client_through_the_stack(toy_stack):
    """The official openai package against the router: completions and chat, whole and streamed, escalated and
    not. Escalated: status applied with T - 1 slots in the JSON (or the first chunk) and in x-kvt-status,
    x-kvt-mapper-id the mapper's id, greedy tokens those of kvt's handoff + generate on the same mapper (the
    chat's prompt: the target's own rendering, from its /tokenize), first-step logprobs within 2e-4 where
    whole; not escalated: the source's own tokens, status source. GET /v1/models lists both models.
    Guards what real clients send and read: the chat endpoint, SSE framing the client parses, the verdict of
    a stream (vLLM streams none), headers, and the chat's ids rendered differently for the source's KV than
    the target's prompt (every chat would fall back)."""
    import openai
    import torch

    import kvt
    from kvt.handoff import handoff
    from tests.test_vllm import ATOL, NEW, own

    s = toy_stack
    ks, kt, mapper = s["ks"], s["kt"], s["mapper"]
    client = openai.OpenAI(base_url=s["urls"]["router"] + "/v1", api_key="none", max_retries=0)
    models = client.models.list().data
    assert [m.model_extra["kvt_role"] for m in models] == ["source", "target"], models
    messages = [{"role": "user", "content": " ".join(s["tok"].decode(s["text"][:60]).split()[:40])}]
    chat_ids = ask(s["urls"]["target"], {"messages": messages}, "/tokenize")[1]["tokens"]
    cases = []
    for kind in ("completions", "chat"):
        for stream in (False, True):
            for escalate in (False, True):
                cases.append((kind, stream, escalate))
    for kind, stream, escalate in cases:
        what = f"{kind}, {'streamed' if stream else 'whole'}, {'escalated' if escalate else 'plain'}"
        args = dict(model="toy", max_tokens=NEW, temperature=0, extra_body=openai_extra(escalate), stream=stream)
        if kind == "completions":
            prompt = s["text"][:90]
            raw = client.completions.with_raw_response.create(prompt=prompt, logprobs=5, **args)
        else:
            prompt = chat_ids
            raw = client.chat.completions.with_raw_response.create(messages=messages, logprobs=True, top_logprobs=5,
                                                                   **args)
        out = raw.parse()
        if stream:
            chunks = list(out)
            verdict = chunks[0].model_extra["kvt"]
            tokens = [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])]
        else:
            verdict = out.model_extra["kvt"]
            tokens = out.choices[0].model_extra["token_ids"]
            if kind == "completions":
                top = out.choices[0].logprobs.top_logprobs[0]
            else:
                top = {t.token: t.logprob for t in out.choices[0].logprobs.content[0].top_logprobs}
            got = {int(t.split(":")[1]): lp for t, lp in top.items()}
        ids = torch.tensor([prompt])
        if escalate:
            assert verdict["status"] == "applied" and verdict["slots"] == len(prompt) - 1, (what, verdict)
            assert (raw.headers["x-kvt-status"], raw.headers["x-kvt-mapper-id"]) == ("applied", verdict["mapper"]), what
            logits, cache = handoff(ks, kt, mapper, ids)
            want_lp, want = logits[0, -1].log_softmax(-1), kvt.generate(kt, logits[:, -1], cache, NEW)[0]
        else:
            assert verdict == {"status": "source"} and raw.headers["x-kvt-status"] == "source", (what, verdict)
            want_lp, want = own(ks, ids)
        assert tokens == want, f"{what}: tokens {tokens}, kvt's {want}"
        if not stream:
            err = max(abs(lp - want_lp[t].item()) for t, lp in got.items())
            assert err <= ATOL, f"{what}: first-step logprobs {err:.2e} from kvt's"
    assert not list(s["kv_dir"].glob("*.kv.safetensors*")), "KV files left behind"


def metric(url, name):
    """The sum of a Prometheus counter's samples on a vLLM server's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(l.rsplit(" ", 1)[1]) for l in lines if l.startswith(name + "{") or l.startswith(name + " "))


@pytest.mark.slow
def test_mapped_kv_is_never_served_as_an_exact_prefix_hit(toy_stack):
    """vLLM RFC #44223: approximate KV must not become exact prefix-cache state. After a prompt's mapped
    (applied) request, the same prompt sent to the target server itself is answered from the target's own
    prefill (first-step logprobs within 2e-4 of kvt's target alone, and apart from the mapped answer's), twice,
    and the target's prefix cache has had no hit. Guards a target started with prefix caching (the stack's
    --no-enable-prefix-caching dropped and the connector's refusal with it): the mapped blocks would be
    committed under the prompt's exact hashes and served to the plain request as if computed."""
    import torch

    from kvt.handoff import handoff
    from tests.test_vllm import ATOL, NEW, own

    s = toy_stack
    p = s["text"][:140]
    status, out = through_router(s["urls"]["router"], p, True, NEW)
    assert out["kvt"]["status"] == "applied", out["kvt"]
    mapped = first_logprobs(out)
    own_lp, tokens = own(s["kt"], torch.tensor([p]))
    logits, _ = handoff(s["ks"], s["kt"], s["mapper"], torch.tensor([p]))
    assert max(abs(lp - logits[0, -1].log_softmax(-1)[t].item()) for t, lp in mapped.items()) <= ATOL
    for _ in range(2):
        status, plain = ask(s["urls"]["target"], {k: v for k, v in {
            "prompt": p, "max_tokens": NEW, "temperature": 0, "logprobs": 5, "ignore_eos": True,
            "return_token_ids": True, "return_tokens_as_token_ids": True}.items()})
        got = first_logprobs(plain)
        err = max(abs(lp - own_lp[t].item()) for t, lp in got.items())
        assert err <= ATOL and plain["choices"][0]["token_ids"] == tokens, f"not the target's own prefill: {err:.2e}"
        assert max(abs(lp - mapped[t]) for t, lp in got.items() if t in mapped) > 10 * ATOL, "served the mapped KV"
    assert metric(s["urls"]["target"], "vllm:prefix_cache_hits_total") == 0


@pytest.mark.slow
def test_mid_stream_faults_end_cleanly(toy_stack):
    """Faults in the middle of a stream, through the openai client: a client that goes away after three
    chunks of a long escalated stream leaves the router and both servers serving (the next escalated request
    is applied, and the target is running no request within 10 s: vLLM aborted the abandoned one); the source
    server killed (SIGKILL to its process group) while it streams a long answer ends the client's stream
    with an error event naming the source, within 60 s, never a hang; then escalated requests are answered
    by the target's own prefill, fallback_reprefill with "source server: ...". Last in the module: it kills
    the source. Guards a router thread stuck on a dead or abandoned stream, and a stream cut short that the
    client takes for a complete answer."""
    import openai
    import torch

    from tests.test_vllm import own

    s = toy_stack
    client = openai.OpenAI(base_url=s["urls"]["router"] + "/v1", api_key="none", max_retries=0, timeout=60)
    long = dict(model="toy", prompt=s["text"][:30], max_tokens=1900, temperature=0, stream=True)
    stream = client.completions.create(**long, extra_body=openai_extra(True))
    for _, chunk in zip(range(3), stream):
        assert chunk.choices[0].text is not None
    stream.close()                                                # the client goes away
    for _ in range(100):
        if metric(s["urls"]["target"], "vllm:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert metric(s["urls"]["target"], "vllm:num_requests_running") == 0, "the abandoned request still runs"
    status, out = through_router(s["urls"]["router"], s["text"][:50], True, 4)
    assert status == 200 and out["kvt"]["status"] == "applied", out["kvt"]

    stream = client.completions.create(**long, extra_body=openai_extra(False))
    ended = {}

    def read():
        try:
            ended["chunks"] = sum(1 for _ in stream)
        except openai.APIError as e:
            ended["error"] = str(e)

    first = next(iter(stream))
    assert first.model_extra["kvt"] == {"status": "source"}
    os.killpg(s["pids"]["source"], signal.SIGKILL)                # the source server dies mid-stream
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(60)
    assert ended, "the client's stream hung after the source server died"
    assert "source server" in ended.get("error", ""), f"the stream ended without an error event: {ended}"
    while alive(s["pids"]["source"]):
        time.sleep(0.2)
    for n in (30, 90):
        status, out = through_router(s["urls"]["router"], s["text"][:n], True, 8)
        assert status == 200 and out["kvt"]["status"] == "fallback_reprefill", out
        assert out["kvt"]["reason"].startswith("source server: "), out["kvt"]
        assert out["choices"][0]["token_ids"] == own(s["kt"], torch.tensor([s["text"][:n]]))[1], "the target's own"
