"""Routing: an OpenAI-compatible router in front of two vLLM servers, a small source model and a large target.

    python -m kvt.integrations.router serve --source http://127.0.0.1:8001 --target http://127.0.0.1:8002 --kv-dir DIR
    python -m kvt.integrations.router stack --source weights/toy-s --target weights/toy-m --mapper m.safetensors

`serve` routes for two servers already running with kvt's connector (serving.py); `stack` starts both
(`vllm serve`'s API server in --vllm-python, on free ports of 127.0.0.1) and the router, prints the three URLs,
and stops them all on Ctrl-C or SIGTERM.

The router answers POST /v1/completions (an OpenAI completions body: one prompt, a string or a list of token
ids) and POST /v1/chat/completions (a chat body with "messages"), whole or streamed ("stream": true), GET
/v1/models (both servers' models, each with its "kvt_role") and GET /health (with the answers served, by kvt
status). The rule: a request escalates to the target when its body says
"escalate": true (a router-only field, removed before forwarding), or when its prompt holds at least
--escalate-at tokens (0: never by length; a string is counted by the source server's POST /tokenize, a list
of ids is its own count; a source that cannot count it escalates it, since the target can prefill it alone).
A chat that may escalate is rendered once, by the target server's POST /tokenize with its messages (the
target's chat template): the source saves KV for exactly those ids, which the target's chat endpoint renders
again; a model without a chat template answers with its own error, passed on.
"model" is dropped: the router picks the server.

- Not escalated: the body goes to the source as is; the answer is the source's, with "kvt": {"status": "source"}.
- Escalated, as vLLM's disaggregated-serving proxies do: (a) the source prefills the prompt (max_tokens 1)
  and saves its KV, kv_transfer_params {"kvt_save": "<kv-dir>/<uuid>.kv.safetensors"}; (b) the target gets the
  original body with {"kvt_load": that path}, maps T - 1 slots and runs the last prompt token; (c) the answer
  is the target's, with "kvt" = its kv_transfer_params["kvt"], the connector's verdict, passed on unchanged
  ({"status": "applied", "mapper": id, "slots": T - 1}, or "fallback_reprefill" / "unsupported" with a
  "reason"). The KV file is deleted afterwards. When (a) fails (refused, timed out, an HTTP error), (b) goes
  without the file and "kvt" is {"status": "fallback_reprefill", "reason": "source server: <why>"}.
- A server that fails its part: HTTP 502 (or its own 4xx, a bad request) with a JSON error naming it and
  "kvt": {"status": "error", "reason": ...}. Every answer carries a "kvt" status, never a traceback, and the
  headers x-kvt-status (and x-kvt-mapper-id where applied), as semantic-router names its KV-transfer status.
- A stream is relayed event by event as the server sends it; the headers and the first event (with "kvt")
  go out when the server's first event arrives. vLLM streams no kv_transfer_params, so the target's connector
  also writes its verdict to the file kv_transfer_params["kvt_verdict"] names, decided before the first token.
  A server that dies or stalls (--timeout) mid-stream ends the stream with one error event; a client that
  goes away closes the server's stream, and vLLM aborts the request.

vLLM 0.32's OpenAI server copies a completions body's kv_transfer_params into SamplingParams.extra_args
(vllm/entrypoints/openai/completion/protocol.py, to_sampling_params), where the connector reads it as
request.kv_transfer_params (vllm/v1/request.py), and returns the connector's request_finished params as the
response's kv_transfer_params (completion/serving.py; chat_completion/ the same for chats). The standard library only: no vLLM, no torch here.
"""
import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import threading
import urllib.error
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kvt.config import KvtError, command


# ---- talking to a server -----------------------------------------------------------------------------

class Failed(Exception):
    """A server's part failed: str(e) is one line naming the server; status is what the client gets."""

    def __init__(self, who, why, status=502):
        super().__init__(f"{who}: {why}")
        self.status = status


