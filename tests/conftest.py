"""Shared fixtures: where ../shared lives, tiny configs, and the real SmolLM2 checkpoint when built."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvt
from kvt.config import Config

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("KVT_SHARED", ROOT.parent / "shared"))
SMOLLM2 = Path(os.environ.get("KVT_SMOLLM2", ROOT / "weights" / "smollm2-135m"))


def tiny_config(family="qwen3", **kw):
    """A 2-layer model of width 64, 4 heads, 2 KV heads of dim 16: runs in milliseconds."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    base = dict(family=family, vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                ffn_dim=128, norm_eps=1e-6, rope=rope, max_seq_len=512)
    return Config(**{**base, **kw})


@pytest.fixture(scope="session")
def smollm2():
    """Path of the real SmolLM2-135M checkpoint (built by ../shared/tools/smollm2.py); skips when absent."""
    if not (SMOLLM2 / "model.safetensors").exists():
        pytest.skip(f"no {SMOLLM2}/model.safetensors; build it: python {SHARED}/tools/smollm2.py {SMOLLM2}")
    return SMOLLM2


# ---- mapper fixtures (issue 3) -------------------------------------------------------------------------

def plane_rotation(angles):
    """(D, D) rotation by angles[i] in each RoPE plane (i, i + D/2): it commutes with RoPE."""
    half = len(angles)
    c, s = angles.cos(), angles.sin()
    R = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    i = torch.arange(half)
    R[i, i], R[i, i + half], R[i + half, i], R[i + half, i + half] = c, -s, s, c
    return R


