"""Loading a checkpoint into the decoder (model.py), random weights of a named shape, and placing a model's
layers across devices; a mapper's weights moved and placed (MapperWeights).

    model = load_model("weights/qwen3-0.6b", dtype="bfloat16")     # config.json + safetensors, checked first
    model = build_model("qwen3-0.6b")                              # random weights of the real shape
    place(model, ["cuda:0", "cuda:1"])                             # contiguous layers per device
"""
from dataclasses import replace

import torch
import torch.nn as nn

from kvt.config import KvtError, load_config, shape
from kvt.model import Transformer
from kvt.weights import check_checkpoint, check_outline, load_weights

def _materialize(cfg, dtype, devices):
    """The model's parameters allocated once, in dtype, each part on its device of `devices` (see place;
    uninitialized). A tied lm_head on another device than the embedding gets its own copy."""
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    if cfg.tie_embeddings and torch.device(devices[0]) != torch.device(devices[-1]):
        model.lm_head.weight = nn.Parameter(torch.empty_like(model.lm_head.weight))  # untied
    for module, device in _parts(model, devices):
        module.to_empty(device=device)
    if torch.device(devices[0]) == torch.device(devices[-1]):
        model.tie()  # to_empty made fresh tensors; tie them again
    return model.eval().requires_grad_(False)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def as_dtype(dtype):
    """A torch dtype from itself or its name ("bfloat16")."""
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in DTYPES:
            raise KvtError(f"dtype {dtype!r} is not one kvt runs models in; use one of {', '.join(DTYPES)}")
        return DTYPES[dtype.removeprefix("torch.")]
    if dtype not in DTYPES.values():
        raise KvtError(f"dtype {dtype} is not one kvt runs models in; use one of {', '.join(DTYPES)}")
    return dtype


def check_weights(cfg, path):
    """config.json against the checkpoint at `path`: every tensor's name, shape and dtype, read from the
    safetensors headers before anything is allocated (the model is built on the meta device)."""
    check_outline(cfg, path)
    with torch.device("meta"):
        check_checkpoint(Transformer(cfg), path)


def load_model(path, dtype=torch.float32, device="cpu", context=None, devices=None):
    """The checkpoint folder `path` (config.json + safetensors) as a Transformer in dtype (a torch dtype
    or its name) on device, or split by layers across `devices` (each part allocated where it lives: no
    device holds it all)."""
    dtype = as_dtype(dtype)
    cfg = load_config(path, context)
    check_weights(cfg, path)
    model = _materialize(cfg, dtype, devices or [device])
    load_weights(model, path)
    return model


@torch.no_grad()
def build_model(cfg, dtype=torch.float32, device="cpu", seed=0, std=0.02):
    """Random weights from a Config or a named shape ("qwen3-0.6b"): for benchmarks and tests."""
    cfg = shape(cfg) if isinstance(cfg, str) else cfg
    model = _materialize(cfg, dtype, [device])
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:  # drawn on CPU so a seed means the same weights on every device
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def layer_device(l, n_layers, devices):
    """The device of layer l of a model split by contiguous layers across devices (place)."""
    return devices[l * len(devices) // n_layers]                   # layer l -> device floor(l * n / L)


def _parts(model, devices):
    """(module, device) for every part of the model split by contiguous layers across devices: the
    embedding and the first layers on devices[0], the final norm and lm_head on devices[-1]."""
    yield model.model.embed_tokens, devices[0]
    for l, block in enumerate(model.model.layers):
        yield block, layer_device(l, model.config.n_layers, devices)
    yield model.model.norm, devices[-1]
    yield model.lm_head, devices[-1]


def place(model, devices):
    """Split a loaded model across devices by contiguous layers (a model too big for one device).

    Each layer's cache lives where the layer is (forward moves only the hidden state between devices),
    so a mapper for target layer l should live on layer_devices(model)[l]. Returns the model."""
    if model.config.tie_embeddings and torch.device(devices[0]) != torch.device(devices[-1]):
        model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach().to(devices[-1]),
                                            requires_grad=False)   # a tied head needs its own copy there
    for module, device in _parts(model, devices):
        module.to(device)
    return model


def layer_devices(model):
    """The device of every layer."""
    return [block.input_layernorm.weight.device for block in model.model.layers]


def dtype_device(model):
    """(dtype, device) of a model's first parameter: where its input goes."""
    p = next(model.parameters())
    return p.dtype, p.device


class MapperWeights:
    """The plumbing kvt.mapper.Mapper inherits, beside its method (Mapper.apply): its tensors by the names
    they have in a file, copies moved (to) or placed across devices (place), its size."""

    def n_params(self):
        return sum(t.numel() for t in self._floats())

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self._floats())

    def _floats(self):
        """Every floating-point weight tensor (per layer once placed)."""
        for t in self.tensors().values():
            yield from [x for x in (t if isinstance(t, list) else [t]) if x.is_floating_point()]

    def tensors(self):
        """Every tensor, by the name it has in a saved file (per-layer lists once placed; .to() stacks them)."""
        out = {}
        for kind in self.layers:                       # "k", "v"
            out.update({f"{kind}.layers": self.layers[kind], f"{kind}.W": self.W[kind], f"{kind}.b": self.b[kind]})
            out.update({f"{kind}.mlp.{name}": w for name, w in self.mlp.get(kind, {}).items()})
        return out

    def to(self, device=None, dtype=None):
        """A copy with weights on device / in dtype (selections stay integer); a placed mapper is
        gathered back into stacked tensors (on device, or the device of its first layer)."""
        def move(x):
            if isinstance(x, list):
                x = torch.stack([w.to(device or x[0].device) for w in x])
            return x.to(device=device, dtype=dtype if x.is_floating_point() else None)
        return self._with(move)

    def place(self, devices):
        """A copy with the weights for target layer l on devices[l] (pass layer_devices(target)), so
        that apply maps each target layer where the target keeps it."""
        assert len(devices) == self.tgt_cfg.n_layers, "one device per target layer"
        def split(x):
            return x if not x.is_floating_point() else [x[l].to(d) for l, d in enumerate(devices)]
        return self.to()._with(split)

    @property
    def placed(self):
        return isinstance(self.W["k"], list)

    def devices(self, default="cpu"):
        """The device of each target layer's weights: a list once placed, else [default] * Lt."""
        W = self.W["k"]
        return [w.device for w in W] if self.placed else [torch.device(default)] * self.tgt_cfg.n_layers

    def _with(self, fn):
        """A copy with fn applied to every tensor (selections, weights, MLP weights)."""
        return replace(self, layers={k: fn(v) for k, v in self.layers.items()}, W={k: fn(v) for k, v in self.W.items()},
                       b={k: fn(v) for k, v in self.b.items()}, meta=dict(self.meta),
                       mlp={k: {n: fn(w) for n, w in p.items()} for k, p in self.mlp.items()})