def call(who, url, body, timeout):
    """POST body as JSON (GET when body is None) to url; the open response (HTTP 200), or Failed naming who."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:       # the server answered with an error: its message, first line
        text = e.read().decode(errors="replace")
        try:
            text = str(json.loads(text)["error"]["message"])   # vLLM's {"error": {"message": ...}}
        except (ValueError, KeyError, TypeError):
            pass
        first = (text.strip().splitlines() or [str(e.reason)])[0][:300]
        raise Failed(who, f"HTTP {e.code}: {first}", e.code if 400 <= e.code < 500 else 502) from None
    except (OSError, http.client.HTTPException, ValueError) as e:  # refused, timed out, cut off
        raise Failed(who, str(getattr(e, "reason", e)) or type(e).__name__) from None


def post(who, url, body, timeout):
    """POST body as JSON to url (GET when body is None); the JSON answer, or Failed naming who."""
    with call(who, url, body, timeout) as r:
        try:
            return json.loads(r.read())
        except (OSError, http.client.HTTPException, ValueError) as e:   # cut off, not JSON
            raise Failed(who, str(e) or type(e).__name__) from None


def error(status, why, kvt_status="error"):
    """An OpenAI-style error body that carries a kvt status too."""
    return {"error": {"message": why, "type": http.client.responses.get(status, "Error"), "code": status},
            "kvt": {"status": kvt_status, "reason": why}}


# ---- the rule and the two flows ----------------------------------------------------------------------

@dataclass
class Router:
    source: str           # base URL of the source server, http://host:port
    target: str
    kv_dir: str           # where the source saves KV files and the target reads them (a disk both see)
    escalate_at: int = 0  # prompt tokens from which a request escalates; 0: never by length
    timeout: float = 600  # seconds for each call to a server (and for each chunk of a stream)
    served: Counter = field(default_factory=Counter)   # answers by kvt status, for GET /health
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, status):
        with self.lock:
            self.served[status] += 1


@dataclass
class Stream:
    """A server's open text/event-stream response to relay, and how to learn the kvt verdict once its first
    event is there (the target's connector has decided by then: vLLM streams no kv_transfer_params)."""
    response: http.client.HTTPResponse
    verdict: object       # () -> the kvt verdict
    who: str
    done: object = None   # () -> None, once relayed: removes the KV file


CHAT = "/v1/chat/completions"
RENDER = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
          "chat_template_kwargs", "tools")                 # what vLLM's /tokenize needs to render a chat as the
                                                           # target's chat endpoint will


def render(r, body):
    """A chat's token ids, rendered once with the target's chat template by the target's own /tokenize: the
    ids the source saves KV for and the target's chat endpoint renders again. Failed (the server's own
    error, e.g. a model without a chat template) is passed on."""
    return post("target server", r.target + "/tokenize", {k: body[k] for k in RENDER if k in body},
                r.timeout)["tokens"]


def escalates(r, flag, prompt, add_special_tokens=True):
    """The rule (the module's docstring): the flag, or the prompt's length from escalate_at on."""
    if flag or not r.escalate_at:
        return bool(flag)
    if isinstance(prompt, list):
        return len(prompt) >= r.escalate_at
    try:
        n = post("source server", r.source + "/tokenize",
                 {"prompt": prompt, "add_special_tokens": add_special_tokens}, r.timeout)["count"]
    except Failed:
        return True   # the source cannot count it (down?); the target can prefill it alone
    return n >= r.escalate_at


def refused(path, flag, body):
    """Why the router cannot take this body (one line), or None."""
    if not isinstance(flag, bool):
        return f"escalate must be true or false, not {flag!r}"
    if path == CHAT:
        messages = body.get("messages")
        return None if isinstance(messages, list) and messages else "a chat request needs a non-empty list of messages"
    prompt = body.get("prompt")
    if isinstance(prompt, str) or isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return None
    return ("one prompt per request (a string or a list of token ids): vLLM returns the kv_transfer_params of a "
            "batch's first prompt only, so the others' kvt verdicts would be lost; send each prompt on its own")


def forward(who, url, body, timeout, verdict):
    """(200, answer with "kvt": verdict()) from a server; a Stream when the body asks for one."""
    if body.get("stream"):
        response = call(who, url, body, timeout)
        return 200, Stream(response, verdict, who)
    out = post(who, url, body, timeout)
    return 200, {**out, "kvt": verdict(out)}