@torch.no_grad()
def function_preserving_twin(model, seed=0):
    """A model computing the same function as `model` whose KV is a different, exact linear function of it.

    Per layer and KV head h: values mixed by an invertible M_h (undone in o_proj), and q and k rotated
    by R_h within each RoPE plane (q.k unchanged; R_h commutes with RoPE, and with Qwen3's q/k RMSNorm
    when its weights are equal within each plane, as build_model's are). So the twin's position-free
    K is R_h k and its V is M_h v: a head-scope mapper can reproduce its cache exactly."""
    cfg = model.config
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    g = torch.Generator().manual_seed(seed)
    sd = {name: t.double().clone() for name, t in model.state_dict().items()}
    for l in range(cfg.n_layers):
        p = f"model.layers.{l}.self_attn."
        for name in ("q_norm.weight", "k_norm.weight"):
            if p + name in sd:
                assert torch.equal(sd[p + name][:D // 2], sd[p + name][D // 2:]), "norm weights must pair up"
        for h in range(Hkv):
            M = torch.eye(D, dtype=torch.float64) + 0.3 * torch.randn(D, D, generator=g, dtype=torch.float64) / D ** 0.5
            R = plane_rotation(torch.rand(D // 2, generator=g, dtype=torch.float64) * 6.283)
            rows = slice(h * D, (h + 1) * D)
            sd[p + "v_proj.weight"][rows] = M @ sd[p + "v_proj.weight"][rows]
            sd[p + "k_proj.weight"][rows] = R @ sd[p + "k_proj.weight"][rows]
            for i in range(h * H // Hkv, (h + 1) * H // Hkv):               # the query heads of KV head h
                q = slice(i * D, (i + 1) * D)
                sd[p + "q_proj.weight"][q] = R @ sd[p + "q_proj.weight"][q]
                sd[p + "o_proj.weight"][:, q] = sd[p + "o_proj.weight"][:, q] @ torch.linalg.inv(M)
    twin = kvt.build_model(cfg, dtype=next(model.parameters()).dtype)
    twin.load_state_dict({name: t.to(twin.state_dict()[name].dtype) for name, t in sd.items()})
    return twin


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tiny models on one thread: on a shared machine, threads waiting for a busy core
    make millisecond ops take tens of milliseconds. Restores the thread count after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def calib_of(ids, val=2, diag=2):
    """A data.Calibration of random ids (n, T): the last `diag` rows for diagnostics, the `val` rows before
    them for validation, the rest to fit (data.calibration_sequences draws these from text)."""
    from kvt.harness.data import Calibration
    n = len(ids) - val - diag
    return Calibration(ids[:n], ids[n:n + val], ids[n + val:])


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """Checkpoint folders source/ and twin/: a random tiny model and its function-preserving twin (an
    exact linear KV map away), sharing one toy tokenizer: run.py end to end in seconds."""
    from kvt.harness import toy
    root = tmp_path_factory.mktemp("pair")
    tok = toy.train_tokenizer(toy.corpus(300))
    cfg = tiny_config(vocab_size=tok.get_vocab_size(), n_layers=3, dim=96, n_heads=4, head_dim=24, max_seq_len=1024)
    source = kvt.build_model(cfg, seed=0, std=0.1)
    for name, model in (("source", source), ("twin", function_preserving_twin(source, seed=1))):
        kvt.save_model(model, root / name)
        tok.save(str(root / name / "tokenizer.json"))
    return root


# ---- a tiny Qwen3 pair as `hf download` leaves it in the Hugging Face cache ------------------------------

QWEN3_CONFIG = {  # Qwen/Qwen3-14B's config.json, as published, but for the sizes
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "max_position_embeddings": 40960, "max_window_layers": 2, "model_type": "qwen3",
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}
QWEN3_GENERATION = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                    "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def hub_checkpoint(hub, repo, config, seed):
    """One repo in the cache layout: blobs/<sha256> holding every file, snapshots/<commit>/<name> relative
    links to them, refs/main naming the commit; weights in bf16, in two shards and an index. Returns the
    snapshot folder and the state dict written."""
    import hashlib
    import json

    from safetensors.torch import save as to_bytes

    from kvt.config import config_from_dict
    from kvt.weights import checkpoint_names
    cfg = config_from_dict(config)
    model = kvt.build_model(cfg, dtype=torch.bfloat16, seed=seed, std=0.2)
    tensors = {checkpoint_names(cfg, n)[0]: p.detach().contiguous() for n, p in model.named_parameters()}
    shard = {name: ("model-00001-of-00002.safetensors" if name.startswith(("model.embed_tokens", "model.layers.0."))
                    else "model-00002-of-00002.safetensors") for name in tensors}
    files = {f: to_bytes({n: t for n, t in tensors.items() if shard[n] == f}, {"format": "pt"}) for f in set(shard.values())}
    index = {"metadata": {"total_size": sum(t.numel() * 2 for t in tensors.values())}, "weight_map": shard}
    for name, content in (("config.json", config), ("generation_config.json", QWEN3_GENERATION),
                          ("model.safetensors.index.json", index)):
        files[name] = json.dumps(content, indent=2).encode()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        files[name] = (SHARED / "tokenizers" / "qwen3" / name).read_bytes()
    folder = hub / ("models--" + repo.replace("/", "--"))
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snapshot = folder / "snapshots" / commit
    (folder / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)                   # no newline, as the hub client writes it
    for name, content in files.items():
        blob = hashlib.sha256(content).hexdigest()
        (folder / "blobs" / blob).write_bytes(content)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / blob)
    return snapshot, tensors


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory):
    """HF_HOME-style folder (hf/) whose hub/ holds tiny Qwen/Qwen3-14B (2 layers) and Qwen/Qwen3-32B (3 layers)
    with the real Qwen3 tokenizer; skips without ../shared/tokenizers/qwen3. Returns (home, {repo: (snapshot,
    tensors)})."""
    if not (SHARED / "tokenizers" / "qwen3" / "tokenizer.json").exists():
        pytest.skip(f"no Qwen3 tokenizer at {SHARED}/tokenizers/qwen3")
    home = tmp_path_factory.mktemp("hf")
    repos = {"Qwen/Qwen3-14B": (dict(QWEN3_CONFIG), 0), "Qwen/Qwen3-32B": (dict(QWEN3_CONFIG, num_hidden_layers=3), 1)}
    return home, {repo: hub_checkpoint(home / "hub", repo, config, seed) for repo, (config, seed) in repos.items()}


def second_venv(tmp_path, *requirements):
    """The python of a virtual environment that sees this interpreter's packages (torch above all) but has
    `requirements` installed over them (from PyPI). The packages are this interpreter's, not the system's:
    `venv --system-site-packages` would see the base Python's, which lack torch when the tests run from a
    venv; a .pth file in the new venv lists this interpreter's site-packages after the venv's own."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    own = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                         capture_output=True, text=True).stdout.strip()
    ours = [p for p in sys.path if p.endswith("-packages") and Path(p).is_dir()]
    (Path(own) / "kvt-tests-parent.pth").write_text("\n".join(ours) + "\n")
    pip = subprocess.run([py, "-m", "pip", "install", "-q", *requirements], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr[-2000:]
    return py


def run_pytest(py, *args):
    r = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:]
