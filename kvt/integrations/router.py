"""Routing: an OpenAI-compatible router in front of two vLLM servers, a small source model and a large target.

    python -m kvt.integrations.router serve --source http://127.0.0.1:8001 --target http://127.0.0.1:8002 --kv-dir DIR
    python -m kvt.integrations.router stack --source weights/toy-s --target weights/toy-m --mapper m.safetensors

`serve` routes for two servers already running with kvt's connector (serving.py); `stack` starts both
(`vllm serve`'s API server in --vllm-python, on free ports of 127.0.0.1) and the router, prints the three URLs,
and stops them all on Ctrl-C or SIGTERM.

The router answers POST /v1/completions (an OpenAI completions body: one prompt, a string or a list of token
ids; no streaming) and GET /health. The rule: a request escalates to the target when its body says
"escalate": true (a router-only field, removed before forwarding), or when its prompt holds at least
--escalate-at tokens (0: never by length; a string is counted by the source server's POST /tokenize, a list
of ids is its own count; a source that cannot count it escalates it, since the target can prefill it alone).
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
  "kvt": {"status": "error", "reason": ...}. Every answer carries a "kvt" status, never a traceback.

vLLM 0.32's OpenAI server copies a completions body's kv_transfer_params into SamplingParams.extra_args
(vllm/entrypoints/openai/completion/protocol.py, to_sampling_params), where the connector reads it as
request.kv_transfer_params (vllm/v1/request.py), and returns the connector's request_finished params as the
response's kv_transfer_params (completion/serving.py). The standard library only: no vLLM, no torch here.
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
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kvt.config import KvtError, command


# ---- talking to a server -----------------------------------------------------------------------------

class Failed(Exception):
    """A server's part failed: str(e) is one line naming the server; status is what the client gets."""

    def __init__(self, who, why, status=502):
        super().__init__(f"{who}: {why}")
        self.status = status


def post(who, url, body, timeout):
    """POST body as JSON to url; the JSON answer, or Failed naming who."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:       # the server answered with an error: its message, first line
        text = e.read().decode(errors="replace")
        try:
            text = str(json.loads(text)["error"]["message"])   # vLLM's {"error": {"message": ...}}
        except (ValueError, KeyError, TypeError):
            pass
        first = (text.strip().splitlines() or [str(e.reason)])[0][:300]
        raise Failed(who, f"HTTP {e.code}: {first}", e.code if 400 <= e.code < 500 else 502) from None
    except (OSError, http.client.HTTPException, ValueError) as e:  # refused, timed out, cut off, not JSON
        raise Failed(who, str(getattr(e, "reason", e)) or type(e).__name__) from None


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
    timeout: float = 600  # seconds for each call to a server


def escalates(r, flag, body):
    """The rule (the module's docstring): the flag, or the prompt's length from escalate_at on."""
    if flag or not r.escalate_at:
        return bool(flag)
    prompt = body["prompt"]
    if isinstance(prompt, list):
        return len(prompt) >= r.escalate_at
    try:
        n = post("source server", r.source + "/tokenize",
                 {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}, r.timeout)["count"]
    except Failed:
        return True   # the source cannot count it (down?); the target can prefill it alone
    return n >= r.escalate_at


def route(r, body):
    """(HTTP status, JSON answer) for a completions body: the rule, then the source alone or both servers."""
    flag = body.get("escalate", False)
    body = {k: v for k, v in body.items() if k not in ("escalate", "model")}
    prompt = body.get("prompt")
    if not isinstance(flag, bool):
        return 400, error(400, f"escalate must be true or false, not {flag!r}", "unsupported")
    if body.get("stream"):
        return 400, error(400, "the router answers whole responses: stream is not supported", "unsupported")
    if not (isinstance(prompt, str) or isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        return 400, error(400, "one prompt per request: a string or a list of token ids", "unsupported")
    if not escalates(r, flag, body):
        try:
            out = post("source server", r.source + "/v1/completions", body, r.timeout)
        except Failed as e:
            return e.status, error(e.status, str(e))
        return 200, {**out, "kvt": {"status": "source"}}
    path = os.path.join(r.kv_dir, f"{uuid.uuid4().hex}.kv.safetensors")
    try:
        try:   # (a) the source prefills the prompt and saves its KV; the one token it makes is dropped
            post("source server", r.source + "/v1/completions",
                 {**body, "max_tokens": 1, "min_tokens": 0, "n": 1, "kv_transfer_params": {"kvt_save": path}},
                 r.timeout)
            load, verdict = {"kv_transfer_params": {"kvt_load": path}}, None
        except Failed as e:
            load, verdict = {}, {"status": "fallback_reprefill", "reason": str(e)}
        try:   # (b) the target maps the file's T - 1 slots and runs the last token (or prefills it all)
            out = post("target server", r.target + "/v1/completions", {**body, **load}, r.timeout)
        except Failed as e:
            return e.status, error(e.status, str(e))
        verdict = verdict or (out.get("kv_transfer_params") or {}).get("kvt") or \
            {"status": "fallback_reprefill", "reason": "the target server gave no kvt verdict (is kvt's connector on?)"}
        return 200, {**out, "kvt": verdict}
    finally:
        if os.path.exists(path):
            os.remove(path)


class Handler(BaseHTTPRequestHandler):
    """POST /v1/completions through route(); GET /health. self.server.router is the Router."""

    def do_GET(self):
        if self.path == "/health":
            return self.reply(200, {"status": "ok"})
        self.reply(404, error(404, f"no GET {self.path} here (POST /v1/completions, GET /health)"))

    def do_POST(self):
        if self.path != "/v1/completions":
            return self.reply(404, error(404, f"no POST {self.path} here (POST /v1/completions, GET /health)"))
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except ValueError as e:
            return self.reply(400, error(400, f"the body is not JSON ({e})"))
        if not isinstance(body, dict):
            return self.reply(400, error(400, "the body is not a JSON object"))
        try:
            status, out = route(self.server.router, body)
        except Exception as e:  # a bug of the router's own: still one JSON line for the client, never a traceback
            status, out = 500, error(500, f"router: {type(e).__name__}: {e}")
        self.reply(status, out)

    def reply(self, status, out):
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


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
        for name, model, config, cpus, extra in (
                ("source", a.source, src_config, a.source_cpus, ()),
                ("target", a.target, tgt_config, a.target_cpus, ("--no-enable-prefix-caching",))):
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