def route(r, path, body):
    """(HTTP status, answer) for a completions or chat body: the rule, then the source alone or both servers.
    The answer is JSON with its "kvt" status, or a Stream to relay."""
    flag = body.get("escalate", False)
    body = {k: v for k, v in body.items() if k not in ("escalate", "model")}
    why = refused(path, flag, body)
    if why:
        return 400, error(400, why, "unsupported")
    try:
        if path == CHAT:
            ids = render(r, body) if flag or r.escalate_at else None
            up = escalates(r, flag, ids)
        else:
            ids, up = body["prompt"], escalates(r, flag, body["prompt"], body.get("add_special_tokens", True))
        if not up:
            return forward("source server", r.source + path, body, r.timeout, lambda out=None: {"status": "source"})
    except Failed as e:
        return e.status, error(e.status, str(e))
    path_kv = os.path.join(r.kv_dir, f"{uuid.uuid4().hex}.kv.safetensors")
    prefill = {"prompt": ids} if path == CHAT else {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    try:   # (a) the source prefills the prompt and saves its KV; the one token it makes is dropped
        post("source server", r.source + "/v1/completions",
             {**prefill, "max_tokens": 1, "min_tokens": 0, "n": 1, "kv_transfer_params": {"kvt_save": path_kv}},
             r.timeout)
        load, known = {"kv_transfer_params": {"kvt_load": path_kv, "kvt_verdict": path_kv + ".verdict.json"}}, None
    except Failed as e:
        load, known = {}, {"status": "fallback_reprefill", "reason": str(e)}

    def verdict(out=None):
        """The connector's verdict: in a whole answer's kv_transfer_params, else the file it wrote."""
        found = (out or {}).get("kv_transfer_params") or {}
        if not found and load and os.path.exists(path_kv + ".verdict.json"):
            found = {"kvt": json.loads(Path(path_kv + ".verdict.json").read_text())}
        return known or found.get("kvt") or {"status": "fallback_reprefill", "reason": "the target server gave no kvt "
                                                                                      "verdict (is kvt's connector on?)"}
    try:   # (b) the target maps the file's T - 1 slots and runs the last token (or prefills it all)
        status, out = forward("target server", r.target + path, {**body, **load}, r.timeout, verdict)
    except Failed as e:
        remove(path_kv)
        return e.status, error(e.status, str(e))
    except BaseException:
        remove(path_kv)
        raise
    if isinstance(out, Stream):
        out.done = lambda: remove(path_kv)                     # once the stream is relayed
    else:
        remove(path_kv)
    return status, out


def remove(path_kv):
    """The KV file and the connector's verdict beside it, once the target is done with them."""
    for p in (path_kv, path_kv + ".verdict.json"):
        if os.path.exists(p):
            os.remove(p)


def headers(verdict):
    """The kvt status as routers send it (semantic-router's x-vsr-kv-transfer-status and mapper id)."""
    out = {"x-kvt-status": str(verdict.get("status", "unknown"))}
    if verdict.get("status") == "applied" and verdict.get("mapper"):
        out["x-kvt-mapper-id"] = str(verdict["mapper"])
    return out


class Handler(BaseHTTPRequestHandler):
    """POST /v1/completions and /v1/chat/completions through route(); GET /v1/models and /health.
    self.server.router is the Router."""

    PATHS = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health"

    def do_GET(self):
        r = self.server.router
        if self.path == "/health":
            with r.lock:
                return self.reply(200, {"status": "ok", "served": dict(r.served)})
        if self.path == "/v1/models":
            try:
                data = [{**m, "kvt_role": who} for who, url in (("source", r.source), ("target", r.target))
                        for m in post(f"{who} server", url + "/v1/models", None, r.timeout)["data"]]
            except Failed as e:
                return self.reply(e.status, error(e.status, str(e)))
            return self.reply(200, {"object": "list", "data": data})
        self.reply(404, error(404, f"no GET {self.path} here ({self.PATHS})"))

    def do_POST(self):
        if self.path not in ("/v1/completions", CHAT):
            return self.reply(404, error(404, f"no POST {self.path} here ({self.PATHS})"))
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except ValueError as e:
            return self.reply(400, error(400, f"the body is not JSON ({e})"))
        if not isinstance(body, dict):
            return self.reply(400, error(400, "the body is not a JSON object"))
        try:
            status, out = route(self.server.router, self.path, body)
        except Exception as e:  # a bug of the router's own: still one JSON line for the client, never a traceback
            status, out = 500, error(500, f"router: {type(e).__name__}: {e}")
        if isinstance(out, Stream):
            try:
                return self.relay(out)
            finally:
                out.response.close()
                if out.done:
                    out.done()
        self.reply(status, out, counted=True)

    def reply(self, status, out, counted=False):
        if counted:                                           # an answer to a completions or chat request
            self.server.router.count(out["kvt"].get("status", "unknown"))
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers(out["kvt"]) if "kvt" in out else {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def relay(self, stream):
        """Relay a server's server-sent events as they arrive: headers and the first event (with "kvt") when
        its first event is there. A server that stops mid-stream (killed, timed out) ends it with an error
        event; a client that goes away closes the server's stream (vLLM then aborts the request)."""
        verdict, ended = None, False
        try:
            for line in stream.response:                      # b"data: {...}\n", b"\n", ..., b"data: [DONE]\n"
                if verdict is None and line.startswith(b"data: {"):
                    verdict = stream.verdict()
                    line = b"data: " + json.dumps({**json.loads(line[6:]), "kvt": verdict}).encode() + b"\n"
                    self.start_events(verdict)
                if verdict is None:
                    continue                                  # nothing before the first event
                self.wfile.write(line)
                if line == b"\n":
                    self.wfile.flush()
                ended = ended or line.startswith(b"data: [DONE]")
            why = None if ended else f"{stream.who}: the stream ended before [DONE]"
        except (BrokenPipeError, ConnectionResetError):      # the client went away: stop reading the server
            return self.server.router.count("client_gone")
        except (OSError, http.client.HTTPException) as e:    # the server died or stalled mid-stream
            why = f"{stream.who}: {str(e) or type(e).__name__} mid-stream"
        if why is None:
            return self.server.router.count(verdict.get("status", "unknown"))
        if verdict is None:
            return self.reply(502, error(502, why), counted=True)
        self.server.router.count("error")
        try:
            self.wfile.write(b"data: " + json.dumps(error(502, why)).encode() + b"\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def start_events(self, verdict):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        for k, v in headers(verdict).items():
            self.send_header(k, v)
        self.end_headers()


def make_server(router, host="127.0.0.1", port=0):
    """A ThreadingHTTPServer for router (port 0: a free one; server.server_address says which)."""
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.router = router
    return server


# ---- the stack: two vLLM servers and the router ------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connector_configs(py, mapper):
    """The source's and the target's --kv-transfer-config, from serving.connector_config run in py (it
    imports vLLM, so not here): one place says how an engine names kvt's connector."""
    code = ("import json; from kvt.integrations.serving import connector_config; "
            f"print(json.dumps([connector_config(role='kv_producer'), connector_config({str(mapper)!r})]))")
    p = subprocess.run([py, "-c", code], capture_output=True, text=True)
    if p.returncode:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise KvtError(f"{py} cannot give kvt's connector config ({last}); run from the repository root, "
                       "in a Python with vLLM (docs/serving.md, Install)")
    return json.loads(p.stdout.strip().splitlines()[-1])


def start_vllm(py, model, port, config, log, a, cpus=None, *extra):
    """vLLM's OpenAI API server for model on 127.0.0.1:port, in a process group of its own (stopped whole);
    cpus: the cores its engine's threads are bound to (VLLM_CPU_OMP_THREADS_BIND), None: vLLM's choice."""
    argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", a.dtype, "--enforce-eager", "--max-model-len", str(a.max_model_len),
            "--seed", "0", "--kv-transfer-config", json.dumps(config), *extra]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           **({"VLLM_CPU_OMP_THREADS_BIND": cpus} if cpus else {})}
    return subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


ERROR_LINE = re.compile(r"(?:^|\] )([\w.]*(?:Error|Exception): .+)")   # "kvt.config.KvtError: ..." in a log line


def cause(log):
    """The first exception a server's log names (vLLM logs the root cause first, each process's again), else
    its last line."""
    lines = [l.strip() for l in Path(log).read_text(errors="replace").splitlines() if l.strip()]
    found = [m.group(1) for l in lines for m in [ERROR_LINE.search(l)] if m]
    return (found or lines[-1:] or ["no output"])[0][:300]


def wait_healthy(name, proc, url, log, timeout):
    """Return once url/health answers 200; a one-line KvtError when the server exits or takes too long."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise KvtError(f"the {name} server exited with status {proc.returncode} before it was healthy "
                           f"({cause(log)}); its log: {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(1)
    raise KvtError(f"the {name} server was not healthy after {timeout} s; its log: {log}")


def stop(procs):
    """SIGTERM each process group, SIGKILL what is left after 30 s: no orphaned engine processes."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)   # the group's other processes (engine core, workers), if any
        except ProcessLookupError:
            pass
        p.wait()


def interrupted(signum, frame):
    raise KeyboardInterrupt


def stack(a):
    py = a.vllm_python or sys.executable
    work = Path(a.kv_dir or tempfile.mkdtemp(prefix="kvt-stack-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    src_config, tgt_config = connector_configs(py, Path(a.mapper).resolve())
    signal.signal(signal.SIGTERM, interrupted)     # SIGTERM stops the children as Ctrl-C does
    servers, procs = {}, []
    try:
        chat = ("--chat-template", str(Path(a.chat_template).resolve())) if a.chat_template else ()
        for name, model, config, cpus, extra in (
                ("source", a.source, src_config, a.source_cpus, chat),
                ("target", a.target, tgt_config, a.target_cpus, ("--no-enable-prefix-caching", *chat))):
            port, log = free_port(), work / f"{name}.log"
            procs.append(start_vllm(py, model, port, config, log, a, cpus, *extra))
            servers[name] = (f"http://127.0.0.1:{port}", procs[-1], log, model)
        for name, (url, proc, log, _) in servers.items():
            wait_healthy(name, proc, url, log, a.start_timeout)
        server = make_server(Router(servers["source"][0], servers["target"][0], str(work), a.escalate_at),
                             a.host, a.port)
        for name, (url, proc, log, model) in servers.items():
            print(f"{name}  {url}  {model}  (pid {proc.pid}, log {log})")
        print(f"router  http://{a.host}:{server.server_address[1]}  (escalate at {a.escalate_at or 'never by'} "
              f"tokens; KV files in {work})", flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopping the servers", flush=True)
    finally:
        stop(procs)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvt.integrations.router", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("serve", help="route for two running vLLM servers with kvt's connector")
    s.add_argument("--source", required=True, help="the source server's URL, http://host:port")
    s.add_argument("--target", required=True, help="the target server's URL")
    s.add_argument("--kv-dir", required=True, help="folder for the KV files, on a disk both servers see")
    t = sub.add_parser("stack", help="start a source and a target vLLM server and the router in front")
    t.add_argument("--source", required=True, type=Path, help="source checkpoint folder")
    t.add_argument("--target", required=True, type=Path, help="target checkpoint folder")
    t.add_argument("--mapper", required=True, type=Path, help="the mapper file (run.py writes runs/<s>_<t>/mapper-*)")
    t.add_argument("--vllm-python", help="a Python with vLLM (default: this one)")
    t.add_argument("--kv-dir", help="folder for the KV files and the servers' logs (default: a new temporary one)")
    t.add_argument("--dtype", default="float32", help="the servers' dtype: float32 or bfloat16 (kvt's connector reads both)")
    t.add_argument("--max-model-len", type=int, default=2048)
    t.add_argument("--chat-template", type=Path, help="a Jinja chat template for both servers (vLLM's --chat-template), "
                   "for models whose tokenizer has none")
    t.add_argument("--start-timeout", type=float, default=600, help="seconds to wait for each server's /health")
    for side in ("source", "target"):
        t.add_argument(f"--{side}-cpus", help=f"the cores the {side} server's engine runs on, e.g. 0 or 0-7 "
                       "(VLLM_CPU_OMP_THREADS_BIND; default vLLM's: every core). On one machine give each server "
                       "its own: two engines whose threads share cores wait on each other")
    for p in (s, t):
        p.add_argument("--escalate-at", type=int, default=0, help="escalate prompts of this many tokens or more "
                                                                  "(0: only when the body says escalate)")
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=8000, help="the router's port")
    a = ap.parse_args(argv)
    if a.what == "stack":
        return stack(a)
    Path(a.kv_dir).mkdir(parents=True, exist_ok=True)
    server = make_server(Router(a.source.rstrip("/"), a.target.rstrip("/"), str(Path(a.kv_dir).resolve()),
                                a.escalate_at), a.host, a.port)
    print(f"router  http://{a.host}:{server.server_address[1]}  -> source {a.source}, target {a.target}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    command(main)
